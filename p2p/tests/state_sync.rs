//! `/gasloc/state/1`: a joining node streams a live peer's state, verified like an exchange.

mod common;

use common::*;
use gasloc_p2p::exchange::{ExchangeError, OutgoingPayload, SendOptions};
use gasloc_p2p::tensors::TensorSet;
use gasloc_proto::wire::{PayloadKind, RefusalReason};
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
