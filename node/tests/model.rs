//! The model and trainer against plain reference computations and transformers.

mod common;

use common::{byte_data, write_manifest, TINY_RUN};
use gasloc_data::shards::TokenDataset;
use gasloc_data::stream::WorkerSlot;
use gasloc_node::checkpoint;
use gasloc_node::model::{apply_rope, causal_attention, rope_tables, Llama};
use gasloc_node::trainer::{model_from_checkpoint, named_parameters, Trainer};
use std::process::Command;
use std::sync::Arc;
use tch::{nn, Device, Kind, Tensor};

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn forward_shapes_and_parameter_count() {
    let dir = tempfile::tempdir().unwrap();
    let (_, manifest) = write_manifest(dir.path(), TINY_RUN);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Llama::new(&vs.root(), &manifest.model);
    let tokens = Tensor::randint(256, [3, 17], (Kind::Int64, Device::Cpu));
    let logits = model.forward(&tokens);
    assert_eq!(logits.size(), vec![3, 17, 256]);
    assert_eq!(logits.kind(), Kind::Float);
    let counted: i64 = named_parameters(&vs)
        .iter()
        .map(|(_, t)| t.numel() as i64)
        .sum();
    assert_eq!(counted as usize, manifest.model.parameter_count());
    let names: Vec<String> = named_parameters(&vs).into_iter().map(|(n, _)| n).collect();
    for expected in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} missing from {names:?}"
        );
    }
}

#[test]
fn rope_matches_the_elementwise_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let (_, manifest) = write_manifest(dir.path(), TINY_RUN);
    let c = &manifest.model;
    let hd = c.head_dim();
    let (cos, sin) = rope_tables(c, Device::Cpu);
    let seq = 9;
    let x = Tensor::randn([1, 2, seq, hd as i64], (Kind::Float, Device::Cpu));
    let got = apply_rope(&x, &cos.narrow(0, 0, seq), &sin.narrow(0, 0, seq));
    // Reference: pair element i with i + hd/2 and rotate the pair by pos · θ^(-2i/hd).
    let xs: Vec<f32> = Vec::try_from(x.flatten(0, -1)).unwrap();
    let mut expected = vec![0f32; xs.len()];
    let half = hd / 2;
    for head in 0..2 {
        for pos in 0..seq as usize {
            let base = (head * seq as usize + pos) * hd;
            for i in 0..half {
                let freq = 1.0 / c.rope_theta.powf(2.0 * i as f64 / hd as f64);
                let angle = pos as f64 * freq;
                let (a, b) = (xs[base + i] as f64, xs[base + i + half] as f64);
                expected[base + i] = (a * angle.cos() - b * angle.sin()) as f32;
                expected[base + i + half] = (b * angle.cos() + a * angle.sin()) as f32;
            }
        }
    }
    let expected = Tensor::from_slice(&expected).view([1, 2, seq, hd as i64]);
    assert!(max_abs_diff(&got, &expected) < 1e-5);
}

#[test]
fn grouped_query_attention_matches_the_plain_formula() {
    let (b, h, kvh, t, d) = (2, 4, 2, 7, 8);
    let q = Tensor::randn([b, h, t, d], (Kind::Float, Device::Cpu));
    let k = Tensor::randn([b, kvh, t, d], (Kind::Float, Device::Cpu));
    let v = Tensor::randn([b, kvh, t, d], (Kind::Float, Device::Cpu));
    let got = causal_attention(&q, &k, &v);
    // Reference: repeat each kv head for its query group, softmax(QKᵀ/√d + causal mask)·V.
    let k_full = k.repeat_interleave_self_int(h / kvh, 1, None);
    let v_full = v.repeat_interleave_self_int(h / kvh, 1, None);
    let scores = q.matmul(&k_full.transpose(-2, -1)) / (d as f64).sqrt();
    let future = Tensor::ones([t, t], (Kind::Bool, Device::Cpu)).triu(1);
    let scores = scores.masked_fill(&future, f64::NEG_INFINITY);
    let expected = scores.softmax(-1, Kind::Float).matmul(&v_full);
    assert_eq!(got.size(), vec![b, h, t, d]);
    assert!(max_abs_diff(&got, &expected) < 1e-5);
}

#[test]
fn loss_falls_on_tiny_data() {
    let dir = tempfile::tempdir().unwrap();
    let (_, manifest) = write_manifest(dir.path(), TINY_RUN);
    let data = Arc::new(TokenDataset::open(&byte_data(dir.path()), 256).unwrap());
    let slot = WorkerSlot { index: 0, count: 1 };
    let mut trainer = Trainer::new(&manifest, Device::Cpu, data, slot).unwrap();
    let first = trainer.step().unwrap().loss;
    assert!(
        (first - (256f64).ln()).abs() < 0.5,
        "initial loss {first} should be near ln 256"
    );
    let mut last = first;
    for _ in 0..59 {
        last = trainer.step().unwrap().loss;
    }
    assert!(last < first - 1.5, "loss went from {first} to {last}");
    assert_eq!(trainer.step_count(), 60);
}

#[test]
fn same_seed_same_model_and_losses() {
    let dir = tempfile::tempdir().unwrap();
    let (_, manifest) = write_manifest(dir.path(), TINY_RUN);
    let data = Arc::new(TokenDataset::open(&byte_data(dir.path()), 256).unwrap());
    let run = || {
        let slot = WorkerSlot { index: 0, count: 1 };
        let mut t = Trainer::new(&manifest, Device::Cpu, data.clone(), slot).unwrap();
        (0..3).map(|_| t.step().unwrap().loss).collect::<Vec<f64>>()
    };
    assert_eq!(run(), run());
}

/// Runs `node/tests/python/hf_parity.py` with the `.venv` Python; returns its stdout.
fn hf_parity(args: &[&std::path::Path], mode: &str) -> String {
    let python = std::env::var("GASLOC_PYTHON")
        .unwrap_or_else(|_| format!("{}/../.venv/bin/python", env!("CARGO_MANIFEST_DIR")));
    let script = format!("{}/tests/python/hf_parity.py", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(&python)
        .arg(&script)
        .arg(mode)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {python}: {e} (make setup installs it)"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "hf_parity.py {mode} failed:\n{stdout}\n{stderr}"
    );
    stdout
}

#[test]
fn checkpoints_and_transformers_agree_in_both_directions() {
    for tied in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let text = TINY_RUN.replace(
            "size = \"tiny\"",
            &format!("size = \"tiny\"\ntie_embeddings = {tied}"),
        );
        let (_, manifest) = write_manifest(dir.path(), &text);
        let data = Arc::new(TokenDataset::open(&byte_data(dir.path()), 256).unwrap());
        let slot = WorkerSlot { index: 0, count: 1 };
        let mut trainer = Trainer::new(&manifest, Device::Cpu, data, slot).unwrap();
        for _ in 0..5 {
            trainer.step().unwrap(); // move the weights away from their init
        }
        let root = dir.path().join("ckpt");
        let step_dir = checkpoint::save(&root, &trainer.checkpoint(), 1).unwrap();

        // gasloc → transformers: logits of the checkpoint as saved, not of the live trainer.
        let ckpt = checkpoint::load(&step_dir, None).unwrap();
        let (_vs, model) = model_from_checkpoint(&ckpt, &step_dir, Device::Cpu).unwrap();
        let tokens = Tensor::randint(256, [2, 24], (Kind::Int64, Device::Cpu));
        let logits = tch::no_grad(|| model.forward(&tokens));
        let reference = dir.path().join("reference.safetensors");
        checkpoint::write_tensors(
            &reference,
            &[
                ("tokens".into(), tokens.to_kind(Kind::Float)),
                ("logits".into(), logits),
            ],
        )
        .unwrap();
        let out = hf_parity(&[&step_dir, &reference], "check");
        assert!(out.contains("max_abs_diff="), "{out}");

        // transformers → gasloc: a plain HF directory (save_pretrained) loads with the
        // run manifest and gives transformers' logits.
        let hf_dir = dir.path().join("hf");
        hf_parity(&[&step_dir, &hf_dir, &reference], "export");
        assert!(!hf_dir.join("train_state.json").exists());
        let hf = checkpoint::load(&hf_dir, Some(&manifest)).unwrap();
        let (_vs, model) = model_from_checkpoint(&hf, &hf_dir, Device::Cpu).unwrap();
        let ours = tch::no_grad(|| model.forward(&tokens));
        let theirs = checkpoint::read_tensors(&hf_dir.join("hf_logits.safetensors"))
            .unwrap()
            .remove(0)
            .1;
        let diff = max_abs_diff(&ours, &theirs);
        assert!(
            diff < 1e-4,
            "tied={tied}: gasloc differs from transformers by {diff}"
        );
    }
}
