#!/usr/bin/env bash
# bench/gate_cost: what the payload gate costs a round, in one run.
#
# A bootstrap and 4 `gasloc-node join` processes train the demo model (examples/runs/demo.toml
# as it is: the default overlap, delayed in five fragments; about 0.8 M parameters, a fifth of
# it a round) on the bundled Shakespeare byte data, on loopback, every node's upload capped by
# --max-upload-rate at 12.5 MB/s (100 Mbit/s, a volunteer's link), in rounds of 6 s. Every
# round each node's gate measures what arrived against its anchor (finiteness, distance,
# cosine) and runs the functional check (its model with the round's fragment as its own, as
# the round's anchor and as each neighbour's, on `[gate] check_tokens` held-out
# tokens), on its trainer thread. Each gate reading holds the trainer's seconds for that
# payload (`screen_s`: decoding, measuring, and its share of the forward passes); the round
# record's `wall_s` is the round's wall time. Reported over all node-rounds that exchanged:
# the trainer's gate seconds a round (mean, median, worst) and their share of the rounds'
# wall time (the goal: at most 2 %); then the same swarm with the check off
# (`check_tokens = 0`), run just after, for the check's own part. Traffic stays on
# loopback.
#
# usage: bench/gate_cost.sh [bin dir] [data dir] [rounds]
set -euo pipefail
bin=${1:-target/release}
data=${2:-datasets/shakespeare-byte}
rounds=${3:-12}
nodes=4
rate=12500000 # bytes/s
period_ms=6000
python=${GASLOC_PYTHON:-python3}
here=$(dirname "$0")
out=$(mktemp -d /tmp/gasloc-gate-cost.XXXXXX)
[ -d "$data" ] || { echo "no data in $data: run make setup" >&2; exit 1; }
echo "bench/gate_cost: $nodes nodes on loopback, uploads capped at $rate B/s, demo model, $rounds rounds of $period_ms ms; out $out"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

# One swarm of $nodes nodes on the manifest $1; its logs and round records under $2.
swarm() {
  local manifest=$1 dir=$2
  mkdir -p "$dir"
  "$bin/gasloc-bootstrap" --run "$manifest" \
    --listen /ip4/127.0.0.1/udp/0/quic-v1 --addr-file "$dir/bootstrap.addr" \
    --genesis-delay-ms 8000 --round-period-ms "$period_ms" --commit-window-ms 500 \
    --reveal-window-ms 500 --exchange-timeout-ms 4000 >"$dir/bootstrap.log" 2>&1 &
  local boot_pid=$!
  pids+=("$boot_pid")
  for _ in $(seq 1 100); do [ -s "$dir/bootstrap.addr" ] && break; sleep 0.1; done
  local boot
  boot=$(head -n1 "$dir/bootstrap.addr")
  local node_pids=()
  for i in $(seq 1 $nodes); do
    mkdir -p "$dir/node$i"
    "$bin/gasloc-node" join --bootstrap "$boot" --data "$data" --home "$dir/node$i" \
      --listen /ip4/127.0.0.1/udp/0/quic-v1 --device cpu --threads 1 --rounds "$rounds" \
      --max-upload-rate "$rate" --report "$dir/node$i/rounds.jsonl" \
      >"$dir/node$i/stdout.log" 2>"$dir/node$i/stderr.log" &
    node_pids+=($!)
    pids+=($!)
  done
  # Bounded: genesis after 8 s, then $rounds rounds, and a margin.
  local deadline=$((SECONDS + 8 + rounds * period_ms / 1000 + 60))
  for p in "${node_pids[@]}"; do
    while kill -0 "$p" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 1; done
  done
  kill -KILL "$boot_pid" 2>/dev/null || true
}

demo="$here/../examples/runs/demo.toml"
swarm "$demo" "$out/check-on"
{ cat "$demo"; printf '\n[gate]\ncheck_tokens = 0\n'; } >"$out/check-off.toml"
swarm "$out/check-off.toml" "$out/check-off"

"$python" - "$out" <<'EOF'
import glob, json, statistics, sys
out = sys.argv[1]
for run in ("check-on", "check-off"):
    rows, refused = [], 0
    for path in sorted(glob.glob(f"{out}/{run}/node*/rounds.jsonl")):
        for line in open(path):
            r = json.loads(line)
            refused += len(r["refused"])
            if r["exchanged"] and r["wall_s"] > 0:
                rows.append(r)
    if not rows:
        sys.exit(f"{run}: no round exchanged anything: see the logs in {out}/{run}")
    gate = [sum(g.get("screen_s", 0.0) for g in r["gate"]) for r in rows]
    share = sum(gate) / sum(r["wall_s"] for r in rows)
    checked = sum(1 for r in rows for g in r["gate"] if g.get("loss") is not None)
    print(f"  {run}: node-rounds that exchanged: {len(rows)}; payloads refused: {refused}; "
          f"payloads the functional check ran on: {checked}")
    print(f"    trainer's gate seconds a round: mean {statistics.mean(gate) * 1000:.1f} ms, "
          f"median {statistics.median(gate) * 1000:.1f} ms, worst {max(gate) * 1000:.1f} ms; "
          f"mean wall_s {statistics.mean(r['wall_s'] for r in rows):.2f} s")
    print(f"    the gate's share of the round: {share:.3%}")
EOF
