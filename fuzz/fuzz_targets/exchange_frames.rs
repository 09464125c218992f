#![no_main]
//! `exchange_frames`: see `gasloc_fuzz::exchange_frames` (fuzz/entry/src/lib.rs) and docs/fuzzing.md.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = gasloc_fuzz::exchange_frames(data);
});
