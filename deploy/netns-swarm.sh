#!/usr/bin/env bash
# A gasloc swarm over a shaped network, on one machine, with Linux network namespaces (run as
# root). One namespace per process: node 0 runs gasloc-bootstrap, nodes 1..N `gasloc-node join`.
# A hub namespace holds a bridge; every node namespace is linked to it by a veth pair and gets
# an address in a private /24 (10.213.<x>.<i+1>, x picked so that it matches no route of this
# machine). Each node's egress is shaped with a tbf qdisc on its veth: node 1 (the straggler)
# gets <straggler-rate> when given, the other nodes <rate>, the bootstrap no limit.
# Waits for every node to exit (at most $TIMEOUT_S seconds, then SIGTERM, then SIGKILL), prints
# the rounds each one reported and exits 0 only if every node exited 0 (and none timed out).
#
# Safety rule: the script only creates, uses and deletes objects it made itself: its namespaces
# (gslc-hub-<id>, gslc-<id>-<i>), the bridge and veths inside them, and addresses inside those
# namespaces. Nothing is added to the root namespace (no address, route, link or firewall rule),
# so the swarm's traffic never leaves its namespaces. On any exit (normal, error, Ctrl-C,
# SIGTERM) it kills every process it started and deletes every namespace (and with them the
# bridge and veths), so `ip netns list` and `ip link` show nothing of it afterwards.
#
# usage: deploy/netns-swarm.sh <bin dir> <run.toml> <out dir> <nodes> <rate> [straggler-rate] \
#          -- [extra gasloc-node join args…]
#   e.g. deploy/netns-swarm.sh target/debug run.toml /tmp/ns-run 4 100mbit 10mbit -- \
#          --synthetic --payload-bytes 1000000 --rounds 5
#   rates are tc rates (100mbit, 2mbit, 500kbit).
#   environment: BOOTSTRAP_ARGS (extra gasloc-bootstrap flags, word-split), TIMEOUT_S (overall
#   bound in seconds, 600), GRACE_S (seconds between SIGTERM and SIGKILL when stopping, 15)
set -euo pipefail

usage() {
  sed -n 's/^# \{0,1\}//; /^usage:/,/^  environment/p' "$0" >&2
  exit 2
}

pos=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do pos+=("$1"); shift; done
[ $# -gt 0 ] && shift # the "--"
extra=("$@")
[ ${#pos[@]} -ge 5 ] && [ ${#pos[@]} -le 6 ] || usage
bin=${pos[0]}
run=${pos[1]}
out=${pos[2]}
nodes=${pos[3]}
rate=${pos[4]}
straggler=${pos[5]:-}
timeout_s=${TIMEOUT_S:-600}
grace_s=${GRACE_S:-15}
read -r -a boot_args <<<"${BOOTSTRAP_ARGS:-}"

[ "$(id -u)" = 0 ] || { echo "netns-swarm: must run as root" >&2; exit 2; }
[[ "$nodes" =~ ^[0-9]+$ ]] && [ "$nodes" -ge 1 ] && [ "$nodes" -le 250 ] ||
  { echo "netns-swarm: nodes must be 1..250" >&2; exit 2; }
[[ "$timeout_s" =~ ^[0-9]+$ ]] && [[ "$grace_s" =~ ^[0-9]+$ ]] ||
  { echo "netns-swarm: TIMEOUT_S and GRACE_S must be whole seconds" >&2; exit 2; }
for b in gasloc-bootstrap gasloc-node; do
  [ -x "$bin/$b" ] || { echo "netns-swarm: no $bin/$b" >&2; exit 2; }
done
[ -f "$run" ] || { echo "netns-swarm: no run manifest $run" >&2; exit 2; }
bin=$(cd "$bin" && pwd)
run=$(cd "$(dirname "$run")" && pwd)/$(basename "$run")
mkdir -p "$out"
out=$(cd "$out" && pwd)

# Names: <id> is this shell's pid (≤ 7 digits), so the bridge name stays ≤ 15 characters.
id=$$
hub=gslc-hub-$id
br=gslc-br$id
ns_of() { echo "gslc-$id-$1"; }

# A /24 under 10.213.0.0/16 that no route or address of this machine mentions (the namespaces have their
# own routing tables anyway; this only avoids confusing anyone reading addresses).
subnet=
used=$( (ip -4 route show table all; ip -4 addr show) 2>/dev/null || true)
for x in $(seq 1 254); do
  if ! grep -q "10\.213\.$x\." <<<"$used"; then subnet=10.213.$x; break; fi
done
[ -n "$subnet" ] || { echo "netns-swarm: no free 10.213.x.0/24" >&2; exit 1; }
ip_of() { echo "$subnet.$(($1 + 1))"; }

created_ns=()
pids=()
cleaned=0
# SIGTERM to the given processes (a node finishes its round and leaves), at most grace_s
# seconds of waiting, then SIGKILL.
stop_pids() {
  local p alive
  for p in "$@"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 1 $((grace_s * 5))); do
    alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.2
  done
  for p in "$@"; do kill -KILL "$p" 2>/dev/null || true; done
}
cleanup() {
  local rc=$?
  [ $cleaned = 1 ] && return
  cleaned=1
  trap - EXIT
  trap '' INT TERM # a second Ctrl-C must not cut the cleanup short
  set +e
  # Every process we started: the nodes first, then the bootstrap.
  [ ${#pids[@]} -gt 1 ] && stop_pids "${pids[@]:1}"
  [ ${#pids[@]} -gt 0 ] && stop_pids "${pids[0]}"
  # Anything else still inside our namespaces (only processes in namespaces we created).
  for ns in "${created_ns[@]}"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  done
  wait 2>/dev/null
  # Deleting a namespace deletes its links: the veths and the bridge in the hub.
  for ns in "${created_ns[@]}"; do
    ip -n "$ns" link del "$br" 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
  echo "netns-swarm: cleaned up (namespaces ${created_ns[*]:-none})"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The hub: a bridge in its own namespace.
ip netns add "$hub"
created_ns+=("$hub")
ip -n "$hub" link set lo up
ip -n "$hub" link add "$br" type bridge forward_delay 0 stp_state 0
ip -n "$hub" link set "$br" up

# One namespace per node, linked to the bridge by a veth pair created directly in the two
# namespaces (veth<i> in the node, p<i> on the bridge), so nothing appears in the root one.
for i in $(seq 0 "$nodes"); do
  ns=$(ns_of "$i")
  ip netns add "$ns"
  created_ns+=("$ns")
  ip -n "$ns" link set lo up
  ip link add "veth$i" netns "$ns" type veth peer name "p$i" netns "$hub"
  ip -n "$hub" link set "p$i" master "$br"
  ip -n "$hub" link set "p$i" up
  ip -n "$ns" addr add "$(ip_of "$i")/24" dev "veth$i"
  ip -n "$ns" link set "veth$i" up
  r=none
  if [ "$i" -ge 1 ]; then
    r=$rate
    [ "$i" = 1 ] && [ -n "$straggler" ] && r=$straggler
    ip netns exec "$ns" tc qdisc add dev "veth$i" root tbf rate "$r" burst 32kbit latency 50ms
  fi
  role=node
  [ "$i" = 0 ] && role=bootstrap
  [ "$i" = 1 ] && [ -n "$straggler" ] && role="node (straggler)"
  echo "node$i: $role  netns=$ns  addr=$(ip_of "$i")/24  rate=$r"
done

# The bootstrap in namespace 0.
bip=$(ip_of 0)
rm -f "$out/bootstrap.addr"
ip netns exec "$(ns_of 0)" "$bin/gasloc-bootstrap" --run "$run" \
  --listen "/ip4/$bip/udp/4001/quic-v1" --listen "/ip4/$bip/tcp/4001" \
  --addr-file "$out/bootstrap.addr" --genesis-delay-ms 8000 "${boot_args[@]}" \
  >"$out/bootstrap.log" 2>&1 &
pids+=($!)
boot=
for _ in $(seq 1 100); do
  boot=$(grep -m1 '/quic-v1/p2p/' "$out/bootstrap.addr" 2>/dev/null || true)
  [ -n "$boot" ] && break
  kill -0 "${pids[0]}" 2>/dev/null || break
  sleep 0.1
done
[ -n "$boot" ] || { echo "netns-swarm: the bootstrap did not start: $out/bootstrap.log" >&2; exit 1; }
echo "bootstrap: $boot"

# The nodes.
for i in $(seq 1 "$nodes"); do
  home=$out/node$i
  mkdir -p "$home"
  nip=$(ip_of "$i")
  ip netns exec "$(ns_of "$i")" "$bin/gasloc-node" join --bootstrap "$boot" \
    --listen "/ip4/$nip/udp/0/quic-v1" --listen "/ip4/$nip/tcp/0" \
    --home "$home" --report "$home/rounds.jsonl" "${extra[@]}" \
    >"$home/stdout.log" 2>"$home/stderr.log" &
  pids+=($!)
done
echo "swarm of $nodes nodes started (timeout ${timeout_s} s); output in $out"

# Wait for every node, at most timeout_s seconds.
deadline=$((SECONDS + timeout_s))
timed_out=0
while :; do
  alive=0
  for p in "${pids[@]:1}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break
  if [ $SECONDS -ge $deadline ]; then
    echo "netns-swarm: timeout after ${timeout_s} s, stopping the nodes" >&2
    stop_pids "${pids[@]:1}"
    timed_out=1
    break
  fi
  sleep 0.5
done

status=$timed_out
for i in $(seq 1 "$nodes"); do
  rc=0
  wait "${pids[$i]}" || rc=$?
  n=0
  [ -f "$out/node$i/rounds.jsonl" ] && n=$(wc -l <"$out/node$i/rounds.jsonl")
  echo "node$i: rounds=$n  exit=$rc"
  [ "$rc" = 0 ] || status=1
done
exit $status
