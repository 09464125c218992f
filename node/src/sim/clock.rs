//! The simulator's network and clock: per-worker link bandwidths, the time an exchange
//! takes, who waits for whom, and the adaptive H_i rule (`docs/algorithms.md`, "Adaptive H_i").
//!
//! Model. Worker i has a symmetric link of `bandwidth_i` bytes/s. A transfer between i and j
//! runs at `min(bandwidth_i, bandwidth_j)`; a worker sends its payload to its neighbours one
//! after the other, so its exchange takes
//! `C_i = latency + Σ_{j ∈ N(i)} bytes / min(bandwidth_i, bandwidth_j)`.
//! * Gossip: the exchange starts when the worker and all its round neighbours are ready;
//!   `end_i = max_{j ∈ N(i) ∪ {i}} ready_j + C_i`. Nobody waits for anyone else.
//! * All-reduce (DiLoCo, ddp): a barrier, then a ring all-reduce limited by the slowest link:
//!   `end = max_j ready_j + latency + 2(n−1)/n · bytes / min_k bandwidth_k` for everyone.
//!
//! Adaptive H_i is the node's rule (`gasloc_proto::pace`): `H_i = clamp(floor((T_round −
//! C_i) / t_step_i), H_min, H_max)`, with the round budget `T_round = H · t_step_i + C°_i`,
//! where `C_i` is [`Network::gossip_time`] and `C°_i` [`Network::standard_gossip_time`].

/// A worker whose link runs at `fraction` of the standard bandwidth (`--straggler i:f`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Straggler {
    pub worker: usize,
    pub fraction: f64,
}

impl std::str::FromStr for Straggler {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("straggler {s:?} is not WORKER:FRACTION (e.g. 3:0.1)");
        let (w, f) = s.split_once(':').ok_or_else(bad)?;
        let worker = w.trim().parse::<usize>().map_err(|_| bad())?;
        let fraction = f.trim().parse::<f64>().map_err(|_| bad())?;
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(format!(
                "straggler {s:?}: the bandwidth fraction {fraction} must lie in (0, 1]"
            ));
        }
        Ok(Straggler { worker, fraction })
    }
}

/// The simulated links.
#[derive(Debug, Clone)]
pub struct Network {
    /// Bytes per second of each worker's link.
    pub bandwidth: Vec<f64>,
    pub standard_bandwidth: f64,
    pub latency_s: f64,
}

impl Network {
    pub fn new(
        workers: usize,
        standard_bandwidth: f64,
        latency_s: f64,
        stragglers: &[Straggler],
    ) -> Self {
        let mut bandwidth = vec![standard_bandwidth; workers];
        for s in stragglers {
            bandwidth[s.worker] = standard_bandwidth * s.fraction;
        }
        Network {
            bandwidth,
            standard_bandwidth,
            latency_s,
        }
    }

    /// `C_i` for sending `bytes` to each of `neighbours`.
    pub fn gossip_time(&self, worker: usize, neighbours: &[usize], bytes: f64) -> f64 {
        if neighbours.is_empty() {
            return 0.0;
        }
        self.latency_s
            + neighbours
                .iter()
                .map(|&j| bytes / self.bandwidth[worker].min(self.bandwidth[j]))
                .sum::<f64>()
    }

    /// `C°_i`: the same exchange with every link at the standard bandwidth.
    pub fn standard_gossip_time(&self, neighbours: &[usize], bytes: f64) -> f64 {
        if neighbours.is_empty() {
            return 0.0;
        }
        self.latency_s + neighbours.len() as f64 * bytes / self.standard_bandwidth
    }

    /// A ring all-reduce of `bytes` over all workers.
    pub fn all_reduce_time(&self, bytes: f64) -> f64 {
        let n = self.bandwidth.len() as f64;
        if n <= 1.0 {
            return 0.0;
        }
        let slowest = self.bandwidth.iter().cloned().fold(f64::INFINITY, f64::min);
        self.latency_s + 2.0 * (n - 1.0) / n * bytes / slowest
    }

    /// Bytes one worker sends in a ring all-reduce of `bytes`.
    pub fn all_reduce_bytes(&self, bytes: u64) -> u64 {
        let n = self.bandwidth.len() as u64;
        if n <= 1 {
            0
        } else {
            2 * (n - 1) * bytes / n
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn straggler_specs_parse_or_name_the_problem() {
        assert_eq!(
            "3:0.1".parse::<Straggler>().unwrap(),
            Straggler {
                worker: 3,
                fraction: 0.1
            }
        );
        for bad in ["3", "x:0.1", "3:y", "3:0", "3:1.5", "-1:0.5"] {
            let e = bad.parse::<Straggler>().unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn a_slow_link_slows_only_its_exchanges() {
        let net = Network::new(
            4,
            100.0,
            0.0,
            &[Straggler {
                worker: 1,
                fraction: 0.1,
            }],
        );
        assert_eq!(net.gossip_time(0, &[2], 50.0), 0.5);
        assert_eq!(net.gossip_time(0, &[1], 50.0), 5.0);
        assert_eq!(net.gossip_time(1, &[0, 3], 50.0), 10.0);
        assert_eq!(net.standard_gossip_time(&[0, 3], 50.0), 1.0);
        // The all-reduce runs at the slowest link: 2·3/4 · 40 / 10.
        assert_eq!(net.all_reduce_time(40.0), 6.0);
        assert_eq!(net.all_reduce_bytes(40), 60);
    }
}
