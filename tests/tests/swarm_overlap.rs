//! Overlapped rounds (`[outer] overlap = "delayed"`) in a swarm of `gasloc-node join`
//! processes on loopback: each node trains the next round while the round before is still
//! exchanging, and takes that round's outer step between two inner steps.
//!
//! Four nodes on the one-peer topology with adaptive H_i, rounds of 5 s. Node 2's upload is
//! capped so that each of its exchanges takes about 1.5 s: a blocking node gives those
//! seconds up (`swarm_training` measures it), an overlapped one trains through them. Node 4
//! saves a checkpoint every round — each taken while the next round trains, its exchange
//! pending — and is killed with SIGKILL: its partners mix it as missing and go on; restarted,
//! it resumes from that checkpoint. Every node ends cleanly and its validation loss falls.

use gasloc_tests::{
    field, join_command, read_report, start_join, start_training_swarm, Proc, ADAPTIVE_ONE_PEER,
};
use serde_json::Value;
use std::time::Duration;

fn mean_of(records: &[Value], key: &str) -> f64 {
    let values: Vec<f64> = records.iter().filter_map(|r| r[key].as_f64()).collect();
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

fn val_losses(records: &[Value]) -> Vec<f64> {
    records
        .iter()
        .filter_map(|r| r["val_loss"].as_f64())
        .collect()
}

#[test]
fn overlapped_rounds_train_through_slow_exchanges_a_kill_and_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let outer = format!("{ADAPTIVE_ONE_PEER}overlap = \"delayed\"\n");
    let (_bootstrap, boot, data) = start_training_swarm(dir, "swarm-overlap-test", 13, &outer);
    let home = |i: usize| dir.join(format!("node{i}"));
    let start_node = |i: usize, extra: &[&str]| start_join(dir, &boot, &data, i, extra);
    // The tiny model's 0.53 MB payload at 350 kB/s: 1.5 s for node 2 and its partner.
    let mut nodes: Vec<Proc> = (1..=4)
        .map(|i| {
            let extra: &[&str] = match i {
                2 => &["--rounds", "9", "--max-upload-rate", "350k"],
                4 => &["--checkpoint-every", "1"],
                _ => &["--rounds", "9"],
            };
            start_node(i, extra)
        })
        .collect();
    for node in &mut nodes {
        node.wait_for_line("start=fresh", Duration::from_secs(60));
    }

    // Node 4: killed once it saved the checkpoint of round 3 or later, restarted at once.
    let long = Duration::from_secs(90);
    let saved = nodes[3].wait_for_checkpoint_round(3, long);
    nodes[3].child.kill().unwrap();
    nodes[3].child.wait().unwrap();
    let mut restarted = Proc::spawn(
        "node4-restarted",
        dir,
        join_command(&boot, &home(4), &data, &["--rounds", "3"]),
    );
    let resumed = restarted.wait_for_line("start=resumed", long);
    let resumed_round: u64 = field(&resumed, "round").unwrap().parse().unwrap();
    assert!(
        resumed_round >= saved,
        "{resumed}: the newest checkpoint was of round {saved}"
    );
    for node in nodes.iter_mut().take(3) {
        node.expect_success(Duration::from_secs(120));
    }
    restarted.expect_success(Duration::from_secs(60));

    let reports: Vec<Vec<Value>> = (1..=4).map(|i| read_report(&home(i))).collect();
    for (i, records) in reports.iter().enumerate() {
        let losses = val_losses(records);
        assert!(
            losses.len() >= 3 && losses.last() < losses.first(),
            "node{}: validation losses {losses:?}",
            i + 1
        );
        for r in records {
            let u = r["compute_utilization"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&u), "node{}: {r}", i + 1);
        }
    }
    // Node 2's exchanges are slow, yet its inner steps get the whole round (no exchange time
    // reserved) and it computes most of the time. From the third round on: the first rounds
    // include the joining.
    let slow: Vec<Value> = reports[1]
        .iter()
        .skip(2)
        .filter(|r| !r["neighbours"].as_array().unwrap().is_empty())
        .cloned()
        .collect();
    let (exchange, budget, busy) = (
        mean_of(&slow, "exchange_s"),
        mean_of(&slow, "budget_s"),
        mean_of(&reports[1][2..], "compute_utilization"),
    );
    eprintln!(
        "node2: exchange {exchange:.2} s, inner-step budget {budget:.2} s of 5, compute \
         utilisation {busy:.3}; nodes 1 and 3: {:.3}, {:.3}",
        mean_of(&reports[0][2..], "compute_utilization"),
        mean_of(&reports[2][2..], "compute_utilization"),
    );
    assert!(
        exchange > 1.0,
        "node2's exchanges were not slow: {exchange:.2} s"
    );
    assert!(
        budget > 4.2,
        "node2's inner steps got {budget:.2} s of a 5 s round"
    );
    assert!(busy > 0.75, "node2 computed {busy:.3} of its rounds");
    // Node 4's partner of the round it was killed in mixed it as missing (or, killed before
    // its reveal, the round left it out), and went on.
    let missed_node4 = reports[..3].iter().flatten().any(|r| {
        !r["failed"].as_array().unwrap().is_empty() || !r["withheld"].as_array().unwrap().is_empty()
    });
    assert!(missed_node4, "no partner saw node 4 fail");
}
