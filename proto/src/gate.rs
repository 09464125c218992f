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
//! A refused payload is mixed as missing, the round engine's rule: its weight returns to self,
//! or on the complete topology is spread over the members that arrived
//! (`Topology::round_row`, `Topology::missing_weight`).
//!
//! A joining node has no anchor to measure against, so the states it fetches from several
//! live peers are measured against each other instead ([`judge_against_median`],
//! [`judge_pair`]): it keeps those within `[gate] max_state_disagreement` of the others and
//! starts from their coordinate-wise median (three or more) or their mean (two).

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

    /// A gate whose window starts from `distances` (oldest first; the last
    /// `median_window` finite, positive ones are kept): the window a restarted node saved in
    /// its checkpoint, or the distances between the anchors a joiner synced from. Without
    /// them a node's only reference is its own pseudo-gradient, which after a restart (the
    /// inner optimizer's moments kept, short steps) is many times shorter than the distance
    /// to an honest neighbour — whose anchor differs from this node's by the swarm's spread
    /// (measured in the compose test: own 1.1–1.5 against neighbours at 10–15).
    pub fn with_accepted(config: GateConfig, distances: impl IntoIterator<Item = f64>) -> Self {
        let mut gate = PayloadGate::new(config);
        gate.restart_window(distances);
        gate
    }

    /// Replaces the window with `distances` (as [`Self::with_accepted`] keeps them) when any
    /// of them is kept; otherwise the window stays as it was. Returns whether it changed.
    pub fn restart_window(&mut self, distances: impl IntoIterator<Item = f64>) -> bool {
        let kept: VecDeque<f64> = distances
            .into_iter()
            .filter(|d| d.is_finite() && *d > 0.0)
            .collect();
        if kept.is_empty() {
            return false;
        }
        self.accepted = kept;
        self.trim();
        true
    }

    /// The accepted distances in the window, oldest first (what a checkpoint keeps).
    pub fn accepted(&self) -> Vec<f64> {
        self.accepted.iter().copied().collect()
    }

    fn trim(&mut self) {
        let window = self.config.median_window.max(1) as usize;
        while self.accepted.len() > window {
            self.accepted.pop_front();
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
        self.trim();
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

/// Which of the states a joiner fetched it may start from.
#[derive(Debug, Clone, PartialEq)]
pub enum StateVerdict {
    /// The sources `kept` (indices, ascending) agree: start from their mean. Each of
    /// `outvoted` lies too far from the others.
    Agreed {
        kept: Vec<usize>,
        outvoted: Vec<usize>,
    },
    /// One source only: there is nothing to check it against.
    Unchecked,
    /// The sources do not agree, and which of them lies cannot be told.
    Split,
}

/// Whether two anchors agree: `‖θ_a − θ_b‖ ≤ ρ · min(‖θ_a‖, ‖θ_b‖)`, with
/// `ρ = [gate] max_state_disagreement`, every number finite. With two sources there is no
/// robust reference, so the *smaller* norm is the scale: a model scaled up (a tensor × 1000:
/// hundreds of norms) or down towards zero lies far away, and so does a sign flip (2). A
/// random direction of honest norm lies √2 away, inside the default ρ = 1.5: early in a run,
/// honest nodes that have not yet mixed with each other lie as far apart as that (measured:
/// up to about one norm at round 3 of the e2e swarm test), so the distance alone cannot tell
/// them from it. The outer momenta are not compared: each integrates its own node's
/// pseudo-gradients (a node on a slow link, taking few inner steps, has a far shorter one);
/// the mean clips them instead ([`momentum_clip`]).
pub fn states_agree(config: &GateConfig, norm_a: f64, norm_b: f64, distance: f64) -> bool {
    let finite = norm_a.is_finite() && norm_b.is_finite() && distance.is_finite();
    finite && distance <= config.max_state_disagreement * norm_a.min(norm_b)
}

/// Two sources: they agree ([`states_agree`]) or one of them lies.
pub fn judge_pair(config: &GateConfig, norms: [f64; 2], distance: f64) -> StateVerdict {
    if states_agree(config, norms[0], norms[1], distance) {
        StateVerdict::Agreed {
            kept: vec![0, 1],
            outvoted: Vec::new(),
        }
    } else {
        StateVerdict::Split
    }
}

/// Three sources or more, measured against their coordinate-wise median anchor, which lies
/// between the honest values in every coordinate while most sources are honest, so both the
/// place and the scale are the median's: `to_median[i] = ‖θ_i − θ_median‖` must be at most
/// `ρ · ‖θ_median‖` (`median_norm`), every number finite. A scaled state lies hundreds of
/// norms away, a sign flip 2; an honest slow node's anchor, shorter than the others, is not
/// held to its own smaller norm. The joiner then starts from the median of the sources kept,
/// so one that passes — a random direction (√2), a state near zero (1) — moves no
/// coordinate outside the honest sources' range. The sources kept are those within the bound
/// when they are at least two; the others are outvoted.
pub fn judge_against_median(
    config: &GateConfig,
    median_norm: f64,
    to_median: &[f64],
) -> StateVerdict {
    let bound = config.max_state_disagreement * median_norm;
    let (kept, outvoted): (Vec<usize>, Vec<usize>) = (0..to_median.len())
        .partition(|&i| bound.is_finite() && to_median[i].is_finite() && to_median[i] <= bound);
    if kept.len() >= 2 {
        StateVerdict::Agreed { kept, outvoted }
    } else {
        StateVerdict::Split
    }
}

/// The factor each kept source's outer momentum is scaled by before the mean: at most 1, so
/// that no momentum is longer than the lower median of their norms. One source's momentum
/// scaled × 1000 behind an honest anchor then counts as one of honest size.
pub fn momentum_clip(norms: &[f64]) -> Vec<f64> {
    let mut sorted: Vec<f64> = norms.iter().copied().filter(|n| n.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let Some(&median) = sorted.get(sorted.len().saturating_sub(1) / 2) else {
        return vec![0.0; norms.len()];
    };
    norms
        .iter()
        .map(|&n| {
            if !n.is_finite() {
                0.0
            } else if n > median {
                median / n
            } else {
                1.0
            }
        })
        .collect()
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

    /// The compose test's restarted node, in numbers: its own pseudo-gradient 1.1 while its
    /// neighbours' models lay 12–15 away (the swarm's spread). With an empty window it
    /// refused them all; with the window its checkpoint kept it accepts them, and the
    /// window survives the trip through `accepted` / `with_accepted` whole and bounded.
    #[test]
    fn a_restarted_node_with_its_saved_window_accepts_the_neighbours_it_accepted_before() {
        let mut before = gate();
        for d in [9.0, 10.8, 12.8, 6.7, 13.6, 7.8, 6.0, 16.0, 6.9, 10.2] {
            assert!(before.judge_round(1.3, &[at(d)])[0].is_ok());
        }
        let fresh = gate().judge_round(1.1, &[at(12.1)]).remove(0);
        assert!(matches!(fresh, Err(Refusal::TooFar { .. })), "{fresh:?}");

        let mut restarted = PayloadGate::with_accepted(GateConfig::default(), before.accepted());
        assert_eq!(restarted.accepted(), before.accepted());
        let verdicts = restarted.judge_round(1.1, &[at(12.1), at(15.2), at(15.5)]);
        assert!(verdicts.iter().all(Result::is_ok), "{verdicts:?}");
        // A scaled model is refused as before.
        let scaled = restarted.judge_round(1.1, &[at(1e4)]).remove(0);
        assert!(matches!(scaled, Err(Refusal::TooFar { .. })), "{scaled:?}");

        let config = GateConfig {
            median_window: 3,
            ..GateConfig::default()
        };
        let seeded = PayloadGate::with_accepted(config, [f64::NAN, 1.0, -2.0, 0.0, 2.0, 3.0, 4.0]);
        assert_eq!(
            seeded.accepted(),
            [2.0, 3.0, 4.0],
            "finite, positive, the newest"
        );
    }

    /// A joiner whose sources were identical (no distance among them) keeps the window it had.
    #[test]
    fn a_window_restarted_from_no_distance_stays_as_it_was() {
        let mut g = PayloadGate::with_accepted(GateConfig::default(), [4.0, 5.0]);
        assert!(!g.restart_window([0.0, 0.0, f64::NAN]));
        assert_eq!(g.accepted(), [4.0, 5.0]);
        assert!(g.restart_window([0.0, 7.0]));
        assert_eq!(g.accepted(), [7.0]);
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

    #[test]
    fn a_joiner_keeps_the_sources_near_the_median_and_outvotes_a_scaled_state() {
        let config = GateConfig::default();
        // Sources 0 and 2 honest, source 1 with a tensor × 1000: the median lies between
        // the honest ones.
        let verdict = judge_against_median(&config, 10.0, &[0.1, 8990.0, 0.1]);
        assert_eq!(
            verdict,
            StateVerdict::Agreed {
                kept: vec![0, 2],
                outvoted: vec![1]
            }
        );
        // A sign flip lies twice the norm away.
        let verdict = judge_against_median(&config, 10.0, &[0.1, 20.0, 0.1]);
        assert!(matches!(verdict, StateVerdict::Agreed { ref outvoted, .. } if outvoted == &[1]));
        // An honest node that has not mixed with the two others yet, a norm away, is kept
        // (the e2e swarm test's round 3), and so is a slow node's anchor, shorter than the
        // others (against its own norm it would lie beyond the bound).
        let verdict = judge_against_median(&config, 55.0, &[0.0, 60.0, 0.0]);
        assert!(matches!(verdict, StateVerdict::Agreed { ref kept, .. } if kept.len() == 3));
        let verdict = judge_against_median(&config, 10.0, &[0.5, 9.0, 0.2]);
        assert!(matches!(verdict, StateVerdict::Agreed { ref kept, .. } if kept.len() == 3));
        // Fewer than two near the median, or no finite median: no verdict.
        let verdict = judge_against_median(&config, 10.0, &[20.0, 0.0, 20.0]);
        assert_eq!(verdict, StateVerdict::Split);
        let verdict = judge_against_median(&config, f64::INFINITY, &[0.0, 0.0, 0.0]);
        assert_eq!(verdict, StateVerdict::Split);
        let verdict = judge_against_median(&config, 10.0, &[f64::NAN, 0.0, f64::NAN]);
        assert_eq!(verdict, StateVerdict::Split);
    }

    #[test]
    fn two_sources_agree_or_one_of_them_lies() {
        let config = GateConfig::default();
        assert!(matches!(
            judge_pair(&config, [10.0, 9.0], 4.0),
            StateVerdict::Agreed { .. }
        ));
        assert!(
            matches!(
                judge_pair(&config, [55.0, 56.0], 60.0),
                StateVerdict::Agreed { .. }
            ),
            "two honest nodes that have not mixed yet, a norm apart"
        );
        assert_eq!(
            judge_pair(&config, [10.0, 0.01], 9.99),
            StateVerdict::Split,
            "a state near zero"
        );
        assert_eq!(
            judge_pair(&config, [10.0, 10.0], 20.0),
            StateVerdict::Split,
            "a sign flip"
        );
        assert_eq!(
            judge_pair(&config, [10.0, 10_000.0], 9_990.0),
            StateVerdict::Split,
            "× 1000"
        );
        assert_eq!(
            judge_pair(&config, [f64::INFINITY, 10.0], 0.0),
            StateVerdict::Split
        );
        assert_eq!(
            judge_pair(&config, [10.0, 10.0], f64::NAN),
            StateVerdict::Split
        );
    }

    #[test]
    fn a_momentum_longer_than_the_median_is_clipped_to_it() {
        // A slow node's short momentum is kept whole; a × 1000 one counts as the median's.
        assert_eq!(momentum_clip(&[2.0, 0.1, 2000.0]), vec![1.0, 1.0, 0.001]);
        assert_eq!(
            momentum_clip(&[3.0, 1.0]),
            vec![1.0 / 3.0, 1.0],
            "the lower median"
        );
        assert_eq!(momentum_clip(&[0.0, 0.0]), vec![1.0, 1.0], "round 0");
        assert_eq!(momentum_clip(&[1.0, f64::NAN]), vec![1.0, 0.0]);
        assert!(momentum_clip(&[]).is_empty());
    }
}
