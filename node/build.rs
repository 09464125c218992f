//! Link-time settings for binaries and tests that use libtorch.
//!
//! * An rpath to torch's `lib/` folder, so `gasloc-node` runs without `LD_LIBRARY_PATH`.
//! * `libtorch_cuda` linked with `--no-as-needed` when the wheel ships it: otherwise the
//!   linker drops it (nothing references it directly) and `tch::Cuda::is_available()` is
//!   false even on a GPU machine.
//!
//! torch's location comes from the same Python that torch-sys asks
//! (`LIBTORCH_USE_PYTORCH=1`, `PYTHON_SYS_EXECUTABLE` or `python3`), or from `LIBTORCH`.

use std::path::PathBuf;
use std::process::Command;

fn torch_lib_dir() -> Option<PathBuf> {
    if let Ok(root) = std::env::var("LIBTORCH") {
        return Some(PathBuf::from(root).join("lib"));
    }
    let python = std::env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .args([
            "-c",
            "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(PathBuf::from(String::from_utf8(out.stdout).ok()?.trim()))
}

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=PYTHON_SYS_EXECUTABLE");
    let Some(lib) = torch_lib_dir() else {
        println!("cargo:warning=torch not found: binaries will need LD_LIBRARY_PATH");
        return;
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}
