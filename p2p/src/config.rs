//! Network settings: listen and bootstrap addresses, transport windows, timeouts and limits.
//!
//! Defaults are chosen to survive minutes of local training between exchanges: the swarm
//! keeps idle connections for 10 minutes and QUIC keeps connections alive with 5 s pings
//! inside a 30 s idle timeout. The idle timeout is also how long a crashed peer's
//! connection lingers: a node that crashes and comes back sooner is reconnected then
//! (`network::EventLoop::on_connection_lost_by_peer`), well inside the minute a joining
//! node waits for the run's topic.

use libp2p::multiaddr::Protocol;
use libp2p::pnet::PreSharedKey;
use libp2p::{Multiaddr, PeerId};
use std::net::Ipv4Addr;
use std::time::Duration;

/// What a swarm is for: a volunteer node or an always-on bootstrap node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Relay client + DCUtR; Kademlia mode from `kad_server`.
    Node,
    /// Kademlia server, relay server, AutoNAT server, manifest server.
    Bootstrap,
}

/// The listen addresses when none are given: QUIC and TCP on all interfaces at `port` (0:
/// any free one), or TCP alone in a private swarm (`private`: a swarm key protects TCP
/// only, see `swarm_key`).
pub fn default_listen(port: u16, private: bool) -> Vec<Multiaddr> {
    let any = Multiaddr::empty().with(Protocol::Ip4(Ipv4Addr::UNSPECIFIED));
    let tcp = any.clone().with(Protocol::Tcp(port));
    if private {
        return vec![tcp];
    }
    let quic = any.with(Protocol::Udp(port)).with(Protocol::QuicV1);
    vec![quic, tcp]
}

/// Everything `build_swarm` and the event loop need to know.
#[derive(Debug, Clone)]
pub struct NetworkConfig {
    pub role: Role,
    pub listen: Vec<Multiaddr>,
    pub bootstrap: Vec<Multiaddr>,
    /// How long a bootstrap address without `/p2p/<id>` is dialled (once a second) before
    /// starting fails naming it: the bootstrap may be a container starting beside this one.
    pub bootstrap_dial_patience: Duration,
    /// Discover peers on the LAN with mDNS.
    pub mdns: bool,
    /// Listen through a relay circuit on each bootstrap node from the start, for a node that
    /// others cannot dial (behind NAT or a firewall): peers reach it through the bootstrap's
    /// relay, and DCUtR then tries a direct connection. Without it a node still does so
    /// once AutoNAT finds it private.
    pub relay_listen: bool,
    /// AutoNAT also works on private and loopback addresses (10/8, 192.168/16, …): as a
    /// client it asks to be dialled back there, as a server it dials back a peer seen at one.
    /// Off by default (libp2p's default): on the internet, a verdict about a private address
    /// says nothing. For swarms inside one private network and networks built for tests.
    pub autonat_private_ips: bool,
    /// Run Kademlia in server mode (answer queries, enter others' routing tables). Turn off
    /// for nodes that are not reachable from outside; a node that AutoNAT finds private
    /// switches to client mode by itself.
    pub kad_server: bool,
    /// How often Kademlia re-runs its bootstrap query (discovers new members).
    pub discovery_interval: Duration,
    /// Swarm: how long a connection without streams stays open.
    pub idle_connection_timeout: Duration,
    pub quic_max_idle_timeout: Duration,
    pub quic_keep_alive_interval: Duration,
    pub quic_max_stream_data: u32,
    pub quic_max_connection_data: u32,
    pub max_established_connections: u32,
    pub max_connections_per_peer: u32,
    pub max_pending_connections: u32,
    /// New connections are refused above this fraction of system memory in use by the process.
    pub max_memory_fraction: f64,
    pub gossip_heartbeat: Duration,
    /// The control plane's cap on one message's data (checked by its validator).
    pub control_max_bytes: usize,
    /// Gossipsub `max_transmit_size`: the cap on one RPC frame, which batches messages and
    /// gossip (IHAVE / IWANT / IDONTWANT lists of message ids). A frame above it is
    /// undecodable and its stream is dropped with every message in it, so it must be far
    /// above `control_max_bytes` (a swarm of n nodes gossips about 3·n ids per round).
    pub gossip_max_frame_bytes: usize,
    /// A closed run's allow-list (`access.rs`): only these peers may connect. `None`: open
    /// (a node learns the list with the manifest and closes its access then).
    pub allowed_peers: Option<std::collections::HashSet<PeerId>>,
    /// A private swarm's pre-shared key (`swarm_key.rs`, libp2p `pnet`): every connection
    /// starts with a handshake under it, so only peers holding the same key connect at all.
    /// TCP only: with a key the swarm has no QUIC transport, and `build_swarm` refuses
    /// listen and bootstrap addresses that are not TCP. (Its `Debug` shows only the key's
    /// fingerprint.)
    pub swarm_key: Option<PreSharedKey>,
    /// Control messages accepted per peer within `control_rate_window`.
    pub control_rate_burst: u32,
    pub control_rate_window: Duration,
    /// Relay server limits (bootstrap role).
    pub relay_max_circuits: usize,
    pub relay_max_circuit_bytes: u64,
    pub relay_max_circuit_duration: Duration,
}

impl NetworkConfig {
    pub fn new(role: Role) -> Self {
        NetworkConfig {
            role,
            listen: Vec::new(),
            bootstrap: Vec::new(),
            bootstrap_dial_patience: Duration::from_secs(30),
            mdns: false,
            relay_listen: false,
            autonat_private_ips: false,
            kad_server: true,
            discovery_interval: Duration::from_secs(30),
            idle_connection_timeout: Duration::from_secs(600),
            quic_max_idle_timeout: Duration::from_secs(30),
            quic_keep_alive_interval: Duration::from_secs(5),
            quic_max_stream_data: 32 << 20,
            quic_max_connection_data: 64 << 20,
            max_established_connections: 512,
            max_connections_per_peer: 4,
            max_pending_connections: 128,
            max_memory_fraction: 0.95,
            gossip_heartbeat: Duration::from_millis(500),
            control_max_bytes: 4096,
            gossip_max_frame_bytes: 1 << 20,
            allowed_peers: None,
            swarm_key: None,
            control_rate_burst: 64,
            control_rate_window: Duration::from_secs(10),
            relay_max_circuits: 64,
            relay_max_circuit_bytes: 0,
            relay_max_circuit_duration: Duration::from_secs(3600),
        }
    }

    /// Checks values a user can get wrong; the error names the setting.
    pub fn validate(&self) -> Result<(), String> {
        if self.quic_keep_alive_interval >= self.quic_max_idle_timeout {
            return Err(format!(
                "QUIC keep-alive interval {:?} must be shorter than the idle timeout {:?}",
                self.quic_keep_alive_interval, self.quic_max_idle_timeout
            ));
        }
        if !(0.0..=1.0).contains(&self.max_memory_fraction) || self.max_memory_fraction == 0.0 {
            return Err(format!(
                "max memory fraction {} must be in (0, 1]",
                self.max_memory_fraction
            ));
        }
        if self.control_max_bytes < 128 {
            return Err("control message cap below 128 bytes".into());
        }
        if self.gossip_max_frame_bytes < 16 * self.control_max_bytes {
            return Err(format!(
                "gossip frame cap {} bytes must be at least 16 control messages ({} bytes)",
                self.gossip_max_frame_bytes,
                16 * self.control_max_bytes
            ));
        }
        if self.listen.is_empty() {
            return Err("no listen address".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gossip_frame_cap_near_the_message_cap_is_refused() {
        let mut c = NetworkConfig::new(Role::Node);
        c.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
        c.validate().unwrap();
        // Frames batch gossip about every message: a cap of one message would drop streams.
        c.gossip_max_frame_bytes = c.control_max_bytes;
        let e = c.validate().unwrap_err();
        assert!(e.contains("gossip frame cap 4096 bytes"), "{e}");
    }

    #[test]
    fn the_default_listen_addresses_are_tcp_only_in_a_private_swarm() {
        let open: Vec<String> = default_listen(4001, false)
            .iter()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(
            open,
            ["/ip4/0.0.0.0/udp/4001/quic-v1", "/ip4/0.0.0.0/tcp/4001"]
        );
        let private: Vec<String> = default_listen(0, true)
            .iter()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(private, ["/ip4/0.0.0.0/tcp/0"]);
    }
}
