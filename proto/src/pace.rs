//! How many inner steps a worker takes in a round (H_i, `docs/algorithms.md`, "Adaptive H_i"), and
//! the moving averages its prediction rests on — torch-free, so that the simulator (`gasloc-node
//! sim`) and the networked node (`gasloc-node join`) run one rule and one estimator.
//!
//! * [`InnerSteps::for_budget`]: `H_i = clamp(floor((T_round − C_i) / t_step), H_min, H_max)`
//!   with adaptive H_i, else H. The caller supplies the budget `T_round − C_i`: the simulator
//!   as `H · t_step + C°_i − C_i` ([`standard_round_budget`]), the node as the time its round
//!   leaves the inner steps on the wall clock.
//! * [`MovingAverage`]: the exponential moving average of step times, outer-step times and
//!   link speeds, with one weight for every quantity.

use crate::manifest::OuterConfig;

/// The manifest's inner-step settings (`[outer] inner_steps`, `adaptive_inner_steps`,
/// `min_inner_steps`, `max_inner_steps`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InnerSteps {
    /// H: the fixed count, and the adaptive rule's count when nothing is known yet.
    pub target: u64,
    pub adaptive: bool,
    pub min: u64,
    pub max: u64,
}

impl InnerSteps {
    pub fn from_manifest(outer: &OuterConfig) -> InnerSteps {
        InnerSteps {
            target: outer.inner_steps,
            adaptive: outer.adaptive_inner_steps,
            min: outer.min_inner_steps,
            max: outer.max_inner_steps.max(outer.min_inner_steps),
        }
    }

    /// H_i for a round that leaves its inner steps `budget_s` seconds (`T_round − C_i`) at
    /// `step_time_s` seconds a step: `clamp(floor(budget / t_step), H_min, H_max)`. Fixed H
    /// ignores both; without a step time yet (the first step of a node) it is H, clamped.
    pub fn for_budget(&self, budget_s: f64, step_time_s: Option<f64>) -> u64 {
        if !self.adaptive {
            return self.target;
        }
        let steps = match step_time_s {
            // A budget of exactly k steps is k steps, whatever the last bit of the division.
            Some(t) if t > 0.0 && budget_s.is_finite() => (budget_s / t + 1e-9).floor().max(0.0),
            _ => self.target as f64,
        };
        // `as` saturates: a huge budget gives u64::MAX, clamped to H_max.
        (steps as u64).clamp(self.min, self.max)
    }

    /// H_i as a node on the wall clock evaluates it before each inner step, with what it
    /// knows then: the budget is the `steps_done` steps at `t_step` each plus the `left_s`
    /// seconds to its deadline (the deadline moves once the round's neighbours are known).
    /// At the round's first step it is [`Self::for_budget`] of the whole budget; with steady
    /// step times the node stops after the same H_i as the simulator's.
    pub fn for_deadline(&self, steps_done: u64, left_s: f64, step_time_s: Option<f64>) -> u64 {
        let spent = steps_done as f64 * step_time_s.unwrap_or(0.0);
        self.for_budget(spent + left_s.max(0.0), step_time_s)
    }
}

/// The simulator's round budget `T_round = H · t_step + C°_i` (the same exchange at the
/// standard bandwidth) less the predicted exchange `C_i`: a worker on standard links keeps H,
/// a straggler and its partners of the round give up the steps their slow transfer costs.
pub fn standard_round_budget(
    target: u64,
    step_time_s: f64,
    standard_exchange_s: f64,
    exchange_s: f64,
) -> f64 {
    target as f64 * step_time_s + standard_exchange_s - exchange_s
}

/// The round budget when rounds overlap (`[outer] overlap`): the exchange runs beside the
/// next round's inner steps, so it costs no step. The round is `T_round = max(H · t_step, C°_i)`
/// (when the exchange at the standard bandwidth is longer than H steps, the round stretches to
/// it and the worker trains through it rather than wait) and all of it is inner steps. A worker
/// whose own exchange `C_i` is longer still waits for it before it hands off again.
pub fn overlapped_round_budget(target: u64, step_time_s: f64, standard_exchange_s: f64) -> f64 {
    (target as f64 * step_time_s).max(standard_exchange_s)
}

/// An exponential moving average: `avg ← (1 − w)·avg + w·sample`, the first sample taken as
/// is. Every moving average of the node and the simulator (inner-step time, outer-step time,
/// seconds per byte with a peer) uses [`MovingAverage::WEIGHT`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MovingAverage {
    value: Option<f64>,
}

impl MovingAverage {
    /// The weight of a new sample.
    pub const WEIGHT: f64 = 0.2;

    /// Adds a sample; a non-finite or negative one is ignored.
    pub fn observe(&mut self, sample: f64) {
        if !(sample.is_finite() && sample >= 0.0) {
            return;
        }
        self.value = Some(match self.value {
            Some(avg) => (1.0 - Self::WEIGHT) * avg + Self::WEIGHT * sample,
            None => sample,
        });
    }

    pub fn get(&self) -> Option<f64> {
        self.value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ADAPTIVE: InnerSteps = InnerSteps {
        target: 30,
        adaptive: true,
        min: 1,
        max: 60,
    };

    #[test]
    fn adaptive_h_gives_up_the_steps_the_slow_exchange_costs() {
        // 30 steps of 0.1 s; a standard exchange of 0.5 s; the straggler's takes 2.0 s.
        let h = |c: f64, max| {
            let rule = InnerSteps { max, ..ADAPTIVE };
            rule.for_budget(standard_round_budget(30, 0.1, 0.5, c), Some(0.1))
        };
        assert_eq!(h(0.5, 60), 30);
        assert_eq!(h(2.0, 60), 15);
        assert_eq!(h(100.0, 60), 1, "never below H_min");
        assert_eq!(h(0.0, 31), 31, "never above H_max");
    }

    /// A node on a (fake, millisecond) wall clock with the simulator's inputs: H, t_step,
    /// C_i and C°_i. It re-evaluates H_i before every step and stops at the simulator's H_i.
    fn node_steps(rule: InnerSteps, t: f64, c: f64, c0: f64) -> u64 {
        let budget_ms = (standard_round_budget(rule.target, t, c0, c) * 1000.0).round() as i64;
        let (start, step_ms) = (1_000_000i64, (t * 1000.0).round() as i64);
        let deadline = start + budget_ms;
        let mut estimate = MovingAverage::default();
        let (mut now, mut steps) = (start, 0u64);
        while steps < rule.for_deadline(steps, (deadline - now) as f64 / 1000.0, estimate.get()) {
            now += step_ms;
            estimate.observe(step_ms as f64 / 1000.0);
            steps += 1;
        }
        steps
    }

    #[test]
    fn the_node_on_its_clock_takes_the_simulators_h_for_the_same_inputs() {
        for (t, c, c0) in [
            (0.1, 0.5, 0.5),
            (0.1, 2.03, 0.5),
            (0.05, 0.0, 0.3),
            (0.2, 9.0, 0.1),
        ] {
            let sim = ADAPTIVE.for_budget(standard_round_budget(30, t, c0, c), Some(t));
            assert_eq!(node_steps(ADAPTIVE, t, c, c0), sim, "t={t} C={c} C°={c0}");
        }
        let fixed = InnerSteps {
            adaptive: false,
            ..ADAPTIVE
        };
        assert_eq!(node_steps(fixed, 0.1, 9.0, 0.5), 30);
    }

    #[test]
    fn fixed_h_and_unknown_step_times_give_h() {
        let fixed = InnerSteps {
            adaptive: false,
            ..ADAPTIVE
        };
        assert_eq!(fixed.for_budget(0.0, Some(1.0)), 30);
        assert_eq!(ADAPTIVE.for_budget(0.5, None), 30);
        assert_eq!(ADAPTIVE.for_budget(f64::INFINITY, Some(0.1)), 30);
        assert_eq!(ADAPTIVE.for_budget(1e300, Some(1e-300)), 60);
        assert_eq!(ADAPTIVE.for_budget(-5.0, Some(0.1)), 1);
    }

    #[test]
    fn the_moving_average_weighs_new_samples_by_its_weight_and_ignores_nonsense() {
        let mut m = MovingAverage::default();
        assert_eq!(m.get(), None);
        m.observe(1.0);
        assert_eq!(m.get(), Some(1.0));
        m.observe(2.0);
        assert!((m.get().unwrap() - (1.0 + MovingAverage::WEIGHT)).abs() < 1e-12);
        let before = m.get();
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            m.observe(bad);
        }
        assert_eq!(m.get(), before);
    }
}
