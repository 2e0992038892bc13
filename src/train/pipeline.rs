//! `shardplan train` of a spec with a pipeline axis: the ranks the engine gives this
//! process (every rank as a thread, or one a process under MPI), each running its lowered
//! program (the one `shardplan plan` prints); the process holding rank 0 writes one JSON
//! line a step in `--log` and a summary with the measured step beside the planned one.

use super::TrainArgs;
use crate::CliError;
use shardplan_executor::train::engine::Engine;
use shardplan_executor::train::pipeline::{PipelineMetrics, PipelineTrainer};
use shardplan_frontends::{trace_error, trace_options, LoadedModel, LoadedParallel, SpecError};

/// Trains `model` with `parallel`'s pipeline on `device` for `--steps` steps, on the ranks
/// `engine` places here: started from `--init-from` or resumed from `--resume`,
/// checkpointed under `--checkpoint-dir` every `--checkpoint-every` steps and at the end.
pub fn run(
    args: &TrainArgs,
    engine: &dyn Engine,
    model: &LoadedModel,
    parallel: &LoadedParallel,
    device: candle_core::Device,
) -> Result<Option<u8>, CliError> {
    refuse_unsupported(args, parallel)?;
    let (mut trainer, planned, leader) = start(args, engine, model, parallel, device)?;
    let failed = |e: shardplan_executor::ExecError| CliError::Other(anyhow::anyhow!("{e}"));
    let mut log = super::open_log(args, leader)?;
    let bar = super::step_bar(args, leader, trainer.steps_done());
    let mut steps: Vec<PipelineMetrics> = Vec::new();
    while trainer.steps_done() < args.steps {
        let m = trainer.step().map_err(failed)?;
        bar.set_message(format!("loss {:.4} | {:.0} tokens/s", m.loss, m.tokens_per_second));
        bar.inc(1);
        super::log_line(&mut log, &m)?;
        steps.push(m);
        let done = trainer.steps_done();
        if args.checkpoint_every > 0 && done.is_multiple_of(args.checkpoint_every) && done < args.steps {
            save(args, &mut trainer).map_err(failed)?;
        }
    }
    bar.finish_and_clear();
    save(args, &mut trainer).map_err(failed)?;
    if leader {
        crate::emit(&summary(&steps, model, planned))?;
    }
    Ok(None)
}

/// The plan and the trainer of this process's ranks, resumed from `--resume`; the planned
/// step's seconds; whether this process holds rank 0.
fn start(
    args: &TrainArgs,
    engine: &dyn Engine,
    model: &LoadedModel,
    parallel: &LoadedParallel,
    device: candle_core::Device,
) -> Result<(PipelineTrainer, f64, bool), CliError> {
    let config = &parallel.config;
    let custom = crate::plan::custom_schedule(parallel)?;
    let forward = shardplan_models::trace(&model.config, trace_options(Some(parallel)))
        .map_err(|e| CliError::Input(trace_error(e, model, Some(parallel))))?;
    let plan = shardplan_planner::pipeline::plan_pipeline(&forward, config, custom)
        .map_err(|e| CliError::Input(parallel.origin.error(e.field(), e.to_string(), e.help())))?;
    let located = |e: shardplan_executor::ExecError| {
        CliError::Input(
            parallel
                .origin
                .error("mesh", e.to_string(), "see `shardplan plan` of this spec"),
        )
    };
    let placement = engine.place_pipeline(&config.mesh, &device).map_err(located)?;
    let leader = placement.ranks.iter().any(|(r, _)| *r == 0);
    let world = (config.mesh.pipeline * config.mesh.stage_world()) as usize;
    if args.checkpoint_dir.is_some() && placement.ranks.len() != world {
        return Err(CliError::Usage(
            "--checkpoint-dir with a pipeline over several processes: a pipeline checkpoint is put together by one process holding every rank; train with --backend local to save, or leave out --checkpoint-dir".into(),
        ));
    }
    let mut trainer = PipelineTrainer::from_placement(&model.config, config, &plan, args.steps, device, placement)
        .map_err(located)?;
    if let Some(path) = &args.init_from {
        trainer.init_from(path).map_err(|e| {
            CliError::Input(SpecError::file(path, e.to_string()).help(
                "give Hugging Face safetensors (a file, or a folder with an index) or a DCP checkpoint of this model",
            ))
        })?;
    }
    if let Some(dir) = &args.resume {
        let warnings = trainer.load(dir).map_err(|e| {
            CliError::Input(SpecError::file(dir, e.to_string()).help("give a shardplan checkpoint of this model"))
        })?;
        super::resumed(args, dir, warnings, leader, trainer.steps_done())?;
    }
    Ok((trainer, plan.step_s, leader))
}

/// Saves a checkpoint under `--checkpoint-dir` (when given), keeping the newest
/// `--checkpoint-keep`.
fn save(args: &TrainArgs, trainer: &mut PipelineTrainer) -> Result<(), shardplan_executor::ExecError> {
    if let Some(dir) = &args.checkpoint_dir {
        match args.checkpoint_format {
            super::CheckpointFormat::Shardplan => trainer.save(dir)?,
            super::CheckpointFormat::Dcp => trainer.save_dcp(dir)?,
        };
        shardplan_executor::ShardedTrainer::prune(dir, args.checkpoint_keep)?;
    }
    Ok(())
}

/// Refuses the options that read a plan's instruction streams, which a pipeline rank does
/// not run, naming the option and why.
fn refuse_unsupported(args: &TrainArgs, parallel: &LoadedParallel) -> Result<(), CliError> {
    let unsupported = [
        (
            args.trace.is_some(),
            "--trace",
            "the trace records each stream of an FSDP plan's program, and a pipeline rank runs its schedule's actions (`shardplan plan` prints them) instead of those streams",
        ),
        (
            args.profile.is_some(),
            "--profile",
            "the profile times the ops of the one graph an FSDP plan runs against its cost model, and a pipeline rank runs several stage graphs",
        ),
        (
            !args.inject_fault.is_empty(),
            "--inject-fault",
            "a fault is injected at a named instruction of an FSDP plan's program, which a pipeline step does not have",
        ),
    ];
    if let Some((_, what, why)) = unsupported.iter().find(|(given, _, _)| *given) {
        return Err(CliError::Usage(format!(
            "{what} with a pipeline (mesh.pipeline in {}): {why}; leave {what} out, or train the spec without its pipeline",
            parallel.origin.file.display()
        )));
    }
    Ok(())
}

/// The end-of-run summary: loss from first to last step, throughput, and the measured
/// step (the steps after the first) against the plan's.
fn summary(steps: &[PipelineMetrics], model: &LoadedModel, planned: f64) -> String {
    let (Some(first), Some(last)) = (steps.first(), steps.last()) else {
        return String::new();
    };
    let tokens: u64 = steps.iter().map(|m| m.tokens).sum();
    let secs: f64 = steps.iter().map(|m| m.step_seconds).sum();
    let warm = if steps.len() > 1 { &steps[1..] } else { steps };
    let measured = warm.iter().map(|m| m.step_seconds).sum::<f64>() / warm.len() as f64;
    format!(
        "trained {} steps of {} on a pipeline: loss {:.4} -> {:.4}, {:.0} tokens/s\nstep      measured {:.3} ms (mean after the first), planned {:.3} ms: {:.2}x\n",
        steps.len(),
        model.config.name(),
        first.loss,
        last.loss,
        tokens as f64 / secs.max(1e-9),
        measured * 1e3,
        planned * 1e3,
        measured / planned.max(1e-12)
    )
}
