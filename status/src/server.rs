//! The HTTP server: `/status` (JSON), `/metrics` (Prometheus text) and `/` (dashboard).
//!
//! It reads the node's latest [`NodeStatus`] from a watch channel and never blocks the
//! node. Bind it to loopback (the default) unless the status should be public. A bootstrap
//! node's server ([`StatusServer::start_bootstrap`]) serves its [`BootstrapStatus`] the same
//! way at `/status` and `/metrics`; it has no dashboard, and `/` answers the JSON document.

use crate::metrics::{BootstrapMetrics, NodeMetrics, UpdateFrom};
use crate::snapshot::{BootstrapStatus, NodeStatus};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use prometheus_client::registry::Registry;
use serde::Serialize;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

const DASHBOARD: &str = include_str!("dashboard.html");
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What the handlers read: the latest document `S` and the metrics `M` derived from it.
struct Shared<S, M> {
    status: watch::Receiver<S>,
    registry: Arc<Registry>,
    metrics: M,
}

impl<S, M: Clone> Clone for Shared<S, M> {
    fn clone(&self) -> Self {
        Shared {
            status: self.status.clone(),
            registry: self.registry.clone(),
            metrics: self.metrics.clone(),
        }
    }
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
        let app = Router::new()
            .route("/", get(dashboard))
            .route("/status", get(status_json::<NodeStatus, NodeMetrics>))
            .route("/metrics", get(metrics_text::<NodeStatus, NodeMetrics>))
            .with_state(Shared {
                status,
                registry,
                metrics,
            });
        Self::serve(addr, app).await
    }

    /// A bootstrap node's server, bound like [`Self::start`]: its [`BootstrapStatus`] at
    /// `/status` (and `/`), and `registry` (holding `metrics`, see
    /// [`BootstrapMetrics::register`]) at `/metrics`.
    pub async fn start_bootstrap(
        addr: SocketAddr,
        status: watch::Receiver<BootstrapStatus>,
        registry: Arc<Registry>,
        metrics: BootstrapMetrics,
    ) -> anyhow::Result<StatusServer> {
        let json = get(status_json::<BootstrapStatus, BootstrapMetrics>);
        let app = Router::new()
            .route("/", json.clone())
            .route("/status", json)
            .route(
                "/metrics",
                get(metrics_text::<BootstrapStatus, BootstrapMetrics>),
            )
            .with_state(Shared {
                status,
                registry,
                metrics,
            });
        Self::serve(addr, app).await
    }

    async fn serve(addr: SocketAddr, app: Router) -> anyhow::Result<StatusServer> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("--status-addr {addr}: cannot listen: {e}"))?;
        let addr = listener.local_addr()?;
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

async fn status_json<S: Serialize + Clone, M>(State(s): State<Shared<S, M>>) -> Json<S> {
    Json(s.status.borrow().clone())
}

async fn metrics_text<S, M: UpdateFrom<S>>(State(s): State<Shared<S, M>>) -> Response {
    s.metrics.update_from(&s.status.borrow());
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &s.registry) {
        Ok(()) => ([(header::CONTENT_TYPE, OPENMETRICS)], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
