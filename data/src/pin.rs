//! Pinned data: the shard table of a run's manifest (`[[data.shards]]`), how it is made
//! from a data directory ([`pin_directory`]) and how a directory is checked against it
//! ([`verify_directory`]).
//!
//! A shard is pinned by its file name, split, byte length, token count and the SHA-256 of
//! the whole file. Hashing reads every byte (about 1 GB/s per core): callers run these
//! functions on a blocking thread, never on the async runtime's.

use crate::shards::{read_shard, shard_files, HEADER_BYTES};
use crate::{DataError, TokenDataset, TokenWidth};
use gasloc_proto::manifest::DataConfig;
use gasloc_proto::{ShardEntry, Split, Tokenizer};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// The SHA-256 of a file's bytes.
pub fn file_sha256(path: &Path) -> Result<[u8; 32], DataError> {
    let io_error = |source| DataError::ShardIo {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io_error)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buffer).map_err(io_error)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(hasher.finalize().into())
}

fn file_len(path: &Path) -> Result<u64, DataError> {
    std::fs::metadata(path)
        .map(|m| m.len())
        .map_err(|source| DataError::ShardIo {
            path: path.to_path_buf(),
            source,
        })
}

/// The table entry of one shard: opens and checks it completely (header, size, every token
/// inside the tokenizer's vocabulary), then hashes it.
pub fn pin_shard(path: &Path, tokenizer: Tokenizer) -> Result<ShardEntry, DataError> {
    let shard = read_shard(path, tokenizer.vocab_size())?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let bytes = file_len(path)?;
    Ok(ShardEntry {
        split: Split::of_file_name(&name),
        name,
        bytes,
        tokens: shard.len() as u64,
        sha256: hex::encode(file_sha256(path)?),
    })
}

/// The shard table of every `*.bin` shard in `dir`, in file-name order. Refuses a
/// directory without a training or a validation shard (a pinned run needs both).
pub fn pin_directory(dir: &Path, tokenizer: Tokenizer) -> Result<Vec<ShardEntry>, DataError> {
    let table = shard_files(dir)?
        .iter()
        .map(|path| pin_shard(path, tokenizer))
        .collect::<Result<Vec<_>, _>>()?;
    if !table.iter().any(|s| s.split == Split::Train) {
        return Err(DataError::NoTrainingShards {
            dir: dir.to_path_buf(),
        });
    }
    if !table.iter().any(|s| s.split == Split::Val) {
        return Err(DataError::NoValidationShards {
            dir: dir.to_path_buf(),
        });
    }
    Ok(table)
}

/// The length a shard of `tokens` tokens has for this tokenizer.
pub fn expected_shard_bytes(tokens: u64, tokenizer: Tokenizer) -> u64 {
    let width = TokenWidth::for_vocab(tokenizer.vocab_size());
    HEADER_BYTES as u64 + tokens * width.bytes_per_token() as u64
}

/// Checks one file against its table entry: length first (cheap), then the SHA-256.
pub fn verify_shard_file(path: &Path, entry: &ShardEntry) -> Result<(), DataError> {
    let bad = |problem: String| DataError::NotPinned {
        path: path.to_path_buf(),
        problem,
    };
    let bytes = file_len(path)?;
    if bytes != entry.bytes {
        return Err(bad(format!(
            "is {bytes} bytes long, the manifest pins {} bytes",
            entry.bytes
        )));
    }
    let digest = hex::encode(file_sha256(path)?);
    if digest != entry.sha256 {
        return Err(bad(format!(
            "has SHA-256 {digest}, the manifest pins {}",
            entry.sha256
        )));
    }
    Ok(())
}

/// Checks that `dir` holds exactly the pinned shards, byte for byte: every entry present
/// with its length and SHA-256, and no other `*.bin` file (the data loader would train on
/// it). The first mismatch is the error, naming the shard.
pub fn verify_directory(dir: &Path, table: &[ShardEntry]) -> Result<(), DataError> {
    for path in shard_files(dir)? {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if !table.iter().any(|e| e.name == name) {
            return Err(DataError::NotPinned {
                path: path.clone(),
                problem: "is not a shard of this run's manifest (remove it, or pin it \
                          with gasloc-node data pin)"
                    .into(),
            });
        }
    }
    for entry in table {
        let path = dir.join(&entry.name);
        if !path.is_file() {
            return Err(DataError::NotPinned {
                path,
                problem: "is missing: the manifest pins it".into(),
            });
        }
        verify_shard_file(&path, entry)?;
    }
    Ok(())
}

/// A run's data directory, opened for training: when the manifest pins its shards, the
/// directory is first checked against the table ([`verify_directory`]), so a node never
/// trains on other data than the run's; then every shard is read and checked
/// ([`TokenDataset::open`]).
pub fn open_run_data(dir: &Path, data: &DataConfig) -> Result<TokenDataset, DataError> {
    if !data.shards.is_empty() {
        verify_directory(dir, &data.shards)?;
    }
    TokenDataset::open(dir, data.tokenizer.vocab_size())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::write_shard;

    fn dataset(dir: &Path) {
        let tokens: Vec<u32> = (0..5000).map(|i| (i * 7 % 256) as u32).collect();
        write_shard(&dir.join("d_train_000000.bin"), &tokens, TokenWidth::U16).unwrap();
        write_shard(
            &dir.join("d_val_000000.bin"),
            &tokens[..600],
            TokenWidth::U16,
        )
        .unwrap();
    }

    #[test]
    fn a_pinned_directory_verifies_and_any_change_is_named() {
        let dir = tempfile::tempdir().unwrap();
        dataset(dir.path());
        let table = pin_directory(dir.path(), Tokenizer::Byte).unwrap();
        assert_eq!(table.len(), 2);
        assert_eq!(table[0].name, "d_train_000000.bin");
        assert_eq!(table[0].tokens, 5000);
        assert_eq!(table[0].bytes, expected_shard_bytes(5000, Tokenizer::Byte));
        assert_eq!(table[1].split, Split::Val);
        verify_directory(dir.path(), &table).unwrap();

        // One byte changed: same length, other hash.
        let train = dir.path().join("d_train_000000.bin");
        let mut bytes = std::fs::read(&train).unwrap();
        bytes[2000] ^= 1;
        std::fs::write(&train, &bytes).unwrap();
        let e = verify_directory(dir.path(), &table)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("d_train_000000.bin") && e.contains("SHA-256"),
            "{e}"
        );

        // Truncated.
        std::fs::write(&train, &bytes[..3000]).unwrap();
        let e = verify_directory(dir.path(), &table)
            .unwrap_err()
            .to_string();
        assert!(e.contains("3000 bytes long"), "{e}");

        // Missing, then a stranger next to the pinned ones.
        std::fs::remove_file(&train).unwrap();
        let e = verify_directory(dir.path(), &table)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("d_train_000000.bin") && e.contains("missing"),
            "{e}"
        );
        dataset(dir.path());
        std::fs::copy(&train, dir.path().join("other_train_000001.bin")).unwrap();
        let e = verify_directory(dir.path(), &table)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("other_train_000001.bin") && e.contains("not a shard"),
            "{e}"
        );
    }

    #[test]
    fn pinning_needs_both_splits() {
        let dir = tempfile::tempdir().unwrap();
        dataset(dir.path());
        std::fs::remove_file(dir.path().join("d_val_000000.bin")).unwrap();
        let e = pin_directory(dir.path(), Tokenizer::Byte).unwrap_err();
        assert!(matches!(e, DataError::NoValidationShards { .. }), "{e}");
    }
}
