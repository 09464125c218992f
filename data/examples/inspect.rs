//! Opens a prepared data directory the way the trainer does and shows what it holds:
//! token counts, the batch streams it allows, and the start of the validation text.
//!
//! ```text
//! cargo run -p gasloc-data --example inspect -- demo-data/shakespeare-gpt2 gpt2
//! ```

use gasloc_data::{BatchStream, TextTokenizer, TokenDataset, WorkerSlot};
use gasloc_proto::Tokenizer;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, tokenizer] = args.as_slice() else {
        eprintln!("usage: inspect <data dir> <gpt2|byte>");
        return ExitCode::FAILURE;
    };
    let tokenizer: Tokenizer = match tokenizer.parse() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match inspect(PathBuf::from(dir), tokenizer) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn inspect(dir: PathBuf, tokenizer: Tokenizer) -> Result<(), gasloc_data::DataError> {
    let data = Arc::new(TokenDataset::open(&dir, tokenizer.vocab_size())?);
    println!(
        "{}: {} training tokens in {} shards, {} validation tokens in {} shards",
        dir.display(),
        data.train_tokens(),
        data.train_shard_count(),
        data.val_tokens(),
        data.val_shards().len()
    );
    let stream = BatchStream::new(data.clone(), 256, 8, WorkerSlot::SOLE, 0)?;
    println!(
        "seq_len 256: {} training sequences per epoch",
        stream.train_windows()
    );
    if let Some(shard) = data.val_shards().first() {
        let tokens = shard.to_u32_vec();
        let text = TextTokenizer::from(tokenizer).decode(&tokens[..tokens.len().min(120)]);
        println!("validation text starts:\n{text}");
    }
    Ok(())
}
