//! Benchmark: goodput of whole-shard downloads over `/gasloc/shard/1` ([`ShardFetcher`]
//! asking one or more peers that serve with [`ShardService`]) against a raw tokio TCP copy
//! of the same bytes. Driven by `bench/shard_fetch`, which runs the processes in network
//! namespaces joined by `tc tbf`-shaped links.
//!
//! Goodput = shard bytes / seconds from the first request (the fetcher is already
//! connected to its peers) until the last shard is in place. For the fetch that includes
//! what a node's download does: listing the peers, one request per chunk, writing each
//! chunk into `<name>.part`, and, per shard, fsync, SHA-256 verification and the rename.
//! The raw reference sends the shard files back to back on one TCP stream, and the receiver
//! writes them into files of the same names (no hashing, no fsync). Both results are checked
//! against the table after the clock stops.
//!
//! - `prepare --dir D --shards K --bytes-per-shard N`: writes K pinned shards of random
//!   byte-tokenizer tokens (the last one a validation shard: a pinned run needs one) and
//!   their table, `D/shards.json`.
//! - `serve --dir D --listen <multiaddr>... --addr-file F`: one libp2p node per `--listen`
//!   (the project's `network::start` with `local_config`), each serving D's shards with
//!   `ShardService` (default limits, no per-peer rate); F gets their full addresses, one a
//!   line. Runs until killed.
//! - `fetch --peer <multiaddr>... --dir D --out O [--chunk-bytes C] [--parallel-shards P]
//!   [--label L] [--link-mbit R]`: a node that fetches every shard of D's table into the
//!   empty directory O from the given peers at once (defaults: the node's `FetchConfig`).
//! - `tcp-serve --dir D --listen IP:PORT --addr-file F` (serves one connection, then exits)
//!   and `tcp-fetch --peer IP:PORT --dir D --out O [--link-mbit R]`: the raw reference.
//!
//! Every measuring mode prints one line `<label> bytes=… seconds=… goodput_Mbit_s=…` (and
//! `goodput_over_link_rate=…` with `--link-mbit`).

use anyhow::{anyhow, bail, Context, Result};
use gasloc_data::pin::{expected_shard_bytes, pin_directory, verify_directory};
use gasloc_data::{write_shard, TokenWidth};
use gasloc_p2p::local_swarm::local_config;
use gasloc_p2p::network::{self, Network};
use gasloc_p2p::shard_fetch::{FetchConfig, FetchProgress, ShardFetcher, ShardSource};
use gasloc_p2p::shard_service::{ShardCatalog, ShardServeConfig, ShardService};
use gasloc_proto::{RunId, ShardEntry, Tokenizer};
use libp2p::identity::Keypair;
use libp2p::{Multiaddr, PeerId};
use rand::{RngCore, SeedableRng};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const RUN_ID: RunId = RunId::from_bytes([0x5B; 32]);
const TABLE: &str = "shards.json";

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Every value given for a repeatable flag.
fn args_of(args: &[String], name: &str) -> Vec<String> {
    args.windows(2)
        .filter(|w| w[0] == name)
        .map(|w| w[1].clone())
        .collect()
}

fn required(args: &[String], name: &str) -> Result<String> {
    arg(args, name).ok_or_else(|| anyhow!("missing {name}"))
}

fn parsed<T: std::str::FromStr>(args: &[String], name: &str) -> Result<Option<T>>
where
    T::Err: std::fmt::Display,
{
    arg(args, name)
        .map(|s| s.parse().map_err(|e| anyhow!("{name} {s:?}: {e}")))
        .transpose()
}

fn read_table(dir: &Path) -> Result<Vec<ShardEntry>> {
    let path = dir.join(TABLE);
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    Ok(serde_json::from_str(&text)?)
}

fn total_bytes(table: &[ShardEntry]) -> u64 {
    table.iter().map(|e| e.bytes).sum()
}

fn report(label: &str, bytes: u64, seconds: f64, link_mbit: Option<f64>, extra: &str) {
    let mbit = bytes as f64 * 8.0 / seconds / 1e6;
    let mut line = format!(
        "{label:<18} bytes={bytes} seconds={seconds:.2} goodput_Mbit_s={mbit:.1} goodput_MiB_s={:.2}",
        bytes as f64 / seconds / (1 << 20) as f64
    );
    if let Some(link) = link_mbit {
        line += &format!(" goodput_over_link_rate={:.3}", mbit / link);
    }
    line += extra;
    println!("{line}");
}

/// An empty directory to fetch into.
fn empty_out(out: &Path) -> Result<()> {
    std::fs::create_dir_all(out)?;
    if std::fs::read_dir(out)?.next().is_some() {
        bail!("{} is not empty", out.display());
    }
    Ok(())
}

fn prepare(dir: &Path, shards: usize, bytes_per_shard: u64) -> Result<()> {
    if shards < 2 {
        bail!("--shards must be at least 2 (a pinned run has a validation shard)");
    }
    std::fs::create_dir_all(dir)?;
    let header = expected_shard_bytes(0, Tokenizer::Byte);
    let per_token = expected_shard_bytes(1, Tokenizer::Byte) - header;
    let tokens = (bytes_per_shard.saturating_sub(header) / per_token).max(1) as usize;
    let width = TokenWidth::for_vocab(Tokenizer::Byte.vocab_size());
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5EED);
    let mut raw = vec![0u8; tokens];
    for i in 0..shards {
        rng.fill_bytes(&mut raw);
        let tokens: Vec<u32> = raw.iter().map(|&b| b as u32).collect();
        let name = if i + 1 < shards {
            format!("bench_train_{i:06}.bin")
        } else {
            "bench_val_000000.bin".to_string()
        };
        write_shard(&dir.join(name), &tokens, width)?;
    }
    let table = pin_directory(dir, Tokenizer::Byte)?;
    std::fs::write(dir.join(TABLE), serde_json::to_string_pretty(&table)?)?;
    println!(
        "prepared {} shards, {} bytes, in {}",
        table.len(),
        total_bytes(&table),
        dir.display()
    );
    Ok(())
}

async fn serve(dir: &Path, listen: &[String], addr_file: &Path) -> Result<()> {
    let table = read_table(dir)?;
    verify_directory(dir, &table)?;
    let catalog = ShardCatalog::new();
    for entry in &table {
        catalog.insert(entry.clone(), dir.join(&entry.name));
    }
    let mut nodes = Vec::new();
    let mut lines = Vec::new();
    for listen in listen {
        let network = network::start(
            Keypair::generate_ed25519(),
            local_config(listen.parse()?, vec![]),
        )
        .await?;
        let service = ShardService::start(
            network.client.stream_control(),
            catalog.clone(),
            ShardServeConfig::new(RUN_ID),
        )?;
        lines.push(format!(
            "{}/p2p/{}",
            network.listen_addrs[0],
            network.client.peer_id()
        ));
        nodes.push((network, service));
    }
    // Written at once, so that a reader never sees half the file.
    let temp = addr_file.with_extension("tmp");
    std::fs::write(&temp, lines.join("\n") + "\n")?;
    std::fs::rename(&temp, addr_file)?;
    loop {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
}

async fn wait_connected(network: &Network, peers: &[PeerId]) -> Result<()> {
    for _ in 0..600 {
        let connected = network.client.connected_peers().await?;
        if peers.iter().all(|p| connected.contains(p)) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("not connected to all of {peers:?} within 30 s")
}

async fn fetch(args: &[String]) -> Result<()> {
    let dir = PathBuf::from(required(args, "--dir")?);
    let out = PathBuf::from(required(args, "--out")?);
    let label = arg(args, "--label").unwrap_or_else(|| "gasloc_fetch".into());
    let link_mbit: Option<f64> = parsed(args, "--link-mbit")?;
    let peer_addrs: Vec<Multiaddr> = args_of(args, "--peer")
        .iter()
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    if peer_addrs.is_empty() {
        bail!("give at least one --peer");
    }
    let peers: Vec<PeerId> = peer_addrs
        .iter()
        .map(|a| network::peer_id_of(a).context("a --peer address ends in /p2p/<id>"))
        .collect::<Result<_>>()?;
    let table = read_table(&dir)?;
    empty_out(&out)?;
    let mut config = FetchConfig::new(RUN_ID, vec![]);
    if let Some(chunk) = parsed(args, "--chunk-bytes")? {
        config.chunk_bytes = chunk;
    }
    if let Some(parallel) = parsed(args, "--parallel-shards")? {
        config.parallel_shards = parallel;
    }
    let (chunk, parallel) = (config.chunk_bytes, config.parallel_shards);
    // The fetcher listens on the transport of its first peer only.
    let quic = peer_addrs[0].to_string().contains("/quic");
    let listen: Multiaddr = if quic {
        "/ip4/0.0.0.0/udp/0/quic-v1".parse()?
    } else {
        "/ip4/0.0.0.0/tcp/0".parse()?
    };
    let network = network::start(
        Keypair::generate_ed25519(),
        local_config(listen, peer_addrs),
    )
    .await?;
    wait_connected(&network, &peers).await?;
    let fetcher = ShardFetcher::new(network.client.stream_control(), config);
    let asked = peers.clone();
    let start = Instant::now();
    let fetched = tokio::time::timeout(
        Duration::from_secs(1800),
        fetcher.fetch(
            &table,
            &out,
            move || asked.clone(),
            None,
            FetchProgress::new(),
        ),
    )
    .await
    .context("fetch not done in 30 minutes")??;
    let seconds = start.elapsed().as_secs_f64();
    verify_directory(&out, &table)?;
    if !fetched.bad_sources.is_empty() {
        bail!("bad sources: {:?}", fetched.bad_sources);
    }
    let mut by_peer: HashMap<PeerId, usize> = HashMap::new();
    for shard in &fetched.shards {
        if let Some(ShardSource::Peer(p)) = &shard.source {
            *by_peer.entry(*p).or_default() += 1;
        }
    }
    let per_peer: Vec<String> = peers
        .iter()
        .map(|p| by_peer.get(p).copied().unwrap_or(0).to_string())
        .collect();
    report(
        &label,
        total_bytes(&table),
        seconds,
        link_mbit,
        &format!(
            " peers={} shards={} shards_per_peer={} chunk_bytes={chunk} parallel_shards={parallel} transport={}",
            peers.len(),
            table.len(),
            per_peer.join("/"),
            if quic { "quic" } else { "tcp" }
        ),
    );
    network.client.shutdown().await;
    Ok(())
}

async fn tcp_serve(dir: &Path, listen: &str, addr_file: &Path) -> Result<()> {
    let table = read_table(dir)?;
    let listener = TcpListener::bind(listen).await?;
    let temp = addr_file.with_extension("tmp");
    std::fs::write(&temp, format!("{}\n", listener.local_addr()?))?;
    std::fs::rename(&temp, addr_file)?;
    let (mut socket, _) = listener.accept().await?;
    socket.set_nodelay(true)?;
    let mut buf = vec![0u8; 1 << 20];
    for entry in &table {
        let mut file = tokio::fs::File::open(dir.join(&entry.name)).await?;
        loop {
            let n = file.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            socket.write_all(&buf[..n]).await?;
        }
    }
    socket.shutdown().await?;
    // Until the receiver has read everything and closed its side.
    let _ = socket.read(&mut buf).await;
    Ok(())
}

async fn tcp_fetch(args: &[String]) -> Result<()> {
    let dir = PathBuf::from(required(args, "--dir")?);
    let out = PathBuf::from(required(args, "--out")?);
    let peer = required(args, "--peer")?;
    let link_mbit: Option<f64> = parsed(args, "--link-mbit")?;
    let table = read_table(&dir)?;
    empty_out(&out)?;
    let mut buf = vec![0u8; 1 << 20];
    let start = Instant::now();
    let mut socket = TcpStream::connect(&peer).await?;
    socket.set_nodelay(true)?;
    for entry in &table {
        let mut file = tokio::fs::File::create(out.join(&entry.name)).await?;
        let mut left = entry.bytes;
        while left > 0 {
            let want = left.min(buf.len() as u64) as usize;
            let n = socket.read(&mut buf[..want]).await?;
            if n == 0 {
                bail!(
                    "the raw stream ended {left} bytes before the end of {}",
                    entry.name
                );
            }
            file.write_all(&buf[..n]).await?;
            left -= n as u64;
        }
        file.flush().await?;
    }
    let seconds = start.elapsed().as_secs_f64();
    drop(socket);
    verify_directory(&out, &table)?;
    report(
        "raw_tcp",
        total_bytes(&table),
        seconds,
        link_mbit,
        &format!(" shards={}", table.len()),
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().collect();
    let path = |name: &str| required(&args, name).map(PathBuf::from);
    match args.get(1).map(String::as_str) {
        Some("prepare") => prepare(
            &path("--dir")?,
            parsed(&args, "--shards")?.unwrap_or(3),
            parsed(&args, "--bytes-per-shard")?.unwrap_or(40_000_000),
        ),
        Some("serve") => {
            let listen = args_of(&args, "--listen");
            if listen.is_empty() {
                bail!("give at least one --listen");
            }
            serve(&path("--dir")?, &listen, &path("--addr-file")?).await
        }
        Some("fetch") => fetch(&args).await,
        Some("tcp-serve") => {
            tcp_serve(
                &path("--dir")?,
                &required(&args, "--listen")?,
                &path("--addr-file")?,
            )
            .await
        }
        Some("tcp-fetch") => tcp_fetch(&args).await,
        _ => bail!(
            "usage: shard_fetch prepare|serve|fetch|tcp-serve|tcp-fetch … (see the module doc)"
        ),
    }
}
