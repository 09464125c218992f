//! Shared fixtures for the node's tests: a tiny run manifest and a small byte-token data
//! directory written as real llm.c shards.
#![allow(dead_code)]

use gasloc_data::shards::{write_shard, TokenWidth};
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

/// Deterministic English-like text: a few sentences in a pseudo-random order.
pub fn sample_text(bytes: usize) -> String {
    const SENTENCES: [&str; 6] = [
        "To be, or not to be, that is the question. ",
        "All the world's a stage, and all the men and women merely players. ",
        "The quality of mercy is not strained. ",
        "Now is the winter of our discontent. ",
        "What's in a name? That which we call a rose would smell as sweet. ",
        "Brevity is the soul of wit. ",
    ];
    let mut out = String::new();
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    while out.len() < bytes {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.push_str(SENTENCES[(state % SENTENCES.len() as u64) as usize]);
    }
    out.truncate(bytes);
    out
}

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
