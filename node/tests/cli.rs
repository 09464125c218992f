//! `gasloc-node train` and `eval` as a user runs them: real processes, real files.

mod common;

use common::{byte_data, write_manifest, TINY_RUN};
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

#[test]
fn resuming_gives_exactly_the_losses_and_weights_of_a_straight_run() {
    let dir = tempfile::tempdir().unwrap();
    let (run_toml, _) = write_manifest(dir.path(), TINY_RUN);
    let data = byte_data(dir.path());
    let straight = dir.path().join("straight");
    let split = dir.path().join("split");

    let a = train(&run_toml, &data, &straight, 8, &[]);
    assert!(a.status.success(), "{}", stderr(&a));
    let b1 = train(&run_toml, &data, &split, 4, &[]);
    assert!(b1.status.success(), "{}", stderr(&b1));
    let b2 = train(&run_toml, &data, &split, 4, &["--resume"]);
    assert!(b2.status.success(), "{}", stderr(&b2));

    let straight_losses = losses(&stdout(&a));
    let mut split_losses = losses(&stdout(&b1));
    split_losses.extend(losses(&stdout(&b2)));
    assert_eq!(straight_losses.len(), 8);
    assert_eq!(straight_losses, split_losses);
    // Bit-identical parameters and optimizer moments after 8 steps either way.
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let x = std::fs::read(straight.join("step_00000008").join(file)).unwrap();
        let y = std::fs::read(split.join("step_00000008").join(file)).unwrap();
        assert!(
            x == y,
            "{file} differs between the straight and the resumed run"
        );
    }
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
    // And it still resumes.
    let again = train(&run_toml, &data, &ckpt, 1, &["--resume"]);
    assert!(again.status.success(), "{}", stderr(&again));
}
