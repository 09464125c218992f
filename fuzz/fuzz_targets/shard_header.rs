#![no_main]
//! `shard_header`: see `gasloc_fuzz::shard_header` (fuzz/entry/src/lib.rs) and docs/fuzzing.md.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = gasloc_fuzz::shard_header(data);
});
