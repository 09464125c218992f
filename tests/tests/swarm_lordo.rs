//! The LoRDO inner optimizer in a real swarm: a bootstrap and three `gasloc-node join`
//! processes train the tiny model on loopback with `inner_optimizer = "lordo"` (rank 8,
//! ω 0.97) and bf16 model payloads on the one-peer topology. After every outer step each node
//! refreshes its bases from its round's mixed pseudo-gradient (the function the simulator
//! calls), so the bases leave their initial identity slices; a late joiner syncs the swarm's
//! state, seeds its bases from the synced outer momentum, and trains.
//!
//! Asserted: every node's validation loss falls far below a uniform guess, the bases moved
//! (a refresh with similarity below 1 in every node's log), the joiner's first loss is below
//! every original node's first, and no payload or state was refused.

use gasloc_tests::{
    field, join_command, prepare_byte_data, read_report, start_bootstrap, tiny_run, val_losses,
    Proc, UNIFORM_LOSS,
};
use std::time::Duration;

/// The similarities the node logged at its bases' refreshes.
fn refresh_similarities(node: &Proc) -> Vec<f64> {
    node.stderr_lines_with("lordo bases refreshed")
        .lines()
        .filter_map(|line| field(line, "similarity")?.parse().ok())
        .collect()
}

#[test]
fn three_nodes_train_with_lordo_and_a_late_joiner_starts_from_their_bases() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let manifest = dir.join("run.toml");
    let run = tiny_run(
        "swarm-lordo-test",
        17,
        "topology = \"one-peer\"\ninner_steps = 25\ninner_optimizer = \"lordo\"\n\
         payload = \"model-bf16\"\n",
    ) + "[lordo]\nrank = 8\nomega = 0.97\n";
    std::fs::write(&manifest, run).unwrap();
    let data = prepare_byte_data(dir);
    let (_bootstrap, boot) = start_bootstrap(dir, &manifest, 6000, 3500, 500, 1500);
    let home = |i: usize| dir.join(format!("node{i}"));
    const ROUNDS: &str = "7";
    let mut nodes: Vec<Proc> = (1..=3)
        .map(|i| {
            Proc::spawn(
                &format!("node{i}"),
                dir,
                join_command(&boot, &home(i), &data, &["--rounds", ROUNDS]),
            )
        })
        .collect();
    nodes[0].wait_for_line("round=2 ", Duration::from_secs(120));
    let mut late = Proc::spawn(
        "late",
        dir,
        join_command(&boot, &home(4), &data, &["--rounds", "3", "--sync-state"]),
    );
    let synced = late.wait_for_line("state_synced_from=", Duration::from_secs(120));
    assert_eq!(field(&synced, "refused"), Some(""), "{synced}");
    let seeded = late.wait_for_line("lordo_bases_from=", Duration::from_secs(60));
    assert_eq!(
        field(&seeded, "lordo_bases_from"),
        Some("synced_momentum"),
        "{seeded}"
    );
    late.expect_success(Duration::from_secs(120));
    for node in &mut nodes {
        node.expect_success(Duration::from_secs(120));
    }

    let firsts: Vec<f64> = (1..=3)
        .map(|i| val_losses(&read_report(&home(i)))[0])
        .collect();
    for (i, node) in nodes.iter().chain(std::iter::once(&late)).enumerate() {
        let records = read_report(&home(i + 1));
        for r in &records {
            assert_eq!(r["refused"], serde_json::json!([]), "{}: {r}", node.name);
        }
        let losses = val_losses(&records);
        assert!(losses.len() >= 3, "{}: {losses:?}", node.name);
        let last = *losses.last().unwrap();
        assert!(
            last < losses[0] && last < 0.6 * UNIFORM_LOSS,
            "{}: {losses:?}",
            node.name
        );
        // The bases left their starting slices: some refresh moved them.
        let similarities = refresh_similarities(node);
        assert!(!similarities.is_empty(), "{}: no refresh logged", node.name);
        assert!(
            similarities.iter().all(|s| (0.0..=1.0 + 1e-4).contains(s))
                && similarities.iter().any(|&s| s < 0.99),
            "{}: {similarities:?}",
            node.name
        );
    }
    let joiner_first = val_losses(&read_report(&home(4)))[0];
    assert!(
        firsts.iter().all(|&f| joiner_first < f),
        "the joiner's first loss {joiner_first} against the others' {firsts:?}"
    );
}

/// Per exchange, the bytes a node received in `round`'s records (the payloads it read in
/// full), over every node's records.
fn bytes_per_exchange(records: &[serde_json::Value], full_sync_every: u64) -> (Vec<f64>, Vec<f64>) {
    let (mut regular, mut full) = (Vec::new(), Vec::new());
    for r in records {
        let exchanged = r["exchanged"].as_array().map_or(0, Vec::len);
        if exchanged == 0 {
            continue;
        }
        let per = r["bytes_received"].as_f64().unwrap() / exchanged as f64;
        match r["round"].as_u64().unwrap().is_multiple_of(full_sync_every) {
            true => full.push(per),
            false => regular.push(per),
        }
    }
    (regular, full)
}

/// The `lordo` payload in a real swarm of the demo model's shape (d 128, 4 layers, byte
/// vocabulary): three nodes and a late joiner exchange each round the low-rank factors of
/// their pseudo-gradients (rank 8) and, every 8th round, their anchors too.
///
/// Asserted: every node's validation loss falls; no payload or state is refused; every
/// node's bases moved; the joiner mixed a full-sync round; the checkpoints hold the payload
/// error; and a payload's bytes, over a cycle of 8 rounds, are at most 0.4 × those of a
/// `model-bf16` payload. That size is measured in the same swarm: a full-sync payload is a
/// regular one plus the anchor in bf16, which is exactly a `model-bf16` payload.
#[test]
fn four_nodes_exchange_lordo_payloads_at_under_two_fifths_of_the_model_bytes() {
    const EVERY: u64 = 8;
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let manifest = dir.join("run.toml");
    let run = format!(
        "name = \"swarm-lordo-payload-test\"\nseed = 5\n[model]\nd_model = 128\nn_layers = 4\n\
         n_heads = 4\nn_kv_heads = 2\n[data]\ntokenizer = \"byte\"\nseq_len = 32\nmicro_batch = 8\n\
         [optimizer]\nlr = 3e-3\nwarmup_steps = 10\ndecay_steps = 2000\n[eval]\nbatches = 4\n\
         [outer]\ntopology = \"one-peer\"\ninner_steps = 10\ninner_optimizer = \"lordo\"\n\
         payload = \"lordo\"\n[lordo]\nrank = 8\nomega = 0.97\nfull_sync_every = {EVERY}\n"
    );
    std::fs::write(&manifest, run).unwrap();
    let data = prepare_byte_data(dir);
    let (_bootstrap, boot) = start_bootstrap(dir, &manifest, 6000, 4000, 500, 2000);
    let home = |i: usize| dir.join(format!("node{i}"));
    // No `--rounds`: on a loaded machine a node may miss a round, which a fixed count turns
    // into a failed exit; the nodes run until the joiner has passed the full-sync round 8,
    // then stop cleanly (SIGTERM: the round in flight finishes).
    let mut nodes: Vec<Proc> = (1..=3)
        .map(|i| {
            Proc::spawn(
                &format!("node{i}"),
                dir,
                join_command(&boot, &home(i), &data, &[]),
            )
        })
        .collect();
    nodes[0].wait_for_line("round=2 ", Duration::from_secs(120));
    let mut late = Proc::spawn(
        "late",
        dir,
        join_command(&boot, &home(4), &data, &["--sync-state"]),
    );
    let synced = late.wait_for_line("state_synced_from=", Duration::from_secs(120));
    assert_eq!(field(&synced, "refused"), Some(""), "{synced}");
    let start = std::time::Instant::now();
    let past_the_sync = |records: &[serde_json::Value]| {
        records
            .iter()
            .any(|r| r["round"].as_u64().is_some_and(|round| round > EVERY))
    };
    while !past_the_sync(&read_report(&home(4))) && start.elapsed() < Duration::from_secs(150) {
        std::thread::sleep(Duration::from_millis(500));
    }
    for node in std::iter::once(&mut late).chain(nodes.iter_mut()) {
        node.terminate();
    }
    late.expect_success(Duration::from_secs(60));
    for node in &mut nodes {
        node.expect_success(Duration::from_secs(60));
    }

    let mut all_records = Vec::new();
    for (i, node) in nodes.iter().chain(std::iter::once(&late)).enumerate() {
        let records = read_report(&home(i + 1));
        for r in &records {
            assert_eq!(r["refused"], serde_json::json!([]), "{}: {r}", node.name);
            assert!(
                r["gate"].as_array().is_none_or(|g| g
                    .iter()
                    .all(|reading| reading["distance"].as_f64().is_some_and(f64::is_finite))),
                "{}: {r}",
                node.name
            );
        }
        let losses = val_losses(&records);
        assert!(losses.len() >= 3, "{}: {losses:?}", node.name);
        let last = *losses.last().unwrap();
        assert!(
            last < losses[0] && last < 0.6 * UNIFORM_LOSS,
            "{}: {losses:?}\n{}",
            node.name,
            node.output()
        );
        assert!(
            refresh_similarities(node).iter().any(|&s| s < 0.99),
            "{}: the bases never moved",
            node.name
        );
        // The payload error is saved beside the outer momentum.
        let latest = std::fs::read_to_string(home(i + 1).join("checkpoints/latest")).unwrap();
        let outer = std::fs::read(
            home(i + 1)
                .join("checkpoints")
                .join(latest.trim())
                .join("outer.safetensors"),
        )
        .unwrap();
        assert!(
            outer.windows(14).any(|w| w == b"payload_error."),
            "{}: no payload error in the checkpoint",
            node.name
        );
        all_records.extend(records);
    }
    // The joiner took part in a full-sync round (round 8).
    let joiner = read_report(&home(4));
    assert!(
        joiner
            .iter()
            .any(|r| r["round"].as_u64().unwrap().is_multiple_of(EVERY)
                && r["exchanged"].as_array().is_some_and(|e| !e.is_empty())),
        "the joiner never exchanged on a full-sync round: {joiner:?}"
    );

    let (regular, full) = bytes_per_exchange(&all_records, EVERY);
    assert!(
        !regular.is_empty() && !full.is_empty(),
        "{regular:?} {full:?}"
    );
    // Every payload of a kind is the same size (its table's).
    let same = |v: &[f64]| v.iter().all(|&b| b == v[0]);
    assert!(same(&regular) && same(&full), "{regular:?} {full:?}");
    let model_bf16 = full[0] - regular[0];
    let per_round = (regular[0] * (EVERY - 1) as f64 + full[0]) / EVERY as f64;
    let ratio = per_round / model_bf16;
    println!(
        "lordo payload: {} B per regular round, {} B per full sync, model-bf16 {} B: {ratio:.3} of it per round over {EVERY} rounds",
        regular[0], full[0], model_bf16
    );
    assert!(ratio <= 0.4, "{ratio}");
}
