//! The payload gate: whether a neighbour's model may be mixed, decided from its numbers.
//!
//! A peer's tensors are untrusted input. Framing, the tensor table and the checksums are
//! checked by the exchange; this gate checks the values, before anything touches the
//! model. The trainer measures each received model `x_j` against its own anchor `θ_i`
//! where the tensors live ([`PayloadStats`]: finiteness, `‖θ_i − x_j‖`, and the cosine of
//! `θ_i − x_j` with this node's own pseudo-gradient `θ_i − x_i`); [`PayloadGate`] decides,
//! torch-free, in this one place:
//!
//! 1. every value finite, else [`Refusal::NonFinite`];
//! 2. `‖θ_i − x_j‖ ≤ k · r`, with `k = [gate] max_distance_ratio` and the reference
//!    `r = max(‖θ_i − x_i‖, median of the last [gate] median_window accepted distances)`,
//!    else [`Refusal::TooFar`]. The maximum keeps a slow node (few inner steps, a short own
//!    pseudo-gradient) from refusing honest neighbours, and the median of *accepted*
//!    payloads is one an attacker cannot inflate without first being accepted. With no
//!    reference yet (no own step and nothing accepted) the bound is not applied;
//! 3. the cosine at least `[gate] min_cosine` (−1, the default, turns it off), else
//!    [`Refusal::Misaligned`].
//!
//! A refused payload is mixed as missing: its weight returns to self
//! (`Topology::round_row`), the round engine's rule.
//!
//! A joining node has no anchor to measure against, so the states it fetches from several
//! live peers are measured against each other instead ([`judge_state_sources`]): it keeps
//! the largest group that pairwise agree within `[gate] max_state_disagreement` and
//! starts from their mean.

use crate::manifest::GateConfig;
use std::collections::VecDeque;
use std::fmt;

/// What the trainer measured of one received model against its own anchor.
#[derive(Debug, Clone, PartialEq)]
pub struct PayloadStats {
    /// The first tensor holding a NaN or an infinity, if any.
    pub non_finite: Option<String>,
    /// `‖θ_i − x_j‖`, the L2 norm over every tensor.
    pub distance: f64,
    /// `cos(θ_i − x_j, θ_i − x_i)`; `None` when either vector is zero.
    pub cosine: Option<f64>,
}

/// Why the gate turned a payload down.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// The trainer could not read the tensor as its table says (the exchange checks the
    /// table first, so this is a bug's or a decoder's refusal, never a panic).
    Malformed {
        tensor: String,
        detail: String,
    },
    NonFinite {
        tensor: String,
    },
    TooFar {
        distance: f64,
        bound: f64,
        reference: f64,
    },
    Misaligned {
        cosine: f64,
        floor: f64,
    },
}

impl Refusal {
    /// A short name of the reason, for counters and metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Refusal::Malformed { .. } => "malformed",
            Refusal::NonFinite { .. } => "non_finite",
            Refusal::TooFar { .. } => "too_far",
            Refusal::Misaligned { .. } => "misaligned",
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Malformed { tensor, detail } => {
                write!(f, "gate: malformed: tensor {tensor}: {detail}")
            }
            Refusal::NonFinite { tensor } => {
                write!(
                    f,
                    "gate: non_finite: tensor {tensor} holds a NaN or an infinity"
                )
            }
            Refusal::TooFar {
                distance,
                bound,
                reference,
            } => write!(
                f,
                "gate: too_far: ‖θ_i − x_j‖ = {distance:.6e} above the bound {bound:.6e} \
                 (max_distance_ratio × reference {reference:.6e})"
            ),
            Refusal::Misaligned { cosine, floor } => write!(
                f,
                "gate: misaligned: cosine with this node's pseudo-gradient {cosine:.4} below \
                 min_cosine {floor:.4}"
            ),
        }
    }
}

impl std::error::Error for Refusal {}

/// The gate of one node: its bounds and the distances it accepted lately.
#[derive(Debug, Clone)]
pub struct PayloadGate {
    config: GateConfig,
    accepted: VecDeque<f64>,
}

impl PayloadGate {
    pub fn new(config: GateConfig) -> Self {
        PayloadGate {
            config,
            accepted: VecDeque::new(),
        }
    }

    /// The (lower) median of the accepted distances in the window (`None` before any).
    pub fn accepted_median(&self) -> Option<f64> {
        if self.accepted.is_empty() {
            return None;
        }
        let mut sorted: Vec<f64> = self.accepted.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        // The lower median: an attacker holding half of the window cannot raise it.
        Some(sorted[(n - 1) / 2])
    }

    /// The reference distance a payload is measured against this round:
    /// `max(‖θ_i − x_i‖, median of the accepted)`.
    pub fn reference(&self, own_distance: f64) -> f64 {
        own_distance.max(self.accepted_median().unwrap_or(0.0))
    }

    /// Judges the round's payloads, `own_distance` being `‖θ_i − x_i‖`. Every payload is
    /// judged against the window as it stood before the round, so their order does not
    /// matter; the accepted ones then enter the window.
    pub fn judge_round(
        &mut self,
        own_distance: f64,
        payloads: &[PayloadStats],
    ) -> Vec<Result<(), Refusal>> {
        let median = self.accepted_median();
        let verdicts: Vec<_> = payloads
            .iter()
            .map(|stats| self.judge(own_distance, median, stats))
            .collect();
        for (stats, verdict) in payloads.iter().zip(&verdicts) {
            if verdict.is_ok() {
                self.accepted.push_back(stats.distance);
            }
        }
        let window = self.config.median_window.max(1) as usize;
        while self.accepted.len() > window {
            self.accepted.pop_front();
        }
        verdicts
    }

    fn judge(
        &self,
        own_distance: f64,
        median: Option<f64>,
        stats: &PayloadStats,
    ) -> Result<(), Refusal> {
        if let Some(tensor) = &stats.non_finite {
            return Err(Refusal::NonFinite {
                tensor: tensor.clone(),
            });
        }
        let reference = own_distance.max(median.unwrap_or(0.0));
        let bound = self.config.max_distance_ratio * reference;
        // Finite values can still sum to an infinite or NaN norm: too far, whatever the
        // reference (so only finite distances ever enter the window).
        if !stats.distance.is_finite() {
            return Err(Refusal::TooFar {
                distance: stats.distance,
                bound,
                reference,
            });
        }
        if reference > 0.0 && reference.is_finite() && stats.distance > bound {
            return Err(Refusal::TooFar {
                distance: stats.distance,
                bound,
                reference,
            });
        }
        if let Some(cosine) = stats.cosine {
            // A NaN cosine passes only a floor that is off.
            let off = self.config.min_cosine <= -1.0;
            if !off && (cosine.is_nan() || cosine < self.config.min_cosine) {
                return Err(Refusal::Misaligned {
                    cosine,
                    floor: self.config.min_cosine,
                });
            }
        }
        Ok(())
    }
}

/// Which of the states a joiner fetched it may start from (see [`judge_state_sources`]).
#[derive(Debug, Clone, PartialEq)]
pub enum StateVerdict {
    /// The sources `kept` (indices, ascending) pairwise agree: start from their mean. Each
    /// of `outvoted` disagrees with at least one of them.
    Agreed {
        kept: Vec<usize>,
        outvoted: Vec<usize>,
    },
    /// One source only: there is nothing to check it against.
    Unchecked,
    /// No two sources agree (or there are none), so which of them lies cannot be told.
    Split,
}

/// A state's two parts, each measured: the anchor (`anchor.*` tensors) and the outer
/// momentum (the rest). Used for norms and for distances between two states.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StateParts {
    pub anchor: f64,
    pub momentum: f64,
}

/// Whether two states agree. The anchors must point the same way:
/// `‖θ_a − θ_b‖ ≤ ρ · max(‖θ_a‖, ‖θ_b‖)` with `ρ = [gate] max_state_disagreement`; honest
/// anchors differ by the swarm's consensus distance. The outer momenta need only be of one
/// size, within `[gate] max_distance_ratio` of each other: each integrates its own node's
/// pseudo-gradients, so honest momenta differ by about as much as they measure. Every number
/// must be finite.
pub fn states_agree(
    config: &GateConfig,
    norm_a: StateParts,
    norm_b: StateParts,
    distance: StateParts,
) -> bool {
    let numbers = [
        norm_a.anchor,
        norm_a.momentum,
        norm_b.anchor,
        norm_b.momentum,
        distance.anchor,
        distance.momentum,
    ];
    if !numbers.iter().all(|n| n.is_finite()) {
        return false;
    }
    let anchors =
        distance.anchor <= config.max_state_disagreement * norm_a.anchor.max(norm_b.anchor);
    let (small, large) = if norm_a.momentum <= norm_b.momentum {
        (norm_a.momentum, norm_b.momentum)
    } else {
        (norm_b.momentum, norm_a.momentum)
    };
    let momenta = large <= config.max_distance_ratio * small;
    anchors && momenta
}

/// Judges the states a joiner fetched, each already through the finiteness check:
/// `norms[i]` measures state i and `distance(a, b)` the difference of states a and b. The
/// verdict keeps the largest group of sources that pairwise agree ([`states_agree`]);
/// between groups of one size, the one whose anchors lie closest together (the smallest
/// largest distance), then the one fetched first. The joiner trusts the sources that agree,
/// so an attacker must control more of them than the honest peers it was given. At most 16
/// sources are considered (the joiner asks a few).
pub fn judge_state_sources(
    config: &GateConfig,
    norms: &[StateParts],
    distance: impl Fn(usize, usize) -> StateParts,
) -> StateVerdict {
    let n = norms.len().min(16);
    match n {
        0 => return StateVerdict::Split,
        1 => return StateVerdict::Unchecked,
        _ => {}
    }
    let mut agree = vec![vec![false; n]; n];
    let mut dist = vec![vec![0.0f64; n]; n];
    for a in 0..n {
        for b in a + 1..n {
            let d = distance(a, b);
            (dist[a][b], dist[b][a]) = (d.anchor, d.anchor);
            let ok = states_agree(config, norms[a], norms[b], d);
            (agree[a][b], agree[b][a]) = (ok, ok);
        }
    }
    // Every subset, as a bit mask; n ≤ 16 keeps this at most 65 536 small checks.
    let mut best: Option<(usize, f64, u32)> = None;
    for mask in 1u32..(1 << n) {
        let members: Vec<usize> = (0..n).filter(|i| mask & (1 << i) != 0).collect();
        if members.len() < 2 {
            continue;
        }
        let mut diameter = 0.0f64;
        let mut clique = true;
        'pairs: for (i, &a) in members.iter().enumerate() {
            for &b in &members[i + 1..] {
                if !agree[a][b] {
                    clique = false;
                    break 'pairs;
                }
                diameter = diameter.max(dist[a][b]);
            }
        }
        if !clique {
            continue;
        }
        let better = match best {
            None => true,
            Some((size, d, _)) => members.len() > size || (members.len() == size && diameter < d),
        };
        if better {
            best = Some((members.len(), diameter, mask));
        }
    }
    match best {
        Some((_, _, mask)) => StateVerdict::Agreed {
            kept: (0..n).filter(|i| mask & (1 << i) != 0).collect(),
            outvoted: (0..norms.len())
                .filter(|&i| i >= n || mask & (1 << i) == 0)
                .collect(),
        },
        None => StateVerdict::Split,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate() -> PayloadGate {
        PayloadGate::new(GateConfig::default())
    }

    fn at(distance: f64) -> PayloadStats {
        PayloadStats {
            non_finite: None,
            distance,
            cosine: Some(0.5),
        }
    }

    #[test]
    fn a_non_finite_value_is_refused_naming_the_tensor() {
        let stats = PayloadStats {
            non_finite: Some("model.norm.weight".into()),
            ..at(1.0)
        };
        let verdict = gate().judge_round(1.0, &[stats]).remove(0).unwrap_err();
        assert_eq!(verdict.kind(), "non_finite");
        assert!(
            verdict.to_string().contains("model.norm.weight"),
            "{verdict}"
        );
    }

    #[test]
    fn a_model_far_beyond_the_own_pseudo_gradient_is_refused_and_an_honest_one_is_not() {
        let k = GateConfig::default().max_distance_ratio;
        let verdicts = gate().judge_round(2.0, &[at(2.5), at(2.0 * k), at(2.0 * k * 1.01)]);
        assert!(verdicts[0].is_ok() && verdicts[1].is_ok());
        assert!(
            matches!(verdicts[2], Err(Refusal::TooFar { reference, .. }) if reference == 2.0),
            "{verdicts:?}"
        );
        // A NaN or infinite norm is never within a bound.
        let verdicts = gate().judge_round(2.0, &[at(f64::NAN), at(f64::INFINITY)]);
        assert!(verdicts
            .iter()
            .all(|v| matches!(v, Err(Refusal::TooFar { .. }))));
    }

    #[test]
    fn a_slow_node_with_a_short_own_pseudo_gradient_keeps_accepting_its_honest_neighbours() {
        let mut g = gate();
        // Rounds where this node stepped normally fill the window with honest distances.
        for _ in 0..5 {
            assert!(g
                .judge_round(3.0, &[at(3.2), at(2.9)])
                .iter()
                .all(Result::is_ok));
        }
        // Then it takes one inner step: its own distance is tiny, the median is not.
        let verdicts = g.judge_round(0.01, &[at(3.1), at(3.3)]);
        assert!(verdicts.iter().all(Result::is_ok), "{verdicts:?}");
    }

    #[test]
    fn with_no_reference_yet_only_finiteness_and_the_cosine_are_checked() {
        let mut g = gate();
        let verdicts = g.judge_round(0.0, &[at(1e6), at(f64::INFINITY), at(f64::NAN)]);
        assert!(verdicts[0].is_ok());
        assert!(matches!(verdicts[1], Err(Refusal::TooFar { .. })));
        assert!(matches!(verdicts[2], Err(Refusal::TooFar { .. })));
        assert_eq!(
            g.accepted_median(),
            Some(1e6),
            "only the finite distance entered"
        );
    }

    #[test]
    fn half_a_window_of_attackers_does_not_raise_the_median() {
        let mut g = gate();
        g.judge_round(0.0, &[at(1.0), at(1.0), at(9.0), at(9.0)]);
        assert_eq!(g.accepted_median(), Some(1.0));
    }

    #[test]
    fn the_median_window_holds_accepted_distances_only_and_is_bounded() {
        let config = GateConfig {
            median_window: 4,
            ..GateConfig::default()
        };
        let mut g = PayloadGate::new(config);
        g.judge_round(1.0, &[at(1.0), at(1e9)]);
        assert_eq!(g.accepted_median(), Some(1.0));
        for d in [2.0, 3.0, 4.0, 5.0] {
            g.judge_round(10.0, &[at(d)]);
        }
        assert_eq!(g.accepted_median(), Some(3.0));
    }

    #[test]
    fn the_cosine_floor_refuses_a_flipped_direction_when_set() {
        let flipped = PayloadStats {
            cosine: Some(-0.9),
            ..at(1.0)
        };
        assert!(gate().judge_round(1.0, std::slice::from_ref(&flipped))[0].is_ok());
        let mut strict = PayloadGate::new(GateConfig {
            min_cosine: 0.0,
            ..GateConfig::default()
        });
        let verdict = strict.judge_round(1.0, &[flipped]).remove(0).unwrap_err();
        assert_eq!(verdict.kind(), "misaligned");
        let nan = PayloadStats {
            cosine: Some(f64::NAN),
            ..at(1.0)
        };
        assert!(gate().judge_round(1.0, std::slice::from_ref(&nan))[0].is_ok());
        assert!(
            strict.judge_round(1.0, &[nan])[0].is_err(),
            "NaN is no cosine"
        );
    }

    /// Parts with the given anchor value and a momentum of 1.
    fn anchor(value: f64) -> StateParts {
        StateParts {
            anchor: value,
            momentum: 1.0,
        }
    }

    /// Three sources with momenta of norm 1 and `d_m = 1`, the anchor distances between
    /// them given as `[d01, d02, d12]`.
    fn three(norms: [f64; 3], d: [f64; 3]) -> StateVerdict {
        let distance = |a: usize, b: usize| {
            anchor(match (a.min(b), a.max(b)) {
                (0, 1) => d[0],
                (0, 2) => d[1],
                _ => d[2],
            })
        };
        judge_state_sources(&GateConfig::default(), &norms.map(anchor), distance)
    }

    #[test]
    fn a_joiner_keeps_the_two_sources_that_agree_and_outvotes_a_scaled_state() {
        // Sources 0 and 2 are honest (1 % apart); source 1 scaled a tensor × 1000.
        let verdict = three([10.0, 9000.0, 10.1], [8990.0, 0.1, 8990.0]);
        assert_eq!(
            verdict,
            StateVerdict::Agreed {
                kept: vec![0, 2],
                outvoted: vec![1]
            }
        );
        // A state of honest norm in a random direction is as far as √2 of the norm.
        let verdict = three([10.0, 10.0, 10.0], [14.1, 0.1, 14.1]);
        assert!(matches!(verdict, StateVerdict::Agreed { ref kept, .. } if kept == &[0, 2]));
    }

    #[test]
    fn honest_sources_in_consensus_all_count_and_one_source_is_unchecked() {
        let verdict = three([10.0, 10.0, 10.0], [0.3, 0.2, 0.4]);
        assert_eq!(
            verdict,
            StateVerdict::Agreed {
                kept: vec![0, 1, 2],
                outvoted: vec![]
            }
        );
        assert_eq!(
            judge_state_sources(&GateConfig::default(), &[anchor(10.0)], |_, _| anchor(0.0)),
            StateVerdict::Unchecked
        );
        assert_eq!(
            judge_state_sources(&GateConfig::default(), &[], |_, _| anchor(0.0)),
            StateVerdict::Split
        );
    }

    #[test]
    fn sources_that_all_disagree_or_hold_a_non_finite_norm_give_no_verdict() {
        assert_eq!(
            three([10.0, 10.0, 10.0], [9.0, 9.0, 9.0]),
            StateVerdict::Split
        );
        let two = |n: [f64; 2], d: f64| {
            judge_state_sources(&GateConfig::default(), &n.map(anchor), |_, _| anchor(d))
        };
        assert_eq!(
            two([10.0, 10.0], 9.0),
            StateVerdict::Split,
            "one of two lies"
        );
        assert_eq!(two([f64::INFINITY, 10.0], 0.0), StateVerdict::Split);
        assert_eq!(two([10.0, 10.0], f64::NAN), StateVerdict::Split);
    }

    #[test]
    fn momenta_must_be_of_one_size_but_may_point_anywhere() {
        let config = GateConfig::default();
        let state = |momentum: f64| StateParts {
            anchor: 10.0,
            momentum,
        };
        let apart = |momentum: f64| StateParts {
            anchor: 0.1,
            momentum,
        };
        // Honest momenta: as far apart as they are long.
        assert!(states_agree(&config, state(2.0), state(3.0), apart(4.0)));
        // A momentum scaled × 1000 behind an honest anchor.
        assert!(!states_agree(
            &config,
            state(2.0),
            state(2000.0),
            apart(2000.0)
        ));
        assert!(!states_agree(&config, state(0.0), state(1.0), apart(1.0)));
        assert!(
            states_agree(&config, state(0.0), state(0.0), apart(0.0)),
            "round 0"
        );
        assert!(!states_agree(
            &config,
            state(2.0),
            state(2.0),
            apart(f64::NAN)
        ));
    }

    #[test]
    fn between_two_agreeing_pairs_the_tighter_one_wins() {
        // 1 agrees with 0 (distance 2.0) and with 2 (distance 0.5); 0 and 2 disagree.
        let verdict = three([10.0, 10.0, 10.0], [2.0, 6.0, 0.5]);
        assert_eq!(
            verdict,
            StateVerdict::Agreed {
                kept: vec![1, 2],
                outvoted: vec![0]
            }
        );
    }
}
