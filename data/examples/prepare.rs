//! `data prepare` without the node: the same flags as `gasloc-node data prepare`, for
//! trying `deploy/demo-data.sh` or preparing data on a machine without libtorch.
//!
//! ```text
//! cargo run -p gasloc-data --example prepare -- \
//!     --input texts/ --out demo-data/x --tokenizer byte [--val-tokens N] [--shard-tokens N]
//! ```

use clap::Parser;
use gasloc_data::prepare::{DEFAULT_SHARD_TOKENS, DEFAULT_VAL_TOKENS};
use gasloc_data::{prepare, PrepareOptions};
use gasloc_proto::Tokenizer;
use std::path::PathBuf;
use std::process::ExitCode;

/// Tokenize text files into llm.c token shards.
#[derive(Parser)]
struct Args {
    /// Text files, or directories whose *.txt files (recursively) are read.
    #[arg(long, required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    /// Directory to create (must not exist, or be empty); it names the shards.
    #[arg(long)]
    out: PathBuf,
    /// gpt2 or byte.
    #[arg(long)]
    tokenizer: Tokenizer,
    /// Tokens at the start of the stream kept for validation.
    #[arg(long, default_value_t = DEFAULT_VAL_TOKENS)]
    val_tokens: usize,
    /// Most tokens per shard.
    #[arg(long, default_value_t = DEFAULT_SHARD_TOKENS)]
    shard_tokens: usize,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let options = PrepareOptions {
        inputs: args.input,
        out: args.out,
        tokenizer: args.tokenizer,
        val_tokens: args.val_tokens,
        shard_tokens: args.shard_tokens,
        progress: true,
    };
    match prepare(&options) {
        Ok(report) => {
            println!("prepared {report}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
