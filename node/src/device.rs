//! Choosing the libtorch device from `--device auto|cpu|cuda|cuda:N`.

use anyhow::{bail, Result};
use tch::Device;

/// Parses a `--device` value and checks that the device exists.
///
/// `auto` is the first CUDA device when libtorch sees one, else the CPU.
pub fn parse_device(spec: &str) -> Result<Device> {
    let cuda_count = tch::Cuda::device_count();
    let device = match spec {
        "auto" => {
            return Ok(if cuda_count > 0 {
                Device::Cuda(0)
            } else {
                Device::Cpu
            })
        }
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(0),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(index)) => Device::Cuda(index),
            _ => bail!("--device {other:?} is not a device (expected auto, cpu, cuda or cuda:N)"),
        },
    };
    if let Device::Cuda(index) = device {
        if cuda_count == 0 {
            bail!("--device {spec}: CUDA was asked for, but libtorch sees no CUDA device here");
        }
        if index as i64 >= cuda_count {
            bail!("--device {spec}: there are only {cuda_count} CUDA device(s) (0..{cuda_count})");
        }
    }
    Ok(device)
}

/// A short name for logs and status: `cpu`, `cuda:0`.
pub fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(i) => format!("cuda:{i}"),
        _ => "cpu".to_string(),
    }
}
