//! gasloc-node's library: everything the `gasloc-node` binary runs.
