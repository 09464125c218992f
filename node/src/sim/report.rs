//! The simulator's outputs in `--out`: `rounds.csv` (one row per round), `workers.csv` (one
//! row per worker and round), `rounds.json` (everything), `summary.md` (one table) and
//! `loss.svg` (validation and mean train loss per round).

use super::{SimOptions, SwarmRound};
use anyhow::{Context, Result};
use gasloc_proto::RunManifest;
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::Path;

/// The headline numbers of a finished simulation.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    pub algorithm: String,
    pub topology: String,
    /// `[outer] overlap`: none, delayed or eager.
    pub overlap: String,
    /// `[outer] fragments`: the model in this many fragments, one exchanged per round.
    pub fragments: usize,
    pub workers: usize,
    pub rounds: u64,
    pub inner_steps_mean: f64,
    pub final_val_loss: f64,
    pub best_val_loss: f64,
    pub final_consensus: f64,
    pub sim_time_s: f64,
    /// Mean bytes one worker sends per round.
    pub bytes_per_worker_round: f64,
    /// The full fp32 model, for comparison.
    pub model_bytes_fp32: u64,
    /// Simulated time of the first evaluation at or below `target_loss`.
    pub target_loss: Option<f64>,
    pub time_to_target_s: Option<f64>,
    /// Inner-step time over simulated wall time, all workers and rounds together.
    pub compute_utilization: f64,
}

impl Summary {
    pub fn new(
        manifest: &RunManifest,
        options: &SimOptions,
        records: &[SwarmRound],
        parameters: u64,
        target_loss: Option<f64>,
    ) -> Summary {
        let vals: Vec<(f64, f64)> = records
            .iter()
            .filter_map(|r| r.val_loss.map(|v| (r.sim_time_s, v)))
            .collect();
        let rounds = records.len().max(1) as f64;
        let last = records.last();
        Summary {
            algorithm: manifest.outer.algorithm.name().into(),
            topology: manifest.outer.topology.name().into(),
            overlap: manifest.outer.overlap.name().into(),
            fragments: manifest.outer.fragments,
            workers: options.workers,
            rounds: records.len() as u64,
            inner_steps_mean: records.iter().map(|r| r.mean_inner_steps()).sum::<f64>() / rounds,
            final_val_loss: vals.last().map_or(f64::NAN, |v| v.1),
            best_val_loss: vals.iter().map(|v| v.1).fold(f64::NAN, f64::min),
            final_consensus: last.map_or(f64::NAN, |r| r.consensus),
            sim_time_s: last.map_or(0.0, |r| r.sim_time_s),
            bytes_per_worker_round: records.iter().map(|r| r.bytes_sent() as f64).sum::<f64>()
                / rounds
                / options.workers as f64,
            model_bytes_fp32: parameters * 4,
            target_loss,
            time_to_target_s: target_loss.and_then(|t| vals.iter().find(|v| v.1 <= t).map(|v| v.0)),
            compute_utilization: {
                let compute: f64 = records
                    .iter()
                    .flat_map(|r| r.workers.iter().map(|w| w.compute_s))
                    .sum();
                let wall: f64 = last.map_or(0.0, |r| r.workers.iter().map(|w| w.finish_s).sum());
                if wall > 0.0 {
                    compute / wall
                } else {
                    1.0
                }
            },
        }
    }
}

/// Writes every output file into `out` (created if needed).
pub fn write_all(
    out: &Path,
    manifest: &RunManifest,
    options: &SimOptions,
    records: &[SwarmRound],
    summary: &Summary,
) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let write = |name: &str, text: String| {
        let path = out.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    write("rounds.csv", rounds_csv(records))?;
    write("workers.csv", workers_csv(records))?;
    let json = serde_json::json!({
        "run_id": manifest.run_id(),
        "manifest": manifest,
        "options": options,
        "stragglers": options.stragglers.iter().map(|s| format!("{}:{}", s.worker, s.fraction)).collect::<Vec<_>>(),
        "summary": summary,
        "rounds": records,
    });
    write("rounds.json", serde_json::to_string_pretty(&json)?)?;
    write("summary.md", summary_markdown(manifest, options, summary))?;
    plot_losses(&out.join("loss.svg"), &manifest.name, records)
}

fn rounds_csv(records: &[SwarmRound]) -> String {
    let mut s = String::from(
        "round,sim_time_s,val_loss,consensus,train_loss_mean,bytes_sent_total,inner_steps_mean,wait_s_max,full_sync,compute_utilization_mean,local_val_loss\n",
    );
    for r in records {
        let _ = writeln!(
            s,
            "{},{:.6},{},{:.6e},{:.6},{},{:.3},{:.6},{},{:.4},{}",
            r.round,
            r.sim_time_s,
            optional_loss(r.val_loss),
            r.consensus,
            r.mean_train_loss(),
            r.bytes_sent(),
            r.mean_inner_steps(),
            r.max_wait_s(),
            r.full_sync,
            r.mean_compute_utilization(),
            optional_loss(r.local_val_loss)
        );
    }
    s
}

/// A loss of an evaluation round, an empty cell on the others.
fn optional_loss(loss: Option<f64>) -> String {
    loss.map_or(String::new(), |v| format!("{v:.6}"))
}

fn workers_csv(records: &[SwarmRound]) -> String {
    let mut s = String::from(
        "round,worker,inner_steps,train_loss,bytes_sent,compute_s,comm_s,wait_s,finish_s,compute_utilization\n",
    );
    for r in records {
        for w in &r.workers {
            let _ = writeln!(
                s,
                "{},{},{},{:.6},{},{:.6},{:.6},{:.6},{:.6},{:.4}",
                r.round,
                w.worker,
                w.inner_steps,
                w.train_loss,
                w.bytes_sent,
                w.compute_s,
                w.comm_s,
                w.wait_s,
                w.finish_s,
                w.compute_utilization
            );
        }
    }
    s
}

fn summary_markdown(manifest: &RunManifest, options: &SimOptions, s: &Summary) -> String {
    let o = &manifest.outer;
    let mut md = format!(
        "# Simulation: {}\n\nrun id `{}`; {} workers × {} rounds; algorithm `{}`, topology `{}`, \
         overlap `{}`, fragments {}, H = {} (adaptive: {}), η = {}, μ = {}, Nesterov: {}, payload `{:?}`, inner optimizer `{:?}`; \
         links {} Mbit/s, latency {} ms{}.\n\n",
        manifest.name,
        manifest.run_id(),
        options.workers,
        options.rounds,
        s.algorithm,
        s.topology,
        s.overlap,
        s.fragments,
        o.inner_steps,
        o.adaptive_inner_steps,
        o.lr,
        o.momentum,
        o.nesterov,
        o.payload,
        o.inner_optimizer,
        options.bandwidth_mbps,
        options.latency_ms,
        options
            .stragglers
            .iter()
            .map(|st| format!(", worker {} at {}×", st.worker, st.fraction))
            .collect::<String>()
    );
    md.push_str("| metric | value |\n|---|---|\n");
    let rows = [
        ("final validation loss", format!("{:.4}", s.final_val_loss)),
        ("best validation loss", format!("{:.4}", s.best_val_loss)),
        (
            "final consensus distance",
            format!("{:.3e}", s.final_consensus),
        ),
        (
            "mean inner steps per round",
            format!("{:.2}", s.inner_steps_mean),
        ),
        ("simulated wall-clock (s)", format!("{:.2}", s.sim_time_s)),
        (
            "compute utilisation",
            format!("{:.3}", s.compute_utilization),
        ),
        (
            "bytes sent per worker per round",
            format!("{:.0}", s.bytes_per_worker_round),
        ),
        ("fp32 model bytes", s.model_bytes_fp32.to_string()),
    ];
    for (k, v) in rows {
        let _ = writeln!(md, "| {k} | {v} |");
    }
    if let Some(t) = s.target_loss {
        let reached = s
            .time_to_target_s
            .map_or("not reached".to_string(), |v| format!("{v:.2}"));
        let _ = writeln!(md, "| simulated time to val loss ≤ {t} (s) | {reached} |");
    }
    md
}

/// Validation loss (points) and mean train loss (line) against the round.
fn plot_losses(path: &Path, title: &str, records: &[SwarmRound]) -> Result<()> {
    let train: Vec<(f64, f64)> = records
        .iter()
        .map(|r| (r.round as f64, r.mean_train_loss()))
        .collect();
    let val: Vec<(f64, f64)> = records
        .iter()
        .filter_map(|r| r.val_loss.map(|v| (r.round as f64, v)))
        .collect();
    let finite = |v: &f64| v.is_finite();
    let all = train.iter().chain(&val).map(|p| p.1).filter(finite);
    let (lo, hi) = all.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
        (a.min(v), b.max(v))
    });
    let (lo, hi) = if lo.is_finite() {
        (lo, hi.max(lo + 1e-3))
    } else {
        (0.0, 1.0)
    };
    let last = records.len().max(2) as f64;
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(format!("{title}: loss per round"), ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(1.0..last, lo..hi)?;
        chart
            .configure_mesh()
            .x_desc("round")
            .y_desc("loss")
            .draw()?;
        chart
            .draw_series(LineSeries::new(train.clone(), &BLUE))?
            .label("train (mean of workers)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
        chart
            .draw_series(LineSeries::new(val.clone(), RED.stroke_width(2)))?
            .label("validation (mean of anchors)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))
}
