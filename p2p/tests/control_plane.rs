//! The gossipsub control plane over real swarms: signed messages of the run are delivered
//! with their author; messages of another run, malformed or oversized ones are not.

mod common;

use common::*;
use gasloc_p2p::network::{ClientError, NetworkEvent};
use gasloc_proto::wire::{control_message::Body, Commit, ControlMessage, Reveal};
use libp2p::identity::Keypair;
use std::time::Duration;

fn commit(run_id: RunId, round: u64, byte: u8) -> ControlMessage {
    ControlMessage {
        run_id: run_id.to_vec(),
        round,
        body: Some(Body::Commit(Commit {
            commitment: vec![byte; 32],
        })),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_valid_messages_of_the_run_are_delivered_with_their_author() {
    init_tracing();
    let receiver = start(Keypair::generate_ed25519(), Transport::Tcp, vec![]).await;
    let sender = start(
        Keypair::generate_ed25519(),
        Transport::Tcp,
        vec![full_addr(&receiver)],
    )
    .await;
    let mut events = receiver.events;
    for client in [&receiver.client, &sender.client] {
        client.join_run(RUN_ID, None).await.unwrap();
    }
    for _ in 0..200 {
        if !sender.client.topic_peers().await.unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Oversized: refused by the sender itself (the 4096-byte cap of a control message).
    let huge = ControlMessage {
        run_id: RUN_ID.to_vec(),
        round: 0,
        body: Some(Body::Reveal(Reveal {
            nonce: vec![0; 5000],
        })),
    };
    let err = sender.client.publish(huge).await.unwrap_err();
    assert!(
        matches!(err, ClientError::MessageTooLarge { cap: 4096, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("exceeds the cap of 4096"), "{err}");

    // Another run's message, a malformed nonce: published, but the receiver drops them.
    sender
        .client
        .publish(commit(RunId::from_bytes([0x99; 32]), 0, 1))
        .await
        .unwrap();
    let short = ControlMessage {
        run_id: RUN_ID.to_vec(),
        round: 0,
        body: Some(Body::Reveal(Reveal { nonce: vec![0; 31] })),
    };
    sender.client.publish(short).await.unwrap();
    // Then a valid one.
    sender.client.publish(commit(RUN_ID, 0, 7)).await.unwrap();

    let delivered = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(NetworkEvent::Control { source, message }) = events.recv().await {
                return (source, message);
            }
        }
    })
    .await
    .expect("the valid message arrives");
    assert_eq!(
        delivered.0,
        sender.client.peer_id(),
        "the signed author is reported"
    );
    assert_eq!(
        delivered.1,
        commit(RUN_ID, 0, 7),
        "the invalid messages were dropped first"
    );
}
