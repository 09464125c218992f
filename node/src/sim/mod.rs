//! The simulator: N workers of one run in one process, each a [`Trainer`] with its own data
//! stream, running the round math of [`crate::algo`] exactly as the networked node does.
//!
//! A round (ALGORITHMS.md §1): every worker starts from its anchor `θ_i`, takes `H_i` inner
//! steps, then mixes over the round's topology (permutation from
//! [`gasloc_proto::topology::sim_round_seed`]`(run seed, round)`) or all-reduces (DiLoCo), and
//! takes its outer step; `ddp` instead averages gradients every step. With a LoRDO inner
//! optimizer the round's mixed pseudo-gradient refreshes the bases.
//!
//! The run is deterministic on the CPU for a seed and thread count, except that with
//! `adaptive_inner_steps` and no fixed `step_time` the measured step time (hence H_i) varies.
//! Compute time is measured, or `H_i × step_time` when one is given; communication is
//! simulated ([`clock`]).

pub mod clock;
pub mod report;

use crate::algo::outer::{
    all_reduce_mean, consensus_distance, mixed_pseudo_gradient, weighted_mix, OuterOptimizer,
};
use crate::algo::payload::{encode_lordo, model_bytes, through_bf16};
use crate::optim::InnerOptimizer;
use crate::trainer::Trainer;
use anyhow::{bail, Result};
use clock::{Network, Straggler};
use gasloc_data::shards::TokenDataset;
use gasloc_data::stream::{validation_batches, Batch, WorkerSlot};
use gasloc_proto::manifest::{Algorithm, Payload};
use gasloc_proto::pace::{standard_round_budget, InnerSteps, MovingAverage};
use gasloc_proto::topology::{permutation, sim_round_seed, MixingRow};
use gasloc_proto::RunManifest;
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;
use tch::{Device, Tensor};

/// How to simulate (everything that is not in the run manifest).
#[derive(Debug, Clone, Serialize)]
pub struct SimOptions {
    pub workers: usize,
    pub rounds: u64,
    #[serde(skip)]
    pub stragglers: Vec<Straggler>,
    /// The standard link, in megabits per second.
    pub bandwidth_mbps: f64,
    pub latency_ms: f64,
    /// A fixed simulated inner-step time; `None` measures it.
    pub step_time_ms: Option<f64>,
    /// Rounds between validation losses (the last round always gets one).
    pub eval_every: u64,
}

impl SimOptions {
    pub fn validate(&self) -> Result<()> {
        if self.workers == 0 {
            bail!("--workers must be at least 1");
        }
        if self.rounds == 0 {
            bail!("--rounds must be at least 1");
        }
        if self.eval_every == 0 {
            bail!("--eval-every must be at least 1");
        }
        if !(self.bandwidth_mbps.is_finite() && self.bandwidth_mbps > 0.0) {
            bail!(
                "--bandwidth-mbps {} must be a positive number",
                self.bandwidth_mbps
            );
        }
        if !(self.latency_ms.is_finite() && self.latency_ms >= 0.0) {
            bail!("--latency-ms {} must be ≥ 0", self.latency_ms);
        }
        if let Some(t) = self.step_time_ms {
            if !(t.is_finite() && t > 0.0) {
                bail!("--step-time-ms {t} must be a positive number");
            }
        }
        for s in &self.stragglers {
            if s.worker >= self.workers {
                bail!(
                    "--straggler {}:{}: worker {} does not exist (--workers {})",
                    s.worker,
                    s.fraction,
                    s.worker,
                    self.workers
                );
            }
        }
        Ok(())
    }
}

/// One worker's part of a round.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerRound {
    pub worker: usize,
    pub inner_steps: u64,
    pub train_loss: f64,
    pub bytes_sent: u64,
    pub compute_s: f64,
    pub comm_s: f64,
    pub wait_s: f64,
    /// The worker's simulated clock at the end of the round.
    pub finish_s: f64,
}

/// One round of the whole swarm.
#[derive(Debug, Clone, Serialize)]
pub struct SwarmRound {
    /// 1-based.
    pub round: u64,
    /// The simulated wall-clock: the latest worker's clock.
    pub sim_time_s: f64,
    /// Mean validation loss of the anchors (on rounds with an evaluation).
    pub val_loss: Option<f64>,
    pub consensus: f64,
    /// A LoRDO round that exchanged the full model.
    pub full_sync: bool,
    pub workers: Vec<WorkerRound>,
}

impl SwarmRound {
    pub fn mean_train_loss(&self) -> f64 {
        self.workers.iter().map(|w| w.train_loss).sum::<f64>() / self.workers.len() as f64
    }
    pub fn mean_inner_steps(&self) -> f64 {
        self.workers
            .iter()
            .map(|w| w.inner_steps as f64)
            .sum::<f64>()
            / self.workers.len() as f64
    }
    pub fn bytes_sent(&self) -> u64 {
        self.workers.iter().map(|w| w.bytes_sent).sum()
    }
    pub fn max_wait_s(&self) -> f64 {
        self.workers.iter().map(|w| w.wait_s).fold(0.0, f64::max)
    }
}

struct Worker {
    trainer: Trainer,
    anchor: Vec<Tensor>,
    outer: OuterOptimizer,
    /// The LoRDO payload's error feedback.
    payload_error: Vec<Tensor>,
    /// The inner-step time: `--step-time-ms`, or the moving average of the measured steps
    /// (the node's estimator).
    step_time: MovingAverage,
    clock_s: f64,
}

/// N workers of one run.
pub struct Simulation {
    manifest: RunManifest,
    options: SimOptions,
    workers: Vec<Worker>,
    names: Vec<String>,
    val: Vec<Batch>,
    network: Network,
    round: u64,
    /// Bytes of the last payload (the exchange-time prediction of adaptive H_i).
    last_payload_bytes: u64,
}

fn copies(tensors: &[Tensor]) -> Vec<Tensor> {
    tensors.iter().map(|t| t.detach().copy()).collect()
}

impl Simulation {
    pub fn new(
        manifest: &RunManifest,
        data: Arc<TokenDataset>,
        options: SimOptions,
    ) -> Result<Self> {
        options.validate()?;
        let n = options.workers;
        let mut workers = Vec::with_capacity(n);
        for index in 0..n {
            let trainer = Trainer::new(
                manifest,
                Device::Cpu,
                data.clone(),
                WorkerSlot { index, count: n },
            )?;
            let anchor = copies(&trainer.parameters());
            workers.push(Worker {
                outer: OuterOptimizer::new(&manifest.outer, &anchor),
                payload_error: anchor.iter().map(Tensor::zeros_like).collect(),
                anchor,
                trainer,
                step_time: {
                    let mut estimate = MovingAverage::default();
                    if let Some(t) = options.step_time_ms {
                        estimate.observe(t / 1e3);
                    }
                    estimate
                },
                clock_s: 0.0,
            });
        }
        let names = workers[0].trainer.parameter_names();
        if data.val_tokens() == 0 {
            bail!("the data directory has no validation shard: the simulator reports validation losses");
        }
        let val = validation_batches(
            &data,
            manifest.data.seq_len,
            manifest.data.micro_batch,
            manifest.eval.batches,
        )?;
        let network = Network::new(
            n,
            options.bandwidth_mbps * 1e6 / 8.0,
            options.latency_ms / 1e3,
            &options.stragglers,
        );
        let last_payload_bytes = model_bytes(
            &workers[0].anchor,
            full_bytes_per_element(manifest.outer.payload),
        );
        Ok(Simulation {
            manifest: manifest.clone(),
            options,
            workers,
            names,
            val,
            network,
            round: 0,
            last_payload_bytes,
        })
    }

    pub fn manifest(&self) -> &RunManifest {
        &self.manifest
    }

    pub fn options(&self) -> &SimOptions {
        &self.options
    }

    /// Each worker's anchor `θ_i`.
    pub fn anchors(&self) -> Vec<Vec<Tensor>> {
        self.workers.iter().map(|w| copies(&w.anchor)).collect()
    }

    /// Parameters of the full model payload, for bytes comparisons.
    pub fn parameter_count(&self) -> u64 {
        self.workers[0]
            .anchor
            .iter()
            .map(|t| t.numel() as u64)
            .sum()
    }

    /// Runs the next round.
    pub fn run_round(&mut self) -> Result<SwarmRound> {
        self.round += 1;
        let record = if self.manifest.outer.algorithm == Algorithm::Ddp {
            self.ddp_round()?
        } else {
            self.local_round()?
        };
        Ok(record)
    }

    /// The round's rows, from the node's function ([`Topology::round_row`]; nobody is
    /// missing in the simulator).
    ///
    /// [`Topology::round_row`]: gasloc_proto::topology::Topology::round_row
    fn mixing_rows(&self) -> Vec<MixingRow> {
        let perm = permutation(
            sim_round_seed(self.manifest.seed, self.round),
            self.workers.len(),
        );
        let topology = self.manifest.outer.topology;
        (0..perm.len())
            .map(|i| topology.round_row(&perm, i, &[]))
            .collect()
    }

    /// The inner steps of each worker this round: the node's rule ([`InnerSteps`]) with the
    /// budget `H · t_step + C°_i − C_i`.
    fn inner_steps(&self, rows: &[MixingRow]) -> Vec<u64> {
        let o = &self.manifest.outer;
        let rule = InnerSteps::from_manifest(o);
        rows.iter()
            .zip(&self.workers)
            .map(|(row, w)| {
                let Some(t) = w.step_time.get().filter(|_| rule.adaptive) else {
                    return rule.for_budget(0.0, None);
                };
                let neighbours: Vec<usize> = row.neighbours().collect();
                let bytes = self.last_payload_bytes as f64;
                let (c, c0) = if o.algorithm == Algorithm::Diloco {
                    let c = self.network.all_reduce_time(bytes);
                    (c, c)
                } else {
                    (
                        self.network.gossip_time(row.worker, &neighbours, bytes),
                        self.network.standard_gossip_time(&neighbours, bytes),
                    )
                };
                rule.for_budget(standard_round_budget(o.inner_steps, t, c0, c), Some(t))
            })
            .collect()
    }

    /// A local-update round: inner steps, exchange, outer step.
    fn local_round(&mut self) -> Result<SwarmRound> {
        let rows = self.mixing_rows();
        let steps = self.inner_steps(&rows);
        let mut losses = Vec::new();
        let mut compute = Vec::new();
        let fixed_step = self.options.step_time_ms.map(|t| t / 1e3);
        for (w, &h) in self.workers.iter_mut().zip(&steps) {
            let mut sum = 0.0;
            let mut measured = 0.0;
            for _ in 0..h {
                let start = Instant::now();
                sum += w.trainer.step()?.loss;
                let took = start.elapsed().as_secs_f64();
                measured += took;
                // Each step feeds the estimate, as on the node.
                if fixed_step.is_none() {
                    w.step_time.observe(took);
                }
            }
            losses.push(sum / h.max(1) as f64);
            compute.push(fixed_step.map_or(measured, |t| h as f64 * t));
        }

        let o = self.manifest.outer.clone();
        let full_sync = o.payload == Payload::Lordo
            && self
                .round
                .is_multiple_of(self.manifest.lordo.full_sync_every);
        let models: Vec<Vec<Tensor>> = self
            .workers
            .iter()
            .map(|w| w.trainer.parameters())
            .collect();
        let (deltas, payload_bytes): (Vec<Vec<Tensor>>, Vec<u64>) = if o.payload == Payload::Lordo {
            let (deltas, mut bytes) = self.lordo_exchange(&rows, &models)?;
            if full_sync && o.algorithm != Algorithm::Diloco {
                let anchor_bytes = self.mix_anchors(&rows);
                bytes.iter_mut().for_each(|b| *b += anchor_bytes);
            }
            (deltas, bytes)
        } else {
            self.model_exchange(&rows, &models, o.payload)
        };
        match o.algorithm {
            Algorithm::Diloco => {
                let (first, rest) = self.workers.split_at_mut(1);
                first[0].outer.step(&mut first[0].anchor, &deltas[0]);
                for w in rest {
                    for (a, b) in w.anchor.iter_mut().zip(&first[0].anchor) {
                        a.copy_(b);
                    }
                }
            }
            _ => {
                for (w, d) in self.workers.iter_mut().zip(&deltas) {
                    w.outer.step(&mut w.anchor, d);
                }
            }
        }
        for (i, w) in self.workers.iter_mut().enumerate() {
            // DiLoCo has one (global) pseudo-gradient.
            let d = &deltas[i.min(deltas.len() - 1)];
            if let InnerOptimizer::Lordo(lordo) = w.trainer.inner_optimizer_mut() {
                lordo.refresh_basis(&self.names, d);
            }
            w.trainer.set_parameters(&w.anchor);
        }
        self.last_payload_bytes = payload_bytes[0].max(1);

        // The clock.
        let n = self.workers.len();
        let ready = self.ready_times(&compute);
        let mut worker_rounds = Vec::with_capacity(n);
        let barrier = o.algorithm == Algorithm::Diloco;
        let all_ready = ready.iter().cloned().fold(0.0, f64::max);
        for (i, row) in rows.iter().enumerate() {
            let neighbours: Vec<usize> = row.neighbours().collect();
            let (start, comm, bytes) = if barrier {
                (
                    all_ready,
                    self.network.all_reduce_time(payload_bytes[i] as f64),
                    self.network.all_reduce_bytes(payload_bytes[i]),
                )
            } else {
                let start = neighbours
                    .iter()
                    .map(|&j| ready[j])
                    .fold(ready[i], f64::max);
                (
                    start,
                    self.network
                        .gossip_time(i, &neighbours, payload_bytes[i] as f64),
                    payload_bytes[i] * neighbours.len() as u64,
                )
            };
            worker_rounds.push(WorkerRound {
                worker: i,
                inner_steps: steps[i],
                train_loss: losses[i],
                bytes_sent: bytes,
                compute_s: compute[i],
                comm_s: comm,
                wait_s: start - ready[i],
                finish_s: start + comm,
            });
        }
        for (w, r) in self.workers.iter_mut().zip(&worker_rounds) {
            w.clock_s = r.finish_s;
        }
        Ok(self.finish_record(worker_rounds, full_sync))
    }

    /// The model payloads: `Δ_i = θ_i − x̄_i` (gossip) or DiLoCo's all-reduce mean; and the
    /// bytes of each worker's payload.
    fn model_exchange(
        &self,
        rows: &[MixingRow],
        models: &[Vec<Tensor>],
        payload: Payload,
    ) -> (Vec<Vec<Tensor>>, Vec<u64>) {
        let bf16 = payload != Payload::ModelFp32;
        let received: Vec<Vec<Tensor>> = if bf16 {
            models
                .iter()
                .map(|m| m.iter().map(through_bf16).collect())
                .collect()
        } else {
            models
                .iter()
                .map(|m| m.iter().map(Tensor::shallow_clone).collect())
                .collect()
        };
        let bytes = model_bytes(&models[0], if bf16 { 2 } else { 4 });
        let deltas = if self.manifest.outer.algorithm == Algorithm::Diloco {
            vec![all_reduce_mean(&self.workers[0].anchor, &received)]
        } else {
            rows.iter()
                .map(|row| {
                    let i = row.worker;
                    mixed_pseudo_gradient(row, &self.workers[i].anchor, |j| {
                        if j == i {
                            &models[i]
                        } else {
                            &received[j]
                        }
                    })
                })
                .collect()
        };
        (deltas, vec![bytes; models.len()])
    }

    /// The LoRDO payloads: each worker encodes `θ_i − x_i` with error feedback; the mixed
    /// pseudo-gradient averages what the round's neighbours decoded.
    fn lordo_exchange(
        &mut self,
        rows: &[MixingRow],
        models: &[Vec<Tensor>],
    ) -> Result<(Vec<Vec<Tensor>>, Vec<u64>)> {
        let mut sent = Vec::with_capacity(models.len());
        for (w, x) in self.workers.iter_mut().zip(models) {
            let InnerOptimizer::Lordo(lordo) = w.trainer.inner_optimizer_mut() else {
                bail!("outer.payload = \"lordo\" needs outer.inner_optimizer = \"lordo\"");
            };
            let pseudo: Vec<Tensor> = {
                let _guard = tch::no_grad_guard();
                w.anchor.iter().zip(x).map(|(a, b)| a - b).collect()
            };
            sent.push(encode_lordo(
                &self.names,
                &pseudo,
                &mut w.payload_error,
                lordo.projected(),
            ));
        }
        let deltas = if self.manifest.outer.algorithm == Algorithm::Diloco {
            let everyone = MixingRow::uniform(0, &(1..models.len()).collect::<Vec<_>>());
            vec![weighted_mix(&everyone, |j| &sent[j].decoded)]
        } else {
            rows.iter()
                .map(|row| weighted_mix(row, |j| &sent[j].decoded))
                .collect()
        };
        Ok((deltas, sent.iter().map(|s| s.bytes).collect()))
    }

    /// A LoRDO full-sync round: the anchors themselves mix, in bf16, outside the outer
    /// momentum (`θ_i ← Σ_j w_ij θ_j`); returns the bytes of one anchor payload.
    fn mix_anchors(&mut self, rows: &[MixingRow]) -> u64 {
        let anchors: Vec<Vec<Tensor>> = self.workers.iter().map(|w| copies(&w.anchor)).collect();
        let received: Vec<Vec<Tensor>> = anchors
            .iter()
            .map(|a| a.iter().map(through_bf16).collect())
            .collect();
        for (w, row) in self.workers.iter_mut().zip(rows) {
            let i = row.worker;
            w.anchor = weighted_mix(row, |j| if j == i { &anchors[i] } else { &received[j] });
        }
        model_bytes(&anchors[0], 2)
    }

    /// Synchronous data parallel: one step, gradients averaged over all workers.
    fn ddp_round(&mut self) -> Result<SwarmRound> {
        let n = self.workers.len();
        let mut losses = Vec::with_capacity(n);
        let mut compute = Vec::with_capacity(n);
        for w in &mut self.workers {
            let start = Instant::now();
            losses.push(w.trainer.accumulate_gradients()?);
            compute.push(match self.options.step_time_ms {
                Some(t) => t / 1e3,
                None => start.elapsed().as_secs_f64(),
            });
        }
        {
            let _guard = tch::no_grad_guard();
            let params: Vec<Vec<Tensor>> = self
                .workers
                .iter()
                .map(|w| w.trainer.parameters())
                .collect();
            for p in 0..params[0].len() {
                let mut sum = params[0][p].grad().copy();
                for worker in &params[1..] {
                    sum += worker[p].grad();
                }
                let mean = sum / n as f64;
                for worker in &params {
                    worker[p].grad().copy_(&mean);
                }
            }
        }
        for (w, &(loss, tokens)) in self.workers.iter_mut().zip(&losses) {
            w.trainer.apply_gradients(loss, tokens);
            let params = w.trainer.parameters();
            for (a, p) in w.anchor.iter_mut().zip(&params) {
                a.copy_(p);
            }
        }
        let bytes = model_bytes(&self.workers[0].anchor, 4);
        let ready = self.ready_times(&compute);
        let start = ready.iter().cloned().fold(0.0, f64::max);
        let comm = self.network.all_reduce_time(bytes as f64);
        let worker_rounds: Vec<WorkerRound> = (0..n)
            .map(|i| WorkerRound {
                worker: i,
                inner_steps: 1,
                train_loss: losses[i].0,
                bytes_sent: self.network.all_reduce_bytes(bytes),
                compute_s: compute[i],
                comm_s: comm,
                wait_s: start - ready[i],
                finish_s: start + comm,
            })
            .collect();
        for w in &mut self.workers {
            w.clock_s = start + comm;
        }
        Ok(self.finish_record(worker_rounds, false))
    }

    /// When each worker's compute of this round ends on its simulated clock.
    fn ready_times(&self, compute: &[f64]) -> Vec<f64> {
        self.workers
            .iter()
            .zip(compute)
            .map(|(w, c)| w.clock_s + c)
            .collect()
    }

    fn finish_record(&self, workers: Vec<WorkerRound>, full_sync: bool) -> SwarmRound {
        let anchors: Vec<Vec<Tensor>> = self
            .workers
            .iter()
            .map(|w| w.anchor.iter().map(Tensor::shallow_clone).collect())
            .collect();
        let evaluate =
            self.round.is_multiple_of(self.options.eval_every) || self.round == self.options.rounds;
        // DiLoCo and ddp keep every worker identical: one evaluation is the mean.
        let evaluated = match self.manifest.outer.algorithm {
            Algorithm::Diloco | Algorithm::Ddp => &self.workers[..1],
            _ => &self.workers[..],
        };
        let val_loss = evaluate.then(|| {
            evaluated
                .iter()
                .map(|w| w.trainer.evaluate(&self.val))
                .sum::<f64>()
                / evaluated.len() as f64
        });
        SwarmRound {
            round: self.round,
            sim_time_s: workers.iter().map(|w| w.finish_s).fold(0.0, f64::max),
            val_loss,
            consensus: consensus_distance(&anchors),
            full_sync,
            workers,
        }
    }
}

/// The model payload's bytes per parameter (LoRDO's full-sync rounds send bf16).
fn full_bytes_per_element(payload: Payload) -> usize {
    match payload {
        Payload::ModelFp32 => 4,
        Payload::ModelBf16 | Payload::Lordo => 2,
    }
}
