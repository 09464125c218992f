# bench/swarm_lib.sh: runs one configuration of a swarm benchmark (sourced by
# bench/straggler.sh and bench/overlap.sh).
#
# The caller sets: bin, data, seconds (of rounds per configuration), nodes, and the links:
# LINKS=netns (root, `ip` and `tc`: each node in its own network namespace on a bridge with a
# tbf egress rate, deploy/netns-swarm.sh) with tbf_rate / tbf_slow (tc rates; tbf_slow, node
# 1's, may be empty), or LINKS=caps (loopback, every node's upload capped by
# --max-upload-rate) with cap_rate / cap_slow (bytes/s; node 1 gets cap_slow).
# swarm_pick_links chooses LINKS when it is not set: netns as root with the tools, else caps.
# Nodes train with --device ${NODE_DEVICE:-cpu} --threads ${NODE_THREADS:-1}.
# Traffic stays on loopback or inside the namespaces the harness creates and removes.

swarm_pids=()
swarm_cleanup() {
  for p in "${swarm_pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}

swarm_pick_links() {
  if [ -z "${LINKS:-}" ]; then
    LINKS=caps
    [ "$(id -u)" = 0 ] && command -v tc >/dev/null && command -v ip >/dev/null && LINKS=netns
  fi
}

# swarm_manifest NAME TOPOLOGY INNER_STEPS ADAPTIVE OVERLAP [FRAGMENTS [MOMENTUM]]: the benchmarks' run manifest,
# the tiny model on byte tokens (0.53 MB fp32 payload), cosine decay far away; every [outer] key
# the comparison needs is written (fragments 1 and outer momentum 0.9 unless given), as the
# defaults depend on the overlap.
swarm_manifest() {
  cat <<EOF
name = "$1"
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
inner_steps = $3
adaptive_inner_steps = $4
min_inner_steps = 2
max_inner_steps = 2000
overlap = "$5"
fragments = ${6:-1}
momentum = ${7:-0.9}
EOF
}

# swarm_config DIR PERIOD_MS EXCHANGE_TIMEOUT_MS [EVAL_EVERY]: a bootstrap and $nodes
# `gasloc-node join` processes run DIR/run.toml for $seconds of rounds, evaluating every
# EVAL_EVERY rounds (default 1); each node's round records go to DIR/node<i>/rounds.jsonl and
# the period to DIR/period_ms (for bench/swarm_report.py).
swarm_config() {
  local dir=$1 period=$2 timeout=$3 eval_every=${4:-1}
  echo "$period" >"$dir/period_ms"
  if [ "$LINKS" = netns ]; then
    # Rounds start 8 s after the bootstrap (the harness's genesis delay); stop after
    # $seconds of them.
    BOOTSTRAP_ARGS="--round-period-ms $period --commit-window-ms 500 --reveal-window-ms 500 --exchange-timeout-ms $timeout" \
      TIMEOUT_S=$((seconds + 60)) bash "$(dirname "${BASH_SOURCE[0]}")/../deploy/netns-swarm.sh" "$bin" \
      "$dir/run.toml" "$dir" "$nodes" "$tbf_rate" ${tbf_slow:+"$tbf_slow"} -- --data "$(realpath "$data")" \
      --device "${NODE_DEVICE:-cpu}" --threads "${NODE_THREADS:-1}" --rounds $((seconds * 1000 / period)) --eval-every "$eval_every" \
      >"$dir/harness.log" 2>&1 || true
  else
    swarm_pids=()
    "$bin/gasloc-bootstrap" --run "$dir/run.toml" --listen /ip4/127.0.0.1/udp/0/quic-v1 \
      --addr-file "$dir/bootstrap.addr" --genesis-delay-ms 6000 --round-period-ms "$period" \
      --commit-window-ms 500 --reveal-window-ms 500 --exchange-timeout-ms "$timeout" \
      >"$dir/bootstrap.log" 2>&1 &
    swarm_pids+=($!)
    for _ in $(seq 1 100); do [ -s "$dir/bootstrap.addr" ] && break; sleep 0.1; done
    local boot i rate
    boot=$(head -n1 "$dir/bootstrap.addr")
    for i in $(seq 1 "$nodes"); do
      rate=$cap_rate
      [ "$i" = 1 ] && rate=${cap_slow:-$cap_rate}
      mkdir -p "$dir/node$i"
      "$bin/gasloc-node" join --bootstrap "$boot" --data "$data" --home "$dir/node$i" \
        --listen /ip4/127.0.0.1/udp/0/quic-v1 --device "${NODE_DEVICE:-cpu}" --threads "${NODE_THREADS:-1}" \
        --max-upload-rate "$rate" --report "$dir/node$i/rounds.jsonl" --eval-every "$eval_every" \
        >"$dir/node$i/stdout.log" 2>"$dir/node$i/stderr.log" &
      swarm_pids+=($!)
    done
    # genesis is 6 s after the bootstrap starts; then $seconds of rounds.
    sleep $((6 + seconds))
    swarm_cleanup
  fi
  echo "  $(basename "$dir"): period $period ms, exchange timeout $timeout ms: $(cat "$dir"/node*/rounds.jsonl 2>/dev/null | wc -l) node-rounds"
}
