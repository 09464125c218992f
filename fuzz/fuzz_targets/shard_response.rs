#![no_main]
//! `shard_response`: see `gasloc_fuzz::shard_response` (fuzz/entry/src/lib.rs) and docs/fuzzing.md.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = gasloc_fuzz::shard_response(data);
});
