//! `shardplan train`: run training steps on any mesh — every rank as a thread of this
//! process (`--backend local`), or one rank per process under mpirun / srun (`mpi`) — with
//! a progress bar, a JSON-lines metrics log, a measured trace, and a clean stop on Ctrl-C.
//! The process running rank 0 alone writes the log, the trace, the bar and the summary.

use crate::fmt::bytes;
use crate::CliError;
use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use shardplan_executor::comm::env::{Launcher, ProcessEnv};
use shardplan_executor::comm::Placement;
use shardplan_executor::train::engine::Engine;
use shardplan_executor::{ExecError, ShardedTrainer};
use shardplan_frontends::{load_model, load_parallel, trace_error, LoadedModel, LoadedParallel, Source, SpecError};
use shardplan_models::ModelConfig;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

mod fit;
mod measured;
mod pipeline;

use measured::Measured;

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Model: a YAML model spec, a Hugging Face config.json, or a preset name.
    #[arg(long, value_name = "FILE", required_unless_present = "plan")]
    pub model: Option<PathBuf>,
    /// Parallel spec (YAML): mesh, sharding policy, batch, optimizer, schedule, data, seed.
    #[arg(long, value_name = "FILE", required_unless_present = "plan")]
    pub parallel: Option<PathBuf>,
    /// Run a plan written by `shardplan plan --format json` (it carries its model and specs).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["model", "parallel"])]
    pub plan: Option<PathBuf>,
    /// Optimizer steps to run (the learning-rate schedule spans exactly these).
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub steps: u64,
    /// Append one JSON object per step (JSON lines) to this file.
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// Save sharded checkpoints under this folder (`step-N/`), at the end and every
    /// --checkpoint-every steps.
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints (0: only at the end).
    #[arg(long, value_name = "N", default_value_t = 0, requires = "checkpoint_dir")]
    pub checkpoint_every: u64,
    /// Complete checkpoints to keep (older ones are removed after each save).
    #[arg(long, value_name = "K", default_value_t = 3, requires = "checkpoint_dir")]
    pub checkpoint_keep: usize,
    /// How checkpoints are written: shardplan's own format, or torch.distributed.checkpoint's
    /// (`dcp`: torchtitan's layout, which torch's `dcp.load`, torchtitan and exported
    /// programs read).
    #[arg(
        long,
        value_enum,
        value_name = "FORMAT",
        default_value = "shardplan",
        requires = "checkpoint_dir"
    )]
    pub checkpoint_format: CheckpointFormat,
    /// Continue from the newest complete checkpoint in DIR (or from a `step-N` folder),
    /// written on any mesh, in either format (a DCP folder has `.metadata`); --steps
    /// counts the whole run.
    #[arg(long, value_name = "DIR", conflicts_with = "init_from")]
    pub resume: Option<PathBuf>,
    /// How a DCP checkpoint given to --resume or --init-from names the parameters:
    /// Hugging Face's (what shardplan writes), or torchtitan's own for its Llama 3
    /// (`layers.0.attention.wq.weight`, wq and wk in its rotary layout).
    #[arg(long, value_enum, value_name = "NAMES", default_value = "hf")]
    pub names: Names,
    /// Start from pretrained weights: a Hugging Face safetensors file, or a folder with
    /// model.safetensors or model.safetensors.index.json, or a DCP step folder.
    #[arg(long, value_name = "PATH")]
    pub init_from: Option<PathBuf>,
    /// Where to compute: `cpu`, or `cuda` / `cuda:N` in a CUDA build (scripts/build-cuda.sh).
    /// With `--backend local` every rank of the mesh runs as a thread on this one device.
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,
    /// On CUDA, which kernels run the ops shardplan has its own for: `candle` (candle's
    /// ops: the path checked against the CPU) or `native` (shardplan's CUDA kernels and
    /// cuDNN flash attention; `shardplan gpu-selftest` checks them against their CPU twins).
    /// Needs `--device cuda` for `native`.
    #[arg(long, value_name = "KERNELS", default_value = "candle")]
    pub kernels: String,
    /// How ranks exchange data: `local` (every rank of the mesh as a thread of this one
    /// process), `mpi` (one rank per process under mpirun or srun; a build with
    /// `--features mpi`), `nccl` (one rank per GPU; CUDA builds). Default: `local` for a
    /// single process, `mpi` for CPU processes under mpirun or srun, `nccl` for CUDA ones.
    #[arg(long, value_enum, value_name = "BACKEND")]
    pub backend: Option<Backend>,
    /// Write a Chrome / Perfetto trace of the measured start and end of every instruction
    /// on every stream of every rank (the track layout of `plan --format trace`).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Write each instruction's measured time totalled by instruction kind, and the compute
    /// stream's time by IR op, per rank and the mean over ranks, as JSON (the steps after
    /// the first); the end of the run prints the mean. `plan --compare FILE` reads it.
    #[arg(long, value_name = "FILE")]
    pub profile: Option<PathBuf>,
    /// How `--profile` and `--trace` time a GPU run: `device` (CUDA events recorded on the
    /// stream each instruction's work is issued to, read after the step: the work's own
    /// time) or `host` (when the host issued it). The CPU is always timed by the host.
    #[arg(long, value_enum, value_name = "CLOCK", default_value = "device")]
    pub profile_clock: ProfileClock,
    /// Seconds a collective or a cross-stream wait may take before the run stops with an
    /// error naming it (a rank that died or hung).
    #[arg(long, value_name = "SECS", default_value_t = 300.0)]
    pub collective_timeout: f64,
    /// For tests of the failure paths: make rank R fail, stall or run out of device memory
    /// at instruction I of its program (`R:I:fail`, `R:I:stall`, `R:I:oom`), at every step
    /// or, with `:STEP`, at that step of the run only.
    #[arg(long, hide = true, value_name = "R:I:fail|stall|oom[:STEP]")]
    pub inject_fault: Vec<String>,
}

fn parse_fault(s: &str) -> Result<(u64, usize, shardplan_executor::train::sharded::Fault, Option<u64>), CliError> {
    use shardplan_executor::train::sharded::Fault;
    let bad = || {
        CliError::Usage(format!(
            "--inject-fault {s:?}: write RANK:INSTRUCTION:KIND or RANK:INSTRUCTION:KIND:STEP, KIND one of fail, stall, oom"
        ))
    };
    let mut it = s.split(':');
    let (Some(r), Some(i), Some(k), step, None) = (it.next(), it.next(), it.next(), it.next(), it.next()) else {
        return Err(bad());
    };
    let fault = match k {
        "fail" => Fault::Fail,
        "stall" => Fault::Stall,
        "oom" => Fault::OutOfMemory,
        _ => return Err(bad()),
    };
    let step = step
        .map(|n| n.parse::<u64>().ok().filter(|&n| n > 0).ok_or_else(bad))
        .transpose()?;
    Ok((
        r.parse().map_err(|_| bad())?,
        i.parse().map_err(|_| bad())?,
        fault,
        step,
    ))
}

/// The engine that moves data between ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    Local,
    Mpi,
    Nccl,
}

/// Exit code of a run stopped by Ctrl-C (128 + SIGINT), as shells report it.
pub const INTERRUPTED: u8 = 130;

/// Where the specs of a run came from, for placing its errors.
enum Specs {
    Files(Box<(LoadedModel, LoadedParallel)>),
    Plan(PathBuf),
}

impl Specs {
    fn file(&self) -> &std::path::Path {
        match self {
            Specs::Files(b) => &b.1.origin.file,
            Specs::Plan(p) => p,
        }
    }
}

/// Reads a plan file and checks it against what it claims to be
/// (`shardplan_planner::rederive::read_plan`).
fn read_plan(path: &std::path::Path) -> Result<shardplan_planner::rederive::CheckedPlan, CliError> {
    let src = Source::read(path)?;
    Ok(shardplan_planner::rederive::read_plan(path, &src.text)?)
}

pub fn run(args: &TrainArgs) -> Result<Option<u8>, CliError> {
    let env = ProcessEnv::from_env().map_err(|e| CliError::Usage(e.to_string()))?;
    let processes = env.as_ref().map_or(1, |e| e.world_size);
    let cuda = args.device.starts_with("cuda");
    let backend = match (args.backend, &env) {
        (Some(b), _) => b,
        (None, None) => Backend::Local,
        (None, Some(e)) if e.world_size == 1 => Backend::Local,
        (None, Some(_)) if cuda => Backend::Nccl,
        (None, Some(e)) if e.launcher != Launcher::Torchrun => Backend::Mpi,
        (None, Some(e)) => {
            return Err(CliError::Usage(format!(
                "rank {} of {}: CPU processes started by {} have no collective engine; start them with `mpirun -np {}` (the MPI backend), or run `shardplan train` once: it runs every rank of the mesh as a thread",
                e.rank,
                e.world_size,
                e.launcher.name(),
                e.world_size
            )))
        }
    };
    if !(args.collective_timeout > 0.0 && args.collective_timeout.is_finite()) {
        return Err(CliError::Usage(format!(
            "--collective-timeout {}: give a positive number of seconds",
            args.collective_timeout
        )));
    }
    match backend {
        Backend::Local => {
            if let Some(e) = env.as_ref().filter(|e| e.world_size > 1) {
                return Err(CliError::Usage(format!(
                    "rank {} of {}: --backend local runs every rank of the mesh as a thread of one process, but {} started {} processes; start one process, or use --backend mpi (CPU) or nccl (GPU)",
                    e.rank, e.world_size, e.launcher.name(), processes
                )));
            }
            train(args, &args.device, &shardplan_executor::train::engine::Threads)
        }
        Backend::Mpi => run_mpi(args, env.as_ref()),
        Backend::Nccl => run_nccl(args, env.as_ref()),
    }
}

/// `rank R of N: ` for a process of a multi-process launch, else nothing.
fn rank_prefix(env: Option<&ProcessEnv>) -> String {
    env.map_or(String::new(), |e| format!("rank {} of {}: ", e.rank, e.world_size))
}

#[cfg(not(feature = "cuda"))]
fn run_nccl(_args: &TrainArgs, env: Option<&ProcessEnv>) -> Result<Option<u8>, CliError> {
    Err(CliError::Usage(format!(
        "{}--backend nccl needs NVIDIA GPUs and a CUDA build, and this shardplan was built without CUDA support (build one with scripts/build-cuda.sh); on the CPU use --backend mpi under mpirun, or one process with --backend local",
        rank_prefix(env)
    )))
}

/// One rank per process on its node's GPU `LOCAL_RANK`, collectives over NCCL
/// (`train::engine::Nccl`).
#[cfg(feature = "cuda")]
fn run_nccl(args: &TrainArgs, env: Option<&ProcessEnv>) -> Result<Option<u8>, CliError> {
    #[cfg(feature = "mpi")]
    let over_mpi: Option<shardplan_executor::train::engine::JoinProcesses> =
        Some(Box::new(shardplan_mpi::process_world));
    #[cfg(not(feature = "mpi"))]
    let over_mpi = None;
    let engine = shardplan_executor::train::engine::Nccl::start(
        env,
        &args.device,
        std::time::Duration::from_secs_f64(args.collective_timeout),
        &rank_prefix(env),
        over_mpi,
    )
    .map_err(|x| CliError::Usage(x.to_string()))?;
    train(args, &engine.device, &engine)
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_args: &TrainArgs, env: Option<&ProcessEnv>) -> Result<Option<u8>, CliError> {
    let who = rank_prefix(env);
    Err(CliError::Usage(format!(
        "{who}--backend mpi: this shardplan was built without MPI support; build it with `cargo build --release --features mpi` (needs Open MPI: apt-get install libopenmpi-dev openmpi-bin libclang-dev)"
    )))
}

#[cfg(feature = "mpi")]
fn run_mpi(args: &TrainArgs, env: Option<&ProcessEnv>) -> Result<Option<u8>, CliError> {
    let engine = shardplan_mpi::Mpi::start(env).map_err(|e| CliError::Usage(e.to_string()))?;
    // Every process runs one rank; on any failure this process stops the whole job, so
    // no rank waits on one that is gone.
    match train(args, &args.device, &engine) {
        Ok(code) => Ok(code),
        Err(e) => {
            let code = crate::report(&e);
            engine.abort(i32::from(code))
        }
    }
}

/// The metrics log `--log` (appended to), on the process that holds rank 0.
fn open_log(args: &TrainArgs, leader: bool) -> Result<Option<std::io::BufWriter<std::fs::File>>, CliError> {
    Ok(match &args.log {
        Some(p) if leader => Some(std::io::BufWriter::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("cannot open the log {}", p.display()))?,
        )),
        _ => None,
    })
}

/// Appends one step's metrics `m` to `log` as a flushed JSON line: a crash or a Ctrl-C
/// leaves a complete log.
fn log_line(log: &mut Option<std::io::BufWriter<std::fs::File>>, m: &impl serde::Serialize) -> Result<(), CliError> {
    if let Some(w) = log.as_mut() {
        let line = serde_json::to_string(m).context("serialising metrics")?;
        writeln!(w, "{line}")
            .and_then(|()| w.flush())
            .context("writing the metrics log")?;
    }
    Ok(())
}

/// The progress bar over `--steps` from step `done`, shown by the process holding rank 0.
fn step_bar(args: &TrainArgs, leader: bool, done: u64) -> ProgressBar {
    let bar = if leader {
        ProgressBar::new(args.steps)
    } else {
        ProgressBar::hidden()
    };
    bar.set_position(done);
    bar.set_style(
        ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30}] {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

/// After a resume from `dir` at step `done`: its `warnings` (by the leader), and a refusal
/// when `--steps`, which counts the whole run, leaves nothing to do.
fn resumed(
    args: &TrainArgs,
    dir: &std::path::Path,
    warnings: Vec<String>,
    leader: bool,
    done: u64,
) -> Result<(), CliError> {
    if leader {
        for w in warnings {
            eprintln!("warning: {w}");
        }
    }
    if done >= args.steps {
        return Err(CliError::Usage(format!(
            "{}: the checkpoint is at step {done}; --steps {} leaves nothing to do (--steps counts the whole run)",
            dir.display(),
            args.steps
        )));
    }
    Ok(())
}

/// Where a GPU run's instructions are timed (`--profile-clock`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProfileClock {
    Device,
    Host,
}

/// Makes the ranks' weights and optimizer state on `device` through `make`, with a
/// progress bar on the process that runs rank 0 (a large model's start-up takes a while).
fn startup(
    placement: Placement,
    device: &candle_core::Device,
    make: impl FnOnce(Placement, &mut dyn FnMut(u64, u64)) -> Result<ShardedTrainer, ExecError>,
) -> Result<ShardedTrainer, ExecError> {
    let bar = if placement.ranks.iter().any(|(r, _)| *r == 0) {
        ProgressBar::new(0)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} making weights on {msg}: shard {pos}/{len} [{bar:30}] {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(if device.is_cpu() {
        "the CPU".to_string()
    } else {
        "the GPU".to_string()
    });
    let t = make(placement, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    t
}

/// How the parameters of a DCP checkpoint read by `--resume` or `--init-from` are named.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Names {
    /// Hugging Face's: `model.layers.0.self_attn.q_proj.weight`.
    Hf,
    /// torchtitan's for its Llama 3: `layers.0.attention.wq.weight`.
    Torchtitan,
}

/// The format `--checkpoint-dir`'s checkpoints are written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CheckpointFormat {
    /// shardplan's own: `step-00000010/` with `metadata.json` and a safetensors file a rank.
    Shardplan,
    /// torch.distributed.checkpoint's, in torchtitan's layout: `step-10/` with `.metadata`.
    Dcp,
}

/// Runs the training loop with the ranks `place` gives this process.
fn train(args: &TrainArgs, device: &str, engine: &dyn Engine) -> Result<Option<u8>, CliError> {
    if args.steps == 0 {
        return Err(CliError::Other(anyhow::anyhow!("--steps must be at least 1")));
    }
    let device_name = device;
    let (device, kernels) = open_device(args, device_name)?;
    shardplan_executor::host::retain_freed_memory();
    if let (None, Some(m), Some(par)) = (&args.plan, &args.model, &args.parallel) {
        let parallel = load_parallel(par)?;
        if parallel.config.pipeline.is_some() {
            return pipeline::run(args, engine, &load_model(m)?, &parallel, device);
        }
    }
    let (specs, mut trainer, model_config) = match (&args.plan, &args.model, &args.parallel) {
        (Some(p), _, _) => trainer_from_plan(args, engine, &device, device_name, p)?,
        (None, Some(m), Some(par)) => trainer_from_specs(args, engine, &device, device_name, m, par)?,
        _ => {
            return Err(CliError::Other(anyhow::anyhow!(
                "give --model and --parallel, or --plan"
            )))
        }
    };
    check_checkpoint_mesh(args, &trainer)?;
    configure(args, &mut trainer, kernels, &specs)?;
    let run = Run::start(args, trainer, specs, device_name)?;
    run.run_steps(&model_config)
}

/// Opens `--device` and checks `--kernels` against it.
fn open_device(
    args: &TrainArgs,
    device_name: &str,
) -> Result<(candle_core::Device, shardplan_executor::gpu::Kernels), CliError> {
    let device = shardplan_executor::runtime::device::open(device_name)
        .map_err(|e| CliError::Usage(format!("--device: {e}")))?;
    let kernels = shardplan_executor::gpu::Kernels::parse(&args.kernels)
        .map_err(|e| CliError::Usage(format!("--kernels: {e}")))?;
    if kernels == shardplan_executor::gpu::Kernels::Native && !device.is_cuda() {
        return Err(CliError::Usage(format!(
            "--kernels native runs shardplan's CUDA kernels, but --device is `{device_name}`: give --device cuda, or leave --kernels at `candle`"
        )));
    }
    Ok((device, kernels))
}

/// The trainer of a plan file (`--plan`), once its memory is known to fit: the ranks'
/// weights and optimizer state made on `device`.
fn trainer_from_plan(
    args: &TrainArgs,
    engine: &dyn Engine,
    device: &candle_core::Device,
    device_name: &str,
    p: &std::path::Path,
) -> Result<(Specs, ShardedTrainer, ModelConfig), CliError> {
    let shardplan_planner::rederive::CheckedPlan {
        plan,
        model,
        parallel,
        joint,
    } = read_plan(p)?;
    if !plan.policy.runtime.is_shardplan() {
        return Err(CliError::Usage(format!(
            "{}: this plan predicts PyTorch FSDP2's run (runtime: {}), whose buffers and hooks shardplan's executor does not run; train from the specs instead (`shardplan train --model M --parallel P` plans the same spec for this executor), or plan without `runtime: fsdp2` and pass that plan",
            p.display(),
            plan.policy.runtime.name()
        )));
    }
    let specs = Specs::Plan(p.to_path_buf());
    let placement = engine.place(&plan, device).map_err(|e| exec_error(e, &specs))?;
    fit::check(&plan, placement.ranks.len(), device, device_name, &model, &parallel, p)?;
    let t = startup(placement, device, |placement, progress| {
        ShardedTrainer::from_placement_on(&model, &parallel, plan, joint, args.steps, placement, device, progress)
    })
    .map_err(|e| exec_error(e, &specs))?;
    Ok((specs, t, model))
}

/// The trainer of a model spec and a parallel spec (`--model`, `--parallel`), planned as
/// this executor runs it, once its memory is known to fit.
fn trainer_from_specs(
    args: &TrainArgs,
    engine: &dyn Engine,
    device: &candle_core::Device,
    device_name: &str,
    m: &std::path::Path,
    par: &std::path::Path,
) -> Result<(Specs, ShardedTrainer, ModelConfig), CliError> {
    let model = load_model(m)?;
    let parallel = load_parallel(par)?;
    // Planned as this executor runs it (one kernel per op), not as PyTorch eager would.
    let run_config = shardplan_executor::train::sharded::executor_config(&parallel.config);
    let (plan, joint) = crate::plan::make_plan_and_graph(&model, &parallel, &run_config)?;
    let config = model.config.clone();
    let specs = Specs::Files(Box::new((model, parallel)));
    let placement = engine.place(&plan, device).map_err(|e| exec_error(e, &specs))?;
    fit::check(
        &plan,
        placement.ranks.len(),
        device,
        device_name,
        &config,
        &run_config,
        specs.file(),
    )?;
    let t = match &specs {
        Specs::Files(b) => startup(placement, device, |placement, progress| {
            ShardedTrainer::from_placement_on(
                &b.0.config,
                &b.1.config,
                plan,
                joint,
                args.steps,
                placement,
                device,
                progress,
            )
        }),
        Specs::Plan(_) => unreachable!("built from files just above"),
    }
    .map_err(|e| exec_error(e, &specs))?;
    Ok((specs, t, config))
}

/// Refuses `--checkpoint-dir` for a tensor- or expert-parallel run split over processes:
/// its checkpoints are saved from one process holding every rank.
fn check_checkpoint_mesh(args: &TrainArgs, trainer: &ShardedTrainer) -> Result<(), CliError> {
    let mesh = trainer.plan().mesh;
    if args.checkpoint_dir.is_some()
        && (mesh.tensor() > 1 || mesh.expert() > 1)
        && trainer.local_ranks().len() as u64 != mesh.world()
    {
        let axis = if mesh.tensor() > 1 {
            format!("a tensor-parallel run (mesh.tensor {})", mesh.tensor())
        } else {
            format!("an expert-parallel run (mesh.expert {})", mesh.expert())
        };
        return Err(CliError::Usage(format!(
            "--checkpoint-dir: {axis} saves its checkpoints from one process holding every rank; run it as threads (`--backend local`), or leave out --checkpoint-dir"
        )));
    }
    Ok(())
}

/// Sets the trainer up as the flags ask: the collective timeout, injected faults, the
/// kernels, the starting weights (`--init-from`, `--resume`) and what it records; the
/// leader says which backend runs the ranks.
fn configure(
    args: &TrainArgs,
    trainer: &mut ShardedTrainer,
    kernels: shardplan_executor::gpu::Kernels,
    specs: &Specs,
) -> Result<(), CliError> {
    trainer.set_timeout(std::time::Duration::from_secs_f64(args.collective_timeout));
    for f in &args.inject_fault {
        let (rank, instr, fault, step) = parse_fault(f)?;
        trainer.inject_fault_at(rank, instr, fault, step);
    }
    let leader = trainer.is_leader();
    if leader {
        let world = trainer.plan().mesh.world();
        eprintln!(
            "backend {}: {}",
            trainer.backend(),
            if trainer.local_ranks().len() as u64 == world {
                format!("{world} rank(s) as threads of this process")
            } else {
                format!("{world} processes, one rank each")
            }
        );
    }
    trainer
        .set_kernels(kernels)
        .map_err(|e| CliError::Usage(format!("--kernels: {e}")))?;
    trainer.set_checkpoint_names(match args.names {
        Names::Hf => shardplan_executor::checkpoint::CheckpointNames::HuggingFace,
        Names::Torchtitan => shardplan_executor::checkpoint::CheckpointNames::Torchtitan,
    });
    if let Some(p) = &args.init_from {
        trainer.init_from(p).map_err(|e| exec_error(e, specs))?;
    }
    if let Some(dir) = &args.resume {
        let warnings = trainer.load(dir).map_err(|e| exec_error(e, specs))?;
        resumed(args, dir, warnings, leader, trainer.steps_done())?;
    }
    if args.trace.is_some() {
        trainer.record_times();
    }
    trainer.set_device_clock(args.profile_clock == ProfileClock::Device);
    if args.profile.is_some() {
        trainer.record_profile();
    }
    Ok(())
}

/// A training run under way: the trainer, where its errors point, and what this process
/// shows and writes (the log and a visible bar on the leader only).
struct Run<'a> {
    args: &'a TrainArgs,
    trainer: ShardedTrainer,
    specs: Specs,
    device_name: &'a str,
    leader: bool,
    log: Option<std::io::BufWriter<std::fs::File>>,
    bar: ProgressBar,
}

impl<'a> Run<'a> {
    /// Opens the metrics log, makes Ctrl-C stop the run after its current step, and shows
    /// the progress bar.
    fn start(
        args: &'a TrainArgs,
        mut trainer: ShardedTrainer,
        specs: Specs,
        device_name: &'a str,
    ) -> Result<Self, CliError> {
        let leader = trainer.is_leader();
        let log = open_log(args, leader)?;
        let stop = Arc::new(AtomicBool::new(false));
        {
            let stop = stop.clone();
            ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst)).context("installing the Ctrl-C handler")?;
        }
        trainer.set_stop_flag(stop);
        let bar = step_bar(args, leader, trainer.steps_done());
        Ok(Run {
            args,
            trainer,
            specs,
            device_name,
            leader,
            log,
            bar,
        })
    }

    /// Runs the steps up to `--steps`, checkpointing every `--checkpoint-every`; the exit
    /// code of a run stopped by Ctrl-C, else `None` once the summary is out.
    fn run_steps(mut self, model: &ModelConfig) -> Result<Option<u8>, CliError> {
        let mut tally = Tally::default();
        while self.trainer.steps_done() < self.args.steps {
            let m = self.trainer.step().map_err(|e| exec_error(e, &self.specs))?;
            tally.add(&m);
            self.bar.set_message(progress_message(&m, tally.last_val));
            self.bar.inc(1);
            self.log_step(&m)?;
            if m.stop {
                return self.interrupted();
            }
            let done = self.trainer.steps_done();
            if self.args.checkpoint_every > 0
                && done.is_multiple_of(self.args.checkpoint_every)
                && done < self.args.steps
            {
                self.save()?;
            }
        }
        self.finish(&tally, model)
    }

    /// Appends the step's metrics to the log, one flushed line per step: a crash or a
    /// Ctrl-C leaves a complete log.
    fn log_step(&mut self, m: &shardplan_executor::ShardedMetrics) -> Result<(), CliError> {
        log_line(&mut self.log, m)
    }

    /// Saves a checkpoint under `--checkpoint-dir` (when given), keeping the newest
    /// `--checkpoint-keep`.
    fn save(&mut self) -> Result<(), CliError> {
        if let Some(dir) = &self.args.checkpoint_dir {
            let saved = match self.args.checkpoint_format {
                CheckpointFormat::Shardplan => self.trainer.save(dir),
                CheckpointFormat::Dcp => self.trainer.save_dcp(dir),
            };
            saved.map_err(|e| exec_error(e, &self.specs))?;
            if self.trainer.is_leader() {
                ShardedTrainer::prune(dir, self.args.checkpoint_keep).map_err(|e| exec_error(e, &self.specs))?;
            }
        }
        Ok(())
    }

    /// Ends a run stopped by Ctrl-C: its checkpoint, trace and profile are written.
    fn interrupted(mut self) -> Result<Option<u8>, CliError> {
        self.bar.abandon();
        self.save()?;
        write_trace(self.args, &mut self.trainer)?;
        if let Some(text) = write_profile(self.args, &mut self.trainer, self.device_name)? {
            crate::emit(&text)?;
        }
        if self.leader {
            eprintln!("interrupted: stopped cleanly after step {}", self.trainer.steps_done());
        }
        Ok(Some(INTERRUPTED))
    }

    /// Ends a finished run: its checkpoint, trace and profile, and the leader's summary.
    fn finish(mut self, tally: &Tally, model: &ModelConfig) -> Result<Option<u8>, CliError> {
        self.bar.finish_and_clear();
        self.save()?;
        write_trace(self.args, &mut self.trainer)?;
        let profile = write_profile(self.args, &mut self.trainer, self.device_name)?;
        if self.leader {
            let mut summary = tally.summary(self.trainer.steps_done(), model, self.trainer.plan());
            if let Some(text) = profile {
                summary.push_str(&text);
            }
            crate::emit(&summary)?;
        }
        Ok(None)
    }
}

/// The progress bar's message after step `m`: rank 0's loss, the latest validation loss,
/// throughput, measured against planned memory and the busiest expert rank.
fn progress_message(m: &shardplan_executor::ShardedMetrics, last_val: Option<f32>) -> String {
    let measured = m.measured_peak.iter().copied().max().unwrap_or(0);
    let gpu = Measured::device_max(m)
        .map(|d| {
            format!(
                " | GPU allocated {} / reserved {} / in use {}",
                bytes(d.allocated_peak),
                bytes(d.reserved_peak),
                bytes(d.in_use)
            )
        })
        .unwrap_or_default();
    let val = last_val.map(|v| format!(" | val {v:.4}")).unwrap_or_default();
    let routing = m
        .routing
        .map(|l| format!(" | busiest expert rank {:.2}x even", l.factor()))
        .unwrap_or_default();
    format!(
        "rank-0 loss {:.4}{val} | {:.0} tok/s | {:.1} ms/step | peak {} measured / {} planned{gpu}{routing}",
        m.rank0_loss,
        m.tokens_per_second,
        m.step_seconds * 1e3,
        bytes(measured),
        bytes(m.planned_peak)
    )
}

/// The run's losses and throughput so far, and what it measured.
#[derive(Default)]
struct Tally {
    first: Option<f32>,
    last: f32,
    tokens: u64,
    secs: f64,
    /// First and latest validation loss.
    first_val: Option<f32>,
    last_val: Option<f32>,
    seen: Measured,
}

impl Tally {
    fn add(&mut self, m: &shardplan_executor::ShardedMetrics) {
        self.first.get_or_insert(m.loss);
        self.last = m.loss;
        self.tokens += m.tokens;
        self.secs += m.step_seconds;
        self.seen.add(m);
        if let Some(v) = m.val_loss {
            self.first_val.get_or_insert(v);
            self.last_val = Some(v);
        }
    }

    /// The end-of-run summary: steps, loss and validation loss from first to last,
    /// throughput, and the predicted-against-measured table.
    fn summary(&self, steps: u64, model: &ModelConfig, plan: &shardplan_planner::Plan) -> String {
        let mut summary = format!(
            "trained {} steps of {}: loss {:.4} -> {:.4}, {:.0} tokens/s\n",
            steps,
            model.name(),
            self.first.unwrap_or(self.last),
            self.last,
            self.tokens as f64 / self.secs.max(1e-9)
        );
        if let (Some(a), Some(b)) = (self.first_val, self.last_val) {
            summary.push_str(&format!("validation loss {a:.4} -> {b:.4}\n"));
        }
        summary.push_str(&self.seen.versus(plan));
        summary
    }
}

/// Writes the measured trace (`--trace`): every process takes part, the leader writes.
fn write_trace(args: &TrainArgs, trainer: &mut ShardedTrainer) -> Result<(), CliError> {
    let Some(path) = &args.trace else {
        return Ok(());
    };
    let trace = trainer
        .measured_trace()
        .map_err(|e| CliError::Other(anyhow::Error::new(e)))?;
    if trainer.is_leader() {
        let text = serde_json::to_string(&trace).context("serialising the trace")?;
        std::fs::write(path, text).with_context(|| format!("cannot write the trace {}", path.display()))?;
    }
    Ok(())
}

/// Writes the profile (`--profile`): every process takes part, the leader writes the file
/// and gets back the summary table to print.
fn write_profile(args: &TrainArgs, trainer: &mut ShardedTrainer, device: &str) -> Result<Option<String>, CliError> {
    let Some(path) = &args.profile else {
        return Ok(None);
    };
    let Some(profile) = trainer
        .profile(device)
        .map_err(|e| CliError::Other(anyhow::Error::new(e)))?
    else {
        return Ok(None);
    };
    if !trainer.is_leader() {
        return Ok(None);
    }
    let text = serde_json::to_string_pretty(&profile).context("serialising the profile")?;
    std::fs::write(path, text + "\n").with_context(|| format!("cannot write the profile {}", path.display()))?;
    Ok(Some(shardplan_executor::train::profile::summary(&profile, path)))
}

/// Bad data files are bad input (exit 2); divergence and internal errors are failures.
fn exec_error(e: ExecError, specs: &Specs) -> CliError {
    let file = specs.file();
    match e {
        // Shape errors (a sequence longer than the model's context...) point into the specs.
        ExecError::Trace(t) => match specs {
            Specs::Files(b) => CliError::Input(trace_error(t, &b.0, Some(&b.1))),
            Specs::Plan(p) => CliError::Input(SpecError::file(p, t.to_string())),
        },
        ExecError::Data(msg) => CliError::Input(
            SpecError::file(file, format!("data: {msg}"))
                .help("fix the token file, or its `dtype`, in the spec's `data` section"),
        ),
        ExecError::Unsupported(msg) => CliError::Input(SpecError::file(file, msg)),
        // The message names the checkpoint file (and tensor) at fault.
        ExecError::Checkpoint(msg) => CliError::Usage(msg),
        other => CliError::Other(anyhow::Error::new(other)),
    }
}
