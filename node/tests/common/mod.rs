//! Shared fixtures for the node's tests: a tiny run manifest and a small byte-token data
//! directory written as real llm.c shards.
#![allow(dead_code)]

use gasloc_data::shards::{write_shard, TokenWidth};
use gasloc_node::volunteer::{RunDataSource, Volunteer, VolunteerOptions};
use gasloc_p2p::PeerId;
use gasloc_proto::RunManifest;
use std::path::{Path, PathBuf};

/// The tiny manifest used across tests: byte tokens, GQA (4 query / 2 kv heads).
pub const TINY_RUN: &str = r#"
name = "test-tiny"
seed = 7

[model]
size = "tiny"

[data]
tokenizer = "byte"
seq_len = 32
micro_batch = 4
grad_accum = 2

[optimizer]
lr = 3e-3
warmup_steps = 5
decay_steps = 200

[eval]
interval = 10
batches = 2
"#;

/// Writes `text` (a manifest) to `dir/run.toml` and parses it.
pub fn write_manifest(dir: &Path, text: &str) -> (PathBuf, RunManifest) {
    let path = dir.join("run.toml");
    std::fs::write(&path, text).unwrap();
    let manifest = RunManifest::load(&path).unwrap();
    (path, manifest)
}

pub use gasloc_tests::sample_text;

/// A data directory with one byte-token training shard and one validation shard.
pub fn byte_data(dir: &Path) -> PathBuf {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let train: Vec<u32> = sample_text(40_000).bytes().map(u32::from).collect();
    let val: Vec<u32> = sample_text(8_000).bytes().rev().map(u32::from).collect();
    write_shard(&data.join("test_train_000000.bin"), &train, TokenWidth::U16).unwrap();
    write_shard(&data.join("test_val_000000.bin"), &val, TokenWidth::U16).unwrap();
    data
}

/// The options of a libtorch volunteer (the trainer behind `join`) of the run `run_text` in
/// `home`, on the CPU with one thread, over [`byte_data`]; a checkpoint every
/// `checkpoint_every` rounds under `home/checkpoints` (0: none).
pub fn volunteer_options(home: &Path, run_text: &str, checkpoint_every: u64) -> VolunteerOptions {
    std::fs::create_dir_all(home).unwrap();
    let (_, manifest) = write_manifest(home, run_text);
    VolunteerOptions {
        manifest,
        device: tch::Device::Cpu,
        data: RunDataSource::Given(byte_data(home)),
        checkpoints: home.join("checkpoints"),
        checkpoint_every,
        keep_checkpoints: 1,
        eval_every: 0,
        threads: 1,
        peer: PeerId::random(),
    }
}

/// A volunteer of [`volunteer_options`], started.
pub fn start_volunteer(home: &Path, run_text: &str, checkpoint_every: u64) -> Volunteer {
    Volunteer::start(volunteer_options(home, run_text, checkpoint_every)).unwrap()
}
