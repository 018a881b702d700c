#!/bin/sh
# Instructions per storage call of RedisStorage on each Redis client (bench/micro-redis-clients.ts),
# counted by callgrind over the measured loop alone, for the client process (GLIDE's core, which
# runs in threads of the same process, included). Needs the benchmark's Redis.
#   sh bench/micro-redis-clients.sh [client ...]        # default: every client
set -e
count=${MICRO_COUNT:-4000}
clients=${*:-ioredis-6 ioredis-6-resp2 ioredis-5 iovalkey node-redis-6 node-redis-6-resp2 node-redis-5 glide-2}
for client in $clients; do
  for op in replay new; do
    out=$(mktemp -d)
    MICRO_CALLGRIND=1 MICRO_CLIENT=$client MICRO_OP=$op MICRO_COUNT=$count valgrind --tool=callgrind --instr-atstart=no \
      --smc-check=all-non-file --callgrind-out-file="$out/cg.%p" \
      node --import tsx "$(dirname "$0")/micro-redis-clients.ts" 2>"$out/log" >/dev/null || { cat "$out/log" >&2; exit 1; }
    total=$(grep -h '^totals:' "$out"/cg.* | awk '{ s += $2 } END { print s }')
    echo "$client $op: $(( total / count )) instructions/op ($count ops)"
    rm -rf "$out"
  done
done
