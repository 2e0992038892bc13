//! `shardplan plan --auto`: the fastest plan within the memory budget, the candidates it
//! beat, and what each knob bought.

use crate::plan::{make_plan_and_graph, write_out, Format, PlanArgs};
use crate::CliError;
use anyhow::Context;
use shardplan_frontends::{LoadedModel, LoadedParallel, Offload, ParallelConfig, SpecError};
use shardplan_planner::auto::{knob_effects, search, spec_yaml, Candidate, Fixed, NoFit, DEFAULT_RESERVE};
use shardplan_planner::print::{bytes, ms};
use std::fmt::Write as _;

fn table(o: &mut String, cands: &[Candidate], top: usize) {
    let _ = writeln!(
        o,
        "  {:>3}  {:<9} {:>6}  {:<7} {:<8} {:<13} {:<7} {:>12} {:>6} {:>11} {:>11}  fits",
        "#", "mesh", "blocks", "reshard", "prefetch", "checkpoint", "offload", "step", "MFU", "exposed", "peak"
    );
    for (i, c) in cands.iter().take(top).enumerate() {
        let k = &c.knobs;
        let _ = writeln!(
            o,
            "  {:>3}  {:<9} {:>6}  {:<7} {:<8} {:<13} {:<7} {:>12} {:>5.1}% {:>11} {:>11}  {}",
            i + 1,
            format!("{}x{}", k.replicate, k.shard),
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
            if c.fits { "yes" } else { "no" }
        );
    }
}

/// What the user fixed in the spec.
fn fixed(p: &LoadedParallel) -> Fixed {
    let o = &p.origin;
    Fixed {
        mesh_split: o.has("mesh.replicate"),
        bucketing: o.has("bucket_mib") || o.has("wrap_modules"),
        reshard: o.has("reshard_after_forward"),
        prefetch: o.has("prefetch"),
        checkpointing: o.has("activation_checkpointing"),
        offload: o.has("offload"),
    }
}

/// Single changes that might make a search fit, and whether they do.
fn what_would_fit(model: &LoadedModel, parallel: &LoadedParallel, budget: u64) -> Vec<String> {
    let base = &parallel.config;
    let mut tries: Vec<(String, ParallelConfig)> = Vec::new();
    let mut more = base.clone();
    more.mesh.shard *= 2;
    tries.push((
        format!(
            "twice the ranks ({} instead of {})",
            more.mesh.world(),
            base.mesh.world()
        ),
        more,
    ));
    if base.batch.per_rank > 1 {
        let mut smaller = base.clone();
        smaller.batch.per_rank /= 2;
        smaller.batch.grad_accum *= 2;
        tries.push((
            format!(
                "batch.per_rank {} with grad_accum {} (same global batch)",
                smaller.batch.per_rank, smaller.batch.grad_accum
            ),
            smaller,
        ));
    }
    if base.offload == Offload::None {
        let mut off = base.clone();
        off.offload = Offload::Cpu;
        tries.push(("offload: cpu".into(), off));
    }
    let mut out = Vec::new();
    for (what, config) in tries {
        let p = LoadedParallel {
            config: config.clone(),
            origin: parallel.origin.clone(),
        };
        let Ok((_, joint)) = make_plan_and_graph(model, &p, &config) else {
            continue;
        };
        if let Ok(Ok(r)) = search(&joint, &config, fixed(parallel), budget, true) {
            out.push(format!("{what} fits ({})", bytes(r.winner.memory.peak)));
        }
    }
    out
}

pub fn run(args: &PlanArgs, model: &LoadedModel, parallel: &LoadedParallel) -> Result<(), CliError> {
    let base = &parallel.config;
    let budget = args
        .memory_budget
        .unwrap_or((base.hardware.hbm_gib * (1u64 << 30) as f64 * (1.0 - DEFAULT_RESERVE)) as u64);
    let (_, joint) = make_plan_and_graph(model, parallel, base)?;
    let found = search(&joint, base, fixed(parallel), budget, true)
        .map_err(|e| CliError::Input(parallel.origin.error(e.field(), e.to_string(), e.help())))?;
    let r = match found {
        Ok(r) => r,
        Err(NoFit { best, budget }) => {
            let fits = what_would_fit(model, parallel, budget);
            let help = if fits.is_empty() {
                "no single change (twice the ranks, half the per-rank batch, CPU offload) fits; combine them or use a smaller model".to_string()
            } else {
                fits.join("; ")
            };
            return Err(CliError::Input(
                SpecError::file(
                    &parallel.origin.file,
                    format!(
                        "no plan fits the budget of {} per rank: the smallest candidate needs {} ({} over: mesh {}x{}, checkpointing {}, reshard {}, offload {})",
                        bytes(budget),
                        bytes(best.peak),
                        bytes(best.peak.saturating_sub(budget)),
                        best.knobs.replicate,
                        best.knobs.shard,
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
    let effects = knob_effects(&r.candidates);
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
            table(&mut o, &r.candidates, args.top);
            let _ = writeln!(o, "the winner, knob by knob:");
            for e in &effects {
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
            }))
            .context("serialising the search")?
                + "\n"
        }
        Format::Trace => {
            serde_json::to_string(&shardplan_planner::trace::chrome_trace(&winner, 0))
                .context("serialising the trace")?
                + "\n"
        }
    };
    write_out(args, &text)
}
