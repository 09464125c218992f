//! Benchmark: the round machine at internet scale, simulated ([`gasloc_p2p::swarm_sim`]):
//! N machines in one process over a simulated network with per-hop latency and loss.
//! Driven by `bench/round_scale`.
//!
//! Prints one line per round (whether every live node decided the same members and
//! permutation, the views if not, failed exchanges, the longest exchange and round) and a
//! summary: rounds agreed, disagreements, failed exchanges, the worst exchange time against
//! the exchange timeout, skipped rounds and the simulation's run time.
//!
//! ```text
//! round_scale [--nodes 1000] [--rounds 100] [--mode mesh|direct] [--degree 8]
//!             [--loss 0.01] [--latency-ms 20..300] [--topology one-peer|two-peer]
//!             [--period-ms 20000] [--commit-window-ms 3000] [--reveal-window-ms 3000]
//!             [--exchange-timeout-ms 10000] [--payload-bytes 33554432]
//!             [--link-bytes-per-s 10000000] [--isolate-reveals-of I] [--seed 1]
//! ```

mod common;

use anyhow::{anyhow, bail, Result};
use common::arg;
use gasloc_p2p::swarm_sim::{run, Dissemination, SimConfig};
use gasloc_proto::topology::Topology;

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().collect();
    let nodes = arg(&args, "--nodes", 1000usize)?;
    let rounds = arg(&args, "--rounds", 100u64)?;
    let seed = arg(&args, "--seed", 1u64)?;
    let mut config = SimConfig::new(nodes, rounds, seed);
    config.dissemination = match arg(&args, "--mode", "mesh".to_string())?.as_str() {
        "mesh" => Dissemination::Mesh {
            degree: arg(&args, "--degree", 8usize)?,
        },
        "direct" => Dissemination::Direct,
        other => bail!("--mode: mesh or direct, not {other}"),
    };
    config.loss = arg(&args, "--loss", config.loss)?;
    let latency = arg(&args, "--latency-ms", "20..300".to_string())?;
    let (lo, hi) = latency
        .split_once("..")
        .ok_or_else(|| anyhow!("--latency-ms: LOW..HIGH (inclusive), not {latency}"))?;
    config.latency_ms = lo.parse()?..=hi.parse()?;
    if config.latency_ms.is_empty() {
        bail!("--latency-ms: empty range {latency}");
    }
    let t = &mut config.timing;
    t.topology = arg(&args, "--topology", t.topology)?;
    if !matches!(t.topology, Topology::OnePeer | Topology::TwoPeer) {
        bail!("--topology: one-peer or two-peer");
    }
    t.period_ms = arg(&args, "--period-ms", t.period_ms)?;
    t.commit_window_ms = arg(&args, "--commit-window-ms", t.commit_window_ms)?;
    t.reveal_window_ms = arg(&args, "--reveal-window-ms", t.reveal_window_ms)?;
    t.exchange_timeout_ms = arg(&args, "--exchange-timeout-ms", t.exchange_timeout_ms)?;
    t.validate().map_err(|e| anyhow!(e))?;
    config.payload_bytes = arg(&args, "--payload-bytes", config.payload_bytes)?;
    config.link_bytes_per_s = arg(&args, "--link-bytes-per-s", config.link_bytes_per_s)?;
    if args.iter().any(|a| a == "--isolate-reveals-of") {
        config.isolate_reveals_of = vec![arg(&args, "--isolate-reveals-of", 0usize)?];
    }

    let t = &config.timing;
    println!(
        "nodes={nodes} rounds={rounds} mode={:?} loss={} latency_ms={}..={} topology={} period_ms={} commit_window_ms={} reveal_window_ms={} exchange_timeout_ms={} payload_bytes={} link_bytes_per_s={} isolate_reveals_of={:?} seed={seed}",
        config.dissemination,
        config.loss,
        config.latency_ms.start(),
        config.latency_ms.end(),
        t.topology.name(),
        t.period_ms,
        t.commit_window_ms,
        t.reveal_window_ms,
        t.exchange_timeout_ms,
        config.payload_bytes,
        config.link_bytes_per_s,
        config.isolate_reveals_of,
    );
    let result = run(&config);
    for r in &result.rounds {
        // Views: (nodes, members) per distinct decision, the largest first; at most 4.
        let views: Vec<String> = r
            .views
            .iter()
            .take(4)
            .map(|(count, members)| format!("{count}x{members}"))
            .collect();
        println!(
            "round={} agreed={} records={} views={}{} failed={} nodes_failing={} max_exchange_s={:.3} max_failed_exchange_s={:.3} max_round_s={:.3} decided_after_ms={} last_reveal_after_ms={}",
            r.round,
            r.agreed,
            r.records,
            views.join(","),
            if r.views.len() > 4 { ",…" } else { "" },
            r.failed,
            r.nodes_with_failures,
            r.max_exchange_s,
            r.max_failed_exchange_s,
            r.max_round_s,
            r.max_decided_after_ms,
            r.max_last_reveal_after_ms,
        );
    }
    let s = &result.summary;
    println!(
        "summary rounds={} agreed_rounds={} ({:.1} %) disagreeing_rounds={} failed_exchanges={} live_failed_exchanges={} max_exchange_s={:.3} max_exchange_s_disagreeing={:.3} max_failed_exchange_s={:.3} exchange_timeout_s={:.3} skipped_rounds={} missing_records={} max_round_s={:.3} messages_published={} deliveries={} undelivered={} past_wakeups={} mesh_degree_min={} mesh_degree_max={} mesh_connected={} wall_s={:.1}",
        s.rounds,
        s.agreed_rounds,
        100.0 * s.agreed_rounds as f64 / s.rounds.max(1) as f64,
        s.disagreeing_rounds,
        s.failed_exchanges,
        s.live_failed_exchanges,
        s.max_exchange_s,
        s.max_exchange_s_disagreeing,
        s.max_failed_exchange_s,
        s.exchange_timeout_s,
        s.skipped_rounds,
        s.missing_records,
        s.max_round_s,
        s.messages_published,
        s.deliveries,
        s.undelivered,
        s.past_wakeups,
        s.mesh_min_degree,
        s.mesh_max_degree,
        s.mesh_connected,
        result.wall_s,
    );
    Ok(())
}
