//! Two volunteers, each behind its own NAT, find out that nobody can dial them (AutoNAT),
//! listen through the bootstrap's relay on their own, and punch a hole to each other (DCUtR):
//! their exchanges then run over a direct connection.
//!
//! Six network namespaces: `net` (the "internet": the bootstrap, routing between its links),
//! two NAT routers `ra` and `rb` (iptables MASQUERADE from their private network to their
//! public address, as a home router does), node A behind `ra`, node B behind `rb`, and node C
//! on a public address. Nobody can open a connection to A or B from outside; A and B can open
//! connections out. All three nodes run the synthetic trainer over QUIC, one-peer, without
//! `--relay`. The test creates and removes its namespaces; it needs root and `iptables`
//! (`make test` installs it when it runs as root). `NAT_TEST_LOG` sets the nodes' `RUST_LOG`
//! (e.g. `info,libp2p_dcutr=debug`).

use gasloc_tests::{
    built_binary, is_root, read_report, synthetic_run, wait_for_file, Namespaces, Proc,
};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// With three nodes and one-peer pairs, A and B are partners in a third of the rounds, at
/// random: 14 rounds (about 9 after the hole punch) left them unpaired about once in 40 runs
/// (CI saw it once); 24 leave them unpaired after the punch about once in 2,000.
const ROUNDS: u64 = 24;
/// Rounds at the end in which every pairing must have exchanged: AutoNAT's first probe comes
/// 15 s after a node starts, and the relay circuit and the hole punch follow it.
const SETTLED_ROUNDS: usize = 4;

const NET: usize = 0;
const ROUTER_A: usize = 1;
const ROUTER_B: usize = 2;
const NODE_A: usize = 3;
const NODE_B: usize = 4;
const NODE_C: usize = 5;

/// Builds the networks: `net` is 10.216.1.1 towards `ra` (10.216.1.2), 10.216.2.1 towards
/// `rb` (10.216.2.2) and 10.216.3.1 towards C (10.216.3.2); A is 192.168.1.2 behind `ra`
/// (192.168.1.1), B is 192.168.2.2 behind `rb` (192.168.2.1).
fn build_networks() -> Namespaces {
    let net = Namespaces::create(&[
        "glnat-net",
        "glnat-ra",
        "glnat-rb",
        "glnat-a",
        "glnat-b",
        "glnat-c",
    ]);
    net.link(NET, "10.216.1.1/24", ROUTER_A, "10.216.1.2/24");
    net.link(NET, "10.216.2.1/24", ROUTER_B, "10.216.2.2/24");
    net.link(NET, "10.216.3.1/24", NODE_C, "10.216.3.2/24");
    net.link(ROUTER_A, "192.168.1.1/24", NODE_A, "192.168.1.2/24");
    net.link(ROUTER_B, "192.168.2.1/24", NODE_B, "192.168.2.2/24");
    net.run(NET, &["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    for (router, public_gateway, private) in [
        (ROUTER_A, "10.216.1.1", "192.168.1.0/24"),
        (ROUTER_B, "10.216.2.1", "192.168.2.0/24"),
    ] {
        net.run(router, &["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        net.run(
            router,
            &["ip", "route", "add", "default", "via", public_gateway],
        );
        net.run(
            router,
            &[
                "iptables",
                "-t",
                "nat",
                "-A",
                "POSTROUTING",
                "-s",
                private,
                "-j",
                "MASQUERADE",
            ],
        );
        // A home router's firewall: from outside, only replies to what was sent from inside
        // get in, to the private network (FORWARD) or to the router itself (INPUT). Dropped
        // there, an unsolicited packet leaves no connection-tracking entry behind (one would
        // take the port that the inside node's mapping needs, and the NAT would pick another).
        for (chain, direction) in [("FORWARD", "-d"), ("INPUT", "! -s")] {
            let mut rule = vec!["iptables", "-A", chain];
            rule.extend(direction.split(' '));
            rule.extend([
                private,
                "-m",
                "conntrack",
                "!",
                "--ctstate",
                "ESTABLISHED,RELATED",
                "-j",
                "DROP",
            ]);
            net.run(router, &rule);
        }
    }
    net.run(
        NODE_A,
        &["ip", "route", "add", "default", "via", "192.168.1.1"],
    );
    net.run(
        NODE_B,
        &["ip", "route", "add", "default", "via", "192.168.2.1"],
    );
    net.run(
        NODE_C,
        &["ip", "route", "add", "default", "via", "10.216.3.1"],
    );
    net
}

/// Runs the bootstrap and the three nodes for [`ROUNDS`] rounds; each node's round records
/// and log.
fn run(dir: &Path) -> Vec<(Vec<serde_json::Value>, String)> {
    let net = build_networks();
    let manifest = dir.join("run.toml");
    std::fs::write(&manifest, synthetic_run("nat-traversal")).unwrap();
    let mut bootstrap = net.command(NET, built_binary("gasloc-bootstrap"));
    bootstrap
        .arg("--run")
        .arg(&manifest)
        .args(["--listen", "/ip4/10.216.1.1/udp/0/quic-v1"])
        .arg("--addr-file")
        .arg(dir.join("bootstrap.addrs"))
        .args(["--genesis-delay-ms", "4000", "--round-period-ms", "3000"])
        .args(["--commit-window-ms", "800", "--reveal-window-ms", "800"])
        .args(["--exchange-timeout-ms", "1800", "--topology", "one-peer"])
        .arg("--autonat-private-ips");
    let _bootstrap = Proc::spawn("bootstrap", dir, bootstrap);
    let addrs = wait_for_file(&dir.join("bootstrap.addrs"), Duration::from_secs(30));
    let bootstrap_addr = addrs
        .lines()
        .next()
        .expect("the bootstrap listens")
        .to_string();

    let node = |index: usize, name: &str| {
        let home = dir.join(name);
        let mut command = net.command(index, built_binary("gasloc-node"));
        command
            .env(
                "RUST_LOG",
                std::env::var("NAT_TEST_LOG").unwrap_or("info".into()),
            )
            .args(["join", "--synthetic", "--bootstrap", &bootstrap_addr])
            .args(["--listen", "/ip4/0.0.0.0/udp/0/quic-v1"])
            .args(["--payload-bytes", "200000", "--tensors", "2"])
            .args(["--inner-steps", "5", "--step-time-ms", "20"])
            .args(["--rounds", &ROUNDS.to_string()])
            .arg("--autonat-private-ips")
            .arg("--home")
            .arg(&home)
            .arg("--report")
            .arg(home.join("rounds.jsonl"));
        Proc::spawn(name, dir, command)
    };
    let mut nodes = [node(NODE_A, "a"), node(NODE_B, "b"), node(NODE_C, "c")];
    for node in &mut nodes {
        node.expect_success(Duration::from_secs(120));
    }
    nodes
        .iter()
        .map(|node| {
            let log = std::fs::read_to_string(&node.stderr).unwrap_or_default();
            (read_report(&dir.join(&node.name)), log)
        })
        .collect()
}

fn iptables_available() -> bool {
    Command::new("iptables")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn nodes_behind_nat_find_out_relay_and_punch_a_hole_to_each_other() {
    if !is_root() || !iptables_available() {
        eprintln!(
            "nat_traversal needs root and iptables to build NATs in network namespaces; not run"
        );
        return;
    }
    let dir = gasloc_tests::TestDir::new();
    let nodes = run(dir.path());
    let [(a, a_log), (b, b_log), (c, c_log)] = &nodes[..] else {
        unreachable!("three nodes")
    };
    for (name, records) in [("A", a), ("B", b), ("C", c)] {
        assert_eq!(records.len() as u64, ROUNDS, "{name}: {records:?}");
    }
    let last = |records: &[serde_json::Value], key: &str| records.last().unwrap()[key].clone();

    // AutoNAT: nobody could dial A or B back at their NAT's public address; C could be.
    assert_eq!(last(a, "reachability"), "private", "A:\n{a_log}");
    assert_eq!(last(b, "reachability"), "private", "B:\n{b_log}");
    assert_eq!(last(c, "reachability"), "public", "C:\n{c_log}");
    // Found private, A and B listened through the bootstrap's relay without being told to.
    for (name, log) in [("A", a_log), ("B", b_log)] {
        assert!(
            log.contains("listening through the relay"),
            "{name} did not listen through the relay:\n{log}"
        );
    }
    assert!(!c_log.contains("listening through the relay"), "{c_log}");

    // A and B reached each other through the relay and DCUtR made that a direct connection.
    for (name, records) in [("A", a), ("B", b)] {
        let punches = last(records, "hole_punches").as_u64().unwrap();
        assert!(
            punches >= 1,
            "{name} made no hole punch:\nA:\n{a_log}\nB:\n{b_log}"
        );
    }

    // Once that settled, every pairing exchanged, A with B included.
    for (name, records) in [("A", a), ("B", b), ("C", c)] {
        for r in &records[records.len() - SETTLED_ROUNDS..] {
            let neighbours = r["neighbours"].as_array().unwrap();
            let exchanged = r["exchanged"].as_array().unwrap();
            assert_eq!(neighbours.len(), exchanged.len(), "{name}: {r}");
        }
    }
    let b_id = b[0]["peer"].as_str();
    let a_with_b = a
        .iter()
        .filter(|r| {
            let exchanged = r["exchanged"].as_array().unwrap();
            exchanged.iter().any(|p| p.as_str() == b_id)
        })
        .count();
    assert!(a_with_b >= 1, "A never exchanged with B: {a:?}");
    for (name, records) in [("A", a), ("B", b), ("C", c)] {
        let exchanged = records
            .iter()
            .filter(|r| !r["exchanged"].as_array().unwrap().is_empty())
            .count();
        eprintln!(
            "{name}: {}, {} hole punches, exchanged in {exchanged} of {ROUNDS} rounds",
            last(records, "reachability").as_str().unwrap(),
            last(records, "hole_punches"),
        );
    }
    eprintln!("A exchanged with B in {a_with_b} rounds");
}
