#!/bin/sh
# Redis's own instructions per first request for each way of storing a response (bench/redis-fence.ts),
# on a redis-server of this script's own under callgrind, on a free port.
set -e
dir=$(mktemp -d)
port=$(node -e "const s=require('net').createServer().listen(0,'127.0.0.1',()=>{console.log(s.address().port);s.close()})")
valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no >"$dir/server.log" 2>&1 &
server=$!
until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.2; done
pid=$(redis-cli -p "$port" info server | sed -n 's/^process_id:\([0-9]*\).*/\1/p')
REDIS_PORT=$port REDIS_PID=$pid CALLGRIND_DIR=$dir npx tsx "$(dirname "$0")/redis-fence.ts" || status=$?
redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
wait "$server" 2>/dev/null || true
rm -rf "$dir"
exit ${status:-0}
