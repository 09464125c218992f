#!/usr/bin/env bash
# bench/train_throughput: tokens/s of gasloc's trainer against the PyTorch eager reference
# (bench/train_reference.py) of the identical model, optimizer, batch and device, side by
# side in one run. Prints one line per shape with both figures and the ratio (≥ 1.0: gasloc
# is at least as fast).
#
# usage: bench/train_throughput.sh [--device cpu|cuda] [--sizes "16m 125m"] [--steps N] [--rounds R]
# Needs `make setup` (torch in .venv, Shakespeare GPT-2 shards) and a release build
# (`cargo build --release -p gasloc-node`). Each round runs reference then gasloc, and the
# best of the rounds counts for each, so a noisy neighbour penalises both alike.
set -euo pipefail
cd "$(dirname "$0")/.."

device=cpu
sizes="16m 125m"
steps=6
rounds=2
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
done

python=${GASLOC_PYTHON:-.venv/bin/python}
node=${GASLOC_NODE:-target/release/gasloc-node}
data=${GASLOC_BENCH_DATA:-datasets/shakespeare-gpt2}
[ -x "$node" ] || { echo "build first: cargo build --release -p gasloc-node" >&2; exit 1; }
[ -d "$data" ] || { echo "no data in $data: run make setup" >&2; exit 1; }

# Batch shapes per size and device: small enough for 2 CPU cores, the manifest's own on GPU.
batch_for() {
  case "$1/$device" in
    16m/cpu) echo "seq_len = 256 micro_batch = 8 grad_accum = 1" ;;
    125m/cpu) echo "seq_len = 256 micro_batch = 4 grad_accum = 1" ;;
    */cuda*) echo "" ;;
  esac
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

best() { sort -g | tail -1; }

printf '%-6s %-6s %14s %14s %7s\n' size device "gasloc tok/s" "torch tok/s" ratio
for size in $sizes; do
  manifest="$work/$size.toml"
  cp "examples/runs/$size.toml" "$manifest"
  read -r -a shape <<<"$(batch_for "$size")"
  i=0
  while [ $i -lt ${#shape[@]} ]; do
    key=${shape[$i]} value=${shape[$((i + 2))]}
    sed -i "s/^$key = .*/$key = $value/" "$manifest"
    i=$((i + 3))
  done
  ours=() theirs=()
  for r in $(seq "$rounds"); do
    theirs+=("$("$python" bench/train_reference.py --run "$manifest" --data "$data" \
      --steps "$steps" --warmup 1 --device "$device" | sed -n 's/^tokens_per_s=\([0-9.]*\).*/\1/p')")
    rm -rf "$work/ckpt"
    # One log line per step (same tokens each); the first (warm-up) is dropped, the rest
    # combined as total tokens / total time, as the reference reports.
    ours+=("$("$node" train --run "$manifest" --data "$data" --steps $((steps + 1)) \
      --log-interval 1 --device "$device" --checkpoint-dir "$work/ckpt" 2>/dev/null |
      sed -n 's/.* tokens_per_s=\([0-9.]*\).*/\1/p' | tail -n +2 |
      awk '{ s += 1 / $1; n++ } END { printf "%.1f", n / s }')")
  done
  g=$(printf '%s\n' "${ours[@]}" | best)
  t=$(printf '%s\n' "${theirs[@]}" | best)
  printf '%-6s %-6s %14.1f %14.1f %7.3f\n' "$size" "$device" "$g" "$t" "$(awk "BEGIN { print $g / $t }")"
done
