//! Token data for gasloc, with no libtorch: reading llm.c token shards ([`shards`]),
//! cutting them into seeded, per-worker disjoint batch streams ([`stream`]), turning text
//! into tokens and back ([`tokenizer`]), and `data prepare`, which writes shards from
//! text files ([`prepare`]), and the pinned shard table of a run's manifest ([`pin`]). Every failure is a [`DataError`] whose message names the
//! file or setting at fault; nothing here panics on bad input.

pub mod error;
pub mod pin;
pub mod prepare;
pub mod shards;
pub mod stream;
pub mod tokenizer;

pub use error::DataError;
pub use prepare::{prepare, PrepareOptions, PrepareReport};
pub use shards::{
    read_shard, read_shard_from, write_shard, Shard, ShardSupply, TokenDataset, TokenWidth,
};
pub use stream::{validation_batches, Batch, BatchStream, StreamCursor, WorkerSlot};
pub use tokenizer::TextTokenizer;
