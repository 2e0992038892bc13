//! `shardplan plan --auto` of a pipeline spec: the fastest pipeline within the budget, the
//! candidates it beat, and why it won.

use crate::plan::{write_out, Format, PlanArgs};
use crate::CliError;
use anyhow::Context;
use shardplan_frontends::{spec_yaml, LoadedModel, LoadedParallel};
use shardplan_planner::pipeline::{search_pipeline, PipelineAuto, PipelineCandidate, PipelineFixed};
use shardplan_planner::print::{bytes, ms};
use std::fmt::Write as _;

/// Searches `parallel`'s open pipeline knobs for `model` within `budget` bytes a rank.
pub fn run(args: &PlanArgs, model: &LoadedModel, parallel: &LoadedParallel, budget: u64) -> Result<(), CliError> {
    let fixed = PipelineFixed::from_origin(&parallel.origin);
    let found = search_pipeline(&model.config, &parallel.config, fixed, budget)
        .map_err(|e| CliError::Input(parallel.origin.error(e.field(), e.to_string(), e.help())))?;
    if let Some(path) = &args.emit_spec {
        std::fs::write(path, spec_yaml(&found.config)).with_context(|| format!("cannot write {}", path.display()))?;
    }
    let text = match args.format {
        Format::Text => report(args, &found, budget),
        Format::Json => {
            serde_json::to_string(&serde_json::json!({
                "plan": shardplan_planner::pipeline::to_json(&found.winner),
                "budget": budget,
                "refused": found.refused,
                "candidates": found.candidates.iter().map(candidate_json).collect::<Vec<_>>(),
            }))
            .context("serialising the search")?
                + "\n"
        }
        Format::Trace => {
            serde_json::to_string(&shardplan_planner::pipeline::chrome_trace(&found.winner))
                .context("serialising the trace")?
                + "\n"
        }
        Format::PpCsv => shardplan_planner::pipeline::write_csv(&found.winner.program.compute),
    };
    write_out(args, &text)
}

/// The text report: the search, the best candidates, why the winner won, and its plan.
fn report(args: &PlanArgs, found: &PipelineAuto, budget: u64) -> String {
    let mut o = String::new();
    let c = &found.config;
    let _ = writeln!(
        o,
        "auto: {} pipelines planned ({} sizes torch refuses left out); budget {} per rank; pipeline x shard split over {} ranks, replicate {} and tensor {} kept, global batch {} kept; the best {}:",
        found.candidates.len(),
        found.refused,
        bytes(budget),
        c.mesh.pipeline * c.mesh.shard,
        c.mesh.replicate,
        c.mesh.tensor,
        c.batch.per_rank * c.mesh.data_parallel(),
        args.top.min(found.candidates.len())
    );
    let _ = writeln!(
        o,
        "  {:>3}  {:<12} {:<22} {:>2} {:>4}  {:<10} {:>12} {:>7} {:>11}  fits",
        "#", "mesh", "schedule", "V", "M", "checkpoint", "step", "bubble", "device"
    );
    for (i, k) in found.candidates.iter().take(args.top).enumerate() {
        let _ = writeln!(
            o,
            "  {:>3}  {:<12} {:<22} {:>2} {:>4}  {:<10} {:>12} {:>6.1}% {:>11}  {}",
            i + 1,
            format!("pp{} x {}", k.pipeline, k.shard),
            k.schedule.to_string(),
            k.stages_per_rank,
            k.microbatches,
            k.checkpointing.to_string(),
            ms(k.step_s),
            100.0 * k.bubble,
            bytes(k.device),
            if k.fits { "yes" } else { "no" }
        );
    }
    let _ = writeln!(o, "why:");
    for line in why(&found.candidates) {
        let _ = writeln!(o, "  {line}");
    }
    o.push('\n');
    o.push_str(&shardplan_planner::pipeline::print::text(
        &found.winner,
        c.batch.per_rank,
    ));
    o
}

/// Why the winner won: the fastest that fits; against it, the best fitting candidate of
/// every other schedule, and the fastest that does not fit.
fn why(cands: &[PipelineCandidate]) -> Vec<String> {
    let Some(w) = cands.first() else {
        return Vec::new();
    };
    let mut lines = vec![format!(
        "{} on pp{} x {} with {} a rank and {} micro-batches, checkpointing {}: {} a step (bubble {:.1}%), {} a rank, the fastest that fits",
        w.schedule,
        w.pipeline,
        w.shard,
        if w.stages_per_rank == 1 { "1 stage".to_string() } else { format!("{} stages", w.stages_per_rank) },
        w.microbatches,
        w.checkpointing,
        ms(w.step_s),
        100.0 * w.bubble,
        bytes(w.device)
    )];
    let mut seen = vec![w.schedule];
    for c in cands.iter().filter(|c| c.fits) {
        if seen.contains(&c.schedule) {
            continue;
        }
        seen.push(c.schedule);
        lines.push(format!(
            "the best {}: {} (+{:.1}%), bubble {:.1}%",
            c.schedule,
            ms(c.step_s),
            100.0 * (c.step_s / w.step_s - 1.0),
            100.0 * c.bubble
        ));
    }
    if let Some(c) = cands
        .iter()
        .filter(|c| !c.fits && c.step_s < w.step_s)
        .min_by(|a, b| a.step_s.total_cmp(&b.step_s))
    {
        lines.push(format!(
            "faster but over the budget: {} on pp{} x {}, checkpointing {}: {} needing {}",
            c.schedule,
            c.pipeline,
            c.shard,
            c.checkpointing,
            ms(c.step_s),
            bytes(c.device)
        ));
    }
    lines
}

fn candidate_json(c: &PipelineCandidate) -> serde_json::Value {
    serde_json::json!({
        "pipeline": c.pipeline,
        "shard": c.shard,
        "schedule": c.schedule.to_string(),
        "stages_per_rank": c.stages_per_rank,
        "microbatches": c.microbatches,
        "activation_checkpointing": c.checkpointing.to_string(),
        "step_s": c.step_s,
        "bubble": c.bubble,
        "device": c.device,
        "fits": c.fits,
    })
}
