//! The node's Prometheus metrics (`/metrics`), kept in the same registry as libp2p's.
//!
//! Values are copied from the latest [`NodeStatus`] when `/metrics` is scraped, so the
//! round loop has one place to report to (the status snapshot) and the two views never
//! disagree. A bootstrap node's [`BootstrapMetrics`] come from its [`BootstrapStatus`] alike.

use crate::snapshot::{BootstrapStatus, NodeStatus};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

type FloatGauge = Gauge<f64, AtomicU64>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerLabel {
    pub peer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabel {
    pub peer: String,
    pub reason: String,
}

/// gasloc's own metrics, all prefixed `gasloc_`.
#[derive(Clone, Default)]
pub struct NodeMetrics {
    round: Gauge,
    inner_steps: Gauge,
    step_time: FloatGauge,
    compute_utilization: FloatGauge,
    train_loss: FloatGauge,
    val_loss: FloatGauge,
    neighbours: Gauge,
    connected_peers: Gauge,
    bytes_sent: Counter,
    bytes_received: Counter,
    rounds: Counter,
    goodput: Family<PeerLabel, FloatGauge>,
    wait_ms: Counter,
    refused: Family<RefusalLabel, Counter>,
    banned: Gauge,
    score: Family<PeerLabel, FloatGauge>,
    shards_held: Gauge,
    shard_bytes_fetched: Counter,
    shard_bytes_served: Counter,
}

impl NodeMetrics {
    /// Creates the metrics and registers them under `gasloc_`.
    pub fn register(registry: &mut Registry) -> NodeMetrics {
        let m = NodeMetrics::default();
        let r = registry.sub_registry_with_prefix("gasloc");
        r.register("round", "Current round", m.round.clone());
        r.register(
            "inner_steps",
            "Inner steps planned this round (H_i)",
            m.inner_steps.clone(),
        );
        r.register(
            "step_time_seconds",
            "Moving average of one inner step",
            m.step_time.clone(),
        );
        r.register("train_loss", "Latest training loss", m.train_loss.clone());
        r.register("val_loss", "Latest validation loss", m.val_loss.clone());
        r.register("neighbours", "Neighbours this round", m.neighbours.clone());
        r.register(
            "connected_peers",
            "Connected peers",
            m.connected_peers.clone(),
        );
        r.register("sent_bytes", "Exchange bytes sent", m.bytes_sent.clone());
        r.register(
            "received_bytes",
            "Exchange bytes received",
            m.bytes_received.clone(),
        );
        r.register("rounds", "Rounds completed", m.rounds.clone());
        r.register(
            "goodput_bytes_per_second",
            "Latest goodput to each peer",
            m.goodput.clone(),
        );
        r.register(
            "compute_utilization",
            "Trainer busy time over wall time in the recent rounds (NaN before the first)",
            m.compute_utilization.clone(),
        );
        r.register(
            "wait_milliseconds",
            "Time spent waiting for neighbours",
            m.wait_ms.clone(),
        );
        r.register(
            "refused_payloads",
            "Neighbour payloads refused, per peer and reason",
            m.refused.clone(),
        );
        r.register(
            "banned_peers",
            "Peers banned for the rest of the run",
            m.banned.clone(),
        );
        r.register(
            "peer_score",
            "Gossipsub application score of each peer with offences (minus one per offence)",
            m.score.clone(),
        );
        r.register(
            "shards_held",
            "Pinned shards of the run this node holds, verified",
            m.shards_held.clone(),
        );
        r.register(
            "shard_fetched_bytes",
            "Shard bytes fetched from peers and mirrors",
            m.shard_bytes_fetched.clone(),
        );
        r.register(
            "shard_served_bytes",
            "Shard bytes served to peers",
            m.shard_bytes_served.clone(),
        );
        m
    }

    /// Brings every metric to the snapshot's values (counters only move forward).
    pub fn update(&self, s: &NodeStatus) {
        self.round.set(s.round as i64);
        self.inner_steps.set(s.inner_steps as i64);
        self.step_time.set(s.step_time_s);
        self.compute_utilization
            .set(s.compute_utilization.unwrap_or(f64::NAN));
        self.train_loss.set(s.train_loss.unwrap_or(f64::NAN));
        self.val_loss.set(s.val_loss.unwrap_or(f64::NAN));
        self.neighbours.set(s.neighbours.len() as i64);
        self.connected_peers.set(s.connected_peers as i64);
        advance(&self.bytes_sent, s.bytes_sent);
        advance(&self.bytes_received, s.bytes_received);
        advance(
            &self.rounds,
            s.history.back().map(|r| r.round + 1).unwrap_or(0),
        );
        advance(&self.wait_ms, (s.wait_s * 1000.0) as u64);
        for (peer, kinds) in &s.refusals {
            for (kind, count) in kinds {
                let label = RefusalLabel {
                    peer: peer.clone(),
                    reason: kind.clone(),
                };
                advance(&self.refused.get_or_create(&label), *count);
            }
        }
        self.banned.set(s.banned.len() as i64);
        self.shards_held.set(s.data.shards_held as i64);
        advance(&self.shard_bytes_fetched, s.data.bytes_fetched);
        advance(&self.shard_bytes_served, s.data.bytes_served);
        for (peer, score) in &s.scores {
            self.score
                .get_or_create(&PeerLabel { peer: peer.clone() })
                .set(*score);
        }
        for (peer, rate) in &s.goodput {
            self.goodput
                .get_or_create(&PeerLabel { peer: peer.clone() })
                .set(*rate);
        }
    }
}

/// A bootstrap node's own metrics, prefixed `gasloc_`.
#[derive(Clone, Default)]
pub struct BootstrapMetrics {
    connected_peers: Gauge,
    topic_peers: Gauge,
}

impl BootstrapMetrics {
    /// Creates the metrics and registers them under `gasloc_`.
    pub fn register(registry: &mut Registry) -> BootstrapMetrics {
        let m = BootstrapMetrics::default();
        let r = registry.sub_registry_with_prefix("gasloc");
        r.register(
            "connected_peers",
            "Connected peers",
            m.connected_peers.clone(),
        );
        r.register(
            "topic_peers",
            "Peers subscribed to the run's topic",
            m.topic_peers.clone(),
        );
        m
    }

    /// Brings every metric to the snapshot's values.
    pub fn update(&self, s: &BootstrapStatus) {
        self.connected_peers.set(s.connected_peers as i64);
        self.topic_peers.set(s.topic_peers as i64);
    }
}

/// Metrics that are brought to a status document's values when `/metrics` is scraped.
pub(crate) trait UpdateFrom<S>: Clone + Send + Sync + 'static {
    fn update_from(&self, status: &S);
}

impl UpdateFrom<NodeStatus> for NodeMetrics {
    fn update_from(&self, status: &NodeStatus) {
        self.update(status)
    }
}

impl UpdateFrom<BootstrapStatus> for BootstrapMetrics {
    fn update_from(&self, status: &BootstrapStatus) {
        self.update(status)
    }
}

/// Moves a counter up to `total` (never down).
fn advance(counter: &Counter, total: u64) {
    let now = counter.get();
    if total > now {
        counter.inc_by(total - now);
    }
}
