//! The round driver: runs rounds of commit-reveal, local work and exchange on a live swarm.
//!
//! It feeds network events and wall-clock time into a [`RoundSchedule`], carries out its
//! actions (publish commits and reveals), runs the (synthetic) trainer for the round and
//! swaps payloads with the round's neighbours through the [`ExchangeService`]. One
//! [`RoundRecord`] per round says what this node saw and did.

use crate::exchange::{ExchangeError, OutgoingPayload, SendOptions};
use crate::exchange_service::ExchangeService;
use crate::network::{unix_ms, Client, NetworkEvent};
use crate::schedule::{Action, RoundPlan, RoundSchedule, Timing};
use crate::synthetic::SyntheticTrainer;
use crate::tensors::TensorSet;
use gasloc_proto::wire::{control_message::Body, Commit, ControlMessage, PayloadKind, Reveal};
use libp2p::PeerId;
use rand::RngCore;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// What the driver does besides the schedule's timing.
#[derive(Debug, Clone)]
pub struct DriverOptions {
    /// Stop after this many decided rounds.
    pub rounds: u64,
    /// Fault injection for tests: never publish reveals (the node gets excluded).
    pub withhold_reveals: bool,
    pub send: SendOptions,
}

/// What one node saw and did in one round (peer ids as base58 strings).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
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
    pub bytes_received: u64,
    /// Milliseconds from the round start until the round was decided.
    pub decided_after_ms: u64,
    /// Milliseconds from the round start to the last commit received from another peer.
    pub last_commit_after_ms: u64,
    /// Milliseconds from the commit deadline (when reveals are sent) to the last reveal.
    pub last_reveal_after_ms: u64,
    /// Control messages this node received while the round was active.
    pub control_messages: u64,
}

type ExchangeResults = Vec<(PeerId, Result<TensorSet, ExchangeError>)>;

async fn join_opt<T>(handle: &mut Option<JoinHandle<T>>) -> Result<T, tokio::task::JoinError> {
    match handle {
        Some(h) => h.await,
        None => std::future::pending().await,
    }
}

/// Drives rounds until `options.rounds` have been decided.
pub struct RoundDriver {
    pub client: Client,
    pub events: mpsc::UnboundedReceiver<NetworkEvent>,
    pub schedule: RoundSchedule,
    pub service: ExchangeService,
    pub trainer: SyntheticTrainer,
    pub options: DriverOptions,
    pub run_id: [u8; 32],
}

struct Active {
    round: u64,
    plan: Option<RoundPlan>,
    decided_at: u64,
    trained: Option<Arc<OutgoingPayload>>,
    exchange_started: bool,
    control_messages: u64,
}

impl RoundDriver {
    /// Runs the rounds; `on_record` sees each record as soon as its round ends. Returns one
    /// exchange timeout after the last round, so that partners can finish reading.
    pub async fn run(mut self, mut on_record: impl FnMut(&RoundRecord)) -> Vec<RoundRecord> {
        let me = self.client.peer_id();
        let timing = self.schedule.timing().clone();
        let table = Arc::new(self.trainer.table());
        let mut next_round = timing.next_joinable_round(unix_ms());
        let mut active: Option<Active> = None;
        let mut training: Option<JoinHandle<TensorSet>> = None;
        let mut exchange: Option<JoinHandle<ExchangeResults>> = None;
        let mut records = Vec::new();
        while (records.len() as u64) < self.options.rounds {
            let now = unix_ms();
            let mut wake = self.schedule.next_wakeup().unwrap_or(u64::MAX);
            if active.is_none() {
                wake = wake.min(timing.round_start(next_round));
            }
            let sleep = Duration::from_millis(wake.saturating_sub(now).min(60_000));
            tokio::select! {
                event = self.events.recv() => match event {
                    Some(event) => {
                        if let (NetworkEvent::Control { .. }, Some(a)) = (&event, active.as_mut()) {
                            a.control_messages += 1;
                        }
                        self.on_event(event)
                    }
                    None => {
                        tracing::warn!("network stopped; ending the round driver");
                        break;
                    }
                },
                _ = tokio::time::sleep(sleep) => {}
                done = join_opt(&mut training) => {
                    training = None;
                    let set = Arc::new(done.expect("synthetic training does not panic"));
                    if let Some(a) = active.as_mut() {
                        self.service.set_state(a.round, Arc::new(OutgoingPayload::new(
                            PayloadKind::State, set.clone(), self.options.send.clone())));
                        a.trained = Some(Arc::new(OutgoingPayload::new(
                            PayloadKind::Model, set, self.options.send.clone())));
                    }
                }
                done = join_opt(&mut exchange) => {
                    exchange = None;
                    let results = done.expect("exchange task does not panic");
                    if let Some(a) = active.take() {
                        let record = make_record(&me, &a, &timing, results);
                        on_record(&record);
                        records.push(record);
                        next_round = a.round + 1;
                    }
                }
            }
            let now = unix_ms();
            // Start the next round when its time has come.
            if active.is_none() && now >= timing.round_start(next_round) {
                if now >= timing.commit_deadline(next_round) {
                    let skip_to = timing.next_joinable_round(now);
                    tracing::warn!(
                        missed = next_round,
                        next = skip_to,
                        "missed a round's commit window"
                    );
                    next_round = skip_to;
                } else {
                    let mut nonce = [0u8; 32];
                    rand::rng().fill_bytes(&mut nonce);
                    match self.schedule.join_round(next_round, nonce, now) {
                        Ok(Action::PublishCommit { round, commitment }) => {
                            self.service.advance_floor(round);
                            self.publish(
                                round,
                                Body::Commit(Commit {
                                    commitment: commitment.to_vec(),
                                }),
                            )
                            .await;
                            let trainer = self.trainer.clone();
                            training = Some(tokio::spawn(async move {
                                trainer.train_round(&me, round).await
                            }));
                            active = Some(Active {
                                round,
                                plan: None,
                                decided_at: 0,
                                trained: None,
                                exchange_started: false,
                                control_messages: 0,
                            });
                        }
                        Ok(other) => tracing::error!(?other, "unexpected action from join_round"),
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot join round");
                            next_round += 1;
                        }
                    }
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
                    Action::Decided(plan) => {
                        if let Some(a) = active.as_mut().filter(|a| a.round == plan.round) {
                            a.plan = Some(plan);
                            a.decided_at = now;
                        }
                    }
                    Action::PublishCommit { .. } => {}
                }
            }
            // Exchange once both the plan and the payload are there.
            if let Some(a) = active.as_mut() {
                if let (Some(plan), Some(payload), false) =
                    (&a.plan, &a.trained, a.exchange_started)
                {
                    a.exchange_started = true;
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
        // Partners may still be reading the last bytes this node sent: keep the swarm up for
        // one exchange timeout before the caller shuts it down.
        tokio::time::sleep(Duration::from_millis(timing.exchange_timeout_ms)).await;
        records
    }

    fn on_event(&mut self, event: NetworkEvent) {
        let NetworkEvent::Control { source, message } = event else {
            return;
        };
        let now = unix_ms();
        let result = match message.body {
            Some(Body::Commit(c)) => match c.commitment.as_slice().try_into() {
                Ok(c) => self.schedule.on_commit(source, message.round, c, now),
                Err(_) => return,
            },
            Some(Body::Reveal(r)) => match r.nonce.as_slice().try_into() {
                Ok(n) => self.schedule.on_reveal(source, message.round, n, now),
                Err(_) => return,
            },
            _ => return,
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

fn make_record(me: &PeerId, a: &Active, timing: &Timing, results: ExchangeResults) -> RoundRecord {
    let round_start = timing.round_start(a.round);
    let strings = |v: &[PeerId]| v.iter().map(|p| p.to_string()).collect::<Vec<_>>();
    let plan = a.plan.as_ref();
    let mut exchanged = Vec::new();
    let mut failed = Vec::new();
    let mut bytes_received = 0;
    for (peer, result) in results {
        match result {
            Ok(set) => {
                bytes_received += set.byte_length();
                exchanged.push(peer.to_string());
            }
            Err(e) => failed.push((peer.to_string(), e.to_string())),
        }
    }
    RoundRecord {
        peer: me.to_string(),
        round: a.round,
        is_member: plan.is_some_and(|p| p.is_member),
        members: plan.map(|p| strings(&p.members)).unwrap_or_default(),
        permutation: plan.map(|p| strings(&p.permutation)).unwrap_or_default(),
        neighbours: plan.map(|p| strings(&p.neighbours)).unwrap_or_default(),
        exchanged,
        failed,
        bytes_received,
        decided_after_ms: a.decided_at.saturating_sub(round_start),
        last_commit_after_ms: plan.map_or(0, |p| p.last_commit_at_ms.saturating_sub(round_start)),
        last_reveal_after_ms: plan.map_or(0, |p| {
            p.last_reveal_at_ms
                .saturating_sub(timing.commit_deadline(a.round))
        }),
        control_messages: a.control_messages,
    }
}
