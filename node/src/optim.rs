//! AdamW with decoupled weight decay, the learning-rate schedule (linear warm-up, cosine
//! decay to a floor) and global gradient-norm clipping. The run manifest's choice between
//! AdamW and LoRDO is [`crate::inner_optimizer::InnerOptimizer`].
//!
//! The AdamW update is PyTorch's single-tensor `torch.optim.AdamW`, step for step, so a run
//! here and the PyTorch reference in `bench/` do the same arithmetic.

use gasloc_proto::manifest::OptimizerConfig;
use std::f64::consts::PI;
use tch::Tensor;

/// The learning rate for each optimizer step.
#[derive(Debug, Clone)]
pub struct LrSchedule {
    peak: f64,
    floor: f64,
    warmup: u64,
    decay: u64,
}

impl LrSchedule {
    pub fn new(c: &OptimizerConfig) -> Self {
        LrSchedule {
            peak: c.lr,
            floor: c.lr * c.min_lr_ratio,
            warmup: c.warmup_steps,
            decay: c.decay_steps,
        }
    }

    /// The rate of the step numbered `step` (0-based): `peak·(step+1)/warmup` during
    /// warm-up, then a cosine from `peak` to `floor` reached at `decay_steps`, flat after.
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = (self.decay - self.warmup).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        self.floor + 0.5 * (self.peak - self.floor) * (1.0 + (PI * progress).cos())
    }
}

/// One optimised tensor and its Adam moments.
#[derive(Debug)]
pub struct ParamState {
    pub name: String,
    pub param: Tensor,
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    pub decay: bool,
}

/// AdamW over a fixed, ordered list of named parameters.
#[derive(Debug)]
pub struct AdamW {
    config: OptimizerConfig,
    params: Vec<ParamState>,
    /// Optimizer steps taken so far (Adam's bias correction uses `steps + 1`).
    steps: u64,
}

impl AdamW {
    /// `params` are (name, tensor) pairs in a stable order. Weight decay applies to 2-D
    /// weights except embeddings, unless `decay_norms_and_embeddings` is set.
    pub fn new(config: &OptimizerConfig, params: Vec<(String, Tensor)>) -> Self {
        let params = params
            .into_iter()
            .map(|(name, param)| {
                let is_matrix = param.dim() >= 2 && !name.contains("embed_tokens");
                ParamState {
                    decay: config.decay_norms_and_embeddings || is_matrix,
                    exp_avg: param.zeros_like(),
                    exp_avg_sq: param.zeros_like(),
                    name,
                    param,
                }
            })
            .collect();
        AdamW {
            config: config.clone(),
            params,
            steps: 0,
        }
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    pub fn params(&self) -> &[ParamState] {
        &self.params
    }

    /// Restores the step count (the moments are restored through [`Self::params`]).
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// The moments, named `exp_avg.<param>` and `exp_avg_sq.<param>` (the live tensors).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .flat_map(|p| {
                [
                    (format!("exp_avg.{}", p.name), p.exp_avg.shallow_clone()),
                    (
                        format!("exp_avg_sq.{}", p.name),
                        p.exp_avg_sq.shallow_clone(),
                    ),
                ]
            })
            .collect()
    }

    /// Takes `config`'s settings (its betas) from the next step on.
    pub fn reset_config(&mut self, config: &OptimizerConfig) {
        self.config = config.clone();
    }

    /// Starts the moments afresh: zero, bias corrections counted again from the next step.
    pub fn reset_moments(&mut self) {
        self.steps = 0;
        for p in &mut self.params {
            let _ = p.exp_avg.zero_();
            let _ = p.exp_avg_sq.zero_();
        }
    }

    /// One QHAdam step (ν = `nu`, ν₂ = 1): `W ← W(1 − lr·wd) − lr·((1−ν)·G + ν·û) / (√v̂ + ε)`.
    /// ν = 1 is [`Self::step`]'s Adam update.
    pub fn step_quasi_hyperbolic(&mut self, lr: f64, nu: f64) {
        self.step_with(lr, Some(nu));
    }

    /// Clears the gradients (they accumulate across micro-batches until then).
    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            p.param.zero_grad();
        }
    }

    /// One AdamW step at learning rate `lr`.
    pub fn step(&mut self, lr: f64) {
        self.step_with(lr, None);
    }

    /// Adam (`nu` None) or QHAdam (`Some(ν)`) with decoupled weight decay.
    fn step_with(&mut self, lr: f64, nu: Option<f64>) {
        let _guard = tch::no_grad_guard();
        let c = &self.config;
        self.steps += 1;
        let (bias1, bias2_sqrt) = bias_corrections(c, self.steps);
        for p in &mut self.params {
            let grad = p.param.grad();
            if !grad.defined() {
                continue;
            }
            if p.decay && c.weight_decay > 0.0 {
                p.param *= 1.0 - lr * c.weight_decay;
            }
            let mut denom = update_moments(&mut p.exp_avg, &mut p.exp_avg_sq, &grad, c, bias2_sqrt);
            match nu {
                None if lr > 0.0 => {
                    // θ ← θ − (lr / (1 − β1^t)) · m / denom, folding the scalar into the
                    // denominator in place: no parameter-sized temporary beyond `denom`.
                    denom *= -bias1 / lr;
                    let _ = p.param.addcdiv_(&p.exp_avg, &denom);
                }
                None => {}
                Some(nu) => {
                    let numerator = &grad * (1.0 - nu) + &p.exp_avg * (nu / bias1);
                    let _ = p.param.addcdiv_(&(numerator * -lr), &denom);
                }
            }
        }
    }
}

/// Adam's bias corrections after `steps` steps: `(1 − β1^t, √(1 − β2^t))`.
pub fn bias_corrections(c: &OptimizerConfig, steps: u64) -> (f64, f64) {
    let t = steps as i32;
    (1.0 - c.beta1.powi(t), (1.0 - c.beta2.powi(t)).sqrt())
}

/// Adam's moment update with `grad` (`m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`),
/// returning the step's denominator `√v / √(1 − β2^t) + ε`.
pub fn update_moments(
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    grad: &Tensor,
    c: &OptimizerConfig,
    bias2_sqrt: f64,
) -> Tensor {
    let _ = exp_avg.lerp_(grad, 1.0 - c.beta1);
    *exp_avg_sq *= c.beta2;
    let _ = exp_avg_sq.addcmul_(grad, &(grad * (1.0 - c.beta2)));
    // One new tensor, then in place (each temporary of a 125M model is 0.5 GB of traffic).
    let mut denom = exp_avg_sq.sqrt();
    denom /= bias2_sqrt;
    denom += c.eps;
    denom
}

/// Scales the gradients of `params` so their global L2 norm is at most `max_norm` (as
/// PyTorch's `clip_grad_norm_`), returning the norm before clipping. `max_norm = 0` only
/// measures.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> f64 {
    let _guard = tch::no_grad_guard();
    let grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
    // Per-tensor L2 norms (no gradient-sized temporaries), then the norm of the norms.
    let norms: Vec<Tensor> = grads
        .iter()
        .filter(|g| g.defined())
        .map(Tensor::norm)
        .collect();
    if norms.is_empty() {
        return 0.0;
    }
    let norm = Tensor::stack(&norms, 0).norm().double_value(&[]);
    if max_norm > 0.0 {
        let coef = (max_norm / (norm + 1e-6)).min(1.0);
        if coef < 1.0 {
            for mut g in grads.into_iter().filter(|g| g.defined()) {
                g *= coef;
            }
        }
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(warmup: u64, decay: u64) -> OptimizerConfig {
        gasloc_proto::RunManifest::parse(
            &format!(
                "name='t'\nseed=1\n[model]\nsize='tiny'\n[data]\ntokenizer='byte'\nseq_len=8\nmicro_batch=1\n\
                 [optimizer]\nlr=1.0\nmin_lr_ratio=0.1\nwarmup_steps={warmup}\ndecay_steps={decay}\n"
            ),
            "t",
        )
        .unwrap()
        .optimizer
    }

    #[test]
    fn schedule_warms_up_then_follows_a_cosine_to_the_floor() {
        let s = LrSchedule::new(&config(10, 110));
        assert!((s.at(0) - 0.1).abs() < 1e-12);
        assert!((s.at(9) - 1.0).abs() < 1e-12);
        assert!((s.at(10) - 1.0).abs() < 1e-12);
        assert!((s.at(60) - 0.55).abs() < 1e-12); // half way: floor + (peak-floor)/2
        assert!((s.at(110) - 0.1).abs() < 1e-12);
        assert!((s.at(10_000) - 0.1).abs() < 1e-12);
        assert!((10..109).all(|i| s.at(i + 1) <= s.at(i)));
    }
}
