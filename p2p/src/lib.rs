//! gasloc's networking, shared by `gasloc-node` and `gasloc-bootstrap` (no libtorch).
//!
//! - [`swarm`], [`config`], [`network`]: the libp2p swarm and the event loop that owns it.
//! - [`control`]: the run's gossipsub control plane and its validation.
//! - [`schedule`], [`permutation`]: commit-reveal and the round's neighbours (sans-IO).
//! - [`frames`], [`exchange`], [`exchange_service`]: tensor exchange on `/gasloc/exchange/2`
//!   and state sync on `/gasloc/state/1`.
//! - [`manifest_service`]: the manifest request-response protocol.
//! - [`shard_service`], [`shard_client`], [`shard_fetch`]: the run's pinned token shards on `/gasloc/shard/1`
//!   (served from a catalog of verified files) and fetched from peers and HTTP mirrors.
//! - [`identity`]: the persisted node key.
//! - [`access`], [`swarm_key`]: a closed run's allow-list, and a private swarm's pre-shared
//!   key (libp2p `pnet`, TCP only).
//! - [`upload_limit`]: the node's upload cap (`--max-upload-rate`).
//! - [`round_machine`], [`links`]: a node's round lifecycle and its link estimates (sans-IO).
//! - [`driver`], [`work`], [`synthetic`]: the async shell that runs the round machine on a
//!   live swarm, what it asks of a trainer, and the synthetic trainer.
//! - [`swarm_node`]: one node wired (network, run topic, exchange service, driver), as
//!   `gasloc-node join` and [`local_swarm`] (many nodes in one process) both start it.
//! - [`swarm_sim`]: many round machines in one process over a simulated network (no I/O).

/// Peer ids (as every crate of gasloc names nodes), addresses and node keys.
pub use libp2p::identity::Keypair;
pub use libp2p::{Multiaddr, PeerId};

pub mod access;
pub mod config;
pub mod control;
pub mod driver;
pub mod exchange;
pub mod exchange_service;
pub mod frames;
pub mod identity;
pub mod links;
pub mod local_swarm;
pub mod manifest_service;
pub mod network;
pub mod peer_standing;
pub mod permutation;
pub mod round_machine;
pub mod schedule;
pub mod shard_client;
pub mod shard_fetch;
pub mod shard_service;
pub mod swarm;
pub mod swarm_key;
pub mod swarm_node;
pub mod swarm_sim;
pub mod synthetic;
pub mod tensors;
pub mod upload_limit;
pub mod work;
