//! mDNS on a LAN (`--mdns`): two nodes without any bootstrap, each in its own network
//! namespace, joined by a veth pair, find each other and connect; without mDNS they do not.
//! The test creates and removes its namespaces (it needs root, like `ip netns`); traffic
//! stays on the veth pair. Each node is this test binary run again inside its namespace
//! (`LAN_PEER_LISTEN` set): see [`lan_peer`].

use gasloc_p2p::config::{NetworkConfig, Role};
use gasloc_p2p::network::{self, NetworkEvent};
use libp2p::identity::Keypair;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const TEST: &str = "two_nodes_on_a_lan_find_each_other_with_mdns_and_not_without";

/// One node that looks for peers with mDNS alone (or nothing, with `mdns` off): prints
/// `peer_id=<id>`, then `connected=<peer>` for the first peer it is connected to, and stays up
/// `linger` more (so that the other side sees the connection too). Panics when no peer
/// turned up within `wait`.
async fn lan_peer(listen: &str, mdns: bool, wait: Duration, linger: Duration) {
    let mut config = NetworkConfig::new(Role::Node);
    config.listen = vec![listen.parse().expect("listen address")];
    config.mdns = mdns;
    let mut node = network::start(Keypair::generate_ed25519(), config)
        .await
        .expect("node starts");
    println!("peer_id={}", node.client.peer_id());
    let found = tokio::time::timeout(wait, async {
        loop {
            match node.events.recv().await {
                Some(NetworkEvent::Connected(peer)) => return Some(peer),
                Some(_) => {}
                None => return None,
            }
        }
    })
    .await;
    let Ok(Some(peer)) = found else {
        panic!("no peer found on the LAN within {wait:?}");
    };
    println!("connected={peer}");
    tokio::time::sleep(linger).await;
    node.client.shutdown().await;
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip runs");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two namespaces joined by a veth pair, 10.214.0.1/24 and 10.214.0.2/24; removed on drop.
struct Lan {
    names: [String; 2],
}

impl Lan {
    fn create() -> Lan {
        let id = std::process::id();
        let names = [format!("glmdns-a-{id}"), format!("glmdns-b-{id}")];
        let lan = Lan { names };
        let [a, b] = &lan.names;
        ip(&["netns", "add", a]);
        ip(&["netns", "add", b]);
        let (va, vb) = (format!("gm{id}a"), format!("gm{id}b"));
        ip(&[
            "link", "add", &va, "netns", a, "type", "veth", "peer", "name", &vb, "netns", b,
        ]);
        for (ns, dev, addr) in [(a, &va, "10.214.0.1/24"), (b, &vb, "10.214.0.2/24")] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
        }
        lan
    }

    /// Runs a [`lan_peer`] in both namespaces at once (this test binary again); their
    /// outputs, in namespace order.
    fn run_pair(&self, mdns: bool, wait_s: u64) -> [Output; 2] {
        let exe = std::env::current_exe().expect("test executable path");
        let spawn = |ns: &str, host: &str| {
            Command::new("ip")
                .args(["netns", "exec", ns, "timeout", "60"])
                .arg(&exe)
                .args(["--exact", TEST, "--nocapture", "--test-threads", "1"])
                .env("LAN_PEER_LISTEN", format!("/ip4/{host}/tcp/0"))
                .env("LAN_PEER_MDNS", if mdns { "on" } else { "off" })
                .env("LAN_PEER_WAIT_S", wait_s.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("lan peer starts")
        };
        let a = spawn(&self.names[0], "10.214.0.1");
        let b = spawn(&self.names[1], "10.214.0.2");
        [
            a.wait_with_output().expect("lan_peer a"),
            b.wait_with_output().expect("lan_peer b"),
        ]
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// The word after `key` in a node's output (the test harness may print on the same line).
fn field<'a>(out: &'a Output, key: &str) -> Option<&'a str> {
    let text = std::str::from_utf8(&out.stdout).ok()?;
    let start = text.find(key)? + key.len();
    text[start..].split_whitespace().next()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

#[test]
fn two_nodes_on_a_lan_find_each_other_with_mdns_and_not_without() {
    if let Ok(listen) = std::env::var("LAN_PEER_LISTEN") {
        // A node inside one of the namespaces.
        let mdns = std::env::var("LAN_PEER_MDNS").as_deref() == Ok("on");
        let wait_s: u64 = std::env::var("LAN_PEER_WAIT_S").unwrap().parse().unwrap();
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (wait, linger) = (Duration::from_secs(wait_s), Duration::from_secs(3));
        runtime.block_on(lan_peer(&listen, mdns, wait, linger));
        return;
    }
    if !is_root() {
        eprintln!("lan_discovery needs root to create network namespaces; not run");
        return;
    }
    let lan = Lan::create();

    let [a, b] = lan.run_pair(true, 30);
    for out in [&a, &b] {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (id_a, id_b) = (
        field(&a, "peer_id=").unwrap(),
        field(&b, "peer_id=").unwrap(),
    );
    assert_eq!(field(&a, "connected="), Some(id_b), "a found b");
    assert_eq!(field(&b, "connected="), Some(id_a), "b found a");

    // The control: the same nodes without mDNS have no way to meet.
    let [a, b] = lan.run_pair(false, 5);
    for out in [&a, &b] {
        assert!(!out.status.success(), "a node without mDNS found a peer");
        let printed = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        assert!(printed.contains("no peer found on the LAN"), "{printed}");
    }
}
