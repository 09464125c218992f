//! LoRDO's inner optimizer (`docs/algorithms.md`, "LoRDO inner optimizer"): low-rank Adam with
//! error feedback and a full-rank quasi-hyperbolic term, for the attention and MLP matrices; every
//! other tensor (embeddings, norms, LM head) takes plain AdamW.
//!
//! A projected weight `W ∈ R^{m×n}` keeps a basis `Q` of rank `r = min(rank, m, n)` — right
//! singular vectors (`Q ∈ R^{n×r}`, `g = G·Q`) when `m ≥ n`, left ones (`Q ∈ R^{m×r}`,
//! `g = Qᵀ·G`) otherwise — and Adam moments of the projected shape only. One inner step with
//! gradient `G` (already clipped by the trainer):
//!
//! ```text
//! G ← G + E ;  g = proj(G) ;  E ← G − back(g)                       (error feedback)
//! u ← β1·u + (1−β1)·g ;  v ← β2·v + (1−β2)·g² ;  û, √v̂ bias-corrected
//! d = √v̂ + ε
//! W ← W·(1 − lr·wd) − lr·[ (1−ω)·G / mean(d)  +  ω·back(û / d) ]      (full-rank QH term)
//! ```
//!
//! `mean(d)` is one scalar per matrix, as in the authors' code. The full-rank term applies
//! `G + E` (the authors' code; `lordo.full_rank_term = "gradient-and-error"`) or the clipped
//! gradient alone (the paper's `Ĝ`; `"gradient"`). Until the first refresh the basis is the
//! identity slice (the first `r` coordinate vectors), as the authors bootstrap it.
//!
//! With `lordo.regime = "authors"` the first `switch_fraction` of the decay steps are low-rank
//! Adam (ω = 1, no full-rank term), then LoRDO switches as the authors warm-start it: betas
//! (0.999, 0.999), every moment reset to zero (bias corrections counted again), learning
//! rate × 0.5, ω as configured, and the tensors that are not projected take QHAdam with ν = ω.
//! [`Lordo::refresh_basis`] replaces `Q` by the top-r singular vectors of the round's aggregated
//! pseudo-gradient and rotates the moments into it (LDAdam's rule, [`rotate_moments`]).

use crate::optim::{bias_corrections, update_moments, AdamW};
use gasloc_proto::manifest::{FullRankTerm, LordoConfig, LordoRegime, OptimizerConfig};
use tch::{Kind, Tensor};

/// Which side of a matrix the basis spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// `m ≥ n`: `Q ∈ R^{n×r}`, `proj(G) = G·Q`, `back(g) = g·Qᵀ`.
    Right,
    /// `m < n`: `Q ∈ R^{m×r}`, `proj(G) = Qᵀ·G`, `back(g) = Q·g`.
    Left,
}

/// The rank-r coordinates of `matrix` in `basis`.
pub fn project(side: Side, basis: &Tensor, matrix: &Tensor) -> Tensor {
    match side {
        Side::Right => matrix.matmul(basis),
        Side::Left => basis.tr().matmul(matrix),
    }
}

/// The full matrix of rank-r coordinates `coords` in `basis`.
pub fn project_back(side: Side, basis: &Tensor, coords: &Tensor) -> Tensor {
    match side {
        Side::Right => coords.matmul(&basis.tr()),
        Side::Left => basis.matmul(coords),
    }
}

/// The side and rank LoRDO uses for a `[m, n]` matrix at the configured rank.
pub fn side_and_rank(shape: &[i64], rank: usize) -> (Side, i64) {
    let (m, n) = (shape[0], shape[1]);
    let side = if m >= n { Side::Right } else { Side::Left };
    (side, (rank as i64).min(m).min(n))
}

/// Whether LoRDO projects the parameter `name`: the attention and MLP matrices.
pub fn is_projected(name: &str, param: &Tensor) -> bool {
    param.dim() == 2 && (name.contains(".self_attn.") || name.contains(".mlp."))
}

/// The top-`rank` singular vectors of `matrix` on `side`, `[n, r]` or `[m, r]`.
pub fn top_singular_basis(side: Side, matrix: &Tensor, rank: i64) -> Tensor {
    let (u, _s, v) = matrix.to_kind(Kind::Float).svd(true, true);
    match side {
        Side::Right => v.narrow(1, 0, rank).contiguous(),
        Side::Left => u.narrow(1, 0, rank).contiguous(),
    }
}

/// How much of the subspace `old` (`[k, r]`, orthonormal columns) the subspace `new` keeps:
/// `‖newᵀ·old‖²_F / r`, 1 when they span the same space, 0 when orthogonal (the authors'
/// code logs it at every refresh).
pub fn basis_similarity(old: &Tensor, new: &Tensor) -> f64 {
    let r = old.size()[1].max(1) as f64;
    new.tr()
        .matmul(old)
        .square()
        .sum(Kind::Float)
        .double_value(&[])
        / r
}

/// One projected matrix and its low-rank state.
#[derive(Debug)]
pub struct LowRankState {
    pub name: String,
    pub param: Tensor,
    pub side: Side,
    pub basis: Tensor,
    /// Adam moments in basis coordinates (`[m, r]` or `[r, n]`).
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    /// Error feedback: what projection cut from the gradients so far, full shape.
    pub error: Tensor,
    pub decay: bool,
}

impl LowRankState {
    /// The rank of the basis, `r`.
    pub fn rank(&self) -> i64 {
        self.basis.size()[1]
    }
}

/// The authors' regime: where it switches, and whether it has.
#[derive(Debug, Clone, Copy)]
struct Switch {
    /// The step count at which the switch happens (before that step).
    at_step: u64,
    /// ω after the switch (the configured one).
    omega: f64,
    done: bool,
}

/// LoRDO over a fixed, ordered list of named parameters.
#[derive(Debug)]
pub struct Lordo {
    config: OptimizerConfig,
    /// ω as it applies now (1 before the authors' regime switches).
    omega: f64,
    full_rank_term: FullRankTerm,
    /// The tensors LoRDO does not project, with their AdamW (QHAdam after a switch) state.
    full_rank: AdamW,
    projected: Vec<LowRankState>,
    steps: u64,
    /// The step count at which the moments were last reset (their bias corrections count
    /// from there).
    moments_since: u64,
    /// The learning rate's factor (0.5 after the authors' switch).
    lr_scale: f64,
    switch: Option<Switch>,
}

impl Lordo {
    pub fn new(
        config: &OptimizerConfig,
        lordo: &LordoConfig,
        params: Vec<(String, Tensor)>,
    ) -> Self {
        let (low, full): (Vec<_>, Vec<_>) = params
            .into_iter()
            .partition(|(name, p)| is_projected(name, p));
        let projected = low
            .into_iter()
            .map(|(name, param)| {
                let shape = param.size();
                let (side, r) = side_and_rank(&shape, lordo.rank);
                let options = (Kind::Float, param.device());
                let basis = match side {
                    Side::Right => Tensor::eye_m(shape[1], r, options),
                    Side::Left => Tensor::eye_m(shape[0], r, options),
                };
                let coords = project(side, &basis, &param).zeros_like();
                LowRankState {
                    decay: true,
                    exp_avg_sq: coords.zeros_like(),
                    exp_avg: coords,
                    error: param.zeros_like(),
                    side,
                    basis,
                    name,
                    param,
                }
            })
            .collect();
        let switch = (lordo.regime == LordoRegime::Authors).then(|| Switch {
            at_step: (config.decay_steps as f64 * lordo.switch_fraction).round() as u64,
            omega: lordo.omega,
            done: false,
        });
        Lordo {
            config: config.clone(),
            omega: if switch.is_some() { 1.0 } else { lordo.omega },
            full_rank_term: lordo.full_rank_term,
            full_rank: AdamW::new(config, full),
            projected,
            steps: 0,
            moments_since: 0,
            lr_scale: 1.0,
            switch,
        }
    }

    /// ω as it applies now.
    pub fn omega(&self) -> f64 {
        self.omega
    }

    /// Whether the authors' regime has switched (false without it).
    pub fn switched(&self) -> bool {
        self.switch.is_some_and(|s| s.done)
    }

    /// The authors' switch: betas (0.999, 0.999), moments reset, lr × 0.5, ω as configured.
    fn switch_now(&mut self) {
        self.enter_switched(self.steps);
        self.full_rank.reset_moments();
        for s in &mut self.projected {
            let _ = s.exp_avg.zero_();
            let _ = s.exp_avg_sq.zero_();
        }
        tracing::info!(
            step = self.steps,
            omega = self.omega,
            "LoRDO: the authors' regime switches (betas 0.999, moments reset, lr x 0.5)"
        );
    }

    /// The settings after the authors' switch, the moments counted from `moments_since`.
    fn enter_switched(&mut self, moments_since: u64) {
        let Some(switch) = self.switch.as_mut() else {
            return;
        };
        switch.done = true;
        self.omega = switch.omega;
        self.config.beta1 = 0.999;
        self.config.beta2 = 0.999;
        self.lr_scale = 0.5;
        self.moments_since = moments_since;
        self.full_rank.reset_config(&self.config);
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    pub fn projected(&self) -> &[LowRankState] {
        &self.projected
    }

    /// Every state tensor, named (the live tensors): the full-rank tensors' moments
    /// (`exp_avg.<param>`, `exp_avg_sq.<param>`), and per projected matrix its moments in
    /// basis coordinates under the same names, its basis (`basis.<param>`) and its error
    /// feedback (`error.<param>`). The regime's state follows from the step count.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut state = self.full_rank.state();
        for s in &self.projected {
            for (prefix, t) in [
                ("exp_avg", &s.exp_avg),
                ("exp_avg_sq", &s.exp_avg_sq),
                ("basis", &s.basis),
                ("error", &s.error),
            ] {
                state.push((format!("{prefix}.{}", s.name), t.shallow_clone()));
            }
        }
        state
    }

    /// One LoRDO step at learning rate `lr` (the schedule's; the regime may scale it).
    pub fn step(&mut self, lr: f64) {
        let _guard = tch::no_grad_guard();
        if self
            .switch
            .is_some_and(|s| !s.done && self.steps >= s.at_step)
        {
            self.switch_now();
        }
        let lr = lr * self.lr_scale;
        if self.switched() {
            self.full_rank.step_quasi_hyperbolic(lr, self.omega);
        } else {
            self.full_rank.step(lr);
        }
        self.steps += 1;
        let c = &self.config;
        let (bias1, bias2_sqrt) = bias_corrections(c, self.steps - self.moments_since);
        for s in &mut self.projected {
            let grad = s.param.grad();
            if !grad.defined() {
                continue;
            }
            let full = &grad + &s.error;
            let coords = project(s.side, &s.basis, &full);
            s.error = &full - project_back(s.side, &s.basis, &coords);
            let denom = update_moments(&mut s.exp_avg, &mut s.exp_avg_sq, &coords, c, bias2_sqrt);
            let low_rank = project_back(s.side, &s.basis, &(&s.exp_avg / bias1 / &denom));
            let mut step = low_rank * self.omega;
            if self.omega < 1.0 {
                let term = match self.full_rank_term {
                    FullRankTerm::GradientAndError => &full,
                    FullRankTerm::Gradient => &grad,
                };
                step += term * ((1.0 - self.omega) / denom.mean(Kind::Float).double_value(&[]));
            }
            if s.decay && c.weight_decay > 0.0 {
                s.param *= 1.0 - lr * c.weight_decay;
            }
            let _ = s.param.g_add_(&(step * -lr));
        }
    }

    /// Replaces each projected matrix's basis by the top-r singular vectors of its entry in
    /// `aggregated` (the round's mixed pseudo-gradient, in `names` order) and rotates its
    /// moments into the new basis. Returns the mean [`basis_similarity`] of the new bases to
    /// the old (1 when nothing moved or nothing is projected), which the authors' code logs
    /// at every refresh.
    pub fn refresh_basis(&mut self, names: &[String], aggregated: &[Tensor]) -> f64 {
        let _guard = tch::no_grad_guard();
        let (bias1, bias2_sqrt) =
            bias_corrections(&self.config, (self.steps - self.moments_since).max(1));
        let bias2 = bias2_sqrt * bias2_sqrt;
        let mut similarity = Vec::with_capacity(self.projected.len());
        for s in &mut self.projected {
            let Some(k) = names.iter().position(|n| *n == s.name) else {
                continue;
            };
            let rank = s.rank();
            let new_basis = top_singular_basis(s.side, &aggregated[k], rank);
            let (u, v) = rotate_moments(
                s.side,
                &s.basis,
                &new_basis,
                &s.exp_avg,
                &s.exp_avg_sq,
                bias1,
                bias2,
            );
            s.exp_avg = u;
            s.exp_avg_sq = v;
            similarity.push(basis_similarity(&s.basis, &new_basis));
            s.basis = new_basis;
        }
        if similarity.is_empty() {
            1.0
        } else {
            similarity.iter().sum::<f64>() / similarity.len() as f64
        }
    }

    pub fn zero_grad(&mut self) {
        self.full_rank.zero_grad();
        for s in &mut self.projected {
            s.param.zero_grad();
        }
    }

    /// Sets the step count (a resumed trainer's). Past the authors' switch, the regime is
    /// as it was after it (the moments being restored are the switched ones).
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
        match self.switch.map(|s| s.at_step) {
            Some(at_step) if steps >= at_step => {
                self.enter_switched(at_step);
                self.full_rank.set_steps(steps - at_step);
            }
            _ => self.full_rank.set_steps(steps),
        }
    }
}

/// LDAdam's moment rotation from basis `old` to basis `new` (same side and rank):
/// `R = newᵀ·old`; `û ← R û` (`û Rᵀ` on the right side); the variance `v̂ − û²` (clamped ≥ 0)
/// is carried with `R∘R`, then `(R û)²` is added back. `bias1`, `bias2` are Adam's bias
/// corrections at the current step; the stored (uncorrected) moments are returned.
pub fn rotate_moments(
    side: Side,
    old: &Tensor,
    new: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    bias1: f64,
    bias2: f64,
) -> (Tensor, Tensor) {
    let r = new.tr().matmul(old);
    let r2 = r.square();
    let mean = exp_avg / bias1;
    let variance = (exp_avg_sq / bias2 - mean.square()).clamp_min(0.0);
    let (mean, variance) = match side {
        Side::Left => (r.matmul(&mean), r2.matmul(&variance)),
        Side::Right => (mean.matmul(&r.tr()), variance.matmul(&r2.tr())),
    };
    let second = (variance + mean.square()).clamp_min(0.0);
    (mean * bias1, second * bias2)
}
