//! A closed run with real processes: the operator makes two nodes' identities with
//! `gasloc-node identity` and lists them in the manifest's `[access] peers`. Both nodes
//! join through the bootstrap and run rounds together; a stranger (an identity not on the
//! list) is refused at the bootstrap's door: it cannot even fetch the manifest. (That a
//! closed node refuses a stranger's QUIC and TCP connections, and drops those open when it
//! closes, is `p2p/tests/closed_run.rs`.)

use gasloc_tests::{built_binary, field, start_bootstrap, synthetic_join_command, synthetic_run};
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
