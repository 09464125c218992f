#!/usr/bin/env bash
# bench/straggler: a swarm with one bandwidth straggler, three ways, in one run.
#
# 4 `gasloc-node join` processes (+ a bootstrap) train the tiny model on the Shakespeare
# byte data. Links: as root with `ip` and `tc`, each node runs in its own network namespace
# on a bridge with a tbf rate limit (deploy/netns-swarm.sh): 16 Mbit/s, node 1 at 1.6 Mbit/s
# (the straggler); otherwise (or with LINKS=caps) on loopback with every node's upload capped
# by --max-upload-rate at 2 MB/s, node 1's at 200 kB/s. Five
# configurations run one after the other for the same wall-clock time, each with the
# shortest round period it can sustain:
#
#   gasloc-adaptive  one-peer, adaptive H_i: the period fits a fast pair's exchange; the
#                    straggler (and whoever is paired with it) takes fewer inner steps;
#   gasloc-delayed   the same with overlap = "delayed": the exchange runs beside the next
#                    round's inner steps, so the straggler's pair keeps computing;
#   gasloc-default   the manifest's default overlap: delayed in five fragments at outer
#                    momentum 0.8, rounds of a fifth of gasloc-delayed's period, evaluated
#                    every fifth round;
#   gasloc-fixed     one-peer, fixed H: the period must fit the straggler's exchange;
#   diloco           complete topology (all-reduce), fixed H: the period must fit the
#                    straggler sending its model to all three peers — everyone waits for it.
#
# Reported per configuration (bench/swarm_report.py): wall-clock seconds until the swarm's
# mean validation loss first reaches the target (the worst configuration's best mean loss, so
# that every configuration reaches it), compute utilisation and idle share, the exchange
# wait (seconds between "payload ready" and "every neighbour's result in", over round time,
# all nodes), inner steps, and the time-to-target ratios against DiLoCo. Traffic stays on
# loopback or inside the namespaces the harness creates and removes.
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
tbf_rate=16mbit tbf_slow=1.6mbit
cap_rate=$fast_rate cap_slow=$slow_rate
python=${GASLOC_PYTHON:-python3}
# shellcheck source=bench/swarm_lib.sh
. "$(dirname "$0")/swarm_lib.sh"
swarm_pick_links
out=$(mktemp -d /tmp/gasloc-straggler.XXXXXX)
[ -d "$data" ] || { echo "no data in $data: run make setup" >&2; exit 1; }
if [ "$LINKS" = netns ]; then
  echo "bench/straggler: $nodes nodes in network namespaces, tbf 16mbit, node1 1.6mbit; $seconds s per configuration; out $out"
else
  echo "bench/straggler: $nodes nodes on loopback, uploads capped at $fast_rate B/s, node1 at $slow_rate B/s; $seconds s per configuration; out $out"
fi

trap swarm_cleanup EXIT INT TERM

run_config() { # name topology adaptive period_ms exchange_timeout_ms [overlap]
  mkdir -p "$out/$1"
  swarm_manifest "straggler-$1" "$2" $H "$3" "${6:-none}" >"$out/$1/run.toml"
  swarm_config "$out/$1" "$4" "$5"
}

# Periods: agreement takes 1 s; a one-peer exchange of the 0.53 MB payload takes ~0.3 s on a
# fast link and ~2.7 s from the straggler; DiLoCo's straggler sends 3 copies (~8 s).
run_config gasloc-adaptive one-peer true 4500 3500
run_config gasloc-delayed one-peer true 4500 3500 delayed
mkdir -p "$out/gasloc-default"
swarm_manifest "straggler-gasloc-default" one-peer 20 true delayed 5 0.8 >"$out/gasloc-default/run.toml"
swarm_config "$out/gasloc-default" 900 700 5
run_config gasloc-fixed one-peer false 5000 3500
run_config diloco complete false 11000 9000

"$python" "$(dirname "$0")/swarm_report.py" "$out" diloco gasloc-adaptive gasloc-delayed gasloc-default gasloc-fixed diloco
