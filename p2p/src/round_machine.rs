//! `RoundMachine`: the life of a node's rounds as a sans-IO state machine — the
//! [`RoundSchedule`] pattern one level up.
//!
//! It owns everything a round decides: when to commit to a round (with an `Announce` of
//! this node's step time and link), when a round starts and its inner steps' deadline, when
//! the exchange starts, which mixing row the outer step applies, what the round record
//! says, and when the node is done. It owns the commit-reveal ([`RoundSchedule`]), the
//! link estimates ([`LinkEstimates`]) and what this node holds against its peers
//! ([`PeerStanding`]: offences and bans). It does no I/O and sees no tensor, only sizes: the
//! caller (the async [`RoundDriver`], or a simulation) feeds it [`Input`]s with the time and
//! carries out the [`Output`]s it returns, and calls again at [`RoundMachine::next_wakeup`].
//!
//! A round moves through the [`Phase`]s `Training → (Agreeing) → Exchanging → Finishing`:
//! * it **starts** at `round_start(t)` if this node committed to it (a round reached only
//!   after it ended is skipped; an overlapped round up to two steps earlier, when the round
//!   before has handed off); the inner steps get a deadline, `round end − C_i − outer
//!   step − margin`, with `C_i` predicted from this node's own link (overlapped: the round's
//!   end);
//! * once the round is **decided** (its reveal window closed; the plan may come before the
//!   round starts, while the node still finishes the round before) the deadline moves to
//!   the prediction with the round's neighbours;
//! * once the plan and the trained payload are both there, the **exchange** starts (no
//!   neighbour: straight to the outer step);
//! * the exchange's outcome per neighbour (swapped, refused, failed — the exchange service
//!   bounds it by the exchange timeout) gives the **mixing row**: the round topology's row
//!   with every neighbour that sent nothing usable removed and its weight placed by the
//!   topology (returned to self; spread over the rest on the complete topology)
//!   ([`RoundPlan::mixing_row`]);
//! * when the outer step is done the round's offences are counted against their peers (a
//!   payload refused for its contents, a reveal withheld, an offence reported beside the
//!   rounds with [`Input::Offences`]); a peer that reaches the limit is banned
//!   ([`Output::Ban`]), and from then on a banned neighbour is refused without an exchange;
//!   the round's [`RoundRecord`] is written and the next round may start.
//!
//! A stop withdraws every round not yet revealed (the swarm leaves this node out of them
//! alike), starts no new round and lets the round in flight finish, so its partners get
//! their exchange and the caller checkpoints. The machine never panics on an input,
//! whatever its order: an input for a round not in flight is ignored.
//!
//! [`RoundDriver`]: crate::driver::RoundDriver

pub use crate::links::PayloadBytes;
use crate::links::{train_deadline, LinkEstimates};
use crate::peer_standing::{Ban, PeerStanding};
use crate::schedule::{Action, RoundPlan, RoundSchedule, Timing};
use gasloc_proto::manifest::GateConfig;
use gasloc_proto::pace::MovingAverage;
use gasloc_proto::topology::{MixingRow, Topology};
use gasloc_proto::wire::{control_message::Body, Announce, Commit, ControlMessage, Reveal};
use gasloc_proto::RefusalKind;
pub use gasloc_status::RoundRecord;
use gasloc_status::{RefusedPayload, TrainerTime};
use libp2p::PeerId;
use rand::rngs::StdRng;
use rand::RngCore;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// What the machine needs besides the schedule.
#[derive(Debug, Clone)]
pub struct MachineConfig {
    /// Stop after this many rounds finished or skipped (`u64::MAX`: until stopped).
    pub rounds: u64,
    /// Bytes of one payload, per round (the exchange-time prediction and the bytes sent).
    pub payload_bytes: PayloadBytes,
    /// The node's upload cap, bytes per second (`--max-upload-rate`).
    pub upload_cap: Option<u64>,
    /// Fault injection for tests: never publish reveals (the node gets excluded).
    pub withhold_reveals: bool,
    /// Overlapped rounds (`[outer] overlap` other than `none`): the inner steps run to the
    /// round's end (no time reserved for the exchange or the outer step), and once a round's
    /// exchange has started the next round may start training beside it. At most one round is handed off: the next one
    /// exchanges only after it has finished.
    pub overlap: bool,
}

/// What happened, as the caller tells it.
#[derive(Debug, Clone)]
pub enum Input {
    /// Time passed (the wakeup the machine asked for, or any other moment).
    Tick,
    /// A control message from the run's topic.
    Control {
        source: PeerId,
        message: ControlMessage,
    },
    /// The round's inner steps are done and its payload is ready to send.
    Trained {
        round: u64,
        inner_steps: u64,
        step_time_s: f64,
        /// Seconds the inner steps took (the trainer's busy time).
        train_s: f64,
        train_loss: Option<f64>,
        /// Where the trainer's other time went.
        trainer_time: TrainerTime,
    },
    /// The round's exchange is over: one outcome per neighbour (a neighbour without one
    /// counts as failed).
    Exchanged {
        round: u64,
        outcomes: Vec<(PeerId, Outcome)>,
    },
    /// The round's mixing and outer step are done.
    Finished { round: u64, val_loss: Option<f64> },
    /// Offences found beside the rounds (shard bytes that fail their digest), counted with
    /// the next round's own.
    Offences(Vec<(PeerId, RefusalKind)>),
    /// Leave the swarm.
    Stop,
}

/// How the exchange with one neighbour ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Its payload arrived and passed every check: `bytes` received, `transfer` from both
    /// sides ready to done.
    Swapped { bytes: u64, transfer: Duration },
    /// Its payload arrived and this node refused it: it failed a check of the exchange or
    /// of the payload gate. `kind` names the check (`too_far`, `table_mismatch`, …);
    /// `bytes` were received (the whole payload when the gate refused it, after a complete
    /// swap; 0 when the exchange did).
    Refused {
        kind: RefusalKind,
        reason: String,
        bytes: u64,
        /// Garbage beyond doubt (the payload gate's `Refusal::is_gross`): one such offence
        /// bans the peer.
        gross: bool,
    },
    /// No payload: a timeout, a lost stream, or the peer refused this node's.
    Failed(String),
}

/// A banned neighbour's outcome: refused without an exchange.
fn banned_outcome() -> Outcome {
    Outcome::Refused {
        kind: RefusalKind::Banned,
        reason: BANNED_REASON.into(),
        bytes: 0,
        gross: false,
    }
}

/// What the caller must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Publish a control message about `round` on the run's topic.
    Publish { round: u64, body: Body },
    /// Start the round's inner steps, to end by `deadline_ms` (Unix ms).
    StartTraining { round: u64, deadline_ms: u64 },
    /// The inner steps of the round in flight should now end by `deadline_ms`.
    MoveDeadline { round: u64, deadline_ms: u64 },
    /// Swap the round's payload with these neighbours.
    StartExchange { round: u64, neighbours: Vec<PeerId> },
    /// Mix with `mixing` and take the outer step. `arrived` names, for each neighbour
    /// term of the row, the peer whose payload it is.
    Finish {
        round: u64,
        mixing: MixingRow,
        arrived: Vec<(usize, PeerId)>,
    },
    /// `peer` is banned for the rest of the run: refuse its connections and keep the ban
    /// (the machine refuses it as a neighbour from now on).
    Ban { peer: PeerId, ban: Ban },
    /// `peer`'s standing changed without a ban: its gossipsub application score
    /// ([`PeerStanding::score`]).
    Score { peer: PeerId, score: f64 },
    /// The round is over: what this node saw and did.
    Record(Box<RoundRecord>),
    /// The node's `/status` document changed.
    Status(StatusChange),
}

/// A change of the node's status document.
#[derive(Debug, Clone, PartialEq)]
pub enum StatusChange {
    /// A round started: its number; neighbours not known yet; training.
    RoundStarted(u64),
    /// The round's neighbours are known.
    Neighbours(Vec<PeerId>),
    /// The inner steps are done.
    Trained {
        inner_steps: u64,
        step_time_s: f64,
        train_loss: Option<f64>,
    },
    Agreeing,
    Exchanging,
    /// The bans and the scores of the peers with offences (by peer id), after a round's
    /// offences were counted.
    Standing {
        banned: Vec<Ban>,
        scores: BTreeMap<String, f64>,
    },
    /// The node is leaving.
    Stopping,
}

/// Where the round in flight is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Inner steps running.
    Training,
    /// Payload ready, the round not decided yet.
    Agreeing,
    /// Swapping payloads with the neighbours.
    Exchanging,
    /// Mixing and the outer step.
    Finishing,
}

/// The round in flight, with what the record needs (times in Unix ms).
#[derive(Debug)]
struct InFlight {
    round: u64,
    phase: Phase,
    started_ms: u64,
    plan: Option<RoundPlan>,
    decided_at_ms: u64,
    deadline_ms: u64,
    predicted_exchange_s: f64,
    inner_steps: u64,
    step_time_s: f64,
    train_s: f64,
    train_loss: Option<f64>,
    trainer_time: TrainerTime,
    ready_at_ms: Option<u64>,
    exchange_started_ms: Option<u64>,
    exchange_done_ms: Option<u64>,
    outcomes: Vec<(PeerId, Outcome)>,
    /// Neighbours of the round this node has banned: refused without an exchange.
    banned: Vec<PeerId>,
    mixing: Option<MixingRow>,
}

/// One node's rounds.
pub struct RoundMachine {
    me: PeerId,
    config: MachineConfig,
    schedule: RoundSchedule,
    links: LinkEstimates,
    finish_time: MovingAverage,
    nonces: StdRng,
    /// The next round to commit to (its commit window opens during the round before it),
    /// and the next round to run (one this node committed to).
    next_commit: u64,
    next_round: u64,
    committed: u64,
    finished: u64,
    skipped: u64,
    /// Plans of rounds decided before this node started them.
    early_plans: HashMap<u64, (RoundPlan, u64)>,
    /// Control messages received per round they are about.
    control_counts: HashMap<u64, u64>,
    /// The round training or agreeing (with blocking rounds, also exchanging and finishing).
    active: Option<InFlight>,
    /// Overlapped rounds: the round exchanging or finishing while `active` trains.
    handed_off: Option<InFlight>,
    stopping: bool,
    /// What this node announces beside its commits.
    last_inner_steps: u64,
    last_step_time_s: f64,
    /// The last round this node finished and when (Unix ms): the next round's wall time
    /// counts from there (`compute_utilization`).
    last_finished: Option<(u64, u64)>,
    /// What this node holds against its peers: offences and bans.
    standing: PeerStanding,
    /// Offences reported beside the rounds ([`Input::Offences`]), counted with the next
    /// round's.
    posted: Vec<(PeerId, RefusalKind)>,
}

/// Why a banned neighbour's payload is not taken (the record's reason).
const BANNED_REASON: &str = "banned by this node for the rest of the run";

impl RoundMachine {
    /// A machine that starts with the first round whose commit window opens a whole window
    /// after `now`, when it starts listening (`Timing::first_round_after_listening`);
    /// `nonces` draws the commit-reveal nonces (seed it from the OS in a node).
    pub fn new(
        me: PeerId,
        config: MachineConfig,
        schedule: RoundSchedule,
        nonces: StdRng,
        now: u64,
    ) -> RoundMachine {
        let next_commit = schedule.timing().first_round_after_listening(now);
        RoundMachine {
            me,
            config,
            schedule,
            links: LinkEstimates::default(),
            finish_time: MovingAverage::default(),
            nonces,
            next_commit,
            next_round: next_commit,
            committed: 0,
            finished: 0,
            skipped: 0,
            early_plans: HashMap::new(),
            control_counts: HashMap::new(),
            active: None,
            handed_off: None,
            stopping: false,
            last_inner_steps: 0,
            last_step_time_s: 0.0,
            last_finished: None,
            standing: PeerStanding::new(&GateConfig::default(), Vec::new()),
            posted: Vec::new(),
        }
    }

    /// The machine with `standing` (the run's ban policy, and the bans this node kept from
    /// an earlier life) in place of the default policy with no bans.
    pub fn with_standing(mut self, standing: PeerStanding) -> Self {
        self.standing = standing;
        self
    }

    /// What this node holds against its peers.
    pub fn standing(&self) -> &PeerStanding {
        &self.standing
    }

    pub fn timing(&self) -> &Timing {
        self.schedule.timing()
    }

    pub fn schedule(&self) -> &RoundSchedule {
        &self.schedule
    }

    /// The round in flight and its phase (with overlapped rounds: the round training or
    /// agreeing, not the one handed off).
    pub fn phase(&self) -> Option<(u64, Phase)> {
        self.active.as_ref().map(|a| (a.round, a.phase))
    }

    /// Overlapped rounds: the round whose exchange or outer step is under way beside the
    /// next round's training, and its phase.
    pub fn handed_off(&self) -> Option<(u64, Phase)> {
        self.handed_off.as_ref().map(|a| (a.round, a.phase))
    }

    /// Rounds finished, and rounds committed to but missed.
    pub fn rounds_done(&self) -> (u64, u64) {
        (self.finished, self.skipped)
    }

    /// True once the node has nothing left to do: its rounds are done, or it is stopping
    /// and no round is in flight.
    pub fn is_done(&self) -> bool {
        self.finished + self.skipped >= self.config.rounds
            || (self.stopping && self.active.is_none() && self.handed_off.is_none())
    }

    /// When the machine next has something to do without an input (Unix ms).
    pub fn next_wakeup(&self) -> Option<u64> {
        let timing = self.schedule.timing();
        let mut wake = self.schedule.next_wakeup();
        let mut consider = |t: u64| wake = Some(wake.map_or(t, |w| w.min(t)));
        if !self.stopping {
            if self.active.is_none() && self.next_round < self.next_commit {
                let early = if self.config.overlap && self.schedule.has_joined(self.next_round) {
                    self.early_start_ms()
                } else {
                    0
                };
                consider(timing.round_start(self.next_round).saturating_sub(early));
            }
            if self.committed < self.config.rounds {
                consider(timing.commit_opens(self.next_commit));
            }
        }
        wake
    }

    /// Takes one input at `now` (Unix ms) and returns what to do.
    pub fn handle(&mut self, input: Input, now: u64) -> Vec<Output> {
        let mut out = Vec::new();
        match input {
            Input::Tick => {}
            Input::Control { source, message } => self.on_control(source, message, now),
            Input::Trained {
                round,
                inner_steps,
                step_time_s,
                train_s,
                train_loss,
                trainer_time,
            } => {
                let trained = (inner_steps, step_time_s, train_s, train_loss);
                self.on_trained(round, trained, trainer_time, now, &mut out)
            }
            Input::Exchanged { round, outcomes } => {
                self.on_exchanged(round, outcomes, now, &mut out)
            }
            Input::Finished { round, val_loss } => self.on_finished(round, val_loss, now, &mut out),
            Input::Offences(offences) => self.posted.extend(offences),
            Input::Stop => {
                if !self.stopping {
                    self.stopping = true;
                    // Rounds committed to but not yet revealed are given up: every peer
                    // leaves this node out of them alike.
                    self.schedule.withdraw_from(0);
                    out.push(Output::Status(StatusChange::Stopping));
                }
            }
        }
        self.advance(now, &mut out);
        out
    }

    fn on_control(&mut self, source: PeerId, message: ControlMessage, now: u64) {
        *self.control_counts.entry(message.round).or_default() += 1;
        let round = message.round;
        let result = match message.body {
            Some(Body::Commit(c)) => match c.commitment.as_slice().try_into() {
                Ok(c) => self.schedule.on_commit(source, round, c, now),
                Err(_) => return,
            },
            Some(Body::Reveal(r)) => match r.nonce.as_slice().try_into() {
                Ok(n) => self.schedule.on_reveal(source, round, n, now),
                Err(_) => return,
            },
            Some(Body::Announce(a)) => {
                self.links.record_announce(source, a.goodput_bytes_per_s);
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

    /// When round `round`'s inner steps should end. Blocking rounds: the round's end less the
    /// predicted exchange, the outer step's measured time and a margin ([`train_deadline`]).
    /// Overlapped rounds: the round's end itself — the exchange and the outer step run beside
    /// the next round's inner steps, which start where these end, so nothing is reserved.
    fn deadline_of(&self, round: u64, predicted_exchange_s: f64) -> u64 {
        let timing = self.schedule.timing();
        if self.config.overlap {
            timing.round_start(round + 1)
        } else {
            train_deadline(timing, round, predicted_exchange_s, self.finish_time.get())
        }
    }

    /// The round `round` if it is in flight in `phase` (in either slot).
    fn in_flight(&mut self, round: u64, phase: Phase) -> Option<&mut InFlight> {
        let a = [&mut self.active, &mut self.handed_off]
            .into_iter()
            .filter_map(|slot| slot.as_mut())
            .find(|a| a.round == round && a.phase == phase);
        if a.is_none() {
            tracing::debug!(
                round,
                ?phase,
                "a result for a round not in that phase: ignored"
            );
        }
        a
    }

    /// `trained`: inner steps, step time, busy seconds, train loss.
    fn on_trained(
        &mut self,
        round: u64,
        trained: (u64, f64, f64, Option<f64>),
        trainer_time: TrainerTime,
        now: u64,
        out: &mut Vec<Output>,
    ) {
        let (inner_steps, step_time_s, train_s, train_loss) = trained;
        let Some(a) = self.in_flight(round, Phase::Training) else {
            return;
        };
        a.inner_steps = inner_steps;
        a.step_time_s = step_time_s;
        a.train_s = train_s;
        a.train_loss = train_loss;
        a.trainer_time = trainer_time;
        a.ready_at_ms = Some(now);
        a.phase = Phase::Agreeing;
        self.last_inner_steps = inner_steps;
        self.last_step_time_s = step_time_s;
        out.push(Output::Status(StatusChange::Trained {
            inner_steps,
            step_time_s,
            train_loss,
        }));
        out.push(Output::Status(StatusChange::Agreeing));
    }

    fn on_exchanged(
        &mut self,
        round: u64,
        mut outcomes: Vec<(PeerId, Outcome)>,
        now: u64,
        out: &mut Vec<Output>,
    ) {
        let (me, topology) = (self.me, self.schedule.timing().topology);
        let Some(a) = self.in_flight(round, Phase::Exchanging) else {
            return;
        };
        let neighbours = a.plan.as_ref().map_or(&[][..], |p| &p.neighbours[..]);
        // One outcome per neighbour, in neighbour order: others are dropped, the missing
        // ones failed, the banned ones refused.
        outcomes.retain(|(p, _)| neighbours.contains(p) && !a.banned.contains(p));
        outcomes.extend(a.banned.iter().map(|&p| (p, banned_outcome())));
        let mut ordered = Vec::with_capacity(neighbours.len());
        for n in neighbours {
            let outcome = match outcomes.iter().position(|(p, _)| p == n) {
                Some(i) => outcomes.swap_remove(i).1,
                None => Outcome::Failed("no result from the exchange".into()),
            };
            ordered.push((*n, outcome));
        }
        let swaps: Vec<(PeerId, Duration)> = ordered
            .iter()
            .filter_map(|(p, o)| match o {
                Outcome::Swapped { transfer, .. } => Some((*p, *transfer)),
                _ => None,
            })
            .collect();
        let exchanged_with = ordered.len();
        a.outcomes = ordered;
        a.exchange_done_ms = Some(now);
        Self::start_finish(&me, topology, a, out);
        self.links.record_exchange(
            self.config.payload_bytes.of_round(round),
            exchanged_with,
            &swaps,
        );
    }

    /// The round's mixing row from its plan and outcomes, and the order to apply it.
    fn start_finish(me: &PeerId, topology: Topology, a: &mut InFlight, out: &mut Vec<Output>) {
        let Some(plan) = a.plan.as_ref() else {
            return;
        };
        let missing: Vec<PeerId> = a
            .outcomes
            .iter()
            .filter(|(_, o)| !matches!(o, Outcome::Swapped { .. }))
            .map(|(p, _)| *p)
            .collect();
        let mixing = plan.mixing_row(topology, me, &missing);
        let arrived: Vec<(usize, PeerId)> = a
            .outcomes
            .iter()
            .filter(|(_, o)| matches!(o, Outcome::Swapped { .. }))
            .filter_map(|(p, _)| plan.member_index(p).map(|i| (i, *p)))
            .collect();
        a.phase = Phase::Finishing;
        a.mixing = Some(mixing.clone());
        out.push(Output::Finish {
            round: a.round,
            mixing,
            arrived,
        });
    }

    fn on_finished(&mut self, round: u64, val_loss: Option<f64>, now: u64, out: &mut Vec<Output>) {
        if self.in_flight(round, Phase::Finishing).is_none() {
            return;
        }
        let slot = match &self.handed_off {
            Some(h) if h.round == round => &mut self.handed_off,
            _ => &mut self.active,
        };
        let a = slot.take().expect("checked above");
        let finish_started = a.exchange_done_ms.unwrap_or(now);
        self.finish_time
            .observe(now.saturating_sub(finish_started) as f64 / 1000.0);
        // The round's wall time: from the end of the round before, when this node finished
        // it (the idle time between two rounds is the trainer's too), else from its start.
        let wall_from = match self.last_finished {
            Some((r, at)) if r + 1 == round => at,
            _ => a.started_ms,
        };
        self.judge_offences(round, &a, out);
        let mut record = self.make_record(a, val_loss, now);
        record.wall_s = now.saturating_sub(wall_from) as f64 / 1000.0;
        record.compute_utilization = compute_utilization(record.train_s, record.wall_s);
        record.control_messages = self.control_counts.remove(&round).unwrap_or(0);
        self.control_counts.retain(|&r, _| r > round);
        self.finished += 1;
        // (With overlapped rounds the next one may have started already.)
        self.next_round = self.next_round.max(round + 1);
        self.last_finished = Some((round, now));
        out.push(Output::Record(Box::new(record)));
    }

    /// Counts round `round`'s offences against their peers — payloads refused for their
    /// contents, reveals withheld after a commit, and the offences posted since the last
    /// round — and says what changed: a [`Output::Ban`] for each peer that reached the limit
    /// (or committed a gross offence), a [`Output::Score`] for each other offender, and the
    /// standing for `/status`.
    fn judge_offences(&mut self, round: u64, a: &InFlight, out: &mut Vec<Output>) {
        let refused = a
            .outcomes
            .iter()
            .filter_map(|(peer, outcome)| match outcome {
                Outcome::Refused { kind, gross, .. } => Some((*peer, *kind, *gross)),
                _ => None,
            });
        let withheld = a
            .plan
            .iter()
            .flat_map(|p| p.withheld.iter())
            .map(|&peer| (peer, RefusalKind::WithheldReveal, false));
        let posted = self
            .posted
            .drain(..)
            .map(|(peer, kind)| (peer, kind, false));
        let offences: Vec<(PeerId, RefusalKind, bool)> = refused
            .chain(withheld)
            .chain(posted)
            .filter(|(_, kind, _)| kind.is_offence())
            .collect();
        if offences.is_empty() {
            return;
        }
        let mut offenders = Vec::new();
        for (peer, kind, gross) in offences {
            let ban = match gross {
                true => self.standing.offend_grossly(peer, round, kind),
                false => self.standing.offend(peer, round, kind),
            };
            match ban {
                Some(ban) => {
                    tracing::warn!(round, %peer, offences = ?ban.offences, "peer banned for the rest of the run");
                    out.push(Output::Ban { peer, ban });
                }
                None if !offenders.contains(&peer) => offenders.push(peer),
                None => {}
            }
        }
        for peer in offenders {
            let score = self.standing.score(&peer, round);
            out.push(Output::Score { peer, score });
        }
        out.push(Output::Status(StatusChange::Standing {
            banned: self.standing.bans().cloned().collect(),
            scores: self.standing.scores(round),
        }));
    }

    /// Everything time alone moves on: commits, the next round's start, reveals and
    /// decisions, the exchange once plan and payload are there.
    fn advance(&mut self, now: u64, out: &mut Vec<Output>) {
        self.commit_if_due(now, out);
        self.start_round_if_due(now, out);
        for action in self.schedule.poll(now) {
            match action {
                Action::PublishReveal { round, nonce } => {
                    if self.config.withhold_reveals {
                        tracing::info!(round, "fault injection: withholding the reveal");
                    } else {
                        out.push(Output::Publish {
                            round,
                            body: Body::Reveal(Reveal {
                                nonce: nonce.to_vec(),
                            }),
                        });
                    }
                }
                Action::Decided(plan) => self.on_decided(plan, now, out),
                Action::PublishCommit { .. } => {}
            }
        }
        self.exchange_if_ready(now, out);
    }

    /// Commits to the next round when its commit window opens, with an `Announce` of this
    /// node's H_i, step time and link for its partners' deadlines.
    fn commit_if_due(&mut self, now: u64, out: &mut Vec<Output>) {
        let timing = self.schedule.timing().clone();
        if self.stopping
            || self.committed >= self.config.rounds
            || now < timing.commit_opens(self.next_commit)
        {
            return;
        }
        if now >= timing.commit_closes(self.next_commit) {
            let skip_to = timing.next_joinable_round(now);
            tracing::warn!(
                missed = self.next_commit,
                next = skip_to,
                "too late to commit to a round"
            );
            self.next_commit = skip_to;
            return;
        }
        let mut nonce = [0u8; 32];
        self.nonces.fill_bytes(&mut nonce);
        match self.schedule.join_round(self.next_commit, nonce, now) {
            Ok(Action::PublishCommit { round, commitment }) => {
                out.push(Output::Publish {
                    round,
                    body: Body::Commit(Commit {
                        commitment: commitment.to_vec(),
                    }),
                });
                out.push(Output::Publish {
                    round,
                    body: Body::Announce(Announce {
                        inner_steps: self.last_inner_steps.min(u32::MAX as u64) as u32,
                        step_time_us: (self.last_step_time_s * 1e6) as u64,
                        goodput_bytes_per_s: self.links.own_goodput(self.config.upload_cap),
                    }),
                });
                self.committed += 1;
            }
            Ok(other) => tracing::error!(?other, "unexpected action from join_round"),
            Err(e) => tracing::warn!(error = %e, "cannot commit to round"),
        }
        self.next_commit += 1;
    }

    /// Starts the next round this node committed to when its time has come (never while
    /// leaving). A round reached only after it ended is skipped.
    fn start_round_if_due(&mut self, now: u64, out: &mut Vec<Output>) {
        let timing = self.schedule.timing().clone();
        while !self.stopping
            && self.active.is_none()
            && self.next_round < self.next_commit
            && self.may_start(self.next_round, now)
        {
            let round = self.next_round;
            let joined = self.schedule.has_joined(round);
            if !joined || now >= timing.round_start(round + 1) {
                if joined {
                    tracing::warn!(round, "missed a round it committed to");
                    self.skipped += 1;
                }
                self.early_plans.remove(&round);
                self.next_round += 1;
                continue;
            }
            let predicted = self.links.predicted_exchange_s(
                self.config.payload_bytes.of_round(round),
                &timing,
                None,
                self.config.upload_cap,
            );
            let deadline_ms = self.deadline_of(round, predicted);
            out.push(Output::Status(StatusChange::RoundStarted(round)));
            out.push(Output::StartTraining { round, deadline_ms });
            self.next_round = round + 1;
            self.active = Some(InFlight {
                round,
                phase: Phase::Training,
                started_ms: now,
                plan: None,
                decided_at_ms: 0,
                deadline_ms,
                predicted_exchange_s: predicted,
                inner_steps: 0,
                step_time_s: 0.0,
                train_s: 0.0,
                train_loss: None,
                trainer_time: TrainerTime::default(),
                ready_at_ms: None,
                exchange_started_ms: None,
                exchange_done_ms: None,
                outcomes: Vec::new(),
                banned: Vec::new(),
                mixing: None,
            });
            if let Some((plan, decided_at)) = self.early_plans.remove(&round) {
                self.take_plan(plan, decided_at, out);
            }
        }
    }

    /// Whether round `round` may start at `now`: at its start time; with overlapped rounds
    /// also up to [`Self::early_start_ms`] before it, once this node has joined it. An
    /// overlapped round trains up to the next one's start, and its last step ends when what
    /// is left is shorter than a step: the next round takes that rest instead of the trainer
    /// idling through it (its deadline, the round after's start, does not move).
    fn may_start(&self, round: u64, now: u64) -> bool {
        let start = self.schedule.timing().round_start(round);
        now >= start
            || (self.config.overlap
                && now + self.early_start_ms() >= start
                && self.schedule.has_joined(round))
    }

    /// How early an overlapped round may start: two of this node's steps (what its round
    /// before leaves when it stops short of a step, with room for the steps' jitter).
    fn early_start_ms(&self) -> u64 {
        (2000.0 * self.last_step_time_s).ceil() as u64
    }

    fn on_decided(&mut self, plan: RoundPlan, now: u64, out: &mut Vec<Output>) {
        match self.active.as_ref() {
            Some(a) if a.round == plan.round => self.take_plan(plan, now, out),
            _ if plan.is_member && plan.round >= self.next_round => {
                self.early_plans.insert(plan.round, (plan, now));
            }
            _ => {}
        }
    }

    /// Gives the round in flight its decided plan: its neighbours, and the train deadline
    /// predicted with their links.
    fn take_plan(&mut self, plan: RoundPlan, decided_at: u64, out: &mut Vec<Output>) {
        let timing = self.schedule.timing().clone();
        let predicted = self.links.predicted_exchange_s(
            self.config.payload_bytes.of_round(plan.round),
            &timing,
            Some(&plan.neighbours),
            self.config.upload_cap,
        );
        // The plan is the active round's (`on_decided` and the round start check it).
        let deadline_ms = self.deadline_of(plan.round, predicted);
        let Some(a) = self.active.as_mut() else {
            return;
        };
        out.push(Output::Status(StatusChange::Neighbours(
            plan.neighbours.clone(),
        )));
        a.predicted_exchange_s = predicted;
        a.decided_at_ms = decided_at;
        if a.phase == Phase::Training && deadline_ms != a.deadline_ms {
            a.deadline_ms = deadline_ms;
            out.push(Output::MoveDeadline {
                round: a.round,
                deadline_ms,
            });
        }
        a.plan = Some(plan);
    }

    /// Starts the exchange once both the plan and the payload are there (with overlapped
    /// rounds, once the round handed off before is finished too) and, with overlapped
    /// rounds, hands the round off so that the next one may start training.
    fn exchange_if_ready(&mut self, now: u64, out: &mut Vec<Output>) {
        let (me, topology) = (self.me, self.schedule.timing().topology);
        if self.config.overlap && self.handed_off.is_some() {
            return;
        }
        let Some(a) = self.active.as_mut() else {
            return;
        };
        if a.phase != Phase::Agreeing {
            return;
        }
        let Some(plan) = a.plan.as_ref() else {
            return;
        };
        a.exchange_started_ms = Some(now);
        // A banned neighbour is refused without an exchange.
        let (banned, neighbours): (Vec<PeerId>, Vec<PeerId>) = plan
            .neighbours
            .iter()
            .copied()
            .partition(|p| self.standing.is_banned(p));
        a.banned = banned;
        if neighbours.is_empty() {
            a.outcomes = a.banned.iter().map(|&p| (p, banned_outcome())).collect();
            a.exchange_done_ms = Some(now);
            Self::start_finish(&me, topology, a, out);
        } else {
            a.phase = Phase::Exchanging;
            out.push(Output::Status(StatusChange::Exchanging));
            out.push(Output::StartExchange {
                round: a.round,
                neighbours,
            });
        }
        if self.config.overlap {
            self.handed_off = self.active.take();
            // The next round may be due already.
            self.start_round_if_due(now, out);
        }
    }

    fn make_record(&self, a: InFlight, val_loss: Option<f64>, now: u64) -> RoundRecord {
        let timing = self.schedule.timing();
        let round_start = timing.round_start(a.round);
        let strings = |v: &[PeerId]| v.iter().map(|p| p.to_string()).collect::<Vec<_>>();
        let seconds = |from: Option<u64>, to: Option<u64>| match (from, to) {
            (Some(f), Some(t)) => t.saturating_sub(f) as f64 / 1000.0,
            _ => 0.0,
        };
        let plan = a.plan.as_ref();
        let (mut exchanged, mut refused, mut failed) = (Vec::new(), Vec::new(), Vec::new());
        let (mut bytes_received, mut transfer) = (0, Duration::ZERO);
        let mut swapped_out = 0u64;
        for (peer, outcome) in &a.outcomes {
            match outcome {
                Outcome::Swapped { bytes, transfer: t } => {
                    bytes_received += bytes;
                    transfer = transfer.max(*t);
                    exchanged.push(peer.to_string());
                }
                Outcome::Refused {
                    kind,
                    reason,
                    bytes,
                    gross,
                } => {
                    bytes_received += bytes;
                    // A complete swap: this node's payload went out too.
                    swapped_out += u64::from(*bytes > 0);
                    refused.push(RefusedPayload {
                        peer: peer.to_string(),
                        kind: *kind,
                        reason: reason.clone(),
                        gross: *gross,
                    })
                }
                Outcome::Failed(why) => failed.push((peer.to_string(), why.clone())),
            }
        }
        let mixing = match (plan, a.mixing.as_ref()) {
            (Some(plan), Some(row)) => {
                let name = |j: usize| match plan.members.get(j) {
                    Some(p) => p.to_string(),
                    None => self.me.to_string(),
                };
                let mut weights = vec![(self.me.to_string(), row.weight(row.worker))];
                weights.extend(row.neighbours().map(|j| (name(j), row.weight(j))));
                weights
            }
            _ => vec![(self.me.to_string(), 1.0)],
        };
        RoundRecord {
            peer: self.me.to_string(),
            round: a.round,
            is_member: plan.is_some_and(|p| p.is_member),
            members: plan.map(|p| strings(&p.members)).unwrap_or_default(),
            permutation: plan.map(|p| strings(&p.permutation)).unwrap_or_default(),
            neighbours: plan.map(|p| strings(&p.neighbours)).unwrap_or_default(),
            withheld: plan.map(|p| strings(&p.withheld)).unwrap_or_default(),
            gate: Vec::new(), // the driver's: the gate runs outside the machine
            bytes_sent: self.config.payload_bytes.of_round(a.round)
                * (exchanged.len() as u64 + swapped_out),
            exchanged,
            refused,
            failed,
            mixing,
            bytes_received,
            inner_steps: a.inner_steps,
            step_time_s: a.step_time_s,
            budget_s: a.deadline_ms.saturating_sub(round_start) as f64 / 1000.0,
            predicted_exchange_s: a.predicted_exchange_s,
            exchange_s: seconds(a.exchange_started_ms, a.exchange_done_ms),
            transfer_s: transfer.as_secs_f64(),
            wait_s: seconds(a.ready_at_ms, a.exchange_done_ms),
            gate_s: 0.0,
            finish_s: seconds(a.exchange_done_ms, Some(now)),
            round_s: seconds(Some(a.started_ms), Some(now)),
            train_s: a.train_s,
            wall_s: 0.0,              // set by on_finished
            compute_utilization: 0.0, // set by on_finished
            trainer_time: a.trainer_time,
            train_loss: a.train_loss,
            val_loss,
            decided_after_ms: a.decided_at_ms.saturating_sub(round_start),
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
            reachability: Default::default(),
            hole_punches: 0,
        }
    }
}

/// The trainer's busy seconds over the wall seconds, in [0, 1] (1 for no wall time).
pub fn compute_utilization(train_s: f64, wall_s: f64) -> f64 {
    if wall_s > 0.0 {
        (train_s / wall_s).clamp(0.0, 1.0)
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gasloc_proto::topology::Topology;
    use libp2p::identity::Keypair;
    use rand::{Rng, SeedableRng};

    const GENESIS: u64 = 1_000_000;
    const PERIOD: u64 = 10_000;
    const TIMEOUT: u64 = 3000;

    fn timing(topology: Topology) -> Timing {
        Timing {
            genesis_ms: GENESIS,
            period_ms: PERIOD,
            commit_window_ms: 1000,
            reveal_window_ms: 1000,
            exchange_timeout_ms: TIMEOUT,
            topology,
        }
    }

    fn peer(i: usize) -> PeerId {
        Keypair::ed25519_from_bytes([i as u8 + 1; 32])
            .unwrap()
            .public()
            .to_peer_id()
    }

    /// `n` machines on a perfect control plane (every publish reaches every other machine
    /// at once); the tests play the trainer and the exchange.
    struct Swarm {
        machines: Vec<RoundMachine>,
    }

    impl Swarm {
        fn new(n: usize, topology: Topology, rounds: u64, now: u64) -> Swarm {
            Swarm::with_overlap(n, topology, rounds, now, false)
        }

        fn with_overlap(
            n: usize,
            topology: Topology,
            rounds: u64,
            now: u64,
            overlap: bool,
        ) -> Swarm {
            let machines = (0..n)
                .map(|i| {
                    let config = MachineConfig {
                        rounds,
                        payload_bytes: PayloadBytes::fixed(1000),
                        upload_cap: None,
                        withhold_reveals: false,
                        overlap,
                    };
                    let schedule = RoundSchedule::new(timing(topology), [7; 32], peer(i));
                    let nonces = StdRng::seed_from_u64(i as u64);
                    RoundMachine::new(peer(i), config, schedule, nonces, now)
                })
                .collect();
            Swarm { machines }
        }

        /// Gives machine `i` an input and delivers what it publishes; returns its outputs
        /// (the publishes of others it triggers are delivered too, not returned).
        fn input(&mut self, i: usize, input: Input, now: u64) -> Vec<Output> {
            let out = self.machines[i].handle(input, now);
            self.deliver(i, &out, now);
            out
        }

        fn deliver(&mut self, from: usize, outputs: &[Output], now: u64) {
            for output in outputs {
                let Output::Publish { round, body } = output else {
                    continue;
                };
                for j in 0..self.machines.len() {
                    if j == from {
                        continue;
                    }
                    let message = ControlMessage {
                        run_id: vec![7; 32],
                        round: *round,
                        body: Some(body.clone()),
                    };
                    let more = self.machines[j].handle(
                        Input::Control {
                            source: peer(from),
                            message,
                        },
                        now,
                    );
                    self.deliver(j, &more, now);
                }
            }
        }

        /// Machine `i` ends `round`'s training at `trained_at` and swaps with every
        /// neighbour at `swapped_at`; returns what the swap's outcome made it do.
        fn train_and_swap(
            &mut self,
            i: usize,
            round: u64,
            trained_at: u64,
            swapped_at: u64,
        ) -> Vec<Output> {
            let out = self.input(i, trained(round), trained_at);
            let neighbours = exchange_of(&out).expect("the exchange starts");
            let outcomes = neighbours.into_iter().map(|p| (p, swapped())).collect();
            self.input(i, Input::Exchanged { round, outcomes }, swapped_at)
        }

        /// Ticks every machine at `now`; returns each one's outputs.
        fn tick(&mut self, now: u64) -> Vec<Vec<Output>> {
            (0..self.machines.len())
                .map(|i| self.input(i, Input::Tick, now))
                .collect()
        }
    }

    fn start(round: u64) -> u64 {
        GENESIS + round * PERIOD
    }

    fn trained(round: u64) -> Input {
        Input::Trained {
            round,
            inner_steps: 10,
            step_time_s: 0.1,
            train_s: 4.24,
            train_loss: Some(2.0),
            trainer_time: TrainerTime {
                served_s: 0.25,
                waited_s: 0.0,
                payload_s: 0.5,
                unused_s: 0.125,
            },
        }
    }

    fn swapped() -> Outcome {
        Outcome::Swapped {
            bytes: 1000,
            transfer: Duration::from_millis(40),
        }
    }

    fn find<T>(out: &[Output], f: impl Fn(&Output) -> Option<T>) -> Option<T> {
        out.iter().find_map(f)
    }

    fn exchange_of(out: &[Output]) -> Option<Vec<PeerId>> {
        find(out, |o| match o {
            Output::StartExchange { neighbours, .. } => Some(neighbours.clone()),
            _ => None,
        })
    }

    fn finish_of(out: &[Output]) -> Option<(MixingRow, Vec<(usize, PeerId)>)> {
        find(out, |o| match o {
            Output::Finish {
                mixing, arrived, ..
            } => Some((mixing.clone(), arrived.clone())),
            _ => None,
        })
    }

    fn record_of(out: &[Output]) -> Option<RoundRecord> {
        find(out, |o| match o {
            Output::Record(r) => Some((**r).clone()),
            _ => None,
        })
    }

    fn training_of(out: &[Output]) -> Option<(u64, u64)> {
        find(out, |o| match o {
            Output::StartTraining { round, deadline_ms } => Some((*round, *deadline_ms)),
            _ => None,
        })
    }

    /// Runs the swarm to round `round`'s decision: commits, start, reveals, plan.
    fn to_decision(s: &mut Swarm, round: u64) -> Vec<Vec<Output>> {
        s.tick(start(round) - 1000);
        let started = s.tick(start(round));
        s.tick(start(round) + 1000);
        started
    }

    #[test]
    fn a_round_runs_from_commit_to_record() {
        let mut s = Swarm::new(2, Topology::OnePeer, 1, start(0) - PERIOD);
        assert_eq!(s.machines[0].next_wakeup(), Some(start(0) - 1000));
        let commits = s.tick(start(0) - 1000);
        assert!(matches!(
            commits[0][..],
            [
                Output::Publish {
                    round: 0,
                    body: Body::Commit(_)
                },
                Output::Publish {
                    round: 0,
                    body: Body::Announce(_)
                }
            ]
        ));
        let started = s.tick(start(0));
        // No link known yet: the deadline leaves the margin (5 % of the period) only.
        assert_eq!(training_of(&started[0]), Some((0, start(1) - 500)));
        assert_eq!(s.machines[0].phase(), Some((0, Phase::Training)));
        s.tick(start(0) + 1000);
        let out = s.input(0, trained(0), start(0) + 5000);
        assert_eq!(exchange_of(&out), Some(vec![peer(1)]));
        let out = s.input(
            0,
            Input::Exchanged {
                round: 0,
                outcomes: vec![(peer(1), swapped())],
            },
            start(0) + 5100,
        );
        let (row, arrived) = finish_of(&out).unwrap();
        assert_eq!(row.weight(row.worker), 0.5);
        let other = row.neighbours().next().unwrap();
        assert_eq!(row.weight(other), 0.5);
        assert_eq!(arrived, vec![(other, peer(1))]);
        let out = s.input(
            0,
            Input::Finished {
                round: 0,
                val_loss: Some(1.5),
            },
            start(0) + 5300,
        );
        let record = record_of(&out).unwrap();
        assert_eq!(record.exchanged, vec![peer(1).to_string()]);
        assert_eq!(record.bytes_sent, 1000);
        assert_eq!(record.bytes_received, 1000);
        assert_eq!(record.inner_steps, 10);
        assert_eq!((record.exchange_s, record.wait_s), (0.1, 0.1));
        assert_eq!((record.finish_s, record.round_s), (0.2, 5.3));
        // The first round's wall time counts from its start: 4.24 s busy of 5.3.
        assert_eq!((record.train_s, record.wall_s), (4.24, 5.3));
        assert!((record.compute_utilization - 0.8).abs() < 1e-12);
        // Where the trainer's other time went, as the trainer reported it.
        let Input::Trained { trainer_time, .. } = trained(0) else {
            unreachable!()
        };
        assert_eq!(record.trainer_time, trainer_time);
        assert_eq!(record.decided_after_ms, 1000);
        assert_eq!(record.val_loss, Some(1.5));
        assert_eq!(record.mixing[0], (peer(0).to_string(), 0.5));
        // Its commit, announce and reveal came from the other node.
        assert_eq!(record.control_messages, 3);
        assert!(s.machines[0].is_done(), "one round asked for");
    }

    /// Machine 0 of a pair runs round `round` with its neighbour's payload ending as
    /// `outcome` (or its exchange never started, when the neighbour is banned); returns the
    /// outputs of its exchange's end and of its outer step's.
    fn round_with(s: &mut Swarm, round: u64, outcome: Outcome) -> (Vec<Output>, Vec<Output>) {
        to_decision(s, round);
        let mut out = s.input(0, trained(round), start(round) + 5000);
        if let Some(neighbours) = exchange_of(&out) {
            let outcomes = neighbours
                .into_iter()
                .map(|p| (p, outcome.clone()))
                .collect();
            out = s.input(0, Input::Exchanged { round, outcomes }, start(round) + 6000);
        }
        let finished = Input::Finished {
            round,
            val_loss: None,
        };
        let done = s.input(0, finished, start(round) + 6500);
        (out, done)
    }

    fn refused(kind: RefusalKind, gross: bool) -> Outcome {
        Outcome::Refused {
            kind,
            reason: format!("gate: {kind}"),
            bytes: 1000,
            gross,
        }
    }

    fn bans_of(out: &[Output]) -> Vec<PeerId> {
        out.iter()
            .filter_map(|o| match o {
                Output::Ban { peer, .. } => Some(*peer),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_neighbour_refused_three_times_is_banned_and_then_refused_without_an_exchange() {
        let mut s = Swarm::new(2, Topology::OnePeer, 10, start(0) - PERIOD);
        // A refusal that is no offence (a busy partner) moves nothing.
        let (_, done) = round_with(&mut s, 0, refused(RefusalKind::Busy, false));
        assert!(bans_of(&done).is_empty());
        assert!(!done.iter().any(|o| matches!(o, Output::Score { .. })));
        for round in 1..=2 {
            let (_, done) = round_with(&mut s, round, refused(RefusalKind::TooFar, false));
            assert!(bans_of(&done).is_empty(), "round {round}");
            let score = find(&done, |o| match o {
                Output::Score { peer, score } => Some((*peer, *score)),
                _ => None,
            });
            assert_eq!(score, Some((peer(1), -(round as f64))));
        }
        let (_, done) = round_with(&mut s, 3, refused(RefusalKind::Harmful, false));
        assert_eq!(bans_of(&done), [peer(1)]);
        let standing = find(&done, |o| match o {
            Output::Status(StatusChange::Standing { banned, .. }) => Some(banned.clone()),
            _ => None,
        })
        .unwrap();
        assert_eq!(
            standing[0].offences,
            ["1:too_far", "2:too_far", "3:harmful"]
        );
        assert!(s.machines[0].standing().is_banned(&peer(1)));
        // Round 4: the banned neighbour is refused without an exchange, mixed as missing.
        let (out, done) = round_with(&mut s, 4, swapped());
        assert_eq!(exchange_of(&out), None, "no exchange with a banned peer");
        let (row, arrived) = finish_of(&out).unwrap();
        assert_eq!((row.weight(row.worker), arrived.len()), (1.0, 0));
        let record = record_of(&done).unwrap();
        assert_eq!(record.refused[0].kind, RefusalKind::Banned);
        assert!(bans_of(&done).is_empty(), "banned once");
    }

    #[test]
    fn a_gross_offence_bans_at_once_and_offences_posted_beside_the_rounds_count() {
        let mut s = Swarm::new(2, Topology::OnePeer, 10, start(0) - PERIOD);
        let (_, done) = round_with(&mut s, 0, refused(RefusalKind::NonFinite, true));
        assert_eq!(bans_of(&done), [peer(1)]);

        let mut s = Swarm::new(2, Topology::OnePeer, 10, start(0) - PERIOD);
        let bad_shards = vec![(peer(1), RefusalKind::BadShard); 2];
        s.input(0, Input::Offences(bad_shards), start(0) - 2000);
        let (_, done) = round_with(&mut s, 0, refused(RefusalKind::TableMismatch, false));
        assert_eq!(bans_of(&done), [peer(1)], "two bad shards and a bad table");
    }

    #[test]
    fn a_machine_started_with_a_kept_ban_never_exchanges_with_that_peer() {
        let mut s = Swarm::new(2, Topology::OnePeer, 10, start(0) - PERIOD);
        let mut standing = PeerStanding::new(&GateConfig::default(), Vec::new());
        standing.offend_grossly(peer(1), 0, RefusalKind::TooFar);
        let machine = std::mem::replace(
            &mut s.machines[0],
            Swarm::new(1, Topology::OnePeer, 1, start(0) - PERIOD)
                .machines
                .remove(0),
        );
        s.machines[0] = machine.with_standing(standing);
        let (out, done) = round_with(&mut s, 0, swapped());
        assert_eq!(exchange_of(&out), None);
        assert_eq!(
            record_of(&done).unwrap().refused[0].kind,
            RefusalKind::Banned
        );
    }

    #[test]
    fn a_failed_or_refused_neighbour_is_mixed_as_missing() {
        let mut s = Swarm::new(3, Topology::TwoPeer, 10, start(0) - PERIOD);
        to_decision(&mut s, 0);
        let out = s.input(0, trained(0), start(0) + 5000);
        let neighbours = exchange_of(&out).unwrap();
        assert_eq!(neighbours.len(), 2);
        // One swap succeeded; the other timed out: ⅔ self, ⅓ the neighbour that arrived.
        let out = s.input(
            0,
            Input::Exchanged {
                round: 0,
                outcomes: vec![
                    (neighbours[0], swapped()),
                    (neighbours[1], Outcome::Failed("deadline".into())),
                ],
            },
            start(0) + 8000,
        );
        let (row, arrived) = finish_of(&out).unwrap();
        assert_eq!(row.weight(row.worker), 2.0 / 3.0);
        assert_eq!(arrived.len(), 1);
        assert_eq!(row.weight(arrived[0].0), 1.0 / 3.0);
        assert_eq!(row.terms.len(), 2);
        let out = s.input(
            0,
            Input::Finished {
                round: 0,
                val_loss: None,
            },
            start(0) + 8100,
        );
        let record = record_of(&out).unwrap();
        assert_eq!(record.failed.len(), 1);
        assert_eq!(record.failed[0].0, neighbours[1].to_string());

        // Round 1: one payload refused, the other's outcome never reported.
        to_decision(&mut s, 1);
        let out = s.input(0, trained(1), start(1) + 5000);
        let neighbours = exchange_of(&out).unwrap();
        let out = s.input(
            0,
            Input::Exchanged {
                round: 1,
                outcomes: vec![(
                    neighbours[0],
                    Outcome::Refused {
                        kind: RefusalKind::TooFar,
                        reason: "gate: too_far".into(),
                        bytes: 0,
                        gross: false,
                    },
                )],
            },
            start(1) + 5500,
        );
        let (row, arrived) = finish_of(&out).unwrap();
        assert_eq!(row.terms, vec![(row.worker, 3)], "alone, weight 1");
        assert!(arrived.is_empty());
        let out = s.input(
            0,
            Input::Finished {
                round: 1,
                val_loss: None,
            },
            start(1) + 5600,
        );
        let record = record_of(&out).unwrap();
        assert_eq!(
            record.refused,
            vec![RefusedPayload {
                peer: neighbours[0].to_string(),
                kind: RefusalKind::TooFar,
                reason: "gate: too_far".into(),
                gross: false,
            }]
        );
        assert_eq!(record.failed.len(), 1, "no outcome counts as failed");
        assert_eq!(record.mixing, vec![(peer(0).to_string(), 1.0)]);
    }

    #[test]
    fn a_plan_decided_while_the_round_before_finishes_is_taken_when_the_round_starts() {
        let mut s = Swarm::new(2, Topology::OnePeer, 10, start(0) - PERIOD);
        to_decision(&mut s, 0);
        s.train_and_swap(0, 0, start(0) + 5000, start(0) + 6000);
        // Node 0's outer step of round 0 runs past round 1's start and decision.
        s.tick(start(1) - 1000);
        let busy = s.tick(start(1));
        assert_eq!(training_of(&busy[0]), None, "still finishing round 0");
        s.tick(start(1) + 1000);
        assert_eq!(s.machines[0].phase(), Some((0, Phase::Finishing)));
        let out = s.input(
            0,
            Input::Finished {
                round: 0,
                val_loss: None,
            },
            start(1) + 1500,
        );
        assert!(record_of(&out).is_some());
        // Round 1 starts at once, with its plan: neighbours known, deadline from their link.
        let (round, _) = training_of(&out).unwrap();
        assert_eq!(round, 1);
        assert!(out
            .iter()
            .any(|o| *o == Output::Status(StatusChange::Neighbours(vec![peer(1)]))));
        let out = s.input(0, trained(1), start(1) + 4000);
        assert_eq!(exchange_of(&out), Some(vec![peer(1)]));
    }

    #[test]
    fn a_round_reached_after_it_ended_is_skipped() {
        let mut s = Swarm::new(2, Topology::OnePeer, 10, start(0) - PERIOD);
        to_decision(&mut s, 0);
        s.train_and_swap(0, 0, start(0) + 5000, start(0) + 6000);
        // Node 0's outer step takes until round 2: it committed to rounds 1 and 2 meanwhile.
        to_decision(&mut s, 1);
        s.tick(start(2) - 1000);
        let out = s.input(
            0,
            Input::Finished {
                round: 0,
                val_loss: None,
            },
            start(2) + 10,
        );
        assert_eq!(s.machines[0].rounds_done(), (1, 1), "round 1 skipped");
        assert_eq!(training_of(&out).map(|t| t.0), Some(2));
    }

    #[test]
    fn a_node_too_late_to_commit_waits_for_the_next_joinable_round() {
        let mut s = Swarm::new(2, Topology::OnePeer, 10, start(0) - PERIOD);
        // Node 0 wakes only after round 0's commit window closed for late nodes.
        let out = s.input(0, Input::Tick, start(0) - 400);
        assert!(out.is_empty(), "{out:?}");
        let out = s.input(0, Input::Tick, start(0) + 10);
        assert_eq!(training_of(&out), None, "round 0 not joined");
        let out = s.input(0, Input::Tick, start(1) - 1000);
        assert!(matches!(
            out[..],
            [
                Output::Publish {
                    round: 1,
                    body: Body::Commit(_)
                },
                ..
            ]
        ));
        assert_eq!(s.machines[0].rounds_done(), (0, 0), "nothing missed");
    }

    #[test]
    fn a_stop_withdraws_unrevealed_rounds_and_finishes_the_round_in_flight() {
        let mut s = Swarm::new(2, Topology::OnePeer, 10, start(0) - PERIOD);
        to_decision(&mut s, 0);
        s.tick(start(1) - 1000); // commits to round 1
        let out = s.input(0, Input::Stop, start(1) - 900);
        assert_eq!(out, vec![Output::Status(StatusChange::Stopping)]);
        assert!(!s.machines[0].schedule().has_joined(1));
        assert!(!s.machines[0].is_done(), "round 0 is in flight");
        // Round 0 still exchanges, so its partner gets its payload.
        let out = s.train_and_swap(0, 0, start(1) - 800, start(1) - 700);
        assert!(finish_of(&out).is_some());
        let out = s.input(
            0,
            Input::Finished {
                round: 0,
                val_loss: None,
            },
            start(1) - 600,
        );
        assert!(record_of(&out).is_some());
        assert!(s.machines[0].is_done());
        // No reveal for round 1, no new round, no commit to round 2.
        let later = s.tick(start(1));
        assert!(later[0].is_empty(), "{:?}", later[0]);
        s.tick(start(1) + 1000);
        let out = s.input(0, Input::Tick, start(2) - 1000);
        assert!(out.is_empty(), "{out:?}");
        // The other node saw node 0 withdraw: it is alone in round 1.
        let other = &s.machines[1];
        assert_eq!(other.phase(), Some((0, Phase::Training)));
    }

    #[test]
    fn a_rounds_wall_time_counts_from_the_end_of_the_round_before() {
        let mut s = Swarm::new(1, Topology::OnePeer, 10, start(0) - PERIOD);
        let mut records = Vec::new();
        for round in 0..2 {
            s.tick(start(round) - 1000);
            s.tick(start(round));
            // Alone: no exchange, straight to the outer step.
            let out = s.input(0, trained(round), start(round) + 5000);
            assert!(finish_of(&out).is_some(), "round {round}");
            let out = s.input(
                0,
                Input::Finished {
                    round,
                    val_loss: None,
                },
                start(round) + 5300,
            );
            records.push(record_of(&out).unwrap());
        }
        assert_eq!(records[0].wall_s, 5.3);
        // Round 1 waited for its start: the idle time between the rounds is counted.
        assert_eq!(records[1].wall_s, PERIOD as f64 / 1000.0);
        let expected = 4.24 / (PERIOD as f64 / 1000.0);
        assert!((records[1].compute_utilization - expected).abs() < 1e-12);
    }

    #[test]
    fn overlapped_rounds_train_the_next_round_while_the_one_before_exchanges() {
        let mut s = Swarm::with_overlap(2, Topology::OnePeer, 3, start(0) - PERIOD, true);
        s.tick(start(0) - 1000);
        let started = s.tick(start(0));
        // Nothing reserved: the steps run to the round's end.
        assert_eq!(training_of(&started[0]), Some((0, start(1))));
        s.tick(start(0) + 1000);
        // Everyone commits to round 1; round 0 ends its steps near the round's end and hands
        // off its payload.
        s.tick(start(1) - 1000);
        let out = s.input(0, trained(0), start(1) - 400);
        assert_eq!(exchange_of(&out), Some(vec![peer(1)]));
        assert_eq!(s.machines[0].phase(), None, "round 0 is handed off");
        assert_eq!(s.machines[0].handed_off(), Some((0, Phase::Exchanging)));
        // Round 1 starts on time, its exchange of round 0 still under way.
        let started = s.input(0, Input::Tick, start(1));
        assert_eq!(training_of(&started), Some((1, start(2))));
        assert_eq!(s.machines[0].phase(), Some((1, Phase::Training)));
        // Round 0's exchange and outer step end during round 1: its record.
        let out = s.input(
            0,
            Input::Exchanged {
                round: 0,
                outcomes: vec![(peer(1), swapped())],
            },
            start(1) + 2000,
        );
        assert!(finish_of(&out).is_some());
        let out = s.input(
            0,
            Input::Finished {
                round: 0,
                val_loss: None,
            },
            start(1) + 2100,
        );
        let record = record_of(&out).unwrap();
        assert_eq!((record.round, record.exchanged.len()), (0, 1));
        assert_eq!(s.machines[0].handed_off(), None);
        assert_eq!(s.machines[0].phase(), Some((1, Phase::Training)));
    }

    #[test]
    fn an_overlapped_round_takes_the_rest_of_the_round_before_that_no_step_fits() {
        // Steps of 0.1 s: an overlapped round may start up to 0.2 s early.
        for (overlap, handed_off_at) in [(true, 150), (true, 250), (false, 150)] {
            let mut s = Swarm::with_overlap(2, Topology::OnePeer, 3, start(0) - PERIOD, overlap);
            s.tick(start(0) - 1000);
            s.tick(start(0));
            s.tick(start(0) + 1000);
            s.tick(start(1) - 1000);
            let at = start(1) - handed_off_at;
            let out = if overlap {
                s.input(0, trained(0), at)
            } else {
                s.train_and_swap(0, 0, at, at);
                let finished = Input::Finished {
                    round: 0,
                    val_loss: None,
                };
                s.input(0, finished, at)
            };
            let early = overlap && handed_off_at <= 200;
            let next = training_of(&out);
            if early {
                // Less than two steps were left: round 1 starts at the hand-off, its
                // deadline (round 2's start) unmoved.
                assert_eq!(next, Some((1, start(2))));
            } else {
                assert_eq!(next, None, "overlap {overlap}, {handed_off_at} ms before");
                let wake = s.machines[0].next_wakeup().unwrap();
                assert!(wake <= start(1), "it wakes for round 1's start");
                let started = s.input(0, Input::Tick, start(1));
                assert_eq!(training_of(&started).map(|(r, _)| r), Some(1));
            }
        }
    }

    #[test]
    fn an_overlapped_round_exchanges_only_after_the_round_before_is_finished() {
        let mut s = Swarm::with_overlap(2, Topology::OnePeer, 3, start(0) - PERIOD, true);
        s.tick(start(0) - 1000);
        s.tick(start(0));
        s.tick(start(0) + 1000);
        s.tick(start(1) - 1000);
        assert!(exchange_of(&s.input(0, trained(0), start(1) - 400)).is_some());
        s.tick(start(1));
        s.tick(start(1) + 1000);
        s.tick(start(2) - 1000);
        // Round 1's payload is ready while round 0 still exchanges: it waits.
        let out = s.input(0, trained(1), start(2) - 400);
        assert_eq!(exchange_of(&out), None);
        assert_eq!(s.machines[0].phase(), Some((1, Phase::Agreeing)));
        let out = s.input(
            0,
            Input::Exchanged {
                round: 0,
                outcomes: vec![(peer(1), swapped())],
            },
            start(2) - 300,
        );
        assert!(finish_of(&out).is_some());
        assert_eq!(exchange_of(&out), None, "not before round 0's outer step");
        let out = s.input(
            0,
            Input::Finished {
                round: 0,
                val_loss: None,
            },
            start(2) - 200,
        );
        assert_eq!(record_of(&out).map(|r| r.round), Some(0));
        assert_eq!(
            exchange_of(&out),
            Some(vec![peer(1)]),
            "round 1 hands off now"
        );
        assert_eq!(s.machines[0].handed_off(), Some((1, Phase::Exchanging)));
        // Its wall time counts from round 0's end.
        let out = s.input(
            0,
            Input::Exchanged {
                round: 1,
                outcomes: vec![(peer(1), swapped())],
            },
            start(2) + 100,
        );
        assert!(finish_of(&out).is_some());
        let out = s.input(
            0,
            Input::Finished {
                round: 1,
                val_loss: None,
            },
            start(2) + 200,
        );
        let record = record_of(&out).unwrap();
        assert_eq!(record.wall_s, 0.4);
    }

    #[test]
    fn a_stop_waits_for_the_handed_off_round_too() {
        let mut s = Swarm::with_overlap(2, Topology::OnePeer, 5, start(0) - PERIOD, true);
        s.tick(start(0) - 1000);
        s.tick(start(0));
        s.tick(start(0) + 1000);
        s.tick(start(1) - 1000);
        s.input(0, trained(0), start(1) - 400);
        s.tick(start(1));
        assert_eq!(s.machines[0].phase(), Some((1, Phase::Training)));
        s.input(0, Input::Stop, start(1) + 100);
        assert!(!s.machines[0].is_done(), "rounds 0 and 1 are in flight");
        let out = s.input(
            0,
            Input::Exchanged {
                round: 0,
                outcomes: vec![(peer(1), swapped())],
            },
            start(1) + 200,
        );
        assert!(finish_of(&out).is_some());
        s.input(
            0,
            Input::Finished {
                round: 0,
                val_loss: None,
            },
            start(1) + 300,
        );
        assert!(!s.machines[0].is_done(), "round 1 is still training");
    }

    #[test]
    fn a_stop_between_rounds_is_done_at_once() {
        let mut s = Swarm::new(1, Topology::OnePeer, 10, start(0) - PERIOD);
        s.tick(start(0) - 1000);
        s.input(0, Input::Stop, start(0) - 500);
        assert!(s.machines[0].is_done());
    }

    #[test]
    fn inputs_in_any_order_never_panic() {
        for overlap in [false, true] {
            inputs_in_any_order(overlap);
        }
    }

    fn inputs_in_any_order(overlap: bool) {
        let mut rng = StdRng::seed_from_u64(11);
        let mut s = Swarm::with_overlap(3, Topology::TwoPeer, 20, start(0) - PERIOD, overlap);
        let mut now = start(0) - PERIOD;
        for _ in 0..5000 {
            now += rng.random_range(0..400);
            let i = rng.random_range(0..3);
            let round = s.machines[i]
                .phase()
                .or(s.machines[i].handed_off())
                .map_or(0, |(r, _)| r)
                .saturating_add_signed(rng.random_range(-1..=1));
            let neighbour = peer(rng.random_range(0..4));
            let input = match rng.random_range(0..9) {
                0 => trained(round),
                1 => Input::Exchanged {
                    round,
                    outcomes: vec![
                        (neighbour, swapped()),
                        (neighbour, Outcome::Failed("x".into())),
                        (
                            neighbour,
                            refused(RefusalKind::TooFar, rng.random_bool(0.1)),
                        ),
                    ],
                },
                5 => Input::Offences(vec![(neighbour, RefusalKind::BadShard)]),
                2 => Input::Finished {
                    round,
                    val_loss: None,
                },
                3 if rng.random_bool(0.02) => Input::Stop,
                4 => Input::Control {
                    source: neighbour,
                    message: ControlMessage {
                        run_id: vec![],
                        round,
                        body: Some(Body::Reveal(Reveal {
                            nonce: vec![1, 2, 3],
                        })),
                    },
                },
                _ => Input::Tick,
            };
            s.input(i, input, now);
            let m = &s.machines[i];
            let (finished, skipped) = m.rounds_done();
            assert!(finished + skipped <= 20);
            if let (Some((training, _)), Some((handed, _))) = (m.phase(), m.handed_off()) {
                assert!(
                    overlap && handed < training,
                    "{handed} handed off, {training} training"
                );
            }
        }
    }
}
