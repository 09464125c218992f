//! The requester's side of `/gasloc/shard/1` (the wire format is in [`crate::shard_service`]):
//! [`list_shards`] asks a peer which shards it holds, [`fetch_range`] asks it for a byte
//! range of one; every answer is bounded before allocation and a refusal is typed
//! ([`ShardClientError`]).

use crate::shard_service::*;
use futures::{AsyncReadExt, AsyncWriteExt};
use gasloc_proto::wire::{ShardRequest, ShardResponse};
use gasloc_proto::RunId;
use libp2p::{PeerId, Stream};
use std::time::Duration;
/// Why a list or range request to a peer gave nothing.
#[derive(Debug, thiserror::Error)]
pub enum ShardClientError {
    #[error("range of {length} bytes not asked for: a range is 1 to {MAX_SHARD_CHUNK} bytes")]
    BadLength { length: u64 },
    #[error("shard name {0:?} is not a shard file name")]
    BadName(String),
    #[error("cannot open a {SHARD_PROTOCOL} stream to {peer}: {detail}")]
    Open { peer: PeerId, detail: String },
    #[error("{peer} refused: {message}")]
    Refused {
        peer: PeerId,
        /// The reason the message names, if a known one.
        reason: Option<ShardRefusal>,
        /// The peer's text, cut to 256 characters.
        message: String,
    },
    #[error("{peer} announced {announced} bytes for a request of {requested}")]
    WrongLength {
        peer: PeerId,
        announced: u64,
        requested: u64,
    },
    #[error("{peer} sent a bad response: {source}")]
    BadResponse {
        peer: PeerId,
        source: ShardWireError,
    },
    #[error("{peer} ended the stream after {got} of {expected} bytes")]
    Truncated {
        peer: PeerId,
        got: u64,
        expected: u64,
    },
    #[error("{peer} did not answer within {timeout:?}")]
    Timeout { peer: PeerId, timeout: Duration },
}

impl ShardClientError {
    /// The server's refusal reason, if it refused.
    pub fn refusal_reason(&self) -> Option<ShardRefusal> {
        match self {
            ShardClientError::Refused { reason, .. } => *reason,
            _ => None,
        }
    }
}

/// How often a stream dropped before any response (libp2p-stream drops inbound streams
/// while the accept loop is handing over another) is opened again.
const DROPPED_STREAM_RETRIES: usize = 3;

/// Opens a stream to `peer`, sends `request`, and reads the response header. A stream that
/// ends before any byte of a response is opened again (a few times).
async fn request(
    control: &libp2p_stream::Control,
    peer: PeerId,
    request: &ShardRequest,
) -> Result<(Stream, ShardResponse), ShardClientError> {
    let mut delay = Duration::from_millis(50);
    let mut attempt = 0;
    loop {
        attempt += 1;
        let mut stream = control
            .clone()
            .open_stream(peer, SHARD_PROTOCOL)
            .await
            .map_err(|e| ShardClientError::Open {
                peer,
                detail: e.to_string(),
            })?;
        let sent = async {
            write_request(&mut stream, request).await?;
            stream.close().await
        }
        .await;
        let response = read_response(&mut stream).await;
        match (sent, response) {
            (_, Ok(response)) => return Ok((stream, response)),
            (_, Err(ShardWireError::Eof)) | (Err(_), Err(ShardWireError::Io(_)))
                if attempt < DROPPED_STREAM_RETRIES =>
            {
                tracing::debug!(%peer, attempt, "shard stream dropped before a response; again");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            (_, Err(source)) => return Err(ShardClientError::BadResponse { peer, source }),
        }
    }
}

fn cut(text: &str) -> String {
    let mut out: String = text.chars().take(MAX_PEER_TEXT_CHARS).collect();
    if text.chars().nth(MAX_PEER_TEXT_CHARS).is_some() {
        out.push('…');
    }
    out
}

fn refused(peer: PeerId, error: &str) -> ShardClientError {
    ShardClientError::Refused {
        peer,
        reason: ShardRefusal::of_error(error),
        message: cut(error),
    }
}

/// The shards `peer` serves for `run_id`; names that are not safe shard file names are
/// left out. Returns within `timeout`.
pub async fn list_shards(
    control: &libp2p_stream::Control,
    peer: PeerId,
    run_id: RunId,
    timeout: Duration,
) -> Result<Vec<String>, ShardClientError> {
    let ask = ShardRequest {
        run_id: run_id.to_vec(),
        ..Default::default()
    };
    let work = async {
        let (_stream, response) = request(control, peer, &ask).await?;
        if !response.error.is_empty() {
            return Err(refused(peer, &response.error));
        }
        let listed = response.names.len();
        let names: Vec<String> = response
            .names
            .into_iter()
            .filter(|n| is_shard_file_name(n))
            .collect();
        if names.len() < listed {
            tracing::debug!(%peer, ignored = listed - names.len(), "unsafe shard names ignored");
        }
        Ok(names)
    };
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or(Err(ShardClientError::Timeout { peer, timeout }))
}

/// `length` bytes of shard `name` from `offset`, as `peer` serves them (unverified: the
/// caller checks the whole shard's SHA-256). At most `length` bytes are allocated, and only
/// once the peer announced exactly that many. Returns within `timeout`.
pub async fn fetch_range(
    control: &libp2p_stream::Control,
    peer: PeerId,
    run_id: RunId,
    name: &str,
    offset: u64,
    length: u64,
    timeout: Duration,
) -> Result<Vec<u8>, ShardClientError> {
    if length == 0 || length > MAX_SHARD_CHUNK {
        return Err(ShardClientError::BadLength { length });
    }
    if !is_shard_file_name(name) {
        return Err(ShardClientError::BadName(cut(name)));
    }
    let ask = ShardRequest {
        run_id: run_id.to_vec(),
        name: name.to_string(),
        offset,
        length,
    };
    let work = async {
        let (mut stream, response) = request(control, peer, &ask).await?;
        if !response.error.is_empty() {
            return Err(refused(peer, &response.error));
        }
        if response.length != length {
            return Err(ShardClientError::WrongLength {
                peer,
                announced: response.length,
                requested: length,
            });
        }
        let mut bytes = Vec::with_capacity(length as usize);
        (&mut stream)
            .take(length)
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| ShardClientError::BadResponse {
                peer,
                source: ShardWireError::Io(e),
            })?;
        if bytes.len() as u64 != length {
            return Err(ShardClientError::Truncated {
                peer,
                got: bytes.len() as u64,
                expected: length,
            });
        }
        Ok(bytes)
    };
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or(Err(ShardClientError::Timeout { peer, timeout }))
}
