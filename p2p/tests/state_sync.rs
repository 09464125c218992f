//! `/gasloc/state/1`: a joining node streams a live peer's state, verified like an exchange.

mod common;

use common::*;
use gasloc_p2p::exchange::{ExchangeError, OutgoingPayload, SendOptions};
use gasloc_p2p::tensors::TensorSet;
use gasloc_proto::wire::{DType, PayloadKind, RefusalReason};
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_node_fetches_the_current_state_or_a_clear_refusal() {
    let ((live, live_service), (_joiner, joiner_service)) = connected_pair(Transport::Quic).await;

    // Nothing to share yet (the node takes part in no round): a refusal that says so, at once.
    let err = joiner_service
        .fetch_state(live.client.peer_id(), None, Duration::from_secs(10))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ExchangeError::Refused {
                reason: RefusalReason::NoState,
                ..
            }
        ),
        "{err}"
    );

    let state = Arc::new(TensorSet::synthetic(3, (1 << 20) + 8, 11));
    live_service.set_state(
        12,
        Arc::new(OutgoingPayload::new(
            PayloadKind::State,
            state.clone(),
            SendOptions {
                chunk_size: 1 << 18,
                zstd_level: Some(1),
                upload_limit: None,
            },
        )),
    );
    let (round, got) = joiner_service
        .fetch_state(
            live.client.peer_id(),
            Some(Arc::new(state.specs())),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert_eq!(round, 12);
    assert!(got == *state);

    // A joiner expecting another model refuses the state (table mismatch) without using it.
    let mut wrong = state.specs();
    wrong[0].shape = vec![1];
    let err = joiner_service
        .fetch_state(
            live.client.peer_id(),
            Some(Arc::new(wrong)),
            Duration::from_secs(30),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ExchangeError::TableMismatch(_)), "{err}");
}

/// A node in rounds makes its state only when asked: a request that finds none marks it
/// wanted and is answered by the state the node's next outer step makes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_request_waits_for_the_state_the_next_outer_step_makes() {
    let ((live, live_service), (_joiner, joiner_service)) = connected_pair(Transport::Quic).await;
    live_service.advance_floor(7); // the live node runs round 7
    assert!(!live_service.take_state_wanted());
    let state = Arc::new(TensorSet::synthetic(2, 4096, 5));
    let table = Arc::new(state.specs());
    let peer = live.client.peer_id();
    let fetch = tokio::spawn(async move {
        joiner_service
            .fetch_state(peer, Some(table), Duration::from_secs(30))
            .await
    });
    // The driver polls the flag before each outer step; the request sets it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !live_service.take_state_wanted() {
        assert!(
            std::time::Instant::now() < deadline,
            "the request never asked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!fetch.is_finished(), "it waits for the state");
    live_service.set_state(
        8,
        Arc::new(OutgoingPayload::new(
            PayloadKind::State,
            state.clone(),
            SendOptions::default(),
        )),
    );
    let (round, got) = fetch.await.unwrap().unwrap();
    assert_eq!(round, 8);
    assert!(got == *state);
}

/// Three nodes wired as `join` wires them: a joiner asks for the state while one source serves
/// a well-formed state holding a NaN and the other none yet, then while the other serves a
/// good one. The poisoned state is never handed over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_skips_a_source_whose_state_holds_a_nan() {
    use gasloc_p2p::local_swarm::local_config;
    use gasloc_p2p::network::unix_ms;
    use gasloc_p2p::schedule::Timing;
    use gasloc_p2p::swarm_node::{JoinedNode, SwarmNode};
    use gasloc_proto::topology::Topology;
    init_tracing();
    let run_id = gasloc_proto::RunId::from_bytes([3; 32]);
    // Far in the future: nobody takes part in a round, so states are served at once.
    let timing = Timing {
        genesis_ms: unix_ms() + 3_600_000,
        period_ms: 10_000,
        commit_window_ms: 1000,
        reveal_window_ms: 1000,
        exchange_timeout_ms: 5000,
        topology: Topology::OnePeer,
    };
    let start = |bootstrap: Vec<libp2p::Multiaddr>| async move {
        let config = local_config(loopback(Transport::Quic), bootstrap);
        SwarmNode::start(libp2p::identity::Keypair::generate_ed25519(), config, None)
            .await
            .unwrap()
    };
    let first = start(vec![]).await;
    let hub: libp2p::Multiaddr = format!("{}/p2p/{}", first.listen_addrs()[0], first.peer_id())
        .parse()
        .unwrap();
    let poisoned: JoinedNode = first.join_run(run_id, timing.clone()).await.unwrap();
    let honest = start(vec![hub.clone()]).await;
    let honest = honest.join_run(run_id, timing.clone()).await.unwrap();
    let joiner = start(vec![hub]).await;
    let joiner = joiner.join_run(run_id, timing).await.unwrap();
    joiner
        .wait_for_topic_peers(2, Duration::from_secs(20))
        .await
        .unwrap();

    // Finite values (random bytes would hold NaN patterns).
    let floats = |n: usize| {
        (0..n)
            .flat_map(|i| (i as f32 * 0.25).to_le_bytes())
            .collect()
    };
    let good = TensorSet::new(vec![
        gasloc_p2p::tensors::Tensor::new("anchor.a", DType::F32, vec![512], floats(512)).unwrap(),
        gasloc_p2p::tensors::Tensor::new("anchor.b", DType::F32, vec![256], floats(256)).unwrap(),
    ]);
    let mut bad = good.clone();
    bad.tensors[1].data[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
    let serve = |set: &TensorSet| {
        Arc::new(OutgoingPayload::new(
            PayloadKind::State,
            Arc::new(set.clone()),
            SendOptions::default(),
        ))
    };
    poisoned.exchange_service().set_state(4, serve(&bad));
    let table = Arc::new(good.specs());
    let fetched = joiner.fetch_state(&[], table.clone()).await;
    assert!(fetched.is_none(), "the poisoned state was taken");

    honest.exchange_service().set_state(4, serve(&good));
    let fetched = joiner
        .fetch_state(&[], table)
        .await
        .expect("the good state");
    assert_eq!(fetched.peer, honest.peer_id());
    assert!(fetched.state == good);
}
