//! The **synthetic trainer**: a stand-in for the libtorch trainer in network tests and
//! scale runs. It "trains" by sleeping a configurable step time per inner step and emits a
//! fixed-size pseudo-random payload; it learns nothing. Its "state" for state sync is the
//! payload of the round it last finished.

use crate::tensors::{TensorSet, TensorSpec};
use crate::work::{
    AnchorSpread, Finished, PayloadTables, Received, RoundWork, TrainOrder, Trained, WorkFuture,
};
use libp2p::PeerId;
use sha2::{Digest, Sha256};
use std::time::Duration;

/// Settings of the synthetic trainer.
#[derive(Debug, Clone)]
pub struct SyntheticTrainer {
    /// Whose payloads these are (seeds the bytes).
    pub peer: PeerId,
    /// Bytes of each round's payload (split over `tensors` f32 tensors).
    pub payload_bytes: usize,
    pub tensors: usize,
    pub inner_steps: u32,
    pub step_time: Duration,
}

impl SyntheticTrainer {
    pub fn new(
        peer: PeerId,
        payload_bytes: usize,
        tensors: usize,
        inner_steps: u32,
        step_time: Duration,
    ) -> Self {
        SyntheticTrainer {
            peer,
            payload_bytes,
            tensors,
            inner_steps,
            step_time,
        }
    }

    fn bytes_each(&self) -> usize {
        (self.payload_bytes / self.tensors.max(1)) / 4 * 4
    }

    /// The table every synthetic payload has (receivers check it).
    pub fn table(&self) -> Vec<TensorSpec> {
        TensorSet::synthetic(self.tensors.max(1), 0, 0)
            .tensors
            .into_iter()
            .map(|t| TensorSpec {
                shape: vec![(self.bytes_each() / 4) as u64],
                ..t.spec()
            })
            .collect()
    }

    /// Sleeps the round's inner steps and returns this node's payload for `round`.
    pub async fn train_round(&self, round: u64) -> TensorSet {
        tokio::time::sleep(self.step_time * self.inner_steps).await;
        self.payload(round).await
    }

    async fn payload(&self, round: u64) -> TensorSet {
        let digest = Sha256::new()
            .chain_update(self.peer.to_bytes())
            .chain_update(round.to_le_bytes())
            .finalize();
        let seed = u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"));
        let (tensors, bytes_each) = (self.tensors.max(1), self.bytes_each());
        tokio::task::spawn_blocking(move || TensorSet::synthetic(tensors, bytes_each, seed))
            .await
            .expect("synthetic payload generation does not panic")
    }
}

impl RoundWork for SyntheticTrainer {
    fn payload_tables(&self) -> PayloadTables {
        PayloadTables::model(self.table())
    }

    fn state_table(&self) -> Vec<TensorSpec> {
        self.table()
    }

    fn train(&mut self, order: TrainOrder) -> WorkFuture<Trained> {
        let this = self.clone();
        Box::pin(async move {
            let began = std::time::Instant::now();
            let payload = this.train_round(order.round).await;
            Ok(Trained {
                payload,
                inner_steps: this.inner_steps as u64,
                step_time_s: this.step_time.as_secs_f64(),
                train_s: began.elapsed().as_secs_f64(),
                train_loss: None,
                trainer_time: Default::default(),
            })
        })
    }

    fn finish(&mut self, received: Received) -> WorkFuture<Finished> {
        let this = self.clone();
        Box::pin(async move {
            let state = match received.want_state {
                true => Some(this.payload(received.round).await),
                false => None,
            };
            Ok(Finished {
                state,
                val_loss: None,
            })
        })
    }

    fn load_state(
        &mut self,
        _round: u64,
        _state: TensorSet,
        _spread: AnchorSpread,
    ) -> WorkFuture<()> {
        Box::pin(async { Ok(()) })
    }

    fn close(&mut self) -> WorkFuture<()> {
        Box::pin(async { Ok(()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn synthetic_payload_matches_its_table_and_differs_per_round() {
        let t = SyntheticTrainer::new(PeerId::random(), 10_000, 3, 2, Duration::from_millis(1));
        let a = t.train_round(1).await;
        assert_eq!(a.specs(), t.table());
        assert_ne!(a, t.train_round(2).await);
    }
}
