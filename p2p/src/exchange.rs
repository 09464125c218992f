//! The exchange wire protocol over any byte stream: headers, chunks, checks, refusals.
//!
//! This module owns what one side of `/gasloc/exchange/2` and `/gasloc/state/1` writes and
//! what it accepts; it does no networking of its own (see `exchange_service`), so it runs
//! over a libp2p stream as well as over an in-memory pipe. Nothing a peer sends is trusted:
//! every length is bounded before allocation, every chunk and tensor checksum is verified,
//! and a result is only returned once the whole payload has passed every check.

use crate::frames::{
    expect_end, read_frame, read_frame_prefix, write_frame, FrameError, FRAME_CHUNK, FRAME_DONE,
    FRAME_HEADER, FRAME_REFUSAL, FRAME_STATE_REQUEST,
};
use crate::tensors::{Tensor, TensorSet, TensorSpec};
use crate::upload_limit::UploadLimiter;
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, FutureExt};
use gasloc_proto::wire::{
    DType, Encoding, ExchangeHeader, PayloadKind, Refusal, RefusalReason, StateRequest,
    TensorEntry, DIGEST_LEN,
};
use gasloc_proto::{RefusalKind, RunId};
use libp2p::PeerId;
use prost::Message;
use std::sync::Arc;

/// Everything that can end an exchange without a result. The receiver's state is never
/// touched when one of these is returned.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("stream ended early while reading {0}")]
    Truncated(&'static str),
    #[error("{what} of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        what: &'static str,
        len: u64,
        max: u64,
    },
    #[error("malformed {what}: {detail}")]
    Malformed { what: &'static str, detail: String },
    #[error("header is for run {got}, not this run")]
    WrongRun { got: String },
    #[error("header is for round {got}, older than the expected round {expected}")]
    OldRound { got: u64, expected: u64 },
    #[error("header is for round {round}, whose exchange has ended on this node")]
    RoundClosed { round: u64 },
    #[error("header is for round {got}, ahead of the expected round {expected}")]
    FutureRound { got: u64, expected: u64 },
    #[error("peer {peer} is not a neighbour of this node in round {round}")]
    NotANeighbour { peer: PeerId, round: u64 },
    #[error("header names sender {claimed} but the stream is authenticated as {actual}")]
    SenderMismatch { claimed: String, actual: PeerId },
    #[error("payload kind {got:?}, expected {expected:?}")]
    WrongKind { got: i32, expected: PayloadKind },
    #[error("tensor table does not match the model: {0}")]
    TableMismatch(String),
    #[error("chunk {chunk} of tensor {tensor}: checksum mismatch")]
    ChunkChecksum { tensor: String, chunk: u64 },
    #[error("tensor {0}: checksum of the assembled bytes does not match the header")]
    TensorChecksum(String),
    #[error("refused by the peer ({reason:?}): {message}")]
    Refused {
        reason: RefusalReason,
        message: String,
    },
    #[error("unexpected frame kind {0}")]
    UnexpectedFrame(u8),
    #[error("no result within the deadline of {0:?}")]
    Deadline(std::time::Duration),
    #[error("could not open a stream to the peer: {0}")]
    Open(String),
    #[error("exchange cancelled: {0}")]
    Cancelled(String),
}

impl ExchangeError {
    fn from_frame(e: FrameError, what: &'static str) -> Self {
        match e {
            FrameError::Eof | FrameError::Truncated => ExchangeError::Truncated(what),
            FrameError::TooLarge { len, max, .. } => ExchangeError::TooLarge { what, len, max },
            FrameError::Io(e) => ExchangeError::Io(e),
        }
    }

    /// Why a receiver refuses the stream for this error, if it is the sender's fault.
    fn refusal_reason(&self) -> Option<RefusalReason> {
        Some(match self {
            ExchangeError::WrongRun { .. } => RefusalReason::WrongRun,
            ExchangeError::OldRound { .. } => RefusalReason::OldRound,
            ExchangeError::RoundClosed { .. } => RefusalReason::RoundClosed,
            ExchangeError::FutureRound { .. } => RefusalReason::FutureRound,
            ExchangeError::NotANeighbour { .. } | ExchangeError::SenderMismatch { .. } => {
                RefusalReason::NotANeighbour
            }
            ExchangeError::TableMismatch(_)
            | ExchangeError::WrongKind { .. }
            | ExchangeError::Malformed { .. } => RefusalReason::TableMismatch,
            ExchangeError::TooLarge { .. } => RefusalReason::TooLarge,
            _ => return None,
        })
    }

    /// The refusal a receiver sends back for this error, if it is the sender's fault.
    pub fn refusal(&self) -> Option<Refusal> {
        Some(Refusal {
            reason: self.refusal_reason()? as i32,
            message: self.to_string(),
        })
    }

    /// The kind of the refusal for this error (`table_mismatch`, …), if it is the sender's
    /// fault: how records, `/status` and `/metrics` count refused payloads.
    pub fn refusal_kind(&self) -> Option<RefusalKind> {
        Some(match self.refusal_reason()? {
            RefusalReason::Unspecified => RefusalKind::Unspecified,
            RefusalReason::WrongRun => RefusalKind::WrongRun,
            RefusalReason::OldRound => RefusalKind::OldRound,
            RefusalReason::FutureRound => RefusalKind::FutureRound,
            RefusalReason::NotANeighbour => RefusalKind::NotANeighbour,
            RefusalReason::TableMismatch => RefusalKind::TableMismatch,
            RefusalReason::TooLarge => RefusalKind::TooLarge,
            RefusalReason::Busy => RefusalKind::Busy,
            RefusalReason::NoState => RefusalKind::NoState,
            RefusalReason::RoundClosed => RefusalKind::RoundClosed,
        })
    }
}

/// Bounds on what a receiver accepts.
#[derive(Debug, Clone)]
pub struct ExchangeLimits {
    /// Largest encoded header.
    pub max_header_bytes: u32,
    /// Largest `chunk_size` a sender may announce.
    pub max_chunk_size: u32,
    /// Largest sum of tensor byte lengths.
    pub max_payload_bytes: u64,
    /// Most tensors in one table.
    pub max_tensors: usize,
}

impl Default for ExchangeLimits {
    fn default() -> Self {
        ExchangeLimits {
            max_header_bytes: 4 << 20,
            max_chunk_size: 16 << 20,
            max_payload_bytes: 32 << 30,
            max_tensors: 1 << 16,
        }
    }
}

/// How a sender cuts and encodes its payload.
#[derive(Debug, Clone)]
pub struct SendOptions {
    pub chunk_size: u32,
    /// `None`: raw chunks; `Some(level)`: every chunk is a zstd frame at that level.
    pub zstd_level: Option<i32>,
    /// The node's upload cap, shared by all its streams (`--max-upload-rate`).
    pub upload_limit: Option<Arc<UploadLimiter>>,
}

impl Default for SendOptions {
    fn default() -> Self {
        SendOptions {
            chunk_size: 1 << 20,
            zstd_level: None,
            upload_limit: None,
        }
    }
}

/// A payload ready to send to any number of peers: tensors plus their table, every chunk's
/// encoding and every checksum, computed once — by [`OutgoingPayload::new`], which hashes and
/// compresses every byte and so belongs on a blocking thread, never on the async runtime.
/// Sending it then only writes.
#[derive(Debug)]
pub struct OutgoingPayload {
    pub kind: PayloadKind,
    pub set: Arc<TensorSet>,
    entries: Vec<TensorEntry>,
    /// Per tensor, per chunk of `options.chunk_size` bytes: what goes on the wire.
    chunks: Vec<Vec<EncodedChunk>>,
    options: SendOptions,
}

/// One chunk as sent: its checksum, and its zstd frame when the payload is compressed (a raw
/// chunk is sent straight from the tensor).
#[derive(Debug)]
struct EncodedChunk {
    checksum: [u8; DIGEST_LEN],
    zstd: Option<Vec<u8>>,
}

impl OutgoingPayload {
    /// Encodes and hashes `set` (heavy: call it off the async runtime). A chunk that zstd
    /// cannot compress is a bug of the zstd library and panics with its message.
    pub fn new(kind: PayloadKind, set: Arc<TensorSet>, options: SendOptions) -> Self {
        let encoding = match options.zstd_level {
            Some(_) => Encoding::Zstd,
            None => Encoding::Raw,
        };
        let chunk_size = options.chunk_size.max(1) as usize;
        // One pass over each tensor: every chunk encoded and hashed, the tensor's own
        // checksum (of its raw bytes) grown chunk by chunk alongside.
        let mut entries = Vec::with_capacity(set.tensors.len());
        let mut chunks = Vec::with_capacity(set.tensors.len());
        for t in &set.tensors {
            let mut whole = blake3::Hasher::new();
            let encoded: Vec<EncodedChunk> = t
                .data
                .chunks(chunk_size)
                .map(|chunk| {
                    whole.update(chunk);
                    let zstd = options.zstd_level.map(|level| {
                        zstd::bulk::compress(chunk, level).expect("zstd compresses any bytes")
                    });
                    let on_wire = zstd.as_deref().unwrap_or(chunk);
                    EncodedChunk {
                        checksum: *blake3::hash(on_wire).as_bytes(),
                        zstd,
                    }
                })
                .collect();
            chunks.push(encoded);
            entries.push(TensorEntry {
                name: t.name.clone(),
                dtype: t.dtype as i32,
                shape: t.shape.clone(),
                encoding: encoding as i32,
                byte_length: t.data.len() as u64,
                checksum: whole.finalize().as_bytes().to_vec(),
            });
        }
        OutgoingPayload {
            kind,
            set,
            entries,
            chunks,
            options,
        }
    }

    /// The header this payload is sent with.
    pub fn header(&self, run_id: &RunId, round: u64, sender: &PeerId) -> ExchangeHeader {
        ExchangeHeader {
            run_id: run_id.to_vec(),
            round,
            sender: sender.to_bytes(),
            kind: self.kind as i32,
            tensors: self.entries.clone(),
            chunk_size: self.options.chunk_size,
        }
    }
}

/// Writes `header` (the payload's own, [`OutgoingPayload::header`]) and then every chunk of
/// `payload`, encoded and hashed already; returns the bytes written.
pub async fn send_payload<W: AsyncWrite + Unpin>(
    w: &mut W,
    header: &ExchangeHeader,
    payload: &OutgoingPayload,
) -> Result<u64, ExchangeError> {
    if header.chunk_size != payload.options.chunk_size {
        return Err(ExchangeError::Malformed {
            what: "header",
            detail: format!(
                "chunk size {} is not the payload's {}",
                header.chunk_size, payload.options.chunk_size
            ),
        });
    }
    let header_bytes = header.encode_to_vec();
    write_frame(w, FRAME_HEADER, &[&header_bytes]).await?;
    let mut written = 5 + header_bytes.len() as u64;
    let chunk_size = payload.options.chunk_size.max(1) as usize;
    for (tensor, encoded) in payload.set.tensors.iter().zip(&payload.chunks) {
        for (chunk, encoded) in tensor.data.chunks(chunk_size).zip(encoded) {
            let bytes = encoded.zstd.as_deref().unwrap_or(chunk);
            write_frame(w, FRAME_CHUNK, &[&encoded.checksum, bytes]).await?;
            written += 5 + DIGEST_LEN as u64 + bytes.len() as u64;
            if let Some(limit) = &payload.options.upload_limit {
                limit.pace(5 + DIGEST_LEN + bytes.len()).await;
            }
        }
    }
    w.flush().await?;
    Ok(written)
}

/// What a receiver checks a header against.
#[derive(Debug, Clone)]
pub struct Expectation {
    pub run_id: RunId,
    /// `Some(r)`: only round `r`; `None`: any round (state sync).
    pub round: Option<u64>,
    /// The authenticated remote peer.
    pub sender: PeerId,
    pub kind: PayloadKind,
    /// `Some`: the exact table (names, dtypes, shapes, in order); `None`: any valid table.
    pub table: Option<Arc<Vec<TensorSpec>>>,
}

/// Checks a decoded header against the expectation and the limits.
pub fn check_header(
    h: &ExchangeHeader,
    e: &Expectation,
    limits: &ExchangeLimits,
) -> Result<(), ExchangeError> {
    if h.run_id != e.run_id.as_bytes() {
        return Err(ExchangeError::WrongRun {
            got: hex::encode(&h.run_id),
        });
    }
    if h.sender != e.sender.to_bytes() {
        return Err(ExchangeError::SenderMismatch {
            claimed: PeerId::from_bytes(&h.sender)
                .map(|p| p.to_string())
                .unwrap_or_else(|_| hex::encode(&h.sender)),
            actual: e.sender,
        });
    }
    if let Some(expected) = e.round {
        if h.round < expected {
            return Err(ExchangeError::OldRound {
                got: h.round,
                expected,
            });
        }
        if h.round > expected {
            return Err(ExchangeError::FutureRound {
                got: h.round,
                expected,
            });
        }
    }
    if h.kind != e.kind as i32 {
        return Err(ExchangeError::WrongKind {
            got: h.kind,
            expected: e.kind,
        });
    }
    if h.chunk_size == 0 || h.chunk_size > limits.max_chunk_size {
        return Err(ExchangeError::TooLarge {
            what: "chunk size",
            len: h.chunk_size.into(),
            max: limits.max_chunk_size.into(),
        });
    }
    if h.tensors.len() > limits.max_tensors {
        return Err(ExchangeError::TooLarge {
            what: "tensor table",
            len: h.tensors.len() as u64,
            max: limits.max_tensors as u64,
        });
    }
    let mut total = 0u64;
    for entry in &h.tensors {
        let dtype = DType::try_from(entry.dtype).map_err(|_| malformed_entry(entry, "dtype"))?;
        Encoding::try_from(entry.encoding)
            .ok()
            .filter(|e| *e != Encoding::Unspecified)
            .ok_or_else(|| malformed_entry(entry, "encoding"))?;
        let len = TensorSpec::byte_length_of(dtype, &entry.shape)
            .ok_or_else(|| malformed_entry(entry, "shape or dtype"))?;
        if len != entry.byte_length {
            return Err(malformed_entry(entry, "byte length"));
        }
        if entry.checksum.len() != DIGEST_LEN {
            return Err(malformed_entry(entry, "checksum length"));
        }
        total = total.saturating_add(len);
    }
    if total > limits.max_payload_bytes {
        return Err(ExchangeError::TooLarge {
            what: "payload",
            len: total,
            max: limits.max_payload_bytes,
        });
    }
    if let Some(table) = &e.table {
        if table.len() != h.tensors.len() {
            return Err(ExchangeError::TableMismatch(format!(
                "{} tensors, expected {}",
                h.tensors.len(),
                table.len()
            )));
        }
        for (got, want) in h.tensors.iter().zip(table.iter()) {
            if got.name != want.name || got.dtype != want.dtype as i32 || got.shape != want.shape {
                return Err(ExchangeError::TableMismatch(format!(
                    "got {} {:?} {:?}, expected {} {:?} {:?}",
                    got.name,
                    DType::try_from(got.dtype).unwrap_or(DType::Unspecified),
                    got.shape,
                    want.name,
                    want.dtype,
                    want.shape
                )));
            }
        }
    }
    Ok(())
}

fn malformed_entry(entry: &TensorEntry, field: &str) -> ExchangeError {
    ExchangeError::Malformed {
        what: "tensor table",
        detail: format!("tensor {:?}: invalid {field}", entry.name),
    }
}

/// The first frame a stream can open with.
#[derive(Debug)]
pub enum FirstFrame {
    Header(ExchangeHeader),
    Refusal(Refusal),
    StateRequest(StateRequest),
}

/// The first frame on `/gasloc/state/1` as a serving node judges it: a state request for
/// `run_id`, or the error to refuse the stream with.
pub fn check_state_request(
    first: FirstFrame,
    run_id: &RunId,
) -> Result<StateRequest, ExchangeError> {
    match first {
        FirstFrame::StateRequest(request) if request.run_id == run_id.as_bytes() => Ok(request),
        FirstFrame::StateRequest(request) => Err(ExchangeError::WrongRun {
            got: hex::encode(request.run_id),
        }),
        _ => Err(ExchangeError::UnexpectedFrame(0)),
    }
}

/// Reads and decodes the first frame of a stream.
pub async fn read_first_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &ExchangeLimits,
) -> Result<FirstFrame, ExchangeError> {
    let max = u64::from(limits.max_header_bytes);
    let (kind, body) = read_frame(r, |_| max)
        .await
        .map_err(|e| ExchangeError::from_frame(e, "header"))?;
    let malformed = |e: prost::DecodeError| ExchangeError::Malformed {
        what: "header",
        detail: e.to_string(),
    };
    match kind {
        FRAME_HEADER => Ok(FirstFrame::Header(
            ExchangeHeader::decode(body.as_slice()).map_err(malformed)?,
        )),
        FRAME_REFUSAL => Ok(FirstFrame::Refusal(
            Refusal::decode(body.as_slice()).map_err(malformed)?,
        )),
        FRAME_STATE_REQUEST => Ok(FirstFrame::StateRequest(
            StateRequest::decode(body.as_slice()).map_err(malformed)?,
        )),
        other => Err(ExchangeError::UnexpectedFrame(other)),
    }
}

/// Reads the first frame and requires a header that passes [`check_header`]; a refusal
/// from the peer becomes [`ExchangeError::Refused`].
pub async fn read_checked_header<R: AsyncRead + Unpin>(
    r: &mut R,
    expect: &Expectation,
    limits: &ExchangeLimits,
) -> Result<ExchangeHeader, ExchangeError> {
    match read_first_frame(r, limits).await? {
        FirstFrame::Header(h) => {
            check_header(&h, expect, limits)?;
            Ok(h)
        }
        FirstFrame::Refusal(refusal) => Err(ExchangeError::Refused {
            reason: RefusalReason::try_from(refusal.reason).unwrap_or(RefusalReason::Unspecified),
            // The peer's words go into logs, records and /status: kept short.
            message: truncated(refusal.message, MAX_PEER_MESSAGE_CHARS),
        }),
        FirstFrame::StateRequest(_) => Err(ExchangeError::UnexpectedFrame(FRAME_STATE_REQUEST)),
    }
}

/// The most characters of a peer's refusal message this node keeps.
pub const MAX_PEER_MESSAGE_CHARS: usize = 256;

/// `text` cut to at most `max` characters (an ellipsis marks the cut).
fn truncated(text: String, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

/// Reads every chunk announced by a checked header, verifies it and assembles the tensors;
/// the stream must end there (state sync).
pub async fn receive_tensors<R: AsyncRead + Unpin>(
    r: &mut R,
    header: &ExchangeHeader,
) -> Result<TensorSet, ExchangeError> {
    let tensors = read_tensors(r, header).await?;
    expect_end(r).await.map_err(|_| ExchangeError::Malformed {
        what: "stream",
        detail: "bytes after the last chunk".into(),
    })?;
    Ok(tensors)
}

/// Chunks read but not yet verified, at most (the reader waits for the verifier beyond).
const VERIFY_QUEUE: usize = 4;

/// A chunk as read off the stream, for the verifier.
struct ReadChunk {
    checksum: [u8; DIGEST_LEN],
    body: Vec<u8>,
    /// The raw bytes it must decode to.
    raw_len: usize,
}

/// Reads every chunk announced by a checked header, verifies it and assembles the tensors.
///
/// The async side only reads: each chunk, bounded before allocation, goes to a verifier on a
/// blocking thread (`VERIFY_QUEUE` chunks ahead at most) that checks its checksum,
/// decompresses it, appends it and hashes the whole tensor as it grows — so BLAKE3 and zstd
/// never run on the runtime's threads, and reading the next chunk overlaps verifying this one.
async fn read_tensors<R: AsyncRead + Unpin>(
    r: &mut R,
    header: &ExchangeHeader,
) -> Result<TensorSet, ExchangeError> {
    let (chunks, inbox) = tokio::sync::mpsc::channel(VERIFY_QUEUE);
    let entries = header.tensors.clone();
    let verifier = tokio::task::spawn_blocking(move || verify_chunks(&entries, inbox));
    let read = read_chunks(r, header, chunks).await;
    let verified = verifier
        .await
        .map_err(|e| ExchangeError::Cancelled(format!("the chunk verifier ended: {e}")))?;
    // A bad chunk stops the reader by closing the queue: the verifier's error is the
    // result; a reader that failed ends the verifier early: the reader's error is.
    match (verified, read) {
        (Ok(tensors), Ok(())) => Ok(TensorSet::new(tensors)),
        (Err(Some(e)), _) | (_, Err(e)) => Err(e),
        (Err(None), Ok(())) => Err(ExchangeError::Truncated("chunk")),
    }
}

/// The reading half of [`read_tensors`]: frames off the stream, in header order.
async fn read_chunks<R: AsyncRead + Unpin>(
    r: &mut R,
    header: &ExchangeHeader,
    chunks: tokio::sync::mpsc::Sender<ReadChunk>,
) -> Result<(), ExchangeError> {
    let chunk_size = u64::from(header.chunk_size);
    for entry in &header.tensors {
        let zstd = entry.encoding == Encoding::Zstd as i32;
        let mut read = 0u64;
        while read < entry.byte_length {
            let raw_len = chunk_size.min(entry.byte_length - read) as usize;
            let max_body = DIGEST_LEN as u64 + encoded_bound(raw_len, zstd);
            let (kind, len) = read_frame_prefix(r, |_| max_body)
                .await
                .map_err(|e| ExchangeError::from_frame(e, "chunk"))?;
            if kind != FRAME_CHUNK {
                return Err(ExchangeError::UnexpectedFrame(kind));
            }
            if (len as usize) < DIGEST_LEN {
                return Err(ExchangeError::Malformed {
                    what: "chunk",
                    detail: format!("{len} bytes is shorter than its checksum"),
                });
            }
            let body_len = len as usize - DIGEST_LEN;
            if !zstd && body_len != raw_len {
                return Err(ExchangeError::Malformed {
                    what: "chunk",
                    detail: format!(
                        "tensor {} chunk {}: {body_len} bytes, expected {raw_len}",
                        entry.name,
                        read / chunk_size
                    ),
                });
            }
            let mut checksum = [0u8; DIGEST_LEN];
            r.read_exact(&mut checksum)
                .await
                .map_err(|_| ExchangeError::Truncated("chunk"))?;
            let mut body = vec![0u8; body_len];
            r.read_exact(&mut body)
                .await
                .map_err(|_| ExchangeError::Truncated("chunk"))?;
            let chunk = ReadChunk {
                checksum,
                body,
                raw_len,
            };
            if chunks.send(chunk).await.is_err() {
                return Ok(()); // the verifier stopped at a bad chunk: its error is the result
            }
            read += raw_len as u64;
        }
    }
    Ok(())
}

/// The verifying half of [`read_tensors`], on a blocking thread: the chunks of `entries`, in
/// order, each checked against its checksum (and decompressed), each tensor against its own.
/// `Err(None)`: the reader stopped before the last chunk (its own error says why).
fn verify_chunks(
    entries: &[TensorEntry],
    mut inbox: tokio::sync::mpsc::Receiver<ReadChunk>,
) -> Result<Vec<Tensor>, Option<ExchangeError>> {
    let mut tensors = Vec::with_capacity(entries.len());
    for entry in entries {
        let zstd = entry.encoding == Encoding::Zstd as i32;
        // Not `with_capacity(byte_length)`: that is the sender's word, up to the payload
        // limit (32 GiB), and would be reserved before a single byte came.
        let mut data = Vec::new();
        let mut whole = blake3::Hasher::new();
        let mut chunk_index = 0u64;
        while (data.len() as u64) < entry.byte_length {
            let Some(chunk) = inbox.blocking_recv() else {
                return Err(None);
            };
            if blake3::hash(&chunk.body).as_bytes() != &chunk.checksum {
                return Err(Some(ExchangeError::ChunkChecksum {
                    tensor: entry.name.clone(),
                    chunk: chunk_index,
                }));
            }
            let start = data.len();
            make_room(&mut data, chunk.raw_len, entry.byte_length);
            if zstd {
                let decoded = zstd::bulk::decompress(&chunk.body, chunk.raw_len).map_err(|e| {
                    Some(ExchangeError::Malformed {
                        what: "zstd chunk",
                        detail: format!("tensor {} chunk {chunk_index}: {e}", entry.name),
                    })
                })?;
                if decoded.len() != chunk.raw_len {
                    return Err(Some(ExchangeError::Malformed {
                        what: "zstd chunk",
                        detail: format!(
                            "tensor {} chunk {chunk_index}: {} bytes, expected {}",
                            entry.name,
                            decoded.len(),
                            chunk.raw_len
                        ),
                    }));
                }
                data.extend_from_slice(&decoded);
            } else {
                data.extend_from_slice(&chunk.body);
            }
            whole.update(&data[start..]);
            chunk_index += 1;
        }
        if whole.finalize().as_bytes().as_slice() != entry.checksum.as_slice() {
            return Err(Some(ExchangeError::TensorChecksum(entry.name.clone())));
        }
        let dtype = DType::try_from(entry.dtype).unwrap_or(DType::Unspecified);
        tensors.push(Tensor {
            name: entry.name.clone(),
            dtype,
            shape: entry.shape.clone(),
            data,
        });
    }
    Ok(tensors)
}

/// Room in `data`, a tensor of `total` bytes as it is assembled, for a chunk of `raw_len`
/// more: the capacity doubles as chunks arrive (amortised copies) but never passes
/// `total`, so a tensor ends with exactly its size reserved and at most twice the bytes
/// received so far are ever reserved.
fn make_room(data: &mut Vec<u8>, raw_len: usize, total: u64) {
    if data.capacity() - data.len() >= raw_len {
        return;
    }
    let remaining = usize::try_from(total).unwrap_or(usize::MAX) - data.len();
    data.reserve_exact(data.len().max(raw_len).min(remaining).max(raw_len));
}

/// The end of an exchange, once both payloads went through: tells the peer that its payload
/// arrived whole (a done frame), waits for the peer's done frame, which says that it verified
/// this node's payload, and only then closes this side and waits for the peer's close.
///
/// Both sides therefore agree on whether the exchange succeeded (both mix, or neither), and a
/// node may go away as soon as this returns. The order is what makes leaving safe: a QUIC
/// connection that closes discards whatever its streams still had in flight, so our done frame
/// could be lost if we left right after reading the peer's. Here we return only after the
/// peer's close, which the peer sends only after it holds our done frame; and once we hold
/// the peer's done frame, a connection that ends before its close is no failure (the peer
/// left after it had everything it needed: both payloads were verified on both sides).
async fn finish_exchange<R, W>(r: &mut R, w: &mut W) -> Result<(), ExchangeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    write_frame(w, FRAME_DONE, &[]).await?;
    w.flush().await?;
    let (kind, _) = read_frame(r, |_| 0)
        .await
        .map_err(|e| ExchangeError::from_frame(e, "the peer's done frame"))?;
    if kind != FRAME_DONE {
        return Err(ExchangeError::UnexpectedFrame(kind));
    }
    // The exchange has succeeded. A failing close or read from here on is a peer that went
    // away; only bytes after its done frame are an error.
    let closed = w.close().await;
    if let Err(FrameError::TooLarge { .. }) = expect_end(r).await {
        return Err(ExchangeError::Malformed {
            what: "stream",
            detail: "bytes after the done frame".into(),
        });
    }
    if let Err(e) = closed {
        tracing::debug!(error = %e, "closing a finished exchange stream failed: the peer left");
    }
    Ok(())
}

/// Upper bound of an encoded chunk of `raw_len` bytes.
fn encoded_bound(raw_len: usize, zstd: bool) -> u64 {
    if zstd {
        zstd::zstd_safe::compress_bound(raw_len) as u64
    } else {
        raw_len as u64
    }
}

/// Sends the header and payload, then closes our side of the stream (FIN).
pub async fn send_and_close<W: AsyncWrite + Unpin>(
    w: &mut W,
    header: &ExchangeHeader,
    payload: &OutgoingPayload,
) -> Result<(), ExchangeError> {
    send_payload(w, header, payload).await?;
    w.close().await?;
    Ok(())
}

/// Writes a refusal frame and closes the stream.
pub async fn refuse<W: AsyncWrite + Unpin>(w: &mut W, refusal: &Refusal) -> std::io::Result<()> {
    write_frame(w, FRAME_REFUSAL, &[&refusal.encode_to_vec()]).await?;
    w.close().await
}

/// Sends our payload and receives theirs at the same time on one stream. A receive error
/// ends the exchange at once; a send error is reported after the receive side has had its
/// chance to explain it (a refusal frame is a better reason than a broken pipe).
pub async fn send_and_receive<S, R, T>(send: S, receive: R) -> Result<T, ExchangeError>
where
    S: std::future::Future<Output = Result<(), ExchangeError>>,
    R: std::future::Future<Output = Result<T, ExchangeError>>,
{
    let send = send.fuse();
    let receive = receive.fuse();
    futures::pin_mut!(send, receive);
    futures::select! {
        sent = send => match sent {
            Ok(()) => receive.await,
            Err(send_error) => match receive.await {
                Err(receive_error) => Err(receive_error),
                Ok(_) => Err(send_error),
            },
        },
        received = receive => {
            let set = received?;
            send.await?;
            Ok(set)
        }
    }
}

/// The opening side of `/gasloc/exchange/2`: writes its header and payload while reading
/// the responder's, then the done frames. Returns the responder's tensors and when its
/// header arrived (the responder sends it once its own payload is ready).
pub async fn run_initiator<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    my_header: &ExchangeHeader,
    payload: &OutgoingPayload,
    expect: &Expectation,
    limits: &ExchangeLimits,
) -> Result<(TensorSet, tokio::time::Instant), ExchangeError> {
    let (mut r, mut w) = stream.split();
    let send = async { send_payload(&mut w, my_header, payload).await.map(|_| ()) };
    let receive = async {
        let header = read_checked_header(&mut r, expect, limits).await?;
        let header_at = tokio::time::Instant::now();
        Ok((read_tensors(&mut r, &header).await?, header_at))
    };
    let received = send_and_receive(send, receive).await?;
    finish_exchange(&mut r, &mut w).await?;
    Ok(received)
}

/// The accepting side of `/gasloc/exchange/2` once the initiator's header has been read and
/// checked: writes our payload while reading theirs, then the done frames.
pub async fn run_responder<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    their_header: &ExchangeHeader,
    my_header: &ExchangeHeader,
    payload: &OutgoingPayload,
) -> Result<TensorSet, ExchangeError> {
    let (mut r, mut w) = stream.split();
    let send = async { send_payload(&mut w, my_header, payload).await.map(|_| ()) };
    let receive = read_tensors(&mut r, their_header);
    let received = send_and_receive(send, receive).await?;
    finish_exchange(&mut r, &mut w).await?;
    Ok(received)
}

/// Encodes a state-sync request frame.
pub async fn write_state_request<W: AsyncWrite + Unpin>(
    w: &mut W,
    run_id: &RunId,
) -> std::io::Result<()> {
    let request = StateRequest {
        run_id: run_id.to_vec(),
    };
    write_frame(w, FRAME_STATE_REQUEST, &[&request.encode_to_vec()]).await?;
    w.close().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::{ready, Context, Poll};
    use std::time::Duration;
    use tokio::sync::mpsc;

    /// Found while writing the `exchange_frames` fuzz target (the input is kept in
    /// fuzz/regressions/exchange_frames/): a state source announcing one 32 GiB tensor (the
    /// payload limit) made a joiner that accepts any table reserve 32 GiB before the first
    /// chunk came.
    #[tokio::test]
    async fn an_announced_tensor_is_not_reserved_before_its_bytes_arrive() {
        let sender = libp2p::identity::Keypair::generate_ed25519()
            .public()
            .to_peer_id();
        let limits = ExchangeLimits::default();
        let shape = vec![limits.max_payload_bytes / 4];
        let header = ExchangeHeader {
            run_id: vec![1; 32],
            round: 3,
            sender: sender.to_bytes(),
            kind: PayloadKind::State as i32,
            tensors: vec![TensorEntry {
                name: "huge".into(),
                dtype: DType::F32 as i32,
                byte_length: TensorSpec::byte_length_of(DType::F32, &shape).unwrap(),
                shape,
                encoding: Encoding::Raw as i32,
                checksum: vec![0; DIGEST_LEN],
            }],
            chunk_size: 1 << 20,
        };
        let expect = Expectation {
            run_id: RunId::from_bytes([1; 32]),
            round: None,
            sender,
            kind: PayloadKind::State,
            table: None,
        };
        check_header(&header, &expect, &limits).expect("a header within the limits");
        // One honest-looking chunk, then the stream ends.
        let chunk = vec![0u8; 1 << 20];
        let mut stream = Vec::new();
        write_frame(
            &mut stream,
            FRAME_CHUNK,
            &[blake3::hash(&chunk).as_bytes(), &chunk],
        )
        .await
        .unwrap();
        let err = receive_tensors(&mut futures::io::Cursor::new(stream), &header)
            .await
            .unwrap_err();
        assert!(matches!(err, ExchangeError::Truncated("chunk")), "{err}");
    }

    /// A message on a [`LeavingLink`]: when it arrives, and its bytes (`None`: the close).
    type InFlight = (tokio::time::Instant, Option<Vec<u8>>);

    /// The message a [`LeavingLink`] is delivering: the timer of its arrival, and its bytes.
    type Arriving = (Pin<Box<tokio::time::Sleep>>, Option<Vec<u8>>);

    /// One end of an in-memory link with a fixed latency that ends the way a QUIC connection
    /// does when its node goes away: once one end is dropped, the other end's reads and
    /// writes fail at once, and whatever was still in flight is lost.
    struct LeavingLink {
        incoming: mpsc::UnboundedReceiver<InFlight>,
        outgoing: mpsc::UnboundedSender<InFlight>,
        arriving: Option<Arriving>,
        readable: Vec<u8>,
        latency: Duration,
        peer_gone: Arc<AtomicBool>,
        me_gone: Arc<AtomicBool>,
    }

    fn leaving_link(latency: Duration) -> (LeavingLink, LeavingLink) {
        let (a_out, b_in) = mpsc::unbounded_channel();
        let (b_out, a_in) = mpsc::unbounded_channel();
        let (a_gone, b_gone) = (Arc::default(), Arc::default());
        let end = |incoming, outgoing, me_gone: &Arc<_>, peer_gone: &Arc<_>| LeavingLink {
            incoming,
            outgoing,
            arriving: None,
            readable: Vec::new(),
            latency,
            peer_gone: Arc::clone(peer_gone),
            me_gone: Arc::clone(me_gone),
        };
        (
            end(a_in, a_out, &a_gone, &b_gone),
            end(b_in, b_out, &b_gone, &a_gone),
        )
    }

    impl LeavingLink {
        fn lost() -> std::io::Error {
            std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "the peer went away")
        }

        fn send(&self, message: Option<Vec<u8>>) -> std::io::Result<()> {
            if self.peer_gone.load(Ordering::SeqCst) {
                return Err(Self::lost());
            }
            let at = tokio::time::Instant::now() + self.latency;
            self.outgoing.send((at, message)).map_err(|_| Self::lost())
        }
    }

    impl Drop for LeavingLink {
        fn drop(&mut self) {
            self.me_gone.store(true, Ordering::SeqCst);
        }
    }

    impl AsyncRead for LeavingLink {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut [u8],
        ) -> Poll<std::io::Result<usize>> {
            loop {
                if self.peer_gone.load(Ordering::SeqCst) {
                    return Poll::Ready(Err(Self::lost()));
                }
                if !self.readable.is_empty() {
                    let n = buf.len().min(self.readable.len());
                    buf[..n].copy_from_slice(&self.readable[..n]);
                    self.readable.drain(..n);
                    return Poll::Ready(Ok(n));
                }
                if self.arriving.is_none() {
                    let Some((at, bytes)) = ready!(self.incoming.poll_recv(cx)) else {
                        return Poll::Ready(Err(Self::lost()));
                    };
                    self.arriving = Some((Box::pin(tokio::time::sleep_until(at)), bytes));
                }
                let (arrival, _) = self.arriving.as_mut().expect("a message is arriving");
                ready!(arrival.as_mut().poll(cx));
                match self.arriving.take().and_then(|(_, bytes)| bytes) {
                    Some(bytes) => self.readable = bytes,
                    None => return Poll::Ready(Ok(0)),
                }
            }
        }
    }

    impl AsyncWrite for LeavingLink {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            Poll::Ready(self.send(Some(buf.to_vec())).map(|()| buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(self.send(None))
        }
    }

    /// The flake behind this test: the initiator read the responder's done frame and close,
    /// returned and shut its node down while its own done frame was still on the wire; the
    /// responder lost it with the connection and counted a whole, verified exchange as
    /// failed. Here the responder is 200 ms later with its payload (so its done frame is
    /// waiting when the initiator finishes), the link has 50 ms of latency, and each side's
    /// end of the link goes away the moment its exchange returns.
    #[tokio::test]
    async fn a_side_that_leaves_the_moment_its_exchange_returns_leaves_its_peer_a_success() {
        let keys = |_| {
            libp2p::identity::Keypair::generate_ed25519()
                .public()
                .to_peer_id()
        };
        let (initiator, responder): (PeerId, PeerId) = (keys(0), keys(1));
        let run_id = RunId::from_bytes([7; 32]);
        let payload = |seed| {
            let set = Arc::new(TensorSet::synthetic(2, 300_000, seed));
            OutgoingPayload::new(PayloadKind::Model, set, SendOptions::default())
        };
        let (initiator_payload, responder_payload) = (payload(1), payload(2));
        let table = Arc::new(initiator_payload.set.specs());
        let expect = |sender| Expectation {
            run_id,
            round: Some(4),
            sender,
            kind: PayloadKind::Model,
            table: Some(table.clone()),
        };
        let (from_responder, from_initiator) = (expect(responder), expect(initiator));
        let (initiator_header, responder_header) = (
            initiator_payload.header(&run_id, 4, &initiator),
            responder_payload.header(&run_id, 4, &responder),
        );
        let limits = ExchangeLimits::default();
        let (initiator_end, mut responder_end) = leaving_link(Duration::from_millis(50));
        let initiator_side = run_initiator(
            initiator_end,
            &initiator_header,
            &initiator_payload,
            &from_responder,
            &limits,
        );
        let responder_side = async {
            let their_header =
                read_checked_header(&mut responder_end, &from_initiator, &limits).await?;
            tokio::time::sleep(Duration::from_millis(200)).await;
            run_responder(
                responder_end,
                &their_header,
                &responder_header,
                &responder_payload,
            )
            .await
        };
        let (got_by_initiator, got_by_responder) = tokio::join!(initiator_side, responder_side);
        let (got_by_initiator, _) = got_by_initiator.expect("the initiator's exchange succeeds");
        let got_by_responder = got_by_responder.expect("the responder's exchange succeeds");
        assert!(got_by_initiator == *responder_payload.set);
        assert!(got_by_responder == *initiator_payload.set);
    }

    #[test]
    fn room_doubles_as_chunks_arrive_and_ends_at_the_tensor_size() {
        let total = 10 * 1000 + 7;
        let mut data = Vec::new();
        let mut most = 0;
        while data.len() < total {
            let raw_len = 1000.min(total - data.len());
            make_room(&mut data, raw_len, total as u64);
            assert!(data.capacity() >= data.len() + raw_len);
            most = most.max(data.capacity());
            assert!(data.capacity() <= 2 * (data.len() + raw_len));
            data.extend(std::iter::repeat_n(0u8, raw_len));
        }
        assert_eq!(data.capacity(), total);
        assert_eq!(most, total);
    }
}
