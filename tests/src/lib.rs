//! Helpers for end-to-end tests: the workspace's built binaries, and a local swarm of real
//! `gasloc-bootstrap` and `gasloc-node join` processes on loopback whose output the test
//! reads back.

pub mod http_mirror;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The path of a binary built by `cargo build` in this workspace's target folder
/// (`target/<profile>/<name>`), found from the running test executable.
pub fn built_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test-binary>
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binary lives in target/<profile>/deps");
    let path = profile_dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace` first (make test does)",
        path.display()
    );
    path
}

/// Waits (bounded) until `path` exists and is not empty; returns its text.
pub fn wait_for_file(path: &Path, bound: Duration) -> String {
    let start = Instant::now();
    while start.elapsed() < bound {
        if let Ok(text) = std::fs::read_to_string(path) {
            if !text.is_empty() {
                return text;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{} did not appear within {bound:?}", path.display());
}

/// A test's scratch folder, removed when the test passes and kept (its path printed) when it
/// fails or `GASLOC_KEEP_TEST_DIRS` is set, so that the nodes' logs and round records of a
/// swarm test can be read.
pub struct TestDir(Option<tempfile::TempDir>);

impl TestDir {
    pub fn new() -> TestDir {
        TestDir(Some(tempfile::tempdir().expect("a scratch folder")))
    }

    pub fn path(&self) -> &Path {
        self.0.as_ref().expect("held until dropped").path()
    }
}

impl Default for TestDir {
    fn default() -> Self {
        TestDir::new()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("GASLOC_KEEP_TEST_DIRS").is_some() {
            if let Some(dir) = self.0.take() {
                eprintln!("the test's folder is kept: {}", dir.keep().display());
            }
        }
    }
}

/// A process whose stdout and stderr go to files; killed when dropped.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
}

impl Proc {
    /// Starts `command` with its output in `dir/<name>.out` and `dir/<name>.err`.
    pub fn spawn(name: &str, dir: &Path, mut command: Command) -> Proc {
        let stdout = dir.join(format!("{name}.out"));
        let stderr = dir.join(format!("{name}.err"));
        let child = command
            .stdout(Stdio::from(std::fs::File::create(&stdout).unwrap()))
            .stderr(Stdio::from(std::fs::File::create(&stderr).unwrap()))
            .spawn()
            .unwrap_or_else(|e| panic!("{name} starts: {e}"));
        Proc {
            name: name.into(),
            child,
            stdout,
            stderr,
        }
    }

    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    /// The last lines of stderr, for assertion messages.
    pub fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// The stderr lines that contain `needle`, without terminal colour codes (so that
    /// [`field`] reads their `key=value` pairs), one per line.
    pub fn stderr_lines_with(&self, needle: &str) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<String> = text
            .lines()
            .filter(|l| l.contains(needle))
            .map(without_colour)
            .collect();
        lines.join("\n")
    }

    /// Waits (bounded) until a stdout line starts with `prefix`; returns that line.
    pub fn wait_for_line(&mut self, prefix: &str, bound: Duration) -> String {
        self.wait_for_text(
            &self.stdout.clone(),
            bound,
            &format!("print {prefix:?}"),
            |l| l.starts_with(prefix),
        )
    }

    /// Waits (bounded) until a stderr line (the log) contains `needle`; returns that line.
    pub fn wait_for_log(&mut self, needle: &str, bound: Duration) -> String {
        self.wait_for_text(
            &self.stderr.clone(),
            bound,
            &format!("log {needle:?}"),
            |l| l.contains(needle),
        )
    }

    /// Polls `path` until a line matches; panics, naming `what` and showing the last stderr
    /// lines, when the process exits first or `bound` passes.
    fn wait_for_text(
        &mut self,
        path: &Path,
        bound: Duration,
        what: &str,
        matches: impl Fn(&str) -> bool,
    ) -> String {
        let start = Instant::now();
        while start.elapsed() < bound {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            if let Some(line) = text.lines().find(|l| matches(l)) {
                return line.to_string();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "{} exited ({status}) before it did {what}:\n{}",
                    self.name,
                    self.stderr_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "{} did not {what} within {bound:?}:\n{}",
            self.name,
            self.stderr_tail()
        );
    }

    /// The rounds of the `checkpoint=… round=R` lines printed so far (each the round the
    /// checkpoint resumes at).
    pub fn checkpoint_rounds(&self) -> Vec<u64> {
        self.output()
            .lines()
            .filter(|l| l.starts_with("checkpoint="))
            .filter_map(|l| field(l, "round")?.parse().ok())
            .collect()
    }

    /// Waits (bounded) for a `checkpoint=… round=R` line with `R ≥ min_round`; returns the
    /// highest such round.
    pub fn wait_for_checkpoint_round(&self, min_round: u64, bound: Duration) -> u64 {
        let start = Instant::now();
        while start.elapsed() < bound {
            let round = self.checkpoint_rounds().into_iter().max();
            if let Some(r) = round.filter(|&r| r >= min_round) {
                return r;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("{} wrote no checkpoint of round ≥ {min_round}", self.name);
    }

    /// Waits (bounded) for the process to exit; returns whether it succeeded.
    pub fn wait_exit(&mut self, bound: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < bound {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "{} did not exit within {bound:?}:\n{}",
            self.name,
            self.stderr_tail()
        );
    }

    /// Waits (bounded) for the process to exit and asserts that it succeeded; the panic
    /// names the process and shows its last stderr lines.
    pub fn expect_success(&mut self, bound: Duration) {
        let succeeded = self.wait_exit(bound);
        assert!(succeeded, "{} failed:\n{}", self.name, self.stderr_tail());
    }

    /// SIGTERM (the node leaves cleanly).
    pub fn terminate(&self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `key=value` fields of one output line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// `line` without its terminal colour codes (`ESC [ … m`, as tracing writes them).
fn without_colour(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

/// `gasloc-bootstrap` for `manifest` on loopback (QUIC and TCP), writing its addresses to
/// `dir/<name>.addrs` and its key to `dir/<name>.key`; the caller adds round timing.
pub fn bootstrap_command(dir: &Path, name: &str, manifest: &Path) -> Command {
    let mut command = Command::new(built_binary("gasloc-bootstrap"));
    command
        .arg("--run")
        .arg(manifest)
        .args([
            "--listen",
            "/ip4/127.0.0.1/udp/0/quic-v1",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
        ])
        .arg("--addr-file")
        .arg(dir.join(format!("{name}.addrs")))
        .arg("--identity")
        .arg(dir.join(format!("{name}.key")));
    command
}

/// Spawns a [`bootstrap_command`] and waits for its QUIC address.
pub fn spawn_bootstrap(dir: &Path, name: &str, command: Command) -> (Proc, String) {
    let proc = Proc::spawn(name, dir, command);
    let addrs = wait_for_file(&dir.join(format!("{name}.addrs")), Duration::from_secs(30));
    let quic = addrs
        .lines()
        .find(|a| a.contains("/quic-v1/"))
        .expect("bootstrap listens on QUIC")
        .to_string();
    (proc, quic)
}

/// Starts a bootstrap for `manifest` on loopback with the given round timing (ms) and
/// returns it with its QUIC address.
pub fn start_bootstrap(
    dir: &Path,
    manifest: &Path,
    genesis_delay_ms: u64,
    period_ms: u64,
    window_ms: u64,
    exchange_timeout_ms: u64,
) -> (Proc, String) {
    let mut command = bootstrap_command(dir, "bootstrap", manifest);
    command
        .args(["--genesis-delay-ms", &genesis_delay_ms.to_string()])
        .args(["--round-period-ms", &period_ms.to_string()])
        .args(["--commit-window-ms", &window_ms.to_string()])
        .args(["--reveal-window-ms", &window_ms.to_string()])
        .args(["--exchange-timeout-ms", &exchange_timeout_ms.to_string()]);
    spawn_bootstrap(dir, "bootstrap", command)
}

/// The swarm of the training tests: writes `dir/run.toml` (the tiny run `name` with `outer`),
/// prepares the byte data and starts a bootstrap with rounds of 5 s (1 s of agreement,
/// exchanges of at most 3 s, genesis 6 s away). Returns the bootstrap, its address and the
/// data directory.
pub fn start_training_swarm(
    dir: &Path,
    name: &str,
    seed: u64,
    outer: &str,
) -> (Proc, String, PathBuf) {
    let manifest = dir.join("run.toml");
    std::fs::write(&manifest, tiny_run(name, seed, outer)).unwrap();
    let data = prepare_byte_data(dir);
    let (bootstrap, boot) = start_bootstrap(dir, &manifest, 6000, 5000, 500, 3000);
    (bootstrap, boot, data)
}

/// Spawns `node<i>`: a [`join_command`] with its home in `dir/node<i>`.
pub fn start_join(dir: &Path, boot: &str, data: &Path, i: usize, extra: &[&str]) -> Proc {
    let home = dir.join(format!("node{i}"));
    Proc::spawn(
        &format!("node{i}"),
        dir,
        join_command(boot, &home, data, extra),
    )
}

/// `gasloc-node join` on loopback with its own home under `dir`, one libtorch thread.
pub fn join_command(bootstrap: &str, home: &Path, data: &Path, extra: &[&str]) -> Command {
    let mut command = fetching_join_command(bootstrap, home, extra);
    command.arg("--data").arg(data);
    command
}

/// [`join_command`] without `--data`: the node fetches the run's pinned shards from the
/// swarm into `<home>/data`.
pub fn fetching_join_command(bootstrap: &str, home: &Path, extra: &[&str]) -> Command {
    let mut command = Command::new(built_binary("gasloc-node"));
    command
        .args(["join", "--bootstrap", bootstrap])
        .args([
            "--listen",
            "/ip4/127.0.0.1/udp/0/quic-v1",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
        ])
        .arg("--home")
        .arg(home)
        .args(["--device", "cpu", "--threads", "1"])
        .arg("--report")
        .arg(home.join("rounds.jsonl"))
        .args(extra);
    command
}

/// `gasloc-node join --synthetic` on loopback (QUIC and TCP) with its home (identity and
/// `rounds.jsonl` report) in `home`: 5 synthetic inner steps of 20 ms per round, a payload of
/// `payload_bytes` in 2 tensors, `rounds` rounds.
pub fn synthetic_join_command(
    bootstrap: &str,
    home: &Path,
    payload_bytes: u64,
    rounds: u64,
) -> Command {
    let listen = ["/ip4/127.0.0.1/udp/0/quic-v1", "/ip4/127.0.0.1/tcp/0"];
    synthetic_join_command_on(bootstrap, home, payload_bytes, rounds, &listen)
}

/// [`synthetic_join_command`] listening on `listen` (loopback addresses) instead.
pub fn synthetic_join_command_on(
    bootstrap: &str,
    home: &Path,
    payload_bytes: u64,
    rounds: u64,
    listen: &[&str],
) -> Command {
    let mut command = Command::new(built_binary("gasloc-node"));
    command
        .args(["join", "--bootstrap", bootstrap, "--synthetic"])
        .args(listen.iter().flat_map(|a| ["--listen", a]))
        .args([
            "--payload-bytes",
            &payload_bytes.to_string(),
            "--tensors",
            "2",
        ])
        .args(["--inner-steps", "5", "--step-time-ms", "20"])
        .args(["--rounds", &rounds.to_string()])
        .arg("--home")
        .arg(home)
        .arg("--report")
        .arg(home.join("rounds.jsonl"));
    command
}

/// The round records a node wrote to its `--report` file (one JSON object per line).
pub fn read_report(home: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(home.join("rounds.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// `GET path` over plain HTTP/1.0 from `addr` (host:port); the whole response, headers
/// included.
pub fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("{addr}: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

/// A run manifest for swarms of the synthetic trainer (the model is never built; only the
/// run id and round timing matter). `name` makes the run id differ between tests.
pub fn synthetic_run(name: &str) -> String {
    format!(
        "name = \"{name}\"\nseed = 1\n[model]\nsize = \"tiny\"\n[data]\ntokenizer = \"byte\"\n\
         seq_len = 64\nmicro_batch = 4\n[optimizer]\ndecay_steps = 100\n"
    )
}

/// A run manifest of the tiny model on byte tokens, as the training tests use it: 32-token
/// sequences, batches of 8, AdamW at 3e-3, 4 validation batches; `outer` is the body of its
/// `[outer]` section (topology, inner steps, …).
pub fn tiny_run(name: &str, seed: u64, outer: &str) -> String {
    format!(
        "name = \"{name}\"\nseed = {seed}\n[model]\nsize = \"tiny\"\n[data]\ntokenizer = \"byte\"\n\
         seq_len = 32\nmicro_batch = 8\n[optimizer]\nlr = 3e-3\nwarmup_steps = 10\n\
         decay_steps = 2000\n[eval]\nbatches = 4\n[outer]\n{outer}"
    )
}

/// The `[outer]` section of the tests that train with faults: one-peer, adaptive H_i (and
/// the default overlap, `delayed` in five fragments, unless the test adds its own).
pub const ADAPTIVE_ONE_PEER: &str = "topology = \"one-peer\"\ninner_steps = 20\n\
    adaptive_inner_steps = true\nmin_inner_steps = 2\nmax_inner_steps = 2000\nlr = 0.7\n\
    momentum = 0.9\n";

/// `outer` with blocking rounds (`overlap = "none"`): for the tests of what a blocking round
/// does (its idle time, its faults), written before overlapped rounds were the default.
pub fn blocking(outer: &str) -> String {
    format!("{outer}overlap = \"none\"\n")
}

/// Deterministic English-like text: a few sentences in a pseudo-random order.
pub fn sample_text(bytes: usize) -> String {
    const SENTENCES: [&str; 6] = [
        "To be, or not to be, that is the question. ",
        "All the world's a stage, and all the men and women merely players. ",
        "The quality of mercy is not strained. ",
        "Now is the winter of our discontent. ",
        "What's in a name? That which we call a rose would smell as sweet. ",
        "Brevity is the soul of wit. ",
    ];
    let mut out = String::new();
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    while out.len() < bytes {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.push_str(SENTENCES[(state % SENTENCES.len() as u64) as usize]);
    }
    out.truncate(bytes);
    out
}

/// Byte-token shards of [`sample_text`] in `dir/data`, made by `gasloc-node data prepare`:
/// 20,000 validation tokens and one training shard of 280,000.
pub fn prepare_byte_data(dir: &Path) -> PathBuf {
    prepare_byte_data_with(dir, 300_000, &[])
}

/// [`prepare_byte_data`] of `bytes` bytes of text, with more `data prepare` flags (such
/// as `--shard-tokens`).
pub fn prepare_byte_data_with(dir: &Path, bytes: usize, extra: &[&str]) -> PathBuf {
    let text = dir.join("corpus.txt");
    std::fs::write(&text, sample_text(bytes)).unwrap();
    let data = dir.join("data");
    let status = Command::new(built_binary("gasloc-node"))
        .args([
            "data",
            "prepare",
            "--tokenizer",
            "byte",
            "--val-tokens",
            "20000",
        ])
        .args(extra)
        .arg("--input")
        .arg(&text)
        .arg("--out")
        .arg(&data)
        .stdout(Stdio::null())
        .status()
        .expect("gasloc-node data prepare runs");
    assert!(status.success(), "data prepare failed");
    data
}

/// `gasloc-node data pin --data <data> --manifest <manifest>`, which must succeed; returns
/// its stdout.
pub fn pin_data(data: &Path, manifest: &Path, extra: &[&str]) -> String {
    let output = Command::new(built_binary("gasloc-node"))
        .args(["data", "pin", "--data"])
        .arg(data)
        .arg("--manifest")
        .arg(manifest)
        .args(extra)
        .output()
        .expect("gasloc-node runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "data pin failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// Network namespaces a test creates, named `<name>-<pid>`, each with its loopback up, joined
/// by veth pairs; removed (with their links) when dropped. Creating them needs root.
pub struct Namespaces {
    names: Vec<String>,
}

impl Namespaces {
    pub fn create(names: &[&str]) -> Namespaces {
        let pid = std::process::id();
        let namespaces = Namespaces {
            names: names.iter().map(|n| format!("{n}-{pid}")).collect(),
        };
        for ns in &namespaces.names {
            ip(&["netns", "add", ns]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        namespaces
    }

    /// A veth pair between namespaces `a` and `b` with the given addresses (`10.0.0.1/24`).
    pub fn link(&self, a: usize, address_a: &str, b: usize, address_b: &str) {
        static LINKS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = LINKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (dev_a, dev_b) = {
            let base = format!("gv{}x{n}", std::process::id());
            (format!("{base}a"), format!("{base}b"))
        };
        let (ns_a, ns_b) = (&self.names[a], &self.names[b]);
        ip(&[
            "link", "add", &dev_a, "netns", ns_a, "type", "veth", "peer", "name", &dev_b, "netns",
            ns_b,
        ]);
        for (ns, dev, address) in [(ns_a, &dev_a, address_a), (ns_b, &dev_b, address_b)] {
            ip(&["-n", ns, "addr", "add", address, "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
        }
    }

    /// Runs `args` (a program and its arguments) inside namespace `index` and asserts that
    /// it succeeded: setup such as `sysctl`, `ip route` or `iptables`.
    pub fn run(&self, index: usize, args: &[&str]) {
        let out = self
            .command(index, args[0])
            .args(&args[1..])
            .output()
            .unwrap_or_else(|e| panic!("{args:?} does not run: {e}"));
        assert!(
            out.status.success(),
            "{args:?} in {}: {}",
            self.names[index],
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `program` run inside namespace `index` (`ip netns exec`).
    pub fn command(&self, index: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.names[index]])
            .arg(program);
        command
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip runs");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether this process may create network namespaces (runs as root).
pub fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// How close the payloads of round records (their `gate` readings) came to the payload
/// gate's bounds.
#[derive(Debug, Clone, Copy)]
pub struct GateMargins {
    /// The largest `distance / reference` (readings with a reference).
    pub ratio: f64,
    /// The smallest cosine.
    pub cosine: f64,
    /// The largest `loss − loss_reference` of the functional check (−∞ when it never ran),
    /// against `[gate] max_loss_increase`.
    pub loss_increase: f64,
    /// How many readings.
    pub n: usize,
}

impl std::fmt::Display for GateMargins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "max distance/reference {:.3}, min cosine {:.3}, max loss increase {:.4}, over {} payloads",
            self.ratio, self.cosine, self.loss_increase, self.n
        )
    }
}

/// The payload gate's margins over round records: see [`GateMargins`].
pub fn gate_margins(records: &[serde_json::Value]) -> GateMargins {
    let mut m = GateMargins {
        ratio: 0.0,
        cosine: 1.0,
        loss_increase: f64::NEG_INFINITY,
        n: 0,
    };
    for reading in records
        .iter()
        .flat_map(|r| r["gate"].as_array().cloned().unwrap_or_default())
    {
        m.n += 1;
        let reference = reading["reference"].as_f64().unwrap_or(0.0);
        if reference > 0.0 {
            m.ratio = m
                .ratio
                .max(reading["distance"].as_f64().unwrap_or(0.0) / reference);
        }
        if let Some(c) = reading["cosine"].as_f64() {
            m.cosine = m.cosine.min(c);
        }
        if let (Some(loss), Some(reference)) =
            (reading["loss"].as_f64(), reading["loss_reference"].as_f64())
        {
            m.loss_increase = m.loss_increase.max(loss - reference);
        }
    }
    m
}

/// ln(256): the loss of a uniform guess over byte tokens (where an untrained model starts).
pub const UNIFORM_LOSS: f64 = 5.545;

/// The validation losses of a node's round records (`read_report`), in round order.
pub fn val_losses(records: &[serde_json::Value]) -> Vec<f64> {
    records
        .iter()
        .filter_map(|r| r["val_loss"].as_f64())
        .collect()
}
