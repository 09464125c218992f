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
