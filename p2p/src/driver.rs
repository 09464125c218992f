//! The round driver: runs rounds of commit-reveal, local work and exchange on a live swarm.
//!
//! It feeds network events and wall-clock time into a [`RoundSchedule`], carries out its
//! actions (publish commits and reveals), asks the [`RoundWork`] (the libtorch trainer or
//! the synthetic one) for the round's inner steps, swaps payloads with the round's
//! neighbours through the [`ExchangeService`], and hands what arrived back to the work for
//! the mixing and the outer step. Rounds follow the wall clock (`genesis + t·period`): no
//! round waits for the whole swarm, and a neighbour that vanishes costs at most one
//! exchange timeout.
//!
//! The inner steps get a deadline: the round's end minus the predicted exchange time `C_i`
//! and the outer step's measured time, so a node on a slow link does fewer inner steps
//! instead of missing rounds (`ALGORITHMS.md` §2). `C_i` is this round's payload bytes times
//! the measured seconds per byte of past swaps. A swap is timed from the moment both sides
//! were ready to its end (no wait for a partner still training counts), per peer as a
//! moving average, and for the node's own link as the fastest swap of the last rounds (a
//! swap is no faster than either side's link, so a slow partner does not make this node
//! look slow). `C_i` is predicted at the round's start from the node's own link, and again,
//! moving the deadline, once the round's neighbours are known — the slowest of its own
//! link, what it measured with each neighbour and the goodput each neighbour announced
//! (every node publishes an `Announce` with its own link's goodput, capped by
//! `--max-upload-rate`, beside its commit), so that the partner of a slow node stops
//! training early enough even when they never met.
//!
//! One [`RoundRecord`] per round says what this node saw and did; the node's `/status`
//! document is kept current through a `watch` channel.

use crate::exchange::{OutgoingPayload, SendOptions};
use crate::exchange_service::{ExchangeResults, ExchangeService};
use crate::network::{unix_ms, Client, NetworkEvent};
use crate::schedule::{Action, RoundPlan, RoundSchedule, Timing};
use crate::tensors::TensorSet;
use crate::work::{Finished, Received, RoundWork, TrainDeadline, TrainOrder, Trained, WorkFuture};
use gasloc_proto::topology::Topology;
use gasloc_proto::wire::{
    control_message::Body, Announce, Commit, ControlMessage, PayloadKind, Reveal,
};
use gasloc_status::{NodeState, NodeStatus};
use libp2p::PeerId;
use rand::RngCore;
use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What the driver does besides the schedule's timing.
#[derive(Debug, Clone)]
pub struct DriverOptions {
    /// Stop after this many finished rounds (`u64::MAX`: until stopped).
    pub rounds: u64,
    /// Fault injection for tests: never publish reveals (the node gets excluded).
    pub withhold_reveals: bool,
    pub send: SendOptions,
}

/// What one node saw and did in one round (peer ids as base58 strings).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RoundRecord {
    pub peer: String,
    pub round: u64,
    pub is_member: bool,
    pub members: Vec<String>,
    pub permutation: Vec<String>,
    pub neighbours: Vec<String>,
    /// Neighbours whose payload arrived and passed every check.
    pub exchanged: Vec<String>,
    /// Neighbours that failed, with the reason.
    pub failed: Vec<(String, String)>,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Inner steps taken (H_i) and the moving average of one step, seconds.
    pub inner_steps: u64,
    pub step_time_s: f64,
    /// Seconds from the round start the inner steps were given (their final deadline), and
    /// the exchange time predicted for the round.
    pub budget_s: f64,
    pub predicted_exchange_s: f64,
    /// Seconds from the start of the exchange until every neighbour's result was in.
    pub exchange_s: f64,
    /// Seconds the slowest swap took from both sides being ready to its end: the link's
    /// share of `exchange_s` (what `predicted_exchange_s` predicts).
    pub transfer_s: f64,
    /// Seconds from "payload ready" until every neighbour's result was in (agreement and
    /// neighbours included).
    pub wait_s: f64,
    /// Seconds of the mixing and outer step.
    pub finish_s: f64,
    /// Seconds from the round start until its outer step was done.
    pub round_s: f64,
    pub train_loss: Option<f64>,
    pub val_loss: Option<f64>,
    /// Milliseconds from the round start until the round was decided.
    pub decided_after_ms: u64,
    /// Milliseconds from the opening of the round's commit window (when members publish
    /// their commits, during the round before) to the last commit received from another
    /// peer.
    pub last_commit_after_ms: u64,
    /// Milliseconds from the round start (when members publish their reveals) to the last
    /// reveal received.
    pub last_reveal_after_ms: u64,
    /// Control messages about this round this node received (commits, announces, reveals).
    pub control_messages: u64,
    /// Peers this node had a connection to when the round ended.
    pub connected_peers: usize,
    /// AutoNAT's verdict when the round ended: `unknown`, `public` or `private`.
    pub reachability: String,
    /// Hole punches (relayed connections made direct) since the node started.
    pub hole_punches: u64,
}

async fn join_opt<T>(handle: &mut Option<JoinHandle<T>>) -> Result<T, tokio::task::JoinError> {
    match handle {
        Some(h) => h.await,
        None => std::future::pending().await,
    }
}

async fn work_opt<T>(future: &mut Option<WorkFuture<T>>) -> anyhow::Result<T> {
    match future {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// The work's future with its tensors made ready to send (`take` moves them out of the
/// output). A payload's checksums take a while for a large model (blake3 over every
/// byte), so they are computed on a blocking thread, not on the runtime's workers.
fn ready_to_send<T: Send + 'static>(
    work: WorkFuture<T>,
    kind: PayloadKind,
    options: SendOptions,
    take: fn(&mut T) -> TensorSet,
) -> WorkFuture<(Arc<OutgoingPayload>, T)> {
    Box::pin(async move {
        let mut output = work.await?;
        let set = take(&mut output);
        let payload =
            tokio::task::spawn_blocking(move || OutgoingPayload::new(kind, Arc::new(set), options))
                .await?;
        Ok((Arc::new(payload), output))
    })
}

/// Drives rounds until `options.rounds` have finished or `stop` is cancelled.
pub struct RoundDriver {
    pub client: Client,
    pub events: mpsc::UnboundedReceiver<NetworkEvent>,
    pub schedule: RoundSchedule,
    pub service: ExchangeService,
    pub work: Box<dyn RoundWork>,
    pub options: DriverOptions,
    pub run_id: [u8; 32],
    /// The node's `/status` document, updated as the round moves on.
    pub status: watch::Sender<NodeStatus>,
    /// Cancelled to leave: the round in flight finishes its exchange (bounded by the
    /// exchange timeout) and outer step, then the work is closed.
    pub stop: CancellationToken,
}

/// The round in flight.
struct Active {
    round: u64,
    started: Instant,
    plan: Option<RoundPlan>,
    decided_at: u64,
    deadline: TrainDeadline,
    predicted_exchange: Duration,
    trained: Option<(Arc<OutgoingPayload>, Trained)>,
    ready_at: Option<Instant>,
    exchange_started: Option<Instant>,
    /// Results, the exchange's duration and the wait, once the exchange is over.
    exchanged: Option<(ExchangeResults, Duration, Duration)>,
    finish_started: Option<Instant>,
}

/// What the node measured, for the next rounds' deadlines. Link times are seconds per
/// payload byte, over all the bytes the node swapped at once (a two-peer round sends its
/// payload twice over the same link).
#[derive(Debug, Default)]
struct Measurements {
    /// Per peer: moving average of the swaps with it.
    peer_s_per_byte: HashMap<PeerId, f64>,
    /// The fastest swap of each of the last [`Self::RECENT_ROUNDS`] rounds with one.
    recent_fastest: VecDeque<f64>,
    /// The goodput each peer announced last, bytes per second.
    announced: HashMap<PeerId, u64>,
    /// Seconds of the outer step.
    finish_s: Option<f64>,
}

impl Measurements {
    const RECENT_ROUNDS: usize = 8;

    fn record_exchange(&mut self, payload_bytes: u64, results: &ExchangeResults) {
        if results.is_empty() || payload_bytes == 0 {
            return;
        }
        let bytes = payload_bytes as f64 * results.len() as f64;
        let mut fastest: Option<f64> = None;
        for (peer, result) in results {
            if let Ok(swapped) = result {
                let per_byte = swapped.transfer.as_secs_f64() / bytes;
                let old = self.peer_s_per_byte.get(peer).copied();
                self.peer_s_per_byte
                    .insert(*peer, moving_average(old, per_byte));
                fastest = Some(fastest.map_or(per_byte, |f| f.min(per_byte)));
            }
        }
        if let Some(fastest) = fastest {
            self.recent_fastest.push_back(fastest);
            if self.recent_fastest.len() > Self::RECENT_ROUNDS {
                self.recent_fastest.pop_front();
            }
        }
    }

    /// This node's own link: the fastest recent swap (a swap is no faster than either
    /// side's link, so the best recent one bounds this node's own).
    fn own_s_per_byte(&self) -> Option<f64> {
        self.recent_fastest.iter().copied().reduce(f64::min)
    }
}

fn moving_average(old: Option<f64>, new: f64) -> f64 {
    match old {
        Some(old) => 0.5 * old + 0.5 * new,
        None => new,
    }
}

impl RoundDriver {
    /// Runs the rounds; `on_record` sees each record as soon as its round ends. After the
    /// last round it keeps the swarm up for one exchange timeout, so that partners can finish
    /// reading, and closes the work (its checkpoint). An error of the work ends the run.
    pub async fn run(
        mut self,
        mut on_record: impl FnMut(&RoundRecord),
    ) -> anyhow::Result<Vec<RoundRecord>> {
        let me = self.client.peer_id();
        let timing = self.schedule.timing().clone();
        let table = Arc::new(self.work.payload_table());
        let payload_bytes: u64 = table.iter().filter_map(|t| t.byte_length()).sum();
        // The next round to commit to (its commit window opens during the round before it),
        // and the next round to run (one this node committed to).
        let mut next_commit = timing.next_joinable_round(unix_ms());
        let mut next_round = next_commit;
        let (mut committed, mut skipped) = (0u64, 0u64);
        // Plans of rounds decided before this node started them (it was still finishing the
        // round before).
        let mut early_plans: HashMap<u64, (RoundPlan, u64)> = HashMap::new();
        // Control messages received per round they are about.
        let mut control_counts: HashMap<u64, u64> = HashMap::new();
        let mut active: Option<Active> = None;
        let mut training: Option<WorkFuture<(Arc<OutgoingPayload>, Trained)>> = None;
        let mut finishing: Option<WorkFuture<(Arc<OutgoingPayload>, Finished)>> = None;
        let mut exchange: Option<JoinHandle<ExchangeResults>> = None;
        let mut measured = Measurements::default();
        let mut records = Vec::new();
        let mut stopping = false;
        let mut outcome = Ok(());
        loop {
            if records.len() as u64 + skipped >= self.options.rounds
                || (stopping && active.is_none())
            {
                break;
            }
            let now = unix_ms();
            let mut wake = self.schedule.next_wakeup().unwrap_or(u64::MAX);
            if active.is_none() {
                wake = wake.min(timing.round_start(next_round));
            }
            if !stopping && committed < self.options.rounds {
                wake = wake.min(timing.commit_opens(next_commit));
            }
            let sleep = Duration::from_millis(wake.saturating_sub(now).min(60_000));
            tokio::select! {
                _ = self.stop.cancelled(), if !stopping => {
                    stopping = true;
                    tracing::info!("leaving: finishing the round in flight");
                    // Rounds committed to but not yet revealed are given up: every peer
                    // leaves this node out of them alike.
                    self.schedule.withdraw_from(0);
                    self.set_state(NodeState::Stopping);
                }
                event = self.events.recv() => match event {
                    Some(event) => {
                        if let NetworkEvent::Control { message, .. } = &event {
                            *control_counts.entry(message.round).or_default() += 1;
                        }
                        self.on_event(event, &mut measured)
                    }
                    None => {
                        tracing::warn!("network stopped; ending the round driver");
                        break;
                    }
                },
                _ = tokio::time::sleep(sleep) => {}
                done = work_opt(&mut training) => {
                    training = None;
                    match done {
                        Ok((payload, trained)) => {
                            if let Some(a) = active.as_mut() {
                                self.status.send_modify(|s| {
                                    s.inner_steps = trained.inner_steps;
                                    s.step_time_s = trained.step_time_s;
                                    if trained.train_loss.is_some() {
                                        s.train_loss = trained.train_loss;
                                    }
                                    s.state = if a.plan.is_some() {
                                        NodeState::Exchanging
                                    } else {
                                        NodeState::Agreeing
                                    };
                                });
                                a.trained = Some((payload, trained));
                                a.ready_at = Some(Instant::now());
                            }
                        }
                        Err(e) => {
                            outcome = Err(e.context("the trainer failed"));
                            break;
                        }
                    }
                }
                done = join_opt(&mut exchange) => {
                    exchange = None;
                    let results = done.expect("exchange task does not panic");
                    if let Some(a) = active.as_mut() {
                        let now = Instant::now();
                        let took = a.exchange_started.map_or(Duration::ZERO, |t| now - t);
                        let waited = a.ready_at.map_or(Duration::ZERO, |t| now - t);
                        measured.record_exchange(payload_bytes, &results);
                        let received = Received {
                            round: a.round,
                            neighbours: a.plan.as_ref().map(|p| p.neighbours.clone()).unwrap_or_default(),
                            payloads: results
                                .iter()
                                .filter_map(|(p, r)| r.as_ref().ok().map(|s| (*p, s.tensors.clone())))
                                .collect(),
                        };
                        a.exchanged = Some((results, took, waited));
                        a.finish_started = Some(Instant::now());
                        finishing = Some(ready_to_send(
                            self.work.finish(received),
                            PayloadKind::State,
                            self.options.send.clone(),
                            |f| std::mem::take(&mut f.state),
                        ));
                    }
                }
                done = work_opt(&mut finishing) => {
                    finishing = None;
                    let (state, finished) = match done {
                        Ok(done) => done,
                        Err(e) => {
                            outcome = Err(e.context("the outer step failed"));
                            break;
                        }
                    };
                    if let Some(a) = active.take() {
                        self.service.set_state(a.round + 1, state);
                        let mut record =
                            make_record(&me, a, &timing, finished.val_loss, payload_bytes);
                        {
                            let status = self.status.borrow();
                            record.connected_peers = status.connected_peers;
                            record.reachability = status.reachability.clone();
                            record.hole_punches = status.hole_punches;
                        }
                        record.control_messages =
                            control_counts.remove(&record.round).unwrap_or(0);
                        control_counts.retain(|&round, _| round > record.round);
                        measured.finish_s = Some(moving_average(measured.finish_s, record.finish_s));
                        self.publish_record(&record);
                        on_record(&record);
                        next_round = record.round + 1;
                        records.push(record);
                    }
                }
            }
            let now = unix_ms();
            // Commit to the next round when its commit window opens, with an `Announce` of
            // this node's H_i, step time and link for its partners' deadlines.
            if !stopping
                && committed < self.options.rounds
                && now >= timing.commit_opens(next_commit)
            {
                if now >= timing.commit_closes(next_commit) {
                    let skip_to = timing.next_joinable_round(now);
                    tracing::warn!(
                        missed = next_commit,
                        next = skip_to,
                        "too late to commit to a round"
                    );
                    next_commit = skip_to;
                } else {
                    let mut nonce = [0u8; 32];
                    rand::rng().fill_bytes(&mut nonce);
                    match self.schedule.join_round(next_commit, nonce, now) {
                        Ok(Action::PublishCommit { round, commitment }) => {
                            let commitment = commitment.to_vec();
                            self.publish(round, Body::Commit(Commit { commitment }))
                                .await;
                            let announce = {
                                let status = self.status.borrow();
                                Announce {
                                    inner_steps: status.inner_steps as u32,
                                    step_time_us: (status.step_time_s * 1e6) as u64,
                                    goodput_bytes_per_s: self.own_goodput(&measured),
                                }
                            };
                            self.publish(round, Body::Announce(announce)).await;
                            committed += 1;
                        }
                        Ok(other) => tracing::error!(?other, "unexpected action from join_round"),
                        Err(e) => tracing::warn!(error = %e, "cannot commit to round"),
                    }
                    next_commit += 1;
                }
            }
            // Start the next round this node committed to when its time has come (never while
            // leaving: the round in flight ends normally, so that its partners get their
            // exchange). A round reached only after it ended is skipped.
            if !stopping
                && active.is_none()
                && next_round < next_commit
                && now >= timing.round_start(next_round)
            {
                let joined = self.schedule.has_joined(next_round);
                if !joined || now >= timing.round_start(next_round + 1) {
                    if joined {
                        tracing::warn!(round = next_round, "missed a round it committed to");
                        skipped += 1;
                    }
                    early_plans.remove(&next_round);
                    next_round += 1;
                } else {
                    let round = next_round;
                    self.service.advance_floor(round);
                    let predicted =
                        self.predicted_exchange(&measured, payload_bytes, &timing, None);
                    let deadline = TrainDeadline::new(
                        self.train_deadline(&timing, round, predicted, &measured),
                    );
                    // The payload moves into the outgoing message (no copy).
                    training = Some(ready_to_send(
                        self.work.train(TrainOrder {
                            round,
                            deadline: deadline.clone(),
                        }),
                        PayloadKind::Model,
                        self.options.send.clone(),
                        |t| std::mem::take(&mut t.payload),
                    ));
                    self.status.send_modify(|s| {
                        s.round = round;
                        s.state = NodeState::Training;
                        s.neighbours.clear();
                    });
                    let mut started = Active {
                        round,
                        started: Instant::now(),
                        plan: None,
                        decided_at: 0,
                        deadline,
                        predicted_exchange: predicted,
                        trained: None,
                        ready_at: None,
                        exchange_started: None,
                        exchanged: None,
                        finish_started: None,
                    };
                    if let Some((plan, decided_at)) = early_plans.remove(&round) {
                        self.take_plan(&mut started, plan, decided_at, &measured, payload_bytes);
                    }
                    active = Some(started);
                }
            }
            for action in self.schedule.poll(now) {
                match action {
                    Action::PublishReveal { round, nonce } => {
                        if self.options.withhold_reveals {
                            tracing::info!(round, "fault injection: withholding the reveal");
                        } else {
                            self.publish(
                                round,
                                Body::Reveal(Reveal {
                                    nonce: nonce.to_vec(),
                                }),
                            )
                            .await;
                        }
                    }
                    Action::Decided(plan) => match active.as_mut() {
                        Some(a) if a.round == plan.round => {
                            self.take_plan(a, plan, now, &measured, payload_bytes)
                        }
                        _ if plan.is_member && plan.round >= next_round => {
                            early_plans.insert(plan.round, (plan, now));
                        }
                        _ => {}
                    },
                    Action::PublishCommit { .. } => {}
                }
            }
            // Exchange once both the plan and the payload are there.
            if let Some(a) = active.as_mut() {
                if let (Some(plan), Some((payload, _)), None) =
                    (&a.plan, &a.trained, a.exchange_started)
                {
                    a.exchange_started = Some(Instant::now());
                    self.set_state(NodeState::Exchanging);
                    let service = self.service.clone();
                    let (round, neighbours, payload, table) = (
                        a.round,
                        plan.neighbours.clone(),
                        payload.clone(),
                        table.clone(),
                    );
                    let timeout = Duration::from_millis(timing.exchange_timeout_ms);
                    exchange = Some(tokio::spawn(async move {
                        if neighbours.is_empty() {
                            return Vec::new();
                        }
                        service
                            .exchange_round(round, &neighbours, payload, Some(table), timeout)
                            .await
                    }));
                }
            }
        }
        self.set_state(NodeState::Stopping);
        // Partners may still be reading the last bytes this node sent: keep the swarm up for
        // one exchange timeout before the caller shuts it down (cut short when leaving).
        if !stopping {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(timing.exchange_timeout_ms)) => {}
                _ = self.stop.cancelled() => {}
            }
        }
        let closed = self.work.close().await;
        self.set_state(NodeState::Stopped);
        outcome?;
        closed?;
        Ok(records)
    }

    /// Gives the round in flight its decided plan: its neighbours, and the train deadline
    /// predicted with their links.
    fn take_plan(
        &self,
        a: &mut Active,
        plan: RoundPlan,
        decided_at: u64,
        measured: &Measurements,
        payload_bytes: u64,
    ) {
        let timing = self.schedule.timing();
        let neighbours: Vec<String> = plan.neighbours.iter().map(|p| p.to_string()).collect();
        self.status.send_modify(|s| s.neighbours = neighbours);
        let predicted =
            self.predicted_exchange(measured, payload_bytes, timing, Some(&plan.neighbours));
        a.predicted_exchange = predicted;
        a.deadline
            .set(self.train_deadline(timing, a.round, predicted, measured));
        a.plan = Some(plan);
        a.decided_at = decided_at;
    }

    /// `C_i`: this round's payload bytes times the seconds per byte of the slowest link
    /// involved — this node's own and, once `neighbours` are known, what it measured with
    /// each and what each announced; before any swap was measured, the upload cap's (if
    /// any).
    fn predicted_exchange(
        &self,
        measured: &Measurements,
        payload_bytes: u64,
        timing: &Timing,
        neighbours: Option<&[PeerId]>,
    ) -> Duration {
        let count = match (neighbours, timing.topology) {
            (Some(n), _) => n.len() as f64,
            (None, Topology::TwoPeer) => 2.0,
            (None, _) => 1.0,
        };
        let bytes = payload_bytes as f64 * count;
        let own = measured.own_s_per_byte().or_else(|| {
            let limit = self.options.send.upload_limit.as_ref()?;
            Some(1.0 / limit.bytes_per_s() as f64)
        });
        let per_byte = match neighbours {
            Some(n) if !n.is_empty() => n
                .iter()
                .filter_map(|p| {
                    let seen = measured.peer_s_per_byte.get(p).copied();
                    let announced = measured.announced.get(p).map(|&g| 1.0 / g as f64);
                    [own, seen, announced]
                        .into_iter()
                        .flatten()
                        .reduce(f64::max)
                })
                .reduce(f64::max),
            _ => own,
        };
        let seconds = per_byte.map_or(0.0, |s| s * bytes);
        Duration::from_secs_f64(seconds.min(timing.exchange_timeout_ms as f64 / 1000.0))
    }

    /// The goodput this node announces: its own link's (the fastest recent swap), at most
    /// its upload cap; 0 when unknown.
    fn own_goodput(&self, measured: &Measurements) -> u64 {
        let seen = measured.own_s_per_byte().map(|s| 1.0 / s.max(1e-12));
        let cap = self
            .options
            .send
            .upload_limit
            .as_ref()
            .map(|l| l.bytes_per_s() as f64);
        match (seen, cap) {
            (Some(a), Some(b)) => a.min(b) as u64,
            (a, b) => a.or(b).unwrap_or(0.0) as u64,
        }
    }

    /// When the inner steps of `round` should end: the round's end less the predicted
    /// exchange, the measured outer step and a margin of 5 % of the period.
    fn train_deadline(
        &self,
        timing: &Timing,
        round: u64,
        predicted_exchange: Duration,
        measured: &Measurements,
    ) -> u64 {
        let reserve = predicted_exchange
            + Duration::from_secs_f64(measured.finish_s.unwrap_or(0.0))
            + Duration::from_millis(timing.period_ms / 20);
        timing
            .round_start(round + 1)
            .saturating_sub(reserve.as_millis() as u64)
    }

    fn set_state(&self, state: NodeState) {
        self.status.send_modify(|s| s.state = state);
    }

    fn publish_record(&self, record: &RoundRecord) {
        let goodput: Vec<(String, f64)> = record
            .exchanged
            .iter()
            .map(|p| {
                let per_peer = record.bytes_received as f64 / record.exchanged.len() as f64;
                (p.clone(), per_peer / record.transfer_s.max(1e-6))
            })
            .collect();
        self.status.send_modify(|s| {
            s.state = NodeState::Training;
            s.goodput.extend(goodput);
            s.record_round(gasloc_status::RoundRecord {
                round: record.round,
                neighbours: record.neighbours.clone(),
                inner_steps: record.inner_steps,
                train_loss: record.train_loss,
                val_loss: record.val_loss,
                bytes_sent: record.bytes_sent,
                bytes_received: record.bytes_received,
                wait_s: record.wait_s,
                round_s: record.round_s,
            });
        });
    }

    fn on_event(&mut self, event: NetworkEvent, measured: &mut Measurements) {
        let now = unix_ms();
        let (source, message) = match event {
            NetworkEvent::Control { source, message } => (source, message),
            NetworkEvent::Connected(_) | NetworkEvent::Disconnected(_) => {
                let delta: isize = if matches!(event, NetworkEvent::Connected(_)) {
                    1
                } else {
                    -1
                };
                self.status.send_modify(|s| {
                    s.connected_peers = s.connected_peers.saturating_add_signed(delta)
                });
                return;
            }
            NetworkEvent::Reachability(reachability) => {
                self.status
                    .send_modify(|s| s.reachability = reachability.as_str().into());
                return;
            }
            NetworkEvent::HolePunched(_) => {
                self.status.send_modify(|s| s.hole_punches += 1);
                return;
            }
            NetworkEvent::Subscribed(_) => return,
        };
        let result = match message.body {
            Some(Body::Commit(c)) => match c.commitment.as_slice().try_into() {
                Ok(c) => self.schedule.on_commit(source, message.round, c, now),
                Err(_) => return,
            },
            Some(Body::Reveal(r)) => match r.nonce.as_slice().try_into() {
                Ok(n) => self.schedule.on_reveal(source, message.round, n, now),
                Err(_) => return,
            },
            Some(Body::Announce(a)) => {
                if a.goodput_bytes_per_s > 0 {
                    measured.announced.insert(source, a.goodput_bytes_per_s);
                }
                return;
            }
            None => return,
        };
        if let Err(e) = result {
            if e.is_misbehaviour() {
                tracing::warn!(%source, error = %e, "misbehaving control message");
            } else {
                tracing::debug!(%source, error = %e, "control message not recorded");
            }
        }
    }

    async fn publish(&self, round: u64, body: Body) {
        let message = ControlMessage {
            run_id: self.run_id.to_vec(),
            round,
            body: Some(body),
        };
        if let Err(e) = self.client.publish(message).await {
            tracing::warn!(round, error = %e, "publishing a control message failed");
        }
    }
}

fn make_record(
    me: &PeerId,
    a: Active,
    timing: &Timing,
    val_loss: Option<f64>,
    payload_bytes: u64,
) -> RoundRecord {
    let round_start = timing.round_start(a.round);
    let strings = |v: &[PeerId]| v.iter().map(|p| p.to_string()).collect::<Vec<_>>();
    let plan = a.plan.as_ref();
    let mut exchanged = Vec::new();
    let mut failed = Vec::new();
    let mut bytes_received = 0;
    let mut transfer = Duration::ZERO;
    let (results, exchange, wait) = a.exchanged.unwrap_or_default();
    for (peer, result) in results {
        match result {
            Ok(swapped) => {
                bytes_received += swapped.tensors.byte_length();
                transfer = transfer.max(swapped.transfer);
                exchanged.push(peer.to_string());
            }
            Err(e) => failed.push((peer.to_string(), e.to_string())),
        }
    }
    let trained = a.trained.as_ref().map(|(_, t)| t);
    RoundRecord {
        peer: me.to_string(),
        round: a.round,
        is_member: plan.is_some_and(|p| p.is_member),
        members: plan.map(|p| strings(&p.members)).unwrap_or_default(),
        permutation: plan.map(|p| strings(&p.permutation)).unwrap_or_default(),
        neighbours: plan.map(|p| strings(&p.neighbours)).unwrap_or_default(),
        bytes_sent: payload_bytes * exchanged.len() as u64,
        exchanged,
        failed,
        bytes_received,
        inner_steps: trained.map_or(0, |t| t.inner_steps),
        step_time_s: trained.map_or(0.0, |t| t.step_time_s),
        budget_s: a.deadline.unix_ms().saturating_sub(round_start) as f64 / 1000.0,
        predicted_exchange_s: a.predicted_exchange.as_secs_f64(),
        exchange_s: exchange.as_secs_f64(),
        transfer_s: transfer.as_secs_f64(),
        wait_s: wait.as_secs_f64(),
        finish_s: a.finish_started.map_or(0.0, |t| t.elapsed().as_secs_f64()),
        round_s: a.started.elapsed().as_secs_f64(),
        train_loss: trained.and_then(|t| t.train_loss),
        val_loss,
        decided_after_ms: a.decided_at.saturating_sub(round_start),
        last_commit_after_ms: plan.map_or(0, |p| {
            p.last_commit_at_ms
                .saturating_sub(timing.commit_opens(a.round))
        }),
        last_reveal_after_ms: plan.map_or(0, |p| {
            p.last_reveal_at_ms
                .saturating_sub(timing.commit_deadline(a.round))
        }),
        control_messages: 0,
        connected_peers: 0,
        reachability: String::new(),
        hole_punches: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exchange::ExchangeError;
    use crate::exchange_service::Swapped;

    fn swap(peer: PeerId, seconds: f64) -> (PeerId, Result<Swapped, ExchangeError>) {
        let swapped = Swapped {
            tensors: TensorSet::default(),
            transfer: Duration::from_secs_f64(seconds),
        };
        (peer, Ok(swapped))
    }

    #[test]
    fn a_slow_partner_does_not_make_the_own_link_look_slow() {
        let (fast, slow) = (PeerId::random(), PeerId::random());
        let mut m = Measurements::default();
        m.record_exchange(1000, &vec![swap(fast, 0.01)]);
        m.record_exchange(1000, &vec![swap(slow, 2.0)]);
        // Its own link is the fastest recent swap; the slow peer is remembered as slow.
        assert_eq!(m.own_s_per_byte(), Some(0.01 / 1000.0));
        assert_eq!(m.peer_s_per_byte[&slow], 2.0 / 1000.0);
        assert_eq!(m.peer_s_per_byte[&fast], 0.01 / 1000.0);
        // Per peer, a moving average.
        m.record_exchange(1000, &vec![swap(slow, 1.0)]);
        assert_eq!(m.peer_s_per_byte[&slow], 1.5 / 1000.0);
    }

    #[test]
    fn own_link_follows_the_last_rounds_and_counts_every_neighbour_of_a_round() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let mut m = Measurements::default();
        m.record_exchange(1000, &vec![swap(a, 0.01)]);
        // The link got slower: after RECENT_ROUNDS rounds the old fast swap is forgotten.
        for _ in 0..Measurements::RECENT_ROUNDS {
            m.record_exchange(1000, &vec![swap(a, 1.0)]);
        }
        assert_eq!(m.own_s_per_byte(), Some(1.0 / 1000.0));
        // Two neighbours at once share the link: 2000 bytes moved in 1 s.
        m.record_exchange(
            1000,
            &vec![
                swap(a, 1.0),
                (b, Err(ExchangeError::Deadline(Duration::from_secs(1)))),
            ],
        );
        assert_eq!(m.own_s_per_byte(), Some(1.0 / 2000.0));
        assert!(
            !m.peer_s_per_byte.contains_key(&b),
            "a failed swap measures nothing"
        );
        // A round without any completed swap changes nothing.
        let before = m.recent_fastest.clone();
        m.record_exchange(
            1000,
            &vec![(b, Err(ExchangeError::Deadline(Duration::ZERO)))],
        );
        assert_eq!(m.recent_fastest, before);
    }
}
