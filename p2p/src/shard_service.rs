//! `/gasloc/shard/1`: serving the run's pinned token shards to peers. This module owns the
//! wire format and the server ([`ShardService`], serving what its [`ShardCatalog`] holds);
//! [`crate::shard_client`] has the two client calls (`list_shards`, `fetch_range`), and
//! [`crate::shard_fetch`] builds whole-shard downloads on top of them.
//!
//! # Wire format
//!
//! One request per stream, opened by the requester:
//!
//! - **Request**: u32 little-endian length (at most [`MAX_SHARD_REQUEST`] = 1 KiB), then a
//!   protobuf `ShardRequest { run_id: bytes (32), name: string, offset: u64, length: u64 }`.
//!   An empty `name` is a list request: "which shards do you hold?".
//! - **Response**: u32 little-endian length (at most [`MAX_SHARD_RESPONSE`] = 64 KiB), then
//!   a protobuf `ShardResponse { error: string, names: repeated string, length: u64 }`,
//!   then exactly `length` raw bytes of the shard starting at `offset`; the server then
//!   closes the stream.
//!
//! A range is at most [`MAX_SHARD_CHUNK`] (4 MiB) and must lie inside the shard. The
//! server answers exactly the requested length or refuses: `error` is non-empty, reads
//! `<reason>: <detail>` (reasons: [`ShardRefusal`]: `wrong-run`, `unknown-shard`,
//! `out-of-range`, `bad-length`, `busy`, `bad-request`, `unavailable`), and no bytes
//! follow. A list answer names at most what fits in 64 KiB, each a safe shard file name
//! ([`is_shard_file_name`]); the requester ignores any other. The requester refuses a
//! response that announces any length other than the one it asked for, before allocating.
//! A request length prefix over 1 KiB makes the server close the stream without reading
//! further; a request not complete within the request timeout (10 s) too.
//!
//! # Limits
//!
//! The server serves at most `max_streams` streams at once (32 by default) and
//! `max_streams_per_peer` from one peer (2); streams beyond those are answered `busy`. The
//! bytes it sends are paced by an optional per-peer rate and by the node's upload cap
//! ([`UploadLimiter`]). File ranges are read on blocking threads, in pieces of
//! [`SEND_PIECE`], so a stream holds at most one piece in memory.

use crate::upload_limit::UploadLimiter;
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, StreamExt};
use gasloc_data::ShardSupply;
use gasloc_proto::wire::{ShardRequest, ShardResponse};
use gasloc_proto::{RunId, ShardEntry};
use libp2p::{PeerId, Stream, StreamProtocol};
use prost::Message;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;

pub const SHARD_PROTOCOL: StreamProtocol = StreamProtocol::new("/gasloc/shard/1");
/// Largest request message (after the length prefix).
pub const MAX_SHARD_REQUEST: u32 = 1024;
/// Largest response header (after the length prefix); bounds a list answer.
pub const MAX_SHARD_RESPONSE: u32 = 64 << 10;
/// Largest range one request may ask for.
pub const MAX_SHARD_CHUNK: u64 = 4 << 20;
/// Bytes the server reads from disk and sends at a time.
pub const SEND_PIECE: usize = 256 << 10;
/// Longest refusal or error text from a peer kept (the rest is cut).
pub(crate) const MAX_PEER_TEXT_CHARS: usize = 256;
/// Tasks that only answer `busy` at once; streams beyond them are dropped.
const BUSY_ANSWERERS: usize = 16;
/// How long a `busy` answer may take (request read and response).
const BUSY_ANSWER_TIMEOUT: Duration = Duration::from_secs(2);
/// Per-peer state entries kept for idle peers before they are pruned.
const MAX_IDLE_PEER_ENTRIES: usize = 4096;

/// Whether `name` is a shard file name the manifest could pin: letters, digits, `.`, `_`,
/// `-`, not starting with `.`, ending in `.bin`, at most 200 bytes (so never a path).
pub fn is_shard_file_name(name: &str) -> bool {
    let safe = |c: char| c.is_ascii_alphanumeric() || "._-".contains(c);
    !name.is_empty()
        && name.len() <= 200
        && name.ends_with(".bin")
        && !name.starts_with('.')
        && name.chars().all(safe)
}

/// Why the server refused a request: the word that opens the response's `error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShardRefusal {
    WrongRun,
    UnknownShard,
    OutOfRange,
    BadLength,
    Busy,
    BadRequest,
    /// The shard is in the catalog but its file could not be read.
    Unavailable,
}

impl ShardRefusal {
    pub const ALL: [ShardRefusal; 7] = [
        ShardRefusal::WrongRun,
        ShardRefusal::UnknownShard,
        ShardRefusal::OutOfRange,
        ShardRefusal::BadLength,
        ShardRefusal::Busy,
        ShardRefusal::BadRequest,
        ShardRefusal::Unavailable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ShardRefusal::WrongRun => "wrong-run",
            ShardRefusal::UnknownShard => "unknown-shard",
            ShardRefusal::OutOfRange => "out-of-range",
            ShardRefusal::BadLength => "bad-length",
            ShardRefusal::Busy => "busy",
            ShardRefusal::BadRequest => "bad-request",
            ShardRefusal::Unavailable => "unavailable",
        }
    }

    /// The reason a response's `error` names, if it names a known one.
    pub fn of_error(error: &str) -> Option<ShardRefusal> {
        let word = error.split(':').next().unwrap_or_default().trim();
        ShardRefusal::ALL.into_iter().find(|r| r.as_str() == word)
    }

    fn index(self) -> usize {
        ShardRefusal::ALL
            .iter()
            .position(|r| *r == self)
            .expect("every reason is in ALL")
    }
}

impl std::fmt::Display for ShardRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why reading or writing a shard message failed.
#[derive(Debug, thiserror::Error)]
pub enum ShardWireError {
    #[error("stream closed before a message")]
    Eof,
    #[error("{what} of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        what: &'static str,
        len: u32,
        max: u32,
    },
    #[error("{what} does not decode: {detail}")]
    Malformed { what: &'static str, detail: String },
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

/// Reads one u32-LE-length-prefixed protobuf message of at most `max` bytes; the length is
/// checked before anything is allocated.
async fn read_message<R: AsyncRead + Unpin, M: Message + Default>(
    r: &mut R,
    max: u32,
    what: &'static str,
) -> Result<M, ShardWireError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut len[got..]).await?;
        if n == 0 {
            return Err(if got == 0 {
                ShardWireError::Eof
            } else {
                ShardWireError::Malformed {
                    what,
                    detail: "stream ended inside the length prefix".into(),
                }
            });
        }
        got += n;
    }
    let len = u32::from_le_bytes(len);
    if len > max {
        return Err(ShardWireError::TooLarge { what, len, max });
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            ShardWireError::Malformed {
                what,
                detail: format!("stream ended inside its {len} bytes"),
            }
        } else {
            ShardWireError::Io(e)
        }
    })?;
    M::decode(body.as_slice()).map_err(|e| ShardWireError::Malformed {
        what,
        detail: e.to_string(),
    })
}

async fn write_message<W: AsyncWrite + Unpin, M: Message>(
    w: &mut W,
    message: &M,
) -> std::io::Result<()> {
    let body = message.encode_to_vec();
    let len = u32::try_from(body.len())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "message over 4 GiB"))?;
    w.write_all(&len.to_le_bytes()).await?;
    w.write_all(&body).await
}

/// Writes a request (length prefix and message); the caller closes its side after.
pub async fn write_request<W: AsyncWrite + Unpin>(
    w: &mut W,
    request: &ShardRequest,
) -> std::io::Result<()> {
    write_message(w, request).await
}

/// Reads a request, refusing a length prefix over [`MAX_SHARD_REQUEST`].
pub async fn read_request<R: AsyncRead + Unpin>(r: &mut R) -> Result<ShardRequest, ShardWireError> {
    read_message(r, MAX_SHARD_REQUEST, "shard request").await
}

/// Writes a response header; its `length` bytes are written by the caller after it.
pub async fn write_response<W: AsyncWrite + Unpin>(
    w: &mut W,
    response: &ShardResponse,
) -> std::io::Result<()> {
    write_message(w, response).await
}

/// Reads a response header, refusing a length prefix over [`MAX_SHARD_RESPONSE`].
pub async fn read_response<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<ShardResponse, ShardWireError> {
    read_message(r, MAX_SHARD_RESPONSE, "shard response").await
}

/// The verified shards this node holds and serves, by name, with the file that holds each.
/// A cheap, cloneable handle: the fetcher inserts a shard once it verified it, the service
/// reads, and a trainer that opened the run's data ahead of its shards waits here for the
/// one it needs ([`ShardSupply`]) until it is inserted or the fetch gives up.
#[derive(Debug, Clone, Default)]
pub struct ShardCatalog {
    inner: Arc<CatalogInner>,
}

#[derive(Debug, Default)]
struct CatalogInner {
    state: Mutex<CatalogState>,
    /// Notified on every insert and on giving up.
    changed: Condvar,
}

#[derive(Debug, Default)]
struct CatalogState {
    shards: HashMap<String, (ShardEntry, PathBuf)>,
    /// Why the shards still missing will not come (the fetch failed or stopped).
    given_up: Option<String>,
}

impl ShardCatalog {
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, CatalogState> {
        self.inner.state.lock().expect("shard catalog lock")
    }

    /// Serves `entry` from `path` from now on. The caller has verified the file against the
    /// entry (the service checks only that ranges lie inside `entry.bytes`).
    pub fn insert(&self, entry: ShardEntry, path: PathBuf) {
        self.state()
            .shards
            .insert(entry.name.clone(), (entry, path));
        self.inner.changed.notify_all();
    }

    /// No shard missing now will be inserted: whoever waits for one gets `why`.
    pub fn give_up(&self, why: String) {
        self.state().given_up.get_or_insert(why);
        self.inner.changed.notify_all();
    }

    /// The names served, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.state().shards.keys().cloned().collect();
        names.sort();
        names
    }

    pub fn len(&self) -> usize {
        self.state().shards.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn contains(&self, name: &str) -> bool {
        self.state().shards.contains_key(name)
    }

    /// The entry and file of a served shard.
    pub fn get(&self, name: &str) -> Option<(ShardEntry, PathBuf)> {
        self.state().shards.get(name).cloned()
    }
}

/// A trainer's data waits here for its shards: blocks (on the trainer's thread, never on
/// the async runtime's) until the shard is in the catalog — verified, under its own name —
/// or the fetch gave up.
impl ShardSupply for ShardCatalog {
    fn wait_for(&self, name: &str) -> Result<(), String> {
        let mut state = self.state();
        loop {
            if state.shards.contains_key(name) {
                return Ok(());
            }
            if let Some(why) = &state.given_up {
                return Err(why.clone());
            }
            state = self.inner.changed.wait(state).expect("shard catalog lock");
        }
    }
}

/// Settings of the shard service.
#[derive(Debug, Clone)]
pub struct ShardServeConfig {
    pub run_id: RunId,
    /// Streams one peer may have open at once; more are answered `busy`.
    pub max_streams_per_peer: usize,
    /// Streams served at once over all peers; more are answered `busy`.
    pub max_streams: usize,
    /// Bytes per second one peer is sent at most (None: unpaced per peer).
    pub per_peer_rate: Option<u64>,
    /// The node's upload cap (`--max-upload-rate`), shared with the exchange.
    pub upload: Option<Arc<UploadLimiter>>,
    /// Time a peer has to send its whole request.
    pub request_timeout: Duration,
    /// Time the response (header and bytes) may take to send; a peer that reads slower
    /// loses the stream.
    pub send_timeout: Duration,
}

impl ShardServeConfig {
    pub fn new(run_id: RunId) -> Self {
        ShardServeConfig {
            run_id,
            max_streams_per_peer: 2,
            max_streams: 32,
            per_peer_rate: None,
            upload: None,
            request_timeout: Duration::from_secs(10),
            send_timeout: Duration::from_secs(120),
        }
    }
}

/// A snapshot of what the service did since it started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardServeStats {
    /// Shard bytes sent (response headers not counted).
    pub bytes_served: u64,
    /// Ranges sent completely.
    pub ranges_served: u64,
    pub lists_served: u64,
    /// Requests refused, by reason (every reason present, zero or not).
    pub refusals: Vec<(ShardRefusal, u64)>,
    /// Streams closed without an answer: a request length over the limit, a request not
    /// complete in time, or a stream dropped because even the `busy` answerers were busy.
    pub streams_dropped: u64,
    /// Streams being served now.
    pub streams_open: u64,
}

impl ShardServeStats {
    pub fn refused(&self, reason: ShardRefusal) -> u64 {
        self.refusals
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0, |(_, n)| *n)
    }
}

#[derive(Default)]
struct Counters {
    bytes_served: AtomicU64,
    ranges_served: AtomicU64,
    lists_served: AtomicU64,
    refusals: [AtomicU64; ShardRefusal::ALL.len()],
    streams_dropped: AtomicU64,
    streams_open: AtomicU64,
}

/// One peer's open streams and its rate pacer.
struct PeerSlot {
    open: usize,
    pacer: Option<Arc<UploadLimiter>>,
}

struct ServiceInner {
    config: ShardServeConfig,
    catalog: ShardCatalog,
    counters: Counters,
    peers: Mutex<HashMap<PeerId, PeerSlot>>,
}

impl ServiceInner {
    fn refused(&self, reason: ShardRefusal) {
        self.counters.refusals[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Takes one of `peer`'s stream slots, or None when it has `max_streams_per_peer`.
    fn claim_peer_slot(self: &Arc<Self>, peer: PeerId) -> Option<PeerStreamGuard> {
        let mut peers = self.peers.lock().expect("shard peers lock");
        if peers.len() > MAX_IDLE_PEER_ENTRIES {
            peers.retain(|_, slot| slot.open > 0);
        }
        let slot = peers.entry(peer).or_insert_with(|| PeerSlot {
            open: 0,
            pacer: self
                .config
                .per_peer_rate
                .map(|rate| Arc::new(UploadLimiter::new(rate))),
        });
        if slot.open >= self.config.max_streams_per_peer {
            return None;
        }
        slot.open += 1;
        Some(PeerStreamGuard {
            inner: self.clone(),
            peer,
            pacer: slot.pacer.clone(),
        })
    }
}

/// Holds one of a peer's stream slots; gives it back when dropped.
struct PeerStreamGuard {
    inner: Arc<ServiceInner>,
    peer: PeerId,
    pacer: Option<Arc<UploadLimiter>>,
}

impl Drop for PeerStreamGuard {
    fn drop(&mut self) {
        let mut peers = self.inner.peers.lock().expect("shard peers lock");
        if let Some(slot) = peers.get_mut(&self.peer) {
            slot.open = slot.open.saturating_sub(1);
        }
    }
}

/// A handle to the running shard service; the accept loop stops when the last handle is
/// dropped.
#[derive(Clone)]
pub struct ShardService {
    inner: Arc<ServiceInner>,
    _accept_loop: Arc<AbortOnDrop>,
}

struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum ShardServiceError {
    #[error("{SHARD_PROTOCOL} is already registered on this swarm")]
    AlreadyRegistered,
}

impl ShardService {
    /// Registers [`SHARD_PROTOCOL`] on the swarm behind `control` and spawns the accept loop.
    pub fn start(
        mut control: libp2p_stream::Control,
        catalog: ShardCatalog,
        config: ShardServeConfig,
    ) -> Result<ShardService, ShardServiceError> {
        let incoming = control
            .accept(SHARD_PROTOCOL)
            .map_err(|_| ShardServiceError::AlreadyRegistered)?;
        let inner = Arc::new(ServiceInner {
            config,
            catalog,
            counters: Counters::default(),
            peers: Mutex::new(HashMap::new()),
        });
        let task = tokio::spawn(accept_loop(Arc::downgrade(&inner), incoming));
        Ok(ShardService {
            inner,
            _accept_loop: Arc::new(AbortOnDrop(task.abort_handle())),
        })
    }

    pub fn catalog(&self) -> &ShardCatalog {
        &self.inner.catalog
    }

    pub fn stats(&self) -> ShardServeStats {
        let c = &self.inner.counters;
        ShardServeStats {
            bytes_served: c.bytes_served.load(Ordering::Relaxed),
            ranges_served: c.ranges_served.load(Ordering::Relaxed),
            lists_served: c.lists_served.load(Ordering::Relaxed),
            refusals: ShardRefusal::ALL
                .into_iter()
                .map(|r| (r, c.refusals[r.index()].load(Ordering::Relaxed)))
                .collect(),
            streams_dropped: c.streams_dropped.load(Ordering::Relaxed),
            streams_open: c.streams_open.load(Ordering::Relaxed),
        }
    }
}

/// Hands each inbound stream to a task at once (libp2p-stream drops inbound streams while
/// the accept loop is slow): a serving task when the overall and per-peer limits allow, a
/// `busy` answerer otherwise, or nothing when even those are all busy.
async fn accept_loop(
    inner: std::sync::Weak<ServiceInner>,
    mut incoming: libp2p_stream::IncomingStreams,
) {
    let (serving, answering_busy) = match inner.upgrade() {
        Some(i) => (
            Arc::new(Semaphore::new(i.config.max_streams)),
            Arc::new(Semaphore::new(BUSY_ANSWERERS)),
        ),
        None => return,
    };
    while let Some((peer, stream)) = incoming.next().await {
        let Some(inner) = inner.upgrade() else { return };
        let permit = serving.clone().try_acquire_owned().ok();
        let guard = permit.as_ref().and_then(|_| inner.claim_peer_slot(peer));
        if let (Some(permit), Some(guard)) = (permit, guard) {
            tokio::spawn(async move {
                let _permit = permit;
                inner.counters.streams_open.fetch_add(1, Ordering::Relaxed);
                serve_stream(&inner, peer, stream, &guard).await;
                inner.counters.streams_open.fetch_sub(1, Ordering::Relaxed);
                drop(guard);
            });
        } else if let Ok(permit) = answering_busy.clone().try_acquire_owned() {
            tokio::spawn(async move {
                let _permit = permit;
                answer_busy(&inner, peer, stream).await;
            });
        } else {
            tracing::debug!(%peer, "shard service: too many streams; dropping one");
            inner
                .counters
                .streams_dropped
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Reads the request (briefly) so the refusal reaches the peer, and answers `busy`.
async fn answer_busy(inner: &ServiceInner, peer: PeerId, mut stream: Stream) {
    let answer = async {
        read_request(&mut stream).await.ok()?;
        let response = refusal(
            ShardRefusal::Busy,
            format!(
                "serving {} streams overall or {} for this peer already; try later",
                inner.config.max_streams, inner.config.max_streams_per_peer
            ),
        );
        write_response(&mut stream, &response).await.ok()?;
        stream.close().await.ok()
    };
    match tokio::time::timeout(BUSY_ANSWER_TIMEOUT, answer).await {
        Ok(Some(())) => inner.refused(ShardRefusal::Busy),
        _ => {
            tracing::debug!(%peer, "shard service: busy answer not delivered");
            inner
                .counters
                .streams_dropped
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn refusal(reason: ShardRefusal, detail: String) -> ShardResponse {
    ShardResponse {
        error: format!("{reason}: {detail}"),
        ..Default::default()
    }
}

/// What to send for a request that passed the checks.
#[derive(Debug, PartialEq, Eq)]
pub enum ShardAnswer {
    List(Vec<String>),
    Range {
        path: PathBuf,
        offset: u64,
        length: u64,
    },
}

/// Checks a request against the run and the catalog (what the server does with every
/// request it decoded; pure, so the fuzz target runs exactly this).
pub fn check_request(
    run_id: &RunId,
    catalog: &ShardCatalog,
    request: &ShardRequest,
) -> Result<ShardAnswer, (ShardRefusal, String)> {
    if request.run_id.as_slice() != run_id.as_bytes() {
        return Err((
            ShardRefusal::WrongRun,
            format!(
                "run {} is not this node's run {}",
                hex::encode(&request.run_id[..request.run_id.len().min(32)]),
                run_id
            ),
        ));
    }
    if request.name.is_empty() {
        return Ok(ShardAnswer::List(names_that_fit(catalog.names())));
    }
    let shown: String = request.name.chars().take(MAX_PEER_TEXT_CHARS).collect();
    let Some((entry, path)) = catalog.get(&request.name) else {
        return Err((
            ShardRefusal::UnknownShard,
            format!("this node does not serve {shown:?}"),
        ));
    };
    let (offset, length) = (request.offset, request.length);
    if length == 0 || length > MAX_SHARD_CHUNK {
        return Err((
            ShardRefusal::BadLength,
            format!("a range is 1 to {MAX_SHARD_CHUNK} bytes, not {length}"),
        ));
    }
    if offset
        .checked_add(length)
        .is_none_or(|end| end > entry.bytes)
    {
        return Err((
            ShardRefusal::OutOfRange,
            format!(
                "{length} bytes from {offset} go past the end of {shown} ({} bytes)",
                entry.bytes
            ),
        ));
    }
    Ok(ShardAnswer::Range {
        path,
        offset,
        length,
    })
}

/// The first names (sorted) whose list answer fits in [`MAX_SHARD_RESPONSE`].
fn names_that_fit(names: Vec<String>) -> Vec<String> {
    // Each name costs its bytes plus a tag and a length varint (at most 3 bytes here).
    let budget = MAX_SHARD_RESPONSE as usize - 16;
    let mut used = 0;
    names
        .into_iter()
        .take_while(|name| {
            used += name.len() + 4;
            used <= budget
        })
        .collect()
}

async fn serve_stream(
    inner: &ServiceInner,
    peer: PeerId,
    mut stream: Stream,
    guard: &PeerStreamGuard,
) {
    let cfg = &inner.config;
    let request = match tokio::time::timeout(cfg.request_timeout, read_request(&mut stream)).await {
        Ok(Ok(request)) => request,
        Ok(Err(e @ ShardWireError::Malformed { .. })) => {
            let response = refusal(ShardRefusal::BadRequest, e.to_string());
            inner.refused(ShardRefusal::BadRequest);
            let _ = tokio::time::timeout(cfg.send_timeout, async {
                write_response(&mut stream, &response).await?;
                stream.close().await
            })
            .await;
            return;
        }
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %e, "shard request unreadable; closing the stream");
            inner
                .counters
                .streams_dropped
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, "no shard request within {:?}", cfg.request_timeout);
            inner
                .counters
                .streams_dropped
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    let answer = match check_request(&cfg.run_id, &inner.catalog, &request) {
        Ok(answer) => answer,
        Err((reason, detail)) => {
            tracing::debug!(%peer, %reason, %detail, "shard request refused");
            inner.refused(reason);
            let _ = tokio::time::timeout(cfg.send_timeout, async {
                write_response(&mut stream, &refusal(reason, detail)).await?;
                stream.close().await
            })
            .await;
            return;
        }
    };
    let sent = tokio::time::timeout(
        cfg.send_timeout,
        send_answer(inner, &mut stream, answer, guard),
    )
    .await
    .unwrap_or_else(|_| Err(format!("not sent within {:?}", cfg.send_timeout)));
    if let Err(e) = sent {
        tracing::debug!(%peer, error = %e, "shard response failed");
    }
}

async fn send_answer(
    inner: &ServiceInner,
    stream: &mut Stream,
    answer: ShardAnswer,
    guard: &PeerStreamGuard,
) -> Result<(), String> {
    let io = |e: std::io::Error| e.to_string();
    let (path, offset, length) = match answer {
        ShardAnswer::List(names) => {
            let response = ShardResponse {
                names,
                ..Default::default()
            };
            write_response(stream, &response).await.map_err(io)?;
            stream.close().await.map_err(io)?;
            inner.counters.lists_served.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        ShardAnswer::Range {
            path,
            offset,
            length,
        } => (path, offset, length),
    };
    // Open and position the file before answering, so that a missing file is a refusal.
    let opened = tokio::task::spawn_blocking(move || {
        use std::io::{Seek, SeekFrom};
        let mut file = std::fs::File::open(&path)?;
        if file.metadata()?.len() < offset + length {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the file is shorter than its catalog entry",
            ));
        }
        file.seek(SeekFrom::Start(offset))?;
        Ok(file)
    })
    .await
    .map_err(|e| e.to_string())?;
    let mut file = match opened {
        Ok(file) => file,
        Err(e) => {
            inner.refused(ShardRefusal::Unavailable);
            let response = refusal(ShardRefusal::Unavailable, e.to_string());
            write_response(stream, &response).await.map_err(io)?;
            stream.close().await.map_err(io)?;
            return Err(format!("shard file unreadable: {e}"));
        }
    };
    let header = ShardResponse {
        length,
        ..Default::default()
    };
    write_response(stream, &header).await.map_err(io)?;
    let mut left = length;
    while left > 0 {
        let piece = left.min(SEND_PIECE as u64) as usize;
        let (returned, bytes) = tokio::task::spawn_blocking(move || {
            use std::io::Read;
            let mut bytes = vec![0u8; piece];
            let read = file.read_exact(&mut bytes);
            (file, read.map(|()| bytes))
        })
        .await
        .map_err(|e| e.to_string())?;
        file = returned;
        let bytes = bytes.map_err(|e| format!("reading the shard file: {e}"))?;
        if let Some(pacer) = &guard.pacer {
            pacer.pace(piece).await;
        }
        if let Some(upload) = &inner.config.upload {
            upload.pace(piece).await;
        }
        stream.write_all(&bytes).await.map_err(io)?;
        inner
            .counters
            .bytes_served
            .fetch_add(piece as u64, Ordering::Relaxed);
        left -= piece as u64;
    }
    stream.close().await.map_err(io)?;
    inner.counters.ranges_served.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str) -> ShardEntry {
        ShardEntry {
            name: name.into(),
            split: gasloc_proto::Split::Train,
            bytes: 1024,
            tokens: 0,
            sha256: "0".repeat(64),
        }
    }

    #[test]
    fn a_trainer_waiting_in_the_catalog_gets_its_shard_or_the_reason_it_will_not_come() {
        let catalog = ShardCatalog::new();
        catalog.insert(entry("a_train_000000.bin"), "a".into());
        assert_eq!(catalog.wait_for("a_train_000000.bin"), Ok(()));

        // A shard inserted while a thread waits for it wakes that thread.
        let waiting = {
            let catalog = catalog.clone();
            std::thread::spawn(move || catalog.wait_for("a_train_000001.bin"))
        };
        std::thread::sleep(Duration::from_millis(50));
        catalog.insert(entry("a_train_000001.bin"), "b".into());
        assert_eq!(waiting.join().unwrap(), Ok(()));

        // Giving up wakes every waiter with the first reason; held shards stay held.
        let waiting = {
            let catalog = catalog.clone();
            std::thread::spawn(move || catalog.wait_for("a_train_000002.bin"))
        };
        std::thread::sleep(Duration::from_millis(50));
        catalog.give_up("no source has it".into());
        catalog.give_up("the node is leaving".into());
        assert_eq!(waiting.join().unwrap(), Err("no source has it".into()));
        assert_eq!(catalog.wait_for("a_train_000000.bin"), Ok(()));
        assert_eq!(catalog.len(), 2);
    }

    #[test]
    fn shard_names_are_file_names_never_paths() {
        assert!(is_shard_file_name("fineweb_train_000001.bin"));
        for bad in [
            "",
            "../x.bin",
            "a/b.bin",
            ".hidden.bin",
            "x.txt",
            "a b.bin",
            "é.bin",
        ] {
            assert!(!is_shard_file_name(bad), "{bad:?}");
        }
        assert!(!is_shard_file_name(&format!("{}.bin", "a".repeat(200))));
    }

    #[test]
    fn refusal_reasons_round_trip_through_the_error_text() {
        for reason in ShardRefusal::ALL {
            let text = refusal(reason, "detail".into()).error;
            assert_eq!(ShardRefusal::of_error(&text), Some(reason), "{text}");
        }
        assert_eq!(ShardRefusal::of_error("something else"), None);
    }

    #[test]
    fn a_long_list_is_cut_to_fit_the_response_limit() {
        let names: Vec<String> = (0..10_000)
            .map(|i| format!("shard_train_{i:06}.bin"))
            .collect();
        let fit = names_that_fit(names);
        let response = ShardResponse {
            names: fit.clone(),
            ..Default::default()
        };
        assert!(response.encoded_len() <= MAX_SHARD_RESPONSE as usize);
        assert!(fit.len() > 2000, "{}", fit.len());
    }

    #[tokio::test]
    async fn an_oversized_request_prefix_is_refused_before_allocating() {
        let mut bytes = (MAX_SHARD_REQUEST + 1).to_le_bytes().to_vec();
        bytes.extend([0u8; 8]);
        let e = read_request(&mut futures::io::Cursor::new(bytes))
            .await
            .unwrap_err();
        assert!(matches!(e, ShardWireError::TooLarge { .. }), "{e}");
    }
}
