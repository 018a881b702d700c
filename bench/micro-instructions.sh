#!/bin/sh
# Instructions per operation of one case of bench/micro-encryption.ts, counted by callgrind over
# the measured loop alone (after a warm-up; collection is switched on and off around the loop with
# callgrind_control). Instruction counts do not depend on the machine's load.
#   sh bench/micro-instructions.sh '<case name>' [<dir of other encryption.ts/memory.ts>]
set -e
case_name=$1
dir=${2:-}
count=${MICRO_COUNT:-10000}
out=$(mktemp -d)
MICRO_CALLGRIND=1 MICRO_CASE=$case_name MICRO_COUNT=$count valgrind --tool=callgrind --instr-atstart=no \
  --smc-check=all-non-file --callgrind-out-file="$out/cg.%p" \
  node --expose-gc --import tsx "$(dirname "$0")/micro-encryption.ts" $dir 2>"$out/log" >/dev/null
total=$(grep -h '^totals:' "$out"/cg.* | awk '{ s += $2 } END { print s }')
echo "$case_name${dir:+ ($dir)}: $(( total / count )) instructions/op ($count ops)"
[ -n "$MICRO_KEEP" ] && cp "$out"/cg.* "$MICRO_KEEP"
rm -rf "$out"
