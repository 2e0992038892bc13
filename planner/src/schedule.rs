//! The schedule: one rank's instructions for one optimizer step, in issue order.
//!
//! Per micro-batch, walking the compute steps in order:
//! - a group is all-gathered before the first step that reads it while it is sharded; the
//!   all-gather is issued when the compute stream starts the step that needs the group
//!   `depth` gathers earlier (FSDP2's prefetch; depth 0 waits for the step itself);
//! - after its last forward read a group is freed (`reshard_after_forward: true`), kept
//!   (`false`; the root group always), or sliced to a post-forward shard (`N`); after its
//!   last read it is freed;
//! - after the step that last writes a group's gradients it is reduce-scattered (every
//!   micro-batch, or only the last, by `grad_sync`), all-reduced over replicas once per step
//!   (HSDP), and under CPU offload copied to the host;
//! - at the end: the gradient norm (partial sums all-reduced over the shard group) and the
//!   optimizer step of each group on its shards.
//!
//! Under `runtime: fsdp2` the same decisions are laid out as PyTorch FSDP2's hooks hold
//! memory (torch 2.15's `_fully_shard`):
//! - an all-gather writes a flat output (`gN.ag`, all-gather/reduce-scatter buffers); with
//!   a parameter dtype other than the master's, the cast shard is first copied into a flat
//!   input of its own (`gN.ag_in`), freed once the collective has its input;
//! - where the group is first read (its pre-forward / pre-backward `wait_for_unshard`) the
//!   compute stream copies the flat output out into the per-parameter tensors
//!   (`split_with_sizes_copy`; `gN.unsharded`, unsharded params), both alive meanwhile. In
//!   backward and recompute the flat output is freed right after the copy-out; in forward
//!   it is kept in the communication context (`all_gather_state`) until the next group's
//!   copy-out, or the root's post-forward, frees it;
//! - a group's post-backward frees the previous group's reduce-scatter input once that
//!   reduce-scatter is done (`reduce_scatter_states`, one buffer in flight), packs its
//!   gradients into its own (`chunk_cat`; `gN.rs_in`), and reduce-scatters into a new output
//!   (`gN.rs_out`) that becomes the sharded gradient when the reduce dtype is the master's;
//!   otherwise it is cast into, or added to, the sharded gradient and freed. The last input
//!   is freed at the end of each backward (the root's final callback);
//! - AdamW keeps one 4-byte `step` tensor per parameter (`gN.optim.step`).

use crate::group::GroupId;
use crate::mesh::Mesh;
use crate::plan::{
    BufId, Buffer, Category, Comm, EventId, GroupReshard, Instr, Issued, PlannedGroup, Policy, Pool, Program, ReduceOp,
    Stream,
};
use crate::steps::{Phase, Step, StepId};
use shardplan_frontends::{AdamwImplementation, GradSync, Offload, Runtime};
use shardplan_ir::{DType, IdVec, ParamId};

/// Buffers, event count and program of one rank.
pub struct Schedule {
    pub buffers: Vec<Buffer>,
    pub events: u32,
    pub program: Program,
}

struct Builder<'a> {
    groups: &'a [PlannedGroup],
    policy: &'a Policy,
    mesh: &'a Mesh,
    buffers: IdVec<BufId, Buffer>,
    events: u32,
    instrs: Vec<Issued>,
    last_wait: [Option<EventId>; Stream::ALL.len()],
    /// While set, `emit` collects into `deferred` (a reduction's tail, issued one compute
    /// step later so the next step's allocations do not wait on it).
    deferring: bool,
    deferred: Vec<(Stream, Instr)>,
    // Per group:
    sharded: IdVec<GroupId, BufId>,
    optim: IdVec<GroupId, Option<BufId>>,
    gathered: IdVec<GroupId, Option<(BufId, EventId, bool)>>,
    post_forward: IdVec<GroupId, Option<BufId>>,
    /// Per group, its gradient pieces made so far: (step position, buffer).
    pieces: IdVec<GroupId, Vec<(usize, BufId)>>,
    sharded_grads: IdVec<GroupId, Option<BufId>>,
    grads_done: IdVec<GroupId, Option<(BufId, EventId)>>,
    /// `runtime: fsdp2`: FSDP2's buffers and hooks (see the module doc).
    fsdp2: bool,
    /// FSDP2's `all_gather_state`: the last forward all-gather's flat output, kept until the
    /// next copy-out.
    ag_state: Option<BufId>,
    /// FSDP2's `reduce_scatter_states`: the last reduce-scatter input and its end.
    rs_state: Option<(BufId, EventId)>,
    /// Whether buffers get their names (the auto search's candidate and trial schedules
    /// leave them empty: only the plan it returns is printed, and that one is planned
    /// again).
    named: bool,
}

impl Builder<'_> {
    fn buf(
        &mut self,
        name: impl FnOnce() -> String,
        category: Category,
        group: GroupId,
        dtype: DType,
        numel: u64,
        pool: Pool,
    ) -> BufId {
        let id = self.buffers.next_key();
        let name = if self.named { name() } else { String::new() };
        self.buffers.push(Buffer {
            id,
            name,
            category,
            group: Some(group),
            dtype,
            numel,
            pool,
            persistent: false,
            params: Vec::new(),
        })
    }

    fn event(&mut self) -> EventId {
        self.events += 1;
        EventId::new(self.events as usize - 1)
    }

    fn emit(&mut self, stream: Stream, instr: Instr) {
        if self.deferring {
            self.deferred.push((stream, instr));
            return;
        }
        if let Instr::Wait { event } = instr {
            // A stream that already waited on this event is past it.
            if self.last_wait[stream.index()] == Some(event) {
                return;
            }
            self.last_wait[stream.index()] = Some(event);
        }
        self.instrs.push(Issued { stream, instr });
    }

    fn record(&mut self, stream: Stream) -> EventId {
        let e = self.event();
        self.emit(stream, Instr::Record { event: e });
        e
    }

    fn offload(&self) -> bool {
        self.policy.offload == Offload::Cpu
    }

    /// The process group `g` is sharded over.
    fn shard_comm(&self, g: GroupId) -> Comm {
        self.mesh.shard_comm(&self.groups[g.index()].group)
    }

    /// How `g`'s gradients are reduced over its shard group: averaged, and the routed
    /// experts' (which sum the tokens of their whole expert group already) over the whole
    /// shard axis.
    fn grad_reduce(&self, g: GroupId) -> ReduceOp {
        if self.groups[g.index()].group.experts && self.mesh.expert() > 1 {
            ReduceOp::AvgOver(self.mesh.shard())
        } else {
            ReduceOp::Avg
        }
    }

    fn gathered_numel(&self, g: GroupId) -> u64 {
        self.groups[g.index()].layout.gathered_numel()
    }

    fn shard_numel(&self, g: GroupId) -> u64 {
        self.groups[g.index()].layout.shard_numel
    }

    /// The part of a buffer's name that says its pass and micro-batch (empty, and not
    /// allocated, when buffers go unnamed: it is read only by their names).
    fn suffix(&self, micro: u32, phase: &str) -> String {
        if !self.named {
            String::new()
        } else if self.policy.grad_accum > 1 {
            format!("{phase}{micro}")
        } else {
            phase.to_string()
        }
    }

    /// All-gathers group `g` on the all-gather stream once `gate` (a compute event) passes.
    fn gather(&mut self, g: GroupId, gate: EventId, micro: u32, phase: Phase) {
        let p = self.policy.mixed_precision.param;
        let full = self.gathered_numel(g);
        let tag = self.suffix(micro, if phase == Phase::Forward { "fwd" } else { "bwd" });
        let fsdp2 = self.fsdp2;
        let category = if fsdp2 {
            Category::CommBuffers
        } else {
            Category::UnshardedParams
        };
        let name = || {
            if fsdp2 {
                format!("{g}.ag.{tag}")
            } else {
                format!("{g}.unsharded.{tag}")
            }
        };
        let dst = self.buf(name, category, g, p, full, Pool::Device);
        let (src, comm, drop_src) = match self.post_forward[g].take() {
            Some(pf) => {
                let n = match self.groups[g.index()].reshard {
                    GroupReshard::ToGroupOf(n) => n,
                    _ => self.mesh.shard(),
                };
                self.emit(Stream::AllGather, Instr::Wait { event: gate });
                (pf, Comm::Reshard(n), true)
            }
            None if self.offload() => {
                let dev = self.buf(
                    || format!("{g}.params.device"),
                    Category::ShardedParams,
                    g,
                    self.policy.mixed_precision.master,
                    self.shard_numel(g),
                    Pool::Device,
                );
                self.emit(Stream::Copy, Instr::Wait { event: gate });
                self.emit(Stream::Copy, Instr::Alloc { buf: dev });
                self.emit(
                    Stream::Copy,
                    Instr::Copy {
                        src: self.sharded[g],
                        dst: dev,
                        accumulate: false,
                    },
                );
                let copied = self.record(Stream::Copy);
                self.emit(Stream::AllGather, Instr::Wait { event: copied });
                (dev, self.shard_comm(g), true)
            }
            None => {
                self.emit(Stream::AllGather, Instr::Wait { event: gate });
                (self.sharded[g], self.shard_comm(g), false)
            }
        };
        // FSDP2 copies a shard to be cast into a flat input of the parameter dtype first
        // (`_get_param_all_gather_inputs`), freed once the all-gather has its input.
        let cast = (self.fsdp2 && p != self.policy.mixed_precision.master).then(|| {
            let numel = self.buffers[src].numel;
            let tag = tag.clone();
            let cast = self.buf(
                || format!("{g}.ag_in.{tag}"),
                Category::CommBuffers,
                g,
                p,
                numel,
                Pool::Device,
            );
            self.emit(Stream::AllGather, Instr::Alloc { buf: cast });
            self.emit(
                Stream::AllGather,
                Instr::Copy {
                    src,
                    dst: cast,
                    accumulate: false,
                },
            );
            cast
        });
        self.emit(Stream::AllGather, Instr::Alloc { buf: dst });
        self.emit(
            Stream::AllGather,
            Instr::AllGather {
                group: g,
                comm,
                src: cast.unwrap_or(src),
                dst,
            },
        );
        if let Some(cast) = cast {
            self.emit(Stream::AllGather, Instr::Free { buf: cast });
        }
        let done = self.record(Stream::AllGather);
        // Frees after a collective are issued one compute step later, so the allocations
        // issued meanwhile do not wait for the collective to finish.
        if drop_src {
            self.deferring = true;
            self.emit(Stream::AllGather, Instr::Free { buf: src });
            self.deferring = false;
        }
        self.gathered[g] = Some((dst, done, false));
    }

    /// FSDP2's `wait_for_unshard` for group `g`, whose all-gather output `flat` the compute
    /// stream has waited for: in forward, free the previous all-gather's output it kept;
    /// copy `flat` out into the per-parameter tensors; keep `flat` (forward) or free it.
    /// Returns the unsharded buffer the group's steps read.
    fn copy_out(&mut self, g: GroupId, flat: BufId, micro: u32, phase: Phase) -> BufId {
        let forward = phase == Phase::Forward;
        if forward {
            self.release_ag_state();
        }
        let tag = self.suffix(micro, if forward { "fwd" } else { "bwd" });
        let numel = self.gathered_numel(g);
        let p = self.policy.mixed_precision.param;
        let dst = self.buf(
            || format!("{g}.unsharded.{tag}"),
            Category::UnshardedParams,
            g,
            p,
            numel,
            Pool::Device,
        );
        self.emit(Stream::Compute, Instr::Alloc { buf: dst });
        self.emit(
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
            self.emit(Stream::Compute, Instr::Free { buf: flat });
        }
        dst
    }

    /// Frees the all-gather output FSDP2 keeps after a forward copy-out.
    fn release_ag_state(&mut self) {
        if let Some(flat) = self.ag_state.take() {
            self.emit(Stream::Compute, Instr::Free { buf: flat });
        }
    }

    /// Frees the reduce-scatter input FSDP2 keeps until the next post-backward (or the end
    /// of backward), after the compute stream waits for its reduce-scatter.
    fn release_rs_state(&mut self) {
        if let Some((buf, done)) = self.rs_state.take() {
            self.emit(Stream::Compute, Instr::Wait { event: done });
            self.emit(Stream::Compute, Instr::Free { buf });
        }
    }

    /// Packs group `g`'s gradient pieces into the reduce-scatter input on the compute
    /// stream and frees them there (FSDP2's copy-in), then reduce-scatters it; on the final
    /// micro-batch also the replica all-reduce and the host copy.
    fn reduce(&mut self, g: GroupId, micro: u32, last_micro: bool) {
        let pieces: Vec<BufId> = std::mem::take(&mut self.pieces[g])
            .into_iter()
            .map(|(_, b)| b)
            .collect();
        if pieces.is_empty() {
            return;
        }
        let master = self.policy.mixed_precision.master;
        let reduce = self.policy.mixed_precision.reduce;
        if self.fsdp2 {
            self.release_rs_state();
        }
        let tag = self.suffix(micro, "rs");
        let packed = self.buf(
            || format!("{g}.{tag}_in"),
            Category::CommBuffers,
            g,
            reduce,
            self.gathered_numel(g),
            Pool::Device,
        );
        self.emit(Stream::Compute, Instr::Alloc { buf: packed });
        self.emit(
            Stream::Compute,
            Instr::PackGrads {
                group: g,
                srcs: pieces.clone(),
                dst: packed,
            },
        );
        for p in pieces {
            self.emit(Stream::Compute, Instr::Free { buf: p });
        }
        let ready = self.record(Stream::Compute);
        self.emit(Stream::ReduceScatter, Instr::Wait { event: ready });
        if self.fsdp2 {
            self.reduce_fsdp2(g, micro, last_micro, packed);
            return;
        }
        let acc = match self.sharded_grads[g] {
            Some(b) => b,
            None => {
                let b = self.buf(
                    || format!("{g}.grads"),
                    Category::ShardedGrads,
                    g,
                    master,
                    self.shard_numel(g),
                    Pool::Device,
                );
                self.emit(Stream::ReduceScatter, Instr::Alloc { buf: b });
                self.sharded_grads[g] = Some(b);
                b
            }
        };
        self.emit(
            Stream::ReduceScatter,
            Instr::ReduceScatter {
                group: g,
                comm: self.shard_comm(g),
                op: self.grad_reduce(g),
                src: packed,
                dst: acc,
            },
        );
        // The tail (free, replica all-reduce, host copy) is issued after the next compute
        // step: the allocations that step makes must not wait for this reduction to finish.
        self.deferring = true;
        self.emit(Stream::ReduceScatter, Instr::Free { buf: packed });
        let done = self.record(Stream::ReduceScatter);
        if !last_micro {
            self.deferring = false;
            return;
        }
        self.finish_grads(g, acc, done);
        self.deferring = false;
    }

    /// The final micro-batch's tail of a group's reduction, from its sharded gradients `acc`
    /// ready at `done`: the replica all-reduce (HSDP), the host copy (offload).
    fn finish_grads(&mut self, g: GroupId, acc: BufId, mut done: EventId) {
        let master = self.policy.mixed_precision.master;
        if self.mesh.replicate() > 1 {
            self.emit(Stream::AllReduce, Instr::Wait { event: done });
            self.emit(
                Stream::AllReduce,
                Instr::AllReduce {
                    group: Some(g),
                    comm: Comm::Replicate,
                    op: ReduceOp::Avg,
                    buf: acc,
                },
            );
            done = self.record(Stream::AllReduce);
        }
        let mut final_buf = acc;
        if self.offload() {
            let host = self.buf(
                || format!("{g}.grads.host"),
                Category::ShardedGrads,
                g,
                master,
                self.shard_numel(g),
                Pool::Host,
            );
            self.emit(Stream::Copy, Instr::Wait { event: done });
            self.emit(Stream::Copy, Instr::Alloc { buf: host });
            self.emit(
                Stream::Copy,
                Instr::Copy {
                    src: acc,
                    dst: host,
                    accumulate: false,
                },
            );
            self.emit(Stream::Copy, Instr::Free { buf: acc });
            done = self.record(Stream::Copy);
            final_buf = host;
        }
        self.sharded_grads[g] = None;
        self.grads_done[g] = Some((final_buf, done));
    }

    /// FSDP2's `foreach_reduce` after the copy-in: a reduce-scatter output of the reduce
    /// dtype that is the sharded gradient, or is cast into / added to it and freed; the input
    /// `packed` kept until the next post-backward.
    fn reduce_fsdp2(&mut self, g: GroupId, micro: u32, last_micro: bool, packed: BufId) {
        let master = self.policy.mixed_precision.master;
        let reduce = self.policy.mixed_precision.reduce;
        let existing = self.sharded_grads[g];
        let becomes_grad = existing.is_none() && reduce == master;
        let category = if becomes_grad {
            Category::ShardedGrads
        } else {
            Category::CommBuffers
        };
        let tag = self.suffix(micro, "rs");
        let name = || {
            if becomes_grad {
                format!("{g}.grads")
            } else {
                format!("{g}.{tag}_out")
            }
        };
        let out = self.buf(name, category, g, reduce, self.shard_numel(g), Pool::Device);
        self.emit(Stream::ReduceScatter, Instr::Alloc { buf: out });
        self.emit(
            Stream::ReduceScatter,
            Instr::ReduceScatter {
                group: g,
                comm: self.shard_comm(g),
                op: self.grad_reduce(g),
                src: packed,
                dst: out,
            },
        );
        let rs_done = self.record(Stream::ReduceScatter);
        self.rs_state = Some((packed, rs_done));
        // The cast / accumulation and the rest follow on the reduce-scatter stream, issued
        // after the next compute step as the other runtime's tails are.
        self.deferring = true;
        let acc = if becomes_grad {
            out
        } else {
            let acc = match existing {
                Some(acc) => acc,
                None => {
                    let acc = self.buf(
                        || format!("{g}.grads"),
                        Category::ShardedGrads,
                        g,
                        master,
                        self.shard_numel(g),
                        Pool::Device,
                    );
                    self.emit(Stream::ReduceScatter, Instr::Alloc { buf: acc });
                    acc
                }
            };
            self.emit(
                Stream::ReduceScatter,
                Instr::Copy {
                    src: out,
                    dst: acc,
                    accumulate: existing.is_some(),
                },
            );
            self.emit(Stream::ReduceScatter, Instr::Free { buf: out });
            acc
        };
        self.sharded_grads[g] = Some(acc);
        let done = self.record(Stream::ReduceScatter);
        if !last_micro {
            self.deferring = false;
            return;
        }
        self.finish_grads(g, acc, done);
        self.deferring = false;
    }

    /// Issues the deferred reduction tails.
    fn flush(&mut self) {
        for (stream, instr) in std::mem::take(&mut self.deferred) {
            self.emit(stream, instr);
        }
    }
}

/// Where each group is used within one micro-batch.
struct Uses {
    last_forward: IdVec<GroupId, Option<usize>>,
    last: IdVec<GroupId, Option<usize>>,
    last_grad: IdVec<GroupId, Option<usize>>,
}

fn uses(steps: &[Step], n_groups: usize) -> Uses {
    let mut u = Uses {
        last_forward: IdVec::from_elem(None, n_groups),
        last: IdVec::from_elem(None, n_groups),
        last_grad: IdVec::from_elem(None, n_groups),
    };
    for (pos, s) in steps.iter().enumerate() {
        for &g in &s.reads {
            if s.phase == Phase::Forward {
                u.last_forward[g] = Some(pos);
            }
            u.last[g] = Some(pos);
        }
        for &g in &s.grads {
            u.last_grad[g] = Some(pos);
        }
    }
    u
}

/// Gathers one micro-batch needs, in order: (step position, group).
fn needs(steps: &[Step], groups: &[PlannedGroup], u: &Uses) -> Vec<(usize, GroupId)> {
    let mut gathered: IdVec<GroupId, bool> = IdVec::from_elem(false, groups.len());
    let mut out = Vec::new();
    for (pos, s) in steps.iter().enumerate() {
        for &g in &s.reads {
            if !gathered[g] {
                gathered[g] = true;
                out.push((pos, g));
            }
        }
        for &g in &s.reads {
            if u.last[g] == Some(pos)
                || (u.last_forward[g] == Some(pos) && groups[g.index()].reshard != GroupReshard::Keep)
            {
                gathered[g] = false;
            }
        }
    }
    out
}

/// Where one all-gather is issued: when the compute stream starts step `at`, for the first
/// read of `group` at step `need` (`at <= need`), in pass `phase`. Every micro-batch
/// issues its gathers at the same points.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gate {
    pub group: GroupId,
    pub phase: Phase,
    pub need: usize,
    pub at: usize,
}

/// The all-gathers of one micro-batch at the points the prefetch depths and explicit lists
/// put them (FSDP2's order): a gather is issued when the step needing the gather `depth`
/// gathers earlier starts, or when its trigger group's first step of the pass starts.
pub fn gates(steps: &[Step], groups: &[PlannedGroup], policy: &Policy) -> Vec<Gate> {
    let u = uses(steps, groups.len());
    let need = needs(steps, groups, &u);
    let first_backward = steps.iter().position(|s| s.phase != Phase::Forward).unwrap_or(0);
    let (fwd, bwd): (Vec<_>, Vec<_>) = need.iter().partition(|(pos, _)| steps[*pos].phase == Phase::Forward);
    let mut out = Vec::with_capacity(need.len());
    for (list, depth, start, explicit) in [
        (
            &fwd,
            policy.prefetch.forward as usize,
            0,
            &policy.prefetch.explicit_forward,
        ),
        (
            &bwd,
            policy.prefetch.backward as usize,
            first_backward,
            &policy.prefetch.explicit_backward,
        ),
    ] {
        for (i, &(pos, g)) in list.iter().enumerate() {
            // An explicit list: gather when the trigger group's first step of this pass starts.
            let trigger = explicit
                .iter()
                .filter(|(_, targets)| targets.contains(&g))
                .filter_map(|(t, _)| {
                    (start..steps.len())
                        .find(|&k| steps[k].group == *t && (steps[k].phase == Phase::Forward) == (start == 0))
                })
                .min();
            let at = match trigger {
                Some(k) => k.min(pos),
                None if i >= depth => hook_fires(steps, groups, policy, list[i - depth], start),
                None => start.min(pos),
            };
            out.push(Gate {
                group: g,
                phase: steps[pos].phase,
                need: pos,
                at,
            });
        }
    }
    out
}

/// The group whose module's hooks fire where a step of group `k` starts under FSDP2: `k`,
/// or for a unit of routed experts the dense unit of the same module ([`crate::group`]
/// gives both the block's scope): a block's steps run under its experts' group, but the
/// block's pre-forward and pre-backward hooks fire first; the experts' own hooks fire
/// inside the step.
pub fn hook_group(groups: &[PlannedGroup], k: GroupId) -> GroupId {
    let grp = &groups[k.index()].group;
    if !grp.experts {
        return k;
    }
    groups
        .iter()
        .find(|o| !o.group.experts && o.group.scopes == grp.scopes)
        .map_or(k, |o| o.group.id)
}

/// Where the group of `(need, group)` prefetches what follows it: the step that first
/// reads it, or under FSDP2 (`runtime: fsdp2`) where its hooks fire ([`hook_group`]): a
/// block's first step of the pass, which may run under its routed experts' group before
/// any step reads the block's own parameters (Mixtral's block opens its backward with the
/// experts').
fn hook_fires(
    steps: &[Step],
    groups: &[PlannedGroup],
    policy: &Policy,
    (need, g): (usize, GroupId),
    start: usize,
) -> usize {
    if policy.runtime != Runtime::Fsdp2 {
        return need;
    }
    let phase = steps[need].phase == Phase::Forward;
    (start..need)
        .rev()
        .take_while(|&k| {
            steps[k].group != g
                && hook_group(groups, steps[k].group) == g
                && (steps[k].phase == Phase::Forward) == phase
        })
        .last()
        .unwrap_or(need)
}

/// The schedule of one rank, its all-gathers issued at [`gates`].
pub fn schedule(steps: &[Step], groups: &[PlannedGroup], policy: &Policy, mesh: &Mesh) -> Schedule {
    schedule_gated(steps, groups, policy, mesh, &gates(steps, groups, policy), true)
}

/// The schedule of one rank with its all-gathers issued at `gates` (one per gather of a
/// micro-batch, as [`gates`] lists them, with any `at` in `..=need`). `named: false`
/// leaves every buffer's name empty (a schedule that is simulated, never printed).
pub fn schedule_gated(
    steps: &[Step],
    groups: &[PlannedGroup],
    policy: &Policy,
    mesh: &Mesh,
    gates: &[Gate],
    named: bool,
) -> Schedule {
    let n = groups.len();
    let pool = if policy.offload == Offload::Cpu {
        Pool::Host
    } else {
        Pool::Device
    };
    let master = policy.mixed_precision.master;
    // About a dozen instructions per step and per group, and a few buffers per step and
    // group: sized once, the vectors are not copied as they grow (a search builds hundreds
    // of schedules).
    let mut b = Builder {
        groups,
        policy,
        mesh,
        buffers: IdVec::with_capacity(3 * (n + steps.len())),
        events: 0,
        instrs: Vec::with_capacity(12 * (n + steps.len())),
        last_wait: [None; Stream::ALL.len()],
        deferring: false,
        deferred: Vec::new(),
        sharded: IdVec::with_capacity(n),
        optim: IdVec::with_capacity(n),
        gathered: IdVec::from_elem(None, n),
        post_forward: IdVec::from_elem(None, n),
        pieces: IdVec::from_elem(Vec::new(), n),
        sharded_grads: IdVec::from_elem(None, n),
        grads_done: IdVec::from_elem(None, n),
        fsdp2: policy.runtime == Runtime::Fsdp2,
        ag_state: None,
        rs_state: None,
        named,
    };
    for grp in groups {
        let g = grp.group.id;
        let shard = grp.layout.shard_numel;
        let p = b.buf(
            || format!("{g}.params"),
            Category::ShardedParams,
            g,
            master,
            shard,
            pool,
        );
        b.buffers[p].persistent = true;
        let pushed = b.sharded.push(p);
        debug_assert_eq!(pushed, g, "groups are in id order");
        let k = policy.optimizer_state_per_param;
        let o = (k > 0).then(|| {
            let o = b.buf(
                || format!("{g}.optim"),
                Category::OptimizerState,
                g,
                master,
                shard * k,
                pool,
            );
            b.buffers[o].persistent = true;
            o
        });
        b.optim.push(o);
        if b.fsdp2 && policy.optimizer == "adamw" {
            // torch's AdamW: a 4-byte `step` tensor per parameter.
            let steps = b.buf(
                || format!("{g}.optim.step"),
                Category::OptimizerState,
                g,
                DType::F32,
                grp.group.params.len() as u64,
                pool,
            );
            b.buffers[steps].persistent = true;
        }
    }

    let u = uses(steps, n);
    // Steps that make gradients of each group: one gradient piece each.
    let mut writers: IdVec<GroupId, usize> = IdVec::from_elem(0, n);
    for s in steps {
        for &g in &s.grads {
            writers[g] += 1;
        }
    }
    // The step at which each gather is issued.
    let mut gate_at: Vec<Vec<(GroupId, Phase, usize)>> = vec![Vec::new(); steps.len()];
    for gate in gates {
        gate_at[gate.at].push((gate.group, gate.phase, gate.need));
    }
    for at in &mut gate_at {
        // Gathers issued at one point go out in the order they are needed.
        at.sort_by_key(|&(_, _, need)| need);
    }

    let last_forward = steps.iter().rposition(|s| s.phase == Phase::Forward);
    let micros = policy.grad_accum as u32;
    // All-to-all steps issued and not yet waited for by the compute stream, with their end.
    let mut pending_a2a: Vec<(StepId, EventId)> = Vec::new();
    for micro in 0..micros {
        let last_micro = micro + 1 == micros;
        let sync = last_micro || policy.grad_sync == GradSync::EveryMicroBatch;
        for (pos, s) in steps.iter().enumerate() {
            // FSDP2 issues a group's own all-gather in its pre-hook, copies out, and only
            // then prefetches the next groups; shardplan issues them all before the step.
            let (now, ahead): (Vec<_>, Vec<_>) = gate_at[pos]
                .iter()
                .copied()
                .partition(|&(_, _, need)| !b.fsdp2 || need == pos);
            if !now.is_empty() {
                let gate = b.record(Stream::Compute);
                for &(g, phase, _) in &now {
                    b.gather(g, gate, micro, phase);
                }
            }
            let mut reads = crate::plan::Bufs::with_capacity(s.reads.len());
            for &g in &s.reads {
                let (mut buf, event, waited) = b.gathered[g].expect("every read group is gathered by its need");
                if !waited {
                    b.emit(Stream::Compute, Instr::Wait { event });
                    if b.fsdp2 {
                        buf = b.copy_out(g, buf, micro, s.phase);
                    }
                    b.gathered[g] = Some((buf, event, true));
                }
                reads.push(buf);
            }
            if !ahead.is_empty() {
                let gate = b.record(Stream::Compute);
                for &(g, phase, _) in &ahead {
                    b.gather(g, gate, micro, phase);
                }
            }
            let mut writes = crate::plan::Bufs::with_capacity(s.grads.len());
            for &g in &s.grads {
                let existing = b.pieces[g].iter().find(|(at, _)| *at == pos).map(|(_, buf)| *buf);
                let buf = match existing {
                    Some(buf) => buf,
                    None => {
                        let grp = &groups[g.index()];
                        let params: Vec<ParamId> = grp
                            .group
                            .params
                            .iter()
                            .copied()
                            .filter(|p| s.grad_params.binary_search(p).is_ok())
                            .collect();
                        let numel = grp
                            .layout
                            .params
                            .iter()
                            .filter(|l| params.contains(&l.param))
                            .map(|l| l.numel())
                            .sum();
                        let several = writers[g] > 1;
                        let buf = b.buf(
                            || {
                                let mut tag = String::new();
                                if policy.grad_accum > 1 && policy.grad_sync == GradSync::EveryMicroBatch {
                                    tag.push_str(&format!("{micro}"));
                                }
                                if several {
                                    tag.push_str(&format!(".{}", StepId::new(pos)));
                                }
                                format!("{g}.unsharded_grads{tag}")
                            },
                            Category::UnshardedGrads,
                            g,
                            policy.mixed_precision.param,
                            numel,
                            Pool::Device,
                        );
                        b.buffers[buf].params = params;
                        b.emit(Stream::Compute, Instr::Alloc { buf });
                        b.pieces[g].push((pos, buf));
                        buf
                    }
                };
                writes.push(buf);
            }
            let run = Instr::Compute {
                step: StepId::new(pos),
                micro,
                reads,
                writes,
            };
            if s.stream == Stream::Compute {
                // The all-to-alls whose values this step is the first to touch.
                for x in &s.waits_for {
                    if let Some(k) = pending_a2a.iter().position(|(p, _)| p == x) {
                        let (_, event) = pending_a2a.swap_remove(k);
                        b.emit(Stream::Compute, Instr::Wait { event });
                    }
                }
                b.emit(Stream::Compute, run);
            } else {
                // An expert-group collective on its own stream, after the compute steps
                // that make its input; the compute stream goes on until a step touches
                // its values (`Step::waits_for`).
                let ready = b.record(Stream::Compute);
                b.emit(s.stream, Instr::Wait { event: ready });
                b.emit(s.stream, run);
                let done = b.record(s.stream);
                pending_a2a.push((StepId::new(pos), done));
            }
            // A step split off before its group's gradients (see `steps`) is short: the
            // deferred tails wait for the step after it.
            let split_off = s.phase == Phase::Backward
                && s.grads.is_empty()
                && steps
                    .get(pos + 1)
                    .is_some_and(|n| n.group == s.group && n.phase == s.phase);
            if !split_off {
                b.flush();
            }
            for &g in &s.reads {
                let (buf, _, _) = b.gathered[g].expect("read groups are gathered");
                // FSDP2 reshards a group in its post-backward, once its gradients are made
                // (the root's, with no input gradient to hook, at the end of backward): its
                // parameters outlive their last read until then.
                if u.last[g] == Some(pos) {
                    let held_to_post_backward = b.fsdp2 && u.last_grad[g].is_some_and(|l| l > pos);
                    if !held_to_post_backward {
                        b.emit(Stream::Compute, Instr::Free { buf });
                        b.gathered[g] = None;
                    }
                } else if u.last_forward[g] == Some(pos) {
                    match groups[g.index()].reshard {
                        GroupReshard::Keep => {}
                        GroupReshard::Free => {
                            b.emit(Stream::Compute, Instr::Free { buf });
                            b.gathered[g] = None;
                        }
                        GroupReshard::ToGroupOf(k) => {
                            let numel = b.gathered_numel(g) / k;
                            let tag = b.suffix(micro, "pf");
                            let pf = b.buf(
                                || format!("{g}.{tag}_shard"),
                                Category::UnshardedParams,
                                g,
                                policy.mixed_precision.param,
                                numel,
                                Pool::Device,
                            );
                            b.emit(Stream::Compute, Instr::Alloc { buf: pf });
                            b.emit(
                                Stream::Compute,
                                Instr::Copy {
                                    src: buf,
                                    dst: pf,
                                    accumulate: false,
                                },
                            );
                            b.emit(Stream::Compute, Instr::Free { buf });
                            b.gathered[g] = None;
                            b.post_forward[g] = Some(pf);
                        }
                    }
                }
            }
            if b.fsdp2 && last_forward == Some(pos) {
                // The root's post-forward frees the all-gather output kept for overlap.
                b.release_ag_state();
            }
            if b.fsdp2 {
                for &g in &s.grads {
                    if u.last_grad[g] == Some(pos) && u.last[g].is_some_and(|l| l < pos) {
                        if let Some((buf, _, _)) = b.gathered[g].take() {
                            b.emit(Stream::Compute, Instr::Free { buf });
                        }
                    }
                }
            }
            if sync {
                for &g in &s.grads {
                    if u.last_grad[g] == Some(pos) {
                        b.reduce(g, micro, last_micro);
                    }
                }
            }
        }
        // (An all-to-all no compute step touched is waited for at the micro-batch's end.)
        for (_, event) in std::mem::take(&mut pending_a2a) {
            b.emit(Stream::Compute, Instr::Wait { event });
        }
        // The end of FSDP2's backward frees the last reduce-scatter input.
        b.release_rs_state();
    }

    b.flush();
    // Gradient norm and the optimizer step, on the device or (offload) on the host.
    let opt = if policy.offload == Offload::Cpu {
        Stream::Host
    } else {
        Stream::Compute
    };
    let finals: Vec<(GroupId, BufId, EventId)> = groups
        .iter()
        .filter_map(|grp| b.grads_done[grp.group.id].map(|(buf, e)| (grp.group.id, buf, e)))
        .collect();
    for &(_, _, e) in &finals {
        b.emit(opt, Instr::Wait { event: e });
    }
    let norm = policy.grad_clip.map(|_| {
        let id = b.buffers.next_key();
        b.buffers.push(Buffer {
            id,
            name: "grad_norm".into(),
            category: Category::CommBuffers,
            group: None,
            // f64: the clipping factor must not depend on how the sum was split.
            dtype: DType::F64,
            numel: 1,
            pool: Pool::Device,
            persistent: false,
            params: Vec::new(),
        });
        b.emit(opt, Instr::Alloc { buf: id });
        b.emit(
            opt,
            Instr::GradNorm {
                grads: finals.iter().map(|f| f.1).collect(),
                dst: id,
            },
        );
        let partial = b.record(opt);
        b.emit(Stream::AllReduce, Instr::Wait { event: partial });
        b.emit(
            Stream::AllReduce,
            Instr::AllReduce {
                group: None,
                comm: Comm::Shard,
                op: ReduceOp::Sum,
                buf: id,
            },
        );
        if b.mesh.tensor() > 1 {
            // Each rank's partial sum counts the parameters split over its tensor group
            // whole and the ones every tensor rank holds once per rank (divided by the
            // group's size), so summed over the group each counts once.
            b.emit(
                Stream::AllReduce,
                Instr::AllReduce {
                    group: None,
                    comm: Comm::Tensor,
                    op: ReduceOp::Sum,
                    buf: id,
                },
            );
        }
        let reduced = b.record(Stream::AllReduce);
        b.emit(opt, Instr::Wait { event: reduced });
        id
    });
    // torch's foreach AdamW (FSDP2's run with `implementation: foreach`) steps every
    // parameter at once: `_foreach_sqrt` of the second moments makes one temporary per
    // parameter, the size of its shard, all alive until the update (the first group's
    // gradients are still alive beside them: freeing them after its step changes no peak);
    // the fused kernel makes none. They are freed when the step ends.
    let temporaries: Vec<BufId> =
        if b.fsdp2 && policy.optimizer == "adamw" && policy.adamw_implementation == AdamwImplementation::Foreach {
            finals
                .iter()
                .map(|&(g, _, _)| {
                    let shard = groups[g.index()].layout.shard_numel;
                    let t = b.buf(
                        || format!("{g}.optim.tmp"),
                        Category::OptimizerState,
                        g,
                        master,
                        shard,
                        pool,
                    );
                    b.emit(opt, Instr::Alloc { buf: t });
                    t
                })
                .collect()
        } else {
            Vec::new()
        };
    for &(g, grads, _) in &finals {
        b.emit(
            opt,
            Instr::OptimizerStep {
                group: g,
                params: b.sharded[g],
                state: b.optim[g],
                grads,
                norm,
            },
        );
        b.emit(opt, Instr::Free { buf: grads });
    }
    for buf in temporaries {
        b.emit(opt, Instr::Free { buf });
    }
    if let Some(n) = norm {
        b.emit(opt, Instr::Free { buf: n });
    }
    Schedule {
        buffers: b.buffers.into_vec(),
        events: b.events,
        program: Program { instrs: b.instrs },
    }
}
