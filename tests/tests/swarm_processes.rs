//! A real bootstrap process and six `gasloc-node join --synthetic` processes on loopback run
//! ten rounds: every node agrees on each round's permutation and every pairing is mutual.

use gasloc_tests::{start_bootstrap, synthetic_join_command, synthetic_run};
use serde_json::Value;
use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

#[test]
fn bootstrap_and_six_nodes_run_ten_rounds_with_mutual_pairings() {
    let dir = gasloc_tests::TestDir::new();
    let manifest = dir.path().join("run.toml");
    std::fs::write(&manifest, synthetic_run("swarm-test")).unwrap();
    // The manifest's default topology is one-peer.
    let (_bootstrap, quic) = start_bootstrap(dir.path(), &manifest, 6000, 2000, 500, 900);
    assert!(quic.contains("/p2p/"), "{quic}");

    let n = 6;
    let mut nodes = Vec::new();
    for i in 0..n {
        let home = dir.path().join(format!("node{i}"));
        let report = home.join("rounds.jsonl");
        let child = synthetic_join_command(&quic, &home, 262144, 10)
            .stdout(Stdio::null())
            .spawn()
            .expect("gasloc-node starts");
        nodes.push((child, report));
    }
    let start = Instant::now();
    let mut reports = Vec::new();
    for (mut child, report) in nodes {
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if start.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
                panic!("a node did not finish 10 rounds within 120 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert!(status.success(), "gasloc-node join failed: {status}");
        reports.push(report);
    }

    let mut rounds: BTreeMap<u64, Vec<Value>> = BTreeMap::new();
    for report in &reports {
        let text = std::fs::read_to_string(report).unwrap();
        let records: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(records.len(), 10, "{}", report.display());
        for record in records {
            rounds
                .entry(record["round"].as_u64().unwrap())
                .or_default()
                .push(record);
        }
    }
    let mut full_rounds = 0;
    for (round, records) in &rounds {
        for r in records {
            assert_eq!(r["permutation"], records[0]["permutation"], "round {round}");
            let me = r["peer"].as_str().unwrap();
            for neighbour in r["neighbours"].as_array().unwrap() {
                let partner = records
                    .iter()
                    .find(|p| p["peer"] == *neighbour)
                    .unwrap_or_else(|| {
                        panic!("round {round}: partner {neighbour} reported nothing")
                    });
                assert!(
                    partner["neighbours"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|x| x == me),
                    "round {round}: pairing of {me} and {neighbour} is not mutual"
                );
            }
            assert_eq!(
                r["exchanged"], r["neighbours"],
                "round {round}: {}",
                r["failed"]
            );
        }
        if records.len() == n {
            full_rounds += 1;
            assert_eq!(
                records[0]["members"].as_array().unwrap().len(),
                n,
                "round {round}"
            );
        }
    }
    assert!(
        full_rounds >= 8,
        "only {full_rounds} rounds had all six nodes"
    );
}
