//! The run's data, pinned by the manifest and fetched from the swarm, with real processes
//! on loopback:
//! - `gasloc-node data pin` writes the shard table; a node whose `--data` is not exactly the
//!   pinned shards is refused before its first round, naming the shard;
//! - a bootstrap serving `--data` and nodes without it: each fetches, verifies and trains;
//! - a peer that serves wrong bytes is caught by the hash and the shard comes from another;
//! - a node killed mid-download resumes its partial shard;
//! - an HTTP mirror as the only source, and a mirror that fails, with the swarm behind it.

use gasloc_tests::http_mirror::{HttpMirror, MirrorMode};
use gasloc_tests::{
    blocking, bootstrap_command, fetching_join_command, field, http_get, join_command, pin_data,
    prepare_byte_data, prepare_byte_data_with, read_report, spawn_bootstrap, start_bootstrap,
    tiny_run, Proc, ADAPTIVE_ONE_PEER, UNIFORM_LOSS,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// A pinned manifest of the tiny model over `prepare_byte_data`'s shards in `dir/data`: a
/// validation shard and one training shard.
fn pinned_run(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    pinned_run_of(dir, name, prepare_byte_data(dir), 2)
}

/// [`pinned_run`] with 280,000 training tokens in three shards.
fn pinned_run_of_three_training_shards(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let data = prepare_byte_data_with(dir, 300_000, &["--shard-tokens", "100000"]);
    pinned_run_of(dir, name, data, 4)
}

/// A pinned manifest of the tiny model over the `shards` shards in `data`.
fn pinned_run_of(dir: &Path, name: &str, data: PathBuf, shards: usize) -> (PathBuf, PathBuf) {
    let manifest = dir.join("run.toml");
    std::fs::write(
        &manifest,
        format!(
            "# a comment\n{}",
            tiny_run(name, 3, &blocking(ADAPTIVE_ONE_PEER))
        ),
    )
    .unwrap();
    let out = pin_data(&data, &manifest, &[]);
    assert!(out.starts_with(&format!("pinned {shards} shards")), "{out}");
    let text = std::fs::read_to_string(&manifest).unwrap();
    assert!(
        text.starts_with("# a comment\n"),
        "comments are kept: {text}"
    );
    assert_eq!(text.matches("[[data.shards]]").count(), shards, "{text}");
    (manifest, data)
}

#[test]
fn a_node_whose_data_is_not_the_pinned_shards_is_refused_before_round_0() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let (manifest, data) = pinned_run(dir, "pinned-refusal-test");

    // Other shards: the same files, one token changed in the training shard.
    let other = dir.join("other");
    std::fs::create_dir(&other).unwrap();
    for entry in std::fs::read_dir(&data).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, other.join(path.file_name().unwrap())).unwrap();
    }
    let train = std::fs::read_dir(&other)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("_train_"))
        .unwrap();
    let mut bytes = std::fs::read(&train).unwrap();
    bytes[5000] = if bytes[5000] == b'a' { b'b' } else { b'a' };
    std::fs::write(&train, &bytes).unwrap();

    let (_bootstrap, boot) = start_bootstrap(dir, &manifest, 4000, 4000, 500, 2000);
    let mut node = Proc::spawn(
        "node",
        dir,
        join_command(&boot, &dir.join("node"), &other, &["--rounds", "2"]),
    );
    assert!(
        !node.wait_exit(Duration::from_secs(60)),
        "a node with other data must fail"
    );
    let stderr = node.stderr_tail();
    let name = train.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        stderr.contains(&name) && stderr.contains("SHA-256"),
        "the refusal names the shard: {stderr}"
    );
    assert!(
        !node.output().contains("round="),
        "refused before round 0: {}",
        node.output()
    );
}

/// A bootstrap with the test timing (rounds of 4 s), serving `data` when given.
fn bootstrap(dir: &Path, manifest: &Path, data: Option<&Path>, extra: &[&str]) -> (Proc, String) {
    let mut command = bootstrap_command(dir, "bootstrap", manifest);
    command.args([
        "--genesis-delay-ms",
        "6000",
        "--round-period-ms",
        "4000",
        "--commit-window-ms",
        "500",
        "--reveal-window-ms",
        "500",
        "--exchange-timeout-ms",
        "2000",
    ]);
    if let Some(data) = data {
        command.arg("--data").arg(data);
    }
    command.args(extra);
    spawn_bootstrap(dir, "bootstrap", command)
}

/// Whether `home/data` holds byte-identical copies of every shard of `data`.
fn holds_the_shards(home: &Path, data: &Path) -> bool {
    std::fs::read_dir(data).unwrap().all(|entry| {
        let path = entry.unwrap().path();
        let copy = home.join("data").join(path.file_name().unwrap());
        std::fs::read(&copy).ok() == std::fs::read(&path).ok()
    })
}

/// The `host:port` a node printed as `status=http://…`.
fn status_addr(node: &mut Proc) -> String {
    let line = node.wait_for_line("status=", Duration::from_secs(5));
    field(&line, "status")
        .unwrap()
        .trim_start_matches("http://")
        .to_string()
}

/// The node's `/status` document.
fn status_json(addr: &str) -> serde_json::Value {
    let response = http_get(addr, "/status");
    serde_json::from_str(response.split("\r\n\r\n").nth(1).unwrap()).unwrap()
}

fn val_losses(home: &Path) -> Vec<f64> {
    read_report(home)
        .iter()
        .filter_map(|r| r["val_loss"].as_f64())
        .collect()
}

#[test]
fn nodes_without_data_fetch_the_pinned_shards_from_the_swarm_and_train() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let (manifest, data) = pinned_run(dir, "fetch-from-swarm-test");
    let (mut boot_proc, boot) = bootstrap(dir, &manifest, Some(&data), &[]);
    boot_proc.wait_for_line("serving_shards=2 ", Duration::from_secs(30));
    let home = |i: usize| dir.join(format!("node{i}"));
    let mut nodes: Vec<Proc> = (1..=3)
        .map(|i| {
            Proc::spawn(
                &format!("node{i}"),
                dir,
                fetching_join_command(
                    &boot,
                    &home(i),
                    &["--rounds", "4", "--status-addr", "127.0.0.1:0"],
                ),
            )
        })
        .collect();
    for (i, node) in nodes.iter_mut().enumerate() {
        let ready = node.wait_for_line("data_ready ", Duration::from_secs(60));
        assert_eq!(field(&ready, "shards"), Some("2"), "{ready}");
        assert!(
            holds_the_shards(&home(i + 1), &data),
            "node{} shards",
            i + 1
        );
    }
    // Status and metrics show the data: held, fetched, served on.
    let addr = status_addr(&mut nodes[0]);
    let body = status_json(&addr);
    let d = &body["data"];
    assert_eq!(d["shards_total"], 2, "{d}");
    assert_eq!(d["shards_held"], 2, "{d}");
    assert_eq!(d["serving"], true, "{d}");
    assert!(d["bytes_fetched"].as_u64().unwrap() > 0, "{d}");
    let metrics = http_get(&addr, "/metrics");
    assert!(metrics.contains("gasloc_shards_held 2"), "{metrics}");
    for (i, node) in nodes.iter_mut().enumerate() {
        node.expect_success(Duration::from_secs(120));
        // From ln(256) = 5.55 nats (an untrained model) to a small fraction of it (the test
        // text is a few sentences repeated: learnt, it costs 0.2–0.5 nats), and lower than
        // after the first round at some point. A round's loss may jump on the way: three
        // nodes on one-peer each train 50–90 steps a round on their own data order, and the
        // mix of two of them with the outer momentum's overshoot was measured up to 1.85
        // locally and 2.50 in CI (node3: 0.95, 2.50, 0.34, 0.19); never back to an
        // untrained model's loss.
        let losses = val_losses(&home(i + 1));
        let best = losses.iter().cloned().fold(f64::INFINITY, f64::min);
        assert!(
            losses.len() >= 2
                && best < losses[0]
                && best < 1.5
                && losses.iter().all(|&l| l < UNIFORM_LOSS),
            "node{}'s validation loss falls: {losses:?}",
            i + 1
        );
    }
}

#[test]
fn a_peer_serving_wrong_bytes_is_caught_and_the_shard_comes_from_another() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let (manifest, data) = pinned_run_of_three_training_shards(dir, "wrong-bytes-test");
    // No bootstrap serves: the two sources are an honest node and one whose shards are
    // changed on disk after its trainer checked them (it serves what is there). The three
    // training shards are fetched at once, at most two from one peer: the liar serves one.
    let (_boot_proc, boot) = bootstrap(dir, &manifest, None, &[]);
    let copy = |name: &str| {
        let to = dir.join(name);
        std::fs::create_dir(&to).unwrap();
        for entry in std::fs::read_dir(&data).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
        }
        to
    };
    let (honest_data, liar_data) = (copy("honest-data"), copy("liar-data"));
    // The honest node serves slowly: a shard waiting for one of its two slots takes the
    // liar, even if the liar was listed late.
    let mut honest = Proc::spawn(
        "honest",
        dir,
        join_command(
            &boot,
            &dir.join("honest"),
            &honest_data,
            &["--data-serve-rate", "100k"],
        ),
    );
    let mut liar = Proc::spawn(
        "liar",
        dir,
        join_command(&boot, &dir.join("liar"), &liar_data, &[]),
    );
    honest.wait_for_line("start=", Duration::from_secs(60));
    liar.wait_for_line("start=", Duration::from_secs(60));
    let liar_id = field(
        &liar.wait_for_line("peer_id=", Duration::from_secs(5)),
        "peer_id",
    )
    .unwrap()
    .to_string();
    // Every byte flipped, lengths kept: only the hash can tell.
    for entry in std::fs::read_dir(&liar_data).unwrap() {
        let path = entry.unwrap().path();
        let flipped: Vec<u8> = std::fs::read(&path).unwrap().iter().map(|b| !b).collect();
        std::fs::write(&path, flipped).unwrap();
    }

    let home = dir.join("fetcher");
    let mut fetcher = Proc::spawn(
        "fetcher",
        dir,
        fetching_join_command(
            &boot,
            &home,
            &[
                "--rounds",
                "2",
                "--data-chunk-bytes",
                "65536",
                "--status-addr",
                "127.0.0.1:0",
            ],
        ),
    );
    fetcher.wait_for_line("data_ready ", Duration::from_secs(90));
    assert!(
        holds_the_shards(&home, &data),
        "the fetched shards are the pinned ones"
    );
    let out = fetcher.output();
    let bad: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("shard_bad_source "))
        .collect();
    assert!(
        bad.iter().any(|l| l.contains(&liar_id)),
        "the liar is named as a bad source: {out}"
    );
    // Wrong bytes are an offence: the liar's score is down (the driver publishes the
    // standing once the node takes part).
    let addr = status_addr(&mut fetcher);
    let start = std::time::Instant::now();
    loop {
        let body = status_json(&addr);
        if body["scores"][&liar_id].as_f64().is_some_and(|s| s < 0.0) {
            assert!(
                body["data"]["bad_sources"].to_string().contains(&liar_id),
                "{}",
                body["data"]
            );
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the liar's score did not go down: {}",
            body["scores"]
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    fetcher.expect_success(Duration::from_secs(90));
}

#[test]
fn a_node_killed_mid_download_resumes_its_partial_shard() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let (manifest, data) = pinned_run(dir, "resume-test");
    // 150 kB/s per peer: the training shard (about 560 kB) takes about 4 s.
    let (_boot_proc, boot) = bootstrap(dir, &manifest, Some(&data), &["--data-serve-rate", "150k"]);
    let home = dir.join("node");
    let chunk: u64 = 32 << 10;
    let command = || {
        fetching_join_command(
            &boot,
            &home,
            &["--rounds", "2", "--data-chunk-bytes", &chunk.to_string()],
        )
    };
    let train_name = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .find(|n| n.contains("_train_"))
        .unwrap();
    let train_bytes = std::fs::metadata(data.join(&train_name)).unwrap().len();
    let part = home.join("data").join(format!("{train_name}.part"));

    let first = Proc::spawn("first", dir, command());
    let start = std::time::Instant::now();
    while std::fs::metadata(&part).map_or(0, |m| m.len()) < 4 * chunk {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no partial shard grew:\n{}",
            first.stderr_tail()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(first); // SIGKILL
    let kept = std::fs::metadata(&part).unwrap().len();
    assert!(kept < train_bytes, "killed before the shard was whole");

    let mut second = Proc::spawn("second", dir, command());
    second.wait_for_line("data_ready ", Duration::from_secs(60));
    let out = second.output();
    let line = out
        .lines()
        .find(|l| l.starts_with("shard_ready ") && l.contains(&train_name))
        .unwrap_or_else(|| panic!("no shard_ready line for {train_name}: {out}"));
    let fetched: u64 = field(line, "bytes_fetched").unwrap().parse().unwrap();
    assert!(
        fetched <= train_bytes - kept + chunk,
        "resumed: fetched {fetched} of {train_bytes} bytes after keeping {kept} (chunk {chunk})"
    );
    assert!(holds_the_shards(&home, &data));
    assert!(!part.exists(), "no partial file is left");
    // Not waited for: restarted at once, the node is not seen as a topic member by a
    // bootstrap that still holds its killed predecessor's connection (same peer id) until
    // that connection times out, so its first round can be a minute away.
}

#[test]
fn an_http_mirror_serves_the_data_and_a_failing_mirror_falls_back_to_the_swarm() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let data = prepare_byte_data(dir);
    let run = |name: &str, mirror: &HttpMirror| {
        let manifest = dir.join(format!("{name}.toml"));
        std::fs::write(&manifest, tiny_run(name, 3, &blocking(ADAPTIVE_ONE_PEER))).unwrap();
        pin_data(&data, &manifest, &["--mirror", &mirror.url]);
        manifest
    };

    // The mirror as the only source: no peer serves.
    let honest = HttpMirror::start(data.clone(), MirrorMode::Honest);
    let manifest = run("mirror-only-test", &honest);
    let (boot_proc, boot) = bootstrap(dir, &manifest, None, &[]);
    let home = dir.join("from-mirror");
    let mut node = Proc::spawn(
        "from-mirror",
        dir,
        fetching_join_command(&boot, &home, &["--rounds", "1"]),
    );
    let out = node.wait_for_line("data_ready ", Duration::from_secs(60));
    assert!(holds_the_shards(&home, &data), "{out}");
    assert!(
        node.output()
            .contains(&format!("source=mirror:{}", honest.url)),
        "{}",
        node.output()
    );
    node.expect_success(Duration::from_secs(60));
    drop(boot_proc);

    // A mirror that answers 404, and one that serves wrong bytes: the swarm serves.
    for mode in [MirrorMode::NotFound, MirrorMode::WrongBytes] {
        let name = format!("mirror-{mode:?}-test").to_lowercase();
        let failing = HttpMirror::start(data.clone(), mode);
        let manifest = run(&name, &failing);
        let sub = dir.join(&name);
        std::fs::create_dir(&sub).unwrap();
        let (_boot_proc, boot) = bootstrap(&sub, &manifest, Some(&data), &[]);
        let home = sub.join("node");
        let mut node = Proc::spawn(
            "node",
            &sub,
            fetching_join_command(&boot, &home, &["--rounds", "1"]),
        );
        node.wait_for_line("data_ready ", Duration::from_secs(90));
        let out = node.output();
        assert!(holds_the_shards(&home, &data), "{mode:?}: {out}");
        // Two shards, two sources: the mirror was given one of them, failed, and the swarm
        // served it.
        assert!(
            failing.requests.load(Ordering::Relaxed) > 0,
            "{mode:?}: mirror unused"
        );
        assert!(
            out.lines()
                .any(|l| l.starts_with("shard_bad_source ") && l.contains("source=mirror:")),
            "{mode:?}: the mirror is named as a bad source: {out}"
        );
        node.expect_success(Duration::from_secs(60));
    }
}

#[test]
fn a_node_with_no_source_for_its_data_stops_with_an_error_naming_the_shard() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let (manifest, _data) = pinned_run(dir, "no-source-test");
    // Nobody serves the shards and the manifest lists no mirror.
    let (_boot_proc, boot) = bootstrap(dir, &manifest, None, &[]);
    let mut node = Proc::spawn(
        "node",
        dir,
        fetching_join_command(&boot, &dir.join("node"), &["--data-patience-s", "3"]),
    );
    assert!(
        !node.wait_exit(Duration::from_secs(60)),
        "a node without a source for its data must fail, not hang"
    );
    let stderr = node.stderr_tail();
    assert!(
        stderr.contains("no source has shard") && stderr.contains(".bin"),
        "the error names the shard: {stderr}"
    );
    assert!(!node.output().contains("round="), "{}", node.output());
}

#[test]
fn a_joiner_trains_on_its_first_shard_while_the_rest_arrive() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    // Three training shards of about 400 kB, served at 30 kB/s: the two the joiner does not
    // train on first take some 27 s to arrive, while its first shard lasts it about 780
    // inner steps (8 rounds or more).
    let data = prepare_byte_data_with(dir, 600_000, &["--shard-tokens", "200000"]);
    let (manifest, data) = pinned_run_of(dir, "fetch-ahead-test", data, 4);
    let (mut boot_proc, boot) =
        bootstrap(dir, &manifest, Some(&data), &["--data-serve-rate", "30k"]);
    boot_proc.wait_for_line("serving_shards=4 ", Duration::from_secs(30));
    // A partner with the data that serves none of it, so the bootstrap is the one source. It
    // outlives the joiner (and is stopped when the test ends).
    let _partner = Proc::spawn(
        "partner",
        dir,
        join_command(
            &boot,
            &dir.join("partner"),
            &data,
            &["--rounds", "20", "--no-serve-data"],
        ),
    );
    let home = dir.join("joiner");
    let mut joiner = Proc::spawn("joiner", dir, fetching_join_command(&boot, &home, &[]));

    // It starts with the validation shard and its first training shard only.
    let first = joiner.wait_for_line("data_first ", Duration::from_secs(60));
    assert_eq!(field(&first, "shards_total"), Some("4"), "{first}");
    let held: u64 = field(&first, "shards_held").unwrap().parse().unwrap();
    assert!((2..4).contains(&held), "{first}");
    let first_shard = field(&first, "shard").unwrap().to_string();
    assert!(home.join("data").join(&first_shard).is_file());

    // It trains while the others arrive, then holds them all, byte for byte.
    joiner.wait_for_line("data_ready ", Duration::from_secs(120));
    let out = joiner.output();
    let ready_at = out.find("data_ready ").unwrap();
    let rounds_before = out[..ready_at].matches("\nround=").count();
    let ready = out[ready_at..].lines().next().unwrap();
    println!(
        "{}\nrounds before data_ready: {rounds_before}",
        &out[..ready_at + ready.len()]
    );
    assert!(
        rounds_before >= 1,
        "a round before the last shard arrived:\n{out}"
    );
    assert!(holds_the_shards(&home, &data));
    // Six rounds in all, then a clean stop (SIGTERM: the round in flight finishes). Stopped
    // rather than given `--rounds`: on a loaded machine a joiner may miss a round, which a
    // fixed count of rounds turns into a failed exit, and this test is not about that.
    let start = std::time::Instant::now();
    while read_report(&home).len() < 6 && start.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(500));
    }
    joiner.terminate();
    joiner.expect_success(Duration::from_secs(60));
    let losses = val_losses(&home);
    let best = losses.iter().cloned().fold(f64::INFINITY, f64::min);
    // On failure: what the joiner printed (its start, state sync and one line per round).
    let out = joiner.output();
    // Below an untrained model's loss every round (a round's loss may jump on the way, as
    // in the test above), and a small fraction of it at best.
    assert!(
        losses.len() >= 4 && losses.iter().all(|&l| l < UNIFORM_LOSS) && best < 1.5,
        "the joiner trains: {losses:?}\n{out}"
    );
    // A joiner that synced its partner's state starts where the swarm is (near the floor of
    // the memorised test text when the partner had trained a few rounds): it keeps that
    // level. One that started from the seed learns.
    if out.contains("state_synced_from=") {
        let (first, last) = (losses[0], *losses.last().unwrap());
        assert!(
            last <= first + 0.1,
            "the joiner lost the synced state's level: {losses:?}\n{out}"
        );
    } else {
        assert!(
            best < losses[0],
            "the joiner's validation loss falls: {losses:?}\n{out}"
        );
    }
}
