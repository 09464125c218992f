//! What a node knows of the links it exchanges over, and the exchange time `C_i` it
//! predicts from them (`docs/algorithms.md`, "Adaptive H_i") — pure functions, no I/O, no clock.
//!
//! A swap is timed from the moment both sides were ready to its end (the exchange service
//! measures it), so waiting for a partner still training is not link time. Link times are
//! seconds per payload byte, over all the bytes the node swapped at once (a two-peer round
//! sends its payload twice over the same link). The node keeps:
//! * per peer, the [`MovingAverage`] of its swaps with it;
//! * its own link: the fastest swap of each of its last [`LinkEstimates::RECENT_ROUNDS`]
//!   rounds (a swap is no faster than either side's link, so a slow partner does not make
//!   this node look slow); this is what it announces to others;
//! * the goodput each peer announced (an `Announce` beside its commit), so that the partner
//!   of a slow node stops training early enough even when they never met.
//!
//! `C_i` is this round's payload bytes ([`PayloadBytes`]: per model fragment, or larger on
//! the LoRDO payload's full-sync rounds) times the seconds per byte of the slowest link
//! involved; the inner steps' deadline is the round's end less `C_i`, the outer step's time
//! and a margin ([`train_deadline`]).

use crate::schedule::Timing;
use gasloc_proto::fragments::fragment_of_round;
use gasloc_proto::manifest::is_full_sync_round;
use gasloc_proto::pace::MovingAverage;
use gasloc_proto::topology::Topology;
use libp2p::PeerId;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// A node's link measurements.
#[derive(Debug, Default)]
pub struct LinkEstimates {
    peer_s_per_byte: HashMap<PeerId, MovingAverage>,
    recent_fastest: VecDeque<f64>,
    announced: HashMap<PeerId, u64>,
}

impl LinkEstimates {
    /// Rounds the node's own link estimate looks back over.
    pub const RECENT_ROUNDS: usize = 8;

    /// Records a round's exchange: `payload_bytes` sent to each of `neighbours` neighbours
    /// at once, and the transfer time of each swap that completed.
    pub fn record_exchange(
        &mut self,
        payload_bytes: u64,
        neighbours: usize,
        swaps: &[(PeerId, Duration)],
    ) {
        if swaps.is_empty() || payload_bytes == 0 {
            return;
        }
        let bytes = payload_bytes as f64 * neighbours.max(swaps.len()) as f64;
        let mut fastest = f64::INFINITY;
        for (peer, transfer) in swaps {
            let per_byte = transfer.as_secs_f64() / bytes;
            self.peer_s_per_byte
                .entry(*peer)
                .or_default()
                .observe(per_byte);
            fastest = fastest.min(per_byte);
        }
        self.recent_fastest.push_back(fastest);
        if self.recent_fastest.len() > Self::RECENT_ROUNDS {
            self.recent_fastest.pop_front();
        }
    }

    /// A peer's announced goodput (bytes per second; 0 means unknown and is ignored).
    pub fn record_announce(&mut self, peer: PeerId, goodput_bytes_per_s: u64) {
        if goodput_bytes_per_s > 0 {
            self.announced.insert(peer, goodput_bytes_per_s);
        }
    }

    /// This node's own link, seconds per byte: the fastest recent swap.
    pub fn own_s_per_byte(&self) -> Option<f64> {
        self.recent_fastest.iter().copied().reduce(f64::min)
    }

    /// Seconds per byte measured with `peer`, if they swapped.
    pub fn peer_s_per_byte(&self, peer: &PeerId) -> Option<f64> {
        self.peer_s_per_byte.get(peer).and_then(|m| m.get())
    }

    /// The goodput this node announces: its own link's, at most its upload cap; 0 when
    /// unknown.
    pub fn own_goodput(&self, upload_cap: Option<u64>) -> u64 {
        let seen = self.own_s_per_byte().map(|s| 1.0 / s.max(1e-12));
        let cap = upload_cap.map(|c| c as f64);
        match (seen, cap) {
            (Some(a), Some(b)) => a.min(b) as u64,
            (a, b) => a.or(b).unwrap_or(0.0) as u64,
        }
    }

    /// `C_i`, seconds: this round's payload bytes times the seconds per byte of the slowest
    /// link involved — this node's own and, once `neighbours` are known, what it measured
    /// with each and what each announced; before any swap was measured, the upload cap's
    /// (if any). Before the neighbours are known, the topology's usual count is assumed. At
    /// most the exchange timeout (no exchange takes longer).
    pub fn predicted_exchange_s(
        &self,
        payload_bytes: u64,
        timing: &Timing,
        neighbours: Option<&[PeerId]>,
        upload_cap: Option<u64>,
    ) -> f64 {
        let count = match (neighbours, timing.topology) {
            (Some(n), _) => n.len() as f64,
            (None, Topology::TwoPeer) => 2.0,
            (None, _) => 1.0,
        };
        let own = self
            .own_s_per_byte()
            .or_else(|| upload_cap.map(|cap| 1.0 / cap.max(1) as f64));
        let per_byte = match neighbours {
            Some(n) if !n.is_empty() => n
                .iter()
                .filter_map(|p| {
                    let seen = self.peer_s_per_byte(p);
                    let announced = self.announced.get(p).map(|&g| 1.0 / g as f64);
                    [own, seen, announced]
                        .into_iter()
                        .flatten()
                        .reduce(f64::max)
                })
                .reduce(f64::max),
            _ => own,
        };
        let seconds = per_byte.map_or(0.0, |s| s * payload_bytes as f64 * count);
        seconds.min(timing.exchange_timeout_ms as f64 / 1000.0)
    }
}

/// When the inner steps of `round` should end (Unix ms): the round's end less the predicted
/// exchange, the outer step's measured time and a margin of 5 % of the period.
pub fn train_deadline(
    timing: &Timing,
    round: u64,
    predicted_exchange_s: f64,
    finish_s: Option<f64>,
) -> u64 {
    let reserve_s = predicted_exchange_s + finish_s.unwrap_or(0.0);
    let reserve_ms = (reserve_s * 1000.0).ceil() as u64 + timing.period_ms / 20;
    timing.round_start(round + 1).saturating_sub(reserve_ms)
}

/// Bytes of one round's payload: the same every round, one size per model fragment in turn
/// (`[outer] fragments`), or (the LoRDO payload, whose full-sync rounds carry the anchor too)
/// larger every `every`-th round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadBytes {
    /// The payload of each fragment, round r sending fragment
    /// [`fragment_of_round`]`(r, len)`: one entry for whole-model payloads.
    pub by_fragment: Vec<u64>,
    /// `(every, bytes)`: the payload of a round `r` with `is_full_sync_round(r, every)`.
    pub full_sync: Option<(u64, u64)>,
}

impl PayloadBytes {
    /// A payload of `bytes` every round.
    pub fn fixed(bytes: u64) -> Self {
        PayloadBytes {
            by_fragment: vec![bytes],
            full_sync: None,
        }
    }

    /// The payload's bytes in `round`.
    pub fn of_round(&self, round: u64) -> u64 {
        match self.full_sync {
            Some((every, bytes)) if is_full_sync_round(round, every) => bytes,
            _ => {
                let f = fragment_of_round(round, self.by_fragment.len());
                self.by_fragment.get(f).copied().unwrap_or(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(topology: Topology) -> Timing {
        Timing {
            genesis_ms: 1_000_000,
            period_ms: 10_000,
            commit_window_ms: 1000,
            reveal_window_ms: 1000,
            exchange_timeout_ms: 3000,
            topology,
        }
    }

    fn swap(peer: PeerId, seconds: f64) -> (PeerId, Duration) {
        (peer, Duration::from_secs_f64(seconds))
    }

    #[test]
    fn a_slow_partner_does_not_make_the_own_link_look_slow() {
        let (fast, slow) = (PeerId::random(), PeerId::random());
        let mut m = LinkEstimates::default();
        m.record_exchange(1000, 1, &[swap(fast, 0.01)]);
        m.record_exchange(1000, 1, &[swap(slow, 2.0)]);
        // Its own link is the fastest recent swap; the slow peer is remembered as slow.
        assert_eq!(m.own_s_per_byte(), Some(0.01 / 1000.0));
        assert_eq!(m.peer_s_per_byte(&slow), Some(2.0 / 1000.0));
        assert_eq!(m.peer_s_per_byte(&fast), Some(0.01 / 1000.0));
        // Per peer, the moving average.
        m.record_exchange(1000, 1, &[swap(slow, 1.0)]);
        let w = MovingAverage::WEIGHT;
        let expected = ((1.0 - w) * 2.0 + w * 1.0) / 1000.0;
        assert!((m.peer_s_per_byte(&slow).unwrap() - expected).abs() < 1e-15);
    }

    #[test]
    fn own_link_follows_the_last_rounds_and_counts_every_neighbour_of_a_round() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let mut m = LinkEstimates::default();
        m.record_exchange(1000, 1, &[swap(a, 0.01)]);
        // The link got slower: after RECENT_ROUNDS rounds the old fast swap is forgotten.
        for _ in 0..LinkEstimates::RECENT_ROUNDS {
            m.record_exchange(1000, 1, &[swap(a, 1.0)]);
        }
        assert_eq!(m.own_s_per_byte(), Some(1.0 / 1000.0));
        // Two neighbours at once share the link: 2000 bytes moved in 1 s (b failed).
        m.record_exchange(1000, 2, &[swap(a, 1.0)]);
        assert_eq!(m.own_s_per_byte(), Some(1.0 / 2000.0));
        assert_eq!(
            m.peer_s_per_byte(&b),
            None,
            "a failed swap measures nothing"
        );
        // A round without any completed swap changes nothing.
        let before = m.recent_fastest.clone();
        m.record_exchange(1000, 1, &[]);
        assert_eq!(m.recent_fastest, before);
    }

    #[test]
    fn the_prediction_takes_the_slowest_link_involved_and_at_most_the_timeout() {
        let t = timing(Topology::OnePeer);
        let (fast, slow) = (PeerId::random(), PeerId::random());
        let mut m = LinkEstimates::default();
        // Nothing known: no time, or the upload cap's.
        assert_eq!(m.predicted_exchange_s(1000, &t, None, None), 0.0);
        assert_eq!(m.predicted_exchange_s(1000, &t, None, Some(500)), 2.0);
        m.record_exchange(1_000_000, 1, &[swap(fast, 0.1)]);
        assert!((m.predicted_exchange_s(1_000_000, &t, None, None) - 0.1).abs() < 1e-12);
        // A neighbour that announced 1 MB/s: its link is the slowest one involved.
        m.record_announce(slow, 1_000_000);
        m.record_announce(fast, 0);
        let c = m.predicted_exchange_s(1_000_000, &t, Some(&[slow]), None);
        assert!((c - 1.0).abs() < 1e-12, "{c}");
        // Two neighbours: twice the bytes over the own link.
        let c = m.predicted_exchange_s(1_000_000, &t, Some(&[fast, fast]), None);
        assert!((c - 0.2).abs() < 1e-12, "{c}");
        // Never more than the exchange timeout.
        m.record_announce(slow, 1);
        assert_eq!(m.predicted_exchange_s(1000, &t, Some(&[slow]), None), 3.0);
        assert!((m.own_goodput(None) as f64 - 1e7).abs() <= 1.0);
        assert_eq!(m.own_goodput(Some(1000)), 1000);
    }

    #[test]
    fn the_deadline_leaves_the_exchange_the_outer_step_and_a_margin() {
        let t = timing(Topology::OnePeer);
        // Round 2 ends at genesis + 30 s; 1.5 s exchange, 0.25 s outer step, 0.5 s margin.
        assert_eq!(
            train_deadline(&t, 2, 1.5, Some(0.25)),
            1_000_000 + 30_000 - 2250
        );
        assert_eq!(train_deadline(&t, 2, 0.0, None), 1_000_000 + 30_000 - 500);
    }
}
