#!/usr/bin/env bash
# bench/broken_checkpoint: the attack that passed the payload gate under the default overlap,
# as an operator would mount it, with the product's binaries.
#
# The demo manifest as it is (delayed overlap, five fragments; examples/runs/demo.toml), a
# bootstrap and 3 honest `gasloc-node join` nodes on loopback (--eval-every 1, a checkpoint
# every round), in rounds of $ROUND_MS (2400 by default, the demo's). After node 1 reports
# round 2, a fourth node joins from a copy of node 1's newest checkpoint whose
# `model.norm.weight` was multiplied by 1000 (in the anchor, model.safetensors, and in the
# model in training, local.safetensors); its loss stays finite, so it trains and sends.
# Reported per honest node: each round's validation loss, and in the rounds it was paired with
# the broken node whether that payload was mixed (M) or refused (kind), with the functional
# check's loss increase; then the worst rise of its validation loss above its value before the
# attack (the round the broken node joined), and the broken node's own losses. With
# [gate] from $GATE (a TOML fragment, e.g. `check_tokens = 0`) the same run with other
# bounds. Traffic stays on loopback.
#
# usage: bench/broken_checkpoint.sh [bin dir] [data dir] [rounds]
set -euo pipefail
bin=${1:-target/release}
data=${2:-datasets/shakespeare-byte}
rounds=${3:-12}
round_ms=${ROUND_MS:-2400}
python=${GASLOC_PYTHON:-python3}
here=$(dirname "$0")
out=$(mktemp -d /tmp/gasloc-broken-checkpoint.XXXXXX)
[ -d "$data" ] || { echo "no data in $data: run make setup" >&2; exit 1; }
echo "bench/broken_checkpoint: 3 honest nodes + 1 from a broken checkpoint, demo manifest, $rounds rounds of $round_ms ms; out $out"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

run="$out/run.toml"
cp "$here/../examples/runs/demo.toml" "$run"
if [ -n "${GATE:-}" ]; then printf '\n[gate]\n%s\n' "$GATE" >>"$run"; fi
"$bin/gasloc-bootstrap" --run "$run" --listen /ip4/127.0.0.1/udp/0/quic-v1 \
  --addr-file "$out/bootstrap.addr" --genesis-delay-ms 8000 --round-period-ms "$round_ms" \
  --commit-window-ms 500 --reveal-window-ms 500 --exchange-timeout-ms $((round_ms / 2)) \
  >"$out/bootstrap.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do [ -s "$out/bootstrap.addr" ] && break; sleep 0.1; done
boot=$(head -n1 "$out/bootstrap.addr")

join() { # home, extra flags...
  local home=$1
  shift
  mkdir -p "$home"
  "$bin/gasloc-node" join --bootstrap "$boot" --data "$data" --home "$home" \
    --listen /ip4/127.0.0.1/udp/0/quic-v1 --device cpu --threads 1 --eval-every 1 \
    --report "$home/rounds.jsonl" "$@" >"$home/stdout.log" 2>"$home/stderr.log" &
  pids+=($!)
  node_pids+=($!)
}
node_pids=()
for i in 1 2 3; do join "$out/node$i" --rounds "$rounds" --checkpoint-every 1; done

# Bounded: node 1's round 2, at most genesis and 4 rounds away (and a margin).
deadline=$((SECONDS + 8 + 4 * round_ms / 1000 + 60))
until grep -q '^round=2 ' "$out/node1/stdout.log" 2>/dev/null; do
  [ $SECONDS -lt $deadline ] || { echo "node 1 never reached round 2: $out" >&2; exit 1; }
  sleep 0.2
done
"$python" - "$out/node1/checkpoints" "$out/broken/checkpoints" <<'EOF'
import os, shutil, sys
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
step = open(os.path.join(src, "latest")).read().strip()
os.makedirs(dst, exist_ok=True)
shutil.copytree(os.path.join(src, step), os.path.join(dst, step))
for name in ("model.safetensors", "local.safetensors"):
    path = os.path.join(dst, step, name)
    if os.path.exists(path):
        tensors = load_file(path)
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1000
        save_file(tensors, path, metadata={"format": "pt"})
open(os.path.join(dst, "latest"), "w").write(step)
print(f"  the broken node starts from node 1's {step}, model.norm.weight x 1000")
EOF
join "$out/broken" --rounds $((rounds - 4))

deadline=$((SECONDS + rounds * round_ms / 1000 + 120))
for p in "${node_pids[@]}"; do
  while kill -0 "$p" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 1; done
done

"$python" - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
def records(home):
    try:
        return [json.loads(l) for l in open(f"{out}/{home}/rounds.jsonl")]
    except FileNotFoundError:
        return []
broken = records("broken")
bad = next(l.split("=", 1)[1].strip() for l in open(f"{out}/broken/stdout.log") if l.startswith("peer_id="))
first = min((r["round"] for r in broken), default=None)
print(f"  the broken node {bad[:16]}…: first round {first}, its validation losses "
      + " ".join(f"{r['val_loss']:.0f}" for r in broken if r.get("val_loss") is not None))
for i in (1, 2, 3):
    rs = records(f"node{i}")
    cells, before, worst, pairings, refused = [], None, 0.0, 0, 0
    for r in rs:
        v = r.get("val_loss")
        cell = f"r{r['round']}:{v:.3f}" if v is not None else f"r{r['round']}:-"
        if bad in r["neighbours"]:
            pairings += 1
            kinds = [x["kind"] for x in r["refused"] if x["peer"] == bad]
            refused += bool(kinds)
            mixed = any(m[0] == bad for m in r["mixing"])
            inc = [g["loss"] - g["loss_reference"] for g in r["gate"]
                   if g["peer"] == bad and g.get("loss") is not None]
            cell += "[" + ("M" if mixed else "") + ",".join(kinds) + "".join(f"{x:+.2f}" for x in inc) + "]"
        cells.append(cell)
        if first is not None and v is not None:
            if r["round"] < first:
                before = v
            elif before is not None:
                worst = max(worst, v - before)
    print(f"  node{i}: paired {pairings}, refused {refused}; worst rise over its loss before the attack {worst:+.3f}")
    print("    " + " ".join(cells))
EOF
