#!/usr/bin/env bash
# `make demo`: a whole gasloc swarm on this machine. A bootstrap node and 4 volunteer nodes
# (`gasloc-node join`) train the demo model (examples/runs/demo.toml, 0.8 M parameters) on
# the bundled Shakespeare byte-token data over loopback: each round every node takes its
# inner AdamW steps, agrees on the round's pairs by commit-reveal, swaps a fifth of its model
# with its partner over QUIC while the next round trains, and takes the outer Nesterov step
# on that fifth (the default overlap). Prints every node's dashboard address and one line
# per round (H_i of each node, its validation loss every fifth round, bytes sent); Ctrl-C stops
# everything cleanly (each node finishes its round, checkpoints and leaves).
#
# The demo joins as a volunteer would, with one command: the manifest pins the data's shards
# (`gasloc-node data pin` writes the table into a copy of demo.toml in the swarm's
# directory), the bootstrap serves them, and the nodes start without --data: each fetches
# the shards from the swarm into its home, checks every SHA-256, then trains.
#
# usage: deploy/demo.sh <bin dir> <data dir> [nodes] [rounds]
set -euo pipefail
bin=${1:?bin dir}
data=${2:?data dir}
nodes=${3:-4}
rounds=${4:-}
shards="$data/shakespeare-byte"
[ -d "$shards" ] || { echo "no demo data in $shards: run make setup" >&2; exit 1; }
export SWARM_DIR=${SWARM_DIR:-runs/swarm-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$SWARM_DIR"
"$bin/gasloc-node" data pin --data "$shards" --manifest examples/runs/demo.toml \
  --out "$SWARM_DIR/run.toml"
echo "gasloc demo: a bootstrap + $nodes nodes on loopback, $(nproc) CPU core(s), one libtorch thread per node"
exec bash "$(dirname "$0")/local-swarm.sh" "$bin" "$SWARM_DIR/run.toml" "$shards" "$nodes" $rounds
