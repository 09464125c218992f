//! `gasloc-bootstrap`: the always-on node that serves a run.
//!
//! It is a Kademlia server, a gossipsub member of the run's topic (it validates and
//! forwards control messages), runs identify/ping, a relay server and an AutoNAT server
//! for volunteers behind NAT, and serves the run manifest with the round timing on
//! `/gasloc/manifest/1`. Several bootstrap nodes can serve one run: give them the same
//! manifest and the same `--genesis-unix-ms`.

use anyhow::{bail, Context, Result};
use clap::Parser;
use gasloc_p2p::config::{NetworkConfig, Role};
use gasloc_p2p::network::{self, unix_ms, NetworkEvent};
use gasloc_p2p::schedule::Timing;
use gasloc_proto::topology::Topology;
use gasloc_proto::wire::ManifestResponse;
use gasloc_proto::RunManifest;
use libp2p::Multiaddr;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(version, about = "gasloc bootstrap node")]
struct Args {
    /// The run manifest (TOML) this bootstrap node serves.
    #[arg(long)]
    run: PathBuf,
    /// Addresses to listen on. Repeatable.
    #[arg(long = "listen", default_values = ["/ip4/0.0.0.0/udp/4001/quic-v1", "/ip4/0.0.0.0/tcp/4001"])]
    listen: Vec<Multiaddr>,
    /// Identity key file (created with mode 0600 if missing); a fresh key when absent.
    #[arg(long)]
    identity: Option<PathBuf>,
    /// Write the full listen addresses (one per line, with /p2p/<peer id>) to this file.
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// Another bootstrap node of the same run to connect to. Repeatable.
    #[arg(long = "peer")]
    peers: Vec<Multiaddr>,
    /// Start of round 0 (ms since the Unix epoch). Default: now + --genesis-delay-ms.
    #[arg(long)]
    genesis_unix_ms: Option<u64>,
    /// Delay from start to round 0 when --genesis-unix-ms is absent.
    #[arg(long, default_value_t = 5000)]
    genesis_delay_ms: u64,
    /// Round period in milliseconds.
    #[arg(long, default_value_t = 60_000)]
    round_period_ms: u64,
    /// Commit window in milliseconds: members publish their commits for a round this long
    /// before it starts (at most one round period).
    #[arg(long, default_value_t = 5_000)]
    commit_window_ms: u64,
    /// Reveal window in milliseconds: reveals are published when a round starts and the
    /// round is decided this long after (shorter than a round period).
    #[arg(long, default_value_t = 5_000)]
    reveal_window_ms: u64,
    /// Exchange timeout in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    exchange_timeout_ms: u64,
    /// Neighbour structure: one-peer, two-peer or complete (default: the manifest's
    /// `[outer] topology`).
    #[arg(long)]
    topology: Option<String>,
    /// Relay circuits at once.
    #[arg(long, default_value_t = 64)]
    relay_max_circuits: usize,
    /// Discover peers on the LAN with mDNS.
    #[arg(long)]
    mdns: bool,
    /// As the AutoNAT server, also dial back peers seen at private and loopback addresses
    /// (swarms inside one private network, test networks).
    #[arg(long)]
    autonat_private_ips: bool,
    /// Serve a JSON status (run, peer id, connected and topic peers) over HTTP on this
    /// address, e.g. 127.0.0.1:9090 (port 0 picks one; the address is printed as status=…).
    #[arg(long)]
    status_addr: Option<std::net::SocketAddr>,
}

/// Answers every TCP connection with an HTTP/1.0 response holding one JSON object.
async fn serve_status(listener: tokio::net::TcpListener, client: network::Client, run_id: String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let Ok((mut socket, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let client = client.clone();
        let run_id = run_id.clone();
        tokio::spawn(async move {
            // Read (and ignore) the request head; answer whatever was asked.
            let mut request = [0u8; 1024];
            let _ = tokio::time::timeout(Duration::from_secs(2), socket.read(&mut request)).await;
            let connected = client.connected_peers().await.unwrap_or_default().len();
            let topic = client.topic_peers().await.unwrap_or_default().len();
            let body = format!(
                "{{\"run_id\":\"{run_id}\",\"peer_id\":\"{}\",\"connected_peers\":{connected},\"topic_peers\":{topic}}}\n",
                client.peer_id()
            );
            let response = format!(
                "HTTP/1.0 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let _ = socket.write_all(response.as_bytes()).await;
            let _ = socket.shutdown().await;
        });
    }
}

/// The swarm topology named by `--topology` (`from` says where the name came from).
fn swarm_topology(name: &str, from: &str) -> Result<Topology> {
    match Topology::from_name(name) {
        Some(t) if t.to_wire().is_some() => Ok(t),
        Some(_) => bail!(
            "topology {name:?} ({from}) is a simulator baseline; a swarm needs one-peer, two-peer or complete"
        ),
        None => bail!("unknown topology {name:?} ({from}; expected one-peer, two-peer or complete)"),
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,libp2p=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let manifest = RunManifest::load(&args.run)?;
    let run_id_hex = manifest.run_id();
    let mut run_id = [0u8; 32];
    hex::decode_to_slice(&run_id_hex, &mut run_id).context("run id is hex")?;
    let timing = Timing {
        genesis_ms: args
            .genesis_unix_ms
            .unwrap_or_else(|| unix_ms() + args.genesis_delay_ms),
        period_ms: args.round_period_ms,
        commit_window_ms: args.commit_window_ms,
        reveal_window_ms: args.reveal_window_ms,
        exchange_timeout_ms: args.exchange_timeout_ms,
        topology: match &args.topology {
            Some(name) => swarm_topology(name, "--topology")?,
            None => swarm_topology(manifest.outer.topology.name(), "[outer] topology")?,
        },
    };
    timing
        .validate()
        .map_err(|e| anyhow::anyhow!("round timing: {e}"))?;

    let keypair = match &args.identity {
        Some(path) => gasloc_p2p::identity::load_or_create(path)?,
        None => libp2p::identity::Keypair::generate_ed25519(),
    };
    let mut config = NetworkConfig::new(Role::Bootstrap);
    config.listen = args.listen.clone();
    config.bootstrap = args.peers.clone();
    config.mdns = args.mdns;
    config.autonat_private_ips = args.autonat_private_ips;
    config.relay_max_circuits = args.relay_max_circuits;
    config.gossip_heartbeat = Duration::from_millis(200);
    let mut network = network::start(keypair, config).await?;
    let client = network.client.clone();
    let me = client.peer_id();
    let full: Vec<String> = network
        .listen_addrs
        .iter()
        .map(|a| format!("{a}/p2p/{me}"))
        .collect();
    println!("run_id={run_id_hex} name={}", manifest.name);
    println!("peer_id={me}");
    for address in &full {
        println!("listening={address}");
    }
    if let Some(addr) = args.status_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot serve status on {addr}"))?;
        println!("status={}", listener.local_addr()?);
        tokio::spawn(serve_status(listener, client.clone(), run_id_hex.clone()));
    }
    if let Some(path) = &args.addr_file {
        let tmp = path.with_extension("tmp");
        let mut file = std::fs::File::create(&tmp)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        for address in &full {
            writeln!(file, "{address}")?;
        }
        file.sync_all()?;
        std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    }
    std::io::stdout().flush()?;

    client
        .serve_manifest(ManifestResponse {
            run_id: run_id.to_vec(),
            manifest_toml: String::from_utf8(manifest.canonical_bytes())
                .context("canonical manifest is UTF-8")?,
            timing: Some(timing.to_wire()),
            error: String::new(),
        })
        .await?;
    client.join_run(run_id, Some(timing)).await?;

    loop {
        tokio::select! {
            event = network.events.recv() => match event {
                Some(NetworkEvent::Connected(peer)) => tracing::info!(%peer, "peer connected"),
                Some(NetworkEvent::Subscribed(peer)) => tracing::info!(%peer, "peer joined the run's topic"),
                Some(_) => {}
                None => bail!("the network event loop stopped"),
            },
            _ = tokio::signal::ctrl_c() => {
                tracing::info!("shutting down");
                client.shutdown().await;
                return Ok(());
            }
        }
    }
}
