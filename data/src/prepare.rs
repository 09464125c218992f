//! `data prepare`: text files in, llm.c token shards out.
//!
//! Each input file is one document. Documents are read in order — the inputs as given, a
//! directory's `*.txt` files (recursively) sorted by path — tokenized, and each is
//! preceded by the tokenizer's end-of-text token (llm.c's convention), so end-of-text
//! separates documents and also opens the token stream. The first `val_tokens` tokens of
//! that stream are the validation split, the rest the training split; each split is cut
//! into shards of at most `shard_tokens` tokens named after the output directory:
//! `<name>_val_000000.bin`, …, `<name>_train_000000.bin`, …. Reading the validation shards
//! and then the training shards, in name order, gives back the whole stream.
//!
//! Shards are uint16 (magic 20240520) for both tokenizers. Everything is written into a
//! temporary directory beside the output, which is renamed into place only when complete,
//! so a failure (bad input, full disk) leaves nothing half-written. The output directory
//! must not exist yet, or be empty.

use crate::shards::{write_shard, TokenWidth};
use crate::{DataError, TextTokenizer};
use gasloc_proto::Tokenizer;
use indicatif::{ProgressBar, ProgressFinish, ProgressStyle};
use std::path::{Path, PathBuf};

/// Validation tokens when the caller has no better idea.
pub const DEFAULT_VAL_TOKENS: usize = 100_000;
/// Tokens per shard when the caller has no better idea (llm.c's choice).
pub const DEFAULT_SHARD_TOKENS: usize = 100_000_000;
/// Inputs at least this large get a progress bar (when progress is asked for).
const PROGRESS_MIN_BYTES: u64 = 1 << 20;

/// What `data prepare` reads and writes.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// Text files (taken whatever their extension) and directories (their `*.txt` files,
    /// recursively).
    pub inputs: Vec<PathBuf>,
    /// The directory to create; it names the shards.
    pub out: PathBuf,
    pub tokenizer: Tokenizer,
    /// Tokens at the start of the stream that form the validation split (0: none).
    pub val_tokens: usize,
    /// Most tokens in one shard.
    pub shard_tokens: usize,
    /// Show a progress bar on stderr for large inputs.
    pub progress: bool,
}

impl PrepareOptions {
    /// Options with the default split and shard size, and a progress bar.
    pub fn new(inputs: Vec<PathBuf>, out: PathBuf, tokenizer: Tokenizer) -> Self {
        PrepareOptions {
            inputs,
            out,
            tokenizer,
            val_tokens: DEFAULT_VAL_TOKENS,
            shard_tokens: DEFAULT_SHARD_TOKENS,
            progress: true,
        }
    }
}

/// What `data prepare` wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepareReport {
    pub tokenizer: Tokenizer,
    pub out: PathBuf,
    pub documents: usize,
    pub input_bytes: u64,
    pub train_tokens: usize,
    pub val_tokens: usize,
    /// Final paths, in stream order.
    pub val_shards: Vec<PathBuf>,
    pub train_shards: Vec<PathBuf>,
}

impl std::fmt::Display for PrepareReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} documents ({} bytes) → {} tokenizer: {} training tokens in {} shards, \
             {} validation tokens in {} shards, in {}",
            self.documents,
            self.input_bytes,
            self.tokenizer.name(),
            self.train_tokens,
            self.train_shards.len(),
            self.val_tokens,
            self.val_shards.len(),
            self.out.display()
        )
    }
}

/// Tokenizes the inputs into shards in `opts.out` (see the module doc).
pub fn prepare(opts: &PrepareOptions) -> Result<PrepareReport, DataError> {
    if opts.shard_tokens == 0 {
        return Err(DataError::InvalidSetting(
            "shard_tokens = 0: a shard must hold at least one token".into(),
        ));
    }
    let documents = collect_documents(&opts.inputs)?;
    check_output_is_free(&opts.out)?;
    let name = shard_name(&opts.out);
    let parent = match opts.out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let output_error = |problem: String| DataError::BadOutput {
        path: opts.out.clone(),
        problem,
    };
    std::fs::create_dir_all(&parent)
        .map_err(|e| output_error(format!("cannot create {}: {e}", parent.display())))?;
    let partial =
        PartialDir::create(parent.join(format!(".{name}.partial-{}", std::process::id())))
            .map_err(|e| output_error(format!("cannot create a temporary directory: {e}")))?;

    let tokenizer = TextTokenizer::from(opts.tokenizer);
    let input_bytes: u64 = documents.iter().map(|d| d.bytes).sum();
    let progress = progress_bar(opts.progress, input_bytes);

    let mut writer = ShardWriter::new(&partial.path, &name, opts);
    for document in &documents {
        let text = read_text(&document.path, opts.tokenizer)?;
        let mut tokens = Vec::with_capacity(text.len() / 3 + 1);
        tokens.push(tokenizer.end_of_text());
        tokens.extend(tokenizer.encode(&text));
        writer.push(&tokens)?;
        progress.inc(document.bytes);
    }
    writer.finish()?;
    progress.finish_using_style();

    if writer.train_tokens == 0 {
        return Err(DataError::BadInput {
            path: opts.inputs.first().cloned().unwrap_or_default(),
            problem: format!(
                "the inputs give only {} tokens, all taken by the validation split \
                 (val_tokens = {}); nothing is left for training",
                writer.val_tokens, opts.val_tokens
            ),
        });
    }
    partial
        .commit(&opts.out)
        .map_err(|e| output_error(format!("cannot move the finished shards into place: {e}")))?;

    let in_out = |names: &[String]| names.iter().map(|n| opts.out.join(n)).collect();
    Ok(PrepareReport {
        tokenizer: opts.tokenizer,
        out: opts.out.clone(),
        documents: documents.len(),
        input_bytes,
        train_tokens: writer.train_tokens,
        val_tokens: writer.val_tokens,
        val_shards: in_out(&writer.val_shards),
        train_shards: in_out(&writer.train_shards),
    })
}

/// A progress bar over the input bytes, on stderr, when asked for and the input is
/// large; it clears itself when done or dropped on an error.
fn progress_bar(wanted: bool, input_bytes: u64) -> ProgressBar {
    if !wanted || input_bytes < PROGRESS_MIN_BYTES {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template(
        "tokenizing {bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
    )
    .expect("a fixed, valid template");
    ProgressBar::new(input_bytes)
        .with_style(style)
        .with_finish(ProgressFinish::AndClear)
}

/// One input file.
struct Document {
    path: PathBuf,
    bytes: u64,
}

/// The documents of all inputs, in order.
fn collect_documents(inputs: &[PathBuf]) -> Result<Vec<Document>, DataError> {
    if inputs.is_empty() {
        return Err(DataError::InvalidSetting("no inputs given".into()));
    }
    let mut documents = Vec::new();
    for input in inputs {
        let bad = |problem: String| DataError::BadInput {
            path: input.clone(),
            problem,
        };
        let metadata = std::fs::metadata(input).map_err(|e| bad(e.to_string()))?;
        if metadata.is_dir() {
            let mut paths = Vec::new();
            find_text_files(input, &mut paths)?;
            if paths.is_empty() {
                return Err(bad("a directory with no *.txt files in it".into()));
            }
            paths.sort();
            for path in paths {
                let bytes = std::fs::metadata(&path)
                    .map_err(|e| DataError::BadInput {
                        path: path.clone(),
                        problem: e.to_string(),
                    })?
                    .len();
                documents.push(Document { path, bytes });
            }
        } else {
            documents.push(Document {
                path: input.clone(),
                bytes: metadata.len(),
            });
        }
    }
    Ok(documents)
}

/// Appends the `*.txt` files under `dir` (recursively, not following directory links).
fn find_text_files(dir: &Path, found: &mut Vec<PathBuf>) -> Result<(), DataError> {
    let bad = |e: std::io::Error| DataError::BadInput {
        path: dir.to_path_buf(),
        problem: format!("cannot list the directory: {e}"),
    };
    for entry in std::fs::read_dir(dir).map_err(bad)? {
        let entry = entry.map_err(bad)?;
        let path = entry.path();
        if entry.file_type().map_err(bad)?.is_dir() {
            find_text_files(&path, found)?;
        } else if path.extension().is_some_and(|e| e == "txt") && path.is_file() {
            found.push(path);
        }
    }
    Ok(())
}

/// A document's text: it must be UTF-8, and for the byte tokenizer free of NUL, which is
/// that tokenizer's end-of-text.
fn read_text(path: &Path, tokenizer: Tokenizer) -> Result<String, DataError> {
    let bad = |problem: String| DataError::BadInput {
        path: path.to_path_buf(),
        problem,
    };
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        bad(format!(
            "not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })?;
    if tokenizer == Tokenizer::Byte {
        if let Some(offset) = text.bytes().position(|b| b == 0) {
            return Err(bad(format!(
                "contains a NUL byte at offset {offset}, which is the byte tokenizer's \
                 end-of-text"
            )));
        }
    }
    Ok(text)
}

fn check_output_is_free(out: &Path) -> Result<(), DataError> {
    let taken = |problem: &str| DataError::BadOutput {
        path: out.to_path_buf(),
        problem: problem.to_string(),
    };
    match std::fs::read_dir(out).map(|mut entries| entries.next().is_none()) {
        Ok(true) => Ok(()),
        Ok(false) => Err(taken(
            "already exists and is not empty; remove it or choose another directory",
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(_) if out.exists() => Err(taken("exists and is not a directory")),
        Err(e) => Err(taken(&e.to_string())),
    }
}

/// The shards' name prefix: the output directory's name, kept from looking like a
/// validation marker.
fn shard_name(out: &Path) -> String {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .filter(|n| !n.is_empty() && n != "..")
        .unwrap_or_else(|| "data".to_string());
    name.replace("_val_", "-val-")
}

/// A directory being filled; removed on drop unless committed.
struct PartialDir {
    path: PathBuf,
    committed: bool,
}

impl PartialDir {
    fn create(path: PathBuf) -> std::io::Result<Self> {
        if path.exists() {
            std::fs::remove_dir_all(&path)?;
        }
        std::fs::create_dir(&path)?;
        Ok(PartialDir {
            path,
            committed: false,
        })
    }

    /// Renames the directory to `to`, which must be absent or an empty directory.
    fn commit(mut self, to: &Path) -> std::io::Result<()> {
        if to.is_dir() {
            std::fs::remove_dir(to)?;
        }
        std::fs::rename(&self.path, to)?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for PartialDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Cuts the token stream into validation and then training shards.
struct ShardWriter {
    dir: PathBuf,
    name: String,
    width: TokenWidth,
    shard_tokens: usize,
    /// Validation tokens still to come; 0 once the stream is in the training split.
    val_left: usize,
    buffer: Vec<u32>,
    val_tokens: usize,
    train_tokens: usize,
    val_shards: Vec<String>,
    train_shards: Vec<String>,
}

impl ShardWriter {
    fn new(dir: &Path, name: &str, opts: &PrepareOptions) -> Self {
        ShardWriter {
            dir: dir.to_path_buf(),
            name: name.to_string(),
            width: TokenWidth::for_vocab(opts.tokenizer.vocab_size()),
            shard_tokens: opts.shard_tokens,
            val_left: opts.val_tokens,
            buffer: Vec::new(),
            val_tokens: 0,
            train_tokens: 0,
            val_shards: Vec::new(),
            train_shards: Vec::new(),
        }
    }

    fn push(&mut self, mut tokens: &[u32]) -> Result<(), DataError> {
        while !tokens.is_empty() {
            let mut room = self.shard_tokens - self.buffer.len();
            if self.val_left > 0 {
                room = room.min(self.val_left);
            }
            let take = room.min(tokens.len());
            self.buffer.extend_from_slice(&tokens[..take]);
            tokens = &tokens[take..];
            if self.val_left > 0 {
                self.val_left -= take;
                self.val_tokens += take;
                if self.val_left == 0 {
                    // The validation split is complete: close its last shard.
                    self.flush(true)?;
                    continue;
                }
            } else {
                self.train_tokens += take;
            }
            if self.buffer.len() == self.shard_tokens {
                self.flush(self.val_left > 0)?;
            }
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), DataError> {
        self.flush(self.val_left > 0)
    }

    fn flush(&mut self, validation: bool) -> Result<(), DataError> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let (split, names) = if validation {
            ("val", &mut self.val_shards)
        } else {
            ("train", &mut self.train_shards)
        };
        let file_name = format!("{}_{split}_{:06}.bin", self.name, names.len());
        write_shard(&self.dir.join(&file_name), &self.buffer, self.width)?;
        names.push(file_name);
        self.buffer.clear();
        Ok(())
    }
}
