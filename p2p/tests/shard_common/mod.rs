//! Helpers of the shard-service tests: small pinned llm.c shards on disk, catalogs, and
//! shard servers on real loopback swarms.
#![allow(dead_code)]

use gasloc_data::{write_shard, TokenWidth};
use gasloc_p2p::shard_service::{ShardCatalog, ShardServeConfig, ShardService};
use gasloc_proto::{ShardEntry, Tokenizer};
use std::path::{Path, PathBuf};

pub use super::common::*;

/// Tokens per training shard: 2 bytes each, so about 200 KB a shard.
pub const TRAIN_TOKENS: usize = 100_000;

/// Writes `train` training shards and one validation shard into `dir` (byte tokenizer,
/// different tokens in each) and returns their pinned table, in file-name order.
pub fn write_pinned_shards(dir: &Path, train: usize) -> Vec<ShardEntry> {
    let width = TokenWidth::for_vocab(Tokenizer::Byte.vocab_size());
    for shard in 0..=train {
        let count = if shard < train {
            TRAIN_TOKENS
        } else {
            TRAIN_TOKENS / 3
        };
        let tokens: Vec<u32> = (0..count)
            .map(|i| ((i * 31 + shard * 101 + i / 7) % 255 + 1) as u32)
            .collect();
        let name = if shard < train {
            format!("t_train_{shard:06}.bin")
        } else {
            "t_val_000000.bin".to_string()
        };
        write_shard(&dir.join(name), &tokens, width).expect("shard written");
    }
    gasloc_data::pin::pin_directory(dir, Tokenizer::Byte).expect("shards pin")
}

/// A catalog serving every entry from `dir`.
pub fn catalog_of(dir: &Path, entries: &[ShardEntry]) -> ShardCatalog {
    let catalog = ShardCatalog::new();
    for entry in entries {
        catalog.insert(entry.clone(), dir.join(&entry.name));
    }
    catalog
}

/// A copy of `entry`'s file in `dir` with one byte flipped in the middle (same length).
pub fn corrupted_copy(from: &Path, entry: &ShardEntry, dir: &Path) -> PathBuf {
    let mut bytes = std::fs::read(from.join(&entry.name)).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xFF;
    let path = dir.join(&entry.name);
    std::fs::write(&path, bytes).unwrap();
    path
}

pub fn serve_config() -> ShardServeConfig {
    ShardServeConfig::new(RUN_ID)
}

/// The shard service on `network`, serving `catalog`.
pub fn serve(
    network: &gasloc_p2p::network::Network,
    catalog: ShardCatalog,
    config: ShardServeConfig,
) -> ShardService {
    ShardService::start(network.client.stream_control(), catalog, config)
        .expect("shard service registers its protocol")
}

/// Starts `servers` swarms and one client swarm that bootstraps from (and is connected to)
/// all of them. Returns (servers, client).
pub async fn swarms(
    servers: usize,
) -> (
    Vec<gasloc_p2p::network::Network>,
    gasloc_p2p::network::Network,
) {
    init_tracing();
    let mut started = Vec::new();
    for _ in 0..servers {
        started.push(
            start(
                libp2p::identity::Keypair::generate_ed25519(),
                Transport::Quic,
                vec![],
            )
            .await,
        );
    }
    let addrs = started.iter().map(full_addr).collect();
    let client = start(
        libp2p::identity::Keypair::generate_ed25519(),
        Transport::Quic,
        addrs,
    )
    .await;
    for server in &started {
        wait_connected(&client, server.client.peer_id()).await;
    }
    (started, client)
}
