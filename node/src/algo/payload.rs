//! What a worker sends at the end of a round, as the receiver will see it, and its size.
//!
//! * `model-fp32`: the local model `x_i`, exact; 4 bytes per parameter.
//! * `model-bf16`: `x_i` rounded to bf16 (round to nearest even); 2 bytes per parameter.
//! * `lordo` (our gossip adaptation of LoRDO, ALGORITHMS.md §4.2): the pseudo-gradient
//!   `Δ_i = θ_i − x_i` plus the worker's payload error `E`, `A = Δ_i + E`; each projected matrix
//!   goes as its rank-r coordinates in the worker's current LoRDO basis *and* that basis (the
//!   receivers do not share it in a gossip swarm), both in bf16: `r·(m+n)` values instead of
//!   `m·n`; every other tensor goes whole in bf16. The sender keeps `E ← A − decoded(A)`, so
//!   what is cut or rounded is sent in a later round (error feedback).

use crate::algo::lordo::{project, project_back, LowRankState};
use tch::{Kind, Tensor};

/// `t` rounded to bf16 and back to fp32: exactly what a bf16 receiver decodes.
pub fn through_bf16(t: &Tensor) -> Tensor {
    t.to_kind(Kind::BFloat16).to_kind(Kind::Float)
}

/// Bytes of a model payload of `elements` parameters at `bytes_per_element`.
pub fn model_bytes(tensors: &[Tensor], bytes_per_element: usize) -> u64 {
    tensors.iter().map(|t| t.numel() as u64).sum::<u64>() * bytes_per_element as u64
}

/// One worker's LoRDO payload, decoded, and its size on the wire.
#[derive(Debug)]
pub struct LordoPayload {
    /// What receivers reconstruct, one tensor per parameter.
    pub decoded: Vec<Tensor>,
    pub bytes: u64,
}

/// Encodes `pseudo_gradient + error` (in parameter order, named by `names`) against the
/// bases of `projected`, updates `error` in place (error feedback) and returns the decoded
/// payload.
pub fn encode_lordo(
    names: &[String],
    pseudo_gradient: &[Tensor],
    error: &mut [Tensor],
    projected: &[LowRankState],
) -> LordoPayload {
    let _guard = tch::no_grad_guard();
    let mut bytes = 0u64;
    let decoded = names
        .iter()
        .zip(pseudo_gradient)
        .zip(error.iter_mut())
        .map(|((name, delta), e)| {
            let wanted = delta + &*e;
            let sent = match projected.iter().find(|s| s.name == *name) {
                Some(s) => {
                    let basis = through_bf16(&s.basis);
                    let coords = through_bf16(&project(s.side, &basis, &wanted));
                    bytes += 2 * (coords.numel() + basis.numel()) as u64;
                    project_back(s.side, &basis, &coords)
                }
                None => {
                    bytes += 2 * wanted.numel() as u64;
                    through_bf16(&wanted)
                }
            };
            *e = &wanted - &sent;
            sent
        })
        .collect();
    LordoPayload { decoded, bytes }
}
