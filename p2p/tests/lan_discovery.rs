//! mDNS on a LAN (`--mdns`): two nodes without any bootstrap, each in its own network
//! namespace, joined by a veth pair, find each other and connect; without mDNS they do not.
//! The test creates and removes its namespaces (it needs root, like `ip netns`); traffic
//! stays on the veth pair. Each node is this test binary run again inside its namespace
//! (`LAN_PEER_LISTEN` set): see [`lan_peer`].

use gasloc_p2p::config::{NetworkConfig, Role};
use gasloc_p2p::network::{self, NetworkEvent};
use gasloc_tests::{is_root, Namespaces};
use libp2p::identity::Keypair;
use std::process::{Output, Stdio};
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

/// Runs a [`lan_peer`] in both namespaces at once (this test binary again); their outputs,
/// in namespace order.
fn run_pair(lan: &Namespaces, mdns: bool, wait_s: u64) -> [Output; 2] {
    let exe = std::env::current_exe().expect("test executable path");
    let spawn = |index: usize| {
        lan.command(index, "timeout")
            .arg((wait_s + 30).to_string())
            .arg(&exe)
            .args(["--exact", TEST, "--nocapture", "--test-threads", "1"])
            .env(
                "LAN_PEER_LISTEN",
                format!("/ip4/10.214.0.{}/tcp/0", index + 1),
            )
            .env("LAN_PEER_MDNS", if mdns { "on" } else { "off" })
            .env("LAN_PEER_WAIT_S", wait_s.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("lan peer starts")
    };
    let (a, b) = (spawn(0), spawn(1));
    [
        a.wait_with_output().expect("lan peer a"),
        b.wait_with_output().expect("lan peer b"),
    ]
}

/// The word after `key` in a node's output (the test harness may print on the same line).
fn field<'a>(out: &'a Output, key: &str) -> Option<&'a str> {
    let text = std::str::from_utf8(&out.stdout).ok()?;
    let start = text.find(key)? + key.len();
    text[start..].split_whitespace().next()
}

#[test]
fn two_nodes_on_a_lan_find_each_other_with_mdns_and_not_without() {
    if let Ok(listen) = std::env::var("LAN_PEER_LISTEN") {
        // A node inside one of the namespaces.
        // What mDNS sent and heard, on stderr: the parent prints it when a node failed.
        let _ = tracing_subscriber::fmt()
            .with_env_filter("libp2p_mdns=debug,libp2p_swarm=debug")
            .with_writer(std::io::stderr)
            .try_init();
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
    let lan = Namespaces::create(&["glmdns-a", "glmdns-b"]);
    lan.link(0, "10.214.0.1/24", 1, "10.214.0.2/24");

    // Both start at once, so the first queries may find no listener yet: the wait covers
    // several of the later queries (every MDNS_QUERY_INTERVAL).
    let [a, b] = run_pair(&lan, true, 60);
    for out in [&a, &b] {
        assert!(
            out.status.success(),
            "a: {}\n{}\nb: {}\n{}",
            String::from_utf8_lossy(&a.stdout),
            String::from_utf8_lossy(&a.stderr),
            String::from_utf8_lossy(&b.stdout),
            String::from_utf8_lossy(&b.stderr)
        );
    }
    let (id_a, id_b) = (
        field(&a, "peer_id=").unwrap(),
        field(&b, "peer_id=").unwrap(),
    );
    assert_eq!(field(&a, "connected="), Some(id_b), "a found b");
    assert_eq!(field(&b, "connected="), Some(id_a), "b found a");

    // The control: the same nodes without mDNS have no way to meet.
    let [a, b] = run_pair(&lan, false, 5);
    for out in [&a, &b] {
        assert!(!out.status.success(), "a node without mDNS found a peer");
        let printed = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        assert!(printed.contains("no peer found on the LAN"), "{printed}");
    }
}
