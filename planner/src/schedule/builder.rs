//! The schedule's builder: the buffers, events and instructions issued so far, and each
//! group's state (its persistent buffers, its gathered parameters, its gradient pieces and
//! sharded gradients). Both runtimes' lowerings issue through it.

use super::{Lowering, Schedule};
use crate::group::GroupId;
use crate::mesh::Mesh;
use crate::plan::{
    BufId, Buffer, Category, Comm, EventId, Instr, Issued, PlannedGroup, Policy, Pool, Program, ReduceOp, Stream,
};
use crate::steps::Phase;
use shardplan_frontends::{Offload, Reshard};
use shardplan_ir::{DType, IdVec};

pub(crate) struct Builder<'a> {
    pub groups: &'a [PlannedGroup],
    pub policy: &'a Policy,
    pub mesh: &'a Mesh,
    buffers: IdVec<BufId, Buffer>,
    events: u32,
    instrs: Vec<Issued>,
    last_wait: [Option<EventId>; Stream::ALL.len()],
    /// While set, `emit` collects into `deferred` (a reduction's tail, issued one compute
    /// step later so the next step's allocations do not wait on it).
    pub deferring: bool,
    deferred: Vec<(Stream, Instr)>,
    // Per group:
    pub sharded: IdVec<GroupId, BufId>,
    pub optim: IdVec<GroupId, Option<BufId>>,
    /// The gathered parameters: the buffer steps read, its all-gather's end, and whether
    /// the compute stream has waited for it.
    pub gathered: IdVec<GroupId, Option<(BufId, EventId, bool)>>,
    pub post_forward: IdVec<GroupId, Option<BufId>>,
    /// Per group, its gradient pieces made so far: (step position, buffer).
    pub pieces: IdVec<GroupId, Vec<(usize, BufId)>>,
    pub sharded_grads: IdVec<GroupId, Option<BufId>>,
    pub grads_done: IdVec<GroupId, Option<(BufId, EventId)>>,
    /// Whether buffers get their names (the auto search's candidate and trial schedules
    /// leave them empty: only the plan it returns is printed, and that one is planned
    /// again).
    named: bool,
}

impl<'a> Builder<'a> {
    /// An empty schedule for `groups` of `steps` compute steps.
    pub(crate) fn new(
        groups: &'a [PlannedGroup],
        policy: &'a Policy,
        mesh: &'a Mesh,
        steps: usize,
        named: bool,
    ) -> Self {
        let n = groups.len();
        // About a dozen instructions per step and per group, and a few buffers per step and
        // group: sized once, the vectors are not copied as they grow (a search builds
        // hundreds of schedules).
        Builder {
            groups,
            policy,
            mesh,
            buffers: IdVec::with_capacity(3 * (n + steps)),
            events: 0,
            instrs: Vec::with_capacity(12 * (n + steps)),
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
            named,
        }
    }

    /// The schedule issued.
    pub(crate) fn finish(self) -> Schedule {
        Schedule {
            buffers: self.buffers.into_vec(),
            events: self.events,
            program: Program { instrs: self.instrs },
        }
    }

    /// Where group state lives: on the host under CPU offload.
    pub(crate) fn state_pool(&self) -> Pool {
        if self.offload() {
            Pool::Host
        } else {
            Pool::Device
        }
    }

    /// The stream of the optimizer step: the compute stream, or the host's under CPU
    /// offload.
    pub(crate) fn optimizer_stream(&self) -> Stream {
        if self.offload() {
            Stream::Host
        } else {
            Stream::Compute
        }
    }

    /// Every group's persistent buffers: its sharded parameters, its optimizer state, and
    /// what `lowering` keeps beside them.
    pub(crate) fn persistent_state(&mut self, lowering: &mut impl Lowering) {
        let pool = self.state_pool();
        let master = self.policy.mixed_precision.master();
        for grp in self.groups {
            let g = grp.group.id;
            let shard = grp.layout.shard_numel;
            let p = self.buf(
                || format!("{g}.params"),
                Category::ShardedParams,
                g,
                master,
                shard,
                pool,
            );
            self.buffers[p].persistent = true;
            let pushed = self.sharded.push(p);
            debug_assert_eq!(pushed, g, "groups are in id order");
            let k = self.policy.optimizer_state_per_param;
            let o = (k > 0).then(|| {
                let o = self.buf(
                    || format!("{g}.optim"),
                    Category::OptimizerState,
                    g,
                    master,
                    shard * k,
                    pool,
                );
                self.buffers[o].persistent = true;
                o
            });
            self.optim.push(o);
            lowering.group_state(self, g, grp.group.params.len() as u64, pool);
        }
    }

    #[inline]
    pub(crate) fn buf(
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

    /// A device buffer of `g`'s gathered size in the parameter dtype: what an all-gather of
    /// `g` writes, or the per-parameter tensors FSDP2 copies it out into.
    pub(crate) fn gathered_buf(&mut self, g: GroupId, category: Category, name: impl FnOnce() -> String) -> BufId {
        let (p, full) = (self.policy.mixed_precision.param, self.gathered_numel(g));
        self.buf(name, category, g, p, full, Pool::Device)
    }

    /// A buffer of no group (the gradient norm).
    pub(crate) fn shared_buf(&mut self, name: &str, category: Category, dtype: DType, numel: u64) -> BufId {
        let id = self.buffers.next_key();
        self.buffers.push(Buffer {
            id,
            name: name.into(),
            category,
            group: None,
            dtype,
            numel,
            pool: Pool::Device,
            persistent: false,
            params: Vec::new(),
        })
    }

    #[inline]
    pub(crate) fn buffer_mut(&mut self, b: BufId) -> &mut Buffer {
        &mut self.buffers[b]
    }

    #[inline]
    pub(crate) fn numel(&self, b: BufId) -> u64 {
        self.buffers[b].numel
    }

    #[inline]
    fn event(&mut self) -> EventId {
        self.events += 1;
        EventId::new(self.events as usize - 1)
    }

    #[inline]
    pub(crate) fn emit(&mut self, stream: Stream, instr: Instr) {
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

    #[inline]
    pub(crate) fn record(&mut self, stream: Stream) -> EventId {
        let e = self.event();
        self.emit(stream, Instr::Record { event: e });
        e
    }

    /// Issues the deferred reduction tails.
    pub(crate) fn flush(&mut self) {
        for (stream, instr) in std::mem::take(&mut self.deferred) {
            self.emit(stream, instr);
        }
    }

    #[inline]
    pub(crate) fn offload(&self) -> bool {
        self.policy.offload == Offload::Cpu
    }

    /// The process group `g` is sharded over.
    #[inline]
    pub(crate) fn shard_comm(&self, g: GroupId) -> Comm {
        self.mesh.shard_comm(&self.groups[g.index()].group)
    }

    /// How `g`'s gradients are reduced over its shard group: averaged, and the routed
    /// experts' (which sum the tokens of their whole expert group already) over the whole
    /// shard axis.
    #[inline]
    pub(crate) fn grad_reduce(&self, g: GroupId) -> ReduceOp {
        if self.groups[g.index()].group.experts && self.mesh.expert() > 1 {
            ReduceOp::AvgOver(self.mesh.shard())
        } else {
            ReduceOp::Avg
        }
    }

    #[inline]
    pub(crate) fn gathered_numel(&self, g: GroupId) -> u64 {
        self.groups[g.index()].layout.gathered_numel()
    }

    #[inline]
    pub(crate) fn shard_numel(&self, g: GroupId) -> u64 {
        self.groups[g.index()].layout.shard_numel
    }

    /// The part of a buffer's name that says its pass and micro-batch (empty, and not
    /// allocated, when buffers go unnamed: it is read only by their names).
    #[inline]
    pub(crate) fn suffix(&self, micro: u32, phase: &str) -> String {
        if !self.named {
            String::new()
        } else if self.policy.grad_accum > 1 {
            format!("{phase}{micro}")
        } else {
            phase.to_string()
        }
    }

    /// All-gathers group `g` on the all-gather stream once `gate` (a compute event)
    /// passes, into the buffer `lowering` gathers into; or, where the lowering skips a
    /// one-rank gather, marks the sharded parameters gathered once `gate` passes.
    pub(crate) fn gather(&mut self, lowering: &mut impl Lowering, g: GroupId, gate: EventId, micro: u32, phase: Phase) {
        if self.post_forward[g].is_none() && !self.offload() && lowering.skips_gather(self, g) {
            self.emit(Stream::AllGather, Instr::Wait { event: gate });
            let done = self.record(Stream::AllGather);
            self.gathered[g] = Some((self.sharded[g], done, false));
            return;
        }
        let tag = self.suffix(micro, if phase == Phase::Forward { "fwd" } else { "bwd" });
        let dst = lowering.gather_output(self, g, &tag);
        let (src, comm, drop_src) = match self.post_forward[g].take() {
            Some(pf) => {
                let n = match self.groups[g.index()].reshard {
                    Reshard::ToGroupOf(n) => n,
                    _ => self.mesh.shard(),
                };
                self.emit(Stream::AllGather, Instr::Wait { event: gate });
                (pf, Comm::Reshard(n), true)
            }
            None if self.offload() => (self.shard_to_device(g, gate), self.shard_comm(g), true),
            None => {
                self.emit(Stream::AllGather, Instr::Wait { event: gate });
                (self.sharded[g], self.shard_comm(g), false)
            }
        };
        let cast = lowering.gather_input(self, g, src, &tag);
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

    /// Under CPU offload, `g`'s shard copied to the device once `gate` passes, the
    /// all-gather stream waiting for the copy.
    fn shard_to_device(&mut self, g: GroupId, gate: EventId) -> BufId {
        let dev = self.buf(
            || format!("{g}.params.device"),
            Category::ShardedParams,
            g,
            self.policy.mixed_precision.master(),
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
        dev
    }

    /// Packs group `g`'s gradient pieces into the reduce-scatter input on the compute
    /// stream and frees them there (FSDP2's copy-in), then reduce-scatters it as
    /// `lowering` does; on the final micro-batch also the replica all-reduce and the host
    /// copy.
    pub(crate) fn reduce(&mut self, lowering: &mut impl Lowering, g: GroupId, micro: u32, last_micro: bool) {
        let pieces: Vec<BufId> = std::mem::take(&mut self.pieces[g])
            .into_iter()
            .map(|(_, b)| b)
            .collect();
        if pieces.is_empty() {
            return;
        }
        let reduce = self.policy.mixed_precision.reduce;
        lowering.before_pack(self);
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
        lowering.reduce_scatter(self, g, micro, last_micro, packed);
    }

    /// The sharded gradients of `g`, allocated on the reduce-scatter stream (as `emit`
    /// issues now: at once, or deferred) at its first reduction.
    pub(crate) fn sharded_grads(&mut self, g: GroupId) -> BufId {
        if let Some(b) = self.sharded_grads[g] {
            return b;
        }
        let b = self.buf(
            || format!("{g}.grads"),
            Category::ShardedGrads,
            g,
            self.policy.mixed_precision.master(),
            self.shard_numel(g),
            Pool::Device,
        );
        self.emit(Stream::ReduceScatter, Instr::Alloc { buf: b });
        self.sharded_grads[g] = Some(b);
        b
    }

    /// Reduce-scatters `g`'s packed gradients `src` into `dst` over its shard group, on the
    /// reduce-scatter stream.
    pub(crate) fn reduce_scatter(&mut self, g: GroupId, src: BufId, dst: BufId) {
        let (comm, op) = (self.shard_comm(g), self.grad_reduce(g));
        self.emit(
            Stream::ReduceScatter,
            Instr::ReduceScatter {
                group: g,
                comm,
                op,
                src,
                dst,
            },
        );
    }

    /// Ends a deferred reduction tail whose sharded gradients `acc` are now written: their
    /// end recorded, and on the last micro-batch what follows ([`Builder::finish_grads`]).
    pub(crate) fn end_reduction(&mut self, g: GroupId, acc: BufId, last_micro: bool) {
        let done = self.record(Stream::ReduceScatter);
        if last_micro {
            self.finish_grads(g, acc, done);
        }
        self.deferring = false;
    }

    /// The final micro-batch's tail of a group's reduction, from its sharded gradients `acc`
    /// ready at `done`: the replica all-reduce (HSDP), the host copy (offload).
    pub(crate) fn finish_grads(&mut self, g: GroupId, acc: BufId, mut done: EventId) {
        let master = self.policy.mixed_precision.master();
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
}
