//! `gasloc-node`: the volunteer's command-line entry point.
//!
//! Each subcommand is a thin shell over the library: it parses flags, opens files, and
//! reports in `key=value` lines on stdout (diagnostics go to stderr through `tracing`).

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use gasloc_data::pin::{open_run_data, pin_directory};
use gasloc_data::prepare::{prepare, PrepareOptions};
use gasloc_data::stream::{validation_batches, WorkerSlot};
use gasloc_node::checkpoint;
use gasloc_node::device::{device_name, parse_device};
use gasloc_node::join::JoinArgs;
use gasloc_node::sim::report::{self, Summary};
use gasloc_node::sim::{SimOptions, Simulation};
use gasloc_node::trainer::{self, Trainer};
use gasloc_proto::{RunManifest, Tokenizer};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
#[command(
    name = "gasloc-node",
    version,
    about = "gasloc volunteer node: train a language model together"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train the run's model on this machine alone.
    Train(TrainArgs),
    /// Print the validation loss of a checkpoint.
    Eval(EvalArgs),
    /// Simulate N workers of the run's algorithm in this process.
    Sim(SimArgs),
    /// Token data tools.
    #[command(subcommand)]
    Data(DataCommand),
    /// Join a run's swarm through its bootstrap nodes and train with it.
    Join(Box<JoinArgs>),
    /// Print a running node's status (its --status-addr) in the terminal.
    Status(StatusArgs),
    /// Print this node's peer id (for a closed run's `[access] peers`), making its identity
    /// key first if there is none.
    Identity(IdentityArgs),
}

#[derive(Args)]
struct IdentityArgs {
    /// The node's directory, as for `join` (its key: <home>/identity.key).
    #[arg(long, default_value = "gasloc-home")]
    home: PathBuf,
    /// The identity key file (default: <home>/identity.key).
    #[arg(long)]
    identity: Option<PathBuf>,
}

#[derive(Args)]
struct StatusArgs {
    /// The node's status address, HOST:PORT.
    #[arg(long)]
    addr: String,
}

#[derive(Args)]
struct TrainArgs {
    /// The run manifest (TOML).
    #[arg(long)]
    run: PathBuf,
    /// Directory of llm.c token shards.
    #[arg(long)]
    data: PathBuf,
    /// Optimizer steps to run in this invocation.
    #[arg(long)]
    steps: u64,
    /// Where checkpoints go (one `step_N/` directory per save and a `latest` pointer).
    #[arg(long)]
    checkpoint_dir: PathBuf,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Continue from the latest checkpoint in --checkpoint-dir.
    #[arg(long, conflicts_with = "init_from")]
    resume: bool,
    /// Start from the parameters of a Hugging Face Llama (or gasloc) checkpoint directory.
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Steps between log lines (each reports the mean loss since the previous one).
    #[arg(long, default_value_t = 10)]
    log_interval: u64,
    /// Steps between checkpoints (0: only at the end).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
    /// Step directories to keep.
    #[arg(long, default_value_t = 2)]
    keep_checkpoints: usize,
    /// This worker's index and the number of workers sharing the data (disjoint streams).
    #[arg(long, default_value_t = 0)]
    worker_index: usize,
    #[arg(long, default_value_t = 1)]
    worker_count: usize,
    /// libtorch intra-op threads (0: libtorch's default).
    #[arg(long, default_value_t = 0)]
    threads: i32,
}

#[derive(Args)]
struct EvalArgs {
    /// A checkpoint step directory, or a checkpoint root with a `latest` pointer.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Directory of llm.c token shards (its validation shards are used).
    #[arg(long)]
    data: PathBuf,
    /// Validation micro-batches (default: the run manifest's eval.batches).
    #[arg(long)]
    batches: Option<usize>,
    /// The run manifest; needed only for a plain Hugging Face directory.
    #[arg(long)]
    run: Option<PathBuf>,
    #[arg(long, default_value = "auto")]
    device: String,
    #[arg(long, default_value_t = 0)]
    threads: i32,
}

#[derive(Args)]
struct SimArgs {
    /// The run manifest (TOML); its [outer] section picks the algorithm.
    #[arg(long)]
    run: PathBuf,
    /// Directory of llm.c token shards (with a validation shard).
    #[arg(long)]
    data: PathBuf,
    #[arg(long)]
    workers: usize,
    #[arg(long)]
    rounds: u64,
    /// Where rounds.csv, workers.csv, rounds.json, summary.md and loss.svg go.
    #[arg(long)]
    out: PathBuf,
    /// WORKER:FRACTION: that worker's link runs at FRACTION of the standard bandwidth.
    #[arg(long = "straggler")]
    stragglers: Vec<gasloc_node::sim::clock::Straggler>,
    /// The standard link bandwidth in Mbit/s.
    #[arg(long, default_value_t = 100.0)]
    bandwidth_mbps: f64,
    #[arg(long, default_value_t = 10.0)]
    latency_ms: f64,
    /// A fixed simulated inner-step time (ms) instead of the measured one: makes the
    /// simulated clock and adaptive H_i reproducible.
    #[arg(long)]
    step_time_ms: Option<f64>,
    /// Rounds between validation losses.
    #[arg(long, default_value_t = 1)]
    eval_every: u64,
    /// Report the simulated time to reach this validation loss.
    #[arg(long)]
    target_loss: Option<f64>,
    /// libtorch intra-op threads (0: libtorch's default).
    #[arg(long, default_value_t = 1)]
    threads: i32,
}

#[derive(Subcommand)]
enum DataCommand {
    /// Tokenize text files into llm.c shards.
    Prepare(PrepareArgs),
    /// Pin a data directory's shards in a run manifest: writes its [[data.shards]] table
    /// (name, split, bytes, tokens, SHA-256 of every *.bin shard), so every node trains on
    /// exactly these files and can fetch them from the swarm.
    Pin(PinArgs),
}

#[derive(Args)]
struct PinArgs {
    /// The directory of shards (`data prepare --out`).
    #[arg(long)]
    data: PathBuf,
    /// The run manifest to pin them in.
    #[arg(long)]
    manifest: PathBuf,
    /// Where to write the pinned manifest (default: over --manifest, through a temporary
    /// file). Comments and layout of the rest of the file are kept.
    #[arg(long)]
    out: Option<PathBuf>,
    /// HTTP(S) mirrors that serve the shards as `<mirror>/<shard name>` (replaces
    /// data.mirrors).
    #[arg(long)]
    mirror: Vec<String>,
}

#[derive(Args)]
struct PrepareArgs {
    /// Text files or directories (searched recursively for *.txt).
    #[arg(long, required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    /// Output directory for the shards.
    #[arg(long)]
    out: PathBuf,
    /// gpt2 or byte.
    #[arg(long)]
    tokenizer: Tokenizer,
    /// Tokens set aside for the validation shard.
    #[arg(long, default_value_t = 100_000)]
    val_tokens: usize,
    /// Tokens per training shard.
    #[arg(long, default_value_t = 100_000_000)]
    shard_tokens: usize,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,libp2p=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => train(args),
        Command::Eval(args) => eval(args),
        Command::Sim(args) => sim(args),
        Command::Data(DataCommand::Prepare(args)) => data_prepare(args),
        Command::Data(DataCommand::Pin(args)) => data_pin(args),
        Command::Join(args) => gasloc_node::join::run(*args),
        Command::Status(args) => gasloc_status::client::fetch_status(&args.addr)
            .map(|s| print!("{}", gasloc_status::client::format_status(&s))),
        Command::Identity(args) => {
            let path = args
                .identity
                .unwrap_or_else(|| args.home.join("identity.key"));
            gasloc_p2p::identity::load_or_create(&path)
                .map(|key| println!("peer_id={}", key.public().to_peer_id()))
                .map_err(anyhow::Error::from)
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// CPU seconds (user + system, all threads) this process has used: unlike wall-clock
/// time it does not grow when other processes compete for the cores.
fn process_cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a complete rusage into the buffer we own.
    let usage = unsafe {
        if libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) != 0 {
            return 0.0;
        }
        usage.assume_init()
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

fn set_threads(threads: i32) {
    if threads > 0 {
        tch::set_num_threads(threads);
    }
}

fn train(args: TrainArgs) -> Result<()> {
    if args.worker_count == 0 || args.worker_index >= args.worker_count {
        bail!(
            "--worker-index {} must be below --worker-count {}",
            args.worker_index,
            args.worker_count
        );
    }
    if args.log_interval == 0 {
        bail!("--log-interval must be at least 1");
    }
    let manifest = RunManifest::load(&args.run)?;
    let device = parse_device(&args.device)?;
    set_threads(args.threads);
    let data = Arc::new(open_run_data(&args.data, &manifest.data)?);
    let slot = WorkerSlot {
        index: args.worker_index,
        count: args.worker_count,
    };
    let has_checkpoint = checkpoint::exists(&args.checkpoint_dir);
    let mut trainer = if args.resume {
        if !has_checkpoint {
            bail!(
                "--resume: {} holds no checkpoint to resume",
                args.checkpoint_dir.display()
            );
        }
        Trainer::resume(&manifest, device, data.clone(), slot, &args.checkpoint_dir)?
    } else {
        if has_checkpoint {
            bail!(
                "{} already holds a checkpoint: pass --resume to continue it, or choose another --checkpoint-dir",
                args.checkpoint_dir.display()
            );
        }
        match &args.init_from {
            Some(dir) => Trainer::init_from(&manifest, device, data.clone(), slot, dir)?,
            None => Trainer::new(&manifest, device, data.clone(), slot)?,
        }
    };
    let val = trainer::validation_set(&data, &manifest)?;

    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, stop.clone()).context("installing signal handlers")?;
    }
    println!(
        "run_id={} model_params={} device={} start_step={} train_tokens={} val_tokens={}",
        manifest.run_id(),
        manifest.model.parameter_count(),
        device_name(device),
        trainer.step_count(),
        data.train_tokens(),
        data.val_tokens()
    );

    let mut window_loss = 0.0;
    let mut window_steps = 0u64;
    let mut window_tokens = 0usize;
    let mut window_start = Instant::now();
    let mut window_cpu = process_cpu_seconds();
    for i in 1..=args.steps {
        let report = trainer.step()?;
        window_loss += report.loss;
        window_steps += 1;
        window_tokens += report.tokens;
        if i % args.log_interval == 0 || i == args.steps {
            let secs = window_start.elapsed().as_secs_f64().max(1e-9);
            let cpu = (process_cpu_seconds() - window_cpu).max(1e-9);
            println!(
                "step={} loss={:.4} lr={:.3e} grad_norm={:.3} tokens_per_s={:.0} tokens_per_cpu_s={:.0}",
                report.step,
                window_loss / window_steps as f64,
                report.lr,
                report.grad_norm,
                window_tokens as f64 / secs,
                window_tokens as f64 / cpu
            );
            window_cpu = process_cpu_seconds();
            (window_loss, window_steps, window_tokens) = (0.0, 0, 0);
            window_start = Instant::now();
        }
        if !val.is_empty() && report.step % manifest.eval.interval == 0 {
            println!(
                "step={} val_loss={:.4}",
                report.step,
                trainer.evaluate(&val)
            );
        }
        let last = i == args.steps || stop.load(Ordering::Relaxed);
        if args.checkpoint_every > 0 && i % args.checkpoint_every == 0 && !last {
            checkpoint::save(
                &args.checkpoint_dir,
                &trainer.checkpoint()?,
                args.keep_checkpoints,
            )?;
        }
        if stop.load(Ordering::Relaxed) {
            eprintln!("stopping early on a signal after step {}", report.step);
            break;
        }
    }
    let dir = checkpoint::save(
        &args.checkpoint_dir,
        &trainer.checkpoint()?,
        args.keep_checkpoints,
    )?;
    println!("step={} checkpoint={}", trainer.step_count(), dir.display());
    Ok(())
}

fn eval(args: EvalArgs) -> Result<()> {
    let device = parse_device(&args.device)?;
    set_threads(args.threads);
    let given = args.run.as_deref().map(RunManifest::load).transpose()?;
    let dir = checkpoint::resolve(&args.checkpoint)?;
    let ckpt = checkpoint::load(&dir, given.as_ref())?;
    let m = &ckpt.manifest;
    let data = open_run_data(&args.data, &m.data)?;
    if data.val_tokens() == 0 {
        bail!(
            "{} has no validation shard (*_val_*.bin)",
            args.data.display()
        );
    }
    let batches = args.batches.unwrap_or(m.eval.batches);
    if batches == 0 {
        bail!("--batches must be at least 1");
    }
    let val = validation_batches(&data, m.data.seq_len, m.data.micro_batch, batches)?;
    let (_vs, model) = trainer::model_from_checkpoint(&ckpt, &dir, device)?;
    let loss = trainer::evaluate(&model, device, &val);
    println!("val_loss={loss:.6}");
    Ok(())
}

fn sim(args: SimArgs) -> Result<()> {
    let manifest = RunManifest::load(&args.run)?;
    set_threads(args.threads);
    let options = SimOptions {
        workers: args.workers,
        rounds: args.rounds,
        stragglers: args.stragglers,
        bandwidth_mbps: args.bandwidth_mbps,
        latency_ms: args.latency_ms,
        step_time_ms: args.step_time_ms,
        eval_every: args.eval_every,
    };
    options.validate()?;
    let data = Arc::new(open_run_data(&args.data, &manifest.data)?);
    let mut simulation = Simulation::new(&manifest, data, options.clone())?;
    println!(
        "run_id={} algorithm={} topology={} overlap={} fragments={} workers={} model_params={}",
        manifest.run_id(),
        manifest.outer.algorithm.name(),
        manifest.outer.topology.name(),
        manifest.outer.overlap.name(),
        manifest.outer.fragments,
        options.workers,
        simulation.parameter_count()
    );
    let mut records = Vec::with_capacity(options.rounds as usize);
    for _ in 0..options.rounds {
        let r = simulation.run_round()?;
        println!(
            "round={} sim_time_s={:.3} train_loss={:.4} val_loss={} consensus={:.3e} mean_h={:.1} \
             compute_utilization={:.3}",
            r.round,
            r.sim_time_s,
            r.mean_train_loss(),
            r.val_loss.map_or("-".into(), |v| format!("{v:.4}")),
            r.consensus,
            r.mean_inner_steps(),
            r.mean_compute_utilization()
        );
        records.push(r);
    }
    let summary = Summary::new(
        &manifest,
        &options,
        &records,
        simulation.parameter_count(),
        args.target_loss,
    );
    report::write_all(&args.out, &manifest, &options, &records, &summary)?;
    println!(
        "final_val_loss={:.4} sim_time_s={:.2} bytes_per_worker_round={:.0} compute_utilization={:.3} out={}",
        summary.final_val_loss,
        summary.sim_time_s,
        summary.bytes_per_worker_round,
        summary.compute_utilization,
        args.out.display()
    );
    Ok(())
}

fn data_pin(args: PinArgs) -> Result<()> {
    let manifest = RunManifest::load(&args.manifest)?;
    let table = pin_directory(&args.data, manifest.data.tokenizer)?;
    let text = std::fs::read_to_string(&args.manifest)
        .with_context(|| format!("cannot read {}", args.manifest.display()))?;
    let mirrors = (!args.mirror.is_empty()).then_some(args.mirror.as_slice());
    let origin = args.manifest.display().to_string();
    let pinned = gasloc_proto::manifest::pin_shards_in_text(&text, &origin, &table, mirrors)?;
    let out = args.out.as_ref().unwrap_or(&args.manifest);
    // Parse what is written before writing it: the pinned manifest must load.
    let checked = RunManifest::parse(&pinned, &out.display().to_string())?;
    let tmp = out.with_extension("toml.tmp");
    std::fs::write(&tmp, &pinned).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, out).with_context(|| format!("cannot write {}", out.display()))?;
    let bytes: u64 = table.iter().map(|s| s.bytes).sum();
    println!(
        "pinned {} shards ({bytes} bytes) in {}; run_id={}",
        table.len(),
        out.display(),
        checked.run_id()
    );
    Ok(())
}

fn data_prepare(args: PrepareArgs) -> Result<()> {
    let report = prepare(&PrepareOptions {
        inputs: args.input,
        out: args.out,
        tokenizer: args.tokenizer,
        val_tokens: args.val_tokens,
        shard_tokens: args.shard_tokens,
        progress: true,
    })?;
    println!("{report}");
    Ok(())
}
