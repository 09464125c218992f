//! gasloc's wire format and run manifest, shared by `gasloc-node` and `gasloc-bootstrap`.
//!
//! * [`manifest`]: the run manifest;
//! * [`run_id`]: the run id ([`RunId`]: 32 bytes, 64 hex digits to people);
//! * [`topology`]: round permutations, communication graphs and mixing weights;
//! * [`pace`]: the adaptive H_i rule and the moving averages it rests on;
//! * [`gate`]: the payload gate, whether a neighbour's model may be mixed;
//! * [`refusal`]: [`RefusalKind`], why a peer's payload, state or behaviour was refused, and
//!   which refusals are offences;
//! * [`fragments`]: the model split into fragments, and which one a round exchanges.
//!
//! Nothing here depends on libtorch, so the bootstrap node builds without it.
//! `wire` holds the protobuf messages specified by `proto/gasloc.proto`.

pub mod fragments;
pub mod gate;
pub mod manifest;
pub mod pace;
pub mod refusal;
pub mod run_id;
pub mod topology;
pub mod wire;

pub use manifest::{RunManifest, ShardEntry, Split, Tokenizer};
pub use refusal::RefusalKind;
pub use run_id::{RunId, RunIdError};
