//! [`RefusalKind`]: why a node turned down something a peer sent or did, one name for every
//! check — the payload gate's, the exchange's, state sync's, the round's and the shard
//! fetcher's — and whether it is an offence that counts towards a ban
//! (`docs/protocol.md` §8).
//!
//! Kinds are typed in memory and written out in snake_case (`too_far`, `withheld_reveal`)
//! wherever they leave the process: round records, `/status`, `/metrics` labels, logs.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Why a peer's payload, state or behaviour was refused.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum RefusalKind {
    // The payload gate (`gate::Refusal`).
    /// A tensor that does not read as its table says.
    Malformed,
    /// A NaN or an infinity (a payload, or a state at sync).
    NonFinite,
    /// Farther from this node's anchor than the distance bound.
    TooFar,
    /// Below the cosine floor.
    Misaligned,
    /// Worse for this node's model than the functional check allows.
    Harmful,
    // The exchange (`wire::RefusalReason`, either side's).
    /// A refusal without a reason.
    #[default]
    Unspecified,
    /// Another run's stream.
    WrongRun,
    /// A round this node has left behind.
    OldRound,
    /// A round that has not begun here (or a state that claims one).
    FutureRound,
    /// A peer that is not this node's neighbour in the round.
    NotANeighbour,
    /// A tensor table other than the round's.
    TableMismatch,
    /// A payload above the size bound.
    TooLarge,
    /// Already exchanging with this peer.
    Busy,
    /// No state to serve.
    NoState,
    /// The round's exchange had ended on this side.
    RoundClosed,
    // State sync.
    /// A state outvoted by the other sources.
    StateDisagrees,
    // The round.
    /// A commit without its reveal.
    WithheldReveal,
    // Shards.
    /// Shard bytes that do not hash to the manifest's digest.
    BadShard,
    // Standing.
    /// A peer this node banned for the rest of the run.
    Banned,
}

impl RefusalKind {
    /// Every kind, in declaration order.
    pub const ALL: [RefusalKind; 19] = [
        RefusalKind::Malformed,
        RefusalKind::NonFinite,
        RefusalKind::TooFar,
        RefusalKind::Misaligned,
        RefusalKind::Harmful,
        RefusalKind::Unspecified,
        RefusalKind::WrongRun,
        RefusalKind::OldRound,
        RefusalKind::FutureRound,
        RefusalKind::NotANeighbour,
        RefusalKind::TableMismatch,
        RefusalKind::TooLarge,
        RefusalKind::Busy,
        RefusalKind::NoState,
        RefusalKind::RoundClosed,
        RefusalKind::StateDisagrees,
        RefusalKind::WithheldReveal,
        RefusalKind::BadShard,
        RefusalKind::Banned,
    ];

    /// Whether a refusal of this kind counts against the peer: what it sent or did is
    /// wrong whatever its link. A timeout, a busy partner, `not_a_neighbour`, an old or
    /// future round are not offences: an honest peer on a bad link does those.
    pub fn is_offence(self) -> bool {
        matches!(
            self,
            RefusalKind::Malformed
                | RefusalKind::NonFinite
                | RefusalKind::TooFar
                | RefusalKind::Misaligned
                | RefusalKind::Harmful
                | RefusalKind::TableMismatch
                | RefusalKind::TooLarge
                | RefusalKind::StateDisagrees
                | RefusalKind::WithheldReveal
                | RefusalKind::BadShard
        )
    }

    /// The snake_case name records, metrics and logs carry.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalKind::Malformed => "malformed",
            RefusalKind::NonFinite => "non_finite",
            RefusalKind::TooFar => "too_far",
            RefusalKind::Misaligned => "misaligned",
            RefusalKind::Harmful => "harmful",
            RefusalKind::Unspecified => "unspecified",
            RefusalKind::WrongRun => "wrong_run",
            RefusalKind::OldRound => "old_round",
            RefusalKind::FutureRound => "future_round",
            RefusalKind::NotANeighbour => "not_a_neighbour",
            RefusalKind::TableMismatch => "table_mismatch",
            RefusalKind::TooLarge => "too_large",
            RefusalKind::Busy => "busy",
            RefusalKind::NoState => "no_state",
            RefusalKind::RoundClosed => "round_closed",
            RefusalKind::StateDisagrees => "state_disagrees",
            RefusalKind::WithheldReveal => "withheld_reveal",
            RefusalKind::BadShard => "bad_shard",
            RefusalKind::Banned => "banned",
        }
    }
}

impl fmt::Display for RefusalKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is no [`RefusalKind`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownRefusalKind(pub String);

impl fmt::Display for UnknownRefusalKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no refusal kind is named {:?}", self.0)
    }
}

impl std::error::Error for UnknownRefusalKind {}

impl FromStr for RefusalKind {
    type Err = UnknownRefusalKind;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        RefusalKind::ALL
            .into_iter()
            .find(|k| k.as_str() == name)
            .ok_or_else(|| UnknownRefusalKind(name.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_reads_back_from_its_name_and_serde_writes_the_same_name() {
        for kind in RefusalKind::ALL {
            assert_eq!(kind.as_str().parse::<RefusalKind>(), Ok(kind));
            assert_eq!(
                serde_json::to_string(&kind).unwrap(),
                format!("\"{}\"", kind.as_str())
            );
        }
        assert!("wrong-run".parse::<RefusalKind>().is_err());
        let mut names: Vec<&str> = RefusalKind::ALL.map(RefusalKind::as_str).to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), RefusalKind::ALL.len(), "each kind once");
    }

    #[test]
    fn offences_are_what_a_peer_sent_or_did_never_its_link() {
        let offences: Vec<&str> = RefusalKind::ALL
            .into_iter()
            .filter(|k| k.is_offence())
            .map(RefusalKind::as_str)
            .collect();
        assert_eq!(
            offences,
            [
                "malformed",
                "non_finite",
                "too_far",
                "misaligned",
                "harmful",
                "table_mismatch",
                "too_large",
                "state_disagrees",
                "withheld_reveal",
                "bad_shard"
            ]
        );
        for link in [
            "busy",
            "not_a_neighbour",
            "old_round",
            "future_round",
            "round_closed",
        ] {
            assert!(!link.parse::<RefusalKind>().unwrap().is_offence());
        }
    }
}
