//! Overlapped rounds on named tensors: what a worker does when a round's exchange runs beside
//! the next round's inner steps (`[outer] overlap`, `docs/algorithms.md` "Overlapped rounds").
//! The simulator and the networked node both drive a worker's [`OverlappedOuter`]; with
//! `overlap = "none"` neither does and a round blocks as before.
//!
//! Round t starts from the worker's anchor `θ_t` and ends its inner steps with the local model
//! `x_t`, which it hands to the exchange ([`OverlappedOuter::hand_off`]). The next round's inner
//! steps start at once. What happens to the outer step depends on the mode:
//!
//! * **`delayed`** (Psyche, PCCL's async DiLoCo, DiLoCoX): nothing changes at the hand-off; the
//!   inner steps go on from `x_t`. When the exchange ends ([`OverlappedOuter::arrived`], then
//!   [`OverlappedOuter::apply`]) the round's outer step is taken exactly as a blocking round
//!   takes it, `θ_{t+1} = θ_t − η·Nesterov(Δ_t)` with `Δ_t = Σ_j w_ij (θ_t − x_t^j)`
//!   ([`mixed_pseudo_gradient`]), and the local progress made since the hand-off is carried
//!   onto the new anchor: `x ← θ_{t+1} + (x − x_t)` ([`carry_progress`]). No inner step is
//!   lost. When the exchange ends before the first inner step of round t+1, `x = x_t` and the
//!   carry gives `θ_{t+1}` bit for bit: a blocking round.
//! * **`eager`** (the idea of arXiv 2502.12996, adapted to gossip): at the hand-off the worker
//!   takes the whole outer step at once with its own fresh pseudo-gradient standing in for
//!   every neighbour's, `θ' = OuterStep(θ_t, θ_t − x_t)` ([`own_term`]), and round t+1 trains
//!   from `θ'`. When the exchange ends, the difference the neighbours make,
//!   `L_t = Σ_{j≠i} w'_ij (x_t − x_t^j)` (the row as applied: a neighbour that sent nothing
//!   usable is not in the sum, its weight placed by the topology; [`late_term`]), is added
//!   to that same outer step ([`OuterOptimizer::add_to_last_step`]). The two parts sum to the
//!   blocking round's pseudo-gradient exactly, because the row's weights sum to one:
//!   `(θ_t − x_t) + Σ_{j≠i} w'_ij (x_t − x_t^j) = Σ_j w'_ij (θ_t − x_t^j) = Δ_t`; the step is
//!   affine in its pseudo-gradient, so the anchor and momentum are the blocking round's up to
//!   rounding, and the progress made since the hand-off is carried onto them. With no
//!   neighbour `L = 0`: a blocking round bit for bit.
//!
//!   The paper applies the others' terms of round t−1 inside round t's step; in gossip a
//!   neighbour's term also carries the disagreement `θ_i − θ_j`, so it is added as soon as it
//!   arrives. The own step needs nothing from the round's mixing row, so it is taken whether
//!   or not the round was decided when the inner steps ended (`docs/algorithms.md`,
//!   "Overlapped rounds", which also gives the measurements against the earlier rule that
//!   stepped with the self weight `w_ii (θ_t − x_t)` alone).
//!
//! A pending exchange that will never be applied (the node stops with one in flight) is
//! dropped with [`OverlappedOuter::drop_pending`], which takes eager's own step back: the
//! worker is left as it was before the hand-off, ready to redo the round.
//!
//! At most one exchange is pending: a worker whose next round ends before its pending exchange
//! does waits for it (the caller's business) before it hands off again.

use crate::algo::copies;
use crate::algo::outer::{mixed_pseudo_gradient, sum_then_divide, OuterOptimizer};
use gasloc_proto::manifest::Overlap;
use gasloc_proto::topology::MixingRow;
use tch::Tensor;

/// `θ_new + (x − x_handed)`, tensor by tensor: the inner steps taken since `x_handed` was
/// handed to the exchange, carried onto the new anchor. When no step was taken (`x` equals
/// `x_handed`) the result is `θ_new` exactly.
pub fn carry_progress(
    local: &[Tensor],
    handed_off: &[Tensor],
    new_anchor: &[Tensor],
) -> Vec<Tensor> {
    let _guard = tch::no_grad_guard();
    local
        .iter()
        .zip(handed_off)
        .zip(new_anchor)
        .map(|((x, h), a)| a + (x - h))
        .collect()
}

/// Eager's part applied at once: the worker's own pseudo-gradient `θ − x_i`, tensor by tensor,
/// standing in for the whole mix.
pub fn own_term(anchor: &[Tensor], own: &[Tensor]) -> Vec<Tensor> {
    let _guard = tch::no_grad_guard();
    anchor.iter().zip(own).map(|(theta, x)| theta - x).collect()
}

/// Eager's part added when the exchange ends: `Σ_{j≠i} w_ij (x_i − x_j)` over the neighbours
/// of `applied` (the row after the exchange, a neighbour that sent nothing usable dropped and
/// its weight placed by the topology's `MissingWeight`), the difference between the blocking
/// round's mix and the own pseudo-gradient [`own_term`] already applied. `None` when there is
/// no neighbour. `own` is the worker's handed-off model `x_i`, `received(j)` neighbour j's
/// decoded local model.
pub fn late_term<'a>(
    applied: &MixingRow,
    own: &[Tensor],
    received: impl Fn(usize) -> &'a [Tensor],
) -> Option<Vec<Tensor>> {
    let terms: Vec<(usize, u32)> = applied
        .terms
        .iter()
        .copied()
        .filter(|&(j, c)| j != applied.worker && c > 0)
        .collect();
    if terms.is_empty() {
        return None;
    }
    let _guard = tch::no_grad_guard();
    Some(
        own.iter()
            .enumerate()
            .map(|(p, x_i)| {
                let summands = terms.iter().map(|&(j, count)| {
                    let d = x_i - &received(j)[p];
                    if count == 1 {
                        d
                    } else {
                        d * count as f64
                    }
                });
                sum_then_divide(summands, applied.denominator)
            })
            .collect(),
    )
}

/// The round whose exchange is under way.
struct Pending {
    round: u64,
    /// `θ_t`, the anchor round t started from.
    anchor: Vec<Tensor>,
    /// `x_t`, the local model handed to the exchange (and, with delayed, what the next
    /// round trains on from; eager's next round trains from the anchor after its own step,
    /// which the anchor still is when the exchange is applied).
    handed_off: Vec<Tensor>,
    /// Eager's own step at the hand-off: the outer optimizer as it was before it (to take
    /// the step back when the exchange is dropped). `None` with delayed, which takes none.
    outer_before_own_step: Option<OuterOptimizer>,
    /// What the exchange gave, once it arrived: `Δ_t` (delayed) or `L_t` (eager).
    arrived: Option<Option<Vec<Tensor>>>,
}

/// One worker's outer step when rounds overlap: its pending exchange. The anchor and the
/// outer optimizer stay the caller's; every method takes them.
pub struct OverlappedOuter {
    mode: Overlap,
    pending: Option<Pending>,
}

/// What a call changed for the caller's trainer.
#[derive(Debug)]
pub enum LocalModel {
    /// Keep training from where it is.
    Unchanged,
    /// Continue from these values (set them as the trainer's parameters).
    Replace(Vec<Tensor>),
}

/// A call that does not fit the worker's state (a caller's bug, reported, never a panic).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OverlapError {
    #[error("overlap = \"none\" has no overlapped outer step")]
    NotOverlapped,
    #[error("round {handing} handed off while round {pending}'s exchange is still pending")]
    StillPending { handing: u64, pending: u64 },
    #[error("round {0}'s exchange is not the one pending")]
    NotPending(u64),
    #[error("round {0}'s exchange has not arrived yet")]
    NotArrived(u64),
}

impl OverlappedOuter {
    pub fn new(mode: Overlap) -> Result<Self, OverlapError> {
        if mode == Overlap::None {
            return Err(OverlapError::NotOverlapped);
        }
        Ok(OverlappedOuter {
            mode,
            pending: None,
        })
    }

    pub fn mode(&self) -> Overlap {
        self.mode
    }

    /// The round whose exchange is under way, if any.
    pub fn pending_round(&self) -> Option<u64> {
        self.pending.as_ref().map(|p| p.round)
    }

    /// The anchor the pending round started from (`θ_t`), if any: what the payload gate
    /// measures the received models from (eager's anchor has moved by its own step since).
    pub fn pending_anchor(&self) -> Option<&[Tensor]> {
        self.pending.as_ref().map(|p| &p.anchor[..])
    }

    /// The local model handed to the pending exchange (`x_t`), if any: the worker's own
    /// payload, which the payload gate measures the received ones against.
    pub fn handed_off(&self) -> Option<&[Tensor]> {
        self.pending.as_ref().map(|p| &p.handed_off[..])
    }

    /// Round `round`'s inner steps ended with `local` (`x_t`), handed to the exchange. Eager
    /// takes its own outer step here and returns the new anchor as the local model; delayed
    /// changes nothing, and the whole step waits for the exchange.
    pub fn hand_off(
        &mut self,
        round: u64,
        anchor: &mut [Tensor],
        outer: &mut OuterOptimizer,
        local: &[Tensor],
    ) -> Result<LocalModel, OverlapError> {
        if let Some(p) = &self.pending {
            return Err(OverlapError::StillPending {
                handing: round,
                pending: p.round,
            });
        }
        let handed_off = copies(local);
        let theta = copies(anchor);
        let (outer_before_own_step, changed) = match self.mode {
            Overlap::None => return Err(OverlapError::NotOverlapped),
            Overlap::Eager => {
                let before = outer.snapshot();
                outer.step(anchor, &own_term(anchor, &handed_off));
                (Some(before), LocalModel::Replace(copies(anchor)))
            }
            Overlap::Delayed => (None, LocalModel::Unchanged),
        };
        self.pending = Some(Pending {
            round,
            anchor: theta,
            handed_off,
            outer_before_own_step,
            arrived: None,
        });
        Ok(changed)
    }

    /// Round `round`'s exchange ended: `applied` is its row (a neighbour that sent nothing
    /// usable removed), `received(j)` neighbour j's decoded local model. Computes what the
    /// exchange gives (`Δ_t`, or `L_t` after eager's own step); [`Self::apply`] takes it into
    /// the anchor.
    pub fn arrived<'a>(
        &mut self,
        round: u64,
        applied: &MixingRow,
        received: impl Fn(usize) -> &'a [Tensor],
    ) -> Result<(), OverlapError> {
        let p = self
            .pending
            .as_mut()
            .filter(|p| p.round == round)
            .ok_or(OverlapError::NotPending(round))?;
        let (theta, handed) = (&p.anchor, &p.handed_off);
        let gives = match &p.outer_before_own_step {
            None => {
                let own = applied.worker;
                let model = |j: usize| -> &[Tensor] {
                    if j == own {
                        handed
                    } else {
                        received(j)
                    }
                };
                Some(mixed_pseudo_gradient(applied, theta, model))
            }
            Some(_) => late_term(applied, handed, received),
        };
        p.arrived = Some(gives);
        Ok(())
    }

    /// Takes the arrived exchange into the worker: delayed steps the anchor with `Δ_t`, eager
    /// adds `L_t` to its own step; either carries `local`'s progress onto the new anchor (the returned local model).
    pub fn apply(
        &mut self,
        anchor: &mut [Tensor],
        outer: &mut OuterOptimizer,
        local: &[Tensor],
    ) -> Result<LocalModel, OverlapError> {
        let Some(p) = self.pending.take() else {
            return Ok(LocalModel::Unchanged);
        };
        let Some(gives) = p.arrived else {
            let round = p.round;
            self.pending = Some(p);
            return Err(OverlapError::NotArrived(round));
        };
        let Some(gives) = gives else {
            // Eager without a neighbour: its own step was the whole outer step.
            return Ok(LocalModel::Unchanged);
        };
        // The progress carried is the local model less what the next round trained from.
        let carried = match p.outer_before_own_step {
            None => {
                outer.step(anchor, &gives);
                carry_progress(local, &p.handed_off, anchor)
            }
            Some(_) => {
                let trained_from = copies(anchor);
                outer.add_to_last_step(anchor, &gives);
                carry_progress(local, &trained_from, anchor)
            }
        };
        Ok(LocalModel::Replace(carried))
    }

    /// The anchor as the worker would hold it once the pending exchange is applied: delayed's
    /// outer step, or eager's neighbours' terms added to its own. Needs the pending exchange
    /// arrived. Leaves `anchor` and `outer` as they are.
    pub fn settled_anchor(
        &self,
        anchor: &[Tensor],
        outer: &OuterOptimizer,
    ) -> Result<Vec<Tensor>, OverlapError> {
        let mut settled = copies(anchor);
        let mut outer = outer.snapshot();
        let Some(p) = &self.pending else {
            return Ok(settled);
        };
        match (&p.arrived, &p.outer_before_own_step) {
            (None, _) => return Err(OverlapError::NotArrived(p.round)),
            (Some(None), _) => {}
            (Some(Some(delta)), None) => outer.step(&mut settled, delta),
            (Some(Some(late)), Some(_)) => outer.add_to_last_step(&mut settled, late),
        }
        Ok(settled)
    }

    /// Drops the pending exchange, if any, without applying it: eager's own step is taken
    /// back, so `anchor` and `outer` are again what round `t` started from, and `t` (returned)
    /// is the round to redo. The caller resets its trainer to the anchor.
    pub fn drop_pending(
        &mut self,
        anchor: &mut [Tensor],
        outer: &mut OuterOptimizer,
    ) -> Option<u64> {
        let p = self.pending.take()?;
        if let Some(before) = p.outer_before_own_step {
            let _guard = tch::no_grad_guard();
            for (a, theta) in anchor.iter_mut().zip(&p.anchor) {
                a.copy_(theta);
            }
            // In place: `outer` may be a fragment's view of the worker's optimizer.
            outer.set_momentum(before.momentum());
        }
        Some(p.round)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gasloc_proto::manifest::OuterConfig;
    use gasloc_proto::topology::MissingWeight;
    use gasloc_proto::RunManifest;
    use tch::{Kind, Tensor};

    fn outer_config() -> OuterConfig {
        let text = "name = \"t\"\nseed = 1\n[model]\nsize = \"tiny\"\n[data]\ntokenizer = \"byte\"\nseq_len = 8\nmicro_batch = 1\n[optimizer]\ndecay_steps = 10\n";
        RunManifest::parse(text, "t").unwrap().outer
    }

    fn model(seed: i64) -> Vec<Tensor> {
        tch::manual_seed(seed);
        vec![
            Tensor::randn([4, 3], (Kind::Float, tch::Device::Cpu)),
            Tensor::randn([5], (Kind::Float, tch::Device::Cpu)),
        ]
    }

    fn same(a: &[Tensor], b: &[Tensor]) -> bool {
        a.iter().zip(b).all(|(x, y)| x.equal(y))
    }

    /// A blocking round: mix, outer step; the local model becomes the anchor.
    fn blocking(
        row: &MixingRow,
        anchor: &mut [Tensor],
        outer: &mut OuterOptimizer,
        models: &[Vec<Tensor>],
    ) {
        let delta = mixed_pseudo_gradient(row, anchor, |j| &models[j]);
        outer.step(anchor, &delta);
    }

    #[test]
    fn delayed_with_an_exchange_that_ends_before_the_next_step_is_a_blocking_round_bit_for_bit() {
        let config = outer_config();
        let start = model(1);
        let models = [model(2), model(3), model(4)];
        let row = MixingRow::uniform(0, &[1, 2]).without(&[2], MissingWeight::ToSelf);
        let (mut a_block, mut a_over) = (copies(&start), copies(&start));
        let mut o_block = OuterOptimizer::new(&config, &start);
        let mut o_over = OuterOptimizer::new(&config, &start);
        let mut overlap = OverlappedOuter::new(Overlap::Delayed).unwrap();
        for round in 0..3 {
            blocking(&row, &mut a_block, &mut o_block, &models);
            let handed = &models[0];
            let kept = overlap
                .hand_off(round, &mut a_over, &mut o_over, handed)
                .unwrap();
            assert!(matches!(kept, LocalModel::Unchanged));
            overlap.arrived(round, &row, |j| &models[j]).unwrap();
            let LocalModel::Replace(local) =
                overlap.apply(&mut a_over, &mut o_over, handed).unwrap()
            else {
                panic!("delayed replaces the local model");
            };
            assert!(same(&a_block, &a_over), "round {round}: anchors differ");
            assert!(
                same(&local, &a_over),
                "round {round}: no step taken, the local model is the anchor"
            );
        }
        assert!(same(o_block.momentum(), o_over.momentum()));
    }

    #[test]
    fn delayed_carries_the_steps_taken_during_the_exchange_onto_the_new_anchor() {
        let config = outer_config();
        let mut anchor = model(1);
        let mut outer = OuterOptimizer::new(&config, &anchor);
        let handed = model(2);
        let progress = model(5);
        let local: Vec<Tensor> = handed.iter().zip(&progress).map(|(h, p)| h + p).collect();
        let mut overlap = OverlappedOuter::new(Overlap::Delayed).unwrap();
        let row = MixingRow::uniform(0, &[1]);
        overlap
            .hand_off(7, &mut anchor, &mut outer, &handed)
            .unwrap();
        let neighbour = model(3);
        overlap.arrived(7, &row, |_| &neighbour).unwrap();
        let LocalModel::Replace(carried) = overlap.apply(&mut anchor, &mut outer, &local).unwrap()
        else {
            panic!("delayed replaces the local model");
        };
        for ((c, a), p) in carried.iter().zip(&anchor).zip(&progress) {
            let gap = (c - a - p).abs().max().double_value(&[]);
            assert!(gap < 1e-5, "carried progress off by {gap}");
        }
        assert_eq!(overlap.pending_round(), None);
    }

    #[test]
    fn eager_own_step_plus_the_neighbours_late_terms_is_the_blocking_outer_step() {
        // Nesterov with μ = 0.9 over three rounds, a neighbour failing in the second (its
        // weight returned to self) and in the third (its weight spread over the rest, as on
        // the complete topology): after each exchange the anchor and momentum are the blocking
        // round's (up to rounding), and the steps taken since the hand-off are carried onto
        // the anchor.
        let config = outer_config();
        let start = model(1);
        let nominal = MixingRow::uniform(0, &[1, 2]);
        let models = [model(2), model(3), model(4)];
        let progress = model(5);
        let (mut a_block, mut a_over) = (copies(&start), copies(&start));
        let mut o_block = OuterOptimizer::new(&config, &start);
        let mut o_over = OuterOptimizer::new(&config, &start);
        let mut overlap = OverlappedOuter::new(Overlap::Eager).unwrap();
        let close = |a: &[Tensor], b: &[Tensor]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs().max().double_value(&[]))
                .fold(0.0, f64::max)
        };
        for round in 0..3 {
            let applied = match round {
                1 => nominal.without(&[2], MissingWeight::ToSelf),
                2 => nominal.without(&[2], MissingWeight::OverThePresent),
                _ => nominal.clone(),
            };
            let round_anchor = copies(&a_over);
            blocking(&applied, &mut a_block, &mut o_block, &models);
            let LocalModel::Replace(trains_from) = overlap
                .hand_off(round, &mut a_over, &mut o_over, &models[0])
                .unwrap()
            else {
                panic!("eager replaces the local model");
            };
            assert!(
                same(&trains_from, &a_over),
                "the next round trains from the own step"
            );
            assert!(
                same(overlap.pending_anchor().unwrap(), &round_anchor)
                    && !same(&round_anchor, &a_over),
                "the payload gate measures from the anchor the round started from, not the \
                 own step's"
            );
            let local: Vec<Tensor> = trains_from
                .iter()
                .zip(&progress)
                .map(|(t, p)| t + p)
                .collect();
            overlap.arrived(round, &applied, |j| &models[j]).unwrap();
            let settled = overlap.settled_anchor(&a_over, &o_over).unwrap();
            let LocalModel::Replace(carried) =
                overlap.apply(&mut a_over, &mut o_over, &local).unwrap()
            else {
                panic!("the neighbours' terms move the anchor");
            };
            assert!(
                same(&settled, &a_over),
                "settled_anchor looks ahead exactly"
            );
            let gap = close(&a_block, &a_over);
            assert!(
                gap < 1e-5,
                "round {round}: anchor off the blocking one by {gap}"
            );
            let gap = close(o_block.momentum(), o_over.momentum());
            assert!(gap < 1e-5, "round {round}: momentum off by {gap}");
            let moved: Vec<Tensor> = a_over.iter().zip(&progress).map(|(a, p)| a + p).collect();
            let gap = close(&carried, &moved);
            assert!(gap < 1e-5, "round {round}: progress carried off by {gap}");
            // The next round starts from the blocking anchor (the inner steps here are the
            // test's models, not trained from it).
            for (a, b) in a_over.iter_mut().zip(&a_block) {
                a.copy_(b);
            }
        }
    }

    #[test]
    fn eager_without_a_neighbour_is_a_blocking_round_bit_for_bit() {
        let config = outer_config();
        let start = model(1);
        let models = [model(2)];
        let alone = MixingRow::uniform(0, &[]);
        let (mut a_block, mut a_over) = (copies(&start), copies(&start));
        let mut o_block = OuterOptimizer::new(&config, &start);
        let mut o_over = OuterOptimizer::new(&config, &start);
        let mut overlap = OverlappedOuter::new(Overlap::Eager).unwrap();
        for round in 0..3 {
            blocking(&alone, &mut a_block, &mut o_block, &models);
            overlap
                .hand_off(round, &mut a_over, &mut o_over, &models[0])
                .unwrap();
            overlap.arrived(round, &alone, |j| &models[j]).unwrap();
            overlap.apply(&mut a_over, &mut o_over, &models[0]).unwrap();
            assert!(same(&a_block, &a_over), "round {round}");
        }
    }

    #[test]
    fn eager_hands_off_with_the_whole_outer_step_on_its_own_pseudo_gradient() {
        // The own step stands the worker's pseudo-gradient in for the whole mix: the anchor
        // after the hand-off is one outer step with θ − x, whatever the round's row will be.
        let config = outer_config();
        let start = model(1);
        let handed = model(2);
        let mut expected = copies(&start);
        let mut o_expected = OuterOptimizer::new(&config, &start);
        let delta: Vec<Tensor> = start.iter().zip(&handed).map(|(a, x)| a - x).collect();
        o_expected.step(&mut expected, &delta);
        let mut anchor = copies(&start);
        let mut outer = OuterOptimizer::new(&config, &start);
        let mut overlap = OverlappedOuter::new(Overlap::Eager).unwrap();
        let LocalModel::Replace(trains_from) = overlap
            .hand_off(4, &mut anchor, &mut outer, &handed)
            .unwrap()
        else {
            panic!("eager replaces the local model");
        };
        assert!(same(&anchor, &expected) && same(&trains_from, &expected));
        assert!(same(outer.momentum(), o_expected.momentum()));
        assert!(same(overlap.pending_anchor().unwrap(), &start));
    }

    #[test]
    fn a_dropped_exchange_leaves_the_worker_as_before_the_hand_off() {
        // Eager's own step is taken back bit for bit; delayed had taken none.
        let config = outer_config();
        let start = model(1);
        let row = MixingRow::uniform(0, &[1]);
        for mode in [Overlap::Delayed, Overlap::Eager] {
            let mut anchor = copies(&start);
            let mut outer = OuterOptimizer::new(&config, &start);
            // A round first, so that the momentum is not zero.
            let mut overlap = OverlappedOuter::new(mode).unwrap();
            overlap
                .hand_off(0, &mut anchor, &mut outer, &model(2))
                .unwrap();
            overlap.arrived(0, &row, |_| &start).unwrap();
            overlap.apply(&mut anchor, &mut outer, &model(2)).unwrap();
            let (anchor_before, outer_before) = (copies(&anchor), outer.snapshot());
            overlap
                .hand_off(1, &mut anchor, &mut outer, &model(3))
                .unwrap();
            assert_eq!(overlap.drop_pending(&mut anchor, &mut outer), Some(1));
            assert!(same(&anchor, &anchor_before), "{mode:?}: anchor");
            assert!(
                same(outer.momentum(), outer_before.momentum()),
                "{mode:?}: momentum"
            );
            assert_eq!(overlap.pending_round(), None);
            assert_eq!(overlap.drop_pending(&mut anchor, &mut outer), None);
        }
    }

    /// Through a fragment's views (`fragment_of`, `OuterOptimizer::fragment`, as the
    /// simulator and the node pass them with `[outer] fragments`): eager's own step moves
    /// only the fragment's anchor and momentum in the worker's whole lists, and dropping the
    /// exchange restores them there bit for bit.
    #[test]
    fn eager_through_a_fragment_view_steps_and_drops_only_the_fragment() {
        use crate::algo::outer::fragment_of;
        let config = outer_config();
        let start = model(1);
        let members = [1usize];
        let mut anchor = copies(&start);
        let mut outer = OuterOptimizer::new(&config, &start);
        // A first step of the whole model, so that every momentum buffer is non-zero.
        outer.step(&mut anchor, &model(4));
        let (anchor_before, outer_before) = (copies(&anchor), outer.snapshot());
        let mut overlap = OverlappedOuter::new(Overlap::Eager).unwrap();
        let local = fragment_of(&model(3), &members);
        overlap
            .hand_off(
                7,
                &mut fragment_of(&anchor, &members),
                &mut outer.fragment(&members),
                &local,
            )
            .unwrap();
        assert!(anchor[0].equal(&anchor_before[0]), "outside the fragment");
        assert!(outer.momentum()[0].equal(&outer_before.momentum()[0]));
        assert!(
            !anchor[1].equal(&anchor_before[1]),
            "the fragment's own step"
        );
        assert!(!outer.momentum()[1].equal(&outer_before.momentum()[1]));
        let dropped = overlap.drop_pending(
            &mut fragment_of(&anchor, &members),
            &mut outer.fragment(&members),
        );
        assert_eq!(dropped, Some(7));
        assert!(same(&anchor, &anchor_before), "anchor restored");
        assert!(
            same(outer.momentum(), outer_before.momentum()),
            "momentum restored"
        );
    }

    #[test]
    fn calls_out_of_order_are_errors_not_panics() {
        let config = outer_config();
        let mut anchor = model(1);
        let mut outer = OuterOptimizer::new(&config, &anchor);
        let row = MixingRow::uniform(0, &[1]);
        let local = model(2);
        assert_eq!(
            OverlappedOuter::new(Overlap::None).err(),
            Some(OverlapError::NotOverlapped)
        );
        let mut overlap = OverlappedOuter::new(Overlap::Delayed).unwrap();
        assert_eq!(
            overlap.arrived(3, &row, |_| &local).err(),
            Some(OverlapError::NotPending(3))
        );
        overlap
            .hand_off(3, &mut anchor, &mut outer, &local)
            .unwrap();
        assert_eq!(
            overlap.hand_off(4, &mut anchor, &mut outer, &local).err(),
            Some(OverlapError::StillPending {
                handing: 4,
                pending: 3
            })
        );
        assert_eq!(
            overlap.apply(&mut anchor, &mut outer, &local).err(),
            Some(OverlapError::NotArrived(3))
        );
        assert_eq!(
            overlap.pending_round(),
            Some(3),
            "a refused apply keeps the exchange pending"
        );
        assert_eq!(
            overlap.settled_anchor(&anchor, &outer).err(),
            Some(OverlapError::NotArrived(3))
        );
    }
}
