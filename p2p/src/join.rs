//! `gasloc-node join`: join a run through its bootstrap nodes and take part in rounds.
//!
//! Everything of the subcommand but the trainer lives here: the swarm, the manifest fetch
//! and check, state sync for a late joiner, the status server, signals, and the round
//! driver. The trainer comes from the caller as a [`RoundWork`]: `gasloc-node` passes its
//! libtorch trainer, or the **synthetic trainer** with `--synthetic`.

use crate::config::{NetworkConfig, Role};
use crate::driver::{DriverOptions, RoundDriver, RoundRecord};
use crate::exchange::SendOptions;
use crate::exchange_service::{ExchangeConfig, ExchangeService};
use crate::manifest_service::verify_manifest_response;
use crate::network::{self, peer_id_of, ClientError, Reachability};
use crate::schedule::Timing;
use crate::synthetic::SyntheticTrainer;
use crate::upload_limit::{parse_rate, UploadLimiter};
use crate::work::RoundWork;
use anyhow::{anyhow, bail, Context};
use gasloc_proto::{RunId, RunManifest};
use gasloc_status::{NodeMetrics, NodeStatus, StatusServer};
use libp2p::{Multiaddr, PeerId};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

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
    /// The run id this node expects the bootstrap node to serve (64 hex digits).
    #[arg(long)]
    pub run_id: Option<RunId>,
    /// Serve /status (JSON), /metrics (Prometheus) and the dashboard on this address
    /// (port 0 picks one; the address is printed as status=http://…).
    #[arg(long)]
    pub status_addr: Option<SocketAddr>,
    /// Cap this node's upload, all peers together, in bytes per second (500k, 2M, 1.5MB/s).
    #[arg(long, value_parser = parse_rate)]
    pub max_upload_rate: Option<u64>,
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
    /// Rounds to take part in before leaving (default: until SIGINT/SIGTERM).
    #[arg(long)]
    pub rounds: Option<u64>,
    /// Wait until this many peers have subscribed to the run's topic before the first round.
    #[arg(long, default_value_t = 1)]
    pub min_peers: usize,
    /// Compress exchanged chunks with zstd at this level (off when absent).
    #[arg(long)]
    pub zstd_level: Option<i32>,
    /// Append one JSON line per round to this file.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Fetch the current state from a peer before the first round (the libtorch trainer
    /// does so whenever it did not resume from its own checkpoint).
    #[arg(long)]
    pub sync_state: bool,
    /// Discover peers on the LAN with mDNS.
    #[arg(long)]
    pub mdns: bool,
    /// Listen through a relay circuit on each bootstrap node from the start (for a node that
    /// others cannot dial: behind NAT or a firewall). Without it a node does so once AutoNAT
    /// finds it private.
    #[arg(long)]
    pub relay: bool,
    /// Let AutoNAT probe private and loopback addresses too (LANs, test networks).
    #[arg(long)]
    pub autonat_private_ips: bool,
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
        c.relay_listen = self.relay;
        c.autonat_private_ips = self.autonat_private_ips;
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

/// What the trainer is built from, once the run is known.
pub struct WorkContext {
    pub manifest: RunManifest,
    pub peer: PeerId,
}

/// A trainer for the run: the work, and whether it needs the swarm's current state (a
/// fresh node joining a run under way) rather than its own (seed or checkpoint).
pub struct JoinWork {
    pub work: Box<dyn RoundWork>,
    pub wants_state: bool,
}

/// The synthetic trainer `--synthetic` asks for.
pub fn synthetic_work(args: &JoinArgs, ctx: &WorkContext) -> anyhow::Result<JoinWork> {
    if args.tensors == 0 || args.payload_bytes < 4 * args.tensors {
        bail!("--payload-bytes must give every one of the --tensors at least 4 bytes");
    }
    Ok(JoinWork {
        work: Box::new(SyntheticTrainer::new(
            ctx.peer,
            args.payload_bytes,
            args.tensors,
            args.inner_steps,
            Duration::from_millis(args.step_time_ms),
        )),
        wants_state: false,
    })
}

/// Runs `gasloc-node join` to completion: until `--rounds` rounds are done or SIGINT /
/// SIGTERM, after which the round in flight finishes, the work is closed (checkpoint) and
/// the node leaves the swarm. `make_work` builds the trainer once the manifest is known.
pub async fn run(
    args: JoinArgs,
    make_work: impl FnOnce(&WorkContext) -> anyhow::Result<JoinWork>,
) -> anyhow::Result<()> {
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
    let mut registry = prometheus_client::registry::Registry::default();
    let network =
        network::start_with_metrics(keypair, args.network_config(), Some(&mut registry)).await?;
    let client = network.client.clone();
    let me = client.peer_id();
    println!("peer_id={me}");
    for address in &network.listen_addrs {
        println!("listening={address}/p2p/{me}");
    }

    let (manifest, timing) = fetch_manifest(&client, &bootstrap_peers, args.run_id).await?;
    let run_id = manifest.run_id();
    println!("run_id={run_id} name={}", manifest.name);

    let (status, status_rx) = tokio::sync::watch::channel(NodeStatus {
        peer_id: me.to_string(),
        run_id: run_id.to_string(),
        run_name: manifest.name.clone(),
        reachability: Reachability::Unknown,
        ..Default::default()
    });
    let metrics = NodeMetrics::register(&mut registry);
    let _server = match args.status_addr {
        Some(addr) => {
            let server = StatusServer::start(addr, status_rx, Arc::new(registry), metrics).await?;
            println!("status=http://{}", server.addr);
            Some(server)
        }
        None => None,
    };

    let context = WorkContext {
        manifest: manifest.clone(),
        peer: me,
    };
    let JoinWork {
        mut work,
        wants_state,
    } = make_work(&context)?;

    client.join_run(run_id, Some(timing.clone())).await?;
    let mut exchange_config = ExchangeConfig::new(run_id);
    exchange_config.accept_wait = Duration::from_millis(timing.exchange_timeout_ms);
    let service = ExchangeService::start(me, client.stream_control(), exchange_config)?;

    wait_for_topic_peers(&client, args.min_peers).await?;
    // A run under way (past its first round) has state to fetch; a new one starts from
    // the seed on every node.
    let under_way = timing.round_at(network::unix_ms()).is_some_and(|r| r > 0);
    if args.sync_state || (wants_state && under_way) {
        status.send_modify(|s| s.state = gasloc_status::NodeState::Syncing);
        let table = Arc::new(work.state_table());
        if let Some((round, state)) = sync_state(&client, &service, &bootstrap_peers, table).await {
            work.load_state(round, state).await?;
        }
    }

    let stop = CancellationToken::new();
    spawn_signal_handler(stop.clone());
    let driver = RoundDriver {
        client: client.clone(),
        events: network.events,
        timing,
        service,
        work,
        options: DriverOptions {
            rounds: args.rounds.unwrap_or(u64::MAX),
            withhold_reveals: args.withhold_reveals,
            send: SendOptions {
                zstd_level: args.zstd_level,
                upload_limit: args
                    .max_upload_rate
                    .map(|r| Arc::new(UploadLimiter::new(r))),
                ..SendOptions::default()
            },
        },
        run_id,
        status,
        stop: stop.clone(),
    };
    let mut report = match &args.report {
        // Appended to: a restarted node continues its report.
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("cannot open report {}", path.display()))?,
        ),
        None => None,
    };
    let outcome = driver
        .run(|record: &RoundRecord| {
            println!("{}", summary_line(record));
            if let Some(file) = report.as_mut() {
                let line = serde_json::to_string(record).expect("records serialize");
                if let Err(e) = writeln!(file, "{line}").and_then(|_| file.flush()) {
                    tracing::error!(error = %e, "cannot write the round report");
                }
            }
        })
        .await;
    client.shutdown().await;
    let records = outcome?;
    if let Some(rounds) = args.rounds {
        if (records.len() as u64) < rounds && !stop.is_cancelled() {
            bail!("stopped after {} of {rounds} rounds", records.len());
        }
    }
    println!("left rounds={}", records.len());
    Ok(())
}

/// One terminal line per round.
pub fn summary_line(r: &RoundRecord) -> String {
    let loss = |l: Option<f64>| l.map_or("-".into(), |l| format!("{l:.4}"));
    format!(
        "round={} members={} neighbours={} exchanged={} failed={} inner_steps={} \
         train_loss={} val_loss={} bytes_sent={} bytes_received={} wait_s={:.2} round_s={:.2}",
        r.round,
        r.members.len(),
        r.neighbours.len(),
        r.exchanged.len(),
        r.failed.len(),
        r.inner_steps,
        loss(r.train_loss),
        loss(r.val_loss),
        r.bytes_sent,
        r.bytes_received,
        r.wait_s,
        r.round_s,
    )
}

/// Cancels `stop` on SIGINT or SIGTERM.
fn spawn_signal_handler(stop: CancellationToken) {
    tokio::spawn(async move {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let Ok(mut term) = signal(SignalKind::terminate()) else {
                return;
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("signal received: leaving after the round in flight");
        stop.cancel();
    });
}

/// Asks each bootstrap node in turn for the manifest (retrying while connections come up).
async fn fetch_manifest(
    client: &network::Client,
    bootstrap_peers: &[PeerId],
    expected_run_id: Option<RunId>,
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
                // Asking again would not help.
                Err(e @ ClientError::NetworkStopped) => return Err(e.into()),
                // The error names the peer.
                Err(e) => last_error = e.to_string(),
            }
        }
        tracing::debug!(attempt, %last_error, "manifest request failed; retrying");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bail!("could not fetch the run manifest: {last_error}")
}

async fn wait_for_topic_peers(client: &network::Client, min_peers: usize) -> anyhow::Result<()> {
    for _ in 0..600 {
        let peers = client.topic_peers().await?;
        if peers.len() >= min_peers {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("fewer than {min_peers} peers subscribed to the run's topic within 60 s")
}

/// Fetches the state from the first topic peer that is not a bootstrap node and has one;
/// `None` when nobody has (a new run: start from the seed).
async fn sync_state(
    client: &network::Client,
    service: &ExchangeService,
    bootstrap_peers: &[PeerId],
    table: Arc<Vec<crate::tensors::TensorSpec>>,
) -> Option<(u64, crate::tensors::TensorSet)> {
    // Subscriptions of peers found through Kademlia arrive over a few heartbeats.
    let mut peers = Vec::new();
    for _ in 0..100 {
        peers = client.topic_peers().await.unwrap_or_default();
        peers.retain(|p| !bootstrap_peers.contains(p));
        if !peers.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for peer in peers {
        match service
            .fetch_state(peer, Some(table.clone()), Duration::from_secs(120))
            .await
        {
            Ok((round, set)) => {
                println!(
                    "state_synced_from={peer} round={round} bytes={}",
                    set.byte_length()
                );
                return Some((round, set));
            }
            Err(e) => tracing::info!(%peer, error = %e, "no state from this peer"),
        }
    }
    println!("state_sync=none");
    None
}

/// [`run`] on a fresh tokio runtime, logging to stderr (`RUST_LOG` filters; a subscriber
/// the caller installed first is kept). For binaries without their own runtime.
pub fn run_blocking(
    args: JoinArgs,
    make_work: impl FnOnce(&WorkContext) -> anyhow::Result<JoinWork>,
) -> anyhow::Result<()> {
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
        .block_on(run(args, make_work))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        join: JoinArgs,
    }

    fn parse(run_id: &str) -> Result<Cli, clap::Error> {
        let bootstrap = format!("/ip4/127.0.0.1/tcp/4001/p2p/{}", PeerId::random());
        Cli::try_parse_from(["join", "--bootstrap", &bootstrap, "--run-id", run_id])
    }

    #[test]
    fn run_id_flag_is_parsed_and_bad_hex_is_refused_with_the_reason() {
        let hex = "36a72869b82fa885360939af62fc87af79302d9c0c44790709fe9d1ce85ac860";
        let cli = parse(hex).unwrap();
        assert_eq!(cli.join.run_id.map(|r| r.to_string()), Some(hex.into()));
        let err = parse("36a7")
            .err()
            .expect("a short run id is refused")
            .to_string();
        assert!(err.contains("--run-id"), "{err}");
        assert!(err.contains("64 hex digits, got 4 characters"), "{err}");
        let err = parse(&hex.replace('a', "g"))
            .err()
            .expect("a run id that is not hex is refused")
            .to_string();
        assert!(err.contains("'g' at position 2 is not one"), "{err}");
    }
}
