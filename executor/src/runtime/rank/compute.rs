//! The compute stream's instructions: a step's nodes in the plan's execution order, with
//! the parameters as views of their groups' gathered buffers and the gradients packed into
//! the reduce-scatter layout (`Instr::Compute`, `Instr::PackGrads`'s helpers).

use super::*;

/// The rows of `layout`'s parameter `i` that shard rank `s` holds, as (offset in its flat
/// shard, elements).
pub(super) fn valid(layout: &GroupLayout, i: usize, s: u64) -> (usize, usize) {
    let p = &layout.params[i];
    let r = chunk_rows(p.dims.first().copied().unwrap_or(1), layout.shard, s);
    (p.shard_offset as usize, ((r.end - r.start) * p.row_elems) as usize)
}

/// The full parameters of a group from its flat all-gather output.
pub(super) fn unflatten(layout: &GroupLayout, gathered: &Tensor) -> Result<Vec<Tensor>, ExecError> {
    let mut out = Vec::with_capacity(layout.params.len());
    for (i, p) in layout.params.iter().enumerate() {
        let mut pieces = Vec::new();
        for s in 0..layout.shard {
            let (off, n) = valid(layout, i, s);
            if n > 0 {
                pieces.push(gathered.narrow(0, s as usize * layout.shard_numel as usize + off, n)?);
            }
        }
        let dims: Vec<usize> = p.dims.iter().map(|&d| d as usize).collect();
        out.push(Tensor::cat(&pieces, 0)?.reshape(dims.as_slice())?);
    }
    Ok(out)
}

/// Gradients (full shapes, by position in the layout; `None` = zero) laid out as a flat
/// all-gather-shaped buffer: rank-major padded shards.
pub(super) fn flatten(
    layout: &GroupLayout,
    grads: &[Option<Tensor>],
    dtype: CDType,
    device: &candle_core::Device,
) -> Result<Tensor, ExecError> {
    let mut pieces = Vec::new();
    let flat: Vec<Option<Tensor>> = grads
        .iter()
        .map(|g| g.as_ref().map(|g| g.flatten_all()).transpose())
        .collect::<Result<_, _>>()?;
    for s in 0..layout.shard {
        for (i, p) in layout.params.iter().enumerate() {
            let rows = chunk_rows(p.dims.first().copied().unwrap_or(1), layout.shard, s);
            let n = ((rows.end - rows.start) * p.row_elems) as usize;
            let pad = p.shard_numel() as usize - n;
            match &flat[i] {
                Some(g) if n > 0 => pieces.push(g.narrow(0, (rows.start * p.row_elems) as usize, n)?.to_dtype(dtype)?),
                _ if n > 0 => pieces.push(Tensor::zeros(n, dtype, device)?),
                _ => {}
            }
            if pad > 0 {
                pieces.push(Tensor::zeros(pad, dtype, device)?);
            }
        }
    }
    Ok(Tensor::cat(&pieces, 0)?)
}

/// The compute stream's own state: activations and parameter views.
pub(super) struct Compute<'c> {
    pub(super) ctx: &'c mut Ctx,
    pub(super) values: IdVec<ValueSlot, Option<Tensor>>,
    /// Gradients a blockwise attention backward made before their own nodes run (see
    /// `ExecOrder::blockwise_attention`); counted in `live` from when they are made.
    pub(super) early: HashMap<NodeId, Tensor>,
    pub(super) live: u64,
    pub(super) micro: Option<u32>,
    pub(super) params: HashMap<BufId, Vec<Tensor>>,
}

impl<'c> Compute<'c> {
    /// Nothing computed yet, on `ctx`, with room for `n_values` values.
    pub(super) fn new(ctx: &'c mut Ctx, n_values: usize) -> Self {
        Compute {
            ctx,
            values: IdVec::from_elem(None, n_values),
            early: HashMap::new(),
            live: 0,
            micro: None,
            params: HashMap::new(),
        }
    }

    /// Starts micro-batch `micro`'s values, dropping another micro-batch's.
    fn enter(&mut self, micro: u32) {
        if self.micro != Some(micro) {
            self.values.values_mut().for_each(|v| *v = None);
            self.early.clear();
            self.live = 0;
            self.micro = Some(micro);
        }
    }
}

/// One compute step's working state while its nodes run.
struct NodeRun<'s> {
    step: usize,
    /// Whether the step recomputes (its values are the recompute copies).
    copy: bool,
    batch: &'s HashMap<String, Tensor>,
    /// Parameter views of the groups the step reads, by parameter.
    params: HashMap<u32, Tensor>,
    /// The parameter gradients the step made, by parameter.
    grads: HashMap<u32, Tensor>,
    /// The running node's position in the execution order.
    pos: usize,
    /// With `profile`: each node's host time, or its marks on the device clock.
    node_seconds: Vec<(NodeId, f64)>,
    node_marks: Vec<(NodeId, Mark, Mark)>,
}

impl StepCtx<'_> {
    /// The node of all-to-all step `step`, whether it is a recomputed copy, and its
    /// position in the execution order.
    fn all_to_all_node(&self, step: usize) -> Result<(NodeId, bool, usize), ExecError> {
        let s = self
            .shared
            .plan
            .steps
            .get(step)
            .ok_or_else(|| ExecError::Internal(format!("no step s{step}")))?;
        let id = s
            .nodes
            .first()
            .map(|r| NodeId(r.start))
            .ok_or_else(|| ExecError::Internal(format!("all-to-all step s{step} has no node")))?;
        Ok((
            id,
            s.phase == shardplan_planner::Phase::Recompute,
            self.shared.step_start[step],
        ))
    }

    /// The compute stream hands all-to-all step `i` (issue index) its operands as it
    /// records the event the step waits for, and counts its output from then on, where the
    /// plan counts it. The compute steps before the step's join do not touch them.
    pub(super) fn hand_operands(&self, i: usize, state: &Mutex<Option<Compute>>) -> Result<(), ExecError> {
        let sh = self.shared;
        let Instr::Compute { step, .. } = &sh.plan.programs[0].instrs[i].instr else {
            return Err(ExecError::Internal(format!("#{i} is not an all-to-all step")));
        };
        let (id, copy, _) = self.all_to_all_node(step.index())?;
        let g = &sh.joint.graph;
        // (An operand the compute stream does not hold is an earlier all-to-all step's
        // output, which the all-to-all stream keeps for it: `all_to_all`.)
        let ops: Vec<Option<Tensor>> = {
            let guard = lock(state);
            let c = guard
                .as_ref()
                .ok_or_else(|| ExecError::Internal("no compute state".into()))?;
            g.node(id)
                .inputs
                .iter()
                .map(|&x| c.values[sh.exec.read_slot(id, copy, x)].clone())
                .collect()
        };
        lock(&self.a2a.mailbox).insert(i, ops);
        let mut m = lock(&self.memory);
        m.in_flight += sh.exec.value_bytes(g, id);
        m.observe();
        Ok(())
    }

    /// All-to-all step `i` (issue index): its expert-group collective on the operands the
    /// compute stream handed it, its output left for the compute step that waits for it.
    pub(super) fn all_to_all(&self, i: usize, step: usize, micro: u32) -> Result<(), ExecError> {
        let sh = self.shared;
        let g = &sh.joint.graph;
        let (id, copy, _) = self.all_to_all_node(step)?;
        let handed = lock(&self.a2a.mailbox)
            .remove(&i)
            .ok_or_else(|| ExecError::Internal(format!("all-to-all step s{step} ran before its operands were made")))?;
        let mut ops = Vec::with_capacity(handed.len());
        {
            let mut kept = lock(&self.a2a.kept);
            for (&x, t) in g.node(id).inputs.iter().zip(handed) {
                let slot = sh.exec.read_slot(id, copy, x);
                let t = match t {
                    Some(t) => t,
                    None => kept
                        .get(&(slot, micro))
                        .cloned()
                        .ok_or_else(|| ExecError::Internal(format!("{id} reads {x} after it was freed")))?,
                };
                if self.tables.a2a_last.get(&(slot, micro)) == Some(&i) {
                    kept.remove(&(slot, micro));
                }
                ops.push(t);
            }
        }
        // Not in `node_seconds`, the compute stream's ops: the step's time is its own
        // instruction's, the profile's all-to-all row.
        let refs: Vec<&Tensor> = ops.iter().collect();
        let op = &sh.joint.graph.node(id).op;
        let missing = |group: &str| {
            ExecError::Internal(format!(
                "s{step} is an all-to-all step, but this rank has no {group} group"
            ))
        };
        let value = if op.is_context_collective() {
            let group = self.a2a.context.as_ref().ok_or_else(|| missing("context"))?;
            crate::cpu::kernels::apply_context(group, op, &refs)?
        } else {
            let group = self.a2a.expert.as_ref().ok_or_else(|| missing("expert"))?;
            crate::cpu::kernels::apply_expert(group, op, &refs)?
        };
        let own = ValueSlot::of(id, copy);
        if self.tables.a2a_last.contains_key(&(own, micro)) {
            // A later all-to-all step reads it (a routing table): kept until that one.
            lock(&self.a2a.kept).insert((own, micro), value.clone());
        }
        lock(&self.a2a.outbox).insert((step as u32, micro), value);
        Ok(())
    }

    /// Takes the output of all-to-all step `step` into the compute stream's values (the
    /// plan has the compute stream wait for it first) and frees the operands it was the
    /// last reader of.
    fn join(&self, c: &mut Compute, step: usize, micro: u32) -> Result<(), ExecError> {
        let sh = self.shared;
        let g = &sh.joint.graph;
        let (id, copy, pos) = self.all_to_all_node(step)?;
        let value = lock(&self.a2a.outbox).remove(&(step as u32, micro)).ok_or_else(|| {
            ExecError::Internal(format!(
                "all-to-all step s{step} has not finished when a step waiting for it starts"
            ))
        })?;
        let bytes = sh.exec.value_bytes(g, id);
        let own = ValueSlot::of(id, copy);
        if sh.exec.last_use(own).is_some() {
            c.values[own] = Some(value);
            c.live += bytes;
        }
        self.free_last_reads(c, id, copy, pos);
        let mut m = lock(&self.memory);
        m.in_flight = m.in_flight.saturating_sub(bytes);
        m.activations = c.live;
        m.observe();
        Ok(())
    }

    /// The first gradient node `id` of a blockwise attention backward: computes all of its
    /// gradients, keeps the others in `c.early` (counted in `c.live` now) and returns `id`'s.
    pub(super) fn blockwise_attention(&self, c: &mut Compute, id: NodeId, copy: bool) -> Result<Tensor, ExecError> {
        let sh = self.shared;
        let g = &sh.joint.graph;
        let b = sh
            .exec
            .blockwise_group(id)
            .ok_or_else(|| ExecError::Internal(format!("{id} is not part of a blockwise attention")))?;
        let mut ops = Vec::with_capacity(4);
        for x in b.operands {
            let slot = sh.exec.read_slot(id, copy, x);
            ops.push(
                c.values[slot]
                    .clone()
                    .ok_or_else(|| ExecError::Internal(format!("{id} reads {x} after it was freed")))?,
            );
        }
        let outs = [b.dq, b.dk, b.dv];
        let made = if sh.native && b.context.is_none() && crate::gpu::attention_applies(&ops[0], &ops[1], &ops[2]) {
            // cuDNN's backward reads the forward's output and log-sum-exp; the plan keeps
            // neither, so the forward runs again here (a fifth of the backward's time on an
            // H200 at the 1.1B shape) and one plan serves every device.
            let (o, lse) = crate::gpu::attention(&ops[0], &ops[1], &ops[2], b.causal)?;
            let grads = crate::gpu::attention_backward(&ops[0], &ops[1], &ops[2], &o, &ops[3], &lse, b.causal)?;
            let mut made: [Option<Tensor>; 3] = grads.map(Some);
            for (m, o) in made.iter_mut().zip(outs) {
                if o.is_none() {
                    *m = None;
                }
            }
            made
        } else {
            crate::cpu::kernels::attention_backward_blockwise(
                &ops[0],
                &ops[1],
                &ops[2],
                &ops[3],
                &c.ctx.mask(b.causal, b.context, ops[0].dim(1)?)?,
                outs.map(|o| o.is_some()),
            )?
        };
        let mut own = None;
        for (node, t) in outs.into_iter().zip(made) {
            let (Some(node), Some(t)) = (node, t) else { continue };
            if node == id {
                own = Some(t);
            } else {
                c.live += sh.exec.value_bytes(g, node);
                c.early.insert(node, t);
            }
        }
        own.ok_or_else(|| ExecError::Internal(format!("{id} is not an output of its blockwise attention")))
    }

    /// Whether node `id` runs in place over its first input
    /// (`ExecOrder::in_place_cross_entropy`): where the fused CPU kernel takes it; other
    /// devices and dtypes make the gradient beside the logits.
    pub(super) fn overwritable(&self, c: &Compute, id: NodeId, copy: bool) -> bool {
        let sh = self.shared;
        let Some(x) = sh.exec.in_place(id) else { return false };
        let node = sh.joint.graph.node(id);
        let slot = sh.exec.read_slot(id, copy, x);
        matches!(node.op, Op::CrossEntropyGrad)
            && node.inputs.len() == 3
            && node.inputs[0] == x
            && c.values[slot]
                .as_ref()
                .is_some_and(|t| fused::applies(&[t]) && t.is_contiguous())
    }

    /// Compute step `step` on micro-batch `micro`: joins the all-to-all steps it waits
    /// for, runs its nodes in the execution order on parameter views of the groups it
    /// reads (`reads`), and adds the parameter gradients it makes into `writes`.
    pub(super) fn compute(
        &self,
        c: &mut Compute,
        step: usize,
        micro: u32,
        reads: &[BufId],
        writes: &[BufId],
    ) -> Result<(), ExecError> {
        let sh = self.shared;
        let s = sh
            .plan
            .steps
            .get(step)
            .ok_or_else(|| ExecError::Internal(format!("no step s{step}")))?;
        c.enter(micro);
        for x in &s.waits_for {
            self.join(c, x.index(), micro)?;
        }
        let mut run = NodeRun {
            step,
            copy: s.phase == shardplan_planner::Phase::Recompute,
            params: self.param_views(c, s, reads)?,
            batch: &self.batches[micro as usize],
            grads: HashMap::new(),
            pos: sh.step_start[step],
            node_seconds: Vec::new(),
            node_marks: Vec::new(),
        };
        for r in &s.nodes {
            for i in r.clone() {
                self.run_node(c, &mut run, NodeId(i))?;
            }
        }
        if sh.profile {
            lock(&self.out).node_seconds.extend(run.node_seconds);
            lock(&self.timing.node_marks).extend(run.node_marks);
        }
        lock(&self.memory).activations = c.live;
        self.write_grads(run.step, writes, run.grads)
    }

    /// The parameters of the groups step `s` reads, by parameter: views of the gathered
    /// buffers `reads`, made once per buffer while it lives.
    fn param_views(
        &self,
        c: &mut Compute,
        s: &shardplan_planner::Step,
        reads: &[BufId],
    ) -> Result<HashMap<u32, Tensor>, ExecError> {
        let groups = &self.shared.plan.groups;
        let mut param_of: HashMap<u32, Tensor> = HashMap::new();
        for (k, &b) in reads.iter().enumerate() {
            let group = &groups[s.reads[k].index()];
            let views = match c.params.entry(b) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => e.insert(unflatten(&group.layout, &self.get(b)?)?),
            };
            for (i, p) in group.group.params.iter().enumerate() {
                param_of.insert(p.0, views[i].clone());
            }
        }
        Ok(param_of)
    }

    /// Runs node `id`: its value, kept where the step reports it (the loss, a parameter's
    /// gradient) and among the values, then the values it was the last reader of freed.
    fn run_node(&self, c: &mut Compute, run: &mut NodeRun, id: NodeId) -> Result<(), ExecError> {
        let sh = self.shared;
        let g = &sh.joint.graph;
        let on_device = self.timing.origin.is_some();
        let started = (sh.profile && !on_device).then(Instant::now);
        let mark = if sh.profile && on_device {
            Some(self.timing.clock.mark()?)
        } else {
            None
        };
        let (value, counted) = self.node_value(c, run, id)?;
        if !run.copy {
            self.keep_output(run, id, &value)?;
        }
        if !counted {
            c.live += sh.exec.value_bytes(g, id);
        }
        let own = ValueSlot::of(id, run.copy);
        c.values[own] = Some(value);
        {
            let mut m = lock(&self.memory);
            m.activations = c.live;
            m.observe();
        }
        self.free_last_reads(c, id, run.copy, run.pos);
        if sh.exec.last_use(own).is_none() && c.values[own].take().is_some() {
            c.live -= sh.exec.value_bytes(g, id);
        }
        run.pos += 1;
        if let Some(t) = started {
            run.node_seconds.push((id, t.elapsed().as_secs_f64()));
        }
        if let Some(m) = mark {
            run.node_marks.push((id, m, self.timing.clock.mark()?));
        }
        Ok(())
    }

    /// Node `id`'s value, and whether its bytes are already in `c.live` (a gradient a
    /// blockwise attention made early).
    fn node_value(&self, c: &mut Compute, run: &NodeRun, id: NodeId) -> Result<(Tensor, bool), ExecError> {
        let sh = self.shared;
        let node = sh.joint.graph.node(id);
        Ok(match &node.op {
            Op::Input { name } => (
                run.batch
                    .get(name)
                    .cloned()
                    .ok_or_else(|| ExecError::Internal(format!("no data for input `{name}`")))?,
                false,
            ),
            _ if sh.exec.placeholder(id) => (Tensor::zeros(0, cdtype(node.ty.dtype), &c.ctx.device)?, false),
            _ if self.overwritable(c, id, run.copy) => (self.cross_entropy_in_place(c, id, run.copy)?, false),
            _ if sh.exec.blockwise_group(id).is_some() => match c.early.remove(&id) {
                Some(t) => (t, true),
                None => (self.blockwise_attention(c, id, run.copy)?, false),
            },
            _ => (self.apply_node(c, run, id)?, false),
        })
    }

    /// The cross-entropy's gradient over its logits (node `id`'s first input), which die
    /// here: made in place over them.
    fn cross_entropy_in_place(&self, c: &mut Compute, id: NodeId, copy: bool) -> Result<Tensor, ExecError> {
        let sh = self.shared;
        let node = sh.joint.graph.node(id);
        let x = node.inputs[0];
        let slot = sh.exec.read_slot(id, copy, x);
        let logits = c.values[slot]
            .take()
            .ok_or_else(|| ExecError::Internal(format!("{id} reads {x} after it was freed")))?;
        c.live -= sh.exec.value_bytes(&sh.joint.graph, x);
        let mut rest = Vec::with_capacity(2);
        for &input in &node.inputs[1..] {
            let slot = sh.exec.read_slot(id, copy, input);
            rest.push(
                c.values[slot]
                    .clone()
                    .ok_or_else(|| ExecError::Internal(format!("{id} reads {input} after it was freed")))?,
            );
        }
        fused::cross_entropy_grad_in_place(&logits, &rest[0], &rest[1])?;
        Ok(logits)
    }

    /// Node `id`'s kernel on its inputs: parameters from the step's views, the others
    /// from the values.
    fn apply_node(&self, c: &mut Compute, run: &NodeRun, id: NodeId) -> Result<Tensor, ExecError> {
        let sh = self.shared;
        let node = sh.joint.graph.node(id);
        let mut ins = Vec::with_capacity(node.inputs.len());
        for &input in &node.inputs {
            let t = match sh.exec.param_of(input) {
                Some(p) => run.params.get(&p).cloned().ok_or_else(|| {
                    ExecError::Internal(format!("{id} reads parameter p{p}, not gathered for this step"))
                })?,
                None => {
                    let slot = sh.exec.read_slot(id, run.copy, input);
                    c.values[slot]
                        .clone()
                        .ok_or_else(|| ExecError::Internal(format!("{id} reads {input} after it was freed")))?
                }
            };
            ins.push(t);
        }
        let refs: Vec<&Tensor> = ins.iter().collect();
        apply(c.ctx, &node.op, &refs, &node.ty)
    }

    /// Keeps the value of node `id` (not a recompute copy) where the step reports it: the
    /// loss (read now on the host, after the step on a GPU: reading a GPU value waits for
    /// the device) or a parameter's gradient.
    fn keep_output(&self, run: &mut NodeRun, id: NodeId, value: &Tensor) -> Result<(), ExecError> {
        let sh = self.shared;
        if id == sh.joint.loss && !value.device().is_cpu() {
            lock(&self.device_losses).push((value.clone(), id));
        } else if id == sh.joint.loss {
            let loss = value.to_dtype(CDType::F32)?.to_scalar::<f32>()?;
            if !loss.is_finite() {
                return Err(non_finite(&sh.joint.graph, id, loss));
            }
            lock(&self.out).losses.push(loss);
        }
        if sh.exec.is_param_grad(id) {
            if let Some(p) = sh.joint.param_grads.iter().position(|x| *x == Some(id)) {
                run.grads.insert(p as u32, value.clone());
            }
        }
        Ok(())
    }

    /// Frees the values node `id` (at position `pos` of the execution order) is the last
    /// reader of; parameters are views, never freed here.
    fn free_last_reads(&self, c: &mut Compute, id: NodeId, copy: bool, pos: usize) {
        let sh = self.shared;
        let g = &sh.joint.graph;
        for &x in g.node(id).inputs.iter().chain(sh.exec.extra_reads(g, id)) {
            if sh.exec.param_of(x).is_some() {
                continue;
            }
            let slot = sh.exec.read_slot(id, copy, x);
            if sh.exec.last_use(slot) == Some(pos) && c.values[slot].take().is_some() {
                c.live -= sh.exec.value_bytes(g, x);
            }
        }
    }

    /// The gradients step `step` made into their pieces `writes`: each piece's parameters,
    /// whole, one after another, added into it.
    fn write_grads(&self, step: usize, writes: &[BufId], mut grads: HashMap<u32, Tensor>) -> Result<(), ExecError> {
        let plan = &self.shared.plan;
        for &b in writes {
            let buf = plan.buffer(b);
            let dtype = cdtype(buf.dtype);
            let mut parts = Vec::with_capacity(buf.params.len());
            for p in &buf.params {
                let t = grads.remove(&p.0).ok_or_else(|| {
                    ExecError::Internal(format!(
                        "step s{step} made no gradient for {p}, which {} holds",
                        buf.name
                    ))
                })?;
                parts.push(t.flatten_all()?.to_dtype(dtype)?);
            }
            let update = Tensor::cat(&parts, 0)?;
            if update.elem_count() as u64 != buf.numel {
                return Err(ExecError::Internal(format!(
                    "{} holds {} elements, its gradients {}",
                    buf.name,
                    buf.numel,
                    update.elem_count()
                )));
            }
            self.accumulate(b, update)?;
        }
        Ok(())
    }
}
