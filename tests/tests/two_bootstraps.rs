//! Several bootstrap nodes serve one run: two `gasloc-bootstrap` processes with the same
//! manifest and genesis, the second connected to the first (`--peer`). Synthetic nodes that
//! know only one of them each (two per bootstrap) form one swarm: in every round they agree
//! on the same members and permutation, and every pairing is mutual and exchanged.

use gasloc_tests::{
    bootstrap_command, read_report, spawn_bootstrap, synthetic_join_command, synthetic_run, Proc,
};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[test]
fn nodes_of_two_bootstraps_form_one_swarm() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let manifest = dir.join("run.toml");
    std::fs::write(&manifest, synthetic_run("two-bootstraps-test")).unwrap();
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let genesis = (now_ms + 8000).to_string();
    let timing = [
        "--genesis-unix-ms",
        &genesis,
        "--round-period-ms",
        "2000",
        "--commit-window-ms",
        "500",
        "--reveal-window-ms",
        "500",
        "--exchange-timeout-ms",
        "900",
    ];
    let mut first = bootstrap_command(dir, "bootstrap-a", &manifest);
    first.args(timing);
    let (_a, addr_a) = spawn_bootstrap(dir, "bootstrap-a", first);
    let mut second = bootstrap_command(dir, "bootstrap-b", &manifest);
    second.args(timing).args(["--peer", &addr_a]);
    let (_b, addr_b) = spawn_bootstrap(dir, "bootstrap-b", second);

    let mut nodes: Vec<(Proc, std::path::PathBuf)> = (0..4)
        .map(|i| {
            let home = dir.join(format!("node{i}"));
            let boot = if i < 2 { &addr_a } else { &addr_b };
            let command = synthetic_join_command(boot, &home, 65536, 6);
            std::fs::create_dir_all(&home).unwrap();
            (Proc::spawn(&format!("node{i}"), dir, command), home)
        })
        .collect();
    for (node, _) in &mut nodes {
        node.expect_success(Duration::from_secs(90));
    }
    let reports: Vec<_> = nodes.iter().map(|(_, home)| read_report(home)).collect();
    let mut full_rounds = 0;
    for round in 0..20u64 {
        let records: Vec<_> = reports
            .iter()
            .flatten()
            .filter(|r| r["round"].as_u64() == Some(round))
            .collect();
        if records.len() < 4 {
            continue;
        }
        full_rounds += 1;
        for r in &records {
            assert_eq!(
                r["members"].as_array().unwrap().len(),
                4,
                "round {round}: {r}"
            );
            assert_eq!(r["permutation"], records[0]["permutation"], "round {round}");
            assert_eq!(
                r["exchanged"], r["neighbours"],
                "round {round}: {}",
                r["failed"]
            );
        }
    }
    assert!(
        full_rounds >= 5,
        "only {full_rounds} rounds had all four nodes"
    );
}
