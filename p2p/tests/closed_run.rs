//! A closed run's allow-list, enforced at the connection level for QUIC and TCP: a peer on
//! the list connects, a stranger's dial is denied, and closing the access of a running node
//! drops the connections of peers not on the list.

mod common;

use common::*;
use gasloc_p2p::local_swarm::local_config;
use gasloc_p2p::network;
use std::collections::HashSet;
use std::time::Duration;

async fn closed_node(
    transport: Transport,
    allowed: &HashSet<libp2p::PeerId>,
    key: libp2p::identity::Keypair,
) -> network::Network {
    let mut config = local_config(loopback(transport), vec![]);
    config.allowed_peers = Some(allowed.clone());
    network::start(key, config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_peers_on_the_allow_list_connect_over_quic_and_tcp() {
    init_tracing();
    for transport in [Transport::Quic, Transport::Tcp] {
        let keys = sorted_keypairs(2);
        let allowed: HashSet<_> = keys.iter().map(|k| k.public().to_peer_id()).collect();
        let host = closed_node(transport, &allowed, keys[0].clone()).await;

        let member = start(keys[1].clone(), transport, vec![]).await;
        member.client.dial(full_addr(&host)).await.unwrap();
        wait_connected(&host, member.client.peer_id()).await;

        let stranger = start(
            libp2p::identity::Keypair::generate_ed25519(),
            transport,
            vec![],
        )
        .await;
        // The dial itself may complete the handshake before the host denies it: either way
        // no connection stays.
        let _ = stranger.client.dial(full_addr(&host)).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let connected = host.client.connected_peers().await.unwrap();
        assert!(
            !connected.contains(&stranger.client.peer_id()),
            "{transport:?}: a stranger is connected"
        );
        assert!(
            connected.contains(&member.client.peer_id()),
            "{transport:?}"
        );
        let theirs = stranger.client.connected_peers().await.unwrap();
        assert!(!theirs.contains(&host.client.peer_id()), "{transport:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_running_node_drops_the_peers_not_on_the_list() {
    init_tracing();
    let keys = sorted_keypairs(3);
    let host = start(keys[0].clone(), Transport::Quic, vec![]).await;
    let member = start(keys[1].clone(), Transport::Quic, vec![full_addr(&host)]).await;
    let stranger = start(keys[2].clone(), Transport::Quic, vec![full_addr(&host)]).await;
    wait_connected(&host, member.client.peer_id()).await;
    wait_connected(&host, stranger.client.peer_id()).await;

    let allowed: HashSet<_> = [&host, &member]
        .iter()
        .map(|n| n.client.peer_id())
        .collect();
    host.client.close_run(allowed).await.unwrap();
    let mut dropped = false;
    for _ in 0..100 {
        let connected = host.client.connected_peers().await.unwrap();
        if !connected.contains(&stranger.client.peer_id()) {
            assert!(connected.contains(&member.client.peer_id()));
            dropped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(dropped, "the stranger's connection stayed open");
    // And it cannot come back.
    let _ = stranger.client.dial(full_addr(&host)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let connected = host.client.connected_peers().await.unwrap();
    assert!(!connected.contains(&stranger.client.peer_id()));
}
