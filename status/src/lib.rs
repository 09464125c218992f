//! gasloc's status endpoint, shared by `gasloc-node` and `gasloc-bootstrap`; no libtorch.
//!
//! * [`snapshot`]: the `/status` documents ([`NodeStatus`] and its round history; a
//!   bootstrap node's [`BootstrapStatus`]);
//! * [`metrics`]: the Prometheus metrics derived from it, in a registry shared with libp2p;
//! * [`server`]: the axum server for `/status`, `/metrics` and the `/` dashboard page;
//! * [`client`]: `gasloc-node status --addr`, the same in a terminal.

pub mod client;
pub mod metrics;
pub mod server;
pub mod snapshot;

pub use metrics::{BootstrapMetrics, NodeMetrics};
pub use server::StatusServer;
pub use snapshot::{
    BannedPeer, BootstrapStatus, DataStatus, GateReading, NodeState, NodeStatus, Reachability,
    RefusedPayload, RoundRecord, StateSyncReport, TrainerTime,
};
