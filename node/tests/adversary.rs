//! Poisoning peers in a real swarm: a bootstrap process, honest `gasloc-node join`
//! processes and, in this test's process, an adversary wired as `join` wires a node
//! (`SwarmNode`) whose trainer trains honestly and then poisons what it hands out:
//! - its payloads ([`Poison::Payloads`]): a NaN on even rounds, `model.norm.weight` × 1000
//!   on odd rounds (the attack that destroyed a demo run before the payload gate). On the
//!   complete topology every honest node meets it every round. Every honest node refuses
//!   each of its payloads by the right reason, never mixes it, refuses no honest peer,
//!   counts the refusals in `/status` and `/metrics`, bans it at its third offence (in
//!   `/status` and in its home's `bans.json`), and learns;
//! - the state it serves to joiners ([`Poison::State`]), the final norm × 1000, finite: a
//!   late joiner fetches three states, outvotes the poisoned one and trains from the honest
//!   anchor.

use gasloc_node::volunteer::{Volunteer, VolunteerOptions};
use gasloc_p2p::driver::DriverOptions;
use gasloc_p2p::exchange::SendOptions;
use gasloc_p2p::local_swarm::local_config;
use gasloc_p2p::peer_standing::PeerStanding;
use gasloc_p2p::swarm_node::{Participation, SwarmNode};
use gasloc_p2p::tensors::{TensorSet, TensorSpec};
use gasloc_p2p::work::{
    Candidate, Finished, Received, RoundWork, Screened, TrainOrder, Trained, WorkFuture,
};
use gasloc_p2p::{Keypair, Multiaddr, PeerId};
use gasloc_tests::{
    field, http_get, join_command, prepare_byte_data, read_report, start_bootstrap, Proc,
};
use serde_json::Value;
use std::time::Duration;

const MANIFEST: &str = r#"
name = "adversary-test"
seed = 11
[model]
size = "tiny"
[data]
tokenizer = "byte"
seq_len = 32
micro_batch = 8
[optimizer]
lr = 3e-3
warmup_steps = 10
decay_steps = 2000
[eval]
batches = 4
[outer]
algorithm = "diloco"
inner_steps = 15
"#;

const ROUNDS: u64 = 6;

/// What the adversary poisons.
#[derive(Clone, Copy, PartialEq)]
enum Poison {
    /// Every payload it sends.
    Payloads,
    /// The state it serves to joining nodes (its payloads are honest).
    State,
}

/// The libtorch trainer, with what it hands out poisoned.
struct Poisoner {
    inner: Volunteer,
    poison: Poison,
}

/// A NaN in `tensor` on even rounds, `tensor` × 1000 on odd ones.
fn poison(round: u64, payload: &mut TensorSet, tensor: &str) {
    let norm = payload
        .tensors
        .iter_mut()
        .find(|t| t.name == tensor)
        .expect("the model has a final norm");
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
    fn payload_table(&self) -> Vec<TensorSpec> {
        self.inner.payload_table()
    }
    fn state_table(&self) -> Vec<TensorSpec> {
        self.inner.state_table()
    }
    fn train(&mut self, order: TrainOrder) -> WorkFuture<Trained> {
        let round = order.round;
        let trained = self.inner.train(order);
        let poisoned = self.poison == Poison::Payloads;
        Box::pin(async move {
            let mut trained = trained.await?;
            if poisoned {
                poison(round, &mut trained.payload, "model.norm.weight");
            }
            Ok(trained)
        })
    }
    fn screen(&mut self, round: u64, candidates: Vec<Candidate>) -> WorkFuture<Vec<Screened>> {
        self.inner.screen(round, candidates)
    }
    fn finish(&mut self, received: Received) -> WorkFuture<Finished> {
        let finished = self.inner.finish(received);
        let poisoned = self.poison == Poison::State;
        Box::pin(async move {
            let mut finished = finished.await?;
            if let (true, Some(state)) = (poisoned, finished.state.as_mut()) {
                // Odd: scaled, finite (a NaN is refused by every joiner on its own).
                poison(1, state, "anchor.model.norm.weight");
            }
            Ok(finished)
        })
    }
    fn load_state(&mut self, round: u64, state: TensorSet) -> WorkFuture<()> {
        self.inner.load_state(round, state)
    }
    fn close(&mut self) -> WorkFuture<()> {
        self.inner.close()
    }
}

/// Joins the swarm at `bootstrap` as the adversary poisoning `what` and takes part in
/// `rounds` rounds; returns its peer id once it has joined, and the task running its rounds.
async fn start_adversary(
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
        data: data.to_path_buf(),
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
        }),
        options: DriverOptions {
            rounds,
            withhold_reveals: false,
            send: SendOptions::default(),
            standing: PeerStanding::new(&manifest.gate, Vec::new()),
            ban_file: None,
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

/// A bootstrap process for [`MANIFEST`] and the adversary, joined; honest nodes are the
/// test's to start (their homes `dir/node<i>`, the adversary's `dir/node0`).
struct Swarm {
    _tmp: tempfile::TempDir,
    _bootstrap: Proc,
    dir: std::path::PathBuf,
    data: std::path::PathBuf,
    boot: String,
    adversary: String,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Swarm {
    async fn with_adversary(poison: Poison, rounds: u64) -> Swarm {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let manifest = dir.join("run.toml");
        std::fs::write(&manifest, MANIFEST).unwrap();
        let data = prepare_byte_data(&dir);
        let (bootstrap, boot) = start_bootstrap(&dir, &manifest, 8000, 4000, 500, 2000);
        let (adversary, task) =
            start_adversary(&boot, &dir.join("node0"), &data, poison, rounds).await;
        Swarm {
            _tmp: tmp,
            _bootstrap: bootstrap,
            dir,
            data,
            boot,
            adversary: adversary.to_string(),
            task,
        }
    }
}

fn peers(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn honest_nodes_refuse_a_poisoning_peer_every_round_and_learn() {
    let swarm = Swarm::with_adversary(Poison::Payloads, ROUNDS).await;
    let (dir, data, boot) = (swarm.dir.clone(), swarm.data.clone(), swarm.boot.clone());
    let home = |i: usize| dir.join(format!("node{i}"));
    let (adversary, adversary_task) = (swarm.adversary.clone(), swarm.task);
    let rounds = ROUNDS.to_string();
    let mut nodes: Vec<Proc> = (1..=3)
        .map(|i| {
            let extra = ["--rounds", &rounds, "--status-addr", "127.0.0.1:0"];
            Proc::spawn(
                &format!("node{i}"),
                &dir,
                join_command(&boot, &home(i), &data, &extra),
            )
        })
        .collect();
    let nodes = tokio::task::spawn_blocking(move || {
        let line = nodes[0].wait_for_line("status=", Duration::from_secs(60));
        let status = field(&line, "status")
            .unwrap()
            .trim_start_matches("http://")
            .to_string();
        // The counts while node 1 still serves them, after its next-to-last round.
        nodes[0].wait_for_line(&format!("round={} ", ROUNDS - 2), Duration::from_secs(120));
        let json = http_get(&status, "/status");
        let metrics = http_get(&status, "/metrics");
        for node in &mut nodes {
            node.expect_success(Duration::from_secs(120));
        }
        (json, metrics)
    });
    let (json, metrics) = nodes.await.unwrap();
    adversary_task.await.unwrap().unwrap();

    let ban_after = gasloc_proto::manifest::GateConfig::default().ban_after_offences as usize;
    for i in 1..=3 {
        let records = read_report(&home(i));
        assert_eq!(records.len() as u64, ROUNDS, "node{i}");
        // Each pairing with the adversary until the ban is an offence; the one that bans
        // it is the `ban_after`-th, and after it the adversary is refused without an
        // exchange (or, disconnected by every honest node, no longer a member at all).
        let mut pairings = 0;
        for r in &records {
            let round = r["round"].as_u64().unwrap();
            let mixed: Vec<&str> = r["mixing"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| w[0].as_str().unwrap())
                .collect();
            assert!(
                !mixed.contains(&adversary.as_str()),
                "node{i} mixed it: {r}"
            );
            assert!(!peers(&r["exchanged"]).contains(&adversary), "node{i}: {r}");
            if !peers(&r["neighbours"]).contains(&adversary) {
                continue;
            }
            pairings += 1;
            let refused = r["refused"].as_array().unwrap();
            assert_eq!(
                refused.len(),
                1,
                "node{i}: only the adversary is refused: {r}"
            );
            assert_eq!(refused[0]["peer"], adversary.as_str(), "node{i}: {r}");
            let kind = if pairings > ban_after {
                "banned"
            } else if round % 2 == 0 {
                "non_finite"
            } else {
                "too_far"
            };
            assert_eq!(refused[0]["kind"], kind, "node{i} round {round}: {r}");
        }
        assert!(
            pairings >= ban_after,
            "node{i} met the adversary in {pairings} rounds"
        );
        let v: Vec<f64> = records
            .iter()
            .filter_map(|r| r["val_loss"].as_f64())
            .collect();
        assert!(v.iter().all(|l| l.is_finite()), "node{i}: {v:?}");
        assert!(v.last().unwrap() < &(v[0] - 0.2), "node{i} learns: {v:?}");
        let honest: Vec<Value> = records
            .iter()
            .map(|r| {
                let mut r = r.clone();
                r["gate"]
                    .as_array_mut()
                    .unwrap()
                    .retain(|g| g["peer"] != adversary.as_str());
                r
            })
            .collect();
        let (ratio, cosine, n) = gasloc_tests::gate_margins(&honest);
        eprintln!("node{i} gate margins (complete, honest peers): max distance/reference {ratio:.3}, min cosine {cosine:.3}, over {n} payloads");
        // The ban is kept in the node's home, for this run.
        let bans: Value =
            serde_json::from_str(&std::fs::read_to_string(home(i).join("bans.json")).unwrap())
                .unwrap();
        let banned: Vec<&str> = bans["bans"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["peer"].as_str().unwrap())
            .collect();
        assert_eq!(banned, [adversary.as_str()], "node{i}: {bans}");
    }
    let body = json.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let status: Value = serde_json::from_str(body).unwrap();
    let counts = &status["refusals"][adversary.as_str()];
    assert!(
        counts["non_finite"].as_u64() >= Some(1) && counts["too_far"].as_u64() >= Some(1),
        "{}",
        status["refusals"]
    );
    assert_eq!(
        status["refusals"].as_object().unwrap().len(),
        1,
        "{}",
        status["refusals"]
    );
    assert!(
        metrics.contains("gasloc_refused_payloads_total{")
            && metrics.contains("reason=\"too_far\""),
        "{metrics}"
    );
    assert!(metrics.contains("gasloc_banned_peers 1"), "{metrics}");
    let banned = status["banned"].as_array().unwrap();
    assert_eq!(banned.len(), 1, "{}", status["banned"]);
    assert_eq!(banned[0]["peer"], adversary.as_str());
    assert_eq!(
        banned[0]["offences"].as_array().unwrap().len(),
        ban_after,
        "{}",
        status["banned"]
    );
}

/// Two honest nodes and the adversary serve states; a late joiner (`--sync-state`) asks all
/// three, outvotes the adversary's (its final norm × 1000: finite, so only the comparison
/// with the honest sources catches it), starts from the honest anchor and trains normally:
/// its first validation loss is the honest nodes' of that round, not a broken model's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_joiner_outvotes_a_peer_serving_a_poisoned_state_and_trains_normally() {
    const HONEST_ROUNDS: u64 = 7;
    let swarm = Swarm::with_adversary(Poison::State, HONEST_ROUNDS).await;
    let (dir, data, boot) = (swarm.dir.clone(), swarm.data.clone(), swarm.boot.clone());
    let home = |i: usize| dir.join(format!("node{i}"));
    let (adversary, adversary_task) = (swarm.adversary.clone(), swarm.task);
    let rounds = HONEST_ROUNDS.to_string();
    let (boot2, dir2, data2) = (boot.clone(), dir.clone(), data.clone());
    let outcome = tokio::task::spawn_blocking(move || {
        let home = |i: usize| dir2.join(format!("node{i}"));
        let mut honest: Vec<Proc> = (1..=2)
            .map(|i| {
                Proc::spawn(
                    &format!("node{i}"),
                    &dir2,
                    join_command(&boot2, &home(i), &data2, &["--rounds", &rounds]),
                )
            })
            .collect();
        honest[0].wait_for_line("round=2 ", Duration::from_secs(120));
        let mut late = Proc::spawn(
            "late",
            &dir2,
            join_command(&boot2, &home(3), &data2, &["--rounds", "2", "--sync-state"]),
        );
        let synced = late.wait_for_line("state_synced_from=", Duration::from_secs(120));
        late.expect_success(Duration::from_secs(120));
        for node in &mut honest {
            node.expect_success(Duration::from_secs(120));
        }
        synced
    });
    let synced = outcome.await.unwrap();
    adversary_task.await.unwrap().unwrap();

    assert_eq!(field(&synced, "sources"), Some("2"), "{synced}");
    assert_eq!(
        field(&synced, "refused"),
        Some(format!("{adversary}:state_disagrees").as_str()),
        "{synced}"
    );
    assert!(
        !field(&synced, "state_synced_from")
            .unwrap()
            .contains(&adversary),
        "{synced}"
    );
    let late = read_report(&home(3));
    let honest = read_report(&home(1));
    assert_eq!(late.len(), 2, "{late:?}");
    for record in &late {
        let round = record["round"].as_u64().unwrap();
        let loss = record["val_loss"].as_f64().expect("a validation loss");
        let theirs = honest
            .iter()
            .find(|r| r["round"].as_u64() == Some(round))
            .and_then(|r| r["val_loss"].as_f64())
            .expect("the honest node ran that round");
        assert!(
            (loss - theirs).abs() <= 0.03 * theirs,
            "round {round}: the joiner's loss {loss} vs the honest node's {theirs}"
        );
    }
}
