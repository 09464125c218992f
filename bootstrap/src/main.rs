//! `gasloc-bootstrap`: the always-on node that serves a run.
//!
//! It is a Kademlia server, a gossipsub member of the run's topic (it validates and
//! forwards control messages), runs identify/ping, a relay server and an AutoNAT server
//! for volunteers behind NAT, and serves the run manifest with the round timing on
//! `/gasloc/manifest/1`; with `--data` it serves the run's pinned shards on
//! `/gasloc/shard/1`. Several bootstrap nodes can serve one run: give them the same
//! manifest and the same `--genesis-unix-ms`. With `--status-addr` it serves its
//! `/status` document and `/metrics` through `gasloc-status`. With `--swarm-key` it serves a
//! private swarm (libp2p pnet, TCP only): only peers holding the same key connect.

mod schedule_file;

use anyhow::{bail, Context, Result};
use clap::Parser;
use gasloc_data::pin::verify_directory;
use gasloc_p2p::config::{default_listen, NetworkConfig, Role};
use gasloc_p2p::manifest_service::manifest_response;
use gasloc_p2p::network::{self, unix_ms, NetworkEvent};
use gasloc_p2p::schedule::Timing;
use gasloc_p2p::shard_service::{ShardCatalog, ShardServeConfig, ShardService};
use gasloc_p2p::swarm_key::load_swarm_key;
use gasloc_proto::topology::Topology;
use gasloc_proto::RunManifest;
use gasloc_status::{BootstrapMetrics, BootstrapStatus, StatusServer};
use libp2p::Multiaddr;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

#[derive(Parser)]
#[command(version, about = "gasloc bootstrap node")]
struct Args {
    /// The run manifest (TOML) this bootstrap node serves.
    #[arg(long)]
    run: PathBuf,
    /// Addresses to listen on. Repeatable. Default: /ip4/0.0.0.0/udp/4001/quic-v1 and
    /// /ip4/0.0.0.0/tcp/4001; with --swarm-key, the TCP one only.
    #[arg(long = "listen")]
    listen: Vec<Multiaddr>,
    /// A private swarm's pre-shared key (a go-ipfs/kubo `swarm.key` file, libp2p pnet): only
    /// peers with the same key can connect at all. TCP only: QUIC addresses are refused.
    #[arg(long)]
    swarm_key: Option<PathBuf>,
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
    /// Keep the round schedule in this file: the first start writes it, every restart serves
    /// the same rounds (and refuses flags that would change them under a running swarm).
    #[arg(long)]
    schedule_file: Option<PathBuf>,
    /// Delay from start to round 0 when --genesis-unix-ms is absent.
    #[arg(long, default_value_t = 5000)]
    genesis_delay_ms: u64,
    /// Round period in milliseconds. Default: a minute over the manifest's `[outer]
    /// fragments`, so every part of the model is exchanged once a minute (12 s with the
    /// default overlap's five fragments, 60 s for the whole model).
    #[arg(long)]
    round_period_ms: Option<u64>,
    /// Commit window in milliseconds: members publish their commits for a round this long
    /// before it starts (at most one round period).
    #[arg(long, default_value_t = 5_000)]
    commit_window_ms: u64,
    /// Reveal window in milliseconds: reveals are published when a round starts and the
    /// round is decided this long after (shorter than a round period).
    #[arg(long, default_value_t = 5_000)]
    reveal_window_ms: u64,
    /// Exchange timeout in milliseconds. Default: half the round period.
    #[arg(long)]
    exchange_timeout_ms: Option<u64>,
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
    /// Serve `/status` (JSON: run, peer id, connected and topic peers) and `/metrics`
    /// (Prometheus, libp2p's included) over HTTP on this address, e.g. 127.0.0.1:9090
    /// (port 0 picks one; the address is printed as status=…).
    #[arg(long)]
    status_addr: Option<std::net::SocketAddr>,
    /// Serve the run's data from this directory on /gasloc/shard/1, so volunteers can join
    /// without --data. The manifest must pin its shards (`gasloc-node data pin`), and the
    /// directory must hold exactly those files: it is checked, hash by hash, at start.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Cap the shard bytes sent to any one peer, per second (500k, 2M).
    #[arg(long, value_parser = gasloc_p2p::upload_limit::parse_rate)]
    data_serve_rate: Option<u64>,
    /// Cap all shard bytes sent, every peer together, per second (500k, 2M).
    #[arg(long, value_parser = gasloc_p2p::upload_limit::parse_rate)]
    max_upload_rate: Option<u64>,
}

/// `--data`: checks the directory against the manifest's pinned shards (on a blocking
/// thread: it hashes every byte) and returns the catalog of shards to serve.
async fn data_to_serve(dir: &Path, manifest: &RunManifest) -> Result<ShardCatalog> {
    let table = manifest.data.shards.clone();
    if table.is_empty() {
        bail!(
            "--data: the manifest pins no shards ([[data.shards]]): pin them first with \
             gasloc-node data pin --data {} --manifest <run.toml>",
            dir.display()
        );
    }
    let owned = dir.to_path_buf();
    let checked = table.clone();
    tokio::task::spawn_blocking(move || verify_directory(&owned, &checked))
        .await
        .context("the data check stopped")?
        .with_context(|| format!("--data {}", dir.display()))?;
    let catalog = ShardCatalog::new();
    for entry in table {
        let path = dir.join(&entry.name);
        catalog.insert(entry, path);
    }
    Ok(catalog)
}

/// Keeps the bootstrap's `/status` document current: polls the event loop for its
/// connected and topic peers (gossipsub reports no unsubscriptions, so counting events
/// would drift) until the network stops.
async fn keep_status_current(client: network::Client, status: watch::Sender<BootstrapStatus>) {
    let mut tick = tokio::time::interval(STATUS_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (Ok(connected), Ok(topic)) =
            (client.connected_peers().await, client.topic_peers().await)
        else {
            return;
        };
        status.send_if_modified(|s| {
            let changed = (s.connected_peers, s.topic_peers) != (connected.len(), topic.len());
            s.connected_peers = connected.len();
            s.topic_peers = topic.len();
            changed
        });
    }
}

/// How often the `/status` document's peer counts are refreshed.
const STATUS_INTERVAL: Duration = Duration::from_millis(500);

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
    let run_id = manifest.run_id();
    let period_ms = args
        .round_period_ms
        .unwrap_or(60_000 / manifest.outer.fragments as u64);
    let timing = Timing {
        genesis_ms: args
            .genesis_unix_ms
            .unwrap_or_else(|| unix_ms() + args.genesis_delay_ms),
        period_ms,
        commit_window_ms: args.commit_window_ms,
        reveal_window_ms: args.reveal_window_ms,
        exchange_timeout_ms: args.exchange_timeout_ms.unwrap_or(period_ms / 2),
        topology: match &args.topology {
            Some(name) => swarm_topology(name, "--topology")?,
            None => swarm_topology(manifest.outer.topology.name(), "[outer] topology")?,
        },
    };
    timing
        .validate()
        .map_err(|e| anyhow::anyhow!("round timing: {e}"))?;
    let timing = match &args.schedule_file {
        Some(path) => schedule_file::keep(path, run_id, timing, args.genesis_unix_ms.is_some())?,
        None => timing,
    };

    let keypair = match &args.identity {
        Some(path) => gasloc_p2p::identity::load_or_create(path)?,
        None => libp2p::identity::Keypair::generate_ed25519(),
    };
    let swarm_key = args.swarm_key.as_deref().map(load_swarm_key).transpose()?;
    let mut config = NetworkConfig::new(Role::Bootstrap);
    config.listen = if args.listen.is_empty() {
        default_listen(4001, swarm_key.is_some())
    } else {
        args.listen.clone()
    };
    config.swarm_key = swarm_key;
    config.bootstrap = args.peers.clone();
    config.mdns = args.mdns;
    config.autonat_private_ips = args.autonat_private_ips;
    config.relay_max_circuits = args.relay_max_circuits;
    config.gossip_heartbeat = Duration::from_millis(200);
    // A closed run: its nodes and the other bootstrap nodes of the run, no one else.
    let other_bootstraps: Vec<libp2p::PeerId> = args
        .peers
        .iter()
        .filter_map(gasloc_p2p::network::peer_id_of)
        .chain(std::iter::once(keypair.public().to_peer_id()))
        .collect();
    config.allowed_peers = gasloc_p2p::access::allowed_peers(&manifest.access, &other_bootstraps)
        .map_err(anyhow::Error::msg)?;
    let mut registry = prometheus_client::registry::Registry::default();
    let mut network = network::start_with_metrics(keypair, config, Some(&mut registry)).await?;
    let client = network.client.clone();
    let me = client.peer_id();
    let full: Vec<String> = network
        .listen_addrs
        .iter()
        .map(|a| format!("{a}/p2p/{me}"))
        .collect();
    println!("run_id={run_id} name={}", manifest.name);
    println!("peer_id={me}");
    if let Some(key) = &swarm_key {
        // The fingerprint, never the key: every member's must match.
        println!("swarm_key_fingerprint={}", key.fingerprint());
    }
    let _shard_service = match &args.data {
        Some(dir) => {
            let catalog = data_to_serve(dir, &manifest).await?;
            let config = ShardServeConfig {
                per_peer_rate: args.data_serve_rate,
                upload: args
                    .max_upload_rate
                    .map(|r| Arc::new(gasloc_p2p::upload_limit::UploadLimiter::new(r))),
                ..ShardServeConfig::new(run_id)
            };
            println!(
                "serving_shards={} bytes={} dir={}",
                catalog.len(),
                manifest.data.shards.iter().map(|e| e.bytes).sum::<u64>(),
                dir.display()
            );
            Some(ShardService::start(
                client.stream_control(),
                catalog,
                config,
            )?)
        }
        None => None,
    };
    println!(
        "genesis_unix_ms={} round_period_ms={}",
        timing.genesis_ms, timing.period_ms
    );
    for address in &full {
        println!("listening={address}");
    }
    let _status_server = match args.status_addr {
        Some(addr) => {
            let (status, status_rx) = watch::channel(BootstrapStatus {
                run_id: run_id.to_string(),
                run_name: manifest.name.clone(),
                peer_id: me.to_string(),
                ..Default::default()
            });
            let metrics = BootstrapMetrics::register(&mut registry);
            let server =
                StatusServer::start_bootstrap(addr, status_rx, Arc::new(registry), metrics).await?;
            println!("status={}", server.addr);
            tokio::spawn(keep_status_current(client.clone(), status));
            Some(server)
        }
        None => None,
    };
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
        .serve_manifest(manifest_response(&manifest, &timing))
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
