//! `gasloc-node train` and `eval` as a user runs them: real processes, real files.

mod common;

use common::{byte_data, write_manifest, TINY_RUN};
use gasloc_node::checkpoint;
use std::path::Path;
use std::process::{Command, Output};

fn node() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gasloc-node"))
}

fn run(cmd: &mut Command) -> Output {
    cmd.env("RUST_LOG", "warn")
        .output()
        .expect("gasloc-node runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `train` with the common flags; `extra` appended.
fn train(run_toml: &Path, data: &Path, ckpt: &Path, steps: u64, extra: &[&str]) -> Output {
    let steps = steps.to_string();
    let device: &[&str] = if extra.contains(&"--device") {
        &[]
    } else {
        &["--device", "cpu"]
    };
    run(node()
        .args(["train", "--threads", "1", "--log-interval", "1"])
        .args(device)
        .args(["--steps", &steps])
        .arg("--run")
        .arg(run_toml)
        .arg("--data")
        .arg(data)
        .arg("--checkpoint-dir")
        .arg(ckpt)
        .args(extra))
}

/// The `loss=` values of the per-step log lines.
fn losses(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.contains(" loss="))
        .map(|l| {
            l.split_whitespace()
                .find_map(|kv| kv.strip_prefix("loss="))
                .unwrap()
                .to_string()
        })
        .collect()
}

fn assert_fails_with(o: &Output, needle: &str) {
    assert!(
        !o.status.success(),
        "expected failure, got success:\n{}",
        stdout(o)
    );
    let err = stderr(o);
    assert!(
        err.contains(needle),
        "error should mention {needle:?}:\n{err}"
    );
    assert!(
        !err.contains("panicked"),
        "a panic is not an error message:\n{err}"
    );
}

/// Trains 8 steps straight and 4 + 4 with `--resume` under `dir`; asserts the same losses
/// and bit-identical parameters and optimizer state after 8 steps either way. Returns the
/// two checkpoint roots.
fn assert_resume_is_exact(
    run_toml: &Path,
    data: &Path,
    dir: &Path,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let (straight, split) = (dir.join("straight"), dir.join("split"));
    let a = train(run_toml, data, &straight, 8, &[]);
    assert!(a.status.success(), "{}", stderr(&a));
    let b1 = train(run_toml, data, &split, 4, &[]);
    assert!(b1.status.success(), "{}", stderr(&b1));
    let b2 = train(run_toml, data, &split, 4, &["--resume"]);
    assert!(b2.status.success(), "{}", stderr(&b2));
    let straight_losses = losses(&stdout(&a));
    let mut split_losses = losses(&stdout(&b1));
    split_losses.extend(losses(&stdout(&b2)));
    assert_eq!(straight_losses.len(), 8);
    assert_eq!(straight_losses, split_losses);
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let x = std::fs::read(straight.join("step_00000008").join(file)).unwrap();
        let y = std::fs::read(split.join("step_00000008").join(file)).unwrap();
        assert!(
            x == y,
            "{file} differs between the straight and the resumed run"
        );
    }
    (straight, split)
}

#[test]
fn resuming_gives_exactly_the_losses_and_weights_of_a_straight_run() {
    let dir = tempfile::tempdir().unwrap();
    let (run_toml, _) = write_manifest(dir.path(), TINY_RUN);
    let data = byte_data(dir.path());
    let (straight, split) = assert_resume_is_exact(&run_toml, &data, dir.path());
    // eval is deterministic and reads the checkpoint root through `latest`.
    let eval = |path: &Path| {
        let o = run(node()
            .args(["eval", "--device", "cpu", "--batches", "2", "--checkpoint"])
            .arg(path)
            .arg("--data")
            .arg(&data));
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let e1 = eval(&straight);
    assert!(e1.starts_with("val_loss="), "{e1}");
    assert_eq!(e1, eval(&straight.join("step_00000008")));
    assert_eq!(e1, eval(&split));
}

#[test]
fn resuming_lordo_gives_exactly_the_state_of_a_straight_run() {
    // LoRDO at rank 4 in the authors' regime, switching at step 3 (0.015 of 200 decay
    // steps): the checkpoint of step 4 holds the low-rank moments, the bases and the error
    // buffers, and the resumed run is past the switch (betas, lr, ω restored from the step).
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "{TINY_RUN}\n[outer]\ninner_optimizer = \"lordo\"\n[lordo]\nrank = 4\nomega = 0.9\n\
         regime = \"authors\"\nswitch_fraction = 0.015\n"
    );
    let (run_toml, _) = write_manifest(dir.path(), &text);
    let data = byte_data(dir.path());
    let (_, split) = assert_resume_is_exact(&run_toml, &data, dir.path());
    let saved =
        checkpoint::read_tensors(&split.join("step_00000004").join("optimizer.safetensors"))
            .unwrap();
    let name = "model.layers.0.self_attn.q_proj.weight";
    for prefix in ["basis", "error", "exp_avg", "exp_avg_sq"] {
        assert!(
            saved.iter().any(|(n, _)| *n == format!("{prefix}.{name}")),
            "the checkpoint holds {prefix}.{name}"
        );
    }

    // A LoRDO state that does not match the manifest (a basis of another rank) is refused,
    // naming the tensor, and the checkpoint is left as it was.
    let path = split.join("step_00000008").join("optimizer.safetensors");
    let mut tensors = checkpoint::read_tensors(&path).unwrap();
    let basis = format!("basis.{name}");
    let entry = tensors.iter_mut().find(|(n, _)| *n == basis).unwrap();
    entry.1 = entry.1.narrow(1, 0, 2).contiguous();
    checkpoint::write_tensors(&path, &tensors).unwrap();
    let before = std::fs::read(&path).unwrap();
    let c = train(&run_toml, &data, &split, 1, &["--resume"]);
    assert_fails_with(&c, &basis);
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

#[test]
fn train_logs_steps_and_validation_and_keeps_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let (run_toml, _) = write_manifest(dir.path(), TINY_RUN);
    let data = byte_data(dir.path());
    let ckpt = dir.path().join("ckpt");
    let o = train(
        &run_toml,
        &data,
        &ckpt,
        20,
        &["--checkpoint-every", "5", "--keep-checkpoints", "2"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for key in [
        "step=1 ",
        "loss=",
        "lr=",
        "tokens_per_s=",
        "step=10 val_loss=",
        "step=20 val_loss=",
    ] {
        assert!(out.contains(key), "missing {key:?} in:\n{out}");
    }
    let mut dirs: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    assert_eq!(dirs, ["latest", "step_00000015", "step_00000020"]);
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap(),
        "step_00000020"
    );
    // A second plain run would overwrite the model: refused.
    let again = train(&run_toml, &data, &ckpt, 1, &[]);
    assert_fails_with(&again, "--resume");
}

#[test]
fn bad_flags_and_files_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (run_toml, _) = write_manifest(dir.path(), TINY_RUN);
    let data = byte_data(dir.path());
    let ckpt = dir.path().join("ckpt");

    assert_fails_with(
        &train(&run_toml, &data, &ckpt, 1, &["--device", "tpu"]),
        "--device",
    );
    assert_fails_with(
        &train(&run_toml, &data, &ckpt, 1, &["--device", "cuda"]),
        "CUDA",
    );
    assert_fails_with(
        &train(&run_toml, &data, &ckpt, 1, &["--resume"]),
        "no checkpoint",
    );

    let missing = dir.path().join("nowhere");
    assert_fails_with(&train(&run_toml, &missing, &ckpt, 1, &[]), "nowhere");

    let bad_run = dir.path().join("bad.toml");
    std::fs::write(&bad_run, TINY_RUN.replace("seq_len", "sequence_length")).unwrap();
    assert_fails_with(&train(&bad_run, &data, &ckpt, 1, &[]), "sequence_length");

    // A shard cut short.
    let truncated = dir.path().join("truncated");
    std::fs::create_dir_all(&truncated).unwrap();
    for entry in std::fs::read_dir(&data).unwrap() {
        let p = entry.unwrap().path();
        let bytes = std::fs::read(&p).unwrap();
        let keep = if p.to_string_lossy().contains("_train_") {
            bytes.len() - 100
        } else {
            bytes.len()
        };
        std::fs::write(truncated.join(p.file_name().unwrap()), &bytes[..keep]).unwrap();
    }
    assert_fails_with(
        &train(&run_toml, &truncated, &ckpt, 1, &[]),
        "test_train_000000.bin",
    );
    assert!(
        !ckpt.exists(),
        "a failed start must not leave a checkpoint directory"
    );

    // A checkpoint of another shape.
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    let (other_run, _) = write_manifest(
        &other,
        &TINY_RUN.replace("size = \"tiny\"", "size = \"tiny\"\nd_model = 32"),
    );
    let o = train(&other_run, &data, &other.join("ckpt"), 1, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let init = other.join("ckpt").to_string_lossy().into_owned();
    assert_fails_with(
        &train(&run_toml, &data, &ckpt, 1, &["--init-from", &init]),
        "shape",
    );
    assert_fails_with(
        &run(node()
            .args(["eval", "--device", "cpu", "--run"])
            .arg(&run_toml)
            .arg("--checkpoint")
            .arg(&init)
            .arg("--data")
            .arg(&data)),
        "shape",
    );
}

#[test]
fn a_write_failure_keeps_the_previous_checkpoint_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (run_toml, _) = write_manifest(dir.path(), TINY_RUN);
    let data = byte_data(dir.path());
    let ckpt = dir.path().join("ckpt");
    let first = train(&run_toml, &data, &ckpt, 2, &[]);
    assert!(first.status.success(), "{}", stderr(&first));
    let before = std::fs::read(ckpt.join("step_00000002/model.safetensors")).unwrap();

    // Resume under a 64 KiB file-size limit: writing the next checkpoint fails part way,
    // as on a full disk (EFBIG instead of ENOSPC; SIGXFSZ is ignored so write() errs).
    let script = format!(
        "trap '' XFSZ; ulimit -f 64; exec \"$0\" train --device cpu --threads 1 --steps 1 --resume \
         --run '{}' --data '{}' --checkpoint-dir '{}'",
        run_toml.display(),
        data.display(),
        ckpt.display()
    );
    let o = run(Command::new("bash")
        .args(["-c", &script])
        .arg(env!("CARGO_BIN_EXE_gasloc-node")));
    assert_fails_with(&o, "writing checkpoint");
    let entries: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !entries.iter().any(|e| e.starts_with(".tmp")),
        "temporary left behind: {entries:?}"
    );
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap(),
        "step_00000002"
    );
    let after = std::fs::read(ckpt.join("step_00000002/model.safetensors")).unwrap();
    assert!(before == after, "the previous checkpoint changed");
    // And it still resumes; the next save also clears what a killed writer left behind.
    let crashed = ckpt.join(".tmp-step_00000003-999999");
    std::fs::create_dir_all(&crashed).unwrap();
    std::fs::write(crashed.join("model.safetensors"), b"half").unwrap();
    let again = train(&run_toml, &data, &ckpt, 1, &["--resume"]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(!crashed.exists());
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap(),
        "step_00000003"
    );
}

/// `sim` with the common flags; `extra` appended.
fn sim(run_toml: &Path, data: &Path, out: &Path, extra: &[&str]) -> Output {
    run(node()
        .args(["sim", "--threads", "1", "--workers", "3", "--rounds", "2"])
        .arg("--run")
        .arg(run_toml)
        .arg("--data")
        .arg(data)
        .arg("--out")
        .arg(out)
        .args(extra))
}

#[test]
fn sim_writes_per_round_records_a_summary_and_a_plot() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!("{TINY_RUN}\n[outer]\ntopology = \"two-peer\"\ninner_steps = 2\n");
    let (run_toml, _) = write_manifest(dir.path(), &text);
    let data = byte_data(dir.path());
    let out = dir.path().join("sim");
    let o = sim(
        &run_toml,
        &data,
        &out,
        &["--straggler", "1:0.2", "--target-loss", "100"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        stdout(&o)
            .lines()
            .filter(|l| l.starts_with("round="))
            .count(),
        2
    );
    let rounds = std::fs::read_to_string(out.join("rounds.csv")).unwrap();
    assert_eq!(rounds.lines().count(), 3, "{rounds}");
    let workers = std::fs::read_to_string(out.join("workers.csv")).unwrap();
    assert_eq!(workers.lines().count(), 1 + 2 * 3, "{workers}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("rounds.json")).unwrap()).unwrap();
    assert_eq!(json["rounds"].as_array().unwrap().len(), 2);
    assert_eq!(json["stragglers"][0], "1:0.2");
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(summary.contains("| final validation loss |"), "{summary}");
    assert!(
        summary.contains("simulated time to val loss ≤ 100"),
        "{summary}"
    );
    let svg = std::fs::read_to_string(out.join("loss.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("polyline"), "{svg}");
}

#[test]
fn sim_refuses_bad_flags_and_manifests_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let (run_toml, _) = write_manifest(dir.path(), TINY_RUN);
    let data = byte_data(dir.path());
    let out = dir.path().join("sim");
    assert_fails_with(
        &sim(&run_toml, &data, &out, &["--straggler", "1"]),
        "WORKER:FRACTION",
    );
    assert_fails_with(
        &sim(&run_toml, &data, &out, &["--straggler", "7:0.5"]),
        "worker 7",
    );
    assert_fails_with(
        &sim(&run_toml, &data, &out, &["--straggler", "1:2"]),
        "(0, 1]",
    );
    assert_fails_with(
        &sim(&run_toml, &data, &out, &["--bandwidth-mbps", "0"]),
        "--bandwidth-mbps",
    );
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        format!("{TINY_RUN}\n[outer]\nalgorithm = \"diloco\"\ntopology = \"ring\"\n"),
    )
    .unwrap();
    assert_fails_with(&sim(&bad, &data, &out, &[]), "outer.topology");
}
