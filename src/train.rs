//! `shardplan train`: run training steps on the CPU, with a progress bar, a JSON-lines
//! metrics log, and a clean stop on Ctrl-C.

use crate::fmt::bytes;
use crate::CliError;
use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use shardplan_executor::{ExecError, Trainer};
use shardplan_frontends::{load_model, load_parallel, trace_error, LoadedModel, LoadedParallel, SpecError};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Model: a YAML model spec, a Hugging Face config.json, or a preset name.
    #[arg(long, value_name = "FILE")]
    pub model: PathBuf,
    /// Parallel spec (YAML): batch, optimizer, schedule, data, seed. Its mesh must be 1 x 1 for now.
    #[arg(long, value_name = "FILE")]
    pub parallel: PathBuf,
    /// Optimizer steps to run (the learning-rate schedule spans exactly these).
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub steps: u64,
    /// Append one JSON object per step (JSON lines) to this file.
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
}

/// Exit code of a run stopped by Ctrl-C (128 + SIGINT), as shells report it.
pub const INTERRUPTED: u8 = 130;

pub fn run(args: &TrainArgs) -> Result<Option<u8>, CliError> {
    let model = load_model(&args.model)?;
    let parallel = load_parallel(&args.parallel)?;
    let world = parallel.config.mesh.world();
    if world != 1 {
        return Err(parallel
            .origin
            .error(
                "mesh",
                format!("the mesh has {world} ranks; `train` runs one rank until the sharded executor lands"),
                "use `mesh: {replicate: 1, shard: 1}` (see examples/parallel/cpu-1.yaml)",
            )
            .into());
    }
    if args.steps == 0 {
        return Err(CliError::Other(anyhow::anyhow!("--steps must be at least 1")));
    }
    let mut trainer = Trainer::new(&model.config, &parallel.config, args.steps, candle_core::Device::Cpu)
        .map_err(|e| exec_error(e, &model, &parallel))?;

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
    bar.set_style(
        ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30}] {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );

    let (mut first, mut last, mut tokens, mut secs) = (None, 0f32, 0u64, 0f64);
    for _ in 0..args.steps {
        let m = trainer.step().map_err(|e| exec_error(e, &model, &parallel))?;
        first.get_or_insert(m.loss);
        last = m.loss;
        tokens += m.tokens;
        secs += m.step_seconds;
        bar.set_message(format!(
            "loss {:.4} | {:.0} tok/s | {:.1} ms/step | peak {}",
            m.loss,
            m.tokens_per_second,
            m.step_seconds * 1e3,
            bytes(m.peak_value_bytes)
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
            eprintln!("interrupted: stopped cleanly after step {}", trainer.steps_done());
            return Ok(Some(INTERRUPTED));
        }
    }
    bar.finish_and_clear();
    let summary = format!(
        "trained {} steps of {}: loss {:.4} -> {:.4}, {:.0} tokens/s\n",
        trainer.steps_done(),
        model.config.name(),
        first.unwrap_or(last),
        last,
        tokens as f64 / secs.max(1e-9)
    );
    crate::emit(&summary)?;
    Ok(None)
}

/// Bad data files are bad input (exit 2); divergence and internal errors are failures.
fn exec_error(e: ExecError, model: &LoadedModel, parallel: &LoadedParallel) -> CliError {
    let file = &parallel.origin.file;
    match e {
        // Shape errors (a sequence longer than the model's context...) point into the specs.
        ExecError::Trace(t) => CliError::Input(trace_error(t, model, Some(parallel))),
        ExecError::Data(msg) => CliError::Input(
            SpecError::file(file, format!("data: {msg}"))
                .help("fix the token file, or its `dtype`, in the spec's `data` section"),
        ),
        ExecError::Unsupported(msg) => CliError::Input(SpecError::file(file, msg)),
        other => CliError::Other(anyhow::Error::new(other)),
    }
}
