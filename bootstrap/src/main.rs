//! `gasloc-bootstrap`: the always-on node that serves a run.
//!
//! For now it loads and validates a run manifest and prints its run id; the libp2p
//! swarm (Kademlia server, gossipsub, relay, manifest service) is built on top of this.

use anyhow::Result;
use clap::Parser;
use gasloc_proto::RunManifest;
use std::path::PathBuf;

#[derive(Parser)]
#[command(version, about = "gasloc bootstrap node")]
struct Args {
    /// The run manifest (TOML) this bootstrap node serves.
    #[arg(long)]
    run: PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let manifest = RunManifest::load(&args.run)?;
    println!("run_id={} name={}", manifest.run_id(), manifest.name);
    Ok(())
}
