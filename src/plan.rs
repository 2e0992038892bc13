//! `shardplan plan`: the whole sharded training step, decided, costed and verified.

use crate::CliError;
use anyhow::Context;
use clap::{Args, ValueEnum};
use shardplan_frontends::{
    load_model, load_parallel, trace_error, trace_options, LoadedModel, LoadedParallel, ParallelConfig, SpecError,
};
use shardplan_ir::differentiate_with;
use shardplan_models::trace;
use shardplan_planner::alternatives::try_plan_alternatives;
use shardplan_planner::print::bytes;
use shardplan_planner::{plan_in, shardplan_executor_prediction, verify, Plan, PlanCache};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Model: a YAML model spec, a Hugging Face config.json, or a preset name.
    #[arg(long, value_name = "FILE")]
    pub model: PathBuf,
    /// Parallel spec (YAML): mesh, wrap policy, resharding, prefetch, precision, batch, hardware.
    #[arg(long, value_name = "FILE")]
    pub parallel: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Write the output to this file instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// The rank whose schedule (text) or timeline (trace) is shown.
    #[arg(long, value_name = "R", default_value_t = 0)]
    pub rank: u64,
    /// Per-rank device memory limit (`80GiB`, `79.6GB`, `1024MiB`, bytes); the plan's device
    /// total (allocator reserved peak + CUDA context + NCCL buffers) must fit.
    /// With --auto the default is the hardware's memory.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub memory_budget: Option<u64>,
    /// Search the knobs the spec leaves out (mesh split unless `mesh.replicate` is written,
    /// bucketing, resharding, prefetch, checkpointing, offload) for the fastest plan that fits.
    #[arg(long)]
    pub auto: bool,
    /// With --auto: candidates shown in the table.
    #[arg(long, value_name = "K", default_value_t = 5, requires = "auto")]
    pub top: usize,
    /// With --auto: write the winning parallel spec as YAML (reproducible without --auto).
    #[arg(long, value_name = "FILE", requires = "auto")]
    pub emit_spec: Option<PathBuf>,
    /// Print the plan's predictions beside what a run measured: a `shardplan train --log`
    /// file, or a JSON object (tokens_per_second, step_seconds, peak_allocated,
    /// peak_reserved) from any framework, with ratios.
    #[arg(long, value_name = "METRICS", conflicts_with = "auto")]
    pub compare: Option<PathBuf>,
    /// Replay a run's allocator requests (the exported program's `--alloc-trace` file)
    /// through the plan's model of the caching allocator, beside the plan's own requests,
    /// under both allocator settings.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["auto", "compare"])]
    pub alloc_trace: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    /// Summary, groups table and one rank's schedule.
    Text,
    /// The Plan as JSON (versioned; `shardplan train --plan` reads it).
    Json,
    /// A Chrome / Perfetto trace of the simulated timeline.
    Trace,
    /// A pipeline's compute-only schedule in torch.distributed.pipelining's CSV format
    /// (one row a pipeline rank), as `pipeline.csv` and torchtitan's
    /// `pipeline_parallel_schedule_csv` read it.
    PpCsv,
}

/// `80GiB`, `1.5 TB`, `512MiB`, `1000` (bytes).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a size; write it like 80GiB, 79.6GB or 1024MiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0f64.powi(3),
        "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{s}`; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"
            ))
        }
    };
    let bytes = v * mult;
    if !bytes.is_finite() || bytes <= 0.0 || bytes >= u64::MAX as f64 {
        return Err(format!("`{s}` is not a positive size"));
    }
    Ok(bytes as u64)
}

/// Traces, differentiates and plans `model` under `config`.
pub fn make_plan(model: &LoadedModel, parallel: &LoadedParallel, config: &ParallelConfig) -> Result<Plan, CliError> {
    make_plan_and_graph(model, parallel, config).map(|(p, _)| p)
}

/// As [`make_plan`], also returning the joint graph the plan was made for.
pub fn make_plan_and_graph(
    model: &LoadedModel,
    parallel: &LoadedParallel,
    config: &ParallelConfig,
) -> Result<(Plan, shardplan_ir::JointGraph), CliError> {
    make_plan_and_graph_traced(model, parallel, config, true)
}

/// As [`make_plan_and_graph`]; `overlap: false` traces each MoE block in torchtitan's order
/// whatever the runtime (`ExpertOptions::overlap`), as `export fsdp2` needs: FSDP2 calls
/// the routed experts' module once between the router and the shared expert.
pub fn make_plan_and_graph_traced(
    model: &LoadedModel,
    parallel: &LoadedParallel,
    config: &ParallelConfig,
    overlap: bool,
) -> Result<(Plan, shardplan_ir::JointGraph), CliError> {
    // Routing is data-dependent: a plan sized at the capacity bound is stated beside the
    // same spec routed evenly, what the bound costs (what `train --plan` checks too). That
    // second plan (`None` for any other spec) is made on a thread of its own beside this one.
    let (planned, even) = std::thread::scope(|scope| {
        let even = scope.spawn(|| shardplan_planner::rederive::even_split(&model.config, config));
        let planned = trace_and_plan(model, parallel, config, overlap);
        (
            planned,
            even.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
        )
    });
    let (mut p, joint) = planned?;
    p.source = Some(shardplan_planner::PlanSource {
        model: model.config.clone(),
        parallel: config.clone(),
    });
    let even = even.map_err(|r| match r {
        shardplan_planner::rederive::Refusal::Plan(e) => {
            CliError::Input(parallel.origin.error(e.field(), e.to_string(), e.help()))
        }
        other => anyhow::anyhow!("{other}").into(),
    })?;
    if let Some(e) = p.experts.as_mut() {
        e.even = even;
    }
    Ok((p, joint))
}

/// The model traced at `config`'s shape, differentiated and planned; errors located in
/// the spec files.
fn trace_and_plan(
    model: &LoadedModel,
    parallel: &LoadedParallel,
    config: &ParallelConfig,
    overlap: bool,
) -> Result<(Plan, shardplan_ir::JointGraph), CliError> {
    let joint = trace_joint(model, parallel, config, overlap)?;
    let located =
        |e: shardplan_planner::PlanError| CliError::Input(parallel.origin.error(e.field(), e.to_string(), e.help()));
    let mut cache = PlanCache::default();
    let (mut plan, _) = plan_in(&joint, config, &mut cache).map_err(located)?;
    // Under another runtime, shardplan's own executor's prediction of the same spec is
    // printed beside it.
    plan.shardplan_executor = shardplan_executor_prediction(&joint, config, &mut cache).map_err(located)?;
    Ok((plan, joint))
}

/// The model traced at `config`'s shape and differentiated; errors located in the spec
/// files.
fn trace_joint(
    model: &LoadedModel,
    parallel: &LoadedParallel,
    config: &ParallelConfig,
    overlap: bool,
) -> Result<shardplan_ir::JointGraph, CliError> {
    let p = LoadedParallel {
        config: config.clone(),
        origin: parallel.origin.clone(),
    };
    let mut opts = trace_options(Some(&p));
    opts.expert.overlap &= overlap;
    let graph = trace(&model.config, opts).map_err(|e| trace_error(e, model, Some(&p)))?;
    Ok(differentiate_with(&graph, config.diff_options())
        .map_err(|e| anyhow::anyhow!("differentiating {}: {e}", graph.name()))?)
}

fn over_budget(model: &LoadedModel, parallel: &LoadedParallel, p: &Plan, budget: u64) -> CliError {
    let peak_at = p
        .programs
        .first()
        .and_then(|pr| pr.instrs.get(p.memory.peak_instr as usize))
        .map(|i| shardplan_planner::print::describe(p, i))
        .unwrap_or_default();
    // Fitting changes first, then the closest misses.
    let tried = try_plan_alternatives(&model.config, &parallel.config, budget);
    let fits: Vec<String> = tried
        .iter()
        .filter(|t| t.fits)
        .map(|t| format!("`{}` ({})", t.change, bytes(t.device)))
        .collect();
    let help = if fits.is_empty() {
        match tried.first() {
            Some(best) => format!(
                "no single change fits; the closest is `{}` at {}; combine changes or add ranks",
                best.change,
                bytes(best.device)
            ),
            None => "add ranks, shorten the sequence or lower the batch".into(),
        }
    } else {
        format!("each of these single changes fits: {}", fits.join("; "))
    };
    CliError::Input(
        SpecError::file(
            &parallel.origin.file,
            format!(
                "the plan needs {} of device memory per rank (reserved {} + CUDA context and NCCL {}; allocated peak {} at #{} {peak_at}), {} over the memory budget of {}",
                bytes(p.memory.device_total),
                bytes(p.memory.reserved_peak),
                bytes(p.memory.overhead.total()),
                bytes(p.memory.peak),
                p.memory.peak_instr,
                bytes(p.memory.device_total.saturating_sub(budget)),
                bytes(budget)
            ),
        )
        .help(help),
    )
}

pub fn run(args: &PlanArgs) -> Result<(), CliError> {
    let model = load_model(&args.model)?;
    let parallel = load_parallel(&args.parallel)?;
    let world = parallel.config.mesh.world();
    if args.rank >= world {
        return Err(CliError::Input(parallel.origin.error(
            "mesh",
            format!("--rank {} is not a rank of this {world}-rank mesh", args.rank),
            format!("use --rank between 0 and {}", world - 1),
        )));
    }
    if parallel.config.pipeline.is_some() {
        return run_pipeline(args, &model, &parallel);
    }
    if let Some(file) = &args.alloc_trace {
        let trace = crate::alloc_trace::read(file)?;
        let (p, joint) = make_plan_and_graph(&model, &parallel, &parallel.config)?;
        let c = crate::alloc_trace::compare(&p, &joint, &parallel.config, &trace);
        let out = match args.format {
            Format::Json => serde_json::to_string(&c).context("serialising the comparison")? + "\n",
            Format::Text => crate::alloc_trace::text(&c, file),
            Format::Trace | Format::PpCsv => {
                return Err(CliError::Usage(
                    "--alloc-trace prints a comparison of allocator replays, as text or JSON\n  help: use --format text or --format json with --alloc-trace".into(),
                ))
            }
        };
        return write_out(args, &out);
    }
    let p = make_plan(&model, &parallel, &parallel.config)?;
    if let Some(budget) = args.memory_budget {
        if verify(&p, Some(budget)).is_err() {
            return Err(over_budget(&model, &parallel, &p, budget));
        }
    }
    if let Some(file) = &args.compare {
        let measured = crate::compare::read(file)?;
        return write_out(args, &crate::compare::table(&p, &measured, file));
    }
    let text = match args.format {
        Format::Text => shardplan_planner::print::text(&p, args.rank),
        Format::Json => serde_json::to_string(&p).context("serialising the plan")? + "\n",
        Format::Trace => {
            serde_json::to_string(&shardplan_planner::trace::chrome_trace(&p, args.rank))
                .context("serialising the trace")?
                + "\n"
        }
        Format::PpCsv => {
            return Err(CliError::Input(parallel.origin.error(
                "mesh",
                "--format pp-csv writes a pipeline's schedule, but the mesh has no pipeline axis",
                "set mesh.pipeline to 2 or more, or use --format text, json or trace",
            )))
        }
    };
    write_out(args, &text)
}

/// `plan` of a spec with a pipeline axis: the stages, the schedule, its timeline and every
/// rank's memory, as text, JSON, a trace or torch's CSV.
fn run_pipeline(args: &PlanArgs, model: &LoadedModel, parallel: &LoadedParallel) -> Result<(), CliError> {
    let config = &parallel.config;
    let refused = |what: &str| {
        CliError::Input(parallel.origin.error(
            "mesh.pipeline",
            format!("{what} of a pipeline plan is not made yet: `shardplan plan` prints the pipeline's stages, timeline and every rank's memory"),
            "leave it out: plan with --format text, json, trace or pp-csv",
        ))
    };
    if args.compare.is_some() || args.memory_budget.is_some() || args.alloc_trace.is_some() {
        return Err(refused("--compare, --memory-budget or --alloc-trace"));
    }
    let custom = custom_schedule(parallel)?;
    let forward =
        trace(&model.config, trace_options(Some(parallel))).map_err(|e| trace_error(e, model, Some(parallel)))?;
    let plan = shardplan_planner::pipeline::plan_pipeline(&forward, config, custom)
        .map_err(|e| CliError::Input(parallel.origin.error(e.field(), e.to_string(), e.help())))?;
    let text = match args.format {
        Format::Text => shardplan_planner::pipeline::print::text(&plan, config.batch.per_rank),
        Format::PpCsv => shardplan_planner::pipeline::write_csv(&plan.program.compute),
        Format::Json => {
            serde_json::to_string(&shardplan_planner::pipeline::to_json(&plan)).context("serialising the plan")? + "\n"
        }
        Format::Trace => {
            serde_json::to_string(&shardplan_planner::pipeline::chrome_trace(&plan)).context("serialising the trace")?
                + "\n"
        }
    };
    write_out(args, &text)
}

/// The spec's `pipeline.csv`, read and validated (refused naming the file, the cell and
/// the rank and slot that break it); `None` where the spec names none.
pub(crate) fn custom_schedule(
    parallel: &LoadedParallel,
) -> Result<Option<shardplan_planner::pipeline::CustomSchedule>, CliError> {
    use shardplan_planner::pipeline::{read_csv, validate_custom, MAX_CSV_BYTES};
    let Some(pipeline) = &parallel.config.pipeline else {
        return Ok(None);
    };
    let Some(path) = &pipeline.csv else {
        return Ok(None);
    };
    let refuse = |message: String, help: &str| CliError::Input(SpecError::file(path, message).help(help));
    let bytes = std::fs::metadata(path)
        .map_err(|e| {
            CliError::Input(parallel.origin.error(
                "pipeline.csv",
                format!("cannot read the schedule {}: {e}", path.display()),
                "give the path of a CSV file, relative to the spec",
            ))
        })?
        .len();
    if bytes > MAX_CSV_BYTES as u64 {
        return Err(refuse(
            format!("{bytes} bytes is more than a schedule may take ({MAX_CSV_BYTES})"),
            "write one row a pipeline rank",
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| {
        refuse(
            format!("cannot read it as text: {e}"),
            "write a UTF-8 CSV file, as torch's _dump_csv does",
        )
    })?;
    let rows = read_csv(&text).map_err(|e| {
        refuse(
            e.to_string(),
            "write one row a pipeline rank, a cell an action like 2F0 (empty: idle)",
        )
    })?;
    let ranks = u32::try_from(parallel.config.mesh.pipeline).unwrap_or(u32::MAX);
    let microbatches = u32::try_from(pipeline.microbatches).unwrap_or(u32::MAX);
    let custom = validate_custom(&rows, ranks, microbatches)
        .map_err(|e| refuse(e.to_string(), "fix the schedule at the rank and slot named; `shardplan plan --format pp-csv` writes a valid one to start from"))?;
    Ok(Some(custom))
}

/// Writes a command's output to `--out` or stdout.
pub fn write_out(args: &PlanArgs, text: &str) -> Result<(), CliError> {
    match &args.out {
        Some(path) => std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?,
        None => crate::emit(text)?,
    }
    Ok(())
}
