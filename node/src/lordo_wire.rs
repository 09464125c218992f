//! The `lordo` payload in a swarm: what `gasloc-node join` sends and reads when the run's
//! `[outer] payload = "lordo"` (`docs/protocol.md`, payload kind `LORDO`).
//!
//! A round's payload is the sender's pseudo-gradient plus its payload error,
//! `A = (θ_i − x_i) + E`, encoded by the simulator's function
//! ([`encode_lordo`](crate::algo::payload::encode_lordo)): each matrix LoRDO projects as its
//! own top-r factors, `<name>.lordo_u` `[m, r]` and `<name>.lordo_svt` `[r, n]`, every other
//! tensor whole as `<name>`; all bf16. On a full-sync round
//! ([`is_full_sync_round`]: rounds 0, K, 2K, … of `[lordo] full_sync_every`) the payload
//! also carries the sender's anchor as `anchor.<name>` (bf16), and the receiver mixes the
//! anchors outside the outer momentum before its outer step, as the simulator does.
//!
//! [`LordoWire`] owns the sender's side (the payload error `E`, which checkpoints keep, and
//! the round's own decoded payload, the self term of the mix) and decodes a neighbour's
//! payload. Its tables are fixed by the manifest and the model's shapes, so a payload whose
//! factors do not match the manifest's ranks is refused by the exchange before any byte of
//! it is decoded.

use crate::algo::lordo::LowRankState;
use crate::algo::payload::{encode_lordo, factor_names, LordoPart};
use crate::tensor_wire::{from_wire, tensor_spec, to_wire};
use anyhow::{bail, Result};
use gasloc_p2p::tensors::TensorSet;
use gasloc_p2p::work::PayloadTables;
use gasloc_proto::manifest::is_full_sync_round;
use gasloc_proto::wire::{DType, PayloadKind};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

/// The wire name prefix of the anchor on full-sync rounds.
pub const ANCHOR_PREFIX: &str = "anchor.";

/// The name under which a checkpoint keeps the payload error of `param` (beside the outer
/// momentum, in `outer.safetensors`).
pub fn payload_error_name(param: &str) -> String {
    format!("payload_error.{param}")
}

/// A neighbour's `lordo` payload, decoded (fp32, on the trainer's device).
pub struct DecodedLordo {
    /// Its pseudo-gradient as it sent it, `U_r·(Σ_r·V_rᵀ)` or whole, per parameter.
    pub pseudo_gradient: Vec<Tensor>,
    /// Its anchor, on a full-sync round.
    pub anchor: Option<Vec<Tensor>>,
}

/// One node's side of the `lordo` payload.
pub struct LordoWire {
    names: Vec<String>,
    shapes: Vec<Vec<i64>>,
    /// Per parameter, the rank of its factors when LoRDO projects it.
    ranks: Vec<Option<i64>>,
    full_sync_every: u64,
    /// `E`, one per parameter: what earlier payloads cut or rounded, sent in a later one.
    payload_error: Vec<Tensor>,
    /// The round of the payload last encoded and what its receivers decode: this node's own
    /// term of the round's mix.
    own: Option<(u64, Vec<Tensor>)>,
}

impl LordoWire {
    /// The payload of a model of `names` and `shapes`, whose projected matrices are
    /// `projected` (the LoRDO inner optimizer's), every `full_sync_every`-th round a full
    /// sync.
    pub fn new(
        names: &[String],
        shapes: &[Vec<i64>],
        projected: &[LowRankState],
        full_sync_every: u64,
        device: Device,
    ) -> Self {
        let ranks = names
            .iter()
            .map(|name| projected.iter().find(|s| s.name == *name).map(|s| s.rank()))
            .collect();
        let payload_error = shapes
            .iter()
            .map(|s| Tensor::zeros(s.as_slice(), (Kind::Float, device)))
            .collect();
        LordoWire {
            names: names.to_vec(),
            shapes: shapes.to_vec(),
            ranks,
            full_sync_every,
            payload_error,
            own: None,
        }
    }

    /// The tables of the payload: every round's, and the full-sync rounds' (with the anchor).
    pub fn tables(&self) -> PayloadTables {
        let mut every_round = Vec::new();
        for ((name, shape), rank) in self.names.iter().zip(&self.shapes).zip(&self.ranks) {
            match rank {
                Some(r) => {
                    let (u, svt) = factor_names(name);
                    every_round.push(tensor_spec(u, &[shape[0], *r], DType::Bf16));
                    every_round.push(tensor_spec(svt, &[*r, shape[1]], DType::Bf16));
                }
                None => every_round.push(tensor_spec(name.clone(), shape, DType::Bf16)),
            }
        }
        let mut full_sync = every_round.clone();
        for (name, shape) in self.names.iter().zip(&self.shapes) {
            full_sync.push(tensor_spec(
                format!("{ANCHOR_PREFIX}{name}"),
                shape,
                DType::Bf16,
            ));
        }
        PayloadTables {
            kind: PayloadKind::Lordo,
            by_fragment: vec![Arc::new(every_round)],
            full_sync: Some((self.full_sync_every, Arc::new(full_sync))),
        }
    }

    pub fn is_full_sync(&self, round: u64) -> bool {
        is_full_sync_round(round, self.full_sync_every)
    }

    /// Encodes round `round`'s payload: `A = (anchor − local) + E` as factors (updating `E`),
    /// and on a full-sync round the anchor; keeps what receivers decode as this node's own
    /// term.
    pub fn encode(
        &mut self,
        round: u64,
        anchor: &[Tensor],
        local: &[Tensor],
        projected: &[LowRankState],
    ) -> Result<TensorSet> {
        let _guard = tch::no_grad_guard();
        let pseudo: Vec<Tensor> = anchor.iter().zip(local).map(|(a, x)| a - x).collect();
        let payload = encode_lordo(&self.names, &pseudo, &mut self.payload_error, projected);
        let mut tensors = Vec::with_capacity(2 * self.names.len());
        for (name, part) in self.names.iter().zip(&payload.parts) {
            match part {
                LordoPart::Factors { left, right } => {
                    let (u, svt) = factor_names(name);
                    tensors.push(to_wire(u, left, Kind::BFloat16, DType::Bf16)?);
                    tensors.push(to_wire(svt, right, Kind::BFloat16, DType::Bf16)?);
                }
                LordoPart::Whole(t) => {
                    tensors.push(to_wire(name.clone(), t, Kind::BFloat16, DType::Bf16)?);
                }
            }
        }
        if self.is_full_sync(round) {
            for (name, a) in self.names.iter().zip(anchor) {
                tensors.push(to_wire(
                    format!("{ANCHOR_PREFIX}{name}"),
                    a,
                    Kind::BFloat16,
                    DType::Bf16,
                )?);
            }
        }
        self.own = Some((round, payload.decoded));
        Ok(TensorSet::new(tensors))
    }

    /// This node's own decoded payload of `round`, if it encoded one.
    pub fn own(&self, round: u64) -> Option<&[Tensor]> {
        match &self.own {
            Some((r, decoded)) if *r == round => Some(decoded),
            _ => None,
        }
    }

    /// Decodes a neighbour's payload of `round`, already checked against that round's table
    /// by the exchange (names, shapes and dtypes in table order); an error names the tensor.
    pub fn decode(&self, round: u64, set: &TensorSet, device: Device) -> Result<DecodedLordo> {
        let full_sync = self.is_full_sync(round);
        // One tensor per parameter, one more per factored matrix, the anchor on full sync.
        let factored = self.ranks.iter().filter(|r| r.is_some()).count();
        let expected = self.names.len() * (1 + usize::from(full_sync)) + factored;
        if set.tensors.len() != expected {
            bail!(
                "a lordo payload of {} tensors, not the {expected} of round {round}'s table",
                set.tensors.len()
            );
        }
        let mut wire = set.tensors.iter();
        let mut take = || wire.next().expect("the count is checked above");
        let mut pseudo_gradient = Vec::with_capacity(self.names.len());
        for (shape, rank) in self.shapes.iter().zip(&self.ranks) {
            pseudo_gradient.push(match rank {
                Some(r) => {
                    let left = from_wire(take(), &[shape[0], *r], device)?;
                    let right = from_wire(take(), &[*r, shape[1]], device)?;
                    left.matmul(&right)
                }
                None => from_wire(take(), shape, device)?,
            });
        }
        let anchor = match full_sync {
            true => Some(
                self.shapes
                    .iter()
                    .map(|shape| from_wire(take(), shape, device))
                    .collect::<Result<Vec<_>>>()?,
            ),
            false => None,
        };
        Ok(DecodedLordo {
            pseudo_gradient,
            anchor,
        })
    }

    /// The payload error `E`, named for a checkpoint.
    pub fn named_error(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .zip(&self.payload_error)
            .map(|(n, e)| (payload_error_name(n), e.detach().to_device(Device::Cpu)))
            .collect()
    }

    /// The payload error as targets to restore a checkpoint's into (same names).
    pub fn error_targets(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .zip(&self.payload_error)
            .map(|(n, e)| (payload_error_name(n), e.shallow_clone()))
            .collect()
    }
}
