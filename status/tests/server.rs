//! The status server over real HTTP on loopback, and its dashboard in headless Chromium.

use gasloc_status::client::{fetch_status, format_status};
use gasloc_status::{
    BootstrapMetrics, BootstrapStatus, NodeMetrics, NodeState, NodeStatus, RoundRecord,
    StatusServer,
};
use prometheus_client::registry::Registry;
use std::process::Command;
use std::sync::Arc;
use tokio::sync::watch;

/// A status as a node three rounds in would report it.
fn sample_status() -> NodeStatus {
    let mut s = NodeStatus {
        peer_id: "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN".into(),
        run_id: "36a72869b82fa885360939af62fc87af79302d9c0c44790709fe9d1ce85ac860".into(),
        run_name: "demo-shakespeare".into(),
        state: NodeState::Training,
        round: 3,
        inner_steps: 20,
        step_time_s: 0.25,
        neighbours: vec!["12D3KooWPeerA00000001".into()],
        connected_peers: 4,
        ..Default::default()
    };
    s.goodput
        .insert("12D3KooWPeerA00000001".into(), 12.5 * 1048576.0);
    s.banned.push(gasloc_status::BannedPeer {
        peer: "12D3KooWBadPeer000001".into(),
        round: 2,
        offences: vec![
            "0:non_finite".into(),
            "1:too_far".into(),
            "2:too_far".into(),
        ],
    });
    s.scores.insert("12D3KooWBadPeer000001".into(), -1000.0);
    s.scores.insert("12D3KooWPeerB00000002".into(), -1.0);
    for round in 0..3u64 {
        s.record_round(RoundRecord {
            round,
            neighbours: vec![format!("12D3KooWPeer{round:09}")],
            inner_steps: 20 - round,
            train_loss: Some(5.0 - round as f64),
            val_loss: (round % 2 == 0).then_some(5.2 - round as f64),
            bytes_sent: 3 << 20,
            bytes_received: 3 << 20,
            wait_s: 0.5,
            round_s: 5.0,
            ..Default::default()
        });
    }
    s
}

async fn start(status: NodeStatus) -> (StatusServer, watch::Sender<NodeStatus>) {
    let (tx, rx) = watch::channel(status);
    let mut registry = Registry::default();
    let metrics = NodeMetrics::register(&mut registry);
    let server = StatusServer::start(
        "127.0.0.1:0".parse().unwrap(),
        rx,
        Arc::new(registry),
        metrics,
    )
    .await
    .unwrap();
    (server, tx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_metrics_and_terminal_view_report_the_node() {
    let (server, tx) = start(sample_status()).await;
    let addr = server.addr.to_string();
    let a = addr.clone();
    let got = tokio::task::spawn_blocking(move || fetch_status(&a))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, sample_status());

    // A change published by the node is what the next request sees.
    tx.send_modify(|s| {
        s.round = 4;
        s.state = NodeState::Exchanging;
    });
    let a = addr.clone();
    let got = tokio::task::spawn_blocking(move || fetch_status(&a))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((got.round, got.state), (4, NodeState::Exchanging));
    let page = format_status(&got);
    assert!(
        page.contains("exchanging") && page.contains("round 4"),
        "{page}"
    );
    assert!(page.contains("H_i 20"), "{page}");

    let a = addr.clone();
    let metrics = tokio::task::spawn_blocking(move || {
        let mut r = ureq::get(&format!("http://{a}/metrics")).call().unwrap();
        r.body_mut().read_to_string().unwrap()
    })
    .await
    .unwrap();
    for line in [
        "gasloc_round 4",
        "gasloc_inner_steps 20",
        "gasloc_sent_bytes_total 9437184",
        "gasloc_rounds_total 3",
        "gasloc_goodput_bytes_per_second{peer=\"12D3KooWPeerA00000001\"} 13107200.0",
        "gasloc_banned_peers 1",
        "gasloc_peer_score{peer=\"12D3KooWPeerB00000002\"} -1.0",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
    assert!(metrics.trim_end().ends_with("# EOF"));
}

/// `GET path` over a plain socket, as HTTP/1.0 (what `tests/tests/bootstrap_cli.rs` and
/// simple scripts send); the whole response, head included.
fn http10_get(addr: std::net::SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let mut socket = std::net::TcpStream::connect(addr).unwrap();
    socket
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    write!(socket, "GET {path} HTTP/1.0\r\n\r\n").unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).unwrap();
    response
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_status_and_metrics_follow_the_bootstrap_node() {
    let document = BootstrapStatus {
        run_id: "36a72869b82fa885360939af62fc87af79302d9c0c44790709fe9d1ce85ac860".into(),
        run_name: "demo-shakespeare".into(),
        peer_id: "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN".into(),
        connected_peers: 3,
        topic_peers: 2,
    };
    let (tx, rx) = watch::channel(document.clone());
    let mut registry = Registry::default();
    let metrics = BootstrapMetrics::register(&mut registry);
    let server = StatusServer::start_bootstrap(
        "127.0.0.1:0".parse().unwrap(),
        rx,
        Arc::new(registry),
        metrics,
    )
    .await
    .unwrap();
    let addr = server.addr;

    let response = tokio::task::spawn_blocking(move || http10_get(addr, "/status"))
        .await
        .unwrap();
    assert!(response.starts_with("HTTP/1.0 200 OK"), "{response}");
    assert!(
        response
            .to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{response}"
    );
    let body = response.split("\r\n\r\n").nth(1).unwrap();
    let got: BootstrapStatus = serde_json::from_str(body).unwrap();
    assert_eq!(got, document);
    // The field names scripts and the end-to-end tests read.
    let json: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(json["run_id"], document.run_id.as_str());
    assert_eq!(json["peer_id"], document.peer_id.as_str());
    assert_eq!(
        (
            json["connected_peers"].as_u64(),
            json["topic_peers"].as_u64()
        ),
        (Some(3), Some(2))
    );

    // What the bootstrap publishes next is what the next request sees, at `/` too.
    tx.send_modify(|s| {
        s.connected_peers = 5;
        s.topic_peers = 4;
    });
    let (root, metrics) =
        tokio::task::spawn_blocking(move || (http10_get(addr, "/"), http10_get(addr, "/metrics")))
            .await
            .unwrap();
    let body = root.split("\r\n\r\n").nth(1).unwrap();
    let got: BootstrapStatus = serde_json::from_str(body).unwrap();
    assert_eq!((got.connected_peers, got.topic_peers), (5, 4));
    for line in ["gasloc_connected_peers 5", "gasloc_topic_peers 4"] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
    assert!(metrics.trim_end().ends_with("# EOF"), "{metrics}");
}

#[test]
fn status_client_names_an_address_without_a_node() {
    // Bind and drop to find a closed port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = fetch_status(&format!("127.0.0.1:{port}")).unwrap_err();
    assert!(
        format!("{err:#}").contains(&format!("127.0.0.1:{port}")),
        "{err:#}"
    );
}

/// The dashboard rendered by a real headless Chromium: it fetched /status and drew the
/// charts (the DOM it dumps has the round and SVG paths). Writes a screenshot next to
/// the test's temporary files, and copies it to docs/ when GASLOC_SCREENSHOT is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_renders_in_headless_chromium() {
    let chromium = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("chromium is not installed: `make setup` installs Debian's chromium");
    let (server, _tx) = start(sample_status()).await;
    let url = format!("http://{}/", server.addr);
    let profile = tempfile::tempdir().unwrap();
    let shot = profile.path().join("dashboard.png");
    let base_args = |p: &std::path::Path| {
        vec![
            "--headless".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-quic".into(),
            "--no-first-run".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            format!("--user-data-dir={}", p.display()),
            "--virtual-time-budget=4000".into(),
        ]
    };
    let (c, u, prof) = (
        chromium.to_string(),
        url.clone(),
        profile.path().to_path_buf(),
    );
    let args = base_args(&prof);
    let dom = tokio::task::spawn_blocking(move || {
        Command::new(&c)
            .args(&args)
            .arg("--dump-dom")
            .arg(&u)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let html = String::from_utf8_lossy(&dom.stdout);
    assert!(
        html.contains("data-round=\"3\""),
        "dashboard did not render /status:\n{html}"
    );
    assert!(html.contains("<path d=\"M"), "no chart was drawn:\n{html}");
    assert!(html.contains("demo-shakespeare"));
    assert!(
        html.contains("12D3KooWBadPeer000001</td>") && html.contains("<td>banned</td>"),
        "the ban is not on the dashboard:\n{html}"
    );

    let (c, u, s) = (chromium.to_string(), url, shot.clone());
    let args = base_args(&prof);
    let out = tokio::task::spawn_blocking(move || {
        Command::new(&c)
            .args(&args)
            .arg("--window-size=1100,900")
            .arg(format!("--screenshot={}", s.display()))
            .arg(&u)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        shot.exists(),
        "no screenshot: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::fs::metadata(&shot).unwrap().len() > 10_000);
    if let Ok(dest) = std::env::var("GASLOC_SCREENSHOT") {
        std::fs::copy(&shot, dest).unwrap();
    }
}
