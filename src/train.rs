//! `shardplan train`: run training steps (on the CPU, or one CUDA device in a CUDA build),
//! with a progress bar, a JSON-lines metrics log, and a clean stop on Ctrl-C.

use crate::fmt::bytes;
use crate::CliError;
use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use shardplan_executor::{ExecError, ShardedTrainer};
use shardplan_frontends::{
    load_model, load_parallel, trace_error, LoadedModel, LoadedParallel, ParallelConfig, Source, SpecError,
};
use shardplan_models::ModelConfig;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
    /// Continue from the newest complete checkpoint in DIR (or from a `step-N` folder),
    /// written on any mesh; --steps counts the whole run.
    #[arg(long, value_name = "DIR", conflicts_with = "init_from")]
    pub resume: Option<PathBuf>,
    /// Start from pretrained weights: a Hugging Face safetensors file, or a folder with
    /// model.safetensors or model.safetensors.index.json.
    #[arg(long, value_name = "PATH")]
    pub init_from: Option<PathBuf>,
    /// Where to compute: `cpu`, or `cuda` / `cuda:N` in a CUDA build (scripts/build-cuda.sh).
    /// Every rank of the mesh runs as a thread on this one device.
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,
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

/// Reads a plan file: JSON errors name the line and column; a plan without its specs, of
/// another format version, or failing the verifier is refused.
fn read_plan(path: &std::path::Path) -> Result<(shardplan_planner::Plan, ModelConfig, ParallelConfig), CliError> {
    let src = Source::read(path)?;
    let plan: shardplan_planner::Plan = serde_json::from_str(&src.text).map_err(|e| {
        SpecError::file(path, format!("not a shardplan plan: {e}"))
            .at(Some(shardplan_frontends::Pos {
                line: e.line() as u64,
                column: e.column() as u64,
            }))
            .help("write one with `shardplan plan --model ... --parallel ... --format json --out plan.json`")
    })?;
    if plan.version != shardplan_planner::PLAN_VERSION {
        return Err(SpecError::file(
            path,
            format!(
                "plan format version {} (this shardplan reads version {})",
                plan.version,
                shardplan_planner::PLAN_VERSION
            ),
        )
        .help("re-run `shardplan plan` with this version")
        .into());
    }
    let Some(source) = plan.source.clone() else {
        return Err(SpecError::file(
            path,
            "the plan does not record the model and parallel specs it was made from",
        )
        .help("write it with `shardplan plan --format json`, which records them")
        .into());
    };
    if let Err(e) = shardplan_planner::verify(&plan, None) {
        return Err(SpecError::file(path, format!("the plan fails verification: {e}"))
            .help("the file was edited or damaged; write it again with `shardplan plan`")
            .into());
    }
    Ok((plan, source.model, source.parallel))
}

pub fn run(args: &TrainArgs) -> Result<Option<u8>, CliError> {
    // Under torchrun / srun / `shardplan launch`, each process would be one rank joined by
    // NCCL; this build runs every rank of a mesh as threads of one process instead.
    match shardplan_executor::dist::DistEnv::from_env() {
        Ok(Some(env)) if env.world_size > 1 => {
            #[cfg(not(feature = "cuda"))]
            let why = "this shardplan was built without CUDA support";
            #[cfg(feature = "cuda")]
            let why = "this build has no NCCL backend yet";
            return Err(CliError::Usage(format!(
                "rank {} of {}: multi-process training needs the NCCL backend, and {why}; run `shardplan train` once instead: it runs every rank of the mesh as a thread on one device (`--device cpu` or `cuda`)",
                env.rank, env.world_size
            )));
        }
        Ok(_) => {}
        Err(e) => return Err(CliError::Usage(e.to_string())),
    }
    if args.steps == 0 {
        return Err(CliError::Other(anyhow::anyhow!("--steps must be at least 1")));
    }
    let device =
        shardplan_executor::device::open(&args.device).map_err(|e| CliError::Usage(format!("--device: {e}")))?;
    shardplan_executor::host::retain_freed_memory();
    let (specs, mut trainer, model_config) = match (&args.plan, &args.model, &args.parallel) {
        (Some(p), _, _) => {
            let (plan, model, parallel) = read_plan(p)?;
            let specs = Specs::Plan(p.clone());
            let graph = shardplan_models::trace(&model, shardplan_executor::sharded::trace_options(&parallel))
                .map_err(|e| exec_error(ExecError::Trace(e), &specs))?;
            let joint = shardplan_ir::differentiate(&graph).map_err(|e| CliError::Other(anyhow::anyhow!("{e}")))?;
            let t = ShardedTrainer::from_plan(&model, &parallel, plan, joint, args.steps)
                .map_err(|e| exec_error(e, &specs))?;
            (specs, t, model)
        }
        (None, Some(m), Some(par)) => {
            let model = load_model(m)?;
            let parallel = load_parallel(par)?;
            let (plan, joint) = crate::plan::make_plan_and_graph(&model, &parallel, &parallel.config)?;
            let config = model.config.clone();
            let specs = Specs::Files(Box::new((model, parallel)));
            let t = match &specs {
                Specs::Files(b) => ShardedTrainer::from_plan(&b.0.config, &b.1.config, plan, joint, args.steps),
                Specs::Plan(_) => unreachable!("built from files just above"),
            }
            .map_err(|e| exec_error(e, &specs))?;
            (specs, t, config)
        }
        _ => {
            return Err(CliError::Other(anyhow::anyhow!(
                "give --model and --parallel, or --plan"
            )))
        }
    };
    trainer.to_device(&device).map_err(|e| exec_error(e, &specs))?;
    if let Some(p) = &args.init_from {
        trainer.init_from(p).map_err(|e| exec_error(e, &specs))?;
    }
    if let Some(dir) = &args.resume {
        for w in trainer.load(dir).map_err(|e| exec_error(e, &specs))? {
            eprintln!("warning: {w}");
        }
        if trainer.steps_done() >= args.steps {
            return Err(CliError::Usage(format!(
                "{}: the checkpoint is at step {}; --steps {} leaves nothing to do (--steps counts the whole run)",
                dir.display(),
                trainer.steps_done(),
                args.steps
            )));
        }
    }
    let save = |trainer: &ShardedTrainer| -> Result<(), CliError> {
        if let Some(dir) = &args.checkpoint_dir {
            trainer.save(dir).map_err(|e| exec_error(e, &specs))?;
            ShardedTrainer::prune(dir, args.checkpoint_keep).map_err(|e| exec_error(e, &specs))?;
        }
        Ok(())
    };

    let mut log = match &args.log {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("cannot open the log {}", p.display()))?,
        )),
        None => None,
    };
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst)).context("installing the Ctrl-C handler")?;
    }
    let bar = ProgressBar::new(args.steps);
    bar.set_position(trainer.steps_done());
    bar.set_style(
        ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30}] {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );

    let (mut first, mut last, mut tokens, mut secs) = (None, 0f32, 0u64, 0f64);
    while trainer.steps_done() < args.steps {
        let m = trainer.step().map_err(|e| exec_error(e, &specs))?;
        first.get_or_insert(m.loss);
        last = m.loss;
        tokens += m.tokens;
        secs += m.step_seconds;
        let measured = m.measured_peak.iter().copied().max().unwrap_or(0);
        bar.set_message(format!(
            "rank-0 loss {:.4} | {:.0} tok/s | {:.1} ms/step | peak {} measured / {} planned",
            m.rank0_loss,
            m.tokens_per_second,
            m.step_seconds * 1e3,
            bytes(measured),
            bytes(m.planned_peak)
        ));
        bar.inc(1);
        if let Some(w) = log.as_mut() {
            let line = serde_json::to_string(&m).context("serialising metrics")?;
            // One flushed line per step: a crash or a Ctrl-C leaves a complete log.
            writeln!(w, "{line}")
                .and_then(|()| w.flush())
                .context("writing the metrics log")?;
        }
        if stop.load(Ordering::SeqCst) {
            bar.abandon();
            save(&trainer)?;
            eprintln!("interrupted: stopped cleanly after step {}", trainer.steps_done());
            return Ok(Some(INTERRUPTED));
        }
        if args.checkpoint_every > 0
            && trainer.steps_done().is_multiple_of(args.checkpoint_every)
            && trainer.steps_done() < args.steps
        {
            save(&trainer)?;
        }
    }
    bar.finish_and_clear();
    save(&trainer)?;
    let summary = format!(
        "trained {} steps of {}: loss {:.4} -> {:.4}, {:.0} tokens/s\n",
        trainer.steps_done(),
        model_config.name(),
        first.unwrap_or(last),
        last,
        tokens as f64 / secs.max(1e-9)
    );
    crate::emit(&summary)?;
    Ok(None)
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
