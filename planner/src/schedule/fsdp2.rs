//! PyTorch FSDP2's lowering (`runtime: fsdp2`): the schedule's decisions laid out as
//! FSDP2's hooks hold memory (torch 2.15's `_fully_shard`):
//! - at world size 1 there is no all-gather: where the group is first read, each shard is
//!   cast (`gN.cast`) and copied into the unsharded parameters on the compute stream;
//! - an all-gather writes a flat output (`gN.ag`, all-gather/reduce-scatter buffers); with
//!   a parameter dtype other than the master's, the cast shard is first copied into a flat
//!   input of its own (`gN.ag_in`), freed once the collective has its input;
//! - a group's own all-gather is issued in its pre-hook, and the groups it prefetches only
//!   after its copy-out;
//! - where the group is first read (its pre-forward / pre-backward `wait_for_unshard`) the
//!   compute stream copies the flat output out into the per-parameter tensors
//!   (`split_with_sizes_copy`; `gN.unsharded`, unsharded params), both alive meanwhile. In
//!   backward and recompute the flat output is freed right after the copy-out; in forward
//!   it is kept in the communication context (`all_gather_state`) until the next group's
//!   copy-out, or the root's post-forward, frees it;
//! - a group's unsharded parameters outlive their last read until its post-backward;
//! - a group's post-backward frees the previous group's reduce-scatter input once that
//!   reduce-scatter is done (`reduce_scatter_states`, one buffer in flight), packs its
//!   gradients into its own (`chunk_cat`; `gN.rs_in`), and reduce-scatters into a new output
//!   (`gN.rs_out`) that becomes the sharded gradient when the reduce dtype is the master's;
//!   otherwise it is cast into, or added to, the sharded gradient and freed. The last input
//!   is freed at the end of each backward (the root's final callback);
//! - AdamW keeps one 4-byte `step` tensor per parameter (`gN.optim.step`), and its foreach
//!   implementation a temporary per parameter through the step.

use super::builder::Builder;
use super::Lowering;
use crate::group::GroupId;
use crate::plan::{BufId, Category, EventId, Instr, Pool, Stream};
use crate::steps::Phase;
use shardplan_frontends::AdamwImplementation;
use shardplan_ir::DType;

/// The collective state FSDP2 keeps between groups.
#[derive(Default)]
pub(crate) struct Fsdp2 {
    /// `all_gather_state`: the last forward all-gather's flat output, kept until the next
    /// copy-out.
    ag_state: Option<BufId>,
    /// `reduce_scatter_states`: the last reduce-scatter input and its end.
    rs_state: Option<(BufId, EventId)>,
}

impl Fsdp2 {
    /// Frees the all-gather output FSDP2 keeps after a forward copy-out.
    fn release_ag_state(&mut self, b: &mut Builder) {
        if let Some(flat) = self.ag_state.take() {
            b.emit(Stream::Compute, Instr::Free { buf: flat });
        }
    }

    /// Frees the reduce-scatter input FSDP2 keeps until the next post-backward (or the end
    /// of backward), after the compute stream waits for its reduce-scatter.
    fn release_rs_state(&mut self, b: &mut Builder) {
        if let Some((buf, done)) = self.rs_state.take() {
            b.emit(Stream::Compute, Instr::Wait { event: done });
            b.emit(Stream::Compute, Instr::Free { buf });
        }
    }
}

/// FSDP2's `wait_for_unshard` at world size 1: each parameter's shard cast to the
/// parameter dtype (`all_gather_inputs`) and copied into its unsharded storage, on the
/// compute stream. The casts are one buffer of the group here, freed after the copy; torch
/// holds two parameters' casts at a time, so the plan holds more for the copy's length.
fn unshard_in_place(b: &mut Builder, g: GroupId, micro: u32, forward: bool) -> BufId {
    let tag = b.suffix(micro, if forward { "fwd" } else { "bwd" });
    let sharded = b.sharded[g];
    let dst = b.gathered_buf(g, Category::UnshardedParams, || format!("{g}.unsharded.{tag}"));
    let cast = (b.policy.mixed_precision.param != b.policy.mixed_precision.master())
        .then(|| b.gathered_buf(g, Category::CommBuffers, || format!("{g}.cast.{tag}")));
    let src = match cast {
        Some(cast) => {
            b.emit(Stream::Compute, Instr::Alloc { buf: cast });
            b.emit(
                Stream::Compute,
                Instr::Copy {
                    src: sharded,
                    dst: cast,
                    accumulate: false,
                },
            );
            cast
        }
        None => sharded,
    };
    b.emit(Stream::Compute, Instr::Alloc { buf: dst });
    b.emit(
        Stream::Compute,
        Instr::Copy {
            src,
            dst,
            accumulate: false,
        },
    );
    if let Some(cast) = cast {
        b.emit(Stream::Compute, Instr::Free { buf: cast });
    }
    dst
}

/// Whether `b`'s optimizer is torch's AdamW.
fn adamw(b: &Builder) -> bool {
    b.policy.optimizer == crate::OptimizerKind::Adamw
}

impl Lowering for Fsdp2 {
    const PREFETCH_AFTER_READS: bool = true;
    const HOLDS_TO_POST_BACKWARD: bool = true;

    fn group_state(&mut self, b: &mut Builder, g: GroupId, params: u64, pool: Pool) {
        if adamw(b) {
            // torch's AdamW: a 4-byte `step` tensor per parameter.
            let steps = b.buf(
                || format!("{g}.optim.step"),
                Category::OptimizerState,
                g,
                DType::F32,
                params,
                pool,
            );
            b.buffer_mut(steps).persistent = true;
        }
    }

    /// At world size 1 FSDP2 makes no all-gather (`FSDPParamGroup.unshard` returns at
    /// once, and `wait_for_unshard` fills each parameter from its shard).
    fn skips_gather(&self, b: &Builder, g: GroupId) -> bool {
        b.shard_comm(g).size(b.mesh) == 1
    }

    fn gather_output(&mut self, b: &mut Builder, g: GroupId, tag: &str) -> BufId {
        b.gathered_buf(g, Category::CommBuffers, || format!("{g}.ag.{tag}"))
    }

    /// FSDP2 copies a shard to be cast into a flat input of the parameter dtype first
    /// (`_get_param_all_gather_inputs`), freed once the all-gather has its input.
    fn gather_input(&mut self, b: &mut Builder, g: GroupId, src: BufId, tag: &str) -> Option<BufId> {
        let p = b.policy.mixed_precision.param;
        if p == b.policy.mixed_precision.master() {
            return None;
        }
        let numel = b.numel(src);
        let cast = b.buf(
            || format!("{g}.ag_in.{tag}"),
            Category::CommBuffers,
            g,
            p,
            numel,
            Pool::Device,
        );
        b.emit(Stream::AllGather, Instr::Alloc { buf: cast });
        b.emit(
            Stream::AllGather,
            Instr::Copy {
                src,
                dst: cast,
                accumulate: false,
            },
        );
        Some(cast)
    }

    /// FSDP2's `wait_for_unshard`: in forward, free the previous all-gather's output it
    /// kept; copy `flat` out into the per-parameter tensors; keep `flat` (forward) or free
    /// it.
    fn first_read(&mut self, b: &mut Builder, g: GroupId, flat: BufId, micro: u32, phase: Phase) -> BufId {
        let forward = phase == Phase::Forward;
        if flat == b.sharded[g] {
            return unshard_in_place(b, g, micro, forward);
        }
        if forward {
            self.release_ag_state(b);
        }
        let tag = b.suffix(micro, if forward { "fwd" } else { "bwd" });
        let dst = b.gathered_buf(g, Category::UnshardedParams, || format!("{g}.unsharded.{tag}"));
        b.emit(Stream::Compute, Instr::Alloc { buf: dst });
        b.emit(
            Stream::Compute,
            Instr::Copy {
                src: flat,
                dst,
                accumulate: false,
            },
        );
        if forward {
            self.ag_state = Some(flat);
        } else {
            b.emit(Stream::Compute, Instr::Free { buf: flat });
        }
        dst
    }

    /// The root's post-forward frees the all-gather output kept for overlap.
    fn after_last_forward(&mut self, b: &mut Builder) {
        self.release_ag_state(b);
    }

    fn before_pack(&mut self, b: &mut Builder) {
        self.release_rs_state(b);
    }

    /// FSDP2's `foreach_reduce` after the copy-in: a reduce-scatter output of the reduce
    /// dtype that is the sharded gradient, or is cast into / added to it and freed; the
    /// input `packed` kept until the next post-backward.
    fn reduce_scatter(&mut self, b: &mut Builder, g: GroupId, micro: u32, last_micro: bool, packed: BufId) {
        let master = b.policy.mixed_precision.master();
        let reduce = b.policy.mixed_precision.reduce;
        let existing = b.sharded_grads[g];
        let becomes_grad = existing.is_none() && reduce == master;
        let category = if becomes_grad {
            Category::ShardedGrads
        } else {
            Category::CommBuffers
        };
        let tag = b.suffix(micro, "rs");
        let name = || {
            if becomes_grad {
                format!("{g}.grads")
            } else {
                format!("{g}.{tag}_out")
            }
        };
        let out = b.buf(name, category, g, reduce, b.shard_numel(g), Pool::Device);
        b.emit(Stream::ReduceScatter, Instr::Alloc { buf: out });
        b.reduce_scatter(g, packed, out);
        let rs_done = b.record(Stream::ReduceScatter);
        self.rs_state = Some((packed, rs_done));
        // The cast / accumulation and the rest follow on the reduce-scatter stream, issued
        // after the next compute step as the other runtime's tails are.
        b.deferring = true;
        let acc = if becomes_grad {
            out
        } else {
            let acc = b.sharded_grads(g);
            b.emit(
                Stream::ReduceScatter,
                Instr::Copy {
                    src: out,
                    dst: acc,
                    accumulate: existing.is_some(),
                },
            );
            b.emit(Stream::ReduceScatter, Instr::Free { buf: out });
            acc
        };
        b.sharded_grads[g] = Some(acc);
        b.end_reduction(g, acc, last_micro);
    }

    /// The end of FSDP2's backward frees the last reduce-scatter input.
    fn end_of_backward(&mut self, b: &mut Builder) {
        self.release_rs_state(b);
    }

    /// torch's foreach AdamW (`implementation: foreach`) steps every parameter at once:
    /// `_foreach_sqrt` of the second moments makes one temporary per parameter, the size of
    /// its shard, all alive until the update (the first group's gradients are still alive
    /// beside them: freeing them after its step changes no peak); the fused kernel makes
    /// none.
    fn optimizer_temporaries(&mut self, b: &mut Builder, groups: &[GroupId]) -> Vec<BufId> {
        if !adamw(b) || b.policy.adamw_implementation != AdamwImplementation::Foreach {
            return Vec::new();
        }
        let (master, pool) = (b.policy.mixed_precision.master(), b.state_pool());
        groups
            .iter()
            .map(|&g| {
                let shard = b.shard_numel(g);
                let t = b.buf(
                    || format!("{g}.optim.tmp"),
                    Category::OptimizerState,
                    g,
                    master,
                    shard,
                    pool,
                );
                b.emit(b.optimizer_stream(), Instr::Alloc { buf: t });
                t
            })
            .collect()
    }
}
