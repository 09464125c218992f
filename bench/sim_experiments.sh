#!/usr/bin/env bash
# bench/sim_experiments: the five simulator experiments of docs/results.md, at small scale
# (the tiny model on Shakespeare bytes, 8 workers, 1 libtorch thread per run).
#
# usage: [SIM_ROUNDS_H30=12] [SIM_ROUNDS_H1=150] bench/sim_experiments.sh [1 2 3 4 5 …]  (default: 1–5)
#        [SIM_SWEEP_TOPOLOGIES="one-peer two-peer"] bench/sim_experiments.sh 2sweep  (η × μ at H = 1)
#        bench/sim_experiments.sh 2best  (DAdam vs GASLoC η 1, μ 0.3 on the four topologies)
#        SIM_MODEL=demo bench/sim_experiments.sh 4demo  (LoRDO rank d/8 vs DiLoCo, demo shape)
#        [SIM_ROUNDS_OVERLAP=30] [SIM_SEEDS="1234 99"] [SIM_LINKS="one-peer:8 two-peer:16"]
#        [SIM_MODES="none delayed eager"] [SIM_MODEL=demo] [SIM_FRAGMENTS=3] bench/sim_experiments.sh 6
#        (overlapped rounds; SIM_MODEL=demo: the demo model's shape, d 128, 4 layers, instead
#        of the tiny one, same data settings; SIM_FRAGMENTS=P: the model in P fragments, rounds
#        of 30/P steps, each exchanging one)
#        [SIM_ROUNDS_OVERLAP=30] [SIM_SEEDS=1234] [SIM_MOMENTA="0.8 0.7"] [SIM_MODES=delayed] bench/sim_experiments.sh 6mu
#        (overlap with less outer momentum; SIM_LINKS="two-peer:16" for two-peer, SIM_MODES=none
#        for the blocking runs at that momentum)
# SIM_EVAL_BATCHES=N (default 4, the manifests' [eval] batches: 2,048 tokens) validates on N
# micro-batches of 512 tokens instead, for gaps finer than the 4 batches' noise; named …-evN.
# Writes runs/exp/<name>[-demo][-seedS][-evN]/ (rounds.csv, workers.csv, rounds.json, summary.md, loss.svg) and the
# manifests it generated in runs/exp/manifests/. Each experiment takes minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

node=${GASLOC_NODE:-target/debug/gasloc-node}
data=${GASLOC_SIM_DATA:-datasets/shakespeare-byte}
out=runs/exp
mkdir -p "$out/manifests"
r30=${SIM_ROUNDS_H30:-12}     # rounds of the H = 30 runs
r1=${SIM_ROUNDS_H1:-150}      # rounds (= steps) of the H = 1 runs
d30=$((r30 * 30))

# manifest NAME DECAY_STEPS OUTER_LINES [LORDO_LINES]: examples/runs/sim-tiny.toml with its
# [outer] replaced and decay_steps set (and with SIM_MODEL=demo the demo model's shape).
manifest() {
  local path="$out/manifests/$1.toml" model='size = "tiny"'
  [ "${SIM_MODEL:-tiny}" = demo ] && model='d_model = 128\nn_layers = 4\nn_heads = 4\nn_kv_heads = 2'
  sed -e '/^\[outer\]/,$d' -e "s/^decay_steps = .*/decay_steps = $2/" \
    -e "s/^seed = .*/seed = ${SIM_SEED:-1234}/" -e "s/^size = \"tiny\"/$model/" \
    -e "s/^batches = .*/batches = ${SIM_EVAL_BATCHES:-4}/" \
    examples/runs/sim-tiny.toml > "$path"
  printf '[outer]\n%b\n' "$3" >> "$path"
  # The experiments below that name no overlap are of blocking rounds (left out, gasloc's
  # default would be delayed in five fragments).
  case "$3" in *overlap*) ;; *) printf 'overlap = "none"\n' >> "$path" ;; esac
  if [ -n "${4:-}" ]; then printf '[lordo]\n%b\n' "$4" >> "$path"; fi
  echo "$path"
}

# sim NAME ROUNDS DECAY OUTER [LORDO] [-- extra sim flags]. The run's name (its manifest and
# output directory) gets "-demo" with SIM_MODEL=demo and "-seedS" with a SIM_SEED other than
# 1234, so runs of other shapes and seeds sit beside each other.
sim() {
  local name=$1 rounds=$2 decay=$3 outer=$4 lordo=${5:-}
  shift 5 || shift $#
  [ "${SIM_MODEL:-tiny}" = demo ] && name+=-demo
  [ "${SIM_SEED:-1234}" != 1234 ] && name+=-seed$SIM_SEED
  [ "${SIM_EVAL_BATCHES:-4}" != 4 ] && name+=-ev$SIM_EVAL_BATCHES
  local run; run=$(manifest "$name" "$decay" "$outer" "$lordo")
  echo "== $name"
  "$node" sim --run "$run" --data "$data" --workers 8 --rounds "$rounds" --out "$out/$name" \
    --threads 1 "$@" | tail -1
}

exp1() { # H = 30: GASLoC one-peer / two-peer vs DiLoCo vs Local-DAdam
  sim e1-gasloc-one-peer "$r30" "$d30" 'topology = "one-peer"\ninner_steps = 30' ''
  sim e1-gasloc-two-peer "$r30" "$d30" 'topology = "two-peer"\ninner_steps = 30' ''
  sim e1-diloco "$r30" "$d30" 'algorithm = "diloco"\ninner_steps = 30' ''
  sim e1-local-dadam-two-peer "$r30" "$d30" 'algorithm = "local-dadam"\ntopology = "two-peer"\ninner_steps = 30' ''
  sim e1-ddp "$d30" "$d30" 'algorithm = "ddp"' '' --eval-every 30
}

exp2() { # H = 1: GASLoC vs DAdam on four topologies
  for t in one-peer two-peer ring complete; do
    sim "e2-gasloc-$t" "$r1" "$r1" "topology = \"$t\"\ninner_steps = 1" '' --eval-every 25
    sim "e2-dadam-$t" "$r1" "$r1" "algorithm = \"dadam\"\ntopology = \"$t\"" '' --eval-every 25
  done
  # the same long-run outer step η/(1−μ) = 1 as DAdam
  sim e2-gasloc-one-peer-eta0.1 "$r1" "$r1" 'topology = "one-peer"\ninner_steps = 1\nlr = 0.1\nmomentum = 0.9' '' --eval-every 25
  exp2sweep
}

exp2sweep() { # H = 1: GASLoC's outer lr and momentum, η ∈ {0.5, 1} × μ ∈ {0, 0.3, 0.5, 0.9}
  # (SIM_SWEEP_TOPOLOGIES, default one-peer and two-peer)
  local t eta mu
  for t in ${SIM_SWEEP_TOPOLOGIES:-one-peer two-peer}; do
    for eta in 0.5 1.0; do
      for mu in 0.0 0.3 0.5 0.9; do
        sim "e2-gasloc-$t-eta$eta-mu$mu" "$r1" "$r1" \
          "topology = \"$t\"\ninner_steps = 1\nlr = $eta\nmomentum = $mu" '' --eval-every 25
      done
    done
  done
}

exp2best() { # H = 1: DAdam against GASLoC's best outer settings of the sweep (η 1, μ 0.3) on the
  # four topologies (docs/results.md §2, at SIM_ROUNDS_H1=500)
  local t
  for t in one-peer two-peer ring complete; do
    sim "e2-dadam-$t" "$r1" "$r1" "algorithm = \"dadam\"\ntopology = \"$t\"" '' --eval-every 50
    sim "e2-gasloc-$t-eta1.0-mu0.3" "$r1" "$r1" \
      "topology = \"$t\"\ninner_steps = 1\nlr = 1.0\nmomentum = 0.3" '' --eval-every 50
  done
}

exp3() { # outer momentum as gossip acceleration: consensus per round, one-peer, H = 30 (μ = 0.9 is e1-gasloc-one-peer)
  # 3b: a pure disagreement under repeated mixing (no local steps), n = 8, 32, 128
  cargo test -q -p gasloc-node --bench gossip_contraction -- 3000 1,2 | tee "$out/e3-contraction.md"
  sim e3-one-peer-mu0 "$r30" "$d30" 'topology = "one-peer"\ninner_steps = 30\nmomentum = 0.0' ''
  # the same long-run step size η/(1−μ) = 0.7 as μ = 0
  sim e3-one-peer-mu0.9-eta0.07 "$r30" "$d30" 'topology = "one-peer"\ninner_steps = 30\nmomentum = 0.9\nlr = 0.07' ''
}

exp4() { # LoRDO. Global projection (the paper's and the authors' code): DiLoCo's all-reduce of
  # the full-rank model, every worker's basis the top-r singular vectors of the full-rank global
  # mean pseudo-gradient; without (ω = 1) and with the full-rank term, ranks d/32, d/8, d/4; at
  # d/8 also the paper's form of the term (the gradient alone) and the authors' regime. Then
  # our gossip adaptation, the `lordo` payload (each pseudo-gradient's own top-r factors).
  for r in 2 8 16; do
    for w in 1.0 0.97; do
      sim "e4-lordo-global-r$r-omega$w" "$r30" "$d30" \
        'algorithm = "diloco"\ninner_steps = 30\ninner_optimizer = "lordo"' "rank = $r\nomega = $w"
    done
  done
  sim e4-lordo-global-r8-omega0.97-paper-term "$r30" "$d30" \
    'algorithm = "diloco"\ninner_steps = 30\ninner_optimizer = "lordo"' \
    'rank = 8\nomega = 0.97\nfull_rank_term = "gradient"'
  sim e4-lordo-global-r8-authors-regime "$r30" "$d30" \
    'algorithm = "diloco"\ninner_steps = 30\ninner_optimizer = "lordo"' \
    'rank = 8\nomega = 0.97\nregime = "authors"'
  for w in 1.0 0.97; do
    sim "e4-lordo-gossip-two-peer-r8-omega$w" "$r30" "$d30" \
      'topology = "two-peer"\ninner_steps = 30\ninner_optimizer = "lordo"\npayload = "lordo"' \
      "rank = 8\nomega = $w\nfull_sync_every = 4"
  done
  sim e4-gasloc-two-peer-bf16 "$r30" "$d30" 'topology = "two-peer"\ninner_steps = 30\npayload = "model-bf16"' ''
}

exp4demo() { # the demo-size pair of experiment 4 (run with SIM_MODEL=demo: d 128, so rank 16 = d/8):
  # LoRDO's global projection in the authors' regime against full-rank DiLoCo
  sim e4-lordo-global-r16-authors-regime "$r30" "$d30" \
    'algorithm = "diloco"\ninner_steps = 30\ninner_optimizer = "lordo"' \
    'rank = 16\nomega = 0.97\nregime = "authors"' --eval-every 10
  sim e1-diloco "$r30" "$d30" 'algorithm = "diloco"\ninner_steps = 30' '' --eval-every 10
}

exp5() { # stragglers: one worker at 10 % / 20 % bandwidth; fixed 20 ms simulated step time
  for f in 0.1 0.2; do
    sim "e5-diloco-s$f" "$r30" "$d30" 'algorithm = "diloco"\ninner_steps = 30' '' --straggler "3:$f" --step-time-ms 20
    sim "e5-gasloc-fixed-s$f" "$r30" "$d30" 'topology = "one-peer"\ninner_steps = 30' '' --straggler "3:$f" --step-time-ms 20
    sim "e5-gasloc-adaptive-s$f" "$r30" "$d30" 'topology = "one-peer"\ninner_steps = 30\nadaptive_inner_steps = true\nmin_inner_steps = 5' '' \
      --straggler "3:$f" --step-time-ms 20
  done
}

exp6() { # overlapped rounds: none / delayed / eager on one-peer and two-peer; 25 ms simulated
  # steps (H = 30: 0.75 s of compute) and links at which a blocking exchange takes about 40 %
  # of the round (one-peer: one 0.53 MB payload at 8 Mbit/s; two-peer: two at 16 Mbit/s).
  # SIM_SEEDS (default 1234) names the run seeds, SIM_LINKS the topology:Mbit/s pairs,
  # SIM_MODES the overlap modes. With SIM_MODEL=demo (3.2 MB payload) the links for the same
  # 40 % are one-peer:50 two-peer:100.
  # SIM_FRAGMENTS=P (default 1) splits the model into P fragments ([outer] fragments): rounds
  # of 30/P inner steps, P times as many, each exchanging one fragment, so every fragment is
  # still synced every 30 steps and the runs take the same inner steps; named …-pP.
  # SIM_MOMENTA (unset by default: μ 0.9, written, as delayed's own default is 0.8) runs each
  # at these outer momenta, named …-muM.
  local ro=${SIM_ROUNDS_OVERLAP:-30} p=${SIM_FRAGMENTS:-1} seed t mode mu name outer
  if ((30 % p != 0)); then echo "SIM_FRAGMENTS=$p must divide 30" >&2; return 1; fi
  for seed in ${SIM_SEEDS:-1234}; do
    for t in ${SIM_LINKS:-one-peer:8 two-peer:16}; do
      for mode in ${SIM_MODES:-none delayed eager}; do
        for mu in ${SIM_MOMENTA:-default}; do
          name="e6-${t%%:*}-$mode"
          outer="topology = \"${t%%:*}\"\ninner_steps = $((30 / p))\noverlap = \"$mode\""
          if [ "$mu" != default ]; then
            name+="-mu$mu"
            outer+="\nmomentum = $mu"
          else
            outer+="\nmomentum = 0.9"
          fi
          ((p > 1)) && name+="-p$p"
          SIM_SEED=$seed sim "$name" $((ro * p)) $((ro * 30)) "$outer\nfragments = $p" '' \
            --step-time-ms 25 --bandwidth-mbps "${t##*:}" --latency-ms 20 --eval-every $((5 * p))
        done
      done
    done
  done
}

exp6mu() { # overlapped rounds with less outer momentum: exp6 with other defaults.
  # SIM_MOMENTA (default 0.8 0.7) names the momenta, SIM_LINKS the topology:Mbit/s pairs
  # (default one-peer:8), SIM_MODES the overlap modes (default delayed; none for the
  # blocking runs at that momentum); SIM_SEEDS and SIM_FRAGMENTS as in exp6.
  SIM_MOMENTA=${SIM_MOMENTA:-0.8 0.7} SIM_LINKS=${SIM_LINKS:-one-peer:8} \
    SIM_MODES=${SIM_MODES:-delayed} exp6
}

for e in "${@:-1 2 3 4 5}"; do
  for one in $e; do "exp$one"; done
done
