//! `/gasloc/state/1`: a joining node streams a live peer's state, verified like an exchange.

mod common;

use common::*;
use gasloc_p2p::exchange::{ExchangeError, OutgoingPayload, SendOptions};
use gasloc_p2p::swarm_node::STATE_ANCHOR_PREFIX;
use gasloc_p2p::tensors::TensorSet;
use gasloc_proto::manifest::GateConfig;
use gasloc_proto::wire::{DType, PayloadKind, RefusalReason};
use gasloc_proto::RefusalKind;
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

/// Source nodes and a joiner wired as `join` wires them, in a run at round 10 (no driver runs:
/// nobody takes part in a round, so states are served at once).
async fn sources_and_joiner(
    sources: usize,
) -> (
    Vec<gasloc_p2p::swarm_node::JoinedNode>,
    gasloc_p2p::swarm_node::JoinedNode,
) {
    use gasloc_p2p::local_swarm::local_config;
    use gasloc_p2p::network::unix_ms;
    use gasloc_p2p::schedule::Timing;
    use gasloc_p2p::swarm_node::SwarmNode;
    use gasloc_proto::topology::Topology;
    init_tracing();
    let run_id = gasloc_proto::RunId::from_bytes([3; 32]);
    let timing = Timing {
        // Round 10 is in progress (the sources serve states up to round 12).
        genesis_ms: unix_ms() - 100_000,
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
    let mut nodes = vec![first.join_run(run_id, timing.clone()).await.unwrap()];
    for _ in 1..sources {
        let node = start(vec![hub.clone()]).await;
        nodes.push(node.join_run(run_id, timing.clone()).await.unwrap());
    }
    let joiner = start(vec![hub]).await;
    let joiner = joiner.join_run(run_id, timing).await.unwrap();
    joiner
        .wait_for_topic_peers(sources, Duration::from_secs(20))
        .await
        .unwrap();
    (nodes, joiner)
}

/// A state of two f32 tensors, `value(i)` at element i.
fn state_of(value: impl Fn(usize) -> f32) -> TensorSet {
    use gasloc_p2p::tensors::Tensor;
    let floats = |n: usize, offset: usize| {
        (0..n)
            .flat_map(|i| value(offset + i).to_le_bytes())
            .collect()
    };
    TensorSet::new(vec![
        Tensor::new("anchor.a", DType::F32, vec![512], floats(512, 0)).unwrap(),
        Tensor::new("anchor.b", DType::F32, vec![256], floats(256, 512)).unwrap(),
    ])
}

/// What `joiner` syncs under the default gate, for states of `like`'s table; the test
/// fails when nobody served one.
async fn sync_default(
    joiner: &gasloc_p2p::swarm_node::JoinedNode,
    like: &TensorSet,
) -> gasloc_p2p::swarm_node::SyncedState {
    let gate = GateConfig::default();
    joiner
        .sync_state(&[], Arc::new(like.specs()), &gate)
        .await
        .unwrap()
        .expect("a state")
}

fn serve(node: &gasloc_p2p::swarm_node::JoinedNode, round: u64, set: &TensorSet) {
    node.exchange_service().set_state(
        round,
        Arc::new(OutgoingPayload::new(
            PayloadKind::State,
            Arc::new(set.clone()),
            SendOptions::default(),
        )),
    );
}

/// Three sources: two honest ones a little apart (as GASLoC anchors are) and one serving a
/// finite state with a tensor scaled × 1000, the attack that destroyed a demo run. The
/// joiner outvotes the poisoned state, says why, and starts from the honest sources' mean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_outvotes_a_poisoned_state_and_starts_from_the_mean_of_the_honest_ones() {
    let (sources, joiner) = sources_and_joiner(3).await;
    let honest_a = state_of(|i| 1.0 + i as f32 * 0.001);
    let honest_b = state_of(|i| 1.02 + i as f32 * 0.001);
    let mut poisoned = honest_a.clone();
    poisoned.tensors[1].data = honest_a.tensors[1]
        .floats()
        .unwrap()
        .iter()
        .flat_map(|v| (v * 1000.0).to_le_bytes())
        .collect();
    serve(&sources[0], 5, &honest_a);
    serve(&sources[1], 5, &poisoned);
    serve(&sources[2], 6, &honest_b);
    let synced = sync_default(&joiner, &honest_a).await;
    let mut kept = synced.sources.clone();
    kept.sort();
    let mut honest = vec![sources[0].peer_id(), sources[2].peer_id()];
    honest.sort();
    assert_eq!(kept, honest);
    assert_eq!(synced.refused.len(), 1, "{:?}", synced.refused);
    assert_eq!(synced.refused[0].peer, sources[1].peer_id().to_string());
    assert_eq!(synced.refused[0].kind, RefusalKind::StateDisagrees);
    assert_eq!(synced.round, 6, "the latest round of the kept sources");
    assert!(synced.state == TensorSet::mean(&[&honest_a, &honest_b]).unwrap());
    assert_eq!(synced.report().sources.len(), 2);
}

/// Three honest sources as they stand early in a run: two that have mixed only with each
/// other hold the same anchor, the third, which has mixed with neither, lies about 1.3 of the
/// norm away (the e2e swarm test's round 3 measured up to about one). None is refused, and
/// the joiner starts from their coordinate-wise median: the pair's state, every coordinate
/// within the sources' range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_honest_sources_a_norm_apart_are_all_kept_and_give_their_median() {
    let (sources, joiner) = sources_and_joiner(3).await;
    let pair = state_of(|i| 1.0 + i as f32 * 0.001);
    let unmixed = state_of(|i| {
        let step = if i % 2 == 0 { 1.8 } else { -1.8 };
        1.0 + i as f32 * 0.001 + step
    });
    serve(&sources[0], 5, &pair);
    serve(&sources[1], 5, &pair);
    serve(&sources[2], 5, &unmixed);
    let synced = sync_default(&joiner, &pair).await;
    assert!(synced.refused.is_empty(), "{:?}", synced.refused);
    assert_eq!(synced.sources.len(), 3);
    assert!(
        synced.state == pair,
        "the median of (pair, pair, unmixed) is the pair's"
    );
    // Against the old rule (ρ = 1, the smaller of the two norms) the third was refused.
    let norm = pair.norm_where(|_| true);
    let distance = pair.distance_where(&unmixed, |_| true).unwrap();
    assert!(
        distance > 1.0 * norm && distance <= GateConfig::default().max_state_disagreement * norm,
        "{distance} against the norm {norm}"
    );
    // The spread the joiner's payload gate starts from: each source's anchor distance from
    // the median (the pair's 0, the unmixed node's all of it).
    let anchor = |t: &gasloc_p2p::tensors::Tensor| t.name.starts_with(STATE_ANCHOR_PREFIX);
    let unmixed_distance = pair.distance_where(&unmixed, anchor).unwrap();
    let tensors = synced.spread.by_source.first().map_or(0, Vec::len);
    let all: Vec<usize> = (0..tensors).collect();
    let mut spread = synced.spread.over(&all);
    spread.sort_by(f64::total_cmp);
    assert_eq!(spread, [0.0, 0.0, unmixed_distance], "{:?}", synced.spread);
    // Tensor by tensor.
    let by_tensor = |set: &TensorSet| pair.distances_by_tensor_where(set, anchor).unwrap();
    let mut each = synced.spread.by_source.clone();
    each.sort_by(|a, b| a.iter().sum::<f64>().total_cmp(&b.iter().sum::<f64>()));
    assert_eq!(each[2], by_tensor(&unmixed));
}

/// The round a source claims becomes the joiner's: one after the swarm's next is refused
/// like a bad value (a round of `u64::MAX` would overflow the next round's number).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_refuses_a_state_claiming_a_round_the_swarm_has_not_reached() {
    let (sources, joiner) = sources_and_joiner(2).await;
    let good = state_of(|i| i as f32 * 0.25);
    serve(&sources[0], u64::MAX, &good);
    serve(&sources[1], 11, &good);
    let synced = sync_default(&joiner, &good).await;
    assert_eq!(synced.sources, vec![sources[1].peer_id()]);
    assert_eq!(synced.round, 11);
    assert_eq!(synced.refused.len(), 1, "{:?}", synced.refused);
    assert_eq!(synced.refused[0].kind, RefusalKind::FutureRound);
}

/// A well-formed state holding a NaN is refused by name; the one finite source left is
/// taken, and the joiner says it could not cross-check it. Two sources that disagree with
/// nobody else to ask are an error, not a guess.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_refuses_a_nan_state_and_never_guesses_between_two_that_disagree() {
    let (sources, joiner) = sources_and_joiner(2).await;
    let good = state_of(|i| i as f32 * 0.25);
    let mut bad = good.clone();
    bad.tensors[1].data[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
    serve(&sources[0], 4, &bad);
    serve(&sources[1], 4, &good);
    let table = Arc::new(good.specs());
    let gate = GateConfig::default();
    let synced = joiner
        .sync_state(&[], table.clone(), &gate)
        .await
        .unwrap()
        .expect("the good state");
    assert_eq!(synced.sources, vec![sources[1].peer_id()]);
    assert!(synced.state == good);
    assert_eq!(synced.refused.len(), 1);
    assert_eq!(synced.refused[0].kind, RefusalKind::NonFinite);
    assert!(
        synced.refused[0].reason.contains("anchor.b"),
        "{:?}",
        synced.refused
    );

    // A finite state in another direction, of the same norm: one of the two lies.
    serve(&sources[0], 4, &state_of(|i| -(i as f32) * 0.25));
    let err = joiner
        .sync_state(&[], table, &gate)
        .await
        .err()
        .expect("no guess");
    assert!(err.to_string().contains("max_state_disagreement"), "{err}");
}
