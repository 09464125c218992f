//! The Llama-3-style decoder, whole, in one file.
//!
//! RMSNorm → grouped-query attention with RoPE (libtorch's scaled-dot-product attention,
//! causal) → RMSNorm → SwiGLU MLP, pre-norm residual blocks, no biases, optional tied
//! embeddings. Parameters are named exactly as Hugging Face's `LlamaForCausalLM` names them
//! (`model.layers.0.self_attn.q_proj.weight`, …) and RoPE rotates the two *halves* of each
//! head (HF's `rotate_half` layout), so a checkpoint is an HF checkpoint with no renaming or
//! permutation.
//!
//! Master weights are fp32. On CUDA with `cuda_compute = "bf16"` the forward casts each weight
//! to bf16 where it is used (what autocast does for matmuls); norms, softmax statistics
//! (inside SDPA) and the loss stay in fp32.

use gasloc_proto::manifest::{CudaCompute, ModelConfig};
use tch::nn::{self, Init};
use tch::{Device, Kind, Tensor};

/// One transformer block's weights.
#[derive(Debug)]
struct Block {
    input_norm: Tensor,
    q_proj: Tensor,
    k_proj: Tensor,
    v_proj: Tensor,
    o_proj: Tensor,
    post_attention_norm: Tensor,
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
}

/// The decoder. Its parameters live in the [`nn::VarStore`] it was built in.
#[derive(Debug)]
pub struct Llama {
    config: ModelConfig,
    embed_tokens: Tensor,
    layers: Vec<Block>,
    norm: Tensor,
    /// `None` when the embeddings are tied.
    lm_head: Option<Tensor>,
    /// The numeric type of matmuls (fp32, or bf16 on CUDA).
    compute: Kind,
    /// RoPE tables `[max_seq_len, head_dim]`, fp32, on the model's device.
    rope_cos: Tensor,
    rope_sin: Tensor,
}

impl Llama {
    /// Builds the model's parameters in `vs` (at its root), initialised from libtorch's
    /// RNG: call `tch::manual_seed` first for a reproducible init. Linear weights and
    /// embeddings are N(0, init_std²), the two residual projections (o_proj, down_proj)
    /// N(0, init_std² / (2·n_layers)), norm gains 1.
    pub fn new(vs: &nn::Path, config: &ModelConfig) -> Llama {
        let c = config;
        let d = c.d_model as i64;
        let kv = (c.n_kv_heads * c.head_dim()) as i64;
        let ffn = c.ffn_hidden as i64;
        let normal = Init::Randn {
            mean: 0.0,
            stdev: c.init_std,
        };
        let residual = Init::Randn {
            mean: 0.0,
            stdev: c.init_std / (2.0 * c.n_layers as f64).sqrt(),
        };
        let model = vs / "model";
        let embed_tokens =
            (&model / "embed_tokens").var("weight", &[c.vocab_size as i64, d], normal);
        let layers = (0..c.n_layers)
            .map(|i| {
                let layer = &model / "layers" / i;
                let attn = &layer / "self_attn";
                let mlp = &layer / "mlp";
                Block {
                    input_norm: (&layer / "input_layernorm").var("weight", &[d], Init::Const(1.0)),
                    q_proj: (&attn / "q_proj").var("weight", &[d, d], normal),
                    k_proj: (&attn / "k_proj").var("weight", &[kv, d], normal),
                    v_proj: (&attn / "v_proj").var("weight", &[kv, d], normal),
                    o_proj: (&attn / "o_proj").var("weight", &[d, d], residual),
                    post_attention_norm: (&layer / "post_attention_layernorm").var(
                        "weight",
                        &[d],
                        Init::Const(1.0),
                    ),
                    gate_proj: (&mlp / "gate_proj").var("weight", &[ffn, d], normal),
                    up_proj: (&mlp / "up_proj").var("weight", &[ffn, d], normal),
                    down_proj: (&mlp / "down_proj").var("weight", &[d, ffn], residual),
                }
            })
            .collect();
        let norm = (&model / "norm").var("weight", &[d], Init::Const(1.0));
        let lm_head = (!c.tie_embeddings)
            .then(|| (vs / "lm_head").var("weight", &[c.vocab_size as i64, d], normal));
        let compute = match (vs.device(), c.cuda_compute) {
            (Device::Cuda(_), CudaCompute::Bf16) => Kind::BFloat16,
            _ => Kind::Float,
        };
        let (rope_cos, rope_sin) = rope_tables(c, vs.device());
        Llama {
            config: c.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            compute,
            rope_cos,
            rope_sin,
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Logits `[batch, seq, vocab]` (fp32) for token ids `[batch, seq]` (int64).
    // `x = x + f(x)` must stay out of place: `+=` on a tch tensor is an in-place add that
    // would overwrite activations autograd saved for the backward pass.
    #[allow(clippy::assign_op_pattern)]
    pub fn forward(&self, tokens: &Tensor) -> Tensor {
        let seq = tokens.size()[1];
        let cos = self.rope_cos.narrow(0, 0, seq);
        let sin = self.rope_sin.narrow(0, 0, seq);
        let mut x =
            Tensor::embedding(&self.embed_tokens, tokens, -1, false, false).to_kind(self.compute);
        for block in &self.layers {
            let h = self.rms_norm(&x, &block.input_norm);
            x = x + self.attention(block, &h, &cos, &sin);
            let h = self.rms_norm(&x, &block.post_attention_norm);
            x = x + self.mlp(block, &h);
        }
        let x = self.rms_norm(&x, &self.norm);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        x.linear(&self.cast(head), None::<Tensor>)
            .to_kind(Kind::Float)
    }

    /// Mean next-token cross-entropy of `targets` `[batch, seq]` given `inputs` `[batch, seq]`.
    pub fn loss(&self, inputs: &Tensor, targets: &Tensor) -> Tensor {
        let logits = self.forward(inputs);
        let vocab = logits.size()[2];
        logits.view([-1, vocab]).cross_entropy_loss(
            &targets.view([-1]),
            None::<Tensor>,
            tch::Reduction::Mean,
            -100,
            0.0,
        )
    }

    /// A weight in the compute type (a no-op view in fp32).
    fn cast(&self, w: &Tensor) -> Tensor {
        if self.compute == Kind::Float {
            w.shallow_clone()
        } else {
            w.to_kind(self.compute)
        }
    }

    /// RMSNorm in fp32, as HF's `LlamaRMSNorm`: `w · x / sqrt(mean(x²) + eps)`.
    fn rms_norm(&self, x: &Tensor, weight: &Tensor) -> Tensor {
        let d = self.config.d_model as i64;
        if self.compute == Kind::Float {
            x.rms_norm([d], Some(weight), self.config.norm_eps)
        } else {
            x.to_kind(Kind::Float)
                .rms_norm([d], Some(weight), self.config.norm_eps)
                .to_kind(self.compute)
        }
    }

    fn attention(&self, b: &Block, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let (batch, seq) = (x.size()[0], x.size()[1]);
        let c = &self.config;
        let (heads, kv_heads, hd) = (c.n_heads as i64, c.n_kv_heads as i64, c.head_dim() as i64);
        let split = |w: &Tensor, n: i64| {
            x.linear(&self.cast(w), None::<Tensor>)
                .view([batch, seq, n, hd])
                .transpose(1, 2)
        };
        let q = apply_rope(&split(&b.q_proj, heads), cos, sin);
        let k = apply_rope(&split(&b.k_proj, kv_heads), cos, sin);
        let v = split(&b.v_proj, kv_heads);
        causal_attention(&q, &k, &v)
            .transpose(1, 2)
            .reshape([batch, seq, heads * hd])
            .linear(&self.cast(&b.o_proj), None::<Tensor>)
    }

    fn mlp(&self, b: &Block, x: &Tensor) -> Tensor {
        let gate = x.linear(&self.cast(&b.gate_proj), None::<Tensor>).silu();
        let up = x.linear(&self.cast(&b.up_proj), None::<Tensor>);
        (gate * up).linear(&self.cast(&b.down_proj), None::<Tensor>)
    }
}

/// Causal grouped-query attention through libtorch's fused scaled-dot-product kernel:
/// `q` is `[batch, heads, seq, head_dim]`, `k` and `v` `[batch, kv_heads, seq, head_dim]`
/// with `kv_heads` dividing `heads` (each kv head serves `heads / kv_heads` query heads).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let grouped = q.size()[1] != k.size()[1];
    Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, true, None, grouped)
}

/// RoPE tables as HF computes them: `inv_freq[i] = 1 / θ^(2i/hd)` in fp32, angles
/// `pos · inv_freq`, duplicated over both halves of the head.
pub fn rope_tables(c: &ModelConfig, device: Device) -> (Tensor, Tensor) {
    let hd = c.head_dim() as i64;
    let exponents = Tensor::arange_start_step(0, hd, 2, (Kind::Int64, Device::Cpu))
        .to_kind(Kind::Float)
        / hd as f64;
    let inv_freq = Tensor::from(c.rope_theta)
        .to_kind(Kind::Float)
        .pow(&exponents)
        .reciprocal();
    let positions = Tensor::arange(c.max_seq_len as i64, (Kind::Float, Device::Cpu));
    let angles = positions.outer(&inv_freq);
    let angles = Tensor::cat(&[&angles, &angles], -1);
    (
        angles.cos().to_device(device),
        angles.sin().to_device(device),
    )
}

/// Rotates `x` `[batch, heads, seq, head_dim]` by position: `x·cos + rotate_half(x)·sin`,
/// where `rotate_half([a, b]) = [−b, a]` over the two halves of the head.
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let first = x.narrow(3, 0, half);
    let second = x.narrow(3, half, half);
    let rotated = Tensor::cat(&[&(-second), &first], 3);
    let kind = x.kind();
    x * cos.to_kind(kind) + rotated * sin.to_kind(kind)
}
