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
    synthetic_run, wait_for_file,
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
    let dir = tempfile::tempdir().unwrap();
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
    let dir = tempfile::tempdir().unwrap();
    let home = |name: &str| dir.path().join(name);
    let (key, other_key) = (home("swarm.key"), home("other.key"));
    swarm_key(&key, 7);
    swarm_key(&other_key, 8);
    let manifest = home("run.toml");
    std::fs::write(&manifest, synthetic_run("private-swarm")).unwrap();
    let bootstrap_log = std::fs::File::create(home("bootstrap.out")).unwrap();
    let mut bootstrap = Command::new(built_binary("gasloc-bootstrap"))
        .arg("--run")
        .arg(&manifest)
        .args(["--listen", "/ip4/127.0.0.1/tcp/0", "--swarm-key"])
        .arg(&key)
        .arg("--addr-file")
        .arg(home("bootstrap.addrs"))
        .args(["--genesis-delay-ms", "4000", "--round-period-ms", "1500"])
        .args(["--commit-window-ms", "500", "--reveal-window-ms", "500"])
        .args(["--exchange-timeout-ms", "900"])
        .stdout(bootstrap_log)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addrs = wait_for_file(&home("bootstrap.addrs"), Duration::from_secs(30));
    let tcp = addrs.lines().next().unwrap().to_string();
    assert!(tcp.contains("/tcp/") && !addrs.contains("quic"), "{addrs}");

    let rounds = 4;
    let spawn = |name: &str, key: Option<&Path>| {
        let log = std::fs::File::create(home(&format!("{name}.err"))).unwrap();
        let out = std::fs::File::create(home(&format!("{name}.out"))).unwrap();
        std::fs::create_dir_all(home(name)).unwrap();
        let mut command =
            synthetic_join_command_on(&tcp, &home(name), 65536, rounds, &["/ip4/127.0.0.1/tcp/0"]);
        if let Some(key) = key {
            command.arg("--swarm-key").arg(key);
        }
        command.stdout(out).stderr(log).spawn().unwrap()
    };
    let mut nodes = [spawn("node1", Some(&key)), spawn("node2", Some(&key))];
    let mut strangers = [spawn("other-key", Some(&other_key)), spawn("no-key", None)];

    for (stranger, name) in strangers.iter_mut().zip(["other-key", "no-key"]) {
        let status = wait(stranger, Duration::from_secs(60));
        assert!(!status.success(), "{name} joined a private swarm");
        let err = std::fs::read_to_string(home(&format!("{name}.err"))).unwrap();
        assert!(
            err.contains("could not fetch the run manifest"),
            "{name}: {err}"
        );
    }
    for (i, node) in nodes.iter_mut().enumerate() {
        let status = wait(node, Duration::from_secs(90));
        let err = std::fs::read_to_string(home(&format!("node{}.err", i + 1))).unwrap();
        assert!(status.success(), "node{}: {err}", i + 1);
    }
    let _ = bootstrap.kill();
    let _ = bootstrap.wait();
    let fingerprint = |name: &str| {
        let out = std::fs::read_to_string(home(name)).unwrap();
        out.lines()
            .find_map(|l| field(l, "swarm_key_fingerprint").map(str::to_string))
            .unwrap_or_else(|| panic!("{name} prints its key's fingerprint: {out}"))
    };
    let expected = fingerprint("bootstrap.out");
    for name in ["node1", "node2"] {
        assert_eq!(fingerprint(&format!("{name}.out")), expected, "{name}");
        let records = gasloc_tests::read_report(&home(name));
        assert_eq!(records.len() as u64, rounds, "{name}");
        let exchanged = records
            .iter()
            .filter(|r| !r["exchanged"].as_array().unwrap().is_empty())
            .count();
        assert!(exchanged >= 2, "{name} exchanged in {exchanged} rounds");
    }
}
