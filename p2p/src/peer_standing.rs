//! `PeerStanding`: what this node holds against each peer, and whom it has banned.
//!
//! A pure state machine, like the round schedule: the driver reports offences as rounds
//! end ([`PeerStanding::offend`]) and carries out what comes back (block the peer's
//! connections, persist the ban, lower its gossipsub score). An offence is a payload or a
//! state refused for its contents (the payload gate's kinds, a table that does not match,
//! an oversized payload, a state outvoted at sync), a reveal withheld after a commit, or
//! shard bytes that do not hash to the manifest's digest (`bad_shard`); a
//! timeout, a busy partner or a disagreement about who is a neighbour is not (an honest
//! peer on a bad link does those). After `[gate] ban_after_offences` offences within
//! `[gate] ban_window_rounds` rounds the peer is banned for the rest of the run; a gross
//! offence (a payload that is garbage beyond doubt, `gasloc_proto::gate::Refusal::is_gross`)
//! bans it at once.
//!
//! The standing of a peer is also its gossipsub application score ([`PeerStanding::score`]):
//! minus one per offence in the window, [`BANNED_SCORE`] once banned.
//!
//! Bans are kept in the node's home ([`BanFile`]) so a restarted node keeps them; the file
//! names the run, and bans of another run are not loaded.

use gasloc_proto::manifest::GateConfig;
use gasloc_proto::{RefusalKind, RunId};
use libp2p::PeerId;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The application score of a banned peer (gossipsub's default graylist threshold is −80
/// and its application weight 10, so a banned peer is graylisted at once).
pub const BANNED_SCORE: f64 = -1000.0;

/// Whether a refusal named `kind` (as records write it) counts against the peer
/// ([`RefusalKind::is_offence`]); a name that is no kind is not.
pub fn is_offence(kind: &str) -> bool {
    kind.parse::<RefusalKind>()
        .is_ok_and(RefusalKind::is_offence)
}

/// Offences found beside the rounds rather than in them — shard bytes that fail the pinned
/// digest while the node fetches the rest of its data as it trains — posted by whoever
/// found them and counted by the round driver with the next round's offences. A cheap,
/// cloneable handle.
#[derive(Debug, Clone, Default)]
pub struct OffenceInbox {
    posted: Arc<Mutex<Vec<(PeerId, RefusalKind)>>>,
}

impl OffenceInbox {
    pub fn new() -> Self {
        Self::default()
    }

    /// `peer` committed an offence of `kind`.
    pub fn post(&self, peer: PeerId, kind: RefusalKind) {
        self.posted
            .lock()
            .expect("offence inbox lock")
            .push((peer, kind));
    }

    /// The offences posted since the last take, oldest first.
    pub fn take(&self) -> Vec<(PeerId, RefusalKind)> {
        std::mem::take(&mut *self.posted.lock().expect("offence inbox lock"))
    }
}

/// A peer banned for the rest of the run (the `/status` document's type).
pub use gasloc_status::BannedPeer as Ban;

/// This node's record of its peers' offences and its bans.
#[derive(Debug, Clone)]
pub struct PeerStanding {
    offences_to_ban: u32,
    window_rounds: u64,
    /// Offences in the window, per peer: `(round, kind)`, oldest first.
    recent: HashMap<PeerId, VecDeque<(u64, RefusalKind)>>,
    banned: BTreeMap<PeerId, Ban>,
}

impl PeerStanding {
    /// A standing with the run's ban policy and the bans loaded from the node's home.
    pub fn new(gate: &GateConfig, banned: Vec<Ban>) -> Self {
        let banned = banned
            .into_iter()
            .filter_map(|ban| Some((ban.peer.parse().ok()?, ban)))
            .collect();
        PeerStanding {
            offences_to_ban: gate.ban_after_offences,
            window_rounds: gate.ban_window_rounds.max(1),
            recent: HashMap::new(),
            banned,
        }
    }

    pub fn is_banned(&self, peer: &PeerId) -> bool {
        self.banned.contains_key(peer)
    }

    pub fn bans(&self) -> impl Iterator<Item = &Ban> {
        self.banned.values()
    }

    /// Records that `peer` committed offence `kind` in `round` (a kind that is no offence
    /// is ignored). Returns the ban when this offence makes it.
    pub fn offend(&mut self, peer: PeerId, round: u64, kind: RefusalKind) -> Option<Ban> {
        self.record(peer, round, kind, false)
    }

    /// Records a gross offence (garbage beyond doubt: the payload gate's
    /// `Refusal::is_gross`), which bans `peer` at once, whatever its offences before (unless
    /// bans are off, `ban_after_offences = 0`: then it counts as one).
    pub fn offend_grossly(&mut self, peer: PeerId, round: u64, kind: RefusalKind) -> Option<Ban> {
        self.record(peer, round, kind, true)
    }

    fn record(&mut self, peer: PeerId, round: u64, kind: RefusalKind, gross: bool) -> Option<Ban> {
        if !kind.is_offence() || self.is_banned(&peer) {
            return None;
        }
        let window = self.window_rounds;
        let recent = self.recent.entry(peer).or_default();
        recent.push_back((round, kind));
        while recent.front().is_some_and(|(r, _)| r + window <= round) {
            recent.pop_front();
        }
        let enough = recent.len() >= self.offences_to_ban as usize;
        if self.offences_to_ban == 0 || !(gross || enough) {
            return None;
        }
        let ban = Ban {
            peer: peer.to_string(),
            round,
            offences: recent.iter().map(|(r, k)| format!("{r}:{k}")).collect(),
        };
        self.recent.remove(&peer);
        self.banned.insert(peer, ban.clone());
        Some(ban)
    }

    /// The peer's gossipsub application score: minus its offences in the window as of
    /// `round`, [`BANNED_SCORE`] once banned.
    pub fn score(&self, peer: &PeerId, round: u64) -> f64 {
        if self.is_banned(peer) {
            return BANNED_SCORE;
        }
        let window = self.window_rounds;
        let count = self.recent.get(peer).map_or(0, |recent| {
            recent.iter().filter(|(r, _)| r + window > round).count()
        });
        -(count as f64)
    }
}

impl PeerStanding {
    /// Every peer with offences in the window or a ban, by peer id, with its score.
    pub fn scores(&self, round: u64) -> BTreeMap<String, f64> {
        self.recent
            .keys()
            .chain(self.banned.keys())
            .map(|peer| (peer.to_string(), self.score(peer, round)))
            .filter(|(_, score)| *score < 0.0)
            .collect()
    }
}

/// The bans of one run, as kept in the node's home.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BanFile {
    pub run_id: String,
    pub bans: Vec<Ban>,
}

impl BanFile {
    /// The file in a node's home.
    pub fn path_in(home: &Path) -> PathBuf {
        home.join("bans.json")
    }

    /// The bans of `run_id` kept at `path`: none when there is no file or it is another
    /// run's; an error naming the file when it cannot be read or parsed (a node never
    /// forgets its bans silently).
    pub fn load(path: &Path, run_id: RunId) -> Result<Vec<Ban>, String> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(format!("cannot read the ban list {}: {e}", path.display())),
        };
        let file: BanFile = serde_json::from_str(&text)
            .map_err(|e| format!("the ban list {} is not valid: {e}", path.display()))?;
        if file.run_id != run_id.to_string() {
            return Ok(Vec::new());
        }
        Ok(file.bans)
    }

    /// Writes the bans of `run_id` to `path` atomically (a temporary file, fsynced, then
    /// renamed over the old one).
    pub fn save<'a>(
        path: &Path,
        run_id: RunId,
        bans: impl Iterator<Item = &'a Ban>,
    ) -> std::io::Result<()> {
        use std::io::Write;
        let file = BanFile {
            run_id: run_id.to_string(),
            bans: bans.cloned().collect(),
        };
        let text = serde_json::to_string_pretty(&file).expect("bans serialize");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension("json.tmp");
        {
            let mut out = std::fs::File::create(&tmp)?;
            out.write_all(text.as_bytes())?;
            out.sync_all()?;
        }
        std::fs::rename(&tmp, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn standing(after: u32, window: u64) -> PeerStanding {
        let gate = GateConfig {
            ban_after_offences: after,
            ban_window_rounds: window,
            ..GateConfig::default()
        };
        PeerStanding::new(&gate, Vec::new())
    }

    #[test]
    fn k_offences_within_the_window_ban_and_older_ones_expire() {
        let peer = PeerId::random();
        let mut s = standing(3, 10);
        assert!(s.offend(peer, 1, RefusalKind::TooFar).is_none());
        assert!(s.offend(peer, 5, RefusalKind::NonFinite).is_none());
        assert_eq!(s.score(&peer, 5), -2.0);
        // Round 11: the offence of round 1 left the window.
        assert!(s.offend(peer, 11, RefusalKind::TooFar).is_none());
        assert_eq!(s.score(&peer, 11), -2.0);
        let ban = s
            .offend(peer, 12, RefusalKind::Misaligned)
            .expect("the third in ten rounds");
        assert_eq!(ban.round, 12);
        assert_eq!(
            ban.offences,
            ["5:non_finite", "11:too_far", "12:misaligned"]
        );
        assert!(s.is_banned(&peer));
        assert_eq!(s.score(&peer, 12), BANNED_SCORE);
        assert!(
            s.offend(peer, 13, RefusalKind::TooFar).is_none(),
            "banned once"
        );
    }

    #[test]
    fn what_an_honest_peer_on_a_bad_link_does_is_no_offence() {
        let peer = PeerId::random();
        let mut s = standing(1, 10);
        for kind in [
            RefusalKind::NotANeighbour,
            RefusalKind::Busy,
            RefusalKind::OldRound,
            RefusalKind::FutureRound,
            RefusalKind::RoundClosed,
        ] {
            assert!(s.offend(peer, 1, kind).is_none(), "{kind}");
        }
        assert_eq!(s.score(&peer, 1), 0.0);
        assert!(s.offend(peer, 2, RefusalKind::WithheldReveal).is_some());
    }

    #[test]
    fn zero_offences_to_ban_turns_bans_off() {
        let peer = PeerId::random();
        let mut s = standing(0, 10);
        for round in 0..20 {
            assert!(s.offend(peer, round, RefusalKind::TooFar).is_none());
        }
        assert!(s.offend_grossly(peer, 20, RefusalKind::NonFinite).is_none());
        assert_eq!(s.score(&peer, 20), -10.0);
    }

    #[test]
    fn one_gross_offence_bans_at_once_and_counts_with_those_before() {
        let peer = PeerId::random();
        let mut s = standing(3, 10);
        assert!(s.offend(peer, 1, RefusalKind::Harmful).is_none());
        let ban = s
            .offend_grossly(peer, 2, RefusalKind::TooFar)
            .expect("garbage beyond doubt bans at its first");
        assert_eq!(ban.offences, ["1:harmful", "2:too_far"]);
        assert!(s.is_banned(&peer));
        // A kind that is no offence is none, gross or not.
        let other = PeerId::random();
        assert!(s.offend_grossly(other, 3, RefusalKind::Busy).is_none());
        assert!(!s.is_banned(&other));
    }

    #[test]
    fn bans_survive_a_restart_of_the_same_run_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = BanFile::path_in(dir.path());
        let run = RunId::from_bytes([1; 32]);
        assert_eq!(BanFile::load(&path, run), Ok(Vec::new()), "no file yet");
        let peer = PeerId::random();
        let mut s = standing(1, 10);
        s.offend(peer, 4, RefusalKind::NonFinite).unwrap();
        BanFile::save(&path, run, s.bans()).unwrap();

        let loaded = BanFile::load(&path, run).unwrap();
        let restarted = PeerStanding::new(&GateConfig::default(), loaded);
        assert!(restarted.is_banned(&peer));
        let other_run = RunId::from_bytes([2; 32]);
        assert_eq!(BanFile::load(&path, other_run), Ok(Vec::new()));

        std::fs::write(&path, "{ not json").unwrap();
        let err = BanFile::load(&path, run).unwrap_err();
        assert!(err.contains("bans.json"), "{err}");
    }
}
