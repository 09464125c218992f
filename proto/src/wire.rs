//! gasloc's wire messages: hand-written `prost` types that mirror `proto/gasloc.proto`.
//!
//! No `protoc` runs at build time: the `.proto` file is the specification and these
//! structs must keep its field numbers and types. The test at the bottom pins a few
//! encodings byte for byte so that a drift between the two is caught.

/// Byte length of run ids, commitments, nonces and checksums on the wire.
pub const DIGEST_LEN: usize = 32;

/// One gossipsub message of a run's control plane.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ControlMessage {
    #[prost(bytes = "vec", tag = "1")]
    pub run_id: Vec<u8>,
    #[prost(uint64, tag = "2")]
    pub round: u64,
    #[prost(oneof = "control_message::Body", tags = "3, 4, 5")]
    pub body: Option<control_message::Body>,
}

/// The bodies a [`ControlMessage`] can carry.
pub mod control_message {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Body {
        #[prost(message, tag = "3")]
        Commit(super::Commit),
        #[prost(message, tag = "4")]
        Reveal(super::Reveal),
        #[prost(message, tag = "5")]
        Announce(super::Announce),
    }
}

/// `commitment = SHA-256(run_id ‖ round (u64 LE) ‖ sender peer id bytes ‖ nonce)`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Commit {
    #[prost(bytes = "vec", tag = "1")]
    pub commitment: Vec<u8>,
}

/// The nonce committed to in this round.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Reveal {
    #[prost(bytes = "vec", tag = "1")]
    pub nonce: Vec<u8>,
}

/// Liveness and link information; informational only.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Announce {
    #[prost(uint32, tag = "1")]
    pub inner_steps: u32,
    #[prost(uint64, tag = "2")]
    pub step_time_us: u64,
    #[prost(uint64, tag = "3")]
    pub goodput_bytes_per_s: u64,
}

/// What an exchange or state-sync payload holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum PayloadKind {
    Unspecified = 0,
    Model = 1,
    Lordo = 2,
    State = 3,
}

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum DType {
    Unspecified = 0,
    F32 = 1,
    Bf16 = 2,
    F16 = 3,
    U8 = 4,
    I64 = 5,
}

impl DType {
    /// Bytes per element; `None` for `Unspecified`.
    pub fn size(self) -> Option<u64> {
        match self {
            DType::Unspecified => None,
            DType::F32 => Some(4),
            DType::Bf16 | DType::F16 => Some(2),
            DType::U8 => Some(1),
            DType::I64 => Some(8),
        }
    }
}

/// How a tensor's chunks are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Encoding {
    Unspecified = 0,
    Raw = 1,
    Zstd = 2,
}

/// One row of an exchange header's tensor table.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorEntry {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(enumeration = "DType", tag = "2")]
    pub dtype: i32,
    #[prost(uint64, repeated, tag = "3")]
    pub shape: Vec<u64>,
    #[prost(enumeration = "Encoding", tag = "4")]
    pub encoding: i32,
    #[prost(uint64, tag = "5")]
    pub byte_length: u64,
    #[prost(bytes = "vec", tag = "6")]
    pub checksum: Vec<u8>,
}

/// The first frame of each direction of an exchange or state-sync response.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExchangeHeader {
    #[prost(bytes = "vec", tag = "1")]
    pub run_id: Vec<u8>,
    #[prost(uint64, tag = "2")]
    pub round: u64,
    #[prost(bytes = "vec", tag = "3")]
    pub sender: Vec<u8>,
    #[prost(enumeration = "PayloadKind", tag = "4")]
    pub kind: i32,
    #[prost(message, repeated, tag = "5")]
    pub tensors: Vec<TensorEntry>,
    #[prost(uint32, tag = "6")]
    pub chunk_size: u32,
}

/// Why a receiver refused a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum RefusalReason {
    Unspecified = 0,
    WrongRun = 1,
    OldRound = 2,
    FutureRound = 3,
    NotANeighbour = 4,
    TableMismatch = 5,
    TooLarge = 6,
    Busy = 7,
    NoState = 8,
    /// The round's exchange had ended on the receiver's side (its deadline passed) before
    /// the stream arrived: the sender is late, not replaying.
    RoundClosed = 9,
}

/// Sent instead of a header when the receiver will not take part.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Refusal {
    #[prost(enumeration = "RefusalReason", tag = "1")]
    pub reason: i32,
    #[prost(string, tag = "2")]
    pub message: String,
}

/// First frame of `/gasloc/state/1`, from the joining node.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StateRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub run_id: Vec<u8>,
}

/// Request of `/gasloc/manifest/1`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ManifestRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub run_id: Vec<u8>,
}

/// The neighbour structure of a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Topology {
    Unspecified = 0,
    OnePeer = 1,
    TwoPeer = 2,
    Complete = 3,
}

/// Round timing all members of a run share (served with the manifest).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RoundTiming {
    #[prost(uint64, tag = "1")]
    pub genesis_unix_ms: u64,
    #[prost(uint64, tag = "2")]
    pub round_period_ms: u64,
    #[prost(uint64, tag = "3")]
    pub commit_window_ms: u64,
    #[prost(uint64, tag = "4")]
    pub reveal_window_ms: u64,
    #[prost(uint64, tag = "5")]
    pub exchange_timeout_ms: u64,
    #[prost(enumeration = "Topology", tag = "6")]
    pub topology: i32,
}

/// Response of `/gasloc/manifest/1`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ManifestResponse {
    #[prost(bytes = "vec", tag = "1")]
    pub run_id: Vec<u8>,
    #[prost(string, tag = "2")]
    pub manifest_toml: String,
    #[prost(message, optional, tag = "3")]
    pub timing: Option<RoundTiming>,
    #[prost(string, tag = "4")]
    pub error: String,
}

/// Request of `/gasloc/shard/1`: one byte range of one pinned shard, or (empty `name`) the
/// names of the shards the peer serves.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ShardRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub run_id: Vec<u8>,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(uint64, tag = "3")]
    pub offset: u64,
    #[prost(uint64, tag = "4")]
    pub length: u64,
}

/// Response header of `/gasloc/shard/1`; exactly `length` raw shard bytes follow it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ShardResponse {
    /// Non-empty: the request was refused (`<reason>: <detail>`), no bytes follow.
    #[prost(string, tag = "1")]
    pub error: String,
    /// The answer to a list request.
    #[prost(string, repeated, tag = "2")]
    pub names: Vec<String>,
    #[prost(uint64, tag = "3")]
    pub length: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// Encodings computed by hand from gasloc.proto's field numbers: if a tag or type in
    /// this file drifts from the .proto, these bytes change.
    #[test]
    fn encodings_match_the_proto_field_numbers() {
        let msg = ControlMessage {
            run_id: vec![0xAA],
            round: 5,
            body: Some(control_message::Body::Reveal(Reveal { nonce: vec![1, 2] })),
        };
        // 1:len(1) AA | 2:varint 5 | 4:len(4) { 1:len(2) 01 02 }
        assert_eq!(
            msg.encode_to_vec(),
            [0x0A, 1, 0xAA, 0x10, 5, 0x22, 4, 0x0A, 2, 1, 2]
        );
        let entry = TensorEntry {
            name: "w".into(),
            dtype: DType::Bf16 as i32,
            shape: vec![2, 3],
            encoding: Encoding::Zstd as i32,
            byte_length: 12,
            checksum: vec![7],
        };
        // 1:"w" | 2:2 | 3:packed [2,3] | 4:2 | 5:12 | 6:[7]
        assert_eq!(
            entry.encode_to_vec(),
            [0x0A, 1, b'w', 0x10, 2, 0x1A, 2, 2, 3, 0x20, 2, 0x28, 12, 0x32, 1, 7]
        );
        let timing = RoundTiming {
            genesis_unix_ms: 1,
            round_period_ms: 2,
            commit_window_ms: 3,
            reveal_window_ms: 4,
            exchange_timeout_ms: 5,
            topology: Topology::Complete as i32,
        };
        assert_eq!(
            timing.encode_to_vec(),
            [0x08, 1, 0x10, 2, 0x18, 3, 0x20, 4, 0x28, 5, 0x30, 3]
        );
        let request = ShardRequest {
            run_id: vec![0xAA],
            name: "a".into(),
            offset: 5,
            length: 300,
        };
        // 1:len(1) AA | 2:"a" | 3:varint 5 | 4:varint 300 (AC 02)
        assert_eq!(
            request.encode_to_vec(),
            [0x0A, 1, 0xAA, 0x12, 1, b'a', 0x18, 5, 0x20, 0xAC, 0x02]
        );
        let response = ShardResponse {
            error: "e".into(),
            names: vec!["x".into(), "y".into()],
            length: 2,
        };
        // 1:"e" | 2:"x" | 2:"y" | 3:varint 2
        assert_eq!(
            response.encode_to_vec(),
            [0x0A, 1, b'e', 0x12, 1, b'x', 0x12, 1, b'y', 0x18, 2]
        );
    }

    #[test]
    fn unknown_enum_values_decode_as_integers_not_errors() {
        let h = ExchangeHeader {
            kind: 99,
            ..Default::default()
        };
        let back = ExchangeHeader::decode(h.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back.kind, 99);
        assert!(PayloadKind::try_from(back.kind).is_err());
    }
}
