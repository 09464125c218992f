//! The control plane: gossipsub messages of a run (commits, reveals, announcements) and
//! their validation before they are forwarded.
//!
//! Every message is checked here first (size, decoding, run id, round window, field
//! lengths, a per-peer rate); the verdict is reported back to gossipsub so that invalid
//! messages are neither delivered nor propagated.

use crate::schedule::Timing;
use gasloc_proto::wire::{control_message::Body, ControlMessage, DIGEST_LEN};
use gasloc_proto::RunId;
use libp2p::gossipsub::{IdentTopic, MessageAcceptance};
use libp2p::PeerId;
use prost::Message;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The gossipsub topic of a run: `gasloc/run/<run id hex>`.
pub fn run_topic(run_id: &RunId) -> IdentTopic {
    IdentTopic::new(format!("gasloc/run/{run_id}"))
}

/// Why a control message was not delivered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlReject {
    #[error("unsigned message")]
    Unsigned,
    #[error("{0} bytes exceeds the cap of {1}")]
    TooLarge(usize, usize),
    #[error("undecodable: {0}")]
    Undecodable(String),
    #[error("run id {0} is not this run")]
    WrongRun(String),
    #[error("round {round} outside the accepted window")]
    RoundOutsideWindow { round: u64 },
    #[error("{0}")]
    BadField(&'static str),
    #[error("peer {0} exceeded its message rate")]
    RateExceeded(PeerId),
}

impl ControlReject {
    /// Gossipsub verdict: `Reject` penalises the propagation source, `Ignore` only drops.
    pub fn acceptance(&self) -> MessageAcceptance {
        match self {
            ControlReject::RoundOutsideWindow { .. } | ControlReject::RateExceeded(_) => {
                MessageAcceptance::Ignore
            }
            _ => MessageAcceptance::Reject,
        }
    }
}

/// Validates incoming control messages of one run.
#[derive(Debug)]
pub struct ControlValidator {
    run_id: RunId,
    timing: Option<Timing>,
    max_bytes: usize,
    burst: u32,
    window: Duration,
    recent: HashMap<PeerId, (Instant, u32)>,
}

impl ControlValidator {
    pub fn new(
        run_id: RunId,
        timing: Option<Timing>,
        max_bytes: usize,
        burst: u32,
        window: Duration,
    ) -> Self {
        ControlValidator {
            run_id,
            timing,
            max_bytes,
            burst,
            window,
            recent: HashMap::new(),
        }
    }

    /// Checks one message; `now_ms` is wall-clock ms since the epoch, `now` a monotonic
    /// instant for the rate limit.
    pub fn validate(
        &mut self,
        source: Option<PeerId>,
        data: &[u8],
        now_ms: u64,
        now: Instant,
    ) -> Result<(PeerId, ControlMessage), ControlReject> {
        let source = source.ok_or(ControlReject::Unsigned)?;
        if data.len() > self.max_bytes {
            return Err(ControlReject::TooLarge(data.len(), self.max_bytes));
        }
        let message =
            ControlMessage::decode(data).map_err(|e| ControlReject::Undecodable(e.to_string()))?;
        if message.run_id != self.run_id.as_bytes() {
            return Err(ControlReject::WrongRun(hex::encode(&message.run_id)));
        }
        if let Some(timing) = &self.timing {
            let ok = match timing.round_at(now_ms) {
                None => message.round == 0,
                // A stranger picks the round: u64::MAX must be refused, not overflow.
                Some(current) => {
                    message.round.saturating_add(1) >= current
                        && message.round <= current.saturating_add(1)
                }
            };
            if !ok {
                return Err(ControlReject::RoundOutsideWindow {
                    round: message.round,
                });
            }
        }
        match &message.body {
            None => return Err(ControlReject::BadField("message has no body")),
            Some(Body::Commit(c)) if c.commitment.len() != DIGEST_LEN => {
                return Err(ControlReject::BadField("commitment is not 32 bytes"))
            }
            Some(Body::Reveal(r)) if r.nonce.len() != DIGEST_LEN => {
                return Err(ControlReject::BadField("nonce is not 32 bytes"))
            }
            _ => {}
        }
        let entry = self.recent.entry(source).or_insert((now, 0));
        if now.duration_since(entry.0) > self.window {
            *entry = (now, 0);
        }
        entry.1 += 1;
        if entry.1 > self.burst {
            return Err(ControlReject::RateExceeded(source));
        }
        Ok((source, message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gasloc_proto::topology::Topology;
    use gasloc_proto::wire::Commit;
    use libp2p::identity::Keypair;

    fn commit(run: [u8; 32], round: u64, len: usize) -> Vec<u8> {
        ControlMessage {
            run_id: run.to_vec(),
            round,
            body: Some(Body::Commit(Commit {
                commitment: vec![1; len],
            })),
        }
        .encode_to_vec()
    }

    /// Run [5; 32], rounds of 1 s from 0, at most 256 bytes and 2 messages a minute a peer.
    fn validator() -> ControlValidator {
        let timing = Timing {
            genesis_ms: 0,
            period_ms: 1000,
            commit_window_ms: 100,
            reveal_window_ms: 100,
            exchange_timeout_ms: 100,
            topology: Topology::OnePeer,
        };
        ControlValidator::new(
            RunId::from_bytes([5; 32]),
            Some(timing),
            256,
            2,
            Duration::from_secs(60),
        )
    }

    /// Found by review while writing the `control_message` fuzz target: `round + 1`
    /// overflowed (a panic in debug builds, the network loop's thread) for round u64::MAX.
    #[test]
    fn a_round_of_u64_max_is_outside_the_window_not_an_overflow() {
        let mut v = validator();
        let peer = Keypair::generate_ed25519().public().to_peer_id();
        assert_eq!(
            v.validate(
                Some(peer),
                &commit([5; 32], u64::MAX, 32),
                10_500,
                Instant::now()
            ),
            Err(ControlReject::RoundOutsideWindow { round: u64::MAX })
        );
    }

    #[test]
    fn each_bad_control_message_gets_a_named_rejection() {
        let mut v = validator();
        let peer = Keypair::generate_ed25519().public().to_peer_id();
        let t = Instant::now();
        let now_ms = 10_500; // round 10
        assert_eq!(
            v.validate(None, &commit([5; 32], 10, 32), now_ms, t),
            Err(ControlReject::Unsigned)
        );
        assert!(matches!(
            v.validate(Some(peer), &[0xFF; 300], now_ms, t),
            Err(ControlReject::TooLarge(300, 256))
        ));
        assert!(matches!(
            v.validate(Some(peer), &[0xFF; 3], now_ms, t),
            Err(ControlReject::Undecodable(_))
        ));
        assert!(matches!(
            v.validate(Some(peer), &commit([6; 32], 10, 32), now_ms, t),
            Err(ControlReject::WrongRun(_))
        ));
        let old = v
            .validate(Some(peer), &commit([5; 32], 8, 32), now_ms, t)
            .unwrap_err();
        assert_eq!(old.acceptance(), MessageAcceptance::Ignore);
        assert!(matches!(
            v.validate(Some(peer), &commit([5; 32], 10, 31), now_ms, t),
            Err(ControlReject::BadField(_))
        ));
        assert!(v
            .validate(Some(peer), &commit([5; 32], 10, 32), now_ms, t)
            .is_ok());
        assert!(v
            .validate(Some(peer), &commit([5; 32], 11, 32), now_ms, t)
            .is_ok());
        assert_eq!(
            v.validate(Some(peer), &commit([5; 32], 9, 32), now_ms, t),
            Err(ControlReject::RateExceeded(peer))
        );
        // The window restarts.
        assert!(v
            .validate(
                Some(peer),
                &commit([5; 32], 10, 32),
                now_ms,
                t + Duration::from_secs(61)
            )
            .is_ok());
    }
}
