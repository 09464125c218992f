//! The simulator: N workers of one run in one process, each a [`Trainer`] with its own data
//! stream, running the round math of [`crate::algo`] exactly as the networked node does.
//!
//! A round (`docs/algorithms.md`, "A round"): every worker starts from its anchor `θ_i`, takes
//! `H_i` inner steps, then mixes over the round's topology (permutation from
//! [`gasloc_proto::topology::sim_round_seed`]`(run seed, round)`) or all-reduces (DiLoCo), and
//! takes its outer step; `ddp` instead averages gradients every step. With a LoRDO inner
//! optimizer the round's mixed pseudo-gradient refreshes the bases.
//!
//! The run is deterministic on the CPU for a seed and thread count, except that with
//! `adaptive_inner_steps` and no fixed `step_time` the measured step time (hence H_i) varies.
//! Compute time is measured, or `H_i × step_time` when one is given; communication is
//! simulated ([`clock`]).

pub mod clock;
pub mod disagreement;
pub mod report;

use crate::algo::copies;
use crate::algo::outer::{
    all_reduce_mean, consensus_distance, fragment_of, mixed_pseudo_gradient, model_fragments,
    weighted_mix, OuterOptimizer,
};
use crate::algo::overlap::{LocalModel, OverlappedOuter};
use crate::algo::payload::{encode_lordo, model_bytes, through_bf16};
use crate::inner_optimizer::InnerOptimizer;
use crate::trainer::Trainer;
use anyhow::{bail, Result};
use clock::{Network, Straggler};
use gasloc_data::shards::TokenDataset;
use gasloc_data::stream::{validation_batches, Batch, WorkerSlot};
use gasloc_proto::fragments::Fragments;
use gasloc_proto::manifest::{is_full_sync_round, Algorithm, Overlap, Payload};
use gasloc_proto::pace::{
    overlapped_round_budget, standard_round_budget, InnerSteps, MovingAverage,
};
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
        // `inf` is allowed: an instantaneous exchange (no latency with --latency-ms 0).
        if self.bandwidth_mbps.is_nan() || self.bandwidth_mbps <= 0.0 {
            bail!(
                "--bandwidth-mbps {} must be a positive number (or inf)",
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
    /// The worker's simulated clock at the end of the round: its outer step done (blocking
    /// rounds), or its payload handed to the exchange (overlapped rounds).
    pub finish_s: f64,
    /// Inner-step time over the round's wall time (`compute_s / (finish_s − round start)`).
    pub compute_utilization: f64,
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
    /// Mean validation loss of the models in training, every worker's (on the same rounds).
    /// The anchors' own with blocking whole-model rounds; with overlap or fragments the model
    /// in training is ahead of its anchor by the steps not yet synced.
    pub local_val_loss: Option<f64>,
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
    pub fn mean_compute_utilization(&self) -> f64 {
        self.workers
            .iter()
            .map(|w| w.compute_utilization)
            .sum::<f64>()
            / self.workers.len() as f64
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
    /// With `[outer] overlap`: the pending exchange, and when it ends on the simulated clock.
    overlap: Option<OverlappedOuter>,
    exchange_done_s: f64,
}

/// N workers of one run.
pub struct Simulation {
    manifest: RunManifest,
    options: SimOptions,
    workers: Vec<Worker>,
    names: Vec<String>,
    val: Vec<Batch>,
    network: Network,
    /// The model's fragments (`[outer] fragments`): which tensors each round exchanges.
    fragments: Fragments,
    round: u64,
    /// Bytes of the last payload (the exchange-time prediction of adaptive H_i).
    last_payload_bytes: u64,
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
                overlap: match manifest.outer.overlap {
                    Overlap::None => None,
                    mode => Some(OverlappedOuter::new(mode)?),
                },
                exchange_done_s: 0.0,
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
        let fragments = model_fragments(&workers[0].anchor, manifest.outer.fragments)?;
        let last_payload_bytes = model_bytes(
            &fragment_of(&workers[0].anchor, fragments.of_round_members(0)),
            full_bytes_per_element(manifest.outer.payload),
        );
        Ok(Simulation {
            manifest: manifest.clone(),
            options,
            workers,
            names,
            val,
            network,
            fragments,
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

    /// Each worker's anchor `θ_i`; with overlapped rounds, as it stands once the pending
    /// exchange is applied (what the worker would hold if it stopped now).
    pub fn anchors(&self) -> Result<Vec<Vec<Tensor>>> {
        Ok(self.settled_anchors()?.iter().map(|a| copies(a)).collect())
    }

    /// Parameters of the full model payload, for bytes comparisons.
    pub fn parameter_count(&self) -> u64 {
        self.workers[0]
            .anchor
            .iter()
            .map(|t| t.numel() as u64)
            .sum()
    }

    /// The tensors round `round` (≥ 1) exchanges (its fragment; every tensor with one). The
    /// node numbers its rounds from 0, the simulator from 1: the simulator's round t is the
    /// node's t − 1, so both start with fragment 0.
    fn fragment(&self, round: u64) -> &[usize] {
        self.fragments.of_round_members(round - 1)
    }

    /// Runs the next round.
    pub fn run_round(&mut self) -> Result<SwarmRound> {
        self.round += 1;
        let record = if self.manifest.outer.algorithm == Algorithm::Ddp {
            self.ddp_round()?
        } else if self.manifest.outer.overlap != Overlap::None {
            self.overlapped_round()?
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
    /// budget `H · t_step + C°_i − C_i`, or `max(H · t_step, C°_i)` when rounds overlap.
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
                let budget = match o.overlap {
                    Overlap::None => standard_round_budget(o.inner_steps, t, c0, c),
                    _ => overlapped_round_budget(o.inner_steps, t, c0),
                };
                rule.for_budget(budget, Some(t))
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
            && is_full_sync_round(self.round, self.manifest.lordo.full_sync_every);
        // The round's fragment (the whole model with `fragments = 1`).
        let members = self.fragment(self.round).to_vec();
        let models: Vec<Vec<Tensor>> = self
            .workers
            .iter()
            .map(|w| fragment_of(&w.trainer.parameters(), &members))
            .collect();
        let (deltas, payload_bytes): (Vec<Vec<Tensor>>, Vec<u64>) = if o.payload == Payload::Lordo {
            let (deltas, mut bytes) = self.lordo_exchange(&rows, &models)?;
            if full_sync && o.algorithm != Algorithm::Diloco {
                let anchor_bytes = self.mix_anchors(&rows);
                bytes.iter_mut().for_each(|b| *b += anchor_bytes);
            }
            (deltas, bytes)
        } else {
            self.model_exchange(&rows, &members, &models, o.payload)
        };
        match o.algorithm {
            Algorithm::Diloco => {
                let (first, rest) = self.workers.split_at_mut(1);
                let w = &mut first[0];
                let mut anchor = fragment_of(&w.anchor, &members);
                w.outer.fragment(&members).step(&mut anchor, &deltas[0]);
                for w in rest {
                    for (a, b) in w.anchor.iter_mut().zip(&first[0].anchor) {
                        a.copy_(b);
                    }
                }
            }
            _ => {
                for (w, d) in self.workers.iter_mut().zip(&deltas) {
                    let mut anchor = fragment_of(&w.anchor, &members);
                    w.outer.fragment(&members).step(&mut anchor, d);
                }
            }
        }
        for (i, w) in self.workers.iter_mut().enumerate() {
            // DiLoCo has one (global) pseudo-gradient.
            let d = &deltas[i.min(deltas.len() - 1)];
            if let InnerOptimizer::Lordo(lordo) = w.trainer.inner_optimizer_mut() {
                lordo.refresh_basis(&self.names, d);
            }
            // The fragment starts the next round from its new anchor; the others train on.
            w.trainer
                .set_fragment(&members, &fragment_of(&w.anchor, &members));
        }
        self.last_payload_bytes = payload_bytes[0].max(1);

        // The clock.
        let n = self.workers.len();
        let ready = self.ready_times(&compute);
        let mut worker_rounds = Vec::with_capacity(n);
        for (i, row) in rows.iter().enumerate() {
            let (start, comm, bytes) = self.exchange_window(row, &ready, payload_bytes[i]);
            let began = self.workers[i].clock_s;
            worker_rounds.push(WorkerRound {
                worker: i,
                inner_steps: steps[i],
                train_loss: losses[i],
                bytes_sent: bytes,
                compute_s: compute[i],
                comm_s: comm,
                wait_s: start - ready[i],
                finish_s: start + comm,
                compute_utilization: utilization(compute[i], start + comm - began),
            });
        }
        for (w, r) in self.workers.iter_mut().zip(&worker_rounds) {
            w.clock_s = r.finish_s;
        }
        self.finish_record(worker_rounds, full_sync)
    }

    /// An overlapped round (`[outer] overlap`, [`OverlappedOuter`]): each worker trains its
    /// H_i steps starting at once; the previous round's exchange ends on the simulated clock
    /// between two of them (or, when it is slower than the steps, the worker waits for it
    /// after the last), and is applied there. Then the worker hands its payload to this
    /// round's exchange, which starts when its neighbours have handed off theirs (DiLoCo: when
    /// everyone has) and ends `C_i` later, in the next round.
    fn overlapped_round(&mut self) -> Result<SwarmRound> {
        let rows = self.mixing_rows();
        let steps = self.inner_steps(&rows);
        let fixed_step = self.options.step_time_ms.map(|t| t / 1e3);
        let n = self.workers.len();
        let (mut losses, mut compute, mut waited, mut began) = (vec![], vec![], vec![], vec![]);
        // Each worker's payload: its local model (the round's fragment of it) as handed off
        // (eager moves the trainer on to its new anchor at the hand-off).
        let mut handed_off = Vec::with_capacity(n);
        for (i, &h) in steps.iter().enumerate() {
            let start_s = self.workers[i].clock_s;
            let (mut sum, mut elapsed) = (0.0, 0.0);
            for _ in 0..h {
                if start_s + elapsed >= self.workers[i].exchange_done_s {
                    self.apply_pending(i)?;
                }
                let w = &mut self.workers[i];
                let began_step = Instant::now();
                sum += w.trainer.step()?.loss;
                let took = began_step.elapsed().as_secs_f64();
                if fixed_step.is_none() {
                    w.step_time.observe(took);
                }
                elapsed += fixed_step.unwrap_or(took);
            }
            // A pending exchange slower than the inner steps: wait for it.
            let wait = (self.workers[i].exchange_done_s - (start_s + elapsed)).max(0.0);
            self.apply_pending(i)?;
            let members = self.fragment(self.round).to_vec();
            let w = &mut self.workers[i];
            let local = copies(&fragment_of(&w.trainer.parameters(), &members));
            let overlap = w.overlap.as_mut().expect("an overlapped run");
            let mut anchor = fragment_of(&w.anchor, &members);
            if let LocalModel::Replace(x) = overlap.hand_off(
                self.round,
                &mut anchor,
                &mut w.outer.fragment(&members),
                &local,
            )? {
                w.trainer.set_fragment(&members, &x);
            }
            handed_off.push(local);
            losses.push(sum / h.max(1) as f64);
            compute.push(elapsed);
            waited.push(wait);
            began.push(start_s);
            w.clock_s = start_s + elapsed + wait;
        }

        // This round's exchange: what each worker receives, and when it ends.
        let o = self.manifest.outer.clone();
        let bf16 = o.payload != Payload::ModelFp32;
        let received: Vec<Vec<Tensor>> = handed_off
            .iter()
            .map(|local| {
                local
                    .iter()
                    .map(|t| {
                        if bf16 {
                            through_bf16(t)
                        } else {
                            t.detach().copy()
                        }
                    })
                    .collect()
            })
            .collect();
        let payload_bytes = model_bytes(&received[0], if bf16 { 2 } else { 4 });
        let ready: Vec<f64> = self.workers.iter().map(|w| w.clock_s).collect();
        let mut worker_rounds = Vec::with_capacity(n);
        for (i, row) in rows.iter().enumerate() {
            let (start, comm, bytes) = self.exchange_window(row, &ready, payload_bytes);
            self.workers[i].exchange_done_s = start + comm;
            worker_rounds.push(WorkerRound {
                worker: i,
                inner_steps: steps[i],
                train_loss: losses[i],
                bytes_sent: bytes,
                compute_s: compute[i],
                comm_s: comm,
                wait_s: waited[i],
                finish_s: ready[i],
                compute_utilization: utilization(compute[i], ready[i] - began[i]),
            });
        }
        // What the exchange gives is known now; each worker applies it when it ends.
        for (w, row) in self.workers.iter_mut().zip(&rows) {
            let overlap = w.overlap.as_mut().expect("an overlapped run");
            overlap.arrived(self.round, row, |j| &received[j])?;
        }
        self.last_payload_bytes = payload_bytes.max(1);
        self.finish_record(worker_rounds, false)
    }

    /// When `row.worker`'s exchange of a `payload_bytes` payload starts on the simulated clock
    /// (gossip: when it and its round neighbours are `ready`; DiLoCo: the barrier, when
    /// everyone is), how long it takes, and the bytes it sends.
    fn exchange_window(
        &self,
        row: &MixingRow,
        ready: &[f64],
        payload_bytes: u64,
    ) -> (f64, f64, u64) {
        if self.manifest.outer.algorithm == Algorithm::Diloco {
            return (
                ready.iter().cloned().fold(0.0, f64::max),
                self.network.all_reduce_time(payload_bytes as f64),
                self.network.all_reduce_bytes(payload_bytes),
            );
        }
        let i = row.worker;
        let neighbours: Vec<usize> = row.neighbours().collect();
        (
            neighbours
                .iter()
                .map(|&j| ready[j])
                .fold(ready[i], f64::max),
            self.network
                .gossip_time(i, &neighbours, payload_bytes as f64),
            payload_bytes * neighbours.len() as u64,
        )
    }

    /// Worker `i` takes its pending exchange into its anchor (the exchange has ended on the
    /// simulated clock); nothing when none is pending.
    fn apply_pending(&mut self, i: usize) -> Result<()> {
        let pending = self.workers[i]
            .overlap
            .as_ref()
            .and_then(|o| o.pending_round());
        let Some(round) = pending else {
            return Ok(());
        };
        let members = self.fragment(round).to_vec();
        let w = &mut self.workers[i];
        let overlap = w.overlap.as_mut().expect("an overlapped run");
        let local = fragment_of(&w.trainer.parameters(), &members);
        let mut anchor = fragment_of(&w.anchor, &members);
        if let LocalModel::Replace(x) =
            overlap.apply(&mut anchor, &mut w.outer.fragment(&members), &local)?
        {
            w.trainer.set_fragment(&members, &x);
        }
        Ok(())
    }

    /// Each worker's anchor as it stands once its pending exchange is applied (what it would
    /// hold if it stopped now); the anchors of blocking rounds as they are.
    fn settled_anchors(&self) -> Result<Vec<Vec<Tensor>>> {
        self.workers
            .iter()
            .map(|w| {
                let pending = w
                    .overlap
                    .as_ref()
                    .and_then(|o| Some((o, o.pending_round()?)));
                let Some((overlap, round)) = pending else {
                    return Ok(w.anchor.iter().map(Tensor::shallow_clone).collect());
                };
                // The pending round's fragment settled, the others as they are.
                let members = self.fragment(round);
                let settled = overlap
                    .settled_anchor(&fragment_of(&w.anchor, members), &w.outer.fragment(members))?;
                let mut anchor: Vec<Tensor> = w.anchor.iter().map(Tensor::shallow_clone).collect();
                for (&k, t) in members.iter().zip(settled) {
                    anchor[k] = t;
                }
                Ok(anchor)
            })
            .collect()
    }

    /// The model payloads of the round's fragment `members` (`models`, fragments of the local
    /// models): `Δ_i = θ_i − x̄_i` (gossip) or DiLoCo's all-reduce mean; and the
    /// bytes of each worker's payload.
    fn model_exchange(
        &self,
        rows: &[MixingRow],
        members: &[usize],
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
            let anchor = fragment_of(&self.workers[0].anchor, members);
            vec![all_reduce_mean(&anchor, &received)]
        } else {
            rows.iter()
                .map(|row| {
                    let i = row.worker;
                    let anchor = fragment_of(&self.workers[i].anchor, members);
                    mixed_pseudo_gradient(row, &anchor, |j| {
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
                compute_utilization: utilization(
                    compute[i],
                    start + comm - self.workers[i].clock_s,
                ),
            })
            .collect();
        for w in &mut self.workers {
            w.clock_s = start + comm;
        }
        self.finish_record(worker_rounds, false)
    }

    /// When each worker's compute of this round ends on its simulated clock.
    fn ready_times(&self, compute: &[f64]) -> Vec<f64> {
        self.workers
            .iter()
            .zip(compute)
            .map(|(w, c)| w.clock_s + c)
            .collect()
    }

    /// The round's record: the consensus distance of the anchors and, on an evaluation round,
    /// their mean validation loss and that of the models in training. With overlapped rounds
    /// the anchors are the settled ones (the pending exchange applied), the trainer's local
    /// model left as it is.
    fn finish_record(&mut self, workers: Vec<WorkerRound>, full_sync: bool) -> Result<SwarmRound> {
        let anchors = self.settled_anchors()?;
        let evaluate =
            self.round.is_multiple_of(self.options.eval_every) || self.round == self.options.rounds;
        // DiLoCo (blocking or delayed) and ddp keep every worker identical: one evaluation is
        // the mean.
        let identical = match self.manifest.outer.algorithm {
            Algorithm::Ddp => true,
            Algorithm::Diloco => self.manifest.outer.overlap != Overlap::Eager,
            _ => false,
        };
        let evaluated = if identical { 1 } else { self.workers.len() };
        let val = &self.val;
        let (val_loss, local_val_loss) = if !evaluate {
            (None, None)
        } else if self.fragments.is_whole() && self.workers.iter().all(|w| w.overlap.is_none()) {
            // After a blocking whole-model round every trainer holds its anchor: one
            // evaluation serves both.
            let evaluations = self.workers.iter().take(evaluated);
            let loss = evaluations.map(|w| w.trainer.evaluate(val)).sum::<f64>() / evaluated as f64;
            (Some(loss), Some(loss))
        } else {
            let local = self
                .workers
                .iter()
                .map(|w| w.trainer.evaluate(val))
                .sum::<f64>()
                / self.workers.len() as f64;
            let anchor = (self.workers.iter_mut().zip(&anchors).take(evaluated))
                .map(|(w, anchor)| w.trainer.evaluate_parameters(anchor, val))
                .sum::<f64>()
                / evaluated as f64;
            (Some(anchor), Some(local))
        };
        Ok(SwarmRound {
            round: self.round,
            sim_time_s: workers.iter().map(|w| w.finish_s).fold(0.0, f64::max),
            val_loss,
            local_val_loss,
            consensus: consensus_distance(&anchors),
            full_sync,
            workers,
        })
    }
}

/// Inner-step time over wall time (1 for a round that took no time).
fn utilization(compute_s: f64, wall_s: f64) -> f64 {
    if wall_s > 0.0 {
        (compute_s / wall_s).min(1.0)
    } else {
        1.0
    }
}

/// The model payload's bytes per parameter (LoRDO's full-sync rounds send bf16).
fn full_bytes_per_element(payload: Payload) -> usize {
    match payload {
        Payload::ModelFp32 => 4,
        Payload::ModelBf16 | Payload::Lordo => 2,
    }
}
