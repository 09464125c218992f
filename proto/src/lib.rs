//! gasloc's wire format and run manifest, shared by `gasloc-node` and `gasloc-bootstrap`.
//!
//! Nothing here depends on libtorch, so the bootstrap node builds without it.
//! `wire` holds the protobuf messages specified by `proto/gasloc.proto`.

pub mod manifest;
pub mod wire;

pub use manifest::{RunManifest, Tokenizer};
