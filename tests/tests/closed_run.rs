//! A closed run with real processes: the operator makes two nodes' identities with
//! `gasloc-node identity` and lists them in the manifest's `[access] peers`. Both nodes
//! join through the bootstrap and run rounds together; a stranger (an identity not on the
//! list) is refused at the bootstrap's door: it cannot even fetch the manifest. (That a
//! closed node refuses a stranger's QUIC and TCP connections, and drops those open when it
//! closes, is `p2p/tests/closed_run.rs`.)
//!
//! A private swarm: a bootstrap and two nodes given the same swarm key (libp2p pnet, TCP
//! only) run rounds together; a node with another key, and one with none, cannot connect at
//! all (`p2p/tests/private_swarm.rs` tests the transport itself).

use gasloc_tests::{
    built_binary, field, start_bootstrap, synthetic_join_command, synthetic_join_command_on,
    synthetic_run, wait_for_file, Proc,
};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn identity(home: &Path) -> String {
    let out = Command::new(built_binary("gasloc-node"))
        .args(["identity", "--home"])
        .arg(home)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    field(text.trim(), "peer_id").unwrap().to_string()
}

/// Waits (bounded) for `child` to exit.
fn wait(child: &mut std::process::Child, bound: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > bound {
            let _ = child.kill();
            panic!("a node did not exit within {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_closed_run_trains_its_listed_nodes_and_refuses_a_stranger() {
    let dir = gasloc_tests::TestDir::new();
    let home = |name: &str| dir.path().join(name);
    let members = [identity(&home("node1")), identity(&home("node2"))];
    let manifest = dir.path().join("run.toml");
    std::fs::write(
        &manifest,
        format!(
            "{}[access]\npeers = [\"{}\", \"{}\"]\n",
            synthetic_run("closed-run"),
            members[0],
            members[1]
        ),
    )
    .unwrap();
    let (_bootstrap, quic) = start_bootstrap(dir.path(), &manifest, 4000, 1500, 500, 900);

    let rounds = 4;
    let spawn = |name: &str| {
        let log = std::fs::File::create(home(&format!("{name}.err"))).unwrap();
        std::fs::create_dir_all(home(name)).unwrap();
        synthetic_join_command(&quic, &home(name), 65536, rounds)
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap()
    };
    let mut nodes = [spawn("node1"), spawn("node2")];
    let mut stranger = spawn("stranger");

    let status = wait(&mut stranger, Duration::from_secs(60));
    assert!(!status.success(), "the stranger joined a closed run");
    let err = std::fs::read_to_string(home("stranger.err")).unwrap();
    assert!(err.contains("could not fetch the run manifest"), "{err}");

    for (i, node) in nodes.iter_mut().enumerate() {
        let status = wait(node, Duration::from_secs(90));
        let err = std::fs::read_to_string(home(&format!("node{}.err", i + 1))).unwrap();
        assert!(status.success(), "node{}: {err}", i + 1);
    }
    for (i, name) in ["node1", "node2"].iter().enumerate() {
        let records = gasloc_tests::read_report(&home(name));
        assert_eq!(records.len() as u64, rounds, "{name}");
        let other = &members[1 - i];
        let met = records
            .iter()
            .filter(|r| {
                r["exchanged"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p == other)
            })
            .count();
        assert!(
            met >= 2,
            "{name} exchanged with its partner in {met} rounds"
        );
        for r in &records {
            let members_seen = r["members"].as_array().unwrap();
            assert!(members_seen.len() <= 2, "{name}: {r}");
        }
    }
}

/// A `swarm.key` file of 32 bytes, each `byte`.
fn swarm_key(path: &Path, byte: u8) {
    let hex: String = std::iter::repeat_n(format!("{byte:02x}"), 32).collect();
    std::fs::write(path, format!("/key/swarm/psk/1.0.0/\n/base16/\n{hex}\n")).unwrap();
}

#[test]
fn a_private_swarm_trains_its_key_holders_and_refuses_a_node_without_the_key() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let (key, other_key) = (dir.join("swarm.key"), dir.join("other.key"));
    swarm_key(&key, 7);
    swarm_key(&other_key, 8);
    let manifest = dir.join("run.toml");
    std::fs::write(&manifest, synthetic_run("private-swarm")).unwrap();
    let mut command = Command::new(built_binary("gasloc-bootstrap"));
    command
        .arg("--run")
        .arg(&manifest)
        .args(["--listen", "/ip4/127.0.0.1/tcp/0", "--swarm-key"])
        .arg(&key)
        .arg("--addr-file")
        .arg(dir.join("bootstrap.addrs"))
        .args(["--genesis-delay-ms", "4000", "--round-period-ms", "1500"])
        .args(["--commit-window-ms", "500", "--reveal-window-ms", "500"])
        .args(["--exchange-timeout-ms", "900"]);
    let bootstrap = Proc::spawn("bootstrap", dir, command);
    let addrs = wait_for_file(&dir.join("bootstrap.addrs"), Duration::from_secs(30));
    let tcp = addrs.lines().next().unwrap().to_string();
    assert!(tcp.contains("/tcp/") && !addrs.contains("quic"), "{addrs}");

    let rounds = 4;
    let spawn = |name: &str, key: Option<&Path>| {
        std::fs::create_dir_all(dir.join(name)).unwrap();
        let tcp_only = ["/ip4/127.0.0.1/tcp/0"];
        let mut command =
            synthetic_join_command_on(&tcp, &dir.join(name), 65536, rounds, &tcp_only);
        if let Some(key) = key {
            command.arg("--swarm-key").arg(key);
        }
        Proc::spawn(name, dir, command)
    };
    let mut nodes = [spawn("node1", Some(&key)), spawn("node2", Some(&key))];
    let mut strangers = [spawn("other-key", Some(&other_key)), spawn("no-key", None)];

    for stranger in &mut strangers {
        let joined = stranger.wait_exit(Duration::from_secs(60));
        assert!(!joined, "{} joined a private swarm", stranger.name);
        let err = stranger.stderr_tail();
        assert!(
            err.contains("could not fetch the run manifest"),
            "{}: {err}",
            stranger.name
        );
    }
    for node in &mut nodes {
        node.expect_success(Duration::from_secs(90));
    }
    let fingerprint = |proc: &Proc| {
        let out = proc.output();
        out.lines()
            .find_map(|l| field(l, "swarm_key_fingerprint").map(str::to_string))
            .unwrap_or_else(|| panic!("{} prints its key's fingerprint: {out}", proc.name))
    };
    let expected = fingerprint(&bootstrap);
    for node in &nodes {
        assert_eq!(fingerprint(node), expected, "{}", node.name);
        let records = gasloc_tests::read_report(&dir.join(&node.name));
        assert_eq!(records.len() as u64, rounds, "{}", node.name);
        let exchanged = records
            .iter()
            .filter(|r| !r["exchanged"].as_array().unwrap().is_empty())
            .count();
        assert!(
            exchanged >= 2,
            "{} exchanged in {exchanged} rounds",
            node.name
        );
    }
}
