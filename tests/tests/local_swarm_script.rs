//! `deploy/local-swarm.sh` (what `make demo` runs) stops however the stop signal arrives.
//! Started in the background from a non-interactive shell, as `setsid make demo &` in a
//! script does, bash starts it with SIGINT ignored, and a signal ignored on entry cannot be
//! trapped: a Ctrl-C sent to the whole process group reaches the nodes (they leave) but not
//! the script's trap. The script must notice that every node has left and return.
//! The manifest pins its shards, as the demo's does, so the nodes start without --data and
//! fetch them from the bootstrap.

use gasloc_tests::{built_binary, pin_data, prepare_byte_data, tiny_run};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn the_local_swarm_returns_after_a_group_sigint_that_its_trap_cannot_catch() {
    let dir = gasloc_tests::TestDir::new();
    let dir = dir.path();
    let manifest = dir.join("run.toml");
    std::fs::write(
        &manifest,
        tiny_run(
            "local-swarm-script-test",
            3,
            "topology = \"one-peer\"\ninner_steps = 5\n",
        ),
    )
    .unwrap();
    let data = prepare_byte_data(dir);
    // Pinned, as `make demo` pins the demo's: the bootstrap serves the shards and the nodes
    // fetch them from the swarm.
    pin_data(&data, &manifest, &[]);
    let bin = built_binary("gasloc-node").parent().unwrap().to_path_buf();
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("deploy/local-swarm.sh");
    let out = dir.join("swarm.out");
    // `… &` in `bash -c`: no job control, so the script starts with SIGINT ignored. The
    // outer shell ignores SIGINT too, to wait for the script and return its status.
    let line = format!(
        "trap '' INT; bash {} {} {} {} 2 >{} 2>&1 & wait $!",
        script.display(),
        bin.display(),
        manifest.display(),
        data.display(),
        out.display()
    );
    let base_port = 20000 + (std::process::id() % 20000) as u16;
    let mut shell = Command::new("bash")
        .args(["-c", &line])
        .env("ROUND_MS", "3000")
        .env("SWARM_DIR", dir.join("swarm"))
        .env("BASE_PORT", base_port.to_string())
        .process_group(0)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let group = shell.id() as i32;
    let printed = || std::fs::read_to_string(&out).unwrap_or_default();

    let start = Instant::now();
    while !printed().lines().any(|l| l.starts_with("round=0 ")) {
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "no round was reported:\n{}",
            printed()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // A terminal's Ctrl-C: SIGINT to the whole process group.
    // SAFETY: kill(2) on the process group this test created.
    unsafe {
        libc::kill(-group, libc::SIGINT);
    }
    let stopped = Instant::now();
    let status = loop {
        if let Some(status) = shell.try_wait().unwrap() {
            break status;
        }
        if stopped.elapsed() > Duration::from_secs(60) {
            // SAFETY: as above; the test fails below.
            unsafe {
                libc::kill(-group, libc::SIGKILL);
            }
            let _ = shell.wait();
            panic!(
                "local-swarm.sh still runs 60 s after SIGINT:\n{}",
                printed()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let mut rest = String::new();
    let _ = std::fs::File::open(&out).map(|mut f| f.read_to_string(&mut rest));
    assert!(status.success(), "{rest}");
    assert!(rest.contains("every node has left"), "{rest}");
    assert!(rest.contains("data: the bootstrap serves"), "{rest}");
    for i in 1..=2 {
        let log = std::fs::read_to_string(dir.join(format!("swarm/node{i}/stdout.log")))
            .unwrap_or_default();
        assert!(
            log.contains("data_ready shards=2 "),
            "node{i} fetched the pinned shards from the swarm: {log}"
        );
    }
}
