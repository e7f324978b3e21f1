#!/bin/bash
# Instructions the broker process spends per connection: connect, CONNACK, PINGREQ,
# DISCONNECT, close (`mqload conns`), counted by callgrind. Unlike connects/s on a shared
# VM, the count repeats within about 1% run to run, so it can judge a change to the
# connect path. Needs valgrind and the venv (make bench-deps).
#
#   scripts/callgrind-conns.sh [CONNECTIONS] [extra mqload args, e.g. --mqtt5]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-2000}
shift || true
port=18899
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$tmp/cg.out" \
    .venv/bin/python -m wrenmq serve --port $port --log-level warning --data-dir "$tmp/data" \
    >"$tmp/valgrind.log" 2>&1 &
pid=$!
for _ in $(seq 300); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.2; done
sleep 1
callgrind_control -i on $pid >/dev/null 2>&1
.bench/mqload/release/mqload conns --port $port --clients "$n" --hold 0.1 --io-timeout 60 "$@" \
    | grep -o '"connected":[0-9]*'
callgrind_control -i off $pid >/dev/null 2>&1
kill $pid
wait $pid || true
total=$(grep '^totals:' "$tmp/cg.out" | awk '{print $2}')
echo "instructions: $total in all, $((total / n)) per connection"
