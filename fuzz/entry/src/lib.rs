//! The entry points of gasloc's fuzz targets: each takes the bytes a stranger could send
//! (or a file could hold) and runs the decoder the node runs on them, with the node's own
//! size bounds, to a result or an error.
//!
//! `fuzz/fuzz_targets/*.rs` (cargo-fuzz, `make fuzz`) call these, and so does the ordinary
//! test `tests/corpus.rs`, which replays every committed corpus file through them: whatever
//! the fuzzer once found stays guarded by `cargo test`. See `docs/fuzzing.md`.
//!
//! None of these may panic, whatever the input; a panic (or an allocation beyond the
//! fuzzer's limit, or a hang) is a bug of the decoder, not of the entry.

use futures::io::{AsyncRead, AsyncWrite, Cursor};
use gasloc_p2p::config::{NetworkConfig, Role};
use gasloc_p2p::control::{ControlReject, ControlValidator};
use gasloc_p2p::exchange::{
    check_header, check_state_request, read_checked_header, read_first_frame, receive_tensors,
    refuse, run_initiator, run_responder, ExchangeError, ExchangeLimits, Expectation, FirstFrame,
    OutgoingPayload, SendOptions,
};
use gasloc_p2p::schedule::Timing;
use gasloc_p2p::shard_service::{
    check_request, is_shard_file_name, read_request, read_response, write_request, write_response,
    ShardAnswer, ShardCatalog,
};
use gasloc_p2p::tensors::{Tensor, TensorSet, TensorSpec};
use gasloc_p2p::{Keypair, PeerId};
use gasloc_proto::topology::Topology;
use gasloc_proto::wire::{
    ControlMessage, DType, ManifestResponse, PayloadKind, ShardRequest, ShardResponse, StateRequest,
};
use gasloc_proto::{RunId, RunManifest};
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// The names of the targets, as `fuzz/fuzz_targets/<name>.rs` and `fuzz/corpus/<name>/`.
pub const TARGETS: [&str; 7] = [
    "exchange_frames",
    "control_message",
    "state_request",
    "manifest",
    "shard_header",
    "shard_request",
    "shard_response",
];

/// The run every target pretends to be part of.
pub fn run_id() -> RunId {
    RunId::from_bytes([0x5a; 32])
}

/// The round the exchange expects.
pub const ROUND: u64 = 7;

/// The stranger: a fixed key, so that a corpus stays valid from run to run.
pub fn peer() -> PeerId {
    keypair(1).public().to_peer_id()
}

/// This node.
pub fn me() -> PeerId {
    keypair(2).public().to_peer_id()
}

fn keypair(seed: u8) -> Keypair {
    Keypair::ed25519_from_bytes([seed; 32]).expect("32 bytes are an ed25519 secret")
}

/// The model both sides hold: small, but with two dtypes and a tensor of several chunks.
pub fn model() -> TensorSet {
    let tensor = |name: &str, dtype: DType, shape: Vec<u64>, fill: u8| {
        let len = TensorSpec::byte_length_of(dtype, &shape).expect("small shape") as usize;
        Tensor {
            name: name.into(),
            dtype,
            shape,
            data: (0..len).map(|i| (i as u8).wrapping_mul(fill)).collect(),
        }
    };
    TensorSet::new(vec![
        tensor("embed", DType::F32, vec![4, 3], 3),
        tensor("norm", DType::Bf16, vec![5], 7),
    ])
}

/// The chunk size of [`OutgoingPayload`]s here: the 48-byte tensor goes in three chunks.
pub const CHUNK_SIZE: u32 = 16;

/// This node's payload of `kind`, raw or zstd (made once: hashing belongs off the hot path).
pub fn payload(kind: PayloadKind, zstd: bool) -> Arc<OutgoingPayload> {
    static PAYLOADS: OnceLock<Vec<Arc<OutgoingPayload>>> = OnceLock::new();
    let all = PAYLOADS.get_or_init(|| {
        let mut all = Vec::new();
        for kind in [PayloadKind::Model, PayloadKind::State] {
            for zstd in [false, true] {
                all.push(Arc::new(OutgoingPayload::new(
                    kind,
                    Arc::new(model()),
                    SendOptions {
                        chunk_size: CHUNK_SIZE,
                        zstd_level: zstd.then_some(1),
                        upload_limit: None,
                    },
                )));
            }
        }
        all
    });
    let index = 2 * usize::from(kind == PayloadKind::State) + usize::from(zstd);
    all[index].clone()
}

fn table() -> Arc<Vec<TensorSpec>> {
    Arc::new(model().tensors.iter().map(|t| t.spec()).collect())
}

/// The one runtime of this thread (the exchange verifies chunks on tokio's blocking pool).
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    thread_local! {
        static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a current-thread runtime");
    }
    RUNTIME.with(|rt| rt.block_on(future))
}

/// A stream whose reading half is the stranger's bytes and whose writing half swallows what
/// this node answers.
pub struct PeerStream<'a> {
    from_peer: Cursor<&'a [u8]>,
}

impl<'a> PeerStream<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        PeerStream {
            from_peer: Cursor::new(bytes),
        }
    }
}

impl AsyncRead for PeerStream<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.from_peer).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerStream<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Which receiving side of the exchange protocol a stranger's bytes meet (the first byte of
/// an `exchange_frames` input, modulo 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangeSide {
    /// `/gasloc/exchange/2`, accepted: first frame, run id, header check against this
    /// node's model, then the responder (the node's `handle_exchange`).
    Responder,
    /// `/gasloc/exchange/2`, opened by this node: the initiator reads the peer's header,
    /// chunks and done frame while sending its own (`ExchangeService::initiate`).
    Initiator,
    /// `/gasloc/state/1`, this node joining: the state source's header, checked against
    /// the model's table, then every chunk and the end of the stream (`fetch_state`).
    StateFetch,
    /// As `StateFetch`, but accepting any valid table (`fetch_state` with no table).
    StateFetchAnyTable,
}

impl ExchangeSide {
    pub fn of(selector: u8) -> Self {
        match selector % 4 {
            0 => ExchangeSide::Responder,
            1 => ExchangeSide::Initiator,
            2 => ExchangeSide::StateFetch,
            _ => ExchangeSide::StateFetchAnyTable,
        }
    }

    pub fn selector(self) -> u8 {
        self as u8
    }
}

/// `exchange_frames`: byte 0 picks the [`ExchangeSide`], the rest is the stream the
/// stranger sends. `Ok`: the tensors this node would accept.
pub fn exchange_frames(data: &[u8]) -> Result<TensorSet, ExchangeError> {
    let Some((&selector, bytes)) = data.split_first() else {
        return Err(ExchangeError::Truncated("selector"));
    };
    let side = ExchangeSide::of(selector);
    let limits = ExchangeLimits::default();
    let mut stream = PeerStream::new(bytes);
    let kind = match side {
        ExchangeSide::Responder | ExchangeSide::Initiator => PayloadKind::Model,
        ExchangeSide::StateFetch | ExchangeSide::StateFetchAnyTable => PayloadKind::State,
    };
    let expect = Expectation {
        run_id: run_id(),
        round: (kind == PayloadKind::Model).then_some(ROUND),
        sender: peer(),
        kind,
        table: (side != ExchangeSide::StateFetchAnyTable).then(table),
    };
    let mine = payload(kind, selector & 0x80 != 0);
    let my_header = mine.header(&run_id(), ROUND, &me());
    block_on(async {
        match side {
            ExchangeSide::Responder => {
                let header = match read_first_frame(&mut stream, &limits).await? {
                    FirstFrame::Header(h) => h,
                    _ => return Err(ExchangeError::UnexpectedFrame(0)),
                };
                if let Err(e) = check_header(&header, &expect, &limits) {
                    if let Some(refusal) = e.refusal() {
                        let _ = refuse(&mut stream, &refusal).await;
                    }
                    return Err(e);
                }
                run_responder(stream, &header, &my_header, &mine).await
            }
            ExchangeSide::Initiator => run_initiator(stream, &my_header, &mine, &expect, &limits)
                .await
                .map(|(set, _)| set),
            ExchangeSide::StateFetch | ExchangeSide::StateFetchAnyTable => {
                let header = read_checked_header(&mut stream, &expect, &limits).await?;
                receive_tensors(&mut stream, &header).await
            }
        }
    })
}

/// `state_request`: the first frame a stranger sends on `/gasloc/state/1`, as the serving
/// node reads it (`handle_state_request`): a state request for this run, or a refusal.
pub fn state_request(data: &[u8]) -> Result<StateRequest, ExchangeError> {
    let mut stream = PeerStream::new(data);
    let limits = ExchangeLimits::default();
    let result = futures::executor::block_on(read_first_frame(&mut stream, &limits))
        .and_then(|first| check_state_request(first, &run_id()));
    if let Err(e) = &result {
        if let Some(refusal) = e.refusal() {
            let _ = futures::executor::block_on(refuse(&mut stream, &refusal));
        }
    }
    result
}

/// The timing the control validator checks rounds against.
pub fn timing() -> Timing {
    Timing {
        genesis_ms: 1_000_000,
        period_ms: 10_000,
        commit_window_ms: 2_000,
        reveal_window_ms: 2_000,
        exchange_timeout_ms: 5_000,
        topology: Topology::OnePeer,
    }
}

/// Wall-clock ms at which `control_message` validates: round [`ROUND`].
pub const CONTROL_NOW_MS: u64 = 1_000_000 + ROUND * 10_000 + 500;

/// `control_message`: a gossipsub payload on the run topic, through the validator with the
/// node's default bounds (`NetworkConfig`: 4096 bytes, 64 a peer in 10 s).
pub fn control_message(data: &[u8]) -> Result<ControlMessage, ControlReject> {
    let config = NetworkConfig::new(Role::Node);
    let mut validator = ControlValidator::new(
        run_id(),
        Some(timing()),
        config.control_max_bytes,
        config.control_rate_burst,
        config.control_rate_window,
    );
    let now = Instant::now();
    // Unsigned first (refused before decoding), then signed, twice: the rate window counts.
    if validator.validate(None, data, CONTROL_NOW_MS, now).is_ok() {
        panic!("an unsigned control message was accepted");
    }
    let first = validator.validate(Some(peer()), data, CONTROL_NOW_MS, now);
    let _ = validator.validate(
        Some(peer()),
        data,
        CONTROL_NOW_MS,
        now + Duration::from_secs(1),
    );
    first.map(|(_, message)| message)
}

/// Most bytes of a served manifest (`/gasloc/manifest/1`'s response cap).
pub const MAX_MANIFEST_BYTES: usize = gasloc_p2p::manifest_service::MAX_MANIFEST_RESPONSE as usize;

/// `manifest`: manifest text as a peer serves it, parsed and validated as the joiner does
/// (`RunManifest::parse`); an accepted manifest must pass `verify_manifest_response` under
/// its own run id and come back from its canonical bytes with the same run id.
pub fn manifest(data: &[u8]) -> Result<RunManifest, String> {
    if data.len() > MAX_MANIFEST_BYTES {
        return Err(format!("{} bytes is over the cap", data.len()));
    }
    // The protobuf string field: a response whose text is not UTF-8 does not decode.
    let text = std::str::from_utf8(data).map_err(|e| e.to_string())?;
    let manifest = RunManifest::parse(text, "served manifest").map_err(|e| e.to_string())?;
    let run_id = manifest.run_id();
    let announced = ManifestResponse {
        run_id: run_id.to_vec(),
        manifest_toml: text.to_string(),
        ..Default::default()
    };
    gasloc_p2p::manifest_service::verify_manifest_response(&announced, Some(run_id))
        .expect("the manifest verifies against its own run id");
    let canonical = String::from_utf8(manifest.canonical_bytes()).expect("canonical TOML is UTF-8");
    let again = RunManifest::parse(&canonical, "canonical").expect("canonical bytes parse");
    assert_eq!(again.run_id(), run_id, "canonical bytes keep the run id");
    Ok(manifest)
}

/// `shard_header`: a token shard file (header, size, tokens) as `read_shard` checks it,
/// for a GPT-2 vocabulary. `Ok`: how many tokens it holds.
pub fn shard_header(data: &[u8]) -> Result<usize, gasloc_data::DataError> {
    let shard =
        gasloc_data::read_shard_from(data, data.len() as u64, Path::new("fuzz.bin"), 50257)?;
    Ok(shard.len())
}

/// The shard every `shard_request` input asks about: 4,000 bytes, pinned.
pub const SERVED_SHARD: &str = "fuzz_train_000000.bin";

/// `shard_request`: a `/gasloc/shard/1` request as the server reads it (length prefix,
/// protobuf, size bound) and checks it against the run and a catalog holding
/// [`SERVED_SHARD`]. `Ok`: what the server would send.
pub fn shard_request(data: &[u8]) -> Result<ShardAnswer, String> {
    let catalog = ShardCatalog::new();
    catalog.insert(
        gasloc_proto::ShardEntry {
            name: SERVED_SHARD.into(),
            split: gasloc_proto::Split::Train,
            bytes: 4000,
            tokens: 1488,
            sha256: "00".repeat(32),
        },
        Path::new("fuzz").join(SERVED_SHARD),
    );
    let mut stream = PeerStream::new(data);
    let request =
        futures::executor::block_on(read_request(&mut stream)).map_err(|e| e.to_string())?;
    check_request(&run_id(), &catalog, &request)
        .map_err(|(reason, detail)| format!("{reason}: {detail}"))
}

/// `shard_response`: a `/gasloc/shard/1` response header as the requester reads it (length
/// prefix, protobuf, size bound). `Ok`: the announced length and the safe names listed.
pub fn shard_response(data: &[u8]) -> Result<(u64, usize), String> {
    let mut stream = PeerStream::new(data);
    let response =
        futures::executor::block_on(read_response(&mut stream)).map_err(|e| e.to_string())?;
    let safe = response
        .names
        .iter()
        .filter(|n| is_shard_file_name(n))
        .count();
    Ok((response.length, safe))
}

/// Runs the target named `name` on `data`; `Ok(true)` if the input was accepted.
pub fn run(name: &str, data: &[u8]) -> Result<bool, String> {
    Ok(match name {
        "exchange_frames" => exchange_frames(data).is_ok(),
        "control_message" => control_message(data).is_ok(),
        "state_request" => state_request(data).is_ok(),
        "manifest" => manifest(data).is_ok(),
        "shard_header" => shard_header(data).is_ok(),
        "shard_request" => shard_request(data).is_ok(),
        "shard_response" => shard_response(data).is_ok(),
        other => return Err(format!("no fuzz target {other}")),
    })
}

/// Inputs every target must accept: what an honest peer sends (and a shard `data prepare`
/// writes). They seed the fuzzer, and the replay test checks that they still pass, so a
/// target cannot quietly turn into one that only ever meets errors.
pub fn seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    use gasloc_p2p::exchange::{send_payload, write_state_request};
    use gasloc_p2p::frames::{write_frame, FRAME_DONE};
    use gasloc_proto::wire::control_message::Body;
    use gasloc_proto::wire::{Announce, Commit, Reveal};
    use prost::Message;

    let mut seeds = Vec::new();
    for side in [
        ExchangeSide::Responder,
        ExchangeSide::Initiator,
        ExchangeSide::StateFetch,
        ExchangeSide::StateFetchAnyTable,
    ] {
        for zstd in [false, true] {
            let kind = match side {
                ExchangeSide::Responder | ExchangeSide::Initiator => PayloadKind::Model,
                _ => PayloadKind::State,
            };
            let theirs = payload(kind, zstd);
            let header = theirs.header(&run_id(), ROUND, &peer());
            let mut bytes = vec![side.selector() | if zstd { 0x80 } else { 0 }];
            futures::executor::block_on(async {
                send_payload(&mut bytes, &header, &theirs).await?;
                if kind == PayloadKind::Model {
                    write_frame(&mut bytes, FRAME_DONE, &[]).await?;
                }
                Ok::<(), ExchangeError>(())
            })
            .expect("writing to memory");
            let name = format!("seed-{side:?}-{}", if zstd { "zstd" } else { "raw" });
            seeds.push(("exchange_frames", name, bytes));
        }
    }

    let mut request = Vec::new();
    futures::executor::block_on(write_state_request(&mut request, &run_id()))
        .expect("writing to memory");
    seeds.push(("state_request", "seed-request".into(), request));

    let control = |body: Body| {
        ControlMessage {
            run_id: run_id().to_vec(),
            round: ROUND,
            body: Some(body),
        }
        .encode_to_vec()
    };
    seeds.extend([
        (
            "control_message",
            "seed-commit".into(),
            control(Body::Commit(Commit {
                commitment: vec![3; 32],
            })),
        ),
        (
            "control_message",
            "seed-reveal".into(),
            control(Body::Reveal(Reveal { nonce: vec![4; 32] })),
        ),
        (
            "control_message",
            "seed-announce".into(),
            control(Body::Announce(Announce {
                inner_steps: 12,
                step_time_us: 250_000,
                goodput_bytes_per_s: 12_500_000,
            })),
        ),
    ]);

    let runs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/runs");
    for name in ["tiny", "16m", "125m", "demo", "sim-tiny"] {
        let text = std::fs::read(runs.join(format!("{name}.toml"))).expect("an example manifest");
        seeds.push(("manifest", format!("seed-{name}"), text));
    }

    for width in [gasloc_data::TokenWidth::U16, gasloc_data::TokenWidth::U32] {
        let tokens = [50256u32, 15496, 11, 995, 0];
        let mut shard = Vec::new();
        for int in [width.magic(), width.version(), tokens.len() as i32]
            .into_iter()
            .chain(std::iter::repeat(0))
            .take(gasloc_data::shards::HEADER_INTS)
        {
            shard.extend_from_slice(&int.to_le_bytes());
        }
        for t in tokens {
            match width {
                gasloc_data::TokenWidth::U16 => shard.extend_from_slice(&(t as u16).to_le_bytes()),
                gasloc_data::TokenWidth::U32 => shard.extend_from_slice(&t.to_le_bytes()),
            }
        }
        seeds.push(("shard_header", format!("seed-{width:?}"), shard));
    }

    let requests = [("seed-list", ""), ("seed-range", SERVED_SHARD)];
    for (name, shard) in requests {
        let request = ShardRequest {
            run_id: run_id().to_vec(),
            name: shard.into(),
            offset: if shard.is_empty() { 0 } else { 1024 },
            length: if shard.is_empty() { 0 } else { 2048 },
        };
        let mut bytes = Vec::new();
        futures::executor::block_on(write_request(&mut bytes, &request))
            .expect("writing to memory");
        seeds.push(("shard_request", name.into(), bytes));
    }
    let responses = [
        (
            "seed-list",
            ShardResponse {
                names: vec![SERVED_SHARD.into(), "fuzz_val_000000.bin".into()],
                ..Default::default()
            },
        ),
        (
            "seed-range",
            ShardResponse {
                length: 2048,
                ..Default::default()
            },
        ),
    ];
    for (name, response) in responses {
        let mut bytes = Vec::new();
        futures::executor::block_on(write_response(&mut bytes, &response))
            .expect("writing to memory");
        seeds.push(("shard_response", name.into(), bytes));
    }
    seeds
}
