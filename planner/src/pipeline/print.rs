//! The text form of a pipeline plan: the schedule and its size, the stages with their
//! modules and times, the step's bubble, and the timeline with time down the page and one
//! column a rank, as torch prints a pipeline order.

use super::plan::PipelinePlan;
use super::timeline::Timeline;
use crate::print::{bytes, ms};
use std::fmt::Write;

/// Most timeline rows; past it a row covers more time than the shortest action.
const MAX_ROWS: usize = 400;

/// The whole report.
pub fn text(plan: &PipelinePlan, per_rank: u64) -> String {
    let mut out = String::new();
    let p = &plan.program;
    let s = p.shape;
    let microbatch = per_rank / u64::from(s.microbatches);
    let stage_word = if s.stages_per_rank == 1 { "stage" } else { "stages" };
    let schedule = p.schedule.map_or("custom schedule".to_string(), |s| s.to_string());
    let placement = match p.schedule.map(super::placement) {
        Some(super::Placement::Loop) => "loop placement",
        Some(super::Placement::V) => "V placement",
        None => "placed by the schedule file",
    };
    let _ = writeln!(
        out,
        "pipeline  {schedule}, {} ranks x {} {stage_word} = {} stages ({placement}), {} micro-batches of {microbatch} {}",
        s.ranks,
        s.stages_per_rank,
        p.stages(),
        s.microbatches,
        if microbatch == 1 { "sequence" } else { "sequences" }
    );
    let t = &plan.timeline;
    let _ = writeln!(
        out,
        "step      {}: the pipeline's program {} (bubble {:.1}% of rank-time), then the optimizer",
        ms(plan.step_s),
        ms(t.makespan),
        100.0 * t.bubble()
    );
    let _ = writeln!(
        out,
        "p2p       {} of activations per micro-batch across each stage boundary, {} a hop",
        bytes(plan.boundary_bytes),
        ms(plan.p2p_s)
    );
    memory_line(&mut out, plan);
    out.push('\n');
    stages_table(&mut out, plan);
    out.push('\n');
    memory_table(&mut out, plan);
    out.push('\n');
    busy_table(&mut out, t);
    out.push('\n');
    timeline(&mut out, t);
    out
}

/// The largest rank's memory against the device: allocated bytes at its peak plus the
/// process's CUDA context and NCCL buffers (its stages' FSDP plan's overhead).
fn memory_line(out: &mut String, plan: &PipelinePlan) {
    let Some((top, device)) = plan.largest_rank() else {
        return;
    };
    let Some(stage) = plan.stages.iter().find(|s| s.rank == top.rank) else {
        return;
    };
    let hw = &stage.fsdp.hardware;
    let hbm = hw.hbm_bytes();
    let verdict = if device <= hbm {
        format!("fits {}'s {} ({} spare)", hw.name, bytes(hbm), bytes(hbm - device))
    } else {
        format!(
            "DOES NOT FIT {}'s {}: {} over",
            hw.name,
            bytes(hbm),
            bytes(device - hbm)
        )
    };
    let _ = writeln!(
        out,
        "memory    {} on pipeline rank {} at its peak ({} allocated + {} CUDA context and NCCL): {verdict}",
        bytes(device),
        top.rank,
        bytes(top.peak),
        bytes(device - top.peak)
    );
}

/// Every pipeline rank's allocated bytes at its peak by part, the largest first (as
/// torchtitan reports a pipeline run's memory).
fn memory_table(out: &mut String, plan: &PipelinePlan) {
    let _ = writeln!(
        out,
        "rank  peak        sharded state  params whole  grads whole  activations  in flight  receives   at action"
    );
    let mut ranks: Vec<&super::RankMemory> = plan.memory.iter().collect();
    ranks.sort_by(|a, b| b.peak.cmp(&a.peak).then(a.rank.cmp(&b.rank)));
    for r in ranks {
        let at = plan.program.lowered[r.rank as usize]
            .get(r.at)
            .map_or_else(String::new, |a| a.to_string());
        let _ = writeln!(
            out,
            "{:<4}  {:<10}  {:<13}  {:<12}  {:<11}  {:<11}  {:<9}  {:<9}  {at}",
            r.rank,
            bytes(r.peak),
            bytes(r.state),
            bytes(r.params_unsharded),
            bytes(r.grads_unsharded),
            bytes(r.activations),
            r.in_flight,
            bytes(r.receives)
        );
    }
}

fn stages_table(out: &mut String, plan: &PipelinePlan) {
    let _ = writeln!(
        out,
        "stage  rank  params       forward     backward    (input + weight)  modules"
    );
    for (i, st) in plan.stages.iter().enumerate() {
        let b = st.times.backward_input + st.times.backward_weight;
        let _ = writeln!(
            out,
            "{i:<5}  {:<4}  {:<11}  {:<10}  {:<10}  {} + {}  {}",
            st.rank,
            st.params,
            ms(st.times.forward),
            ms(b),
            ms(st.times.backward_input),
            ms(st.times.backward_weight),
            modules_span(&st.modules)
        );
    }
}

/// `tok_embeddings, layers.0-3` for a run of consecutive numbered modules.
fn modules_span(modules: &[String]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut run: Option<(String, u64, u64)> = None;
    let flush = |run: &mut Option<(String, u64, u64)>, parts: &mut Vec<String>| {
        if let Some((prefix, a, b)) = run.take() {
            parts.push(if a == b {
                format!("{prefix}.{a}")
            } else {
                format!("{prefix}.{a}-{b}")
            });
        }
    };
    for m in modules {
        let numbered = m
            .rsplit_once('.')
            .and_then(|(p, n)| n.parse::<u64>().ok().map(|n| (p.to_string(), n)));
        match (numbered, &mut run) {
            (Some((p, n)), Some((rp, _, b))) if *rp == p && *b + 1 == n => *b = n,
            (Some((p, n)), _) => {
                flush(&mut run, &mut parts);
                run = Some((p, n, n));
            }
            (None, _) => {
                flush(&mut run, &mut parts);
                parts.push(m.clone());
            }
        }
    }
    flush(&mut run, &mut parts);
    parts.join(", ")
}

fn busy_table(out: &mut String, t: &Timeline) {
    let _ = writeln!(out, "rank  busy        idle");
    for r in 0..t.ranks.len() {
        let busy = t.busy(r);
        let _ = writeln!(
            out,
            "{r:<4}  {:<10}  {:.1}%",
            ms(busy),
            100.0 * (1.0 - busy / t.makespan.max(f64::MIN_POSITIVE))
        );
    }
}

/// Time down the page, a column a rank: an action's label where it starts, `|` while it
/// runs on, `.` where the rank idles.
fn timeline(out: &mut String, t: &Timeline) {
    let shortest = t
        .ranks
        .iter()
        .flatten()
        .map(|s| s.end - s.start)
        .filter(|d| *d > 0.0)
        .fold(f64::INFINITY, f64::min);
    if !shortest.is_finite() || t.makespan <= 0.0 {
        return;
    }
    let row = shortest.max(t.makespan / MAX_ROWS as f64);
    let rows = (t.makespan / row).ceil() as usize;
    let width = t
        .ranks
        .iter()
        .flatten()
        .map(|s| s.action.to_string().len())
        .max()
        .unwrap_or(1)
        .max(6);
    let _ = writeln!(
        out,
        "timeline  one row = {}; F forward, B backward, I/W its input/weight halves, [stage]KIND[micro-batch]",
        ms(row)
    );
    let header: Vec<String> = (0..t.ranks.len())
        .map(|r| format!("{:<width$}", format!("rank {r}")))
        .collect();
    let _ = writeln!(out, "{:>10}  {}", "", header.join(" ").trim_end());
    let eps = row * 1e-6;
    let mut next = vec![0usize; t.ranks.len()];
    for i in 0..rows {
        let (from, to) = (i as f64 * row - eps, (i + 1) as f64 * row - eps);
        let cells: Vec<String> = t
            .ranks
            .iter()
            .enumerate()
            .map(|(r, spans)| {
                while next[r] < spans.len() && spans[next[r]].end <= from {
                    next[r] += 1;
                }
                // A span that starts in this row shows its label; one that started
                // before and runs on shows `|`; none, the rank idles.
                let in_row = spans[next[r]..]
                    .iter()
                    .take_while(|s| s.start < to)
                    .find(|s| s.start >= from);
                let cell = match (in_row, spans.get(next[r])) {
                    (Some(s), _) => s.action.to_string(),
                    (None, Some(s)) if s.start < from => "|".to_string(),
                    _ => ".".to_string(),
                };
                format!("{cell:<width$}")
            })
            .collect();
        let _ = writeln!(out, "{:>10}  {}", ms(from + eps), cells.join(" ").trim_end());
    }
}

#[cfg(test)]
mod tests {
    use super::modules_span;

    #[test]
    fn consecutive_layers_print_as_a_range() {
        let m: Vec<String> = [
            "tok_embeddings",
            "layers.0",
            "layers.1",
            "layers.2",
            "norm",
            "output",
            "loss",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(modules_span(&m), "tok_embeddings, layers.0-2, norm, output, loss");
        assert_eq!(modules_span(&["layers.5".into()]), "layers.5");
    }
}
