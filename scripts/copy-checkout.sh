#!/usr/bin/env bash
# A copy of this checkout in DIR: the files git knows (committed or not, and new files it does not
# ignore) and node_modules. A test run there has its own dist/, .tmp/ and coverage/, so that
# several runs (other Node versions, another Fastify) can go at once beside this one.
#
#   scripts/copy-checkout.sh /tmp/node22-run
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: $0 DIR}
rm -rf "$dir"
mkdir -p "$dir"
git ls-files -z --cached --others --exclude-standard | rsync -a --from0 --files-from=- --ignore-missing-args ./ "$dir/"
cp -a node_modules "$dir/"
