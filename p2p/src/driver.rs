//! The round driver: the async shell around a [`RoundMachine`], on a live swarm.
//!
//! The machine decides everything about a round (commit-reveal, deadlines, the exchange's
//! start, the mixing row, the record; see `round_machine.rs`); the driver only carries out
//! its outputs and feeds it inputs: network events and the wall clock, the [`RoundWork`]'s
//! results (the libtorch trainer or the synthetic one), and the [`ExchangeService`]'s
//! outcome per neighbour. It owns what the machine must not see: the payload tensors.
//!
//! Heavy work stays off the runtime's threads: a payload's checksums (blake3 over every
//! byte) are computed on a blocking thread, and a received payload moves into the outer
//! step without a copy. The node's `/status` document is kept current through a `watch`
//! channel.

use crate::exchange::{ExchangeError, OutgoingPayload, SendOptions};
use crate::exchange_service::{ExchangeResults, ExchangeService};
use crate::network::{unix_ms, Client, NetworkEvent};
use crate::peer_standing::{Ban, BanFile, OffenceInbox, PeerStanding};
pub use crate::round_machine::RoundRecord;
use crate::round_machine::{Input, MachineConfig, Outcome, Output, RoundMachine, StatusChange};
use crate::schedule::{RoundSchedule, Timing};
use crate::tensors::TensorSet;
use crate::work::{
    Arrived, Candidate, Finished, GateReading, Received, RoundWork, Screened, TrainDeadline,
    TrainOrder, Trained, WorkFuture,
};
use gasloc_proto::wire::{control_message::Body, ControlMessage, PayloadKind};
use gasloc_status::{NodeState, NodeStatus};
use libp2p::PeerId;
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
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
    /// The peers' offences and this node's bans, as they stand when the rounds begin (the
    /// bans loaded from the node's home, or none).
    pub standing: PeerStanding,
    /// Where new bans are written, so a restarted node keeps them (`None`: not kept).
    pub ban_file: Option<PathBuf>,
    /// Offences found beside the rounds (bad shard bytes from the data fetch), counted with
    /// each round's own.
    pub offences: OffenceInbox,
    /// Overlapped rounds (`[outer] overlap`): the next round trains while this one's
    /// exchange and outer step run ([`MachineConfig::overlap`]); the work must take a
    /// `finish` call while a `train` call is under way.
    pub overlap: bool,
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

/// The work's future with its tensors, if any, made ready to send (`take` moves them out of
/// the output). A payload's checksums take a while for a large model (blake3 over every
/// byte), so they are computed on a blocking thread, not on the runtime's workers.
fn ready_to_send<T: Send + 'static>(
    work: WorkFuture<T>,
    kind: PayloadKind,
    options: SendOptions,
    take: fn(&mut T) -> Option<TensorSet>,
) -> WorkFuture<(Option<Arc<OutgoingPayload>>, T)> {
    Box::pin(async move {
        let mut output = work.await?;
        let Some(set) = take(&mut output) else {
            return Ok((None, output));
        };
        let payload =
            tokio::task::spawn_blocking(move || OutgoingPayload::new(kind, Arc::new(set), options))
                .await?;
        Ok((Some(Arc::new(payload)), output))
    })
}

/// Work under way for a round: the round, and the work's output with its tensors (if any)
/// made ready to send.
type ForRound<T> = WorkFuture<(u64, (Option<Arc<OutgoingPayload>>, T))>;

/// `work`, its output labelled with the round it is for.
fn of_round<T: Send + 'static>(round: u64, work: WorkFuture<T>) -> WorkFuture<(u64, T)> {
    Box::pin(async move { Ok((round, work.await?)) })
}

/// Drives rounds until `options.rounds` have finished or `stop` is cancelled. Built by
/// [`crate::swarm_node::JoinedNode::take_part`], the one wiring of a node.
pub struct RoundDriver {
    pub(crate) client: Client,
    pub(crate) events: mpsc::UnboundedReceiver<NetworkEvent>,
    /// The run's round timing (the driver's commit-reveal schedule is made from it).
    pub(crate) timing: Timing,
    pub(crate) service: ExchangeService,
    pub(crate) work: Box<dyn RoundWork>,
    pub(crate) options: DriverOptions,
    pub(crate) run_id: gasloc_proto::RunId,
    /// The node's `/status` document, updated as the round moves on.
    pub(crate) status: watch::Sender<NodeStatus>,
    /// Cancelled to leave: the round in flight finishes its exchange (bounded by the
    /// exchange timeout) and outer step, then the work is closed.
    pub(crate) stop: CancellationToken,
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
        let timing = self.timing.clone();
        let tables = self.work.payload_tables();
        let config = MachineConfig {
            rounds: self.options.rounds,
            payload_bytes: tables.bytes(),
            upload_cap: self
                .options
                .send
                .upload_limit
                .as_ref()
                .map(|l| l.bytes_per_s()),
            withhold_reveals: self.options.withhold_reveals,
            overlap: self.options.overlap,
        };
        let schedule = RoundSchedule::new(timing.clone(), *self.run_id.as_bytes(), me);
        let mut machine = RoundMachine::new(
            me,
            config,
            schedule,
            StdRng::from_rng(&mut rand::rng()),
            unix_ms(),
        )
        .with_standing(self.options.standing.clone());
        // What the machine must not see: the round's payload, and what arrived.
        let mut deadline = TrainDeadline::default();
        let mut payload: Option<Arc<OutgoingPayload>> = None;
        let mut arrived: ExchangeResults = Vec::new();
        // Each piece of work in flight carries its round to its completion.
        let mut training: Option<ForRound<Trained>> = None;
        let mut exchange: Option<JoinHandle<(u64, ExchangeResults)>> = None;
        let mut screening: Option<WorkFuture<Gated>> = None;
        // The last payload gate's round, duration and readings, for that round's record.
        let mut gate_took: Option<(u64, Duration, Vec<GateReading>)> = None;
        let mut finishing: Option<ForRound<Finished>> = None;
        let mut records = Vec::new();
        // Bans from an earlier life of this node hold from the start (the machine refuses a
        // banned neighbour without an exchange; the network refuses its connections).
        for ban in machine.standing().bans() {
            if let Ok(peer) = ban.peer.parse::<PeerId>() {
                let _ = self.client.ban(peer).await;
            }
        }
        self.apply(StatusChange::Standing {
            banned: machine.standing().bans().cloned().collect(),
            scores: machine.standing().scores(0),
        });
        // Whether a ban came in this batch of outputs (the ban list is written once).
        let mut banned_now = false;
        let mut stopping = false;
        let mut outcome = Ok(());
        let mut outputs = machine.handle(Input::Tick, unix_ms());
        loop {
            for output in outputs.drain(..) {
                match output {
                    Output::Publish { round, body } => self.publish(round, body).await,
                    Output::StartTraining { round, deadline_ms } => {
                        self.service.advance_floor(round);
                        deadline = TrainDeadline::new(deadline_ms);
                        // The payload moves into the outgoing message (no copy).
                        training = Some(of_round(
                            round,
                            ready_to_send(
                                self.work.train(TrainOrder {
                                    round,
                                    deadline: deadline.clone(),
                                }),
                                tables.kind,
                                self.options.send.clone(),
                                |t| Some(std::mem::take(&mut t.payload)),
                            ),
                        ));
                    }
                    Output::MoveDeadline { deadline_ms, .. } => deadline.set(deadline_ms),
                    Output::StartExchange { round, neighbours } => {
                        tracing::info!(
                            "round {round}: exchange started with {} neighbour(s)",
                            neighbours.len()
                        );
                        let (service, table) = (self.service.clone(), tables.for_round(round));
                        let timeout = Duration::from_millis(timing.exchange_timeout_ms);
                        // A payload is sent in one exchange: it moves into it. The round is
                        // registered here, before a `StartTraining` of the next round in
                        // these outputs raises the service's floor past it.
                        let registered = payload.take().map(|payload| {
                            service.register_round(
                                round,
                                &neighbours,
                                payload,
                                Some(table),
                                timeout,
                            )
                        });
                        exchange = Some(tokio::spawn(async move {
                            // The payload is stored before the `Trained` input that leads
                            // here; without one, every neighbour fails and the round goes on.
                            let Some(registered) = registered else {
                                let failed =
                                    || ExchangeError::Cancelled("no payload to send".into());
                                let results =
                                    neighbours.iter().map(|p| (*p, Err(failed()))).collect();
                                return (round, results);
                            };
                            (round, service.exchange_registered(registered).await)
                        }));
                    }
                    Output::Finish {
                        round,
                        mixing,
                        arrived: terms,
                    } => {
                        // Each payload the row names moves into the outer step.
                        let mut payloads = Vec::with_capacity(terms.len());
                        for (index, peer) in terms {
                            let position =
                                arrived.iter().position(|(p, r)| *p == peer && r.is_ok());
                            if let Some(Ok(swapped)) = position.map(|i| arrived.swap_remove(i).1) {
                                payloads.push(Arrived {
                                    index,
                                    peer,
                                    tensors: swapped.tensors,
                                });
                            }
                        }
                        arrived.clear();
                        // The late-joiner state is made only when someone asked for it.
                        let want_state = self.service.take_state_wanted();
                        finishing = Some(of_round(
                            round,
                            ready_to_send(
                                self.work.finish(Received {
                                    round,
                                    mixing,
                                    payloads,
                                    want_state,
                                }),
                                PayloadKind::State,
                                self.options.send.clone(),
                                |f| f.state.take(),
                            ),
                        ));
                    }
                    Output::Record(mut record) => {
                        {
                            let status = self.status.borrow();
                            record.connected_peers = status.connected_peers;
                            record.reachability = status.reachability;
                            record.hole_punches = status.hole_punches;
                        }
                        if let Some((round, took, readings)) = gate_took.take() {
                            if round == record.round {
                                record.gate_s = took.as_secs_f64();
                                record.gate = readings;
                            }
                        }
                        self.publish_record(&record);
                        on_record(&record);
                        records.push(*record);
                    }
                    Output::Ban { peer, .. } => {
                        let _ = self.client.ban(peer).await;
                        banned_now = true;
                    }
                    Output::Score { peer, score } => {
                        let _ = self.client.set_score(peer, score).await;
                    }
                    Output::Status(change) => self.apply(change),
                }
            }
            if std::mem::take(&mut banned_now) {
                self.keep_bans(machine.standing().bans().cloned().collect())
                    .await;
            }
            if machine.is_done() {
                break;
            }
            let now = unix_ms();
            let wake = machine.next_wakeup().unwrap_or(u64::MAX);
            let sleep = Duration::from_millis(wake.saturating_sub(now).min(60_000));
            let input = tokio::select! {
                _ = self.stop.cancelled(), if !stopping => {
                    stopping = true;
                    tracing::info!("leaving: finishing the round in flight");
                    Input::Stop
                }
                event = self.events.recv() => match event {
                    Some(NetworkEvent::Control { source, message }) => {
                        Input::Control { source, message }
                    }
                    Some(other) => {
                        self.on_network_event(other);
                        Input::Tick
                    }
                    None => {
                        tracing::warn!("network stopped; ending the round driver");
                        break;
                    }
                },
                _ = tokio::time::sleep(sleep) => Input::Tick,
                done = work_opt(&mut training) => {
                    training = None;
                    match done {
                        Ok((round, (ready, trained))) => {
                            payload = ready;
                            Input::Trained {
                                round,
                                inner_steps: trained.inner_steps,
                                step_time_s: trained.step_time_s,
                                train_s: trained.train_s,
                                train_loss: trained.train_loss,
                                trainer_time: trained.trainer_time,
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
                    let (round, results) = done.expect("exchange task does not panic");
                    // What arrived goes through the payload gate before the machine hears
                    // of it: a refused payload is mixed as missing.
                    screening = Some(screen(self.work.as_mut(), round, results));
                    continue;
                }
                done = work_opt(&mut screening) => {
                    screening = None;
                    match done {
                        Ok(Gated { round, results, outcomes, took, readings }) => {
                            gate_took = Some((round, took, readings));
                            arrived = results;
                            Input::Exchanged { round, outcomes }
                        }
                        Err(e) => {
                            outcome = Err(e.context("the payload gate failed"));
                            break;
                        }
                    }
                }
                done = work_opt(&mut finishing) => {
                    finishing = None;
                    match done {
                        Ok((round, (state, finished))) => {
                            if let Some(state) = state {
                                self.service.set_state(round + 1, state);
                            }
                            Input::Finished { round, val_loss: finished.val_loss }
                        }
                        Err(e) => {
                            outcome = Err(e.context("the outer step failed"));
                            break;
                        }
                    }
                }
            };
            let now = unix_ms();
            let posted = self.options.offences.take();
            if !posted.is_empty() {
                outputs.extend(machine.handle(Input::Offences(posted), now));
            }
            outputs.extend(machine.handle(input, now));
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

    /// Writes the bans to the node's home (when it keeps them), so a restarted node keeps
    /// them.
    async fn keep_bans(&self, bans: Vec<Ban>) {
        let Some(path) = self.options.ban_file.clone() else {
            return;
        };
        let run_id = self.run_id;
        let saved =
            tokio::task::spawn_blocking(move || BanFile::save(&path, run_id, bans.iter())).await;
        if let Ok(Err(e)) | Err(e) = saved.map_err(std::io::Error::other) {
            tracing::error!(error = %e, "cannot write the ban list");
        }
    }

    /// Carries a status change of the machine into the `/status` document.
    fn apply(&self, change: StatusChange) {
        self.status.send_modify(|s| match change {
            StatusChange::RoundStarted(round) => {
                s.round = round;
                s.state = NodeState::Training;
                s.neighbours.clear();
            }
            StatusChange::Neighbours(neighbours) => {
                s.neighbours = neighbours.iter().map(|p| p.to_string()).collect();
            }
            StatusChange::Trained {
                inner_steps,
                step_time_s,
                train_loss,
            } => {
                s.inner_steps = inner_steps;
                s.step_time_s = step_time_s;
                if train_loss.is_some() {
                    s.train_loss = train_loss;
                }
            }
            StatusChange::Agreeing => s.state = NodeState::Agreeing,
            StatusChange::Exchanging => s.state = NodeState::Exchanging,
            StatusChange::Standing { banned, scores } => {
                s.banned = banned;
                s.scores = scores;
            }
            StatusChange::Stopping => s.state = NodeState::Stopping,
        });
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
            s.record_round(record.clone());
        });
    }

    /// Network events that are not control messages only change the status document.
    fn on_network_event(&self, event: NetworkEvent) {
        match event {
            NetworkEvent::Connected(_) => self
                .status
                .send_modify(|s| s.connected_peers = s.connected_peers.saturating_add(1)),
            NetworkEvent::Disconnected(_) => self
                .status
                .send_modify(|s| s.connected_peers = s.connected_peers.saturating_sub(1)),
            NetworkEvent::Reachability(reachability) => {
                self.status.send_modify(|s| s.reachability = reachability)
            }
            NetworkEvent::HolePunched(_) => self.status.send_modify(|s| s.hole_punches += 1),
            NetworkEvent::Control { .. } | NetworkEvent::Subscribed(_) => {}
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

/// A neighbour's exchange result as the machine sees it: sizes and reasons, no tensors. A
/// payload this node's checks turned down (the sender's fault) is refused; anything else
/// that left no payload failed.
fn outcome_of(
    result: &Result<crate::exchange_service::Swapped, crate::exchange::ExchangeError>,
) -> Outcome {
    match result {
        Ok(swapped) => Outcome::Swapped {
            bytes: swapped.tensors.byte_length(),
            transfer: swapped.transfer,
        },
        Err(e) => match e.refusal_kind() {
            Some(kind) => Outcome::Refused {
                kind,
                reason: e.to_string(),
                bytes: 0,
                gross: false,
            },
            None => Outcome::Failed(e.to_string()),
        },
    }
}

/// A round's exchange results after the payload gate.
struct Gated {
    round: u64,
    /// Refused payloads taken out.
    results: ExchangeResults,
    /// Each neighbour's outcome, a gate refusal as `Refused`.
    outcomes: Vec<(PeerId, Outcome)>,
    /// How long the gate took.
    took: Duration,
    /// What it measured.
    readings: Vec<GateReading>,
}

/// Passes the payloads that came through the exchange to the work's payload gate and
/// returns the results with every refused payload taken out, and each neighbour's outcome.
/// The tensors move to the gate and back, uncopied.
fn screen(work: &mut dyn RoundWork, round: u64, mut results: ExchangeResults) -> WorkFuture<Gated> {
    let candidates: Vec<Candidate> = results
        .iter_mut()
        .filter_map(|(peer, result)| {
            let swapped = result.as_mut().ok()?;
            Some(Candidate {
                peer: *peer,
                tensors: std::mem::take(&mut swapped.tensors),
            })
        })
        .collect();
    let started = std::time::Instant::now();
    let screened = work.screen(round, candidates);
    Box::pin(async move {
        let mut outcomes: Vec<(PeerId, Outcome)> = Vec::with_capacity(results.len());
        let mut verdicts = screened.await?;
        let readings = verdicts
            .iter_mut()
            .filter_map(|s| s.reading.take())
            .collect();
        for (peer, result) in results.iter_mut() {
            let Ok(swapped) = result else {
                outcomes.push((*peer, outcome_of(result)));
                continue;
            };
            let Some(at) = verdicts.iter().position(|s| s.candidate.peer == *peer) else {
                // The gate gave no verdict: nothing about the payload is known to be good.
                outcomes.push((
                    *peer,
                    Outcome::Failed("the payload gate gave no verdict".into()),
                ));
                *result = Err(ExchangeError::Cancelled(
                    "no verdict of the payload gate".into(),
                ));
                continue;
            };
            let Screened {
                candidate, verdict, ..
            } = verdicts.swap_remove(at);
            match verdict {
                Ok(()) => {
                    swapped.tensors = candidate.tensors;
                    outcomes.push((*peer, outcome_of(result)));
                }
                Err(refusal) => {
                    tracing::warn!(round, %peer, %refusal, "payload refused");
                    outcomes.push((
                        *peer,
                        Outcome::Refused {
                            kind: refusal.kind(),
                            reason: refusal.to_string(),
                            bytes: candidate.tensors.byte_length(),
                            gross: refusal.is_gross(),
                        },
                    ));
                    *result = Err(ExchangeError::Cancelled(refusal.to_string()));
                }
            }
        }
        Ok(Gated {
            round,
            results,
            outcomes,
            took: started.elapsed(),
            readings,
        })
    })
}
