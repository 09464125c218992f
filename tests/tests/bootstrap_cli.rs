//! `gasloc-bootstrap` as a process: what it prints, its persisted identity, its status
//! endpoint, and clear refusals of bad flags and files.

use gasloc_proto::RunManifest;
use gasloc_tests::built_binary;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const MANIFEST: &str = "name = \"cli-test\"\nseed = 3\n[model]\nsize = \"tiny\"\n[data]\ntokenizer = \"byte\"\nseq_len = 32\nmicro_batch = 2\n[optimizer]\ndecay_steps = 10\n";

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the bootstrap node and collects its stdout lines until `status=` (bounded).
fn start(dir: &std::path::Path) -> (Running, Vec<String>) {
    let mut child = Command::new(built_binary("gasloc-bootstrap"))
        .arg("--run")
        .arg(dir.join("run.toml"))
        .args([
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--listen",
            "/ip4/127.0.0.1/udp/0/quic-v1",
        ])
        .arg("--identity")
        .arg(dir.join("id.key"))
        .args(["--status-addr", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("gasloc-bootstrap starts");
    let stdout = child.stdout.take().unwrap();
    // From here on the guard kills and waits for the process, also on panic.
    let child = Running(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(30)) {
        let done = line.starts_with("status=");
        lines.push(line);
        if done {
            return (child, lines);
        }
    }
    panic!("no status= line; got {lines:?}");
}

fn value<'a>(lines: &'a [String], key: &str) -> Vec<&'a str> {
    lines.iter().filter_map(|l| l.strip_prefix(key)).collect()
}

#[test]
fn bootstrap_prints_full_addresses_keeps_its_identity_and_serves_status() {
    let dir = gasloc_tests::TestDir::new();
    std::fs::write(dir.path().join("run.toml"), MANIFEST).unwrap();
    let run_id = RunManifest::parse(MANIFEST, "t")
        .unwrap()
        .run_id()
        .to_string();

    let (first, lines) = start(dir.path());
    assert_eq!(
        value(&lines, "run_id="),
        [format!("{run_id} name=cli-test").as_str()]
    );
    let peer = value(&lines, "peer_id=")[0].to_string();
    let listening = value(&lines, "listening=");
    assert_eq!(listening.len(), 2, "{lines:?}");
    for address in &listening {
        assert!(address.starts_with("/ip4/127.0.0.1/"), "{address}");
        assert!(address.ends_with(&format!("/p2p/{peer}")), "{address}");
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("id.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    let status_addr = value(&lines, "status=")[0];
    let mut socket = std::net::TcpStream::connect(status_addr).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    socket.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.0 200 OK"), "{response}");
    let body = response.split("\r\n\r\n").nth(1).unwrap();
    let status: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(status["run_id"], run_id.as_str());
    assert_eq!(status["peer_id"], peer.as_str());
    drop(first);

    // Restarted with the same identity file: the same peer id.
    let (_second, lines) = start(dir.path());
    assert_eq!(value(&lines, "peer_id=")[0], peer);
}

fn refusal(args: &[&str], dir: &std::path::Path) -> String {
    let out = Command::new(built_binary("gasloc-bootstrap"))
        .current_dir(dir)
        .args(args)
        .args(["--listen", "/ip4/127.0.0.1/tcp/0"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{args:?} was accepted");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bootstrap_refuses_bad_flags_and_files_with_a_reason() {
    let dir = gasloc_tests::TestDir::new();
    std::fs::write(dir.path().join("run.toml"), MANIFEST).unwrap();
    std::fs::write(dir.path().join("bad.key"), b"not a key").unwrap();
    std::fs::write(
        dir.path().join("swarm.key"),
        format!("/key/swarm/psk/1.0.0/\n/base16/\n{}\n", "ab".repeat(32)),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("short.key"),
        "/key/swarm/psk/1.0.0/\n/base16/\nabcd\n",
    )
    .unwrap();
    let cases: [(&[&str], &str); 10] = [
        (&["--run", "missing.toml"], "cannot read run manifest"),
        (
            &["--run", "run.toml", "--topology", "star"],
            "unknown topology",
        ),
        (
            &["--run", "run.toml", "--topology", "ring"],
            "is a simulator baseline",
        ),
        (
            &[
                "--run",
                "run.toml",
                "--round-period-ms",
                "1000",
                "--commit-window-ms",
                "1500",
                "--reveal-window-ms",
                "600",
            ],
            "commit window 1500 ms must not be longer than the round period",
        ),
        (
            &[
                "--run",
                "run.toml",
                "--round-period-ms",
                "1000",
                "--commit-window-ms",
                "500",
                "--reveal-window-ms",
                "1000",
            ],
            "reveal window 1000 ms must be shorter than the round period",
        ),
        (
            &["--run", "run.toml", "--identity", "bad.key"],
            "identity file",
        ),
        (
            &["--run", "run.toml", "--swarm-key", "missing.key"],
            "swarm key missing.key: no such file",
        ),
        (
            &["--run", "run.toml", "--swarm-key", "bad.key"],
            "swarm key bad.key: the first line is \"not a key\"",
        ),
        (
            &["--run", "run.toml", "--swarm-key", "short.key"],
            "swarm key short.key: the third line must be 64 hex digits",
        ),
        (
            &[
                "--run",
                "run.toml",
                "--swarm-key",
                "swarm.key",
                "--listen",
                "/ip4/127.0.0.1/udp/0/quic-v1",
            ],
            "listen address /ip4/127.0.0.1/udp/0/quic-v1 is not TCP",
        ),
    ];
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let key = dir.path().join("bad.key");
        std::fs::set_permissions(key, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    for (args, reason) in cases {
        let stderr = refusal(args, dir.path());
        assert!(stderr.contains(reason), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
