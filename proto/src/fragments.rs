//! Model fragments (`[outer] fragments = P`, Streaming DiLoCo, arXiv 2501.18512): the
//! model's tensors split into P groups of about equal size, and which group a round
//! exchanges. Round t (numbered from 0, as the node numbers its rounds; the simulator's
//! round t is round t − 1 here) mixes and outer-steps only fragment `t mod P`; the other
//! fragments keep training locally and are synced in their own rounds, so each fragment is
//! synced every `P · H` inner steps and a round's payload is about `1/P` of the model.
//!
//! With overlapped rounds (`[outer] overlap`) the exchange of a fragment then runs beside
//! `1/P` as many inner steps as the whole model's would, which is the point: the outer step
//! of a fragment lands after fewer stale steps.
//!
//! The split is spelled out here (largest tensor first, to the fragment with the fewest
//! elements so far, ties to the lower index), so every node of a run computes the same one
//! from the tensor sizes alone and no library upgrade changes it. Torch-free: the simulator
//! and the node call the same function.

/// The fragment round `round` (numbered from 0) exchanges out of `count`: `round mod count`
/// (0 when `count` is 0 or 1).
pub fn fragment_of_round(round: u64, count: usize) -> usize {
    (round % count.max(1) as u64) as usize
}

/// Fragments of a model's tensor list: which tensors each holds, by index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fragments {
    /// `members[f]`: the indices of fragment f's tensors, ascending.
    members: Vec<Vec<usize>>,
}

/// A split that cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FragmentError {
    #[error("fragments = 0: there must be at least one")]
    NoFragments,
    #[error("fragments = {fragments} but the model has only {tensors} tensors: each fragment needs at least one")]
    MoreFragmentsThanTensors { fragments: usize, tensors: usize },
}

impl Fragments {
    /// Splits tensors of `sizes` elements (in the model's parameter order) into `count`
    /// fragments of about equal total size. One fragment holds every tensor.
    pub fn split(sizes: &[u64], count: usize) -> Result<Self, FragmentError> {
        if count == 0 {
            return Err(FragmentError::NoFragments);
        }
        if count > sizes.len() {
            return Err(FragmentError::MoreFragmentsThanTensors {
                fragments: count,
                tensors: sizes.len(),
            });
        }
        // Largest first; equal sizes in parameter order.
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
        let mut totals = vec![0u64; count];
        let mut members = vec![Vec::new(); count];
        for k in order {
            // The lightest fragment so far, the lowest index among equals.
            let mut lightest = 0;
            for f in 1..count {
                if totals[f] < totals[lightest] {
                    lightest = f;
                }
            }
            totals[lightest] += sizes[k];
            members[lightest].push(k);
        }
        for m in &mut members {
            m.sort_unstable();
        }
        Ok(Fragments { members })
    }

    /// P, the number of fragments.
    pub fn count(&self) -> usize {
        self.members.len()
    }

    /// The fragment round `round` (numbered from 0) exchanges ([`fragment_of_round`]).
    pub fn of_round(&self, round: u64) -> usize {
        fragment_of_round(round, self.members.len())
    }

    /// The tensor indices of fragment `f`, ascending.
    pub fn members(&self, f: usize) -> &[usize] {
        &self.members[f]
    }

    /// The tensor indices round `round` exchanges.
    pub fn of_round_members(&self, round: u64) -> &[usize] {
        self.members(self.of_round(round))
    }

    /// Whether every tensor is in the one fragment (`fragments = 1`: whole-model rounds).
    pub fn is_whole(&self) -> bool {
        self.members.len() == 1
    }

    /// `items` restricted to round `round`'s fragment, in order.
    pub fn pick<'a, T>(&self, round: u64, items: &'a [T]) -> Vec<&'a T> {
        self.of_round_members(round)
            .iter()
            .map(|&k| &items[k])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_fragment_holds_every_tensor_and_every_round_exchanges_it() {
        let f = Fragments::split(&[5, 1, 9], 1).unwrap();
        assert!(f.is_whole());
        assert_eq!(f.members(0), &[0, 1, 2]);
        for round in 0..5 {
            assert_eq!(f.of_round(round), 0);
        }
    }

    #[test]
    fn the_split_is_spelled_out() {
        // Sizes in order 9, 8, 5, 4, 4, 1 (indices 1, 4, 2, 0, 5, 3), each to the lightest:
        // 9 → f0, 8 → f1, 5 → f2; 4 → f2 (totals were 9, 8, 5); 4 → f1 (9, 8, 9);
        // 1 → f0 (9, 12, 9: f0 and f2 tie, the lower index wins).
        let f = Fragments::split(&[4, 9, 5, 1, 8, 4], 3).unwrap();
        assert_eq!(f.members(0), &[1, 3]);
        assert_eq!(f.members(1), &[4, 5]);
        assert_eq!(f.members(2), &[0, 2]);
        assert_eq!(
            (0..7).map(|r| f.of_round(r)).collect::<Vec<_>>(),
            [0, 1, 2, 0, 1, 2, 0]
        );
        assert_eq!(f.pick(1, &["a", "b", "c", "d", "e", "f"]), [&"e", &"f"]);
    }

    #[test]
    fn impossible_splits_are_refused_by_name() {
        assert_eq!(
            Fragments::split(&[1, 2], 0),
            Err(FragmentError::NoFragments)
        );
        let e = Fragments::split(&[1, 2], 3).unwrap_err();
        assert_eq!(
            e,
            FragmentError::MoreFragmentsThanTensors {
                fragments: 3,
                tensors: 2
            }
        );
        assert!(e.to_string().contains("only 2 tensors"));
    }

    /// Every tensor is in exactly one fragment, none is empty, and no fragment is heavier
    /// than an equal share plus the largest tensor (the greedy split's bound), over many
    /// size lists (a fixed pseudo-random sequence) and fragment counts.
    #[test]
    fn fragments_partition_the_tensors_and_balance_them() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..300 {
            let n = 1 + (next() % 40) as usize;
            let sizes: Vec<u64> = (0..n).map(|_| 1 + next() % 10_000).collect();
            let total: u64 = sizes.iter().sum();
            let largest = *sizes.iter().max().unwrap();
            for count in 1..=n.min(8) {
                let f = Fragments::split(&sizes, count).unwrap();
                assert_eq!(f.count(), count);
                let mut seen = vec![0; n];
                for g in 0..count {
                    let members = f.members(g);
                    assert!(
                        !members.is_empty(),
                        "{sizes:?} into {count}: fragment {g} empty"
                    );
                    assert!(members.windows(2).all(|w| w[0] < w[1]));
                    let weight: u64 = members.iter().map(|&k| sizes[k]).sum();
                    assert!(weight * count as u64 <= total + largest * count as u64);
                    for &k in members {
                        seen[k] += 1;
                    }
                }
                assert!(seen.iter().all(|&s| s == 1), "{sizes:?} into {count}");
            }
        }
    }
}
