//! A private swarm's pre-shared key (libp2p `pnet`) on real swarms over loopback TCP: nodes
//! with the same key connect and talk (a manifest request, a relay circuit); a node with
//! another key, or with none, cannot connect to a keyed one, nor a keyed one to it; a QUIC
//! address next to a key is refused naming it.

mod common;

use common::*;
use gasloc_p2p::config::{NetworkConfig, Role};
use gasloc_p2p::local_swarm::local_config;
use gasloc_p2p::network::{self, Network};
use gasloc_p2p::swarm_key::{NotTcp, PreSharedKey};
use gasloc_proto::wire::ManifestResponse;
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::Multiaddr;
use std::time::Duration;

/// How long one dial across a key mismatch may take to fail (libp2p's connection timeout
/// is 10 s; a mismatch usually fails at once).
const DIAL_BOUND: Duration = Duration::from_secs(15);

fn key(byte: u8) -> PreSharedKey {
    PreSharedKey::new([byte; 32])
}

/// A node on loopback TCP with `swarm_key`.
async fn node(swarm_key: Option<PreSharedKey>, bootstrap: Vec<Multiaddr>) -> Network {
    let mut config = local_config(loopback(Transport::Tcp), bootstrap);
    config.swarm_key = swarm_key;
    network::start(Keypair::generate_ed25519(), config)
        .await
        .expect("a keyed node starts on loopback TCP")
}

/// `from` dials `to` (bounded); asserts that no connection results on either side.
async fn assert_cannot_connect(from: &Network, to: &Network, what: &str) {
    match tokio::time::timeout(DIAL_BOUND, from.client.dial(full_addr(to))).await {
        Ok(Ok(peer)) => panic!("{what}: the dial reached {peer}"),
        Ok(Err(error)) => eprintln!("{what}: dial refused as expected: {error}"),
        Err(_) => eprintln!("{what}: dial still pending after {DIAL_BOUND:?}"),
    }
    let theirs = to.client.connected_peers().await.unwrap();
    assert!(
        !theirs.contains(&from.client.peer_id()),
        "{what}: connected"
    );
    let ours = from.client.connected_peers().await.unwrap();
    assert!(!ours.contains(&to.client.peer_id()), "{what}: connected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_with_the_same_key_connect_and_exchange_a_manifest() {
    init_tracing();
    let host = node(Some(key(7)), vec![]).await;
    let served = ManifestResponse {
        run_id: vec![0x42; 32],
        manifest_toml: "name = \"private\"\n".into(),
        ..Default::default()
    };
    host.client.serve_manifest(served.clone()).await.unwrap();
    let member = node(Some(key(7)), vec![full_addr(&host)]).await;
    wait_connected(&host, member.client.peer_id()).await;
    let got = tokio::time::timeout(
        Duration::from_secs(10),
        member.client.request_manifest(host.client.peer_id()),
    )
    .await
    .expect("the manifest came back within 10 s")
    .unwrap();
    assert_eq!(got, served);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_another_key_cannot_connect() {
    init_tracing();
    let host = node(Some(key(7)), vec![]).await;
    let other = node(Some(key(8)), vec![]).await;
    assert_cannot_connect(&other, &host, "another key dials").await;
    assert_cannot_connect(&host, &other, "dials another key").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_a_key_and_a_keyed_node_cannot_connect_either_way() {
    init_tracing();
    let keyed = node(Some(key(7)), vec![]).await;
    let open = node(None, vec![]).await;
    assert_cannot_connect(&open, &keyed, "no key dials a keyed node").await;
    assert_cannot_connect(&keyed, &open, "a keyed node dials one without a key").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_circuit_works_between_keyed_nodes() {
    init_tracing();
    let mut config = NetworkConfig::new(Role::Bootstrap);
    config.listen = vec![loopback(Transport::Tcp)];
    config.swarm_key = Some(key(7));
    let relay = network::start(Keypair::generate_ed25519(), config)
        .await
        .unwrap();
    // Listens through the relay from the start (as `--relay` does).
    let mut config = local_config(loopback(Transport::Tcp), vec![full_addr(&relay)]);
    config.swarm_key = Some(key(7));
    config.relay_listen = true;
    let behind = network::start(Keypair::generate_ed25519(), config)
        .await
        .unwrap();
    let dialer = node(Some(key(7)), vec![]).await;
    let circuit = full_addr(&relay)
        .with(Protocol::P2pCircuit)
        .with(Protocol::P2p(behind.client.peer_id()));
    // The reservation on the relay is made in the background: dial until it is up (bounded).
    let mut reached = None;
    for _ in 0..40 {
        match tokio::time::timeout(DIAL_BOUND, dialer.client.dial(circuit.clone())).await {
            Ok(Ok(peer)) => {
                reached = Some(peer);
                break;
            }
            Ok(Err(error)) => eprintln!("circuit not up yet: {error}"),
            Err(_) => eprintln!("circuit dial pending after {DIAL_BOUND:?}"),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(reached, Some(behind.client.peer_id()), "no circuit");
    wait_connected(&behind, dialer.client.peer_id()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quic_address_with_a_key_is_refused_naming_it() {
    init_tracing();
    let mut config = local_config(loopback(Transport::Quic), vec![]);
    config.swarm_key = Some(key(7));
    let error = match network::start(Keypair::generate_ed25519(), config).await {
        Ok(_) => panic!("a keyed node started on QUIC"),
        Err(e) => e,
    };
    let not_tcp = error
        .downcast_ref::<NotTcp>()
        .unwrap_or_else(|| panic!("not a NotTcp: {error:#}"));
    assert_eq!(not_tcp.setting, "listen");
    assert_eq!(not_tcp.address, loopback(Transport::Quic));
}
