//! Who mixes with whom in a round, and with which weights — torch-free, so the simulator and
//! the networked node derive the same graph from the same round seed.
//!
//! * [`permutation`]: Fisher–Yates over `0..n` driven by ChaCha20 keyed with the round's
//!   32-byte seed (`docs/algorithms.md`, "Topologies and permutations"). The index draw is spelled
//!   out here (rejection sampling on `next_u64`) instead of borrowed from `rand`'s `shuffle`, so
//!   the permutation is fixed by this file alone and cannot change with a `rand` upgrade.
//! * [`Topology::mixing`]: the round's mixing matrix, one [`MixingRow`] per worker, with
//!   weights kept as exact fractions `count / denominator` (every weight of the four
//!   topologies is `1/k`, `c/k` once missing neighbours are folded back into self, or
//!   `1/(k−m)` once m are left out of the complete topology's mean).
//! * [`MixingRow::without`]: a neighbour that did not arrive is dropped and its weight goes
//!   where the topology's [`MissingWeight`] says: back to self on the gossip topologies
//!   (`docs/algorithms.md`, "A round"), over the members that arrived on the complete one (DiLoCo's
//!   mean over the workers that reported). Either way the row stays stochastic.
//!   [`Topology::round_row`] is one worker's row of a round with its missing neighbours so dropped
//!   (what the node and the simulator apply).
//! * [`sim_round_seed`]: how the simulator derives a round's seed from the run seed.

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The communication graph of a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Topology {
    /// Pairs `(π0,π1), (π2,π3), …`, weights ½ self ½ partner; an odd one out mixes alone.
    OnePeer,
    /// The ring `π0→π1→…→π(n−1)→π0`, weights ⅓ self and ⅓ each neighbour.
    TwoPeer,
    /// Everyone with everyone, weights 1/n (all-reduce).
    Complete,
    /// The fixed ring `0→1→…→n−1→0` whatever the permutation (a comparison baseline).
    Ring,
}

impl Topology {
    /// Every topology, in the order the names are listed to users.
    pub const ALL: [Topology; 4] = [
        Topology::OnePeer,
        Topology::TwoPeer,
        Topology::Complete,
        Topology::Ring,
    ];

    /// The topology called `name` (`one-peer`, `two-peer`, `complete`, `ring`).
    pub fn from_name(name: &str) -> Option<Topology> {
        Topology::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Its wire form; `None` for `Ring`, a simulator baseline that swarms do not run.
    pub fn to_wire(self) -> Option<crate::wire::Topology> {
        use crate::wire::Topology as Wire;
        match self {
            Topology::OnePeer => Some(Wire::OnePeer),
            Topology::TwoPeer => Some(Wire::TwoPeer),
            Topology::Complete => Some(Wire::Complete),
            Topology::Ring => None,
        }
    }

    /// From its wire form (`i32` as prost stores it); `None` if unspecified or unknown.
    pub fn from_wire(value: i32) -> Option<Topology> {
        use crate::wire::Topology as Wire;
        match Wire::try_from(value).ok()? {
            Wire::OnePeer => Some(Topology::OnePeer),
            Wire::TwoPeer => Some(Topology::TwoPeer),
            Wire::Complete => Some(Topology::Complete),
            Wire::Unspecified => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Topology::OnePeer => "one-peer",
            Topology::TwoPeer => "two-peer",
            Topology::Complete => "complete",
            Topology::Ring => "ring",
        }
    }

    /// Each worker's neighbours this round (never itself), ascending, for the round's
    /// permutation `perm` of `0..n`.
    pub fn neighbours(self, perm: &[usize]) -> Vec<Vec<usize>> {
        let mut position = vec![0; perm.len()];
        for (k, &w) in perm.iter().enumerate() {
            position[w] = k;
        }
        (0..perm.len())
            .map(|w| self.neighbours_at(perm, position[w]))
            .collect()
    }

    /// The neighbours (ascending, never itself) of the worker at position `k` of `perm`.
    fn neighbours_at(self, perm: &[usize], k: usize) -> Vec<usize> {
        let n = perm.len();
        let me = perm[k];
        let mut out = match self {
            // Pairs (π0,π1), (π2,π3), …: the partner is the other half of the pair, if any.
            Topology::OnePeer => (k ^ 1 < n).then(|| perm[k ^ 1]).into_iter().collect(),
            Topology::TwoPeer => vec![perm[(k + n - 1) % n], perm[(k + 1) % n]],
            Topology::Ring => vec![(me + n - 1) % n, (me + 1) % n],
            Topology::Complete => (0..n).collect(),
        };
        out.retain(|&j| j != me);
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The mixing matrix of the round: worker `i` averages itself and its neighbours with
    /// equal weights `1 / (1 + neighbours)` (½, ⅓, 1/n; a ring of 2 is a pair).
    pub fn mixing(self, perm: &[usize]) -> Vec<MixingRow> {
        self.neighbours(perm)
            .into_iter()
            .enumerate()
            .map(|(i, neighbours)| MixingRow::uniform(i, &neighbours))
            .collect()
    }

    /// Where this topology puts the weight of a neighbour that sent nothing usable.
    pub fn missing_weight(self) -> MissingWeight {
        match self {
            Topology::Complete => MissingWeight::OverThePresent,
            Topology::OnePeer | Topology::TwoPeer | Topology::Ring => MissingWeight::ToSelf,
        }
    }

    /// The row `worker` applies in a round with permutation `perm` when the neighbours in
    /// `missing` sent nothing usable (absent, failed or refused): the topology's row with
    /// those dropped and their weight placed by [`Self::missing_weight`]
    /// ([`MixingRow::without`]). The one place where the simulator and the networked node get
    /// their mixing weights.
    pub fn round_row(self, perm: &[usize], worker: usize, missing: &[usize]) -> MixingRow {
        let k = perm
            .iter()
            .position(|&w| w == worker)
            .expect("the worker is in the permutation");
        MixingRow::uniform(worker, &self.neighbours_at(perm, k))
            .without(missing, self.missing_weight())
    }
}

/// Where the weight of a neighbour that sent nothing usable (absent, failed or refused) goes.
/// The row stays stochastic either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingWeight {
    /// Back to self (`docs/algorithms.md`, "A round", step 3): the gossip topologies, where a
    /// worker has one or two neighbours and the partner that did arrive keeps the weight the matrix
    /// gave it.
    ToSelf,
    /// Over the rest of the row, in proportion to its weights: on the complete topology, the
    /// mean over the members whose models arrived, which is what DiLoCo does when a worker
    /// drops out. Every node that received the same models then holds the same anchor, the
    /// DiLoCo invariant; returned to self, each honest node that refuses `k` of `n` members
    /// would give its own model `(k+1)/n` of the mix and the anchors would part
    /// (`docs/algorithms.md`, "Topologies and permutations", has the measurement).
    OverThePresent,
}

impl std::str::FromStr for Topology {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "one-peer" => Ok(Topology::OnePeer),
            "two-peer" => Ok(Topology::TwoPeer),
            "complete" => Ok(Topology::Complete),
            "ring" => Ok(Topology::Ring),
            other => Err(format!(
                "unknown topology {other:?} (expected one-peer, two-peer, complete or ring)"
            )),
        }
    }
}

/// One row of a mixing matrix: `x̄_i = Σ_j (count_j / denominator) · x_j`, the terms in
/// ascending worker order (so every worker sums in the same order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MixingRow {
    /// The worker this row belongs to.
    pub worker: usize,
    /// `(j, count_j)`, ascending in `j`, self included; the counts sum to `denominator`.
    pub terms: Vec<(usize, u32)>,
    pub denominator: u32,
}

impl MixingRow {
    /// Equal weights over self and `neighbours`.
    pub fn uniform(worker: usize, neighbours: &[usize]) -> MixingRow {
        let mut terms: Vec<(usize, u32)> = neighbours.iter().map(|&j| (j, 1)).collect();
        terms.push((worker, 1));
        terms.sort_unstable();
        terms.dedup_by_key(|t| t.0);
        MixingRow {
            worker,
            denominator: terms.len() as u32,
            terms,
        }
    }

    /// The row with the neighbours in `missing` dropped (self never is) and their weight
    /// placed as `rule` says: added to self's count, or left out of the denominator so the
    /// counts that remain are the whole.
    pub fn without(&self, missing: &[usize], rule: MissingWeight) -> MixingRow {
        let mut dropped = 0;
        let mut terms: Vec<(usize, u32)> = Vec::with_capacity(self.terms.len());
        for &(j, c) in &self.terms {
            if j != self.worker && missing.contains(&j) {
                dropped += c;
            } else {
                terms.push((j, c));
            }
        }
        let denominator = match rule {
            MissingWeight::ToSelf => {
                if let Some(own) = terms.iter_mut().find(|t| t.0 == self.worker) {
                    own.1 += dropped;
                }
                self.denominator
            }
            MissingWeight::OverThePresent => self.denominator - dropped,
        };
        MixingRow {
            worker: self.worker,
            terms,
            denominator,
        }
    }

    /// The neighbours in this row (self excluded).
    pub fn neighbours(&self) -> impl Iterator<Item = usize> + '_ {
        self.terms
            .iter()
            .map(|t| t.0)
            .filter(move |&j| j != self.worker)
    }

    /// The weight of worker `j` as a float (0 when absent).
    pub fn weight(&self, j: usize) -> f64 {
        self.terms
            .iter()
            .find(|t| t.0 == j)
            .map_or(0.0, |t| t.1 as f64 / self.denominator as f64)
    }
}

/// A uniform draw from `0..bound` by rejection on 64-bit words (no modulo bias).
fn uniform_below(rng: &mut ChaCha20Rng, bound: u64) -> u64 {
    let zone = u64::MAX - (u64::MAX - bound + 1) % bound;
    loop {
        let word = rng.next_u64();
        if word <= zone {
            return word % bound;
        }
    }
}

/// The round's permutation of `0..n`: Fisher–Yates (`for i in (1..n).rev(): swap(i,
/// uniform(0..=i))`) driven by ChaCha20 seeded with `seed`.
pub fn permutation(seed: [u8; 32], n: usize) -> Vec<usize> {
    let mut rng = ChaCha20Rng::from_seed(seed);
    let mut perm: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = uniform_below(&mut rng, i as u64 + 1) as usize;
        perm.swap(i, j);
    }
    perm
}

/// The simulator's round seed: `SHA-256("gasloc sim round seed v1" ‖ run_seed (u64 LE) ‖
/// round (u64 LE))`. The networked swarm replaces this with the commit-reveal seed (§3).
pub fn sim_round_seed(run_seed: u64, round: u64) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"gasloc sim round seed v1");
    h.update(run_seed.to_le_bytes());
    h.update(round.to_le_bytes());
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_wire_forms_round_trip_and_the_ring_has_no_wire_form() {
        for t in Topology::ALL {
            assert_eq!(Topology::from_name(t.name()), Some(t));
            match t.to_wire() {
                Some(w) => assert_eq!(Topology::from_wire(w as i32), Some(t)),
                None => assert_eq!(t, Topology::Ring),
            }
        }
        assert_eq!(Topology::from_name("star"), None);
        assert_eq!(Topology::from_wire(0), None, "unspecified");
        assert_eq!(Topology::from_wire(99), None, "unknown");
    }

    fn matrix(rows: &[MixingRow]) -> Vec<Vec<f64>> {
        let n = rows.len();
        rows.iter()
            .map(|r| (0..n).map(|j| r.weight(j)).collect())
            .collect()
    }

    #[test]
    fn permutation_is_a_permutation_and_fixed_by_its_seed() {
        for n in [0, 1, 2, 3, 8, 33] {
            let p = permutation(sim_round_seed(5, 9), n);
            let mut sorted = p.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..n).collect::<Vec<_>>());
            assert_eq!(p, permutation(sim_round_seed(5, 9), n));
        }
        let a = permutation(sim_round_seed(5, 1), 16);
        let b = permutation(sim_round_seed(5, 2), 16);
        let c = permutation(sim_round_seed(6, 1), 16);
        assert_ne!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn permutation_draws_every_position_about_equally() {
        // 4000 rounds of n = 4: each worker lands on each position ~1000 times.
        let mut counts = [[0u32; 4]; 4];
        for round in 0..4000 {
            for (pos, &w) in permutation(sim_round_seed(1, round), 4).iter().enumerate() {
                counts[w][pos] += 1;
            }
        }
        for row in counts {
            for c in row {
                assert!((850..1150).contains(&c), "{counts:?}");
            }
        }
    }

    #[test]
    fn mixing_matrices_are_doubly_stochastic_and_symmetric() {
        for topology in Topology::ALL {
            for n in 1..=9 {
                for round in 0..5 {
                    let w = matrix(&topology.mixing(&permutation(sim_round_seed(3, round), n)));
                    for i in 0..n {
                        let row: f64 = w[i].iter().sum();
                        let col: f64 = w.iter().map(|r| r[i]).sum();
                        assert!((row - 1.0).abs() < 1e-12, "{topology:?} n={n} row {i}");
                        assert!((col - 1.0).abs() < 1e-12, "{topology:?} n={n} col {i}");
                        for (j, other) in w.iter().enumerate() {
                            assert_eq!(w[i][j], other[i], "{topology:?} n={n}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn topologies_have_the_specified_shapes() {
        let perm = vec![3, 0, 4, 1, 2];
        let one = Topology::OnePeer.neighbours(&perm);
        assert_eq!(one, vec![vec![3], vec![4], vec![], vec![0], vec![1]]);
        let w = matrix(&Topology::OnePeer.mixing(&perm));
        assert_eq!((w[0][0], w[0][3], w[2][2]), (0.5, 0.5, 1.0));
        let two = Topology::TwoPeer.neighbours(&perm);
        assert_eq!(two[3], vec![0, 2]);
        assert_eq!(two[0], vec![3, 4]);
        assert!((Topology::TwoPeer.mixing(&perm)[0].weight(4) - 1.0 / 3.0).abs() < 1e-15);
        assert_eq!(Topology::Ring.neighbours(&perm)[0], vec![1, 4]);
        assert_eq!(Topology::Complete.neighbours(&perm)[2], vec![0, 1, 3, 4]);
        // A ring of two is a pair; of one, self alone.
        let w = matrix(&Topology::TwoPeer.mixing(&[1, 0]));
        assert_eq!(w, vec![vec![0.5, 0.5], vec![0.5, 0.5]]);
        assert_eq!(matrix(&Topology::Ring.mixing(&[0])), vec![vec![1.0]]);
    }

    #[test]
    fn one_row_is_the_matrix_row_and_drops_what_is_missing() {
        for topology in Topology::ALL {
            for n in 1..=9 {
                for round in 0..5 {
                    let perm = permutation(sim_round_seed(4, round), n);
                    let rows = topology.mixing(&perm);
                    for (i, row) in rows.iter().enumerate() {
                        assert_eq!(
                            &topology.round_row(&perm, i, &[]),
                            row,
                            "{topology:?} n={n}"
                        );
                        let missing: Vec<usize> = row.neighbours().take(1).collect();
                        assert_eq!(
                            topology.round_row(&perm, i, &missing),
                            row.without(&missing, topology.missing_weight())
                        );
                    }
                }
            }
        }
        // Two-peer, one of two neighbours missing: ⅔ self, ⅓ the other (`docs/algorithms.md`, "A
        // round").
        let row = Topology::TwoPeer.round_row(&[0, 1, 2], 1, &[2]);
        assert_eq!(
            (row.weight(1), row.weight(0), row.weight(2)),
            (2.0 / 3.0, 1.0 / 3.0, 0.0)
        );
    }

    #[test]
    fn a_missing_neighbour_returns_its_weight_to_self() {
        let row = Topology::TwoPeer.mixing(&[0, 1, 2, 3])[1].without(&[2], MissingWeight::ToSelf);
        assert_eq!(row.terms, vec![(0, 1), (1, 2)]);
        assert_eq!(row.denominator, 3);
        assert!((row.weight(1) - 2.0 / 3.0).abs() < 1e-15);
        assert_eq!(row.neighbours().collect::<Vec<_>>(), vec![0]);
        // Self is never dropped.
        let alone = row.without(&[0, 1], MissingWeight::ToSelf);
        assert_eq!(alone.terms, vec![(1, 3)]);
    }

    #[test]
    fn on_the_complete_topology_the_missing_are_left_out_of_the_mean() {
        // 8 members, 2 of them (6 and 7) missing for everyone: each of the other six mixes
        // the mean of the six, the same row whoever computes it.
        let perm = permutation(sim_round_seed(3, 1), 8);
        let rows: Vec<MixingRow> = (0..6)
            .map(|i| Topology::Complete.round_row(&perm, i, &[6, 7]))
            .collect();
        for row in &rows {
            assert_eq!(row.denominator, 6);
            assert_eq!(row.terms, (0..6).map(|j| (j, 1)).collect::<Vec<_>>());
            assert_eq!(row.weight(row.worker), 1.0 / 6.0);
            assert_eq!(row.weight(7), 0.0);
        }
        // Returned to self instead, each would give itself 3/8 and the rows would differ.
        let to_self = Topology::Complete.mixing(&perm)[0].without(&[6, 7], MissingWeight::ToSelf);
        assert_eq!(to_self.weight(0), 3.0 / 8.0);
        // Everyone missing: alone, weight 1. Nobody missing: the matrix row.
        let alone = Topology::Complete.round_row(&perm, 2, &[0, 1, 3, 4, 5, 6, 7]);
        assert_eq!((alone.terms, alone.denominator), (vec![(2, 1)], 1));
        assert_eq!(
            Topology::Complete.round_row(&perm, 2, &[]),
            Topology::Complete.mixing(&perm)[2]
        );
    }

    #[test]
    fn every_row_stays_stochastic_whatever_is_missing() {
        for topology in Topology::ALL {
            for n in 1..=9 {
                let perm = permutation(sim_round_seed(8, n as u64), n);
                for i in 0..n {
                    // Every subset of the others missing, up to n = 9 (256 subsets).
                    let others: Vec<usize> = (0..n).filter(|&j| j != i).collect();
                    for mask in 0..(1u32 << others.len()) {
                        let missing: Vec<usize> = others
                            .iter()
                            .enumerate()
                            .filter(|(b, _)| mask >> b & 1 == 1)
                            .map(|(_, &j)| j)
                            .collect();
                        let row = topology.round_row(&perm, i, &missing);
                        let sum: u32 = row.terms.iter().map(|t| t.1).sum();
                        assert_eq!(sum, row.denominator, "{topology:?} n={n} i={i}");
                        assert!(row.weight(i) > 0.0);
                        assert!(missing.iter().all(|&j| row.weight(j) == 0.0));
                    }
                }
            }
        }
    }
}
