//! bench/gossip_contraction: experiment 3 of `docs/results.md` — how fast a pure
//! disagreement contracts under repeated mixing, with and without outer momentum
//! (`gasloc_node::sim::disagreement`: no local steps, the node's own mixing rows and outer
//! optimizer, double precision). For each topology and worker count it runs plain averaging
//! (η 1, μ 0), Nesterov momentum μ ∈ {0.3, 0.5, 0.7, 0.9, 0.95} at η 1, and the run defaults
//! (η 0.7, μ 0.9), and prints one markdown table: the rounds until the consensus distance is
//! 10⁻⁶ of its start ("—" when not within the bound) and the mean contraction per round.
//!
//! usage: cargo bench -p gasloc-node --bench gossip_contraction -- [MAX_ROUNDS=3000] [SEEDS=1,2]
//! (`cargo test --release --bench gossip_contraction -- …` runs it too.)

use anyhow::{Context, Result};
use gasloc_node::sim::disagreement::{contract, outer_settings, Disagreement};
use gasloc_proto::topology::Topology;

/// (η, μ): plain averaging, momentum at η 1, and DiLoCo's defaults.
const OUTER: [(f64, f64); 7] = [
    (1.0, 0.0),
    (1.0, 0.3),
    (1.0, 0.5),
    (1.0, 0.7),
    (1.0, 0.9),
    (1.0, 0.95),
    (0.7, 0.9),
];
const WORKERS: [usize; 3] = [8, 32, 128];
const TOPOLOGIES: [Topology; 3] = [Topology::OnePeer, Topology::TwoPeer, Topology::Ring];

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let max_rounds: u64 = match args.first() {
        Some(a) => a.parse().context("MAX_ROUNDS must be a whole number")?,
        None => 3000,
    };
    let seeds: Vec<u64> = match args.get(1) {
        Some(a) => a
            .split(',')
            .map(|s| s.parse().context("SEEDS: whole numbers, comma-separated"))
            .collect::<Result<_>>()?,
        None => vec![1, 2],
    };
    println!("max rounds {max_rounds}, seeds {seeds:?}, anchors of 64 values, Nesterov");
    println!("| topology | n | η | μ | rounds to 1e-6 (per seed) | contraction per round (mean) |");
    println!("|---|---|---|---|---|---|");
    for topology in TOPOLOGIES {
        for workers in WORKERS {
            for (lr, momentum) in OUTER {
                let outer = outer_settings(lr, momentum);
                let (mut rounds, mut rates) = (Vec::new(), Vec::new());
                for &seed in &seeds {
                    let c = contract(&Disagreement {
                        workers,
                        topology,
                        outer: outer.clone(),
                        dimension: 64,
                        max_rounds,
                        seed,
                    });
                    rounds.push(c.rounds_to_target.map_or("—".into(), |r| r.to_string()));
                    rates.push(c.rate_per_round());
                }
                let rate = rates.iter().sum::<f64>() / rates.len() as f64;
                println!(
                    "| {} | {workers} | {lr} | {momentum} | {} | {rate:.4} |",
                    topology.name(),
                    rounds.join(", ")
                );
            }
        }
    }
    Ok(())
}
