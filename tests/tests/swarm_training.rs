//! A real swarm that learns, with faults: a bootstrap and four `gasloc-node join`
//! processes train the tiny model on loopback with the one-peer topology and adaptive H_i.
//! During the run
//! - node 4 is killed with SIGKILL; the others keep completing rounds, and restarted it
//!   resumes from its own checkpoint and rejoins;
//! - a fifth node joins mid-run, syncs the anchor from the live peers (their states agree,
//!   none is refused) and trains from their mean;
//! - node 2's upload is capped (`--max-upload-rate`): it predicts its slow exchanges and
//!   gives its inner steps less of each round (H_i goes down).
//!
//! At the end every node's validation loss is far below the initial one, and the swarm's
//! mean is within a stated margin of one node trained alone for as many steps.

use gasloc_tests::{
    blocking, built_binary, field, join_command, read_report, start_join, start_training_swarm,
    val_losses, Proc, ADAPTIVE_ONE_PEER, UNIFORM_LOSS,
};
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn rounds_of(records: &[Value]) -> Vec<u64> {
    records
        .iter()
        .map(|r| r["round"].as_u64().unwrap())
        .collect()
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

#[test]
fn a_swarm_trains_through_a_kill_a_late_joiner_and_a_slow_uplink() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let manifest = dir.join("run.toml");
    let (_bootstrap, boot, data) =
        start_training_swarm(dir, "swarm-training-test", 11, &blocking(ADAPTIVE_ONE_PEER));
    let home = |i: usize| dir.join(format!("node{i}"));
    let start_node = |i: usize, extra: &[&str]| start_join(dir, &boot, &data, i, extra);
    // The tiny model is 131 k parameters, 0.53 MB per payload: at 350 kB/s node 2 needs
    // 1.5 s to send it, the others a few milliseconds.
    let mut nodes: Vec<Proc> = (1..=4)
        .map(|i| {
            let extra: &[&str] = match i {
                2 => &["--max-upload-rate", "350k", "--checkpoint-every", "2"],
                _ => &["--checkpoint-every", "2"],
            };
            start_node(i, extra)
        })
        .collect();
    for node in &mut nodes {
        node.wait_for_line("start=fresh", Duration::from_secs(60));
    }

    // Node 4: killed after its second checkpoint, restarted two rounds later.
    let long = Duration::from_secs(90);
    nodes[3].wait_for_line("checkpoint=", long);
    let saved = nodes[3].wait_for_checkpoint_round(2, long);
    nodes[3].child.kill().unwrap();
    nodes[3].child.wait().unwrap();
    let killed_after = read_report(&home(4)).len();

    // A fifth node joins while node 4 is away.
    let mut late = start_node(5, &["--checkpoint-every", "100"]);
    let synced = late.wait_for_line("state_synced_from=", long);
    let synced_round: u64 = field(&synced, "round").unwrap().parse().unwrap();
    assert!(synced_round >= 1, "{synced}");
    eprintln!("{synced}");
    // Three live sources (node 4 is away): their states, apart as one-peer anchors are
    // early in a run (two that have mixed only with each other against one that has mixed
    // with neither: about one norm), agree, and none is refused.
    let sources: usize = field(&synced, "sources").unwrap().parse().unwrap();
    let measured = late.stderr_lines_with("state sync:");
    assert!(sources >= 2, "cross-checked: {synced}\n{measured}");
    assert_eq!(field(&synced, "refused"), Some(""), "{synced}\n{measured}");
    // Its payload gate starts from the sources' spread (their anchors' distances from the
    // state it starts from), not from its own first pseudo-gradient alone.
    let apart: f64 = field(&synced, "disagreement").unwrap().parse().unwrap();
    let loaded = "state synced: training from the swarm's anchor";
    late.wait_for_log(loaded, long);
    let loaded = late.stderr_lines_with(loaded);
    let reference: f64 = field(&loaded, "gate_reference")
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("{loaded}"));
    assert!(apart == 0.0 || reference > 0.0, "{synced}\n{loaded}");

    // Others keep completing rounds meanwhile.
    std::thread::sleep(Duration::from_secs(8));
    let mut restarted = Proc::spawn(
        "node4-restarted",
        dir,
        join_command(&boot, &home(4), &data, &["--checkpoint-every", "2"]),
    );
    let resumed = restarted.wait_for_line("start=resumed", long);
    assert_eq!(
        field(&resumed, "round").unwrap().parse::<u64>().unwrap(),
        saved,
        "{resumed}"
    );
    // Let the full swarm (1, 2, 3, 4 restarted, 5) run until the restarted node has
    // completed 4 more rounds and nodes 1–3 have at least `MIN_ROUNDS` each (how fast that
    // comes depends on the machine, so wait for it rather than for a time), then stop it
    // cleanly: SIGTERM finishes the round, checkpoints and leaves.
    const MIN_ROUNDS: usize = 9;
    let before = read_report(&home(4)).len();
    let enough = || {
        read_report(&home(4)).len() >= before + 4
            && (1..=3).all(|i| read_report(&home(i)).len() >= MIN_ROUNDS)
    };
    let start = std::time::Instant::now();
    while !enough() && start.elapsed() < long {
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        enough(),
        "the swarm did not complete enough rounds in {long:?}"
    );
    nodes[3] = restarted;
    nodes.push(late);
    for node in &nodes {
        node.terminate();
    }
    for node in &mut nodes {
        node.expect_success(Duration::from_secs(60));
        assert!(node.output().contains("left rounds="), "{}", node.name);
    }

    let reports: Vec<Vec<Value>> = (1..=5).map(|i| read_report(&home(i))).collect();
    // The payload gate refused no honest model: not the slow node's, not the late joiner's,
    // not that of node 4 resumed from an older checkpoint.
    for (i, records) in reports.iter().enumerate() {
        for r in records {
            assert_eq!(r["refused"], serde_json::json!([]), "node{}: {r}", i + 1);
        }
        // Nor banned anyone: not the slow node, not the one killed mid-round.
        let bans = home(i + 1).join("bans.json");
        assert!(
            !bans.exists(),
            "node{} banned: {}",
            i + 1,
            std::fs::read_to_string(&bans).unwrap_or_default()
        );
    }
    // How close the honest models came to the gate's bounds (reported; the refusals above
    // are the check).
    let all: Vec<Value> = reports.iter().flatten().cloned().collect();
    let margins = gasloc_tests::gate_margins(&all);
    assert!(margins.n > 0, "the gate measured nothing");
    assert!(
        margins.loss_increase.is_finite(),
        "the functional check ran: {margins}"
    );
    eprintln!("gate margins (one-peer): {margins}");
    // Nodes 1–3 completed nearly every round from their first to their last, through the
    // kill (a round may be missed when a partner's slow link is met for the first time).
    for (i, records) in reports.iter().enumerate().take(3) {
        let rounds = rounds_of(records);
        assert!(rounds.len() >= MIN_ROUNDS, "node{}: {rounds:?}", i + 1);
        let span = rounds.last().unwrap() - rounds[0] + 1;
        assert!(
            rounds.len() as u64 + 2 >= span,
            "node{} missed more than 2 of {span} rounds: {rounds:?}",
            i + 1
        );
        let failed = records
            .iter()
            .filter(|r| !r["failed"].as_array().unwrap().is_empty())
            .count();
        assert!(
            failed <= 3,
            "node{}: {failed} rounds lost a neighbour",
            i + 1
        );
    }
    // Node 4 took part before the kill and after the restart, continuing from its checkpoint.
    // (Its report is appended to across the restart.)
    let node4 = rounds_of(&reports[3]);
    assert!(
        killed_after >= 2 && node4.len() >= killed_after + 4,
        "{node4:?}"
    );
    assert!(
        node4[killed_after] > node4[killed_after - 1] + 1 && node4[killed_after] >= saved,
        "{node4:?}: killed after {killed_after} rounds, resumed from round {saved}"
    );

    // The late joiner started from the swarm's anchor: its first evaluation is already far
    // below the untrained loss and within the others' range at that round (at most 0.3 nats
    // above the worst of them: a node paired that round with the restarted node 4, which
    // resumed an older checkpoint, is pulled back by the mix, and so is the joiner if it was).
    let late_first = &reports[4][0];
    let late_round = late_first["round"].as_u64().unwrap();
    let late_val = late_first["val_loss"].as_f64().unwrap();
    let others_then: Vec<f64> = reports[..3]
        .iter()
        .flatten()
        .filter(|r| r["round"].as_u64() == Some(late_round))
        .filter_map(|r| r["val_loss"].as_f64())
        .collect();
    assert!(
        late_val < others_then.iter().copied().fold(f64::MIN, f64::max) + 0.3
            && late_val < UNIFORM_LOSS - 1.0,
        "late joiner's first val_loss {late_val} vs the others' {others_then:?}"
    );

    // Every node learned: its last validation loss is far below its first and below ln 256.
    for (i, records) in reports.iter().enumerate() {
        let v = val_losses(records);
        let (first, last) = (v[0], *v.last().unwrap());
        assert!(
            last < first - 0.3 || last < 2.8,
            "node{}: val_loss {v:?}",
            i + 1
        );
        assert!(last < UNIFORM_LOSS - 2.0, "node{}: val_loss {v:?}", i + 1);
    }

    // The capped uplink adapts: node 2 predicts its slow exchange (from its cap, then from
    // measurement) and gives its inner steps less time, so it takes fewer of them than the
    // unlimited nodes do in rounds where they are paired with a fast partner (averaged over
    // the rounds from the third on, once the exchanges were measured).
    let slow_peer = reports[1][0]["peer"].as_str().unwrap().to_string();
    let fast_rounds = |records: &[Value]| -> Vec<Value> {
        records
            .iter()
            .skip(2)
            .filter(|r| {
                let n = r["neighbours"].as_array().unwrap();
                !n.is_empty() && !n.iter().any(|p| p.as_str() == Some(slow_peer.as_str()))
            })
            .cloned()
            .collect()
    };
    let mean_of = |records: &[Value], key: &str| {
        mean(
            &records
                .iter()
                .map(|r| r[key].as_f64().unwrap())
                .collect::<Vec<_>>(),
        )
    };
    // (Rounds where node 2 had a neighbour: an odd one out exchanges nothing.)
    let slow: Vec<Value> = reports[1]
        .iter()
        .skip(2)
        .filter(|r| !r["neighbours"].as_array().unwrap().is_empty())
        .cloned()
        .collect();
    let predicted: Vec<f64> = slow
        .iter()
        .map(|r| r["predicted_exchange_s"].as_f64().unwrap())
        .collect();
    assert!(
        !predicted.is_empty() && predicted.iter().all(|&p| p > 1.0),
        "node2 did not predict its slow exchanges: {predicted:?}"
    );
    assert!(
        mean_of(&slow, "exchange_s") > 1.0,
        "node2's exchanges were not slow"
    );
    // Its inner steps get the round less that exchange: at least 0.75 s of the ~4.75 s a
    // node without a slow exchange gets (rounds of 5 s), so H_i goes down with it.
    let budget = mean_of(&slow, "budget_s");
    assert!(budget < 4.0, "node2's inner steps still got {budget:.2} s");
    let unlimited: Vec<Value> = [0, 2]
        .iter()
        .flat_map(|&i| fast_rounds(&reports[i]))
        .collect();
    println!(
        "node2: budget {budget:.2} s, {:.0} inner steps per round, predicted exchange {:.2} s; unlimited nodes with fast partners: budget {:.2} s, {:.0} inner steps, predicted exchange {:.3} s",
        mean_of(&slow, "inner_steps"),
        mean_of(&slow, "predicted_exchange_s"),
        mean_of(&unlimited, "budget_s"),
        mean_of(&unlimited, "inner_steps"),
        mean_of(&unlimited, "predicted_exchange_s"),
    );
    // Every record says how much of its round the trainer computed; the slow uplink's
    // shorter budget shows as a lower utilisation than the unlimited nodes'.
    for r in reports.iter().flatten() {
        let (busy, wall) = (
            r["train_s"].as_f64().unwrap(),
            r["wall_s"].as_f64().unwrap(),
        );
        let u = r["compute_utilization"].as_f64().unwrap();
        assert!(
            wall > 0.0 && wall >= busy && busy >= 0.0,
            "train_s {busy}, wall_s {wall}"
        );
        assert!((u - busy / wall).abs() < 1e-9 && u <= 1.0, "{u}");
    }
    println!(
        "compute utilisation: node2 {:.3}, unlimited nodes with fast partners {:.3}",
        mean_of(&slow, "compute_utilization"),
        mean_of(&unlimited, "compute_utilization")
    );
    assert!(mean_of(&slow, "compute_utilization") < mean_of(&unlimited, "compute_utilization"));
    // Meeting the slow node does not make the others predict slow exchanges with fast
    // partners: a swap is timed from both sides ready, and a node's own link is its fastest
    // recent swap (compared with node 2's prediction in the same run, not with a time).
    assert!(
        !unlimited.is_empty()
            && mean_of(&unlimited, "predicted_exchange_s") < 0.5 * mean(&predicted),
        "unlimited nodes predict {:.3} s with fast partners, node 2 {:.3} s",
        mean_of(&unlimited, "predicted_exchange_s"),
        mean(&predicted)
    );
    // Against one node alone for as many inner steps as a swarm node took on average.
    let steps_per_node = mean(
        &[0, 2]
            .iter()
            .map(|&i| {
                reports[i]
                    .iter()
                    .map(|r| r["inner_steps"].as_f64().unwrap())
                    .sum::<f64>()
            })
            .collect::<Vec<_>>(),
    )
    .round() as u64;
    let alone = train_alone(dir, &manifest, &data, steps_per_node);
    let swarm_mean = mean(
        &reports[..3]
            .iter()
            .map(|r| *val_losses(r).last().unwrap())
            .collect::<Vec<_>>(),
    );
    println!("swarm mean val_loss {swarm_mean:.4}; alone after {steps_per_node} steps {alone:.4}");
    assert!(
        swarm_mean < alone + 0.25,
        "swarm mean val_loss {swarm_mean} is not within 0.25 nats of one node alone ({alone})"
    );
}
/// `gasloc-node train` for `steps` steps alone, then `gasloc-node eval`: its final
/// validation loss (same validation batches as the swarm nodes).
fn train_alone(dir: &Path, manifest: &Path, data: &Path, steps: u64) -> f64 {
    let checkpoints = dir.join("alone");
    let run = |args: &[&str]| {
        let out = Command::new(built_binary("gasloc-node"))
            .args(args)
            .output()
            .expect("gasloc-node runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let (m, d, c) = (
        manifest.to_str().unwrap(),
        data.to_str().unwrap(),
        checkpoints.to_str().unwrap(),
    );
    let steps = steps.to_string();
    run(&[
        "train",
        "--run",
        m,
        "--data",
        d,
        "--steps",
        &steps,
        "--threads",
        "1",
        "--device",
        "cpu",
        "--checkpoint-dir",
        c,
    ]);
    let out = run(&[
        "eval",
        "--checkpoint",
        c,
        "--data",
        d,
        "--threads",
        "1",
        "--device",
        "cpu",
    ]);
    out.lines()
        .find_map(|l| field(l, "val_loss")?.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no val_loss in {out}"))
}
