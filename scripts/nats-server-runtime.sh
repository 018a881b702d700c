#!/usr/bin/env bash
# Installs a nats-server newer than the machine's (Debian 12's is 2.9.10) into a cache directory,
# and prints the binary's path: the recipes' tests run the NATS recipe against it too
# (NATS_SERVER_NEWER). No npm package ships a nats-server binary (nats-memory-server downloads one
# from GitHub when it is installed), so it comes from Debian's own archive: the nats-server package
# of Debian 13 (trixie), fetched with apt-get from a sources list of its own in the cache (the
# system's lists and packages are left as they are), unpacked with dpkg-deb, never installed.
#
#   NATS_SERVER_NEWER=$(scripts/nats-server-runtime.sh) npx vitest run test/recipes-nats.test.ts
#
# NATS_SERVER_DIR chooses the cache. The version is pinned here; raise it on purpose. Debian's
# archive keeps only a release's current version: when a point release has replaced the pinned one,
# the current one is taken (and cached under its own version) rather than failing the run.
set -euo pipefail

version=2.10.27-1+b2
cache=${NATS_SERVER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/fastify-idempotency/nats-server}
binary=$cache/$version/nats-server
if [ -x "$binary" ]; then
  echo "$binary"
  exit 0
fi
for cached in "$cache"/*/nats-server; do
  if [ -x "$cached" ]; then
    echo "$cached"
    exit 0
  fi
done

mkdir -p "$cache"
work=$(mktemp -d "$cache/.download.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/archives/partial"
echo 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main' > "$work/sources.list"
apt=(-o "Dir::Etc::sourcelist=$work/sources.list" -o Dir::Etc::sourceparts=/dev/null -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::Archives=$work/archives" -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
apt-get "${apt[@]}" -qq update > /dev/null
if ! (cd "$work" && apt-get "${apt[@]}" -qq download "nats-server=$version" > /dev/null 2>&1); then
  (cd "$work" && apt-get "${apt[@]}" -qq download nats-server > /dev/null)
  version=$(dpkg-deb -f "$work"/nats-server_*.deb Version)
  binary=$cache/$version/nats-server
fi
dpkg-deb -x "$work"/nats-server_*.deb "$work/root"
"$work/root/usr/sbin/nats-server" --version > /dev/null
mkdir -p "$work/$version"
mv "$work/root/usr/sbin/nats-server" "$work/$version/nats-server"
# A concurrent run may have installed it meanwhile: keep whichever landed first.
mv -T "$work/$version" "$cache/$version" 2>/dev/null || true
echo "$binary"
