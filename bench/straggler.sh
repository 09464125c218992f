#!/usr/bin/env bash
# bench/straggler: a swarm with one bandwidth straggler, three ways, in one run.
#
# 4 `gasloc-node join` processes (+ a bootstrap) train the tiny model on the Shakespeare
# byte data. Links: as root with `ip` and `tc`, each node runs in its own network namespace
# on a bridge with a tbf rate limit (deploy/netns-swarm.sh): 16 Mbit/s, node 1 at 1.6 Mbit/s
# (the straggler); otherwise (or with LINKS=caps) on loopback with every node's upload capped
# by --max-upload-rate at 2 MB/s, node 1's at 200 kB/s. Three
# configurations run one after the other for the same wall-clock time, each with the
# shortest round period it can sustain:
#
#   gasloc-adaptive  one-peer, adaptive H_i: the period fits a fast pair's exchange; the
#                    straggler (and whoever is paired with it) takes fewer inner steps;
#   gasloc-fixed     one-peer, fixed H: the period must fit the straggler's exchange;
#   diloco           complete topology (all-reduce), fixed H: the period must fit the
#                    straggler sending its model to all three peers — everyone waits for it.
#
# Reported per configuration: wall-clock seconds until the swarm's mean validation loss first
# reaches the target (the worst of the three configurations' best mean loss, so that every
# configuration reaches it), the idle share (seconds between "payload ready" and "every
# neighbour's result in", over round time, all nodes), inner steps per node per second, and
# the time-to-target ratios against DiLoCo. Traffic stays on loopback or inside the
# namespaces the harness creates and removes.
#
# usage: bench/straggler.sh [bin dir] [data dir] [seconds per configuration]
set -euo pipefail
bin=${1:-target/debug}
data=${2:-datasets/shakespeare-byte}
seconds=${3:-75}
nodes=4
fast_rate=2000000   # bytes/s
slow_rate=200000    # 10 %
H=100
python=${GASLOC_PYTHON:-python3}
if [ -z "${LINKS:-}" ]; then
  LINKS=caps
  [ "$(id -u)" = 0 ] && command -v tc >/dev/null && command -v ip >/dev/null && LINKS=netns
fi
out=$(mktemp -d /tmp/gasloc-straggler.XXXXXX)
[ -d "$data" ] || { echo "no data in $data: run make setup" >&2; exit 1; }
if [ "$LINKS" = netns ]; then
  echo "bench/straggler: $nodes nodes in network namespaces, tbf 16mbit, node1 1.6mbit; $seconds s per configuration; out $out"
else
  echo "bench/straggler: $nodes nodes on loopback, uploads capped at $fast_rate B/s, node1 at $slow_rate B/s; $seconds s per configuration; out $out"
fi

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

manifest() { # name topology adaptive
  cat <<EOF
name = "straggler-$1"
seed = 3
[model]
size = "tiny"
[data]
tokenizer = "byte"
seq_len = 64
micro_batch = 8
[optimizer]
lr = 3e-3
warmup_steps = 20
decay_steps = 100000
[eval]
batches = 8
[outer]
topology = "$2"
inner_steps = $H
adaptive_inner_steps = $3
min_inner_steps = 2
max_inner_steps = 2000
EOF
}

run_config() { # name topology adaptive period_ms exchange_timeout_ms
  local name=$1 dir="$out/$1"
  mkdir -p "$dir"
  manifest "$1" "$2" "$3" >"$dir/run.toml"
  echo "$4" >"$dir/period_ms"
  if [ "$LINKS" = netns ]; then
    # Rounds start 8 s after the bootstrap (the harness's genesis delay); stop after
    # $seconds of them.
    BOOTSTRAP_ARGS="--round-period-ms $4 --commit-window-ms 500 --reveal-window-ms 500 --exchange-timeout-ms $5" \
      TIMEOUT_S=$((seconds + 60)) bash "$(dirname "$0")/../deploy/netns-swarm.sh" "$bin" \
      "$dir/run.toml" "$dir" $nodes 16mbit 1.6mbit -- --data "$(realpath "$data")" \
      --device cpu --threads 1 --rounds $((seconds * 1000 / $4)) >"$dir/harness.log" 2>&1 || true
    echo "  $name: period $4 ms, exchange timeout $5 ms: $(cat "$dir"/node*/rounds.jsonl | wc -l) node-rounds"
    return
  fi
  pids=()
  "$bin/gasloc-bootstrap" --run "$dir/run.toml" --listen /ip4/127.0.0.1/udp/0/quic-v1 \
    --addr-file "$dir/bootstrap.addr" --genesis-delay-ms 6000 --round-period-ms "$4" \
    --commit-window-ms 500 --reveal-window-ms 500 --exchange-timeout-ms "$5" \
    >"$dir/bootstrap.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 100); do [ -s "$dir/bootstrap.addr" ] && break; sleep 0.1; done
  local boot
  boot=$(head -n1 "$dir/bootstrap.addr")
  for i in $(seq 1 $nodes); do
    local rate=$fast_rate
    [ "$i" = 1 ] && rate=$slow_rate
    mkdir -p "$dir/node$i"
    "$bin/gasloc-node" join --bootstrap "$boot" --data "$data" --home "$dir/node$i" \
      --listen /ip4/127.0.0.1/udp/0/quic-v1 --device cpu --threads 1 \
      --max-upload-rate "$rate" --report "$dir/node$i/rounds.jsonl" \
      >"$dir/node$i/stdout.log" 2>"$dir/node$i/stderr.log" &
    pids+=($!)
  done
  # genesis is 6 s after the bootstrap starts; then $seconds of rounds.
  sleep $((6 + seconds))
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  echo "  $name: period $4 ms, exchange timeout $5 ms: $(cat "$dir"/node*/rounds.jsonl | wc -l) node-rounds"
}

# Periods: agreement takes 1 s; a one-peer exchange of the 0.53 MB payload takes ~0.3 s on a
# fast link and ~2.7 s from the straggler; DiLoCo's straggler sends 3 copies (~8 s).
run_config gasloc-adaptive one-peer true 4500 3500
run_config gasloc-fixed one-peer false 5000 3500
run_config diloco complete false 11000 9000

"$python" - "$out" <<'EOF'
import json, sys, glob, os
out = sys.argv[1]
configs = ["gasloc-adaptive", "gasloc-fixed", "diloco"]
result = {}
for c in configs:
    points = {}  # round -> [(round seconds, val loss)] over nodes
    steps = wait = rtime = 0.0
    nodes = sorted(glob.glob(f"{out}/{c}/node*/rounds.jsonl"))
    for path in nodes:
        for line in open(path):
            r = json.loads(line)
            steps += r["inner_steps"]; wait += r["wait_s"]; rtime += r["round_s"]
            if r["val_loss"] is not None:
                points.setdefault(r["round"], []).append((r["round_s"], r["val_loss"]))
    result[c] = dict(points=points, steps=steps, wait=wait, rtime=rtime, nodes=len(nodes))
# Rounds follow the wall clock: round r ends at r * period + its duration (from genesis).
periods = {c: int(open(f"{out}/{c}/period_ms").read()) / 1000 for c in configs}
curves = {}
for c, r in result.items():
    curve = []
    for rnd in sorted(r["points"]):
        vals = [v for _, v in r["points"][rnd]]
        ends = [s for s, _ in r["points"][rnd]]
        if len(vals) >= max(1, r["nodes"] - 1):
            curve.append((rnd * periods[c] + max(ends), sum(vals) / len(vals)))
    curves[c] = curve
target = max(min(v for _, v in curve) for curve in curves.values())
print(f"target mean val_loss: {target:.4f} (the worst configuration's best)")
tt = {}
for c in configs:
    t = next(t for t, v in curves[c] if v <= target)
    tt[c] = t
    r = result[c]
    idle = r["wait"] / r["rtime"] if r["rtime"] else 0.0
    best = min(v for _, v in curves[c])
    print(f"  {c:16s} time to target {t:6.1f} s   best mean val_loss {best:.4f}   idle share {idle:5.1%}   inner steps {r['steps']:.0f}")
for c in configs[:2]:
    print(f"  ratio {c} / diloco time to target: {tt[c] / tt['diloco']:.2f}")
print(f"  ratio gasloc-adaptive / gasloc-fixed time to target: {tt['gasloc-adaptive'] / tt['gasloc-fixed']:.2f}")
EOF
