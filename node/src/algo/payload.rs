//! What a worker sends at the end of a round, as the receiver will see it, and its size.
//!
//! * `model-fp32`: the local model `x_i`, exact; 4 bytes per parameter.
//! * `model-bf16`: `x_i` rounded to bf16 (round to nearest even); 2 bytes per parameter.
//! * `lordo` (our gossip adaptation of LoRDO, `docs/algorithms.md`, "The `lordo` payload"): the
//!   pseudo-gradient `Δ_i = θ_i − x_i` plus the worker's payload error `E`, `A = Δ_i + E`; each
//!   projected matrix goes as the top-r factors of `A` itself, `U_r` and `Σ_r·V_rᵀ` (its truncated
//!   SVD), both in bf16: `r·(m+n)` values instead of `m·n`; every other tensor goes whole in bf16.
//!   The sender keeps `E ← A − decoded(A)`, so what is cut or rounded is sent in a later round
//!   (error feedback).
//!
//!   The factors are `A`'s own, not `A` projected through the worker's LoRDO basis `Q`: a
//!   payload inside `span(Q)` would make the basis refresh (the SVD of the mix of such
//!   payloads) return `span(Q)` again, freezing the basis for good, and `E` would integrate
//!   everything outside `span(Q)` with nothing to drain it. A truncated SVD is a contraction
//!   (`‖A − decoded(A)‖² ≤ (1 − r/min(m,n))·‖A‖²`, up to the bf16 rounding), so `E` stays
//!   bounded, and the mix of the neighbours' payloads spans more than one basis.

use crate::algo::lordo::LowRankState;
use tch::{Kind, Tensor};

/// `t` rounded to bf16 and back to fp32: exactly what a bf16 receiver decodes.
pub fn through_bf16(t: &Tensor) -> Tensor {
    t.to_kind(Kind::BFloat16).to_kind(Kind::Float)
}

/// Bytes of a model payload of `elements` parameters at `bytes_per_element`.
pub fn model_bytes(tensors: &[Tensor], bytes_per_element: usize) -> u64 {
    tensors.iter().map(|t| t.numel() as u64).sum::<u64>() * bytes_per_element as u64
}

/// One tensor of a LoRDO payload as it goes on the wire, its values already rounded to bf16
/// (held in fp32).
#[derive(Debug)]
pub enum LordoPart {
    /// A projected matrix: `U_r` `[m, r]` and `Σ_r·V_rᵀ` `[r, n]`.
    Factors { left: Tensor, right: Tensor },
    /// Any other tensor, whole.
    Whole(Tensor),
}

impl LordoPart {
    /// What a receiver reconstructs: `U_r·(Σ_r·V_rᵀ)`, or the tensor.
    pub fn decode(&self) -> Tensor {
        match self {
            LordoPart::Factors { left, right } => left.matmul(right),
            LordoPart::Whole(t) => t.shallow_clone(),
        }
    }
}

/// One worker's LoRDO payload: what goes on the wire, decoded, and its size.
#[derive(Debug)]
pub struct LordoPayload {
    /// One part per parameter, in parameter order.
    pub parts: Vec<LordoPart>,
    /// What receivers reconstruct, one tensor per parameter.
    pub decoded: Vec<Tensor>,
    pub bytes: u64,
}

/// The wire names of a projected matrix's two factors in a `lordo` payload
/// (`docs/protocol.md`): `<name>.lordo_u` and `<name>.lordo_svt`.
pub fn factor_names(name: &str) -> (String, String) {
    (format!("{name}.lordo_u"), format!("{name}.lordo_svt"))
}

/// The top-`rank` factors of `matrix`'s truncated SVD, `(U_r, Σ_r·V_rᵀ)`: `[m, r]` and
/// `[r, n]`, whose product is the best rank-r approximation of `matrix`.
pub fn top_factors(matrix: &Tensor, rank: i64) -> (Tensor, Tensor) {
    let (u, s, v) = matrix.to_kind(Kind::Float).svd(true, true);
    let rank = rank.min(s.size()[0]);
    let left = u.narrow(1, 0, rank).contiguous();
    let right = (v.narrow(1, 0, rank) * s.narrow(0, 0, rank))
        .tr()
        .contiguous();
    (left, right)
}

/// Encodes `pseudo_gradient + error` (in parameter order, named by `names`): each matrix that
/// `projected` names as its top-r factors at that state's rank (its basis is not used: see
/// the module's doc), every other tensor whole in bf16. Updates `error` in place (error
/// feedback) and returns the payload.
pub fn encode_lordo(
    names: &[String],
    pseudo_gradient: &[Tensor],
    error: &mut [Tensor],
    projected: &[LowRankState],
) -> LordoPayload {
    let _guard = tch::no_grad_guard();
    let mut bytes = 0u64;
    let mut parts = Vec::with_capacity(names.len());
    let mut decoded = Vec::with_capacity(names.len());
    for ((name, delta), e) in names.iter().zip(pseudo_gradient).zip(error.iter_mut()) {
        let wanted = delta + &*e;
        let part = match projected.iter().find(|s| s.name == *name) {
            Some(s) => {
                let (left, right) = top_factors(&wanted, s.rank());
                let (left, right) = (through_bf16(&left), through_bf16(&right));
                bytes += 2 * (left.numel() + right.numel()) as u64;
                LordoPart::Factors { left, right }
            }
            None => {
                bytes += 2 * wanted.numel() as u64;
                LordoPart::Whole(through_bf16(&wanted))
            }
        };
        let sent = part.decode();
        *e = &wanted - &sent;
        parts.push(part);
        decoded.push(sent);
    }
    LordoPayload {
        parts,
        decoded,
        bytes,
    }
}
