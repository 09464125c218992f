//! Commit-reveal arithmetic and the round's permutation and neighbour sets.
//!
//! Pure functions, specified byte for byte in `docs/protocol.md` so that any implementation
//! derives the same permutation from the same reveals (`docs/protocol.md` §4).

use gasloc_proto::topology;
use gasloc_proto::topology::Topology;
use gasloc_proto::wire::DIGEST_LEN;
use libp2p::PeerId;
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

/// Orders peers by their multihash bytes (the canonical member order). Each peer's bytes
/// are computed once (a round of 1,000 members would otherwise build them 20,000 times).
pub fn sort_peers(peers: &mut [PeerId]) {
    peers.sort_by_cached_key(|p| p.to_bytes());
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

/// The round's permutation of `0..n`: [`gasloc_proto::topology::permutation`] (Fisher–Yates
/// driven by ChaCha20 seeded with `seed`), the same function the simulator uses.
pub fn index_permutation(seed: &Digest32, n: usize) -> Vec<usize> {
    topology::permutation(*seed, n)
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
/// The neighbour sets are [`gasloc_proto::topology::Topology::neighbours`] over positions in
/// `perm`: one-peer pairs `(π0, π1), (π2, π3), …` (an odd last member has none); two-peer is
/// the ring `π0 → π1 → … → π(n−1) → π0` (n = 2: the one other member); complete is everyone.
pub fn neighbours(topology: Topology, perm: &[PeerId], me: &PeerId) -> Vec<PeerId> {
    let Some(pos) = perm.iter().position(|p| p == me) else {
        return Vec::new();
    };
    let positions: Vec<usize> = (0..perm.len()).collect();
    topology.neighbours(&positions)[pos]
        .iter()
        .map(|&k| perm[k])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p::identity::Keypair;
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    use rand_chacha::ChaCha20Rng;

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
}
