//! The distributed-training math, on named tensors, shared by the simulator and the
//! networked node (one implementation):
//!
//! * [`outer`]: the mixed pseudo-gradient of a round, DiLoCo's all-reduce, the outer
//!   Nesterov / heavy-ball step and the consensus distance;
//! * [`lordo`]: LoRDO's low-rank inner optimizer (error feedback, full-rank QH term, basis
//!   refresh with moment rotation);
//! * [`overlap`]: the outer step when a round's exchange overlaps the next round's inner
//!   steps (`delayed`, `eager`);
//! * [`payload`]: what a worker sends (fp32 / bf16 model, LoRDO pseudo-gradient) and its size.
//!
//! Who mixes with whom (permutations, topologies, weights) is torch-free and lives in
//! `gasloc_proto::topology`.

pub mod lordo;
pub mod outer;
pub mod overlap;
pub mod payload;

use tch::Tensor;

/// Detached deep copies of `tensors`: a snapshot that no later in-place write reaches.
pub fn copies(tensors: &[Tensor]) -> Vec<Tensor> {
    tensors.iter().map(|t| t.detach().copy()).collect()
}
