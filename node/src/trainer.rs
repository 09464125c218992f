//! The local trainer: one model, its AdamW state and one worker's data stream.
//!
//! `Trainer::step` is one optimizer step (gradient accumulation over micro-batches,
//! global-norm clipping, scheduled learning rate); synchronous data parallel splits it into
//! [`Trainer::accumulate_gradients`] and [`Trainer::apply_gradients`] around a gradient
//! average. The outer loop of a round reads and writes the parameters through
//! [`Trainer::parameters`] and reaches LoRDO's basis through [`Trainer::inner_optimizer_mut`]. A trainer is built fresh from the run's
//! seed, from a gasloc checkpoint (exact resume: parameters, moments, step, data cursor),
//! or from a plain Hugging Face directory (`--init-from`: parameters only).
//!
//! libtorch work is synchronous and heavy: callers on an async runtime run it on a
//! dedicated thread.

use crate::checkpoint::{self, Checkpoint, TrainState};
use crate::inner_optimizer::InnerOptimizer;
use crate::model::Llama;
use crate::optim::{clip_grad_norm, LrSchedule};
use anyhow::{bail, Context, Result};
use gasloc_data::shards::TokenDataset;
use gasloc_data::stream::{Batch, BatchStream, WorkerSlot};
use gasloc_proto::RunManifest;
use std::path::Path;
use std::sync::Arc;
use tch::{nn, Device, Kind, Tensor};

/// What one optimizer step did.
#[derive(Debug, Clone, Copy)]
pub struct StepReport {
    /// Optimizer steps taken, this one included.
    pub step: u64,
    /// Mean training loss over the step's micro-batches.
    pub loss: f64,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub tokens: usize,
}

pub struct Trainer {
    manifest: RunManifest,
    run_id: String,
    device: Device,
    slot: WorkerSlot,
    // Owns the parameters; `model` and `optimizer` hold handles to them.
    _vs: nn::VarStore,
    model: Llama,
    /// The parameters, sorted by name (handles to the store's tensors).
    params: Vec<(String, Tensor)>,
    optimizer: InnerOptimizer,
    schedule: LrSchedule,
    stream: BatchStream,
}

impl Trainer {
    /// A trainer at step 0, parameters initialised from the run's seed (on the CPU, then
    /// moved, so every device starts from the same numbers).
    pub fn new(
        manifest: &RunManifest,
        device: Device,
        data: Arc<TokenDataset>,
        slot: WorkerSlot,
    ) -> Result<Trainer> {
        Self::with_stream_seed(manifest, device, data, slot, manifest.seed)
    }

    /// [`Trainer::new`] with the data stream shuffled by `stream_seed` instead of the run's
    /// seed: a swarm node derives it from its peer id, so volunteers read the data in
    /// different orders without knowing how many of them there are.
    pub fn with_stream_seed(
        manifest: &RunManifest,
        device: Device,
        data: Arc<TokenDataset>,
        slot: WorkerSlot,
        stream_seed: u64,
    ) -> Result<Trainer> {
        tch::manual_seed(manifest.seed as i64);
        let mut vs = nn::VarStore::new(device);
        let model = if device == Device::Cpu {
            Llama::new(&vs.root(), &manifest.model)
        } else {
            let cpu = nn::VarStore::new(Device::Cpu);
            let _ = Llama::new(&cpu.root(), &manifest.model);
            let model = Llama::new(&vs.root(), &manifest.model);
            vs.copy(&cpu)?;
            model
        };
        let params = named_parameters(&vs);
        let optimizer = InnerOptimizer::new(
            manifest,
            params
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect(),
        );
        let stream = BatchStream::new(
            data,
            manifest.data.seq_len,
            manifest.data.micro_batch,
            slot,
            stream_seed,
        )?;
        Ok(Trainer {
            run_id: manifest.run_id().to_string(),
            manifest: manifest.clone(),
            device,
            slot,
            _vs: vs,
            model,
            params,
            optimizer,
            schedule: LrSchedule::new(&manifest.optimizer),
            stream,
        })
    }

    /// Continues a gasloc checkpoint exactly where it stopped.
    pub fn resume(
        manifest: &RunManifest,
        device: Device,
        data: Arc<TokenDataset>,
        slot: WorkerSlot,
        checkpoint_path: &Path,
    ) -> Result<Trainer> {
        let dir = checkpoint::resolve(checkpoint_path)?;
        let ckpt = checkpoint::load(&dir, Some(manifest))?;
        Self::from_checkpoint(manifest, device, data, slot, &ckpt, &dir)
    }

    /// [`Trainer::resume`] from a checkpoint already read from `dir`.
    pub fn from_checkpoint(
        manifest: &RunManifest,
        device: Device,
        data: Arc<TokenDataset>,
        slot: WorkerSlot,
        ckpt: &Checkpoint,
        dir: &Path,
    ) -> Result<Trainer> {
        let Some(state) = &ckpt.state else {
            bail!(
                "{} holds a model but no gasloc train state: use --init-from to start from it",
                dir.display()
            );
        };
        if state.run_id != manifest.run_id().to_string() {
            bail!(
                "checkpoint {} belongs to run {}, not to this manifest's run {}",
                dir.display(),
                state.run_id,
                manifest.run_id()
            );
        }
        if (state.worker_index, state.worker_count) != (slot.index, slot.count) {
            bail!(
                "checkpoint {} was written by worker {} of {}, not {} of {}",
                dir.display(),
                state.worker_index,
                state.worker_count,
                slot.index,
                slot.count
            );
        }
        let mut trainer =
            Trainer::with_stream_seed(manifest, device, data, slot, state.stream.seed)?;
        trainer.load_parameters(ckpt, dir)?;
        checkpoint::copy_into(&ckpt.optimizer, &trainer.optimizer.state(), dir, false)?;
        trainer.optimizer.set_steps(state.step);
        trainer
            .stream
            .seek(&state.stream)
            .with_context(|| format!("restoring the data cursor of {}", dir.display()))?;
        Ok(trainer)
    }

    /// A fresh trainer (step 0, zero moments) whose parameters come from an HF or gasloc
    /// model directory.
    pub fn init_from(
        manifest: &RunManifest,
        device: Device,
        data: Arc<TokenDataset>,
        slot: WorkerSlot,
        model_dir: &Path,
    ) -> Result<Trainer> {
        let dir = checkpoint::resolve(model_dir)?;
        let ckpt = checkpoint::load(&dir, Some(manifest))?;
        let mut trainer = Trainer::new(manifest, device, data, slot)?;
        trainer.load_parameters(&ckpt, &dir)?;
        Ok(trainer)
    }

    fn load_parameters(&mut self, ckpt: &Checkpoint, dir: &Path) -> Result<()> {
        let targets: Vec<(String, Tensor)> = self
            .params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        checkpoint::copy_into(
            &ckpt.model,
            &targets,
            dir,
            self.manifest.model.tie_embeddings,
        )
    }

    pub fn manifest(&self) -> &RunManifest {
        &self.manifest
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// Optimizer steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.optimizer.steps()
    }

    /// The parameters in name order: handles to the live tensors (writing into them, under
    /// `tch::no_grad`, changes the model).
    /// The training shards' file names in the order this trainer's stream will first read
    /// them from where it stands ([`BatchStream::shards_ahead`]).
    pub fn shards_ahead(&self) -> Vec<String> {
        let data = self.stream.dataset();
        self.stream
            .shards_ahead()
            .into_iter()
            .map(|i| {
                let path = data.train_shard_path(i);
                path.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    }

    pub fn parameters(&self) -> Vec<Tensor> {
        self.params.iter().map(|(_, t)| t.shallow_clone()).collect()
    }

    /// The parameter names, in the order of [`Self::parameters`].
    pub fn parameter_names(&self) -> Vec<String> {
        self.params.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Overwrites the parameters with `values` (same order and shapes).
    pub fn set_parameters(&mut self, values: &[Tensor]) {
        let _guard = tch::no_grad_guard();
        for ((_, p), v) in self.params.iter_mut().zip(values) {
            p.copy_(v);
        }
    }

    /// Overwrites the parameters of fragment `members` (tensor indices, in order) with
    /// `values`; the others keep theirs.
    pub fn set_fragment(&mut self, members: &[usize], values: &[Tensor]) {
        let _guard = tch::no_grad_guard();
        for (&k, v) in members.iter().zip(values) {
            self.params[k].1.copy_(v);
        }
    }

    pub fn inner_optimizer(&self) -> &InnerOptimizer {
        &self.optimizer
    }

    pub fn inner_optimizer_mut(&mut self) -> &mut InnerOptimizer {
        &mut self.optimizer
    }

    /// One optimizer step over `grad_accum` micro-batches of this worker's stream.
    pub fn step(&mut self) -> Result<StepReport> {
        let (loss, tokens) = self.accumulate_gradients()?;
        Ok(self.apply_gradients(loss, tokens))
    }

    /// Forward and backward over `grad_accum` micro-batches: the gradients are left in the
    /// parameters' `.grad`. Returns the mean loss and the tokens used.
    pub fn accumulate_gradients(&mut self) -> Result<(f64, usize)> {
        let accum = self.manifest.data.grad_accum;
        let mut loss_sum = 0.0;
        let mut tokens = 0;
        for _ in 0..accum {
            let batch = self.stream.next_batch()?;
            tokens += batch.rows * batch.seq_len;
            let (inputs, targets) = self.to_device(&batch);
            let loss = self.model.loss(&inputs, &targets);
            (&loss / accum as f64).backward();
            loss_sum += loss.double_value(&[]);
        }
        let loss = loss_sum / accum as f64;
        if !loss.is_finite() {
            self.optimizer.zero_grad();
            bail!(
                "training diverged: the loss of step {} is {loss}",
                self.optimizer.steps() + 1
            );
        }
        Ok((loss, tokens))
    }

    /// Clips the gradients in `.grad`, takes the optimizer step at the scheduled rate and
    /// clears them.
    pub fn apply_gradients(&mut self, loss: f64, tokens: usize) -> StepReport {
        let step = self.optimizer.steps();
        let grad_norm = clip_grad_norm(&self.parameters(), self.manifest.optimizer.grad_clip);
        let lr = self.schedule.at(step);
        self.optimizer.step(lr);
        self.optimizer.zero_grad();
        StepReport {
            step: step + 1,
            loss,
            lr,
            grad_norm,
            tokens,
        }
    }

    /// Mean loss over `batches` (no gradients).
    pub fn evaluate(&self, batches: &[Batch]) -> f64 {
        evaluate(&self.model, self.device, batches)
    }

    /// Mean loss over `batches` of the parameters `values` (same order and shapes) in place of
    /// the model in training, which is put back after: an anchor's loss mid-training.
    pub fn evaluate_parameters(&mut self, values: &[Tensor], batches: &[Batch]) -> f64 {
        let in_training = crate::algo::copies(&self.parameters());
        self.set_parameters(values);
        let loss = self.evaluate(batches);
        self.set_parameters(&in_training);
        loss
    }

    /// Mean loss over `batches` of the model in training with the tensors `members` set to
    /// each of `variants` in turn (each in `members`' order): a fragment's candidates judged
    /// in the model they would join. The model in training is put back after, exactly.
    pub fn evaluate_with_fragment(
        &mut self,
        members: &[usize],
        variants: &[Vec<Tensor>],
        batches: &[Batch],
    ) -> Vec<f64> {
        let in_training = crate::algo::copies(&crate::algo::outer::fragment_of(
            &self.parameters(),
            members,
        ));
        let losses = variants
            .iter()
            .map(|values| {
                self.set_fragment(members, values);
                self.evaluate(batches)
            })
            .collect();
        self.set_fragment(members, &in_training);
        losses
    }

    /// The current state as a checkpoint (tensors copied to the CPU): the model, the inner
    /// optimizer's state (AdamW's moments, or LoRDO's moments, bases and error buffers), the
    /// step and the data cursor.
    pub fn checkpoint(&self) -> Result<Checkpoint> {
        let to_cpu = |t: &Tensor| t.detach().to_device(Device::Cpu);
        Ok(Checkpoint {
            manifest: self.manifest.clone(),
            model: self
                .params
                .iter()
                .map(|(name, p)| (name.clone(), to_cpu(p)))
                .collect(),
            optimizer: self
                .optimizer
                .state()
                .into_iter()
                .map(|(name, t)| (name, to_cpu(&t)))
                .collect(),
            state: Some(TrainState::new(
                self.run_id.clone(),
                self.optimizer.steps(),
                &self.slot,
                self.stream.cursor(),
            )),
            outer_momentum: Vec::new(),
            local: Vec::new(),
        })
    }

    fn to_device(&self, batch: &Batch) -> (Tensor, Tensor) {
        batch_tensors(batch, self.device)
    }
}

/// The run's validation batches (`[eval] batches` of them) from `data`'s validation shards,
/// or none (with a warning) when `data` has no validation shard.
pub fn validation_set(data: &TokenDataset, manifest: &RunManifest) -> Result<Vec<Batch>> {
    if data.val_tokens() == 0 {
        tracing::warn!(
            "{} has no validation shard: no val_loss",
            data.dir().display()
        );
        return Ok(Vec::new());
    }
    Ok(gasloc_data::stream::validation_batches(
        data,
        manifest.data.seq_len,
        manifest.data.micro_batch,
        manifest.eval.batches,
    )?)
}

/// The model's parameters in a stable order (sorted by name).
pub fn named_parameters(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    params
}

/// A batch as `[rows, seq_len]` int64 tensors on `device`.
pub fn batch_tensors(batch: &Batch, device: Device) -> (Tensor, Tensor) {
    let shape = [batch.rows as i64, batch.seq_len as i64];
    let inputs = Tensor::from_slice(&batch.inputs)
        .view(shape)
        .to_device(device);
    let targets = Tensor::from_slice(&batch.targets)
        .view(shape)
        .to_device(device);
    (inputs, targets)
}

/// Mean loss of `model` over `batches`, without gradients.
pub fn evaluate(model: &Llama, device: Device, batches: &[Batch]) -> f64 {
    let _guard = tch::no_grad_guard();
    if batches.is_empty() {
        return f64::NAN;
    }
    let total: f64 = batches
        .iter()
        .map(|b| {
            let (inputs, targets) = batch_tensors(b, device);
            model
                .loss(&inputs, &targets)
                .to_kind(Kind::Double)
                .double_value(&[])
        })
        .sum();
    total / batches.len() as f64
}

/// A model (no optimizer, no data stream) on `device` with the checkpoint's parameters,
/// for evaluation. The returned store owns the parameters.
pub fn model_from_checkpoint(
    ckpt: &Checkpoint,
    origin: &Path,
    device: Device,
) -> Result<(nn::VarStore, Llama)> {
    let vs = nn::VarStore::new(device);
    let model = Llama::new(&vs.root(), &ckpt.manifest.model);
    checkpoint::copy_into(
        &ckpt.model,
        &named_parameters(&vs),
        origin,
        ckpt.manifest.model.tie_embeddings,
    )?;
    Ok((vs, model))
}
