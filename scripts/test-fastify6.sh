#!/usr/bin/env bash
# The project's type-check and its whole test suite against the newest Fastify 6 (release or
# pre-release) on Node 24, the first Node Fastify 6 supports. It runs in a copy of this checkout
# (in a temporary directory, removed at the end) whose node_modules differ from this one's by
# Fastify alone, so this checkout is left as it is.
#
#   scripts/test-fastify6.sh                 # the newest 6.x the registry has
#   FASTIFY6_VERSION=6.0.0-alpha.4 scripts/test-fastify6.sh
#   scripts/test-fastify6.sh --sequence.shuffle.files --sequence.seed=6   # arguments go to vitest
set -euo pipefail
cd "$(dirname "$0")/.."

node24=$(scripts/node-runtime.sh 24)
# Node 24 first on PATH (npm runs on it too), and its headers for any native build.
export PATH="$node24/bin:$PATH" npm_config_nodedir=$node24

version=${FASTIFY6_VERSION:-$(npm view fastify versions --json | node -e '
  const semver = require("semver")
  const versions = JSON.parse(require("node:fs").readFileSync(0, "utf8")).filter((v) => semver.major(v) === 6)
  console.log(semver.rsort(versions)[0] ?? "")')}
if [ -z "$version" ]; then echo "fastify6: the registry has no Fastify 6" >&2; exit 1; fi

copy=$(mktemp -d "${TMPDIR:-/tmp}/fastify-idempotency-fastify6.XXXXXX")
trap 'rm -rf "$copy"' EXIT
scripts/copy-checkout.sh "$copy"
cd "$copy"
npm install --no-save --no-audit --no-fund --ignore-scripts --loglevel=error "fastify@$version"

installed=$(node -p 'require("fastify/package.json").version')
echo "fastify6: Fastify $installed on Node $(node --version)"
npm run typecheck
npx vitest run "$@"
