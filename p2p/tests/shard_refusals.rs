//! Every bad request on `/gasloc/shard/1` is refused with its reason (or the stream is
//! closed) and costs the server nothing it did not bound; a server announcing more bytes
//! than asked for is refused by the requester. Real swarms on loopback.

mod common;
mod shard_common;

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use gasloc_p2p::network::Network;
use gasloc_p2p::shard_client::{fetch_range, list_shards, ShardClientError};
use gasloc_p2p::shard_service::{
    read_request, read_response, write_request, write_response, ShardRefusal, ShardService,
    MAX_SHARD_CHUNK, MAX_SHARD_REQUEST, SHARD_PROTOCOL,
};
use gasloc_proto::wire::{ShardRequest, ShardResponse};
use gasloc_proto::{RunId, ShardEntry};
use shard_common::*;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(10);

struct Setup {
    dir: tempfile::TempDir,
    entries: Vec<ShardEntry>,
    server: Network,
    client: Network,
    service: ShardService,
}

async fn setup_with(config: gasloc_p2p::shard_service::ShardServeConfig) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let entries = write_pinned_shards(dir.path(), 1);
    let (mut servers, client) = swarms(1).await;
    let server = servers.remove(0);
    let service = serve(&server, catalog_of(dir.path(), &entries), config);
    Setup {
        dir,
        entries,
        server,
        client,
        service,
    }
}

async fn setup() -> Setup {
    setup_with(serve_config()).await
}

impl Setup {
    fn server_id(&self) -> libp2p::PeerId {
        self.server.client.peer_id()
    }

    async fn fetch(
        &self,
        run_id: RunId,
        name: &str,
        offset: u64,
        length: u64,
    ) -> Result<Vec<u8>, ShardClientError> {
        let control = self.client.client.stream_control();
        fetch_range(
            &control,
            self.server_id(),
            run_id,
            name,
            offset,
            length,
            TIMEOUT,
        )
        .await
    }

    /// Sends `request` on a raw stream and returns the server's response header.
    async fn raw(&self, request: &ShardRequest) -> ShardResponse {
        let mut stream = self
            .client
            .client
            .stream_control()
            .open_stream(self.server_id(), SHARD_PROTOCOL)
            .await
            .expect("server speaks the shard protocol");
        write_request(&mut stream, request).await.unwrap();
        stream.close().await.unwrap();
        tokio::time::timeout(TIMEOUT, read_response(&mut stream))
            .await
            .expect("an answer in time")
            .expect("a readable answer")
    }
}

fn assert_refused<T: std::fmt::Debug>(
    result: Result<T, ShardClientError>,
    reason: ShardRefusal,
) -> String {
    match result {
        Err(e) => {
            assert_eq!(e.refusal_reason(), Some(reason), "{e}");
            e.to_string()
        }
        Ok(v) => panic!("expected a {reason} refusal, got {v:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_shard_is_served_byte_for_byte() {
    let s = setup().await;
    let control = s.client.client.stream_control();
    let names = list_shards(&control, s.server_id(), RUN_ID, TIMEOUT)
        .await
        .unwrap();
    let expected: Vec<String> = s.entries.iter().map(|e| e.name.clone()).collect();
    assert_eq!(names, expected);
    let entry = &s.entries[0];
    let bytes = s.fetch(RUN_ID, &entry.name, 1000, 70_000).await.unwrap();
    let file = std::fs::read(s.dir.path().join(&entry.name)).unwrap();
    assert_eq!(bytes, file[1000..71_000]);
    let stats = s.service.stats();
    assert_eq!(
        (stats.ranges_served, stats.bytes_served, stats.lists_served),
        (1, 70_000, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_run_id_is_refused() {
    let s = setup().await;
    let other_run = RunId::from_bytes([0x43; 32]);
    let e = assert_refused(
        s.fetch(other_run, &s.entries[0].name, 0, 100).await,
        ShardRefusal::WrongRun,
    );
    assert!(e.contains("not this node's run"), "{e}");
    let control = s.client.client.stream_control();
    assert_refused(
        list_shards(&control, s.server_id(), other_run, TIMEOUT).await,
        ShardRefusal::WrongRun,
    );
    assert_eq!(s.service.stats().refused(ShardRefusal::WrongRun), 2);
    assert_eq!(s.service.stats().bytes_served, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_shard_is_refused() {
    let s = setup().await;
    let e = assert_refused(
        s.fetch(RUN_ID, "t_train_000099.bin", 0, 100).await,
        ShardRefusal::UnknownShard,
    );
    assert!(e.contains("t_train_000099.bin"), "{e}");
    // A path is not even asked for.
    let path = s
        .fetch(RUN_ID, "../t_train_000000.bin", 0, 100)
        .await
        .unwrap_err();
    assert!(matches!(path, ShardClientError::BadName(_)), "{path}");
    assert_eq!(s.service.stats().refused(ShardRefusal::UnknownShard), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn range_beyond_the_end_is_refused() {
    let s = setup().await;
    let entry = &s.entries[0];
    let e = assert_refused(
        s.fetch(RUN_ID, &entry.name, entry.bytes - 10, 100).await,
        ShardRefusal::OutOfRange,
    );
    assert!(e.contains(&format!("{} bytes", entry.bytes)), "{e}");
    // An offset whose end overflows u64 is beyond the end too.
    let response = s
        .raw(&ShardRequest {
            run_id: RUN_ID.to_vec(),
            name: entry.name.clone(),
            offset: u64::MAX - 5,
            length: 100,
        })
        .await;
    assert!(
        response.error.starts_with("out-of-range"),
        "{}",
        response.error
    );
    assert_eq!(response.length, 0);
    assert_eq!(s.service.stats().refused(ShardRefusal::OutOfRange), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_or_oversize_length_is_refused() {
    let s = setup().await;
    let name = s.entries[0].name.clone();
    for length in [0, MAX_SHARD_CHUNK + 1, u64::MAX] {
        let response = s
            .raw(&ShardRequest {
                run_id: RUN_ID.to_vec(),
                name: name.clone(),
                offset: 0,
                length,
            })
            .await;
        assert!(
            response.error.starts_with("bad-length"),
            "{length}: {}",
            response.error
        );
        // The requester does not even ask.
        let local = s.fetch(RUN_ID, &name, 0, length).await.unwrap_err();
        assert!(
            matches!(local, ShardClientError::BadLength { .. }),
            "{local}"
        );
    }
    assert_eq!(s.service.stats().refused(ShardRefusal::BadLength), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_streams_from_one_peer_than_allowed_are_busy() {
    let s = setup().await;
    assert_eq!(serve_config().max_streams_per_peer, 2);
    // Two streams that never send their request hold both of this peer's slots.
    let mut held = Vec::new();
    for open in 1..=2u64 {
        let stream = s
            .client
            .client
            .stream_control()
            .open_stream(s.server_id(), SHARD_PROTOCOL)
            .await
            .unwrap();
        held.push(stream);
        for _ in 0..100 {
            if s.service.stats().streams_open >= open {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            s.service.stats().streams_open,
            open,
            "the server took stream {open}"
        );
    }
    let e = assert_refused(
        s.fetch(RUN_ID, &s.entries[0].name, 0, 100).await,
        ShardRefusal::Busy,
    );
    assert!(e.contains("try later"), "{e}");
    assert_eq!(s.service.stats().refused(ShardRefusal::Busy), 1);
    // Once a held stream is gone, the peer is served again.
    drop(held);
    let mut served = false;
    for _ in 0..100 {
        if s.fetch(RUN_ID, &s.entries[0].name, 0, 100).await.is_ok() {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(served, "served again after the held streams closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_length_over_the_limit_closes_the_stream() {
    let s = setup().await;
    let mut stream = s
        .client
        .client
        .stream_control()
        .open_stream(s.server_id(), SHARD_PROTOCOL)
        .await
        .unwrap();
    // Announces 4 GiB - 1; the server reads the prefix and stops.
    let mut garbage = u32::MAX.to_le_bytes().to_vec();
    garbage.extend([0xEE; 64]);
    stream.write_all(&garbage).await.unwrap();
    stream.close().await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(TIMEOUT, stream.read_to_end(&mut answer))
        .await
        .expect("the server closes the stream in time");
    assert!(
        answer.is_empty(),
        "no answer to garbage: {read:?} {answer:?}"
    );
    let stats = s.service.stats();
    assert_eq!(stats.streams_dropped, 1);
    assert_eq!(stats.bytes_served, 0);
    // Just over the limit is refused the same way.
    let mut stream = s
        .client
        .client
        .stream_control()
        .open_stream(s.server_id(), SHARD_PROTOCOL)
        .await
        .unwrap();
    stream
        .write_all(&(MAX_SHARD_REQUEST + 1).to_le_bytes())
        .await
        .unwrap();
    stream.close().await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(TIMEOUT, stream.read_to_end(&mut answer))
        .await
        .expect("closed in time");
    assert!(answer.is_empty());
    assert_eq!(s.service.stats().streams_dropped, 2);
}

/// A server that answers every request announcing `announce(requested)` bytes and then
/// sends that many (at most 1 MiB).
fn lying_server(network: &Network, announce: fn(u64) -> u64) {
    let mut incoming = network
        .client
        .stream_control()
        .accept(SHARD_PROTOCOL)
        .unwrap();
    tokio::spawn(async move {
        while let Some((_, mut stream)) = incoming.next().await {
            tokio::spawn(async move {
                let Ok(request) = read_request(&mut stream).await else {
                    return;
                };
                let length = announce(request.length);
                let header = ShardResponse {
                    length,
                    ..Default::default()
                };
                let _ = write_response(&mut stream, &header).await;
                let _ = stream
                    .write_all(&vec![7u8; length.min(1 << 20) as usize])
                    .await;
                let _ = stream.close().await;
            });
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_announcing_more_bytes_than_asked_is_refused() {
    init_tracing();
    let (mut servers, client) = swarms(2).await;
    let (liar, huge_liar) = (servers.remove(0), servers.remove(0));
    lying_server(&liar, |asked| asked + 1);
    lying_server(&huge_liar, |_| u64::MAX);
    let control = client.client.stream_control();
    for (server, announced) in [(&liar, 1001), (&huge_liar, u64::MAX)] {
        let e = fetch_range(
            &control,
            server.client.peer_id(),
            RUN_ID,
            "t_train_000000.bin",
            0,
            1000,
            TIMEOUT,
        )
        .await
        .unwrap_err();
        match e {
            ShardClientError::WrongLength {
                announced: a,
                requested,
                ..
            } => {
                assert_eq!((a, requested), (announced, 1000));
            }
            other => panic!("expected a refused length, got {other}"),
        }
    }
}
