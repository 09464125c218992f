//! A node that crashes and comes back with the same identity, over QUIC, before its peers
//! noticed it was gone: its peers still hold its old connection when the new one arrives.
//!
//! The crash is real as far as the wire can tell: the node's swarm runs on its own tokio
//! runtime, which is dropped without polling anything again, so no close frame is ever sent
//! (as after SIGKILL). The node then starts again on the same UDP port, as a restarted
//! `gasloc-node` does.

mod common;

use common::*;
use gasloc_p2p::local_swarm::local_config;
use gasloc_p2p::network::{self, Network};
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;

/// Shorter than the product's default (30 s), to keep the test short: a killed node's
/// connection stays open on its peer's side this long.
const QUIC_IDLE_TIMEOUT: Duration = Duration::from_secs(8);

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

fn udp_port(address: &Multiaddr) -> u16 {
    address
        .iter()
        .find_map(|p| match p {
            Protocol::Udp(port) => Some(port),
            _ => None,
        })
        .expect("a QUIC address has a UDP port")
}

/// Starts a node listening on `port` (0: any), dialling `bootstrap`, on the run's topic.
async fn start_on_topic(keypair: Keypair, port: u16, bootstrap: Vec<Multiaddr>) -> Network {
    let listen: Multiaddr = format!("/ip4/127.0.0.1/udp/{port}/quic-v1")
        .parse()
        .unwrap();
    // The crashed node's socket is closed as its runtime drops it: bounded retries if the
    // port is not free yet.
    let mut config = local_config(listen, bootstrap);
    config.quic_max_idle_timeout = QUIC_IDLE_TIMEOUT;
    config.quic_keep_alive_interval = Duration::from_secs(2);
    let mut attempts = 0;
    let network = loop {
        match network::start(keypair.clone(), config.clone()).await {
            Ok(network) => break network,
            Err(e) if attempts < 20 => {
                attempts += 1;
                tracing::info!(error = %e, "port {port} not free yet");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("cannot start a node on port {port}: {e:#}"),
        }
    };
    network.client.join_run(RUN_ID, None).await.unwrap();
    network
}

/// Waits (bounded by `limit`) until `network` counts `peer` on the run's topic; returns how
/// long it took, or `None`.
async fn wait_topic_peer(network: &Network, peer: PeerId, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if network.client.topic_peers().await.unwrap().contains(&peer) {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// The peer's gossipsub greeting went out on the connection that died with the crash; the
/// restarted node must still learn that the peer is on the run's topic. The peer finds the
/// dead connection out at the QUIC idle timeout (8 s here) and must then reconnect; the
/// bound is 30 s. Without the reconnection the restarted node never learns it.
#[test]
fn a_node_restarted_before_its_peer_noticed_the_crash_sees_the_peer_on_the_topic() {
    init_tracing();
    let peer_runtime = runtime();
    let peer = peer_runtime.block_on(start_on_topic(Keypair::generate_ed25519(), 0, vec![]));
    let peer_id = peer.client.peer_id();
    let peer_addr = full_addr(&peer);

    let keypair = Keypair::generate_ed25519();
    let crashing_runtime = runtime();
    let crashing =
        crashing_runtime.block_on(start_on_topic(keypair.clone(), 0, vec![peer_addr.clone()]));
    let port = udp_port(&crashing.listen_addrs[0]);
    let first_wait =
        crashing_runtime.block_on(wait_topic_peer(&crashing, peer_id, Duration::from_secs(30)));
    assert!(
        first_wait.is_some(),
        "the first run of the node never saw its peer on the topic"
    );
    let crashed_id = crashing.client.peer_id();
    let seen_by_peer =
        peer_runtime.block_on(wait_topic_peer(&peer, crashed_id, Duration::from_secs(30)));
    assert!(
        seen_by_peer.is_some(),
        "the peer never saw the node on the topic"
    );

    // The crash: nothing of the node's runtime runs again (the runtime goes first: dropping
    // the client first would let the event loop end and close its connections politely).
    crashing_runtime.shutdown_background();
    drop(crashing);

    let restarted_runtime = runtime();
    let restarted = restarted_runtime.block_on(start_on_topic(keypair, port, vec![peer_addr]));
    let waited = restarted_runtime.block_on(wait_topic_peer(
        &restarted,
        peer_id,
        Duration::from_secs(30),
    ));
    assert!(
        waited.is_some(),
        "the restarted node did not see its peer on the run's topic within 30 s: the peer's \
         subscription went out on the connection that died with the crash"
    );
    eprintln!(
        "restarted node saw its peer on the topic after {:.1} s",
        waited.unwrap().as_secs_f64()
    );
    // And the swarm is whole again: the peer still counts the node.
    let seen_again =
        peer_runtime.block_on(wait_topic_peer(&peer, crashed_id, Duration::from_secs(10)));
    assert!(
        seen_again.is_some(),
        "the peer lost the restarted node from the topic"
    );
    restarted_runtime.block_on(restarted.client.shutdown());
    peer_runtime.block_on(peer.client.shutdown());
}
