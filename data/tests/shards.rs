//! The shard reader accepts good uint16 and uint32 shards and refuses each kind of bad
//! one with an error that names the file.

use gasloc_data::{read_shard, write_shard, DataError, TokenDataset, TokenWidth};
use std::path::Path;

/// A shard file written byte by byte, so it can be wrong on purpose.
fn raw_shard(magic: i32, version: i32, header_count: i32, token_bytes: &[u8]) -> Vec<u8> {
    let mut header = vec![0i32; 256];
    header[0] = magic;
    header[1] = version;
    header[2] = header_count;
    let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    bytes.extend_from_slice(token_bytes);
    bytes
}

fn u16_bytes(tokens: &[u16]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

fn assert_refused(path: &Path, vocab_size: usize, expected: &str) {
    let error = read_shard(path, vocab_size).expect_err("a bad shard must be refused");
    let message = error.to_string();
    assert!(
        message.contains(&path.display().to_string()),
        "error does not name the file: {message}"
    );
    assert!(
        message.contains(expected),
        "expected {expected:?} in: {message}"
    );
}

#[test]
fn good_u16_and_u32_shards_read_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let small: Vec<u32> = (0..1000).map(|i| (i * 37) % 50257).collect();
    let large: Vec<u32> = (0..1000).map(|i| 100_000 + i * 7).collect();
    let u16_path = dir.path().join("a_train_000000.bin");
    let u32_path = dir.path().join("b_train_000000.bin");
    write_shard(&u16_path, &small, TokenWidth::U16).unwrap();
    write_shard(&u32_path, &large, TokenWidth::U32).unwrap();

    // The exact llm.c layout: 1024-byte header, then 2 or 4 bytes per token.
    let bytes = std::fs::read(&u16_path).unwrap();
    assert_eq!(bytes.len(), 1024 + 2 * small.len());
    assert_eq!(&bytes[0..4], &20240520i32.to_le_bytes());
    assert_eq!(&bytes[4..8], &1i32.to_le_bytes());
    assert_eq!(&bytes[8..12], &1000i32.to_le_bytes());
    assert!(bytes[12..1024].iter().all(|&b| b == 0));
    assert_eq!(&bytes[1026..1028], &(37u16).to_le_bytes());
    let bytes = std::fs::read(&u32_path).unwrap();
    assert_eq!(bytes.len(), 1024 + 4 * large.len());
    assert_eq!(
        &bytes[0..8],
        &[20240801i32.to_le_bytes(), 7i32.to_le_bytes()].concat()[..]
    );

    let shard = read_shard(&u16_path, 50257).unwrap();
    assert_eq!((shard.width(), shard.len()), (TokenWidth::U16, 1000));
    assert_eq!(shard.to_u32_vec(), small);
    let shard = read_shard(&u32_path, 200_000).unwrap();
    assert_eq!((shard.width(), shard.len()), (TokenWidth::U32, 1000));
    assert_eq!(shard.to_u32_vec(), large);
    let mut as_i64 = Vec::new();
    shard.extend_i64(10, 3, &mut as_i64);
    assert_eq!(as_i64, vec![100_070, 100_077, 100_084]);
    // No temporary file is left beside the shards.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
}

#[test]
fn dataset_splits_validation_from_training_and_ignores_other_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_shard(&d.join("x_val_000000.bin"), &[1, 2, 3], TokenWidth::U16).unwrap();
    write_shard(&d.join("x_train_000001.bin"), &[4, 5], TokenWidth::U16).unwrap();
    write_shard(
        &d.join("x_train_000000.bin"),
        &[6, 7, 8, 9],
        TokenWidth::U32,
    )
    .unwrap();
    std::fs::write(d.join("README.txt"), "not a shard").unwrap();
    std::fs::create_dir(d.join("nested.bin")).unwrap();

    let data = TokenDataset::open(d, 10).unwrap();
    assert_eq!((data.train_tokens(), data.val_tokens()), (6, 3));
    let train: Vec<_> = data
        .train_shards()
        .unwrap()
        .iter()
        .map(|s| s.to_u32_vec())
        .collect();
    assert_eq!(
        train,
        vec![vec![6, 7, 8, 9], vec![4, 5]],
        "shards in file-name order"
    );
    assert_eq!(data.val_shards()[0].to_u32_vec(), vec![1, 2, 3]);
}

#[test]
fn missing_file_and_missing_or_empty_directory_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("gone_train_000000.bin");
    assert_refused(&missing, 256, "No such file");

    let missing_dir = dir.path().join("nowhere");
    let error = TokenDataset::open(&missing_dir, 256).unwrap_err();
    assert!(matches!(error, DataError::Directory { .. }), "{error}");
    assert!(error.to_string().contains("nowhere"), "{error}");

    let error = TokenDataset::open(dir.path(), 256).unwrap_err();
    assert!(
        matches!(error, DataError::NoTrainingShards { .. }),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .contains(&dir.path().display().to_string()),
        "{error}"
    );

    // Validation shards alone are no training data either.
    write_shard(
        &dir.path().join("x_val_000000.bin"),
        &[1, 2],
        TokenWidth::U16,
    )
    .unwrap();
    let error = TokenDataset::open(dir.path(), 256).unwrap_err();
    assert!(
        matches!(error, DataError::NoTrainingShards { .. }),
        "{error}"
    );
}

#[test]
fn truncated_shards_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x_train_000000.bin");
    std::fs::write(&path, raw_shard(20240520, 1, 1000, &[0u8; 1500])).unwrap();
    assert_refused(
        &path,
        256,
        "truncated: header says 1000 tokens (2000 bytes) but the file has 1500 bytes after the header",
    );

    std::fs::write(&path, &raw_shard(20240520, 1, 0, &[])[..100]).unwrap();
    assert_refused(
        &path,
        256,
        "truncated: the file has 100 bytes, fewer than the 1024-byte header",
    );

    std::fs::write(&path, b"").unwrap();
    assert_refused(&path, 256, "truncated: the file has 0 bytes");

    // A uint32 shard read with the uint16 size would pass; check the u32 arithmetic.
    std::fs::write(&path, raw_shard(20240801, 7, 10, &[0u8; 20])).unwrap();
    assert_refused(
        &path,
        256,
        "header says 10 tokens (40 bytes) but the file has 20 bytes",
    );
}

#[test]
fn a_file_longer_than_its_header_says_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x_train_000000.bin");
    std::fs::write(&path, raw_shard(20240520, 1, 3, &u16_bytes(&[1, 2, 3, 4]))).unwrap();
    assert_refused(
        &path,
        256,
        "too long: header says 3 tokens (6 bytes) but the file has 8 bytes",
    );

    std::fs::write(&path, raw_shard(20240520, 1, -5, &[])).unwrap();
    assert_refused(&path, 256, "negative token count -5");
}

#[test]
fn wrong_magic_and_wrong_version_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x_train_000000.bin");
    std::fs::write(&path, raw_shard(1234, 1, 1, &u16_bytes(&[1]))).unwrap();
    assert_refused(
        &path,
        256,
        "wrong magic 1234 (expected 20240520 or 20240801)",
    );

    std::fs::write(&path, raw_shard(20240520, 7, 1, &u16_bytes(&[1]))).unwrap();
    assert_refused(
        &path,
        256,
        "wrong version 7 for magic 20240520 (expected 1)",
    );

    std::fs::write(&path, raw_shard(20240801, 1, 1, &1u32.to_le_bytes())).unwrap();
    assert_refused(
        &path,
        256,
        "wrong version 1 for magic 20240801 (expected 7)",
    );
}

#[test]
fn tokens_beyond_the_vocabulary_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x_train_000000.bin");
    let mut tokens = vec![65u32; 40];
    tokens[17] = 300;
    write_shard(&path, &tokens, TokenWidth::U16).unwrap();
    assert_refused(
        &path,
        256,
        "token 300 at position 17 is beyond the vocabulary of 256",
    );
    // The vocabulary is exclusive: token 256 is already outside a 256-token vocabulary.
    tokens[17] = 256;
    write_shard(&path, &tokens, TokenWidth::U32).unwrap();
    assert_refused(
        &path,
        256,
        "token 256 at position 17 is beyond the vocabulary of 256",
    );
    assert!(read_shard(&path, 257).is_ok());
}

#[test]
fn a_bad_shard_among_good_ones_fails_the_dataset_and_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_shard(&d.join("x_train_000000.bin"), &[1, 2, 3], TokenWidth::U16).unwrap();
    let bad = d.join("x_train_000001.bin");
    std::fs::write(&bad, raw_shard(20240520, 1, 4, &u16_bytes(&[1, 2]))).unwrap();
    let message = TokenDataset::open(d, 256).unwrap_err().to_string();
    assert!(
        message.contains("x_train_000001.bin") && message.contains("truncated"),
        "{message}"
    );

    std::fs::write(&bad, raw_shard(20240520, 1, 2, &u16_bytes(&[1, 999]))).unwrap();
    let message = TokenDataset::open(d, 256).unwrap_err().to_string();
    assert!(
        message.contains("x_train_000001.bin") && message.contains("token 999"),
        "{message}"
    );
}

#[test]
fn write_shard_refuses_tokens_too_wide_for_uint16_and_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x_train_000000.bin");
    let message = write_shard(&path, &[1, 70_000], TokenWidth::U16)
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("x_train_000000.bin") && message.contains("70000"),
        "{message}"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    let unwritable = dir.path().join("no-such-dir").join("x.bin");
    let message = write_shard(&unwritable, &[1], TokenWidth::U16)
        .unwrap_err()
        .to_string();
    assert!(message.contains("no-such-dir"), "{message}");
}

#[test]
fn debug_output_of_a_dataset_does_not_list_its_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..10_000).map(|i| 1000 + i % 1000).collect();
    write_shard(
        &dir.path().join("x_train_000000.bin"),
        &tokens,
        TokenWidth::U16,
    )
    .unwrap();
    let data = TokenDataset::open(dir.path(), 50257).unwrap();
    let shown = format!("{data:?}");
    assert!(shown.contains("len: 10000") && shown.len() < 500, "{shown}");
}
