//! The HTTP server: `/status` (JSON), `/metrics` (Prometheus text) and `/` (dashboard).
//!
//! It reads the node's latest [`NodeStatus`] from a watch channel and never blocks the
//! node. Bind it to loopback (the default) unless the status should be public.

use crate::metrics::NodeMetrics;
use crate::snapshot::NodeStatus;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use prometheus_client::registry::Registry;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

const DASHBOARD: &str = include_str!("dashboard.html");
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone)]
struct Shared {
    status: watch::Receiver<NodeStatus>,
    registry: Arc<Registry>,
    metrics: NodeMetrics,
}

/// A running status server.
pub struct StatusServer {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl StatusServer {
    /// Binds `addr` (port 0 picks a free port) and serves until dropped. `registry` holds
    /// `metrics` (see [`NodeMetrics::register`]) and any others, libp2p's included.
    pub async fn start(
        addr: SocketAddr,
        status: watch::Receiver<NodeStatus>,
        registry: Arc<Registry>,
        metrics: NodeMetrics,
    ) -> anyhow::Result<StatusServer> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("--status-addr {addr}: cannot listen: {e}"))?;
        let addr = listener.local_addr()?;
        let app = Router::new()
            .route("/", get(dashboard))
            .route("/status", get(status_json))
            .route("/metrics", get(metrics_text))
            .with_state(Shared {
                status,
                registry,
                metrics,
            });
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("status server on {addr} stopped: {e}");
            }
        });
        Ok(StatusServer { addr, task })
    }
}

impl Drop for StatusServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn dashboard() -> Html<&'static str> {
    Html(DASHBOARD)
}

async fn status_json(State(s): State<Shared>) -> Json<NodeStatus> {
    Json(s.status.borrow().clone())
}

async fn metrics_text(State(s): State<Shared>) -> Response {
    s.metrics.update(&s.status.borrow());
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &s.registry) {
        Ok(()) => ([(header::CONTENT_TYPE, OPENMETRICS)], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
