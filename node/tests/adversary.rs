//! A poisoning peer in a real swarm: a bootstrap process, three honest `gasloc-node join`
//! processes and, in this test's process, an adversary wired as `join` wires a node
//! (`SwarmNode`) whose trainer trains honestly and then poisons what it sends — a NaN on
//! even rounds, `model.norm.weight` × 1000 on odd rounds (the attack that destroyed a demo
//! run before the payload gate). On the complete topology every honest node meets it every
//! round. Every honest node refuses each of its payloads by the right reason, never mixes
//! it, refuses no honest peer, counts the refusals in `/status` and `/metrics`, and learns.

use gasloc_node::volunteer::{Volunteer, VolunteerOptions};
use gasloc_p2p::driver::DriverOptions;
use gasloc_p2p::exchange::SendOptions;
use gasloc_p2p::local_swarm::local_config;
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

/// The libtorch trainer, with every payload it sends poisoned.
struct Poisoner {
    inner: Volunteer,
}

fn poison(round: u64, payload: &mut TensorSet) {
    let norm = payload
        .tensors
        .iter_mut()
        .find(|t| t.name == "model.norm.weight")
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
        Box::pin(async move {
            let mut trained = trained.await?;
            poison(round, &mut trained.payload);
            Ok(trained)
        })
    }
    fn screen(&mut self, round: u64, candidates: Vec<Candidate>) -> WorkFuture<Vec<Screened>> {
        self.inner.screen(round, candidates)
    }
    fn finish(&mut self, received: Received) -> WorkFuture<Finished> {
        self.inner.finish(received)
    }
    fn load_state(&mut self, round: u64, state: TensorSet) -> WorkFuture<()> {
        self.inner.load_state(round, state)
    }
    fn close(&mut self) -> WorkFuture<()> {
        self.inner.close()
    }
}

/// Joins the swarm at `bootstrap` as the adversary and takes part in [`ROUNDS`] rounds;
/// returns its peer id once it has joined, and the task running its rounds.
async fn start_adversary(
    bootstrap: &str,
    home: &std::path::Path,
    data: &std::path::Path,
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
        work: Box::new(Poisoner { inner }),
        options: DriverOptions {
            rounds: ROUNDS,
            withhold_reveals: false,
            send: SendOptions::default(),
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

fn peers(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn honest_nodes_refuse_a_poisoning_peer_every_round_and_learn() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path().to_path_buf();
    let manifest = dir.join("run.toml");
    std::fs::write(&manifest, MANIFEST).unwrap();
    let data = prepare_byte_data(&dir);
    let (_bootstrap, boot) = start_bootstrap(&dir, &manifest, 8000, 4000, 500, 2000);
    let home = |i: usize| dir.join(format!("node{i}"));

    let (adversary, adversary_task) = start_adversary(&boot, &home(0), &data).await;
    let adversary = adversary.to_string();
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

    for i in 1..=3 {
        let records = read_report(&home(i));
        assert_eq!(records.len() as u64, ROUNDS, "node{i}");
        for r in &records {
            let round = r["round"].as_u64().unwrap();
            if !peers(&r["neighbours"]).contains(&adversary) {
                continue;
            }
            let refused = r["refused"].as_array().unwrap();
            assert_eq!(
                refused.len(),
                1,
                "node{i}: only the adversary is refused: {r}"
            );
            assert_eq!(refused[0]["peer"], adversary.as_str(), "node{i}: {r}");
            let kind = if round % 2 == 0 {
                "non_finite"
            } else {
                "too_far"
            };
            assert_eq!(refused[0]["kind"], kind, "node{i} round {round}: {r}");
            assert!(!peers(&r["exchanged"]).contains(&adversary), "node{i}: {r}");
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
        }
        let met = records
            .iter()
            .filter(|r| peers(&r["neighbours"]).contains(&adversary))
            .count();
        assert!(
            met as u64 >= ROUNDS - 1,
            "node{i} met the adversary in {met} rounds"
        );
        let v: Vec<f64> = records
            .iter()
            .filter_map(|r| r["val_loss"].as_f64())
            .collect();
        assert!(v.iter().all(|l| l.is_finite()), "node{i}: {v:?}");
        assert!(v.last().unwrap() < &(v[0] - 0.2), "node{i} learns: {v:?}");
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
}
