//! What would fit: single changes to a parallel spec that lower per-rank memory, each
//! re-planned against a budget. `shardplan plan --memory-budget` and `plan --auto` name the
//! ones that fit when the spec itself does not.
//!
//! Each change is described as the user would make it, so the CLI can print it as is; an
//! alternative is kept only if it changes the config (`checkpointing: full` is not offered
//! to a spec that already checkpoints every block). Alternatives whose graph cannot be
//! traced or planned are left out, not reported.

use crate::auto::{search, Fixed};
use crate::plan;
use shardplan_frontends::{ActivationCheckpointing, GradSync, Offload, ParallelConfig, Prefetch, Reshard};
use shardplan_ir::{differentiate_with, JointGraph};
use shardplan_models::{trace, ModelConfig};

/// One change to a spec and the config it gives.
#[derive(Clone, Debug, PartialEq)]
pub struct Alternative {
    /// The change as the user would write it (`offload: cpu`).
    pub change: String,
    pub config: ParallelConfig,
}

/// An alternative, planned: its per-rank memory and whether that fits the budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tried {
    pub change: String,
    /// The plan's allocated peak per rank; for a search that found nothing, the smallest
    /// candidate's.
    pub peak: u64,
    /// The plan's device total per rank (what must fit), likewise.
    pub device: u64,
    pub fits: bool,
}

/// Single changes to a spec that lower memory without a search, in the order they are
/// tried: checkpointing, resharding, shallower prefetch, gradient sync, half the per-rank
/// batch (same global batch), twice the ranks, CPU offload, and for long sequences a
/// context axis of 2, 4 or 8 ranks.
pub fn plan_alternatives(c: &ParallelConfig) -> Vec<Alternative> {
    let mut out = Vec::new();
    let mut push = |change: String, f: &dyn Fn(&mut ParallelConfig)| {
        let mut n = c.clone();
        f(&mut n);
        if n != *c {
            out.push(Alternative { change, config: n });
        }
    };
    push("activation_checkpointing: full".into(), &|n| {
        n.activation_checkpointing = ActivationCheckpointing::Full
    });
    push("reshard_after_forward: true".into(), &|n| {
        n.reshard_after_forward = Reshard::AfterForward
    });
    let depth_one = if c.prefetch.peak_aware {
        "prefetch: auto"
    } else {
        "prefetch: {forward: 1, backward: 1}"
    };
    push(depth_one.into(), &|n| {
        n.prefetch = Prefetch {
            forward: n.prefetch.forward.min(1),
            backward: n.prefetch.backward.min(1),
            explicit_forward: Default::default(),
            explicit_backward: Default::default(),
            peak_aware: n.prefetch.peak_aware,
        }
    });
    push("batch.grad_sync: every_micro_batch".into(), &|n| {
        n.batch.grad_sync = GradSync::EveryMicroBatch
    });
    if c.batch.per_rank > 1 {
        push(
            format!(
                "batch: {{per_rank: {}, grad_accum: {}}} (same global batch)",
                c.batch.per_rank / 2,
                c.batch.grad_accum * 2
            ),
            &|n| {
                n.batch.per_rank /= 2;
                n.batch.grad_accum *= 2;
            },
        );
    }
    push(
        format!(
            "mesh: {{replicate: {}, shard: {}}} (twice the ranks)",
            c.mesh.replicate,
            c.mesh.shard * 2
        ),
        &|n| n.mesh.shard *= 2,
    );
    push("offload: cpu".into(), &|n| n.offload = Offload::Cpu);
    // Long sequences: each split over a context group carved from the shard axis, the
    // global batch kept by accumulation (a model that cannot split is left out when traced).
    if c.batch.seq_len.unwrap_or(0) >= crate::auto::CONTEXT_MIN_SEQ && c.mesh.expert <= 1 && c.mesh.pipeline <= 1 {
        for k in [2u64, 4, 8] {
            if !c.mesh.shard.is_multiple_of(k) {
                continue;
            }
            push(
                format!(
                    "mesh: {{replicate: {}, shard: {}, context: {}}} with grad_accum {} (each sequence over {} context ranks, same global batch)",
                    c.mesh.replicate,
                    c.mesh.shard / k,
                    c.mesh.context * k,
                    c.batch.grad_accum * k,
                    c.mesh.context * k
                ),
                &|n| {
                    n.mesh.shard /= k;
                    n.mesh.context *= k;
                    n.batch.grad_accum *= k;
                },
            );
        }
    }
    out
}

/// Plans each of [`plan_alternatives`] of `base` for `model` against `budget` bytes of
/// device memory per rank: those that fit first, then by device total (the closest miss
/// first).
pub fn try_plan_alternatives(model: &ModelConfig, base: &ParallelConfig, budget: u64) -> Vec<Tried> {
    let mut tried: Vec<Tried> = plan_alternatives(base)
        .into_iter()
        .filter_map(|a| {
            let joint = joint_graph(model, &a.config)?;
            let p = plan(&joint, &a.config).ok()?;
            Some(Tried {
                change: a.change,
                peak: p.memory.peak,
                device: p.memory.device_total,
                fits: p.memory.device_total <= budget,
            })
        })
        .collect();
    tried.sort_by_key(|t| (!t.fits, t.device));
    tried
}

/// Single changes outside the `--auto` search space that lower memory, in the order they
/// are tried: twice the ranks, half the per-rank batch (same global batch), CPU offload.
pub fn search_alternatives(c: &ParallelConfig) -> Vec<Alternative> {
    let mut out = Vec::new();
    let mut more = c.clone();
    more.mesh.shard *= 2;
    out.push(Alternative {
        change: format!("twice the ranks ({} instead of {})", more.mesh.world(), c.mesh.world()),
        config: more,
    });
    if c.batch.per_rank > 1 {
        let mut smaller = c.clone();
        smaller.batch.per_rank /= 2;
        smaller.batch.grad_accum *= 2;
        out.push(Alternative {
            change: format!(
                "batch.per_rank {} with grad_accum {} (same global batch)",
                smaller.batch.per_rank, smaller.batch.grad_accum
            ),
            config: smaller,
        });
    }
    if c.offload == Offload::None {
        let mut off = c.clone();
        off.offload = Offload::Cpu;
        out.push(Alternative {
            change: "offload: cpu".into(),
            config: off,
        });
    }
    out
}

/// Runs the `--auto` search (with the knobs `fixed` kept) on each of
/// [`search_alternatives`] of `base` against `budget`, in the order tried. A search that
/// fits reports its winner's memory; one that does not, its smallest candidate's.
pub fn try_search_alternatives(model: &ModelConfig, base: &ParallelConfig, fixed: Fixed, budget: u64) -> Vec<Tried> {
    search_alternatives(base)
        .into_iter()
        .filter_map(|a| {
            let joint = joint_graph(model, &a.config)?;
            // The changed spec must plan as written before its open knobs are searched.
            plan(&joint, &a.config).ok()?;
            let (peak, device, fits) = match search(&joint, &a.config, fixed, budget, true).ok()? {
                Ok(r) => (r.winner.memory.peak, r.winner.memory.device_total, true),
                Err(no) => (no.best.peak, no.best.device, false),
            };
            Some(Tried {
                change: a.change,
                peak,
                device,
                fits,
            })
        })
        .collect()
}

/// The joint graph [`plan`] takes for `config`: `model` traced at the per-rank micro-batch
/// in the param dtype, then differentiated; `None` if either fails.
fn joint_graph(model: &ModelConfig, config: &ParallelConfig) -> Option<JointGraph> {
    differentiate_with(&trace(model, config.trace_options()).ok()?, config.diff_options()).ok()
}
