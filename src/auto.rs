//! `shardplan plan --auto`: the fastest plan within the memory budget, the candidates it
//! beat, and what each knob bought.

use crate::plan::{make_plan_and_graph, write_out, Format, PlanArgs};
use crate::CliError;
use anyhow::Context;
use shardplan_frontends::spec_yaml;
use shardplan_frontends::{LoadedModel, LoadedParallel, SpecError};
use shardplan_planner::alternatives::try_search_alternatives;
use shardplan_planner::auto::{default_budget, knob_effects, search_model, Candidate, Fixed, NoFit};
use shardplan_planner::print::{bytes, ms};
use std::fmt::Write as _;

mod pipeline;

fn table(o: &mut String, cands: &[Candidate], top: usize, budget: u64) {
    // A float8 column only when the search tried Float8 (`float8:` without a recipe).
    let float8 = cands.iter().any(|c| c.knobs.float8 != "none");
    let _ = writeln!(
        o,
        "  {:>3}  {:<9} {:>6}  {:<7} {:<8} {:<13} {:<7} {:>12} {:>6} {:>11} {:>11} {:>11}  fits{}",
        "#",
        "mesh",
        "blocks",
        "reshard",
        "prefetch",
        "checkpoint",
        "offload",
        "step",
        "MFU",
        "exposed",
        "peak",
        "device",
        if float8 { "  float8" } else { "" }
    );
    for (i, c) in cands.iter().take(top).enumerate() {
        let k = &c.knobs;
        let _ = writeln!(
            o,
            "  {:>3}  {:<9} {:>6}  {:<7} {:<8} {:<13} {:<7} {:>12} {:>5.1}% {:>11} {:>11} {:>11}  {}{}",
            i + 1,
            k.mesh(),
            if k.blocks_per_group == 0 {
                "spec".to_string()
            } else {
                k.blocks_per_group.to_string()
            },
            k.reshard_after_forward,
            format!("{}/{}", k.prefetch_forward, k.prefetch_backward),
            k.activation_checkpointing,
            if k.offload { "cpu" } else { "none" },
            ms(c.step_s),
            c.mfu * 100.0,
            ms(c.exposed_comm_s),
            bytes(c.peak),
            // A bound when the allocated peak and overheads alone exceed the budget.
            if c.device_exact {
                bytes(c.device)
            } else {
                format!(">{}", bytes(c.device))
            },
            fits(c, budget),
            if float8 {
                " ".repeat(6usize.saturating_sub(fits(c, budget).len())) + &k.float8
            } else {
                String::new()
            }
        );
    }
    if cands.iter().take(top).any(|c| fits(c, budget) == "-") {
        let _ = writeln!(
            o,
            "  -: not replayed through the allocator, being slower than a candidate that fits (its device total is a lower bound)"
        );
    }
}

/// `yes`, `no`, or `-` where the search left the fit open ([`Candidate::fits_budget`]).
fn fits(c: &Candidate, budget: u64) -> &'static str {
    match c.fits_budget(budget) {
        Some(true) => "yes",
        Some(false) => "no",
        None => "-",
    }
}

/// `plan --auto`: the specs from `args`, searched.
pub fn run_args(args: &PlanArgs) -> Result<(), CliError> {
    let model = shardplan_frontends::load_model(&args.model)?;
    let parallel = shardplan_frontends::load_parallel(&args.parallel)?;
    run(args, &model, &parallel)
}

pub fn run(args: &PlanArgs, model: &LoadedModel, parallel: &LoadedParallel) -> Result<(), CliError> {
    let base = &parallel.config;
    let budget = args.memory_budget.unwrap_or_else(|| default_budget(&base.hardware));
    if base.pipeline.is_some() {
        return pipeline::run(args, model, parallel, budget);
    }
    let fixed = Fixed::from_origin(&parallel.origin);
    // The spec must plan as written (its errors are the user's); the search then traces
    // the model again at each tensor-parallel degree it tries.
    make_plan_and_graph(model, parallel, base)?;
    let found = search_model(&model.config, base, fixed, budget, true)
        .map_err(|e| CliError::Input(parallel.origin.error(e.field(), e.to_string(), e.help())))?;
    let r = match found {
        Ok(r) => r,
        Err(NoFit { best, budget }) => {
            let fits: Vec<String> = try_search_alternatives(&model.config, base, fixed, budget)
                .into_iter()
                .filter(|t| t.fits)
                .map(|t| format!("{} fits ({})", t.change, bytes(t.device)))
                .collect();
            let help = if fits.is_empty() {
                "no single change (twice the ranks, half the per-rank batch, CPU offload) fits; combine them or use a smaller model".to_string()
            } else {
                fits.join("; ")
            };
            return Err(CliError::Input(
                SpecError::file(
                    &parallel.origin.file,
                    format!(
                        "no plan fits the budget of {} per rank: the smallest candidate needs {} of device memory ({} over: mesh {}, checkpointing {}, reshard {}, offload {})",
                        bytes(budget),
                        bytes(best.device),
                        bytes(best.device.saturating_sub(budget)),
                        best.knobs.mesh(),
                        best.knobs.activation_checkpointing,
                        best.knobs.reshard_after_forward,
                        if best.knobs.offload { "cpu" } else { "none" }
                    ),
                )
                .help(help),
            ));
        }
    };
    let mut winner = r.winner.clone();
    winner.source = Some(shardplan_planner::PlanSource {
        model: model.config.clone(),
        parallel: r.config.clone(),
    });
    if let Some(path) = &args.emit_spec {
        std::fs::write(path, spec_yaml(&r.config)).with_context(|| format!("cannot write {}", path.display()))?;
    }
    let effects = knob_effects(&r.candidates, budget);
    let text = match args.format {
        Format::Text => {
            let mut o = String::new();
            let _ = writeln!(
                o,
                "auto: {} candidates planned ({} pruned by the monotone rules), the winner verified; budget {} per rank; the best {}:",
                r.evaluated,
                r.pruned,
                bytes(budget),
                args.top.min(r.candidates.len())
            );
            table(&mut o, &r.candidates, args.top, budget);
            let _ = writeln!(o, "the winner, knob by knob:");
            for e in effects.iter().chain(&r.context_effects) {
                let _ = writeln!(o, "  {e}");
            }
            o.push('\n');
            o.push_str(&shardplan_planner::print::text(
                &winner,
                args.rank.min(winner.mesh.world() - 1),
            ));
            o
        }
        Format::Json => {
            serde_json::to_string(&serde_json::json!({
                "plan": winner,
                "budget": budget,
                "evaluated": r.evaluated,
                "pruned": r.pruned,
                "candidates": r.candidates,
                "knob_effects": effects,
                "context_effects": r.context_effects,
            }))
            .context("serialising the search")?
                + "\n"
        }
        Format::Trace => {
            serde_json::to_string(&shardplan_planner::trace::chrome_trace(&winner, 0))
                .context("serialising the trace")?
                + "\n"
        }
        Format::PpCsv => {
            return Err(CliError::Input(parallel.origin.error(
                "mesh",
                "--format pp-csv writes a pipeline's schedule, and this spec has no pipeline",
                "add a pipeline section to search pipelines, or use --format text, json or trace",
            )))
        }
    };
    write_out(args, &text)
}
