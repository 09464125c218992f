//! The round machine at scale, simulated (`swarm_sim`): 50 nodes through a lossy,
//! high-latency gossip mesh agree on every round, a node whose reveals are lost costs only
//! its own exchange (at most one timeout), and a seed gives one run. The 1,000-node
//! measurement is `bench/round_scale` (`docs/performance.md`).

use gasloc_p2p::swarm_sim::{run, Dissemination, SimConfig, SimResult};
use gasloc_proto::topology::Topology;

/// 50 nodes, 1 % loss per hop, 20–300 ms per hop, the scale run's timing.
fn config(rounds: u64, seed: u64) -> SimConfig {
    let mut config = SimConfig::new(50, rounds, seed);
    config.loss = 0.01;
    config.latency_ms = 20..=300;
    config
}

/// No node skips or misses a round and no exchange outlasts the timeout (+ 1 s).
fn assert_no_round_lost_and_exchanges_bounded(result: &SimResult, config: &SimConfig) {
    let s = &result.summary;
    assert_eq!(s.rounds as u64, config.rounds, "{:?}", result.rounds);
    assert_eq!(s.skipped_rounds, 0, "{s:?}");
    assert_eq!(s.missing_records, 0, "{s:?}");
    assert_eq!(s.past_wakeups, 0, "{s:?}");
    let limit = config.timing.exchange_timeout_ms as f64 / 1000.0 + 1.0;
    for r in &result.rounds {
        assert!(r.max_exchange_s <= limit, "round {}: {r:?}", r.round);
    }
}

#[test]
fn fifty_nodes_agree_through_a_lossy_mesh_every_round() {
    for topology in [Topology::OnePeer, Topology::TwoPeer] {
        let mut config = config(20, 1);
        config.timing.topology = topology;
        let result = run(&config);
        let s = &result.summary;
        assert!(s.mesh_connected, "{s:?}");
        assert_no_round_lost_and_exchanges_bounded(&result, &config);
        // A node misses a message only if every path to it lost it: with mesh degree 8 and
        // 1 % loss per hop, every round is expected to agree (≥ 95 % asserted).
        assert!(
            s.agreed_rounds * 100 >= s.rounds * 95,
            "{topology:?}: {s:?}\n{:?}",
            result.rounds
        );
        for r in result.rounds.iter().filter(|r| r.agreed) {
            assert_eq!(r.views, vec![(50, 50)], "{topology:?} round {}", r.round);
            assert_eq!(
                r.failed, 0,
                "{topology:?}: an agreed round's swaps all complete"
            );
        }
    }
}

#[test]
fn a_node_whose_reveals_are_lost_costs_only_its_own_exchange() {
    for topology in [Topology::OnePeer, Topology::TwoPeer] {
        let mut config = config(10, 2);
        config.timing.topology = topology;
        config.isolate_reveals_of = vec![7];
        let result = run(&config);
        let s = &result.summary;
        assert_eq!(s.live_nodes, 49);
        assert_no_round_lost_and_exchanges_bounded(&result, &config);
        assert_eq!(
            s.agreed_rounds, s.rounds,
            "{topology:?}: {:?}",
            result.rounds
        );
        let neighbours = match topology {
            Topology::OnePeer => 1,
            _ => 2,
        };
        let timeout_s = config.timing.exchange_timeout_ms as f64 / 1000.0;
        for r in &result.rounds {
            // The 49 others leave it out alike and swap among themselves.
            assert_eq!(r.views, vec![(49, 49)], "{topology:?} round {}", r.round);
            assert_eq!(r.live_failed, 0, "{topology:?} round {}: {r:?}", r.round);
            // It waits in vain for the partners of its own view, one timeout.
            assert_eq!(
                r.failed, neighbours,
                "{topology:?} round {}: {r:?}",
                r.round
            );
            assert_eq!(r.nodes_with_failures, 1);
            assert!(r.max_failed_exchange_s <= timeout_s + 1.0, "{r:?}");
        }
    }
}

#[test]
fn without_a_mesh_one_percent_loss_breaks_agreement_at_a_bounded_cost() {
    // Each of 50 nodes misses ~1 % of 98 commits and reveals per round: the views differ
    // every round. What a disagreement costs is still bounded: failed swaps end at the
    // exchange timeout, and no round is skipped.
    let mut config = config(5, 3);
    config.dissemination = Dissemination::Direct;
    let result = run(&config);
    let s = &result.summary;
    assert_no_round_lost_and_exchanges_bounded(&result, &config);
    assert_eq!(s.agreed_rounds, 0, "{:?}", result.rounds);
    assert!(s.failed_exchanges > 0);
    assert!(
        s.max_failed_exchange_s <= s.exchange_timeout_s + 1.0,
        "{s:?}"
    );
}

#[test]
fn a_seed_gives_one_run() {
    let config = config(6, 9);
    let (a, b) = (run(&config), run(&config));
    assert_eq!(a.summary, b.summary);
    assert_eq!(a.rounds, b.rounds);
    let other = run(&SimConfig {
        seed: 10,
        ..config.clone()
    });
    let reveals = |r: &SimResult| {
        r.rounds
            .iter()
            .map(|r| r.max_last_reveal_after_ms)
            .collect::<Vec<_>>()
    };
    assert_ne!(
        reveals(&a),
        reveals(&other),
        "another seed, other latencies"
    );
}
