//! What a node reports about itself: the `/status` JSON documents.
//!
//! The node's round loop owns a [`NodeStatus`] and publishes a copy after every change
//! through a `tokio::sync::watch` channel; the HTTP server, the metrics and the terminal
//! client only read those copies. A bootstrap node reports the smaller [`BootstrapStatus`]
//! the same way. [`Reachability`] is AutoNAT's verdict as both the network layer and the
//! documents name it.

use gasloc_proto::RefusalKind;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::fmt;

/// Rounds kept in [`NodeStatus::history`].
pub const HISTORY_ROUNDS: usize = 200;

/// The recent rounds [`NodeStatus::compute_utilization`] counts.
pub const UTILIZATION_ROUNDS: usize = 10;

/// Where the node is in its round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    #[default]
    Starting,
    /// Streaming the current anchor from a live peer (late join).
    Syncing,
    /// Running inner steps.
    Training,
    /// Commit-reveal of the round's permutation.
    Agreeing,
    /// Sending and receiving states with this round's neighbours.
    Exchanging,
    /// Waiting for neighbours that have not arrived yet.
    Waiting,
    /// Finishing the current exchange and writing a checkpoint before leaving.
    Stopping,
    Stopped,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Starting => "starting",
            NodeState::Syncing => "syncing",
            NodeState::Training => "training",
            NodeState::Agreeing => "agreeing",
            NodeState::Exchanging => "exchanging",
            NodeState::Waiting => "waiting",
            NodeState::Stopping => "stopping",
            NodeState::Stopped => "stopped",
        }
    }
}

/// Whether other peers can dial a node, as AutoNAT last found (a bootstrap node, the
/// AutoNAT server, dials back the addresses the node was seen at). In JSON: `"unknown"`,
/// `"public"` or `"private"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Reachability {
    /// Not probed yet, or the probes disagree.
    #[default]
    Unknown,
    /// Dialled back at an address it was seen at.
    Public,
    /// Behind NAT or a firewall: peers reach it only through a relay circuit (which the node
    /// then listens on) or after a hole punch.
    Private,
}

impl Reachability {
    /// `unknown`, `public` or `private` (the status document's word).
    pub fn as_str(self) -> &'static str {
        match self {
            Reachability::Unknown => "unknown",
            Reachability::Public => "public",
            Reachability::Private => "private",
        }
    }
}

impl fmt::Display for Reachability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one node saw and did in one round (peer ids as base58 strings): the one record of a
/// round, written by the round machine, printed and appended to `--report` by `join`, and
/// kept in [`NodeStatus::history`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct RoundRecord {
    pub peer: String,
    pub round: u64,
    pub is_member: bool,
    pub members: Vec<String>,
    pub permutation: Vec<String>,
    pub neighbours: Vec<String>,
    /// Neighbours whose payload arrived and passed every check.
    pub exchanged: Vec<String>,
    /// Neighbours whose payload arrived and was refused: by the exchange's checks (framing,
    /// table, checksums) or by the payload gate (its values).
    pub refused: Vec<RefusedPayload>,
    /// Neighbours that failed, with the reason.
    pub failed: Vec<(String, String)>,
    /// Peers that committed to the round but withheld their reveal (excluded from it).
    pub withheld: Vec<String>,
    /// The payload gate's numbers for every payload it measured (accepted or refused).
    pub gate: Vec<GateReading>,
    /// The weights applied, `(peer, weight)`, this node first: the round topology's row
    /// with every neighbour that sent nothing usable left out (its weight returned to self,
    /// or on the complete topology spread over the members that arrived).
    pub mixing: Vec<(String, f64)>,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Inner steps taken (H_i) and the moving average of one step, seconds.
    pub inner_steps: u64,
    pub step_time_s: f64,
    /// Seconds from the round start the inner steps were given (their final deadline), and
    /// the exchange time predicted for the round.
    pub budget_s: f64,
    pub predicted_exchange_s: f64,
    /// Seconds from the start of the exchange until every neighbour's result was in.
    pub exchange_s: f64,
    /// Seconds the slowest swap took from both sides being ready to its end: the link's
    /// share of `exchange_s` (what `predicted_exchange_s` predicts).
    pub transfer_s: f64,
    /// Seconds from "payload ready" until every neighbour's result was in (agreement and
    /// neighbours included).
    pub wait_s: f64,
    /// Seconds the payload gate took to judge what arrived (the last part of `exchange_s`
    /// and `wait_s`; filled in by the driver).
    pub gate_s: f64,
    /// Seconds of the mixing and outer step.
    pub finish_s: f64,
    /// Seconds from the round start until its outer step was done.
    pub round_s: f64,
    /// Seconds the trainer spent on the round's inner steps.
    pub train_s: f64,
    /// The round's wall time: from the end of the round before (when this node finished it)
    /// or the round's start, to its outer step done.
    pub wall_s: f64,
    /// `train_s / wall_s`: the share of the round the trainer computed.
    pub compute_utilization: f64,
    /// Where the trainer thread's time went in this round besides its inner steps.
    pub trainer_time: TrainerTime,
    pub train_loss: Option<f64>,
    pub val_loss: Option<f64>,
    /// Milliseconds from the round start until the round was decided.
    pub decided_after_ms: u64,
    /// Milliseconds from the opening of the round's commit window (when members publish
    /// their commits, during the round before) to the last commit received from another
    /// peer.
    pub last_commit_after_ms: u64,
    /// Milliseconds from the round start (when members publish their reveals) to the last
    /// reveal received.
    pub last_reveal_after_ms: u64,
    /// Control messages about this round this node received (commits, announces, reveals).
    pub control_messages: u64,
    /// Peers this node had a connection to when the round ended (filled in by the driver).
    pub connected_peers: usize,
    /// AutoNAT's verdict when the round ended (filled in by the driver).
    pub reachability: Reachability,
    /// Hole punches since the node started (filled in by the driver).
    pub hole_punches: u64,
}

/// Where the trainer thread spent a round's time besides its inner steps (`train_s`), from
/// its training order to its payload ready: the trainer's side of what keeps
/// `compute_utilization` below 1. A blocking round's exchange, and its gate and outer step
/// (which the trainer serves after the payload), are not in it. An overlapped round's steps
/// begin before its `wall_s` window opens (at the round before's outer step), so these parts
/// and `train_s` add up to the wall time over many rounds, not within one.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct TrainerTime {
    /// Overlapped rounds: seconds, until the inner steps stopped, serving the round handed off
    /// before this one (its payload gate and outer step) between steps.
    pub served_s: f64,
    /// Overlapped rounds: seconds after the last inner step until the round before's outer
    /// step was done (waiting for its exchange, and serving its gate and outer step if they
    /// came then): a round hands off only after the one before is finished.
    pub waited_s: f64,
    /// Seconds, after any such wait, to the payload ready: the hand-off (eager's own outer
    /// step; on a checkpoint round the moments' snapshot) and the payload's encoding.
    pub payload_s: f64,
    /// Seconds of the steps' deadline left when they stopped: with adaptive H_i less than one
    /// step (one more would not have fit); with a fixed H, or at H_max, whatever remained.
    pub unused_s: f64,
}

/// What the payload gate measured of one neighbour's payload: how close an honest peer lies
/// to the bounds (`distance / reference` against `max_distance_ratio`, `cosine` against
/// `min_cosine`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct GateReading {
    pub peer: String,
    /// `‖θ_i − x_j‖`.
    pub distance: f64,
    /// `max(‖θ_i − x_i‖, median of the accepted distances)`, 0 before there is one.
    pub reference: f64,
    /// `cos(θ_i − x_j, θ_i − x_i)`, when both are nonzero.
    pub cosine: Option<f64>,
    /// The functional check: the loss on a held-out batch of this node's model with the
    /// payload swapped in (its round's fragment `x_j`), when the check ran.
    pub loss: Option<f64>,
    /// What `loss` is held against: the larger of the model's loss with its own payload and
    /// with the round's anchor (`loss − loss_reference` against `[gate] max_loss_increase`).
    pub loss_reference: Option<f64>,
    /// Seconds of the trainer's time this payload's screening took (the round's shared out
    /// over its payloads): the gate's cost, without the wait for the trainer thread.
    pub screen_s: f64,
}

/// A neighbour's payload this node turned down, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct RefusedPayload {
    pub peer: String,
    /// The reason's kind: the payload gate's (`non_finite`, `too_far`, …), the exchange's
    /// (`table_mismatch`, `not_a_neighbour`, `too_large`, …) or state sync's.
    pub kind: RefusalKind,
    /// The whole reason, with its numbers.
    pub reason: String,
    /// Garbage beyond doubt (`gasloc_proto::gate::Refusal::is_gross`): one such offence bans
    /// the peer.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gross: bool,
}

/// The node's state as `/status` serves it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct NodeStatus {
    pub peer_id: String,
    pub run_id: String,
    pub run_name: String,
    pub state: NodeState,
    pub round: u64,
    /// Inner steps planned for the current round (H_i).
    pub inner_steps: u64,
    /// Moving average of one inner step, seconds.
    pub step_time_s: f64,
    pub train_loss: Option<f64>,
    pub val_loss: Option<f64>,
    /// This round's neighbours (peer ids).
    pub neighbours: Vec<String>,
    /// Totals since the node started.
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Measured goodput to each peer, bytes per second (latest transfer).
    pub goodput: BTreeMap<String, f64>,
    /// Total seconds spent waiting for neighbours.
    pub wait_s: f64,
    /// Peers this node is connected to.
    pub connected_peers: usize,
    /// Whether other peers can dial this node, as AutoNAT last found (when private, it
    /// listens through the bootstrap nodes' relays).
    pub reachability: Reachability,
    /// Relayed connections DCUtR turned into direct ones (hole punches) since the start.
    pub hole_punches: u64,
    /// Payloads refused since the start, per peer and reason kind.
    pub refusals: BTreeMap<String, BTreeMap<String, u64>>,
    /// Recent rounds, oldest first, at most [`HISTORY_ROUNDS`].
    pub history: VecDeque<RoundRecord>,
    /// How this node's starting state was chosen, when it joined a run under way.
    pub state_sync: Option<StateSyncReport>,
    /// Peers this node banned for the rest of the run (kept in its home across restarts).
    pub banned: Vec<BannedPeer>,
    /// Offences per peer within the ban window, as its gossipsub application score
    /// (0: none; minus one per offence).
    pub scores: BTreeMap<String, f64>,
    /// The run's pinned shards on this node: held, fetched and served.
    pub data: DataStatus,
    /// The trainer's busy time over wall time in the last [`UTILIZATION_ROUNDS`] rounds
    /// (None before the first round ends).
    pub compute_utilization: Option<f64>,
}

/// The run's data on one node (all zero for a run that does not pin its shards).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct DataStatus {
    /// Shards the manifest pins, and how many of them this node holds verified.
    pub shards_total: u64,
    pub shards_held: u64,
    /// Bytes of all pinned shards, and bytes this process fetched (resumed bytes are not
    /// fetched again and not counted).
    pub bytes_total: u64,
    pub bytes_fetched: u64,
    /// Shard bytes this node served to peers.
    pub bytes_served: u64,
    /// Whether this node serves its verified shards to peers.
    pub serving: bool,
    /// Sources that served wrong bytes or failed, `source shard: reason`.
    pub bad_sources: Vec<String>,
}

/// A peer banned for the rest of the run: its connections are refused, it is no neighbour
/// to mix with, and its gossipsub score is the lowest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct BannedPeer {
    pub peer: String,
    /// The round of the offence that banned it.
    pub round: u64,
    /// The offences within the window, `round:kind`, oldest first.
    pub offences: Vec<String>,
}

/// A late joiner's state sync: the sources it started from and the ones it refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct StateSyncReport {
    /// The round the state begins.
    pub round: u64,
    /// The peers whose states agreed and were averaged; one alone was not cross-checked.
    pub sources: Vec<String>,
    /// States refused: `non_finite`, or `state_disagrees` (outvoted by the sources that
    /// agree with each other).
    pub refused: Vec<RefusedPayload>,
    /// The largest relative distance `‖θ_a − θ_b‖ / max(‖θ_a‖, ‖θ_b‖)` between the anchors
    /// of two kept sources (0 for one source).
    pub disagreement: f64,
}

impl NodeStatus {
    /// Keeps the state sync's report, counting its refusals with the rounds'.
    pub fn record_state_sync(&mut self, report: StateSyncReport) {
        for refused in &report.refused {
            self.count_refusal(refused);
        }
        self.state_sync = Some(report);
    }

    fn count_refusal(&mut self, refused: &RefusedPayload) {
        *self
            .refusals
            .entry(refused.peer.clone())
            .or_default()
            .entry(refused.kind.to_string())
            .or_default() += 1;
    }

    /// Appends a finished round to the history (dropping the oldest beyond the cap) and
    /// adds its traffic and waiting to the totals.
    pub fn record_round(&mut self, record: RoundRecord) {
        self.bytes_sent += record.bytes_sent;
        self.bytes_received += record.bytes_received;
        self.wait_s += record.wait_s;
        for refused in &record.refused {
            self.count_refusal(refused);
        }
        if record.train_loss.is_some() {
            self.train_loss = record.train_loss;
        }
        if record.val_loss.is_some() {
            self.val_loss = record.val_loss;
        }
        self.history.push_back(record);
        while self.history.len() > HISTORY_ROUNDS {
            self.history.pop_front();
        }
        let recent = self.history.iter().rev().take(UTILIZATION_ROUNDS);
        let (busy, wall) = recent.fold((0.0, 0.0), |(b, w), r| (b + r.train_s, w + r.wall_s));
        self.compute_utilization = Some(if wall > 0.0 {
            (busy / wall).clamp(0.0, 1.0)
        } else {
            1.0
        });
    }

    /// The share of wall-clock time spent waiting over the recorded rounds (0 when none).
    pub fn idle_share(&self) -> f64 {
        let total: f64 = self.history.iter().map(|r| r.round_s).sum();
        let waiting: f64 = self.history.iter().map(|r| r.wait_s).sum();
        if total > 0.0 {
            waiting / total
        } else {
            0.0
        }
    }
}

/// A bootstrap node's `/status` document: which run it serves and who it sees.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct BootstrapStatus {
    pub run_id: String,
    pub run_name: String,
    pub peer_id: String,
    /// Peers the bootstrap node has a connection to.
    pub connected_peers: usize,
    /// Peers subscribed to the run's topic, as the bootstrap node's gossipsub knows them.
    pub topic_peers: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_utilization_is_busy_over_wall_time_of_the_recent_rounds() {
        let mut s = NodeStatus::default();
        assert_eq!(s.compute_utilization, None);
        let round = |round, train_s, wall_s| RoundRecord {
            round,
            train_s,
            wall_s,
            ..Default::default()
        };
        // Old rounds that idled half the time, then UTILIZATION_ROUNDS busy ones.
        for r in 0..5 {
            s.record_round(round(r, 1.0, 2.0));
        }
        assert_eq!(s.compute_utilization, Some(0.5));
        for r in 5..(5 + UTILIZATION_ROUNDS as u64 - 1) {
            s.record_round(round(r, 3.0, 4.0));
        }
        // 9 rounds of 3/4 and one of 1/2: 28 / 38.
        let expected = (9.0 * 3.0 + 1.0) / (9.0 * 4.0 + 2.0);
        assert!((s.compute_utilization.unwrap() - expected).abs() < 1e-12);
        s.record_round(round(99, 4.0, 4.0));
        let expected = (9.0 * 3.0 + 4.0) / (10.0 * 4.0);
        assert!((s.compute_utilization.unwrap() - expected).abs() < 1e-12);
    }

    #[test]
    fn history_is_capped_and_totals_add_up() {
        let mut s = NodeStatus::default();
        for round in 0..(HISTORY_ROUNDS as u64 + 5) {
            s.record_round(RoundRecord {
                round,
                bytes_sent: 10,
                bytes_received: 20,
                wait_s: 0.5,
                round_s: 2.0,
                train_loss: Some(3.0),
                // The round machine's whole record is kept, not a summary of it.
                failed: vec![("12D3KooWPeerB".into(), "exchange timed out".into())],
                refused: vec![RefusedPayload {
                    peer: "12D3KooWPeerD".into(),
                    kind: RefusalKind::TooFar,
                    reason: "gate: too_far: …".into(),
                    gross: false,
                }],
                mixing: vec![
                    ("12D3KooWPeerA".into(), 2.0 / 3.0),
                    ("12D3KooWPeerC".into(), 1.0 / 3.0),
                ],
                reachability: Reachability::Public,
                ..Default::default()
            });
        }
        assert_eq!(s.history.len(), HISTORY_ROUNDS);
        assert_eq!(s.history.front().unwrap().round, 5);
        assert_eq!(s.bytes_sent, 10 * (HISTORY_ROUNDS as u64 + 5));
        assert!((s.idle_share() - 0.25).abs() < 1e-12);
        assert_eq!(s.train_loss, Some(3.0));
        assert_eq!(
            s.refusals["12D3KooWPeerD"]["too_far"],
            HISTORY_ROUNDS as u64 + 5,
            "refusals count every round, not only those in the history"
        );
        s.reachability = Reachability::Private;
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.contains(r#""reachability":"private""#), "{json}");
        let back: NodeStatus = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn reachability_is_its_lowercase_word_in_json_and_text() {
        for (r, word) in [
            (Reachability::Unknown, "unknown"),
            (Reachability::Public, "public"),
            (Reachability::Private, "private"),
        ] {
            assert_eq!(serde_json::to_string(&r).unwrap(), format!("\"{word}\""));
            assert_eq!(
                serde_json::from_str::<Reachability>(&format!("\"{word}\"")).unwrap(),
                r
            );
            assert_eq!(r.to_string(), word);
        }
        assert!(serde_json::from_str::<Reachability>("\"Public\"").is_err());
        assert_eq!(Reachability::default(), Reachability::Unknown);
    }
}
