#!/usr/bin/env bash
# bench/gate_cost: what the payload gate costs a round, against the round's exchange, in one
# run.
#
# A bootstrap and 4 `gasloc-node join` processes train the demo model (examples/runs/demo.toml,
# about 0.8 M parameters: a 3.2 MB fp32 payload) on the bundled Shakespeare byte data, on
# loopback, every node's upload capped by --max-upload-rate at 12.5 MB/s (100 Mbit/s, a
# volunteer's link). Every round each node's gate measures what arrived against its anchor
# (finiteness, distance, cosine) on its trainer thread; the round record holds the gate's
# seconds (`gate_s`) next to the exchange's (`exchange_s`, which includes them). Reported over
# all node-rounds that exchanged: the median and the worst of gate_s / exchange_s, the mean
# of each, and the gate's share of the round. Traffic stays on loopback.
#
# usage: bench/gate_cost.sh [bin dir] [data dir] [rounds]
set -euo pipefail
bin=${1:-target/release}
data=${2:-datasets/shakespeare-byte}
rounds=${3:-12}
nodes=4
rate=12500000 # bytes/s
python=${GASLOC_PYTHON:-python3}
here=$(dirname "$0")
out=$(mktemp -d /tmp/gasloc-gate-cost.XXXXXX)
[ -d "$data" ] || { echo "no data in $data: run make setup" >&2; exit 1; }
echo "bench/gate_cost: $nodes nodes on loopback, uploads capped at $rate B/s, demo model, $rounds rounds; out $out"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

"$bin/gasloc-bootstrap" --run "$here/../examples/runs/demo.toml" \
  --listen /ip4/127.0.0.1/udp/0/quic-v1 --addr-file "$out/bootstrap.addr" \
  --genesis-delay-ms 8000 --round-period-ms 6000 --commit-window-ms 500 \
  --reveal-window-ms 500 --exchange-timeout-ms 4000 >"$out/bootstrap.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do [ -s "$out/bootstrap.addr" ] && break; sleep 0.1; done
boot=$(head -n1 "$out/bootstrap.addr")
node_pids=()
for i in $(seq 1 $nodes); do
  mkdir -p "$out/node$i"
  "$bin/gasloc-node" join --bootstrap "$boot" --data "$data" --home "$out/node$i" \
    --listen /ip4/127.0.0.1/udp/0/quic-v1 --device cpu --threads 1 --rounds "$rounds" \
    --max-upload-rate "$rate" --report "$out/node$i/rounds.jsonl" \
    >"$out/node$i/stdout.log" 2>"$out/node$i/stderr.log" &
  node_pids+=($!)
  pids+=($!)
done
# Bounded: genesis after 8 s, then $rounds rounds of 6 s, and a margin.
deadline=$((SECONDS + 8 + rounds * 6 + 60))
for p in "${node_pids[@]}"; do
  while kill -0 "$p" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 1; done
done

"$python" - "$out" <<'EOF'
import glob, json, statistics, sys
out = sys.argv[1]
rows = []
refused = 0
for path in sorted(glob.glob(f"{out}/node*/rounds.jsonl")):
    for line in open(path):
        r = json.loads(line)
        refused += len(r["refused"])
        if r["exchanged"] and r["exchange_s"] > 0:
            rows.append(r)
if not rows:
    sys.exit("no round exchanged anything: see the logs in " + out)
ratios = [r["gate_s"] / r["exchange_s"] for r in rows]
gate = statistics.mean(r["gate_s"] for r in rows)
exchange = statistics.mean(r["exchange_s"] for r in rows)
share = sum(r["gate_s"] for r in rows) / sum(r["round_s"] for r in rows)
print(f"  node-rounds that exchanged: {len(rows)}; payloads refused: {refused}")
print(f"  gate_s mean {gate * 1000:.1f} ms; exchange_s mean {exchange * 1000:.1f} ms")
print(f"  gate / exchange: median {statistics.median(ratios):.2%}, worst {max(ratios):.2%}")
print(f"  gate's share of the round: {share:.2%}")
EOF
