//! The **synthetic trainer**: a stand-in for the libtorch trainer in network tests and
//! scale runs. It "trains" by sleeping a configurable step time per inner step and emits a
//! fixed-size pseudo-random payload; it learns nothing.

use crate::tensors::{TensorSet, TensorSpec};
use libp2p::PeerId;
use sha2::{Digest, Sha256};
use std::time::Duration;

/// Settings of the synthetic trainer.
#[derive(Debug, Clone)]
pub struct SyntheticTrainer {
    /// Bytes of each round's payload (split over `tensors` f32 tensors).
    pub payload_bytes: usize,
    pub tensors: usize,
    pub inner_steps: u32,
    pub step_time: Duration,
}

impl SyntheticTrainer {
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

    /// Runs one round's inner steps (sleeps) and returns this node's payload for `round`.
    pub async fn train_round(&self, me: &PeerId, round: u64) -> TensorSet {
        tokio::time::sleep(self.step_time * self.inner_steps).await;
        let digest = Sha256::new()
            .chain_update(me.to_bytes())
            .chain_update(round.to_le_bytes())
            .finalize();
        let seed = u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"));
        let (tensors, bytes_each) = (self.tensors.max(1), self.bytes_each());
        tokio::task::spawn_blocking(move || TensorSet::synthetic(tensors, bytes_each, seed))
            .await
            .expect("synthetic payload generation does not panic")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn synthetic_payload_matches_its_table_and_differs_per_round() {
        let t = SyntheticTrainer {
            payload_bytes: 10_000,
            tensors: 3,
            inner_steps: 2,
            step_time: Duration::from_millis(1),
        };
        let me = PeerId::random();
        let a = t.train_round(&me, 1).await;
        assert_eq!(a.specs(), t.table());
        assert_ne!(a, t.train_round(&me, 2).await);
    }
}
