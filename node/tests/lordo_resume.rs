//! The `lordo` payload's error feedback across a restart: the payload error `E` (what earlier
//! payloads cut or rounded, sent in a later one) is saved in the node's checkpoint beside the
//! outer momentum and restored on resume, so a restarted node sends, byte for byte, the
//! payload it would have sent had it gone on; without its `E` it would send another.

mod common;

use common::{start_volunteer, volunteer_options, TINY_RUN};
use gasloc_node::checkpoint::{read_tensors, write_tensors, OUTER_FILE};
use gasloc_node::volunteer::{Start, Volunteer};
use gasloc_p2p::network::unix_ms;
use gasloc_p2p::tensors::TensorSet;
use gasloc_p2p::work::{Received, RoundWork, TrainDeadline, TrainOrder};
use gasloc_proto::topology::MixingRow;
use std::path::Path;

const LORDO: &str =
    "[outer]\ntopology = \"two-peer\"\ninner_steps = 4\ninner_optimizer = \"lordo\"\n\
                     payload = \"lordo\"\n[lordo]\nrank = 4\nfull_sync_every = 4\n";

async fn train(v: &mut Volunteer, round: u64) -> TensorSet {
    let deadline = TrainDeadline::new(unix_ms() + 60_000);
    v.train(TrainOrder { round, deadline })
        .await
        .unwrap()
        .payload
}

/// Round `round`'s outer step with no neighbour (this node's own payload alone).
async fn finish_alone(v: &mut Volunteer, round: u64) {
    let received = Received {
        round,
        mixing: MixingRow::uniform(0, &[]),
        payloads: Vec::new(),
        want_state: false,
    };
    v.finish(received).await.unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_lordo_node_sends_the_payload_it_would_have_sent() {
    let dir = tempfile::tempdir().unwrap();
    let run = format!("{TINY_RUN}\n{LORDO}");
    let mut going_on = start_volunteer(&dir.path().join("a"), &run, 1);
    // Rounds 0 and 1, each saved; round 2's payload is the one compared.
    for round in 0..2 {
        let _ = train(&mut going_on, round).await;
        finish_alone(&mut going_on, round).await;
    }
    for name in ["b", "c"] {
        copy_dir(
            &dir.path().join("a/checkpoints"),
            &dir.path().join(name).join("checkpoints"),
        );
    }
    let expected = train(&mut going_on, 2).await;

    let mut resumed = start_volunteer(&dir.path().join("b"), &run, 1);
    assert!(
        matches!(resumed.start_kind(), Start::Resumed { round: 2, .. }),
        "{:?}",
        resumed.start_kind()
    );
    let got = train(&mut resumed, 2).await;
    assert_eq!(got.tensors.len(), expected.tensors.len());
    for (a, b) in got.tensors.iter().zip(&expected.tensors) {
        assert!(
            a.name == b.name && a.data == b.data,
            "tensor {} differs",
            a.name
        );
    }

    // The same checkpoint with its payload error zeroed: the payload differs, so the error
    // was restored above, not found zero.
    let latest = std::fs::read_to_string(dir.path().join("c/checkpoints/latest")).unwrap();
    let outer = dir
        .path()
        .join("c/checkpoints")
        .join(latest.trim())
        .join(OUTER_FILE);
    let mut tensors = read_tensors(&outer).unwrap();
    let mut zeroed = 0;
    for (name, t) in &mut tensors {
        if name.starts_with("payload_error.") {
            assert!(t.abs().max().double_value(&[]) > 0.0, "{name} is zero");
            *t = t.zeros_like();
            zeroed += 1;
        }
    }
    assert!(zeroed > 0, "no payload error in the checkpoint");
    write_tensors(&outer, &tensors).unwrap();
    let mut forgetful = start_volunteer(&dir.path().join("c"), &run, 1);
    let other = train(&mut forgetful, 2).await;
    assert!(
        other
            .tensors
            .iter()
            .zip(&expected.tensors)
            .any(|(a, b)| a.data != b.data),
        "a zero payload error gave the same payload"
    );

    // A checkpoint without the payload error is refused, naming the tensor.
    let tensors: Vec<_> = read_tensors(&outer)
        .unwrap()
        .into_iter()
        .filter(|(name, _)| !name.starts_with("payload_error."))
        .collect();
    write_tensors(&outer, &tensors).unwrap();
    let refused = Volunteer::start(volunteer_options(&dir.path().join("c"), &run, 1));
    let error = format!(
        "{:#}",
        refused
            .err()
            .expect("a checkpoint without its payload error")
    );
    assert!(error.contains("payload_error."), "{error}");
}
