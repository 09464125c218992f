//! Overlapped rounds (`[outer] overlap = "delayed"`, the default, and `"eager"`) in swarms of
//! `gasloc-node join` processes on loopback: each node trains the next round while the round
//! before is still exchanging, and takes that round's outer step between two inner steps.
//!
//! Four nodes on the one-peer topology with adaptive H_i, rounds of 5 s, in each test.
//! `delayed`: node 2's upload is capped so that each of its exchanges takes about 1.5 s: a
//! blocking node gives those seconds up (`swarm_training` measures it), an overlapped one
//! trains through them. Node 4 (capped too) saves a checkpoint every round — its moments taken
//! at the hand-off, while the exchange was pending — and is killed with SIGKILL while an
//! exchange is under way: its partner of that round fails mid-exchange, mixes it as missing
//! and goes on; restarted, node 4 resumes from that checkpoint. `eager`: node 3 (capped) is
//! stopped with SIGTERM while an exchange is under way: it completes that round, saves, and
//! resumes there when restarted; a fifth node joins late and syncs the swarm's state (the
//! anchors and outer momenta of nodes whose rounds overlap). The default overlap (`delayed`,
//! `fragments = 5`): each round sends, mixes and outer-steps a fifth of the model, the five
//! parts in turn; a node is stopped mid-exchange and resumes, a fifth joins late. Every node ends cleanly and
//! its validation loss falls.

use gasloc_tests::{
    field, join_command, read_report, start_join, start_training_swarm, val_losses, Proc, TestDir,
    ADAPTIVE_ONE_PEER,
};
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

fn mean_of(records: &[Value], key: &str) -> f64 {
    let values: Vec<f64> = records.iter().filter_map(|r| r[key].as_f64()).collect();
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// Asserts that no exchange between two of `steady` (nodes never stopped) was refused as
/// being for an old round: a round's exchange is served while the next round trains.
fn assert_no_old_round_refusals(reports: &[(usize, Vec<Value>)], steady: &[usize]) {
    let id = |records: &[Value]| records[0]["peer"].as_str().unwrap().to_owned();
    let steady_ids: Vec<String> = reports
        .iter()
        .filter(|(i, _)| steady.contains(i))
        .map(|(_, r)| id(r))
        .collect();
    for (i, records) in reports.iter().filter(|(i, _)| steady.contains(i)) {
        for r in records {
            for failed in r["failed"].as_array().unwrap() {
                let (peer, reason) = (failed[0].as_str().unwrap(), failed[1].as_str().unwrap());
                assert!(
                    !(steady_ids.iter().any(|s| s == peer) && reason.contains("OldRound")),
                    "node{i} round {}: an overlapped exchange was refused as old: {reason}",
                    r["round"]
                );
            }
        }
    }
}

/// Starts nodes 1 to 4 of a swarm and waits until each has started fresh: node `stopped`
/// with `stopped_extra` (it will be stopped and restarted), the others with `--rounds rounds`.
fn start_four(
    dir: &Path,
    boot: &str,
    data: &Path,
    stopped: usize,
    stopped_extra: &[&str],
    rounds: &str,
) -> Vec<Proc> {
    let mut nodes: Vec<Proc> = (1..=4)
        .map(|i| {
            // Every round evaluated, also in fragments (whose default is once per pass).
            let extra: &[&str] = if i == stopped {
                stopped_extra
            } else {
                &["--rounds", rounds, "--eval-every", "1"]
            };
            start_join(dir, boot, data, i, extra)
        })
        .collect();
    for node in &mut nodes {
        node.wait_for_line("start=fresh", Duration::from_secs(60));
    }
    nodes
}

/// SIGTERM to `node` while the exchange of the round after its checkpoint of round
/// `checkpointed` (or later) is under way; it must end cleanly. Returns that round.
fn stop_mid_exchange(node: &mut Proc, checkpointed: u64) -> u64 {
    let long = Duration::from_secs(90);
    let exchanging = node.wait_for_checkpoint_round(checkpointed, long) + 1;
    node.wait_for_log(&format!("round {exchanging}: exchange started"), long);
    node.terminate();
    node.expect_success(Duration::from_secs(60));
    exchanging
}

/// The step directory `home`'s checkpoint root's `latest` names.
fn latest_checkpoint(home: &Path) -> std::path::PathBuf {
    let root = home.join("checkpoints");
    let latest = std::fs::read_to_string(root.join("latest")).unwrap();
    root.join(latest.trim())
}

/// Restarts node `i` (stopped, its newest checkpoint at round `newest`) for 2 rounds and
/// checks that it resumes at that round.
fn restart_resumed(dir: &Path, boot: &str, data: &Path, i: usize, newest: u64) -> Proc {
    let home = dir.join(format!("node{i}"));
    let mut restarted = Proc::spawn(
        &format!("node{i}-restarted"),
        dir,
        join_command(boot, &home, data, &["--rounds", "2"]),
    );
    let resumed = restarted.wait_for_line("start=resumed", Duration::from_secs(90));
    assert_eq!(
        field(&resumed, "round").map(str::to_owned),
        Some(newest.to_string()),
        "{resumed}"
    );
    restarted
}

#[test]
fn overlapped_rounds_train_through_slow_exchanges_a_kill_and_a_restart() {
    let dir = TestDir::new();
    let dir = dir.path();
    let outer = format!("{ADAPTIVE_ONE_PEER}overlap = \"delayed\"\nfragments = 1\n");
    let (_bootstrap, boot, data) = start_training_swarm(dir, "swarm-overlap-test", 13, &outer);
    let home = |i: usize| dir.join(format!("node{i}"));
    let start_node = |i: usize, extra: &[&str]| start_join(dir, &boot, &data, i, extra);
    // The tiny model's 0.53 MB payload at 350 kB/s: 1.5 s for node 2 and its partner.
    let mut nodes: Vec<Proc> = (1..=4)
        .map(|i| {
            let extra: &[&str] = match i {
                2 => &["--rounds", "9", "--max-upload-rate", "350k"],
                4 => &["--checkpoint-every", "1", "--max-upload-rate", "350k"],
                _ => &["--rounds", "9"],
            };
            start_node(i, extra)
        })
        .collect();
    for node in &mut nodes {
        node.wait_for_line("start=fresh", Duration::from_secs(60));
    }

    // Node 4: killed once it saved the checkpoint of round 3 or later and the exchange of
    // the round after that one started (a 1.5 s exchange), restarted at once.
    let long = Duration::from_secs(90);
    let saved = nodes[3].wait_for_checkpoint_round(3, long) + 1;
    nodes[3].wait_for_log(&format!("round {saved}: exchange started"), long);
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
    let numbered: Vec<(usize, Vec<Value>)> = (1..=4).zip(reports.iter().cloned()).collect();
    assert_no_old_round_refusals(&numbered, &[1, 2, 3]);
    for (i, records) in reports.iter().enumerate() {
        let losses = val_losses(records);
        eprintln!("node{}: validation losses {losses:.3?}", i + 1);
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
    // The trainer accounts for the steps' budget: its steps, the round before served
    // between them, and what was left unused when one more step would not fit add up to the
    // budget, less the moment the trainer took to pick up its order.
    for r in &slow {
        let t = &r["trainer_time"];
        let part = |key: &str| t[key].as_f64().unwrap();
        let accounted = r["train_s"].as_f64().unwrap() + part("served_s") + part("unused_s");
        let budget = r["budget_s"].as_f64().unwrap();
        eprintln!(
            "node2 round {}: steps, serving and unused {accounted:.3} s of {budget:.3} s",
            r["round"]
        );
        assert!(
            accounted > 0.9 * budget && accounted < budget + 0.25,
            "node2 round {}: steps, serving and unused time {accounted:.3} s of a {budget:.3} s \
             budget ({t})",
            r["round"]
        );
    }
    // Node 4's partner of the round it was killed in mixed it as missing (or, killed before
    // its reveal, the round left it out), and went on.
    let missed_node4 = reports[..3].iter().flatten().any(|r| {
        !r["failed"].as_array().unwrap().is_empty() || !r["withheld"].as_array().unwrap().is_empty()
    });
    assert!(missed_node4, "no partner saw node 4 fail");
}

#[test]
fn eager_overlapped_rounds_stop_cleanly_mid_exchange_and_resume() {
    let dir = TestDir::new();
    let dir = dir.path();
    let outer = format!("{ADAPTIVE_ONE_PEER}overlap = \"eager\"\n");
    let (_bootstrap, boot, data) = start_training_swarm(dir, "swarm-eager-test", 17, &outer);
    let home = |i: usize| dir.join(format!("node{i}"));
    let capped = ["--checkpoint-every", "1", "--max-upload-rate", "350k"];
    let mut nodes = start_four(dir, &boot, &data, 3, &capped, "8");

    // Node 3: SIGTERM while the exchange of a round after its checkpoint of round 2 is
    // under way. A stop finishes what is in flight: that exchange and its outer step, the
    // round training, then the checkpoint.
    let long = Duration::from_secs(90);
    let exchanging = stop_mid_exchange(&mut nodes[2], 2);
    let stopped: Vec<Value> = read_report(&home(3));
    let last = stopped
        .iter()
        .map(|r| r["round"].as_u64().unwrap())
        .max()
        .unwrap();
    assert!(
        stopped.iter().any(|r| r["round"] == exchanging),
        "the round exchanging at the stop ({exchanging}) has no record"
    );
    let newest = nodes[2].checkpoint_rounds().into_iter().max().unwrap();
    assert_eq!(
        newest,
        last + 1,
        "the checkpoint at the stop resumes after the last round recorded"
    );
    let mut restarted = restart_resumed(dir, &boot, &data, 3, newest);
    // A late joiner: its state comes from the live nodes, each mid-overlap.
    let mut joiner = start_join(dir, &boot, &data, 5, &["--rounds", "2"]);
    let synced = joiner.wait_for_line("state_synced_from=", long);
    let sources: usize = field(&synced, "sources").unwrap().parse().unwrap();
    assert!(sources >= 2, "{synced}");
    for node in nodes.iter_mut().filter(|n| n.name != "node3") {
        node.expect_success(Duration::from_secs(120));
    }
    restarted.expect_success(Duration::from_secs(60));
    joiner.expect_success(Duration::from_secs(60));

    // The joiner starts where the swarm is: its first validation loss is below every
    // original node's first.
    let first = |i: usize| val_losses(&read_report(&home(i)))[0];
    let joined = first(5);
    for i in [1, 2, 4] {
        assert!(joined < first(i), "node5 {joined} vs node{i} {}", first(i));
    }
    let numbered: Vec<(usize, Vec<Value>)> = (1..=4).map(|i| (i, read_report(&home(i)))).collect();
    assert_no_old_round_refusals(&numbered, &[1, 2, 4]);
    for i in 1..=4 {
        let records = read_report(&home(i));
        let losses = val_losses(&records);
        eprintln!("node{i}: validation losses {losses:.3?}");
        assert!(
            losses.len() >= 3 && losses.last() < losses.first(),
            "node{i}: validation losses {losses:?}"
        );
        assert!(records
            .iter()
            .all(|r| (0.0..=1.0).contains(&r["compute_utilization"].as_f64().unwrap())));
    }
    eprintln!(
        "node3: stopped while round {exchanging} exchanged; last round {last}, resumed at {newest}"
    );
}

/// The default overlap, `[outer] overlap` left out: `delayed` in five fragments. Every
/// round's payload is one fragment of the model, the fragments in turn (rounds five apart
/// send the same bytes, each a part of the whole model's), every node checks each payload
/// against its round's fragment and accepts its partners', a node stopped mid-exchange
/// resumes where it saved, a late joiner syncs the whole state, and every validation loss
/// falls.
#[test]
fn fragmented_overlapped_rounds_send_each_fragment_in_turn() {
    let dir = TestDir::new();
    let dir = dir.path();
    let outer = ADAPTIVE_ONE_PEER;
    let fragments = 5u64;
    let (_bootstrap, boot, data) = start_training_swarm(dir, "swarm-fragments-test", 19, outer);
    let home = |i: usize| dir.join(format!("node{i}"));
    let capped = ["--checkpoint-every", "1", "--max-upload-rate", "150k"];
    let mut nodes = start_four(dir, &boot, &data, 2, &capped, "9");
    // Node 2: SIGTERM while an exchange after its checkpoint of round 3 is under way.
    stop_mid_exchange(&mut nodes[1], 3);
    let newest = nodes[1].checkpoint_rounds().into_iter().max().unwrap();
    // The checkpoint at the stop holds the model in training beside the anchor: the dropped
    // round's fragment as its anchor, the other four with the local progress made since
    // their last sync, which the restart resumes instead of losing.
    let saved = latest_checkpoint(&home(2));
    let (anchor, local) = (
        std::fs::read(saved.join("model.safetensors")).unwrap(),
        std::fs::read(saved.join("local.safetensors")).unwrap(),
    );
    let (anchor, local) = (
        safetensors::SafeTensors::deserialize(&anchor).unwrap(),
        safetensors::SafeTensors::deserialize(&local).unwrap(),
    );
    let mut names = anchor.names();
    names.sort();
    let mut local_names = local.names();
    local_names.sort();
    assert_eq!(names, local_names, "{}", saved.display());
    let trained: Vec<&str> = names
        .iter()
        .filter(|n| anchor.tensor(n).unwrap().data() != local.tensor(n).unwrap().data())
        .copied()
        .collect();
    assert!(
        !trained.is_empty() && trained.len() < names.len(),
        "{}: {} of {} tensors hold local progress: {trained:?}",
        saved.display(),
        trained.len(),
        names.len()
    );
    let mut restarted = restart_resumed(dir, &boot, &data, 2, newest);
    restarted.wait_for_log("the model in training restored", Duration::from_secs(30));
    let mut joiner = start_join(dir, &boot, &data, 5, &["--rounds", "2"]);
    joiner.wait_for_line("state_synced_from=", Duration::from_secs(90));
    for node in nodes.iter_mut().filter(|n| n.name != "node2") {
        node.expect_success(Duration::from_secs(120));
    }
    restarted.expect_success(Duration::from_secs(60));
    joiner.expect_success(Duration::from_secs(60));

    // The tiny model's whole fp32 payload is 0.53 MB; each round sends one fragment of it.
    const WHOLE_MODEL_BYTES: f64 = 525_568.0;
    for i in [1, 3, 4] {
        let records = read_report(&home(i));
        let mut per_round = std::collections::BTreeMap::new();
        for r in &records {
            assert!(
                r["refused"].as_array().unwrap().is_empty(),
                "node{i} round {}: a payload was refused: {}",
                r["round"],
                r["refused"]
            );
            let exchanged = r["exchanged"].as_array().unwrap().len() as u64;
            if let Some(sent) = r["bytes_sent"].as_u64().unwrap().checked_div(exchanged) {
                per_round.insert(r["round"].as_u64().unwrap(), sent);
            }
        }
        assert!(per_round.len() >= 6, "node{i}: {per_round:?}");
        for (&round, &sent) in &per_round {
            let share = sent as f64 / WHOLE_MODEL_BYTES;
            assert!(
                (0.05..0.5).contains(&share),
                "node{i} round {round}: sent {sent} bytes to a partner, {share:.2} of the model"
            );
            if let Some(&later) = per_round.get(&(round + fragments)) {
                assert_eq!(
                    sent,
                    later,
                    "node{i}: rounds {round} and {} send one fragment",
                    round + fragments
                );
            }
        }
        let sizes: std::collections::BTreeSet<u64> = per_round.values().copied().collect();
        assert!(
            sizes.len() >= 2,
            "node{i}: one payload size {sizes:?}: not in fragments"
        );
        let losses = val_losses(&records);
        eprintln!("node{i}: validation losses {losses:.3?}, bytes per partner {per_round:?}");
        assert!(
            losses.len() >= 3 && losses.last() < losses.first(),
            "node{i}: validation losses {losses:?}"
        );
    }
}
