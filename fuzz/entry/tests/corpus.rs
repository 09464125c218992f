//! Replays every committed fuzz corpus (`fuzz/corpus/<target>/`) and every kept crash input
//! (`fuzz/regressions/<target>/`) through the fuzz targets' own entry points: what the
//! fuzzer found once stays guarded by `cargo test`. See docs/fuzzing.md.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The files of `dir`, sorted; `None` if it does not exist.
fn files(dir: &Path) -> Option<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .map(|e| e.expect("a readable corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    Some(files)
}

/// Runs `target` on the file, turning a panic into a failure that names the file.
fn replay(target: &str, file: &Path) -> bool {
    let data = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    match catch_unwind(AssertUnwindSafe(|| gasloc_fuzz::run(target, &data))) {
        Ok(Ok(accepted)) => accepted,
        Ok(Err(e)) => panic!("{e}"),
        Err(_) => panic!("{target} panicked on {}", file.display()),
    }
}

#[test]
fn every_corpus_file_decodes_or_is_refused_without_a_panic() {
    for target in gasloc_fuzz::TARGETS {
        let dir = fuzz_dir().join("corpus").join(target);
        let files = files(&dir).unwrap_or_else(|| panic!("corpus {} is missing", dir.display()));
        assert!(!files.is_empty(), "corpus {} is empty", dir.display());
        let accepted = files.iter().filter(|f| replay(target, f)).count();
        eprintln!("{target}: {} inputs, {accepted} accepted", files.len());
    }
}

#[test]
fn every_input_that_once_broke_a_decoder_is_refused() {
    let root = fuzz_dir().join("regressions");
    for target in gasloc_fuzz::TARGETS {
        for file in files(&root.join(target)).unwrap_or_default() {
            assert!(
                !replay(target, &file),
                "{target} accepted {}, which must be refused",
                file.display()
            );
        }
    }
}

#[test]
fn what_an_honest_peer_sends_is_accepted() {
    for (target, name, data) in gasloc_fuzz::seeds() {
        let accepted = catch_unwind(AssertUnwindSafe(|| gasloc_fuzz::run(target, &data)));
        assert!(
            matches!(accepted, Ok(Ok(true))),
            "{target}: seed {name} was not accepted"
        );
    }
}
