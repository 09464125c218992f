#!/usr/bin/env bash
# A whole gasloc swarm on this machine, on loopback: one gasloc-bootstrap and N
# `gasloc-node join` processes, each with its own home directory, identity, checkpoints and
# status page. Prints every node's dashboard address, then one summary line per round
# (validation loss of each node, bytes moved), and stops everything cleanly on Ctrl-C
# (each node finishes its round, saves a checkpoint and leaves).
#
# When the manifest pins its shards ([[data.shards]], `gasloc-node data pin`), the bootstrap
# serves <data dir> and the nodes start without --data: they fetch the shards from the swarm.
# Otherwise every node trains on <data dir> directly.
#
# usage: deploy/local-swarm.sh <bin dir> <run.toml> <data dir> [nodes] [rounds]
#   environment: ROUND_MS (round period, default 2400: with the demo manifest's five fragments
#   every part of the model is exchanged once in 12 s), SWARM_DIR (default runs/swarm-<time>),
#   BASE_PORT (status ports BASE_PORT+1…, default 8380), THREADS (libtorch threads per node, 1)
set -euo pipefail
bin=${1:?bin dir with gasloc-node and gasloc-bootstrap}
run=${2:?run manifest}
data=${3:?data dir}
nodes=${4:-4}
rounds=${5:-}
round_ms=${ROUND_MS:-2400}
base_port=${BASE_PORT:-8380}
threads=${THREADS:-1}
dir=${SWARM_DIR:-runs/swarm-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$dir"
if grep -q '^\[\[data\.shards\]\]' "$run"; then
  serve_data=(--data "$data")
  node_data=()
else
  serve_data=()
  node_data=(--data "$data")
fi

pids=()
stop() {
  trap - INT TERM
  echo
  echo "stopping: every node finishes its round, checkpoints and leaves…"
  for p in "${pids[@]:1}"; do kill -TERM "$p" 2>/dev/null || true; done
  # Bounded wait for the nodes, then the bootstrap.
  for _ in $(seq 1 120); do
    alive=0
    for p in "${pids[@]:1}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.5
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  echo "logs, reports and checkpoints: $dir"
  exit 0
}
trap stop INT TERM HUP

# The bootstrap: round timing for a small CPU swarm. Rounds follow the wall clock; each node
# fits its inner steps to the period (adaptive H_i when the manifest asks for it).
"$bin/gasloc-bootstrap" --run "$run" --listen /ip4/127.0.0.1/udp/0/quic-v1 \
  --listen /ip4/127.0.0.1/tcp/0 --addr-file "$dir/bootstrap.addr" \
  --identity "$dir/bootstrap.key" --genesis-delay-ms 8000 \
  --round-period-ms "$round_ms" --commit-window-ms 1500 --reveal-window-ms 1500 \
  --exchange-timeout-ms $((round_ms / 2)) "${serve_data[@]}" >"$dir/bootstrap.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do [ -s "$dir/bootstrap.addr" ] && break; sleep 0.1; done
[ -s "$dir/bootstrap.addr" ] || { echo "the bootstrap did not start: $dir/bootstrap.log" >&2; stop; }
boot=$(head -n1 "$dir/bootstrap.addr")
echo "bootstrap: $boot"
[ ${#serve_data[@]} -gt 0 ] &&
  echo "data: the bootstrap serves the run's pinned shards; each node fetches them into its home"

for i in $(seq 1 "$nodes"); do
  home="$dir/node$i"
  mkdir -p "$home"
  "$bin/gasloc-node" join --bootstrap "$boot" "${node_data[@]}" --home "$home" \
    --listen /ip4/127.0.0.1/udp/0/quic-v1 --listen /ip4/127.0.0.1/tcp/0 \
    --status-addr "127.0.0.1:$((base_port + i))" --threads "$threads" --device cpu \
    --report "$home/rounds.jsonl" ${rounds:+--rounds "$rounds"} \
    >"$home/stdout.log" 2>"$home/stderr.log" &
  pids+=($!)
  echo "node$i dashboard: http://127.0.0.1:$((base_port + i))/   (gasloc-node status --addr 127.0.0.1:$((base_port + i)))"
done
echo "swarm of $nodes nodes starting (round period $round_ms ms); Ctrl-C stops it"

# One line per round once every node reported it (or a node stopped).
next=0
while :; do
  line="round=$next"
  complete=1
  total_bytes=0
  reported=0
  for i in $(seq 1 "$nodes"); do
    rec=$(grep -h "^round=$next " "$dir/node$i/stdout.log" 2>/dev/null | head -n1 || true)
    if [ -z "$rec" ]; then
      # A node that already reported a later round (or has left) skipped this one.
      if grep -q "^round=$((next + 1)) " "$dir/node$i/stdout.log" 2>/dev/null ||
        ! kill -0 "${pids[$i]}" 2>/dev/null; then
        line+="  node$i: -"
        continue
      fi
      complete=0
      break
    fi
    val=$(sed -n 's/.* val_loss=\([^ ]*\).*/\1/p' <<<"$rec")
    bytes=$(sed -n 's/.* bytes_sent=\([0-9]*\).*/\1/p' <<<"$rec")
    steps=$(sed -n 's/.* inner_steps=\([0-9]*\).*/\1/p' <<<"$rec")
    line+="  node$i: val_loss=$val H=$steps"
    reported=$((reported + 1))
    total_bytes=$((total_bytes + bytes))
  done
  # A round that some node reported is printed; a round no node reported means every node
  # has left (or skipped it): fall through to the check below, never spin on later rounds.
  if [ $complete = 1 ]; then
    [ "$reported" -gt 0 ] && echo "$line  sent=$((total_bytes / 1000)) kB"
    next=$((next + 1))
    [ "$reported" -gt 0 ] && continue
  fi
  # Stop when every node has exited: after --rounds, or when a signal reached the nodes but
  # not this script (a shell started in the background from a script ignores SIGINT, and
  # bash cannot trap a signal ignored on entry).
  alive=0
  for p in "${pids[@]:1}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  # A round every live node skipped: go on to the next at once.
  [ $alive = 1 ] && [ $complete = 1 ] && continue
  if [ $alive = 0 ]; then
    echo "every node has left"
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    echo "logs, reports and checkpoints: $dir"
    exit 0
  fi
  sleep 1
done
