//! gasloc's status endpoint, shared by `gasloc-node` (and usable by the bootstrap node);
//! no libtorch.
//!
//! * [`snapshot`]: the `/status` document ([`NodeStatus`]) and its round history;
//! * [`metrics`]: the Prometheus metrics derived from it, in a registry shared with libp2p;
//! * [`server`]: the axum server for `/status`, `/metrics` and the `/` dashboard page;
//! * [`client`]: `gasloc-node status --addr`, the same in a terminal.

pub mod client;
pub mod metrics;
pub mod server;
pub mod snapshot;

pub use metrics::NodeMetrics;
pub use server::StatusServer;
pub use snapshot::{NodeState, NodeStatus, RoundRecord};
