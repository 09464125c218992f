//! gasloc's wire format and run manifest, shared by `gasloc-node` and `gasloc-bootstrap`.
//!
//! Nothing here depends on libtorch, so the bootstrap node builds without it.

pub mod manifest;

pub use manifest::{RunManifest, Tokenizer};
