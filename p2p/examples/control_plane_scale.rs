//! Benchmark: the control plane with many synthetic nodes in one process.
//! Driven by `bench/control_plane_scale`.
//!
//! Prints, per round, whether every node agreed on the permutation and membership, the
//! control-plane latency (last commit received after the round start, last reveal received
//! after the reveal time; worst node) and control messages per node; then a summary with
//! the agreement rate and messages per node against the ideal `3·(n−1)` (a commit, an
//! announce and a reveal from every other node), both measured in this run.

mod common;

use anyhow::Result;
use common::arg;
use gasloc_p2p::driver::RoundRecord;
use gasloc_p2p::local_swarm::LocalSwarm;
use gasloc_p2p::schedule::Timing;
use gasloc_p2p::synthetic::SyntheticTrainer;
use gasloc_proto::topology::Topology;
use std::collections::BTreeMap;
use std::time::Duration;

fn percentile(values: &mut [u64], p: f64) -> u64 {
    values.sort_unstable();
    values[((values.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().collect();
    let nodes = arg::<u64>(&args, "--nodes", 32)? as usize;
    let rounds = arg::<u64>(&args, "--rounds", 10)?;
    let period = arg::<u64>(&args, "--period-ms", 3000)?;
    let commit_window = arg::<u64>(&args, "--commit-window-ms", 2000)?;
    let reveal_window = arg::<u64>(&args, "--reveal-window-ms", 800)?;
    let swarm = LocalSwarm {
        nodes,
        rounds,
        withholder: None,
        overlap: false,
        timing: Timing {
            genesis_ms: 0,
            period_ms: period,
            commit_window_ms: commit_window,
            reveal_window_ms: reveal_window,
            exchange_timeout_ms: period - reveal_window - 200,
            topology: Topology::OnePeer,
        },
        trainer: SyntheticTrainer::new(
            libp2p::PeerId::random(),
            16 << 10,
            1,
            1,
            Duration::from_millis(1),
        ),
        listen: "/ip4/127.0.0.1/tcp/0".parse()?,
        run_id: gasloc_proto::RunId::from_bytes([0xC0; 32]),
    };
    let all = swarm.run().await?;
    let mut by_round: BTreeMap<u64, Vec<&RoundRecord>> = BTreeMap::new();
    for record in all.iter().flatten() {
        by_round.entry(record.round).or_default().push(record);
    }
    // Each other node publishes a commit, an announce and a reveal per round.
    let ideal = 3 * (nodes as u64 - 1);
    let (mut agreed, mut total_messages, mut total_reports) = (0, 0u64, 0u64);
    let (mut commit_lat, mut reveal_lat) = (Vec::new(), Vec::new());
    println!("nodes={nodes} rounds={rounds} period_ms={period} commit_window_ms={commit_window} reveal_window_ms={reveal_window}");
    for (round, records) in &by_round {
        let all_agree = records.len() == nodes
            && records
                .iter()
                .all(|r| r.permutation == records[0].permutation && r.members.len() == nodes);
        agreed += u64::from(all_agree);
        let worst_commit = records
            .iter()
            .map(|r| r.last_commit_after_ms)
            .max()
            .unwrap_or(0);
        let worst_reveal = records
            .iter()
            .map(|r| r.last_reveal_after_ms)
            .max()
            .unwrap_or(0);
        commit_lat.push(worst_commit);
        reveal_lat.push(worst_reveal);
        let messages: u64 = records.iter().map(|r| r.control_messages).sum();
        total_messages += messages;
        total_reports += records.len() as u64;
        println!(
            "round={round} reporting={} agreed={all_agree} connected_peers_min={} last_commit_after_ms={worst_commit} last_reveal_after_ms={worst_reveal} messages_per_node={:.1} exchanged_ok={}/{}",
            records.len(),
            records.iter().map(|r| r.connected_peers).min().unwrap_or(0),
            messages as f64 / records.len() as f64,
            records.iter().map(|r| r.exchanged.len()).sum::<usize>(),
            records.iter().map(|r| r.neighbours.len()).sum::<usize>(),
        );
        if !all_agree {
            describe_disagreement(records, nodes);
        }
    }
    let per_node = total_messages as f64 / total_reports.max(1) as f64;
    println!(
        "summary agreement_rate={:.3} commit_latency_ms_p50={} commit_latency_ms_max={} reveal_latency_ms_p50={} reveal_latency_ms_max={} messages_per_node_per_round={per_node:.1} ideal={ideal} ratio_vs_ideal={:.3}",
        agreed as f64 / by_round.len().max(1) as f64,
        percentile(&mut commit_lat.clone(), 0.5),
        percentile(&mut commit_lat, 1.0),
        percentile(&mut reveal_lat.clone(), 0.5),
        percentile(&mut reveal_lat, 1.0),
        per_node / ideal as f64,
    );
    Ok(())
}

/// For a round without agreement: the views the nodes decided on (how many nodes saw how
/// many members) and which members some nodes lacked.
fn describe_disagreement(records: &[&RoundRecord], nodes: usize) {
    let mut views: BTreeMap<usize, usize> = BTreeMap::new();
    let mut seen_by: BTreeMap<&str, usize> = BTreeMap::new();
    for r in records {
        *views.entry(r.members.len()).or_default() += 1;
        for m in &r.members {
            *seen_by.entry(m.as_str()).or_default() += 1;
        }
    }
    let fewest = records
        .iter()
        .min_by_key(|r| r.members.len())
        .expect("records");
    println!(
        "  the node with the fewest members ({}) is connected to {} peers",
        fewest.members.len(),
        fewest.connected_peers
    );
    let partial: Vec<String> = seen_by
        .iter()
        .filter(|(_, &n)| n < records.len())
        .map(|(m, n)| format!("{}…:{n}", &m[m.len() - 6..]))
        .collect();
    println!(
        "  views (members: nodes) {views:?} of {nodes} nodes; members not seen by all reporting nodes (seen by): {partial:?}"
    );
}
