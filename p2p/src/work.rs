//! [`RoundWork`]: what the round driver asks of the local trainer, whichever it is.
//!
//! The driver owns the network side of a round (commit-reveal, the exchange); the work owns
//! the model: it runs the round's inner steps within a time budget, produces the payload to
//! send, and at the end of the round mixes what arrived and takes the outer step. The
//! libtorch trainer (`gasloc-node`'s `volunteer` module) and the [`SyntheticTrainer`]
//! implement it; the network crate never sees a libtorch tensor.
//!
//! Calls return boxed futures that own what they need (`'static`), so the driver can poll
//! them next to network events; a libtorch implementation sends each call to its own
//! thread and awaits the reply.
//!
//! [`SyntheticTrainer`]: crate::synthetic::SyntheticTrainer

use crate::round_machine::PayloadBytes;
use crate::tensors::{TensorSet, TensorSpec};
use gasloc_proto::fragments::fragment_of_round;
use gasloc_proto::gate::Refusal;
use gasloc_proto::manifest::is_full_sync_round;
use gasloc_proto::topology::MixingRow;
use gasloc_proto::wire::PayloadKind;
use gasloc_status::TrainerTime;
use libp2p::PeerId;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A call's result, computed off the driver's task.
pub type WorkFuture<T> = Pin<Box<dyn Future<Output = anyhow::Result<T>> + Send>>;

/// The payloads this node sends and expects: their kind, and the table of every round's
/// payload — the same every round, one per model fragment in turn (`[outer] fragments`), or
/// (the `lordo` payload) a larger one on its full-sync rounds, which carry the sender's
/// anchor too. An incoming payload is checked against the table of its round.
#[derive(Debug, Clone)]
pub struct PayloadTables {
    pub kind: PayloadKind,
    /// The table of each fragment's payload, round r sending fragment
    /// [`fragment_of_round`]`(r, len)`: one table for whole-model payloads.
    pub by_fragment: Vec<Arc<Vec<TensorSpec>>>,
    /// `(every, table)`: the table of a round `r` with `is_full_sync_round(r, every)`.
    pub full_sync: Option<(u64, Arc<Vec<TensorSpec>>)>,
}

impl PayloadTables {
    /// A model payload: one table, every round.
    pub fn model(table: Vec<TensorSpec>) -> Self {
        Self::model_fragments(vec![table])
    }

    /// A model payload in fragments: `tables[f]` is fragment f's, sent in its rounds.
    pub fn model_fragments(tables: Vec<Vec<TensorSpec>>) -> Self {
        PayloadTables {
            kind: PayloadKind::Model,
            by_fragment: tables.into_iter().map(Arc::new).collect(),
            full_sync: None,
        }
    }

    /// The table of `round`'s payload.
    pub fn for_round(&self, round: u64) -> Arc<Vec<TensorSpec>> {
        match &self.full_sync {
            Some((every, table)) if is_full_sync_round(round, *every) => table.clone(),
            // Never empty by construction; an empty table would refuse every payload.
            _ => {
                let f = fragment_of_round(round, self.by_fragment.len());
                self.by_fragment.get(f).cloned().unwrap_or_default()
            }
        }
    }

    /// The payloads' sizes, as the round machine counts them.
    pub fn bytes(&self) -> PayloadBytes {
        let bytes = |table: &[TensorSpec]| table.iter().filter_map(|t| t.byte_length()).sum();
        PayloadBytes {
            by_fragment: self.by_fragment.iter().map(|t| bytes(t)).collect(),
            full_sync: self
                .full_sync
                .as_ref()
                .map(|(every, table)| (*every, bytes(table))),
        }
    }
}

/// What the driver asks for when a round starts.
#[derive(Debug, Clone)]
pub struct TrainOrder {
    pub round: u64,
    /// When the inner steps should be done so that the exchange still ends within the
    /// round: the round's end minus the predicted exchange time and the outer step
    /// (`docs/algorithms.md`, "Adaptive H_i"). The driver moves it once the round's neighbours are
    /// known. An adaptive trainer fits H_i to it; a fixed-H trainer ignores it.
    pub deadline: TrainDeadline,
}

/// A deadline in Unix milliseconds that one side may move while the other reads it.
#[derive(Debug, Clone, Default)]
pub struct TrainDeadline(Arc<AtomicU64>);

impl TrainDeadline {
    pub fn new(unix_ms: u64) -> Self {
        TrainDeadline(Arc::new(AtomicU64::new(unix_ms)))
    }
    pub fn set(&self, unix_ms: u64) {
        self.0.store(unix_ms, Ordering::Relaxed);
    }
    pub fn unix_ms(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
    /// Time left from `now_unix_ms` (zero once passed).
    pub fn remaining(&self, now_unix_ms: u64) -> Duration {
        Duration::from_millis(self.unix_ms().saturating_sub(now_unix_ms))
    }
}

/// What the inner steps produced.
#[derive(Debug, Clone)]
pub struct Trained {
    /// The payload every neighbour receives (it matches its round's table of
    /// [`RoundWork::payload_tables`]).
    pub payload: TensorSet,
    /// Inner steps taken (H_i).
    pub inner_steps: u64,
    /// Moving average of one inner step, seconds.
    pub step_time_s: f64,
    /// Seconds the round's inner steps took: the trainer's busy time, which
    /// `compute_utilization` counts.
    pub train_s: f64,
    /// Mean training loss over the round's steps (None for the synthetic trainer).
    pub train_loss: Option<f64>,
    /// Where the trainer's time went besides the inner steps.
    pub trainer_time: TrainerTime,
}

/// What the round's outer step mixes: the row to apply and the payloads it names.
#[derive(Debug, Clone)]
pub struct Received {
    pub round: u64,
    /// The weights to apply, `x̄_i = Σ_j w_ij x_j`: the round topology's row for this node
    /// (`mixing.worker`, its own model) with every neighbour that sent nothing usable
    /// removed and its weight placed by the topology (`Topology::missing_weight`: returned
    /// to self, or on the complete topology spread over the rest), so the row stays stochastic
    /// ([`crate::schedule::RoundPlan::mixing_row`], the simulator's function). Indices are
    /// the round's members in canonical order, so every node sums in the same order.
    pub mixing: MixingRow,
    /// The payload of every neighbour term of `mixing`, by its index.
    pub payloads: Vec<Arrived>,
    /// A joining node asked for this node's state: return it in [`Finished::state`]. It is
    /// made on request only (copying and hashing anchor and momentum every round would be
    /// work for nobody).
    pub want_state: bool,
}

/// A neighbour's payload that arrived and passed every check.
#[derive(Debug, Clone)]
pub struct Arrived {
    /// Its index in [`Received::mixing`].
    pub index: usize,
    pub peer: PeerId,
    pub tensors: TensorSet,
}

/// A neighbour's payload that passed the exchange's checks, on its way through the
/// payload gate ([`RoundWork::screen`]).
#[derive(Debug, Clone)]
pub struct Candidate {
    pub peer: PeerId,
    pub tensors: TensorSet,
}

/// The gate's verdict on a [`Candidate`], which it hands back (moved, not copied).
#[derive(Debug, Clone)]
pub struct Screened {
    pub candidate: Candidate,
    pub verdict: Result<(), Refusal>,
    /// What the gate measured (`None` when nothing was: the payload did not decode, or the
    /// trainer checks nothing).
    pub reading: Option<GateReading>,
}

/// The payload gate's numbers for one payload, as the round record keeps them.
pub use gasloc_status::GateReading;

/// The state after the round's outer step.
#[derive(Debug, Clone)]
pub struct Finished {
    /// Anchor and outer momentum, as state sync serves them to joining nodes, when
    /// [`Received::want_state`] asked for them.
    pub state: Option<TensorSet>,
    /// Validation loss of the new anchor, when it was evaluated this round.
    pub val_loss: Option<f64>,
}

/// The local trainer as the round driver sees it.
pub trait RoundWork: Send + Sync {
    /// The kind and tables of the payloads (incoming payloads are checked against them).
    fn payload_tables(&self) -> PayloadTables;
    /// The table of the state that state sync moves.
    fn state_table(&self) -> Vec<TensorSpec>;
    /// Runs the round's inner steps.
    fn train(&mut self, order: TrainOrder) -> WorkFuture<Trained>;
    /// The payload gate (`gasloc_proto::gate`): checks the values of the round's payloads
    /// that passed the exchange, before any is mixed, and returns one verdict per
    /// candidate. A refused payload is mixed as missing. Called after each round's exchange
    /// (a round without neighbours has none) and before [`Self::finish`]. The default accepts every
    /// payload: for a trainer whose payload is no model (the synthetic trainer's random bytes).
    fn screen(&mut self, _round: u64, candidates: Vec<Candidate>) -> WorkFuture<Vec<Screened>> {
        Box::pin(async move {
            Ok(candidates
                .into_iter()
                .map(|candidate| Screened {
                    candidate,
                    verdict: Ok(()),
                    reading: None,
                })
                .collect())
        })
    }
    /// Mixes this node's model with what arrived and applies the outer step.
    fn finish(&mut self, received: Received) -> WorkFuture<Finished>;
    /// Replaces the state with one fetched from live peers (late join); `round` is the
    /// round it was published for, `spread` the distances of the sources' anchors from it
    /// ([`SyncedState::spread`](crate::swarm_node::SyncedState::spread)): where the payload
    /// gate's windows of accepted distances start.
    fn load_state(&mut self, round: u64, state: TensorSet, spread: AnchorSpread) -> WorkFuture<()>;
    /// Leaving the swarm: persist what a restart needs (a checkpoint of the last anchor).
    fn close(&mut self) -> WorkFuture<()>;
}

/// How far each kept source's anchor lies from the state a joiner starts from, tensor by
/// tensor: `by_source[s][k] = ‖θ_s,k − θ_start,k‖` over the k-th anchor tensor (the state's
/// anchor tensors in order, so the model's parameters in order).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AnchorSpread {
    pub by_source: Vec<Vec<f64>>,
}

impl AnchorSpread {
    /// Each source's distance over the tensors `members` (indices among the anchor's).
    pub fn over(&self, members: &[usize]) -> Vec<f64> {
        self.by_source
            .iter()
            .map(|d| {
                members
                    .iter()
                    .filter_map(|&k| d.get(k))
                    .map(|x| x * x)
                    .sum::<f64>()
                    .sqrt()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gasloc_proto::wire::DType;

    fn spec(name: &str, elements: u64) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype: DType::Bf16,
            shape: vec![elements],
        }
    }

    #[test]
    fn a_lordo_payload_carries_the_anchor_table_and_its_bytes_on_full_sync_rounds_only() {
        let every_round = vec![spec("w.lordo_u", 10), spec("w.lordo_svt", 6)];
        let mut full = every_round.clone();
        full.push(spec("anchor.w", 100));
        let tables = PayloadTables {
            kind: PayloadKind::Lordo,
            by_fragment: vec![Arc::new(every_round)],
            full_sync: Some((4, Arc::new(full))),
        };
        let bytes = tables.bytes();
        for round in 0..9 {
            let (names, expected) = match round % 4 == 0 {
                true => (3, 232),
                false => (2, 32),
            };
            assert_eq!(tables.for_round(round).len(), names, "round {round}");
            assert_eq!(bytes.of_round(round), expected, "round {round}");
        }
        let model = PayloadTables::model(vec![spec("w", 100)]);
        assert_eq!(model.bytes(), PayloadBytes::fixed(200));
        assert_eq!(model.for_round(4).len(), 1);
    }

    #[test]
    fn a_fragmented_model_payload_sends_each_fragment_in_turn() {
        let tables = PayloadTables::model_fragments(vec![
            vec![spec("a", 10), spec("c", 5)],
            vec![spec("b", 12)],
        ]);
        let bytes = tables.bytes();
        for (round, first, expected) in [(0, "a", 30), (1, "b", 24), (2, "a", 30), (3, "b", 24)] {
            assert_eq!(tables.for_round(round)[0].name, first, "round {round}");
            assert_eq!(bytes.of_round(round), expected, "round {round}");
        }
    }
}
