//! `RunAccess`: who may connect to this node at all — everyone (an open run), or only the
//! peers on a closed run's allow-list (the manifest's `[access] peers`, so part of the run
//! id).
//!
//! A libp2p behaviour that owns no protocol: it decides at the connection level, for QUIC,
//! TCP and relayed connections alike, before any other behaviour sees the peer. A peer not on
//! the list cannot connect, so it cannot gossip, exchange or fetch state with this node.
//! A node learns the list only from the manifest it fetches from a bootstrap node, so the
//! access can be closed while the swarm runs ([`RunAccess::close`]): connections of peers
//! not on the list are then closed at once. (This node's bans are the separate
//! `allow_block_list` behaviour: see `peer_standing`.)

use libp2p::core::transport::PortUse;
use libp2p::core::Endpoint;
use libp2p::swarm::{
    dummy, CloseConnection, ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler,
    THandlerInEvent, THandlerOutEvent, ToSwarm,
};
use libp2p::{Multiaddr, PeerId};
use std::collections::{HashSet, VecDeque};
use std::convert::Infallible;
use std::fmt;
use std::task::{Context, Poll, Waker};

/// The peers a closed run allows: the manifest's `[access] peers` and `also` (the bootstrap
/// nodes this node was given, which need not be listed). `None` for an open run; an error
/// naming an entry that is not a peer id.
pub fn allowed_peers(
    access: &gasloc_proto::manifest::AccessConfig,
    also: &[PeerId],
) -> Result<Option<HashSet<PeerId>>, String> {
    if access.is_open() {
        return Ok(None);
    }
    let mut allowed: HashSet<PeerId> = also.iter().copied().collect();
    for entry in &access.peers {
        let peer = entry
            .parse::<PeerId>()
            .map_err(|e| format!("access.peers: {entry:?} is not a peer id: {e}"))?;
        allowed.insert(peer);
    }
    Ok(Some(allowed))
}

/// Why a connection was denied: the peer is not on the run's allow-list.
#[derive(Debug)]
pub struct NotOnAllowList {
    pub peer: PeerId,
}

impl fmt::Display for NotOnAllowList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer {} is not on the run's allow-list", self.peer)
    }
}

impl std::error::Error for NotOnAllowList {}

/// The behaviour (see the module doc).
#[derive(Default)]
pub struct RunAccess {
    /// `None`: an open run.
    allowed: Option<HashSet<PeerId>>,
    connected: HashSet<PeerId>,
    to_close: VecDeque<PeerId>,
    waker: Option<Waker>,
}

impl RunAccess {
    /// Access for a run: open when `allowed` is `None`.
    pub fn new(allowed: Option<HashSet<PeerId>>) -> Self {
        RunAccess {
            allowed,
            ..Default::default()
        }
    }

    /// Closes the run to every peer outside `allowed`, closing their open connections.
    pub fn close(&mut self, allowed: HashSet<PeerId>) {
        self.to_close
            .extend(self.connected.iter().filter(|p| !allowed.contains(p)));
        self.allowed = Some(allowed);
        if let Some(waker) = self.waker.take() {
            waker.wake();
        }
    }

    pub fn is_closed(&self) -> bool {
        self.allowed.is_some()
    }

    fn enforce(&self, peer: &PeerId) -> Result<(), ConnectionDenied> {
        match &self.allowed {
            Some(allowed) if !allowed.contains(peer) => {
                Err(ConnectionDenied::new(NotOnAllowList { peer: *peer }))
            }
            _ => Ok(()),
        }
    }
}

impl NetworkBehaviour for RunAccess {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_established_inbound_connection(
        &mut self,
        _: ConnectionId,
        peer: PeerId,
        _: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.enforce(&peer)?;
        Ok(dummy::ConnectionHandler)
    }

    fn handle_pending_outbound_connection(
        &mut self,
        _: ConnectionId,
        peer: Option<PeerId>,
        _: &[Multiaddr],
        _: Endpoint,
    ) -> Result<Vec<Multiaddr>, ConnectionDenied> {
        if let Some(peer) = peer {
            self.enforce(&peer)?;
        }
        Ok(vec![])
    }

    fn handle_established_outbound_connection(
        &mut self,
        _: ConnectionId,
        peer: PeerId,
        _: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.enforce(&peer)?;
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            FromSwarm::ConnectionEstablished(e) => {
                self.connected.insert(e.peer_id);
            }
            FromSwarm::ConnectionClosed(e) if e.remaining_established == 0 => {
                self.connected.remove(&e.peer_id);
            }
            _ => {}
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _: PeerId,
        _: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        if let Some(peer) = self.to_close.pop_front() {
            return Poll::Ready(ToSwarm::CloseConnection {
                peer_id: peer,
                connection: CloseConnection::All,
            });
        }
        self.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}
