//! A bootstrap address without `/p2p/<peer id>` (what a compose network gives a node:
//! `/dns4/bootstrap/tcp/4001`): the node learns the peer that answers there and takes it as
//! its bootstrap node; nobody answering is an error naming the address, within the patience.

mod common;

use common::*;
use gasloc_p2p::local_swarm::local_config;
use gasloc_p2p::network;
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_without_a_peer_id_resolves_to_the_peer_that_answers() {
    init_tracing();
    for transport in [Transport::Quic, Transport::Tcp] {
        let host = start(Keypair::generate_ed25519(), transport, vec![]).await;
        let bare = host.listen_addrs[0].clone();
        assert!(!bare.iter().any(|p| matches!(p, Protocol::P2p(_))));
        let node = network::start(
            Keypair::generate_ed25519(),
            local_config(loopback(transport), vec![bare]),
        )
        .await
        .unwrap();
        assert_eq!(
            node.bootstrap_peers,
            vec![host.client.peer_id()],
            "{transport:?}"
        );
        wait_connected(&host, node.client.peer_id()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bare_address_where_nobody_answers_fails_naming_it_within_the_patience() {
    init_tracing();
    // A port nobody listens on: take one and let it go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nobody: libp2p::Multiaddr = format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap();
    let mut config = local_config(loopback(Transport::Tcp), vec![nobody.clone()]);
    config.bootstrap_dial_patience = Duration::from_secs(2);
    let start = Instant::now();
    let error = match network::start(Keypair::generate_ed25519(), config).await {
        Ok(_) => panic!("a node started with no bootstrap at {nobody}"),
        Err(e) => e.to_string(),
    };
    assert!(
        error.contains(&format!("no bootstrap node answered at {nobody} within 2s")),
        "{error}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}
