//! A whole swarm's rounds in one process, simulated: N [`RoundMachine`]s (each with the
//! real [`RoundSchedule`]) driven through a simulated network by a deterministic
//! discrete-event loop — the house pattern of `schedule.rs`'s tests, at internet scale.
//!
//! It owns the simulated world around the machines: the clock, the network that carries
//! their control messages, their training, their exchanges and their outer steps; the
//! machines decide everything else, exactly as in a node. What it measures is whether every
//! live node decides on the same round (members and permutation) and what a disagreement
//! costs.
//!
//! The model (all times Unix ms; every random draw from one seeded [`StdRng`], events in a
//! [`BinaryHeap`] ordered by time and then by a sequence number, so a seed gives one run):
//! * **Control plane** ([`Dissemination::Mesh`], gossipsub-like): a random undirected mesh in
//!   which every node links to `degree / 2` random others (average degree ≈ `degree`). A
//!   published message travels hop by hop; each edge it crosses, per message, takes a
//!   latency drawn uniformly from [`SimConfig::latency_ms`] and loses it with probability
//!   [`SimConfig::loss`]. A node receives the message at its earliest arrival over the
//!   surviving paths (Dijkstra per message) and forwards it on receipt. Not modelled:
//!   gossipsub's IHAVE/IWANT repair of lost messages, mesh maintenance (the mesh is fixed
//!   for the run), message validation and any CPU cost. [`Dissemination::Direct`] has no
//!   mesh: each (message, receiver) pair gets one latency and one loss draw, so the
//!   comparison shows what the mesh's redundancy buys.
//! * **Clocks** are in sync: every node's `now` is the simulation's.
//! * **Training** ends exactly at the deadline the machine gives (adaptive H fills it), moved
//!   by `MoveDeadline`.
//! * **Exchange**: a swap between `i` and `j` happens when both started the same round's
//!   exchange naming each other, the later before the earlier one's exchange timeout. It
//!   ends `bytes / link_bytes_per_s` after the later start, where `bytes` is the payload
//!   times the larger neighbour count of the two (a node sends to all its neighbours at
//!   once over one link); it fails on both sides if that is after the earlier side's
//!   timeout. A neighbour not paired by a node's timeout fails at start + timeout. A node's
//!   exchange result comes when every neighbour has an outcome. Links are all alike; no
//!   refusals.
//! * **Outer step**: [`SimConfig::finish_ms`] after `Finish`.
//! * **Faults**: the reveals of the nodes in [`SimConfig::isolate_reveals_of`] reach nobody.
//!
//! A round's record is reduced at once to a digest of (round, members, permutation) and a
//! few numbers ([`RoundStats`]); a round **agreed** when every live node (one not isolated)
//! wrote a record for it as a member and all those records have one digest.

use crate::round_machine::{
    Input, MachineConfig, Outcome, Output, PayloadBytes, RoundMachine, RoundRecord,
};
use crate::schedule::{RoundSchedule, Timing};
use gasloc_proto::topology::Topology;
use gasloc_proto::wire::{control_message::Body, ControlMessage};
use gasloc_status::TrainerTime;
use libp2p::identity::Keypair;
use libp2p::PeerId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::hash::{Hash, Hasher};
use std::ops::RangeInclusive;
use std::time::{Duration, Instant};

/// How control messages spread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Dissemination {
    /// Hop by hop over a random mesh of average degree `degree` (gossipsub's D is 5–12,
    /// default 6–8).
    Mesh { degree: usize },
    /// Straight from the publisher to every receiver, one latency and loss draw each.
    Direct,
}

/// One simulated run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub nodes: usize,
    /// Rounds each machine runs (finished or skipped).
    pub rounds: u64,
    /// The run's timing; the simulation starts one period before genesis.
    pub timing: Timing,
    /// Per hop (mesh) or per delivery (direct), drawn uniformly, ms.
    pub latency_ms: RangeInclusive<u64>,
    /// Probability that one hop (mesh) or one delivery (direct) loses a message.
    pub loss: f64,
    pub dissemination: Dissemination,
    pub payload_bytes: u64,
    /// Every node's link, bytes per second.
    pub link_bytes_per_s: u64,
    /// Seconds of one inner step (for the record's H_i only).
    pub step_time_s: f64,
    /// Milliseconds of the mixing and outer step.
    pub finish_ms: u64,
    /// Nodes whose reveals reach nobody (they are not counted as live).
    pub isolate_reveals_of: Vec<usize>,
    pub seed: u64,
}

impl SimConfig {
    /// The scale run's defaults: one-peer, period 20 s, commit and reveal windows 3 s,
    /// exchange timeout 10 s, a 32 MiB payload over 10 MB/s links (3.4 s per swap),
    /// 20–300 ms per hop, 1 % loss, a mesh of degree 8, genesis at 2027-01-15 08:00 UTC.
    pub fn new(nodes: usize, rounds: u64, seed: u64) -> SimConfig {
        SimConfig {
            nodes,
            rounds,
            timing: Timing {
                genesis_ms: 1_800_000_000_000,
                period_ms: 20_000,
                commit_window_ms: 3_000,
                reveal_window_ms: 3_000,
                exchange_timeout_ms: 10_000,
                topology: Topology::OnePeer,
            },
            latency_ms: 20..=300,
            loss: 0.01,
            dissemination: Dissemination::Mesh { degree: 8 },
            payload_bytes: 32 << 20,
            link_bytes_per_s: 10_000_000,
            step_time_s: 0.25,
            finish_ms: 50,
            isolate_reveals_of: Vec::new(),
            seed,
        }
    }
}

/// One round as the nodes recorded it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoundStats {
    pub round: u64,
    /// Records written for the round by live nodes, and by live nodes as members.
    pub records: usize,
    pub member_records: usize,
    /// Distinct (members, permutation) digests among the live member records, largest group
    /// first: `(nodes with that view, members in it)`.
    pub views: Vec<(usize, usize)>,
    pub agreed: bool,
    /// Neighbour outcomes that failed, over every node's record (isolated nodes included).
    pub failed: u64,
    /// Of those, the ones in live nodes' records.
    pub live_failed: u64,
    /// Records with at least one failed neighbour.
    pub nodes_with_failures: usize,
    pub max_exchange_s: f64,
    /// The longest exchange among records with a failed neighbour (0: none).
    pub max_failed_exchange_s: f64,
    pub max_round_s: f64,
    /// The latest decision and reveal arrival after the round start, ms (worst node).
    pub max_decided_after_ms: u64,
    pub max_last_reveal_after_ms: u64,
}

/// What a run measured (no wall-clock time: same seed, same summary).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimSummary {
    pub nodes: usize,
    pub live_nodes: usize,
    pub rounds: usize,
    pub agreed_rounds: usize,
    pub disagreeing_rounds: usize,
    pub failed_exchanges: u64,
    /// Failed neighbour outcomes in live nodes' records.
    pub live_failed_exchanges: u64,
    pub max_exchange_s: f64,
    /// The longest exchange in a round that did not agree (0: none) and of a record with a
    /// failed neighbour, against the timeout.
    pub max_exchange_s_disagreeing: f64,
    pub max_failed_exchange_s: f64,
    pub exchange_timeout_s: f64,
    /// Rounds the machines committed to and missed (`rounds_done().1`, all nodes).
    pub skipped_rounds: u64,
    /// Rounds some live node has no record of (skipped, or not committed to).
    pub missing_records: u64,
    pub max_round_s: f64,
    pub messages_published: u64,
    /// Message deliveries to nodes, and (message, receiver) pairs that never arrived.
    pub deliveries: u64,
    pub undelivered: u64,
    /// Wakeups the machines asked for at or before the moment they asked (scheduled 1 ms
    /// later instead); 0 in a healthy run.
    pub past_wakeups: u64,
    /// The mesh: smallest and largest degree, and whether it is connected.
    pub mesh_min_degree: usize,
    pub mesh_max_degree: usize,
    pub mesh_connected: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct SimResult {
    pub rounds: Vec<RoundStats>,
    pub summary: SimSummary,
    /// Seconds the simulation took to run.
    pub wall_s: f64,
}

/// The digest of what a record says was decided.
pub fn plan_digest(record: &RoundRecord) -> u64 {
    // DefaultHasher::new() has fixed keys: deterministic across runs.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    record.round.hash(&mut h);
    record.members.hash(&mut h);
    record.permutation.hash(&mut h);
    h.finish()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Tick(u32),
    /// The next arrival of an in-flight message.
    Deliver(u32),
    Trained {
        node: u32,
        round: u64,
        deadline: u64,
    },
    ExchangeTimeout {
        node: u32,
        round: u64,
    },
    ExchangeDone {
        node: u32,
        round: u64,
    },
    Finished {
        node: u32,
        round: u64,
    },
}

struct Training {
    round: u64,
    started: u64,
    deadline: u64,
}

struct Exchange {
    round: u64,
    started: u64,
    neighbours: Vec<u32>,
    /// Per neighbour: when its outcome is in, and the outcome.
    outcomes: Vec<Option<(u64, Outcome)>>,
    complete: bool,
}

struct Node {
    machine: RoundMachine,
    next_tick: Option<u64>,
    training: Option<Training>,
    exchange: Option<Exchange>,
    done: bool,
}

struct Message {
    source: u32,
    round: u64,
    body: Body,
    /// (arrival ms, receiver), in arrival order.
    arrivals: Vec<(u64, u32)>,
    cursor: usize,
}

#[derive(Default)]
struct RoundAcc {
    records: usize,
    member_records: usize,
    views: Vec<(u64, usize, usize)>,
    failed: u64,
    live_failed: u64,
    nodes_with_failures: usize,
    max_exchange_s: f64,
    max_failed_exchange_s: f64,
    max_round_s: f64,
    max_decided_after_ms: u64,
    max_last_reveal_after_ms: u64,
}

/// The simulated swarm.
struct Sim {
    config: SimConfig,
    run_id: [u8; 32],
    peers: Vec<PeerId>,
    index: HashMap<PeerId, u32>,
    isolated: Vec<bool>,
    nodes: Vec<Node>,
    /// The mesh as adjacency lists in one array (`adj[offsets[i]..offsets[i + 1]]`).
    offsets: Vec<usize>,
    adj: Vec<u32>,
    rng: StdRng,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    messages: Vec<Option<Message>>,
    free_messages: Vec<u32>,
    spare_arrivals: Vec<Vec<(u64, u32)>>,
    // Dijkstra's scratch space.
    dist: Vec<u64>,
    settled: Vec<bool>,
    frontier: BinaryHeap<Reverse<(u64, u32)>>,
    stats: BTreeMap<u64, RoundAcc>,
    published: u64,
    deliveries: u64,
    undelivered: u64,
    past_wakeups: u64,
}

/// Runs the simulation to the end: every machine done (or the time its rounds allow, plus
/// five periods, passed).
pub fn run(config: &SimConfig) -> SimResult {
    let wall = Instant::now();
    let mut sim = Sim::new(config.clone());
    sim.run();
    let (rounds, summary) = sim.results();
    SimResult {
        rounds,
        summary,
        wall_s: wall.elapsed().as_secs_f64(),
    }
}

fn peer_of(seed: u64, i: usize) -> PeerId {
    let mut secret = [0u8; 32];
    secret[..8].copy_from_slice(&seed.to_le_bytes());
    secret[8..16].copy_from_slice(&(i as u64).to_le_bytes());
    secret[16] = 0x5c;
    Keypair::ed25519_from_bytes(secret)
        .expect("32 bytes are an ed25519 secret")
        .public()
        .to_peer_id()
}

impl Sim {
    fn new(config: SimConfig) -> Sim {
        let n = config.nodes;
        let mut rng = StdRng::seed_from_u64(config.seed);
        let run_id: [u8; 32] = rng.random();
        let peers: Vec<PeerId> = (0..n).map(|i| peer_of(config.seed, i)).collect();
        let index = peers
            .iter()
            .enumerate()
            .map(|(i, p)| (*p, i as u32))
            .collect();
        let mut isolated = vec![false; n];
        for &i in &config.isolate_reveals_of {
            if i < n {
                isolated[i] = true;
            }
        }
        let start = config
            .timing
            .genesis_ms
            .saturating_sub(config.timing.period_ms);
        let nodes = peers
            .iter()
            .map(|peer| {
                let machine_config = MachineConfig {
                    rounds: config.rounds,
                    payload_bytes: PayloadBytes::fixed(config.payload_bytes),
                    upload_cap: None,
                    withhold_reveals: false,
                    overlap: false,
                };
                let schedule = RoundSchedule::new(config.timing.clone(), run_id, *peer);
                let nonces = StdRng::seed_from_u64(rng.random());
                Node {
                    machine: RoundMachine::new(*peer, machine_config, schedule, nonces, start),
                    next_tick: None,
                    training: None,
                    exchange: None,
                    done: false,
                }
            })
            .collect();
        let (offsets, adj) = match config.dissemination {
            Dissemination::Mesh { degree } => random_mesh(n, degree, &mut rng),
            Dissemination::Direct => (vec![0; n + 1], Vec::new()),
        };
        let mut sim = Sim {
            config,
            run_id,
            peers,
            index,
            isolated,
            nodes,
            offsets,
            adj,
            rng,
            events: BinaryHeap::new(),
            seq: 0,
            messages: Vec::new(),
            free_messages: Vec::new(),
            spare_arrivals: Vec::new(),
            dist: vec![u64::MAX; n],
            settled: vec![false; n],
            frontier: BinaryHeap::new(),
            stats: BTreeMap::new(),
            published: 0,
            deliveries: 0,
            undelivered: 0,
            past_wakeups: 0,
        };
        for i in 0..n {
            sim.nodes[i].next_tick = Some(start);
            sim.push(start, Event::Tick(i as u32));
        }
        sim
    }

    fn push(&mut self, at: u64, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, event)));
    }

    fn run(&mut self) {
        let end = self.config.timing.round_start(self.config.rounds + 5);
        let mut live = self.nodes.len();
        while let Some(Reverse((now, _, event))) = self.events.pop() {
            if now > end || live == 0 {
                break;
            }
            let (node, input) = match event {
                Event::Tick(i) => {
                    let node = &mut self.nodes[i as usize];
                    if node.next_tick == Some(now) {
                        node.next_tick = None;
                    }
                    (i, Input::Tick)
                }
                Event::Deliver(m) => match self.next_delivery(m) {
                    Some(delivery) => delivery,
                    None => continue,
                },
                Event::Trained {
                    node,
                    round,
                    deadline,
                } => {
                    let n = &mut self.nodes[node as usize];
                    match n.training.as_ref() {
                        Some(t) if t.round == round && t.deadline == deadline => {}
                        _ => continue, // moved since
                    }
                    let t = n.training.take().expect("checked");
                    let trained_s = now.saturating_sub(t.started) as f64 / 1000.0;
                    let steps = (trained_s / self.config.step_time_s).floor().max(1.0) as u64;
                    let train_s = steps as f64 * self.config.step_time_s;
                    (
                        node,
                        Input::Trained {
                            round,
                            inner_steps: steps,
                            step_time_s: self.config.step_time_s,
                            train_s,
                            train_loss: None,
                            // What is left of the training window after whole steps.
                            trainer_time: TrainerTime {
                                unused_s: (trained_s - train_s).max(0.0),
                                ..TrainerTime::default()
                            },
                        },
                    )
                }
                Event::ExchangeTimeout { node, round } => {
                    self.exchange_timeout(node, round, now);
                    continue;
                }
                Event::ExchangeDone { node, round } => {
                    let n = &mut self.nodes[node as usize];
                    let Some(ex) = n.exchange.take_if(|e| e.round == round) else {
                        continue;
                    };
                    let outcomes = ex
                        .neighbours
                        .iter()
                        .zip(ex.outcomes)
                        .map(|(&j, o)| (self.peers[j as usize], o.expect("complete").1))
                        .collect();
                    (node, Input::Exchanged { round, outcomes })
                }
                Event::Finished { node, round } => (
                    node,
                    Input::Finished {
                        round,
                        val_loss: None,
                    },
                ),
            };
            let i = node as usize;
            if self.nodes[i].done {
                continue;
            }
            let outputs = self.nodes[i].machine.handle(input, now);
            for output in outputs {
                self.apply(node, output, now);
            }
            let n = &mut self.nodes[i];
            if n.machine.is_done() {
                n.done = true;
                live -= 1;
                continue;
            }
            if let Some(mut wake) = n.machine.next_wakeup() {
                if wake <= now {
                    self.past_wakeups += 1;
                    wake = now + 1;
                }
                if n.next_tick.is_none_or(|t| wake < t) {
                    n.next_tick = Some(wake);
                    self.push(wake, Event::Tick(node));
                }
            }
        }
    }

    /// The receiver and input of message `m`'s next arrival; schedules the one after.
    fn next_delivery(&mut self, m: u32) -> Option<(u32, Input)> {
        let msg = self.messages[m as usize]
            .as_mut()
            .expect("message in flight");
        let (_, receiver) = msg.arrivals[msg.cursor];
        msg.cursor += 1;
        let input = Input::Control {
            source: self.peers[msg.source as usize],
            message: ControlMessage {
                run_id: self.run_id.to_vec(),
                round: msg.round,
                body: Some(msg.body.clone()),
            },
        };
        match msg.arrivals.get(msg.cursor) {
            Some(&(at, _)) => self.push(at, Event::Deliver(m)),
            None => {
                let mut msg = self.messages[m as usize].take().expect("in flight");
                msg.arrivals.clear();
                self.spare_arrivals.push(msg.arrivals);
                self.free_messages.push(m);
            }
        }
        if self.nodes[receiver as usize].done {
            return None;
        }
        self.deliveries += 1;
        Some((receiver, input))
    }

    fn apply(&mut self, node: u32, output: Output, now: u64) {
        let i = node as usize;
        match output {
            Output::Publish { round, body } => self.publish(node, round, body, now),
            Output::StartTraining { round, deadline_ms } => {
                self.nodes[i].training = Some(Training {
                    round,
                    started: now,
                    deadline: deadline_ms,
                });
                self.train_until(node, round, deadline_ms, now);
            }
            Output::MoveDeadline { round, deadline_ms } => {
                if let Some(t) = self.nodes[i].training.as_mut().filter(|t| t.round == round) {
                    t.deadline = deadline_ms;
                    self.train_until(node, round, deadline_ms, now);
                }
            }
            Output::StartExchange { round, neighbours } => {
                self.start_exchange(node, round, &neighbours, now)
            }
            Output::Finish { round, .. } => {
                self.push(now + self.config.finish_ms, Event::Finished { node, round })
            }
            Output::Record(record) => self.record(node, &record),
            // Every simulated node is honest: nobody is banned, and no score moves.
            Output::Ban { .. } | Output::Score { .. } | Output::Status(_) => {}
        }
    }

    /// The node's training of `round` ends at `deadline` (a moved deadline schedules again;
    /// the stale event is ignored).
    fn train_until(&mut self, node: u32, round: u64, deadline: u64, now: u64) {
        self.push(
            deadline.max(now),
            Event::Trained {
                node,
                round,
                deadline,
            },
        );
    }

    fn publish(&mut self, source: u32, round: u64, body: Body, now: u64) {
        self.published += 1;
        let mut arrivals = self.spare_arrivals.pop().unwrap_or_default();
        let n = self.nodes.len();
        let reaches_nobody = self.isolated[source as usize] && matches!(body, Body::Reveal(_));
        if reaches_nobody {
            self.undelivered += n as u64 - 1;
        } else {
            match self.config.dissemination {
                Dissemination::Mesh { .. } => self.spread(source, now, &mut arrivals),
                Dissemination::Direct => {
                    for v in 0..n as u32 {
                        if v == source || self.rng.random_bool(self.config.loss) {
                            continue;
                        }
                        let latency = self.rng.random_range(self.config.latency_ms.clone());
                        arrivals.push((now + latency, v));
                    }
                    arrivals.sort_unstable();
                }
            }
            self.undelivered += (n - 1 - arrivals.len()) as u64;
        }
        let Some(&(first, _)) = arrivals.first() else {
            self.spare_arrivals.push(arrivals);
            return;
        };
        let message = Message {
            source,
            round,
            body,
            arrivals,
            cursor: 0,
        };
        let m = match self.free_messages.pop() {
            Some(m) => {
                self.messages[m as usize] = Some(message);
                m
            }
            None => {
                self.messages.push(Some(message));
                (self.messages.len() - 1) as u32
            }
        };
        self.push(first, Event::Deliver(m));
    }

    /// Earliest arrival at every node of a message `source` publishes at `now`, over the
    /// mesh, each hop with its own latency and loss draw (Dijkstra).
    fn spread(&mut self, source: u32, now: u64, arrivals: &mut Vec<(u64, u32)>) {
        self.dist.fill(u64::MAX);
        self.settled.fill(false);
        self.frontier.clear();
        self.dist[source as usize] = now;
        self.frontier.push(Reverse((now, source)));
        let latency = self.config.latency_ms.clone();
        while let Some(Reverse((d, u))) = self.frontier.pop() {
            let ui = u as usize;
            if self.settled[ui] {
                continue;
            }
            self.settled[ui] = true;
            if u != source {
                arrivals.push((d, u));
            }
            for &v in &self.adj[self.offsets[ui]..self.offsets[ui + 1]] {
                let vi = v as usize;
                if self.settled[vi] || self.rng.random_bool(self.config.loss) {
                    continue;
                }
                let at = d + self.rng.random_range(latency.clone());
                if at < self.dist[vi] {
                    self.dist[vi] = at;
                    self.frontier.push(Reverse((at, v)));
                }
            }
        }
    }

    fn start_exchange(&mut self, node: u32, round: u64, neighbours: &[PeerId], now: u64) {
        let timeout = self.config.timing.exchange_timeout_ms;
        let mine: Vec<u32> = neighbours
            .iter()
            .map(|p| *self.index.get(p).expect("neighbours are simulated peers"))
            .collect();
        let mut outcomes: Vec<Option<(u64, Outcome)>> = vec![None; mine.len()];
        for (k, &j) in mine.iter().enumerate() {
            let payload = self.config.payload_bytes;
            let rate = self.config.link_bytes_per_s.max(1);
            let Some(theirs) = self.nodes[j as usize].exchange.as_mut() else {
                continue;
            };
            if theirs.round != round || now >= theirs.started + timeout {
                continue;
            }
            let Some(m) = theirs.neighbours.iter().position(|&x| x == node) else {
                continue;
            };
            if theirs.outcomes[m].is_some() {
                continue;
            }
            // Both send to all their neighbours at once over one link.
            let sends = mine.len().max(theirs.neighbours.len()) as u64;
            let transfer_ms = (payload * sends * 1000).div_ceil(rate);
            let done = now + transfer_ms;
            let give_up = theirs.started + timeout;
            let (at, outcome) = if done <= give_up {
                let transfer = Duration::from_millis(transfer_ms);
                (
                    done,
                    Outcome::Swapped {
                        bytes: payload,
                        transfer,
                    },
                )
            } else {
                (give_up, timed_out())
            };
            theirs.outcomes[m] = Some((at, outcome.clone()));
            outcomes[k] = Some((at, outcome));
            self.complete_if_done(j);
        }
        self.nodes[node as usize].exchange = Some(Exchange {
            round,
            started: now,
            neighbours: mine,
            outcomes,
            complete: false,
        });
        self.complete_if_done(node);
        self.push(now + timeout, Event::ExchangeTimeout { node, round });
    }

    fn exchange_timeout(&mut self, node: u32, round: u64, now: u64) {
        let Some(ex) = self.nodes[node as usize]
            .exchange
            .as_mut()
            .filter(|e| e.round == round)
        else {
            return;
        };
        for o in ex.outcomes.iter_mut().filter(|o| o.is_none()) {
            *o = Some((now, timed_out()));
        }
        self.complete_if_done(node);
    }

    /// Schedules the exchange result once every neighbour has an outcome.
    fn complete_if_done(&mut self, node: u32) {
        let Some(ex) = self.nodes[node as usize].exchange.as_mut() else {
            return;
        };
        if ex.complete || ex.outcomes.iter().any(|o| o.is_none()) {
            return;
        }
        ex.complete = true;
        let at = ex.outcomes.iter().flatten().map(|(t, _)| *t).max();
        let round = ex.round;
        let at = at.unwrap_or(ex.started);
        self.push(at, Event::ExchangeDone { node, round });
    }

    fn record(&mut self, node: u32, r: &RoundRecord) {
        let acc = self.stats.entry(r.round).or_default();
        let failed = r.failed.len() as u64;
        acc.failed += failed;
        acc.max_exchange_s = acc.max_exchange_s.max(r.exchange_s);
        acc.max_round_s = acc.max_round_s.max(r.round_s);
        if failed > 0 {
            acc.nodes_with_failures += 1;
            acc.max_failed_exchange_s = acc.max_failed_exchange_s.max(r.exchange_s);
        }
        acc.max_decided_after_ms = acc.max_decided_after_ms.max(r.decided_after_ms);
        acc.max_last_reveal_after_ms = acc.max_last_reveal_after_ms.max(r.last_reveal_after_ms);
        if self.isolated[node as usize] {
            return;
        }
        acc.live_failed += failed;
        acc.records += 1;
        if !r.is_member {
            return;
        }
        acc.member_records += 1;
        let digest = plan_digest(r);
        match acc.views.iter_mut().find(|(d, _, _)| *d == digest) {
            Some(view) => view.1 += 1,
            None => acc.views.push((digest, 1, r.members.len())),
        }
    }

    fn results(self) -> (Vec<RoundStats>, SimSummary) {
        let live = self.isolated.iter().filter(|&&x| !x).count();
        let timeout_s = self.config.timing.exchange_timeout_ms as f64 / 1000.0;
        let mut rounds = Vec::new();
        for (round, acc) in self.stats {
            let mut views: Vec<(usize, usize)> = acc
                .views
                .iter()
                .map(|&(_, count, members)| (count, members))
                .collect();
            views.sort_unstable_by(|a, b| b.cmp(a));
            rounds.push(RoundStats {
                round,
                records: acc.records,
                member_records: acc.member_records,
                agreed: views.len() == 1 && acc.member_records == live,
                views,
                failed: acc.failed,
                live_failed: acc.live_failed,
                nodes_with_failures: acc.nodes_with_failures,
                max_exchange_s: acc.max_exchange_s,
                max_failed_exchange_s: acc.max_failed_exchange_s,
                max_round_s: acc.max_round_s,
                max_decided_after_ms: acc.max_decided_after_ms,
                max_last_reveal_after_ms: acc.max_last_reveal_after_ms,
            });
        }
        let max = |f: fn(&RoundStats) -> f64, only_disagreeing: bool| {
            rounds
                .iter()
                .filter(|r| !only_disagreeing || !r.agreed)
                .map(f)
                .fold(0.0, f64::max)
        };
        let degrees: Vec<usize> = self.offsets.windows(2).map(|w| w[1] - w[0]).collect();
        let agreed_rounds = rounds.iter().filter(|r| r.agreed).count();
        let summary = SimSummary {
            nodes: self.nodes.len(),
            live_nodes: live,
            rounds: rounds.len(),
            agreed_rounds,
            disagreeing_rounds: rounds.len() - agreed_rounds,
            failed_exchanges: rounds.iter().map(|r| r.failed).sum(),
            live_failed_exchanges: rounds.iter().map(|r| r.live_failed).sum(),
            max_exchange_s: max(|r| r.max_exchange_s, false),
            max_exchange_s_disagreeing: max(|r| r.max_exchange_s, true),
            max_failed_exchange_s: max(|r| r.max_failed_exchange_s, false),
            exchange_timeout_s: timeout_s,
            skipped_rounds: self.nodes.iter().map(|n| n.machine.rounds_done().1).sum(),
            missing_records: rounds.iter().map(|r| (live - r.records) as u64).sum(),
            max_round_s: max(|r| r.max_round_s, false),
            messages_published: self.published,
            deliveries: self.deliveries,
            undelivered: self.undelivered,
            past_wakeups: self.past_wakeups,
            mesh_min_degree: degrees.iter().copied().min().unwrap_or(0),
            mesh_max_degree: degrees.iter().copied().max().unwrap_or(0),
            mesh_connected: match self.config.dissemination {
                Dissemination::Mesh { .. } => connected(&self.offsets, &self.adj),
                Dissemination::Direct => true,
            },
        };
        (rounds, summary)
    }
}

fn timed_out() -> Outcome {
    Outcome::Failed("no result within the exchange timeout".into())
}

/// A random undirected graph in which each node links to `degree / 2` random others, as
/// adjacency lists in one array.
fn random_mesh(n: usize, degree: usize, rng: &mut StdRng) -> (Vec<usize>, Vec<u32>) {
    let mut lists: Vec<Vec<u32>> = vec![Vec::new(); n];
    let links = (degree / 2).min(n.saturating_sub(1));
    for i in 0..n {
        let mut made = 0;
        // Stops early only in a swarm so small that `i` links to everyone already.
        while made < links && lists[i].len() < n - 1 {
            let j = rng.random_range(0..n);
            if j == i || lists[i].contains(&(j as u32)) {
                continue;
            }
            lists[i].push(j as u32);
            lists[j].push(i as u32);
            made += 1;
        }
    }
    let mut offsets = Vec::with_capacity(n + 1);
    let mut adj = Vec::new();
    offsets.push(0);
    for list in lists {
        adj.extend(list);
        offsets.push(adj.len());
    }
    (offsets, adj)
}

fn connected(offsets: &[usize], adj: &[u32]) -> bool {
    let n = offsets.len() - 1;
    if n == 0 {
        return true;
    }
    let mut seen = vec![false; n];
    let mut stack = vec![0usize];
    seen[0] = true;
    let mut count = 1;
    while let Some(u) = stack.pop() {
        for &v in &adj[offsets[u]..offsets[u + 1]] {
            if !seen[v as usize] {
                seen[v as usize] = true;
                count += 1;
                stack.push(v as usize);
            }
        }
    }
    count == n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mesh_has_the_asked_degree_and_is_connected() {
        let mut rng = StdRng::seed_from_u64(1);
        let (offsets, adj) = random_mesh(200, 8, &mut rng);
        assert_eq!(
            adj.len(),
            200 * 8,
            "4 links made per node, each counted twice"
        );
        let min = offsets.windows(2).map(|w| w[1] - w[0]).min().unwrap();
        assert!(min >= 4);
        assert!(connected(&offsets, &adj));
    }

    #[test]
    fn a_lossless_mesh_reaches_everyone_in_arrival_order() {
        let mut config = SimConfig::new(30, 1, 3);
        config.loss = 0.0;
        let mut sim = Sim::new(config);
        let mut arrivals = Vec::new();
        sim.spread(0, 1000, &mut arrivals);
        assert_eq!(arrivals.len(), 29);
        assert!(arrivals.windows(2).all(|w| w[0].0 <= w[1].0));
        // Neighbours of the source hear it within one hop's latency.
        for &v in &sim.adj[sim.offsets[0]..sim.offsets[1]] {
            let at = arrivals.iter().find(|(_, u)| *u == v).unwrap().0;
            assert!((1020..=1300).contains(&at), "{at}");
        }
    }

    #[test]
    fn a_small_lossless_swarm_agrees_every_round_and_every_swap_completes() {
        let mut config = SimConfig::new(8, 4, 11);
        config.loss = 0.0;
        let result = run(&config);
        let s = &result.summary;
        assert_eq!(s.rounds, 4);
        assert_eq!(s.agreed_rounds, 4, "{:?}", result.rounds);
        assert_eq!(s.failed_exchanges, 0);
        assert_eq!(s.skipped_rounds, 0);
        assert_eq!(s.past_wakeups, 0);
        assert_eq!(s.undelivered, 0);
        assert_eq!(s.deliveries, s.messages_published * 7);
        // A 32 MiB swap over 10 MB/s.
        assert!(result.rounds.iter().all(|r| r.max_exchange_s >= 3.3));
    }
}
