//! The run manifest: the TOML file that defines a training run.
//!
//! Every node of a run must hold the same manifest. A manifest is parsed, checked
//! (unknown keys and impossible values are errors that name the key), and *resolved*:
//! named model sizes are expanded and every default is filled in. The **run id** is the
//! SHA-256 of the resolved manifest's canonical bytes ([`RunManifest::canonical_bytes`]),
//! so comments, key order and spelled-out defaults do not change it.
//!
//! This module parses the file and resolves it ([`RunManifest::parse`]); `sections` holds
//! the typed sections and their defaults (re-exported here).

use crate::run_id::RunId;
use crate::topology::Topology;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::Path;

/// Why a manifest was refused. The message names the file and the key.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("cannot read run manifest {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("run manifest {path}: {message}")]
    Parse { path: String, message: String },
    #[error("run manifest {path}: {key} {message}")]
    Invalid {
        path: String,
        key: &'static str,
        message: String,
    },
}

mod sections;
pub use sections::*;

/// `[model]` as written in the file: a named size and/or explicit fields.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelSection {
    size: Option<String>,
    vocab_size: Option<usize>,
    d_model: Option<usize>,
    n_layers: Option<usize>,
    n_heads: Option<usize>,
    n_kv_heads: Option<usize>,
    ffn_hidden: Option<usize>,
    max_seq_len: Option<usize>,
    rope_theta: Option<f64>,
    norm_eps: Option<f64>,
    tie_embeddings: Option<bool>,
    init_std: Option<f64>,
    cuda_compute: Option<CudaCompute>,
}

/// Llama's MLP width: 8/3·d rounded up to a multiple of 256 (of 32 for small widths).
fn llama_ffn_hidden(d_model: usize) -> usize {
    let multiple = if d_model >= 256 { 256 } else { 32 };
    (8 * d_model / 3).div_ceil(multiple) * multiple
}

/// `[outer]` as written: every key optional, defaults depend on the algorithm.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct OuterSection {
    algorithm: Option<Algorithm>,
    topology: Option<Topology>,
    inner_steps: Option<u64>,
    adaptive_inner_steps: Option<bool>,
    min_inner_steps: Option<u64>,
    max_inner_steps: Option<u64>,
    lr: Option<f64>,
    momentum: Option<f64>,
    nesterov: Option<bool>,
    payload: Option<Payload>,
    inner_optimizer: Option<InnerOptimizerKind>,
    overlap: Option<Overlap>,
    fragments: Option<usize>,
}

/// Resolves `[outer]`: the algorithm fixes what it implies, and contradicting it is an error.
fn resolve_outer(s: &OuterSection) -> Result<OuterConfig, (&'static str, String)> {
    let algorithm = s.algorithm.unwrap_or(Algorithm::Gasloc);
    let a = algorithm.name();
    let fixed_topology = matches!(algorithm, Algorithm::Diloco | Algorithm::Ddp);
    let topology = match (fixed_topology, s.topology) {
        (true, Some(t)) if t != Topology::Complete => {
            return Err((
                "outer.topology",
                format!(
                    "= {:?} contradicts algorithm {a:?} (always complete)",
                    t.name()
                ),
            ))
        }
        (true, _) => Topology::Complete,
        (false, t) => t.unwrap_or(Topology::OnePeer),
    };
    let payload = s.payload.unwrap_or(Payload::ModelFp32);
    let inner_optimizer = s.inner_optimizer.unwrap_or(InnerOptimizerKind::Adamw);
    let overlap = s
        .overlap
        .unwrap_or(Overlap::default_for(algorithm, inner_optimizer));
    // (LoRDO refreshes its bases from the whole model's pseudo-gradient: one fragment.)
    let fragments = s.fragments.unwrap_or(
        if overlap == Overlap::Delayed && inner_optimizer == InnerOptimizerKind::Adamw {
            DELAYED_FRAGMENTS
        } else {
            1
        },
    );
    let one_step = matches!(algorithm, Algorithm::Dadam | Algorithm::Ddp);
    let inner_steps = match (one_step, s.inner_steps) {
        (true, Some(h)) if h != 1 => {
            return Err((
                "outer.inner_steps",
                format!("= {h} contradicts algorithm {a:?} (one inner step per round)"),
            ))
        }
        (true, _) => 1,
        // H = 30 steps between two syncs of each fragment: 30 / P steps a round.
        // (`fragments = 0` is refused below, by name.)
        (false, h) => h.unwrap_or(30u64.div_ceil(fragments.max(1) as u64)),
    };
    let plain_averaging = matches!(algorithm, Algorithm::LocalDadam | Algorithm::Dadam);
    let (lr, momentum) = if plain_averaging {
        if s.lr.is_some_and(|v| v != 1.0) {
            return Err(("outer.lr", format!("must be 1 for algorithm {a:?}")));
        }
        if s.momentum.is_some_and(|v| v != 0.0) {
            return Err(("outer.momentum", format!("must be 0 for algorithm {a:?}")));
        }
        (1.0, 0.0)
    } else {
        let momentum = if overlap == Overlap::Delayed {
            0.8
        } else {
            0.9
        };
        (s.lr.unwrap_or(0.7), s.momentum.unwrap_or(momentum))
    };
    Ok(OuterConfig {
        algorithm,
        topology,
        inner_steps,
        adaptive_inner_steps: s.adaptive_inner_steps.unwrap_or(false),
        min_inner_steps: s.min_inner_steps.unwrap_or(1),
        max_inner_steps: s.max_inner_steps.unwrap_or(2 * inner_steps),
        lr,
        momentum,
        nesterov: s.nesterov.unwrap_or(true),
        payload,
        inner_optimizer,
        overlap,
        fragments,
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ManifestFile {
    name: String,
    seed: u64,
    #[serde(default)]
    model: ModelSection,
    data: DataConfig,
    optimizer: OptimizerConfig,
    #[serde(default)]
    eval: EvalConfig,
    #[serde(default)]
    outer: OuterSection,
    #[serde(default)]
    lordo: LordoConfig,
    #[serde(default)]
    gate: GateConfig,
    #[serde(default)]
    access: AccessConfig,
}

/// A resolved, validated run manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunManifest {
    pub name: String,
    pub seed: u64,
    pub model: ModelConfig,
    pub data: DataConfig,
    pub optimizer: OptimizerConfig,
    pub eval: EvalConfig,
    pub outer: OuterConfig,
    pub lordo: LordoConfig,
    pub gate: GateConfig,
    /// Left out of the canonical bytes of an open run (so open runs' ids do not depend on it).
    #[serde(default, skip_serializing_if = "AccessConfig::is_open")]
    pub access: AccessConfig,
}

impl RunManifest {
    /// Reads, parses and validates a manifest file.
    pub fn load(path: &Path) -> Result<Self, ManifestError> {
        let text = std::fs::read_to_string(path).map_err(|source| ManifestError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates manifest text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ManifestError> {
        let file: ManifestFile = toml::from_str(text).map_err(|e| ManifestError::Parse {
            path: origin.to_string(),
            message: e.to_string().trim_end().to_string(),
        })?;
        let invalid = |key: &'static str, message: String| ManifestError::Invalid {
            path: origin.to_string(),
            key,
            message,
        };
        let model = resolve_model(&file.model, &file.data).map_err(|(k, m)| invalid(k, m))?;
        let outer = resolve_outer(&file.outer).map_err(|(k, m)| invalid(k, m))?;
        let manifest = RunManifest {
            name: file.name,
            seed: file.seed,
            model,
            data: file.data,
            optimizer: file.optimizer,
            eval: file.eval,
            outer,
            lordo: file.lordo,
            gate: file.gate,
            access: file.access,
        };
        manifest.validate().map_err(|(k, m)| invalid(k, m))?;
        Ok(manifest)
    }

    /// The canonical bytes: the resolved manifest written back as TOML, every key
    /// present, in the declaration order of these structs.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        toml::to_string(self)
            .expect("a resolved manifest always serializes")
            .into_bytes()
    }

    /// The run id: the SHA-256 of [`Self::canonical_bytes`] (shown as 64 lowercase hex
    /// digits).
    pub fn run_id(&self) -> RunId {
        RunId::from_bytes(Sha256::digest(self.canonical_bytes()).into())
    }

    fn validate(&self) -> Result<(), (&'static str, String)> {
        let m = &self.model;
        let d = &self.data;
        let o = &self.optimizer;
        let positive = [
            ("model.vocab_size", m.vocab_size),
            ("model.d_model", m.d_model),
            ("model.n_layers", m.n_layers),
            ("model.n_heads", m.n_heads),
            ("model.n_kv_heads", m.n_kv_heads),
            ("model.ffn_hidden", m.ffn_hidden),
            ("model.max_seq_len", m.max_seq_len),
            ("data.seq_len", d.seq_len),
            ("data.micro_batch", d.micro_batch),
            ("data.grad_accum", d.grad_accum),
            ("eval.batches", self.eval.batches),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err((key, "must be at least 1".into()));
            }
        }
        if !m.d_model.is_multiple_of(m.n_heads) {
            return Err((
                "model.n_heads",
                format!(
                    "= {} does not divide model.d_model = {}",
                    m.n_heads, m.d_model
                ),
            ));
        }
        if !m.head_dim().is_multiple_of(2) {
            return Err((
                "model.n_heads",
                format!(
                    "gives an odd head dimension {} (RoPE needs it even)",
                    m.head_dim()
                ),
            ));
        }
        if !m.n_heads.is_multiple_of(m.n_kv_heads) {
            return Err((
                "model.n_kv_heads",
                format!(
                    "= {} does not divide model.n_heads = {}",
                    m.n_kv_heads, m.n_heads
                ),
            ));
        }
        if m.vocab_size < d.tokenizer.vocab_size() {
            return Err((
                "model.vocab_size",
                format!(
                    "= {} is smaller than the {} tokenizer's {} tokens",
                    m.vocab_size,
                    d.tokenizer.name(),
                    d.tokenizer.vocab_size()
                ),
            ));
        }
        if d.seq_len > m.max_seq_len {
            return Err((
                "data.seq_len",
                format!(
                    "= {} exceeds model.max_seq_len = {}",
                    d.seq_len, m.max_seq_len
                ),
            ));
        }
        let finite_positive = [
            ("model.rope_theta", m.rope_theta),
            ("model.norm_eps", m.norm_eps),
            ("model.init_std", m.init_std),
            ("optimizer.lr", o.lr),
            ("optimizer.eps", o.eps),
        ];
        for (key, value) in finite_positive {
            if !(value.is_finite() && value > 0.0) {
                return Err((key, format!("= {value} must be a positive number")));
            }
        }
        let unit = [
            ("optimizer.beta1", o.beta1),
            ("optimizer.beta2", o.beta2),
            ("optimizer.min_lr_ratio", o.min_lr_ratio),
        ];
        for (key, value) in unit {
            if !(0.0..=1.0).contains(&value) || (key != "optimizer.min_lr_ratio" && value == 1.0) {
                return Err((key, format!("= {value} must lie in [0, 1)")));
            }
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            return Err((
                "optimizer.weight_decay",
                format!("= {} must be ≥ 0", o.weight_decay),
            ));
        }
        if !(o.grad_clip.is_finite() && o.grad_clip >= 0.0) {
            return Err((
                "optimizer.grad_clip",
                format!("= {} must be ≥ 0", o.grad_clip),
            ));
        }
        if o.decay_steps == 0 || o.warmup_steps > o.decay_steps {
            return Err((
                "optimizer.decay_steps",
                format!(
                    "= {} must be ≥ 1 and ≥ optimizer.warmup_steps = {}",
                    o.decay_steps, o.warmup_steps
                ),
            ));
        }
        if self.eval.interval == 0 {
            return Err(("eval.interval", "must be at least 1".into()));
        }
        self.validate_outer()?;
        self.validate_gate()?;
        self.validate_access()?;
        self.validate_shards()
    }

    /// The shard table: safe, unique file names whose split matches the loader's naming
    /// rule, sizes within bounds, hex digests, both splits present; mirrors are http(s).
    fn validate_shards(&self) -> Result<(), (&'static str, String)> {
        let d = &self.data;
        for mirror in &d.mirrors {
            let rest = mirror
                .strip_prefix("http://")
                .or_else(|| mirror.strip_prefix("https://"));
            if rest.is_none_or(|r| r.is_empty() || r.contains(char::is_whitespace)) {
                return Err((
                    "data.mirrors",
                    format!("{mirror:?} is not an http:// or https:// address"),
                ));
            }
        }
        if d.shards.is_empty() {
            return Ok(());
        }
        let mut seen = std::collections::HashSet::new();
        for shard in &d.shards {
            let name = &shard.name;
            let safe = |c: char| c.is_ascii_alphanumeric() || "._-".contains(c);
            if name.len() > 200
                || !name.ends_with(".bin")
                || name.starts_with('.')
                || !name.chars().all(safe)
            {
                return Err((
                    "data.shards",
                    format!(
                        "name {name:?} is not a shard file name (letters, digits, . _ -; \
                         ending in .bin; at most 200 characters)"
                    ),
                ));
            }
            if !seen.insert(name) {
                return Err(("data.shards", format!("{name} is listed twice")));
            }
            if shard.split != Split::of_file_name(name) {
                return Err((
                    "data.shards",
                    format!(
                        "{name} is marked {} but its name puts it in the other split \
                         (validation shards are named *_val_*.bin)",
                        shard.split.name()
                    ),
                ));
            }
            if shard.bytes > MAX_SHARD_BYTES || shard.tokens == 0 || shard.bytes <= shard.tokens {
                return Err((
                    "data.shards",
                    format!(
                        "{name}: {} bytes for {} tokens is not a possible shard \
                         (at least one token, at most {MAX_SHARD_BYTES} bytes)",
                        shard.bytes, shard.tokens
                    ),
                ));
            }
            let hex_digest = shard.sha256.len() == 64
                && shard
                    .sha256
                    .chars()
                    .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c));
            if !hex_digest {
                return Err((
                    "data.shards",
                    format!(
                        "{name}: sha256 {:?} is not 64 lowercase hex digits",
                        shard.sha256
                    ),
                ));
            }
        }
        for split in [Split::Train, Split::Val] {
            if !d.shards.iter().any(|s| s.split == split) {
                return Err((
                    "data.shards",
                    format!(
                        "pins no {} shard (a pinned run needs both splits)",
                        split.name()
                    ),
                ));
            }
        }
        Ok(())
    }

    fn validate_access(&self) -> Result<(), (&'static str, String)> {
        let base58 = |c: char| c.is_ascii_alphanumeric() && !"0OIl".contains(c);
        let mut seen = std::collections::HashSet::new();
        for peer in &self.access.peers {
            if !(32..=128).contains(&peer.len()) || !peer.chars().all(base58) {
                return Err((
                    "access.peers",
                    format!("{peer:?} is not a peer id (base58, as gasloc-node prints it)"),
                ));
            }
            if !seen.insert(peer) {
                return Err(("access.peers", format!("{peer} is listed twice")));
            }
        }
        Ok(())
    }

    fn validate_gate(&self) -> Result<(), (&'static str, String)> {
        let g = &self.gate;
        if !(g.max_distance_ratio.is_finite() && g.max_distance_ratio >= 1.0) {
            return Err((
                "gate.max_distance_ratio",
                format!("= {} must be a number ≥ 1", g.max_distance_ratio),
            ));
        }
        if g.median_window == 0 {
            return Err(("gate.median_window", "must be at least 1".into()));
        }
        if !(-1.0..=1.0).contains(&g.min_cosine) {
            return Err((
                "gate.min_cosine",
                format!("= {} must lie in [-1, 1] (-1: off)", g.min_cosine),
            ));
        }
        if !(g.max_state_disagreement > 0.0 && g.max_state_disagreement <= 10.0) {
            return Err((
                "gate.max_state_disagreement",
                format!("= {} must lie in (0, 10]", g.max_state_disagreement),
            ));
        }
        if g.ban_window_rounds == 0 {
            return Err(("gate.ban_window_rounds", "must be at least 1".into()));
        }
        if g.max_loss_increase.is_nan() || g.max_loss_increase < 0.0 {
            return Err((
                "gate.max_loss_increase",
                format!(
                    "= {} must be a number ≥ 0 (nats; inf: off)",
                    g.max_loss_increase
                ),
            ));
        }
        if g.check_tokens > MAX_CHECK_TOKENS {
            return Err((
                "gate.check_tokens",
                format!(
                    "= {} must be at most {MAX_CHECK_TOKENS} (0: off)",
                    g.check_tokens
                ),
            ));
        }
        Ok(())
    }

    fn validate_outer(&self) -> Result<(), (&'static str, String)> {
        let u = &self.outer;
        let l = &self.lordo;
        if u.inner_steps == 0 {
            return Err(("outer.inner_steps", "must be at least 1".into()));
        }
        if u.min_inner_steps == 0 || u.min_inner_steps > u.inner_steps {
            return Err((
                "outer.min_inner_steps",
                format!(
                    "= {} must lie in [1, outer.inner_steps = {}]",
                    u.min_inner_steps, u.inner_steps
                ),
            ));
        }
        if u.max_inner_steps < u.inner_steps {
            return Err((
                "outer.max_inner_steps",
                format!(
                    "= {} must be ≥ outer.inner_steps = {}",
                    u.max_inner_steps, u.inner_steps
                ),
            ));
        }
        if !(u.lr.is_finite() && u.lr > 0.0) {
            return Err(("outer.lr", format!("= {} must be a positive number", u.lr)));
        }
        if !(0.0..1.0).contains(&u.momentum) {
            return Err((
                "outer.momentum",
                format!("= {} must lie in [0, 1)", u.momentum),
            ));
        }
        if u.payload == Payload::Lordo && u.inner_optimizer != InnerOptimizerKind::Lordo {
            return Err((
                "outer.payload",
                "= \"lordo\" needs outer.inner_optimizer = \"lordo\" (its basis)".into(),
            ));
        }
        if u.algorithm == Algorithm::Ddp && u.payload == Payload::Lordo {
            return Err((
                "outer.payload",
                "= \"lordo\" does not apply to algorithm \"ddp\" (it averages gradients)".into(),
            ));
        }
        if u.algorithm == Algorithm::Ddp && u.overlap != Overlap::None {
            return Err((
                "outer.overlap",
                format!(
                    "= {:?} does not apply to algorithm \"ddp\" (it averages gradients every step)",
                    u.overlap.name()
                ),
            ));
        }
        if u.payload == Payload::Lordo && u.overlap != Overlap::None {
            return Err((
                "outer.overlap",
                format!(
                    "= {:?} is not supported with payload \"lordo\" (its basis refresh needs the round's mix before the next inner step)",
                    u.overlap.name()
                ),
            ));
        }
        if u.fragments == 0 || u.fragments > MAX_FRAGMENTS {
            return Err((
                "outer.fragments",
                format!("= {} must lie in [1, {MAX_FRAGMENTS}]", u.fragments),
            ));
        }
        if u.fragments > 1 && u.algorithm == Algorithm::Ddp {
            return Err((
                "outer.fragments",
                "does not apply to algorithm \"ddp\" (it averages gradients every step)".into(),
            ));
        }
        if u.fragments > 1 && u.inner_optimizer == InnerOptimizerKind::Lordo {
            return Err((
                "outer.fragments",
                "is not supported with inner_optimizer \"lordo\" (its bases are refreshed from the whole model's pseudo-gradient)".into(),
            ));
        }
        if l.rank == 0 {
            return Err(("lordo.rank", "must be at least 1".into()));
        }
        if !(l.omega > 0.0 && l.omega <= 1.0) {
            return Err(("lordo.omega", format!("= {} must lie in (0, 1]", l.omega)));
        }
        if l.full_sync_every == 0 {
            return Err(("lordo.full_sync_every", "must be at least 1".into()));
        }
        if !(l.switch_fraction > 0.0 && l.switch_fraction < 1.0) {
            return Err((
                "lordo.switch_fraction",
                format!("= {} must lie in (0, 1)", l.switch_fraction),
            ));
        }
        Ok(())
    }
}

/// Expands `[model]`: a named size gives the shape, explicit keys override it.
fn resolve_model(
    s: &ModelSection,
    data: &DataConfig,
) -> Result<ModelConfig, (&'static str, String)> {
    // (d_model, n_layers, n_heads, n_kv_heads, tie_embeddings)
    let preset = match s.size.as_deref() {
        None => None,
        Some("tiny") => Some((64, 2, 4, 2, false)),
        Some("16m") => Some((256, 4, 4, 4, true)),
        Some("125m") => Some((768, 12, 12, 12, true)),
        Some(other) => {
            return Err((
                "model.size",
                format!("= {other:?} is not a known size (tiny, 16m, 125m)"),
            ))
        }
    };
    let need = |v: Option<usize>, p: Option<usize>, key: &'static str| {
        v.or(p)
            .ok_or((key, "is required when model.size is not given".to_string()))
    };
    let d_model = need(s.d_model, preset.map(|p| p.0), "model.d_model")?;
    let n_layers = need(s.n_layers, preset.map(|p| p.1), "model.n_layers")?;
    let n_heads = need(s.n_heads, preset.map(|p| p.2), "model.n_heads")?;
    let n_kv_heads = s.n_kv_heads.or(preset.map(|p| p.3)).unwrap_or(n_heads);
    Ok(ModelConfig {
        vocab_size: s
            .vocab_size
            .unwrap_or_else(|| data.tokenizer.padded_vocab_size()),
        d_model,
        n_layers,
        n_heads,
        n_kv_heads,
        ffn_hidden: s.ffn_hidden.unwrap_or_else(|| llama_ffn_hidden(d_model)),
        max_seq_len: s.max_seq_len.unwrap_or(data.seq_len.max(1024)),
        rope_theta: s.rope_theta.unwrap_or(500_000.0),
        norm_eps: s.norm_eps.unwrap_or(1e-5),
        tie_embeddings: s.tie_embeddings.or(preset.map(|p| p.4)).unwrap_or(false),
        init_std: s.init_std.unwrap_or(0.02),
        cuda_compute: s.cuda_compute.unwrap_or(CudaCompute::Bf16),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const TINY: &str = r#"
name = "t"
seed = 1
[model]
size = "tiny"
[data]
tokenizer = "byte"
seq_len = 64
micro_batch = 4
[optimizer]
decay_steps = 100
"#;

    #[test]
    fn presets_resolve_to_the_named_shapes() {
        let m = RunManifest::parse(TINY, "t").unwrap();
        assert_eq!(
            (m.model.d_model, m.model.n_layers, m.model.vocab_size),
            (64, 2, 256)
        );
        let big = TINY
            .replace("\"tiny\"", "\"125m\"")
            .replace("\"byte\"", "\"gpt2\"");
        let m = RunManifest::parse(&big, "t").unwrap();
        assert_eq!(
            (m.model.d_model, m.model.n_layers, m.model.n_heads),
            (768, 12, 12)
        );
        assert_eq!((m.model.vocab_size, m.model.ffn_hidden), (50304, 2048));
        let p = m.model.parameter_count();
        assert!((120_000_000..130_000_000).contains(&p), "{p}");
    }

    #[test]
    fn run_id_ignores_comments_and_spelled_out_defaults() {
        let a = RunManifest::parse(TINY, "a").unwrap();
        let b = RunManifest::parse(
            &format!(
                "# a comment\n{}",
                TINY.replace("decay_steps = 100", "decay_steps = 100\nlr = 4e-4")
            ),
            "b",
        )
        .unwrap();
        assert_eq!(a.run_id(), b.run_id());
        let c = RunManifest::parse(&TINY.replace("seed = 1", "seed = 2"), "c").unwrap();
        assert_ne!(a.run_id(), c.run_id());
        assert_eq!(a.run_id().to_string().len(), 64);
        // The overlap default spelled out is the same run; blocking rounds are another.
        let outer = |lines: &str| RunManifest::parse(&format!("{TINY}[outer]\n{lines}\n"), "o");
        let spelled =
            outer("overlap = \"delayed\"\nfragments = 5\ninner_steps = 6\nmomentum = 0.8");
        assert_eq!(a.run_id(), spelled.unwrap().run_id());
        assert_ne!(a.run_id(), outer("overlap = \"none\"").unwrap().run_id());
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_key() {
        let e = RunManifest::parse(&TINY.replace("seq_len", "seq_length"), "x.toml").unwrap_err();
        assert!(e.to_string().contains("seq_length"), "{e}");
        let e = RunManifest::parse(
            &TINY.replace("size = \"tiny\"", "size = \"tiny\"\nn_heads = 3"),
            "x",
        )
        .unwrap_err();
        assert!(e.to_string().contains("model.n_heads"), "{e}");
        let e = RunManifest::parse(&TINY.replace("micro_batch = 4", "micro_batch = 0"), "x")
            .unwrap_err();
        assert!(e.to_string().contains("data.micro_batch"), "{e}");
        let e = RunManifest::parse(&TINY.replace("\"tiny\"", "\"huge\""), "x").unwrap_err();
        assert!(e.to_string().contains("model.size"), "{e}");
    }

    #[test]
    fn outer_defaults_follow_the_algorithm() {
        let m = RunManifest::parse(TINY, "t").unwrap();
        let o = &m.outer;
        assert_eq!(
            (o.algorithm, o.topology),
            (Algorithm::Gasloc, Topology::OnePeer)
        );
        // GASLoC overlaps its exchange by default: delayed, in five fragments, six steps a
        // round (each fragment synced every 30), outer momentum 0.8.
        assert_eq!((o.overlap, o.fragments), (Overlap::Delayed, 5));
        assert_eq!(
            (o.inner_steps, o.min_inner_steps, o.max_inner_steps),
            (6, 1, 12)
        );
        assert_eq!((o.lr, o.momentum, o.nesterov), (0.7, 0.8, true));
        assert_eq!(o.payload, Payload::ModelFp32);
        let with = |outer: &str| RunManifest::parse(&format!("{TINY}[outer]\n{outer}\n"), "x");
        // Blocking rounds, asked for: the whole model, 30 steps, momentum 0.9.
        let b = with("overlap = \"none\"").unwrap().outer;
        assert_eq!((b.fragments, b.inner_steps, b.momentum), (1, 30, 0.9));
        let e = with("overlap = \"eager\"").unwrap().outer;
        assert_eq!((e.fragments, e.inner_steps, e.momentum), (1, 30, 0.9));
        // What is written wins over the mode's defaults.
        let w = with("fragments = 3\nmomentum = 0.9").unwrap().outer;
        assert_eq!(
            (w.overlap, w.fragments, w.inner_steps, w.momentum),
            (Overlap::Delayed, 3, 10, 0.9)
        );
        let d = with("algorithm = \"diloco\"\ninner_steps = 50")
            .unwrap()
            .outer;
        assert_eq!((d.topology, d.inner_steps), (Topology::Complete, 50));
        // DiLoCo stays the blocking baseline; LoRDO needs each round's mix.
        let d = with("algorithm = \"diloco\"").unwrap().outer;
        assert_eq!(
            (d.overlap, d.fragments, d.inner_steps, d.momentum),
            (Overlap::None, 1, 30, 0.9)
        );
        let l = with("inner_optimizer = \"lordo\"").unwrap().outer;
        assert_eq!(
            (l.overlap, l.fragments, l.inner_steps),
            (Overlap::None, 1, 30)
        );
        let d = with("algorithm = \"dadam\"\ntopology = \"ring\"")
            .unwrap()
            .outer;
        assert_eq!((d.inner_steps, d.lr, d.momentum), (1, 1.0, 0.0));
        assert_eq!(d.topology, Topology::Ring);
        let d = with("algorithm = \"ddp\"").unwrap().outer;
        assert_eq!((d.inner_steps, d.topology), (1, Topology::Complete));
    }

    #[test]
    fn outer_contradictions_and_bad_values_name_the_key() {
        let with = |outer: &str| {
            RunManifest::parse(&format!("{TINY}[outer]\n{outer}\n"), "x")
                .unwrap_err()
                .to_string()
        };
        let cases = [
            (
                "algorithm = \"diloco\"\ntopology = \"one-peer\"",
                "outer.topology",
            ),
            (
                "algorithm = \"dadam\"\ninner_steps = 5",
                "outer.inner_steps",
            ),
            ("algorithm = \"local-dadam\"\nlr = 0.7", "outer.lr"),
            (
                "algorithm = \"local-dadam\"\nmomentum = 0.9",
                "outer.momentum",
            ),
            ("algorithm = \"gossip\"", "algorithm"),
            ("topology = \"star\"", "topology"),
            ("inner_steps = 0", "outer.inner_steps"),
            (
                "inner_steps = 10\nmin_inner_steps = 11",
                "outer.min_inner_steps",
            ),
            (
                "inner_steps = 10\nmax_inner_steps = 9",
                "outer.max_inner_steps",
            ),
            ("momentum = 1.0", "outer.momentum"),
            ("lr = -1.0", "outer.lr"),
            ("payload = \"lordo\"", "outer.payload"),
            ("inner_step = 3", "inner_step"),
            ("overlap = \"always\"", "overlap"),
            (
                "algorithm = \"ddp\"\noverlap = \"delayed\"",
                "outer.overlap",
            ),
            (
                "inner_optimizer = \"lordo\"\npayload = \"lordo\"\noverlap = \"eager\"",
                "outer.overlap",
            ),
            ("fragments = 0", "outer.fragments"),
            ("fragments = 65", "outer.fragments"),
            ("algorithm = \"ddp\"\nfragments = 2", "outer.fragments"),
            (
                "inner_optimizer = \"lordo\"\nfragments = 2",
                "outer.fragments",
            ),
        ];
        for (outer, key) in cases {
            let e = with(outer);
            assert!(e.contains(key), "{outer}: {e}");
        }
        let lordo = |body: &str| {
            RunManifest::parse(&format!("{TINY}[lordo]\n{body}\n"), "x")
                .unwrap_err()
                .to_string()
        };
        assert!(lordo("rank = 0").contains("lordo.rank"));
        assert!(lordo("omega = 0.0").contains("lordo.omega"));
        assert!(lordo("omega = 1.5").contains("lordo.omega"));
        assert!(lordo("full_sync_every = 0").contains("lordo.full_sync_every"));
        assert!(lordo("switch_fraction = 1.0").contains("lordo.switch_fraction"));
        assert!(lordo("regime = \"warm\"").contains("regime"));
        assert!(lordo("full_rank_term = \"error\"").contains("full_rank_term"));
    }

    #[test]
    fn lordo_forms_and_regime_are_in_the_run_id_only_when_chosen() {
        let plain = RunManifest::parse(TINY, "a").unwrap();
        let spelled = RunManifest::parse(
            &format!(
                "{TINY}[lordo]\nfull_rank_term = \"gradient-and-error\"\nregime = \"constant\"\n"
            ),
            "b",
        )
        .unwrap();
        assert_eq!(plain.run_id(), spelled.run_id());
        let paper = RunManifest::parse(
            &format!("{TINY}[lordo]\nfull_rank_term = \"gradient\"\n"),
            "c",
        )
        .unwrap();
        let authors =
            RunManifest::parse(&format!("{TINY}[lordo]\nregime = \"authors\"\n"), "d").unwrap();
        assert_eq!(paper.lordo.full_rank_term, FullRankTerm::Gradient);
        assert_eq!(authors.lordo.regime, LordoRegime::Authors);
        assert!((authors.lordo.switch_fraction - 1.0 / 6.0).abs() < 1e-12);
        assert_ne!(plain.run_id(), paper.run_id());
        assert_ne!(plain.run_id(), authors.run_id());
        assert_ne!(paper.run_id(), authors.run_id());
    }

    #[test]
    fn overlap_and_fragments_are_in_the_run_id_and_the_canonical_text_round_trips() {
        // Both are always written: left out of a manifest, overlap means the default for
        // the algorithm (delayed for gasloc) and fragments the default for the overlap, so
        // the canonical text must name them for a reader (a served manifest, a checkpoint's)
        // to resolve the same run.
        let outer = |lines: &str| RunManifest::parse(&format!("{TINY}[outer]\n{lines}\n"), "x");
        let mut ids = Vec::new();
        for lines in [
            "overlap = \"none\"",
            "overlap = \"none\"\nfragments = 3",
            "overlap = \"delayed\"",
            "overlap = \"delayed\"\nfragments = 1",
            "overlap = \"eager\"",
            "algorithm = \"diloco\"",
            "inner_optimizer = \"lordo\"",
        ] {
            let m = outer(lines).unwrap();
            let canonical = String::from_utf8(m.canonical_bytes()).unwrap();
            assert!(canonical.contains("overlap = "), "{lines}: {canonical}");
            assert!(canonical.contains("fragments = "), "{lines}: {canonical}");
            let again = RunManifest::parse(&canonical, "canonical").unwrap();
            assert_eq!(again.outer, m.outer, "{lines}");
            assert_eq!(again.run_id(), m.run_id(), "{lines}");
            ids.push(m.run_id());
        }
        let default = RunManifest::parse(TINY, "x").unwrap();
        assert_eq!(
            default.run_id(),
            ids[2],
            "delayed spelled out is the default"
        );
        let mut distinct = ids.clone();
        distinct.sort_by_key(|id| id.to_string());
        distinct.dedup();
        assert_eq!(distinct.len(), ids.len(), "each is another run");
    }

    #[test]
    fn an_allow_list_closes_the_run_and_is_part_of_its_id() {
        let open = RunManifest::parse(TINY, "x").unwrap();
        assert!(open.access.is_open());
        let peer = "12D3KooWKeviigG7NWus8RSvzgfSEtVDeNBh3PeDQFsFvE39STue";
        let closed =
            RunManifest::parse(&format!("{TINY}[access]\npeers = [\"{peer}\"]\n"), "x").unwrap();
        assert_eq!(closed.access.peers, [peer]);
        assert_ne!(closed.run_id(), open.run_id());
        let empty = RunManifest::parse(&format!("{TINY}[access]\npeers = []\n"), "x").unwrap();
        assert_eq!(
            empty.run_id(),
            open.run_id(),
            "an empty list is an open run"
        );
        let bad = |list: &str| {
            RunManifest::parse(&format!("{TINY}[access]\npeers = {list}\n"), "x")
                .unwrap_err()
                .to_string()
        };
        assert!(bad("[\"not a peer\"]").contains("access.peers"));
        assert!(bad(&format!("[\"{peer}\", \"{peer}\"]")).contains("listed twice"));
    }

    #[test]
    fn gate_defaults_and_bad_bounds_name_the_key() {
        let m = RunManifest::parse(TINY, "x").unwrap();
        assert_eq!(m.gate, GateConfig::default());
        let strict = RunManifest::parse(&format!("{TINY}[gate]\nmin_cosine = 0.0\n"), "x").unwrap();
        assert_eq!(strict.gate.min_cosine, 0.0);
        assert_ne!(
            strict.run_id(),
            m.run_id(),
            "the gate's bounds are part of the run id"
        );
        let gate = |body: &str| {
            RunManifest::parse(&format!("{TINY}[gate]\n{body}\n"), "x")
                .unwrap_err()
                .to_string()
        };
        assert!(gate("max_distance_ratio = 0.5").contains("gate.max_distance_ratio"));
        assert!(gate("max_distance_ratio = inf").contains("gate.max_distance_ratio"));
        assert!(gate("median_window = 0").contains("gate.median_window"));
        assert!(gate("min_cosine = 1.5").contains("gate.min_cosine"));
        assert!(gate("max_state_disagreement = 0").contains("gate.max_state_disagreement"));
        assert!(gate("max_state_disagreement = nan").contains("gate.max_state_disagreement"));
        assert!(gate("ban_window_rounds = 0").contains("gate.ban_window_rounds"));
        assert!(gate("max_ratio = 3.0").contains("max_ratio"));
        assert!(gate("max_loss_increase = -0.1").contains("gate.max_loss_increase"));
        assert!(gate("max_loss_increase = nan").contains("gate.max_loss_increase"));
        assert!(gate("check_tokens = 100000").contains("gate.check_tokens"));
    }

    /// The functional check's keys are in the run id only where they are set to another
    /// value: a manifest that leaves them out keeps the id it had before they existed.
    #[test]
    fn the_functional_checks_keys_enter_the_run_id_only_away_from_their_defaults() {
        let m = RunManifest::parse(TINY, "x").unwrap();
        let spelled = RunManifest::parse(
            &format!("{TINY}[gate]\nmax_loss_increase = inf\ncheck_tokens = 256\n"),
            "x",
        )
        .unwrap();
        assert_eq!(spelled.run_id(), m.run_id());
        let canonical = String::from_utf8(m.canonical_bytes()).unwrap();
        assert!(!canonical.contains("max_loss_increase"), "{canonical}");
        for body in [
            "max_loss_increase = 0.5",
            "check_tokens = 0",
            "max_loss_increase = 0.3",
        ] {
            let other = RunManifest::parse(&format!("{TINY}[gate]\n{body}\n"), "x").unwrap();
            assert_ne!(other.run_id(), m.run_id(), "{body}");
            let text = String::from_utf8(other.canonical_bytes()).unwrap();
            let again = RunManifest::parse(&text, "canonical").unwrap();
            assert_eq!(again.gate, other.gate, "{body}: {text}");
        }
    }
}

#[cfg(test)]
mod shard_table_tests {
    use super::*;

    const BASE: &str = super::tests::TINY;

    fn with_table(table: &str) -> String {
        // The table goes under [data]: insert it before [optimizer].
        BASE.replace("[optimizer]", &format!("{table}\n[optimizer]"))
    }

    const DIGEST: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    fn two_shards() -> String {
        format!(
            r#"
[[data.shards]]
name = "d_train_000000.bin"
split = "train"
bytes = 3024
tokens = 1000
sha256 = "{DIGEST}"
[[data.shards]]
name = "d_val_000000.bin"
split = "val"
bytes = 1224
tokens = 100
sha256 = "{DIGEST}"
"#
        )
    }

    #[test]
    fn a_pinned_table_round_trips_and_changes_the_run_id() {
        let open = RunManifest::parse(BASE, "t").unwrap();
        let pinned = RunManifest::parse(&with_table(&two_shards()), "t").unwrap();
        assert_eq!(pinned.data.shards.len(), 2);
        assert_eq!(pinned.data.shards[1].split, Split::Val);
        assert_eq!(pinned.data.shards[0].digest()[1], 0x11);
        assert_ne!(open.run_id(), pinned.run_id());
        // An unpinned manifest writes no table: its run id is what it was before tables.
        assert!(!String::from_utf8(open.canonical_bytes())
            .unwrap()
            .contains("shards"));
        let canonical = String::from_utf8(pinned.canonical_bytes()).unwrap();
        let again = RunManifest::parse(&canonical, "canonical").unwrap();
        assert_eq!(again, pinned);
        assert_eq!(again.run_id(), pinned.run_id());
    }

    fn refusal(table: &str) -> String {
        RunManifest::parse(&with_table(table), "t")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_table_with_a_bad_entry_is_refused_naming_it() {
        let good = two_shards();
        let cases = [
            (
                good.replace("d_train_000000.bin", "../x_train.bin"),
                "../x_train.bin",
            ),
            (
                good.replace("d_train_000000.bin", "d_train.txt"),
                "d_train.txt",
            ),
            (
                good.replace("d_val_000000.bin", "d_train_000000.bin"),
                "listed twice",
            ),
            (
                good.replace("split = \"val\"", "split = \"train\""),
                "other split",
            ),
            (
                good.replace("bytes = 3024", "bytes = 10"),
                "not a possible shard",
            ),
            (good.replacen(DIGEST, "ABC", 1), "64 lowercase hex"),
            (
                format!("mirrors = [\"ftp://x\"]\n{good}"),
                "not an http:// or https://",
            ),
        ];
        for (table, expected) in cases {
            let e = refusal(&table);
            assert!(e.contains(expected), "{expected:?} not in {e}");
        }
        let only_train = two_shards()
            .split("[[data.shards]]")
            .nth(1)
            .unwrap()
            .to_string();
        let e = refusal(&format!("[[data.shards]]{only_train}"));
        assert!(e.contains("pins no val shard"), "{e}");
    }

    #[test]
    fn pinning_text_keeps_its_comments_and_replaces_an_old_table() {
        let text = format!("# my run\n{BASE}");
        let table: Vec<ShardEntry> = RunManifest::parse(&with_table(&two_shards()), "t")
            .unwrap()
            .data
            .shards;
        let mirrors = ["https://example.org/d".to_string()];
        let once = pin_shards_in_text(&text, "t", &table, Some(&mirrors)).unwrap();
        assert!(once.starts_with("# my run\n"), "{once}");
        let parsed = RunManifest::parse(&once, "pinned").unwrap();
        assert_eq!(parsed.data.shards, table);
        assert_eq!(parsed.data.mirrors, mirrors);
        // Pinning again with one shard less replaces the table; mirrors stay unless given.
        let twice = pin_shards_in_text(&once, "t", &table[..1], None).unwrap();
        let e = RunManifest::parse(&twice, "pinned")
            .unwrap_err()
            .to_string();
        assert!(e.contains("pins no val shard"), "{e}");
        assert!(twice.contains("https://example.org/d"));
        let e = pin_shards_in_text("name = 1", "t", &table, None).unwrap_err();
        assert!(e.to_string().contains("no [data] table"), "{e}");
    }

    #[test]
    fn mirrors_are_kept() {
        let m = RunManifest::parse(
            &with_table(&format!(
                "mirrors = [\"http://127.0.0.1:9/d\"]\n{}",
                two_shards()
            )),
            "t",
        )
        .unwrap();
        assert_eq!(m.data.mirrors, ["http://127.0.0.1:9/d"]);
    }
}
