//! Real swarms in one process run the round driver: every node derives the same
//! permutation each round, and a node whose reveals never arrive is excluded by the rest.

mod common;

use common::*;
use gasloc_p2p::driver::RoundRecord;
use gasloc_p2p::local_swarm::LocalSwarm;
use gasloc_p2p::schedule::Timing;
use gasloc_p2p::synthetic::SyntheticTrainer;
use gasloc_proto::topology::Topology;
use std::collections::BTreeMap;
use std::time::Duration;

async fn run_swarm(
    nodes: usize,
    rounds: u64,
    withholder: Option<usize>,
    topology: Topology,
) -> Vec<Vec<RoundRecord>> {
    run_swarm_with(nodes, rounds, withholder, topology, false).await
}

async fn run_swarm_with(
    nodes: usize,
    rounds: u64,
    withholder: Option<usize>,
    topology: Topology,
    overlap: bool,
) -> Vec<Vec<RoundRecord>> {
    init_tracing();
    LocalSwarm {
        nodes,
        rounds,
        withholder,
        overlap,
        timing: Timing {
            genesis_ms: 0,
            // Generous windows: 16 nodes share 2 cores with the rest of the test suite, and
            // this test is about agreement, not about how short a round can be.
            period_ms: 2600,
            commit_window_ms: 500,
            reveal_window_ms: 500,
            exchange_timeout_ms: 1400,
            topology,
        },
        trainer: SyntheticTrainer::new(
            libp2p::PeerId::random(),
            64 << 10,
            2,
            2,
            Duration::from_millis(5),
        ),
        listen: loopback(Transport::Tcp),
        run_id: RUN_ID,
    }
    .run()
    .await
    .expect("the local swarm runs")
}

/// Records of each round, keyed by round, from every node that reported it.
fn by_round(all: &[Vec<RoundRecord>]) -> BTreeMap<u64, Vec<&RoundRecord>> {
    let mut rounds: BTreeMap<u64, Vec<&RoundRecord>> = BTreeMap::new();
    for record in all.iter().flatten() {
        rounds.entry(record.round).or_default().push(record);
    }
    rounds
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_nodes_agree_on_the_permutation_for_twenty_rounds() {
    let all = run_swarm(8, 20, None, Topology::OnePeer).await;
    let rounds = by_round(&all);
    assert_eq!(rounds.len(), 20, "all nodes ran the same 20 rounds");
    for (round, records) in &rounds {
        assert_eq!(records.len(), 8, "round {round}");
        for r in records {
            assert_eq!(
                r.members.len(),
                8,
                "round {round}: {} saw {:?}",
                r.peer,
                r.members
            );
            assert_eq!(r.permutation, records[0].permutation, "round {round}");
            assert_eq!(r.neighbours.len(), 1);
            // Mutual pairing, and the exchange succeeded on both sides.
            let partner = records.iter().find(|p| p.peer == r.neighbours[0]).unwrap();
            assert_eq!(partner.neighbours, vec![r.peer.clone()], "round {round}");
            assert_eq!(r.exchanged, r.neighbours, "round {round}: {:?}", r.failed);
        }
    }
    let first = &rounds.values().next().unwrap()[0].permutation;
    assert!(
        rounds.values().any(|r| &r[0].permutation != first),
        "permutations change between rounds"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_reveals_are_dropped_is_excluded_and_the_rest_agree() {
    let all = run_swarm(8, 4, Some(3), Topology::TwoPeer).await;
    let withholder = all[3][0].peer.clone();
    let rounds = by_round(&all);
    assert!(rounds.len() >= 4);
    for (round, records) in &rounds {
        let honest: Vec<_> = records.iter().filter(|r| r.peer != withholder).collect();
        assert_eq!(honest.len(), 7, "round {round}");
        for r in &honest {
            assert_eq!(r.members.len(), 7, "round {round}");
            assert!(!r.members.contains(&withholder));
            assert!(!r.neighbours.contains(&withholder));
            // Its commits arrived and its reveals did not: an offence each (bans are on;
            // the third bans it, and then its commits reach nobody).
            if (1..=2).contains(round) {
                assert_eq!(
                    r.withheld,
                    std::slice::from_ref(&withholder),
                    "round {round}"
                );
            }
            assert_eq!(r.permutation, honest[0].permutation, "round {round}");
            assert_eq!(r.neighbours.len(), 2);
            assert_eq!(r.exchanged.len(), 2, "round {round}: {:?}", r.failed);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapped_rounds_agree_and_exchange_on_a_real_swarm() {
    // The round driver with two rounds in flight (one training, one handed off): the same
    // plans everywhere, every exchange done, every round recorded once, in order.
    let all = run_swarm_with(4, 5, None, Topology::OnePeer, true).await;
    let rounds = by_round(&all);
    assert_eq!(rounds.len(), 5);
    for (round, records) in &rounds {
        assert_eq!(records.len(), 4, "round {round}");
        for r in records {
            assert_eq!(r.permutation, records[0].permutation, "round {round}");
            assert_eq!(r.exchanged, r.neighbours, "round {round}: {:?}", r.failed);
            assert!((0.0..=1.0).contains(&r.compute_utilization));
        }
    }
    for records in &all {
        let order: Vec<u64> = records.iter().map(|r| r.round).collect();
        assert_eq!(order, (0..5).collect::<Vec<_>>());
    }
}
