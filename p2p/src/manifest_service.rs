//! `/gasloc/manifest/1`: the request-response codec that serves a run's manifest.
//!
//! Each message is a u32 little-endian length followed by a protobuf `ManifestRequest`
//! (at most 1 KiB) or `ManifestResponse` (at most 1 MiB). The requester verifies the run
//! id itself (see [`verify_manifest_response`]).
//!
//! Every member of a run serves it: the bootstrap nodes from the start, and each node once
//! it holds the verified manifest, so that a newcomer can join through any live node's
//! address when no bootstrap node is left ([`manifest_response`] builds what both serve).

use crate::schedule::Timing;
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use gasloc_proto::wire::{ManifestRequest, ManifestResponse};
use gasloc_proto::{RunId, RunManifest};
use libp2p::StreamProtocol;
use prost::Message;
use std::io;

pub const MANIFEST_PROTOCOL: StreamProtocol = StreamProtocol::new("/gasloc/manifest/1");
pub const MAX_MANIFEST_REQUEST: u32 = 1024;
pub const MAX_MANIFEST_RESPONSE: u32 = 1 << 20;

/// The codec (stateless).
#[derive(Debug, Clone, Default)]
pub struct ManifestCodec;

async fn read_message<T: AsyncRead + Unpin + Send, M: Message + Default>(
    io: &mut T,
    max: u32,
) -> io::Result<M> {
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len);
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("manifest message of {len} bytes exceeds {max}"),
        ));
    }
    let mut body = vec![0u8; len as usize];
    io.read_exact(&mut body).await?;
    M::decode(body.as_slice()).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

async fn write_message<T: AsyncWrite + Unpin + Send, M: Message>(
    io: &mut T,
    m: &M,
) -> io::Result<()> {
    let body = m.encode_to_vec();
    io.write_all(&(body.len() as u32).to_le_bytes()).await?;
    io.write_all(&body).await?;
    io.close().await
}

impl libp2p::request_response::Codec for ManifestCodec {
    type Protocol = StreamProtocol;
    type Request = ManifestRequest;
    type Response = ManifestResponse;

    async fn read_request<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<ManifestRequest> {
        read_message(io, MAX_MANIFEST_REQUEST).await
    }
    async fn read_response<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<ManifestResponse> {
        read_message(io, MAX_MANIFEST_RESPONSE).await
    }
    async fn write_request<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        req: ManifestRequest,
    ) -> io::Result<()> {
        write_message(io, &req).await
    }
    async fn write_response<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        res: ManifestResponse,
    ) -> io::Result<()> {
        write_message(io, &res).await
    }
}

/// What a member of the run serves to a manifest request: the canonical manifest, its run
/// id and the round timing.
pub fn manifest_response(manifest: &RunManifest, timing: &Timing) -> ManifestResponse {
    ManifestResponse {
        run_id: manifest.run_id().to_vec(),
        // Canonical bytes are TOML, written by us: UTF-8 by construction.
        manifest_toml: String::from_utf8_lossy(&manifest.canonical_bytes()).into_owned(),
        timing: Some(timing.to_wire()),
        error: String::new(),
    }
}

/// Parses a served manifest and checks that its run id is the one announced (and, when
/// given, the one the caller expects).
pub fn verify_manifest_response(
    response: &ManifestResponse,
    expected_run_id: Option<RunId>,
) -> Result<RunManifest, String> {
    if !response.error.is_empty() {
        return Err(format!("manifest request refused: {}", response.error));
    }
    let manifest = RunManifest::parse(&response.manifest_toml, "served manifest")
        .map_err(|e| e.to_string())?;
    let run_id = manifest.run_id();
    if response.run_id != run_id.as_bytes() {
        return Err(format!(
            "served manifest hashes to run {run_id}, but the response announces {}",
            hex::encode(&response.run_id)
        ));
    }
    if let Some(expected) = expected_run_id {
        if expected != run_id {
            return Err(format!(
                "served run {run_id} is not the expected run {expected}"
            ));
        }
    }
    Ok(manifest)
}
