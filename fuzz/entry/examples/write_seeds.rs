//! Writes the honest inputs of `gasloc_fuzz::seeds` into `fuzz/corpus/<target>/` (the
//! fuzzer's starting points): `cargo run -p gasloc-fuzz --example write_seeds`.

fn main() -> std::io::Result<()> {
    let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus");
    for (target, name, data) in gasloc_fuzz::seeds() {
        let dir = corpus.join(target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(&name), data)?;
        println!("{target}/{name}");
    }
    Ok(())
}
