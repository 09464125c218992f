//! A swarm on the two-peer topology (each node mixes with two ring neighbours) learns, with
//! fixed H; a node that expects another run is refused before it trains; a live node's
//! status endpoint serves its status (terminal client), its JSON and its metrics; and when a
//! node is killed after the round is decided, each of its two partners mixes it as missing:
//! ⅔ itself, ⅓ its other neighbour (`docs/algorithms.md`, "A round"), and goes on.

use gasloc_tests::{
    built_binary, field, http_get, join_command, prepare_byte_data, read_report, start_bootstrap,
    tiny_run, Proc,
};
use std::process::Command;
use std::time::Duration;

#[test]
fn four_nodes_on_a_two_peer_ring_learn_and_other_runs_are_refused() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let manifest = dir.join("run.toml");
    std::fs::write(
        &manifest,
        tiny_run(
            "swarm-two-peer-test",
            5,
            "topology = \"two-peer\"\ninner_steps = 25\n",
        ),
    )
    .unwrap();
    let data = prepare_byte_data(dir);
    let (_bootstrap, boot) = start_bootstrap(dir, &manifest, 6000, 3500, 500, 1500);
    let home = |i: usize| dir.join(format!("node{i}"));

    // A node that expects another run's id is refused by the manifest check.
    let other_run = "ab".repeat(32);
    let mut stranger = Proc::spawn(
        "stranger",
        dir,
        join_command(&boot, &home(9), &data, &["--run-id", &other_run]),
    );
    assert!(!stranger.wait_exit(Duration::from_secs(60)));
    let refusal = std::fs::read_to_string(&stranger.stderr).unwrap();
    assert!(refusal.contains(&other_run), "{refusal}");

    let mut nodes: Vec<Proc> = (1..=4)
        .map(|i| {
            // Port 0: any free port; the node prints the address.
            let status = "127.0.0.1:0".to_string();
            Proc::spawn(
                &format!("node{i}"),
                dir,
                join_command(
                    &boot,
                    &home(i),
                    &data,
                    // Every round evaluated (the default overlap's is every fifth).
                    &[
                        "--rounds",
                        "7",
                        "--status-addr",
                        &status,
                        "--eval-every",
                        "1",
                    ],
                ),
            )
        })
        .collect();
    let status_line = nodes[0].wait_for_line("status=", Duration::from_secs(60));
    let status_addr = field(&status_line, "status")
        .unwrap()
        .trim_start_matches("http://")
        .to_string();
    // While the swarm runs: the node's status in the terminal and its Prometheus metrics
    // (gasloc's and libp2p's).
    let first = nodes[0].wait_for_line("round=1 ", Duration::from_secs(60));
    let peer = field(&nodes[0].output(), "peer_id").unwrap().to_string();
    let status = Command::new(built_binary("gasloc-node"))
        .args(["status", "--addr", &status_addr])
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains(&peer) && status.contains("swarm-two-peer-test"),
        "{status}"
    );
    assert!(status.contains("round"), "{status}\nafter {first}");
    let metrics = http_get(&status_addr, "/metrics");
    for metric in [
        "gasloc_round",
        "gasloc_inner_steps",
        "gasloc_val_loss",
        "libp2p_swarm",
    ] {
        assert!(
            metrics.contains(metric),
            "no {metric} in /metrics:\n{metrics}"
        );
    }
    let json = http_get(&status_addr, "/status");
    assert!(
        json.contains("\"history\"") && json.contains(&peer),
        "{json}"
    );

    // Node 4 dies early in round 3: after its reveal (published as the round starts) and
    // before the round is decided (500 ms in) and its exchange starts, so it is in its
    // partners' plan but never sends them anything.
    let status4 = field(
        &nodes[3].wait_for_line("status=", Duration::from_secs(60)),
        "status",
    )
    .unwrap()
    .trim_start_matches("http://")
    .to_string();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        assert!(
            std::net::TcpStream::connect(&status4).is_ok(),
            "node4's status server is gone:\n{}\n{}",
            nodes[3].output(),
            nodes[3].stderr_tail()
        );
        let response = http_get(&status4, "/status");
        let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        let json: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        let undecided = json["neighbours"].as_array().is_some_and(|n| n.is_empty());
        if json["round"].as_u64() == Some(3) && undecided {
            std::thread::sleep(Duration::from_millis(150));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "node4 never reached round 3: {json}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    nodes[3].child.kill().unwrap();
    let killed = field(&nodes[3].output(), "peer_id").unwrap().to_string();

    for node in &mut nodes[..3] {
        node.expect_success(Duration::from_secs(120));
    }
    let mut partners = 0;
    for i in 1..=3 {
        let records = read_report(&home(i));
        assert_eq!(records.len(), 7, "node{i}");
        for r in &records {
            assert_eq!(r["inner_steps"], 25, "node{i}: fixed H");
            assert_eq!(r["neighbours"].as_array().unwrap().len(), 2, "node{i}: {r}");
            assert_eq!(
                r["refused"],
                serde_json::json!([]),
                "node{i}: the gate refused an honest model: {r}"
            );
            let weights: Vec<f64> = r["mixing"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| w[1].as_f64().unwrap())
                .collect();
            let lost_partner = r["failed"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f[0] == killed);
            if lost_partner {
                // The killed node's weight went back to self: ⅔ self, ⅓ the other.
                assert_eq!(r["round"], 3, "node{i}: {r}");
                assert_eq!(weights, vec![2.0 / 3.0, 1.0 / 3.0], "node{i}: {r}");
                partners += 1;
                continue;
            }
            assert_eq!(
                r["exchanged"], r["neighbours"],
                "node{i} round {}: {}",
                r["round"], r["failed"]
            );
            assert_eq!(weights, vec![1.0 / 3.0; 3], "node{i}: {r}");
        }
        let v: Vec<f64> = records
            .iter()
            .filter_map(|r| r["val_loss"].as_f64())
            .collect();
        assert!(v.last().unwrap() < &(v[0] - 0.3), "node{i}: {v:?}");
        assert!(v.last().unwrap() < &3.0, "node{i}: {v:?}");
    }
    assert_eq!(
        partners, 2,
        "both ring partners of the killed node mixed it as missing"
    );
}
