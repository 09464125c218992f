//! Named, typed byte tensors: what the exchange and state-sync protocols move.
//!
//! The network never interprets tensor bytes; it checks names, dtypes, shapes, lengths and
//! checksums. Converting to and from libtorch tensors is the node's job.

use gasloc_proto::wire::DType;

/// One tensor as contiguous little-endian bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

impl Tensor {
    /// Whether a floating-point element is a NaN or an infinity (integers never are).
    pub fn holds_non_finite(&self) -> bool {
        match self.dtype {
            DType::F32 => self
                .data
                .chunks_exact(4)
                .any(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7f80_0000 == 0x7f80_0000),
            DType::Bf16 => self
                .data
                .chunks_exact(2)
                .any(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7f80 == 0x7f80),
            DType::F16 => self
                .data
                .chunks_exact(2)
                .any(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7c00 == 0x7c00),
            _ => false,
        }
    }

    /// Its elements as f32 when it is a floating-point tensor (fp32, bf16 and fp16 decoded
    /// from the raw little-endian bytes), `None` for an integer one.
    pub fn floats(&self) -> Option<Vec<f32>> {
        let values = match self.dtype {
            DType::F32 => self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            DType::Bf16 => self
                .data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::F16 => self
                .data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => return None,
        };
        Some(values)
    }

    /// `values` encoded in this tensor's floating-point dtype (rounded to nearest for bf16
    /// and fp16); `None` for an integer dtype.
    fn encode_floats(dtype: DType, values: &[f32]) -> Option<Vec<u8>> {
        let bytes = match dtype {
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::Bf16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            _ => return None,
        };
        Some(bytes)
    }

    /// A tensor whose byte length matches `shape` and `dtype`, or an error naming the mismatch.
    pub fn new(
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<u64>,
        data: Vec<u8>,
    ) -> Result<Self, String> {
        let name = name.into();
        let expected = TensorSpec::byte_length_of(dtype, &shape)
            .ok_or_else(|| format!("tensor {name}: shape {shape:?} overflows or dtype unset"))?;
        if expected != data.len() as u64 {
            return Err(format!(
                "tensor {name}: {} bytes but shape {shape:?} of {dtype:?} needs {expected}",
                data.len()
            ));
        }
        Ok(Tensor {
            name,
            dtype,
            shape,
            data,
        })
    }

    pub fn spec(&self) -> TensorSpec {
        TensorSpec {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
        }
    }
}

/// The name, dtype and shape a receiver expects for one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

impl TensorSpec {
    /// Bytes of a tensor of this dtype and shape; `None` on overflow or unknown dtype.
    pub fn byte_length_of(dtype: DType, shape: &[u64]) -> Option<u64> {
        shape
            .iter()
            .try_fold(dtype.size()?, |acc, &d| acc.checked_mul(d))
    }

    pub fn byte_length(&self) -> Option<u64> {
        Self::byte_length_of(self.dtype, &self.shape)
    }
}

/// An ordered set of tensors (a model state, a payload).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TensorSet {
    pub tensors: Vec<Tensor>,
}

impl TensorSet {
    pub fn new(tensors: Vec<Tensor>) -> Self {
        TensorSet { tensors }
    }

    /// The name of the first floating-point tensor holding a NaN or an infinity, read from
    /// the raw little-endian bytes (fp32, bf16, fp16: all exponent bits set).
    pub fn first_non_finite(&self) -> Option<&str> {
        self.tensors
            .iter()
            .find(|t| t.holds_non_finite())
            .map(|t| t.name.as_str())
    }

    /// The L2 norm over the floating-point tensors `part` picks, summed in f64.
    pub fn norm_where(&self, part: impl Fn(&Tensor) -> bool) -> f64 {
        self.tensors
            .iter()
            .filter(|t| part(t))
            .filter_map(Tensor::floats)
            .flatten()
            .map(|v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            .sqrt()
    }

    /// `‖self − other‖` over the floating-point tensors `part` picks; `None` when the two
    /// tables differ.
    pub fn distance_where(&self, other: &TensorSet, part: impl Fn(&Tensor) -> bool) -> Option<f64> {
        let squared: f64 = self
            .distances_by_tensor_where(other, part)?
            .iter()
            .map(|d| d * d)
            .sum();
        Some(squared.sqrt())
    }

    /// `‖self_k − other_k‖` of each floating-point tensor `part` picks, in order; `None` when
    /// the two tables differ.
    pub fn distances_by_tensor_where(
        &self,
        other: &TensorSet,
        part: impl Fn(&Tensor) -> bool,
    ) -> Option<Vec<f64>> {
        if self.specs() != other.specs() {
            return None;
        }
        let mut distances = Vec::new();
        for (a, b) in self
            .tensors
            .iter()
            .zip(&other.tensors)
            .filter(|(a, _)| part(a))
        {
            if let (Some(a), Some(b)) = (a.floats(), b.floats()) {
                let squared = a
                    .iter()
                    .zip(&b)
                    .map(|(x, y)| {
                        let d = f64::from(*x) - f64::from(*y);
                        d * d
                    })
                    .sum::<f64>();
                distances.push(squared.sqrt());
            }
        }
        Some(distances)
    }

    /// Multiplies the floating-point tensors `part` picks by `factor`, in their dtypes.
    pub fn scale_where(&mut self, factor: f64, part: impl Fn(&Tensor) -> bool) {
        for tensor in self.tensors.iter_mut().filter(|t| part(t)) {
            let Some(values) = tensor.floats() else {
                continue;
            };
            let scaled: Vec<f32> = values
                .iter()
                .map(|v| (f64::from(*v) * factor) as f32)
                .collect();
            if let Some(data) = Tensor::encode_floats(tensor.dtype, &scaled) {
                tensor.data = data;
            }
        }
    }

    /// The element-wise median of `sets` (the mean of the middle two for an even count), each
    /// floating-point tensor kept in its dtype; integer tensors are the first set's. `None`
    /// when `sets` is empty or the tables differ.
    pub fn median(sets: &[&TensorSet]) -> Option<TensorSet> {
        TensorSet::elementwise(sets, |column| {
            column.sort_by(f64::total_cmp);
            let n = column.len();
            if n % 2 == 1 {
                column[n / 2]
            } else {
                (column[n / 2 - 1] + column[n / 2]) / 2.0
            }
        })
    }

    /// The element-wise mean of `sets`, each floating-point tensor kept in its dtype
    /// (summed in f64); integer tensors are the first set's. `None` when `sets` is empty or
    /// the tables differ.
    pub fn mean(sets: &[&TensorSet]) -> Option<TensorSet> {
        TensorSet::elementwise(sets, |column| {
            column.iter().sum::<f64>() / column.len() as f64
        })
    }

    /// Each floating-point element of the result is `reduce` of that element across `sets`
    /// (in f64, in the sets' order), encoded in the tensor's dtype; integer tensors are the
    /// first set's. `None` when `sets` is empty or the tables differ.
    fn elementwise(
        sets: &[&TensorSet],
        mut reduce: impl FnMut(&mut [f64]) -> f64,
    ) -> Option<TensorSet> {
        let (first, rest) = sets.split_first()?;
        let table = first.specs();
        if rest.iter().any(|s| s.specs() != table) {
            return None;
        }
        let mut tensors = Vec::with_capacity(first.tensors.len());
        for (i, tensor) in first.tensors.iter().enumerate() {
            let Some(columns) = sets
                .iter()
                .map(|s| s.tensors[i].floats())
                .collect::<Option<Vec<Vec<f32>>>>()
            else {
                tensors.push(tensor.clone()); // an integer tensor
                continue;
            };
            let mut column = vec![0.0f64; sets.len()];
            let values: Vec<f32> = (0..columns[0].len())
                .map(|e| {
                    for (slot, values) in column.iter_mut().zip(&columns) {
                        *slot = f64::from(values[e]);
                    }
                    reduce(&mut column) as f32
                })
                .collect();
            tensors.push(Tensor {
                data: Tensor::encode_floats(tensor.dtype, &values)?,
                ..tensor.clone()
            });
        }
        Some(TensorSet::new(tensors))
    }

    /// The table a receiver of this set should expect.
    pub fn specs(&self) -> Vec<TensorSpec> {
        self.tensors.iter().map(Tensor::spec).collect()
    }

    /// Total payload bytes.
    pub fn byte_length(&self) -> u64 {
        self.tensors.iter().map(|t| t.data.len() as u64).sum()
    }

    /// Deterministic pseudo-random tensors (xorshift bytes) for tests and the synthetic
    /// trainer: `count` f32 tensors named `synthetic.<i>`, `bytes_each` bytes each
    /// (rounded down to a multiple of 4).
    pub fn synthetic(count: usize, bytes_each: usize, seed: u64) -> TensorSet {
        let elems = bytes_each / 4;
        let mut state = seed | 1;
        let tensors = (0..count)
            .map(|i| {
                let mut data = vec![0u8; elems * 4];
                for word in data.chunks_exact_mut(8) {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    word.copy_from_slice(&state.to_le_bytes());
                }
                let rest = data.len() / 8 * 8;
                for b in &mut data[rest..] {
                    *b = state as u8;
                }
                Tensor {
                    name: format!("synthetic.{i}"),
                    dtype: DType::F32,
                    shape: vec![elems as u64],
                    data,
                }
            })
            .collect();
        TensorSet { tensors }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_values_are_found_in_the_raw_bytes_of_every_float_dtype() {
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let tensor = |name: &str, dtype: DType, data: Vec<u8>| {
            let n = data.len() as u64 / dtype.size().unwrap();
            Tensor::new(name, dtype, vec![n], data).unwrap()
        };
        let good = tensor(
            "a",
            DType::F32,
            f32s(&[0.0, -1.5, f32::MAX, f32::MIN_POSITIVE]),
        );
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let set = TensorSet::new(vec![
                good.clone(),
                tensor("b", DType::F32, f32s(&[1.0, bad])),
            ]);
            assert_eq!(set.first_non_finite(), Some("b"), "{bad}");
        }
        assert_eq!(TensorSet::new(vec![good]).first_non_finite(), None);
        // bf16 is the top half of an f32; f16's exponent is 5 bits.
        let bf16 = |x: f32| ((x.to_bits() >> 16) as u16).to_le_bytes().to_vec();
        assert!(tensor("c", DType::Bf16, bf16(f32::NAN)).holds_non_finite());
        assert!(!tensor("c", DType::Bf16, bf16(3.0e38)).holds_non_finite());
        assert!(tensor("d", DType::F16, 0x7c00u16.to_le_bytes().to_vec()).holds_non_finite());
        assert!(!tensor("d", DType::F16, 0x7bffu16.to_le_bytes().to_vec()).holds_non_finite());
        assert!(!tensor("e", DType::U8, vec![0xff; 4]).holds_non_finite());
    }

    #[test]
    fn norms_distances_and_means_are_read_from_the_raw_bytes_of_every_float_dtype() {
        let set = |values: &[f32], dtype: DType| {
            let tensor = Tensor {
                name: "t".into(),
                dtype,
                shape: vec![values.len() as u64],
                data: Tensor::encode_floats(dtype, values).unwrap(),
            };
            let ints = Tensor::new("i", DType::U8, vec![2], vec![7, 9]).unwrap();
            TensorSet::new(vec![tensor, ints])
        };
        for dtype in [DType::F32, DType::Bf16, DType::F16] {
            let a = set(&[3.0, 4.0], dtype);
            let b = set(&[0.0, 0.0], dtype);
            assert_eq!(
                a.norm_where(|_| true),
                5.0,
                "{dtype:?}: integers do not count"
            );
            assert_eq!(a.distance_where(&b, |_| true), Some(5.0));
            let mean = TensorSet::mean(&[&a, &b, &set(&[3.0, 8.0], dtype)]).unwrap();
            assert_eq!(mean.tensors[0].floats().unwrap(), vec![2.0, 4.0]);
            assert_eq!(mean.tensors[0].dtype, dtype);
            assert_eq!(mean.tensors[1], a.tensors[1]);
            let median = TensorSet::median(&[&a, &b, &set(&[3.0, 8.0], dtype)]).unwrap();
            assert_eq!(median.tensors[0].floats().unwrap(), vec![3.0, 4.0]);
            let even = TensorSet::median(&[&a, &b]).unwrap();
            assert_eq!(even.tensors[0].floats().unwrap(), vec![1.5, 2.0]);
            let mut scaled = a.clone();
            scaled.scale_where(0.5, |t| t.name == "t");
            assert_eq!(scaled.tensors[0].floats().unwrap(), vec![1.5, 2.0]);
            assert_eq!(scaled.tensors[1], a.tensors[1], "integers stay");
        }
        let other = set(&[1.0, 2.0, 3.0], DType::F32);
        assert_eq!(
            set(&[1.0, 2.0], DType::F32).distance_where(&other, |_| true),
            None
        );
        assert!(TensorSet::mean(&[&set(&[1.0, 2.0], DType::F32), &other]).is_none());
        assert!(TensorSet::mean(&[]).is_none());
    }

    #[test]
    fn tensor_new_refuses_a_length_that_does_not_match_the_shape() {
        let err = Tensor::new("w", DType::F32, vec![2, 3], vec![0; 23]).unwrap_err();
        assert!(err.contains("needs 24"), "{err}");
        assert!(Tensor::new("w", DType::F32, vec![2, 3], vec![0; 24]).is_ok());
        assert!(TensorSpec::byte_length_of(DType::F32, &[u64::MAX, 2]).is_none());
    }

    #[test]
    fn synthetic_sets_are_deterministic_and_seed_dependent() {
        let a = TensorSet::synthetic(2, 1000, 7);
        assert_eq!(a, TensorSet::synthetic(2, 1000, 7));
        assert_ne!(a, TensorSet::synthetic(2, 1000, 8));
        assert_eq!(a.byte_length(), 2000);
    }
}
