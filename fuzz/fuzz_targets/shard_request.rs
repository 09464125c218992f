#![no_main]
//! `shard_request`: see `gasloc_fuzz::shard_request` (fuzz/entry/src/lib.rs) and docs/fuzzing.md.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = gasloc_fuzz::shard_request(data);
});
