//! gasloc's wire format and run manifest, shared by `gasloc-node` and `gasloc-bootstrap`.
//!
//! * [`manifest`]: the run manifest and its run id;
//! * [`topology`]: round permutations, communication graphs and mixing weights;
//! * [`pace`]: the adaptive H_i rule and the moving averages it rests on.
//!
//! Nothing here depends on libtorch, so the bootstrap node builds without it.
//! `wire` holds the protobuf messages specified by `proto/gasloc.proto`.

pub mod manifest;
pub mod pace;
pub mod topology;
pub mod wire;

pub use manifest::{RunManifest, Tokenizer};
