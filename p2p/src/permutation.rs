//! Commit-reveal arithmetic and the round's permutation and neighbour sets.
//!
//! Pure functions, specified byte for byte in `docs/protocol.md` so that any implementation
//! derives the same permutation from the same reveals (`ALGORITHMS.md` §3).

use gasloc_proto::wire::{Topology, DIGEST_LEN};
use libp2p::PeerId;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use sha2::{Digest, Sha256};

pub type Digest32 = [u8; DIGEST_LEN];

/// `SHA-256(run_id ‖ round as u64 LE ‖ peer id bytes ‖ nonce)`.
pub fn commitment(run_id: &Digest32, round: u64, peer: &PeerId, nonce: &Digest32) -> Digest32 {
    let mut h = Sha256::new();
    h.update(run_id);
    h.update(round.to_le_bytes());
    h.update(peer.to_bytes());
    h.update(nonce);
    h.finalize().into()
}

/// Orders peers by their multihash bytes (the canonical member order).
pub fn sort_peers(peers: &mut [PeerId]) {
    peers.sort_by_key(|p| p.to_bytes());
}

/// The round seed: `SHA-256("gasloc-round-seed-v1" ‖ run_id ‖ round LE ‖ for each member in
/// canonical order: u16 LE length of peer id bytes ‖ peer id bytes ‖ nonce)`.
/// `members` must be sorted with [`sort_peers`] order.
pub fn round_seed(run_id: &Digest32, round: u64, members: &[(PeerId, Digest32)]) -> Digest32 {
    let mut h = Sha256::new();
    h.update(b"gasloc-round-seed-v1");
    h.update(run_id);
    h.update(round.to_le_bytes());
    for (peer, nonce) in members {
        let bytes = peer.to_bytes();
        h.update((bytes.len() as u16).to_le_bytes());
        h.update(&bytes);
        h.update(nonce);
    }
    h.finalize().into()
}

/// A uniform integer in `0..bound`: draw `x = next_u64()`; with
/// `zone = u64::MAX - ((u64::MAX - bound + 1) % bound)`, accept when `x <= zone` and return
/// `x % bound`, otherwise draw again (`zone + 1` is a multiple of `bound`).
pub fn uniform_below(rng: &mut ChaCha20Rng, bound: u64) -> u64 {
    assert!(bound > 0, "uniform_below needs a positive bound");
    let zone = u64::MAX - (u64::MAX - bound + 1) % bound;
    loop {
        let x = rng.next_u64();
        if x <= zone {
            return x % bound;
        }
    }
}

/// The round's permutation of `0..n`: Fisher–Yates driven by ChaCha20 seeded with `seed`:
/// for `i` from `n-1` down to `1`, swap `i` with `uniform_below(i + 1)`. (The same function
/// as `gasloc_proto::topology::permutation` on the `algo` branch; one of the two goes when
/// they meet.)
pub fn index_permutation(seed: &Digest32, n: usize) -> Vec<usize> {
    let mut rng = ChaCha20Rng::from_seed(*seed);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = uniform_below(&mut rng, i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// The members in permuted order: `index_permutation(seed, n)` applied to the canonically
/// ordered members.
pub fn permutation(sorted_members: &[PeerId], seed: &Digest32) -> Vec<PeerId> {
    index_permutation(seed, sorted_members.len())
        .into_iter()
        .map(|i| sorted_members[i])
        .collect()
}

/// `me`'s neighbours in the permutation `perm` under `topology`; empty if `me` is not in it.
/// One-peer pairs `(π0, π1), (π2, π3), …` (an odd last member has none); two-peer is the ring
/// `π0 → π1 → … → π(n−1) → π0` (n = 2: the one other member); complete is everyone else.
pub fn neighbours(topology: Topology, perm: &[PeerId], me: &PeerId) -> Vec<PeerId> {
    let Some(pos) = perm.iter().position(|p| p == me) else {
        return Vec::new();
    };
    let n = perm.len();
    match topology {
        Topology::OnePeer | Topology::Unspecified => {
            let partner = pos ^ 1;
            if partner < n {
                vec![perm[partner]]
            } else {
                Vec::new()
            }
        }
        Topology::TwoPeer => {
            if n < 2 {
                return Vec::new();
            }
            let next = perm[(pos + 1) % n];
            let prev = perm[(pos + n - 1) % n];
            if next == prev {
                vec![next]
            } else {
                vec![prev, next]
            }
        }
        Topology::Complete => perm.iter().filter(|p| *p != me).copied().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p::identity::Keypair;

    fn peers(n: u8) -> Vec<PeerId> {
        let mut v: Vec<PeerId> = (0..n)
            .map(|i| {
                Keypair::ed25519_from_bytes([i + 1; 32])
                    .unwrap()
                    .public()
                    .to_peer_id()
            })
            .collect();
        sort_peers(&mut v);
        v
    }

    #[test]
    fn permutation_is_a_deterministic_shuffle_of_the_members() {
        let members = peers(9);
        let a = permutation(&members, &[1; 32]);
        assert_eq!(a, permutation(&members, &[1; 32]));
        assert_ne!(a, permutation(&members, &[2; 32]));
        let mut sorted = a.clone();
        sort_peers(&mut sorted);
        assert_eq!(sorted, members);
    }

    #[test]
    fn chacha_stream_is_the_documented_one() {
        // docs/protocol.md: the first next_u64 of ChaCha20 (20 rounds) keyed with 32 zero
        // bytes, nonce 0, is the first 8 keystream bytes as little-endian: 76 b8 e0 ad ...
        let mut rng = ChaCha20Rng::from_seed([0; 32]);
        assert_eq!(
            rng.next_u64(),
            u64::from_le_bytes([0x76, 0xb8, 0xe0, 0xad, 0xa0, 0xf1, 0x3d, 0x90])
        );
    }

    #[test]
    fn neighbour_sets_are_symmetric_in_every_topology() {
        for n in 1..=9u8 {
            let perm = permutation(&peers(n), &[n; 32]);
            for topology in [Topology::OnePeer, Topology::TwoPeer, Topology::Complete] {
                for me in &perm {
                    let mine = neighbours(topology, &perm, me);
                    assert!(!mine.contains(me));
                    for other in &mine {
                        assert!(
                            neighbours(topology, &perm, other).contains(me),
                            "{topology:?} n={n}"
                        );
                    }
                    let expected = match (topology, n) {
                        (_, 1) => 0,
                        (Topology::OnePeer, _) => {
                            usize::from(perm.iter().position(|p| p == me).unwrap() ^ 1 < n as usize)
                        }
                        (Topology::TwoPeer, 2) => 1,
                        (Topology::TwoPeer, _) => 2,
                        _ => n as usize - 1,
                    };
                    assert_eq!(mine.len(), expected, "{topology:?} n={n}");
                }
            }
        }
        let outsider = Keypair::ed25519_from_bytes([99; 32])
            .unwrap()
            .public()
            .to_peer_id();
        assert!(neighbours(Topology::Complete, &peers(3), &outsider).is_empty());
    }

    #[test]
    fn uniform_below_covers_its_range() {
        let mut rng = ChaCha20Rng::from_seed([3; 32]);
        let mut seen = [false; 5];
        for _ in 0..200 {
            seen[uniform_below(&mut rng, 5) as usize] = true;
        }
        assert!(seen.iter().all(|s| *s));
        assert_eq!(uniform_below(&mut rng, 1), 0);
    }
}
