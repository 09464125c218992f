//! `gasloc-node join`: join a run through its bootstrap nodes and take part in rounds.
//!
//! All of the subcommand lives here so that the node binary only forwards its arguments.
//! Today the only trainer behind `join` is the **synthetic trainer** (`--synthetic`); the
//! libtorch trainer plugs into the same round driver later.

use crate::config::{NetworkConfig, Role};
use crate::driver::{DriverOptions, RoundDriver, RoundRecord};
use crate::exchange::SendOptions;
use crate::exchange_service::{ExchangeConfig, ExchangeService};
use crate::manifest_service::verify_manifest_response;
use crate::network::{self, peer_id_of};
use crate::schedule::{RoundSchedule, Timing};
use crate::synthetic::SyntheticTrainer;
use anyhow::{anyhow, bail, Context};
use libp2p::{Multiaddr, PeerId};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

/// Arguments of `gasloc-node join`.
#[derive(Debug, Clone, clap::Args)]
pub struct JoinArgs {
    /// A bootstrap node's full address, ending in /p2p/<peer id>. Repeatable.
    #[arg(long = "bootstrap", required = true)]
    pub bootstrap: Vec<Multiaddr>,
    /// Addresses to listen on. Repeatable.
    #[arg(long = "listen", default_values = ["/ip4/0.0.0.0/udp/0/quic-v1", "/ip4/0.0.0.0/tcp/0"])]
    pub listen: Vec<Multiaddr>,
    /// The node's identity key file (created with mode 0600 if missing); a fresh key when absent.
    #[arg(long)]
    pub identity: Option<PathBuf>,
    /// The run id this node expects the bootstrap node to serve (hex).
    #[arg(long)]
    pub run_id: Option<String>,
    /// Use the synthetic trainer (random payload, sleeps instead of training).
    #[arg(long)]
    pub synthetic: bool,
    /// Synthetic payload size in bytes per round.
    #[arg(long, default_value_t = 1 << 20)]
    pub payload_bytes: usize,
    /// Tensors the synthetic payload is split into.
    #[arg(long, default_value_t = 4)]
    pub tensors: usize,
    /// Synthetic inner steps per round.
    #[arg(long, default_value_t = 10)]
    pub inner_steps: u32,
    /// Synthetic step time in milliseconds.
    #[arg(long, default_value_t = 10)]
    pub step_time_ms: u64,
    /// Rounds to take part in before exiting.
    #[arg(long, default_value_t = 10)]
    pub rounds: u64,
    /// Wait until this many peers have subscribed to the run's topic before the first round.
    #[arg(long, default_value_t = 1)]
    pub min_peers: usize,
    /// Compress exchanged chunks with zstd at this level (off when absent).
    #[arg(long)]
    pub zstd_level: Option<i32>,
    /// Write one JSON line per round to this file.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Fetch the current state from a peer before the first round.
    #[arg(long)]
    pub sync_state: bool,
    /// Discover peers on the LAN with mDNS.
    #[arg(long)]
    pub mdns: bool,
    /// Kademlia client mode (for nodes not reachable from outside).
    #[arg(long)]
    pub kad_client: bool,
    /// Swarm idle-connection timeout in seconds.
    #[arg(long, default_value_t = 600)]
    pub idle_connection_timeout_s: u64,
    /// QUIC idle timeout in seconds.
    #[arg(long, default_value_t = 60)]
    pub quic_idle_timeout_s: u64,
    /// QUIC keep-alive interval in seconds.
    #[arg(long, default_value_t = 10)]
    pub quic_keep_alive_s: u64,
    /// QUIC per-stream receive window in bytes.
    #[arg(long, default_value_t = 32 << 20)]
    pub quic_stream_window: u32,
    /// QUIC per-connection receive window in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub quic_connection_window: u32,
    /// Fault injection for tests: commit but never reveal.
    #[arg(long, hide = true)]
    pub withhold_reveals: bool,
}

impl JoinArgs {
    /// The network settings these arguments describe.
    pub fn network_config(&self) -> NetworkConfig {
        let mut c = NetworkConfig::new(Role::Node);
        c.listen = self.listen.clone();
        c.bootstrap = self.bootstrap.clone();
        c.mdns = self.mdns;
        c.kad_server = !self.kad_client;
        c.idle_connection_timeout = Duration::from_secs(self.idle_connection_timeout_s);
        c.quic_max_idle_timeout = Duration::from_secs(self.quic_idle_timeout_s);
        c.quic_keep_alive_interval = Duration::from_secs(self.quic_keep_alive_s);
        c.quic_max_stream_data = self.quic_stream_window;
        c.quic_max_connection_data = self.quic_connection_window;
        c.gossip_heartbeat = Duration::from_millis(200);
        c.discovery_interval = Duration::from_secs(5);
        c
    }
}

/// Runs `gasloc-node join` to completion.
pub async fn run(args: JoinArgs) -> anyhow::Result<()> {
    if !args.synthetic {
        bail!("join needs --synthetic: the libtorch trainer is not wired to the swarm yet");
    }
    if args.tensors == 0 || args.payload_bytes < 4 * args.tensors {
        bail!("--payload-bytes must give every one of the --tensors at least 4 bytes");
    }
    let bootstrap_peers: Vec<PeerId> = args
        .bootstrap
        .iter()
        .map(|a| {
            peer_id_of(a).ok_or_else(|| anyhow!("--bootstrap {a} does not end in /p2p/<peer id>"))
        })
        .collect::<anyhow::Result<_>>()?;
    let keypair = match &args.identity {
        Some(path) => crate::identity::load_or_create(path)?,
        None => libp2p::identity::Keypair::generate_ed25519(),
    };
    let network = network::start(keypair, args.network_config()).await?;
    let client = network.client.clone();
    let me = client.peer_id();
    println!("peer_id={me}");
    for address in &network.listen_addrs {
        println!("listening={address}/p2p/{me}");
    }

    let (manifest, timing) =
        fetch_manifest(&client, &bootstrap_peers, args.run_id.as_deref()).await?;
    let run_id_hex = manifest.run_id();
    let mut run_id = [0u8; 32];
    hex::decode_to_slice(&run_id_hex, &mut run_id).context("run id is hex")?;
    println!("run_id={run_id_hex} name={}", manifest.name);
    client
        .join_run(run_id, Some(timing.clone()))
        .await
        .map_err(anyhow::Error::msg)?;

    let mut exchange_config = ExchangeConfig::new(run_id);
    exchange_config.accept_wait = Duration::from_millis(timing.exchange_timeout_ms);
    let service = ExchangeService::start(me, client.stream_control(), exchange_config)?;

    wait_for_topic_peers(&client, args.min_peers).await?;
    if args.sync_state {
        sync_state(&client, &service, &bootstrap_peers).await;
    }

    let trainer = SyntheticTrainer {
        payload_bytes: args.payload_bytes,
        tensors: args.tensors,
        inner_steps: args.inner_steps,
        step_time: Duration::from_millis(args.step_time_ms),
    };
    let driver = RoundDriver {
        client: client.clone(),
        events: network.events,
        schedule: RoundSchedule::new(timing, run_id, me),
        service,
        trainer,
        options: DriverOptions {
            rounds: args.rounds,
            withhold_reveals: args.withhold_reveals,
            send: SendOptions {
                zstd_level: args.zstd_level,
                ..SendOptions::default()
            },
        },
        run_id,
    };
    let mut report = match &args.report {
        Some(path) => Some(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create report {}", path.display()))?,
        ),
        None => None,
    };
    let records = driver
        .run(|record: &RoundRecord| {
            println!(
                "round={} members={} neighbours={} exchanged={} failed={}",
                record.round,
                record.members.len(),
                record.neighbours.len(),
                record.exchanged.len(),
                record.failed.len()
            );
            if let Some(file) = report.as_mut() {
                let line = serde_json::to_string(record).expect("records serialize");
                if let Err(e) = writeln!(file, "{line}").and_then(|_| file.flush()) {
                    tracing::error!(error = %e, "cannot write the round report");
                }
            }
        })
        .await;
    client.shutdown().await;
    if (records.len() as u64) < args.rounds {
        bail!("stopped after {} of {} rounds", records.len(), args.rounds);
    }
    Ok(())
}

/// Asks each bootstrap node in turn for the manifest (retrying while connections come up).
async fn fetch_manifest(
    client: &network::Client,
    bootstrap_peers: &[PeerId],
    expected_run_id: Option<&str>,
) -> anyhow::Result<(gasloc_proto::RunManifest, Timing)> {
    let mut last_error = String::from("no bootstrap node");
    for attempt in 0..20 {
        for peer in bootstrap_peers {
            match client.request_manifest(*peer).await {
                Ok(response) => {
                    let manifest = verify_manifest_response(&response, expected_run_id)
                        .map_err(|e| anyhow!("bootstrap {peer}: {e}"))?;
                    let timing = response
                        .timing
                        .as_ref()
                        .ok_or_else(|| anyhow!("bootstrap {peer} served no round timing"))
                        .and_then(|t| {
                            Timing::from_wire(t)
                                .map_err(|e| anyhow!("bootstrap {peer}: round timing: {e}"))
                        })?;
                    return Ok((manifest, timing));
                }
                Err(e) => last_error = format!("bootstrap {peer}: {e}"),
            }
        }
        tracing::debug!(attempt, %last_error, "manifest request failed; retrying");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bail!("could not fetch the run manifest: {last_error}")
}

async fn wait_for_topic_peers(client: &network::Client, min_peers: usize) -> anyhow::Result<()> {
    for _ in 0..600 {
        let peers = client.topic_peers().await.map_err(anyhow::Error::msg)?;
        if peers.len() >= min_peers {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("fewer than {min_peers} peers subscribed to the run's topic within 60 s")
}

/// Fetches the state from the first topic peer that is not a bootstrap node and has one.
async fn sync_state(
    client: &network::Client,
    service: &ExchangeService,
    bootstrap_peers: &[PeerId],
) {
    let peers = client.topic_peers().await.unwrap_or_default();
    for peer in peers.into_iter().filter(|p| !bootstrap_peers.contains(p)) {
        match service
            .fetch_state(peer, None, Duration::from_secs(60))
            .await
        {
            Ok((round, set)) => {
                println!(
                    "state_synced_from={peer} round={round} bytes={}",
                    set.byte_length()
                );
                return;
            }
            Err(e) => tracing::warn!(%peer, error = %e, "state sync failed"),
        }
    }
    println!("state_sync=none");
}

/// [`run`] on a fresh tokio runtime, logging to stderr (`RUST_LOG` filters; a subscriber
/// the caller installed first is kept). For binaries without their own runtime.
pub fn run_blocking(args: JoinArgs) -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,libp2p=warn".into()),
        )
        .with_writer(std::io::stderr)
        .try_init();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?
        .block_on(run(args))
}
