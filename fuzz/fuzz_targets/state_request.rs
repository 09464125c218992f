#![no_main]
//! `state_request`: see `gasloc_fuzz::state_request` (fuzz/entry/src/lib.rs) and docs/fuzzing.md.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = gasloc_fuzz::state_request(data);
});
