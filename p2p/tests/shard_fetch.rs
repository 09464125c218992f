//! Fetching a run's pinned shards into a directory from swarm peers and HTTP mirrors: the
//! result is always the verified shards, whatever a bad source sends. Real swarms and a
//! real HTTP server on loopback.

mod common;
mod shard_common;

use futures::{AsyncWriteExt, StreamExt};
use gasloc_data::pin::verify_directory;
use gasloc_p2p::network::Network;
use gasloc_p2p::shard_fetch::{
    FetchConfig, FetchError, FetchProgress, FetchReport, ShardFetcher, ShardSource,
};
use gasloc_p2p::shard_service::{
    read_request, write_response, ShardCatalog, ShardService, SHARD_PROTOCOL,
};
use gasloc_proto::wire::ShardResponse;
use gasloc_proto::ShardEntry;
use gasloc_tests::http_mirror::{HttpMirror, MirrorMode};
use libp2p::PeerId;
use shard_common::*;
use std::path::{Path, PathBuf};
use std::time::Duration;

const CHUNK: u64 = 64 << 10;
/// Bound on any fetch in these tests.
const FETCH_LIMIT: Duration = Duration::from_secs(60);

fn fetch_config(mirrors: Vec<String>) -> FetchConfig {
    let mut config = FetchConfig::new(RUN_ID, mirrors);
    config.chunk_bytes = CHUNK;
    config.request_timeout = Duration::from_secs(10);
    config.patience = Duration::from_secs(5);
    config.retry_delay = Duration::from_millis(100);
    config
}

/// Fetches `entries` into `dir` through `client`, asking `peers`, within [`FETCH_LIMIT`].
async fn fetch(
    client: &Network,
    config: FetchConfig,
    entries: &[ShardEntry],
    dir: &Path,
    peers: Vec<PeerId>,
    catalog: Option<ShardCatalog>,
    progress: FetchProgress,
) -> Result<FetchReport, FetchError> {
    let fetcher = ShardFetcher::new(client.client.stream_control(), config);
    tokio::time::timeout(
        FETCH_LIMIT,
        fetcher.fetch(entries, dir, move || peers.clone(), catalog, progress),
    )
    .await
    .expect("the fetch ends in time")
}

/// Shards written and pinned in a fresh directory.
fn source_shards(train: usize) -> (tempfile::TempDir, Vec<ShardEntry>) {
    let dir = tempfile::tempdir().unwrap();
    let entries = write_pinned_shards(dir.path(), train);
    (dir, entries)
}

fn total_bytes(entries: &[ShardEntry]) -> u64 {
    entries.iter().map(|e| e.bytes).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_fills_an_empty_directory() {
    let (source, entries) = source_shards(3);
    let (servers, client) = swarms(1).await;
    let service = serve(
        &servers[0],
        catalog_of(source.path(), &entries),
        serve_config(),
    );
    let target = tempfile::tempdir().unwrap();
    let catalog = ShardCatalog::new();
    let progress = FetchProgress::new();
    let report = fetch(
        &client,
        fetch_config(vec![]),
        &entries,
        target.path(),
        vec![servers[0].client.peer_id()],
        Some(catalog.clone()),
        progress.clone(),
    )
    .await
    .unwrap();
    verify_directory(target.path(), &entries).unwrap();
    assert_eq!(catalog.len(), entries.len());
    for entry in &entries {
        assert!(catalog.contains(&entry.name));
        assert!(!target.path().join(format!("{}.part", entry.name)).exists());
    }
    let seen = progress.snapshot();
    assert_eq!(seen.shards_total, entries.len() as u64);
    assert_eq!(seen.shards_held, entries.len() as u64);
    assert_eq!(seen.bytes_total, total_bytes(&entries));
    assert_eq!(seen.bytes_fetched, total_bytes(&entries));
    assert!(report.bad_sources.is_empty(), "{:?}", report.bad_sources);
    let server = ShardSource::Peer(servers[0].client.peer_id());
    for (shard, entry) in report.shards.iter().zip(&entries) {
        assert_eq!(shard.name, entry.name);
        assert_eq!(shard.source.as_ref(), Some(&server));
        assert_eq!(shard.bytes_fetched, entry.bytes);
    }
    assert_eq!(service.stats().bytes_served, total_bytes(&entries));

    // A second fetch finds everything present and fetches nothing.
    let again = fetch(
        &client,
        fetch_config(vec![]),
        &entries,
        target.path(),
        vec![],
        None,
        FetchProgress::new(),
    )
    .await
    .unwrap();
    assert!(again
        .shards
        .iter()
        .all(|s| s.source.is_none() && s.bytes_fetched == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_peers_share_the_shards() {
    let (source, entries) = source_shards(5);
    let (servers, client) = swarms(2).await;
    let services: Vec<ShardService> = servers
        .iter()
        .map(|s| serve(s, catalog_of(source.path(), &entries), serve_config()))
        .collect();
    let target = tempfile::tempdir().unwrap();
    let peers = servers.iter().map(|s| s.client.peer_id()).collect();
    let report = fetch(
        &client,
        fetch_config(vec![]),
        &entries,
        target.path(),
        peers,
        None,
        FetchProgress::new(),
    )
    .await
    .unwrap();
    verify_directory(target.path(), &entries).unwrap();
    for (i, service) in services.iter().enumerate() {
        let served = service.stats().bytes_served;
        assert!(served > 0, "server {i} served nothing: {report:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupting_source_is_dropped_and_the_shard_ends_verified() {
    let (source, entries) = source_shards(2);
    let (servers, client) = swarms(2).await;
    let (corrupt, honest) = (&servers[0], &servers[1]);
    // The corrupting server holds the first shard, with one byte flipped (right length).
    let flipped_dir = tempfile::tempdir().unwrap();
    let victim = &entries[0];
    let flipped = corrupted_copy(source.path(), victim, flipped_dir.path());
    let bad_catalog = ShardCatalog::new();
    bad_catalog.insert(victim.clone(), flipped);
    let _bad = serve(corrupt, bad_catalog, serve_config());
    let _good = serve(honest, catalog_of(source.path(), &entries), serve_config());
    let target = tempfile::tempdir().unwrap();
    // The corrupting peer comes first, so it is picked for the shard it holds.
    let peers = vec![corrupt.client.peer_id(), honest.client.peer_id()];
    let report = fetch(
        &client,
        fetch_config(vec![]),
        &entries,
        target.path(),
        peers,
        None,
        FetchProgress::new(),
    )
    .await
    .unwrap();
    verify_directory(target.path(), &entries).unwrap();
    assert_eq!(report.bad_sources.len(), 1, "{:?}", report.bad_sources);
    let bad = &report.bad_sources[0];
    assert_eq!(bad.source, ShardSource::Peer(corrupt.client.peer_id()));
    assert_eq!(bad.shard, victim.name);
    assert!(bad.reason.contains("SHA-256"), "{}", bad.reason);
    assert!(bad.wrong_bytes, "wrong bytes are an offence");
    assert_eq!(
        report.shards[0].source,
        Some(ShardSource::Peer(honest.client.peer_id()))
    );
    assert_eq!(
        report.shards[0].bytes_fetched,
        2 * victim.bytes,
        "fetched twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_failing_mid_shard_is_dropped_and_another_continues_the_part() {
    let (source, entries) = source_shards(2);
    let (servers, client) = swarms(2).await;
    let (broken, honest) = (&servers[0], &servers[1]);
    // The broken server's file of the first shard ends after 100 000 bytes: it serves the
    // first chunk, then refuses the second (its file is shorter than the entry).
    let victim = &entries[0];
    let short_dir = tempfile::tempdir().unwrap();
    let whole = std::fs::read(source.path().join(&victim.name)).unwrap();
    std::fs::write(short_dir.path().join(&victim.name), &whole[..100_000]).unwrap();
    let _broken = serve(
        broken,
        catalog_of(short_dir.path(), &entries[..1]),
        serve_config(),
    );
    let _honest = serve(honest, catalog_of(source.path(), &entries), serve_config());
    let target = tempfile::tempdir().unwrap();
    let peers = vec![broken.client.peer_id(), honest.client.peer_id()];
    let report = fetch(
        &client,
        fetch_config(vec![]),
        &entries,
        target.path(),
        peers,
        None,
        FetchProgress::new(),
    )
    .await
    .unwrap();
    verify_directory(target.path(), &entries).unwrap();
    assert_eq!(report.bad_sources.len(), 1, "{:?}", report.bad_sources);
    let bad = &report.bad_sources[0];
    assert_eq!(bad.source, ShardSource::Peer(broken.client.peer_id()));
    assert!(bad.reason.contains("unavailable"), "{}", bad.reason);
    assert!(!bad.wrong_bytes, "a failing source is not an offence");
    // The first chunk came from the broken server and was kept: nothing fetched twice.
    assert_eq!(report.shards[0].bytes_fetched, victim.bytes);
    assert_eq!(
        report.shards[0].source,
        Some(ShardSource::Peer(honest.client.peer_id()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_file_is_continued_not_fetched_again() {
    let (source, entries) = source_shards(1);
    let (servers, client) = swarms(1).await;
    let _service = serve(
        &servers[0],
        catalog_of(source.path(), &entries),
        serve_config(),
    );
    let target = tempfile::tempdir().unwrap();
    let entry = &entries[0];
    // The first 2 chunks, and a part of the third, from an earlier attempt.
    let kept = 2 * CHUNK;
    let whole = std::fs::read(source.path().join(&entry.name)).unwrap();
    let part: PathBuf = target.path().join(format!("{}.part", entry.name));
    std::fs::write(&part, &whole[..kept as usize + 1000]).unwrap();
    let progress = FetchProgress::new();
    let report = fetch(
        &client,
        fetch_config(vec![]),
        std::slice::from_ref(entry),
        target.path(),
        vec![servers[0].client.peer_id()],
        None,
        progress.clone(),
    )
    .await
    .unwrap();
    assert_eq!(
        std::fs::read(target.path().join(&entry.name)).unwrap(),
        whole
    );
    assert!(!part.exists());
    let remaining = entry.bytes - kept;
    let fetched = progress.snapshot().bytes_fetched;
    assert!(
        fetched <= remaining + CHUNK,
        "{fetched} fetched, {remaining} remained"
    );
    assert_eq!(fetched, remaining, "continued from the last whole chunk");
    assert_eq!(report.shards[0].bytes_fetched, fetched);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_source_anywhere_is_a_no_source_error_within_the_patience() {
    let (_source, entries) = source_shards(1);
    let (servers, client) = swarms(1).await;
    // A peer that serves nothing, and no mirror.
    let _empty = serve(&servers[0], ShardCatalog::new(), serve_config());
    let target = tempfile::tempdir().unwrap();
    let mut config = fetch_config(vec![]);
    config.patience = Duration::from_secs(2);
    let started = std::time::Instant::now();
    let e = fetch(
        &client,
        config,
        &entries,
        target.path(),
        vec![servers[0].client.peer_id()],
        None,
        FetchProgress::new(),
    )
    .await
    .unwrap_err();
    let took = started.elapsed();
    assert!(matches!(e, FetchError::NoSource { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("no source has shard t_") && text.contains("no peer listed it"),
        "{text}"
    );
    assert!(took < Duration::from_secs(10), "gave up after {took:?}");
    assert!(
        took >= Duration::from_secs(2),
        "gave up before the patience: {took:?}"
    );
}

// ---- HTTP mirrors ---------------------------------------------------------------------

// The mirror is `gasloc_tests::http_mirror` (std threads on loopback, Range support).

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_mirror_alone_fills_the_directory() {
    let (source, entries) = source_shards(2);
    let server = HttpMirror::start(source.path().to_path_buf(), MirrorMode::Honest);
    let mirror = server.url.clone();
    let (_, client) = swarms(0).await;
    let target = tempfile::tempdir().unwrap();
    let catalog = ShardCatalog::new();
    let progress = FetchProgress::new();
    let report = fetch(
        &client,
        fetch_config(vec![format!("{mirror}/")]),
        &entries,
        target.path(),
        vec![],
        Some(catalog.clone()),
        progress.clone(),
    )
    .await
    .unwrap();
    verify_directory(target.path(), &entries).unwrap();
    assert!(report.bad_sources.is_empty(), "{:?}", report.bad_sources);
    let source = ShardSource::Mirror(format!("{mirror}/"));
    assert!(report
        .shards
        .iter()
        .all(|s| s.source.as_ref() == Some(&source)));
    assert_eq!(catalog.len(), entries.len());
    assert_eq!(progress.snapshot().bytes_fetched, total_bytes(&entries));
}

/// A mirror in `mode` next to an honest peer: every shard ends verified, from the peer,
/// and the mirror is reported bad for each.
async fn mirror_falls_back_to_a_peer(mode: MirrorMode, reason: &str) {
    let (source, entries) = source_shards(2);
    let server = HttpMirror::start(source.path().to_path_buf(), mode);
    let mirror = server.url.clone();
    let (servers, client) = swarms(1).await;
    let _service = serve(
        &servers[0],
        catalog_of(source.path(), &entries),
        serve_config(),
    );
    let target = tempfile::tempdir().unwrap();
    let peer = servers[0].client.peer_id();
    // One shard at a time, so that each is offered to the mirror first (mirrors come
    // first when sources are equally loaded).
    let mut config = fetch_config(vec![mirror.clone()]);
    config.parallel_shards = 1;
    let report = fetch(
        &client,
        config,
        &entries,
        target.path(),
        vec![peer],
        None,
        FetchProgress::new(),
    )
    .await
    .unwrap();
    verify_directory(target.path(), &entries).unwrap();
    assert!(
        report
            .shards
            .iter()
            .all(|s| s.source == Some(ShardSource::Peer(peer))),
        "{report:?}"
    );
    // Each shard found the mirror bad.
    assert_eq!(
        report.bad_sources.len(),
        entries.len(),
        "{:?}",
        report.bad_sources
    );
    for bad in &report.bad_sources {
        assert_eq!(bad.source, ShardSource::Mirror(mirror.clone()));
        assert!(bad.reason.contains(reason), "{}", bad.reason);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_answering_404_falls_back_to_a_peer() {
    mirror_falls_back_to_a_peer(MirrorMode::NotFound, "HTTP status 404").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_serving_wrong_bytes_falls_back_to_a_peer() {
    mirror_falls_back_to_a_peer(MirrorMode::WrongBytes, "SHA-256").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_is_always_busy_ends_in_no_source_within_the_patience() {
    let (_source, entries) = source_shards(1);
    let (servers, client) = swarms(1).await;
    // It lists the shards, and answers every range request busy.
    let names: Vec<String> = entries.iter().map(|e| e.name.clone()).collect();
    let mut incoming = servers[0]
        .client
        .stream_control()
        .accept(SHARD_PROTOCOL)
        .unwrap();
    tokio::spawn(async move {
        while let Some((_, mut stream)) = incoming.next().await {
            let names = names.clone();
            tokio::spawn(async move {
                let Ok(request) = read_request(&mut stream).await else {
                    return;
                };
                let response = if request.name.is_empty() {
                    ShardResponse {
                        names,
                        ..Default::default()
                    }
                } else {
                    ShardResponse {
                        error: "busy: try later".into(),
                        ..Default::default()
                    }
                };
                let _ = write_response(&mut stream, &response).await;
                let _ = stream.close().await;
            });
        }
    });
    let target = tempfile::tempdir().unwrap();
    let mut config = fetch_config(vec![]);
    config.patience = Duration::from_secs(2);
    let started = std::time::Instant::now();
    let e = fetch(
        &client,
        config,
        &entries[..1],
        target.path(),
        vec![servers[0].client.peer_id()],
        None,
        FetchProgress::new(),
    )
    .await
    .unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, FetchError::NoSource { .. }), "{text}");
    assert!(text.contains("busy"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_peer_rate_paces_what_a_peer_is_sent() {
    let (source, entries) = source_shards(1);
    let (servers, client) = swarms(1).await;
    let mut config = serve_config();
    config.per_peer_rate = Some(500_000);
    let service = serve(&servers[0], catalog_of(source.path(), &entries), config);
    let target = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    fetch(
        &client,
        fetch_config(vec![]),
        &entries,
        target.path(),
        vec![servers[0].client.peer_id()],
        None,
        FetchProgress::new(),
    )
    .await
    .unwrap();
    let took = started.elapsed().as_secs_f64();
    let bytes = total_bytes(&entries) as f64;
    assert_eq!(service.stats().bytes_served, total_bytes(&entries));
    // At 500 kB/s the bytes take bytes / 500k seconds (the first piece's slot included).
    assert!(
        took >= bytes / 500_000.0 * 0.9,
        "{bytes} bytes in {took:.2} s"
    );
}
