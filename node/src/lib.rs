//! gasloc-node's library: everything the `gasloc-node` binary runs.
//!
//! * [`model`]: the Llama-3-style decoder, whole, in one file;
//! * [`optim`]: AdamW, the learning-rate schedule and gradient clipping;
//! * [`trainer`]: one model + optimizer + data stream, stepping and evaluating;
//! * [`checkpoint`]: Hugging Face-compatible checkpoints plus gasloc's training state;
//! * [`device`]: `--device` parsing.
//!
//! Token data lives in the torch-free `gasloc-data` crate, the run manifest in
//! `gasloc-proto`.

pub mod checkpoint;
pub mod device;
pub mod model;
pub mod optim;
pub mod trainer;
