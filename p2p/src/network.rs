//! The network event loop and its cloneable [`Client`] handle.
//!
//! One task owns the `Swarm` ([`EventLoop`]); everything else talks to it by sending
//! [`Command`]s through a [`Client`] and receives [`NetworkEvent`]s on a channel (the
//! rust-libp2p `file-sharing` example pattern). Bulk streams do not pass through the loop:
//! [`Client::stream_control`] gives a `libp2p_stream::Control` for the exchange protocols.
//! A request the loop cannot carry out fails with a [`ClientError`] that says why (the loop
//! is gone, or what the swarm refused).

use crate::config::{NetworkConfig, Role};
use crate::control::{run_topic, ControlValidator};
use crate::schedule::Timing;
use crate::swarm::{build_swarm, GaslocBehaviour, GaslocBehaviourEvent};
use anyhow::{anyhow, bail, Context};
use futures::StreamExt;
use gasloc_proto::wire::{ControlMessage, ManifestRequest, ManifestResponse};
use gasloc_proto::RunId;
use libp2p::core::ConnectedPoint;
use libp2p::gossipsub::{self, IdentTopic};
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::request_response::{self, OutboundRequestId};
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{ConnectionId, DialError, SwarmEvent};
use libp2p::{autonat, dcutr, identify, kad, mdns, Multiaddr, PeerId, Swarm};
use prost::Message;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};

/// Milliseconds since the Unix epoch (the wall clock the round schedule runs on).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// AutoNAT's verdict on this node, as the status documents and round records name it
/// (defined in `gasloc-status`, which both the network and the documents use).
pub use gasloc_status::Reachability;

/// The verdict of an AutoNAT status (the address a public node was dialled back at is
/// logged, not kept).
fn reachability_of(status: &autonat::NatStatus) -> Reachability {
    match status {
        autonat::NatStatus::Public(_) => Reachability::Public,
        autonat::NatStatus::Private => Reachability::Private,
        autonat::NatStatus::Unknown => Reachability::Unknown,
    }
}

/// Why a [`Client`] request failed. `NetworkStopped` means the event loop is gone (after
/// [`Client::shutdown`], or when the swarm task ended); the others are the swarm's own
/// refusals of one request, and the network goes on.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("the network event loop has stopped")]
    NetworkStopped,
    #[error("publish before joining a run")]
    NotJoined,
    #[error("cannot subscribe to {topic}: {error}")]
    Subscribe {
        topic: String,
        error: gossipsub::SubscriptionError,
    },
    /// Refused by this node itself: peers' validators would drop it.
    #[error("publish failed: control message of {len} bytes exceeds the cap of {cap}")]
    MessageTooLarge { len: usize, cap: usize },
    #[error("publish failed: {0}")]
    Publish(gossipsub::PublishError),
    #[error("cannot dial {address}: {error}")]
    Dial {
        address: Multiaddr,
        error: DialError,
    },
    #[error("manifest request to {peer} failed: {error}")]
    ManifestRequest {
        peer: PeerId,
        error: request_response::OutboundFailure,
    },
}

/// What the event loop reports.
#[derive(Debug, Clone)]
pub enum NetworkEvent {
    /// A control message that passed validation; `source` is its signed author.
    Control {
        source: PeerId,
        message: ControlMessage,
    },
    /// A peer subscribed to the run's topic.
    Subscribed(PeerId),
    Connected(PeerId),
    Disconnected(PeerId),
    /// AutoNAT changed its verdict on this node's reachability.
    Reachability(Reachability),
    /// DCUtR turned a relayed connection to this peer into a direct one (a hole punch).
    HolePunched(PeerId),
}

/// Requests to the event loop.
#[derive(Debug)]
pub enum Command {
    JoinRun {
        run_id: RunId,
        timing: Option<Timing>,
        reply: oneshot::Sender<Result<(), ClientError>>,
    },
    Publish {
        message: ControlMessage,
        reply: oneshot::Sender<Result<(), ClientError>>,
    },
    TopicPeers {
        reply: oneshot::Sender<Vec<PeerId>>,
    },
    ConnectedPeers {
        reply: oneshot::Sender<Vec<PeerId>>,
    },
    Dial {
        address: Multiaddr,
        /// The peer that answers becomes a bootstrap node of this node.
        bootstrap: bool,
        reply: oneshot::Sender<Result<PeerId, ClientError>>,
    },
    RequestManifest {
        peer: PeerId,
        reply: oneshot::Sender<Result<ManifestResponse, ClientError>>,
    },
    ServeManifest {
        response: ManifestResponse,
    },
    /// Refuse every connection of `peer` from now on, closing the open ones.
    Ban {
        peer: PeerId,
    },
    /// Close the run to every peer outside `allowed` (see [`crate::access`]).
    CloseRun {
        allowed: std::collections::HashSet<PeerId>,
    },
    /// Set `peer`'s gossipsub application score.
    SetScore {
        peer: PeerId,
        score: f64,
    },
    Shutdown,
}

/// A cloneable handle to the event loop.
#[derive(Clone)]
pub struct Client {
    commands: mpsc::Sender<Command>,
    peer_id: PeerId,
    stream_control: libp2p_stream::Control,
}

/// A started network: the handle, its events and the addresses it listens on.
pub struct Network {
    pub client: Client,
    pub events: mpsc::UnboundedReceiver<NetworkEvent>,
    pub listen_addrs: Vec<Multiaddr>,
    /// The bootstrap nodes (`config.bootstrap`): the peer id each address names, or, for an
    /// address without `/p2p/<id>`, the peer that answered there.
    pub bootstrap_peers: Vec<PeerId>,
    pub task: tokio::task::JoinHandle<()>,
}

impl Client {
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// A fresh stream control (one per concurrent `open_stream` caller).
    pub fn stream_control(&self) -> libp2p_stream::Control {
        self.stream_control.clone()
    }

    /// Sends a command that needs no answer.
    async fn tell(&self, command: Command) -> Result<(), ClientError> {
        self.commands
            .send(command)
            .await
            .map_err(|_| ClientError::NetworkStopped)
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, ClientError> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(make(tx))
            .await
            .map_err(|_| ClientError::NetworkStopped)?;
        rx.await.map_err(|_| ClientError::NetworkStopped)
    }

    /// Subscribes to the run's topic and validates its messages against `run_id` (and the
    /// round window of `timing`, when given).
    pub async fn join_run(&self, run_id: RunId, timing: Option<Timing>) -> Result<(), ClientError> {
        self.ask(|reply| Command::JoinRun {
            run_id,
            timing,
            reply,
        })
        .await?
    }

    /// Publishes a control message on the run's topic (refused before [`Self::join_run`]
    /// and above the control-message cap).
    pub async fn publish(&self, message: ControlMessage) -> Result<(), ClientError> {
        self.ask(|reply| Command::Publish { message, reply })
            .await?
    }

    /// Peers known to be subscribed to the run's topic.
    pub async fn topic_peers(&self) -> Result<Vec<PeerId>, ClientError> {
        self.ask(|reply| Command::TopicPeers { reply }).await
    }

    pub async fn connected_peers(&self) -> Result<Vec<PeerId>, ClientError> {
        self.ask(|reply| Command::ConnectedPeers { reply }).await
    }

    /// Dials `address`; returns the peer connected to, once the connection is established,
    /// or the error.
    pub async fn dial(&self, address: Multiaddr) -> Result<PeerId, ClientError> {
        self.ask(|reply| Command::Dial {
            address,
            bootstrap: false,
            reply,
        })
        .await?
    }

    /// Dials a bootstrap address that names no peer id (`/dns4/bootstrap/tcp/4001`): the
    /// peer that answers there is taken as a bootstrap node from then on.
    async fn dial_bootstrap(&self, address: Multiaddr) -> Result<PeerId, ClientError> {
        self.ask(|reply| Command::Dial {
            address,
            bootstrap: true,
            reply,
        })
        .await?
    }

    /// Asks `peer` for the manifest it serves (the response is not verified here: see
    /// [`crate::manifest_service::verify_manifest_response`]).
    pub async fn request_manifest(&self, peer: PeerId) -> Result<ManifestResponse, ClientError> {
        self.ask(|reply| Command::RequestManifest { peer, reply })
            .await?
    }

    /// Serves `response` to every manifest request from now on.
    pub async fn serve_manifest(&self, response: ManifestResponse) -> Result<(), ClientError> {
        self.tell(Command::ServeManifest { response }).await
    }

    /// Bans `peer` from this node: its connections are closed and refused from now on, for
    /// QUIC, TCP and relayed ones alike (see [`crate::peer_standing`]).
    pub async fn ban(&self, peer: PeerId) -> Result<(), ClientError> {
        self.tell(Command::Ban { peer }).await
    }

    /// Closes the run to every peer outside `allowed`: their connections are closed and
    /// refused from now on.
    pub async fn close_run(
        &self,
        allowed: std::collections::HashSet<PeerId>,
    ) -> Result<(), ClientError> {
        self.tell(Command::CloseRun { allowed }).await
    }

    /// Sets `peer`'s gossipsub application score (its standing with this node).
    pub async fn set_score(&self, peer: PeerId, score: f64) -> Result<(), ClientError> {
        self.tell(Command::SetScore { peer, score }).await
    }

    pub async fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown).await;
    }
}

/// The peer id at the end of a multiaddr (`…/p2p/<id>`), if any.
pub fn peer_id_of(address: &Multiaddr) -> Option<PeerId> {
    address.iter().find_map(|p| match p {
        Protocol::P2p(id) => Some(id),
        _ => None,
    })
}

/// Builds the swarm, listens, dials the bootstrap nodes and spawns the event loop.
/// Returns once every listener has at least one address (or fails naming the address).
pub async fn start(keypair: Keypair, config: NetworkConfig) -> anyhow::Result<Network> {
    start_with_metrics(keypair, config, None).await
}

/// [`start`], recording libp2p's own metrics (connections, gossipsub, Kademlia, identify,
/// ping, relay) into `registry` under `libp2p_` when one is given.
pub async fn start_with_metrics(
    keypair: Keypair,
    config: NetworkConfig,
    registry: Option<&mut prometheus_client::registry::Registry>,
) -> anyhow::Result<Network> {
    let metrics = registry.map(libp2p::metrics::Metrics::new);
    let peer_id = keypair.public().to_peer_id();
    let mut swarm = build_swarm(keypair, &config)?;
    let mut pending_listeners = HashSet::new();
    for address in &config.listen {
        let id = swarm
            .listen_on(address.clone())
            .with_context(|| format!("cannot listen on {address}"))?;
        pending_listeners.insert(id);
    }
    let mut listen_addrs = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !pending_listeners.is_empty() {
        let event = tokio::time::timeout_at(deadline, swarm.select_next_some())
            .await
            .map_err(|_| anyhow!("listeners did not report an address within 10 s"))?;
        match event {
            SwarmEvent::NewListenAddr {
                listener_id,
                address,
            } => {
                pending_listeners.remove(&listener_id);
                listen_addrs.push(address);
            }
            SwarmEvent::ListenerClosed {
                addresses, reason, ..
            } => {
                return Err(anyhow!("listener {addresses:?} closed: {reason:?}"));
            }
            SwarmEvent::ListenerError { error, .. } => {
                return Err(anyhow!("listener error: {error}"));
            }
            _ => {}
        }
    }
    // A bootstrap node is reachable where it listens (that is its job): its relay server
    // serves circuits only once the node has a confirmed external address.
    if config.role == Role::Bootstrap {
        for address in &listen_addrs {
            swarm.add_external_address(address.clone());
        }
    }
    let mut bootstrap_peers = HashSet::new();
    let mut unpinned = Vec::new();
    for address in &config.bootstrap {
        let Some(peer) = peer_id_of(address) else {
            unpinned.push(address.clone());
            continue;
        };
        bootstrap_peers.insert(peer);
        swarm.add_peer_address(peer, address.clone());
        swarm
            .behaviour_mut()
            .kad
            .add_address(&peer, address.clone());
        swarm
            .dial(address.clone())
            .with_context(|| format!("cannot dial bootstrap address {address}"))?;
    }
    let mut pinned: Vec<PeerId> = bootstrap_peers.iter().copied().collect();
    let patience = config.bootstrap_dial_patience;
    let (commands_tx, commands_rx) = mpsc::channel(256);
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let stream_control = swarm.behaviour().stream.new_control();
    let event_loop = EventLoop {
        swarm,
        config,
        commands: commands_rx,
        events: events_tx,
        topic: None,
        validator: None,
        served_manifest: None,
        pending_manifest: HashMap::new(),
        pending_dials: HashMap::new(),
        bootstrap_peers,
        bootstrap_links: HashMap::new(),
        relayed: HashMap::new(),
        redial_when_closed: HashSet::new(),
        relay_circuits: HashSet::new(),
        reachability: Reachability::Unknown,
        lookups: HashMap::new(),
        metrics,
    };
    let task = tokio::spawn(event_loop.run());
    let client = Client {
        commands: commands_tx,
        peer_id,
        stream_control,
    };
    for address in unpinned {
        pinned.push(resolve_bootstrap(&client, address, patience).await?);
    }
    Ok(Network {
        client,
        events: events_rx,
        listen_addrs,
        bootstrap_peers: pinned,
        task,
    })
}

/// Learns who answers at a bootstrap address that names no peer id, dialling it every
/// second for `patience`. The peer is not pinned, so whoever answers there is trusted to
/// serve the manifest: the run id (`--run-id`) still pins the run itself.
async fn resolve_bootstrap(
    client: &Client,
    address: Multiaddr,
    patience: Duration,
) -> anyhow::Result<PeerId> {
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        match client.dial_bootstrap(address.clone()).await {
            Ok(peer) => {
                tracing::info!(%address, %peer, "bootstrap address without a peer id answered");
                return Ok(peer);
            }
            Err(ClientError::NetworkStopped) => bail!("the network stopped"),
            Err(error) if tokio::time::Instant::now() >= deadline => bail!(
                "no bootstrap node answered at {address} within {}s: {error}",
                patience.as_secs()
            ),
            Err(error) => {
                tracing::debug!(%address, %error, "bootstrap not reachable yet; dialling again");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// A manifest request in flight: whom it went to, and who waits for the answer.
type PendingManifest = (
    PeerId,
    oneshot::Sender<Result<ManifestResponse, ClientError>>,
);
/// A dial in flight: the address, and who waits for the connection.
/// A dial in flight: its address, whether the peer is to be a bootstrap node, who waits.
type PendingDial = (
    Multiaddr,
    bool,
    oneshot::Sender<Result<PeerId, ClientError>>,
);

/// Owns the swarm; runs until `Shutdown` or until every `Client` is dropped.
pub struct EventLoop {
    swarm: Swarm<GaslocBehaviour>,
    config: NetworkConfig,
    commands: mpsc::Receiver<Command>,
    events: mpsc::UnboundedSender<NetworkEvent>,
    topic: Option<IdentTopic>,
    validator: Option<ControlValidator>,
    served_manifest: Option<ManifestResponse>,
    pending_manifest: HashMap<OutboundRequestId, PendingManifest>,
    pending_dials: HashMap<ConnectionId, PendingDial>,
    bootstrap_peers: HashSet<PeerId>,
    /// The address this node dialled each connected bootstrap node at (a relay circuit on
    /// it is reached through there).
    bootstrap_links: HashMap<PeerId, Multiaddr>,
    relayed: HashMap<PeerId, Vec<ConnectionId>>,
    /// Peers this node disconnected from because they restarted while connected (see
    /// [`EventLoop::on_connection_lost_by_peer`]): redialled once their last connection is closed.
    redial_when_closed: HashSet<PeerId>,
    /// Bootstrap nodes this node listens through (a relay circuit each).
    relay_circuits: HashSet<PeerId>,
    /// AutoNAT's last verdict on this node.
    reachability: Reachability,
    /// When a Kademlia lookup for a control-message author was last started.
    lookups: HashMap<PeerId, Instant>,
    metrics: Option<libp2p::metrics::Metrics>,
}

/// Whether a connection ended because the peer's side of it is gone, as opposed to a close
/// the peer sent on purpose or a local decision: for QUIC, the idle timeout (nothing heard
/// for that long) or a stateless reset (the peer's endpoint no longer knows the connection);
/// for TCP, a reset (the peer's kernel no longer knows it), a timeout or a broken pipe. Looks
/// through the layers libp2p wraps a transport's error in (the muxer's error inside an
/// `io::Error`, and what that error says it was caused by).
fn peer_lost_the_connection(error: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    let mut layer: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = layer {
        if let Some(libp2p::quic::Error::Connection(error)) =
            current.downcast_ref::<libp2p::quic::Error>()
        {
            // libp2p-quic keeps quinn's error private and shows it as quinn does: these are
            // quinn's words for `ConnectionError::TimedOut` and `ConnectionError::Reset`
            // (`p2p/tests/restart.rs` fails if they change).
            return matches!(error.to_string().as_str(), "timed out" | "reset by peer");
        }
        if let Some(io) = current.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                ErrorKind::ConnectionReset | ErrorKind::TimedOut | ErrorKind::BrokenPipe
            ) {
                return true;
            }
            // An `io::Error`'s `source` skips the error it wraps: look at that one itself.
            if let Some(inner) = io.get_ref() {
                layer = Some(inner);
                continue;
            }
        }
        layer = current.source();
    }
    false
}

/// Minimum time between two lookups of the same author.
const LOOKUP_INTERVAL: Duration = Duration::from_secs(10);

impl EventLoop {
    async fn run(mut self) {
        loop {
            tokio::select! {
                event = self.swarm.select_next_some() => self.on_swarm_event(event),
                command = self.commands.recv() => match command {
                    None | Some(Command::Shutdown) => break,
                    Some(command) => self.on_command(command),
                },
            }
        }
        tracing::debug!(peer = %self.swarm.local_peer_id(), "network event loop stopped");
    }

    fn emit(&self, event: NetworkEvent) {
        let _ = self.events.send(event);
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::JoinRun {
                run_id,
                timing,
                reply,
            } => {
                let topic = run_topic(&run_id);
                let result = self
                    .swarm
                    .behaviour_mut()
                    .gossipsub
                    .subscribe(&topic)
                    .map(|_| ())
                    .map_err(|error| ClientError::Subscribe {
                        topic: topic.to_string(),
                        error,
                    });
                self.validator = Some(ControlValidator::new(
                    run_id,
                    timing,
                    self.config.control_max_bytes,
                    self.config.control_rate_burst,
                    self.config.control_rate_window,
                ));
                self.topic = Some(topic);
                let _ = reply.send(result);
            }
            Command::Publish { message, reply } => {
                let data = message.encode_to_vec();
                let cap = self.config.control_max_bytes;
                let result = match &self.topic {
                    None => Err(ClientError::NotJoined),
                    // Peers' validators would refuse it: do not send it at all.
                    Some(_) if data.len() > cap => Err(ClientError::MessageTooLarge {
                        len: data.len(),
                        cap,
                    }),
                    Some(topic) => self
                        .swarm
                        .behaviour_mut()
                        .gossipsub
                        .publish(topic.clone(), data)
                        .map(|_| ())
                        .map_err(ClientError::Publish),
                };
                let _ = reply.send(result);
            }
            Command::TopicPeers { reply } => {
                let peers = match &self.topic {
                    None => Vec::new(),
                    Some(topic) => {
                        let hash = topic.hash();
                        self.swarm
                            .behaviour()
                            .gossipsub
                            .all_peers()
                            .filter(|(_, topics)| topics.contains(&&hash))
                            .map(|(p, _)| *p)
                            .collect()
                    }
                };
                let _ = reply.send(peers);
            }
            Command::ConnectedPeers { reply } => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            Command::Dial {
                address,
                bootstrap,
                reply,
            } => {
                let opts = DialOpts::from(address.clone());
                let id = opts.connection_id();
                match self.swarm.dial(opts) {
                    Ok(()) => {
                        self.pending_dials.insert(id, (address, bootstrap, reply));
                    }
                    Err(error) => {
                        let _ = reply.send(Err(ClientError::Dial { address, error }));
                    }
                }
            }
            Command::RequestManifest { peer, reply } => {
                let id = self
                    .swarm
                    .behaviour_mut()
                    .manifest
                    .send_request(&peer, ManifestRequest { run_id: Vec::new() });
                self.pending_manifest.insert(id, (peer, reply));
            }
            Command::ServeManifest { response } => self.served_manifest = Some(response),
            Command::Ban { peer } => {
                // Closes its connections and refuses new ones. Its control messages that
                // other peers forward still count in the round's agreement (gossipsub's
                // blacklist would drop them and split this node's view of the members from
                // the swarm's); its score makes this node ignore what it sends directly.
                self.swarm.behaviour_mut().blocked.block_peer(peer);
                self.swarm
                    .behaviour_mut()
                    .gossipsub
                    .set_application_score(&peer, crate::peer_standing::BANNED_SCORE);
            }
            Command::CloseRun { allowed } => self.swarm.behaviour_mut().access.close(allowed),
            Command::SetScore { peer, score } => {
                self.swarm
                    .behaviour_mut()
                    .gossipsub
                    .set_application_score(&peer, score);
            }
            Command::Shutdown => {}
        }
    }

    fn on_swarm_event(&mut self, event: SwarmEvent<GaslocBehaviourEvent>) {
        if let Some(metrics) = &self.metrics {
            use libp2p::metrics::Recorder;
            metrics.record(&event);
            if let SwarmEvent::Behaviour(behaviour) = &event {
                match behaviour {
                    GaslocBehaviourEvent::Gossipsub(e) => metrics.record(e),
                    GaslocBehaviourEvent::Kad(e) => metrics.record(e),
                    GaslocBehaviourEvent::Identify(e) => metrics.record(e),
                    GaslocBehaviourEvent::Ping(e) => metrics.record(e),
                    GaslocBehaviourEvent::RelayServer(e) => metrics.record(e),
                    GaslocBehaviourEvent::Dcutr(e) => metrics.record(e),
                    _ => {}
                }
            }
        }
        match event {
            SwarmEvent::Behaviour(event) => self.on_behaviour_event(event),
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                num_established,
                ..
            } => {
                if let Some((address, bootstrap, reply)) = self.pending_dials.remove(&connection_id)
                {
                    if bootstrap {
                        self.bootstrap_peers.insert(peer_id);
                        self.swarm.add_peer_address(peer_id, address);
                    }
                    let _ = reply.send(Ok(peer_id));
                }
                if endpoint.is_relayed() {
                    self.relayed.entry(peer_id).or_default().push(connection_id);
                }
                if let ConnectedPoint::Dialer { address, .. } = &endpoint {
                    if !endpoint.is_relayed() && self.bootstrap_peers.contains(&peer_id) {
                        self.swarm
                            .behaviour_mut()
                            .kad
                            .add_address(&peer_id, address.clone());
                        let _ = self.swarm.behaviour_mut().kad.bootstrap();
                        self.bootstrap_links.insert(peer_id, address.clone());
                        if self.config.relay_listen || self.reachability == Reachability::Private {
                            self.listen_through_relay(peer_id);
                        }
                    }
                }
                if num_established.get() == 1 {
                    self.emit(NetworkEvent::Connected(peer_id));
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                endpoint,
                num_established,
                cause,
            } => {
                if let Some(ids) = self.relayed.get_mut(&peer_id) {
                    ids.retain(|id| *id != connection_id);
                }
                if num_established == 0 {
                    self.emit(NetworkEvent::Disconnected(peer_id));
                    if self.redial_when_closed.remove(&peer_id) {
                        let _ = self.swarm.dial(
                            DialOpts::peer_id(peer_id)
                                .condition(PeerCondition::DisconnectedAndNotDialing)
                                .build(),
                        );
                    }
                } else if let Some(libp2p::swarm::ConnectionError::IO(error)) = cause {
                    if !endpoint.is_relayed() && peer_lost_the_connection(&error) {
                        self.on_connection_lost_by_peer(peer_id, &error);
                    }
                }
            }
            SwarmEvent::OutgoingConnectionError {
                connection_id,
                error,
                peer_id,
            } => {
                tracing::debug!(?peer_id, %error, "outgoing connection failed");
                if let Some((address, _, reply)) = self.pending_dials.remove(&connection_id) {
                    let _ = reply.send(Err(ClientError::Dial { address, error }));
                }
            }
            _ => {}
        }
    }

    /// A direct connection to `peer` ended because the peer's side of it is gone, while a
    /// newer connection to the same peer stands: the peer crashed and came back with the
    /// same identity before this node noticed, and connected again.
    ///
    /// Gossipsub greets a peer (sends it our subscriptions) on its first connection only, and
    /// that was the dead one: the restarted peer would never learn that this node is on the
    /// run's topic, and would stop waiting for subscribers. So this node drops every
    /// connection to the peer and dials it again once the last one is closed: the new first
    /// connection carries a fresh greeting both ways. (A QUIC connection to a killed node
    /// stays open on this side until the QUIC idle timeout: the restarted node cannot reset
    /// it, as its connection ids are keyed afresh at every start. A TCP connection of a node
    /// cut off its network stays open on this side until the node, back, answers a segment on
    /// it with a reset.)
    fn on_connection_lost_by_peer(&mut self, peer: PeerId, error: &std::io::Error) {
        tracing::info!(
            %peer,
            %error,
            "a connection to a peer died while a newer one stood (the peer restarted): reconnecting so gossipsub greets it again"
        );
        if self.redial_when_closed.insert(peer) {
            let _ = self.swarm.disconnect_peer_id(peer);
        }
    }

    fn on_behaviour_event(&mut self, event: GaslocBehaviourEvent) {
        match event {
            GaslocBehaviourEvent::Identify(identify::Event::Received { peer_id, info, .. }) => {
                for address in info.listen_addrs {
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .add_address(&peer_id, address);
                }
            }
            GaslocBehaviourEvent::Gossipsub(gossipsub::Event::Message {
                propagation_source,
                message_id,
                message,
            }) => self.on_gossip_message(propagation_source, message_id, message),
            GaslocBehaviourEvent::Gossipsub(gossipsub::Event::Subscribed { peer_id, topic })
                if self.topic.as_ref().is_some_and(|t| t.hash() == topic) =>
            {
                self.emit(NetworkEvent::Subscribed(peer_id));
            }
            GaslocBehaviourEvent::Manifest(event) => self.on_manifest_event(event),
            GaslocBehaviourEvent::Mdns(mdns::Event::Discovered(found)) => {
                let mut by_peer: HashMap<PeerId, Vec<Multiaddr>> = HashMap::new();
                for (peer, address) in found {
                    self.swarm.add_peer_address(peer, address.clone());
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .add_address(&peer, address.clone());
                    by_peer.entry(peer).or_default().push(address);
                }
                // Two nodes on a LAN hear each other's answers at the same moment and dial at
                // once. Dialling TCP from the listen port (libp2p's default) would then make
                // both dials one TCP connection by simultaneous open, which both ends take
                // for their own outbound one, and the handshake fails on both sides. A fresh
                // port per dial keeps them two connections; one dial per peer, not per address.
                for (peer, addresses) in by_peer {
                    let _ = self.swarm.dial(
                        DialOpts::peer_id(peer)
                            .addresses(addresses)
                            .condition(PeerCondition::DisconnectedAndNotDialing)
                            .allocate_new_port()
                            .build(),
                    );
                }
            }
            GaslocBehaviourEvent::Dcutr(dcutr::Event {
                remote_peer_id,
                result,
            }) => match result {
                Ok(_) => {
                    tracing::info!(peer = %remote_peer_id, "direct connection through a hole punch");
                    // libp2p-stream picks a random connection: drop the relayed ones once a
                    // direct connection exists, so bulk transfers never use a relay circuit.
                    for id in self.relayed.remove(&remote_peer_id).unwrap_or_default() {
                        self.swarm.close_connection(id);
                    }
                    self.emit(NetworkEvent::HolePunched(remote_peer_id));
                }
                Err(error) => {
                    tracing::info!(peer = %remote_peer_id, %error, "hole punch failed; the relay circuit stays")
                }
            },
            GaslocBehaviourEvent::Autonat(autonat::Event::StatusChanged { new, .. }) => {
                self.on_reachability(new)
            }
            GaslocBehaviourEvent::Gossipsub(gossipsub::Event::SlowPeer {
                peer_id,
                failed_messages,
            }) => {
                tracing::warn!(peer = %peer_id, ?failed_messages, "gossipsub dropped messages to a slow peer");
            }
            GaslocBehaviourEvent::Kad(kad::Event::RoutingUpdated { peer, .. }) => {
                tracing::trace!(%peer, "kademlia routing updated");
            }
            _ => {}
        }
    }

    fn on_gossip_message(
        &mut self,
        propagation_source: PeerId,
        message_id: gossipsub::MessageId,
        message: gossipsub::Message,
    ) {
        let Some(validator) = self.validator.as_mut() else {
            self.swarm
                .behaviour_mut()
                .gossipsub
                .report_message_validation_result(
                    &message_id,
                    &propagation_source,
                    gossipsub::MessageAcceptance::Ignore,
                );
            return;
        };
        let verdict = validator.validate(message.source, &message.data, unix_ms(), Instant::now());
        let acceptance = match &verdict {
            Ok(_) => gossipsub::MessageAcceptance::Accept,
            Err(reject) => {
                tracing::warn!(source = ?message.source, via = %propagation_source, %reject, "control message refused");
                reject.acceptance()
            }
        };
        self.swarm
            .behaviour_mut()
            .gossipsub
            .report_message_validation_result(&message_id, &propagation_source, acceptance);
        if let Ok((source, message)) = verdict {
            self.find_author(source);
            self.emit(NetworkEvent::Control { source, message });
        }
    }

    /// AutoNAT's new verdict: reported, and a node nobody can dial listens through a relay
    /// circuit on each bootstrap node it is connected to (as `--relay` does from the start)
    /// and answers no Kademlia queries (others would put its unreachable addresses in their
    /// routing tables); found public again, it serves Kademlia again if configured to.
    fn on_reachability(&mut self, status: autonat::NatStatus) {
        match &status {
            autonat::NatStatus::Public(address) => {
                tracing::info!(%address, "reachability: public (AutoNAT dialled this node back)")
            }
            autonat::NatStatus::Private => {
                tracing::info!("reachability: private (AutoNAT could not dial this node back)")
            }
            autonat::NatStatus::Unknown => tracing::info!("reachability: unknown"),
        }
        let reachability = reachability_of(&status);
        self.reachability = reachability;
        if self.config.role == Role::Node {
            match reachability {
                Reachability::Private => {
                    tracing::info!(
                        "listening through the bootstrap nodes' relays; Kademlia in client mode"
                    );
                    let kad = &mut self.swarm.behaviour_mut().kad;
                    kad.set_mode(Some(kad::Mode::Client));
                    let relays: Vec<PeerId> = self.bootstrap_links.keys().copied().collect();
                    for relay in relays {
                        self.listen_through_relay(relay);
                    }
                }
                Reachability::Public if self.config.kad_server => {
                    let kad = &mut self.swarm.behaviour_mut().kad;
                    kad.set_mode(Some(kad::Mode::Server));
                }
                _ => {}
            }
        }
        self.emit(NetworkEvent::Reachability(reachability));
    }

    /// Listens through a relay circuit on bootstrap node `relay` (once per relay): peers that
    /// cannot dial this node directly reach it at `<address>/p2p/<relay>/p2p-circuit/p2p/<me>`,
    /// where `address` is where this node dialled the relay.
    fn listen_through_relay(&mut self, relay: PeerId) {
        let Some(address) = self.bootstrap_links.get(&relay) else {
            return;
        };
        if !self.relay_circuits.insert(relay) {
            return;
        }
        let mut circuit = address.clone();
        if matches!(circuit.iter().last(), Some(Protocol::P2p(_))) {
            circuit.pop();
        }
        let circuit = circuit
            .with(Protocol::P2p(relay))
            .with(Protocol::P2pCircuit);
        match self.swarm.listen_on(circuit.clone()) {
            Ok(_) => tracing::info!(%circuit, "listening through the relay"),
            Err(e) => tracing::warn!(%circuit, error = %e, "cannot listen through the relay"),
        }
    }

    /// Round partners are taken from the control plane's authors: look up the address of an
    /// author this node is not connected to, so that an exchange stream can be opened later,
    /// and note the author's relay circuit on each bootstrap node (`/p2p/<bootstrap>/
    /// p2p-circuit/p2p/<author>`: it works when the author listens there with `--relay`,
    /// because nobody can dial it directly).
    fn find_author(&mut self, peer: PeerId) {
        if peer == *self.swarm.local_peer_id() || self.swarm.is_connected(&peer) {
            return;
        }
        let now = Instant::now();
        if self
            .lookups
            .get(&peer)
            .is_some_and(|last| now.duration_since(*last) < LOOKUP_INTERVAL)
        {
            return;
        }
        self.lookups.insert(peer, now);
        self.swarm.behaviour_mut().kad.get_closest_peers(peer);
        let relays: Vec<Multiaddr> = self
            .config
            .bootstrap
            .iter()
            .filter(|a| peer_id_of(a).is_some_and(|relay| relay != peer))
            .map(|a| {
                a.clone()
                    .with(Protocol::P2pCircuit)
                    .with(Protocol::P2p(peer))
            })
            .collect();
        for circuit in relays {
            self.swarm.add_peer_address(peer, circuit);
        }
    }

    fn on_manifest_event(
        &mut self,
        event: request_response::Event<ManifestRequest, ManifestResponse>,
    ) {
        match event {
            request_response::Event::Message { peer, message, .. } => match message {
                request_response::Message::Request {
                    request, channel, ..
                } => {
                    let response = match &self.served_manifest {
                        Some(served)
                            if request.run_id.is_empty() || request.run_id == served.run_id =>
                        {
                            served.clone()
                        }
                        Some(_) => ManifestResponse {
                            error: "this node serves another run".into(),
                            ..Default::default()
                        },
                        None => ManifestResponse {
                            error: "this node serves no manifest".into(),
                            ..Default::default()
                        },
                    };
                    tracing::debug!(%peer, "serving the run manifest");
                    let _ = self
                        .swarm
                        .behaviour_mut()
                        .manifest
                        .send_response(channel, response);
                }
                request_response::Message::Response {
                    request_id,
                    response,
                } => {
                    if let Some((_, reply)) = self.pending_manifest.remove(&request_id) {
                        let _ = reply.send(Ok(response));
                    }
                }
            },
            request_response::Event::OutboundFailure {
                request_id, error, ..
            } => {
                if let Some((peer, reply)) = self.pending_manifest.remove(&request_id) {
                    let _ = reply.send(Err(ClientError::ManifestRequest { peer, error }));
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Error, ErrorKind};

    /// A muxer's error the way libp2p-yamux's is: it shows its cause through `source`.
    #[derive(Debug)]
    struct MuxerError(Error);

    impl std::fmt::Display for MuxerError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "i/o error: {}", self.0)
        }
    }

    impl std::error::Error for MuxerError {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_reset_or_a_timeout_under_the_muxer_is_a_lost_connection_and_a_close_is_not() {
        let boxed = |kind: ErrorKind| Error::other(MuxerError(Error::from(kind)));
        assert!(peer_lost_the_connection(&boxed(ErrorKind::ConnectionReset)));
        assert!(peer_lost_the_connection(&boxed(ErrorKind::TimedOut)));
        assert!(peer_lost_the_connection(&boxed(ErrorKind::BrokenPipe)));
        assert!(peer_lost_the_connection(&Error::from(
            ErrorKind::ConnectionReset
        )));
        assert!(!peer_lost_the_connection(&boxed(ErrorKind::UnexpectedEof)));
        assert!(!peer_lost_the_connection(&Error::other(
            "closed by peer: 0"
        )));
        assert!(!peer_lost_the_connection(&Error::from(
            ErrorKind::ConnectionAborted
        )));
    }
}
