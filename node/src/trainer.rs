//! The local trainer: one model, its AdamW state and one worker's data stream.
//!
//! `Trainer::step` is one optimizer step (gradient accumulation over micro-batches,
//! global-norm clipping, scheduled learning rate). A trainer is built fresh from the run's
//! seed, from a gasloc checkpoint (exact resume: parameters, moments, step, data cursor),
//! or from a plain Hugging Face directory (`--init-from`: parameters only).
//!
//! libtorch work is synchronous and heavy: callers on an async runtime run it on a
//! dedicated thread.

use crate::checkpoint::{self, Checkpoint, TrainState};
use crate::model::Llama;
use crate::optim::{AdamW, LrSchedule};
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
    optimizer: AdamW,
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
        let optimizer = AdamW::new(&manifest.optimizer, params);
        let stream = BatchStream::new(
            data,
            manifest.data.seq_len,
            manifest.data.micro_batch,
            slot,
            manifest.seed,
        )?;
        Ok(Trainer {
            run_id: manifest.run_id(),
            manifest: manifest.clone(),
            device,
            slot,
            _vs: vs,
            model,
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
        let Some(state) = &ckpt.state else {
            bail!(
                "{} holds a model but no gasloc train state: use --init-from to start from it",
                dir.display()
            );
        };
        if state.run_id != manifest.run_id() {
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
        let mut trainer = Trainer::new(manifest, device, data, slot)?;
        trainer.load_parameters(&ckpt, &dir)?;
        let targets: Vec<(String, Tensor)> = trainer
            .optimizer
            .params()
            .iter()
            .flat_map(|p| {
                [
                    (format!("exp_avg.{}", p.name), p.exp_avg.shallow_clone()),
                    (
                        format!("exp_avg_sq.{}", p.name),
                        p.exp_avg_sq.shallow_clone(),
                    ),
                ]
            })
            .collect();
        let sources: Vec<(String, Tensor)> = ckpt
            .moments
            .iter()
            .flat_map(|(name, m, v)| {
                [
                    (format!("exp_avg.{name}"), m.shallow_clone()),
                    (format!("exp_avg_sq.{name}"), v.shallow_clone()),
                ]
            })
            .collect();
        checkpoint::copy_into(&sources, &targets, &dir, false)?;
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
            .optimizer
            .params()
            .iter()
            .map(|p| (p.name.clone(), p.param.shallow_clone()))
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

    /// One optimizer step over `grad_accum` micro-batches of this worker's stream.
    pub fn step(&mut self) -> Result<StepReport> {
        let accum = self.manifest.data.grad_accum;
        let mut loss_sum = 0.0;
        let mut tokens = 0;
        for _ in 0..accum {
            let batch = self.stream.next_batch();
            tokens += batch.rows * batch.seq_len;
            let (inputs, targets) = self.to_device(&batch);
            let loss = self.model.loss(&inputs, &targets);
            (&loss / accum as f64).backward();
            loss_sum += loss.double_value(&[]);
        }
        let loss = loss_sum / accum as f64;
        let step = self.optimizer.steps();
        if !loss.is_finite() {
            self.optimizer.zero_grad();
            bail!("training diverged: the loss of step {} is {loss}", step + 1);
        }
        let grad_norm = self
            .optimizer
            .clip_grad_norm(self.manifest.optimizer.grad_clip);
        let lr = self.schedule.at(step);
        self.optimizer.step(lr);
        self.optimizer.zero_grad();
        Ok(StepReport {
            step: step + 1,
            loss,
            lr,
            grad_norm,
            tokens,
        })
    }

    /// Mean loss over `batches` (no gradients).
    pub fn evaluate(&self, batches: &[Batch]) -> f64 {
        evaluate(&self.model, self.device, batches)
    }

    /// The current state as a checkpoint (tensors copied to the CPU).
    pub fn checkpoint(&self) -> Checkpoint {
        let to_cpu = |t: &Tensor| t.detach().to_device(Device::Cpu);
        let params = self.optimizer.params();
        Checkpoint {
            manifest: self.manifest.clone(),
            model: params
                .iter()
                .map(|p| (p.name.clone(), to_cpu(&p.param)))
                .collect(),
            moments: params
                .iter()
                .map(|p| (p.name.clone(), to_cpu(&p.exp_avg), to_cpu(&p.exp_avg_sq)))
                .collect(),
            state: Some(TrainState::new(
                self.run_id.clone(),
                self.optimizer.steps(),
                &self.slot,
                self.stream.cursor(),
            )),
        }
    }

    fn to_device(&self, batch: &Batch) -> (Tensor, Tensor) {
        batch_tensors(batch, self.device)
    }
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
