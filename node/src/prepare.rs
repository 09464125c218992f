//! `gasloc-node data prepare` (being written).
