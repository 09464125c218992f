//! `RoundSchedule`: the sans-IO state machine that turns commits and reveals into each
//! round's members, permutation and neighbours (`docs/protocol.md` §4).
//!
//! Time is wall-clock milliseconds since the Unix epoch, passed in by the caller (an
//! injectable clock): round `t` starts at `start_t = genesis + t·period`. The commit-reveal
//! of a round is pipelined with the round before it: members publish their commits for round
//! `t` when its commit window opens, `commit_window` before `start_t` (during round `t − 1`),
//! and receivers accept them until `start_t`, so commits have the whole window to spread;
//! at `start_t` members publish their reveals, accepted until `start_t + reveal_window`,
//! when the round is decided (its inner steps are already running). No I/O happens here:
//! inputs are method calls, outputs are [`Action`]s for the caller to carry out.

use crate::permutation::{commitment, neighbours, permutation, round_seed, sort_peers, Digest32};
use gasloc_proto::topology::{MixingRow, Topology};
use gasloc_proto::wire::RoundTiming;
use libp2p::PeerId;
use std::collections::{BTreeMap, HashMap};

/// Round timing shared by every member of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timing {
    pub genesis_ms: u64,
    pub period_ms: u64,
    pub commit_window_ms: u64,
    pub reveal_window_ms: u64,
    pub exchange_timeout_ms: u64,
    pub topology: Topology,
}

impl Timing {
    /// Checks the windows fit in a round; the error names the offending value.
    pub fn validate(&self) -> Result<(), String> {
        if self.period_ms == 0 || self.commit_window_ms == 0 || self.reveal_window_ms == 0 {
            return Err("round period, commit window and reveal window must be positive".into());
        }
        if self.commit_window_ms > self.period_ms {
            return Err(format!(
                "commit window {} ms must not be longer than the round period {} ms (commits \
                 for a round are published during the round before it)",
                self.commit_window_ms, self.period_ms
            ));
        }
        if self.reveal_window_ms >= self.period_ms {
            return Err(format!(
                "reveal window {} ms must be shorter than the round period {} ms",
                self.reveal_window_ms, self.period_ms
            ));
        }
        if self.topology.to_wire().is_none() {
            return Err(format!(
                "topology {} is a simulator baseline; a swarm runs one-peer, two-peer or complete",
                self.topology.name()
            ));
        }
        Ok(())
    }

    pub fn round_start(&self, round: u64) -> u64 {
        self.genesis_ms + round * self.period_ms
    }
    /// When members publish their commits for `round`: `commit_window` before it starts.
    pub fn commit_opens(&self, round: u64) -> u64 {
        self.round_start(round)
            .saturating_sub(self.commit_window_ms)
    }
    /// The last moment a node may publish its commit for `round` (a node that starts late
    /// still leaves half the window for the commit to spread).
    pub fn commit_closes(&self, round: u64) -> u64 {
        self.round_start(round)
            .saturating_sub(self.commit_window_ms / 2)
    }
    /// Commits for `round` are accepted until it starts; reveals are published then.
    pub fn commit_deadline(&self, round: u64) -> u64 {
        self.round_start(round)
    }
    /// Reveals for `round` are accepted until this moment, when the round is decided.
    pub fn reveal_deadline(&self, round: u64) -> u64 {
        self.round_start(round) + self.reveal_window_ms
    }
    /// The round in progress at `now`; `None` before genesis.
    pub fn round_at(&self, now: u64) -> Option<u64> {
        now.checked_sub(self.genesis_ms).map(|d| d / self.period_ms)
    }
    /// The first round a node may still commit to at `now`.
    pub fn next_joinable_round(&self, now: u64) -> u64 {
        let next = self.round_at(now).map_or(0, |r| r + 1);
        if now < self.commit_closes(next) {
            next
        } else {
            next + 1
        }
    }

    /// The first round a node that starts listening to the run's topic at `now` takes part
    /// in: the first whose commit window opens at least one commit window after `now`. By
    /// then its gossip links have formed (a few heartbeats), so it hears every member's
    /// commit of that round, and its own commit has the whole window to spread. A node that
    /// committed late to a round whose commits went out before it listened could decide it
    /// with another member list than the others (`docs/protocol.md` §4).
    pub fn first_round_after_listening(&self, now: u64) -> u64 {
        let mut round = self.round_at(now).map_or(0, |r| r + 1);
        while self.commit_opens(round) < now.saturating_add(self.commit_window_ms) {
            round += 1;
        }
        round
    }

    pub fn from_wire(t: &RoundTiming) -> Result<Self, String> {
        let topology = Topology::from_wire(t.topology)
            .ok_or_else(|| format!("topology {} is unspecified or unknown", t.topology))?;
        let timing = Timing {
            genesis_ms: t.genesis_unix_ms,
            period_ms: t.round_period_ms,
            commit_window_ms: t.commit_window_ms,
            reveal_window_ms: t.reveal_window_ms,
            exchange_timeout_ms: t.exchange_timeout_ms,
            topology,
        };
        timing.validate()?;
        Ok(timing)
    }

    pub fn to_wire(&self) -> RoundTiming {
        RoundTiming {
            genesis_unix_ms: self.genesis_ms,
            round_period_ms: self.period_ms,
            commit_window_ms: self.commit_window_ms,
            reveal_window_ms: self.reveal_window_ms,
            exchange_timeout_ms: self.exchange_timeout_ms,
            // A validated timing has a swarm topology (the simulator's ring has no wire form).
            topology: self.topology.to_wire().map_or(0, |t| t as i32),
        }
    }
}

/// What the caller must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    PublishCommit { round: u64, commitment: Digest32 },
    PublishReveal { round: u64, nonce: Digest32 },
    Decided(RoundPlan),
}

/// The outcome of a round's commit-reveal as this node sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundPlan {
    pub round: u64,
    /// Members in canonical (peer id byte) order.
    pub members: Vec<PeerId>,
    pub seed: Digest32,
    pub permutation: Vec<PeerId>,
    /// This node's neighbours; empty when it is not a member.
    pub neighbours: Vec<PeerId>,
    pub is_member: bool,
    /// Peers that committed but did not reveal in time (excluded).
    pub withheld: Vec<PeerId>,
    /// When the last accepted commit and reveal from another peer arrived (0: none).
    pub last_commit_at_ms: u64,
    pub last_reveal_at_ms: u64,
}

impl RoundPlan {
    /// The mixing row `me` applies in this round when the neighbours in `missing` sent
    /// nothing usable (no payload, a failed or a refused one): the topology's row over the
    /// members, with those neighbours dropped and their weight placed by the topology
    /// ([`Topology::round_row`], the simulator's function). Indices are positions in
    /// [`Self::members`]; a node outside the round mixes alone, as index `members.len()`.
    pub fn mixing_row(&self, topology: Topology, me: &PeerId, missing: &[PeerId]) -> MixingRow {
        let index: HashMap<&PeerId, usize> = self
            .members
            .iter()
            .enumerate()
            .map(|(i, p)| (p, i))
            .collect();
        let Some(&worker) = index.get(me).filter(|_| self.is_member) else {
            return MixingRow::uniform(self.members.len(), &[]);
        };
        let perm: Vec<usize> = self.permutation.iter().map(|p| index[p]).collect();
        let missing: Vec<usize> = missing
            .iter()
            .filter_map(|p| index.get(p).copied())
            .collect();
        topology.round_row(&perm, worker, &missing)
    }

    /// A member's index in [`Self::members`] (the index space of [`Self::mixing_row`]).
    pub fn member_index(&self, peer: &PeerId) -> Option<usize> {
        self.members.iter().position(|p| p == peer)
    }
}

/// Why a commit or reveal was not recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("round {round} is outside the accepted window (current {current:?})")]
    OutsideWindow { round: u64, current: Option<u64> },
    #[error("commit for round {round} arrived after its commit window closed")]
    LateCommit { round: u64 },
    #[error("reveal for round {round} arrived after its reveal window closed")]
    LateReveal { round: u64 },
    #[error("peer sent a different commit for round {round}")]
    ConflictingCommit { round: u64 },
    #[error("reveal for round {round} without a recorded commit")]
    NoCommit { round: u64 },
    #[error("reveal for round {round} does not match the commit")]
    RevealMismatch { round: u64 },
    #[error("round {round} has been decided")]
    AlreadyDecided { round: u64 },
}

impl Rejection {
    /// True when the sender is provably misbehaving (as opposed to late or out of sync).
    pub fn is_misbehaviour(&self) -> bool {
        matches!(
            self,
            Rejection::ConflictingCommit { .. } | Rejection::RevealMismatch { .. }
        )
    }
}

#[derive(Debug, Default)]
struct RoundState {
    my_nonce: Option<Digest32>,
    revealed: bool,
    decided: bool,
    commits: HashMap<PeerId, Digest32>,
    reveals: HashMap<PeerId, Digest32>,
    last_commit_at_ms: u64,
    last_reveal_at_ms: u64,
}

/// The commit-reveal state machine for one node.
#[derive(Debug)]
pub struct RoundSchedule {
    timing: Timing,
    run_id: Digest32,
    me: PeerId,
    rounds: BTreeMap<u64, RoundState>,
    withheld_counts: HashMap<PeerId, u32>,
}

impl RoundSchedule {
    pub fn new(timing: Timing, run_id: Digest32, me: PeerId) -> Self {
        RoundSchedule {
            timing,
            run_id,
            me,
            rounds: BTreeMap::new(),
            withheld_counts: HashMap::new(),
        }
    }

    pub fn timing(&self) -> &Timing {
        &self.timing
    }

    /// Rounds for which control messages are accepted at `now`: the current one, the one
    /// before (late reveals) and the next (clock skew).
    pub fn accepts_round(&self, round: u64, now: u64) -> bool {
        match self.timing.round_at(now) {
            None => round == 0,
            Some(current) => round + 1 >= current && round <= current + 1,
        }
    }

    /// Takes part in `round` with the caller's fresh random `nonce`; returns the commit to
    /// publish. Fails once it is too late to publish a commit for the round.
    pub fn join_round(
        &mut self,
        round: u64,
        nonce: Digest32,
        now: u64,
    ) -> Result<Action, Rejection> {
        if now >= self.timing.commit_closes(round) {
            return Err(Rejection::LateCommit { round });
        }
        let c = commitment(&self.run_id, round, &self.me, &nonce);
        let state = self.rounds.entry(round).or_default();
        if state.my_nonce.is_some() {
            return Err(Rejection::ConflictingCommit { round });
        }
        state.my_nonce = Some(nonce);
        state.commits.insert(self.me, c);
        Ok(Action::PublishCommit {
            round,
            commitment: c,
        })
    }

    /// Records a peer's commit.
    pub fn on_commit(
        &mut self,
        from: PeerId,
        round: u64,
        commitment: Digest32,
        now: u64,
    ) -> Result<(), Rejection> {
        self.check_window(round, now)?;
        if now >= self.timing.commit_deadline(round) {
            return Err(Rejection::LateCommit { round });
        }
        let state = self.rounds.entry(round).or_default();
        match state.commits.get(&from) {
            Some(existing) if *existing != commitment => {
                Err(Rejection::ConflictingCommit { round })
            }
            _ => {
                state.commits.insert(from, commitment);
                state.last_commit_at_ms = state.last_commit_at_ms.max(now);
                Ok(())
            }
        }
    }

    /// Records a peer's reveal if it matches its commit.
    pub fn on_reveal(
        &mut self,
        from: PeerId,
        round: u64,
        nonce: Digest32,
        now: u64,
    ) -> Result<(), Rejection> {
        self.check_window(round, now)?;
        if now >= self.timing.reveal_deadline(round) {
            return Err(Rejection::LateReveal { round });
        }
        let run_id = self.run_id;
        let state = self.rounds.entry(round).or_default();
        if state.decided {
            return Err(Rejection::AlreadyDecided { round });
        }
        let Some(committed) = state.commits.get(&from) else {
            return Err(Rejection::NoCommit { round });
        };
        if *committed != commitment(&run_id, round, &from, &nonce) {
            return Err(Rejection::RevealMismatch { round });
        }
        state.reveals.insert(from, nonce);
        state.last_reveal_at_ms = state.last_reveal_at_ms.max(now);
        Ok(())
    }

    fn check_window(&self, round: u64, now: u64) -> Result<(), Rejection> {
        if self.accepts_round(round, now) {
            Ok(())
        } else {
            Err(Rejection::OutsideWindow {
                round,
                current: self.timing.round_at(now),
            })
        }
    }

    /// Gives up the rounds from `round` on that this node committed to: it will not reveal
    /// them (it is leaving), so every peer leaves it out of those rounds alike.
    pub fn withdraw_from(&mut self, round: u64) {
        for (_, state) in self.rounds.range_mut(round..) {
            if !state.revealed {
                state.my_nonce = None;
                state.commits.remove(&self.me);
            }
        }
    }

    /// Whether this node committed to `round` (and has not withdrawn).
    pub fn has_joined(&self, round: u64) -> bool {
        self.rounds
            .get(&round)
            .is_some_and(|state| state.my_nonce.is_some())
    }

    /// Advances time: reveals due at `now` and rounds decided at `now`, in round order.
    pub fn poll(&mut self, now: u64) -> Vec<Action> {
        let mut actions = Vec::new();
        let timing = self.timing.clone();
        let mut decided_withheld = Vec::new();
        for (&round, state) in self.rounds.iter_mut() {
            if let Some(nonce) = state.my_nonce {
                if !state.revealed
                    && now >= timing.commit_deadline(round)
                    && now < timing.reveal_deadline(round)
                {
                    state.revealed = true;
                    state.reveals.insert(self.me, nonce);
                    actions.push(Action::PublishReveal { round, nonce });
                }
            }
            if !state.decided && now >= timing.reveal_deadline(round) {
                state.decided = true;
                let plan = decide(&timing, &self.run_id, &self.me, round, state);
                decided_withheld.extend(plan.withheld.iter().copied());
                actions.push(Action::Decided(plan));
            }
        }
        for peer in decided_withheld {
            *self.withheld_counts.entry(peer).or_default() += 1;
        }
        // Forget rounds well behind the current one.
        if let Some(current) = timing.round_at(now) {
            let keep_from = current.saturating_sub(2);
            self.rounds = self.rounds.split_off(&keep_from);
        }
        actions
    }

    /// When `poll` next has something to do (ms since epoch), if anything is pending.
    pub fn next_wakeup(&self) -> Option<u64> {
        self.rounds
            .iter()
            .filter_map(|(&round, state)| {
                if state.my_nonce.is_some() && !state.revealed {
                    Some(self.timing.commit_deadline(round))
                } else if !state.decided {
                    Some(self.timing.reveal_deadline(round))
                } else {
                    None
                }
            })
            .min()
    }

    /// How many decided rounds each peer committed to without revealing.
    pub fn withheld_counts(&self) -> &HashMap<PeerId, u32> {
        &self.withheld_counts
    }
}

fn decide(
    timing: &Timing,
    run_id: &Digest32,
    me: &PeerId,
    round: u64,
    state: &RoundState,
) -> RoundPlan {
    let mut members: Vec<PeerId> = state.reveals.keys().copied().collect();
    sort_peers(&mut members);
    let with_nonces: Vec<(PeerId, Digest32)> =
        members.iter().map(|p| (*p, state.reveals[p])).collect();
    let seed = round_seed(run_id, round, &with_nonces);
    let perm = permutation(&members, &seed);
    let is_member = state.reveals.contains_key(me);
    let neighbours = if is_member {
        neighbours(timing.topology, &perm, me)
    } else {
        Vec::new()
    };
    let mut withheld: Vec<PeerId> = state
        .commits
        .keys()
        .filter(|p| !state.reveals.contains_key(p))
        .copied()
        .collect();
    sort_peers(&mut withheld);
    RoundPlan {
        round,
        members,
        seed,
        permutation: perm,
        neighbours,
        is_member,
        withheld,
        last_commit_at_ms: state.last_commit_at_ms,
        last_reveal_at_ms: state.last_reveal_at_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p::identity::Keypair;

    const GENESIS: u64 = 1_000_000;

    fn timing(topology: Topology) -> Timing {
        Timing {
            genesis_ms: GENESIS,
            period_ms: 1000,
            commit_window_ms: 200,
            reveal_window_ms: 200,
            exchange_timeout_ms: 500,
            topology,
        }
    }

    fn peer(i: u8) -> PeerId {
        Keypair::ed25519_from_bytes([i + 1; 32])
            .unwrap()
            .public()
            .to_peer_id()
    }

    /// Delivers every action of `from` to the other schedules (a perfect network, except
    /// for the reveals of the peers in `drop_reveals_of`).
    fn deliver(
        schedules: &mut [RoundSchedule],
        from: usize,
        actions: &[Action],
        now: u64,
        drop_reveals_of: &[usize],
    ) {
        let sender = schedules[from].me;
        for action in actions {
            for (i, s) in schedules.iter_mut().enumerate() {
                if i == from {
                    continue;
                }
                match action {
                    Action::PublishCommit { round, commitment } => {
                        s.on_commit(sender, *round, *commitment, now).unwrap()
                    }
                    Action::PublishReveal { round, nonce } if !drop_reveals_of.contains(&from) => {
                        s.on_reveal(sender, *round, *nonce, now).unwrap()
                    }
                    _ => {}
                }
            }
        }
    }

    fn run_rounds(
        n: u8,
        rounds: u64,
        drop_reveals_of: &[usize],
        topology: Topology,
    ) -> Vec<Vec<RoundPlan>> {
        let mut schedules: Vec<RoundSchedule> = (0..n)
            .map(|i| RoundSchedule::new(timing(topology), [7; 32], peer(i)))
            .collect();
        let mut plans = vec![Vec::new(); n as usize];
        for round in 0..rounds {
            // Commits when the round's commit window opens (during the round before), reveals
            // at its start, the decision when the reveal window closes.
            let start = GENESIS + round * 1000;
            for i in 0..schedules.len() {
                let nonce = [(round as u8).wrapping_mul(31) ^ i as u8; 32];
                let a = schedules[i].join_round(round, nonce, start - 190).unwrap();
                deliver(&mut schedules, i, &[a], start - 180, drop_reveals_of);
            }
            for now in [start, start + 200] {
                for i in 0..schedules.len() {
                    let actions = schedules[i].poll(now);
                    deliver(&mut schedules, i, &actions, now + 1, drop_reveals_of);
                    for a in actions {
                        if let Action::Decided(plan) = a {
                            plans[i].push(plan);
                        }
                    }
                }
            }
        }
        plans
    }

    #[test]
    fn all_nodes_derive_the_same_permutation_every_round() {
        let plans = run_rounds(8, 20, &[], Topology::OnePeer);
        for round in 0..20 {
            let reference = &plans[0][round];
            assert_eq!(reference.members.len(), 8);
            for node in &plans {
                assert_eq!(node[round].permutation, reference.permutation);
                assert!(node[round].is_member);
                assert_eq!(node[round].neighbours.len(), 1);
            }
        }
        // The permutation changes between rounds.
        assert_ne!(plans[0][0].permutation, plans[0][1].permutation);
    }

    #[test]
    fn a_withheld_reveal_excludes_that_node_and_the_rest_agree() {
        let plans = run_rounds(8, 3, &[5], Topology::TwoPeer);
        let withholder = peer(5);
        for round in 0..3 {
            let reference = &plans[0][round];
            assert_eq!(reference.members.len(), 7);
            assert!(!reference.members.contains(&withholder));
            assert_eq!(reference.withheld, vec![withholder]);
            for (i, node) in plans.iter().enumerate() {
                if i == 5 {
                    // Its own view includes itself but nobody counts it.
                    assert!(node[round].is_member);
                    continue;
                }
                assert_eq!(node[round].permutation, reference.permutation);
                assert!(!node[round].neighbours.contains(&withholder));
                assert_eq!(node[round].neighbours.len(), 2);
            }
        }
    }

    #[test]
    fn late_conflicting_and_forged_messages_are_rejected_without_effect() {
        let t = timing(Topology::Complete);
        let mut s = RoundSchedule::new(t.clone(), [1; 32], peer(0));
        let other = peer(1);
        let nonce = [9; 32];
        let round1 = GENESIS + 1000;
        let good = commitment(&[1; 32], 1, &other, &nonce);
        // Commits for round 1 are accepted during round 0, until round 1 starts.
        assert_eq!(
            s.on_commit(other, 1, good, round1),
            Err(Rejection::LateCommit { round: 1 })
        );
        assert_eq!(
            s.on_commit(other, 5, good, round1 - 150),
            Err(Rejection::OutsideWindow {
                round: 5,
                current: Some(0)
            })
        );
        s.on_commit(other, 1, good, round1 - 150).unwrap();
        assert_eq!(
            s.on_commit(other, 1, [0; 32], round1 - 149),
            Err(Rejection::ConflictingCommit { round: 1 })
        );
        // Reveals are accepted from the round's start until its reveal window closes.
        assert_eq!(
            s.on_reveal(other, 1, [8; 32], round1 + 50),
            Err(Rejection::RevealMismatch { round: 1 })
        );
        assert_eq!(
            s.on_reveal(peer(2), 1, nonce, round1 + 50),
            Err(Rejection::NoCommit { round: 1 })
        );
        assert_eq!(
            s.on_reveal(other, 1, nonce, round1 + 200),
            Err(Rejection::LateReveal { round: 1 })
        );
        s.on_reveal(other, 1, nonce, round1 + 199).unwrap();
        let actions = s.poll(round1 + 200);
        let [Action::Decided(plan)] = actions.as_slice() else {
            panic!("{actions:?}")
        };
        // peer(0) never joined: it sees the round but is not a member.
        assert_eq!(plan.members, vec![other]);
        assert!(!plan.is_member && plan.neighbours.is_empty());
        // Too late to commit to round 2 once less than half its commit window is left.
        assert!(s.join_round(2, nonce, GENESIS + 2000 - 100).is_err());
        assert_eq!(s.next_wakeup(), None);
    }

    #[test]
    fn a_node_that_withdraws_does_not_reveal_and_is_left_out() {
        let t = timing(Topology::OnePeer);
        let mut s = RoundSchedule::new(t, [1; 32], peer(0));
        let start = GENESIS + 1000;
        s.join_round(1, [3; 32], start - 200).unwrap();
        assert!(s.has_joined(1));
        assert_eq!(
            s.next_wakeup(),
            Some(start),
            "it would reveal when round 1 starts"
        );
        s.withdraw_from(1);
        assert!(!s.has_joined(1));
        let actions = s.poll(start + 200);
        let [Action::Decided(plan)] = actions.as_slice() else {
            panic!("{actions:?}")
        };
        assert!(!plan.is_member && plan.members.is_empty() && plan.withheld.is_empty());
    }

    #[test]
    fn the_plans_mixing_row_weighs_its_neighbours_and_returns_a_missing_ones_weight() {
        let plans = run_rounds(5, 2, &[], Topology::TwoPeer);
        for (i, node) in plans.iter().enumerate() {
            let plan = &node[1];
            let me = peer(i as u8);
            let row = plan.mixing_row(Topology::TwoPeer, &me, &[]);
            let own = plan.member_index(&me).unwrap();
            assert_eq!(row.worker, own);
            let mut expected: Vec<usize> = plan
                .neighbours
                .iter()
                .map(|p| plan.member_index(p).unwrap())
                .collect();
            expected.sort_unstable();
            assert_eq!(row.neighbours().collect::<Vec<_>>(), expected);
            assert_eq!(row.weight(own), 1.0 / 3.0);
            // One neighbour's payload did not arrive: ⅔ self, ⅓ the other.
            let row = plan.mixing_row(Topology::TwoPeer, &me, &plan.neighbours[..1]);
            assert_eq!(row.weight(own), 2.0 / 3.0);
            let other = plan.member_index(&plan.neighbours[1]).unwrap();
            assert_eq!(row.weight(other), 1.0 / 3.0);
        }
        // A node outside the round mixes alone.
        let outsider = plans[0][1].mixing_row(Topology::TwoPeer, &peer(9), &[]);
        assert_eq!(outsider.terms, vec![(5, 1)]);
        assert_eq!(outsider.denominator, 1);
    }

    #[test]
    fn on_the_complete_topology_the_nodes_that_miss_the_same_peer_mix_the_same_mean() {
        let plans = run_rounds(5, 2, &[], Topology::Complete);
        let refused = peer(4);
        let rows: Vec<MixingRow> = (0..4u8)
            .map(|i| plans[i as usize][1].mixing_row(Topology::Complete, &peer(i), &[refused]))
            .collect();
        let gone = plans[0][1].member_index(&refused).unwrap();
        for (i, row) in rows.iter().enumerate() {
            // A quarter each for the four that arrived, self included; none for the refused.
            assert_eq!(row.denominator, 4, "node {i}");
            assert_eq!(row.weight(row.worker), 0.25);
            assert_eq!(row.weight(gone), 0.0);
            // The same terms in the same order at every node: the same anchor, to the bit.
            assert_eq!(row.terms, rows[0].terms);
        }
    }

    #[test]
    fn timing_refuses_windows_that_do_not_fit_and_finds_the_next_round() {
        let mut t = timing(Topology::OnePeer);
        assert_eq!(t.round_at(GENESIS - 1), None);
        assert_eq!(t.round_at(GENESIS + 2500), Some(2));
        // Round 3's commit window opens at 2800 and a late node may commit until 2900.
        assert_eq!(t.commit_opens(3), GENESIS + 2800);
        assert_eq!(t.next_joinable_round(GENESIS + 2100), 3);
        assert_eq!(t.next_joinable_round(GENESIS + 2899), 3);
        assert_eq!(t.next_joinable_round(GENESIS + 2900), 4);
        assert_eq!(t.next_joinable_round(GENESIS - 5000), 0);
        // A node that starts listening takes part from the first round whose commits go
        // out a whole commit window (200 ms) later.
        assert_eq!(t.first_round_after_listening(GENESIS - 5000), 0);
        assert_eq!(t.first_round_after_listening(GENESIS - 400), 0);
        assert_eq!(t.first_round_after_listening(GENESIS - 399), 1);
        assert_eq!(t.first_round_after_listening(GENESIS + 2100), 3);
        assert_eq!(t.first_round_after_listening(GENESIS + 2601), 4);
        assert_eq!(t.first_round_after_listening(GENESIS + 2850), 4);
        assert_eq!(Timing::from_wire(&t.to_wire()).unwrap(), t);
        t.reveal_window_ms = 1000;
        assert!(t
            .validate()
            .unwrap_err()
            .contains("shorter than the round period"));
        t.reveal_window_ms = 200;
        t.commit_window_ms = 1001;
        assert!(t.validate().unwrap_err().contains("commit window 1001 ms"));
    }
}
