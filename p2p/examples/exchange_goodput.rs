//! Benchmark: goodput of `/gasloc/exchange/2` against a raw tokio TCP copy of the same bytes,
//! measured in the same run. Driven by `bench/exchange_goodput`.
//!
//! Both sides send `--bytes` and receive `--bytes` at the same time (an exchange is
//! bidirectional), so the raw reference also copies both ways at once on one TCP socket.
//! Goodput = bytes received by one side / seconds until both sides are done.
//!
//! - `loopback --bytes N`: everything in this process on 127.0.0.1.
//! - `serve --host IP --bytes N --addr-file F` and `connect --addr-file F --bytes N
//!   [--link-mbit R]`: two processes (e.g. in two network namespaces).

use anyhow::{anyhow, bail, Context, Result};
use gasloc_p2p::exchange::{OutgoingPayload, SendOptions};
use gasloc_p2p::exchange_service::{ExchangeConfig, ExchangeService};
use gasloc_p2p::local_swarm::local_config;
use gasloc_p2p::network::{self, Network};
use gasloc_p2p::tensors::TensorSet;
use gasloc_proto::wire::PayloadKind;
use gasloc_proto::RunId;
use libp2p::identity::Keypair;
use libp2p::{Multiaddr, PeerId};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const RUN_ID: RunId = RunId::from_bytes([0xBE; 32]);
const RAW_PORT: u16 = 5201;
const QUIC_PORT: u16 = 5202;
const TCP_PORT: u16 = 5203;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn required(args: &[String], name: &str) -> Result<String> {
    arg(args, name).ok_or_else(|| anyhow!("missing {name}"))
}

/// The two benchmark identities, ordered so that the connecting side ("client") has the
/// smaller peer id and therefore opens the exchange stream.
fn identities(transport_tag: u8) -> (Keypair, Keypair) {
    let a = Keypair::ed25519_from_bytes([transport_tag; 32]).expect("32 bytes");
    let b = Keypair::ed25519_from_bytes([transport_tag + 100; 32]).expect("32 bytes");
    if a.public().to_peer_id().to_bytes() < b.public().to_peer_id().to_bytes() {
        (a, b)
    } else {
        (b, a)
    }
}

fn payload(bytes: usize, seed: u64) -> Arc<OutgoingPayload> {
    let tensors = (bytes / (64 << 20)).max(1);
    let set = TensorSet::synthetic(tensors, bytes / tensors, seed);
    Arc::new(OutgoingPayload::new(
        PayloadKind::Model,
        Arc::new(set),
        SendOptions::default(),
    ))
}

fn service(network: &Network) -> Result<ExchangeService> {
    let mut config = ExchangeConfig::new(RUN_ID);
    config.accept_wait = Duration::from_secs(600);
    ExchangeService::start(
        network.client.peer_id(),
        network.client.stream_control(),
        config,
    )
}

/// Raw reference: write `bytes` and read `bytes` at the same time on one TCP socket.
async fn raw_copy(stream: TcpStream, bytes: usize) -> Result<()> {
    stream.set_nodelay(true)?;
    let (mut r, mut w) = stream.into_split();
    let send = async {
        let block = vec![0x5Au8; 1 << 20];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(block.len());
            w.write_all(&block[..n]).await?;
            left -= n;
        }
        w.shutdown().await?;
        Ok::<_, std::io::Error>(())
    };
    let receive = async {
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0usize;
        loop {
            let n = r.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            got += n;
        }
        Ok::<_, std::io::Error>(got)
    };
    let ((), got) = tokio::try_join!(send, receive)?;
    if got != bytes {
        bail!("raw copy received {got} of {bytes} bytes");
    }
    Ok(())
}

async fn gasloc_exchange(
    service: &ExchangeService,
    peer: PeerId,
    payload: Arc<OutgoingPayload>,
) -> Result<u64> {
    let table = Arc::new(payload.set.specs());
    let results = service
        .exchange_round(1, &[peer], payload, Some(table), Duration::from_secs(1800))
        .await;
    let (_, result) = results.into_iter().next().context("one neighbour")?;
    Ok(result?.tensors.byte_length())
}

fn report(
    name: &str,
    bytes: usize,
    seconds: f64,
    reference: Option<f64>,
    link_mbit: Option<f64>,
) -> f64 {
    let goodput = bytes as f64 / seconds;
    let mut line = format!(
        "{name:<14} bytes={bytes} seconds={seconds:.2} goodput_MiB_s={:.1} goodput_Mbit_s={:.1}",
        goodput / (1 << 20) as f64,
        goodput * 8.0 / 1e6
    );
    if let Some(reference) = reference {
        line += &format!(" ratio_vs_raw_tcp={:.3}", goodput / reference);
    }
    if let Some(mbit) = link_mbit {
        line += &format!(
            " goodput_over_link_rate={:.3}",
            goodput * 8.0 / (mbit * 1e6)
        );
    }
    println!("{line}");
    goodput
}

async fn loopback(bytes: usize) -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let start = Instant::now();
    let (accepted, connected) = tokio::join!(listener.accept(), TcpStream::connect(addr));
    let (server, _) = accepted?;
    tokio::try_join!(raw_copy(server, bytes), raw_copy(connected?, bytes))?;
    let reference = report("raw_tcp", bytes, start.elapsed().as_secs_f64(), None, None);

    for (name, tag, listen) in [
        ("gasloc_quic", 1u8, "/ip4/127.0.0.1/udp/0/quic-v1"),
        ("gasloc_tcp", 2u8, "/ip4/127.0.0.1/tcp/0"),
    ] {
        let (client_key, server_key) = identities(tag);
        let listen: Multiaddr = listen.parse()?;
        let server = network::start(server_key, local_config(listen.clone(), vec![])).await?;
        let server_addr: Multiaddr =
            format!("{}/p2p/{}", server.listen_addrs[0], server.client.peer_id()).parse()?;
        let client = network::start(client_key, local_config(listen, vec![server_addr])).await?;
        let (server_service, client_service) = (service(&server)?, service(&client)?);
        let (sp, cp) = (server.client.peer_id(), client.client.peer_id());
        let (pay_s, pay_c) = (payload(bytes, 1), payload(bytes, 2));
        wait_connected(&client, sp).await?;
        let start = Instant::now();
        let (a, b) = tokio::join!(
            gasloc_exchange(&server_service, cp, pay_s),
            gasloc_exchange(&client_service, sp, pay_c)
        );
        a?;
        b?;
        report(
            name,
            bytes,
            start.elapsed().as_secs_f64(),
            Some(reference),
            None,
        );
        server.client.shutdown().await;
        client.client.shutdown().await;
    }
    Ok(())
}

async fn wait_connected(network: &Network, peer: PeerId) -> Result<()> {
    for _ in 0..600 {
        if network.client.connected_peers().await?.contains(&peer) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("not connected to {peer} within 30 s")
}

async fn serve(host: &str, bytes: usize, addr_file: &str) -> Result<()> {
    let raw = TcpListener::bind((host, RAW_PORT)).await?;
    let mut lines = vec![format!("raw {host}:{RAW_PORT}")];
    let mut swarms = Vec::new();
    for (tag, listen) in [
        (1u8, format!("/ip4/{host}/udp/{QUIC_PORT}/quic-v1")),
        (2u8, format!("/ip4/{host}/tcp/{TCP_PORT}")),
    ] {
        let (client_key, server_key) = identities(tag);
        let network = network::start(server_key, local_config(listen.parse()?, vec![])).await?;
        lines.push(format!(
            "{}/p2p/{}",
            network.listen_addrs[0],
            network.client.peer_id()
        ));
        let svc = service(&network)?;
        swarms.push((network, svc, client_key.public().to_peer_id()));
    }
    let server_payload = payload(bytes, 1);
    std::fs::write(addr_file, lines.join("\n") + "\n")?;
    let (socket, _) = raw.accept().await?;
    raw_copy(socket, bytes).await?;
    for (_network, svc, client) in &swarms {
        gasloc_exchange(svc, *client, server_payload.clone()).await?;
    }
    Ok(())
}

async fn connect(addr_file: &str, bytes: usize, link_mbit: Option<f64>) -> Result<()> {
    let text = std::fs::read_to_string(addr_file)?;
    let lines: Vec<&str> = text.lines().collect();
    let raw_addr = lines[0].strip_prefix("raw ").context("raw address line")?;
    let client_payload = payload(bytes, 2);
    let start = Instant::now();
    raw_copy(TcpStream::connect(raw_addr).await?, bytes).await?;
    let reference = report(
        "raw_tcp",
        bytes,
        start.elapsed().as_secs_f64(),
        None,
        link_mbit,
    );
    for (i, (name, tag)) in [("gasloc_quic", 1u8), ("gasloc_tcp", 2u8)]
        .into_iter()
        .enumerate()
    {
        let server_addr: Multiaddr = lines[i + 1].parse()?;
        let server_peer = network::peer_id_of(&server_addr).context("address has /p2p/")?;
        let (client_key, _) = identities(tag);
        let listen: Multiaddr = if name == "gasloc_quic" {
            "/ip4/0.0.0.0/udp/0/quic-v1".parse()?
        } else {
            "/ip4/0.0.0.0/tcp/0".parse()?
        };
        let client = network::start(client_key, local_config(listen, vec![server_addr])).await?;
        let svc = service(&client)?;
        wait_connected(&client, server_peer).await?;
        let start = Instant::now();
        gasloc_exchange(&svc, server_peer, client_payload.clone()).await?;
        report(
            name,
            bytes,
            start.elapsed().as_secs_f64(),
            Some(reference),
            link_mbit,
        );
        client.client.shutdown().await;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    // RUST_LOG=yamux=debug shows the TCP muxer's window growth, for example.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().collect();
    let bytes: usize = arg(&args, "--bytes")
        .unwrap_or_else(|| (1usize << 30).to_string())
        .parse()?;
    match args.get(1).map(String::as_str) {
        Some("loopback") => loopback(bytes).await,
        Some("serve") => {
            serve(
                &required(&args, "--host")?,
                bytes,
                &required(&args, "--addr-file")?,
            )
            .await
        }
        Some("connect") => {
            let link = arg(&args, "--link-mbit").map(|s| s.parse()).transpose()?;
            connect(&required(&args, "--addr-file")?, bytes, link).await
        }
        _ => bail!("usage: exchange_goodput loopback|serve|connect [--bytes N] …"),
    }
}
