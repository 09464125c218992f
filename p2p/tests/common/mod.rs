//! Shared helpers for the p2p integration tests: real swarms on loopback.
#![allow(dead_code)]

use gasloc_p2p::exchange_service::{ExchangeConfig, ExchangeService};
use gasloc_p2p::local_swarm::local_config;
use gasloc_p2p::network::{self, Network};
pub use gasloc_proto::RunId;
use libp2p::identity::Keypair;
use libp2p::{Multiaddr, PeerId};
use std::time::Duration;

pub const RUN_ID: RunId = RunId::from_bytes([0x42; 32]);

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,libp2p=error".into()),
        )
        .with_test_writer()
        .try_init();
}

/// `n` fresh keypairs ordered by peer id bytes (index 0 is the smallest: it opens streams).
pub fn sorted_keypairs(n: usize) -> Vec<Keypair> {
    let mut keys: Vec<Keypair> = (0..n).map(|_| Keypair::generate_ed25519()).collect();
    keys.sort_by_key(|k| k.public().to_peer_id().to_bytes());
    keys
}

#[derive(Clone, Copy, Debug)]
pub enum Transport {
    Quic,
    Tcp,
}

pub fn loopback(transport: Transport) -> Multiaddr {
    match transport {
        Transport::Quic => "/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap(),
        Transport::Tcp => "/ip4/127.0.0.1/tcp/0".parse().unwrap(),
    }
}

pub async fn start(keypair: Keypair, transport: Transport, bootstrap: Vec<Multiaddr>) -> Network {
    network::start(keypair, local_config(loopback(transport), bootstrap))
        .await
        .expect("network starts on loopback")
}

/// The first listen address with `/p2p/<peer id>` appended.
pub fn full_addr(network: &Network) -> Multiaddr {
    let peer = network.client.peer_id();
    format!("{}/p2p/{peer}", network.listen_addrs[0])
        .parse()
        .unwrap()
}

pub fn service(network: &Network) -> ExchangeService {
    let mut config = ExchangeConfig::new(RUN_ID);
    config.accept_wait = Duration::from_secs(5);
    ExchangeService::start(
        network.client.peer_id(),
        network.client.stream_control(),
        config,
    )
    .expect("exchange service registers its protocols")
}

/// Two swarms on loopback, connected, each with its exchange service; the first has the
/// smaller peer id (it opens the exchange streams).
pub async fn connected_pair(
    transport: Transport,
) -> ((Network, ExchangeService), (Network, ExchangeService)) {
    init_tracing();
    let keys = sorted_keypairs(2);
    let a = start(keys[0].clone(), transport, vec![]).await;
    let b = start(keys[1].clone(), transport, vec![full_addr(&a)]).await;
    wait_connected(&a, b.client.peer_id()).await;
    wait_connected(&b, a.client.peer_id()).await;
    let (sa, sb) = (service(&a), service(&b));
    ((a, sa), (b, sb))
}

/// Waits (bounded) until `network` is connected to `peer`.
pub async fn wait_connected(network: &Network, peer: PeerId) {
    for _ in 0..200 {
        if network
            .client
            .connected_peers()
            .await
            .unwrap()
            .contains(&peer)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("not connected to {peer} within 10 s");
}
