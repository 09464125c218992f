//! The persisted ed25519 identity: a node keeps its peer id across restarts.
//!
//! The file holds the keypair's libp2p protobuf encoding and is created with mode 0600;
//! an existing file that is readable by others, unreadable or malformed is an error.

use libp2p::identity::Keypair;
use std::io::Write;
use std::path::Path;

/// Why an identity file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("identity file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("identity file {path} is not a libp2p keypair: {message}")]
    Malformed { path: String, message: String },
    #[error("identity file {path} has mode {mode:o}; it must not be readable by group or others (chmod 600)")]
    Permissions { path: String, mode: u32 },
}

/// Loads the keypair at `path`, or creates a new ed25519 keypair there (mode 0600).
pub fn load_or_create(path: &Path) -> Result<Keypair, IdentityError> {
    let shown = path.display().to_string();
    let io = |source| IdentityError::Io {
        path: shown.clone(),
        source,
    };
    match std::fs::read(path) {
        Ok(bytes) => {
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(path).map_err(io)?.permissions().mode() & 0o777;
                if mode & 0o077 != 0 {
                    return Err(IdentityError::Permissions { path: shown, mode });
                }
            }
            Keypair::from_protobuf_encoding(&bytes).map_err(|e| IdentityError::Malformed {
                path: shown.clone(),
                message: e.to_string(),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let keypair = Keypair::generate_ed25519();
            let bytes = keypair
                .to_protobuf_encoding()
                .expect("ed25519 keys always encode");
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(io)?;
            }
            let mut options = std::fs::OpenOptions::new();
            options.write(true).create_new(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                options.mode(0o600);
            }
            let mut file = options.open(path).map_err(io)?;
            file.write_all(&bytes).map_err(io)?;
            file.sync_all().map_err(io)?;
            Ok(keypair)
        }
        Err(e) => Err(io(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_is_created_private_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys/identity.key");
        let first = load_or_create(&path).unwrap();
        let second = load_or_create(&path).unwrap();
        assert_eq!(first.public().to_peer_id(), second.public().to_peer_id());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
            let err = load_or_create(&path).unwrap_err();
            assert!(err.to_string().contains("chmod 600"), "{err}");
        }
        let bad = dir.path().join("bad.key");
        std::fs::write(&bad, b"not a key").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        assert!(matches!(
            load_or_create(&bad),
            Err(IdentityError::Malformed { .. })
        ));
    }
}
