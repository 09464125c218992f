//! Batches: each worker's endless stream of training micro-batches, and the fixed set of
//! validation batches.
//!
//! # Windows
//! Every shard is cut into *windows* of `seq_len + 1` tokens starting at multiples of
//! `seq_len`, as in llm.c: window `k` of a shard is tokens `k·seq_len ..= (k+1)·seq_len`;
//! its first `seq_len` tokens are a row of inputs and its last `seq_len` the row's
//! targets (inputs shifted by one). Consecutive windows share one token, every token of a
//! shard is used, and no window crosses a shard boundary. The training windows of all
//! training shards, in shard order, are numbered `0 .. W`.
//!
//! # Disjoint, seeded streams
//! Epoch `e` orders the `W` windows shard by shard, as llm.c reads its shards: a generator
//! (ChaCha8 keyed by the stream's `seed`, stream number `e`) first shuffles the training
//! shards, then, shard after shard in that order, the shard's own windows. So every worker
//! with the same seed and data computes the same order, and a worker reads one shard
//! through before it needs the next — which lets a joining node train on its first shard
//! while it fetches the others ([`BatchStream::shards_ahead`] says in which order it will
//! need them). With a single training shard the shard shuffle draws nothing, and the order
//! is a permutation of its windows. Worker `index` of `count` ([`WorkerSlot`]) takes the windows at
//! permutation positions `index, index + count, index + 2·count, …`; the slots of one
//! epoch are therefore disjoint, and together they cover every window once. A micro-batch
//! is the worker's next `micro_batch` windows; when its share of an epoch is used up it
//! continues with the next epoch's permutation. A worker's share is at least
//! `floor(W / count)` windows, and [`BatchStream::new`] requires that to be at least
//! `micro_batch`, so no batch holds a window twice.
//!
//! # Resuming
//! A [`StreamCursor`] is the worker's place — `(epoch, position)`, `position` being the
//! number of its windows already taken in that epoch — plus the identity it was made for:
//! seed, slot, shape and the size of the training data. [`BatchStream::seek`] refuses a
//! cursor with another identity; with a matching one, the next batch is bit-identical to
//! the one the original stream would have produced.
//!
//! # Validation
//! [`validation_batches`] takes the windows of the validation shards in order (no
//! shuffling), so every node evaluates on exactly the same batches.

use crate::{DataError, Shard, TokenDataset};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Worker `index` of `count`: the workers of a run split each epoch between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerSlot {
    pub index: usize,
    pub count: usize,
}

impl WorkerSlot {
    /// The only worker of a run.
    pub const SOLE: WorkerSlot = WorkerSlot { index: 0, count: 1 };
}

/// A micro-batch: `rows` sequences of `seq_len` tokens, row-major `[rows, seq_len]`;
/// `targets[r][t]` is the token that follows `inputs[r][t]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<i64>,
    pub targets: Vec<i64>,
    pub rows: usize,
    pub seq_len: usize,
}

/// Where a [`BatchStream`] stands, and which stream it belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamCursor {
    /// The stream's identity: seed, slot, batch shape and training data size.
    pub seed: u64,
    pub slot: WorkerSlot,
    pub seq_len: usize,
    pub micro_batch: usize,
    pub train_tokens: usize,
    pub train_windows: usize,
    /// The epoch being read.
    pub epoch: u64,
    /// Windows of this epoch already taken by this worker.
    pub position: usize,
}

/// The key of the window-order generator: the run seed plus a fixed label, so the data
/// order never coincides with another use of the same seed (weight initialisation, say).
fn order_key(seed: u64) -> [u8; 32] {
    let mut key = *b"gasloc data order v1\0\0\0\0\0\0\0\0\0\0\0\0";
    key[24..].copy_from_slice(&seed.to_le_bytes());
    key
}

/// One epoch's order of the training windows (see the module doc).
struct EpochOrder {
    /// The shards, in the order the epoch reads them.
    shards: Vec<usize>,
    /// The window numbers, shard after shard in `shards` order, shuffled inside each shard.
    windows: Vec<usize>,
}

/// The order of the training windows in `epoch`, for shards whose windows are numbered
/// from `shard_first_window[s]` up to the next shard's first (`train_windows` for the last).
fn epoch_order(
    seed: u64,
    epoch: u64,
    shard_first_window: &[usize],
    train_windows: usize,
) -> EpochOrder {
    let (mut rng, shards) = shard_order(seed, epoch, shard_first_window.len());
    let mut windows = Vec::with_capacity(train_windows);
    for &shard in &shards {
        let (first, end) = shard_windows(shard_first_window, train_windows, shard);
        let from = windows.len();
        windows.extend(first..end);
        windows[from..].shuffle(&mut rng);
    }
    EpochOrder { shards, windows }
}

/// The order of the `shards` training shards in `epoch` — the generator's first draws of the
/// epoch — and the generator, which goes on to order each shard's windows.
fn shard_order(seed: u64, epoch: u64, shards: usize) -> (ChaCha8Rng, Vec<usize>) {
    let mut rng = ChaCha8Rng::from_seed(order_key(seed));
    rng.set_stream(epoch);
    let mut order: Vec<usize> = (0..shards).collect();
    order.shuffle(&mut rng);
    (rng, order)
}

/// The window numbers `first..end` of training shard `shard`.
fn shard_windows(
    shard_first_window: &[usize],
    train_windows: usize,
    shard: usize,
) -> (usize, usize) {
    let first = shard_first_window[shard];
    let end = shard_first_window
        .get(shard + 1)
        .copied()
        .unwrap_or(train_windows);
    (first, end)
}

/// Windows of `seq_len + 1` tokens with stride `seq_len` in a shard of `len` tokens.
fn windows_in(len: usize, seq_len: usize) -> usize {
    len.saturating_sub(1) / seq_len
}

fn check_shape(seq_len: usize, micro_batch: usize) -> Result<(), DataError> {
    if seq_len == 0 || micro_batch == 0 {
        return Err(DataError::InvalidSetting(format!(
            "seq_len = {seq_len} and micro_batch = {micro_batch} must both be at least 1"
        )));
    }
    Ok(())
}

/// Copies window `window` (starting at token `start` of `shard`) into row form.
fn push_window(shard: &Shard, start: usize, seq_len: usize, batch: &mut Batch) {
    shard.extend_i64(start, seq_len, &mut batch.inputs);
    shard.extend_i64(start + 1, seq_len, &mut batch.targets);
    batch.rows += 1;
}

fn empty_batch(rows: usize, seq_len: usize) -> Batch {
    Batch {
        inputs: Vec::with_capacity(rows * seq_len),
        targets: Vec::with_capacity(rows * seq_len),
        rows: 0,
        seq_len,
    }
}

/// One worker's endless, seeded stream of training micro-batches (see the module doc).
pub struct BatchStream {
    data: Arc<TokenDataset>,
    seq_len: usize,
    micro_batch: usize,
    slot: WorkerSlot,
    seed: u64,
    /// Number of the first window of each training shard.
    shard_first_window: Vec<usize>,
    train_windows: usize,
    epoch: u64,
    position: usize,
    /// The order of `epoch`.
    order: EpochOrder,
}

/// Where the stream stands, not the permutation it holds.
impl std::fmt::Debug for BatchStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchStream")
            .field("dir", &self.data.dir())
            .field("cursor", &self.cursor())
            .finish()
    }
}

impl BatchStream {
    /// The stream of worker `slot` at the start of epoch 0. Fails if the shape or slot is
    /// impossible, or if the training data gives a worker fewer than `micro_batch`
    /// windows per epoch.
    pub fn new(
        data: Arc<TokenDataset>,
        seq_len: usize,
        micro_batch: usize,
        slot: WorkerSlot,
        seed: u64,
    ) -> Result<Self, DataError> {
        check_shape(seq_len, micro_batch)?;
        if slot.count == 0 || slot.index >= slot.count {
            return Err(DataError::InvalidSetting(format!(
                "worker {} of {} does not exist (the index must be below the count)",
                slot.index, slot.count
            )));
        }
        let mut shard_first_window = Vec::with_capacity(data.train_shard_count());
        let mut train_windows = 0;
        for shard in 0..data.train_shard_count() {
            shard_first_window.push(train_windows);
            train_windows += windows_in(data.train_shard_len(shard), seq_len);
        }
        let needed = slot.count * micro_batch;
        if train_windows < needed {
            return Err(DataError::TooFewTokens(format!(
                "the training shards in {} hold {} tokens, {train_windows} windows of \
                 seq_len + 1 = {} tokens; {} workers with micro_batch {micro_batch} need at \
                 least {needed}",
                data.dir().display(),
                data.train_tokens(),
                seq_len + 1,
                slot.count,
            )));
        }
        Ok(BatchStream {
            order: epoch_order(seed, 0, &shard_first_window, train_windows),
            data,
            seq_len,
            micro_batch,
            slot,
            seed,
            shard_first_window,
            train_windows,
            epoch: 0,
            position: 0,
        })
    }

    pub fn slot(&self) -> WorkerSlot {
        self.slot
    }

    /// The data this stream reads.
    pub fn dataset(&self) -> &Arc<TokenDataset> {
        &self.data
    }

    /// Training windows (sequences) in one epoch, over all workers.
    pub fn train_windows(&self) -> usize {
        self.train_windows
    }

    /// Windows of one epoch that belong to this worker.
    pub fn windows_per_epoch(&self) -> usize {
        (self.train_windows - self.slot.index).div_ceil(self.slot.count)
    }

    /// The next `micro_batch` sequences of this worker. Reading a shard for the first time
    /// can fail only for a dataset opened ahead of its data
    /// ([`TokenDataset::open_pinned`]): the shard never arrived, or its tokens are bad.
    /// The stream then stays where it was.
    pub fn next_batch(&mut self) -> Result<Batch, DataError> {
        let before = self.cursor();
        let mut batch = empty_batch(self.micro_batch, self.seq_len);
        for _ in 0..self.micro_batch {
            let window = self.next_window();
            let shard_index = self.shard_first_window.partition_point(|&f| f <= window) - 1;
            let start = (window - self.shard_first_window[shard_index]) * self.seq_len;
            match self.data.train_shard(shard_index) {
                Ok(shard) => push_window(shard, start, self.seq_len, &mut batch),
                Err(e) => {
                    self.seek(&before).expect("a stream's own cursor fits it");
                    return Err(e);
                }
            }
        }
        Ok(batch)
    }

    fn next_window(&mut self) -> usize {
        if self.position == self.windows_per_epoch() {
            self.epoch += 1;
            self.position = 0;
            self.order = self.order_of(self.epoch);
        }
        let window = self.order.windows[self.slot.index + self.position * self.slot.count];
        self.position += 1;
        window
    }

    fn order_of(&self, epoch: u64) -> EpochOrder {
        epoch_order(
            self.seed,
            epoch,
            &self.shard_first_window,
            self.train_windows,
        )
    }

    /// The training shards (indices in [`TokenDataset`] order) in the order this stream
    /// will first read them from where it stands: those left in this epoch, then the next
    /// epoch's, then any it may never read (a shard too small to give this worker a
    /// window) — each shard once. A node fetching a run's data fetches it in this order.
    pub fn shards_ahead(&self) -> Vec<usize> {
        let count = self.slot.count;
        // Position in the epoch's order of this worker's next window.
        let next = self.slot.index + self.position * count;
        let mut ahead = Vec::with_capacity(self.shard_first_window.len());
        let mut listed = vec![false; self.shard_first_window.len()];
        let mut list = |shard: usize| {
            if !std::mem::replace(&mut listed[shard], true) {
                ahead.push(shard);
            }
        };
        let mut start = 0;
        for &shard in &self.order.shards {
            let (first, end) = shard_windows(&self.shard_first_window, self.train_windows, shard);
            let end = start + (end - first);
            // This worker's first position at or after `max(start, next)`.
            let from = start.max(next);
            let mine = from + (self.slot.index + count - from % count) % count;
            if mine < end {
                list(shard);
            }
            start = end;
        }
        // The next epoch's shard order only: its windows need not be shuffled for this.
        let (_, next_epoch) = shard_order(self.seed, self.epoch + 1, self.shard_first_window.len());
        for shard in next_epoch {
            list(shard);
        }
        for shard in 0..self.shard_first_window.len() {
            list(shard);
        }
        ahead
    }

    /// Where the stream stands; [`Self::seek`] returns to it.
    pub fn cursor(&self) -> StreamCursor {
        StreamCursor {
            seed: self.seed,
            slot: self.slot,
            seq_len: self.seq_len,
            micro_batch: self.micro_batch,
            train_tokens: self.data.train_tokens(),
            train_windows: self.train_windows,
            epoch: self.epoch,
            position: self.position,
        }
    }

    /// Continues from `cursor`, which must come from a stream with the same seed, slot,
    /// shape and training data.
    pub fn seek(&mut self, cursor: &StreamCursor) -> Result<(), DataError> {
        let mine = self.cursor();
        let identity = |c: &StreamCursor| {
            format!(
                "seed {}, worker {} of {}, seq_len {}, micro_batch {}, {} training tokens",
                c.seed, c.slot.index, c.slot.count, c.seq_len, c.micro_batch, c.train_tokens
            )
        };
        let same_identity = StreamCursor {
            epoch: mine.epoch,
            position: mine.position,
            ..cursor.clone()
        } == mine;
        if !same_identity {
            return Err(DataError::CursorMismatch(format!(
                "it was made for {} but this stream has {}",
                identity(cursor),
                identity(&mine)
            )));
        }
        if cursor.position > self.windows_per_epoch() {
            return Err(DataError::CursorMismatch(format!(
                "position {} is past the {} windows of this worker's epoch",
                cursor.position,
                self.windows_per_epoch()
            )));
        }
        if cursor.epoch != self.epoch {
            self.order = self.order_of(cursor.epoch);
            self.epoch = cursor.epoch;
        }
        self.position = cursor.position;
        Ok(())
    }
}

/// The first `max_batches` full micro-batches of the validation shards, windows in file
/// order: the same batches on every node. Fails if there are no validation shards or
/// they do not fill one batch.
pub fn validation_batches(
    data: &TokenDataset,
    seq_len: usize,
    micro_batch: usize,
    max_batches: usize,
) -> Result<Vec<Batch>, DataError> {
    check_shape(seq_len, micro_batch)?;
    if max_batches == 0 {
        return Err(DataError::InvalidSetting(
            "max_batches = 0: ask for at least one validation batch".into(),
        ));
    }
    if data.val_shards().is_empty() {
        return Err(DataError::NoValidationShards {
            dir: data.dir().to_path_buf(),
        });
    }
    let mut batches = Vec::new();
    let mut batch = empty_batch(micro_batch, seq_len);
    'shards: for shard in data.val_shards() {
        for window in 0..windows_in(shard.len(), seq_len) {
            push_window(shard, window * seq_len, seq_len, &mut batch);
            if batch.rows == micro_batch {
                batches.push(std::mem::replace(
                    &mut batch,
                    empty_batch(micro_batch, seq_len),
                ));
                if batches.len() == max_batches {
                    break 'shards;
                }
            }
        }
    }
    if batches.is_empty() {
        return Err(DataError::TooFewTokens(format!(
            "the validation shards in {} hold {} tokens, not one batch of {micro_batch} \
             windows of seq_len + 1 = {} tokens",
            data.dir().display(),
            data.val_tokens(),
            seq_len + 1
        )));
    }
    Ok(batches)
}
