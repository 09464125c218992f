//! The contraction of a pure disagreement under repeated mixing: experiment 3 of
//! `docs/results.md`, the χ → √χ claim where it lives.
//!
//! The GASLoC paper (`docs/algorithms.md`, "A round", why outer momentum) says outer Nesterov
//! momentum acts as gossip acceleration: the consensus error contracts at a rate set by √χ instead
//! of χ, the inverse spectral gap of the mixing. In training that rate is hidden by the fresh
//! disagreement each round's local steps inject, so this measures it alone: n workers start from
//! anchors that differ (a common vector plus independent noise), take no local steps (each worker's
//! "local model" is its anchor, `x_i = θ_i`), and every round each one mixes with its
//! neighbours of that round and takes its outer step, with the same functions as the
//! simulator and the node: the round's permutation ([`permutation`], [`sim_round_seed`]), the
//! topology's row ([`Topology::round_row`]), the mixed pseudo-gradient
//! ([`mixed_pseudo_gradient`]) and the outer optimizer ([`OuterOptimizer`]). The doubly
//! stochastic rows keep the mean anchor where it is, so only the disagreement moves.
//!
//! Reported per configuration: the consensus distance ([`consensus_distance`]) after each
//! round relative to the start, and the rounds it takes to fall by [`TARGET_REDUCTION`]
//! (with the per-round rate that implies). Double precision throughout, so the rounding floor
//! lies far below the target.

use crate::algo::outer::{consensus_distance, mixed_pseudo_gradient, OuterOptimizer};
use gasloc_proto::manifest::OuterConfig;
use gasloc_proto::topology::{permutation, sim_round_seed, Topology};
use gasloc_proto::RunManifest;
use tch::{Device, Kind, Tensor};

/// The fall of the consensus distance that counts as "contracted": 10⁻⁶ of its start.
pub const TARGET_REDUCTION: f64 = 1e-6;

/// One configuration.
#[derive(Debug, Clone)]
pub struct Disagreement {
    pub workers: usize,
    pub topology: Topology,
    /// η, μ and Nesterov are taken from here (the rest of the outer settings do not apply).
    pub outer: OuterConfig,
    /// Length of each worker's anchor.
    pub dimension: i64,
    pub max_rounds: u64,
    /// Seeds the starting anchors and the rounds' permutations.
    pub seed: u64,
}

/// What a configuration did.
#[derive(Debug, Clone)]
pub struct Contraction {
    /// Consensus distance after each round over the one at the start (index 0 is round 1).
    pub relative: Vec<f64>,
    /// The first round after which the distance is at most [`TARGET_REDUCTION`] of the
    /// start; `None` when it was not reached within `max_rounds`.
    pub rounds_to_target: Option<u64>,
}

impl Contraction {
    /// The geometric mean contraction per round up to the target, `TARGET^(1/rounds)`, or
    /// over every round when the target was not reached.
    pub fn rate_per_round(&self) -> f64 {
        match self.rounds_to_target {
            Some(r) => TARGET_REDUCTION.powf(1.0 / r as f64),
            None => {
                let last = self.relative.last().copied().unwrap_or(1.0);
                last.powf(1.0 / self.relative.len().max(1) as f64)
            }
        }
    }
}

/// The run's default outer settings (Nesterov) with learning rate `lr` and momentum
/// `momentum`: what a [`Disagreement`] takes.
pub fn outer_settings(lr: f64, momentum: f64) -> OuterConfig {
    let text = "name = \"contraction\"\nseed = 1\n[model]\nsize = \"tiny\"\n[data]\n\
                tokenizer = \"byte\"\nseq_len = 8\nmicro_batch = 1\n[optimizer]\ndecay_steps = 10\n";
    let mut outer = RunManifest::parse(text, "contraction")
        .expect("the fixed manifest parses")
        .outer;
    outer.lr = lr;
    outer.momentum = momentum;
    outer
}

/// The anchors every configuration starts from: a common vector plus independent noise
/// per worker, both N(0, 1), drawn from `seed`.
fn starting_anchors(config: &Disagreement) -> Vec<Vec<Tensor>> {
    let options = (Kind::Double, Device::Cpu);
    tch::manual_seed(config.seed as i64);
    let common = Tensor::randn([config.dimension], options);
    (0..config.workers)
        .map(|_| vec![&common + Tensor::randn([config.dimension], options)])
        .collect()
}

/// One outer optimizer per worker, with the configuration's settings.
fn outer_optimizers(config: &Disagreement, anchors: &[Vec<Tensor>]) -> Vec<OuterOptimizer> {
    anchors
        .iter()
        .map(|a| OuterOptimizer::new(&config.outer, a))
        .collect()
}

/// One round: every worker mixes with its neighbours of the round and takes its outer step.
/// No local steps, so each worker's "local model" is its anchor as it stood before anyone's
/// outer step of this round.
fn mix_once(
    config: &Disagreement,
    round: u64,
    anchors: &mut [Vec<Tensor>],
    outers: &mut [OuterOptimizer],
) {
    let perm = permutation(sim_round_seed(config.seed, round), config.workers);
    let models: Vec<Vec<Tensor>> = anchors
        .iter()
        .map(|a| a.iter().map(Tensor::copy).collect())
        .collect();
    for (i, (anchor, outer)) in anchors.iter_mut().zip(outers.iter_mut()).enumerate() {
        let row = config.topology.round_row(&perm, i, &[]);
        let delta = mixed_pseudo_gradient(&row, &models[i], |j| &models[j]);
        outer.step(anchor, &delta);
    }
}

/// Runs one configuration; stops at the target or after `max_rounds`.
pub fn contract(config: &Disagreement) -> Contraction {
    let _guard = tch::no_grad_guard();
    let mut anchors = starting_anchors(config);
    let mut outers = outer_optimizers(config, &anchors);
    let start = consensus_distance(&anchors);
    let mut relative = Vec::new();
    let mut rounds_to_target = None;
    for round in 0..config.max_rounds {
        mix_once(config, round, &mut anchors, &mut outers);
        let now = consensus_distance(&anchors) / start;
        relative.push(now);
        if now <= TARGET_REDUCTION {
            rounds_to_target = Some(round + 1);
            break;
        }
        if !now.is_finite() || now > 1e12 {
            break; // diverged: the rate says so
        }
    }
    Contraction {
        relative,
        rounds_to_target,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(workers: usize, topology: Topology, lr: f64, momentum: f64) -> Disagreement {
        Disagreement {
            workers,
            topology,
            outer: outer_settings(lr, momentum),
            dimension: 16,
            max_rounds: 400,
            seed: 7,
        }
    }

    #[test]
    fn plain_averaging_on_the_complete_graph_agrees_in_one_round() {
        let c = contract(&config(8, Topology::Complete, 1.0, 0.0));
        assert_eq!(c.rounds_to_target, Some(1), "{:?}", c.relative);
    }

    #[test]
    fn plain_averaging_over_random_pairs_halves_the_disagreement_about_every_round() {
        // A pair's average removes half of the pair's spread in expectation: E‖·‖² × ½.
        let c = contract(&config(32, Topology::OnePeer, 1.0, 0.0));
        let rate = c.rate_per_round();
        assert!(
            (0.4..0.6).contains(&rate),
            "rate {rate}, {:?}",
            c.rounds_to_target
        );
    }

    #[test]
    fn a_fixed_ring_contracts_slower_as_it_grows() {
        // Its spectral gap shrinks as 1/n²: the rounds to the target grow with n.
        let small = contract(&config(8, Topology::Ring, 1.0, 0.0));
        let large = contract(&config(32, Topology::Ring, 1.0, 0.0));
        let (s, l) = (
            small.rounds_to_target.unwrap(),
            large.rounds_to_target.unwrap_or(u64::MAX),
        );
        assert!(l > 4 * s, "ring of 8: {s} rounds, of 32: {l}");
    }

    #[test]
    fn momentum_accelerates_a_fixed_ring_and_slows_random_pairs() {
        // Where the χ → √χ claim lives: a fixed ring of 32 has a small spectral gap, and
        // outer momentum contracts it faster than plain averaging; random pairs mix fast
        // already, and momentum only adds oscillation.
        let ring = |mu| contract(&config(32, Topology::Ring, 1.0, mu)).rate_per_round();
        let (plain, accelerated) = (ring(0.0), ring(0.9));
        assert!(
            accelerated < plain - 0.05,
            "ring: μ 0.9 {accelerated}, μ 0 {plain}"
        );
        let pairs = |mu| contract(&config(32, Topology::OnePeer, 1.0, mu)).rate_per_round();
        let (plain, with_momentum) = (pairs(0.0), pairs(0.7));
        assert!(
            with_momentum > plain,
            "one-peer: μ 0.7 {with_momentum}, μ 0 {plain}"
        );
    }

    #[test]
    fn the_mean_anchor_does_not_move() {
        // Doubly stochastic rows and pseudo-gradients that sum to zero over the workers:
        // momentum or not, the mean anchor stays where it started; only the disagreement
        // moves. Checked on the anchors themselves, round by round.
        let _guard = tch::no_grad_guard();
        let c = config(8, Topology::TwoPeer, 0.7, 0.9);
        let mut anchors = starting_anchors(&c);
        let mean = |a: &[Vec<Tensor>]| {
            Tensor::stack(&a.iter().map(|w| &w[0]).collect::<Vec<_>>(), 0).mean_dim(
                0,
                false,
                Kind::Double,
            )
        };
        let before = mean(&anchors);
        let mut outers = outer_optimizers(&c, &anchors);
        for round in 0..20 {
            mix_once(&c, round, &mut anchors, &mut outers);
        }
        let drift = (mean(&anchors) - &before).norm().double_value(&[]);
        assert!(drift < 1e-12, "the mean moved by {drift}");
        assert!(consensus_distance(&anchors) < 0.5 * consensus_distance(&starting_anchors(&c)));
    }
}
