//! A node that nobody can dial still exchanges, through the bootstrap's relay (`--relay`).
//!
//! Three network namespaces: the bootstrap's, joined by a veth pair each to node A's and to
//! node B's, with no route between A and B (as with a node behind NAT, B can reach the
//! bootstrap but nobody can reach B). Both nodes run the synthetic trainer, one-peer, so they
//! are each other's partner in every round. With `--relay`, B listens through a relay circuit
//! on the bootstrap and A reaches it there: every round's exchange completes. Without it,
//! the control plane still works (it goes through the bootstrap) but no exchange does.
//! The test creates and removes its namespaces (it needs root, like `ip netns`).

use gasloc_tests::{
    built_binary, is_root, read_report, synthetic_run, wait_for_file, Namespaces, Proc,
};
use std::path::Path;
use std::time::Duration;

const ROUNDS: u64 = 5;

/// Runs the bootstrap and both nodes for [`ROUNDS`] rounds; A's and B's round records.
fn run(dir: &Path, b_relays: bool) -> [Vec<serde_json::Value>; 2] {
    // r is 10.215.1.1 towards a (10.215.1.2) and 10.215.2.1 towards b (10.215.2.2).
    let net = Namespaces::create(&["glrelay-r", "glrelay-a", "glrelay-b"]);
    net.link(0, "10.215.1.1/24", 1, "10.215.1.2/24");
    net.link(0, "10.215.2.1/24", 2, "10.215.2.2/24");
    let manifest = dir.join("run.toml");
    std::fs::write(&manifest, synthetic_run("relay-reachability")).unwrap();
    let mut bootstrap = net.command(0, built_binary("gasloc-bootstrap"));
    bootstrap
        .arg("--run")
        .arg(&manifest)
        .args(["--listen", "/ip4/10.215.1.1/tcp/0"])
        .args(["--listen", "/ip4/10.215.2.1/tcp/0"])
        .arg("--addr-file")
        .arg(dir.join("bootstrap.addrs"))
        .args(["--genesis-delay-ms", "4000", "--round-period-ms", "3000"])
        .args(["--commit-window-ms", "800", "--reveal-window-ms", "800"])
        .args(["--exchange-timeout-ms", "1800", "--topology", "one-peer"]);
    let _bootstrap = Proc::spawn("bootstrap", dir, bootstrap);
    let addrs = wait_for_file(&dir.join("bootstrap.addrs"), Duration::from_secs(30));
    // Node `index` (1: A, 2: B) is 10.215.<index>.2 and reaches the bootstrap at .1.
    let node = |index: usize, name: &str, relay: bool| {
        let bootstrap = addrs
            .lines()
            .find(|a| a.starts_with(&format!("/ip4/10.215.{index}.1/")))
            .expect("the bootstrap listens on both links");
        let home = dir.join(name);
        let mut command = net.command(index, built_binary("gasloc-node"));
        command
            .args(["join", "--synthetic", "--bootstrap", bootstrap])
            .args(["--listen", &format!("/ip4/10.215.{index}.2/tcp/0")])
            .args(["--payload-bytes", "200000", "--tensors", "2"])
            .args(["--inner-steps", "5", "--step-time-ms", "20"])
            .args(["--rounds", &ROUNDS.to_string()])
            .arg("--home")
            .arg(&home)
            .arg("--report")
            .arg(home.join("rounds.jsonl"));
        if relay {
            command.arg("--relay");
        }
        Proc::spawn(name, dir, command)
    };
    let mut nodes = [node(1, "a", false), node(2, "b", b_relays)];
    for node in &mut nodes {
        node.expect_success(Duration::from_secs(60));
    }
    [read_report(&dir.join("a")), read_report(&dir.join("b"))]
}

fn exchanged_rounds(records: &[serde_json::Value]) -> usize {
    records
        .iter()
        .filter(|r| !r["exchanged"].as_array().unwrap().is_empty())
        .count()
}

#[test]
fn a_node_nobody_can_dial_exchanges_through_the_bootstrap_relay() {
    if !is_root() {
        eprintln!("relay_reachability needs root to create network namespaces; not run");
        return;
    }
    // With --relay on B: A and B are partners in every round and every exchange completes.
    let dir = gasloc_tests::TestDir::new();
    let [a, b] = run(dir.path(), true);
    assert_eq!(a.len() as u64, ROUNDS, "{a:?}");
    assert_eq!(b.len() as u64, ROUNDS, "{b:?}");
    for records in [&a, &b] {
        for r in records.iter() {
            assert_eq!(r["members"].as_array().unwrap().len(), 2, "{r}");
        }
    }
    assert_eq!(exchanged_rounds(&a) as u64, ROUNDS, "A's exchanges: {a:?}");
    assert_eq!(exchanged_rounds(&b) as u64, ROUNDS, "B's exchanges: {b:?}");

    // The control: without --relay the same two nodes agree on their pairing through the
    // bootstrap, but neither can reach the other.
    let dir = gasloc_tests::TestDir::new();
    let [a, b] = run(dir.path(), false);
    assert!(a
        .iter()
        .any(|r| r["members"].as_array().unwrap().len() == 2));
    assert_eq!(
        exchanged_rounds(&a) + exchanged_rounds(&b),
        0,
        "{a:?} {b:?}"
    );
}
