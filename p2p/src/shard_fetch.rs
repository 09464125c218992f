//! Fetching a run's pinned shards into a data directory, from swarm peers
//! ([`crate::shard_service`]) and from the manifest's HTTP(S) mirrors. This module owns
//! where each shard comes from, the `.part` files, resumption, verification and the move
//! into place.
//!
//! For each pinned shard not already present and verified, [`ShardFetcher::fetch`] picks a
//! source that holds it (mirrors are assumed to hold every shard; peers say which they hold
//! when asked with [`list_shards`], and are asked again when no source is left), and
//! downloads the shard from that one source, chunk after chunk, into `<dir>/<name>.part`.
//! A `.part` left by an earlier attempt is continued from its length rounded down to a
//! chunk. The complete file is checked against the manifest ([`verify_shard_file`], on a
//! blocking thread), synced and renamed to `<dir>/<name>`: a file under a shard's final
//! name is always a whole, verified shard.
//!
//! Shards are fetched several at a time, each from the least loaded source that holds it
//! (a peer serves at most two of a fetch's downloads at once, its default stream limit),
//! so N sources fill a node about N times as fast as one. A source that fails (an error, a
//! refusal other than `busy`, or bytes that do not hash to the pinned digest) is dropped
//! for that shard and reported in [`FetchReport::bad_sources`]; the shard then comes from
//! another source. A shard no source holds for [`FetchConfig::patience`] ends the fetch
//! with [`FetchError::NoSource`].

use crate::shard_client::{fetch_range, list_shards};
use crate::shard_service::{is_shard_file_name, ShardRefusal};
use crate::shard_service::{ShardCatalog, MAX_SHARD_CHUNK};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use gasloc_data::pin::verify_shard_file;
use gasloc_data::DataError;
use gasloc_proto::{RunId, ShardEntry};
use libp2p::PeerId;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Where a shard's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ShardSource {
    Peer(PeerId),
    /// A mirror's base URL (the shard is at `<mirror>/<name>`).
    Mirror(String),
}

impl std::fmt::Display for ShardSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShardSource::Peer(peer) => write!(f, "peer {peer}"),
            ShardSource::Mirror(url) => write!(f, "mirror {url}"),
        }
    }
}

/// Settings of a [`ShardFetcher`].
#[derive(Debug, Clone)]
pub struct FetchConfig {
    pub run_id: RunId,
    /// The manifest's `data.mirrors` (http(s) base URLs).
    pub mirrors: Vec<String>,
    /// Bytes asked for per request: 1 to [`MAX_SHARD_CHUNK`] (default 1 MiB).
    pub chunk_bytes: u64,
    /// Shards downloaded at once (default 3).
    pub parallel_shards: usize,
    /// Time one request (a list, a range) may take.
    pub request_timeout: Duration,
    /// How long a shard may have no source before the fetch gives up (default 60 s).
    pub patience: Duration,
    /// How long to wait before asking again when no source is free.
    pub retry_delay: Duration,
}

impl FetchConfig {
    pub fn new(run_id: RunId, mirrors: Vec<String>) -> Self {
        FetchConfig {
            run_id,
            mirrors,
            chunk_bytes: 1 << 20,
            parallel_shards: 3,
            request_timeout: Duration::from_secs(30),
            patience: Duration::from_secs(60),
            retry_delay: Duration::from_millis(500),
        }
    }
}

/// Why a fetch stopped.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("no source has shard {shard} (waited {patience:?}): {}", tried_text(.tried))]
    NoSource {
        shard: String,
        patience: Duration,
        /// Each source tried and why it was dropped.
        tried: Vec<String>,
    },
    #[error("shard name {0:?} is not a shard file name")]
    UnsafeName(String),
    #[error("fetch settings: {0}")]
    Config(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Data(#[from] DataError),
    #[error("a blocking task failed: {0}")]
    Task(String),
}

fn tried_text(tried: &[String]) -> String {
    if tried.is_empty() {
        "no peer listed it and no mirror was tried".into()
    } else {
        format!("tried {}", tried.join("; "))
    }
}

/// Counters a status page reads while a fetch runs (cheap to clone, shared). Fetches that
/// share one add up: a node fetching its first shards, then the rest, shows one total.
#[derive(Debug, Clone, Default)]
pub struct FetchProgress {
    counters: Arc<ProgressCounters>,
}

#[derive(Debug, Default)]
struct ProgressCounters {
    bytes_total: AtomicU64,
    bytes_fetched: AtomicU64,
    shards_total: AtomicU64,
    shards_held: AtomicU64,
}

/// A reading of [`FetchProgress`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FetchProgressSnapshot {
    /// Bytes of every shard the fetches sharing these counters were asked for.
    pub bytes_total: u64,
    /// Bytes downloaded by this process (bytes of resumed `.part` files not counted).
    pub bytes_fetched: u64,
    pub shards_total: u64,
    /// Shards present and verified.
    pub shards_held: u64,
}

impl FetchProgress {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn snapshot(&self) -> FetchProgressSnapshot {
        let c = &self.counters;
        FetchProgressSnapshot {
            bytes_total: c.bytes_total.load(Ordering::Relaxed),
            bytes_fetched: c.bytes_fetched.load(Ordering::Relaxed),
            shards_total: c.shards_total.load(Ordering::Relaxed),
            shards_held: c.shards_held.load(Ordering::Relaxed),
        }
    }
}

/// One shard of a finished fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardFetched {
    pub name: String,
    /// The source of the verified bytes; None when the shard was already present.
    pub source: Option<ShardSource>,
    /// Bytes downloaded for it by this process, from all sources (bad ones included).
    pub bytes_fetched: u64,
}

/// A source dropped for a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadSource {
    pub source: ShardSource,
    pub shard: String,
    pub reason: String,
    /// The source's bytes did not hash to the pinned digest (it alone wrote the shard): an
    /// offence, unlike a source that failed or went away.
    pub wrong_bytes: bool,
}

/// What a finished fetch did.
#[derive(Debug, Clone, Default)]
pub struct FetchReport {
    /// In the order of the entries given.
    pub shards: Vec<ShardFetched>,
    pub bad_sources: Vec<BadSource>,
}

/// Downloads that may start for one shard before the fetch gives up on it (each failure
/// drops a source, so this only bounds sources that keep coming back).
const MAX_DOWNLOADS_PER_SHARD: usize = 32;
/// A forced re-listing of the peers happens at most this often.
const RELIST_INTERVAL: Duration = Duration::from_secs(1);
/// Downloads of one fetch served by one peer at once: the shard service's default
/// per-peer stream limit, so the fetch does not make a peer answer busy.
const MAX_DOWNLOADS_PER_PEER: usize = 2;
/// List requests in flight at once.
const LISTS_AT_ONCE: usize = 16;

/// Fetches pinned shards from peers (over the swarm behind `control`) and mirrors.
pub struct ShardFetcher {
    control: libp2p_stream::Control,
    config: FetchConfig,
    http: ureq::Agent,
}

/// Which shards each peer said it holds, and how many downloads each source serves now.
#[derive(Default)]
struct SourceBook {
    holders: HashMap<PeerId, HashSet<String>>,
    in_use: HashMap<ShardSource, usize>,
    last_listed: Option<Instant>,
}

/// The state one `fetch` call shares between its shard downloads.
struct FetchRun<'a> {
    dir: &'a Path,
    peers: &'a (dyn Fn() -> Vec<PeerId> + Send + Sync),
    catalog: Option<&'a ShardCatalog>,
    progress: &'a FetchProgress,
    book: Mutex<SourceBook>,
    /// Told whenever a download gives its source slot back, so that a shard waiting for a
    /// free source starts at once (not up to a `retry_delay` later, the link idle).
    freed: tokio::sync::Notify,
    /// Serializes re-listing (one round of list requests at a time).
    listing: tokio::sync::Mutex<()>,
    bad_sources: Mutex<Vec<BadSource>>,
}

/// A download slot taken on a source; given back when dropped.
struct SourceInUse<'a> {
    book: &'a Mutex<SourceBook>,
    freed: &'a tokio::sync::Notify,
    source: ShardSource,
}

impl Drop for SourceInUse<'_> {
    fn drop(&mut self) {
        let mut book = self.book.lock().expect("source book lock");
        if let Some(n) = book.in_use.get_mut(&self.source) {
            *n = n.saturating_sub(1);
        }
        drop(book);
        self.freed.notify_waiters();
    }
}

/// What [`ShardFetcher::pick_source`] found for a shard.
enum Pick<'r> {
    Source(SourceInUse<'r>),
    /// Sources hold the shard, but each serves this fetch its most downloads already.
    AllOccupied,
    /// No source that is neither dropped nor cooling down holds it.
    Nothing,
}

/// How a download from one source ended, when it did not give a verified shard.
enum SourceFailure {
    /// The source is busy: try it (or another) again shortly.
    Busy(String),
    /// The peer does not serve the shard (any more).
    NotHeld(String),
    /// The source failed (an error, a refusal, a timeout): drop it for this shard.
    Bad(String),
    /// The source alone wrote the whole `.part`, and it does not hash to the pinned
    /// digest: drop it for this shard; a peer has offended.
    WrongBytes(String),
    /// The complete file did not verify, but bytes from more than one source (or from an
    /// earlier process) were in it: the `.part` is deleted and nobody is blamed.
    MixedMismatch(String),
    /// A local problem (disk): the fetch stops.
    Local(FetchError),
}

/// Which sources wrote the bytes of a shard's `.part`.
#[derive(Default)]
struct PartOrigin {
    sources: HashSet<ShardSource>,
    /// Bytes from before this process were kept.
    inherited: bool,
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Runs `work` on a blocking thread.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, FetchError> + Send + 'static,
) -> Result<T, FetchError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| FetchError::Task(e.to_string()))?
}

impl ShardFetcher {
    pub fn new(control: libp2p_stream::Control, config: FetchConfig) -> Self {
        let http = ureq::Agent::config_builder()
            .timeout_global(Some(config.request_timeout))
            .http_status_as_error(false)
            .build()
            .into();
        ShardFetcher {
            control,
            config,
            http,
        }
    }

    pub fn config(&self) -> &FetchConfig {
        &self.config
    }

    /// Makes `dir` hold every shard of `entries`, verified. `peers` names the peers to ask
    /// (called again whenever they are re-asked; leave this node out). Each verified shard
    /// (present or fetched) is inserted into `catalog`, so this node serves it.
    pub async fn fetch(
        &self,
        entries: &[ShardEntry],
        dir: &Path,
        peers: impl Fn() -> Vec<PeerId> + Send + Sync,
        catalog: Option<ShardCatalog>,
        progress: FetchProgress,
    ) -> Result<FetchReport, FetchError> {
        let cfg = &self.config;
        if cfg.chunk_bytes == 0 || cfg.chunk_bytes > MAX_SHARD_CHUNK {
            return Err(FetchError::Config(format!(
                "chunk of {} bytes: it must be 1 to {MAX_SHARD_CHUNK}",
                cfg.chunk_bytes
            )));
        }
        if let Some(bad) = entries.iter().find(|e| !is_shard_file_name(&e.name)) {
            return Err(FetchError::UnsafeName(bad.name.clone()));
        }
        let mut names = HashSet::new();
        if let Some(twice) = entries.iter().find(|e| !names.insert(&e.name)) {
            // Two downloads would write one `.part`.
            return Err(FetchError::Config(format!(
                "{} is listed twice",
                twice.name
            )));
        }
        let owned_dir = dir.to_path_buf();
        blocking(move || std::fs::create_dir_all(&owned_dir).map_err(io_error(&owned_dir))).await?;
        let c = &progress.counters;
        c.shards_total
            .fetch_add(entries.len() as u64, Ordering::Relaxed);
        c.bytes_total
            .fetch_add(entries.iter().map(|e| e.bytes).sum(), Ordering::Relaxed);

        let run = FetchRun {
            dir,
            peers: &peers,
            catalog: catalog.as_ref(),
            progress: &progress,
            book: Mutex::new(SourceBook::default()),
            freed: tokio::sync::Notify::new(),
            listing: tokio::sync::Mutex::new(()),
            bad_sources: Mutex::new(Vec::new()),
        };
        let run = &run;
        // The downloads are made up front (a future does nothing until polled) and boxed:
        // a closure inside the stream would make the whole fetch lose `Send`.
        let downloads: Vec<BoxFuture<'_, Result<(usize, ShardFetched), FetchError>>> = entries
            .iter()
            .enumerate()
            .map(|(i, entry)| {
                self.fetch_shard(run, entry)
                    .map(move |shard| shard.map(|s| (i, s)))
                    .boxed()
            })
            .collect();
        let mut results: Vec<(usize, ShardFetched)> = futures::stream::iter(downloads)
            .buffer_unordered(cfg.parallel_shards.max(1))
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        results.sort_by_key(|(i, _)| *i);
        let bad_sources = std::mem::take(&mut *run.bad_sources.lock().expect("bad sources lock"));
        Ok(FetchReport {
            shards: results.into_iter().map(|(_, s)| s).collect(),
            bad_sources,
        })
    }

    /// One shard, present or fetched, verified and in the catalog.
    async fn fetch_shard(
        &self,
        run: &FetchRun<'_>,
        entry: &ShardEntry,
    ) -> Result<ShardFetched, FetchError> {
        let cfg = &self.config;
        let final_path = run.dir.join(&entry.name);
        let part_path = run.dir.join(format!("{}.part", entry.name));
        let mut shard = ShardFetched {
            name: entry.name.clone(),
            source: None,
            bytes_fetched: 0,
        };
        if self.already_held(entry, &final_path).await? {
            self.held(run, entry, final_path);
            return Ok(shard);
        }
        // Sources dropped for this shard, and why.
        let mut dropped: Vec<(ShardSource, String)> = Vec::new();
        // Sources that answered busy: not asked again before the instant.
        let mut cooling: HashMap<ShardSource, Instant> = HashMap::new();
        let mut origin = PartOrigin::default();
        let mut first_download = true;
        // The last time this shard made progress or lost a source: the patience counts
        // from there (so a source that only ever answers busy does not keep it waiting).
        let mut hopeful_since = Instant::now();
        let mut downloads = 0;
        loop {
            let order = (run.peers)();
            self.list_new_peers(run, &order).await;
            // Made before looking, so that a slot given back after the look wakes it.
            let freed = run.freed.notified();
            let slot = match self.pick_source(run, entry, &order, &dropped, &cooling) {
                Pick::Source(slot) if downloads < MAX_DOWNLOADS_PER_SHARD => slot,
                Pick::Source(_) => return Err(no_source(entry, cfg.patience, &dropped, &cooling)),
                Pick::AllOccupied => {
                    // Its sources are busy with this fetch's other shards: not a lack of
                    // sources, so the patience does not run. Another download ending
                    // frees a slot; `retry_delay` bounds the wait all the same.
                    hopeful_since = Instant::now();
                    let _ = tokio::time::timeout(cfg.retry_delay, freed).await;
                    continue;
                }
                Pick::Nothing => {
                    if hopeful_since.elapsed() >= cfg.patience {
                        return Err(no_source(entry, cfg.patience, &dropped, &cooling));
                    }
                    tokio::time::sleep(cfg.retry_delay).await;
                    self.relist_peers(run).await;
                    continue;
                }
            };
            downloads += 1;
            let source = slot.source.clone();
            let fetched_before = shard.bytes_fetched;
            let outcome = self
                .download(
                    run,
                    entry,
                    &source,
                    &part_path,
                    &mut origin,
                    std::mem::take(&mut first_download),
                    &mut shard.bytes_fetched,
                )
                .await;
            drop(slot);
            if shard.bytes_fetched > fetched_before {
                hopeful_since = Instant::now();
            }
            match outcome {
                Ok(()) => {
                    self.install(&part_path, &final_path).await?;
                    shard.source = Some(source);
                    self.held(run, entry, final_path);
                    return Ok(shard);
                }
                Err(SourceFailure::Busy(why)) => {
                    tracing::debug!(shard = %entry.name, %source, %why, "source busy");
                    cooling.insert(source, Instant::now() + cfg.retry_delay);
                }
                Err(SourceFailure::NotHeld(why)) => {
                    tracing::debug!(shard = %entry.name, %source, %why, "source does not hold the shard");
                    if let ShardSource::Peer(peer) = &source {
                        let mut book = run.book.lock().expect("source book lock");
                        if let Some(names) = book.holders.get_mut(peer) {
                            names.remove(&entry.name);
                        }
                    }
                }
                Err(SourceFailure::MixedMismatch(why)) => {
                    tracing::warn!(shard = %entry.name, %why, "shard did not verify; fetching it again from the start");
                }
                Err(failure @ (SourceFailure::Bad(_) | SourceFailure::WrongBytes(_))) => {
                    let (reason, wrong_bytes) = match failure {
                        SourceFailure::WrongBytes(reason) => (reason, true),
                        SourceFailure::Bad(reason) => (reason, false),
                        _ => unreachable!("matched above"),
                    };
                    tracing::warn!(shard = %entry.name, %source, %reason, "dropping a source for this shard");
                    run.bad_sources
                        .lock()
                        .expect("bad sources lock")
                        .push(BadSource {
                            source: source.clone(),
                            shard: entry.name.clone(),
                            reason: reason.clone(),
                            wrong_bytes,
                        });
                    dropped.push((source, reason));
                    hopeful_since = Instant::now();
                }
                Err(SourceFailure::Local(e)) => return Err(e),
            }
        }
    }

    /// Whether `path` already holds the verified shard.
    async fn already_held(&self, entry: &ShardEntry, path: &Path) -> Result<bool, FetchError> {
        let (entry, path) = (entry.clone(), path.to_path_buf());
        blocking(move || {
            if !path.is_file() {
                return Ok(false);
            }
            match verify_shard_file(&path, &entry) {
                Ok(()) => Ok(true),
                Err(DataError::NotPinned { problem, .. }) => {
                    tracing::warn!(path = %path.display(), %problem, "present but not the pinned shard; fetching it");
                    Ok(false)
                }
                Err(e) => Err(e.into()),
            }
        })
        .await
    }

    fn held(&self, run: &FetchRun<'_>, entry: &ShardEntry, path: PathBuf) {
        if let Some(catalog) = run.catalog {
            catalog.insert(entry.clone(), path);
        }
        run.progress
            .counters
            .shards_held
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Asks the peers not asked yet which shards they hold.
    async fn list_new_peers(&self, run: &FetchRun<'_>, order: &[PeerId]) {
        let new: Vec<PeerId> = {
            let book = run.book.lock().expect("source book lock");
            order
                .iter()
                .filter(|p| !book.holders.contains_key(p))
                .copied()
                .collect()
        };
        if new.is_empty() {
            return;
        }
        let _listing = run.listing.lock().await;
        // Another shard's download may have asked them while this one waited.
        let still_new: Vec<PeerId> = {
            let book = run.book.lock().expect("source book lock");
            new.into_iter()
                .filter(|p| !book.holders.contains_key(p))
                .collect()
        };
        if !still_new.is_empty() {
            self.list(run, still_new).await;
        }
    }

    /// Asks every peer again (no more often than [`RELIST_INTERVAL`]).
    async fn relist_peers(&self, run: &FetchRun<'_>) {
        let _listing = run.listing.lock().await;
        let recent = run
            .book
            .lock()
            .expect("source book lock")
            .last_listed
            .is_some_and(|at| at.elapsed() < RELIST_INTERVAL);
        if !recent {
            self.list(run, (run.peers)()).await;
        }
    }

    /// Asks `peers` (a few at a time) which shards they hold. A peer that does not answer
    /// keeps what it said before (nothing, if it never answered).
    async fn list(&self, run: &FetchRun<'_>, peers: Vec<PeerId>) {
        let cfg = &self.config;
        let asks: Vec<BoxFuture<'_, _>> = peers
            .into_iter()
            .map(|peer| {
                list_shards(&self.control, peer, cfg.run_id, cfg.request_timeout)
                    .map(move |listed| (peer, listed))
                    .boxed()
            })
            .collect();
        let answers: Vec<_> = futures::stream::iter(asks)
            .buffer_unordered(LISTS_AT_ONCE)
            .collect()
            .await;
        let mut book = run.book.lock().expect("source book lock");
        for (peer, listed) in answers {
            match listed {
                Ok(names) => {
                    book.holders.insert(peer, names.into_iter().collect());
                }
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "listing a peer's shards failed");
                    book.holders.entry(peer).or_default();
                }
            }
        }
        book.last_listed = Some(Instant::now());
    }

    /// The least loaded source that holds `entry`, is neither dropped nor cooling down, and
    /// if a peer serves fewer than [`MAX_DOWNLOADS_PER_PEER`] of this fetch's downloads
    /// (mirrors first, then peers in `order`, on ties), with a download slot taken on it.
    fn pick_source<'r>(
        &self,
        run: &'r FetchRun<'_>,
        entry: &ShardEntry,
        order: &[PeerId],
        dropped: &[(ShardSource, String)],
        cooling: &HashMap<ShardSource, Instant>,
    ) -> Pick<'r> {
        let now = Instant::now();
        let mut book = run.book.lock().expect("source book lock");
        let holders = &book.holders;
        let candidates: Vec<ShardSource> = self
            .config
            .mirrors
            .iter()
            .map(|m| ShardSource::Mirror(m.clone()))
            .chain(
                order
                    .iter()
                    .filter(|p| {
                        holders
                            .get(p)
                            .is_some_and(|names| names.contains(&entry.name))
                    })
                    .map(|p| ShardSource::Peer(*p)),
            )
            .filter(|s| !dropped.iter().any(|(d, _)| d == s))
            .filter(|s| cooling.get(s).is_none_or(|until| *until <= now))
            .collect();
        if candidates.is_empty() {
            return Pick::Nothing;
        }
        let load = |s: &ShardSource| book.in_use.get(s).copied().unwrap_or(0);
        let chosen = candidates
            .into_iter()
            .filter(|s| match s {
                ShardSource::Peer(_) => load(s) < MAX_DOWNLOADS_PER_PEER,
                ShardSource::Mirror(_) => true,
            })
            .min_by_key(|s| load(s));
        let Some(chosen) = chosen else {
            return Pick::AllOccupied;
        };
        *book.in_use.entry(chosen.clone()).or_insert(0) += 1;
        Pick::Source(SourceInUse {
            book: &run.book,
            freed: &run.freed,
            source: chosen,
        })
    }

    /// Downloads the rest of `entry` from `source` into `part` and verifies it.
    #[allow(clippy::too_many_arguments)]
    async fn download(
        &self,
        run: &FetchRun<'_>,
        entry: &ShardEntry,
        source: &ShardSource,
        part: &Path,
        origin: &mut PartOrigin,
        first_download: bool,
        fetched: &mut u64,
    ) -> Result<(), SourceFailure> {
        let chunk = self.config.chunk_bytes;
        let mut offset = self
            .resume_offset(entry, part)
            .await
            .map_err(SourceFailure::Local)?;
        if offset == 0 {
            *origin = PartOrigin::default();
        } else if first_download {
            origin.inherited = true;
        }
        while offset < entry.bytes {
            let length = chunk.min(entry.bytes - offset);
            let bytes = self.fetch_chunk(entry, source, offset, length).await?;
            origin.sources.insert(source.clone());
            let owned_part = part.to_path_buf();
            blocking(move || write_at(&owned_part, offset, &bytes))
                .await
                .map_err(SourceFailure::Local)?;
            offset += length;
            *fetched += length;
            run.progress
                .counters
                .bytes_fetched
                .fetch_add(length, Ordering::Relaxed);
        }
        let (owned_part, owned_entry) = (part.to_path_buf(), entry.clone());
        let verified = blocking(move || {
            sync_file(&owned_part)?;
            Ok(verify_shard_file(&owned_part, &owned_entry))
        })
        .await
        .map_err(SourceFailure::Local)?;
        match verified {
            Ok(()) => Ok(()),
            Err(DataError::NotPinned { problem, .. }) => {
                let owned_part = part.to_path_buf();
                blocking(move || std::fs::remove_file(&owned_part).map_err(io_error(&owned_part)))
                    .await
                    .map_err(SourceFailure::Local)?;
                let single = origin.sources.len() == 1 && !origin.inherited;
                *origin = PartOrigin::default();
                let reason = format!("the shard it sent {problem}");
                Err(if single {
                    SourceFailure::WrongBytes(reason)
                } else {
                    SourceFailure::MixedMismatch(reason)
                })
            }
            Err(e) => Err(SourceFailure::Local(e.into())),
        }
    }

    /// Where to continue `part`: its length rounded down to a chunk (0 when it is missing
    /// or longer than the shard); the file is cut there (and created).
    async fn resume_offset(&self, entry: &ShardEntry, part: &Path) -> Result<u64, FetchError> {
        let (chunk, bytes, part) = (self.config.chunk_bytes, entry.bytes, part.to_path_buf());
        blocking(move || {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&part)
                .map_err(io_error(&part))?;
            let len = file.metadata().map_err(io_error(&part))?.len();
            let offset = if len > bytes { 0 } else { len / chunk * chunk };
            file.set_len(offset).map_err(io_error(&part))?;
            Ok(offset)
        })
        .await
    }

    /// One chunk from one source, as received (unverified).
    async fn fetch_chunk(
        &self,
        entry: &ShardEntry,
        source: &ShardSource,
        offset: u64,
        length: u64,
    ) -> Result<Vec<u8>, SourceFailure> {
        let cfg = &self.config;
        match source {
            ShardSource::Peer(peer) => fetch_range(
                &self.control,
                *peer,
                cfg.run_id,
                &entry.name,
                offset,
                length,
                cfg.request_timeout,
            )
            .await
            .map_err(|e| match e.refusal_reason() {
                Some(ShardRefusal::Busy) => SourceFailure::Busy(e.to_string()),
                Some(ShardRefusal::UnknownShard) => SourceFailure::NotHeld(e.to_string()),
                _ => SourceFailure::Bad(e.to_string()),
            }),
            ShardSource::Mirror(base) => {
                let url = format!("{}/{}", base.trim_end_matches('/'), entry.name);
                let (agent, file_bytes) = (self.http.clone(), entry.bytes);
                tokio::task::spawn_blocking(move || {
                    http_range(&agent, &url, offset, length, file_bytes)
                        .map_err(|e| format!("{url}: {e}"))
                })
                .await
                .map_err(|e| SourceFailure::Local(FetchError::Task(e.to_string())))?
                .map_err(SourceFailure::Bad)
            }
        }
    }

    /// Syncs the verified `.part`, renames it to the shard's name and syncs the directory.
    async fn install(&self, part: &Path, final_path: &Path) -> Result<(), FetchError> {
        let (part, final_path) = (part.to_path_buf(), final_path.to_path_buf());
        blocking(move || {
            std::fs::rename(&part, &final_path).map_err(io_error(&final_path))?;
            if let Some(dir) = final_path.parent() {
                // Makes the rename durable; not every platform can open a directory.
                if let Ok(dir) = std::fs::File::open(dir) {
                    let _ = dir.sync_all();
                }
            }
            Ok(())
        })
        .await
    }
}

fn no_source(
    entry: &ShardEntry,
    patience: Duration,
    dropped: &[(ShardSource, String)],
    busy: &HashMap<ShardSource, Instant>,
) -> FetchError {
    let dropped = dropped
        .iter()
        .map(|(source, why)| format!("{source}: {why}"));
    let busy = busy.keys().map(|source| format!("{source}: busy"));
    FetchError::NoSource {
        shard: entry.name.clone(),
        patience,
        tried: dropped.chain(busy).collect(),
    }
}

fn write_at(path: &Path, offset: u64, bytes: &[u8]) -> Result<(), FetchError> {
    use std::io::{Seek, SeekFrom, Write};
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_error(path))?;
    file.seek(SeekFrom::Start(offset)).map_err(io_error(path))?;
    file.write_all(bytes).map_err(io_error(path))
}

fn sync_file(path: &Path) -> Result<(), FetchError> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io_error(path))
}

/// `length` bytes of the file at `url` from `offset` by an HTTP range request (blocking).
/// Accepts a 206 whose Content-Range is exactly the range asked for, or a 200 when the
/// range is the whole file; reads at most `length` bytes.
fn http_range(
    agent: &ureq::Agent,
    url: &str,
    offset: u64,
    length: u64,
    file_bytes: u64,
) -> Result<Vec<u8>, String> {
    let last = offset + length - 1;
    let mut response = agent
        .get(url)
        .header("Range", &format!("bytes={offset}-{last}"))
        .call()
        .map_err(|e| e.to_string())?;
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    match response.status().as_u16() {
        206 => {
            let range = header("content-range").ok_or("206 without a Content-Range")?;
            let asked = format!("bytes {offset}-{last}/");
            let total = range.strip_prefix(&asked);
            if !total.is_some_and(|t| t == "*" || t == file_bytes.to_string()) {
                return Err(format!(
                    "answered range {range:?}, asked for bytes {offset}-{last} of {file_bytes}"
                ));
            }
        }
        200 if offset == 0 && length == file_bytes => {}
        200 => return Err("answered the whole file (200) to a range request".into()),
        status => return Err(format!("HTTP status {status}")),
    }
    if let Some(announced) = header("content-length") {
        if announced.trim().parse::<u64>().ok() != Some(length) {
            return Err(format!(
                "Content-Length {announced:?} for a range of {length} bytes"
            ));
        }
    }
    let bytes = response
        .body_mut()
        .with_config()
        .limit(length)
        .read_to_vec()
        .map_err(|e| format!("reading the body: {e}"))?;
    if bytes.len() as u64 != length {
        return Err(format!(
            "body of {} bytes for a range of {length}",
            bytes.len()
        ));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>(_: &T) {}

    #[test]
    fn a_fetch_can_run_on_a_spawned_task() {
        let control = libp2p_stream::Behaviour::new().new_control();
        let fetcher = ShardFetcher::new(
            control,
            FetchConfig::new(RunId::from_bytes([1; 32]), vec![]),
        );
        let fetch = fetcher.fetch(
            &[],
            Path::new("unused"),
            Vec::new,
            None,
            FetchProgress::new(),
        );
        assert_send(&fetch);
    }

    #[test]
    fn sources_name_themselves() {
        let mirror = ShardSource::Mirror("https://data.example/run".into());
        assert_eq!(mirror.to_string(), "mirror https://data.example/run");
        let peer = PeerId::random();
        assert_eq!(ShardSource::Peer(peer).to_string(), format!("peer {peer}"));
    }
}
