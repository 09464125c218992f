//! [`RunId`]: the 32-byte id of a run, the SHA-256 of its resolved manifest
//! ([`crate::RunManifest::run_id`]).
//!
//! On the wire it is its 32 raw bytes ([`RunId::try_from`] a byte slice checks the length);
//! to people, on the command line and in JSON it is 64 lowercase hex digits
//! ([`std::fmt::Display`], [`std::str::FromStr`], serde as a string). Parsing never panics:
//! bad input is a [`RunIdError`] that says what was wrong.

use crate::wire::DIGEST_LEN;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A run id.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct RunId([u8; DIGEST_LEN]);

/// Why a run id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunIdError {
    #[error("a run id is {expected} hex digits, got {got} characters")]
    HexLength { expected: usize, got: usize },
    #[error("a run id is hex digits; {character:?} at position {position} is not one")]
    NotHex { character: char, position: usize },
    #[error("a run id is {DIGEST_LEN} bytes, got {0}")]
    ByteLength(usize),
}

impl RunId {
    pub const fn from_bytes(bytes: [u8; DIGEST_LEN]) -> Self {
        RunId(bytes)
    }

    pub const fn as_bytes(&self) -> &[u8; DIGEST_LEN] {
        &self.0
    }

    /// The raw bytes as a wire message field holds them.
    pub fn to_vec(&self) -> Vec<u8> {
        self.0.to_vec()
    }
}

impl From<[u8; DIGEST_LEN]> for RunId {
    fn from(bytes: [u8; DIGEST_LEN]) -> Self {
        RunId(bytes)
    }
}

impl From<RunId> for [u8; DIGEST_LEN] {
    fn from(id: RunId) -> Self {
        id.0
    }
}

/// A run id from a wire message's bytes (exactly [`DIGEST_LEN`] of them).
impl TryFrom<&[u8]> for RunId {
    type Error = RunIdError;

    fn try_from(bytes: &[u8]) -> Result<Self, RunIdError> {
        bytes
            .try_into()
            .map(RunId)
            .map_err(|_| RunIdError::ByteLength(bytes.len()))
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RunId({self})")
    }
}

/// 64 hex digits; upper case is accepted, [`fmt::Display`] writes lower case.
impl FromStr for RunId {
    type Err = RunIdError;

    fn from_str(s: &str) -> Result<Self, RunIdError> {
        if let Some((position, character)) =
            s.chars().enumerate().find(|(_, c)| !c.is_ascii_hexdigit())
        {
            return Err(RunIdError::NotHex {
                character,
                position,
            });
        }
        if s.len() != 2 * DIGEST_LEN {
            return Err(RunIdError::HexLength {
                expected: 2 * DIGEST_LEN,
                got: s.len(),
            });
        }
        let mut bytes = [0u8; DIGEST_LEN];
        hex::decode_to_slice(s, &mut bytes).map_err(|_| RunIdError::HexLength {
            expected: 2 * DIGEST_LEN,
            got: s.len(),
        })?;
        Ok(RunId(bytes))
    }
}

impl From<RunId> for String {
    fn from(id: RunId) -> Self {
        id.to_string()
    }
}

impl TryFrom<String> for RunId {
    type Error = RunIdError;

    fn try_from(s: String) -> Result<Self, RunIdError> {
        s.parse()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "36a72869b82fa885360939af62fc87af79302d9c0c44790709fe9d1ce85ac860";

    #[test]
    fn hex_text_and_json_round_trip() {
        let id: RunId = HEX.parse().unwrap();
        assert_eq!(id.to_string(), HEX);
        assert_eq!(id.as_bytes()[0], 0x36);
        assert_eq!(HEX.to_uppercase().parse::<RunId>().unwrap(), id);
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, format!("\"{HEX}\""));
        assert_eq!(serde_json::from_str::<RunId>(&json).unwrap(), id);
        assert_eq!(RunId::try_from(id.to_vec().as_slice()).unwrap(), id);
        assert_eq!(format!("{id:?}"), format!("RunId({HEX})"));
    }

    #[test]
    fn bad_input_is_refused_with_the_reason() {
        assert_eq!(
            "abc".parse::<RunId>(),
            Err(RunIdError::HexLength {
                expected: 64,
                got: 3
            })
        );
        let not_hex = format!("{}zz", &HEX[..62]);
        assert_eq!(
            not_hex.parse::<RunId>(),
            Err(RunIdError::NotHex {
                character: 'z',
                position: 62
            })
        );
        // A multi-byte character is not hex, and does not panic the slicing.
        assert!(matches!(
            format!("é{}", &HEX[2..]).parse::<RunId>(),
            Err(RunIdError::NotHex { position: 0, .. })
        ));
        assert_eq!(
            RunId::try_from(&[1u8, 2, 3][..]),
            Err(RunIdError::ByteLength(3))
        );
        assert!(serde_json::from_str::<RunId>("\"abc\"").is_err());
        let message = "abc".parse::<RunId>().unwrap_err().to_string();
        assert_eq!(message, "a run id is 64 hex digits, got 3 characters");
    }
}
