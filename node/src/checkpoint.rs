//! Checkpoints: a Hugging Face Llama directory plus gasloc's own training state,
//! written atomically.
//!
//! A checkpoint root (`--checkpoint-dir`) holds one directory per saved step and a
//! `latest` pointer:
//! ```text
//! <root>/step_00000100/model.safetensors     HF tensor names, fp32 ({"format": "pt"})
//!                      config.json           HF LlamaConfig (LlamaForCausalLM loads the dir)
//!                      optimizer.safetensors the inner optimizer's state: exp_avg.<name>,
//!                                            exp_avg_sq.<name> (AdamW; LoRDO adds basis.<name>
//!                                            and error.<name> of its projected matrices, whose
//!                                            moments are in basis coordinates)
//!                      train_state.json      step, run id, worker slot, data-stream cursor
//!                                            (a swarm node's also: its round, its payload
//!                                            gate's accepted distances)
//!                      run.toml              the resolved run manifest (canonical bytes)
//!                      outer.safetensors     a swarm node's outer momentum
//!                      local.safetensors     with `[outer] fragments` > 1, the model in
//!                                            training: the fragments not synced since
//!                                            their last round hold local progress the
//!                                            anchor (model.safetensors) lacks
//! <root>/latest                              "step_00000100"
//! ```
//! Each step directory is written under a temporary name, every file fsynced, then
//! renamed into place; `latest` is replaced by rename too. A crash or a full disk mid-write
//! leaves the previous checkpoint and pointer whole, and the temporary directory is removed.

use anyhow::{anyhow, bail, Context, Result};
use gasloc_data::stream::{StreamCursor, WorkerSlot};
use gasloc_proto::RunManifest;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

pub const MODEL_FILE: &str = "model.safetensors";
pub const CONFIG_FILE: &str = "config.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "train_state.json";
/// The outer optimizer's momentum of a swarm node (absent for single-node training).
pub const OUTER_FILE: &str = "outer.safetensors";
/// A swarm node's model in training, with `[outer] fragments` > 1 (absent otherwise).
pub const LOCAL_FILE: &str = "local.safetensors";
pub const MANIFEST_FILE: &str = "run.toml";
const LATEST: &str = "latest";
const STATE_FORMAT: &str = "gasloc-train-state/1";

/// gasloc's training state beside the model.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainState {
    pub format: String,
    pub run_id: String,
    /// Optimizer steps taken.
    pub step: u64,
    pub worker_index: usize,
    pub worker_count: usize,
    pub stream: StreamCursor,
    /// For a swarm node: the round the saved anchor begins (the next one it takes part in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round: Option<u64>,
    /// For a swarm node: the distances its payload gate accepted lately, per model fragment,
    /// oldest first (the gate's reference, `gasloc_proto::gate::PayloadGate::accepted`), so
    /// that a restarted node judges its neighbours as it did before the restart.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gate_windows: Vec<Vec<f64>>,
    /// The one window of checkpoints written before the windows were kept per fragment:
    /// read (as every fragment's window), no longer written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gate_accepted: Vec<f64>,
}

impl TrainState {
    pub fn new(run_id: String, step: u64, slot: &WorkerSlot, stream: StreamCursor) -> Self {
        TrainState {
            format: STATE_FORMAT.into(),
            run_id,
            step,
            worker_index: slot.index,
            worker_count: slot.count,
            stream,
            round: None,
            gate_windows: Vec::new(),
            gate_accepted: Vec::new(),
        }
    }

    /// The payload gate's windows for a model in `fragments` fragments: `gate_windows`, or in
    /// a checkpoint of the one window, that window for each.
    pub fn gate_windows(&self, fragments: usize) -> Vec<Vec<f64>> {
        if self.gate_windows.is_empty() && !self.gate_accepted.is_empty() {
            return vec![self.gate_accepted.clone(); fragments];
        }
        self.gate_windows.clone()
    }
}

/// Everything a checkpoint holds, in memory, tensors on the CPU.
pub struct Checkpoint {
    pub manifest: RunManifest,
    pub model: Vec<(String, Tensor)>,
    /// The inner optimizer's state tensors by name (`InnerOptimizer::state`); empty for a
    /// model-only (HF) directory.
    pub optimizer: Vec<(String, Tensor)>,
    pub state: Option<TrainState>,
    /// The outer momentum per parameter (a swarm node's); empty otherwise.
    pub outer_momentum: Vec<(String, Tensor)>,
    /// The model in training per parameter, where it differs from `model` in more than the
    /// steps since the last round (a swarm node's with `[outer] fragments` > 1: `model` is
    /// the anchor, each fragment as of its last sync); empty otherwise.
    pub local: Vec<(String, Tensor)>,
}

/// The directory name of the checkpoint of `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step_{step:08}")
}

/// Writes a checkpoint under `root` and points `latest` at it; keeps the newest `keep`
/// step directories (at least 1). Returns the new step directory.
pub fn save(root: &Path, ckpt: &Checkpoint, keep: usize) -> Result<PathBuf> {
    let state = ckpt
        .state
        .as_ref()
        .ok_or_else(|| anyhow!("a training checkpoint needs its train state"))?;
    fs::create_dir_all(root)
        .with_context(|| format!("creating checkpoint directory {}", root.display()))?;
    let name = step_dir_name(state.step);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    let result = write_step_dir(&tmp, ckpt, state);
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e.context(format!("writing checkpoint {}", root.join(&name).display())));
    }
    let dest = root.join(&name);
    if dest.exists() {
        // Saving the same step again (e.g. after a resume that ran 0 steps): replace it.
        fs::remove_dir_all(&dest).with_context(|| format!("replacing {}", dest.display()))?;
    }
    fs::rename(&tmp, &dest).with_context(|| format!("renaming {} into place", tmp.display()))?;
    write_atomically(&root.join(LATEST), name.as_bytes())
        .with_context(|| format!("updating {}", root.join(LATEST).display()))?;
    sync_dir(root)?;
    prune(root, keep.max(1))?;
    Ok(dest)
}

fn write_step_dir(dir: &Path, ckpt: &Checkpoint, state: &TrainState) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    write_model_dir(dir, &ckpt.manifest, &ckpt.model)?;
    write_tensors(&dir.join(OPTIMIZER_FILE), &ckpt.optimizer)?;
    if !ckpt.outer_momentum.is_empty() {
        write_tensors(&dir.join(OUTER_FILE), &ckpt.outer_momentum)?;
    }
    if !ckpt.local.is_empty() {
        write_tensors(&dir.join(LOCAL_FILE), &ckpt.local)?;
    }
    write_file(&dir.join(STATE_FILE), &serde_json::to_vec_pretty(state)?)?;
    sync_dir(dir)
}

/// Writes an HF-loadable model directory's files into `dir` (no atomicity of its own).
pub fn write_model_dir(
    dir: &Path,
    manifest: &RunManifest,
    model: &[(String, Tensor)],
) -> Result<()> {
    write_tensors(&dir.join(MODEL_FILE), model)?;
    let config = hf_config(manifest);
    write_file(&dir.join(CONFIG_FILE), &serde_json::to_vec_pretty(&config)?)?;
    write_file(&dir.join(MANIFEST_FILE), &manifest.canonical_bytes())
}

/// The step directory a path names: a step directory itself, or a root with `latest`.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join(MODEL_FILE).exists() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join(LATEST);
    if latest.exists() {
        let name =
            fs::read_to_string(&latest).with_context(|| format!("reading {}", latest.display()))?;
        let dir = path.join(name.trim());
        if !dir.join(MODEL_FILE).exists() {
            bail!(
                "{} points at {}, which holds no {MODEL_FILE}",
                latest.display(),
                dir.display()
            );
        }
        return Ok(dir);
    }
    if !path.exists() {
        bail!("checkpoint {} does not exist", path.display());
    }
    bail!(
        "{} is not a checkpoint: it has neither {MODEL_FILE} nor a `latest` pointer",
        path.display()
    )
}

/// Whether `root` already holds a checkpoint.
pub fn exists(root: &Path) -> bool {
    resolve(root).is_ok()
}

/// Reads a checkpoint directory (or root). A directory with only `model.safetensors` and
/// `config.json` (a plain HF checkpoint) needs `manifest` to know the run; one written by
/// gasloc carries its own and must agree with `manifest` when both are given.
pub fn load(path: &Path, manifest: Option<&RunManifest>) -> Result<Checkpoint> {
    let dir = resolve(path)?;
    let own = dir.join(MANIFEST_FILE);
    let manifest = match (own.exists(), manifest) {
        (true, given) => {
            let stored = RunManifest::load(&own)?;
            if let Some(given) = given {
                if given.model != stored.model {
                    bail!(
                        "checkpoint {} holds a model of another shape than the run manifest's [model]",
                        dir.display()
                    );
                }
            }
            given.cloned().unwrap_or(stored)
        }
        (false, Some(given)) => {
            check_hf_config(&dir, given)?;
            given.clone()
        }
        (false, None) => bail!(
            "{} has no {MANIFEST_FILE}: give the run manifest (--run) to read it",
            dir.display()
        ),
    };
    let model = read_tensors(&dir.join(MODEL_FILE))?;
    let optimizer_file = dir.join(OPTIMIZER_FILE);
    let state_file = dir.join(STATE_FILE);
    let (optimizer, state) = if state_file.exists() {
        let state: TrainState = serde_json::from_slice(
            &fs::read(&state_file).with_context(|| format!("reading {}", state_file.display()))?,
        )
        .with_context(|| format!("{} is not a gasloc train state", state_file.display()))?;
        if state.format != STATE_FORMAT {
            bail!(
                "{}: unknown format {:?}",
                state_file.display(),
                state.format
            );
        }
        // Which tensors the optimizer needs, and their shapes, the trainer checks when it
        // copies them in (`copy_into`).
        (read_tensors(&optimizer_file)?, Some(state))
    } else {
        (Vec::new(), None)
    };
    let outer_file = dir.join(OUTER_FILE);
    let outer_momentum = if outer_file.exists() {
        read_tensors(&outer_file)?
    } else {
        Vec::new()
    };
    let local_file = dir.join(LOCAL_FILE);
    let local = if local_file.exists() {
        read_tensors(&local_file)?
    } else {
        Vec::new()
    };
    Ok(Checkpoint {
        manifest,
        model,
        optimizer,
        state,
        outer_momentum,
        local,
    })
}

/// Copies checkpoint tensors into live ones, by name, refusing any missing tensor or
/// shape mismatch before anything is modified.
pub fn copy_into(
    source: &[(String, Tensor)],
    targets: &[(String, Tensor)],
    origin: &Path,
    tied_embeddings: bool,
) -> Result<()> {
    let by_name: HashMap<&str, &Tensor> = source.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for (name, target) in targets {
        let src = by_name
            .get(name.as_str())
            .ok_or_else(|| anyhow!("checkpoint {} lacks tensor {name}", origin.display()))?;
        if src.size() != target.size() {
            bail!(
                "checkpoint {}: tensor {name} has shape {:?}, the model expects {:?}",
                origin.display(),
                src.size(),
                target.size()
            );
        }
    }
    let known: std::collections::HashSet<&str> = targets.iter().map(|(n, _)| n.as_str()).collect();
    for (name, _) in source {
        let ignorable = tied_embeddings && name == "lm_head.weight";
        if !known.contains(name.as_str()) && !ignorable {
            bail!(
                "checkpoint {}: unexpected tensor {name} (another model shape?)",
                origin.display()
            );
        }
    }
    let _guard = tch::no_grad_guard();
    for (name, target) in targets {
        let mut target = target.shallow_clone();
        target.copy_(by_name[name.as_str()]);
    }
    Ok(())
}

/// HF `LlamaConfig` for the run's model.
fn hf_config(m: &RunManifest) -> serde_json::Value {
    let c = &m.model;
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.ffn_hidden,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim(),
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": false,
        "mlp_bias": false,
        "initializer_range": c.init_std,
        "torch_dtype": "float32",
        "bos_token_id": m.data.tokenizer.end_of_text(),
        "eos_token_id": m.data.tokenizer.end_of_text(),
    })
}

/// Checks a plain HF directory's `config.json` against the run's model, naming the
/// first key that differs.
fn check_hf_config(dir: &Path, m: &RunManifest) -> Result<()> {
    let path = dir.join(CONFIG_FILE);
    let text = fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let found: serde_json::Value =
        serde_json::from_slice(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let expected = hf_config(m);
    for key in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "tie_word_embeddings",
    ] {
        let default_kv = if key == "num_key_value_heads" {
            found.get("num_attention_heads")
        } else {
            None
        };
        let got = found.get(key).or(default_kv);
        if got != expected.get(key) {
            bail!(
                "{}: {key} is {}, the run manifest's model needs {}",
                path.display(),
                got.map(|v| v.to_string())
                    .unwrap_or_else(|| "missing".into()),
                expected[key]
            );
        }
    }
    Ok(())
}

/// Writes named fp32/bf16 tensors as a safetensors file with `{"format": "pt"}` metadata.
pub fn write_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let mut owned: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> = BTreeMap::new();
    for (name, t) in tensors {
        let t = t.to_device(Device::Cpu).contiguous();
        let dtype = match t.kind() {
            Kind::Float => Dtype::F32,
            Kind::BFloat16 => Dtype::BF16,
            other => bail!("tensor {name}: cannot store kind {other:?}"),
        };
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        let numel = t.numel();
        let mut bytes = vec![0u8; numel * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut bytes, numel)?;
        owned.insert(name.clone(), (dtype, shape, bytes));
    }
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(name, (dtype, shape, bytes))| {
            Ok((name.clone(), TensorView::new(*dtype, shape.clone(), bytes)?))
        })
        .collect::<Result<_>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(views, Some(metadata))?;
    write_file(path, &bytes)
}

/// Reads every tensor of a safetensors file onto the CPU (fp32 and bf16; f16 is widened).
pub fn read_tensors(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let bytes = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow!("{} is not a valid safetensors file: {e}", path.display()))?;
    let mut out = Vec::new();
    for (name, view) in file.tensors() {
        let kind = match view.dtype() {
            Dtype::F32 => Kind::Float,
            Dtype::BF16 => Kind::BFloat16,
            Dtype::F16 => Kind::Half,
            other => bail!(
                "{}: tensor {name} has unsupported dtype {other:?}",
                path.display()
            ),
        };
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let t = Tensor::f_from_data_size(view.data(), &shape, kind)?;
        let t = if kind == Kind::Half {
            t.to_kind(Kind::Float)
        } else {
            t
        };
        out.push((name, t));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Writes a file and fsyncs it.
fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .with_context(|| format!("writing {}", path.display()))
}

/// Replaces `path` by writing a sibling temporary file and renaming it.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    if let Err(e) = write_file(&tmp, bytes) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing directory {}", dir.display()))
}

/// Removes all but the newest `keep` step directories, and temporary directories that a
/// crashed writer left behind (ours was renamed already).
fn prune(root: &Path, keep: usize) -> Result<()> {
    let mut steps = Vec::new();
    for entry in fs::read_dir(root)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.starts_with("step_") {
            steps.push(name);
        } else if name.starts_with(".tmp-step_") {
            let _ = fs::remove_dir_all(root.join(&name));
        }
    }
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for name in &steps[..excess] {
        fs::remove_dir_all(root.join(name))
            .with_context(|| format!("removing old checkpoint {}", root.join(name).display()))?;
    }
    Ok(())
}
