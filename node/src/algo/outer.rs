//! The end of a round on named tensors: the mixed pseudo-gradient and the outer step
//! (`docs/algorithms.md`, "A round", steps 3–4). The simulator and the networked node both call
//! these.
//!
//! A model is a list of tensors in the trainer's parameter order. The mixing is written in
//! pseudo-gradient form, `Δ_i = Σ_j w_ij·(θ_i − x_j) = θ_i − x̄_i` (the rows are stochastic), with
//! the terms summed in ascending worker order and the weights as exact fractions
//! `count/denominator`: `Δ_i = (Σ_j count_j·(θ_i − x_j)) / denominator`. With the complete
//! topology and identical anchors this is, operation for operation, DiLoCo's all-reduce
//! `mean_j(θ − x_j)` ([`all_reduce_mean`]), which is what makes the two bit-identical.

use gasloc_proto::fragments::Fragments;
use gasloc_proto::manifest::OuterConfig;
use gasloc_proto::topology::MixingRow;
use tch::Tensor;

/// `Δ_i = (Σ_j count_j·(θ_i − x_j)) / denominator` for worker `row.worker`, tensor by tensor.
/// `model(j)` gives worker j's received (decoded) local model; the worker's own comes from it
/// too.
pub fn mixed_pseudo_gradient<'a>(
    row: &MixingRow,
    anchor: &[Tensor],
    model: impl Fn(usize) -> &'a [Tensor],
) -> Vec<Tensor> {
    let _guard = tch::no_grad_guard();
    anchor
        .iter()
        .enumerate()
        .map(|(p, theta)| {
            let terms = row.terms.iter().map(|&(j, count)| {
                let d = theta - &model(j)[p];
                if count == 1 {
                    d
                } else {
                    d * count as f64
                }
            });
            sum_then_divide(terms, row.denominator)
        })
        .collect()
}

/// `(Σ_j count_j·t_j) / denominator`, tensor by tensor: the row's weighted mean of what the
/// workers sent — pseudo-gradients (the LoRDO payload, where anchors differ between workers)
/// or anchors (its full-sync rounds).
pub fn weighted_mix<'a>(row: &MixingRow, sent: impl Fn(usize) -> &'a [Tensor]) -> Vec<Tensor> {
    let _guard = tch::no_grad_guard();
    let own = sent(row.worker);
    (0..own.len())
        .map(|p| {
            let terms = row.terms.iter().map(|&(j, count)| {
                let x = sent(j)[p].copy();
                if count == 1 {
                    x
                } else {
                    x * count as f64
                }
            });
            sum_then_divide(terms, row.denominator)
        })
        .collect()
}

/// The tensors of fragment `members` (indices, `gasloc_proto::fragments`), *sharing storage*
/// with `tensors` (shallow clones): what is done to them in place (an outer step, a carry,
/// `copy_`) is done to `tensors`, so `&mut fragment_of(&anchor, m)` steps the anchor itself.
pub fn fragment_of(tensors: &[Tensor], members: &[usize]) -> Vec<Tensor> {
    members
        .iter()
        .map(|&k| tensors[k].shallow_clone())
        .collect()
}

/// The model's fragments (`[outer] fragments = count`, [`Fragments::split`]): its tensors
/// split by their sizes, a split that cannot be made named as the manifest section's. The
/// simulator and the node both split with this.
pub fn model_fragments(anchor: &[Tensor], count: usize) -> anyhow::Result<Fragments> {
    let sizes: Vec<u64> = anchor.iter().map(|t| t.numel() as u64).collect();
    Fragments::split(&sizes, count).map_err(|e| anyhow::anyhow!("[outer] {e}"))
}

/// DiLoCo's all-reduce: `mean_j(θ − x_j)` over all workers, summed in worker order.
pub fn all_reduce_mean(anchor: &[Tensor], models: &[Vec<Tensor>]) -> Vec<Tensor> {
    let _guard = tch::no_grad_guard();
    anchor
        .iter()
        .enumerate()
        .map(|(p, theta)| {
            sum_then_divide(models.iter().map(|x| theta - &x[p]), models.len() as u32)
        })
        .collect()
}

/// `(Σ terms) / denominator`, the terms summed in the order given.
pub(crate) fn sum_then_divide(terms: impl Iterator<Item = Tensor>, denominator: u32) -> Tensor {
    let mut terms = terms;
    let mut acc = terms.next().expect("a mixing row always holds self");
    for t in terms {
        acc += t;
    }
    if denominator == 1 {
        acc
    } else {
        acc / denominator as f64
    }
}

/// The outer optimizer: SGD with momentum on the pseudo-gradient `Δ`, as
/// `torch.optim.SGD(lr=η, momentum=μ, nesterov=…)`:
/// `m ← μ·m + Δ`; `θ ← θ − η·(Δ + μ·m)` (Nesterov) or `θ ← θ − η·m` (heavy-ball).
#[derive(Debug)]
pub struct OuterOptimizer {
    lr: f64,
    momentum: f64,
    nesterov: bool,
    /// `m`, zeros at the start, one per tensor.
    buffers: Vec<Tensor>,
}

impl OuterOptimizer {
    pub fn new(config: &OuterConfig, anchor: &[Tensor]) -> Self {
        OuterOptimizer {
            lr: config.lr,
            momentum: config.momentum,
            nesterov: config.nesterov,
            buffers: anchor.iter().map(Tensor::zeros_like).collect(),
        }
    }

    /// A copy with its own momentum buffers (to look ahead without moving this one).
    pub fn snapshot(&self) -> OuterOptimizer {
        OuterOptimizer {
            lr: self.lr,
            momentum: self.momentum,
            nesterov: self.nesterov,
            buffers: self.buffers.iter().map(Tensor::copy).collect(),
        }
    }

    /// The optimizer of fragment `members` (tensor indices, `gasloc_proto::fragments`).
    /// Its momentum buffers *share storage* with this one's (shallow clones): although it
    /// takes `&self`, a step of the returned optimizer changes this one's momentum in place.
    /// That is the point: the simulator and the node step a round's fragment through it.
    pub fn fragment(&self, members: &[usize]) -> OuterOptimizer {
        OuterOptimizer {
            lr: self.lr,
            momentum: self.momentum,
            nesterov: self.nesterov,
            buffers: fragment_of(&self.buffers, members),
        }
    }

    /// The momentum buffers `m`, one per tensor (what a checkpoint and state sync carry).
    pub fn momentum(&self) -> &[Tensor] {
        &self.buffers
    }

    /// Overwrites the momentum buffers with `values` (same order and shapes).
    pub fn set_momentum(&mut self, values: &[Tensor]) {
        let _guard = tch::no_grad_guard();
        for (m, v) in self.buffers.iter_mut().zip(values) {
            m.copy_(v);
        }
    }

    /// Adds `late` to the outer step taken last (`step(anchor, Δ)`), in place: afterwards
    /// anchor and momentum are those of `step(anchor_before, Δ + late)`, up to rounding.
    /// The step is affine in Δ for a given momentum, so the difference is
    /// `m ← m + late`, `θ ← θ − η·(1 + μ)·late` (Nesterov) or `θ ← θ − η·late` (heavy-ball,
    /// or μ = 0).
    pub fn add_to_last_step(&mut self, anchor: &mut [Tensor], late: &[Tensor]) {
        let _guard = tch::no_grad_guard();
        let scale = if self.nesterov {
            self.lr * (1.0 + self.momentum)
        } else {
            self.lr
        };
        for ((theta, m), l) in anchor.iter_mut().zip(&mut self.buffers).zip(late) {
            if self.momentum != 0.0 {
                *m += l;
            }
            *theta -= l * scale;
        }
    }

    /// Applies one outer step to `anchor` in place.
    pub fn step(&mut self, anchor: &mut [Tensor], delta: &[Tensor]) {
        let _guard = tch::no_grad_guard();
        for ((theta, m), d) in anchor.iter_mut().zip(&mut self.buffers).zip(delta) {
            if self.momentum == 0.0 {
                *theta -= d * self.lr;
                continue;
            }
            *m *= self.momentum;
            *m += d;
            let update = if self.nesterov {
                d + &*m * self.momentum
            } else {
                m.shallow_clone()
            };
            *theta -= update * self.lr;
        }
    }
}

/// Consensus distance `mean_i ‖θ_i − θ̄‖² / ‖θ̄‖²` over all tensors of all workers.
pub fn consensus_distance(anchors: &[Vec<Tensor>]) -> f64 {
    let _guard = tch::no_grad_guard();
    let n = anchors.len() as f64;
    let (mut spread, mut norm) = (0.0, 0.0);
    for p in 0..anchors[0].len() {
        let stacked = Tensor::stack(&anchors.iter().map(|a| &a[p]).collect::<Vec<_>>(), 0)
            .to_kind(tch::Kind::Double);
        let mean = stacked.mean_dim(0, false, tch::Kind::Double);
        spread += (&stacked - &mean)
            .square()
            .sum(tch::Kind::Double)
            .double_value(&[])
            / n;
        norm += mean.square().sum(tch::Kind::Double).double_value(&[]);
    }
    if norm == 0.0 {
        0.0
    } else {
        spread / norm
    }
}
