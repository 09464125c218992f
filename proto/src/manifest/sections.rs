//! The manifest's sections as typed values — the model, the data and its pinned shards, the
//! optimizer, evaluation, the outer loop, LoRDO, the payload gate and access — with their
//! defaults and the rules that resolve the outer loop's.

use super::*;

/// The tokenizer a run's data was prepared with; it fixes the vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tokenizer {
    /// GPT-2 BPE (tiktoken's `r50k_base`), 50257 tokens, end-of-text 50256.
    Gpt2,
    /// Raw bytes, vocabulary 256, end-of-text 0 (NUL never occurs in text).
    Byte,
}

impl Tokenizer {
    /// The token ids the tokenizer can produce.
    pub fn vocab_size(self) -> usize {
        match self {
            Tokenizer::Gpt2 => 50257,
            Tokenizer::Byte => 256,
        }
    }
    /// The model's embedding rows: GPT-2's vocabulary padded to a multiple of 64.
    pub fn padded_vocab_size(self) -> usize {
        self.vocab_size().div_ceil(64) * 64
    }
    pub fn end_of_text(self) -> u32 {
        match self {
            Tokenizer::Gpt2 => 50256,
            Tokenizer::Byte => 0,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Tokenizer::Gpt2 => "gpt2",
            Tokenizer::Byte => "byte",
        }
    }
}

impl std::str::FromStr for Tokenizer {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "gpt2" => Ok(Tokenizer::Gpt2),
            "byte" => Ok(Tokenizer::Byte),
            other => Err(format!(
                "unknown tokenizer {other:?} (expected gpt2 or byte)"
            )),
        }
    }
}

/// The numeric type of the forward and backward pass on CUDA. Master weights and the
/// optimizer stay in fp32 whatever is chosen; on CPU the model always runs in fp32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CudaCompute {
    Bf16,
    Fp32,
}

/// A fully resolved Llama-3-style decoder shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub ffn_hidden: usize,
    pub max_seq_len: usize,
    pub rope_theta: f64,
    pub norm_eps: f64,
    pub tie_embeddings: bool,
    pub init_std: f64,
    pub cuda_compute: CudaCompute,
}

impl ModelConfig {
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// Parameters in the model (tied embeddings counted once).
    pub fn parameter_count(&self) -> usize {
        let d = self.d_model;
        let kv = self.n_kv_heads * self.head_dim();
        let attn = d * d * 2 + d * kv * 2;
        let mlp = 3 * d * self.ffn_hidden;
        let per_layer = attn + mlp + 2 * d;
        let embed = self.vocab_size * d;
        let head = if self.tie_embeddings { 0 } else { embed };
        embed + head + self.n_layers * per_layer + d
    }
}

/// Token data and batch shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    pub tokenizer: Tokenizer,
    /// Tokens per training sequence.
    pub seq_len: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches accumulated into one optimizer step.
    #[serde(default = "one")]
    pub grad_accum: usize,
    /// Plain HTTP(S) mirrors of the shards: `<mirror>/<shard name>` serves each shard,
    /// with range requests. Optional; the swarm serves the shards too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mirrors: Vec<String>,
    /// The run's shards, pinned: a node trains only on files that match this table byte
    /// for byte (`gasloc-node data pin` writes it). Empty: the data is not pinned (each
    /// node brings its own `--data`, unchecked). Left out of the canonical bytes when
    /// empty, so the run ids of unpinned runs do not depend on it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<ShardEntry>,
}

/// Which split a shard belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Val,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Val => "val",
        }
    }

    /// The split a shard's file name puts it in (the data loader's rule: `*_val_*.bin`
    /// is validation data).
    pub fn of_file_name(name: &str) -> Split {
        if name.contains("_val_") {
            Split::Val
        } else {
            Split::Train
        }
    }
}

/// One pinned shard of a run's data: `[[data.shards]]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    /// The file name (no directory), ending in `.bin`.
    pub name: String,
    pub split: Split,
    /// The file's length in bytes, header included.
    pub bytes: u64,
    /// Tokens after the header.
    pub tokens: u64,
    /// SHA-256 of the whole file, 64 lowercase hex digits.
    pub sha256: String,
}

impl ShardEntry {
    /// The digest as bytes (validated when the manifest was parsed).
    pub fn digest(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        hex::decode_to_slice(&self.sha256, &mut out).expect("validated when parsed");
        out
    }
}

/// Writes a shard table (and, when given, the mirrors) into manifest text: `[data]`'s
/// `shards` and `mirrors` are replaced and the rest of the file — comments, order, layout —
/// is kept as it was. The result still has to pass [`RunManifest::parse`].
pub fn pin_shards_in_text(
    text: &str,
    origin: &str,
    table: &[ShardEntry],
    mirrors: Option<&[String]>,
) -> Result<String, ManifestError> {
    let parse_error = |message: String| ManifestError::Parse {
        path: origin.to_string(),
        message,
    };
    let mut doc: toml_edit::DocumentMut = text
        .parse()
        .map_err(|e: toml_edit::TomlError| parse_error(e.to_string().trim_end().to_string()))?;
    let data = doc
        .get_mut("data")
        .and_then(|d| d.as_table_mut())
        .ok_or_else(|| parse_error("has no [data] table".into()))?;
    if let Some(mirrors) = mirrors {
        data.insert(
            "mirrors",
            toml_edit::value(toml_edit::Array::from_iter(mirrors)),
        );
    }
    let mut shards = toml_edit::ArrayOfTables::new();
    for entry in table {
        let mut t = toml_edit::Table::new();
        t.insert("name", toml_edit::value(&entry.name));
        t.insert("split", toml_edit::value(entry.split.name()));
        t.insert("bytes", toml_edit::value(entry.bytes as i64));
        t.insert("tokens", toml_edit::value(entry.tokens as i64));
        t.insert("sha256", toml_edit::value(&entry.sha256));
        shards.push(t);
    }
    data.insert("shards", toml_edit::Item::ArrayOfTables(shards));
    Ok(doc.to_string())
}

/// The largest shard a manifest may pin (1 TiB): bounds every size derived from the table.
pub const MAX_SHARD_BYTES: u64 = 1 << 40;

/// The most fragments `[outer] fragments` may name (each round then exchanges at least 1/64
/// of the model).
pub const MAX_FRAGMENTS: usize = 64;

impl DataConfig {
    /// Tokens consumed by one optimizer step.
    pub fn tokens_per_step(&self) -> usize {
        self.seq_len * self.micro_batch * self.grad_accum
    }
}

/// Inner optimizer (AdamW) and its learning-rate schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    #[serde(default = "default_lr")]
    pub lr: f64,
    /// The cosine decays to `lr · min_lr_ratio`.
    #[serde(default = "default_min_lr_ratio")]
    pub min_lr_ratio: f64,
    #[serde(default)]
    pub warmup_steps: u64,
    /// Steps over which the cosine decays (warm-up included); flat at the minimum after.
    pub decay_steps: u64,
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    #[serde(default = "default_eps")]
    pub eps: f64,
    #[serde(default = "default_weight_decay")]
    pub weight_decay: f64,
    /// Also decay norm gains and embeddings (off by default, as in most Llama recipes).
    #[serde(default)]
    pub decay_norms_and_embeddings: bool,
    /// Global gradient-norm clip; 0 turns clipping off.
    #[serde(default = "one_f64")]
    pub grad_clip: f64,
}

/// The most tokens `[gate] check_tokens` may name: the functional check runs on every
/// received payload, and its batch is held on the trainer's device.
pub const MAX_CHECK_TOKENS: u64 = 65_536;

/// `[gate]`: the bounds of the payload gate (`gate.rs`), the values check of every model a
/// neighbour sends before it is mixed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GateConfig {
    /// k: a received model may lie at most k times the reference distance from this node's
    /// anchor (the reference: the larger of this node's own pseudo-gradient norm and the
    /// median of the distances it accepted lately).
    #[serde(default = "default_max_distance_ratio")]
    pub max_distance_ratio: f64,
    /// Accepted distances the median runs over.
    #[serde(default = "default_median_window")]
    pub median_window: u64,
    /// The least cosine between a neighbour's and this node's pseudo-gradient; −1 turns the
    /// check off.
    #[serde(default = "default_min_cosine")]
    pub min_cosine: f64,
    /// ρ: two states a joiner fetched agree when their anchors lie within
    /// `‖θ_a − θ_b‖ ≤ ρ · min(‖θ_a‖, ‖θ_b‖)`; with three sources or more, each must lie within
    /// `ρ · ‖θ_median‖` of their coordinate-wise median. A joiner starts from the median of the
    /// sources that agree (three or more) or their mean (two, each outer momentum clipped to
    /// their median norm). See `gate::states_agree` for why 1.5.
    #[serde(default = "default_max_state_disagreement")]
    pub max_state_disagreement: f64,
    /// A peer is banned for the rest of the run after this many offences (a refused
    /// payload or state, a withheld reveal) within [`Self::ban_window_rounds`]; 0: never.
    #[serde(default = "default_ban_after_offences")]
    pub ban_after_offences: u32,
    /// The rounds offences are counted over.
    #[serde(default = "default_ban_window_rounds")]
    pub ban_window_rounds: u64,
    /// The functional check (`gate::LossReading`): a payload is refused as `harmful` when
    /// this node's model with the payload mixed in at half weight (the round's fragment
    /// `(x_i + x_j) / 2`) has a loss on a held-out batch more than this many nats above the
    /// larger of the model's loss with its own payload and with the fragment as the round
    /// started. `inf`, the default, refuses only a payload whose loss is not finite: honest
    /// payloads can do real harm when mixed (two halves of a one-peer swarm test that
    /// trained apart for four rounds: +1.16 nats at their first mix), and a finite bound
    /// would refuse them as offences; the losses are measured and recorded all the same.
    /// Left out of the canonical bytes at its default.
    #[serde(
        default = "default_max_loss_increase",
        skip_serializing_if = "is_default_max_loss_increase"
    )]
    pub max_loss_increase: f64,
    /// The tokens the functional check runs on: whole validation sequences of `[data]
    /// seq_len`, as many as fit (at least one), another slice each round; 0 turns the check
    /// off. Left out of the canonical bytes at its default.
    #[serde(
        default = "default_check_tokens",
        skip_serializing_if = "is_default_check_tokens"
    )]
    pub check_tokens: u64,
}

impl Default for GateConfig {
    fn default() -> Self {
        GateConfig {
            max_distance_ratio: default_max_distance_ratio(),
            median_window: default_median_window(),
            min_cosine: default_min_cosine(),
            max_state_disagreement: default_max_state_disagreement(),
            ban_after_offences: default_ban_after_offences(),
            ban_window_rounds: default_ban_window_rounds(),
            max_loss_increase: default_max_loss_increase(),
            check_tokens: default_check_tokens(),
        }
    }
}

fn default_max_distance_ratio() -> f64 {
    10.0
}
fn default_median_window() -> u64 {
    32
}
fn default_min_cosine() -> f64 {
    -1.0
}
fn default_max_state_disagreement() -> f64 {
    1.5
}
fn default_ban_after_offences() -> u32 {
    3
}
fn default_ban_window_rounds() -> u64 {
    20
}
fn default_max_loss_increase() -> f64 {
    f64::INFINITY
}
fn is_default_max_loss_increase(v: &f64) -> bool {
    *v == default_max_loss_increase()
}
fn default_check_tokens() -> u64 {
    256
}
fn is_default_check_tokens(v: &u64) -> bool {
    *v == default_check_tokens()
}

/// Validation during training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalConfig {
    /// Optimizer steps between validation losses.
    #[serde(default = "default_eval_interval")]
    pub interval: u64,
    /// Micro-batches of the validation split per validation loss.
    #[serde(default = "default_eval_batches")]
    pub batches: usize,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            interval: default_eval_interval(),
            batches: default_eval_batches(),
        }
    }
}

fn one() -> usize {
    1
}
fn one_f64() -> f64 {
    1.0
}
fn default_lr() -> f64 {
    4e-4
}
fn default_min_lr_ratio() -> f64 {
    0.1
}
fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.95
}
fn default_eps() -> f64 {
    1e-8
}
fn default_weight_decay() -> f64 {
    0.1
}
fn default_eval_interval() -> u64 {
    50
}
fn default_eval_batches() -> usize {
    8
}

/// The distributed algorithm of a run (`docs/algorithms.md`, "A round").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Algorithm {
    /// Gossip over the round's topology, then the outer (Nesterov) step.
    Gasloc,
    /// All-reduce of the pseudo-gradients with a barrier, then the outer step.
    Diloco,
    /// Gossip averaging of the models after H inner steps (η = 1, μ = 0).
    LocalDadam,
    /// Local-DAdam with H = 1.
    Dadam,
    /// Synchronous data parallel: gradients averaged every step (the reference).
    Ddp,
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Gasloc => "gasloc",
            Algorithm::Diloco => "diloco",
            Algorithm::LocalDadam => "local-dadam",
            Algorithm::Dadam => "dadam",
            Algorithm::Ddp => "ddp",
        }
    }
}

/// What a worker sends its neighbours at the end of a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Payload {
    /// The local model `x_i`, fp32.
    ModelFp32,
    /// The local model `x_i`, rounded to bf16.
    ModelBf16,
    /// Rank-r pseudo-gradient factors with error feedback (`docs/algorithms.md`, "The `lordo`
    /// payload"); needs `outer.inner_optimizer = "lordo"`.
    Lordo,
}

/// How a round's exchange overlaps the next round's inner steps (`docs/algorithms.md`,
/// "Overlapped rounds"). Left out, [`Overlap::default_for`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Overlap {
    /// Blocking rounds: train, exchange, outer step, then the next round's inner steps.
    None,
    /// The next round's inner steps start as soon as the payload is handed to the exchange;
    /// when the exchange ends, the round's outer step is applied to the anchor and the local
    /// progress made since is carried onto the new anchor.
    Delayed,
    /// The worker's own fresh pseudo-gradient term is applied at once, its neighbours'
    /// terms added to that outer step when the exchange ends (the idea of arXiv 2502.12996,
    /// adapted to gossip).
    Eager,
}

/// The fragments `overlap = "delayed"` defaults to: each round exchanges a fifth of the
/// model, so the update a round applies late is a fifth as large (`docs/results.md` §6).
pub const DELAYED_FRAGMENTS: usize = 5;

impl Overlap {
    /// `[outer] overlap` when the manifest leaves it out: `delayed` for GASLoC with AdamW
    /// inner steps — whose defaults are then [`DELAYED_FRAGMENTS`] fragments, 30 / 5 = 6
    /// inner steps a round and outer momentum 0.8, the configuration measured within 1 % of
    /// blocking rounds' loss at equal steps on one-peer and two-peer (`docs/results.md` §6)
    /// that keeps the trainer computing through the exchange — and `none` for everything
    /// else: DiLoCo stays the blocking baseline, the one-step and plain-averaging algorithms
    /// have no round to overlap, and LoRDO's bases need each round's mix.
    pub fn default_for(algorithm: Algorithm, inner_optimizer: InnerOptimizerKind) -> Overlap {
        if algorithm == Algorithm::Gasloc && inner_optimizer == InnerOptimizerKind::Adamw {
            Overlap::Delayed
        } else {
            Overlap::None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Overlap::None => "none",
            Overlap::Delayed => "delayed",
            Overlap::Eager => "eager",
        }
    }
}

/// The optimizer of the inner steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InnerOptimizerKind {
    Adamw,
    /// Low-rank Adam with error feedback and the full-rank quasi-hyperbolic term (§4.1).
    Lordo,
}

/// `[outer]`, resolved: the round structure and the outer optimizer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OuterConfig {
    pub algorithm: Algorithm,
    pub topology: Topology,
    /// H: inner steps per round (the target when `adaptive_inner_steps`).
    pub inner_steps: u64,
    /// Each worker picks its own H_i in `[min_inner_steps, max_inner_steps]` (§2).
    pub adaptive_inner_steps: bool,
    pub min_inner_steps: u64,
    pub max_inner_steps: u64,
    /// η, the outer learning rate.
    pub lr: f64,
    /// μ, the outer momentum.
    pub momentum: f64,
    /// Nesterov (as `torch.optim.SGD(nesterov=True)`) or plain heavy-ball.
    pub nesterov: bool,
    pub payload: Payload,
    pub inner_optimizer: InnerOptimizerKind,
    /// Whether the exchange overlaps the next round's inner steps. Always in the canonical
    /// bytes: left out of a manifest it means [`Overlap::default_for`], not `none`, so the
    /// served canonical text must say which.
    pub overlap: Overlap,
    /// P: the model's tensors in P fragments, round t (from 0) mixing and outer-stepping only
    /// fragment `t mod P` (Streaming DiLoCo; [`crate::fragments`]). 1 is the whole model
    /// every round. Always in the canonical bytes, as its default depends on `overlap`.
    pub fragments: usize,
}

/// `[lordo]`: the low-rank inner optimizer and payload (used when selected in `[outer]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LordoConfig {
    /// r: rank of the projected matrices (capped at min(m, n) per matrix).
    #[serde(default = "default_lordo_rank")]
    pub rank: usize,
    /// ω: weight of the low-rank Adam term; `1 − ω` goes to the full-rank term. 1 = none.
    #[serde(default = "default_lordo_omega")]
    pub omega: f64,
    /// With `payload = "lordo"`: every K-th round the anchors are also sent (bf16) and mixed,
    /// so the workers stay in consensus.
    #[serde(default = "default_full_sync_every")]
    pub full_sync_every: u64,
    /// What the full-rank term `(1 − ω)·X / mean(d)` applies: the gradient plus the error
    /// feedback buffer (the authors' code, the default) or the gradient alone (the paper).
    /// Left out of the canonical bytes at its default.
    #[serde(default, skip_serializing_if = "FullRankTerm::is_default")]
    pub full_rank_term: FullRankTerm,
    /// `constant` (the default): ω, the betas and the learning rate as configured from the
    /// first step. `authors`: the LoRDO authors' regime (below). Left out of the canonical
    /// bytes at its default.
    #[serde(default, skip_serializing_if = "LordoRegime::is_constant")]
    pub regime: LordoRegime,
    /// With `regime = "authors"`: the share of `optimizer.decay_steps` trained as low-rank
    /// Adam (ω = 1) before the switch to LoRDO proper: betas (0.999, 0.999), moments reset,
    /// learning rate × 0.5, ω as configured, QHAdam (ν = ω) on the tensors that are not
    /// projected. The authors warm-start at step 2048 of 12288: 1/6, the default.
    #[serde(
        default = "default_switch_fraction",
        skip_serializing_if = "is_default_switch_fraction"
    )]
    pub switch_fraction: f64,
}

/// The input of LoRDO's full-rank quasi-hyperbolic term.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FullRankTerm {
    /// `G + E`, the clipped gradient with the error feedback added (the authors' code).
    #[default]
    GradientAndError,
    /// `Ĝ`, the clipped gradient alone (the paper's update rule).
    Gradient,
}

impl FullRankTerm {
    pub fn is_default(&self) -> bool {
        *self == FullRankTerm::default()
    }
}

/// When LoRDO's settings apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LordoRegime {
    /// ω, betas and learning rate as configured, from the first step.
    #[default]
    Constant,
    /// Low-rank Adam (ω = 1) for `switch_fraction` of the decay steps, then the switch.
    Authors,
}

impl LordoRegime {
    pub fn is_constant(&self) -> bool {
        *self == LordoRegime::Constant
    }
}

impl Default for LordoConfig {
    fn default() -> Self {
        LordoConfig {
            rank: default_lordo_rank(),
            omega: default_lordo_omega(),
            full_sync_every: default_full_sync_every(),
            full_rank_term: FullRankTerm::default(),
            regime: LordoRegime::default(),
            switch_fraction: default_switch_fraction(),
        }
    }
}

fn default_switch_fraction() -> f64 {
    1.0 / 6.0
}
fn is_default_switch_fraction(f: &f64) -> bool {
    *f == default_switch_fraction()
}

fn default_lordo_rank() -> usize {
    8
}
fn default_lordo_omega() -> f64 {
    0.97
}
/// Whether `round` is a full-sync round of the `lordo` payload (`[lordo] full_sync_every`
/// = `every`, at least 1): rounds 0, K, 2K, … also carry the sender's anchor. The simulator,
/// the node's payload and the round machine's byte counts all ask this one function.
pub fn is_full_sync_round(round: u64, every: u64) -> bool {
    round.is_multiple_of(every.max(1))
}

fn default_full_sync_every() -> u64 {
    4
}

/// `[access]`: who may take part. Absent or empty: an open run, anyone may join. A closed
/// run lists the peer ids (base58, as `gasloc-node` prints them) of every node and bootstrap
/// node; the list is part of the run id, and every node refuses connections from peers not
/// on it (`p2p/src/access.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessConfig {
    #[serde(default)]
    pub peers: Vec<String>,
}

impl AccessConfig {
    /// An open run: no allow-list.
    pub fn is_open(&self) -> bool {
        self.peers.is_empty()
    }
}
