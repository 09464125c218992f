//! The run's data on a joining node: where its shards come from, and serving them on.
//!
//! [`RunData::provide`] decides where the trainer's shards come from. With `--data` it is
//! that directory (the trainer checks it against the manifest's pinned table before
//! opening it). Without `--data`, a run that pins its shards is fetched into `<home>/data`
//! — from the peers that hold them, the bootstrap among them, and the manifest's mirrors
//! ([`gasloc_p2p::shard_fetch`]) — every shard checked against its SHA-256 and moved into
//! place only when whole, in two steps:
//! 1. [`RunData::provide`] fetches the validation shards, which the trainer evaluates on
//!    from its first round, and hands the trainer the directory as *arriving*;
//! 2. once the trainer knows in which order its data stream will read the training shards,
//!    [`RunData::fetch_training_shards`] fetches them in that order in the background and
//!    returns when the first is held. The trainer waits for each of the others (in the
//!    [`ShardCatalog`]) only if it reaches it before the fetch does.
//!
//! A progress bar shows the download on a terminal; `/status` and `/metrics` show shards
//! held and bytes fetched and served. A peer whose bytes fail the digest is posted to the
//! round driver's [`OffenceInbox`] (`bad_shard`). Unless `--no-serve-data`, the node serves
//! every verified shard it holds on `/gasloc/shard/1` from the moment it has it, so a run's
//! data spreads with its members.

use crate::volunteer::RunDataSource;
use anyhow::{bail, Context, Result};
use gasloc_data::ShardSupply;
use gasloc_p2p::peer_standing::OffenceInbox;
use gasloc_p2p::shard_fetch::{FetchConfig, FetchProgress, FetchReport, ShardFetcher, ShardSource};
use gasloc_p2p::shard_service::{ShardCatalog, ShardServeConfig, ShardService, MAX_SHARD_CHUNK};
use gasloc_p2p::swarm_node::SwarmNode;
use gasloc_p2p::upload_limit::{parse_rate, UploadLimiter};
use gasloc_p2p::PeerId;
use gasloc_proto::{RefusalKind, RunManifest, ShardEntry, Split};
use gasloc_status::NodeStatus;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What this node holds of the run's data, and the service that serves it.
pub struct RunData {
    /// Where the trainer's shards come from; None for the synthetic trainer.
    pub source: Option<RunDataSource>,
    catalog: ShardCatalog,
    /// Serving the catalog (None: the run pins no shards, or --no-serve-data).
    service: Option<Arc<ShardService>>,
    /// Offences found by the fetch, for the round driver.
    offences: OffenceInbox,
    /// The fetch under way, when this node fetches its data.
    fetch: Option<DataFetch>,
}

/// `gasloc-node join`'s flags about the run's data (flattened into its `JoinArgs`).
#[derive(Debug, Clone, clap::Args)]
pub struct DataArgs {
    /// Token shards of the run's data (`gasloc-node data prepare`). When the manifest pins
    /// its shards they must match the table exactly. Without --data, a run that pins its
    /// shards is fetched from the swarm (and the manifest's mirrors) into <home>/data.
    #[arg(long = "data")]
    pub dir: Option<PathBuf>,
    /// Do not serve this node's verified shards of the run's data to peers (by default every
    /// node serves the pinned shards it holds, on /gasloc/shard/1).
    #[arg(long)]
    pub no_serve_data: bool,
    /// Cap the shard bytes this node sends to any one peer, per second (500k, 2M); the
    /// node's --max-upload-rate caps them too, together with the exchanges.
    #[arg(long, value_parser = parse_rate)]
    pub data_serve_rate: Option<u64>,
    /// Bytes asked for per shard request when fetching (1 KiB to 4 MiB); a fetch cut off
    /// resumes from the last whole chunk.
    #[arg(long, default_value_t = 1 << 20)]
    pub data_chunk_bytes: u64,
    /// How long a shard may find no source (no peer holds it, no mirror serves it) before
    /// the join stops with an error naming it, in seconds.
    #[arg(long, default_value_t = 60)]
    pub data_patience_s: u64,
}

impl RunData {
    /// Starts serving (when the run pins its shards) and, without `--data`, fetches the
    /// validation shards; the training shards follow in
    /// [`Self::fetch_training_shards`].
    /// `home` is the node's directory (fetched shards go to `<home>/data`); a `synthetic`
    /// node has no data and serves none.
    #[allow(clippy::too_many_arguments)]
    pub async fn provide(
        args: &DataArgs,
        home: &Path,
        synthetic: bool,
        manifest: &RunManifest,
        node: &SwarmNode,
        upload: Option<Arc<UploadLimiter>>,
        status: &watch::Sender<NodeStatus>,
    ) -> Result<RunData> {
        let shards = &manifest.data.shards;
        let run_id = manifest.run_id();
        let catalog = ShardCatalog::new();
        let serving = !shards.is_empty() && !synthetic && !args.no_serve_data;
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
            source: None,
            catalog,
            service,
            offences: OffenceInbox::new(),
            fetch: None,
        };
        data.keep_status_current(status.clone());
        if synthetic {
            return Ok(data);
        }
        if let Some(dir) = &args.dir {
            data.source = Some(RunDataSource::Given(dir.clone()));
            return Ok(data);
        }
        if shards.is_empty() {
            bail!(
                "run {run_id} does not pin its data (no [[data.shards]] in its manifest): \
                 give --data <dir> with the run's shards"
            );
        }
        let dir = home.join("data");
        let fetch = DataFetch::start(args, manifest, node, &dir, status)?;
        let val: Vec<ShardEntry> = shards
            .iter()
            .filter(|e| e.split == Split::Val)
            .cloned()
            .collect();
        let report = fetch
            .fetcher
            .fetch(
                &val,
                &dir,
                fetch.peer_list(),
                Some(data.catalog.clone()),
                fetch.progress.clone(),
            )
            .await
            .context("cannot fetch the run's validation data")?;
        record_report(
            &report,
            &data.catalog,
            &fetch.progress,
            &data.offences,
            status,
        );
        let supply: Arc<dyn ShardSupply> = Arc::new(data.catalog.clone());
        data.source = Some(RunDataSource::Arriving(dir, supply));
        data.fetch = Some(fetch);
        Ok(data)
    }

    /// Fetches the training shards in `order` (file names, the order the trainer will read
    /// them; shards it does not name follow): the first now, alone, so the node starts as
    /// soon as it can; the others in the background while the node trains. When the
    /// background fetch fails, or `stop` is cancelled first, the shards still missing are
    /// given up: a trainer waiting for one gets the reason. Does nothing when this node did
    /// not fetch its data.
    pub async fn fetch_training_shards(
        &mut self,
        manifest: &RunManifest,
        order: &[String],
        stop: CancellationToken,
        status: &watch::Sender<NodeStatus>,
    ) -> Result<()> {
        let Some(fetch) = self.fetch.as_mut() else {
            return Ok(());
        };
        let mut train: Vec<ShardEntry> = manifest
            .data
            .shards
            .iter()
            .filter(|e| e.split == Split::Train)
            .cloned()
            .collect();
        train.sort_by_key(|e| {
            order
                .iter()
                .position(|n| *n == e.name)
                .unwrap_or(usize::MAX)
        });
        if train.is_empty() {
            bail!("run {} pins no training shard", manifest.run_id());
        }
        let rest = train.split_off(1);
        let first = train;

        let report = fetch
            .fetcher
            .fetch(
                &first,
                &fetch.dir,
                fetch.peer_list(),
                Some(self.catalog.clone()),
                fetch.progress.clone(),
            )
            .await
            .with_context(|| format!("cannot fetch the first training shard {}", first[0].name))?;
        record_report(
            &report,
            &self.catalog,
            &fetch.progress,
            &self.offences,
            status,
        );
        fetch.bar.finish_and_clear();
        println!(
            "data_first shard={} shards_held={} shards_total={} seconds={:.2}",
            first[0].name,
            self.catalog.len(),
            manifest.data.shards.len(),
            fetch.started.elapsed().as_secs_f64(),
        );

        let (fetcher, progress) = (fetch.fetcher.clone(), fetch.progress.clone());
        let (dir, peers) = (fetch.dir.clone(), fetch.peer_list());
        let (catalog, offences) = (self.catalog.clone(), self.offences.clone());
        let (started, status) = (fetch.started, status.clone());
        fetch.training = Some(tokio::spawn(async move {
            let fetched =
                fetcher.fetch(&rest, &dir, peers, Some(catalog.clone()), progress.clone());
            let outcome = tokio::select! {
                outcome = fetched => outcome,
                _ = stop.cancelled() => {
                    catalog.give_up("the node is stopping".into());
                    return;
                }
            };
            match outcome {
                Ok(report) => {
                    record_report(&report, &catalog, &progress, &offences, &status);
                    print_data_ready(&progress, started, catalog.len(), &dir);
                }
                Err(e) => {
                    let why = format!("cannot fetch the run's data: {e}");
                    tracing::error!(error = %why, "the training shards still missing will not come");
                    println!("data_fetch_failed reason={why:?}");
                    catalog.give_up(why);
                }
            }
        }));
        Ok(())
    }

    /// Serves the shards of `--data` once the trainer checked them against the pinned table
    /// (they count as held, served or not).
    pub fn serve_given_directory(&self, args: &DataArgs, synthetic: bool, manifest: &RunManifest) {
        let Some(dir) = &args.dir else { return };
        if synthetic || manifest.data.shards.is_empty() {
            return;
        }
        for entry in &manifest.data.shards {
            self.catalog.insert(entry.clone(), dir.join(&entry.name));
        }
    }

    /// Where the fetch posts the peers that served bytes which do not hash to the pinned
    /// digest (`bad_shard`, an offence, unlike a source that failed or went away).
    pub fn offences(&self) -> OffenceInbox {
        self.offences.clone()
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
                    s.data.shards_held = held;
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

impl Drop for RunData {
    /// A node leaving stops its fetch; a trainer still waiting for a shard is told why.
    fn drop(&mut self) {
        if let Some(task) = self.fetch.as_ref().and_then(|f| f.training.as_ref()) {
            task.abort();
        }
        self.catalog.give_up("the node is leaving".into());
    }
}

/// A fetch of the run's pinned shards into `<home>/data`, in the steps of the module doc,
/// with what they share: the fetcher, the peers to ask, the progress counters and what
/// shows them.
struct DataFetch {
    fetcher: Arc<ShardFetcher>,
    dir: PathBuf,
    progress: FetchProgress,
    /// Every connected peer, refreshed in the background.
    peers: Arc<Mutex<Vec<PeerId>>>,
    bar: indicatif::ProgressBar,
    started: Instant,
    /// The background fetch of the training shards, once started.
    training: Option<JoinHandle<()>>,
    /// The peer refresher and the progress display.
    helpers: Vec<JoinHandle<()>>,
}

impl DataFetch {
    fn start(
        args: &DataArgs,
        manifest: &RunManifest,
        node: &SwarmNode,
        dir: &Path,
        status: &watch::Sender<NodeStatus>,
    ) -> Result<DataFetch> {
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
        let fetcher = Arc::new(ShardFetcher::new(node.client().stream_control(), config));
        let progress = FetchProgress::new();

        // The peers to ask: every connected peer, refreshed in the background (the fetcher
        // asks for them synchronously whenever it looks for a source again).
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
                    bar.set_position(p.bytes_fetched.min(total));
                    status.send_modify(|s| s.data.bytes_fetched = p.bytes_fetched);
                    if status.is_closed() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            })
        };
        Ok(DataFetch {
            fetcher,
            dir: dir.to_path_buf(),
            progress,
            peers,
            bar,
            started: Instant::now(),
            training: None,
            helpers: vec![refresh, show],
        })
    }

    /// The fetcher's view of the peers to ask.
    fn peer_list(&self) -> impl Fn() -> Vec<PeerId> + Send + Sync + 'static {
        let peers = self.peers.clone();
        move || peers.lock().expect("peer list lock").clone()
    }
}

impl Drop for DataFetch {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
        for helper in &self.helpers {
            helper.abort();
        }
    }
}

/// One line per shard of a finished fetch and per bad source; the shards held, the bytes
/// fetched and the bad sources go into `/status`, and a peer whose bytes failed the digest is posted as a
/// `bad_shard` offence.
fn record_report(
    report: &FetchReport,
    catalog: &ShardCatalog,
    progress: &FetchProgress,
    offences: &OffenceInbox,
    status: &watch::Sender<NodeStatus>,
) {
    status.send_modify(|s| {
        s.data.shards_held = catalog.len() as u64;
        s.data.bytes_fetched = progress.snapshot().bytes_fetched;
        s.data.bad_sources.extend(
            report
                .bad_sources
                .iter()
                .map(|b| format!("{} {}: {}", b.source, b.shard, b.reason)),
        )
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
        if let (true, ShardSource::Peer(peer)) = (bad.wrong_bytes, &bad.source) {
            offences.post(*peer, RefusalKind::BadShard);
        }
    }
}

/// The line that says every shard is here: how many, how many bytes were downloaded, and
/// the goodput since the fetch began.
fn print_data_ready(progress: &FetchProgress, started: Instant, held: usize, dir: &Path) {
    let p = progress.snapshot();
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "data_ready shards={held} bytes_fetched={} seconds={seconds:.2} goodput_mbit={:.1} dir={}",
        p.bytes_fetched,
        p.bytes_fetched as f64 * 8e-6 / seconds.max(1e-9),
        dir.display()
    );
}
