//! The container files stay in step with each other and with their docs, without Docker:
//! the two Dockerfiles (FROM scratch, as `make image` builds it, and FROM debian-slim, for a
//! machine with a registry) differ only in their base and what they copy, and every setting
//! `deploy/compose.yaml` reads from the environment is documented in its header.

use std::collections::BTreeSet;
use std::path::Path;

fn read(path: &str) -> String {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    std::fs::read_to_string(repo.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The Dockerfile's instructions other than FROM and COPY, in order.
fn instructions_beyond_the_base(text: &str) -> Vec<&str> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter(|l| !l.starts_with("FROM ") && !l.starts_with("COPY "))
        .collect()
}

#[test]
fn the_scratch_and_the_debian_dockerfiles_build_the_same_image_on_two_bases() {
    let scratch = read("deploy/docker/Dockerfile.scratch");
    let debian = read("deploy/docker/Dockerfile");
    assert!(scratch.contains("\nFROM scratch\n"));
    assert!(debian.contains("\nFROM debian:bookworm-slim\n"));
    let (a, b) = (
        instructions_beyond_the_base(&scratch),
        instructions_beyond_the_base(&debian),
    );
    assert!(a.iter().any(|l| l.starts_with("ENTRYPOINT ")), "{a:?}");
    assert_eq!(a, b, "the two Dockerfiles drifted apart");
}

#[test]
fn every_setting_the_compose_file_reads_is_documented_in_its_header() {
    let compose = read("deploy/compose.yaml");
    let header: String = compose
        .lines()
        .take_while(|l| l.starts_with('#') || l.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    let mut used = BTreeSet::new();
    for part in compose.split("${").skip(1) {
        let name: String = part
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        used.insert(name);
    }
    assert!(used.len() >= 10, "{used:?}");
    for name in &used {
        assert!(
            header.contains(&format!("{name}=")),
            "compose.yaml reads ${{{name}}} but its header does not document it"
        );
    }
}
