//! Many real nodes in one process on loopback, for tests and the control-plane benchmark.
//!
//! Node 0 doubles as the hub every other node bootstraps from (as a bootstrap node would);
//! every node is wired as `gasloc-node join` wires it ([`SwarmNode`]): the real swarm,
//! control plane, round driver and exchange service, with the synthetic trainer.

use crate::config::{NetworkConfig, Role};
use crate::driver::{DriverOptions, RoundRecord};
use crate::exchange::SendOptions;
use crate::network::unix_ms;
use crate::peer_standing::PeerStanding;
use crate::schedule::Timing;
use crate::swarm_node::{Participation, SwarmNode};
use crate::synthetic::SyntheticTrainer;
use anyhow::{bail, Context};
use gasloc_proto::manifest::GateConfig;
use gasloc_proto::RunId;
use libp2p::identity::Keypair;
use libp2p::Multiaddr;
use std::time::Duration;

/// What to run.
#[derive(Debug, Clone)]
pub struct LocalSwarm {
    pub nodes: usize,
    pub rounds: u64,
    /// This node never publishes its reveals.
    pub withholder: Option<usize>,
    /// Round timing; `genesis_ms` is replaced by "round 0's commit window opens a second
    /// after every node is subscribed".
    pub timing: Timing,
    /// The synthetic trainer every node runs (its `peer` is replaced by each node's id).
    pub trainer: SyntheticTrainer,
    /// `/ip4/127.0.0.1/tcp/0` or `/ip4/127.0.0.1/udp/0/quic-v1`.
    pub listen: Multiaddr,
    pub run_id: RunId,
    /// Overlapped rounds ([`DriverOptions::overlap`]).
    pub overlap: bool,
}

/// The network settings of one local node.
pub fn local_config(listen: Multiaddr, bootstrap: Vec<Multiaddr>) -> NetworkConfig {
    let mut c = NetworkConfig::new(Role::Node);
    c.listen = vec![listen];
    c.bootstrap = bootstrap;
    c.gossip_heartbeat = Duration::from_millis(100);
    c.discovery_interval = Duration::from_secs(10);
    c
}

impl LocalSwarm {
    /// Starts every node, runs `rounds` rounds and returns each node's records (in node order).
    pub async fn run(&self) -> anyhow::Result<Vec<Vec<RoundRecord>>> {
        let n = self.nodes;
        if n < 2 {
            bail!("a local swarm needs at least 2 nodes");
        }
        let mut nodes = Vec::with_capacity(n);
        let hub = SwarmNode::start(
            Keypair::generate_ed25519(),
            local_config(self.listen.clone(), vec![]),
            None,
        )
        .await?;
        let hub_addr: Multiaddr =
            format!("{}/p2p/{}", hub.listen_addrs()[0], hub.peer_id()).parse()?;
        nodes.push(hub);
        for _ in 1..n {
            let config = local_config(self.listen.clone(), vec![hub_addr.clone()]);
            nodes.push(SwarmNode::start(Keypair::generate_ed25519(), config, None).await?);
        }
        // The rounds' timing is fixed once the topic has formed, so the nodes subscribe
        // without one first; `join_run` below subscribes again with it.
        for node in &nodes {
            node.client().join_run(self.run_id, None).await?;
        }
        // Bounded wait: the hub sees everyone on the topic, everyone sees the hub.
        let mut ready = false;
        for _ in 0..400 {
            ready = nodes[0].client().topic_peers().await?.len() >= n - 1;
            for node in &nodes[1..] {
                ready &= !node.client().topic_peers().await?.is_empty();
            }
            if ready {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if !ready {
            bail!("the local swarm did not form its topic within 20 s");
        }
        // Round 0's commits go out a second after the topic formed (its commit window opens
        // `commit_window` before genesis).
        let timing = Timing {
            genesis_ms: unix_ms() + 1000 + self.timing.commit_window_ms,
            ..self.timing.clone()
        };
        timing.validate().map_err(anyhow::Error::msg)?;
        let mut tasks = Vec::with_capacity(n);
        for (i, node) in nodes.into_iter().enumerate() {
            let me = node.peer_id();
            let node = node.join_run(self.run_id, timing.clone()).await?;
            let participation = Participation {
                work: Box::new(SyntheticTrainer {
                    peer: me,
                    ..self.trainer.clone()
                }),
                options: DriverOptions {
                    rounds: self.rounds,
                    withhold_reveals: self.withholder == Some(i),
                    send: SendOptions::default(),
                    standing: PeerStanding::new(&GateConfig::default(), Vec::new()),
                    ban_file: None,
                    offences: Default::default(),
                    overlap: self.overlap,
                },
                status: tokio::sync::watch::channel(Default::default()).0,
                stop: Default::default(),
            };
            tasks.push(tokio::spawn(node.take_part(participation, |_| {})));
        }
        let bound = Duration::from_millis(timing.period_ms * (self.rounds + 4) + 20_000);
        let mut all = Vec::with_capacity(n);
        for task in tasks {
            let records = tokio::time::timeout(bound, task)
                .await
                .context("a node's round driver did not finish in time")???;
            all.push(records);
        }
        Ok(all)
    }
}
