//! Data that is still arriving: a stream reads its shards one after another, says in which
//! order it will need them, and a dataset opened on a run's pinned table ahead of its
//! shards waits for each one the first time a batch needs it — and fails, naming the
//! shard, when its download gives up.
//!
//! The test data holds every token value once (token = its position id, below GPT-2's
//! vocabulary), so a window is identified by the first token of its inputs, and its shard
//! by that token's thousand.

use gasloc_data::pin::pin_directory;
use gasloc_data::{
    write_shard, BatchStream, DataError, ShardSupply, TokenDataset, TokenWidth, WorkerSlot,
};
use gasloc_proto::{ShardEntry, Tokenizer};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

const SEQ_LEN: usize = 8;
const SHARD_TOKENS: u32 = 1000;
/// Windows of `seq_len + 1` tokens with stride `seq_len` in a shard of 1000 tokens.
const SHARD_WINDOWS: usize = 999 / SEQ_LEN;

/// `shards` training shards (`t_train_00000k.bin` holding `1000k .. 1000(k+1)`) and a
/// validation shard.
fn write_dataset(dir: &Path, shards: u32) {
    for k in 0..shards {
        let tokens: Vec<u32> = (k * SHARD_TOKENS..(k + 1) * SHARD_TOKENS).collect();
        let name = format!("t_train_{k:06}.bin");
        write_shard(&dir.join(name), &tokens, TokenWidth::U16).unwrap();
    }
    let val: Vec<u32> = (40_000..40_100).collect();
    write_shard(&dir.join("t_val_000000.bin"), &val, TokenWidth::U16).unwrap();
}

fn sole_stream(data: Arc<TokenDataset>, seed: u64) -> BatchStream {
    BatchStream::new(data, SEQ_LEN, 1, WorkerSlot::SOLE, seed).unwrap()
}

/// The shard of each of the next `n` windows of a one-window-per-batch stream.
fn next_shards(stream: &mut BatchStream, n: usize) -> Vec<usize> {
    (0..n)
        .map(|_| stream.next_batch().unwrap().inputs[0] as usize / SHARD_TOKENS as usize)
        .collect()
}

/// Each shard's windows in one run, in the order first seen.
fn runs(shards: &[usize]) -> Vec<usize> {
    let mut order: Vec<usize> = shards.to_vec();
    order.dedup();
    order
}

#[test]
fn an_epoch_reads_its_shards_one_after_another_in_the_order_shards_ahead_gives() {
    let dir = tempfile::tempdir().unwrap();
    write_dataset(dir.path(), 4);
    let data = Arc::new(TokenDataset::open(dir.path(), 50257).unwrap());
    for seed in [1, 2, 3] {
        let mut stream = sole_stream(data.clone(), seed);
        let ahead = stream.shards_ahead();
        let epoch = next_shards(&mut stream, 4 * SHARD_WINDOWS);
        let order = runs(&epoch);
        assert_eq!(order.len(), 4, "one run of windows per shard: {order:?}");
        assert_eq!(
            ahead, order,
            "shards_ahead at the start is the epoch's order"
        );

        // Halfway through the second shard: it comes first, then the rest of this epoch's,
        // then the next epoch's first shard (which this epoch already read).
        let mut stream = sole_stream(data.clone(), seed);
        next_shards(&mut stream, SHARD_WINDOWS + SHARD_WINDOWS / 2);
        let ahead = stream.shards_ahead();
        assert_eq!(ahead[..3], order[1..], "seed {seed}");
        assert_eq!(ahead.len(), 4);
        assert_eq!(ahead[3], order[0]);
    }
    // Another seed, another shard order (among the three seeds).
    let firsts: HashSet<Vec<usize>> = [1, 2, 3]
        .iter()
        .map(|&seed| sole_stream(data.clone(), seed).shards_ahead())
        .collect();
    assert!(firsts.len() > 1, "the shard order depends on the seed");
}

#[test]
fn a_worker_of_several_lists_every_shard_once_and_reads_them_in_that_order() {
    let dir = tempfile::tempdir().unwrap();
    write_dataset(dir.path(), 3);
    let data = Arc::new(TokenDataset::open(dir.path(), 50257).unwrap());
    for index in 0..3 {
        let slot = WorkerSlot { index, count: 3 };
        let mut stream = BatchStream::new(data.clone(), SEQ_LEN, 1, slot, 11).unwrap();
        let ahead = stream.shards_ahead();
        let mut sorted = ahead.clone();
        sorted.sort();
        assert_eq!(sorted, vec![0, 1, 2]);
        let share = stream.windows_per_epoch();
        assert_eq!(runs(&next_shards(&mut stream, share)), ahead);
    }
}

/// The generator the stream's order comes from, spelled out here: a change to it changes
/// every recorded run's data order.
fn pinned_generator(seed: u64, epoch: u64) -> ChaCha8Rng {
    let mut key = *b"gasloc data order v1\0\0\0\0\0\0\0\0\0\0\0\0";
    key[24..].copy_from_slice(&seed.to_le_bytes());
    let mut rng = ChaCha8Rng::from_seed(key);
    rng.set_stream(epoch);
    rng
}

#[test]
fn with_one_training_shard_the_order_is_the_plain_permutation_of_its_windows() {
    // The demo data and every recorded result have one training shard: reading shard by
    // shard left their data order as it was, a permutation of all windows.
    let dir = tempfile::tempdir().unwrap();
    write_dataset(dir.path(), 1);
    let data = Arc::new(TokenDataset::open(dir.path(), 50257).unwrap());
    let mut stream = sole_stream(data, 5);
    for epoch in 0..2 {
        let mut expected: Vec<usize> = (0..SHARD_WINDOWS).collect();
        expected.shuffle(&mut pinned_generator(5, epoch));
        let got: Vec<usize> = (0..SHARD_WINDOWS)
            .map(|_| stream.next_batch().unwrap().inputs[0] as usize / SEQ_LEN)
            .collect();
        assert_eq!(got, expected, "epoch {epoch}");
    }
}

/// A download under way, as the dataset sees it: shards become ready one by one, or the
/// download gives up.
#[derive(Debug, Default)]
struct Download {
    state: Mutex<(HashSet<String>, Option<String>)>,
    changed: Condvar,
}

impl Download {
    fn arrive(&self, name: &str) {
        self.state.lock().unwrap().0.insert(name.to_string());
        self.changed.notify_all();
    }

    fn give_up(&self, why: &str) {
        self.state.lock().unwrap().1 = Some(why.to_string());
        self.changed.notify_all();
    }
}

impl ShardSupply for Download {
    fn wait_for(&self, name: &str) -> Result<(), String> {
        let mut state = self.state.lock().unwrap();
        loop {
            if state.0.contains(name) {
                return Ok(());
            }
            if let Some(why) = &state.1 {
                return Err(why.clone());
            }
            let (next, timeout) = self
                .changed
                .wait_timeout(state, Duration::from_secs(30))
                .unwrap();
            assert!(!timeout.timed_out(), "nobody delivered {name}");
            state = next;
        }
    }
}

/// The pinned table of a 3-shard dataset written in `full`, and an empty directory it is
/// to arrive in, with the validation shard already there.
fn arriving(full: &Path, empty: &Path) -> (Vec<ShardEntry>, Arc<Download>) {
    write_dataset(full, 3);
    let table = pin_directory(full, Tokenizer::Gpt2).unwrap();
    let download = Arc::new(Download::default());
    std::fs::copy(
        full.join("t_val_000000.bin"),
        empty.join("t_val_000000.bin"),
    )
    .unwrap();
    download.arrive("t_val_000000.bin");
    (table, download)
}

#[test]
fn a_dataset_opened_ahead_of_its_shards_waits_for_each_and_streams_as_the_whole_one() {
    let (full, empty) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (table, download) = arriving(full.path(), empty.path());
    let data =
        Arc::new(TokenDataset::open_pinned(empty.path(), &table, 50257, download.clone()).unwrap());
    assert_eq!(data.train_shard_count(), 3);
    assert_eq!(data.train_tokens(), 3 * SHARD_TOKENS as usize);
    assert_eq!(data.val_shards()[0].len(), 100);
    let whole = Arc::new(TokenDataset::open(full.path(), 50257).unwrap());
    let mut expected = sole_stream(whole, 8);
    let mut stream = sole_stream(data.clone(), 8);
    assert_eq!(
        stream.cursor(),
        expected.cursor(),
        "same identity, same cursor"
    );

    // The shards arrive in the order the stream needs them, each while the stream waits.
    for shard in stream.shards_ahead() {
        assert!(!data.train_shard_is_read(shard));
        let name = format!("t_train_{shard:06}.bin");
        let deliver = {
            let (download, from, to) = (
                download.clone(),
                full.path().join(&name),
                empty.path().join(&name),
            );
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                std::fs::copy(from, to).unwrap();
                download.arrive(&name);
            })
        };
        for _ in 0..SHARD_WINDOWS {
            assert_eq!(stream.next_batch().unwrap(), expected.next_batch().unwrap());
        }
        deliver.join().unwrap();
        assert!(data.train_shard_is_read(shard));
    }
}

#[test]
fn a_shard_whose_download_gives_up_is_an_error_naming_it_and_the_stream_stays_put() {
    let (full, empty) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (table, download) = arriving(full.path(), empty.path());
    let data =
        Arc::new(TokenDataset::open_pinned(empty.path(), &table, 50257, download.clone()).unwrap());
    let mut stream = sole_stream(data, 8);
    let first = stream.shards_ahead()[0];
    let name = format!("t_train_{first:06}.bin");
    let before = stream.cursor();
    download.give_up("no peer or mirror holds it (tried 3 sources)");
    let error = stream.next_batch().unwrap_err();
    assert!(
        matches!(error, DataError::ShardUnavailable { .. }),
        "{error}"
    );
    let text = error.to_string();
    assert!(
        text.contains(&name) && text.contains("tried 3 sources"),
        "{text}"
    );
    assert_eq!(stream.cursor(), before, "a failed batch takes no window");
}

#[test]
fn a_delivered_shard_whose_tokens_disagree_with_the_table_is_refused_naming_it() {
    let (full, empty) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (mut table, download) = arriving(full.path(), empty.path());
    let entry = table
        .iter_mut()
        .find(|e| e.name == "t_train_000001.bin")
        .unwrap();
    entry.tokens += 1;
    let data = TokenDataset::open_pinned(empty.path(), &table, 50257, download.clone()).unwrap();
    std::fs::copy(
        full.path().join("t_train_000001.bin"),
        empty.path().join("t_train_000001.bin"),
    )
    .unwrap();
    download.arrive("t_train_000001.bin");
    let error = data.train_shard(1).unwrap_err().to_string();
    assert!(
        error.contains("t_train_000001.bin") && error.contains("1001"),
        "{error}"
    );
}
