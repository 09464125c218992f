//! Batch streams: per-worker disjointness, determinism, exact resume, and the fixed
//! validation batches.
//!
//! The test data holds every token value at most once (token = its own position id), so
//! a window is identified by the first token of its inputs.

use gasloc_data::{
    validation_batches, write_shard, Batch, BatchStream, DataError, StreamCursor, TokenDataset,
    TokenWidth, WorkerSlot,
};
use std::collections::HashSet;
use std::sync::Arc;

const SEQ_LEN: usize = 8;
const MICRO_BATCH: usize = 4;
const VOCAB: usize = 1 << 20;
/// Training shards of 1000 and 700 tokens: 124 + 87 windows of 9 tokens, stride 8.
const TRAIN_WINDOWS: usize = 999 / SEQ_LEN + 699 / SEQ_LEN;

/// Training shards holding 0..1000 and 1000..1700; a validation shard holding
/// 500_000..500_100.
fn dataset() -> (tempfile::TempDir, Arc<TokenDataset>) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ids = |range: std::ops::Range<u32>| range.collect::<Vec<u32>>();
    write_shard(
        &d.join("t_train_000000.bin"),
        &ids(0..1000),
        TokenWidth::U32,
    )
    .unwrap();
    write_shard(
        &d.join("t_train_000001.bin"),
        &ids(1000..1700),
        TokenWidth::U32,
    )
    .unwrap();
    write_shard(
        &d.join("t_val_000000.bin"),
        &ids(500_000..500_100),
        TokenWidth::U32,
    )
    .unwrap();
    let data = Arc::new(TokenDataset::open(d, VOCAB).unwrap());
    (dir, data)
}

fn stream(data: &Arc<TokenDataset>, index: usize, count: usize, seed: u64) -> BatchStream {
    BatchStream::new(
        data.clone(),
        SEQ_LEN,
        MICRO_BATCH,
        WorkerSlot { index, count },
        seed,
    )
    .unwrap()
}

/// The first input token of each row: the window's identity in this data.
fn window_ids(batch: &Batch) -> Vec<i64> {
    batch
        .inputs
        .chunks(batch.seq_len)
        .map(|row| row[0])
        .collect()
}

/// The next `n` windows of a stream (whole batches taken, surplus rows dropped).
fn next_windows(stream: &mut BatchStream, n: usize) -> Vec<i64> {
    let mut ids = Vec::new();
    while ids.len() < n {
        ids.extend(window_ids(&stream.next_batch().unwrap()));
    }
    ids.truncate(n);
    ids
}

/// Rows are real windows: consecutive tokens of one shard starting at a multiple of
/// seq_len, targets = inputs shifted by one.
fn assert_well_formed(batch: &Batch) {
    assert_eq!((batch.rows, batch.seq_len), (MICRO_BATCH, SEQ_LEN));
    assert_eq!(batch.inputs.len(), MICRO_BATCH * SEQ_LEN);
    assert_eq!(batch.targets.len(), MICRO_BATCH * SEQ_LEN);
    for (inputs, targets) in batch
        .inputs
        .chunks(SEQ_LEN)
        .zip(batch.targets.chunks(SEQ_LEN))
    {
        let first = inputs[0];
        let shard_start = if first < 1000 { 0 } else { 1000 };
        let shard_end = if first < 1000 { 1000 } else { 1700 };
        assert_eq!(
            (first - shard_start) % SEQ_LEN as i64,
            0,
            "window start {first}"
        );
        assert!(
            first + (SEQ_LEN as i64) < shard_end,
            "window {first} crosses its shard end"
        );
        for t in 0..SEQ_LEN {
            assert_eq!(inputs[t], first + t as i64);
            assert_eq!(targets[t], first + t as i64 + 1);
        }
    }
}

#[test]
fn workers_of_one_seed_split_each_epoch_disjointly_and_completely() {
    let (_dir, data) = dataset();
    for count in [1, 2, 3, 5] {
        let mut seen = HashSet::new();
        for index in 0..count {
            let mut worker = stream(&data, index, count, 42);
            let share = worker.windows_per_epoch();
            assert!(share >= TRAIN_WINDOWS / count);
            let ids = next_windows(&mut worker, share);
            for id in ids {
                assert!(seen.insert(id), "window {id} given twice ({count} workers)");
            }
        }
        assert_eq!(
            seen.len(),
            TRAIN_WINDOWS,
            "{count} workers together cover every window"
        );
    }
}

#[test]
fn batches_are_windows_of_consecutive_tokens_with_shifted_targets() {
    let (_dir, data) = dataset();
    let mut worker = stream(&data, 1, 2, 7);
    for _ in 0..100 {
        assert_well_formed(&worker.next_batch().unwrap());
    }
}

#[test]
fn the_same_seed_and_slot_give_the_same_stream_and_others_differ() {
    let (_dir, data) = dataset();
    let (mut a, mut b) = (stream(&data, 1, 3, 9), stream(&data, 1, 3, 9));
    for _ in 0..80 {
        assert_eq!(a.next_batch().unwrap(), b.next_batch().unwrap());
    }
    let first = |index, seed| stream(&data, index, 3, seed).next_batch().unwrap();
    assert_ne!(first(1, 9), first(1, 10), "another seed, another order");
    assert_ne!(first(1, 9), first(2, 9), "another worker, other windows");
}

#[test]
fn each_epoch_covers_every_window_once_in_a_new_order() {
    let (_dir, data) = dataset();
    // One window per batch, so whole batches end exactly at the epoch's end.
    let mut sole = BatchStream::new(data.clone(), SEQ_LEN, 1, WorkerSlot::SOLE, 3).unwrap();
    let epoch0 = next_windows(&mut sole, TRAIN_WINDOWS);
    let epoch1 = next_windows(&mut sole, TRAIN_WINDOWS);
    assert_eq!(sole.cursor().epoch, 1);
    for epoch in [&epoch0, &epoch1] {
        assert_eq!(epoch.iter().collect::<HashSet<_>>().len(), TRAIN_WINDOWS);
    }
    assert_ne!(epoch0, epoch1);
    // Not the file order either.
    let mut sorted = epoch0.clone();
    sorted.sort();
    assert_ne!(epoch0, sorted);
}

#[test]
fn seek_resumes_bit_exactly_also_across_epochs_and_through_serde() {
    let (_dir, data) = dataset();
    let mut original = stream(&data, 1, 2, 5);
    // A worker's epoch is 106 windows ≈ 26.5 batches: stop before, at and after the end.
    for stop in [0, 13, 26, 27, 40, 80] {
        let mut run = stream(&data, 1, 2, 5);
        for _ in 0..stop {
            run.next_batch().unwrap();
        }
        let json = serde_json::to_string(&run.cursor()).unwrap();
        let cursor: StreamCursor = serde_json::from_str(&json).unwrap();
        assert_eq!(cursor, run.cursor());
        let expected: Vec<Batch> = (0..30).map(|_| run.next_batch().unwrap()).collect();

        let mut resumed = stream(&data, 1, 2, 5);
        resumed.seek(&cursor).unwrap();
        let got: Vec<Batch> = (0..30).map(|_| resumed.next_batch().unwrap()).collect();
        assert_eq!(got, expected, "resume after {stop} batches");
        assert_eq!(resumed.cursor(), run.cursor());

        // And an advanced stream can be sent back.
        original.seek(&cursor).unwrap();
        assert_eq!(original.next_batch().unwrap(), expected[0]);
    }
}

#[test]
fn seek_refuses_a_cursor_of_another_stream() {
    let (_dir, data) = dataset();
    let mut mine = stream(&data, 0, 2, 1);
    let refuse = |stream: &mut BatchStream, cursor: StreamCursor, expected: &str| {
        let error = stream.seek(&cursor).unwrap_err();
        assert!(matches!(error, DataError::CursorMismatch(_)), "{error}");
        assert!(
            error.to_string().contains(expected),
            "{expected:?} not in {error}"
        );
    };
    refuse(&mut mine, stream(&data, 0, 2, 2).cursor(), "seed 2");
    refuse(&mut mine, stream(&data, 1, 2, 1).cursor(), "worker 1 of 2");
    refuse(&mut mine, stream(&data, 0, 3, 1).cursor(), "worker 0 of 3");
    let other_shape = BatchStream::new(
        data.clone(),
        16,
        MICRO_BATCH,
        WorkerSlot { index: 0, count: 2 },
        1,
    )
    .unwrap();
    refuse(&mut mine, other_shape.cursor(), "seq_len 16");
    let other_data = StreamCursor {
        train_tokens: 99,
        ..mine.cursor()
    };
    refuse(&mut mine, other_data, "99 training tokens");
    let past_the_end = StreamCursor {
        position: mine.windows_per_epoch() + 1,
        ..mine.cursor()
    };
    refuse(&mut mine, past_the_end, "past the");
    // The refused cursors changed nothing.
    assert_eq!(
        mine.next_batch().unwrap(),
        stream(&data, 0, 2, 1).next_batch().unwrap()
    );
}

#[test]
fn impossible_slots_shapes_and_too_little_data_are_errors() {
    let (_dir, data) = dataset();
    let new = |seq_len, micro_batch, index, count| {
        BatchStream::new(
            data.clone(),
            seq_len,
            micro_batch,
            WorkerSlot { index, count },
            0,
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
    };
    assert!(new(SEQ_LEN, MICRO_BATCH, 2, 2).contains("worker 2 of 2"));
    assert!(new(SEQ_LEN, MICRO_BATCH, 0, 0).contains("worker 0 of 0"));
    assert!(new(0, MICRO_BATCH, 0, 1).contains("seq_len = 0"));
    assert!(new(SEQ_LEN, 0, 0, 1).contains("micro_batch = 0"));
    let message = new(SEQ_LEN, MICRO_BATCH, 0, 60);
    assert!(
        message.starts_with("too few tokens") && message.contains("1700 tokens"),
        "{message}"
    );
    let message = new(2000, 1, 0, 1);
    assert!(message.starts_with("too few tokens"), "{message}");
}

#[test]
fn validation_batches_are_the_validation_windows_in_order() {
    let (_dir, data) = dataset();
    let batches = validation_batches(&data, SEQ_LEN, 2, 100).unwrap();
    // 100 tokens: 12 windows, 6 batches of 2.
    assert_eq!(batches.len(), 6);
    assert_eq!(batches, validation_batches(&data, SEQ_LEN, 2, 100).unwrap());
    for (b, batch) in batches.iter().enumerate() {
        let expected: Vec<i64> = (0..2 * SEQ_LEN as i64)
            .map(|i| 500_000 + (b * 2 * SEQ_LEN) as i64 + i)
            .collect();
        assert_eq!(batch.inputs, expected);
        assert_eq!(
            batch.targets,
            expected.iter().map(|t| t + 1).collect::<Vec<_>>()
        );
        assert_eq!((batch.rows, batch.seq_len), (2, SEQ_LEN));
    }
    assert_eq!(
        validation_batches(&data, SEQ_LEN, 2, 3).unwrap(),
        batches[..3]
    );
    // Only full batches: 12 windows make one batch of 8, not a second partial one.
    assert_eq!(validation_batches(&data, SEQ_LEN, 8, 100).unwrap().len(), 1);
}

#[test]
fn validation_without_enough_validation_data_is_an_error() {
    let (_dir, data) = dataset();
    let message = validation_batches(&data, SEQ_LEN, 13, 10)
        .unwrap_err()
        .to_string();
    assert!(
        message.starts_with("too few tokens") && message.contains("100 tokens"),
        "{message}"
    );
    assert!(validation_batches(&data, SEQ_LEN, 2, 0).is_err());

    let dir = tempfile::tempdir().unwrap();
    write_shard(
        &dir.path().join("t_train_000000.bin"),
        &[1; 50],
        TokenWidth::U16,
    )
    .unwrap();
    let train_only = TokenDataset::open(dir.path(), 256).unwrap();
    let error = validation_batches(&train_only, SEQ_LEN, 1, 1).unwrap_err();
    assert!(
        matches!(error, DataError::NoValidationShards { .. }),
        "{error}"
    );
}
