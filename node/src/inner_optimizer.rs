//! [`InnerOptimizer`]: the inner optimizer the run manifest chose, AdamW
//! ([`crate::optim::AdamW`]) or LoRDO ([`crate::algo::lordo::Lordo`]).

use crate::algo::lordo::Lordo;
use crate::optim::AdamW;
use gasloc_proto::manifest::InnerOptimizerKind;
use gasloc_proto::RunManifest;
use tch::Tensor;

/// The inner optimizer the run manifest chose (`outer.inner_optimizer`). Its state persists
/// across rounds: a round never resets it.
#[derive(Debug)]
pub enum InnerOptimizer {
    AdamW(AdamW),
    Lordo(Lordo),
}

impl InnerOptimizer {
    pub fn new(manifest: &RunManifest, params: Vec<(String, Tensor)>) -> Self {
        match manifest.outer.inner_optimizer {
            InnerOptimizerKind::Adamw => {
                InnerOptimizer::AdamW(AdamW::new(&manifest.optimizer, params))
            }
            InnerOptimizerKind::Lordo => {
                InnerOptimizer::Lordo(Lordo::new(&manifest.optimizer, &manifest.lordo, params))
            }
        }
    }

    pub fn steps(&self) -> u64 {
        match self {
            InnerOptimizer::AdamW(o) => o.steps(),
            InnerOptimizer::Lordo(o) => o.steps(),
        }
    }

    pub fn set_steps(&mut self, steps: u64) {
        match self {
            InnerOptimizer::AdamW(o) => o.set_steps(steps),
            InnerOptimizer::Lordo(o) => o.set_steps(steps),
        }
    }

    /// Every state tensor, named as a checkpoint's `optimizer.safetensors` holds it (the
    /// live tensors: copying into them restores the state).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        match self {
            InnerOptimizer::AdamW(o) => o.state(),
            InnerOptimizer::Lordo(o) => o.state(),
        }
    }

    pub fn step(&mut self, lr: f64) {
        match self {
            InnerOptimizer::AdamW(o) => o.step(lr),
            InnerOptimizer::Lordo(o) => o.step(lr),
        }
    }

    pub fn zero_grad(&mut self) {
        match self {
            InnerOptimizer::AdamW(o) => o.zero_grad(),
            InnerOptimizer::Lordo(o) => o.zero_grad(),
        }
    }
}
