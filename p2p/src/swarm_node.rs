//! One swarm node, wired: the libp2p network, the run's topic, the exchange service and the
//! round driver, put together in the order a node needs them. `gasloc-node join` and the
//! in-process harness ([`crate::local_swarm`]) both build their nodes through it, so a test
//! of many nodes in one process runs the wiring the binary runs.
//!
//! A node's life, each step a method that consumes the step before:
//! 1. [`SwarmNode::start`]: listen, dial the bootstrap nodes;
//! 2. [`SwarmNode::fetch_manifest`] when the run comes from a bootstrap node;
//! 3. [`SwarmNode::join_run`]: subscribe to the run's topic (its messages checked against
//!    the round timing) and serve exchanges and state, giving a [`JoinedNode`];
//! 4. optionally [`JoinedNode::wait_for_topic_peers`] and [`JoinedNode::fetch_state`] (a
//!    late joiner);
//! 5. [`JoinedNode::take_part`]: the rounds, then leave the swarm.
//!
//! What is the process's and not the node's stays with the caller: the command line, the
//! logger and the runtime, stdout, the status server, signals, the trainer.

use crate::config::NetworkConfig;
use crate::driver::{DriverOptions, RoundDriver, RoundRecord};
use crate::exchange_service::{ExchangeConfig, ExchangeService};
use crate::manifest_service::verify_manifest_response;
use crate::network::{self, Client, ClientError, Network, NetworkEvent};
use crate::schedule::Timing;
use crate::tensors::{TensorSet, TensorSpec};
use crate::work::RoundWork;
use anyhow::{anyhow, bail};
use gasloc_proto::{RunId, RunManifest};
use gasloc_status::NodeStatus;
use libp2p::identity::Keypair;
use libp2p::{Multiaddr, PeerId};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// A started node: listening, connected to its bootstrap nodes, in no run yet.
pub struct SwarmNode {
    network: Network,
}

/// A node in a run: subscribed to the run's topic and serving the exchange and state
/// protocols.
pub struct JoinedNode {
    client: Client,
    events: mpsc::UnboundedReceiver<NetworkEvent>,
    service: ExchangeService,
    run_id: RunId,
    timing: Timing,
}

/// What taking part in rounds needs besides the node.
pub struct Participation {
    /// The trainer (the libtorch one, or the synthetic one).
    pub work: Box<dyn RoundWork>,
    pub options: DriverOptions,
    /// The node's `/status` document, kept current as rounds move on.
    pub status: watch::Sender<NodeStatus>,
    /// Cancelled to leave after the round in flight.
    pub stop: CancellationToken,
}

/// A state a peer served (see [`JoinedNode::fetch_state`]).
pub struct FetchedState {
    pub peer: PeerId,
    pub round: u64,
    pub state: TensorSet,
}

impl SwarmNode {
    /// Starts the network with `keypair` and `config`, recording libp2p's metrics into
    /// `registry` when one is given.
    pub async fn start(
        keypair: Keypair,
        config: NetworkConfig,
        registry: Option<&mut prometheus_client::registry::Registry>,
    ) -> anyhow::Result<Self> {
        let network = network::start_with_metrics(keypair, config, registry).await?;
        Ok(Self { network })
    }

    pub fn peer_id(&self) -> PeerId {
        self.network.client.peer_id()
    }

    pub fn client(&self) -> &Client {
        &self.network.client
    }

    /// The addresses the node listens on (without its `/p2p/<id>`).
    pub fn listen_addrs(&self) -> &[Multiaddr] {
        &self.network.listen_addrs
    }

    /// Asks each bootstrap node in turn for the run's manifest and round timing, retrying
    /// for about 5 s while connections come up. The manifest is verified (and checked
    /// against `expected` when given) before it is returned; a bootstrap node serving a bad
    /// one is an error at once, naming it.
    pub async fn fetch_manifest(
        &self,
        bootstrap_peers: &[PeerId],
        expected: Option<RunId>,
    ) -> anyhow::Result<(RunManifest, Timing)> {
        let client = &self.network.client;
        let mut last_error = String::from("no bootstrap node");
        for attempt in 0..20 {
            for peer in bootstrap_peers {
                match client.request_manifest(*peer).await {
                    Ok(response) => {
                        let manifest = verify_manifest_response(&response, expected)
                            .map_err(|e| anyhow!("bootstrap {peer}: {e}"))?;
                        let timing = response
                            .timing
                            .as_ref()
                            .ok_or_else(|| anyhow!("bootstrap {peer} served no round timing"))
                            .and_then(|t| {
                                Timing::from_wire(t)
                                    .map_err(|e| anyhow!("bootstrap {peer}: round timing: {e}"))
                            })?;
                        return Ok((manifest, timing));
                    }
                    // Asking again would not help.
                    Err(e @ ClientError::NetworkStopped) => return Err(e.into()),
                    // The error names the peer.
                    Err(e) => last_error = e.to_string(),
                }
            }
            tracing::debug!(attempt, %last_error, "manifest request failed; retrying");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        bail!("could not fetch the run manifest: {last_error}")
    }

    /// Joins run `run_id`: subscribes to its topic, checking control messages against
    /// `timing`'s round window, and serves exchanges (a partner is waited for up to one
    /// exchange timeout) and state requests.
    pub async fn join_run(self, run_id: RunId, timing: Timing) -> anyhow::Result<JoinedNode> {
        let Network { client, events, .. } = self.network;
        client.join_run(run_id, Some(timing.clone())).await?;
        let mut config = ExchangeConfig::new(run_id);
        config.accept_wait = Duration::from_millis(timing.exchange_timeout_ms);
        let service = ExchangeService::start(client.peer_id(), client.stream_control(), config)?;
        Ok(JoinedNode {
            client,
            events,
            service,
            run_id,
            timing,
        })
    }
}

impl JoinedNode {
    pub fn peer_id(&self) -> PeerId {
        self.client.peer_id()
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The node's exchange and state-sync service (the driver publishes its state there).
    pub fn exchange_service(&self) -> &ExchangeService {
        &self.service
    }

    /// Waits, up to `within`, until at least `min_peers` peers are subscribed to the run's
    /// topic.
    pub async fn wait_for_topic_peers(
        &self,
        min_peers: usize,
        within: Duration,
    ) -> anyhow::Result<()> {
        let poll = Duration::from_millis(100);
        let tries = (within.as_millis() / poll.as_millis()).max(1);
        for _ in 0..tries {
            if self.client.topic_peers().await?.len() >= min_peers {
                return Ok(());
            }
            tokio::time::sleep(poll).await;
        }
        bail!(
            "fewer than {min_peers} peers subscribed to the run's topic within {} s",
            within.as_secs()
        )
    }

    /// Fetches the run's current state (checked against `table`, every value finite) from
    /// the first topic peer outside `exclude` (the bootstrap nodes, which hold none) that
    /// serves one, skipping a peer whose state holds a NaN or an infinity; `None`
    /// when nobody does (a new run: start from the seed). Peers found through Kademlia
    /// subscribe over a few heartbeats, so the topic is watched for up to 20 s.
    pub async fn fetch_state(
        &self,
        exclude: &[PeerId],
        table: Arc<Vec<TensorSpec>>,
    ) -> Option<FetchedState> {
        let mut peers = Vec::new();
        for _ in 0..100 {
            peers = self.client.topic_peers().await.unwrap_or_default();
            peers.retain(|p| !exclude.contains(p));
            if !peers.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for peer in peers {
            match self
                .service
                .fetch_state(peer, Some(table.clone()), Duration::from_secs(120))
                .await
            {
                Ok((round, state)) => match state.first_non_finite() {
                    // Well formed, but poison: ask the next peer.
                    Some(tensor) => tracing::warn!(
                        %peer,
                        tensor,
                        "refused the peer's state: it holds a NaN or an infinity"
                    ),
                    None => return Some(FetchedState { peer, round, state }),
                },
                Err(e) => tracing::info!(%peer, error = %e, "no state from this peer"),
            }
        }
        None
    }

    /// Takes part in rounds until `options.rounds` are done or `stop` is cancelled (see
    /// [`RoundDriver::run`]; `on_record` sees each round's record as it ends), then leaves
    /// the swarm. Returns the records of the rounds taken part in.
    pub async fn take_part(
        self,
        participation: Participation,
        on_record: impl FnMut(&RoundRecord),
    ) -> anyhow::Result<Vec<RoundRecord>> {
        let Participation {
            work,
            options,
            status,
            stop,
        } = participation;
        let driver = RoundDriver {
            client: self.client.clone(),
            events: self.events,
            timing: self.timing,
            service: self.service,
            work,
            options,
            run_id: self.run_id,
            status,
            stop,
        };
        let records = driver.run(on_record).await;
        self.client.shutdown().await;
        records
    }
}
