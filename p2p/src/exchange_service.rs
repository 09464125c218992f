//! The exchange and state-sync services on a live swarm: `/gasloc/exchange/2` and
//! `/gasloc/state/1`.
//!
//! [`ExchangeService::exchange_round`] swaps payloads with a round's neighbours: for each
//! pair the peer with the smaller peer id (by bytes) opens the stream and the other accepts
//! it, so exactly one stream carries both directions. The accept loops only hand each
//! inbound stream to a task bounded by a semaphore (libp2p-stream drops inbound streams
//! when the accept loop is slow). Inbound streams are matched against the rounds this node
//! has registered; anything else is refused with a reason and logged.

use crate::exchange::{
    check_header, check_state_request, read_checked_header, read_first_frame, receive_tensors,
    refuse, run_initiator, run_responder, send_payload, write_state_request, ExchangeError,
    ExchangeLimits, Expectation, FirstFrame, OutgoingPayload,
};
use crate::tensors::{TensorSet, TensorSpec};
use futures::{AsyncWriteExt, StreamExt};
use gasloc_proto::wire::{PayloadKind, Refusal, RefusalReason};
use gasloc_proto::RunId;
use libp2p::{PeerId, Stream, StreamProtocol};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{broadcast, oneshot, Notify, Semaphore};
use tokio::time::Instant;

pub const EXCHANGE_PROTOCOL: StreamProtocol = StreamProtocol::new("/gasloc/exchange/2");
pub const STATE_PROTOCOL: StreamProtocol = StreamProtocol::new("/gasloc/state/1");

/// Settings of the exchange service.
#[derive(Debug, Clone)]
pub struct ExchangeConfig {
    pub run_id: RunId,
    pub limits: ExchangeLimits,
    /// Inbound streams handled at once; more are dropped.
    pub max_inbound: usize,
    /// Time a peer has to send its first frame.
    pub header_timeout: Duration,
    /// How long an inbound stream for the next round waits for this node to reach it.
    pub accept_wait: Duration,
}

impl ExchangeConfig {
    pub fn new(run_id: RunId) -> Self {
        ExchangeConfig {
            run_id,
            limits: ExchangeLimits::default(),
            max_inbound: 16,
            header_timeout: Duration::from_secs(10),
            accept_wait: Duration::from_secs(30),
        }
    }
}

/// What happened to one inbound stream (for logs, status and tests).
#[derive(Debug, Clone)]
pub struct InboundReport {
    pub peer: PeerId,
    pub protocol: &'static str,
    pub round: Option<u64>,
    /// `Ok(bytes received)` or the reason it was refused or failed.
    pub outcome: Result<u64, String>,
}

/// A neighbour's payload, verified, and how long the link took to swap it.
#[derive(Debug)]
pub struct Swapped {
    pub tensors: TensorSet,
    /// From the moment both sides were ready (the later of this node starting the round's
    /// exchange and the neighbour's header arriving: each side sends its header once its
    /// payload is ready) until both directions were done. Unlike the exchange's whole
    /// duration it holds no wait for a neighbour still training, so it measures the link.
    pub transfer: Duration,
}

/// What `exchange_round` returns: per neighbour, its payload or the reason there is none.
pub type ExchangeResults = Vec<(PeerId, Result<Swapped, ExchangeError>)>;

/// A round registered with an [`ExchangeService`] ([`ExchangeService::register_round`]) whose
/// swaps are still to run: pass it to [`ExchangeService::exchange_registered`], which also
/// closes the round (until then it stays registered).
pub struct RegisteredRound {
    round: u64,
    neighbours: Vec<PeerId>,
    payload: Arc<OutgoingPayload>,
    table: Option<Arc<Vec<TensorSpec>>>,
    timeout: Duration,
    deadline: Instant,
    receivers: HashMap<PeerId, oneshot::Receiver<Result<Swapped, ExchangeError>>>,
}

struct RoundSlot {
    neighbours: HashSet<PeerId>,
    payload: Arc<OutgoingPayload>,
    table: Option<Arc<Vec<TensorSpec>>>,
    /// When this node registered the round (its payload was ready).
    started: Instant,
    deadline: Instant,
    waiting: HashMap<PeerId, oneshot::Sender<Result<Swapped, ExchangeError>>>,
}

/// How many ended rounds [`ServiceState::closed`] remembers.
const CLOSED_ROUNDS_KEPT: usize = 8;

#[derive(Default)]
struct ServiceState {
    /// Rounds below this are over: their streams are refused as old.
    floor: u64,
    /// Whether this node has told the service where it is (a floor or a round). Before
    /// that, a stream for any round waits for the round to be registered.
    positioned: bool,
    rounds: HashMap<u64, RoundSlot>,
    /// The last few rounds whose exchange ended here, newest last: a stream for one of them
    /// is late ([`ExchangeError::RoundClosed`]), not a replay of an old round.
    closed: VecDeque<u64>,
    state: Option<(u64, Arc<OutgoingPayload>)>,
    /// A state request found no fresh state: the next outer step should make one.
    state_wanted: bool,
}

struct Inner {
    me: PeerId,
    config: ExchangeConfig,
    control: libp2p_stream::Control,
    state: Mutex<ServiceState>,
    changed: Notify,
    reports: broadcast::Sender<InboundReport>,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for task in self.tasks.lock().map(|t| t.clone()).unwrap_or_default() {
            task.abort();
        }
    }
}

/// A handle to the running exchange and state-sync service.
#[derive(Clone)]
pub struct ExchangeService {
    inner: Arc<Inner>,
}

impl ExchangeService {
    /// Registers both protocols on the swarm behind `control` and spawns their accept loops.
    pub fn start(
        me: PeerId,
        mut control: libp2p_stream::Control,
        config: ExchangeConfig,
    ) -> anyhow::Result<Self> {
        let exchange_incoming = control
            .accept(EXCHANGE_PROTOCOL)
            .map_err(|e| anyhow::anyhow!("{EXCHANGE_PROTOCOL}: {e}"))?;
        let state_incoming = control
            .accept(STATE_PROTOCOL)
            .map_err(|e| anyhow::anyhow!("{STATE_PROTOCOL}: {e}"))?;
        let (reports, _) = broadcast::channel(1024);
        let inner = Arc::new(Inner {
            me,
            config,
            control,
            state: Mutex::new(ServiceState::default()),
            changed: Notify::new(),
            reports,
            tasks: Mutex::new(Vec::new()),
        });
        let weak = Arc::downgrade(&inner);
        let exchange_loop = tokio::spawn(accept_loop(weak.clone(), exchange_incoming, false));
        let state_loop = tokio::spawn(accept_loop(weak, state_incoming, true));
        inner
            .tasks
            .lock()
            .expect("fresh mutex")
            .extend([exchange_loop.abort_handle(), state_loop.abort_handle()]);
        Ok(ExchangeService { inner })
    }

    /// Reports of every inbound stream from now on.
    pub fn reports(&self) -> broadcast::Receiver<InboundReport> {
        self.inner.reports.subscribe()
    }

    /// Streams for rounds below `round` are refused as old from now on — except for a round
    /// whose exchange is still registered (an overlapped round exchanging while the next one
    /// trains) — and streams for rounds more than one ahead of the newest known round as
    /// future (the round driver calls this when it starts a round).
    pub fn advance_floor(&self, round: u64) {
        let mut st = self.inner.state.lock().expect("exchange state lock");
        st.floor = st.floor.max(round);
        st.positioned = true;
        drop(st);
        self.inner.changed.notify_waiters();
    }

    /// Whether `round` is registered by an `exchange_round` in progress.
    pub fn is_registered(&self, round: u64) -> bool {
        self.inner
            .state
            .lock()
            .expect("exchange state lock")
            .rounds
            .contains_key(&round)
    }

    /// Publishes this node's current state (anchor + outer momentum) for state sync: the
    /// state `round` begins from. Requests waiting for a fresh state get it.
    pub fn set_state(&self, round: u64, payload: Arc<OutgoingPayload>) {
        let mut st = self.inner.state.lock().expect("exchange state lock");
        st.state = Some((round, payload));
        st.state_wanted = false;
        drop(st);
        self.inner.changed.notify_waiters();
    }

    /// Whether a state request arrived that no fresh state could answer (and forgets it):
    /// the state is made on request, by the next outer step, not every round.
    pub fn take_state_wanted(&self) -> bool {
        std::mem::take(
            &mut self
                .inner
                .state
                .lock()
                .expect("exchange state lock")
                .state_wanted,
        )
    }

    /// Swaps `payload` with every neighbour of `round`. Each result is the neighbour's
    /// verified tensors or the reason there are none; the call returns within `timeout`.
    pub async fn exchange_round(
        &self,
        round: u64,
        neighbours: &[PeerId],
        payload: Arc<OutgoingPayload>,
        table: Option<Arc<Vec<TensorSpec>>>,
        timeout: Duration,
    ) -> ExchangeResults {
        let registered = self.register_round(round, neighbours, payload, table, timeout);
        self.exchange_registered(registered).await
    }

    /// The first half of [`Self::exchange_round`], done at once: registers `round`, so that
    /// from now on its neighbours' streams are answered — also after [`Self::advance_floor`]
    /// passes it, as it does when an overlapped node starts its next round right after the
    /// hand-off, before the exchange's task has run. The timeout counts from here.
    pub fn register_round(
        &self,
        round: u64,
        neighbours: &[PeerId],
        payload: Arc<OutgoingPayload>,
        table: Option<Arc<Vec<TensorSpec>>>,
        timeout: Duration,
    ) -> RegisteredRound {
        let started = Instant::now();
        let deadline = started + timeout;
        let me_bytes = self.inner.me.to_bytes();
        let mut receivers = HashMap::new();
        {
            let mut st = self.inner.state.lock().expect("exchange state lock");
            st.positioned = true;
            let mut waiting = HashMap::new();
            for peer in neighbours {
                if peer.to_bytes() > me_bytes {
                    continue; // we open this one
                }
                let (tx, rx) = oneshot::channel();
                waiting.insert(*peer, tx);
                receivers.insert(*peer, rx);
            }
            st.rounds.insert(
                round,
                RoundSlot {
                    neighbours: neighbours.iter().copied().collect(),
                    payload: payload.clone(),
                    table: table.clone(),
                    started,
                    deadline,
                    waiting,
                },
            );
        }
        self.inner.changed.notify_waiters();
        RegisteredRound {
            round,
            neighbours: neighbours.to_vec(),
            payload,
            table,
            timeout,
            deadline,
            receivers,
        }
    }

    /// The second half of [`Self::exchange_round`]: waits for the neighbours that open their
    /// streams to this node and opens the others', until the round's deadline.
    pub async fn exchange_registered(&self, registered: RegisteredRound) -> ExchangeResults {
        let RegisteredRound {
            round,
            neighbours,
            payload,
            table,
            timeout,
            deadline,
            mut receivers,
        } = registered;
        let jobs = neighbours.iter().map(|peer| {
            let peer = *peer;
            let receiver = receivers.remove(&peer);
            let payload = payload.clone();
            let table = table.clone();
            async move {
                let result = match receiver {
                    Some(rx) => match tokio::time::timeout_at(deadline, rx).await {
                        Ok(Ok(result)) => result,
                        Ok(Err(_)) => Err(ExchangeError::Cancelled("inbound handler ended".into())),
                        Err(_) => Err(ExchangeError::Deadline(timeout)),
                    },
                    None => tokio::time::timeout_at(
                        deadline,
                        self.initiate(peer, round, &payload, table),
                    )
                    .await
                    .unwrap_or(Err(ExchangeError::Deadline(timeout))),
                };
                if let Err(e) = &result {
                    tracing::warn!(%peer, round, error = %e, "exchange with neighbour failed");
                }
                (peer, result)
            }
        });
        let results = futures::future::join_all(jobs).await;
        {
            let mut st = self.inner.state.lock().expect("exchange state lock");
            st.rounds.remove(&round);
            st.closed.push_back(round);
            while st.closed.len() > CLOSED_ROUNDS_KEPT {
                st.closed.pop_front();
            }
            st.floor = st.floor.max(round + 1);
        }
        self.inner.changed.notify_waiters();
        results
    }

    async fn initiate(
        &self,
        peer: PeerId,
        round: u64,
        payload: &OutgoingPayload,
        table: Option<Arc<Vec<TensorSpec>>>,
    ) -> Result<Swapped, ExchangeError> {
        let cfg = &self.inner.config;
        let header = payload.header(&cfg.run_id, round, &self.inner.me);
        let expect = Expectation {
            run_id: cfg.run_id,
            round: Some(round),
            sender: peer,
            kind: payload.kind,
            table,
        };
        let mut delay = Duration::from_millis(50);
        loop {
            let stream = self.open(peer, EXCHANGE_PROTOCOL).await?;
            match run_initiator(stream, &header, payload, &expect, &cfg.limits).await {
                // The stream ended before the peer's header: libp2p-stream hands inbound
                // streams over through a channel of one, and drops a stream that arrives
                // while another (from this round's other neighbour) is still being handed
                // over. The peer never saw this one: open another (the caller's deadline
                // bounds the retries).
                Err(ExchangeError::Truncated("header")) => {
                    tracing::debug!(%peer, round, "stream dropped before the header; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_millis(800));
                }
                // The responder's header came once both sides were ready (this node
                // opened the stream when its payload was).
                Ok((tensors, header_at)) => {
                    return Ok(Swapped {
                        tensors,
                        transfer: header_at.elapsed(),
                    })
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Opens a stream, retrying dial failures (addresses may still be being discovered)
    /// until the caller's deadline cancels it.
    async fn open(&self, peer: PeerId, protocol: StreamProtocol) -> Result<Stream, ExchangeError> {
        let mut control = self.inner.control.clone();
        let mut delay = Duration::from_millis(100);
        loop {
            match control.open_stream(peer, protocol.clone()).await {
                Ok(stream) => return Ok(stream),
                Err(libp2p_stream::OpenStreamError::UnsupportedProtocol(p)) => {
                    return Err(ExchangeError::Open(format!("peer does not speak {p}")))
                }
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "opening stream failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// Fetches the current state (anchor + outer momentum) from `peer`. Returns the round it
    /// belongs to and the verified tensors.
    pub async fn fetch_state(
        &self,
        peer: PeerId,
        table: Option<Arc<Vec<TensorSpec>>>,
        timeout: Duration,
    ) -> Result<(u64, TensorSet), ExchangeError> {
        let work = async {
            let mut stream = self.open(peer, STATE_PROTOCOL).await?;
            let cfg = &self.inner.config;
            write_state_request(&mut stream, &cfg.run_id).await?;
            let expect = Expectation {
                run_id: cfg.run_id,
                round: None,
                sender: peer,
                kind: PayloadKind::State,
                table,
            };
            let header = read_checked_header(&mut stream, &expect, &cfg.limits).await?;
            let set = receive_tensors(&mut stream, &header).await?;
            Ok((header.round, set))
        };
        tokio::time::timeout(timeout, work)
            .await
            .unwrap_or(Err(ExchangeError::Deadline(timeout)))
    }
}

async fn accept_loop(
    inner: std::sync::Weak<Inner>,
    mut incoming: libp2p_stream::IncomingStreams,
    state: bool,
) {
    let permits = match inner.upgrade() {
        Some(i) => Arc::new(Semaphore::new(i.config.max_inbound)),
        None => return,
    };
    while let Some((peer, stream)) = incoming.next().await {
        let Some(inner) = inner.upgrade() else { return };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "too many inbound streams; dropping one");
            continue;
        };
        tokio::spawn(async move {
            let _permit = permit;
            let report = if state {
                handle_state_request(&inner, peer, stream).await
            } else {
                handle_exchange(&inner, peer, stream).await
            };
            if let Err(reason) = &report.outcome {
                tracing::warn!(%peer, protocol = report.protocol, round = ?report.round, %reason, "inbound stream refused or failed");
            }
            let _ = inner.reports.send(report);
        });
    }
}

/// An inbound stream's place in a registered round: where its result goes and what to
/// answer with.
struct ClaimedSlot {
    reply: oneshot::Sender<Result<Swapped, ExchangeError>>,
    payload: Arc<OutgoingPayload>,
    table: Option<Arc<Vec<TensorSpec>>>,
    started: Instant,
    deadline: Instant,
}

/// Finds (or waits for) the round slot for an inbound stream and takes its reply channel.
async fn claim_slot(inner: &Inner, peer: PeerId, round: u64) -> Result<ClaimedSlot, ExchangeError> {
    let give_up = Instant::now() + inner.config.accept_wait;
    loop {
        let notified = inner.changed.notified();
        {
            let mut st = inner.state.lock().expect("exchange state lock");
            // A registered round is served even below the floor: with overlapped rounds the
            // node starts round t+1 (raising the floor) while round t's exchange runs.
            if round < st.floor && !st.rounds.contains_key(&round) {
                if st.closed.contains(&round) {
                    return Err(ExchangeError::RoundClosed { round });
                }
                return Err(ExchangeError::OldRound {
                    got: round,
                    expected: st.floor,
                });
            }
            if let Some(slot) = st.rounds.get_mut(&round) {
                if !slot.neighbours.contains(&peer) {
                    return Err(ExchangeError::NotANeighbour { peer, round });
                }
                return match slot.waiting.remove(&peer) {
                    Some(reply) => Ok(ClaimedSlot {
                        reply,
                        payload: slot.payload.clone(),
                        table: slot.table.clone(),
                        started: slot.started,
                        deadline: slot.deadline,
                    }),
                    None => Err(ExchangeError::Malformed {
                        what: "stream",
                        detail: format!("a second stream, or a stream this node should have opened, for round {round}"),
                    }),
                };
            }
            let newest = st
                .rounds
                .keys()
                .max()
                .copied()
                .unwrap_or(st.floor)
                .max(st.floor);
            if st.positioned && round > newest + 1 {
                return Err(ExchangeError::FutureRound {
                    got: round,
                    expected: newest,
                });
            }
        }
        if tokio::time::timeout_at(give_up, notified).await.is_err() {
            return Err(ExchangeError::NotANeighbour { peer, round });
        }
    }
}

async fn handle_exchange(inner: &Inner, peer: PeerId, mut stream: Stream) -> InboundReport {
    let cfg = &inner.config;
    let mut report = InboundReport {
        peer,
        protocol: "exchange",
        round: None,
        outcome: Err(String::new()),
    };
    let first = read_first_frame_in_time(&mut stream, cfg).await;
    let header_at = Instant::now();
    let header = match first {
        Ok(FirstFrame::Header(h)) => h,
        Ok(_) => {
            return refuse_and_report(stream, report, ExchangeError::UnexpectedFrame(0)).await;
        }
        Err(e) => return refuse_and_report(stream, report, e).await,
    };
    report.round = Some(header.round);
    if header.run_id != cfg.run_id.as_bytes() {
        let e = ExchangeError::WrongRun {
            got: hex::encode(&header.run_id),
        };
        return refuse_and_report(stream, report, e).await;
    }
    let ClaimedSlot {
        reply,
        payload,
        table,
        started,
        deadline,
    } = match claim_slot(inner, peer, header.round).await {
        Ok(slot) => slot,
        Err(e) => return refuse_and_report(stream, report, e).await,
    };
    let expect = Expectation {
        run_id: cfg.run_id,
        round: Some(header.round),
        sender: peer,
        kind: payload.kind,
        table,
    };
    if let Err(e) = check_header(&header, &expect, &cfg.limits) {
        report.outcome = Err(e.to_string());
        if let Some(refusal) = e.refusal() {
            let _ = refuse(&mut stream, &refusal).await;
        }
        let _ = reply.send(Err(e));
        return report;
    }
    let my_header = payload.header(&cfg.run_id, header.round, &inner.me);
    let result = tokio::time::timeout_at(
        deadline,
        run_responder(stream, &header, &my_header, &payload),
    )
    .await
    .unwrap_or(Err(ExchangeError::Deadline(
        deadline.saturating_duration_since(Instant::now()),
    )));
    report.outcome = match &result {
        Ok(set) => Ok(set.byte_length()),
        Err(e) => Err(e.to_string()),
    };
    let both_ready = header_at.max(started);
    let result = result.map(|tensors| Swapped {
        tensors,
        transfer: both_ready.elapsed(),
    });
    let _ = reply.send(result);
    report
}

/// How long a state request waits for the next outer step to make a fresh state.
const STATE_WAIT: Duration = Duration::from_secs(90);

/// The state to serve: a fresh one (for the round in progress or the next), else — the node
/// makes its state only when asked — the one the next outer step makes, waited for up to
/// [`STATE_WAIT`]; after that the newest there is, if any. A node not taking part in rounds
/// yet (it has no position) will make none: it answers at once.
async fn fresh_state(inner: &Inner) -> Option<(u64, Arc<OutgoingPayload>)> {
    let deadline = tokio::time::Instant::now() + STATE_WAIT;
    loop {
        let changed = inner.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        {
            let mut st = inner.state.lock().expect("exchange state lock");
            let floor = st.floor;
            match &st.state {
                Some((round, payload)) if *round >= floor => {
                    return Some((*round, payload.clone()))
                }
                stale => {
                    if !st.positioned || tokio::time::Instant::now() >= deadline {
                        return stale.clone();
                    }
                }
            }
            st.state_wanted = true;
        }
        let _ = tokio::time::timeout_at(deadline, changed).await;
    }
}

async fn handle_state_request(inner: &Inner, peer: PeerId, mut stream: Stream) -> InboundReport {
    let cfg = &inner.config;
    let report = InboundReport {
        peer,
        protocol: "state",
        round: None,
        outcome: Err(String::new()),
    };
    let first = read_first_frame_in_time(&mut stream, cfg).await;
    if let Err(e) = first.and_then(|first| check_state_request(first, &cfg.run_id)) {
        return refuse_and_report(stream, report, e).await;
    }
    let Some((round, payload)) = fresh_state(inner).await else {
        let mut report = report;
        let refusal = Refusal {
            reason: RefusalReason::NoState as i32,
            message: "this node has no state to share yet".into(),
        };
        let _ = refuse(&mut stream, &refusal).await;
        report.outcome = Err(refusal.message);
        return report;
    };
    let header = payload.header(&cfg.run_id, round, &inner.me);
    let sent = async {
        let n = send_payload(&mut stream, &header, &payload).await?;
        stream.close().await?;
        Ok::<u64, ExchangeError>(n)
    }
    .await;
    InboundReport {
        round: Some(round),
        outcome: sent.map_err(|e| e.to_string()),
        ..report
    }
}

/// The first frame of an inbound stream, within the configured header timeout.
async fn read_first_frame_in_time(
    stream: &mut Stream,
    cfg: &ExchangeConfig,
) -> Result<FirstFrame, ExchangeError> {
    tokio::time::timeout(cfg.header_timeout, read_first_frame(stream, &cfg.limits))
        .await
        .unwrap_or(Err(ExchangeError::Deadline(cfg.header_timeout)))
}

async fn refuse_and_report(
    mut stream: Stream,
    mut report: InboundReport,
    e: ExchangeError,
) -> InboundReport {
    if let Some(refusal) = e.refusal() {
        let _ = refuse(&mut stream, &refusal).await;
    }
    report.outcome = Err(e.to_string());
    report
}
