//! `gasloc-node status --addr HOST:PORT`: fetches `/status` and prints it for a terminal.

use crate::snapshot::NodeStatus;
use anyhow::{Context, Result};
use std::fmt::Write;
use std::time::Duration;

/// Fetches and parses `http://{addr}/status`.
pub fn fetch_status(addr: &str) -> Result<NodeStatus> {
    let url = format!("http://{addr}/status");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .into();
    let mut response = agent
        .get(&url)
        .call()
        .with_context(|| format!("no gasloc status at {url}"))?;
    let body = response
        .body_mut()
        .read_to_string()
        .with_context(|| format!("reading {url}"))?;
    serde_json::from_str(&body).with_context(|| format!("{url} did not answer a gasloc status"))
}

fn loss(x: Option<f64>) -> String {
    x.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into())
}

fn short(peer: &str) -> &str {
    let n = peer.len();
    &peer[n.saturating_sub(8)..]
}

/// The status as a terminal page: summary, links, recent rounds.
pub fn format_status(s: &NodeStatus) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "peer      {}", s.peer_id);
    let _ = writeln!(out, "run       {} ({})", s.run_name, s.run_id);
    let _ = writeln!(
        out,
        "state     {}   round {}   H_i {}   step {:.3}s   peers {}",
        s.state.as_str(),
        s.round,
        s.inner_steps,
        s.step_time_s,
        s.connected_peers
    );
    let _ = writeln!(
        out,
        "network   reachability {}   hole punches {}",
        s.reachability, s.hole_punches
    );
    let _ = writeln!(
        out,
        "loss      train {}   val {}",
        loss(s.train_loss),
        loss(s.val_loss)
    );
    let _ = writeln!(
        out,
        "compute   utilisation {} of recent rounds",
        s.compute_utilization
            .map_or("—".to_string(), |u| format!("{:.0}%", 100.0 * u))
    );
    let _ = writeln!(
        out,
        "traffic   sent {:.1} MiB   received {:.1} MiB   waiting {:.1}s ({:.0}% of recent rounds)",
        s.bytes_sent as f64 / 1048576.0,
        s.bytes_received as f64 / 1048576.0,
        s.wait_s,
        100.0 * s.idle_share()
    );
    if s.data.shards_total > 0 {
        let _ = writeln!(
            out,
            "data      {}/{} shards held   fetched {:.1} of {:.1} MiB   served {:.1} MiB{}",
            s.data.shards_held,
            s.data.shards_total,
            s.data.bytes_fetched as f64 / 1048576.0,
            s.data.bytes_total as f64 / 1048576.0,
            s.data.bytes_served as f64 / 1048576.0,
            if s.data.serving {
                ""
            } else {
                "   (not serving)"
            }
        );
        for bad in &s.data.bad_sources {
            let _ = writeln!(out, "  bad source {bad}");
        }
    }
    let neighbours: Vec<&str> = s.neighbours.iter().map(|p| short(p)).collect();
    let _ = writeln!(out, "neighbours {}", neighbours.join(", "));
    for (peer, rate) in &s.goodput {
        let _ = writeln!(
            out,
            "  link …{}  {:.1} MiB/s",
            short(peer),
            rate / 1048576.0
        );
    }
    let _ = writeln!(
        out,
        "\nround  H_i  train    val      sent MiB  wait s  neighbours"
    );
    for r in s.history.iter().rev().take(10) {
        let n: Vec<&str> = r.neighbours.iter().map(|p| short(p)).collect();
        let _ = writeln!(
            out,
            "{:>5} {:>4}  {:<8} {:<8} {:>8.2} {:>7.2}  {}",
            r.round,
            r.inner_steps,
            loss(r.train_loss),
            loss(r.val_loss),
            r.bytes_sent as f64 / 1048576.0,
            r.wait_s,
            n.join(",")
        );
    }
    out
}
