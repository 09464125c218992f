//! A share of the swarm attacking: a bootstrap process, honest `gasloc-node join` processes
//! and in-process adversaries (`adversaries/mod.rs`) on the complete topology (DiLoCo), with
//! the cosine floor that topology allows (`[gate] min_cosine = 0.05`: honest cosines fall as
//! training goes on, to 0.10 by round 15 on Shakespeare, where 0.2 refused an honest node;
//! sign flips lie below 0, random directions at about 0). Four runs: 6 honest nodes alone,
//! then the same 6 (same identities, so the same data) with 2 adversaries (25 %: a
//! sign-flipped and a random-direction pseudo-gradient), one of the six on a tenth of the
//! others' upload bandwidth in both runs; 5 of them alone, then with 3 (37.5 %: a stale
//! model, NaN / × 1000, a sign flip). In each attacked run no honest node mixes a poisoned
//! payload; every adversary is refused by every honest node it meets from its first poisoned
//! round, and banned by it within 3 pairings; no honest node is refused or banned by anyone;
//! and every honest node's validation loss stays within 0.5 nats of the same nodes' alone at
//! the same round (the figures are printed; on the tests' six sentences, memorised by round
//! 6, a small change in the mix moves the loss by a large fraction: see `docs/security.md`).
//!
//! On the complete topology a refused member's weight is spread over the members that
//! arrived (DiLoCo's mean over those present), so the honest nodes, which refuse the same
//! adversaries, hold one anchor: the test asserts their validation losses equal to the bit
//! in every round in which they mixed the same members.
//!
//! On real text it measures the goal: with `GASLOC_ADVERSARY_DATA` naming byte shards (an
//! absolute path, such as `$PWD/datasets/shakespeare-byte` from `make setup`) and
//! `GASLOC_ADVERSARY_ROUNDS=16` (default 7) it prints the gaps and asserts every honest loss
//! within 3 % of the same nodes' alone at the same round. The reference is exact: the same
//! identities alone give the same losses to the bit, so a gap is the attack's own cost.

mod adversaries;

use adversaries::{mixed_peers, peers, Poison, Swarm};
use gasloc_tests::{join_command, read_report, Proc};
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Duration;

/// Rounds per run: `$GASLOC_ADVERSARY_ROUNDS`, else 7.
fn rounds() -> u64 {
    std::env::var("GASLOC_ADVERSARY_ROUNDS")
        .map(|r| {
            r.parse()
                .expect("GASLOC_ADVERSARY_ROUNDS is a number of rounds")
        })
        .unwrap_or(7)
}
/// Genesis delay, period, commit/reveal windows, exchange timeout (ms): eight libtorch
/// trainers share two cores.
const TIMING: [u64; 4] = [15_000, 5_000, 500, 2_500];

fn manifest() -> String {
    format!("{}[gate]\nmin_cosine = 0.05\n", adversaries::manifest())
}

/// The 25 % runs' upload caps (`--max-upload-rate`), one per honest node: the sixth on a
/// tenth of the others' bandwidth. Its exchange (a 0.53 MB model to each of 7 members) takes
/// about 0.9 s of the 2.5 s exchange window, the others' about 0.1 s.
const ONE_ON_A_TENTH: [&str; 6] = ["40M", "40M", "40M", "40M", "40M", "4M"];

/// One run: `honest` join processes (identities `keys/node<i>.key`, the same in every run,
/// so each node reads the same data in each) beside adversaries poisoning `poisons`; node
/// i's upload is capped at `caps[i]` when there is one. Returns each honest node's round
/// records and bans file, and the adversaries' peer ids.
async fn run(
    keys: &std::path::Path,
    honest: usize,
    poisons: &[Poison],
    caps: &[&str],
) -> (Vec<(Vec<Value>, Value)>, Vec<String>) {
    let mut swarm = Swarm::start(&manifest(), poisons, rounds(), TIMING).await;
    let (dir, data, boot) = (swarm.dir.clone(), swarm.data.clone(), swarm.boot.clone());
    let wait = Duration::from_secs(170 + 10 * rounds());
    let rounds = rounds().to_string();
    let homes: Vec<_> = (1..=honest).map(|i| dir.join(format!("node{i}"))).collect();
    let spawned = homes.clone();
    let keys = keys.to_path_buf();
    let caps: Vec<String> = caps.iter().map(|c| c.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let mut nodes: Vec<Proc> = spawned
            .iter()
            .enumerate()
            .map(|(i, home)| {
                let key = keys.join(format!("node{}.key", i + 1));
                let key = key.to_str().unwrap();
                let mut extra = vec!["--rounds", &rounds, "--identity", key];
                if let Some(cap) = caps.get(i) {
                    extra.extend(["--max-upload-rate", cap.as_str()]);
                }
                Proc::spawn(
                    &format!("node{}", i + 1),
                    &dir,
                    join_command(&boot, home, &data, &extra),
                )
            })
            .collect();
        for node in &mut nodes {
            node.expect_success(wait);
        }
    })
    .await
    .unwrap();
    for task in swarm.tasks.drain(..) {
        task.await.unwrap().unwrap();
    }
    let results = homes
        .iter()
        .map(|home| {
            let bans = std::fs::read_to_string(home.join("bans.json"))
                .map(|t| serde_json::from_str(&t).unwrap())
                .unwrap_or(Value::Null);
            (read_report(home), bans)
        })
        .collect();
    (results, swarm.adversaries.clone())
}

/// The refusal kinds an honest node may give a payload of `mode` in `round`.
fn expected_kinds(mode: Poison, round: u64) -> &'static [&'static str] {
    match mode {
        Poison::Payloads if round.is_multiple_of(2) => &["non_finite"],
        Poison::Payloads => &["too_far"],
        _ => &["misaligned", "too_far", "harmful"],
    }
}

/// The pairing at which an honest node bans an adversary of `mode`: the first for garbage
/// beyond doubt (a NaN, a model × 1000: gross offences), else the `ban_after_offences`-th.
fn bans_at(mode: Poison) -> usize {
    match mode {
        Poison::Payloads => 1,
        _ => gasloc_proto::manifest::GateConfig::default().ban_after_offences as usize,
    }
}

/// Checks one attacked run (see the module doc) and returns its validation losses per round.
fn check(run: &str, nodes: &[(Vec<Value>, Value)], adversaries: &[String], modes: &[Poison]) {
    for (n, (records, bans)) in nodes.iter().enumerate() {
        let node = format!("{run} node{}", n + 1);
        assert!(
            records.len() as u64 >= rounds() - 1,
            "{node}: {} rounds",
            records.len()
        );
        let mut pairings = vec![0usize; adversaries.len()];
        for r in records {
            let round = r["round"].as_u64().unwrap();
            let refused = r["refused"].as_array().unwrap();
            for refusal in refused {
                let peer = refusal["peer"].as_str().unwrap();
                assert!(
                    adversaries.iter().any(|a| a == peer),
                    "{node} refused an honest peer: {r}"
                );
            }
            let mixed = mixed_peers(r);
            for (k, (adversary, mode)) in adversaries.iter().zip(modes).enumerate() {
                let Some(first) = mode.first_poisoned_round() else {
                    continue;
                };
                if round < first || !peers(&r["neighbours"]).contains(adversary) {
                    continue;
                }
                pairings[k] += 1;
                assert!(
                    !mixed.contains(&adversary.as_str()),
                    "{node} mixed {mode:?}: {r}"
                );
                let refusal = refused
                    .iter()
                    .find(|x| x["peer"] == adversary.as_str())
                    .unwrap_or_else(|| {
                        panic!("{node} did not refuse {mode:?} in round {round}: {r}")
                    });
                let kind = refusal["kind"].as_str().unwrap();
                if pairings[k] > bans_at(*mode) {
                    assert_eq!(kind, "banned", "{node} round {round} {mode:?}: {r}");
                } else {
                    assert!(
                        expected_kinds(*mode, round).contains(&kind),
                        "{node} round {round} {mode:?}: refused as {kind}: {r}"
                    );
                }
            }
        }
        let banned: Vec<&str> = bans["bans"]
            .as_array()
            .map(|b| b.iter().map(|b| b["peer"].as_str().unwrap()).collect())
            .unwrap_or_default();
        for (k, adversary) in adversaries.iter().enumerate() {
            assert!(
                pairings[k] >= bans_at(modes[k]),
                "{node} met {:?} in only {} poisoned rounds",
                modes[k],
                pairings[k]
            );
            assert!(
                banned.contains(&adversary.as_str()),
                "{node} did not ban {:?}: {bans}",
                modes[k]
            );
        }
        assert_eq!(
            banned.len(),
            adversaries.len(),
            "{node} banned an honest peer: {bans}"
        );
    }
}

/// Prints the lowest cosine the gate measured between two honest nodes' pseudo-gradients in
/// a run, and its round: the margin under which `[gate] min_cosine` must stay.
fn print_lowest_honest_cosine(run: &str, nodes: &[(Vec<Value>, Value)], adversaries: &[String]) {
    let mut lowest: Option<(f64, u64)> = None;
    for (records, _) in nodes {
        for r in records {
            for reading in r["gate"].as_array().into_iter().flatten() {
                let honest = !adversaries.iter().any(|a| reading["peer"] == a.as_str());
                if let (true, Some(cosine)) = (honest, reading["cosine"].as_f64()) {
                    if lowest.is_none_or(|(c, _)| cosine < c) {
                        lowest = Some((cosine, r["round"].as_u64().unwrap()));
                    }
                }
            }
        }
    }
    if let Some((cosine, round)) = lowest {
        eprintln!(
            "{run}: lowest cosine between honest pseudo-gradients {cosine:.4} (round {round})"
        );
    }
}

/// DiLoCo's invariant, kept under attack: on the complete topology a refused member's weight
/// is spread over the members that arrived, so honest nodes that mixed the same members in
/// every round so far hold the same anchor and give the same validation loss, to the bit.
/// Checks the rounds from the first while every node has a record with a validation loss and
/// the same mixed set (a payload that came too late for one node parts the anchors from
/// there, which is printed) and returns how many.
fn assert_one_anchor(run: &str, nodes: &[(Vec<Value>, Value)]) -> usize {
    struct Mixed {
        peers: Vec<String>,
        val_loss: Option<f64>,
    }
    let by_round = |records: &[Value]| -> BTreeMap<u64, Mixed> {
        records
            .iter()
            .map(|r| {
                let mut peers: Vec<String> =
                    mixed_peers(r).into_iter().map(str::to_string).collect();
                peers.sort_unstable();
                let val_loss = r["val_loss"].as_f64();
                (r["round"].as_u64().unwrap(), Mixed { peers, val_loss })
            })
            .collect()
    };
    let nodes: Vec<_> = nodes.iter().map(|(records, _)| by_round(records)).collect();
    let mut checked = 0;
    for round in 0.. {
        let Some(at_round) = nodes
            .iter()
            .map(|n| n.get(&round))
            .collect::<Option<Vec<_>>>()
        else {
            break;
        };
        if let Some(parted) = at_round.iter().find(|m| m.peers != at_round[0].peers) {
            eprintln!(
                "{run} round {round}: the honest nodes mixed different members ({:?} and {:?})",
                at_round[0].peers, parted.peers
            );
            break;
        }
        let Some(losses) = at_round
            .iter()
            .map(|m| m.val_loss)
            .collect::<Option<Vec<_>>>()
        else {
            break;
        };
        assert!(
            losses.iter().all(|l| l.to_bits() == losses[0].to_bits()),
            "{run} round {round}: the honest nodes mixed the same members but hold different \
             anchors (validation losses {losses:?})"
        );
        checked += 1;
    }
    eprintln!("{run}: one anchor for every honest node in rounds 0..{checked}");
    checked
}

fn val_losses(nodes: &[(Vec<Value>, Value)]) -> BTreeMap<u64, Vec<f64>> {
    let mut by_round: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for (records, _) in nodes {
        for r in records {
            if let Some(loss) = r["val_loss"].as_f64() {
                by_round
                    .entry(r["round"].as_u64().unwrap())
                    .or_default()
                    .push(loss);
            }
        }
    }
    by_round
}

/// The largest gap, relative and in nats, between any honest node's loss and the reference's
/// mean loss at the same round, over the rounds both have; prints both, round by round.
fn worst_gap(
    run: &str,
    losses: &BTreeMap<u64, Vec<f64>>,
    reference: &BTreeMap<u64, Vec<f64>>,
) -> (f64, f64, usize) {
    let (mut worst, mut worst_nats) = (0.0f64, 0.0f64);
    let mut rounds = 0;
    for (round, losses) in losses {
        let Some(reference) = reference.get(round) else {
            continue;
        };
        let mean = reference.iter().sum::<f64>() / reference.len() as f64;
        rounds += 1;
        let (mut gap, mut nats) = (0.0f64, 0.0f64);
        for loss in losses {
            assert!(loss.is_finite(), "round {round}: {loss}");
            gap = gap.max((loss - mean).abs() / mean);
            nats = nats.max((loss - mean).abs());
        }
        eprintln!(
            "{run} round {round}: reference {mean:.4}, attacked {losses:.4?}, gap {:.2} % ({nats:.3} nats)",
            gap * 100.0
        );
        worst = worst.max(gap);
        worst_nats = worst_nats.max(nats);
    }
    (worst, worst_nats, rounds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarter_and_three_eighths_of_the_swarm_attacking_leave_the_honest_training_as_alone() {
    let keys = tempfile::tempdir().unwrap();
    let reference_of = |nodes: &[(Vec<Value>, Value)], run: &str| {
        for (n, (records, bans)) in nodes.iter().enumerate() {
            for r in records {
                assert_eq!(
                    r["refused"],
                    serde_json::json!([]),
                    "{run} node{}: {r}",
                    n + 1
                );
            }
            assert!(bans.is_null(), "{run} node{} banned someone: {bans}", n + 1);
        }
        print_lowest_honest_cosine(run, nodes, &[]);
        val_losses(nodes)
    };

    // 25 %: six honest nodes, one of them on a tenth of the others' bandwidth, alone and then
    // beside two adversaries.
    let caps = &ONE_ON_A_TENTH;
    let alone = reference_of(&run(keys.path(), 6, &[], caps).await.0, "six alone");
    let quarter = [Poison::SignFlip, Poison::RandomDirection];
    let (nodes, adversaries) = run(keys.path(), 6, &quarter, caps).await;
    print_lowest_honest_cosine("25 %", &nodes, &adversaries);
    check("25 %", &nodes, &adversaries, &quarter);
    let one_anchor_rounds_25 = assert_one_anchor("25 %", &nodes);
    // The node on a tenth of the bandwidth still delivers: the others mix its model.
    let slow = nodes[5].0[0]["peer"].as_str().unwrap().to_string();
    for (n, (records, _)) in nodes[..5].iter().enumerate() {
        let mixed = records
            .iter()
            .filter(|r| mixed_peers(r).contains(&slow.as_str()))
            .count();
        eprintln!(
            "25 %: node{} mixed the slow node in {mixed} of {} rounds",
            n + 1,
            records.len()
        );
        assert!(
            mixed as u64 >= rounds() / 2,
            "node{} mixed the slow node in {mixed} rounds only",
            n + 1
        );
    }
    let (gap_25, nats_25, rounds_25) = worst_gap("25 %", &val_losses(&nodes), &alone);

    // 37.5 %: five of them, alone and then beside three.
    let alone = reference_of(&run(keys.path(), 5, &[], &[]).await.0, "five alone");
    let three_eighths = [Poison::Stale, Poison::Payloads, Poison::SignFlip];
    let (nodes, adversaries) = run(keys.path(), 5, &three_eighths, &[]).await;
    print_lowest_honest_cosine("37.5 %", &nodes, &adversaries);
    check("37.5 %", &nodes, &adversaries, &three_eighths);
    let one_anchor_rounds_37 = assert_one_anchor("37.5 %", &nodes);
    assert!(
        one_anchor_rounds_25 + one_anchor_rounds_37 >= 1,
        "no round in which every honest node mixed the same members"
    );
    let (gap_37, nats_37, rounds_37) = worst_gap("37.5 %", &val_losses(&nodes), &alone);

    eprintln!(
        "validation loss vs the same nodes alone: 25 %: worst gap {:.2} % ({nats_25:.3} nats) over \
         {rounds_25} rounds; 37.5 %: {:.2} % ({nats_37:.3} nats) over {rounds_37} rounds",
        gap_25 * 100.0,
        gap_37 * 100.0
    );
    assert!(rounds_25 >= 4 && rounds_37 >= 4, "too few rounds in common");
    // The goal is 3 %. At this scale the relative gap says little: the test text is six
    // sentences, memorised by round 6 (losses near 0.45 nats, where a small change in the
    // mix moves the loss by a large fraction). The bound tells a defended swarm from a
    // poisoned one (a × 1000 model took losses from 2 to 140–546 nats).
    assert!(nats_25 <= 0.5, "25 %: an honest loss {nats_25:.3} nats off");
    assert!(
        nats_37 <= 0.5,
        "37.5 %: an honest loss {nats_37:.3} nats off"
    );
    // On real text the goal, 3 %, is asserted (docs/security.md: 1.12–1.34 % at 25 % and
    // 1.69–2.65 % at 37.5 % in two invocations, each with its own identities: the margin is
    // 0.35 points at its smallest).
    if std::env::var_os("GASLOC_ADVERSARY_DATA").is_some() {
        assert!(
            gap_25 <= 0.03,
            "25 %: an honest loss {:.2} % off",
            gap_25 * 100.0
        );
        assert!(
            gap_37 <= 0.03,
            "37.5 %: an honest loss {:.2} % off",
            gap_37 * 100.0
        );
    }
}
