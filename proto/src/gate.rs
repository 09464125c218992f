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
}
