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
//! 4. optionally [`JoinedNode::wait_for_topic_peers`] and [`JoinedNode::sync_state`] (a
//!    late joiner);
//! 5. [`JoinedNode::take_part`]: the rounds, then leave the swarm.
//!
//! What is the process's and not the node's stays with the caller: the command line, the
//! logger and the runtime, stdout, the status server, signals, the trainer.

use crate::config::NetworkConfig;
use crate::driver::{DriverOptions, RoundDriver, RoundRecord};
use crate::exchange_service::{ExchangeConfig, ExchangeService};
use crate::manifest_service::verify_manifest_response;
use crate::network::{self, unix_ms, Client, ClientError, Network, NetworkEvent};
use crate::schedule::Timing;
use crate::tensors::{TensorSet, TensorSpec};
use crate::work::{AnchorSpread, RoundWork};
use anyhow::{anyhow, bail};
use gasloc_proto::gate::{judge_against_median, judge_pair, momentum_clip, StateVerdict};
use gasloc_proto::manifest::GateConfig;
use gasloc_proto::{RefusalKind, RunId, RunManifest};
use gasloc_status::{NodeStatus, RefusedPayload, StateSyncReport};
use libp2p::identity::Keypair;
use libp2p::{Multiaddr, PeerId};
use rand::seq::SliceRandom;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// How long a node asks its bootstrap nodes for the run's manifest before it gives up.
const MANIFEST_PATIENCE: Duration = Duration::from_secs(30);

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

/// States a joiner fetches and checks against each other (see [`JoinedNode::sync_state`]).
pub const STATE_SOURCES: usize = 3;
/// Peers a joiner asks for their state at most, when the first ones disagree.
pub const MAX_STATE_PEERS_ASKED: usize = 8;

/// The state a joining node starts from (see [`JoinedNode::sync_state`]).
pub struct SyncedState {
    /// The round the state begins: the latest among the sources kept.
    pub round: u64,
    /// The kept sources' states combined: their median (three or more) or mean (two).
    pub state: TensorSet,
    /// The peers whose states agreed and were combined (one alone: not cross-checked).
    pub sources: Vec<PeerId>,
    /// The states refused, and why.
    pub refused: Vec<RefusedPayload>,
    /// The largest `‖θ_a − θ_b‖ / min(‖θ_a‖, ‖θ_b‖)` between the anchors of two kept
    /// sources (0 for one).
    pub disagreement: f64,
    /// How far each kept source's anchor lies from the anchor the joiner starts from (one
    /// source: none), tensor by tensor: how far apart the swarm's anchors lie, so how far an
    /// honest neighbour's model will lie from this node's. The joiner's payload gate starts
    /// its windows from them, fragment by fragment
    /// ([`RoundWork::load_state`](crate::work::RoundWork::load_state)).
    pub spread: AnchorSpread,
}

impl SyncedState {
    /// The report `/status` keeps.
    pub fn report(&self) -> StateSyncReport {
        StateSyncReport {
            round: self.round,
            sources: self.sources.iter().map(PeerId::to_string).collect(),
            refused: self.refused.clone(),
            disagreement: self.disagreement,
        }
    }
}

/// The prefix of the anchor's tensors in a state (`anchor.<param>`; the outer momentum's
/// are `outer_momentum.<param>`): the state protocol's convention.
pub const STATE_ANCHOR_PREFIX: &str = "anchor.";

fn is_anchor(tensor: &crate::tensors::Tensor) -> bool {
    tensor.name.starts_with(STATE_ANCHOR_PREFIX)
}

/// A finite state one peer served.
struct FetchedState {
    peer: PeerId,
    round: u64,
    state: TensorSet,
}

/// The fetched states measured against each other and judged.
struct Judged {
    verdict: StateVerdict,
    /// `relative[a][b] = ‖θ_a − θ_b‖ / min(‖θ_a‖, ‖θ_b‖)`, the anchors'.
    relative: Vec<Vec<f64>>,
    /// With three sources or more, `‖θ_i − θ_median‖ / ‖θ_median‖`, the measure they are
    /// judged by.
    to_median: Option<Vec<f64>>,
    /// With three sources or more, their coordinate-wise median: when every source is kept,
    /// the state the joiner starts from, not computed twice.
    median: Option<TensorSet>,
    fetched: Vec<FetchedState>,
}

/// Measures the fetched states against each other and judges them, on a blocking thread;
/// hands the states back.
async fn judge_fetched(gate: GateConfig, fetched: Vec<FetchedState>) -> anyhow::Result<Judged> {
    let judged = tokio::task::spawn_blocking(move || {
        let n = fetched.len();
        let norms: Vec<f64> = fetched
            .iter()
            .map(|f| f.state.norm_where(is_anchor))
            .collect();
        for (f, norm) in fetched.iter().zip(&norms) {
            tracing::info!(peer = %f.peer, round = f.round, norm, "state sync: a source's anchor");
        }
        let mut distances = vec![vec![f64::INFINITY; n]; n];
        let mut relative = vec![vec![0.0; n]; n];
        for a in 0..n {
            for b in a + 1..n {
                // Every state was checked against one table: they match.
                let (x, y) = (&fetched[a].state, &fetched[b].state);
                let d = x.distance_where(y, is_anchor).unwrap_or(f64::INFINITY);
                let r = d / norms[a].min(norms[b]);
                tracing::info!(
                    a = %fetched[a].peer,
                    b = %fetched[b].peer,
                    relative = r,
                    "state sync: ‖θ_a − θ_b‖ / min(‖θ_a‖, ‖θ_b‖)"
                );
                (distances[a][b], distances[b][a]) = (d, d);
                (relative[a][b], relative[b][a]) = (r, r);
            }
        }
        let mut to_median_relative = None;
        let mut median_of_all = None;
        let verdict = match n {
            0 => StateVerdict::Split,
            1 => StateVerdict::Unchecked,
            2 => judge_pair(&gate, [norms[0], norms[1]], distances[0][1]),
            _ => {
                // Every state was checked against one table: the median exists.
                let sets: Vec<&TensorSet> = fetched.iter().map(|f| &f.state).collect();
                match TensorSet::median(&sets) {
                    Some(median) => {
                        let to_median: Vec<f64> = fetched
                            .iter()
                            .map(|f| {
                                f.state
                                    .distance_where(&median, is_anchor)
                                    .unwrap_or(f64::INFINITY)
                            })
                            .collect();
                        let median_norm = median.norm_where(is_anchor);
                        tracing::info!(
                            ?to_median,
                            median_norm,
                            "state sync: distances to the median anchor"
                        );
                        to_median_relative =
                            Some(to_median.iter().map(|d| d / median_norm).collect());
                        let verdict = judge_against_median(&gate, median_norm, &to_median);
                        median_of_all = Some(median);
                        verdict
                    }
                    None => StateVerdict::Split,
                }
            }
        };
        Judged {
            verdict,
            relative,
            to_median: to_median_relative,
            median: median_of_all,
            fetched,
        }
    })
    .await?;
    Ok(judged)
}

/// Why a joiner gives up: its sources split and nobody else serves a state.
fn split_error(fetched: &[FetchedState], gate: &GateConfig) -> String {
    let sources: Vec<String> = fetched.iter().map(|f| f.peer.to_string()).collect();
    format!(
        "state sync: the states of {} disagree with each other beyond \
         gate.max_state_disagreement = {}, and no other peer serves one: which to trust \
         cannot be told",
        sources.join(", "),
        gate.max_state_disagreement
    )
}

/// The state a joiner starts from, of the `kept` states, on a blocking thread: three or more,
/// their coordinate-wise median (anchor and outer momentum alike: a source the bound let
/// through moves no coordinate outside the range of the others); two, their mean, each one's
/// outer momentum first clipped to the lower median of their norms ([`momentum_clip`]); one,
/// that state as it is. `median_of_all` is [`Judged::median`]: when every fetched state is
/// kept, it is that median, already made.
async fn start_state_of(
    mut fetched: Vec<FetchedState>,
    kept: Vec<usize>,
    median_of_all: Option<TensorSet>,
    refused: Vec<RefusedPayload>,
    disagreement: f64,
) -> anyhow::Result<SyncedState> {
    tokio::task::spawn_blocking(move || {
        let round = kept.iter().map(|&i| fetched[i].round).max().unwrap_or(0);
        let sources = kept.iter().map(|&i| fetched[i].peer).collect();
        let every_source_kept = kept.len() == fetched.len() && kept.len() >= 3;
        let state = if let (true, Some(median)) = (every_source_kept, median_of_all) {
            median
        } else if let [only] = kept[..] {
            fetched.swap_remove(only).state
        } else if kept.len() >= 3 {
            let sets: Vec<&TensorSet> = kept.iter().map(|&i| &fetched[i].state).collect();
            TensorSet::median(&sets)
                .ok_or_else(|| anyhow!("state sync: the kept states' tables differ"))?
        } else {
            let is_momentum = |t: &crate::tensors::Tensor| !is_anchor(t);
            let norms: Vec<f64> = kept
                .iter()
                .map(|&i| fetched[i].state.norm_where(is_momentum))
                .collect();
            for (&i, factor) in kept.iter().zip(momentum_clip(&norms)) {
                if factor < 1.0 {
                    tracing::info!(peer = %fetched[i].peer, factor, "state sync: outer momentum clipped to the median");
                    fetched[i].state.scale_where(factor, is_momentum);
                }
            }
            let sets: Vec<&TensorSet> = kept.iter().map(|&i| &fetched[i].state).collect();
            TensorSet::mean(&sets)
                .ok_or_else(|| anyhow!("state sync: the kept states' tables differ"))?
        };
        let spread = AnchorSpread {
            by_source: if kept.len() >= 2 {
                kept.iter()
                    .filter_map(|&i| fetched[i].state.distances_by_tensor_where(&state, is_anchor))
                    .collect()
            } else {
                Vec::new()
            },
        };
        Ok(SyncedState {
            round,
            state,
            sources,
            refused,
            disagreement,
            spread,
        })
    })
    .await?
}

/// A state refused at sync, logged once.
fn refuse_state(peer: PeerId, kind: RefusalKind, reason: String) -> RefusedPayload {
    tracing::warn!(%peer, refusal = %kind, "refused the peer's state: {reason}");
    RefusedPayload {
        peer: peer.to_string(),
        kind,
        reason,
        gross: false,
    }
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

    /// The bootstrap nodes it was started with (for an address that named no peer id, the
    /// peer that answered there).
    pub fn bootstrap_peers(&self) -> &[PeerId] {
        &self.network.bootstrap_peers
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
        // 20 asks, for 30 s at most: a dial that hangs (a peer under another swarm key
        // answers nothing sensible) takes the connection timeout, 10 s, each time.
        let give_up = Instant::now() + MANIFEST_PATIENCE;
        for attempt in 0..20 {
            if attempt > 0 && Instant::now() >= give_up {
                break;
            }
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

    /// Closes this node to every peer outside a closed run's allow-list (the manifest's
    /// `[access] peers`, and `bootstrap_peers`); nothing for an open run. An error when this
    /// node is not on the list itself, or the list holds something that is no peer id.
    pub async fn close_run(
        &self,
        manifest: &RunManifest,
        bootstrap_peers: &[PeerId],
    ) -> anyhow::Result<()> {
        let Some(allowed) = crate::access::allowed_peers(&manifest.access, bootstrap_peers)
            .map_err(|e| anyhow!(e))?
        else {
            return Ok(());
        };
        let me = self.peer_id();
        if !allowed.contains(&me) {
            bail!(
                "run {} is closed and this node ({me}) is not on its allow-list \
                 ([access] peers in the manifest)",
                manifest.name
            );
        }
        tracing::info!(
            peers = allowed.len(),
            "closed run: only its allow-list may connect"
        );
        self.network.client.close_run(allowed).await?;
        Ok(())
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

    /// The state a late joiner starts from, fetched from up to [`STATE_SOURCES`] live peers
    /// and checked as untrusted input. Each state is checked against `table` and for NaN
    /// and infinity; the finite ones are measured against each other (torch-free, on the
    /// raw bytes, off the async runtime's threads): three or more against their
    /// coordinate-wise median ([`judge_against_median`]), two against each other
    /// ([`judge_pair`]). The joiner starts from those that agree within
    /// `gate.max_state_disagreement`: their coordinate-wise median (three or more) or their
    /// mean (two, each outer momentum clipped to their median norm, [`momentum_clip`]),
    /// see [`start_state_of`]; when the states split it asks more peers, up to
    /// [`MAX_STATE_PEERS_ASKED`] in all, before giving up with an error. A
    /// single source is taken unchecked (the report says so). `Ok(None)` when nobody
    /// serves a state (a new run: start from the seed). Peers are asked in random order,
    /// outside `exclude` (the bootstrap nodes, which hold none); peers found through
    /// Kademlia subscribe over a few heartbeats, so the topic is watched for up to 20 s.
    pub async fn sync_state(
        &self,
        exclude: &[PeerId],
        table: Arc<Vec<TensorSpec>>,
        gate: &GateConfig,
    ) -> anyhow::Result<Option<SyncedState>> {
        let mut peers = self.state_candidates(exclude, &[]).await;
        peers.truncate(MAX_STATE_PEERS_ASKED);

        let mut fetched: Vec<FetchedState> = Vec::new();
        let mut refused = Vec::new();
        let mut asked = 0;
        let mut wanted = STATE_SOURCES;
        loop {
            while fetched.len() < wanted && asked < peers.len() {
                let batch = &peers[asked..(asked + wanted - fetched.len()).min(peers.len())];
                asked += batch.len();
                let answers = futures::future::join_all(batch.iter().map(|&peer| {
                    let table = table.clone();
                    async move {
                        let answer = self
                            .service
                            .fetch_state(peer, Some(table), Duration::from_secs(120))
                            .await;
                        (peer, answer)
                    }
                }))
                .await;
                // A live node serves the state its last outer step made: for the round in
                // progress or the next (one more for clock skew). The round a peer claims
                // becomes this node's, so a later one is refused like a bad value.
                let latest = self.timing.round_at(unix_ms()).map_or(0, |r| r + 2);
                for (peer, answer) in answers {
                    match answer {
                        Ok((round, _)) if round > latest => refused.push(refuse_state(
                            peer,
                            RefusalKind::FutureRound,
                            format!("state sync: the state claims round {round}, after {latest}"),
                        )),
                        Ok((round, state)) => match state.first_non_finite() {
                            Some(tensor) => refused.push(refuse_state(
                                peer,
                                RefusalKind::NonFinite,
                                format!("state sync: tensor {tensor} holds a NaN or an infinity"),
                            )),
                            None => fetched.push(FetchedState { peer, round, state }),
                        },
                        Err(e) => tracing::info!(%peer, error = %e, "no state from this peer"),
                    }
                }
            }
            if fetched.is_empty() {
                return Ok(None);
            }
            let judged = judge_fetched(gate.clone(), fetched).await?;
            fetched = judged.fetched;
            let relative = judged.relative;
            match judged.verdict {
                StateVerdict::Agreed { kept, outvoted } => {
                    for &i in &outvoted {
                        let reason = match &judged.to_median {
                            Some(to_median) => format!(
                                "state sync: the state's anchor lies {:.3e} of the median's norm \
                                 from the median of the {} sources (beyond \
                                 gate.max_state_disagreement = {})",
                                to_median[i],
                                fetched.len(),
                                gate.max_state_disagreement
                            ),
                            None => format!(
                                "state sync: the state's anchor lies up to {:.3e} of the smaller \
                                 norm from the sources that agree (beyond \
                                 gate.max_state_disagreement = {})",
                                kept.iter().map(|&k| relative[i][k]).fold(0.0, f64::max),
                                gate.max_state_disagreement
                            ),
                        };
                        refused.push(refuse_state(
                            fetched[i].peer,
                            RefusalKind::StateDisagrees,
                            reason,
                        ));
                    }
                    let disagreement = kept
                        .iter()
                        .flat_map(|&a| kept.iter().map(move |&b| (a, b)))
                        .map(|(a, b)| relative[a][b])
                        .fold(0.0, f64::max);
                    return Ok(Some(
                        start_state_of(fetched, kept, judged.median, refused, disagreement).await?,
                    ));
                }
                StateVerdict::Unchecked => {
                    tracing::warn!(
                        peer = %fetched[0].peer,
                        "state sync: one source only; its state is not cross-checked"
                    );
                    return Ok(Some(
                        start_state_of(fetched, vec![0], None, refused, 0.0).await?,
                    ));
                }
                StateVerdict::Split => {
                    if asked == peers.len() && peers.len() < MAX_STATE_PEERS_ASKED {
                        // Peers that subscribed since, to break the tie.
                        let more = self.state_candidates(exclude, &peers).await;
                        peers.extend(more);
                        peers.truncate(MAX_STATE_PEERS_ASKED);
                    }
                    if asked == peers.len() {
                        bail!(split_error(&fetched, gate));
                    }
                    wanted = fetched.len() + 1;
                }
            }
        }
    }

    /// Topic peers to ask for their state, outside `exclude` and `known`, in random order.
    /// Peers found through Kademlia subscribe over a few heartbeats: the topic is watched
    /// until [`STATE_SOURCES`] are there, or for 5 s once there is one, or for 20 s.
    async fn state_candidates(&self, exclude: &[PeerId], known: &[PeerId]) -> Vec<PeerId> {
        let started = std::time::Instant::now();
        let mut peers = Vec::new();
        while started.elapsed() < Duration::from_secs(20) {
            peers = self.client.topic_peers().await.unwrap_or_default();
            peers.retain(|p| !exclude.contains(p) && !known.contains(p));
            let enough = known.len() + peers.len() >= STATE_SOURCES;
            if enough || (!peers.is_empty() && started.elapsed() >= Duration::from_secs(5)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        peers.shuffle(&mut rand::rng());
        peers
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
