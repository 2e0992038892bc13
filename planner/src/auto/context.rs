//! Why `--auto` chose its context degree: the search run again on each context degree it
//! tried alone, and each outcome worded against the winner.

use super::{search_spaces, Candidate, Fixed, NoFit};
use crate::PlanError;
use shardplan_frontends::ParallelConfig;
use shardplan_ir::JointGraph;

/// One line per context degree of `spaces` other than `winner`'s: its fastest candidate
/// that fits `budget` (and how much slower than `winner`), or the least device memory any
/// of its candidates needs. Empty when the spaces have one context degree.
pub(crate) fn context_effects(
    spaces: &[(&JointGraph, ParallelConfig)],
    fixed: Fixed,
    budget: u64,
    winner: &Candidate,
) -> Result<Vec<String>, PlanError> {
    let mut degrees: Vec<u64> = spaces.iter().map(|(_, c)| c.mesh.context).collect();
    degrees.sort_unstable();
    degrees.dedup();
    if degrees.len() <= 1 {
        return Ok(Vec::new());
    }
    let mut out = Vec::with_capacity(degrees.len());
    for d in degrees {
        if d == winner.knobs.context {
            out.push(format!(
                "context {d}: the winner, {:.3} s a step, {} of device memory",
                winner.step_s,
                gib(winner.device)
            ));
            continue;
        }
        let alone: Vec<(&JointGraph, ParallelConfig)> = spaces
            .iter()
            .filter(|(_, c)| c.mesh.context == d)
            .map(|(j, c)| (*j, c.clone()))
            .collect();
        out.push(match search_spaces(&alone, fixed, budget, true)? {
            Ok(r) => {
                let best = &r.candidates[0];
                format!(
                    "context {d}: fits at best in {:.3} s a step ({:+.1}% against the winner; mesh {}, checkpointing {})",
                    best.step_s,
                    (best.step_s / winner.step_s - 1.0) * 100.0,
                    best.knobs.mesh(),
                    best.knobs.activation_checkpointing
                )
            }
            Err(NoFit { best, .. }) => format!(
                "context {d}: does not fit: its smallest candidate needs {} of device memory ({} over the budget)",
                gib(best.device),
                gib(best.device.saturating_sub(budget))
            ),
        });
    }
    Ok(out)
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}
