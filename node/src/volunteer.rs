//! The volunteer's trainer in a swarm: the libtorch side of `gasloc-node join`.
//!
//! [`Volunteer`] implements the round driver's [`RoundWork`]. libtorch work is heavy and
//! synchronous, so every call is sent to one OS thread that alone owns the [`Trainer`], the
//! anchor `θ_i` and the outer optimizer; the async driver awaits the reply. A round on that
//! thread is:
//!
//! 1. **train**: H_i inner AdamW steps from the anchor. With `adaptive_inner_steps`, as many
//!    steps as fit before the driver's deadline (the round's end less the predicted exchange
//!    and outer step, `docs/algorithms.md`, "Adaptive H_i") at `t_step`, the moving average of this
//!    node's measured step time: `H_i = clamp(floor(budget / t_step), H_min, H_max)`, the
//!    simulator's function (`gasloc_proto::pace`); otherwise H.
//!    The payload is the local model `x_i` (fp32 or bf16, `[outer] payload`), or with
//!    `payload = "lordo"` the low-rank factors of the pseudo-gradient `θ_i − x_i` plus the
//!    payload error, and the anchor every `[lordo] full_sync_every` rounds
//!    ([`crate::lordo_wire`]).
//! 2. **finish**: the mix `x̄_i = Σ_j w_ij x_j` with the row the round machine hands over
//!    (the round topology's row, a neighbour that sent nothing usable removed and its weight
//!    returned to self — ⅔ / ⅓ in two-peer with one missing — or, on the complete topology,
//!    spread over the members that arrived), as a pseudo-gradient
//!    `Δ_i = θ_i − x̄_i`, then the outer Nesterov step on `θ_i` — the same functions as the
//!    simulator (`algo::outer`, `topology::Topology::round_row`). With `lordo` payloads the
//!    mix is of the decoded pseudo-gradients, `Δ_i = Σ_j w_ij Δ_j` (and on a full-sync round
//!    the anchors, `θ_i ← Σ_j w_ij θ_j`, before the outer step), as in the simulator. The new
//!    anchor is evaluated and, every K rounds, saved.
//!
//! With `[outer] fragments = P` a round's payload, mix and outer step are those of its
//! fragment only (`gasloc_proto::fragments`: round r's is `r mod P`), through views of the
//! anchor and momentum that share their storage; the other tensors train on. The anchor
//! then holds each fragment as of its last sync.
//!
//! The state served to late joiners is the anchor and the outer momentum, named
//! `anchor.<param>` and `outer_momentum.<param>` (fp32), made by the outer step of a round
//! in which a joiner asked for it (`Received::want_state`), not every round. A checkpoint is the
//! anchor as an HF model plus the AdamW moments, the data cursor, the outer momentum and the next
//! round; with fragments also the model in training (`local.safetensors`), so that the fragments'
//! local progress since their last sync survives a restart.

use crate::algo::outer::{
    fragment_of, mixed_pseudo_gradient, model_fragments, weighted_mix, OuterOptimizer,
};
use crate::algo::overlap::{LocalModel, OverlapError, OverlappedOuter};
use crate::checkpoint::{self, Checkpoint};
use crate::inner_optimizer::InnerOptimizer;
use crate::lordo_wire::LordoWire;
use crate::tensor_wire::{from_wire, tensor_spec, to_wire};
use crate::trainer::{validation_set, Trainer};
use anyhow::{anyhow, bail, Context, Result};
use gasloc_data::shards::{ShardSupply, TokenDataset};
use gasloc_data::stream::{Batch, WorkerSlot};
use gasloc_p2p::network::unix_ms;
use gasloc_p2p::tensors::{TensorSet, TensorSpec};
use gasloc_p2p::work::{
    AnchorSpread, Candidate, Finished, GateReading, PayloadTables, Received, RoundWork, Screened,
    TrainOrder, Trained, WorkFuture,
};
use gasloc_p2p::PeerId;
use gasloc_proto::fragments::Fragments;
use gasloc_proto::gate::{LossReading, PayloadGate, PayloadStats, Refusal};
use gasloc_proto::manifest::{Algorithm, InnerOptimizerKind, Overlap, Payload};
use gasloc_proto::pace::{InnerSteps, MovingAverage};
use gasloc_proto::topology::MixingRow;
use gasloc_proto::wire::DType;
use gasloc_proto::RunManifest;
use gasloc_status::TrainerTime;
use sha2::{Digest, Sha256};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;
use tch::{Device, Kind, Tensor};
use tokio::sync::oneshot;

/// Where the trainer's token shards (`gasloc-node data prepare`) come from.
#[derive(Debug, Clone)]
pub enum RunDataSource {
    /// A directory the operator gave: checked against the manifest's pinned table (when it
    /// has one), then read whole.
    Given(PathBuf),
    /// The run's pinned shards, arriving in this directory from a fetch under way that
    /// verifies each against the table: the validation shards are waited for when the
    /// trainer opens, each training shard the first time a batch needs it.
    Arriving(PathBuf, Arc<dyn ShardSupply>),
}

/// Where and how a volunteer trains.
#[derive(Debug, Clone)]
pub struct VolunteerOptions {
    pub manifest: RunManifest,
    pub device: Device,
    /// The run's token shards.
    pub data: RunDataSource,
    /// Checkpoints go to `<checkpoints>/step_…` with a `latest` pointer.
    pub checkpoints: PathBuf,
    /// Save every this many rounds (and when leaving).
    pub checkpoint_every: u64,
    pub keep_checkpoints: usize,
    /// Evaluate the anchor every this many rounds (0: never).
    pub eval_every: u64,
    /// libtorch intra-op threads (0: libtorch's default).
    pub threads: i32,
    /// The node's peer id: seeds its data order.
    pub peer: PeerId,
}

/// How the volunteer started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// From the run's seed initialisation (a new run, unless state sync finds one under way).
    Fresh,
    /// From its own checkpoint, whose anchor begins this round; `gate_window` distances
    /// restored to the payload gate's window.
    Resumed {
        round: u64,
        step: u64,
        gate_window: usize,
    },
}

/// The libtorch trainer behind `gasloc-node join` (a handle to its thread).
pub struct Volunteer {
    requests: mpsc::Sender<Request>,
    payload_tables: PayloadTables,
    state_table: Vec<TensorSpec>,
    start: Start,
    shards_ahead: Vec<String>,
}

enum Request {
    Train(TrainOrder, oneshot::Sender<Result<Trained>>),
    Screen(u64, Vec<Candidate>, oneshot::Sender<Result<Vec<Screened>>>),
    Finish(Received, oneshot::Sender<Result<Finished>>),
    LoadState(u64, TensorSet, AnchorSpread, oneshot::Sender<Result<()>>),
    Close(oneshot::Sender<Result<()>>),
}

impl Volunteer {
    /// Starts the trainer thread: resumes from the newest checkpoint under
    /// `options.checkpoints` when there is one of this run, else starts from the seed.
    pub fn start(options: VolunteerOptions) -> Result<Volunteer> {
        check_supported(&options.manifest)?;
        let (ready_tx, ready_rx) = mpsc::channel();
        let (requests, inbox) = mpsc::channel();
        std::thread::Builder::new()
            .name("gasloc-trainer".into())
            .spawn(move || {
                if options.threads > 0 {
                    tch::set_num_threads(options.threads);
                }
                match RoundTrainer::open(options) {
                    Ok(trainer) => {
                        let _ = ready_tx.send(Ok((
                            trainer.payload_tables(),
                            trainer.state_table(),
                            trainer.start,
                            trainer.trainer.shards_ahead(),
                        )));
                        trainer.serve(inbox);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .context("cannot start the trainer thread")?;
        let (payload_tables, state_table, start, shards_ahead) = ready_rx
            .recv()
            .map_err(|_| anyhow!("the trainer thread ended while starting"))??;
        Ok(Volunteer {
            requests,
            payload_tables,
            state_table,
            start,
            shards_ahead,
        })
    }

    /// The training shards' file names in the order this volunteer will first read them,
    /// as it stood when it started: the order to fetch a run's data in.
    pub fn shards_ahead(&self) -> &[String] {
        &self.shards_ahead
    }

    pub fn start_kind(&self) -> Start {
        self.start
    }

    fn call<T: Send + 'static>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T>>) -> Request,
    ) -> WorkFuture<T> {
        let (tx, rx) = oneshot::channel();
        let sent = self.requests.send(make(tx));
        Box::pin(async move {
            sent.map_err(|_| anyhow!("the trainer thread has ended"))?;
            rx.await
                .map_err(|_| anyhow!("the trainer thread ended without answering"))?
        })
    }
}

impl RoundWork for Volunteer {
    fn payload_tables(&self) -> PayloadTables {
        self.payload_tables.clone()
    }
    fn state_table(&self) -> Vec<TensorSpec> {
        self.state_table.clone()
    }
    fn train(&mut self, order: TrainOrder) -> WorkFuture<Trained> {
        self.call(|reply| Request::Train(order, reply))
    }
    fn screen(&mut self, round: u64, candidates: Vec<Candidate>) -> WorkFuture<Vec<Screened>> {
        self.call(|reply| Request::Screen(round, candidates, reply))
    }
    fn finish(&mut self, received: Received) -> WorkFuture<Finished> {
        self.call(|reply| Request::Finish(received, reply))
    }
    fn load_state(&mut self, round: u64, state: TensorSet, spread: AnchorSpread) -> WorkFuture<()> {
        self.call(|reply| Request::LoadState(round, state, spread, reply))
    }
    fn close(&mut self) -> WorkFuture<()> {
        self.call(Request::Close)
    }
}

/// What `join` supports today; the error names the manifest key.
fn check_supported(m: &RunManifest) -> Result<()> {
    if m.outer.algorithm != Algorithm::Gasloc && m.outer.algorithm != Algorithm::Diloco {
        bail!(
            "[outer] algorithm = {:?}: join runs gasloc (and diloco with topology = \"complete\")",
            m.outer.algorithm
        );
    }
    if m.outer.inner_optimizer == InnerOptimizerKind::Lordo && m.outer.overlap != Overlap::None {
        bail!(
            "[outer] overlap = {:?} with inner_optimizer = \"lordo\": join refreshes LoRDO's bases from the round's mixed pseudo-gradient before the next inner step, which overlapped rounds take before the mix; use overlap = \"none\"",
            m.outer.overlap
        );
    }
    Ok(())
}

/// The state the trainer thread owns.
struct RoundTrainer {
    options: VolunteerOptions,
    trainer: Trainer,
    names: Vec<String>,
    shapes: Vec<Vec<i64>>,
    /// θ_i, on the trainer's device (with `[outer] fragments`, each fragment as of its
    /// last sync).
    anchor: Vec<Tensor>,
    outer: OuterOptimizer,
    /// The model's fragments (`[outer] fragments`): round r sends, mixes and outer-steps
    /// only the tensors of `fragments.of_round_members(r)` (every tensor with one fragment).
    fragments: Fragments,
    /// Judges each received model before it is mixed (`[gate]` of the manifest), with a
    /// window of accepted distances per fragment.
    gate: PayloadGate,
    /// The functional check's held-out batches (`[gate] check_tokens` of validation
    /// sequences each), round r using `check[r mod len]`; empty when the check is off.
    check: Vec<Batch>,
    /// `[outer] payload = "lordo"`: the low-rank payload's sender and decoder.
    lordo_wire: Option<LordoWire>,
    val: Vec<Batch>,
    payload_dtype: DType,
    /// Moving average of one inner step, seconds.
    step_time: MovingAverage,
    /// The round the anchor begins (the next round to finish).
    round: u64,
    rounds_since_checkpoint: u64,
    /// The round of the anchor in the newest checkpoint written or resumed from.
    saved_round: Option<u64>,
    start: Start,
    /// `[outer] overlap = "delayed"`: the round handed off to the exchange, whose outer step
    /// comes while the next round trains.
    overlap: Option<OverlappedOuter>,
    /// The checkpoint a blocking node would write after the handed-off round (its AdamW
    /// moments and data cursor at the hand-off), taken when that round's outer step saves.
    checkpoint_at_hand_off: Option<Checkpoint>,
    /// Requests that came while a round trained and must wait for its end.
    deferred: VecDeque<Request>,
    /// Neighbours' models (`model-*` payloads) the gate accepted, by round and peer, as it
    /// decoded them: the outer step mixes these instead of decoding the payload again.
    accepted_models: Vec<(u64, PeerId, Vec<Tensor>)>,
}

impl RoundTrainer {
    fn open(options: VolunteerOptions) -> Result<RoundTrainer> {
        let manifest = &options.manifest;
        let data = Arc::new(match &options.data {
            RunDataSource::Given(dir) => gasloc_data::pin::open_run_data(dir, &manifest.data)?,
            RunDataSource::Arriving(dir, supply) => TokenDataset::open_pinned(
                dir,
                &manifest.data.shards,
                manifest.data.tokenizer.vocab_size(),
                supply.clone(),
            )?,
        });
        let slot = WorkerSlot { index: 0, count: 1 };
        let mut start = Start::Fresh;
        let mut saved_momentum = Vec::new();
        let mut saved_local = Vec::new();
        let mut gate_windows = Vec::new();
        let trainer = match newest_checkpoint(&options)? {
            Some((dir, ckpt)) => {
                let trainer = Trainer::from_checkpoint(
                    manifest,
                    options.device,
                    data.clone(),
                    slot,
                    &ckpt,
                    &dir,
                )?;
                let state = ckpt.state.as_ref().expect("checked by from_checkpoint");
                gate_windows = state.gate_windows(manifest.outer.fragments);
                start = Start::Resumed {
                    round: state.round.unwrap_or(0),
                    step: state.step,
                    gate_window: gate_windows.iter().map(Vec::len).sum(),
                };
                saved_momentum = ckpt.outer_momentum;
                saved_local = ckpt.local;
                trainer
            }
            None => Trainer::with_stream_seed(
                manifest,
                options.device,
                data.clone(),
                slot,
                stream_seed(manifest.seed, &options.peer),
            )?,
        };
        let val = if options.eval_every > 0 {
            validation_set(&data, manifest)?
        } else {
            Vec::new()
        };
        let check = check_batches(&data, manifest);
        let anchor: Vec<Tensor> = trainer.parameters().iter().map(|t| t.copy()).collect();
        let outer = OuterOptimizer::new(&manifest.outer, &anchor);
        let names = trainer.parameter_names();
        if !saved_local.is_empty() {
            // With fragments, the model in training resumes where it was: the fragments not
            // synced since their last round keep their local progress.
            let targets: Vec<(String, Tensor)> =
                names.iter().cloned().zip(trainer.parameters()).collect();
            checkpoint::copy_into(&saved_local, &targets, &options.checkpoints, false)
                .context("restoring the model in training (local.safetensors)")?;
            tracing::info!("the model in training restored: each fragment's local progress since its last sync resumes");
        }
        let shapes: Vec<Vec<i64>> = anchor.iter().map(|t| t.size()).collect();
        let fragments = model_fragments(&anchor, manifest.outer.fragments)?;
        let gate =
            PayloadGate::with_accepted(manifest.gate.clone(), fragments.count(), gate_windows);
        let lordo_wire = match (&manifest.outer.payload, trainer.inner_optimizer()) {
            (Payload::Lordo, InnerOptimizer::Lordo(lordo)) => Some(LordoWire::new(
                &names,
                &shapes,
                lordo.projected(),
                manifest.lordo.full_sync_every,
                options.device,
            )),
            _ => None,
        };
        if !saved_momentum.is_empty() {
            // The outer momentum, and the lordo payload's error beside it.
            let mut targets: Vec<(String, Tensor)> = names
                .iter()
                .zip(outer.momentum())
                .map(|(n, m)| (n.clone(), m.shallow_clone()))
                .collect();
            if let Some(wire) = &lordo_wire {
                targets.extend(wire.error_targets());
            }
            checkpoint::copy_into(&saved_momentum, &targets, &options.checkpoints, false)
                .context("restoring the outer momentum")?;
        }
        let round = match start {
            Start::Resumed { round, .. } => round,
            Start::Fresh => 0,
        };
        Ok(RoundTrainer {
            payload_dtype: match manifest.outer.payload {
                Payload::ModelBf16 => DType::Bf16,
                _ => DType::F32,
            },
            trainer,
            names,
            shapes,
            anchor,
            outer,
            fragments,
            gate,
            check,
            lordo_wire,
            val,
            step_time: MovingAverage::default(),
            round,
            rounds_since_checkpoint: 0,
            saved_round: match start {
                Start::Resumed { round, .. } => Some(round),
                Start::Fresh => None,
            },
            start,
            overlap: match manifest.outer.overlap {
                Overlap::None => None,
                mode => Some(OverlappedOuter::new(mode)?),
            },
            checkpoint_at_hand_off: None,
            deferred: VecDeque::new(),
            accepted_models: Vec::new(),
            options,
        })
    }

    fn serve(mut self, inbox: mpsc::Receiver<Request>) {
        loop {
            let request = match self.deferred.pop_front() {
                Some(request) => request,
                None => match inbox.recv() {
                    Ok(request) => request,
                    Err(_) => return,
                },
            };
            match request {
                Request::Train(order, reply) => {
                    let _ = reply.send(self.train(order, &inbox));
                }
                Request::Screen(round, candidates, reply) => {
                    let _ = reply.send(self.screen(round, candidates));
                }
                Request::Finish(received, reply) => {
                    let _ = reply.send(self.finish(received));
                }
                Request::LoadState(round, state, spread, reply) => {
                    let _ = reply.send(self.load_state(round, state, spread));
                }
                Request::Close(reply) => {
                    // Saved already when the newest checkpoint holds the current anchor.
                    let current = self.saved_round == Some(self.round);
                    let _ = reply.send(if current { Ok(()) } else { self.save() });
                    return;
                }
            }
        }
    }

    fn payload_tables(&self) -> PayloadTables {
        match &self.lordo_wire {
            Some(wire) => wire.tables(),
            None => PayloadTables::model_fragments(
                (0..self.fragments.count())
                    .map(|f| {
                        self.fragments
                            .members(f)
                            .iter()
                            .map(|&k| {
                                tensor_spec(
                                    self.names[k].clone(),
                                    &self.shapes[k],
                                    self.payload_dtype,
                                )
                            })
                            .collect()
                    })
                    .collect(),
            ),
        }
    }

    fn state_table(&self) -> Vec<TensorSpec> {
        ["anchor", "outer_momentum"]
            .iter()
            .flat_map(|prefix| {
                self.names
                    .iter()
                    .zip(&self.shapes)
                    .map(move |(n, s)| tensor_spec(format!("{prefix}.{n}"), s, DType::F32))
            })
            .collect()
    }

    /// Runs H_i inner steps: H with fixed H; with adaptive H_i, re-evaluated before every
    /// step with the driver's deadline (which moves once the neighbours are known) and the
    /// moving average of this node's step time — the simulator's rule (`pace`, §2).
    ///
    /// With overlapped rounds the round before may still be exchanging: between two steps
    /// its screening and outer step are served as they come ([`Self::serve_handed_off`]),
    /// and after the last step this round waits for that outer step before it hands off
    /// its own payload.
    fn train(&mut self, order: TrainOrder, inbox: &mpsc::Receiver<Request>) -> Result<Trained> {
        let rule = InnerSteps::from_manifest(&self.options.manifest.outer);
        let mut loss_sum = 0.0;
        let mut steps = 0u64;
        let mut busy = 0.0;
        let mut trainer_time = TrainerTime::default();
        loop {
            let t0 = Instant::now();
            self.serve_handed_off(inbox, false)?;
            trainer_time.served_s += t0.elapsed().as_secs_f64();
            let left = order.deadline.remaining(unix_ms()).as_secs_f64();
            if steps >= rule.for_deadline(steps, left, self.step_time.get()) {
                trainer_time.unused_s = left;
                break;
            }
            let t0 = Instant::now();
            let report = self.trainer.step()?;
            let took = t0.elapsed().as_secs_f64();
            self.step_time.observe(took);
            busy += took;
            loss_sum += report.loss;
            steps += 1;
        }
        if self.overlap.is_some() {
            let t0 = Instant::now();
            self.serve_handed_off(inbox, true)?;
            trainer_time.waited_s = t0.elapsed().as_secs_f64();
        }
        let t0 = Instant::now();
        self.hand_off(order.round)?;
        let payload = self.payload(order.round)?;
        trainer_time.payload_s = t0.elapsed().as_secs_f64();
        Ok(Trained {
            payload,
            inner_steps: steps,
            step_time_s: self.step_time.get().unwrap_or(0.0),
            train_s: busy,
            train_loss: (steps > 0).then(|| loss_sum / steps as f64),
            trainer_time,
        })
    }

    /// Overlapped rounds: serves the screening and outer step of the round handed off while
    /// the next one trains; any other request waits until the training ends. With `wait`,
    /// blocks until that round's outer step is done (a round hands off only after the one
    /// before is finished); without, serves what has come and returns.
    fn serve_handed_off(&mut self, inbox: &mpsc::Receiver<Request>, wait: bool) -> Result<()> {
        while self.pending_round().is_some() {
            let request = if wait {
                inbox
                    .recv()
                    .map_err(|_| anyhow!("the round driver left with a round exchanging"))?
            } else {
                match inbox.try_recv() {
                    Ok(request) => request,
                    Err(_) => return Ok(()),
                }
            };
            match request {
                Request::Screen(round, candidates, reply) => {
                    let _ = reply.send(self.screen(round, candidates));
                }
                Request::Finish(received, reply) => {
                    let _ = reply.send(self.finish(received));
                }
                other => self.deferred.push_back(other),
            }
        }
        Ok(())
    }

    /// The round handed off to the exchange whose outer step is still to come (overlapped
    /// rounds only).
    fn pending_round(&self) -> Option<u64> {
        self.overlap.as_ref().and_then(|o| o.pending_round())
    }

    /// Overlapped rounds: round `round`'s payload goes to the exchange and the next round
    /// trains on: delayed from the payload, eager from the anchor after its own outer step.
    /// When that round's outer step
    /// will save a checkpoint, the moments and data cursor are taken now, as a blocking node
    /// would save them.
    fn hand_off(&mut self, round: u64) -> Result<()> {
        let Some(overlap) = self.overlap.as_mut() else {
            return Ok(());
        };
        // The round's fragment (every tensor with one fragment).
        let members = self.fragments.of_round_members(round);
        let local = fragment_of(&self.trainer.parameters(), members);
        let trains_from = overlap
            .hand_off(
                round,
                &mut fragment_of(&self.anchor, members),
                &mut self.outer.fragment(members),
                &local,
            )
            .map_err(|e| anyhow!("overlapped round {round}: {e}"))?;
        if let LocalModel::Replace(x) = trains_from {
            self.trainer.set_fragment(members, &x);
        }
        let saves = self.options.checkpoint_every > 0
            && self.rounds_since_checkpoint + 1 >= self.options.checkpoint_every;
        self.checkpoint_at_hand_off = if saves {
            Some(self.trainer.checkpoint()?)
        } else {
            None
        };
        Ok(())
    }

    /// The round's wire payload: the local model (with overlapped rounds, the model handed
    /// off), or the `lordo` payload of its pseudo-gradient.
    fn payload(&mut self, round: u64) -> Result<TensorSet> {
        if let (Some(wire), InnerOptimizer::Lordo(lordo)) =
            (self.lordo_wire.as_mut(), self.trainer.inner_optimizer())
        {
            let local = self.trainer.parameters();
            return wire.encode(round, &self.anchor, &local, lordo.projected());
        }
        let kind = match self.payload_dtype {
            DType::Bf16 => Kind::BFloat16,
            _ => Kind::Float,
        };
        let tensors = self
            .fragments
            .pick(round, &self.names)
            .into_iter()
            .zip(self.own_payload_model(round))
            .map(|(name, t)| to_wire(name.clone(), &t, kind, self.payload_dtype))
            .collect::<Result<Vec<_>>>()?;
        Ok(TensorSet::new(tensors))
    }

    /// The payload gate: measures each received model `x_j` against the anchor `θ_i` —
    /// finiteness, `‖θ_i − x_j‖`, and its cosine with this node's own pseudo-gradient
    /// `θ_i − x_i`, over the round's fragment — then what it does: the functional check's
    /// losses ([`Self::loss_readings`]); [`PayloadGate`] judges (`gasloc_proto::gate`),
    /// against the fragment's own window. A `lordo` payload is measured as the model it stands
    /// for: `θ_i − x_j` is its pseudo-gradient `Δ_j`, plus `θ_i − θ_j` on a full-sync round,
    /// whose anchor is mixed too; this node's own is the pseudo-gradient it sent.
    fn screen(&mut self, round: u64, candidates: Vec<Candidate>) -> Result<Vec<Screened>> {
        let started = Instant::now();
        let _guard = tch::no_grad_guard();
        let anchor = self.round_anchor(round);
        let own_model = self.own_payload_model(round);
        let own_delta: Vec<Tensor> = match self.lordo_wire.as_ref().and_then(|w| w.own(round)) {
            Some(sent) => sent.iter().map(Tensor::shallow_clone).collect(),
            None => anchor.iter().zip(&own_model).map(|(a, x)| a - x).collect(),
        };
        let own_distance = own_delta
            .iter()
            .map(|d| d.norm().double_value(&[]).powi(2))
            .sum::<f64>()
            .sqrt();
        let device = self.trainer.device();
        let mut measured = Vec::with_capacity(candidates.len());
        // Each candidate's model `x_j` over the round's fragment, when it could be read: for a
        // model payload the decoded one (kept for the outer step if the gate accepts it), for
        // a `lordo` payload `θ_i − (θ_i − x_j)`.
        let mut models: Vec<Option<Vec<Tensor>>> = Vec::with_capacity(candidates.len());
        for candidate in &candidates {
            let (stats, model) = match &self.lordo_wire {
                Some(wire) => {
                    match lordo_differences(wire, round, &candidate.tensors, &anchor, device) {
                        Ok(d) => {
                            let model = anchor.iter().zip(&d).map(|(a, d)| a - d).collect();
                            let named = self.names.iter().cloned().zip(d).map(Ok);
                            (measure(named, &own_delta, own_distance), Some(model))
                        }
                        Err(refusal) => (Err(refusal), None),
                    }
                }
                None => match self.decode_model(round, &candidate.tensors, device) {
                    Ok(model) => {
                        // `θ_i − x_j`, tensor by tensor.
                        let differences = candidate
                            .tensors
                            .tensors
                            .iter()
                            .zip(&model)
                            .zip(&anchor)
                            .map(|((wire, x), a)| Ok((wire.name.clone(), a - x)));
                        (measure(differences, &own_delta, own_distance), Some(model))
                    }
                    Err(refusal) => (Err(refusal), None),
                },
            };
            measured.push(stats);
            models.push(model);
        }
        // The functional check, on every payload whose values are finite.
        let finite: Vec<Option<&[Tensor]>> = measured
            .iter()
            .zip(&models)
            .map(|(stats, model)| match (stats, model) {
                (Ok(stats), Some(model)) if stats.non_finite.is_none() => Some(&model[..]),
                _ => None,
            })
            .collect();
        let mut readings = self.loss_readings(round, &anchor, &own_model, &finite);
        for (stats, reading) in measured.iter_mut().zip(readings.iter_mut()) {
            if let Ok(stats) = stats {
                stats.loss = reading.take();
            }
        }
        let stats: Vec<PayloadStats> = measured
            .iter()
            .filter_map(|m| m.as_ref().ok().cloned())
            .collect();
        let fragment = self.fragments.of_round(round);
        let reference = self.gate.reference(fragment, own_distance);
        let mut judged = self
            .gate
            .judge_round(fragment, own_distance, &stats)
            .into_iter();
        // The trainer's seconds for this round's gate, shared out over its readings.
        let screen_s = started.elapsed().as_secs_f64() / candidates.len().max(1) as f64;
        let keeps_models = self.lordo_wire.is_none();
        let accepted_models = &mut self.accepted_models;
        let screened = candidates
            .into_iter()
            .zip(measured)
            .zip(models)
            .map(|((candidate, measured), model)| {
                let (verdict, reading) = match measured {
                    Ok(stats) => (
                        judged.next().expect("one verdict per measured payload"),
                        Some(GateReading {
                            peer: candidate.peer.to_string(),
                            distance: stats.distance,
                            reference,
                            cosine: stats.cosine,
                            loss: stats.loss.map(|l| l.theirs),
                            loss_reference: stats.loss.map(|l| l.reference()),
                            screen_s,
                        }),
                    ),
                    Err(refusal) => (Err(refusal), None),
                };
                if let (Ok(()), Some(model), true) = (&verdict, model, keeps_models) {
                    accepted_models.push((round, candidate.peer, model));
                }
                Screened {
                    candidate,
                    verdict,
                    reading,
                }
            })
            .collect();
        Ok(screened)
    }

    /// The functional check's losses ([`LossReading`]) of each model in `theirs` (`None`:
    /// not checked), on this round's held-out batch: the model in training with the round's
    /// fragment set to this node's own payload `own`, to the round's anchor `anchor`, and to
    /// the pair's equal mix `(x_i + x_j) / 2` with each `x_j` (what a one-peer round's outer
    /// step makes of the payload with η = 1 and no momentum). The model in training is put
    /// back after, exactly.
    /// Nothing is measured when the check is off (`[gate] check_tokens = 0`, or no
    /// validation data).
    fn loss_readings(
        &mut self,
        round: u64,
        anchor: &[Tensor],
        own: &[Tensor],
        theirs: &[Option<&[Tensor]>],
    ) -> Vec<Option<LossReading>> {
        if self.check.is_empty() || theirs.iter().all(Option::is_none) {
            return vec![None; theirs.len()];
        }
        let batch = &self.check[(round % self.check.len() as u64) as usize];
        let members = self.fragments.of_round_members(round).to_vec();
        let mut variants: Vec<Vec<Tensor>> = vec![
            own.iter().map(Tensor::shallow_clone).collect(),
            anchor.iter().map(Tensor::shallow_clone).collect(),
        ];
        for x in theirs.iter().flatten() {
            let pair = [own, *x];
            variants.push(weighted_mix(&MixingRow::uniform(0, &[1]), |j| pair[j]));
        }
        let losses =
            self.trainer
                .evaluate_with_fragment(&members, &variants, std::slice::from_ref(batch));
        let (own_loss, anchor_loss) = (losses[0], losses[1]);
        let mut with_theirs = losses[2..].iter();
        theirs
            .iter()
            .map(|x| {
                x.map(|_| LossReading {
                    own: own_loss,
                    anchor: anchor_loss,
                    theirs: *with_theirs.next().expect("one loss per model checked"),
                })
            })
            .collect()
    }

    /// Round `round`'s model payload (already checked against its table: the round's
    /// fragment) as fp32 tensors on `device`; a tensor that does not decode is refused as
    /// malformed, named.
    fn decode_model(
        &self,
        round: u64,
        payload: &TensorSet,
        device: Device,
    ) -> Result<Vec<Tensor>, Refusal> {
        payload
            .tensors
            .iter()
            .zip(self.fragments.pick(round, &self.shapes))
            .map(|(wire, shape)| {
                from_wire(wire, shape, device).map_err(|e| malformed(&wire.name, e))
            })
            .collect()
    }

    /// The anchor round `round` (the one being screened) started from, `θ_i`, of the
    /// round's fragment: the anchor, or with an overlapped round pending the one it started
    /// from (eager has moved the anchor by its own step since).
    fn round_anchor(&self, round: u64) -> Vec<Tensor> {
        debug_assert!(self.pending_round().is_none_or(|p| p == round));
        match self.overlap.as_ref().and_then(|o| o.pending_anchor()) {
            Some(anchor) => anchor.iter().map(Tensor::shallow_clone).collect(),
            None => fragment_of(&self.anchor, self.fragments.of_round_members(round)),
        }
    }

    /// This node's model as it sent it in round `round`, the round's fragment: the
    /// trainer's parameters, or with overlapped rounds the model handed off (the trainer has
    /// moved on since).
    fn own_payload_model(&self, round: u64) -> Vec<Tensor> {
        debug_assert!(self.pending_round().is_none_or(|p| p == round));
        match self.overlap.as_ref().and_then(|o| o.handed_off()) {
            Some(handed) => handed.iter().map(Tensor::shallow_clone).collect(),
            None => fragment_of(
                &self.trainer.parameters(),
                self.fragments.of_round_members(round),
            ),
        }
    }

    fn finish(&mut self, received: Received) -> Result<Finished> {
        let device = self.trainer.device();
        let own = self.own_payload_model(received.round);
        // The round's fragment (every tensor with one fragment): what it mixes and steps.
        let members = self.fragments.of_round_members(received.round).to_vec();
        // The `lordo` payload mixes pseudo-gradients (and, on a full-sync round, anchors);
        // a model payload mixes models.
        let lordo = match &self.lordo_wire {
            Some(wire) => Some(lordo_mix(wire, &received, &self.anchor, &own, device)?),
            None => None,
        };
        let mut models: Vec<(usize, Vec<Tensor>)> = Vec::with_capacity(received.payloads.len());
        let round = received.round;
        if lordo.is_none() {
            for arrived in &received.payloads {
                // The model the gate decoded and accepted, else decoded here.
                let kept = self
                    .accepted_models
                    .iter()
                    .position(|(r, peer, _)| *r == round && *peer == arrived.peer);
                let decoded = match kept {
                    Some(k) => self.accepted_models.swap_remove(k).2,
                    None => self
                        .decode_model(round, &arrived.tensors, device)
                        .with_context(|| format!("decoding the model from {}", arrived.peer))?,
                };
                models.push((arrived.index, decoded));
            }
        }
        // Accepted, then left out of the mix (the neighbour's result came too late).
        self.accepted_models.retain(|(r, _, _)| *r > round);
        // The row is the round machine's: every neighbour term has its payload. Term
        // `mixing.worker` (and, should a payload ever be missing, that term too, as if its
        // weight were returned to self) is this node's own model.
        let model = |j: usize| match models.iter().find(|(i, _)| *i == j) {
            Some((_, m)) => &m[..],
            None => &own[..],
        };
        let every = self.options.eval_every;
        let evaluate = every > 0 && !self.val.is_empty() && received.round.is_multiple_of(every);
        let val_loss = match self.overlap.as_mut() {
            None => {
                let delta = match lordo {
                    Some(LordoMix { delta, anchor }) => {
                        // A full-sync round: the anchors mix outside the outer momentum.
                        if let Some(mixed) = anchor {
                            let _guard = tch::no_grad_guard();
                            for (a, m) in self.anchor.iter_mut().zip(&mixed) {
                                a.copy_(m);
                            }
                        }
                        delta
                    }
                    None => {
                        let anchor = fragment_of(&self.anchor, &members);
                        mixed_pseudo_gradient(&received.mixing, &anchor, model)
                    }
                };
                let mut anchor = fragment_of(&self.anchor, &members);
                self.outer.fragment(&members).step(&mut anchor, &delta);
                // LoRDO: each projected matrix's basis becomes the top-r singular vectors
                // of its mixed pseudo-gradient, as the simulator does (under DiLoCo the
                // global mean: the paper's global projection).
                if let InnerOptimizer::Lordo(lordo) = self.trainer.inner_optimizer_mut() {
                    let similarity = lordo.refresh_basis(&self.names, &delta);
                    tracing::info!(
                        round = received.round,
                        similarity,
                        "lordo bases refreshed from the mixed pseudo-gradient"
                    );
                }
                // The fragment starts the next round from its new anchor; the others train on.
                self.trainer.set_fragment(&members, &anchor);
                evaluate.then(|| self.evaluate_anchor())
            }
            Some(overlap) => {
                // The outer step of the round handed off; the steps the next round took
                // since are carried onto the new anchor.
                let overlapped = |e: OverlapError| anyhow!("round {}: {e}", received.round);
                overlap
                    .arrived(received.round, &received.mixing, model)
                    .map_err(overlapped)?;
                let local = fragment_of(&self.trainer.parameters(), &members);
                let carried = overlap
                    .apply(
                        &mut fragment_of(&self.anchor, &members),
                        &mut self.outer.fragment(&members),
                        &local,
                    )
                    .map_err(overlapped)?;
                if let LocalModel::Replace(x) = carried {
                    self.trainer.set_fragment(&members, &x);
                }
                evaluate.then(|| self.evaluate_anchor())
            }
        };
        self.round = received.round + 1;
        self.rounds_since_checkpoint += 1;
        if self.options.checkpoint_every > 0
            && self.rounds_since_checkpoint >= self.options.checkpoint_every
        {
            let base = match self.checkpoint_at_hand_off.take() {
                Some(mut at_hand_off) => {
                    // With fragments its model is saved as the model in training
                    // (`save_from`). As after a blocking round, the round's fragment resumes
                    // from its new anchor, the others from where they were at the hand-off.
                    if !self.fragments.is_whole() {
                        for &k in &members {
                            at_hand_off.model[k].1 = self.anchor[k].detach().to_device(Device::Cpu);
                        }
                    }
                    at_hand_off
                }
                None => self.trainer.checkpoint()?,
            };
            self.save_from(base)?;
        }
        Ok(Finished {
            state: match received.want_state {
                true => Some(self.state()?),
                false => None,
            },
            val_loss,
        })
    }

    /// The validation loss of the anchor, not of the model in training. After a blocking
    /// whole-model round the trainer holds the anchor; otherwise (overlapped rounds, or
    /// fragments not synced this round) the anchor is set for the evaluation and the local
    /// model put back after.
    fn evaluate_anchor(&mut self) -> f64 {
        if self.overlap.is_none() && self.fragments.is_whole() {
            return self.trainer.evaluate(&self.val);
        }
        self.trainer.evaluate_parameters(&self.anchor, &self.val)
    }

    /// Anchor and outer momentum, fp32, for state sync.
    fn state(&self) -> Result<TensorSet> {
        let mut tensors = Vec::with_capacity(2 * self.names.len());
        for (prefix, values) in [
            ("anchor", &self.anchor[..]),
            ("outer_momentum", self.outer.momentum()),
        ] {
            for (name, t) in self.names.iter().zip(values) {
                tensors.push(to_wire(
                    format!("{prefix}.{name}"),
                    t,
                    Kind::Float,
                    DType::F32,
                )?);
            }
        }
        Ok(TensorSet::new(tensors))
    }

    fn load_state(&mut self, round: u64, state: TensorSet, spread: AnchorSpread) -> Result<()> {
        let n = self.names.len();
        if state.tensors.len() != 2 * n {
            bail!(
                "the synced state holds {} tensors, not {}",
                state.tensors.len(),
                2 * n
            );
        }
        // A state with a NaN or an infinity would poison every step after it: refused
        // before it is decoded (the check `sync_state` makes, on the same bytes).
        if let Some(tensor) = state.first_non_finite() {
            bail!("the synced state's tensor {tensor} holds a NaN or an infinity: refused");
        }
        let device = self.trainer.device();
        let decode = |range: std::ops::Range<usize>| {
            state.tensors[range]
                .iter()
                .zip(&self.shapes)
                .map(|(t, shape)| from_wire(t, shape, device))
                .collect::<Result<Vec<_>>>()
        };
        let anchor = decode(0..n)?;
        let momentum = decode(n..2 * n)?;
        let _guard = tch::no_grad_guard();
        for (a, v) in self.anchor.iter_mut().zip(&anchor) {
            a.copy_(v);
        }
        self.outer.set_momentum(&momentum);
        // LoRDO: a joiner has no pseudo-gradient of its own yet; its bases start as the top-r
        // singular vectors of the synced outer momentum, the swarm's recent pseudo-gradients
        // (before the first outer step the momentum is zero, and the bases stay as they are).
        if let InnerOptimizer::Lordo(lordo) = self.trainer.inner_optimizer_mut() {
            // Any non-zero value: the finiteness check above ran on the same values.
            let moved = momentum
                .iter()
                .any(|m| m.abs().max().double_value(&[]) > 0.0);
            if moved {
                let similarity = lordo.refresh_basis(&self.names, &momentum);
                tracing::info!(
                    round,
                    similarity,
                    "lordo bases from the synced outer momentum"
                );
                println!("lordo_bases_from=synced_momentum round={round}");
            }
        }
        self.trainer.set_parameters(&self.anchor);
        self.round = round;
        // Each fragment's window of accepted distances: the synced sources' spread over the
        // fragment, when they were several and not all alike; else what this node had (a
        // stale checkpoint's window, or none).
        let windows = (0..self.fragments.count())
            .map(|f| spread.over(self.fragments.members(f)))
            .collect();
        self.gate.restart_windows(windows);
        tracing::info!(
            round,
            gate_reference = self.gate.accepted_median(0).unwrap_or(0.0),
            "state synced: training from the swarm's anchor"
        );
        Ok(())
    }

    /// Saves the anchor (not the half-trained local model) with the inner optimizer's
    /// moments, the data cursor, the outer momentum and the round it begins (with fragments,
    /// the model in training too). A pending overlapped exchange is dropped (eager's own step
    /// taken back): the node resumes at that round, its fragment from the anchor it started
    /// from.
    fn save(&mut self) -> Result<()> {
        if let Some(overlap) = self.overlap.as_mut() {
            let members = overlap
                .pending_round()
                .map(|round| self.fragments.of_round_members(round).to_vec())
                .unwrap_or_default();
            let dropped = overlap.drop_pending(
                &mut fragment_of(&self.anchor, &members),
                &mut self.outer.fragment(&members),
            );
            if let Some(round) = dropped {
                tracing::info!(round, "stopping with round {round}'s exchange pending: dropped, the checkpoint resumes at that round");
                self.round = round;
                self.trainer
                    .set_fragment(&members, &fragment_of(&self.anchor, &members));
            }
        }
        let ckpt = self.trainer.checkpoint()?;
        self.save_from(ckpt)
    }

    /// Saves `ckpt` (the trainer's moments and data cursor) with the anchor as its model,
    /// the outer momentum, and the next round. With fragments, `ckpt`'s model (the model in
    /// training as of `ckpt`) is saved beside the anchor as the local model: a restart
    /// resumes each fragment's local progress instead of losing up to (P − 1)·H steps of it.
    fn save_from(&mut self, mut ckpt: Checkpoint) -> Result<()> {
        let to_cpu = |t: &Tensor| t.detach().to_device(Device::Cpu);
        if !self.fragments.is_whole() {
            ckpt.local = std::mem::take(&mut ckpt.model);
        }
        ckpt.model = self
            .names
            .iter()
            .zip(&self.anchor)
            .map(|(n, t)| (n.clone(), to_cpu(t)))
            .collect();
        ckpt.outer_momentum = self
            .names
            .iter()
            .zip(self.outer.momentum())
            .map(|(n, t)| (n.clone(), to_cpu(t)))
            .collect();
        if let Some(wire) = &self.lordo_wire {
            ckpt.outer_momentum.extend(wire.named_error());
        }
        if let Some(state) = ckpt.state.as_mut() {
            state.round = Some(self.round);
            state.gate_windows = self.gate.accepted();
            state.gate_accepted = Vec::new();
        }
        let dir = checkpoint::save(
            &self.options.checkpoints,
            &ckpt,
            self.options.keep_checkpoints,
        )?;
        self.rounds_since_checkpoint = 0;
        self.saved_round = Some(self.round);
        tracing::info!(round = self.round, dir = %dir.display(), "checkpoint saved");
        println!("checkpoint={} round={}", dir.display(), self.round);
        Ok(())
    }
}

/// The newest checkpoint under `options.checkpoints`, if any; one of another run is an error.
fn newest_checkpoint(options: &VolunteerOptions) -> Result<Option<(PathBuf, Checkpoint)>> {
    if !checkpoint::exists(&options.checkpoints) {
        return Ok(None);
    }
    let dir = checkpoint::resolve(&options.checkpoints)?;
    let ckpt = checkpoint::load(&dir, Some(&options.manifest))?;
    let run = ckpt.state.as_ref().map(|s| s.run_id.clone());
    if run.as_deref() != Some(options.manifest.run_id().to_string().as_str()) {
        bail!(
            "{} holds a checkpoint of run {}, not of this run {}: use another --home",
            dir.display(),
            run.unwrap_or_else(|| "(none)".into()),
            options.manifest.run_id()
        );
    }
    Ok(Some((dir, ckpt)))
}

/// A round's mix of `lordo` payloads (the simulator's `weighted_mix`, `algo::outer`).
struct LordoMix {
    /// `Δ_i = Σ_j w_ij·Δ_j`, this node's own term the payload it sent.
    delta: Vec<Tensor>,
    /// On a full-sync round, `Σ_j w_ij·θ_j`, this node's own term its anchor.
    anchor: Option<Vec<Tensor>>,
}

/// Mixes the `lordo` payloads that `received` names with this node's own (the one it sent;
/// should there be none, its exact pseudo-gradient `anchor − own_model`).
fn lordo_mix(
    wire: &LordoWire,
    received: &Received,
    anchor: &[Tensor],
    own_model: &[Tensor],
    device: Device,
) -> Result<LordoMix> {
    let _guard = tch::no_grad_guard();
    let round = received.round;
    let own: Vec<Tensor> = match wire.own(round) {
        Some(sent) => sent.iter().map(Tensor::shallow_clone).collect(),
        None => anchor.iter().zip(own_model).map(|(a, x)| a - x).collect(),
    };
    let mut decoded = Vec::with_capacity(received.payloads.len());
    for arrived in &received.payloads {
        let payload = wire
            .decode(round, &arrived.tensors, device)
            .with_context(|| format!("decoding the lordo payload from {}", arrived.peer))?;
        decoded.push((arrived.index, payload));
    }
    let theirs = |j: usize| decoded.iter().find(|(i, _)| *i == j).map(|(_, d)| d);
    let delta = weighted_mix(&received.mixing, |j| match theirs(j) {
        Some(d) => &d.pseudo_gradient[..],
        None => &own[..],
    });
    let anchor = wire.is_full_sync(round).then(|| {
        weighted_mix(&received.mixing, |j| {
            match theirs(j).and_then(|d| d.anchor.as_deref()) {
                Some(a) => a,
                None => anchor,
            }
        })
    });
    Ok(LordoMix { delta, anchor })
}

/// A refusal of a payload the trainer could not read as its table says.
fn malformed(tensor: &str, e: impl std::fmt::Display) -> Refusal {
    Refusal::Malformed {
        tensor: tensor.to_string(),
        detail: format!("{e:#}"),
    }
}

/// A `lordo` payload's `θ_i − x_j` per parameter: its pseudo-gradient `Δ_j`, plus
/// `θ_i − θ_j` on a full-sync round.
fn lordo_differences(
    wire: &LordoWire,
    round: u64,
    set: &TensorSet,
    anchor: &[Tensor],
    device: Device,
) -> Result<Vec<Tensor>, Refusal> {
    let decoded = wire
        .decode(round, set, device)
        .map_err(|e| malformed("lordo payload", e))?;
    let mut differences = decoded.pseudo_gradient;
    if let Some(theirs) = &decoded.anchor {
        for ((d, own), theirs) in differences.iter_mut().zip(anchor).zip(theirs) {
            *d += own - theirs;
        }
    }
    Ok(differences)
}

/// One received payload's numbers for the gate, from its differences `θ_i − x_j` per
/// tensor (named), or the first refusal met while making them: two passes over each, its
/// norm and its dot product with the own pseudo-gradient (fp32, libtorch's pairwise sums).
/// A NaN or an infinity makes the norm non-finite, and only then are the values looked at
/// (a difference that overflows fp32 counts as one); a norm that overflows from finite
/// values is too far.
fn measure(
    differences: impl Iterator<Item = Result<(String, Tensor), Refusal>>,
    own_delta: &[Tensor],
    own_distance: f64,
) -> Result<PayloadStats, Refusal> {
    let (mut squared, mut dot) = (0.0, 0.0);
    let mut non_finite = None;
    for (difference, own) in differences.zip(own_delta) {
        let (name, d) = difference?;
        let d = d.flatten(0, -1);
        let norm = d.norm().double_value(&[]);
        if !norm.is_finite() && non_finite.is_none() {
            let finite = d
                .isfinite()
                .all()
                .f_int64_value(&[])
                .map_err(|e| malformed(&name, e))?;
            if finite == 0 {
                non_finite = Some(name);
            }
        }
        squared += norm * norm;
        dot += d.dot(&own.flatten(0, -1)).double_value(&[]);
    }
    let distance = squared.sqrt();
    let cosine = (distance > 0.0 && own_distance > 0.0).then(|| dot / (distance * own_distance));
    Ok(PayloadStats {
        non_finite,
        distance,
        cosine,
        loss: None,
    })
}

/// The functional check's held-out batches: up to [`CHECK_SLICES`] batches of `[gate]
/// check_tokens` of whole validation sequences each, at least one (none when the check is off or
/// the data has no validation split, with a warning).
fn check_batches(data: &TokenDataset, manifest: &RunManifest) -> Vec<Batch> {
    let tokens = manifest.gate.check_tokens as usize;
    if tokens == 0 {
        return Vec::new();
    }
    let sequences = (tokens / manifest.data.seq_len.max(1)).max(1);
    let batches = gasloc_data::stream::validation_batches(
        data,
        manifest.data.seq_len,
        sequences,
        CHECK_SLICES,
    );
    match batches {
        Ok(batches) => batches,
        Err(e) => {
            tracing::warn!("the payload gate's functional check is off: no held-out batch ({e})");
            Vec::new()
        }
    }
}

/// How many slices of the validation split the functional check takes turns over.
const CHECK_SLICES: usize = 8;

/// The data order of a node: the run's seed mixed with its peer id.
fn stream_seed(run_seed: u64, peer: &PeerId) -> u64 {
    let digest = Sha256::new()
        .chain_update(run_seed.to_le_bytes())
        .chain_update(peer.to_bytes())
        .finalize();
    u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(outer: &str) -> RunManifest {
        let text = format!(
            "name = \"t\"\nseed = 1\n[model]\nsize = \"tiny\"\n[data]\ntokenizer = \"byte\"\nseq_len = 8\nmicro_batch = 1\n[optimizer]\ndecay_steps = 10\n[outer]\n{outer}\n"
        );
        RunManifest::parse(&text, "t").unwrap()
    }

    #[test]
    fn join_refuses_what_it_does_not_run_naming_the_key() {
        assert!(check_supported(&manifest("topology = \"two-peer\"")).is_ok());
        assert!(check_supported(&manifest("algorithm = \"diloco\"")).is_ok());
        let refused = |outer: &str| check_supported(&manifest(outer)).unwrap_err().to_string();
        assert!(refused("algorithm = \"dadam\"").contains("algorithm"));
        assert!(check_supported(&manifest("inner_optimizer = \"lordo\"")).is_ok());
        assert!(check_supported(&manifest(
            "inner_optimizer = \"lordo\"\npayload = \"lordo\""
        ))
        .is_ok());
        assert!(refused("inner_optimizer = \"lordo\"\noverlap = \"delayed\"").contains("overlap"));
        assert!(check_supported(&manifest("overlap = \"delayed\"")).is_ok());
        assert!(check_supported(&manifest("overlap = \"eager\"")).is_ok());
    }
}
