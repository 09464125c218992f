//! Helpers for end-to-end tests: locating the workspace's built binaries.

use std::path::PathBuf;

/// The path of a binary built by `cargo build` in this workspace's target folder
/// (`target/<profile>/<name>`), found from the running test executable.
pub fn built_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test-binary>
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binary lives in target/<profile>/deps");
    let path = profile_dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace` first (make test does)",
        path.display()
    );
    path
}
