//! A run outlives its bootstrap node. Every node serves the run's manifest and round timing
//! once it holds them, so when the only `gasloc-bootstrap` is killed the nodes go on agreeing
//! on rounds among themselves, and a newcomer joins through a node's address (with the run id
//! pinned) and takes part in the exchanges.

use gasloc_tests::{
    field, read_report, start_bootstrap, synthetic_join_command, synthetic_run, Proc,
};
use std::time::{Duration, Instant};

/// The node's QUIC address, as it printed it (`listening=…/quic-v1/p2p/<id>`).
fn quic_address(node: &mut Proc) -> String {
    node.wait_for_line("listening=", Duration::from_secs(30));
    node.output()
        .lines()
        .filter_map(|l| l.strip_prefix("listening="))
        .find(|a| a.contains("/quic-v1/"))
        .expect("the node listens on QUIC")
        .to_string()
}

#[test]
fn rounds_go_on_and_a_newcomer_joins_through_a_node_after_the_bootstrap_dies() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let manifest = dir.join("run.toml");
    std::fs::write(&manifest, synthetic_run("lost-bootstrap-test")).unwrap();
    let (mut bootstrap, boot) = start_bootstrap(dir, &manifest, 6000, 2000, 500, 900);

    let mut nodes: Vec<(Proc, std::path::PathBuf)> = (0..3)
        .map(|i| {
            let home = dir.join(format!("node{i}"));
            std::fs::create_dir_all(&home).unwrap();
            let command = synthetic_join_command(&boot, &home, 65536, 18);
            (Proc::spawn(&format!("node{i}"), dir, command), home)
        })
        .collect();
    let entry = quic_address(&mut nodes[0].0);
    let run_line = nodes[0].0.wait_for_line("run_id=", Duration::from_secs(30));
    let run_id = field(&run_line, "run_id").unwrap().to_string();

    // Two rounds with the bootstrap, then it dies.
    let start = Instant::now();
    while read_report(&nodes[0].1).len() < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "node0 reported no two rounds:\n{}",
            nodes[0].0.stderr_tail()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    bootstrap.child.kill().unwrap();
    bootstrap.child.wait().unwrap();
    let last_with_bootstrap = read_report(&nodes[0].1)
        .last()
        .and_then(|r| r["round"].as_u64())
        .unwrap();

    // The newcomer knows only node0's address.
    let home = dir.join("newcomer");
    std::fs::create_dir_all(&home).unwrap();
    let mut command = synthetic_join_command(&entry, &home, 65536, 6);
    command.args(["--run-id", &run_id]);
    let mut newcomer = Proc::spawn("newcomer", dir, command);
    newcomer.expect_success(Duration::from_secs(90));
    for (node, _) in &mut nodes {
        node.expect_success(Duration::from_secs(90));
    }

    let joined = newcomer.output();
    assert!(
        joined.contains(&format!("run_id={run_id} ")),
        "the newcomer got another run:\n{joined}"
    );
    let theirs = read_report(&home);
    let exchanged: Vec<u64> = theirs
        .iter()
        .filter(|r| !r["exchanged"].as_array().unwrap().is_empty())
        .map(|r| r["round"].as_u64().unwrap())
        .collect();
    assert!(
        exchanged.len() >= 3,
        "the newcomer exchanged in rounds {exchanged:?} only:\n{}",
        newcomer.stderr_tail()
    );

    // Every round after the bootstrap died: one plan among the nodes that reported it, and
    // the newcomer among the members of the rounds it took part in.
    let reports: Vec<_> = nodes
        .iter()
        .map(|(_, home)| read_report(home))
        .chain(std::iter::once(theirs.clone()))
        .collect();
    let mut agreed_after = 0;
    for round in last_with_bootstrap + 1..last_with_bootstrap + 20 {
        let records: Vec<_> = reports
            .iter()
            .flatten()
            .filter(|r| r["round"].as_u64() == Some(round))
            .collect();
        if records.len() < 3 {
            continue;
        }
        agreed_after += 1;
        for r in &records {
            assert_eq!(r["members"], records[0]["members"], "round {round}");
            assert_eq!(r["permutation"], records[0]["permutation"], "round {round}");
        }
        if exchanged.contains(&round) {
            assert_eq!(
                records[0]["members"].as_array().unwrap().len(),
                4,
                "round {round}: {}",
                records[0]
            );
        }
    }
    assert!(
        agreed_after >= 5,
        "only {agreed_after} rounds were agreed after the bootstrap died"
    );
}
