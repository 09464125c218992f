//! llm.c token shards: reading, checking and writing them.
//!
//! A shard is a header of 256 little-endian `i32` followed by the tokens:
//!
//! | header\[0\] (magic) | header\[1\] (version) | header\[2\] | tokens            |
//! |---------------------|-----------------------|-------------|-------------------|
//! | 20240520            | 1                     | token count | little-endian u16 |
//! | 20240801            | 7                     | token count | little-endian u32 |
//!
//! The rest of the header is zero. A [`TokenDataset`] is every `*.bin` shard of one
//! directory, in file-name order: `*_val_*.bin` are the validation split, the others the
//! training split. Reading a shard checks it completely — magic, version, that the file
//! size is exactly what the header says, and that every token lies inside the
//! vocabulary — so the trainer never meets a bad token later. Tokens are read into
//! memory once, at their stored width (two bytes each for GPT-2 and byte data).
//!
//! A dataset opened whole ([`TokenDataset::open`]) reads every shard at once. A run's
//! pinned shards can also be opened while they are still downloading
//! ([`TokenDataset::open_pinned`]): the lengths come from the manifest's table, and each
//! training shard is waited for (from a [`ShardSupply`]) and read the first time a batch
//! needs it, so a joining node trains on its first shard while the rest arrive.

use crate::DataError;
use gasloc_proto::manifest::ShardEntry;
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// `i32` entries in a shard header.
pub const HEADER_INTS: usize = 256;
/// Bytes in a shard header.
pub const HEADER_BYTES: usize = HEADER_INTS * 4;

/// How tokens are stored in a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenWidth {
    /// uint16 tokens, magic 20240520, version 1 (llm.c's GPT-2 shards).
    U16,
    /// uint32 tokens, magic 20240801, version 7 (llm.c's Llama-3 shards).
    U32,
}

impl TokenWidth {
    pub const U16_MAGIC: i32 = 20240520;
    pub const U32_MAGIC: i32 = 20240801;

    pub fn magic(self) -> i32 {
        match self {
            TokenWidth::U16 => Self::U16_MAGIC,
            TokenWidth::U32 => Self::U32_MAGIC,
        }
    }

    pub fn version(self) -> i32 {
        match self {
            TokenWidth::U16 => 1,
            TokenWidth::U32 => 7,
        }
    }

    pub fn bytes_per_token(self) -> usize {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }

    /// The narrowest width that holds every token of a vocabulary.
    pub fn for_vocab(vocab_size: usize) -> TokenWidth {
        if vocab_size <= 1 << 16 {
            TokenWidth::U16
        } else {
            TokenWidth::U32
        }
    }

    fn from_magic(magic: i32) -> Option<TokenWidth> {
        match magic {
            Self::U16_MAGIC => Some(TokenWidth::U16),
            Self::U32_MAGIC => Some(TokenWidth::U32),
            _ => None,
        }
    }
}

/// A shard's tokens, kept at their stored width.
enum ShardTokens {
    U16(Vec<u16>),
    U32(Vec<u32>),
}

/// One checked shard, held in memory.
pub struct Shard {
    path: PathBuf,
    tokens: ShardTokens,
}

/// Path, width and length only: a shard can hold a hundred million tokens.
impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard")
            .field("path", &self.path)
            .field("width", &self.width())
            .field("len", &self.len())
            .finish()
    }
}

impl Shard {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn width(&self) -> TokenWidth {
        match self.tokens {
            ShardTokens::U16(_) => TokenWidth::U16,
            ShardTokens::U32(_) => TokenWidth::U32,
        }
    }

    pub fn len(&self) -> usize {
        match &self.tokens {
            ShardTokens::U16(t) => t.len(),
            ShardTokens::U32(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends tokens `start..start + count` to `out` as `i64` (the trainer's index type).
    /// Panics if the range is out of bounds; callers compute ranges from [`Self::len`].
    pub fn extend_i64(&self, start: usize, count: usize, out: &mut Vec<i64>) {
        match &self.tokens {
            ShardTokens::U16(t) => out.extend(t[start..start + count].iter().map(|&x| x as i64)),
            ShardTokens::U32(t) => out.extend(t[start..start + count].iter().map(|&x| x as i64)),
        }
    }

    /// A copy of all tokens as `u32` (for decoding and tests).
    pub fn to_u32_vec(&self) -> Vec<u32> {
        match &self.tokens {
            ShardTokens::U16(t) => t.iter().map(|&x| x as u32).collect(),
            ShardTokens::U32(t) => t.clone(),
        }
    }
}

/// Reads and checks one shard: header, exact file size, every token `< vocab_size`.
pub fn read_shard(path: &Path, vocab_size: usize) -> Result<Shard, DataError> {
    let io = |source: std::io::Error| DataError::ShardIo {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let file_bytes = file.metadata().map_err(io)?.len();
    read_shard_from(file, file_bytes, path, vocab_size)
}

/// [`read_shard`] on any reader of a shard of `file_bytes` bytes (`path` names it in errors
/// and in the result): the checks the trainer runs, on bytes from anywhere.
pub fn read_shard_from<R: Read>(
    mut file: R,
    file_bytes: u64,
    path: &Path,
    vocab_size: usize,
) -> Result<Shard, DataError> {
    let bad = |problem: String| DataError::BadShard {
        path: path.to_path_buf(),
        problem,
    };
    let io = |source: std::io::Error| DataError::ShardIo {
        path: path.to_path_buf(),
        source,
    };
    if file_bytes < HEADER_BYTES as u64 {
        return Err(bad(format!(
            "truncated: the file has {file_bytes} bytes, fewer than the {HEADER_BYTES}-byte header"
        )));
    }
    let mut header_bytes = [0u8; HEADER_BYTES];
    file.read_exact(&mut header_bytes).map_err(io)?;
    let header_int =
        |i: usize| i32::from_le_bytes(header_bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    let (magic, version, header_count) = (header_int(0), header_int(1), header_int(2));

    let width = TokenWidth::from_magic(magic).ok_or_else(|| {
        bad(format!(
            "wrong magic {magic} (expected {} or {})",
            TokenWidth::U16_MAGIC,
            TokenWidth::U32_MAGIC
        ))
    })?;
    if version != width.version() {
        return Err(bad(format!(
            "wrong version {version} for magic {magic} (expected {})",
            width.version()
        )));
    }
    let token_count = usize::try_from(header_count).map_err(|_| {
        bad(format!(
            "header gives a negative token count {header_count}"
        ))
    })?;

    let expected_bytes = token_count as u64 * width.bytes_per_token() as u64;
    let body_bytes = file_bytes - HEADER_BYTES as u64;
    if body_bytes != expected_bytes {
        let what = if body_bytes < expected_bytes {
            "truncated"
        } else {
            "too long"
        };
        return Err(bad(format!(
            "{what}: header says {token_count} tokens ({expected_bytes} bytes) but the file has \
             {body_bytes} bytes after the header"
        )));
    }

    let tokens = match width {
        TokenWidth::U16 => {
            ShardTokens::U16(read_tokens(&mut file, token_count, u16::from_le_bytes).map_err(io)?)
        }
        TokenWidth::U32 => {
            ShardTokens::U32(read_tokens(&mut file, token_count, u32::from_le_bytes).map_err(io)?)
        }
    };
    let shard = Shard {
        path: path.to_path_buf(),
        tokens,
    };
    if let Some((position, token)) = first_token_beyond(&shard.tokens, vocab_size) {
        return Err(bad(format!(
            "token {token} at position {position} is beyond the vocabulary of {vocab_size}"
        )));
    }
    Ok(shard)
}

/// Reads `count` little-endian tokens of `N` bytes each, a megabyte at a time, straight
/// into the result (no second full-size copy).
fn read_tokens<T, const N: usize>(
    file: &mut impl Read,
    count: usize,
    from_le: fn([u8; N]) -> T,
) -> std::io::Result<Vec<T>> {
    let mut tokens = Vec::with_capacity(count);
    let mut chunk = vec![0u8; (1 << 20) / N * N];
    let mut remaining = count;
    while remaining > 0 {
        let take = remaining.min(chunk.len() / N);
        let bytes = &mut chunk[..take * N];
        file.read_exact(bytes)?;
        tokens.extend(
            bytes
                .chunks_exact(N)
                .map(|b| from_le(b.try_into().expect("N bytes"))),
        );
        remaining -= take;
    }
    Ok(tokens)
}

fn first_token_beyond(tokens: &ShardTokens, vocab_size: usize) -> Option<(usize, u64)> {
    match tokens {
        ShardTokens::U16(t) => t
            .iter()
            .position(|&x| x as usize >= vocab_size)
            .map(|i| (i, t[i] as u64)),
        ShardTokens::U32(t) => t
            .iter()
            .position(|&x| x as usize >= vocab_size)
            .map(|i| (i, t[i] as u64)),
    }
}

/// Writes `tokens` as a shard at `path`. The file is written beside it under a
/// temporary name and renamed into place, so a failure leaves no partial shard.
pub fn write_shard(path: &Path, tokens: &[u32], width: TokenWidth) -> Result<(), DataError> {
    let bad = |problem: String| DataError::BadShard {
        path: path.to_path_buf(),
        problem,
    };
    let header_count = i32::try_from(tokens.len()).map_err(|_| {
        bad(format!(
            "{} tokens do not fit a shard header (at most {})",
            tokens.len(),
            i32::MAX
        ))
    })?;
    if width == TokenWidth::U16 {
        if let Some(position) = tokens.iter().position(|&t| t > u16::MAX as u32) {
            return Err(bad(format!(
                "token {} at position {position} does not fit a uint16 shard",
                tokens[position]
            )));
        }
    }

    let mut header = [0i32; HEADER_INTS];
    header[0] = width.magic();
    header[1] = width.version();
    header[2] = header_count;

    let mut temp_name = path.as_os_str().to_owned();
    temp_name.push(".tmp");
    let temp_path = PathBuf::from(temp_name);
    let written = write_shard_file(&temp_path, &header, tokens, width)
        .and_then(|()| std::fs::rename(&temp_path, path));
    written.map_err(|source| {
        let _ = std::fs::remove_file(&temp_path);
        DataError::ShardIo {
            path: path.to_path_buf(),
            source,
        }
    })
}

fn write_shard_file(
    path: &Path,
    header: &[i32; HEADER_INTS],
    tokens: &[u32],
    width: TokenWidth,
) -> std::io::Result<()> {
    let mut out = BufWriter::with_capacity(1 << 20, File::create(path)?);
    for value in header {
        out.write_all(&value.to_le_bytes())?;
    }
    match width {
        TokenWidth::U16 => {
            for &token in tokens {
                out.write_all(&(token as u16).to_le_bytes())?;
            }
        }
        TokenWidth::U32 => {
            for &token in tokens {
                out.write_all(&token.to_le_bytes())?;
            }
        }
    }
    out.into_inner().map_err(|e| e.into_error())?.sync_all()
}

/// Whether a shard file name marks it as validation data.
fn is_validation_shard(name: &str) -> bool {
    gasloc_proto::Split::of_file_name(name) == gasloc_proto::Split::Val
}

/// The `*.bin` files of a directory (not its subdirectories), in file-name order.
pub(crate) fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let listing_error = |source| DataError::Directory {
        dir: dir.to_path_buf(),
        source,
    };
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(listing_error)? {
        let path = entry.map_err(listing_error)?.path();
        if path.extension().is_some_and(|e| e == "bin") && path.is_file() {
            paths.push(path);
        }
    }
    paths.sort();
    Ok(paths)
}

/// Where a dataset's missing shards come from while it is in use: a download under way
/// (the node's fetch of the run's pinned shards). The dataset asks for a shard the first
/// time it reads it, from the thread that reads it.
pub trait ShardSupply: Send + Sync + std::fmt::Debug {
    /// Blocks until the shard named `name` lies in the dataset's directory under that name,
    /// whole and verified against the run's pinned table, or says why it never will.
    fn wait_for(&self, name: &str) -> Result<(), String>;
}

/// A training shard: its file and length are known when the dataset opens, its tokens are
/// read at first use (at once for a directory opened whole, by [`TokenDataset::open`]).
struct TrainShard {
    path: PathBuf,
    /// Tokens, from the header (opened whole) or the pinned table (opened ahead of its data).
    len: usize,
    tokens: OnceLock<Shard>,
}

/// Every shard of a data directory, split into training and validation. The training
/// shards are numbered in file-name order, whether they are read when the dataset opens
/// ([`Self::open`]) or as they are first needed ([`Self::open_pinned`]); the validation
/// shards are always read when it opens.
pub struct TokenDataset {
    dir: PathBuf,
    vocab_size: usize,
    train: Vec<TrainShard>,
    val: Vec<Shard>,
    /// Where the training shards not in `dir` yet come from (None: all were there).
    supply: Option<Arc<dyn ShardSupply>>,
}

/// Paths and lengths only, as for [`Shard`].
impl std::fmt::Debug for TrainShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainShard")
            .field("path", &self.path)
            .field("len", &self.len)
            .field("read", &self.tokens.get().is_some())
            .finish()
    }
}

impl std::fmt::Debug for TokenDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenDataset")
            .field("dir", &self.dir)
            .field("vocab_size", &self.vocab_size)
            .field("train", &self.train)
            .field("val", &self.val)
            .field("arriving", &self.supply.is_some())
            .finish()
    }
}

impl TokenDataset {
    /// Opens every `*.bin` shard in `dir` (not its subdirectories), in file-name order:
    /// `*_val_*.bin` are validation, others training. Checks each shard's header, that the
    /// file size matches it, and that every token is `< vocab_size`. At least one training
    /// shard is required; validation shards are optional here.
    pub fn open(dir: &Path, vocab_size: usize) -> Result<Self, DataError> {
        let paths = shard_files(dir)?;

        let (mut train, mut val) = (Vec::new(), Vec::new());
        for path in paths {
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            let shard = read_shard(&path, vocab_size)?;
            if is_validation_shard(&name) {
                val.push(shard);
            } else {
                train.push(TrainShard {
                    path: path.clone(),
                    len: shard.len(),
                    tokens: OnceLock::from(shard),
                });
            }
        }
        Self::assemble(dir, vocab_size, train, val, None)
    }

    /// Opens a run's pinned shards in `dir` while they are still arriving: the validation
    /// shards are waited for from `supply` and read now; each training shard is waited for
    /// and read the first time a batch needs it ([`Self::train_shard`]). The training
    /// shards are numbered in name order, as [`Self::open`] numbers them, so a stream over
    /// either is the same stream. The caller's `supply` verifies every shard against
    /// `table` before it is in `dir`; a shard whose tokens then disagree with the table's
    /// count is refused when read.
    pub fn open_pinned(
        dir: &Path,
        table: &[ShardEntry],
        vocab_size: usize,
        supply: Arc<dyn ShardSupply>,
    ) -> Result<Self, DataError> {
        let mut entries: Vec<&ShardEntry> = table.iter().collect();
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        let (mut train, mut val) = (Vec::new(), Vec::new());
        for entry in entries {
            let path = dir.join(&entry.name);
            let len = usize::try_from(entry.tokens).map_err(|_| DataError::NotPinned {
                path: path.clone(),
                problem: format!(
                    "the manifest pins {} tokens, more than this machine can address",
                    entry.tokens
                ),
            })?;
            if is_validation_shard(&entry.name) {
                val.push(read_supplied(&path, len, vocab_size, supply.as_ref())?);
            } else {
                train.push(TrainShard {
                    path,
                    len,
                    tokens: OnceLock::new(),
                });
            }
        }
        Self::assemble(dir, vocab_size, train, val, Some(supply))
    }

    /// The dataset of these shards; at least one must be a training shard.
    fn assemble(
        dir: &Path,
        vocab_size: usize,
        train: Vec<TrainShard>,
        val: Vec<Shard>,
        supply: Option<Arc<dyn ShardSupply>>,
    ) -> Result<Self, DataError> {
        if train.is_empty() {
            return Err(DataError::NoTrainingShards {
                dir: dir.to_path_buf(),
            });
        }
        Ok(TokenDataset {
            dir: dir.to_path_buf(),
            vocab_size,
            train,
            val,
            supply,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Training shards, read or not.
    pub fn train_shard_count(&self) -> usize {
        self.train.len()
    }

    /// Tokens in training shard `index`, known without reading it. Panics if `index` is
    /// not below [`Self::train_shard_count`].
    pub fn train_shard_len(&self, index: usize) -> usize {
        self.train[index].len
    }

    /// The file of training shard `index` (it may not be there yet).
    pub fn train_shard_path(&self, index: usize) -> &Path {
        &self.train[index].path
    }

    /// Whether training shard `index` has been read into memory.
    pub fn train_shard_is_read(&self, index: usize) -> bool {
        self.train[index].tokens.get().is_some()
    }

    /// Training shard `index`, read and checked at its first use: for a dataset opened
    /// ahead of its data, after waiting for the supply to deliver it. An error names the
    /// shard (it never arrived, or its tokens are bad). Panics if `index` is not below
    /// [`Self::train_shard_count`].
    pub fn train_shard(&self, index: usize) -> Result<&Shard, DataError> {
        let slot = &self.train[index];
        if let Some(shard) = slot.tokens.get() {
            return Ok(shard);
        }
        let supply = self
            .supply
            .as_deref()
            .expect("a dataset opened whole has read every shard");
        let shard = read_supplied(&slot.path, slot.len, self.vocab_size, supply)?;
        // Another thread may have read it meanwhile: either copy is the same shard.
        Ok(slot.tokens.get_or_init(|| shard))
    }

    /// Every training shard, read (waiting for those still arriving).
    pub fn train_shards(&self) -> Result<Vec<&Shard>, DataError> {
        (0..self.train.len()).map(|i| self.train_shard(i)).collect()
    }

    pub fn val_shards(&self) -> &[Shard] {
        &self.val
    }

    pub fn train_tokens(&self) -> usize {
        self.train.iter().map(|s| s.len).sum()
    }

    pub fn val_tokens(&self) -> usize {
        self.val.iter().map(Shard::len).sum()
    }
}

/// Waits for `supply` to deliver the shard at `path`, then reads and checks it, and that
/// it holds the `len` tokens the pinned table says.
fn read_supplied(
    path: &Path,
    len: usize,
    vocab_size: usize,
    supply: &dyn ShardSupply,
) -> Result<Shard, DataError> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    supply
        .wait_for(&name)
        .map_err(|why| DataError::ShardUnavailable {
            path: path.to_path_buf(),
            why,
        })?;
    let shard = read_shard(path, vocab_size)?;
    if shard.len() != len {
        return Err(DataError::NotPinned {
            path: path.to_path_buf(),
            problem: format!("holds {} tokens, the manifest pins {len}", shard.len()),
        });
    }
    Ok(shard)
}
