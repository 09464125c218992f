//! bench/sim_overhead: the simulator's wall time per round against N × H × one plain
//! training step of the same model, measured in the same process, interleaved so a noisy
//! neighbour slows both alike. Prints both figures and their ratio (goal ≤ 1.1).
//!
//! usage: cargo bench -p gasloc-node --bench sim_overhead -- RUN.toml DATA_DIR [WORKERS] [ROUNDS]
//! (cargo runs it from `node/`: give absolute paths, e.g. `$PWD/examples/runs/sim-tiny.toml`;
//! `cargo test --bench sim_overhead -- …` runs it in the dev profile.)
//! (H comes from the manifest's [outer] inner_steps.)

use anyhow::{bail, Context, Result};
use gasloc_data::shards::TokenDataset;
use gasloc_data::stream::WorkerSlot;
use gasloc_node::sim::{SimOptions, Simulation};
use gasloc_node::trainer::Trainer;
use gasloc_proto::RunManifest;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if args.len() < 2 {
        bail!("usage: sim_overhead RUN.toml DATA_DIR [WORKERS=8] [ROUNDS=4]");
    }
    let manifest = RunManifest::load(&PathBuf::from(&args[0]))?;
    let data = Arc::new(TokenDataset::open(
        &PathBuf::from(&args[1]),
        manifest.data.tokenizer.vocab_size(),
    )?);
    let parse = |i: usize, default: u64| -> Result<u64> {
        args.get(i).map_or(Ok(default), |s| {
            s.parse().with_context(|| format!("argument {s:?}"))
        })
    };
    let workers = parse(2, 8)? as usize;
    let rounds = parse(3, 4)?;
    tch::set_num_threads(1);
    let h = manifest.outer.inner_steps;
    let options = SimOptions {
        workers,
        rounds: u64::MAX,
        stragglers: Vec::new(),
        bandwidth_mbps: 100.0,
        latency_ms: 10.0,
        step_time_ms: None,
        eval_every: u64::MAX,
    };
    let mut sim = Simulation::new(&manifest, data.clone(), options)?;
    let mut plain = Trainer::new(&manifest, tch::Device::Cpu, data, WorkerSlot::SOLE)?;
    // Warm-up of both.
    sim.run_round()?;
    plain.step()?;
    let (mut round_s, mut step_s) = (0.0, 0.0);
    for _ in 0..rounds {
        let t = Instant::now();
        for _ in 0..h {
            plain.step()?;
        }
        step_s += t.elapsed().as_secs_f64() / h as f64;
        let t = Instant::now();
        sim.run_round()?;
        round_s += t.elapsed().as_secs_f64();
    }
    let (round_s, step_s) = (round_s / rounds as f64, step_s / rounds as f64);
    let budget = workers as f64 * h as f64 * step_s;
    println!(
        "algorithm={} topology={} workers={workers} H={h} params={} round_s={round_s:.4} \
         plain_step_s={step_s:.5} n_h_steps_s={budget:.4} ratio={:.3}",
        manifest.outer.algorithm.name(),
        manifest.outer.topology.name(),
        sim.parameter_count(),
        round_s / budget
    );
    Ok(())
}
