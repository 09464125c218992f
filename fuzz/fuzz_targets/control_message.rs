#![no_main]
//! `control_message`: see `gasloc_fuzz::control_message` (fuzz/entry/src/lib.rs) and docs/fuzzing.md.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = gasloc_fuzz::control_message(data);
});
