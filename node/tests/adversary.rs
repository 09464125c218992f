//! Poisoning peers in a real swarm: a bootstrap process, honest `gasloc-node join`
//! processes and, in this test's process, an adversary (`adversaries/mod.rs`):
//! - poisoning its payloads ([`Poison::Payloads`]): a NaN on even rounds,
//!   `model.norm.weight` × 1000 on odd rounds (the attack that destroyed a demo run before
//!   the payload gate). On the complete topology every honest node meets it every round.
//!   Every honest node refuses each of its payloads by the right reason, never mixes it,
//!   refuses no honest peer, counts the refusals in `/status` and `/metrics`, bans it at its
//!   first offence — a NaN is garbage beyond doubt, a gross offence (in `/status` and in its
//!   home's `bans.json`) — and learns;
//! - poisoning the state it serves to joiners ([`Poison::State`]), the final norm × 1000,
//!   finite: a late joiner fetches three states, outvotes the poisoned one and trains from
//!   the honest anchor.

mod adversaries;

use adversaries::{mixed_peers, peers, Poison, Swarm};
use gasloc_tests::{field, http_get, join_command, read_report, Proc};
use serde_json::Value;
use std::time::Duration;

const ROUNDS: u64 = 6;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn honest_nodes_refuse_a_poisoning_peer_every_round_and_learn() {
    let mut swarm = Swarm::with_adversary(Poison::Payloads, ROUNDS).await;
    let (dir, data, boot) = (swarm.dir.clone(), swarm.data.clone(), swarm.boot.clone());
    let home = |i: usize| dir.join(format!("node{i}"));
    let (adversary, adversary_task) = (swarm.adversaries[0].clone(), swarm.tasks.remove(0));
    let rounds = ROUNDS.to_string();
    let mut nodes: Vec<Proc> = (1..=3)
        .map(|i| {
            let extra = ["--rounds", &rounds, "--status-addr", "127.0.0.1:0"];
            Proc::spawn(
                &format!("node{i}"),
                &dir,
                join_command(&boot, &home(i), &data, &extra),
            )
        })
        .collect();
    let nodes = tokio::task::spawn_blocking(move || {
        let line = nodes[0].wait_for_line("status=", Duration::from_secs(60));
        let status = field(&line, "status")
            .unwrap()
            .trim_start_matches("http://")
            .to_string();
        // The counts while node 1 still serves them, after its next-to-last round.
        nodes[0].wait_for_line(&format!("round={} ", ROUNDS - 2), Duration::from_secs(120));
        let json = http_get(&status, "/status");
        let metrics = http_get(&status, "/metrics");
        for node in &mut nodes {
            node.expect_success(Duration::from_secs(120));
        }
        (json, metrics)
    });
    let (json, metrics) = nodes.await.unwrap();
    adversary_task.await.unwrap().unwrap();

    for i in 1..=3 {
        let records = read_report(&home(i));
        assert_eq!(records.len() as u64, ROUNDS, "node{i}");
        // Its first pairing is a gross offence (a NaN in round 0) and bans it; after it the
        // adversary is refused without an exchange (or, disconnected by every honest node,
        // no longer a member at all).
        let mut pairings = 0;
        for r in &records {
            let round = r["round"].as_u64().unwrap();
            let mixed = mixed_peers(r);
            assert!(
                !mixed.contains(&adversary.as_str()),
                "node{i} mixed it: {r}"
            );
            assert!(!peers(&r["exchanged"]).contains(&adversary), "node{i}: {r}");
            if !peers(&r["neighbours"]).contains(&adversary) {
                continue;
            }
            pairings += 1;
            let refused = r["refused"].as_array().unwrap();
            assert_eq!(
                refused.len(),
                1,
                "node{i}: only the adversary is refused: {r}"
            );
            assert_eq!(refused[0]["peer"], adversary.as_str(), "node{i}: {r}");
            let kind = if pairings > 1 {
                "banned"
            } else if round % 2 == 0 {
                "non_finite"
            } else {
                "too_far"
            };
            assert_eq!(refused[0]["kind"], kind, "node{i} round {round}: {r}");
        }
        assert!(pairings >= 1, "node{i} never met the adversary");
        let v: Vec<f64> = records
            .iter()
            .filter_map(|r| r["val_loss"].as_f64())
            .collect();
        assert!(v.iter().all(|l| l.is_finite()), "node{i}: {v:?}");
        assert!(v.last().unwrap() < &(v[0] - 0.2), "node{i} learns: {v:?}");
        let honest = adversaries::without_readings_of(&records, &adversary);
        let margins = gasloc_tests::gate_margins(&honest);
        eprintln!("node{i} gate margins (complete, honest peers): {margins}");
        // The ban is kept in the node's home, for this run.
        let bans: Value =
            serde_json::from_str(&std::fs::read_to_string(home(i).join("bans.json")).unwrap())
                .unwrap();
        let banned: Vec<&str> = bans["bans"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["peer"].as_str().unwrap())
            .collect();
        assert_eq!(banned, [adversary.as_str()], "node{i}: {bans}");
    }
    let body = json.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let status: Value = serde_json::from_str(body).unwrap();
    let counts = &status["refusals"][adversary.as_str()];
    assert!(
        counts["non_finite"].as_u64() >= Some(1),
        "{}",
        status["refusals"]
    );
    assert_eq!(
        status["refusals"].as_object().unwrap().len(),
        1,
        "{}",
        status["refusals"]
    );
    assert!(
        metrics.contains("gasloc_refused_payloads_total{")
            && metrics.contains("reason=\"non_finite\""),
        "{metrics}"
    );
    assert!(metrics.contains("gasloc_banned_peers 1"), "{metrics}");
    let banned = status["banned"].as_array().unwrap();
    assert_eq!(banned.len(), 1, "{}", status["banned"]);
    assert_eq!(banned[0]["peer"], adversary.as_str());
    assert_eq!(
        banned[0]["offences"].as_array().unwrap().len(),
        1,
        "one gross offence: {}",
        status["banned"]
    );
}

/// Two honest nodes and the adversary serve states; a late joiner (`--sync-state`) asks all
/// three, outvotes the adversary's (its final norm × 1000: finite, so only the comparison
/// with the honest sources catches it), starts from the honest anchor and trains normally:
/// its validation loss lies within 3 % of the honest nodes' of that round, not a broken
/// model's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_joiner_outvotes_a_peer_serving_a_poisoned_state_and_trains_normally() {
    let swarm = Swarm::with_adversary(Poison::State, 7).await;
    a_late_joiner_outvotes_a_poisoned_state(swarm, 7).await;
}

/// The same on the default manifest: overlapped rounds (delayed) in five fragments, one-peer,
/// where the state a joiner fetches holds each fragment as of its last sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_default_manifest_a_late_joiner_outvotes_a_poisoned_state_and_trains_normally() {
    let manifest = adversaries::default_manifest("one-peer");
    let swarm = Swarm::start(&manifest, &[Poison::State], 8, [8000, 2500, 400, 1200]).await;
    a_late_joiner_outvotes_a_poisoned_state(swarm, 8).await;
}

/// Two honest nodes and `swarm`'s adversary (serving poisoned states) take part in
/// `honest_rounds` rounds; a late joiner syncs its state after round 2 and takes part in two.
async fn a_late_joiner_outvotes_a_poisoned_state(mut swarm: Swarm, honest_rounds: u64) {
    let (dir, data, boot) = (swarm.dir.clone(), swarm.data.clone(), swarm.boot.clone());
    let home = |i: usize| dir.join(format!("node{i}"));
    let (adversary, adversary_task) = (swarm.adversaries[0].clone(), swarm.tasks.remove(0));
    let rounds = honest_rounds.to_string();
    let (boot2, dir2, data2) = (boot.clone(), dir.clone(), data.clone());
    let outcome = tokio::task::spawn_blocking(move || {
        let home = |i: usize| dir2.join(format!("node{i}"));
        let mut honest: Vec<Proc> = (1..=2)
            .map(|i| {
                Proc::spawn(
                    &format!("node{i}"),
                    &dir2,
                    join_command(
                        &boot2,
                        &home(i),
                        &data2,
                        &["--rounds", &rounds, "--eval-every", "1"],
                    ),
                )
            })
            .collect();
        honest[0].wait_for_line("round=2 ", Duration::from_secs(120));
        let mut late = Proc::spawn(
            "late",
            &dir2,
            join_command(
                &boot2,
                &home(3),
                &data2,
                &["--rounds", "2", "--sync-state", "--eval-every", "1"],
            ),
        );
        let synced = late.wait_for_line("state_synced_from=", Duration::from_secs(120));
        late.expect_success(Duration::from_secs(120));
        for node in &mut honest {
            node.expect_success(Duration::from_secs(120));
        }
        synced
    });
    let synced = outcome.await.unwrap();
    adversary_task.await.unwrap().unwrap();

    assert_eq!(field(&synced, "sources"), Some("2"), "{synced}");
    assert_eq!(
        field(&synced, "refused"),
        Some(format!("{adversary}:state_disagrees").as_str()),
        "{synced}"
    );
    assert!(
        !field(&synced, "state_synced_from")
            .unwrap()
            .contains(&adversary),
        "{synced}"
    );
    let late = read_report(&home(3));
    let honest = [read_report(&home(1)), read_report(&home(2))];
    assert_eq!(late.len(), 2, "{late:?}");
    for record in &late {
        let round = record["round"].as_u64().unwrap();
        let loss = record["val_loss"].as_f64().expect("a validation loss");
        // The honest nodes' losses of that round: on one-peer gossip (the default manifest)
        // their anchors differ, so the joiner is held to their range.
        let theirs: Vec<f64> = honest
            .iter()
            .filter_map(|records| {
                records
                    .iter()
                    .find(|r| r["round"].as_u64() == Some(round))
                    .and_then(|r| r["val_loss"].as_f64())
            })
            .collect();
        assert!(!theirs.is_empty(), "no honest node ran round {round}");
        let low = theirs.iter().copied().fold(f64::INFINITY, f64::min);
        let high = theirs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        assert!(
            loss >= 0.97 * low && loss <= 1.03 * high,
            "round {round}: the joiner's loss {loss} vs the honest nodes' {theirs:?}"
        );
    }
}
