#!/usr/bin/env bash
# `make demo`: trains the demo model (examples/runs/demo.toml) on the bundled Shakespeare
# byte-token data on this machine, printing a line per 10 steps and a validation loss every
# 25, then evaluates the final checkpoint. Ctrl-C stops it cleanly: the node finishes its
# step and writes a checkpoint.
#
# usage: deploy/demo.sh <gasloc-node binary> <data dir> [steps]
set -euo pipefail
node=${1:?gasloc-node binary}
data=${2:?data dir}
steps=${3:-400}
shards="$data/shakespeare-byte"
[ -d "$shards" ] || { echo "no demo data in $shards: run make setup" >&2; exit 1; }
run_dir="runs/demo-$(date +%Y%m%d-%H%M%S)"
echo "gasloc demo: training examples/runs/demo.toml for $steps steps on $(nproc) CPU core(s)"
echo "checkpoints: $run_dir  (Ctrl-C stops after the current step and saves)"
"$node" train --run examples/runs/demo.toml --data "$shards" --steps "$steps" \
  --checkpoint-dir "$run_dir" --checkpoint-every 100 --log-interval 10 --device auto
"$node" eval --checkpoint "$run_dir" --data "$shards"
