//! The simulator on real tiny data: the invariants that need whole runs.

mod common;

use common::{byte_data, TINY_RUN};
use gasloc_data::shards::TokenDataset;
use gasloc_node::sim::clock::Straggler;
use gasloc_node::sim::{SimOptions, Simulation, SwarmRound};
use gasloc_proto::RunManifest;
use std::sync::{Arc, Mutex};
use tch::Tensor;

fn manifest(outer: &str) -> RunManifest {
    manifest_with(outer, "")
}

fn manifest_with(outer: &str, extra: &str) -> RunManifest {
    RunManifest::parse(&format!("{TINY_RUN}\n[outer]\n{outer}\n{extra}"), "test").unwrap()
}

fn options(workers: usize, rounds: u64) -> SimOptions {
    SimOptions {
        workers,
        rounds,
        stragglers: Vec::new(),
        bandwidth_mbps: 100.0,
        latency_ms: 10.0,
        step_time_ms: Some(20.0),
        eval_every: 1,
    }
}

/// Parameter init seeds libtorch's global RNG (`tch::manual_seed`): simulations in parallel
/// test threads would interleave their draws, so they take turns.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn simulate(m: &RunManifest, o: SimOptions) -> (Vec<SwarmRound>, Vec<Vec<Tensor>>) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let data = Arc::new(TokenDataset::open(&byte_data(dir.path()), 256).unwrap());
    let mut sim = Simulation::new(m, data, o.clone()).unwrap();
    let records = (0..o.rounds).map(|_| sim.run_round().unwrap()).collect();
    (records, sim.anchors().unwrap())
}

fn same_bits(a: &[Vec<Tensor>], b: &[Vec<Tensor>]) -> bool {
    a.iter()
        .zip(b)
        .all(|(x, y)| x.iter().zip(y).all(|(s, t)| s.equal(t)))
}

#[test]
fn complete_topology_with_nesterov_is_diloco_bit_for_bit() {
    let (gasloc, anchors_g) = simulate(
        &manifest(
            "algorithm = \"gasloc\"\ntopology = \"complete\"\ninner_steps = 3\noverlap = \"none\"",
        ),
        options(4, 3),
    );
    let (diloco, anchors_d) = simulate(
        &manifest("algorithm = \"diloco\"\ninner_steps = 3"),
        options(4, 3),
    );
    assert!(same_bits(&anchors_g, &anchors_d));
    // …and every GASLoC worker holds the same anchor.
    assert!(same_bits(&anchors_g[..1], &anchors_g[3..]));
    for (g, d) in gasloc.iter().zip(&diloco) {
        assert_eq!(g.val_loss, d.val_loss);
        assert_eq!(g.consensus, 0.0);
    }
}

#[test]
fn the_same_seed_gives_the_same_run() {
    let m = manifest("topology = \"one-peer\"\ninner_steps = 2");
    let (a, anchors_a) = simulate(&m, options(4, 3));
    let (b, anchors_b) = simulate(&m, options(4, 3));
    assert!(same_bits(&anchors_a, &anchors_b));
    let losses = |r: &[SwarmRound]| -> Vec<f64> {
        r.iter()
            .flat_map(|r| r.workers.iter().map(|w| w.train_loss))
            .collect()
    };
    assert_eq!(losses(&a), losses(&b));
    // Gossip leaves the anchors apart, but a one-peer round shrinks the gap.
    assert!(a.iter().all(|r| r.consensus > 0.0));
    let other = RunManifest::parse(
        &format!(
            "{}\n[outer]\ntopology = \"one-peer\"\ninner_steps = 2",
            TINY_RUN.replace("seed = 7", "seed = 8")
        ),
        "t",
    )
    .unwrap();
    let (_, anchors_c) = simulate(&other, options(4, 3));
    assert!(!same_bits(&anchors_a, &anchors_c));
}

#[test]
fn every_algorithm_trains_and_ddp_keeps_workers_identical() {
    for (outer, rounds) in [
        (
            "algorithm = \"gasloc\"\ntopology = \"two-peer\"\ninner_steps = 4",
            4,
        ),
        ("algorithm = \"local-dadam\"\ninner_steps = 4", 4),
        ("algorithm = \"dadam\"\ntopology = \"ring\"", 12),
        ("algorithm = \"ddp\"", 12),
    ] {
        let (records, anchors) = simulate(&manifest(outer), options(3, rounds));
        let first = records[0].val_loss.unwrap();
        let last = records.last().unwrap().val_loss.unwrap();
        assert!(last < first, "{outer}: {first} → {last}");
        if outer.contains("ddp") {
            assert!(same_bits(&anchors[..1], &anchors[1..2]));
            assert!(records.iter().all(|r| r.consensus == 0.0));
        }
    }
}

#[test]
fn lordo_payload_sends_less_than_the_model_and_resyncs_every_k_rounds() {
    let m = manifest_with(
        "inner_steps = 2\ninner_optimizer = \"lordo\"\npayload = \"lordo\"",
        "[lordo]\nrank = 4\nfull_sync_every = 3",
    );
    let (records, _) = simulate(&m, options(4, 6));
    let full: Vec<bool> = records.iter().map(|r| r.full_sync).collect();
    assert_eq!(full, vec![false, false, true, false, false, true]);
    let low = records[0].bytes_sent();
    let model = records[2].bytes_sent();
    assert!(low * 2 < model, "lordo {low} vs bf16 model {model}");
    assert!(records.iter().all(|r| r.val_loss.unwrap().is_finite()));
}

#[test]
fn adaptive_h_shortens_the_straggler_rounds_only() {
    // Blocking rounds: the exchange's time comes out of the straggler's and its partner's steps.
    let m = manifest(
        "inner_steps = 10\nadaptive_inner_steps = true\nmin_inner_steps = 2\noverlap = \"none\"",
    );
    let mut o = options(4, 3);
    o.stragglers = vec![Straggler {
        worker: 2,
        fraction: 0.05,
    }];
    let (records, _) = simulate(&m, o);
    for r in &records {
        let partner_of_2: Vec<usize> = r
            .workers
            .iter()
            .filter(|w| w.inner_steps < 10)
            .map(|w| w.worker)
            .collect();
        assert!(partner_of_2.contains(&2), "{partner_of_2:?}");
        assert_eq!(
            partner_of_2.len(),
            2,
            "the straggler and its one-peer partner"
        );
    }
}

#[test]
fn bad_options_are_refused_with_the_flag_named() {
    let m = manifest("inner_steps = 2");
    let dir = tempfile::tempdir().unwrap();
    let data = Arc::new(TokenDataset::open(&byte_data(dir.path()), 256).unwrap());
    let mut o = options(4, 1);
    o.stragglers = vec![Straggler {
        worker: 4,
        fraction: 0.1,
    }];
    let e = Simulation::new(&m, data.clone(), o)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("--straggler 4:0.1"), "{e}");
    let e = Simulation::new(&m, data, options(0, 1))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("--workers"), "{e}");
}

/// An exchange that takes no time: no bandwidth limit, no latency.
fn instantaneous(workers: usize, rounds: u64) -> SimOptions {
    SimOptions {
        bandwidth_mbps: f64::INFINITY,
        latency_ms: 0.0,
        ..options(workers, rounds)
    }
}

#[test]
fn delayed_overlap_with_an_instantaneous_exchange_is_the_blocking_run_bit_for_bit() {
    for outer in [
        "topology = \"one-peer\"\ninner_steps = 3\nfragments = 1",
        "topology = \"two-peer\"\ninner_steps = 3\nfragments = 1",
        "algorithm = \"diloco\"\ninner_steps = 3\nfragments = 1",
        "topology = \"two-peer\"\ninner_steps = 3\nfragments = 3",
        "algorithm = \"diloco\"\ninner_steps = 3\nfragments = 2",
    ] {
        // The same settings spelled out for both (delayed's own defaults differ).
        let (blocking, anchors_b) = simulate(
            &manifest(&format!("{outer}\noverlap = \"none\"")),
            instantaneous(4, 4),
        );
        let (delayed, anchors_d) = simulate(
            &manifest(&format!("{outer}\noverlap = \"delayed\"\nmomentum = 0.9")),
            instantaneous(4, 4),
        );
        assert!(same_bits(&anchors_b, &anchors_d), "{outer}: anchors differ");
        for (b, d) in blocking.iter().zip(&delayed) {
            assert_eq!(b.val_loss, d.val_loss, "{outer}: round {}", b.round);
            assert_eq!(b.consensus, d.consensus, "{outer}: round {}", b.round);
            assert_eq!(
                b.mean_train_loss(),
                d.mean_train_loss(),
                "{outer}: round {}",
                b.round
            );
        }
    }
}

/// With `fragments = P` a round mixes and outer-steps only its fragment: after round t the
/// anchors' tensors outside fragment `(t − 1) mod P` (the simulator counts rounds from 1) are
/// those of round t − 1 bit for bit,
/// those inside have moved, and the record's bytes are the fragment's.
#[test]
fn a_fragmented_round_moves_only_its_fragment() {
    use gasloc_node::algo::outer::model_fragments;
    use gasloc_node::algo::payload::model_bytes;
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let data = Arc::new(TokenDataset::open(&byte_data(dir.path()), 256).unwrap());
    for overlap in ["none", "delayed"] {
        let m = manifest(&format!(
            "topology = \"one-peer\"\ninner_steps = 2\nfragments = 3\noverlap = \"{overlap}\""
        ));
        let mut sim = Simulation::new(&m, data.clone(), instantaneous(4, 4)).unwrap();
        let mut before = sim.anchors().unwrap();
        let fragments = model_fragments(&before[0], 3).unwrap();
        for round in 1..=4u64 {
            let record = sim.run_round().unwrap();
            let after = sim.anchors().unwrap();
            // The simulator's round t is the node's t − 1 (numbered from 0).
            let members = fragments.of_round_members(round - 1);
            for (b, a) in before.iter().zip(&after) {
                for (k, (x, y)) in b.iter().zip(a).enumerate() {
                    assert_eq!(
                        x.equal(y),
                        !members.contains(&k),
                        "{overlap}, round {round}, tensor {k} (fragment {members:?})"
                    );
                }
            }
            let fragment: Vec<Tensor> = members.iter().map(|&k| after[0][k].copy()).collect();
            assert_eq!(
                record.workers[0].bytes_sent,
                model_bytes(&fragment, 4),
                "{overlap}, round {round}: one fragment, fp32, to one peer"
            );
            before = after;
        }
    }
}

/// The record's two validation losses: after a blocking whole-model round the models in
/// training are the anchors, so the two are equal; in fragments the models in training keep
/// the other fragments' unsynced steps, which their anchors do not have, so the two differ.
#[test]
fn the_models_in_training_are_evaluated_beside_the_anchors() {
    let whole = "topology = \"one-peer\"\ninner_steps = 3\noverlap = \"none\"";
    let (blocking, _) = simulate(&manifest(whole), options(4, 3));
    for r in &blocking {
        assert_eq!(r.local_val_loss, r.val_loss, "round {}", r.round);
    }
    let (fragmented, _) = simulate(&manifest(&format!("{whole}\nfragments = 3")), options(4, 3));
    for r in &fragmented {
        let (anchors, local) = (r.val_loss.unwrap(), r.local_val_loss.unwrap());
        assert!(local.is_finite() && anchors.is_finite());
        assert_ne!(
            local, anchors,
            "round {}: the unsynced fragments count",
            r.round
        );
    }
}

#[test]
fn eager_overlap_with_an_instantaneous_exchange_is_the_blocking_run_up_to_rounding() {
    // The own step and the neighbours' terms added to it give the blocking outer step up to
    // rounding; the payload is the model handed off, not the anchor eager moves on to.
    let outer = "topology = \"two-peer\"\ninner_steps = 3";
    let blocking = manifest(&format!("{outer}\noverlap = \"none\""));
    let (blocking, _) = simulate(&blocking, instantaneous(4, 4));
    let (eager, _) = simulate(
        &manifest(&format!("{outer}\noverlap = \"eager\"")),
        instantaneous(4, 4),
    );
    for (b, e) in blocking.iter().zip(&eager) {
        let (b, e) = (b.val_loss.unwrap(), e.val_loss.unwrap());
        assert!((b - e).abs() < 1e-3, "round: blocking {b}, eager {e}");
    }
}

#[test]
fn eager_overlap_without_a_neighbour_is_the_blocking_run_bit_for_bit() {
    let outer = "topology = \"one-peer\"\ninner_steps = 3";
    let blocking = manifest(&format!("{outer}\noverlap = \"none\""));
    let (blocking, anchors_b) = simulate(&blocking, options(1, 3));
    let (eager, anchors_e) = simulate(
        &manifest(&format!("{outer}\noverlap = \"eager\"")),
        options(1, 3),
    );
    assert!(same_bits(&anchors_b, &anchors_e));
    for (b, e) in blocking.iter().zip(&eager) {
        assert_eq!(b.val_loss, e.val_loss, "round {}", b.round);
    }
}

#[test]
fn overlapped_rounds_train_through_a_slow_exchange_and_still_learn() {
    // 20 ms steps, H = 6: 120 ms of compute; the tiny model's fp32 payload (~0.5 MB) to two
    // neighbours over 140 Mbit/s with 20 ms latency takes ~80 ms more, which a blocking round
    // spends idle and an overlapped one hides behind the next round's steps.
    let slow = SimOptions {
        bandwidth_mbps: 140.0,
        latency_ms: 20.0,
        ..options(4, 6)
    };
    let outer = "topology = \"two-peer\"\ninner_steps = 6\nmomentum = 0.5\nfragments = 1";
    let (blocking, _) = simulate(
        &manifest(&format!("{outer}\noverlap = \"none\"")),
        slow.clone(),
    );
    let busy = |r: &[SwarmRound]| {
        r.iter().map(|r| r.mean_compute_utilization()).sum::<f64>() / r.len() as f64
    };
    let blocking_busy = busy(&blocking);
    let vals = |r: &[SwarmRound]| r.iter().map(|r| r.val_loss.unwrap()).collect::<Vec<_>>();
    println!("none: {:?}", vals(&blocking));
    assert!(
        blocking_busy < 0.7,
        "the exchange should cost a blocking round time: {blocking_busy}"
    );
    for mode in ["delayed", "eager"] {
        let (overlapped, anchors) = simulate(
            &manifest(&format!("{outer}\noverlap = \"{mode}\"")),
            slow.clone(),
        );
        let overlapped_busy = busy(&overlapped);
        println!(
            "{mode}: {:?} utilisation {overlapped_busy:.3} (none {blocking_busy:.3})",
            vals(&overlapped)
        );
        assert!(
            overlapped_busy > 0.97 && overlapped_busy > blocking_busy,
            "{mode}: utilisation {overlapped_busy} (blocking {blocking_busy})"
        );
        // Same inner steps in less simulated time.
        let last = |r: &[SwarmRound]| r.last().unwrap().sim_time_s;
        assert!(last(&overlapped) < last(&blocking), "{mode}");
        let first = overlapped[0].val_loss.unwrap();
        let end = overlapped.last().unwrap().val_loss.unwrap();
        assert!(end < first, "{mode}: validation loss {first} → {end}");
        let best = |r: &[SwarmRound]| vals(r).into_iter().fold(f64::INFINITY, f64::min);
        assert!(
            best(&overlapped) < 1.05 * best(&blocking),
            "{mode}: best validation loss {} against blocking {}",
            best(&overlapped),
            best(&blocking)
        );
        assert!(anchors
            .iter()
            .flatten()
            .all(|t| t.isfinite().all().int64_value(&[]) == 1));
    }
}
