#!/usr/bin/env bash
# bench/overlap_gpu: blocking against overlapped rounds at the 125m shape on one GPU: tokens/s
# per node and compute utilisation, in one run.
#
# A bootstrap and 2 `gasloc-node join` processes on loopback share one GPU (--device cuda:0)
# and train the 125m manifest's model (d 768, 12 layers, GPT-2 vocabulary, about 124 M
# parameters, bf16 compute, fp32 master weights) on the Shakespeare GPT-2 shards, 32 768
# tokens per optimizer step, one-peer, adaptive H_i, a `model-bf16` payload (248 MB). Every
# node's upload is capped (--max-upload-rate) so that one blocking exchange takes about 40 %
# of a round. The configurations (`none`, `delayed`, `eager` and `default` by default) run one
# after the other for the same wall-clock time: the three modes on the whole model at outer
# momentum 0.9, and `default` with no overlap, fragments, inner steps or momentum written (the
# manifest's default: `delayed` in five fragments, 6 steps a round, μ 0.8) in rounds of a fifth
# of the period, evaluated every fifth round; bench/swarm_report.py prints each one's utilisation, idle
# share and tokens/s per node (over wall time and while training).
#
# The two nodes share the GPU: when both train at once (overlapped rounds) each gets about
# half of it, so tokens/s per node measures the GPU's share that a node turns into training,
# and the sum over the nodes what the GPU did.
#
# usage: bench/overlap_gpu.sh [bin dir] [data dir] [seconds per configuration] [configurations]
#   environment: NODE_DEVICE (cuda:0), SIZE (125m), TOKENIZER (gpt2), SEQ_LEN (1024),
#   MICRO_BATCH (8), GRAD_ACCUM (4), PERIOD_MS (15000), CAP (upload cap, bytes/s: 41000000),
#   EXCHANGE_TIMEOUT_MS (period − 2 s). The defaults are the GPU run's; with NODE_DEVICE=cpu,
#   SIZE=tiny, TOKENIZER=byte and small batches the same script checks itself on a CPU.
set -euo pipefail
bin=${1:-target/release}
data=${2:-datasets/shakespeare-gpt2}
seconds=${3:-90}
configs=${4:-none delayed eager default}
nodes=2
export NODE_DEVICE=${NODE_DEVICE:-cuda:0} NODE_THREADS=${NODE_THREADS:-4}
size=${SIZE:-125m} tokenizer=${TOKENIZER:-gpt2}
seq_len=${SEQ_LEN:-1024} micro_batch=${MICRO_BATCH:-8} grad_accum=${GRAD_ACCUM:-4}
period=${PERIOD_MS:-15000}
timeout=${EXCHANGE_TIMEOUT_MS:-$((period - 2000))}
LINKS=caps cap_rate=${CAP:-41000000} cap_slow=
python=${GASLOC_PYTHON:-python3}
# shellcheck source=bench/swarm_lib.sh
. "$(dirname "$0")/swarm_lib.sh"
[ -d "$data" ] || { echo "no data in $data: run make setup" >&2; exit 1; }
out=$(mktemp -d /tmp/gasloc-overlap-gpu.XXXXXX)
echo "bench/overlap_gpu: $nodes nodes on $NODE_DEVICE, $size, uploads capped at $cap_rate B/s," \
  "rounds of $period ms, $seconds s per configuration; out $out"
trap swarm_cleanup EXIT INT TERM

for mode in $configs; do
  mkdir -p "$out/$mode"
  cat >"$out/$mode/run.toml" <<EOF
name = "overlap-gpu-$mode"
seed = 3
[model]
size = "$size"
cuda_compute = "bf16"
[data]
tokenizer = "$tokenizer"
seq_len = $seq_len
micro_batch = $micro_batch
grad_accum = $grad_accum
[optimizer]
lr = 6e-4
warmup_steps = 20
decay_steps = 100000
[eval]
batches = 4
[outer]
topology = "one-peer"
adaptive_inner_steps = true
min_inner_steps = 2
max_inner_steps = 2000
payload = "model-bf16"
EOF
  if [ "$mode" = default ]; then
    swarm_config "$out/$mode" $((period / 5)) $((timeout / 5)) 5
  else
    printf 'inner_steps = 30\noverlap = "%s"\nfragments = 1\nmomentum = 0.9\n' "$mode" >>"$out/$mode/run.toml"
    swarm_config "$out/$mode" "$period" "$timeout"
  fi
done

"$python" "$(dirname "$0")/swarm_report.py" --tokens-per-step $((seq_len * micro_batch * grad_accum)) \
  "$out" none $configs
