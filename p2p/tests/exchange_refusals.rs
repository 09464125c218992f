//! Every bad input on `/gasloc/exchange/2` is refused with a logged reason and leaves the
//! receiver without a result; a partner killed mid-transfer costs at most the deadline.

mod common;

use common::*;
use futures::{AsyncReadExt, AsyncWriteExt};
use gasloc_p2p::exchange::{
    read_first_frame, send_payload, ExchangeError, ExchangeLimits, FirstFrame, OutgoingPayload,
    SendOptions,
};
use gasloc_p2p::exchange_service::{
    ExchangeResults, ExchangeService, InboundReport, EXCHANGE_PROTOCOL,
};
use gasloc_p2p::frames::{write_frame, FRAME_CHUNK, FRAME_HEADER};
use gasloc_p2p::network::Network;
use gasloc_p2p::tensors::TensorSet;
use gasloc_proto::wire::{ExchangeHeader, PayloadKind, RefusalReason};
use libp2p::PeerId;
use prost::Message;
use std::sync::Arc;
use std::time::Duration;

const ROUND: u64 = 5;

struct Setup {
    attacker: Network,
    victim: Network,
    service: ExchangeService,
    payload: Arc<OutgoingPayload>,
}

fn payload(seed: u64) -> Arc<OutgoingPayload> {
    Arc::new(OutgoingPayload::new(
        PayloadKind::Model,
        Arc::new(TensorSet::synthetic(2, 256 << 10, seed)),
        SendOptions::default(),
    ))
}

async fn setup() -> Setup {
    init_tracing();
    // The attacker has the smaller peer id, so the victim waits for it to open the stream.
    let keys = sorted_keypairs(2);
    let attacker = start(keys[0].clone(), Transport::Quic, vec![]).await;
    let victim = start(keys[1].clone(), Transport::Quic, vec![full_addr(&attacker)]).await;
    wait_connected(&attacker, victim.client.peer_id()).await;
    let service = service(&victim);
    Setup {
        attacker,
        victim,
        service,
        payload: payload(9),
    }
}

/// Starts the victim's round `round` with `neighbours`; returns its result task.
async fn victim_round(
    s: &Setup,
    round: u64,
    neighbours: Vec<PeerId>,
) -> tokio::task::JoinHandle<ExchangeResults> {
    let service = s.service.clone();
    let payload = s.payload.clone();
    let table = Arc::new(payload.set.specs());
    let task = tokio::spawn(async move {
        service
            .exchange_round(
                round,
                &neighbours,
                payload,
                Some(table),
                Duration::from_secs(3),
            )
            .await
    });
    for _ in 0..200 {
        if s.service.is_registered(round) {
            return task;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("round {round} never registered");
}

fn valid_header(s: &Setup, round: u64) -> ExchangeHeader {
    s.payload
        .header(&RUN_ID, round, &s.attacker.client.peer_id())
}

/// Opens a stream as the attacker, writes `bytes`, closes its side and returns the
/// victim's first frame (None if the victim just closed the stream).
async fn attack(s: &Setup, bytes: Vec<u8>) -> Option<FirstFrame> {
    let mut control = s.attacker.client.stream_control();
    let mut stream = control
        .open_stream(s.victim.client.peer_id(), EXCHANGE_PROTOCOL)
        .await
        .expect("victim accepts the protocol");
    let _ = stream.write_all(&bytes).await;
    let _ = stream.close().await;
    tokio::time::timeout(
        Duration::from_secs(10),
        read_first_frame(&mut stream, &ExchangeLimits::default()),
    )
    .await
    .expect("victim answers or closes in time")
    .ok()
}

async fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    write_frame(&mut out, kind, &[body]).await.unwrap();
    out
}

async fn next_report(
    reports: &mut tokio::sync::broadcast::Receiver<InboundReport>,
) -> InboundReport {
    tokio::time::timeout(Duration::from_secs(10), reports.recv())
        .await
        .expect("a report in time")
        .expect("report channel open")
}

fn assert_refused(reply: Option<FirstFrame>, reason: RefusalReason) {
    match reply {
        Some(FirstFrame::Refusal(r)) => assert_eq!(r.reason, reason as i32, "{}", r.message),
        other => panic!("expected a {reason:?} refusal, got {other:?}"),
    }
}

/// The victim's round produced no tensors for anyone.
async fn assert_untouched(task: tokio::task::JoinHandle<ExchangeResults>) {
    for (peer, result) in task.await.unwrap() {
        assert!(result.is_err(), "victim accepted tensors from {peer}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_chunk_is_refused() {
    let s = setup().await;
    let mut reports = s.service.reports();
    let task = victim_round(&s, ROUND, vec![s.attacker.client.peer_id()]).await;
    let header = valid_header(&s, ROUND);
    let mut bytes = frame(FRAME_HEADER, &header.encode_to_vec()).await;
    // A chunk of the right length whose checksum matches nothing.
    let mut chunk = vec![0u8; 32];
    chunk.extend(std::iter::repeat_n(
        7u8,
        header.tensors[0].byte_length as usize,
    ));
    bytes.extend(frame(FRAME_CHUNK, &chunk).await);
    attack(&s, bytes).await;
    let report = next_report(&mut reports).await;
    assert!(report.outcome.unwrap_err().contains("checksum mismatch"));
    let results = task.await.unwrap();
    assert!(
        matches!(results[0].1, Err(ExchangeError::ChunkChecksum { .. })),
        "{:?}",
        results[0].1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partner_that_never_confirms_our_payload_leaves_no_result() {
    // A valid header and payload, but the stream ends without the done frame that says the
    // partner received and verified ours: it may not have it, so neither side mixes.
    let s = setup().await;
    let mut reports = s.service.reports();
    let task = victim_round(&s, ROUND, vec![s.attacker.client.peer_id()]).await;
    let mut bytes = Vec::new();
    send_payload(&mut bytes, &valid_header(&s, ROUND), &s.payload)
        .await
        .unwrap();
    let mut control = s.attacker.client.stream_control();
    let mut stream = control
        .open_stream(s.victim.client.peer_id(), EXCHANGE_PROTOCOL)
        .await
        .expect("victim accepts the protocol");
    stream.write_all(&bytes).await.unwrap();
    stream.close().await.unwrap();
    // Everything the victim sends is read (its payload and its done frame), so the only
    // thing missing on its side is ours.
    let mut theirs = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut theirs))
        .await
        .expect("the victim ends its side in time")
        .unwrap();
    let report = next_report(&mut reports).await;
    let outcome = report.outcome.unwrap_err();
    assert!(outcome.contains("done frame"), "{outcome}");
    assert_untouched(task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_run_id_is_refused() {
    let s = setup().await;
    let mut reports = s.service.reports();
    let task = victim_round(&s, ROUND, vec![s.attacker.client.peer_id()]).await;
    let mut header = valid_header(&s, ROUND);
    header.run_id = vec![0x43; 32];
    let reply = attack(&s, frame(FRAME_HEADER, &header.encode_to_vec()).await).await;
    assert_refused(reply, RefusalReason::WrongRun);
    assert!(next_report(&mut reports)
        .await
        .outcome
        .unwrap_err()
        .contains("not this run"));
    assert_untouched(task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_old_round_is_refused() {
    let s = setup().await;
    let mut reports = s.service.reports();
    s.service.advance_floor(ROUND + 1);
    let task = victim_round(&s, ROUND + 1, vec![s.attacker.client.peer_id()]).await;
    let reply = attack(
        &s,
        frame(FRAME_HEADER, &valid_header(&s, ROUND).encode_to_vec()).await,
    )
    .await;
    assert_refused(reply, RefusalReason::OldRound);
    assert!(next_report(&mut reports)
        .await
        .outcome
        .unwrap_err()
        .contains("older than"));
    assert_untouched(task).await;
}

/// A stream for a round whose exchange the receiver ended at its deadline is late, not a
/// replay: it is refused as `ROUND_CLOSED`, so the sender (and its round record) can tell
/// the two apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_after_the_round_closed_at_its_deadline_is_refused_as_late() {
    let s = setup().await;
    let mut reports = s.service.reports();
    let task = victim_round(&s, ROUND, vec![s.attacker.client.peer_id()]).await;
    let results = task.await.unwrap();
    assert!(
        matches!(results[0].1, Err(ExchangeError::Deadline(_))),
        "{:?}",
        results[0].1
    );
    let reply = attack(
        &s,
        frame(FRAME_HEADER, &valid_header(&s, ROUND).encode_to_vec()).await,
    )
    .await;
    assert_refused(reply, RefusalReason::RoundClosed);
    assert!(next_report(&mut reports)
        .await
        .outcome
        .unwrap_err()
        .contains("has ended on this node"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_header_is_refused_before_it_is_read() {
    let s = setup().await;
    let mut reports = s.service.reports();
    let task = victim_round(&s, ROUND, vec![s.attacker.client.peer_id()]).await;
    let too_long = ExchangeLimits::default().max_header_bytes + 1;
    let mut prefix = vec![FRAME_HEADER];
    prefix.extend_from_slice(&too_long.to_le_bytes());
    let reply = attack(&s, prefix).await;
    assert_refused(reply, RefusalReason::TooLarge);
    assert!(next_report(&mut reports)
        .await
        .outcome
        .unwrap_err()
        .contains("exceeds the limit"));
    assert_untouched(task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_header_is_refused() {
    let s = setup().await;
    let mut reports = s.service.reports();
    let task = victim_round(&s, ROUND, vec![s.attacker.client.peer_id()]).await;
    let full = frame(FRAME_HEADER, &valid_header(&s, ROUND).encode_to_vec()).await;
    let reply = attack(&s, full[..full.len() / 2].to_vec()).await;
    assert!(
        reply.is_none(),
        "no payload is sent back on a truncated header: {reply:?}"
    );
    assert!(next_report(&mut reports)
        .await
        .outcome
        .unwrap_err()
        .contains("ended early"));
    assert_untouched(task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_table_that_does_not_match_the_model_is_refused() {
    let s = setup().await;
    let mut reports = s.service.reports();
    let task = victim_round(&s, ROUND, vec![s.attacker.client.peer_id()]).await;
    let mut header = valid_header(&s, ROUND);
    header.tensors[1].shape = vec![2, header.tensors[1].shape[0] / 2];
    let reply = attack(&s, frame(FRAME_HEADER, &header.encode_to_vec()).await).await;
    assert_refused(reply, RefusalReason::TableMismatch);
    assert!(next_report(&mut reports)
        .await
        .outcome
        .unwrap_err()
        .contains("does not match the model"));
    let results = task.await.unwrap();
    assert!(
        matches!(results[0].1, Err(ExchangeError::TableMismatch(_))),
        "{:?}",
        results[0].1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_not_in_this_round_is_refused() {
    let s = setup().await;
    let mut reports = s.service.reports();
    let stranger = PeerId::random();
    let task = victim_round(&s, ROUND, vec![stranger]).await;
    let reply = attack(
        &s,
        frame(FRAME_HEADER, &valid_header(&s, ROUND).encode_to_vec()).await,
    )
    .await;
    assert_refused(reply, RefusalReason::NotANeighbour);
    assert!(next_report(&mut reports)
        .await
        .outcome
        .unwrap_err()
        .contains("not a neighbour"));
    assert_untouched(task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partner_killed_mid_transfer_costs_at_most_the_deadline() {
    init_tracing();
    let keys = sorted_keypairs(3);
    // keys[0] will die mid-transfer; keys[2] is the survivor; keys[1] a healthy partner.
    let dying = start(keys[0].clone(), Transport::Quic, vec![]).await;
    let survivor = start(keys[2].clone(), Transport::Quic, vec![full_addr(&dying)]).await;
    let healthy = start(keys[1].clone(), Transport::Quic, vec![full_addr(&survivor)]).await;
    wait_connected(&survivor, dying.client.peer_id()).await;
    wait_connected(&survivor, healthy.client.peer_id()).await;
    let survivor_service = service(&survivor);
    let healthy_service = service(&healthy);
    let big = Arc::new(OutgoingPayload::new(
        PayloadKind::Model,
        Arc::new(TensorSet::synthetic(1, 32 << 20, 3)),
        SendOptions::default(),
    ));
    let table = Arc::new(big.set.specs());
    let deadline = Duration::from_secs(5);
    let round = {
        let service = survivor_service.clone();
        let (big, table, peer) = (big.clone(), table.clone(), dying.client.peer_id());
        tokio::spawn(async move {
            service
                .exchange_round(1, &[peer], big, Some(table), deadline)
                .await
        })
    };
    // The dying node sends a valid header and 1 MiB of its 32 MiB, then its process's swarm dies.
    let mut control = dying.client.stream_control();
    let mut stream = control
        .open_stream(survivor.client.peer_id(), EXCHANGE_PROTOCOL)
        .await
        .unwrap();
    let header = big.header(&RUN_ID, 1, &dying.client.peer_id());
    stream
        .write_all(&frame(FRAME_HEADER, &header.encode_to_vec()).await)
        .await
        .unwrap();
    let first = &big.set.tensors[0].data[..1 << 20];
    let mut chunk = blake3::hash(first).as_bytes().to_vec();
    chunk.extend_from_slice(first);
    stream
        .write_all(&frame(FRAME_CHUNK, &chunk).await)
        .await
        .unwrap();
    stream.flush().await.unwrap();
    dying.task.abort();
    drop(stream);
    drop(control);
    drop(dying);

    let results = tokio::time::timeout(deadline * 2, round)
        .await
        .expect("the survivor's round ends by its deadline")
        .unwrap();
    assert!(results[0].1.is_err(), "no tensors from a dead partner");

    // And it goes on: the next round with a healthy partner succeeds.
    let small = payload(4);
    let small_table = Arc::new(small.set.specs());
    let (peer_s, peer_h) = ([survivor.client.peer_id()], [healthy.client.peer_id()]);
    let (rs, rh) = tokio::join!(
        survivor_service.exchange_round(
            2,
            &peer_h,
            small.clone(),
            Some(small_table.clone()),
            deadline
        ),
        healthy_service.exchange_round(2, &peer_s, small.clone(), Some(small_table), deadline),
    );
    assert!(rs[0].1.is_ok(), "{:?}", rs[0].1);
    assert!(rh[0].1.is_ok(), "{:?}", rh[0].1);
}

#[tokio::test]
async fn a_peers_huge_refusal_message_is_cut_before_it_reaches_logs_and_status() {
    use gasloc_p2p::exchange::{read_checked_header, refuse, Expectation, MAX_PEER_MESSAGE_CHARS};
    use gasloc_proto::wire::Refusal;
    let mut bytes = Vec::new();
    let refusal = Refusal {
        reason: RefusalReason::TableMismatch as i32,
        message: "é".repeat(1 << 20),
    };
    refuse(&mut futures::io::Cursor::new(&mut bytes), &refusal)
        .await
        .unwrap();
    let expect = Expectation {
        run_id: gasloc_proto::RunId::from_bytes([7; 32]),
        round: Some(ROUND),
        sender: PeerId::random(),
        kind: PayloadKind::Model,
        table: None,
    };
    let err = read_checked_header(
        &mut futures::io::Cursor::new(bytes),
        &expect,
        &ExchangeLimits::default(),
    )
    .await
    .unwrap_err();
    let ExchangeError::Refused { message, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!(
        message.chars().count(),
        MAX_PEER_MESSAGE_CHARS + 1,
        "256 and the ellipsis"
    );
    assert!(err.to_string().len() < 1024, "{}", err.to_string().len());
}
