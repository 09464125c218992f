//! Swarm construction: transports (QUIC, TCP + noise + yamux, DNS, relay client; or, in a
//! private swarm with a pre-shared key, TCP + pnet + noise + yamux only) and the composed
//! behaviour every gasloc process runs.

use crate::config::{NetworkConfig, Role};
use crate::manifest_service::{ManifestCodec, MANIFEST_PROTOCOL};
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::Boxed;
use libp2p::core::upgrade;
use libp2p::identity::Keypair;
use libp2p::pnet::{PnetConfig, PreSharedKey};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{
    allow_block_list, autonat, connection_limits, dcutr, gossipsub, identify, kad, mdns,
    memory_connection_limits, noise, ping, relay, request_response, tcp, yamux, PeerId,
    StreamProtocol, Swarm, Transport,
};
use sha2::{Digest, Sha256};

/// Kademlia protocol name of gasloc swarms (keeps them apart from the public DHT).
pub const KAD_PROTOCOL: StreamProtocol = StreamProtocol::new("/gasloc/kad/1");
/// Identify protocol version string.
pub const IDENTIFY_PROTOCOL: &str = "/gasloc/1";
/// How often a node with `--mdns` asks the LAN for peers once its first probes are done.
pub const MDNS_QUERY_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// The behaviours of a gasloc process. Role-specific parts are toggled off elsewhere.
#[derive(NetworkBehaviour)]
pub struct GaslocBehaviour {
    /// Who may connect: everyone, or a closed run's allow-list.
    pub access: crate::access::RunAccess,
    /// Peers this node banned (`peer_standing`): their connections are denied.
    pub blocked: allow_block_list::Behaviour<allow_block_list::BlockedPeers>,
    pub connection_limits: connection_limits::Behaviour,
    pub memory_limits: memory_connection_limits::Behaviour,
    pub identify: identify::Behaviour,
    pub ping: ping::Behaviour,
    pub kad: kad::Behaviour<kad::store::MemoryStore>,
    pub gossipsub: gossipsub::Behaviour,
    pub stream: libp2p_stream::Behaviour,
    pub manifest: request_response::Behaviour<ManifestCodec>,
    pub relay_client: relay::client::Behaviour,
    pub relay_server: Toggle<relay::Behaviour>,
    pub dcutr: Toggle<dcutr::Behaviour>,
    pub autonat: autonat::Behaviour,
    pub mdns: Toggle<mdns::tokio::Behaviour>,
}

/// Builds the swarm for `config` with identity `keypair` (does not listen or dial yet).
///
/// Without a swarm key: QUIC, and TCP + noise + yamux. With one (`config.swarm_key`): TCP
/// only, each connection starting with the `pnet` handshake under the key (see
/// [`private_tcp`]); listen and bootstrap addresses that are not TCP are refused with a
/// [`crate::swarm_key::NotTcp`]. Both get DNS and relay circuits (a circuit rides on a
/// connection to the relay, so with a key only over a keyed one).
pub fn build_swarm(
    keypair: Keypair,
    config: &NetworkConfig,
) -> anyhow::Result<Swarm<GaslocBehaviour>> {
    config.validate().map_err(anyhow::Error::msg)?;
    let behaviour = |key: &Keypair, relay_client: relay::client::Behaviour| {
        build_behaviour(key, relay_client, config)
            .map_err(Box::<dyn std::error::Error + Send + Sync>::from)
    };
    let swarm_config =
        |c: libp2p::swarm::Config| c.with_idle_connection_timeout(config.idle_connection_timeout);
    let builder = libp2p::SwarmBuilder::with_existing_identity(keypair).with_tokio();
    let swarm = match config.swarm_key {
        None => {
            let quic_idle_ms =
                u32::try_from(config.quic_max_idle_timeout.as_millis()).unwrap_or(u32::MAX);
            builder
                .with_tcp(tcp_config(), noise::Config::new, yamux::Config::default)?
                .with_quic_config(|mut q| {
                    q.max_idle_timeout = quic_idle_ms;
                    q.keep_alive_interval = config.quic_keep_alive_interval;
                    q.max_stream_data = config.quic_max_stream_data;
                    q.max_connection_data = config.quic_max_connection_data;
                    q
                })
                .with_dns()?
                .with_relay_client(noise::Config::new, yamux::Config::default)?
                .with_behaviour(behaviour)?
                .with_swarm_config(swarm_config)
                .build()
        }
        Some(psk) => {
            crate::swarm_key::check_tcp_only(config)?;
            builder
                .with_other_transport(|key| {
                    private_tcp(key, psk).map_err(Box::<dyn std::error::Error + Send + Sync>::from)
                })?
                .with_dns()?
                .with_relay_client(noise::Config::new, yamux::Config::default)?
                .with_behaviour(behaviour)?
                .with_swarm_config(swarm_config)
                .build()
        }
    };
    Ok(swarm)
}

fn tcp_config() -> tcp::Config {
    tcp::Config::default().nodelay(true)
}

/// A private swarm's transport (rust-libp2p's `ipfs-private` example): TCP, then the `pnet`
/// handshake under `psk` (nonces, then XSalsa20 over everything after), then noise and
/// yamux as on the open TCP transport. A peer with another key, or none, fails the
/// multistream-select that follows: it reads ciphertext.
fn private_tcp(
    key: &Keypair,
    psk: PreSharedKey,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>, noise::Error> {
    let noise = noise::Config::new(key)?;
    Ok(tcp::tokio::Transport::new(tcp_config())
        .and_then(move |socket, _| PnetConfig::new(psk).handshake(socket))
        .upgrade(upgrade::Version::V1Lazy)
        .authenticate(noise)
        .multiplex(yamux::Config::default())
        .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
        .boxed())
}

fn build_behaviour(
    key: &Keypair,
    relay_client: relay::client::Behaviour,
    config: &NetworkConfig,
) -> anyhow::Result<GaslocBehaviour> {
    let peer_id = key.public().to_peer_id();
    let limits = connection_limits::ConnectionLimits::default()
        .with_max_established(Some(config.max_established_connections))
        .with_max_established_per_peer(Some(config.max_connections_per_peer))
        .with_max_pending_incoming(Some(config.max_pending_connections))
        .with_max_pending_outgoing(Some(config.max_pending_connections));

    let mut kad_config = kad::Config::new(KAD_PROTOCOL);
    kad_config.set_periodic_bootstrap_interval(Some(config.discovery_interval));
    let mut kad =
        kad::Behaviour::with_config(peer_id, kad::store::MemoryStore::new(peer_id), kad_config);
    if config.role == Role::Bootstrap || config.kad_server {
        kad.set_mode(Some(kad::Mode::Server));
    }

    let gossip_config = gossipsub::ConfigBuilder::default()
        .heartbeat_interval(config.gossip_heartbeat)
        .heartbeat_initial_delay(config.gossip_heartbeat)
        .validation_mode(gossipsub::ValidationMode::Strict)
        .validate_messages()
        .max_transmit_size(config.gossip_max_frame_bytes)
        .mesh_n_low(4)
        .mesh_n(6)
        .mesh_n_high(12)
        .mesh_outbound_min(2)
        .message_id_fn(|m: &gossipsub::Message| {
            // Content-addressed per source: identical bytes from two peers stay two messages.
            let mut h = Sha256::new();
            if let Some(source) = &m.source {
                h.update(source.to_bytes());
            }
            h.update(&m.data);
            gossipsub::MessageId::from(h.finalize()[..20].to_vec())
        })
        .build()
        .map_err(|e| anyhow::anyhow!("gossipsub config: {e}"))?;
    let mut gossipsub = gossipsub::Behaviour::new(
        gossipsub::MessageAuthenticity::Signed(key.clone()),
        gossip_config,
    )
    .map_err(|e| anyhow::anyhow!("gossipsub: {e}"))?;
    // Peer scoring, so that a peer's standing with this node (its offences: see
    // `peer_standing`) is its application score. Many volunteers share an address (one
    // NAT, one campus, loopback in tests): no penalty for colocation.
    let score_params = gossipsub::PeerScoreParams {
        ip_colocation_factor_weight: 0.0,
        ..Default::default()
    };
    gossipsub
        .with_peer_score(score_params, gossipsub::PeerScoreThresholds::default())
        .map_err(|e| anyhow::anyhow!("gossipsub peer score: {e}"))?;

    let manifest_support = match config.role {
        Role::Bootstrap => request_response::ProtocolSupport::Full,
        Role::Node => request_response::ProtocolSupport::Full,
    };
    let manifest = request_response::Behaviour::with_codec(
        ManifestCodec,
        [(MANIFEST_PROTOCOL, manifest_support)],
        request_response::Config::default(),
    );

    let relay_server = (config.role == Role::Bootstrap).then(|| {
        let relay_config = relay::Config {
            max_circuits: config.relay_max_circuits,
            max_circuits_per_peer: 4,
            max_circuit_duration: config.relay_max_circuit_duration,
            max_circuit_bytes: config.relay_max_circuit_bytes,
            ..Default::default()
        };
        relay::Behaviour::new(peer_id, relay_config)
    });
    let dcutr = (config.role == Role::Node).then(|| dcutr::Behaviour::new(peer_id));
    let mdns = if config.mdns {
        // libp2p's default asks again only every 5 minutes once its first probes are done:
        // a node whose first queries went unanswered (its neighbour was still starting its
        // listeners) would wait that long. One query per 10 s is little traffic on a LAN.
        Some(mdns::tokio::Behaviour::new(
            mdns::Config {
                query_interval: MDNS_QUERY_INTERVAL,
                ..Default::default()
            },
            peer_id,
        )?)
    } else {
        None
    };

    Ok(GaslocBehaviour {
        access: crate::access::RunAccess::new(config.allowed_peers.clone()),
        blocked: allow_block_list::Behaviour::default(),
        connection_limits: connection_limits::Behaviour::new(limits),
        memory_limits: memory_connection_limits::Behaviour::with_max_percentage(
            config.max_memory_fraction,
        ),
        identify: identify::Behaviour::new(
            identify::Config::new(IDENTIFY_PROTOCOL.into(), key.public())
                .with_agent_version(format!("gasloc/{}", env!("CARGO_PKG_VERSION")))
                // A relay circuit opened later is an address too: tell connected peers.
                .with_push_listen_addr_updates(true),
        ),
        ping: ping::Behaviour::default(),
        kad,
        gossipsub,
        stream: libp2p_stream::Behaviour::new(),
        manifest,
        relay_client,
        relay_server: relay_server.into(),
        dcutr: dcutr.into(),
        autonat: autonat::Behaviour::new(
            peer_id,
            autonat::Config {
                only_global_ips: !config.autonat_private_ips,
                ..Default::default()
            },
        ),
        mdns: mdns.into(),
    })
}
