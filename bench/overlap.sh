#!/usr/bin/env bash
# bench/overlap: blocking rounds against overlapped ones on links where a blocking exchange
# takes about 40 % of a round, in one run.
#
# 4 `gasloc-node join` processes (+ a bootstrap) train the tiny model (0.53 MB fp32 payload)
# on the Shakespeare byte data, one-peer, adaptive H_i, rounds of 5 s. Links: as root with
# `ip` and `tc`, each node in its own network namespace on a bridge with a 2 Mbit/s tbf egress
# (deploy/netns-swarm.sh): one exchange takes about 2.1 s; otherwise (or with LINKS=caps)
# on loopback with every node's upload capped at 250 kB/s by --max-upload-rate. Three
# configurations run one after the other for the same wall-clock time:
#
#   none     blocking rounds: a node's inner steps end early enough for its exchange to
#            end within the round, then it waits for it;
#   delayed  overlap = "delayed": the inner steps run to the round's end, the exchange runs
#            beside the next round's, whose steps carry over onto the new anchor;
#   eager    overlap = "eager": the same, with the node's own share of the outer step taken
#            at the hand-off;
#   delayed-p3  overlap = "delayed" with fragments = 3: rounds of a third of the period, each
#            exchanging a third of the model, so every fragment is synced once per period as
#            the whole model is in the others;
#   delayed-p5  overlap = "delayed" with fragments = 5 and outer momentum 0.8 (the simulator's
#            best at the demo size, docs/results.md §6): rounds of a fifth of the period.
#
# Reported per configuration (bench/swarm_report.py): compute utilisation (trainer busy time
# over wall time), idle share, exchange wait, inner steps, wall-clock seconds until the
# swarm's mean validation loss first reaches the target (the worst configuration's best), and
# each one's time-to-target ratio against `none`. Traffic stays on loopback or inside the
# namespaces the harness creates and removes.
#
# usage: bench/overlap.sh [bin dir] [data dir] [seconds per configuration]
set -euo pipefail
bin=${1:-target/debug}
data=${2:-datasets/shakespeare-byte}
seconds=${3:-90}
nodes=4
period=5000
tbf_rate=2mbit tbf_slow=
cap_rate=250000 cap_slow=
python=${GASLOC_PYTHON:-python3}
# shellcheck source=bench/swarm_lib.sh
. "$(dirname "$0")/swarm_lib.sh"
swarm_pick_links
out=$(mktemp -d /tmp/gasloc-overlap.XXXXXX)
[ -d "$data" ] || { echo "no data in $data: run make setup" >&2; exit 1; }
if [ "$LINKS" = netns ]; then
  echo "bench/overlap: $nodes nodes in network namespaces, tbf $tbf_rate; $seconds s per configuration; out $out"
else
  echo "bench/overlap: $nodes nodes on loopback, uploads capped at $cap_rate B/s; $seconds s per configuration; out $out"
fi
trap swarm_cleanup EXIT INT TERM

for mode in none delayed eager; do
  mkdir -p "$out/$mode"
  swarm_manifest "overlap-$mode" one-peer 100 true "$mode" >"$out/$mode/run.toml"
  swarm_config "$out/$mode" "$period" 4500
done
mkdir -p "$out/delayed-p3"
swarm_manifest "overlap-delayed-p3" one-peer 33 true delayed 3 >"$out/delayed-p3/run.toml"
swarm_config "$out/delayed-p3" $((period / 3)) 1500 3  # evaluated once per period, as the others
mkdir -p "$out/delayed-p5"
swarm_manifest "overlap-delayed-p5" one-peer 20 true delayed 5 0.8 >"$out/delayed-p5/run.toml"
swarm_config "$out/delayed-p5" $((period / 5)) 900 5

"$python" "$(dirname "$0")/swarm_report.py" "$out" none none delayed eager delayed-p3 delayed-p5
