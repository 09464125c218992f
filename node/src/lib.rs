//! gasloc-node's library: everything the `gasloc-node` binary runs.
//!
//! * [`algo`]: the round math (mixing, outer step, LoRDO, payloads);
//! * [`sim`]: N workers in one process, per-round records, summary and plot;
//! * [`model`]: the Llama-3-style decoder, whole, in one file;
//! * [`optim`]: AdamW, the learning-rate schedule and gradient clipping;
//! * [`inner_optimizer`]: the manifest's inner optimizer, AdamW or LoRDO;
//! * [`trainer`]: one model + optimizer + data stream, stepping and evaluating;
//! * [`checkpoint`]: Hugging Face-compatible checkpoints plus gasloc's training state;
//! * [`volunteer`]: the trainer behind `gasloc-node join` (rounds on its own thread);
//! * [`tensor_wire`]: libtorch tensors to and from the wire's tensors;
//! * [`lordo_wire`]: the LoRDO payload's factors on the wire;
//! * [`run_data`]: the run's shards on a joining node: `--data`, or fetched from the swarm,
//!   and served on;
//! * [`join`]: the `gasloc-node join` process around one swarm node (flags, runtime,
//!   stdout, report, status server, signals);
//! * [`device`]: `--device` parsing.
//!
//! Token data lives in the torch-free `gasloc-data` crate, the run manifest in
//! `gasloc-proto`.

pub mod algo;
pub mod checkpoint;
pub mod device;
pub mod inner_optimizer;
pub mod join;
pub mod lordo_wire;
pub mod model;
pub mod optim;
pub mod run_data;
pub mod sim;
pub mod tensor_wire;
pub mod trainer;
pub mod volunteer;
