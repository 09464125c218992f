//! [`DataError`]: every way token data can be refused. Each message names the file,
//! directory or setting at fault and says what is wrong with it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A shard file is unreadable or malformed: wrong magic or version, a size that
    /// disagrees with its header, a token beyond the vocabulary.
    #[error("shard {}: {problem}", path.display())]
    BadShard { path: PathBuf, problem: String },

    /// A shard that does not match the run's pinned shard table (`[[data.shards]]`).
    #[error("shard {}: {problem}", path.display())]
    NotPinned { path: PathBuf, problem: String },

    /// A shard the dataset was opened ahead of never arrived: its download gave up.
    #[error("shard {} is not here and will not come: {why}", path.display())]
    ShardUnavailable { path: PathBuf, why: String },

    /// A shard could not be opened, read or written.
    #[error("shard {}: {source}", path.display())]
    ShardIo {
        path: PathBuf,
        source: std::io::Error,
    },

    /// The data directory could not be listed.
    #[error("cannot read data directory {}: {source}", dir.display())]
    Directory {
        dir: PathBuf,
        source: std::io::Error,
    },

    #[error("no training shards (*.bin not named *_val_*.bin) in {}", dir.display())]
    NoTrainingShards { dir: PathBuf },

    #[error("no validation shards (*_val_*.bin) in {}", dir.display())]
    NoValidationShards { dir: PathBuf },

    /// The data is too small for the batch shape or number of workers asked for.
    #[error("too few tokens: {0}")]
    TooFewTokens(String),

    /// An impossible setting (zero sequence length, worker 3 of 2, …).
    #[error("invalid setting: {0}")]
    InvalidSetting(String),

    /// A stream cursor made for another seed, worker, shape or dataset.
    #[error("cannot resume from this stream cursor: {0}")]
    CursorMismatch(String),

    /// An input of `data prepare` is missing, unreadable or not usable text.
    #[error("input {}: {problem}", path.display())]
    BadInput { path: PathBuf, problem: String },

    /// The output of `data prepare` cannot be written.
    #[error("output {}: {problem}", path.display())]
    BadOutput { path: PathBuf, problem: String },
}
