//! A private swarm's pre-shared key (libp2p `pnet`): a second fence around a closed run, for
//! swarms on TCP only.
//!
//! Every TCP connection of a node started with a key begins with the `pnet` handshake: both
//! sides exchange nonces and encrypt everything after them (multistream-select, noise, the
//! peer ids) with XSalsa20 under the key. A peer without the key, or with another one, reads
//! noise and never learns a peer id or a protocol name; the connection fails before any
//! behaviour sees it. QUIC brings its own TLS handshake that `pnet` cannot wrap, so a keyed
//! swarm listens and dials on TCP only ([`check_tcp_only`] refuses other addresses).
//!
//! The key file is go-ipfs/kubo's `swarm.key`:
//!
//! ```text
//! /key/swarm/psk/1.0.0/
//! /base16/
//! <64 hex digits: the 32-byte key>
//! ```

use crate::config::NetworkConfig;
use libp2p::multiaddr::Protocol;
use libp2p::Multiaddr;
use std::path::{Path, PathBuf};

/// The key itself (its `Debug` shows only its fingerprint; `fingerprint()` is what to log).
pub use libp2p::pnet::PreSharedKey;

/// The key file's first line.
pub const KEY_FILE_HEADER: &str = "/key/swarm/psk/1.0.0/";
/// The key file's second line: the only encoding read.
pub const KEY_FILE_ENCODING: &str = "/base16/";
/// Bytes in a key (64 hex digits in the file).
pub const KEY_BYTES: usize = 32;

/// Why a swarm key file could not be used; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum SwarmKeyError {
    #[error("swarm key {}: no such file", path.display())]
    Missing { path: PathBuf },
    #[error("swarm key {}: cannot read it: {source}", path.display())]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "swarm key {}: the first line is {found:?}, expected {KEY_FILE_HEADER:?} \
         (a go-ipfs/kubo swarm.key)",
        path.display()
    )]
    BadHeader { path: PathBuf, found: String },
    #[error(
        "swarm key {}: the second line is {found:?}, expected {KEY_FILE_ENCODING:?} \
         (the only encoding read)",
        path.display()
    )]
    BadEncoding { path: PathBuf, found: String },
    #[error(
        "swarm key {}: the third line must be {} hex digits (the {KEY_BYTES}-byte key): {problem}",
        path.display(),
        2 * KEY_BYTES
    )]
    BadKey { path: PathBuf, problem: String },
}

/// Reads a swarm key file (see the module doc).
pub fn load_swarm_key(path: &Path) -> Result<PreSharedKey, SwarmKeyError> {
    let text = std::fs::read_to_string(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            SwarmKeyError::Missing {
                path: path.to_path_buf(),
            }
        } else {
            SwarmKeyError::Unreadable {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    parse_swarm_key(&text, path)
}

/// Parses the text of a swarm key file; `path` is only for the error.
///
/// Parsed here rather than by `PreSharedKey::from_str`, whose errors do not say which line
/// is wrong and which slices the key line two bytes at a time (a non-ASCII character across
/// such a cut panics).
pub fn parse_swarm_key(text: &str, path: &Path) -> Result<PreSharedKey, SwarmKeyError> {
    let mut lines = text.lines().map(str::trim_end);
    let header = lines.next().unwrap_or_default();
    if header != KEY_FILE_HEADER {
        return Err(SwarmKeyError::BadHeader {
            path: path.to_path_buf(),
            found: header.to_string(),
        });
    }
    let encoding = lines.next().unwrap_or_default();
    if encoding != KEY_FILE_ENCODING {
        return Err(SwarmKeyError::BadEncoding {
            path: path.to_path_buf(),
            found: encoding.to_string(),
        });
    }
    let bad_key = |problem: String| SwarmKeyError::BadKey {
        path: path.to_path_buf(),
        problem,
    };
    let digits = lines.next().unwrap_or_default();
    if let Some((at, c)) = digits
        .chars()
        .enumerate()
        .find(|(_, c)| !c.is_ascii_hexdigit())
    {
        return Err(bad_key(format!(
            "{c:?} at character {} is not a hex digit",
            at + 1
        )));
    }
    // Every character is an ASCII hex digit now: only the length can be wrong.
    let mut key = [0u8; KEY_BYTES];
    hex::decode_to_slice(digits, &mut key)
        .map_err(|_| bad_key(format!("found {} digits", digits.len())))?;
    Ok(PreSharedKey::new(key))
}

/// Why a keyed swarm refused an address: it is not TCP, and `pnet` protects TCP only.
#[derive(Debug, thiserror::Error)]
#[error(
    "{setting} address {address} is not TCP: a swarm key (pnet) protects TCP connections \
     only (QUIC has its own handshake that pnet cannot wrap), so a swarm with a key listens \
     and dials on /tcp/ addresses only"
)]
pub struct NotTcp {
    /// `listen` or `bootstrap`: which setting holds the address.
    pub setting: &'static str,
    pub address: Multiaddr,
}

/// Checks that every listen and bootstrap address of `config` is a TCP one (a relay circuit
/// reached over TCP is one too). Only meaningful for a swarm with a key.
pub fn check_tcp_only(config: &NetworkConfig) -> Result<(), NotTcp> {
    let listen = config.listen.iter().map(|a| ("listen", a));
    let bootstrap = config.bootstrap.iter().map(|a| ("bootstrap", a));
    for (setting, address) in listen.chain(bootstrap) {
        let tcp = address.iter().any(|p| matches!(p, Protocol::Tcp(_)));
        let udp = address.iter().any(|p| matches!(p, Protocol::Udp(_)));
        if !tcp || udp {
            return Err(NotTcp {
                setting,
                address: address.clone(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Role;

    const GOOD_HEX: &str = "0123456789abcdef0123456789abcdef0123456789ABCDEF0123456789ABCDEF";

    fn parse(text: &str) -> Result<PreSharedKey, SwarmKeyError> {
        parse_swarm_key(text, Path::new("swarm.key"))
    }

    #[test]
    fn a_kubo_key_file_is_read_and_round_trips() {
        let text = format!("{KEY_FILE_HEADER}\n{KEY_FILE_ENCODING}\n{GOOD_HEX}\n");
        let key = parse(&text).unwrap();
        // libp2p writes the same format (lower-case hex).
        assert_eq!(
            key.to_key_file(),
            format!(
                "{KEY_FILE_HEADER}\n{KEY_FILE_ENCODING}\n{}\n",
                GOOD_HEX.to_lowercase()
            )
        );
        // Without a final newline and with Windows line ends too.
        let crlf = format!("{KEY_FILE_HEADER}\r\n{KEY_FILE_ENCODING}\r\n{GOOD_HEX}");
        assert_eq!(parse(&crlf).unwrap(), key);
    }

    #[test]
    fn a_missing_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.key");
        let e = load_swarm_key(&path).unwrap_err();
        assert!(matches!(e, SwarmKeyError::Missing { .. }), "{e:?}");
        assert!(e.to_string().contains("nope.key: no such file"), "{e}");
    }

    #[test]
    fn a_directory_is_unreadable() {
        let dir = tempfile::tempdir().unwrap();
        let e = load_swarm_key(dir.path()).unwrap_err();
        assert!(matches!(e, SwarmKeyError::Unreadable { .. }), "{e:?}");
    }

    #[test]
    fn a_wrong_or_missing_header_is_refused() {
        let e = parse(&format!("/key/swarm/psk/2.0.0/\n/base16/\n{GOOD_HEX}\n")).unwrap_err();
        assert!(matches!(e, SwarmKeyError::BadHeader { .. }), "{e:?}");
        assert!(
            e.to_string()
                .contains("the first line is \"/key/swarm/psk/2.0.0/\""),
            "{e}"
        );
        let e = parse("").unwrap_err();
        assert!(matches!(e, SwarmKeyError::BadHeader { .. }), "{e:?}");
        // A bare hex key without the header lines.
        let e = parse(GOOD_HEX).unwrap_err();
        assert!(matches!(e, SwarmKeyError::BadHeader { .. }), "{e:?}");
    }

    #[test]
    fn another_encoding_is_refused() {
        let e = parse(&format!("{KEY_FILE_HEADER}\n/base64/\nASNFZ4mrze8=\n")).unwrap_err();
        assert!(matches!(e, SwarmKeyError::BadEncoding { .. }), "{e:?}");
        assert!(e.to_string().contains("\"/base64/\""), "{e}");
        let e = parse(&format!("{KEY_FILE_HEADER}\n")).unwrap_err();
        assert!(matches!(e, SwarmKeyError::BadEncoding { .. }), "{e:?}");
    }

    #[test]
    fn a_short_long_or_missing_key_is_refused_with_its_length() {
        for (digits, found) in [
            (&GOOD_HEX[..62], "found 62 digits"),
            (&GOOD_HEX[..63], "found 63 digits"),
            ("", "found 0 digits"),
        ] {
            let e = parse(&format!(
                "{KEY_FILE_HEADER}\n{KEY_FILE_ENCODING}\n{digits}\n"
            ))
            .unwrap_err();
            assert!(matches!(e, SwarmKeyError::BadKey { .. }), "{e:?}");
            assert!(e.to_string().contains(found), "{e}");
        }
        let long = format!("{GOOD_HEX}00");
        let e = parse(&format!("{KEY_FILE_HEADER}\n{KEY_FILE_ENCODING}\n{long}\n")).unwrap_err();
        assert!(e.to_string().contains("found 66 digits"), "{e}");
    }

    #[test]
    fn a_non_hex_character_is_named_not_a_panic() {
        let mut digits = GOOD_HEX.to_string();
        digits.replace_range(9..10, "g");
        let e = parse(&format!(
            "{KEY_FILE_HEADER}\n{KEY_FILE_ENCODING}\n{digits}\n"
        ))
        .unwrap_err();
        assert!(matches!(e, SwarmKeyError::BadKey { .. }), "{e:?}");
        assert!(e.to_string().contains("'g' at character 10"), "{e}");
        // 64 bytes with a two-byte character across bytes 61..63: `PreSharedKey::from_str`
        // panics on it (it slices bytes 60..62).
        let mut digits = GOOD_HEX[..61].to_string();
        digits.push('é');
        digits.push('0');
        assert_eq!(digits.len(), 64);
        let e = parse(&format!(
            "{KEY_FILE_HEADER}\n{KEY_FILE_ENCODING}\n{digits}\n"
        ))
        .unwrap_err();
        assert!(e.to_string().contains("'é' at character 62"), "{e}");
    }

    #[test]
    fn only_tcp_addresses_are_allowed_with_a_key() {
        let mut c = NetworkConfig::new(Role::Node);
        c.listen = vec!["/ip4/0.0.0.0/tcp/4001".parse().unwrap()];
        c.bootstrap = vec![
            "/dns4/bootstrap/tcp/4001".parse().unwrap(),
            "/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit"
                .parse()
                .unwrap(),
        ];
        check_tcp_only(&c).unwrap();
        c.listen
            .push("/ip4/0.0.0.0/udp/4001/quic-v1".parse().unwrap());
        let e = check_tcp_only(&c).unwrap_err();
        assert_eq!(e.setting, "listen");
        assert!(
            e.to_string()
                .starts_with("listen address /ip4/0.0.0.0/udp/4001/quic-v1 is not TCP"),
            "{e}"
        );
        c.listen.pop();
        c.bootstrap
            .push("/ip4/10.0.0.1/udp/4001/quic-v1".parse().unwrap());
        assert_eq!(check_tcp_only(&c).unwrap_err().setting, "bootstrap");
    }
}
