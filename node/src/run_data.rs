//! The run's data on a joining node: where its shards come from, and serving them on.
//!
//! [`RunData::provide`] decides the directory the trainer reads. With `--data` it is that
//! directory (the trainer checks it against the manifest's pinned table before opening it).
//! Without `--data`, a run that pins its shards is fetched into `<home>/data` before the
//! first round — from the peers that hold them, the bootstrap among them, and the
//! manifest's mirrors ([`gasloc_p2p::shard_fetch`]) — every shard checked against its
//! SHA-256 and moved into place only when whole. A progress bar shows the download on a
//! terminal; `/status` and `/metrics` show shards held and bytes fetched and served.
//!
//! Unless `--no-serve-data`, the node serves every verified shard it holds on
//! `/gasloc/shard/1` from the moment it has it, so a run's data spreads with its members.

use crate::join::JoinArgs;
use anyhow::{bail, Context, Result};
use gasloc_p2p::shard_fetch::{FetchConfig, FetchProgress, FetchReport, ShardFetcher, ShardSource};
use gasloc_p2p::shard_service::{ShardCatalog, ShardServeConfig, ShardService, MAX_SHARD_CHUNK};
use gasloc_p2p::swarm_node::SwarmNode;
use gasloc_p2p::upload_limit::UploadLimiter;
use gasloc_p2p::PeerId;
use gasloc_proto::RunManifest;
use gasloc_status::NodeStatus;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// What this node holds of the run's data, and the service that serves it.
pub struct RunData {
    /// The directory the trainer reads; None for the synthetic trainer.
    pub dir: Option<PathBuf>,
    catalog: ShardCatalog,
    /// Serving the catalog (None: the run pins no shards, or --no-serve-data).
    service: Option<Arc<ShardService>>,
    /// What the fetch did, when this node fetched.
    report: Option<FetchReport>,
}

impl RunData {
    /// Starts serving (when the run pins its shards) and, without `--data`, fetches them.
    pub async fn provide(
        args: &JoinArgs,
        manifest: &RunManifest,
        node: &SwarmNode,
        upload: Option<Arc<UploadLimiter>>,
        status: &watch::Sender<NodeStatus>,
    ) -> Result<RunData> {
        let shards = &manifest.data.shards;
        let run_id = manifest.run_id();
        let catalog = ShardCatalog::new();
        let serving = !shards.is_empty() && !args.synthetic && !args.no_serve_data;
        let service = match serving {
            true => {
                let config = ShardServeConfig {
                    per_peer_rate: args.data_serve_rate,
                    upload,
                    ..ShardServeConfig::new(run_id)
                };
                let control = node.client().stream_control();
                Some(Arc::new(ShardService::start(
                    control,
                    catalog.clone(),
                    config,
                )?))
            }
            false => None,
        };
        status.send_modify(|s| {
            s.data.shards_total = shards.len() as u64;
            s.data.bytes_total = shards.iter().map(|e| e.bytes).sum();
            s.data.serving = serving;
        });
        let mut data = RunData {
            dir: args.data.clone(),
            catalog,
            service,
            report: None,
        };
        data.keep_status_current(status.clone());
        if args.synthetic || args.data.is_some() {
            return Ok(data);
        }
        if shards.is_empty() {
            bail!(
                "run {run_id} does not pin its data (no [[data.shards]] in its manifest): \
                 give --data <dir> with the run's shards"
            );
        }
        let dir = args.home.join("data");
        let report = fetch(args, manifest, node, &dir, &data.catalog, status).await?;
        data.dir = Some(dir);
        data.report = Some(report);
        Ok(data)
    }

    /// Serves the shards of `--data` once the trainer checked them against the pinned table
    /// (they count as held, served or not).
    pub fn serve_given_directory(&self, args: &JoinArgs, manifest: &RunManifest) {
        let Some(dir) = &args.data else { return };
        if args.synthetic || manifest.data.shards.is_empty() {
            return;
        }
        for entry in &manifest.data.shards {
            self.catalog.insert(entry.clone(), dir.join(&entry.name));
        }
    }

    /// Peers that served bytes that do not hash to the pinned digest (an offence, unlike a
    /// source that failed or went away).
    pub fn wrong_bytes_peers(&self) -> impl Iterator<Item = PeerId> + '_ {
        self.report
            .iter()
            .flat_map(|r| r.bad_sources.iter())
            .filter(|bad| bad.wrong_bytes)
            .filter_map(|bad| match bad.source {
                ShardSource::Peer(peer) => Some(peer),
                ShardSource::Mirror(_) => None,
            })
    }

    /// Keeps `/status`'s data section current — shards held and bytes served, every second —
    /// while the node runs (the task ends when the service is dropped or status closes).
    fn keep_status_current(&self, status: watch::Sender<NodeStatus>) {
        let catalog = self.catalog.clone();
        let service = self.service.as_ref().map(Arc::downgrade);
        tokio::spawn(async move {
            loop {
                let served = match &service {
                    Some(weak) => match weak.upgrade() {
                        Some(service) => service.stats().bytes_served,
                        None => return,
                    },
                    None => 0,
                };
                let held = catalog.len() as u64;
                status.send_modify(|s| {
                    // While fetching, the fetch's own count is the newer one.
                    s.data.shards_held = s.data.shards_held.max(held);
                    s.data.bytes_served = served;
                });
                if status.is_closed() {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }
}

/// Fetches the pinned shards into `dir`, showing progress; prints one line per shard.
async fn fetch(
    args: &JoinArgs,
    manifest: &RunManifest,
    node: &SwarmNode,
    dir: &std::path::Path,
    catalog: &ShardCatalog,
    status: &watch::Sender<NodeStatus>,
) -> Result<FetchReport> {
    let shards = &manifest.data.shards;
    let total: u64 = shards.iter().map(|e| e.bytes).sum();
    println!(
        "data_fetch shards={} bytes={total} dir={} mirrors={}",
        shards.len(),
        dir.display(),
        manifest.data.mirrors.len()
    );
    let config = FetchConfig {
        chunk_bytes: args.data_chunk_bytes,
        patience: Duration::from_secs(args.data_patience_s),
        ..FetchConfig::new(manifest.run_id(), manifest.data.mirrors.clone())
    };
    if !(1024..=MAX_SHARD_CHUNK).contains(&config.chunk_bytes) {
        bail!(
            "--data-chunk-bytes {} must lie between 1024 and {MAX_SHARD_CHUNK}",
            config.chunk_bytes
        );
    }
    let fetcher = ShardFetcher::new(node.client().stream_control(), config);
    let progress = FetchProgress::new();
    let started = std::time::Instant::now();

    // The peers to ask: every connected peer, refreshed in the background (the fetcher asks
    // for them synchronously whenever it looks for a source again).
    let peers = Arc::new(Mutex::new(Vec::<PeerId>::new()));
    let refresh = {
        let peers = peers.clone();
        let client = node.client().clone();
        tokio::spawn(async move {
            loop {
                if let Ok(now) = client.connected_peers().await {
                    *peers.lock().expect("peer list lock") = now;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    // A progress bar on a terminal (indicatif draws nothing otherwise), and /status.
    let bar = indicatif::ProgressBar::new(total).with_style(
        indicatif::ProgressStyle::with_template(
            "fetching the run's data {bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("a valid template"),
    );
    let show = {
        let (progress, bar, status) = (progress.clone(), bar.clone(), status.clone());
        tokio::spawn(async move {
            loop {
                let p = progress.snapshot();
                bar.set_position(p.bytes_fetched.min(p.bytes_total));
                status.send_modify(|s| {
                    s.data.shards_held = p.shards_held;
                    s.data.bytes_fetched = p.bytes_fetched;
                });
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };
    let outcome = fetcher
        .fetch(
            shards,
            dir,
            move || peers.lock().expect("peer list lock").clone(),
            Some(catalog.clone()),
            progress.clone(),
        )
        .await;
    refresh.abort();
    show.abort();
    bar.finish_and_clear();
    let report = outcome.context("cannot fetch the run's data")?;
    let p = progress.snapshot();
    status.send_modify(|s| {
        s.data.shards_held = p.shards_held;
        s.data.bytes_fetched = p.bytes_fetched;
        s.data.bad_sources = report
            .bad_sources
            .iter()
            .map(|b| format!("{} {}: {}", b.source, b.shard, b.reason))
            .collect();
    });
    for shard in &report.shards {
        let source = shard
            .source
            .as_ref()
            .map_or("present".to_string(), |s| s.to_string().replace(' ', ":"));
        println!(
            "shard_ready name={} source={source} bytes_fetched={}",
            shard.name, shard.bytes_fetched
        );
    }
    for bad in &report.bad_sources {
        println!(
            "shard_bad_source shard={} source={} reason={:?}",
            bad.shard,
            bad.source.to_string().replace(' ', ":"),
            bad.reason
        );
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "data_ready shards={} bytes_fetched={} seconds={seconds:.2} goodput_mbit={:.1} dir={}",
        p.shards_held,
        p.bytes_fetched,
        p.bytes_fetched as f64 * 8e-6 / seconds.max(1e-9),
        dir.display()
    );
    Ok(report)
}
