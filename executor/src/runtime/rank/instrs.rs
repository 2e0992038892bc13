//! One function per kind of instruction, and the dispatch from an instruction to its kind.

use super::compute::flatten;
use super::*;

impl StepCtx<'_> {
    /// Runs instruction `i`. `state` is the compute stream's activations and parameter
    /// views: the compute stream's steps run on it, and so does a step on the all-to-all
    /// stream (an expert-group collective), which the plan orders between two compute steps
    /// (the verifier's activation order), so the two never hold it at once for long.
    pub(super) fn execute(&self, i: usize, state: &Mutex<Option<Compute>>) -> Result<(), ExecError> {
        let issued = &self.shared.plan.programs[0].instrs[i];
        let stream = issued.stream;
        match &issued.instr {
            Instr::Alloc { buf } => self.alloc(i, *buf),
            Instr::Free { buf } => self.free(i, *buf, stream, state),
            Instr::Record { event } => self.record_event(event.index(), state),
            Instr::Wait { event } => self.wait(event.index()),
            Instr::Compute { step, micro, .. } if stream == Stream::AllToAll => {
                self.launch(i, || self.all_to_all(i, step.index(), *micro))
            }
            Instr::Compute {
                step,
                micro,
                reads,
                writes,
            } => self.compute_step(i, step.index(), *micro, reads, writes, state),
            Instr::AllGather { comm, src, dst, .. } => self.all_gather(i, (*comm, stream), *src, *dst),
            Instr::PackGrads { group, dst, .. } => self.pack_grads(i, group.index(), *dst),
            Instr::ReduceScatter { comm, op, src, dst, .. } => self.reduce_scatter(i, (*comm, stream), *op, *src, *dst),
            Instr::AllReduce { comm, op, buf, .. } => self.all_reduce(i, (*comm, stream), *op, *buf),
            Instr::Copy { src, dst, accumulate } => self.copy(*src, *dst, *accumulate),
            Instr::PostForwardSlice { src, dst, ranks } => self.post_forward_slice(*src, *dst, *ranks),
            Instr::GradNorm { grads, dst } => self.grad_norm(grads, *dst),
            Instr::OptimizerStep {
                group,
                params,
                grads,
                norm,
                ..
            } => self.optimizer_step(group.index(), *params, *grads, *norm),
        }
    }

    /// `Alloc`: `buf` reads as zeros, and its bytes count from its turn in issue order.
    fn alloc(&self, i: usize, buf: BufId) -> Result<(), ExecError> {
        let b = self.shared.plan.buffer(buf);
        let bytes = planned_bytes(b);
        *lock(&self.bufs[buf.index()]) = Slot::Zero;
        self.sequenced(i, |m| {
            *m.level(b.pool).slot(b.category) += bytes;
            m.observe();
        })
    }

    /// `Free`: drops `buf` (and, on the compute stream, the parameter views of it); its
    /// bytes stop counting at its turn in issue order.
    fn free(&self, i: usize, buf: BufId, stream: Stream, state: &Mutex<Option<Compute>>) -> Result<(), ExecError> {
        let b = self.shared.plan.buffer(buf);
        let bytes = match std::mem::take(&mut *lock(&self.bufs[buf.index()])) {
            Slot::Value(t) => tensor_bytes(&t),
            Slot::Zero => planned_bytes(b),
            Slot::Free => 0,
        };
        if stream == Stream::Compute {
            if let Some(c) = lock(state).as_mut() {
                c.params.remove(&buf);
            }
        }
        self.sequenced(i, |m| {
            let level = m.level(b.pool);
            *level.slot(b.category) = level.get(b.category).saturating_sub(bytes);
        })
    }

    /// `Record`: marks event `e`, first handing the all-to-all step that waits for it its
    /// operands.
    fn record_event(&self, e: usize, state: &Mutex<Option<Compute>>) -> Result<(), ExecError> {
        if let Some(x) = self.tables.ready_of.get(e).copied().flatten() {
            self.hand_operands(x, state)?;
        }
        self.record(e);
        Ok(())
    }

    /// `Compute` on the compute stream: the step's nodes on the compute state, in its
    /// launch turn (the state is taken after the turn: a stream holding it never waits for
    /// a turn, see `launch`).
    fn compute_step(
        &self,
        i: usize,
        step: usize,
        micro: u32,
        reads: &[BufId],
        writes: &[BufId],
        state: &Mutex<Option<Compute>>,
    ) -> Result<(), ExecError> {
        self.launch(i, || {
            let mut guard = lock(state);
            let c = guard
                .as_mut()
                .ok_or_else(|| ExecError::Internal("no compute state for this step".into()))?;
            self.compute(c, step, micro, reads, writes)
        })
    }

    /// `AllGather`: `src`, cast to `dst`'s dtype, gathered over `on` into `dst`.
    fn all_gather(&self, i: usize, on: (Comm, Stream), src: BufId, dst: BufId) -> Result<(), ExecError> {
        let dtype = cdtype(self.shared.plan.buffer(dst).dtype);
        let input = self.get(src)?.to_dtype(dtype)?;
        let c = self.comms.get(on.0, on.1)?;
        let out = self.launch(i, || c.all_gather(self.tag(i), &input))?;
        self.set(dst, out)
    }

    /// `PackGrads`: the gradient pieces laid out as the group's all-gather output (the
    /// pieces' places in the layout are `ProgramTables::packs`).
    fn pack_grads(&self, i: usize, group: usize, dst: BufId) -> Result<(), ExecError> {
        let plan = &self.shared.plan;
        let layout = &plan.groups[group].layout;
        let mut per_param: Vec<Option<Tensor>> = vec![None; layout.params.len()];
        for (b, params) in &self.tables.packs[i] {
            let piece = self.get(*b)?;
            let mut off = 0usize;
            for &(k, n) in params {
                per_param[k] = Some(piece.narrow(0, off, n)?);
                off += n;
            }
        }
        let packed = flatten(layout, &per_param, cdtype(plan.buffer(dst).dtype), &self.device)?;
        self.set(dst, packed)
    }

    /// `ReduceScatter`: `src` reduced over `on`, this rank's part added into `dst`.
    fn reduce_scatter(
        &self,
        i: usize,
        on: (Comm, Stream),
        op: ReduceOp,
        src: BufId,
        dst: BufId,
    ) -> Result<(), ExecError> {
        let input = self.get(src)?;
        let c = self.comms.get(on.0, on.1)?;
        let part = self.launch(i, || c.reduce_scatter(self.tag(i), &input, reduce(op)))?;
        self.accumulate(dst, scaled(part, op)?)
    }

    /// `AllReduce`: `buf` reduced over `on`, in place.
    fn all_reduce(&self, i: usize, on: (Comm, Stream), op: ReduceOp, buf: BufId) -> Result<(), ExecError> {
        let t = self.get(buf)?;
        let c = self.comms.get(on.0, on.1)?;
        let r = self.launch(i, || c.all_reduce(self.tag(i), &t, reduce(op)))?;
        self.set(buf, scaled(r, op)?)
    }

    /// `Copy`: `src` into (or, `accumulate`, added to) `dst`, between pools a transfer.
    fn copy(&self, src: BufId, dst: BufId, accumulate: bool) -> Result<(), ExecError> {
        let s = self.get(src)?;
        let d = self.shared.plan.buffer(dst);
        let value = s.to_dtype(cdtype(d.dtype))?.copy()?;
        // Between pools (CPU offload), the copy is a transfer.
        let value = value.to_device(&self.pool_device(d.pool))?;
        if accumulate {
            self.accumulate(dst, value)
        } else {
            self.set(dst, value)
        }
    }

    /// `PostForwardSlice`: this rank's slice of the gathered `src` among `ranks`
    /// consecutive shard ranks (the rank's shard coordinate modulo `ranks`), into `dst`.
    fn post_forward_slice(&self, src: BufId, dst: BufId, ranks: u64) -> Result<(), ExecError> {
        let s = self.get(src)?;
        let n = self.shared.plan.buffer(dst).numel as usize;
        let j = (self.shared.plan.mesh.coords(self.rank).shard % ranks.max(1)) as usize;
        self.set(dst, s.narrow(0, j * n, n)?.copy()?)
    }

    /// `GradNorm`: the sum of squares of the averaged gradients `grads` into `dst`.
    fn grad_norm(&self, grads: &[BufId], dst: BufId) -> Result<(), ExecError> {
        let scale = 1.0 / self.shared.plan.policy.grad_accum as f64;
        let norm = self.sum_squares(grads, scale)?;
        self.set(dst, norm)
    }

    /// `OptimizerStep`: group `group`'s update of `params` from `grads`, averaged over the
    /// micro-batches and clipped by the norm in `norm` (if any); shardplan's own kernel
    /// when it applies.
    fn optimizer_step(&self, group: usize, params: BufId, grads: BufId, norm: Option<BufId>) -> Result<(), ExecError> {
        let accum = 1.0 / self.shared.plan.policy.grad_accum as f64;
        let scale = match norm {
            None => GradScale::Host(accum),
            Some(n) => self.clip_scale(&self.get(n)?, accum)?,
        };
        let mut g = self.get(grads)?;
        if self.shared.native {
            let (host, factor) = match &scale {
                GradScale::Host(s) => (*s, None),
                GradScale::Device(s) => (1.0, Some(s)),
            };
            let mut p = [self.get(params)?];
            if lock(&self.opt)[group].step_native(&mut p, &g, self.lr, host, factor)? {
                let [p] = p;
                return self.set(params, p);
            }
        }
        let host_scale = match scale {
            GradScale::Host(s) => s,
            GradScale::Device(s) => {
                g = g.broadcast_mul(&s.to_dtype(g.dtype())?)?;
                1.0
            }
        };
        let mut p = [self.get(params)?];
        lock(&self.opt)[group].step_scaled(&mut p, &[g], self.lr, host_scale)?;
        let [p] = p;
        self.set(params, p)
    }
}

fn reduce(op: ReduceOp) -> Reduce {
    match op {
        ReduceOp::Sum | ReduceOp::AvgOver(_) => Reduce::Sum,
        ReduceOp::Avg => Reduce::Avg,
    }
}

/// `t` divided as `op` asks after the backend's reduction ([`ReduceOp::AvgOver`]).
fn scaled(t: Tensor, op: ReduceOp) -> Result<Tensor, ExecError> {
    match op {
        ReduceOp::AvgOver(n) if n > 1 => Ok((t / n as f64)?),
        _ => Ok(t),
    }
}
