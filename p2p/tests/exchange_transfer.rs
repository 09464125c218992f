//! Two real swarms on loopback exchange tensor sets over QUIC and over TCP.

mod common;

use common::*;
use gasloc_p2p::exchange::{OutgoingPayload, SendOptions};
use gasloc_p2p::tensors::TensorSet;
use gasloc_proto::wire::PayloadKind;
use std::sync::Arc;
use std::time::Duration;

async fn exchange_pair(
    transport: Transport,
    bytes_each: usize,
    tensors: usize,
    zstd_level: Option<i32>,
) {
    let ((a, sa), (b, sb)) = connected_pair(transport).await;
    let (pa, pb) = (a.client.peer_id(), b.client.peer_id());
    let set_a = Arc::new(TensorSet::synthetic(tensors, bytes_each, 1));
    let set_b = Arc::new(TensorSet::synthetic(tensors, bytes_each, 2));
    let table = Arc::new(set_a.specs());
    let send = SendOptions {
        zstd_level,
        ..SendOptions::default()
    };
    let pay_a = Arc::new(OutgoingPayload::new(
        PayloadKind::Model,
        set_a.clone(),
        send.clone(),
    ));
    let pay_b = Arc::new(OutgoingPayload::new(
        PayloadKind::Model,
        set_b.clone(),
        send,
    ));
    let timeout = Duration::from_secs(240);
    let (to_b, to_a) = ([pb], [pa]);
    let (ra, rb) = tokio::join!(
        sa.exchange_round(7, &to_b, pay_a, Some(table.clone()), timeout),
        sb.exchange_round(7, &to_a, pay_b, Some(table), timeout),
    );
    let (peer, got_b) = ra.into_iter().next().unwrap();
    assert_eq!(peer, pb);
    let got_b = got_b.expect("a receives b's payload");
    let (peer, got_a) = rb.into_iter().next().unwrap();
    assert_eq!(peer, pa);
    let got_a = got_a.expect("b receives a's payload");
    assert!(got_a.tensors == *set_a, "a's tensors arrive byte for byte");
    assert!(got_b.tensors == *set_b, "b's tensors arrive byte for byte");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_exchanges_256_mib_byte_for_byte() {
    exchange_pair(Transport::Quic, 64 << 20, 4, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_exchanges_256_mib_byte_for_byte() {
    exchange_pair(Transport::Tcp, 64 << 20, 4, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zstd_encoded_exchange_round_trips() {
    // Odd sizes: chunks that do not divide the tensors, a tensor smaller than a chunk.
    exchange_pair(Transport::Quic, 3 * (1 << 20) + 12, 3, Some(3)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_leaves_as_soon_as_its_exchange_returns_cuts_nothing() {
    // An exchange returns only once the partner confirmed that our payload arrived whole, so
    // a node may shut its swarm down right away (as `join` does after its last round). Over
    // QUIC a finished stream may still hold megabytes in the send buffer; without the
    // confirmation the partner would lose them.
    let ((a, sa), (b, sb)) = connected_pair(Transport::Quic).await;
    let (pa, pb) = (a.client.peer_id(), b.client.peer_id());
    let timeout = Duration::from_secs(120);
    let (to_b, to_a) = ([pb], [pa]);
    for round in 0..3u64 {
        let set_a = Arc::new(TensorSet::synthetic(2, 8 << 20, 10 + round));
        let set_b = Arc::new(TensorSet::synthetic(2, 8 << 20, 20 + round));
        let table = Arc::new(set_a.specs());
        let pay = |set: &Arc<TensorSet>| {
            Arc::new(OutgoingPayload::new(
                PayloadKind::Model,
                set.clone(),
                SendOptions::default(),
            ))
        };
        let (pay_a, pay_b) = (pay(&set_a), pay(&set_b));
        let leaving = round == 2;
        let a_side = async {
            let result = sa
                .exchange_round(round, &to_b, pay_a, Some(table.clone()), timeout)
                .await;
            if leaving {
                a.client.shutdown().await;
            }
            result
        };
        let (ra, rb) = tokio::join!(
            a_side,
            sb.exchange_round(round, &to_a, pay_b, Some(table.clone()), timeout)
        );
        let got_b = ra
            .into_iter()
            .next()
            .unwrap()
            .1
            .expect("a receives b's payload");
        let got_a = rb
            .into_iter()
            .next()
            .unwrap()
            .1
            .expect("b receives a's payload");
        assert!(got_a.tensors == *set_a && got_b.tensors == *set_b);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_arrives_before_the_responder_reaches_the_round_waits_for_it() {
    let ((a, sa), (b, sb)) = connected_pair(Transport::Tcp).await;
    let (pa, pb) = (a.client.peer_id(), b.client.peer_id());
    let pay = Arc::new(OutgoingPayload::new(
        PayloadKind::Model,
        Arc::new(TensorSet::synthetic(1, 1 << 20, 5)),
        SendOptions::default(),
    ));
    // a opens the stream (smaller peer id) for round 1000 while b has not started any round.
    let early = {
        let (sa, pay) = (sa.clone(), pay.clone());
        tokio::spawn(async move {
            let started = tokio::time::Instant::now();
            let results = sa
                .exchange_round(1000, &[pb], pay, None, Duration::from_secs(20))
                .await;
            (results, started.elapsed())
        })
    };
    let mut reports = sb.reports();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        reports.try_recv().is_err(),
        "b has not refused the early stream"
    );
    let late = sb
        .exchange_round(1000, &[pa], pay.clone(), None, Duration::from_secs(20))
        .await;
    assert!(late[0].1.is_ok(), "{:?}", late[0].1);
    let (early, whole) = early.await.unwrap();
    let swapped = early[0].1.as_ref().expect("a's early exchange completes");
    // The swap's transfer time starts once both sides were ready: b registered the round
    // 300 ms or more after a did, so a's wait for it is not counted as link time.
    assert!(
        swapped.transfer + Duration::from_millis(300) <= whole,
        "transfer {:?} of an exchange that took {whole:?} includes the wait for b",
        swapped.transfer
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_still_exchanging_is_served_after_the_next_round_started() {
    // Overlapped rounds: b hands round 4 to the exchange and starts round 5 (the driver
    // raises the floor to 5) before a's stream for round 4 arrives. The stream is round 4's,
    // still registered: served, not refused as old.
    let ((a, sa), (b, sb)) = connected_pair(Transport::Tcp).await;
    let (pa, pb) = (a.client.peer_id(), b.client.peer_id());
    let pay = |seed| {
        Arc::new(OutgoingPayload::new(
            PayloadKind::Model,
            Arc::new(TensorSet::synthetic(1, 1 << 20, seed)),
            SendOptions::default(),
        ))
    };
    let responder = {
        let (sb, pay) = (sb.clone(), pay(2));
        tokio::spawn(async move {
            sb.exchange_round(4, &[pa], pay, None, Duration::from_secs(20))
                .await
        })
    };
    for _ in 0..200 {
        if sb.is_registered(4) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(sb.is_registered(4), "b registered round 4");
    sb.advance_floor(5);
    let early = sa
        .exchange_round(4, &[pb], pay(1), None, Duration::from_secs(20))
        .await;
    assert!(early[0].1.is_ok(), "a's round 4: {:?}", early[0].1);
    let late = responder.await.unwrap();
    assert!(late[0].1.is_ok(), "b's round 4: {:?}", late[0].1);
    // Once round 4's exchange is over, a stream for it is old.
    let replay = sa
        .exchange_round(4, &[pb], pay(1), None, Duration::from_secs(5))
        .await;
    assert!(replay[0].1.is_err(), "a replay of round 4 after it ended");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_registered_as_its_node_starts_the_next_serves_the_stream_waiting_for_it() {
    // Overlapped rounds, the partner first: its stream for round 4 waits at the node, which
    // then hands round 4 off and at once starts round 5 (the driver registers the round, then
    // raises the floor to 5, before the exchange's task runs). The waiting stream is served.
    let ((a, sa), (b, sb)) = connected_pair(Transport::Tcp).await;
    let (pa, pb) = (a.client.peer_id(), b.client.peer_id());
    // The node with the smaller id opens the stream: it is the partner here.
    let ((partner, partner_id), (node, node_id)) = if pa.to_bytes() < pb.to_bytes() {
        ((sa, pa), (sb, pb))
    } else {
        ((sb, pb), (sa, pa))
    };
    let pay = |seed| {
        Arc::new(OutgoingPayload::new(
            PayloadKind::Model,
            Arc::new(TensorSet::synthetic(1, 1 << 16, seed)),
            SendOptions::default(),
        ))
    };
    node.advance_floor(4);
    let first = {
        let (partner, pay) = (partner.clone(), pay(1));
        tokio::spawn(async move {
            partner
                .exchange_round(4, &[node_id], pay, None, Duration::from_secs(20))
                .await
        })
    };
    // The partner's stream reaches the node and waits for round 4 to be registered.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let registered = node.register_round(4, &[partner_id], pay(2), None, Duration::from_secs(20));
    node.advance_floor(5);
    // The exchange's task runs a little later.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let late = node.exchange_registered(registered).await;
    assert!(late[0].1.is_ok(), "the node's round 4: {:?}", late[0].1);
    let early = first.await.unwrap();
    assert!(
        early[0].1.is_ok(),
        "the partner's round 4: {:?}",
        early[0].1
    );
}
