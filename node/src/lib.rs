//! gasloc-node's library: everything the `gasloc-node` binary runs.
//!
//! * [`data`] reads llm.c token shards and hands each worker its own batch stream;
//! * [`prepare`] turns text into such shards (`gasloc-node data prepare`);
//! * [`tokenizer`] is the GPT-2 BPE and byte tokenizers behind it;

pub mod data;
pub mod prepare;
pub mod tokenizer;
