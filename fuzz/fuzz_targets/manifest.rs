#![no_main]
//! `manifest`: see `gasloc_fuzz::manifest` (fuzz/entry/src/lib.rs) and docs/fuzzing.md.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = gasloc_fuzz::manifest(data);
});
