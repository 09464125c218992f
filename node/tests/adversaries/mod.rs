//! The adversary harness of the swarm tests (never the product's CLI): a node wired as
//! `join` wires one (`SwarmNode`, the real wire) whose libtorch trainer trains honestly and
//! then poisons what it hands out, in one of the [`Poison`] modes; and a swarm of a
//! bootstrap process with such adversaries, for honest `gasloc-node join` processes to
//! join.
#![allow(dead_code)]

use gasloc_node::volunteer::{RunDataSource, Volunteer, VolunteerOptions};
use gasloc_p2p::driver::DriverOptions;
use gasloc_p2p::exchange::SendOptions;
use gasloc_p2p::local_swarm::local_config;
use gasloc_p2p::peer_standing::PeerStanding;
use gasloc_p2p::swarm_node::{Participation, SwarmNode, STATE_ANCHOR_PREFIX};
use gasloc_p2p::tensors::{TensorSet, TensorSpec};
use gasloc_p2p::work::{
    AnchorSpread, Candidate, Finished, PayloadTables, Received, RoundWork, Screened, TrainOrder,
    Trained, WorkFuture,
};
use gasloc_p2p::{Keypair, Multiaddr, PeerId};
use gasloc_proto::manifest::Overlap;
use gasloc_tests::{prepare_byte_data, start_bootstrap, Proc};
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// DiLoCo (the complete topology): every node meets every other every round.
pub fn manifest() -> String {
    gasloc_tests::tiny_run(
        "adversary-test",
        11,
        "algorithm = \"diloco\"\ninner_steps = 15\n",
    )
}

/// What the adversary poisons.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Poison {
    /// Every payload it sends: a NaN on even rounds, `model.norm.weight` × 1000 on odd ones.
    Payloads,
    /// The state it serves to joining nodes (its payloads are honest).
    State,
    /// Its pseudo-gradient sign-flipped: `2θ − x` (from round 1: it needs its anchor).
    SignFlip,
    /// A random direction of its honest pseudo-gradient's norm: `θ − ‖θ − x‖ · u / ‖u‖`
    /// (from round 1).
    RandomDirection,
    /// A stale model: its anchor of up to 3 rounds before (from round 2, when it has one
    /// older than the current).
    Stale,
}

impl Poison {
    /// The first round this mode poisons a payload (`None`: it never does).
    pub fn first_poisoned_round(self) -> Option<u64> {
        match self {
            Poison::Payloads => Some(0),
            Poison::State => None,
            Poison::SignFlip | Poison::RandomDirection => Some(1),
            Poison::Stale => Some(2),
        }
    }
}

/// The libtorch trainer, with what it hands out poisoned.
struct Poisoner {
    inner: Volunteer,
    poison: Poison,
    /// Its anchors at the start of the last rounds (payload names), oldest first.
    anchors: Arc<Mutex<VecDeque<Weights>>>,
}

/// A model's values by payload tensor name.
type Weights = HashMap<String, Vec<f32>>;

fn floats(t: &gasloc_p2p::tensors::Tensor) -> Vec<f32> {
    t.floats().expect("fp32 payloads")
}

/// `payload` rewritten tensor by tensor as `f(anchor, x)`.
fn rewrite(payload: &mut TensorSet, anchor: &Weights, f: impl Fn(&[f32], &[f32]) -> Vec<f32>) {
    for t in &mut payload.tensors {
        let theta = &anchor[&t.name];
        t.data = f(theta, &floats(t))
            .into_iter()
            .flat_map(f32::to_le_bytes)
            .collect();
    }
}

/// The modes that need the anchor, applied to a trained payload.
fn poison_with_anchor(
    mode: Poison,
    round: u64,
    payload: &mut TensorSet,
    anchors: &VecDeque<Weights>,
) {
    let Some(theta) = anchors.back() else {
        return; // round 0: no anchor yet, the payload goes out honest
    };
    match mode {
        Poison::SignFlip => rewrite(payload, theta, |t, x| {
            t.iter().zip(x).map(|(t, x)| 2.0 * t - x).collect()
        }),
        Poison::RandomDirection => {
            let delta: f64 = payload
                .tensors
                .iter()
                .flat_map(|p| {
                    let x = floats(p);
                    theta[&p.name]
                        .iter()
                        .zip(x)
                        .map(|(t, x)| f64::from(t - x).powi(2))
                        .collect::<Vec<_>>()
                })
                .sum::<f64>()
                .sqrt();
            let mut state = 0x2545_F491_4F6C_DD1Du64 ^ round;
            let mut uniform = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            };
            let mut u: HashMap<String, Vec<f64>> = HashMap::new();
            for p in &payload.tensors {
                u.insert(
                    p.name.clone(),
                    (0..theta[&p.name].len()).map(|_| uniform()).collect(),
                );
            }
            let norm = u.values().flatten().map(|v| v * v).sum::<f64>().sqrt();
            for p in &mut payload.tensors {
                let dir = &u[&p.name];
                p.data = theta[&p.name]
                    .iter()
                    .zip(dir)
                    .map(|(t, d)| (f64::from(*t) - delta * d / norm) as f32)
                    .flat_map(f32::to_le_bytes)
                    .collect();
            }
        }
        Poison::Stale if anchors.len() >= 2 => {
            let old = anchors.front().unwrap();
            rewrite(payload, old, |t, _| t.to_vec())
        }
        _ => {}
    }
}

/// A NaN in `tensor` on even rounds, `tensor` × 1000 on odd ones; a payload without
/// `tensor` (a model fragment of other tensors) has its first tensor poisoned instead.
fn poison(round: u64, payload: &mut TensorSet, tensor: &str) {
    let at = payload
        .tensors
        .iter()
        .position(|t| t.name == tensor)
        .unwrap_or(0);
    let norm = &mut payload.tensors[at];
    let values = norm.data.chunks_exact(4).enumerate().map(|(i, b)| {
        let v = f32::from_le_bytes(b.try_into().unwrap());
        match round % 2 {
            0 if i == 0 => f32::NAN,
            0 => v,
            _ => v * 1000.0,
        }
    });
    norm.data = values.flat_map(f32::to_le_bytes).collect();
}

impl RoundWork for Poisoner {
    fn payload_tables(&self) -> PayloadTables {
        self.inner.payload_tables()
    }
    fn state_table(&self) -> Vec<TensorSpec> {
        self.inner.state_table()
    }
    fn train(&mut self, order: TrainOrder) -> WorkFuture<Trained> {
        let round = order.round;
        let trained = self.inner.train(order);
        let (mode, anchors) = (self.poison, self.anchors.clone());
        Box::pin(async move {
            let mut trained = trained.await?;
            match mode {
                Poison::Payloads => poison(round, &mut trained.payload, "model.norm.weight"),
                Poison::State => {}
                _ => {
                    let anchors = anchors.lock().unwrap().clone();
                    poison_with_anchor(mode, round, &mut trained.payload, &anchors);
                }
            }
            Ok(trained)
        })
    }
    fn screen(&mut self, round: u64, candidates: Vec<Candidate>) -> WorkFuture<Vec<Screened>> {
        self.inner.screen(round, candidates)
    }
    fn finish(&mut self, mut received: Received) -> WorkFuture<Finished> {
        // The state (anchor and momentum) every round: the anchor-based modes need it.
        let asked = received.want_state;
        received.want_state = true;
        let finished = self.inner.finish(received);
        let poisoned = self.poison == Poison::State;
        let anchors = self.anchors.clone();
        Box::pin(async move {
            let mut finished = finished.await?;
            if let Some(state) = &finished.state {
                let anchor: Weights = state
                    .tensors
                    .iter()
                    .filter_map(|t| {
                        let name = t.name.strip_prefix(STATE_ANCHOR_PREFIX)?;
                        Some((name.to_string(), floats(t)))
                    })
                    .collect();
                let mut anchors = anchors.lock().unwrap();
                anchors.push_back(anchor);
                if anchors.len() > 4 {
                    anchors.pop_front();
                }
            }
            if !asked {
                finished.state = None;
            }
            if let (true, Some(state)) = (poisoned, finished.state.as_mut()) {
                // Odd: scaled, finite (a NaN is refused by every joiner on its own).
                poison(1, state, "anchor.model.norm.weight");
            }
            Ok(finished)
        })
    }
    fn load_state(&mut self, round: u64, state: TensorSet, spread: AnchorSpread) -> WorkFuture<()> {
        self.inner.load_state(round, state, spread)
    }
    fn close(&mut self) -> WorkFuture<()> {
        self.inner.close()
    }
}

/// Joins the swarm at `bootstrap` as the adversary poisoning `what` and takes part in
/// `rounds` rounds; returns its peer id once it has joined, and the task running its rounds.
pub async fn start_adversary(
    bootstrap: &str,
    home: &std::path::Path,
    data: &std::path::Path,
    what: Poison,
    rounds: u64,
) -> (PeerId, tokio::task::JoinHandle<anyhow::Result<()>>) {
    let bootstrap: Multiaddr = bootstrap.parse().unwrap();
    let bootstrap_peer = gasloc_p2p::network::peer_id_of(&bootstrap).unwrap();
    let listen: Multiaddr = "/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap();
    let node = SwarmNode::start(
        Keypair::generate_ed25519(),
        local_config(listen, vec![bootstrap]),
        None,
    )
    .await
    .unwrap();
    let me = node.peer_id();
    let (manifest, timing) = node.fetch_manifest(&[bootstrap_peer], None).await.unwrap();
    let inner = Volunteer::start(VolunteerOptions {
        manifest: manifest.clone(),
        device: tch::Device::Cpu,
        data: RunDataSource::Given(data.to_path_buf()),
        checkpoints: home.join("checkpoints"),
        checkpoint_every: 0,
        keep_checkpoints: 1,
        eval_every: 0,
        threads: 1,
        peer: me,
    })
    .unwrap();
    let node = node.join_run(manifest.run_id(), timing).await.unwrap();
    let participation = Participation {
        work: Box::new(Poisoner {
            inner,
            poison: what,
            anchors: Default::default(),
        }),
        options: DriverOptions {
            rounds,
            withhold_reveals: false,
            send: SendOptions::default(),
            standing: PeerStanding::new(&manifest.gate, Vec::new()),
            ban_file: None,
            offences: Default::default(),
            overlap: manifest.outer.overlap != Overlap::None,
        },
        status: tokio::sync::watch::channel(Default::default()).0,
        stop: Default::default(),
    };
    let task = tokio::spawn(async move {
        node.take_part(participation, |_| {}).await?;
        Ok(())
    });
    (me, task)
}

/// A bootstrap process for a manifest and adversaries, joined; honest nodes are the test's
/// to start (their homes `dir/node<i>`, i ≥ 1; the adversaries' `dir/adversary<k>`).
pub struct Swarm {
    _tmp: tempfile::TempDir,
    _bootstrap: Proc,
    pub dir: std::path::PathBuf,
    pub data: std::path::PathBuf,
    pub boot: String,
    /// The adversaries' peer ids, in the order of their modes.
    pub adversaries: Vec<String>,
    pub tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Swarm {
    /// The swarm of [`manifest`] with one adversary, in rounds of 4 s.
    pub async fn with_adversary(poison: Poison, rounds: u64) -> Swarm {
        Swarm::start(&manifest(), &[poison], rounds, [8000, 4000, 500, 2000]).await
    }

    /// `timing`: genesis delay, period, commit and reveal windows, exchange timeout (ms).
    /// The data: the byte shards in `$GASLOC_ADVERSARY_DATA` when it is set (real text, such
    /// as `make setup`'s `datasets/shakespeare-byte`), else the tests' six-sentence corpus.
    pub async fn start(manifest: &str, poisons: &[Poison], rounds: u64, timing: [u64; 4]) -> Swarm {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let path = dir.join("run.toml");
        std::fs::write(&path, manifest).unwrap();
        let data = test_data(&dir);
        let [genesis, period, window, exchange] = timing;
        let (bootstrap, boot) = start_bootstrap(&dir, &path, genesis, period, window, exchange);
        let (mut adversaries, mut tasks) = (Vec::new(), Vec::new());
        for (k, poison) in poisons.iter().enumerate() {
            let home = dir.join(format!("adversary{k}"));
            let (peer, task) = start_adversary(&boot, &home, &data, *poison, rounds).await;
            adversaries.push(peer.to_string());
            tasks.push(task);
        }
        Swarm {
            _tmp: tmp,
            _bootstrap: bootstrap,
            dir,
            data,
            boot,
            adversaries,
            tasks,
        }
    }
}

/// The default manifest's `[outer]` (delayed overlap in five fragments, six inner steps) on
/// `topology`: what a user runs, for the adversaries of `adversary_default.rs`.
pub fn default_manifest(topology: &str) -> String {
    gasloc_tests::tiny_run(
        "adversary-default-test",
        11,
        &format!("topology = \"{topology}\"\n"),
    )
}

/// The byte shards in `$GASLOC_ADVERSARY_DATA` when it is set (real text, such as `make
/// setup`'s `datasets/shakespeare-byte`), else the tests' six-sentence corpus written in `dir`.
pub fn test_data(dir: &std::path::Path) -> std::path::PathBuf {
    match std::env::var_os("GASLOC_ADVERSARY_DATA") {
        Some(given) => std::fs::canonicalize(&given)
            .unwrap_or_else(|e| panic!("GASLOC_ADVERSARY_DATA={given:?}: {e}")),
        None => prepare_byte_data(dir),
    }
}

/// Round records with `peer`'s gate readings left out (the honest ones' margins).
pub fn without_readings_of(records: &[Value], peer: &str) -> Vec<Value> {
    records
        .iter()
        .map(|r| {
            let mut r = r.clone();
            if let Some(gate) = r["gate"].as_array_mut() {
                gate.retain(|g| g["peer"] != peer);
            }
            r
        })
        .collect()
}

/// The peers whose models a round record says were mixed (this node first).
pub fn mixed_peers(record: &Value) -> Vec<&str> {
    record["mixing"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w[0].as_str().unwrap())
        .collect()
}

pub fn peers(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect()
}
