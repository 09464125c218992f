//! `--schedule-file`: the round schedule a bootstrap node serves, kept across its restarts.
//!
//! A bootstrap without it picks a new genesis (now + `--genesis-delay-ms`) each time it
//! starts, so one restarted under a running swarm (`docker-compose restart bootstrap`) would
//! serve newcomers rounds that are not the swarm's. With it, the first start writes the run
//! id and the timing it chose; every later start serves that same timing, and refuses, naming
//! the value, flags that would change it under the swarm.
//!
//! The file is plain `key=value` lines, written to a temporary file and renamed into place.

use anyhow::{bail, Context, Result};
use gasloc_p2p::schedule::Timing;
use gasloc_proto::topology::Topology;
use gasloc_proto::RunId;
use std::io::Write;
use std::path::Path;

/// The timing to serve: the one `path` holds for `run_id`, after checking that `wanted` (what
/// the flags ask for) agrees with it but for the genesis; or `wanted`, written to `path`
/// when there is no file yet. `genesis_pinned`: the flags named a genesis themselves
/// (`--genesis-unix-ms`), so it must agree too.
pub fn keep(path: &Path, run_id: RunId, wanted: Timing, genesis_pinned: bool) -> Result<Timing> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            write(path, run_id, &wanted)?;
            return Ok(wanted);
        }
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let (kept_run, kept) =
        parse(&text).with_context(|| format!("schedule file {}", path.display()))?;
    if kept_run != run_id {
        bail!(
            "schedule file {} holds run {kept_run}, but this bootstrap serves run {run_id}: \
             remove the file to start a new schedule",
            path.display()
        );
    }
    let differs = [
        ("--round-period-ms", kept.period_ms, wanted.period_ms),
        (
            "--commit-window-ms",
            kept.commit_window_ms,
            wanted.commit_window_ms,
        ),
        (
            "--reveal-window-ms",
            kept.reveal_window_ms,
            wanted.reveal_window_ms,
        ),
        (
            "--exchange-timeout-ms",
            kept.exchange_timeout_ms,
            wanted.exchange_timeout_ms,
        ),
    ]
    .into_iter()
    .chain(genesis_pinned.then_some(("--genesis-unix-ms", kept.genesis_ms, wanted.genesis_ms)))
    .find(|(_, kept, wanted)| kept != wanted);
    if let Some((flag, kept_value, wanted_value)) = differs {
        bail!(
            "{flag} {wanted_value} differs from the running schedule's {kept_value} in {}: a \
             swarm cannot change its rounds under way (remove the file to start a new schedule)",
            path.display()
        );
    }
    if kept.topology != wanted.topology {
        bail!(
            "--topology {} differs from the running schedule's {} in {}",
            wanted.topology.name(),
            kept.topology.name(),
            path.display()
        );
    }
    Ok(kept)
}

fn write(path: &Path, run_id: RunId, timing: &Timing) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut file =
        std::fs::File::create(&tmp).with_context(|| format!("cannot write {}", tmp.display()))?;
    writeln!(file, "run_id={run_id}")?;
    writeln!(file, "genesis_unix_ms={}", timing.genesis_ms)?;
    writeln!(file, "round_period_ms={}", timing.period_ms)?;
    writeln!(file, "commit_window_ms={}", timing.commit_window_ms)?;
    writeln!(file, "reveal_window_ms={}", timing.reveal_window_ms)?;
    writeln!(file, "exchange_timeout_ms={}", timing.exchange_timeout_ms)?;
    writeln!(file, "topology={}", timing.topology.name())?;
    file.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}

fn parse(text: &str) -> Result<(RunId, Timing)> {
    let value = |key: &str| -> Result<&str> {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .map(str::trim)
            .with_context(|| format!("no {key}= line"))
    };
    let number = |key: &str| -> Result<u64> {
        let v = value(key)?;
        v.parse()
            .with_context(|| format!("{key}={v} is not a number of milliseconds"))
    };
    let run_id: RunId = value("run_id")?
        .parse()
        .map_err(|e| anyhow::anyhow!("run_id: {e}"))?;
    let topology_name = value("topology")?;
    let topology = Topology::from_name(topology_name)
        .with_context(|| format!("topology={topology_name} is no topology"))?;
    let timing = Timing {
        genesis_ms: number("genesis_unix_ms")?,
        period_ms: number("round_period_ms")?,
        commit_window_ms: number("commit_window_ms")?,
        reveal_window_ms: number("reveal_window_ms")?,
        exchange_timeout_ms: number("exchange_timeout_ms")?,
        topology,
    };
    timing.validate().map_err(|e| anyhow::anyhow!(e))?;
    Ok((run_id, timing))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(genesis_ms: u64, period_ms: u64) -> Timing {
        Timing {
            genesis_ms,
            period_ms,
            commit_window_ms: 500,
            reveal_window_ms: 500,
            exchange_timeout_ms: 1000,
            topology: Topology::OnePeer,
        }
    }

    #[test]
    fn a_restart_serves_the_first_genesis_and_refuses_a_changed_period_or_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("schedule");
        let run = RunId::from([7u8; 32]);
        let first = keep(&path, run, timing(1_000, 4_000), false).unwrap();
        assert_eq!(first.genesis_ms, 1_000);
        // Restarted later: a new "now + delay" genesis is asked for, the kept one is served.
        let again = keep(&path, run, timing(9_000, 4_000), false).unwrap();
        assert_eq!(again, first);

        let err = keep(&path, run, timing(9_000, 5_000), false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--round-period-ms 5000 differs from the running schedule's 4000"),
            "{err}"
        );
        let err = keep(&path, run, timing(9_000, 4_000), true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--genesis-unix-ms 9000"), "{err}");
        let other = RunId::from([8u8; 32]);
        let err = keep(&path, other, timing(9_000, 4_000), false)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("holds run {run}")), "{err}");
    }

    #[test]
    fn a_damaged_schedule_file_is_an_error_naming_the_file_and_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("schedule");
        let run = RunId::from([7u8; 32]);
        keep(&path, run, timing(1_000, 4_000), false).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(
            &path,
            text.replace("round_period_ms=4000", "round_period_ms=soon"),
        )
        .unwrap();
        let err = format!(
            "{:#}",
            keep(&path, run, timing(1_000, 4_000), false).unwrap_err()
        );
        assert!(err.contains("schedule file"), "{err}");
        assert!(
            err.contains("round_period_ms=soon is not a number"),
            "{err}"
        );
    }
}
