//! libtorch tensors to and from the wire's named little-endian tensors
//! (`gasloc_p2p::tensors`): what the volunteer's payloads and the LoRDO payload
//! (`lordo_wire`) are made of.

use anyhow::{bail, Result};
use gasloc_p2p::tensors::{Tensor as WireTensor, TensorSpec};
use gasloc_proto::wire::DType;
use tch::{Device, Kind, Tensor};

/// A libtorch tensor as a named little-endian wire tensor of `dtype`.
///
/// The value type is converted where the tensor lives (on a GPU: there, so half the bytes
/// cross to the host and the CPU converts nothing), then copied out.
pub(crate) fn to_wire(name: String, t: &Tensor, kind: Kind, dtype: DType) -> Result<WireTensor> {
    let t = t.detach().to_kind(kind).to_device(Device::Cpu).contiguous();
    let numel = t.numel();
    let mut bytes = vec![0u8; numel * dtype.size().unwrap_or(4) as usize];
    t.f_copy_data_u8(&mut bytes, numel)?;
    let shape = t.size().iter().map(|&d| d as u64).collect();
    WireTensor::new(name, dtype, shape, bytes).map_err(anyhow::Error::msg)
}

/// A wire tensor (already checked against its table) as an fp32 tensor on `device`. The
/// wire's bytes go to the device as they are and are widened there (bf16 → fp32 is exact,
/// so where it happens changes no value; on a GPU half the bytes cross and the CPU converts
/// nothing).
pub(crate) fn from_wire(t: &WireTensor, shape: &[i64], device: Device) -> Result<Tensor> {
    let kind = match t.dtype {
        DType::F32 => Kind::Float,
        DType::Bf16 => Kind::BFloat16,
        other => bail!("tensor {}: dtype {other:?} is not a model payload", t.name),
    };
    Ok(Tensor::f_from_data_size(&t.data, shape, kind)?
        .to_device(device)
        .to_kind(Kind::Float))
}

/// The wire description of one libtorch tensor of `shape`.
pub(crate) fn tensor_spec(name: String, shape: &[i64], dtype: DType) -> TensorSpec {
    TensorSpec {
        name,
        dtype,
        shape: shape.iter().map(|&d| d as u64).collect(),
    }
}
