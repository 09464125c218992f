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
//!    [`Refusal::Misaligned`];
//! 4. the functional check ([`LossReading`]): what the payload does to this node's model, not
//!    how far it lies. The trainer evaluates, on a held-out batch of its own (`[gate]
//!    check_tokens` of validation sequences, another slice each round), its model in training
//!    with the round's fragment set three ways: its own payload `x_i` (`own`), the anchor the
//!    round started from `θ_i` (`anchor`), and the pair's equal mix `(x_i + x_j) / 2`
//!    (`theirs`: what a one-peer round's outer step makes of the payload with η = 1 and no
//!    momentum, the largest weight any topology gives one neighbour). The payload is refused
//!    as [`Refusal::Harmful`] when `theirs > max(own, anchor) + [gate] max_loss_increase`.
//!    The mix, not the payload swapped in whole, is judged because an honest fragment
//!    trained beside other fragments than this node's (a fresh joiner's, a resumed node's, a
//!    slow peer's) is worse on its own in this node's model than it is in the average the
//!    round takes; the larger of the two references keeps a slow peer, whose fragment has
//!    trained less than this node's, from being refused. Garbage stays garbage at half
//!    weight.
//!
//! Distances are kept per fragment (`[outer] fragments`): each fragment has its own window of
//! accepted distances and is judged against it and against this node's own pseudo-gradient
//! *of that fragment*, so a fragment of a fifth of the model is never measured against a
//! median of other fragments' or of whole-model distances.
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
use crate::refusal::RefusalKind;
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
    /// The functional check's losses; `None` when it did not run (`check_tokens = 0`, no
    /// validation data, or a payload already found non-finite).
    pub loss: Option<LossReading>,
}

/// The functional check's three losses of this node's model in training on one held-out
/// batch, the round's fragment set to: this node's own payload `x_i`, the anchor the round
/// started from `θ_i`, and the mix `(x_i + x_j) / 2` with the neighbour's payload `x_j`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossReading {
    pub own: f64,
    pub anchor: f64,
    pub theirs: f64,
}

impl LossReading {
    /// What the mix is held against: the larger of the finite `own` and `anchor` (NaN when
    /// neither is finite: this node's own model cannot be judged by, and nothing is).
    pub fn reference(&self) -> f64 {
        match (self.own.is_finite(), self.anchor.is_finite()) {
            (true, true) => self.own.max(self.anchor),
            (true, false) => self.own,
            (false, true) => self.anchor,
            (false, false) => f64::NAN,
        }
    }

    /// `theirs − reference`: how much the payload raises the loss (∞ where its loss is not
    /// finite).
    pub fn increase(&self) -> f64 {
        if self.theirs.is_finite() {
            self.theirs - self.reference()
        } else {
            f64::INFINITY
        }
    }
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
    /// The functional check: this node's model with the payload mixed in at half weight has
    /// a loss on a held-out batch more than `[gate] max_loss_increase` over the reference.
    Harmful {
        loss: f64,
        reference: f64,
        bound: f64,
    },
}

/// How far beyond its bound a refused payload must lie to be gross: not an honest model on a
/// bad day but no model at all (see [`Refusal::is_gross`]).
pub const GROSS_FACTOR: f64 = 10.0;

impl Refusal {
    /// Whether the payload is garbage beyond doubt, so that one such offence bans its sender
    /// (`PeerStanding`): a NaN or an infinity (an honest trainer stops at a non-finite loss
    /// before it sends), a distance more than [`GROSS_FACTOR`] times the bound, or a loss
    /// increase more than [`GROSS_FACTOR`] times `max_loss_increase` (or not finite). Honest
    /// peers in the swarm tests lie within 2.2 × the distance reference (the bound is 10 ×).
    pub fn is_gross(&self) -> bool {
        match self {
            Refusal::NonFinite { .. } => true,
            Refusal::TooFar {
                distance, bound, ..
            } => !distance.is_finite() || (*bound > 0.0 && *distance > GROSS_FACTOR * bound),
            Refusal::Harmful {
                loss,
                reference,
                bound,
            } => {
                let increase = loss - reference;
                !increase.is_finite() || (*bound > 0.0 && increase > GROSS_FACTOR * bound)
            }
            Refusal::Malformed { .. } | Refusal::Misaligned { .. } => false,
        }
    }

    /// The reason's kind, for records, counters and metrics labels.
    pub fn kind(&self) -> RefusalKind {
        match self {
            Refusal::Malformed { .. } => RefusalKind::Malformed,
            Refusal::NonFinite { .. } => RefusalKind::NonFinite,
            Refusal::TooFar { .. } => RefusalKind::TooFar,
            Refusal::Misaligned { .. } => RefusalKind::Misaligned,
            Refusal::Harmful { .. } => RefusalKind::Harmful,
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
            Refusal::Harmful {
                loss,
                reference,
                bound,
            } => write!(
                f,
                "gate: harmful: this node's model with the payload mixed in at half weight has a loss of \
                 {loss:.4} on a held-out batch, more than max_loss_increase {bound} above \
                 {reference:.4} (the larger of its own and its round start's)"
            ),
        }
    }
}

impl std::error::Error for Refusal {}

/// The gate of one node: its bounds and, per model fragment, the distances it accepted
/// lately.
#[derive(Debug, Clone)]
pub struct PayloadGate {
    config: GateConfig,
    /// `accepted[f]`: fragment f's window, oldest first (one window with one fragment).
    accepted: Vec<VecDeque<f64>>,
}

impl PayloadGate {
    /// A gate for a model in `fragments` fragments (at least one window is kept).
    pub fn new(config: GateConfig, fragments: usize) -> Self {
        PayloadGate {
            config,
            accepted: vec![VecDeque::new(); fragments.max(1)],
        }
    }

    /// A gate whose windows start from `windows[f]` (oldest first; the last `median_window`
    /// finite, positive ones are kept; a missing or empty one stays empty): the windows a
    /// restarted node saved in its checkpoint, or the distances between the anchors a
    /// joiner synced from. Without them a node's only reference is its own
    /// pseudo-gradient, which after a restart (the inner optimizer's moments kept, short
    /// steps) is many times shorter than the distance to an honest neighbour — whose anchor
    /// differs from this node's by the swarm's spread (measured in the compose test: own
    /// 1.1–1.5 against neighbours at 10–15).
    pub fn with_accepted(config: GateConfig, fragments: usize, windows: Vec<Vec<f64>>) -> Self {
        let mut gate = PayloadGate::new(config, fragments);
        gate.restart_windows(windows);
        gate
    }

    /// Replaces fragment f's window with `windows[f]` (as [`Self::with_accepted`] keeps them)
    /// wherever any of them is kept; the other windows stay as they were. Returns whether any
    /// changed.
    pub fn restart_windows(&mut self, windows: Vec<Vec<f64>>) -> bool {
        let mut changed = false;
        for (window, distances) in self.accepted.iter_mut().zip(windows) {
            let kept: VecDeque<f64> = distances
                .into_iter()
                .filter(|d| d.is_finite() && *d > 0.0)
                .collect();
            if !kept.is_empty() {
                *window = kept;
                changed = true;
            }
        }
        self.trim();
        changed
    }

    /// Each fragment's accepted distances, oldest first (what a checkpoint keeps).
    pub fn accepted(&self) -> Vec<Vec<f64>> {
        self.accepted
            .iter()
            .map(|w| w.iter().copied().collect())
            .collect()
    }

    fn trim(&mut self) {
        let size = self.config.median_window.max(1) as usize;
        for window in &mut self.accepted {
            while window.len() > size {
                window.pop_front();
            }
        }
    }

    /// Fragment `fragment`'s window (the last one for an index beyond the model's).
    fn window_index(&self, fragment: usize) -> usize {
        fragment.min(self.accepted.len() - 1)
    }

    fn window(&self, fragment: usize) -> &VecDeque<f64> {
        &self.accepted[self.window_index(fragment)]
    }

    /// The (lower) median of fragment `fragment`'s accepted distances (`None` before any).
    pub fn accepted_median(&self, fragment: usize) -> Option<f64> {
        let window = self.window(fragment);
        if window.is_empty() {
            return None;
        }
        let mut sorted: Vec<f64> = window.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        // The lower median: an attacker holding half of the window cannot raise it.
        Some(sorted[(n - 1) / 2])
    }

    /// The reference distance a payload of fragment `fragment` is measured against this
    /// round: `max(‖θ_i − x_i‖, median of the fragment's accepted)`.
    pub fn reference(&self, fragment: usize, own_distance: f64) -> f64 {
        own_distance.max(self.accepted_median(fragment).unwrap_or(0.0))
    }

    /// Judges the round's payloads of fragment `fragment`, `own_distance` being this node's
    /// `‖θ_i − x_i‖` over the same fragment. Every payload is judged against the window as it
    /// stood before the round, so their order does not matter; the accepted ones then enter
    /// the fragment's window.
    pub fn judge_round(
        &mut self,
        fragment: usize,
        own_distance: f64,
        payloads: &[PayloadStats],
    ) -> Vec<Result<(), Refusal>> {
        let median = self.accepted_median(fragment);
        let verdicts: Vec<_> = payloads
            .iter()
            .map(|stats| self.judge(own_distance, median, stats))
            .collect();
        let index = self.window_index(fragment);
        let window = &mut self.accepted[index];
        for (stats, verdict) in payloads.iter().zip(&verdicts) {
            if verdict.is_ok() {
                window.push_back(stats.distance);
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
        if let Some(loss) = &stats.loss {
            self.judge_loss(loss)?;
        }
        Ok(())
    }

    /// The functional check alone: refused when the loss with the payload is not finite, or
    /// lies more than `max_loss_increase` above the reference; nothing is judged when this node's own
    /// losses are not finite (its model, not the payload, is then what is broken).
    pub fn judge_loss(&self, loss: &LossReading) -> Result<(), Refusal> {
        let reference = loss.reference();
        let bound = self.config.max_loss_increase;
        if reference.is_nan() {
            return Ok(());
        }
        // A loss that is not finite is beyond every bound, `inf` included.
        if !loss.theirs.is_finite() || loss.increase() > bound {
            return Err(Refusal::Harmful {
                loss: loss.theirs,
                reference,
                bound,
            });
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
        PayloadGate::new(GateConfig::default(), 1)
    }

    fn at(distance: f64) -> PayloadStats {
        PayloadStats {
            non_finite: None,
            distance,
            cosine: Some(0.5),
            loss: None,
        }
    }

    #[test]
    fn a_non_finite_value_is_refused_naming_the_tensor() {
        let stats = PayloadStats {
            non_finite: Some("model.norm.weight".into()),
            ..at(1.0)
        };
        let verdict = gate().judge_round(0, 1.0, &[stats]).remove(0).unwrap_err();
        assert_eq!(verdict.kind().as_str(), "non_finite");
        assert!(
            verdict.to_string().contains("model.norm.weight"),
            "{verdict}"
        );
    }

    #[test]
    fn a_model_far_beyond_the_own_pseudo_gradient_is_refused_and_an_honest_one_is_not() {
        let k = GateConfig::default().max_distance_ratio;
        let verdicts = gate().judge_round(0, 2.0, &[at(2.5), at(2.0 * k), at(2.0 * k * 1.01)]);
        assert!(verdicts[0].is_ok() && verdicts[1].is_ok());
        assert!(
            matches!(verdicts[2], Err(Refusal::TooFar { reference, .. }) if reference == 2.0),
            "{verdicts:?}"
        );
        // A NaN or infinite norm is never within a bound.
        let verdicts = gate().judge_round(0, 2.0, &[at(f64::NAN), at(f64::INFINITY)]);
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
                .judge_round(0, 3.0, &[at(3.2), at(2.9)])
                .iter()
                .all(Result::is_ok));
        }
        // Then it takes one inner step: its own distance is tiny, the median is not.
        let verdicts = g.judge_round(0, 0.01, &[at(3.1), at(3.3)]);
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
            assert!(before.judge_round(0, 1.3, &[at(d)])[0].is_ok());
        }
        let fresh = gate().judge_round(0, 1.1, &[at(12.1)]).remove(0);
        assert!(matches!(fresh, Err(Refusal::TooFar { .. })), "{fresh:?}");

        let mut restarted = PayloadGate::with_accepted(GateConfig::default(), 1, before.accepted());
        assert_eq!(restarted.accepted(), before.accepted());
        let verdicts = restarted.judge_round(0, 1.1, &[at(12.1), at(15.2), at(15.5)]);
        assert!(verdicts.iter().all(Result::is_ok), "{verdicts:?}");
        // A scaled model is refused as before.
        let scaled = restarted.judge_round(0, 1.1, &[at(1e4)]).remove(0);
        assert!(matches!(scaled, Err(Refusal::TooFar { .. })), "{scaled:?}");

        let config = GateConfig {
            median_window: 3,
            ..GateConfig::default()
        };
        let seeded = PayloadGate::with_accepted(
            config,
            1,
            vec![vec![f64::NAN, 1.0, -2.0, 0.0, 2.0, 3.0, 4.0]],
        );
        assert_eq!(
            seeded.accepted(),
            [[2.0, 3.0, 4.0]],
            "finite, positive, the newest"
        );
    }

    /// A joiner whose sources were identical (no distance among them) keeps the window it had.
    #[test]
    fn a_window_restarted_from_no_distance_stays_as_it_was() {
        let mut g = PayloadGate::with_accepted(GateConfig::default(), 1, vec![vec![4.0, 5.0]]);
        assert!(!g.restart_windows(vec![vec![0.0, 0.0, f64::NAN]]));
        assert_eq!(g.accepted(), [[4.0, 5.0]]);
        assert!(g.restart_windows(vec![vec![0.0, 7.0]]));
        assert_eq!(g.accepted(), [[7.0]]);
    }

    #[test]
    fn with_no_reference_yet_only_finiteness_and_the_cosine_are_checked() {
        let mut g = gate();
        let verdicts = g.judge_round(0, 0.0, &[at(1e6), at(f64::INFINITY), at(f64::NAN)]);
        assert!(verdicts[0].is_ok());
        assert!(matches!(verdicts[1], Err(Refusal::TooFar { .. })));
        assert!(matches!(verdicts[2], Err(Refusal::TooFar { .. })));
        assert_eq!(
            g.accepted_median(0),
            Some(1e6),
            "only the finite distance entered"
        );
    }

    #[test]
    fn half_a_window_of_attackers_does_not_raise_the_median() {
        let mut g = gate();
        g.judge_round(0, 0.0, &[at(1.0), at(1.0), at(9.0), at(9.0)]);
        assert_eq!(g.accepted_median(0), Some(1.0));
    }

    #[test]
    fn the_median_window_holds_accepted_distances_only_and_is_bounded() {
        let config = GateConfig {
            median_window: 4,
            ..GateConfig::default()
        };
        let mut g = PayloadGate::new(config, 1);
        g.judge_round(0, 1.0, &[at(1.0), at(1e9)]);
        assert_eq!(g.accepted_median(0), Some(1.0));
        for d in [2.0, 3.0, 4.0, 5.0] {
            g.judge_round(0, 10.0, &[at(d)]);
        }
        assert_eq!(g.accepted_median(0), Some(3.0));
    }

    #[test]
    fn the_cosine_floor_refuses_a_flipped_direction_when_set() {
        let flipped = PayloadStats {
            cosine: Some(-0.9),
            ..at(1.0)
        };
        assert!(gate().judge_round(0, 1.0, std::slice::from_ref(&flipped))[0].is_ok());
        let mut strict = PayloadGate::new(
            GateConfig {
                min_cosine: 0.0,
                ..GateConfig::default()
            },
            1,
        );
        let verdict = strict
            .judge_round(0, 1.0, &[flipped])
            .remove(0)
            .unwrap_err();
        assert_eq!(verdict.kind().as_str(), "misaligned");
        let nan = PayloadStats {
            cosine: Some(f64::NAN),
            ..at(1.0)
        };
        assert!(gate().judge_round(0, 1.0, std::slice::from_ref(&nan))[0].is_ok());
        assert!(
            strict.judge_round(0, 1.0, &[nan])[0].is_err(),
            "NaN is no cosine"
        );
    }

    /// The regression of the default overlap: five fragments of different sizes judged
    /// through one window. Each fragment now has its own: a fragment whose honest distances
    /// are small is not judged against a median of larger fragments', and the other way.
    #[test]
    fn each_fragment_is_judged_against_its_own_window() {
        let mut g = PayloadGate::new(GateConfig::default(), 3);
        for _ in 0..6 {
            assert!(g.judge_round(0, 1.0, &[at(1.0)])[0].is_ok());
            assert!(g.judge_round(1, 100.0, &[at(100.0)])[0].is_ok());
        }
        assert_eq!(g.accepted_median(0), Some(1.0));
        assert_eq!(g.accepted_median(1), Some(100.0));
        assert_eq!(g.accepted_median(2), None);
        // 50 is honest for fragment 1 and fifty times fragment 0's own spread: too far there.
        assert!(g.judge_round(1, 0.1, &[at(50.0)])[0].is_ok());
        let far = g.judge_round(0, 0.1, &[at(50.0)]).remove(0);
        assert!(
            matches!(far, Err(Refusal::TooFar { reference, .. }) if reference == 1.0),
            "{far:?}"
        );
        // The windows survive a checkpoint's trip, each as it was.
        let saved = g.accepted();
        let restored = PayloadGate::with_accepted(GateConfig::default(), 3, saved.clone());
        assert_eq!(restored.accepted(), saved);
        // A joiner's windows start from the spread per fragment; an empty one stays empty.
        let mut joiner = PayloadGate::new(GateConfig::default(), 3);
        assert!(joiner.restart_windows(vec![vec![2.0], vec![], vec![3.0, 4.0]]));
        assert_eq!(joiner.accepted(), [vec![2.0], vec![], vec![3.0, 4.0]]);
    }

    fn with_loss(own: f64, anchor: f64, theirs: f64) -> PayloadStats {
        PayloadStats {
            loss: Some(LossReading {
                own,
                anchor,
                theirs,
            }),
            ..at(1.0)
        }
    }

    /// A gate whose functional check refuses at 0.3 nats (off by default).
    fn bounded() -> PayloadGate {
        PayloadGate::new(
            GateConfig {
                max_loss_increase: 0.3,
                ..GateConfig::default()
            },
            1,
        )
    }

    #[test]
    fn a_payload_that_raises_the_loss_beyond_the_bound_is_harmful() {
        let bound = 0.3;
        let verdicts = bounded().judge_round(
            0,
            1.0,
            &[
                // Better than its own: an honest neighbour ahead of this node.
                with_loss(2.5, 2.6, 2.4),
                // Worse than its own but no worse than the round start: an honest slow peer.
                with_loss(2.5, 2.9, 2.8),
                // Within the bound over both.
                with_loss(2.5, 2.6, 2.6 + bound * 0.9),
                // A garbage model: 7 nats.
                with_loss(2.5, 2.6, 7.2),
                // A loss that is not finite.
                with_loss(2.5, 2.6, f64::NAN),
                with_loss(2.5, 2.6, f64::INFINITY),
            ],
        );
        assert!(verdicts[..3].iter().all(Result::is_ok), "{verdicts:?}");
        for verdict in &verdicts[3..] {
            let refusal = verdict.clone().unwrap_err();
            assert_eq!(refusal.kind().as_str(), "harmful");
            assert!(
                refusal.to_string().contains("max_loss_increase"),
                "{refusal}"
            );
        }
        assert!(
            matches!(verdicts[3], Err(Refusal::Harmful { reference, .. }) if reference == 2.6),
            "the reference is the larger of own and anchor"
        );
        // A harmful payload's distance does not enter the window.
        let mut g = bounded();
        g.judge_round(0, 1.0, &[with_loss(2.5, 2.6, 9.0)]);
        assert_eq!(g.accepted_median(0), None);
    }

    #[test]
    fn only_garbage_beyond_doubt_is_gross() {
        let too_far = |distance: f64| Refusal::TooFar {
            distance,
            bound: 10.0,
            reference: 1.0,
        };
        assert!(!too_far(11.0).is_gross(), "just beyond the bound");
        assert!(too_far(101.0).is_gross());
        assert!(too_far(f64::INFINITY).is_gross());
        assert!(Refusal::NonFinite { tensor: "t".into() }.is_gross());
        let harmful = |loss: f64| Refusal::Harmful {
            loss,
            reference: 2.0,
            bound: 0.3,
        };
        assert!(!harmful(2.5).is_gross());
        assert!(harmful(5.1).is_gross());
        assert!(harmful(f64::NAN).is_gross());
        let misaligned = Refusal::Misaligned {
            cosine: -1.0,
            floor: 0.0,
        };
        assert!(!misaligned.is_gross());
    }

    #[test]
    fn the_functional_check_judges_nothing_when_the_own_model_has_no_finite_loss_and_can_be_off() {
        assert!(bounded()
            .judge_loss(&LossReading {
                own: f64::NAN,
                anchor: f64::INFINITY,
                theirs: 9.0
            })
            .is_ok());
        assert!(
            bounded()
                .judge_loss(&LossReading {
                    own: f64::NAN,
                    anchor: 2.0,
                    theirs: 9.0
                })
                .is_err(),
            "one finite reference is enough"
        );
        let off = PayloadGate::new(
            GateConfig {
                max_loss_increase: f64::INFINITY,
                ..GateConfig::default()
            },
            1,
        );
        assert!(off
            .judge_loss(&LossReading {
                own: 2.0,
                anchor: 2.0,
                theirs: 1e9
            })
            .is_ok());
        assert!(off
            .judge_loss(&LossReading {
                own: 2.0,
                anchor: 2.0,
                theirs: f64::NAN
            })
            .is_err());
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
