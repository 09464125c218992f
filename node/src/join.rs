//! `gasloc-node join`: the process around one swarm node.
//!
//! This module owns what is the process's: the subcommand's flags ([`JoinArgs`]), the tokio
//! runtime, the node's home directory, stdout (`key=value` lines, one summary line per
//! round), the `--report` file, the status server and signals. The node itself — network,
//! run topic, exchange service, round driver — is wired by [`gasloc_p2p::swarm_node`], the
//! same wiring the in-process harness runs; the trainer is the libtorch [`Volunteer`] or,
//! with `--synthetic`, [`SyntheticTrainer`].

use crate::device::{device_name, parse_device};
use crate::run_data::{DataArgs, RunData};
use crate::volunteer::{RunDataSource, Start, Volunteer, VolunteerOptions};
use anyhow::{bail, Context, Result};
use gasloc_p2p::config::{default_listen, NetworkConfig, Role};
use gasloc_p2p::driver::{DriverOptions, RoundRecord};
use gasloc_p2p::exchange::SendOptions;
use gasloc_p2p::manifest_service::manifest_response;
use gasloc_p2p::network::unix_ms;
use gasloc_p2p::peer_standing::{BanFile, PeerStanding};
use gasloc_p2p::swarm_key::load_swarm_key;
use gasloc_p2p::swarm_node::{Participation, SwarmNode};
use gasloc_p2p::synthetic::SyntheticTrainer;
use gasloc_p2p::upload_limit::{parse_rate, UploadLimiter};
use gasloc_p2p::work::RoundWork;
use gasloc_p2p::{Multiaddr, PeerId};
use gasloc_proto::manifest::Overlap;
use gasloc_proto::{RunId, RunManifest};
use gasloc_status::{NodeMetrics, NodeState, NodeStatus, Reachability, StatusServer};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Arguments of `gasloc-node join`.
#[derive(Debug, Clone, clap::Args)]
pub struct JoinArgs {
    /// The network: where to enter, where to listen, transports and discovery.
    #[command(flatten)]
    pub network: NetworkArgs,
    /// This node's directory: its identity key (identity.key, unless --identity) and its
    /// checkpoints (checkpoints/). A restarted node resumes from here.
    #[arg(long, default_value = "gasloc-home")]
    pub home: PathBuf,
    /// The node's identity key file (created with mode 0600 if missing; default:
    /// <home>/identity.key).
    #[arg(long)]
    pub identity: Option<PathBuf>,
    /// The run id this node expects the bootstrap node to serve (64 hex digits).
    #[arg(long)]
    pub run_id: Option<RunId>,
    /// The run's data: `--data`, serving it, fetching it.
    #[command(flatten)]
    pub data: DataArgs,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Save a checkpoint every this many rounds (and always when leaving).
    #[arg(long, default_value_t = 10)]
    pub checkpoint_every: u64,
    /// Checkpoints kept.
    #[arg(long, default_value_t = 3)]
    pub keep_checkpoints: usize,
    /// Evaluate the anchor every this many rounds (0: never). Default: the manifest's `[outer]
    /// fragments`, once per pass over the model (every round for whole-model rounds, every
    /// fifth with the default overlap's five fragments).
    #[arg(long)]
    pub eval_every: Option<u64>,
    /// libtorch intra-op threads (0: libtorch's default; use 1 when several nodes share a
    /// machine).
    #[arg(long, default_value_t = 0)]
    pub threads: i32,
    /// Serve /status (JSON), /metrics (Prometheus) and the dashboard on this address
    /// (port 0 picks one; the address is printed as status=http://…).
    #[arg(long)]
    pub status_addr: Option<SocketAddr>,
    /// Cap this node's upload, all peers together, in bytes per second (500k, 2M, 1.5MB/s).
    #[arg(long, value_parser = parse_rate)]
    pub max_upload_rate: Option<u64>,
    /// The synthetic trainer (network tests and benchmarks without libtorch).
    #[command(flatten)]
    pub synthetic: SyntheticArgs,
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
}

/// `gasloc-node join`'s flags about the network, flattened into [`JoinArgs`].
#[derive(Debug, Clone, clap::Args)]
pub struct NetworkArgs {
    /// Where to enter the run: a bootstrap node's or any live node's address, ending in
    /// /p2p/<peer id>. Without the peer id (`/dns4/bootstrap/tcp/4001`, as in a compose
    /// network) whoever answers there is trusted to serve the manifest: give --run-id to pin
    /// the run. Repeatable.
    #[arg(long = "bootstrap", required = true)]
    pub bootstrap: Vec<Multiaddr>,
    /// Addresses to listen on. Repeatable. Default: QUIC and TCP on all interfaces, on free
    /// ports; with --swarm-key, TCP only.
    #[arg(long = "listen")]
    pub listen: Vec<Multiaddr>,
    /// A private swarm's pre-shared key (a go-ipfs/kubo `swarm.key` file, libp2p pnet): only
    /// peers holding the same key can connect at all. TCP only: QUIC addresses are refused.
    #[arg(long)]
    pub swarm_key: Option<PathBuf>,
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
    #[arg(long, default_value_t = 30)]
    pub quic_idle_timeout_s: u64,
    /// QUIC keep-alive interval in seconds.
    #[arg(long, default_value_t = 5)]
    pub quic_keep_alive_s: u64,
    /// QUIC per-stream receive window in bytes.
    #[arg(long, default_value_t = 32 << 20)]
    pub quic_stream_window: u32,
    /// QUIC per-connection receive window in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub quic_connection_window: u32,
}

impl NetworkArgs {
    /// The network settings these arguments describe.
    /// The network settings of these flags; fails on an unreadable or malformed
    /// `--swarm-key` file, naming it.
    pub fn network_config(&self) -> Result<NetworkConfig> {
        let mut c = NetworkConfig::new(Role::Node);
        let swarm_key = self.swarm_key.as_deref().map(load_swarm_key).transpose()?;
        c.listen = if self.listen.is_empty() {
            default_listen(0, swarm_key.is_some())
        } else {
            self.listen.clone()
        };
        c.swarm_key = swarm_key;
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
        Ok(c)
    }
}

/// `gasloc-node join`'s flags for the synthetic trainer (`--synthetic` and its payload and
/// pace), flattened into [`JoinArgs`].
#[derive(Debug, Clone, clap::Args)]
pub struct SyntheticArgs {
    /// Use the synthetic trainer (random payload, sleeps instead of training).
    #[arg(long = "synthetic")]
    pub on: bool,
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
}

/// Runs `gasloc-node join` to completion on a fresh tokio runtime: until `--rounds` rounds
/// are done or SIGINT / SIGTERM, after which the round in flight finishes, the trainer is
/// closed (its checkpoint) and the node leaves the swarm.
pub fn run(args: JoinArgs) -> Result<()> {
    let synthetic = &args.synthetic;
    if synthetic.on && (synthetic.tensors == 0 || synthetic.payload_bytes < 4 * synthetic.tensors) {
        bail!("--payload-bytes must give every one of the --tensors at least 4 bytes");
    }
    // The synthetic trainer uses no device.
    let device = match args.synthetic.on {
        true => None,
        false => Some(parse_device(&args.device)?),
    };
    // The home holds the default identity key and the libtorch trainer's checkpoints.
    if args.identity.is_none() || !args.synthetic.on {
        std::fs::create_dir_all(&args.home)
            .with_context(|| format!("cannot create --home {}", args.home.display()))?;
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?
        .block_on(join(args, device))
}

async fn join(args: JoinArgs, device: Option<tch::Device>) -> Result<()> {
    let identity = args
        .identity
        .clone()
        .unwrap_or_else(|| args.home.join("identity.key"));
    let keypair = gasloc_p2p::identity::load_or_create(&identity)?;
    let mut registry = prometheus_client::registry::Registry::default();
    let network = args.network.network_config()?;
    if let Some(key) = &network.swarm_key {
        // The fingerprint, never the key: every member's must match.
        println!("swarm_key_fingerprint={}", key.fingerprint());
    }
    let node = SwarmNode::start(keypair, network, Some(&mut registry)).await?;
    let bootstrap_peers = node.bootstrap_peers().to_vec();
    let me = node.peer_id();
    println!("peer_id={me}");
    for address in node.listen_addrs() {
        println!("listening={address}/p2p/{me}");
    }

    let (manifest, timing) = node
        .fetch_manifest(&bootstrap_peers, args.run_id)
        .await
        .map_err(|e| match &args.network.swarm_key {
            // Under another key a dial fails with no reason given: say what to check.
            Some(path) => e.context(format!(
                "this node is in a private swarm (--swarm-key {}): a bootstrap with another \
                 key, or none, cannot be reached",
                path.display()
            )),
            None => e,
        })?;
    node.close_run(&manifest, &bootstrap_peers).await?;
    let run_id = manifest.run_id();
    println!("run_id={run_id} name={}", manifest.name);
    // Any member brings newcomers in: the run goes on being joinable with no bootstrap left.
    node.client()
        .serve_manifest(manifest_response(&manifest, &timing))
        .await?;

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

    // One upload cap for everything this node sends: exchanges, states and shards.
    let upload_limit = args
        .max_upload_rate
        .map(|r| Arc::new(UploadLimiter::new(r)));
    // Cancelled by SIGINT or SIGTERM once the rounds begin (the handler is installed then).
    let stop = CancellationToken::new();
    let mut data = RunData::provide(
        &args.data,
        &args.home,
        args.synthetic.on,
        &manifest,
        &node,
        upload_limit.clone(),
        &status,
    )
    .await?;
    let (mut work, started_from, shards_ahead) =
        make_trainer(&args, &manifest, me, device, data.source.clone()).await?;
    // The trainer checked --data against the pinned table before it opened it: serve it.
    data.serve_given_directory(&args.data, args.synthetic.on, &manifest);
    // Without --data: the training shards, in the order the trainer will read them; the
    // first before the first round, the rest while it trains.
    data.fetch_training_shards(&manifest, &shards_ahead, stop.clone(), &status)
        .await?;

    let node = node.join_run(run_id, timing.clone()).await?;
    node.wait_for_topic_peers(args.min_peers, Duration::from_secs(60))
        .await?;
    // A run under way (past its first round) has state to fetch; a new one starts from
    // the seed on every node. A node resumed from a checkpoint more than a round old fetches
    // the swarm's anchor too (its own is stale: its neighbours' models would lie beyond the
    // payload gate's bound), keeping its inner optimizer and data cursor.
    let now_round = timing.round_at(unix_ms()).unwrap_or(0);
    let wants_state = match started_from {
        StartedFrom::Seed => now_round > 0,
        StartedFrom::Checkpoint { round } if now_round > round.saturating_add(1) => {
            println!("state_sync=stale checkpoint_round={round} swarm_round={now_round}");
            true
        }
        StartedFrom::Checkpoint { .. } | StartedFrom::Nothing => false,
    };
    if args.sync_state || wants_state {
        status.send_modify(|s| s.state = NodeState::Syncing);
        let table = Arc::new(work.state_table());
        match node
            .sync_state(&bootstrap_peers, table, &manifest.gate)
            .await?
        {
            Some(synced) => {
                let sources: Vec<String> = synced.sources.iter().map(|p| p.to_string()).collect();
                let refused: Vec<String> = synced
                    .refused
                    .iter()
                    .map(|r| format!("{}:{}", r.peer, r.kind))
                    .collect();
                println!(
                    "state_synced_from={} sources={} round={} bytes={} disagreement={:.3e} \
                     refused={}",
                    sources.join(","),
                    sources.len(),
                    synced.round,
                    synced.state.byte_length(),
                    synced.disagreement,
                    refused.join(",")
                );
                if sources.len() == 1 {
                    println!(
                        "state_sync_unchecked=one source only: its state was not cross-checked"
                    );
                }
                status.send_modify(|s| s.record_state_sync(synced.report()));
                work.load_state(synced.round, synced.state, synced.spread)
                    .await?;
            }
            None => println!("state_sync=none"),
        }
    }

    // The bans this node made in an earlier life in this run hold on.
    let ban_file = BanFile::path_in(&args.home);
    let bans = BanFile::load(&ban_file, run_id).map_err(anyhow::Error::msg)?;
    if !bans.is_empty() {
        println!("bans_loaded={} file={}", bans.len(), ban_file.display());
    }
    let standing = PeerStanding::new(&manifest.gate, bans);

    spawn_signal_handler(stop.clone());
    let participation = Participation {
        work,
        options: DriverOptions {
            rounds: args.rounds.unwrap_or(u64::MAX),
            withhold_reveals: false,
            send: SendOptions {
                zstd_level: args.zstd_level,
                upload_limit,
                ..SendOptions::default()
            },
            standing,
            ban_file: Some(ban_file),
            // A peer that served shard bytes that do not hash to the manifest's digest
            // offended.
            offences: data.offences(),
            overlap: manifest.outer.overlap != Overlap::None,
        },
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
    let records = node
        .take_part(participation, |record: &RoundRecord| {
            println!("{}", summary_line(record));
            if let Some(file) = report.as_mut() {
                let line = serde_json::to_string(record).expect("records serialize");
                if let Err(e) = writeln!(file, "{line}").and_then(|_| file.flush()) {
                    tracing::error!(error = %e, "cannot write the round report");
                }
            }
        })
        .await?;
    if let Some(rounds) = args.rounds {
        if (records.len() as u64) < rounds && !stop.is_cancelled() {
            bail!("stopped after {} of {rounds} rounds", records.len());
        }
    }
    println!("left rounds={}", records.len());
    Ok(())
}

/// The trainer `args` ask for, whether it needs the swarm's current state (a fresh node
/// joining a run under way) rather than its own (seed or checkpoint), and the training
/// shards in the order it will read them (none for the synthetic trainer). The libtorch
/// trainer loads its data, model and checkpoint on a blocking thread.
async fn make_trainer(
    args: &JoinArgs,
    manifest: &RunManifest,
    peer: PeerId,
    device: Option<tch::Device>,
    data: Option<RunDataSource>,
) -> Result<(Box<dyn RoundWork>, StartedFrom, Vec<String>)> {
    let Some(device) = device else {
        let trainer = SyntheticTrainer::new(
            peer,
            args.synthetic.payload_bytes,
            args.synthetic.tensors,
            args.synthetic.inner_steps,
            Duration::from_millis(args.synthetic.step_time_ms),
        );
        return Ok((Box::new(trainer), StartedFrom::Nothing, Vec::new()));
    };
    let options = VolunteerOptions {
        manifest: manifest.clone(),
        device,
        data: data.context("the libtorch trainer needs the run's data")?,
        checkpoints: args.home.join("checkpoints"),
        checkpoint_every: args.checkpoint_every,
        keep_checkpoints: args.keep_checkpoints,
        eval_every: args.eval_every.unwrap_or(manifest.outer.fragments as u64),
        threads: args.threads,
        peer,
    };
    let volunteer = tokio::task::spawn_blocking(move || Volunteer::start(options)).await??;
    match volunteer.start_kind() {
        Start::Fresh => println!("start=fresh device={}", device_name(device)),
        Start::Resumed {
            round,
            step,
            gate_window,
        } => println!(
            "start=resumed round={round} step={step} gate_window={gate_window} device={}",
            device_name(device)
        ),
    }
    let from = match volunteer.start_kind() {
        Start::Fresh => StartedFrom::Seed,
        Start::Resumed { round, .. } => StartedFrom::Checkpoint { round },
    };
    let shards_ahead = volunteer.shards_ahead().to_vec();
    Ok((Box::new(volunteer), from, shards_ahead))
}

/// What the trainer's state was made from before the first round.
enum StartedFrom {
    /// The run's seed (a fresh node).
    Seed,
    /// The node's own checkpoint of `round`.
    Checkpoint { round: u64 },
    /// No model to sync (the synthetic trainer).
    Nothing,
}

/// One terminal line per round.
pub fn summary_line(r: &RoundRecord) -> String {
    let loss = |l: Option<f64>| l.map_or("-".into(), |l| format!("{l:.4}"));
    format!(
        "round={} members={} neighbours={} exchanged={} refused={} failed={} inner_steps={} \
         train_loss={} val_loss={} bytes_sent={} bytes_received={} wait_s={:.2} round_s={:.2} \
         compute_utilization={:.3}",
        r.round,
        r.members.len(),
        r.neighbours.len(),
        r.exchanged.len(),
        r.refused.len(),
        r.failed.len(),
        r.inner_steps,
        loss(r.train_loss),
        loss(r.val_loss),
        r.bytes_sent,
        r.bytes_received,
        r.wait_s,
        r.round_s,
        r.compute_utilization,
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
