//! The execution order: the order a rank runs the joint graph's nodes in (checkpointed
//! blocks' recompute inserted), each value's last reader, and what shardplan's kernels or
//! PyTorch's hold beside the graph's values. The planner's activation model and the
//! executor both read it, so both free at the same points.

use super::Runner;
use shardplan_frontends::{ActivationCheckpointing, SavedMatmuls};
use shardplan_ir::{IdVec, JointGraph, ModuleKind, NodeId, Op, ScopeId};

shardplan_ir::entity! {
    /// A value of the execution order (printed `v7`): a node's output, or its recomputed
    /// copy in a checkpointed block's recompute ([`ValueSlot::of`]).
    pub struct ValueSlot("v");
}

impl ValueSlot {
    /// The slot of node `id`'s value (`copy`: of its recomputed copy).
    #[inline]
    pub fn of(id: NodeId, copy: bool) -> ValueSlot {
        ValueSlot(id.0 * 2 + u32::from(copy))
    }
}

/// `last_use` of a value nothing reads.
const UNREAD: usize = usize::MAX;

/// The order a rank runs the joint graph's nodes in, and when each value dies: shared by
/// the planner's activation model and the executor, so both free at the same points.
pub struct ExecOrder {
    /// `(node, recomputed copy?)` in execution order; parameters are not executed.
    order: Vec<(NodeId, bool)>,
    /// The parameter a `param` node yields.
    param_of_node: Vec<Option<u32>>,
    /// True for the nodes that are final parameter gradients.
    is_param_grad: Vec<bool>,
    /// Position in `order` of the last reader of each value; `UNREAD` for values nothing
    /// reads.
    last_use: IdVec<ValueSlot, usize>,
    /// The checkpointed block each node belongs to, if any.
    ckpt: IdVec<NodeId, Option<ScopeId>>,
    /// Forward nodes of checkpointed blocks whose outputs are kept (selective
    /// checkpointing), so nothing recomputes them.
    saved: IdVec<NodeId, bool>,
    forward_len: usize,
    /// Attention's backward runs as one flash-attention kernel (PyTorch's
    /// `scaled_dot_product_attention`): the probabilities and their gradient, the
    /// `[b, h, s, t]` values the graph names, live only in its on-chip tiles, so they hold
    /// no memory. Set by [`ExecOrder::blockwise_attention`] for shardplan's executor too.
    flash_attention: bool,
    /// Attention backwards shardplan's executor runs blockwise (see
    /// [`ExecOrder::blockwise_attention`]); empty otherwise.
    blockwise: Vec<BlockwiseAttention>,
    /// Index into `blockwise` of each node that is part of one: its probabilities, their
    /// gradient and its outputs.
    blockwise_of: Vec<Option<u32>>,
    /// Per node: the input whose memory it writes its value into (see
    /// [`ExecOrder::in_place_cross_entropy`]); empty when none does.
    in_place: Vec<Option<NodeId>>,
    /// Per node: a backward recomputation of a forward node
    /// ([`JointGraph::recompute_of`]) that a checkpointed block's recompute already makes:
    /// it does not run, and its readers read that recomputed copy.
    alias: Vec<Option<NodeId>>,
    /// What torch.compile fuses (`Runner::Fsdp2` with `compile`): a fused node's value is
    /// computed inside its readers' kernels and holds no memory. Empty when nothing is
    /// compiled.
    compiled: crate::compiled::Compiled,
}

/// One attention backward as shardplan's executor runs it under
/// [`ExecOrder::blockwise_attention`]: the probabilities and their gradient are
/// placeholders, and the first of its outputs in order computes all of them in blocks of
/// query rows from the forward operands and the output gradient.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockwiseAttention {
    /// The `attn_probs` node (a placeholder).
    pub probs: NodeId,
    /// The `attn_grad_scores` node (a placeholder), when q or k needs a gradient.
    pub scores: Option<NodeId>,
    /// q, k, v and the output gradient, the values the blockwise kernel reads.
    pub operands: [NodeId; 4],
    /// The forward operands and the output gradient.
    pub q: NodeId,
    pub k: NodeId,
    pub v: NodeId,
    pub dy: NodeId,
    pub causal: bool,
    /// The context layout of a context-parallel attention's mask.
    pub context: Option<shardplan_ir::ContextLayout>,
    /// The gradient nodes, where the graph has them.
    pub dq: Option<NodeId>,
    pub dk: Option<NodeId>,
    pub dv: Option<NodeId>,
}

impl BlockwiseAttention {
    /// The gradient nodes the graph has, in node order; the first computes them all.
    pub fn outputs(&self) -> impl Iterator<Item = NodeId> {
        let mut out = [self.dv, self.dq, self.dk];
        out.sort_unstable();
        out.into_iter().flatten()
    }
}

impl ExecOrder {
    /// The order `runner` runs `joint` in under checkpointing `ac`: node order, except
    /// that a checkpointed block's forward runs again just before its first backward
    /// node; shardplan's executor's blockwise attention and in-place cross-entropy
    /// ([`ExecOrder::shardplan_kernels`]), flash attention under PyTorch.
    pub fn new(joint: &JointGraph, ac: ActivationCheckpointing, runner: Runner) -> Self {
        let mut exec = ExecOrder::in_graph_order(joint, ac);
        if !runner.is_fsdp2() {
            // The ring runs on the all-to-all stream (`steps::walk`), FSDP2 inline.
            ring::overlap_context_collectives(&joint.graph, joint.forward_len, &mut exec.order);
            exec.last_reads(&joint.graph);
        }
        if runner == Runner::Shardplan {
            exec.shardplan_kernels(&joint.graph);
        } else {
            exec.flash_attention = true;
        }
        exec.compiled = crate::compiled::Compiled::new(&joint.graph, runner.compile());
        exec
    }

    /// `(node, recomputed copy?)` in execution order; parameters are not executed.
    #[inline]
    pub fn order(&self) -> &[(NodeId, bool)] {
        &self.order
    }

    /// Values in the table [`ValueSlot`]s index: two per node.
    #[inline]
    pub fn slots(&self) -> usize {
        self.last_use.len()
    }

    /// Position in [`ExecOrder::order`] of the last reader of `slot`'s value; `None` when
    /// nothing reads it.
    #[inline]
    pub fn last_use(&self, slot: ValueSlot) -> Option<usize> {
        Some(self.last_use[slot]).filter(|&p| p != UNREAD)
    }

    /// The parameter node `id` yields, if it is a `param` node.
    #[inline]
    pub fn param_of(&self, id: NodeId) -> Option<u32> {
        self.param_of_node[id.index()]
    }

    /// Whether node `id` is a final parameter gradient.
    #[inline]
    pub fn is_param_grad(&self, id: NodeId) -> bool {
        self.is_param_grad[id.index()]
    }

    /// The attention backwards run blockwise ([`ExecOrder::blockwise_attention`]).
    pub fn blockwise(&self) -> &[BlockwiseAttention] {
        &self.blockwise
    }

    /// The graph's own order, checkpointed blocks' recompute inserted, every value held.
    fn in_graph_order(joint: &JointGraph, ac: ActivationCheckpointing) -> Self {
        let g = &joint.graph;
        let n = g.node_count();
        let ckpt = checkpointed_blocks(g, ac);
        let mut param_of_node: Vec<Option<u32>> = vec![None; n];
        for (p, param) in g.params() {
            param_of_node[param.node.index()] = Some(p.0);
        }
        let saved = match ac {
            ActivationCheckpointing::Selective(policy) => selective_saves(joint, &ckpt, policy),
            _ => IdVec::from_elem(false, n),
        };
        // Final parameter gradients (their values live in the groups' gradient buffers).
        let mut is_param_grad = vec![false; n];
        for grad in joint.param_grads.iter().flatten() {
            is_param_grad[grad.index()] = true;
        }
        // Backward recomputations of values the block's recompute makes anyway.
        let mut alias: Vec<Option<NodeId>> = vec![None; n];
        for (i, of) in joint.recompute_of.iter().enumerate() {
            if let Some(f) = *of {
                let c = NodeId::new(i);
                if ckpt[f].is_some() && !saved[f] && ckpt[c] == ckpt[f] {
                    alias[i] = Some(f);
                }
            }
        }
        let order = recompute_order(joint, &ckpt, &saved, &param_of_node, &alias);
        let mut exec = ExecOrder {
            order,
            param_of_node,
            is_param_grad,
            last_use: IdVec::from_elem(UNREAD, n * 2),
            ckpt,
            saved,
            forward_len: joint.forward_len,
            flash_attention: false,
            blockwise: Vec::new(),
            blockwise_of: Vec::new(),
            in_place: Vec::new(),
            alias,
            compiled: crate::compiled::Compiled::default(),
        };
        exec.last_reads(g);
        exec
    }

    /// Each value's last reader in `order`, anew.
    fn last_reads(&mut self, g: &shardplan_ir::Graph) {
        self.last_use = IdVec::from_elem(UNREAD, g.node_count() * 2);
        for pos in 0..self.order.len() {
            let (id, copy) = self.order[pos];
            for &input in &g.node(id).inputs {
                if self.param_of_node[input.index()].is_none() {
                    let s = self.read_slot(id, copy, input);
                    self.last_use[s] = pos;
                }
            }
        }
    }

    /// Runs attention's backward as shardplan's executor does: blockwise, as flash
    /// attention does, with no `[b, h, s, t]` value in memory.
    ///
    /// For each `attn_probs` node whose readers are only `attn_grad_v` and
    /// `attn_grad_scores` (and whose `attn_grad_scores` is read only by `attn_grad_q` and
    /// `attn_grad_k`), the probabilities and their gradient become placeholders that hold
    /// no memory, and the first gradient node in order computes dq, dk and dv together in
    /// blocks of query rows, recomputing each block's probabilities from q and k. So the
    /// gradient nodes read q, k, v and the output gradient, which live until the last of
    /// them (as a flash-attention backward kernel holds its operands until it ends).
    ///
    /// The executor holds dq and dk from the first gradient node on, the plan from their
    /// own nodes; the nodes between make only placeholders and free nothing (every operand
    /// lives to the last gradient node), so both see the same peak.
    fn blockwise_attention(&mut self, g: &shardplan_ir::Graph) {
        let n = g.node_count();
        let readers = attention_readers(g);
        self.blockwise.clear();
        self.blockwise_of = vec![None; n];
        for (probs, node) in g.nodes() {
            let Op::AttnProbs { causal, context } = node.op else {
                continue;
            };
            let (q, k) = (node.inputs[0], node.inputs[1]);
            let mut b = BlockwiseAttention {
                probs,
                scores: None,
                operands: [q; 4],
                q,
                k,
                v: q,
                dy: q,
                causal,
                context,
                dq: None,
                dk: None,
                dv: None,
            };
            let (mut dy, mut v, mut ok) = (None, None, true);
            for &r in &readers[probs.index()] {
                let rn = g.node(r);
                match rn.op {
                    Op::AttnGradV { .. } if rn.inputs[0] == probs && b.dv.is_none() => {
                        b.dv = Some(r);
                        ok &= *dy.get_or_insert(rn.inputs[1]) == rn.inputs[1];
                    }
                    Op::AttnGradScores if rn.inputs[0] == probs && b.scores.is_none() => {
                        b.scores = Some(r);
                        ok &= *dy.get_or_insert(rn.inputs[1]) == rn.inputs[1];
                        v = Some(rn.inputs[2]);
                        for &r2 in &readers[r.index()] {
                            let r2n = g.node(r2);
                            match r2n.op {
                                Op::AttnGradQ if r2n.inputs[..] == [r, k] && b.dq.is_none() => b.dq = Some(r2),
                                Op::AttnGradK { .. } if r2n.inputs[..] == [r, q] && b.dk.is_none() => b.dk = Some(r2),
                                _ => ok = false,
                            }
                        }
                    }
                    _ => ok = false,
                }
            }
            // v: the attention's own third operand; `attn_grad_v` alone does not name it.
            let forward = node.grad_of.map(|f| g.node(f));
            let fv = forward
                .filter(|f| matches!(f.op, Op::Attention { .. }) && f.inputs[..2] == [q, k])
                .map(|f| f.inputs[2]);
            match (v, fv) {
                (Some(a), Some(b)) if a != b => ok = false,
                (None, None) => ok = false,
                _ => {}
            }
            let (Some(dy), Some(v)) = (dy, v.or(fv)) else { continue };
            if !ok || (b.dv.is_none() && b.dq.is_none() && b.dk.is_none()) {
                continue;
            }
            b.dy = dy;
            b.v = v;
            b.operands = [q, k, v, dy];
            let index = Some(self.blockwise.len() as u32);
            for x in [Some(b.probs), b.scores, b.dq, b.dk, b.dv].into_iter().flatten() {
                self.blockwise_of[x.index()] = index;
            }
            self.blockwise.push(b);
        }
        self.flash_attention = true;
        // The gradient nodes read the operands through the placeholders.
        for pos in 0..self.order.len() {
            let (id, copy) = self.order[pos];
            let Some(operands) = self.blockwise_group(id).map(|b| b.operands) else {
                continue;
            };
            if matches!(g.node(id).op, Op::AttnProbs { .. } | Op::AttnGradScores) {
                continue;
            }
            for x in operands {
                if self.param_of_node[x.index()].is_none() {
                    let s = self.read_slot(id, copy, x);
                    self.last_use[s] = self.last_use[s].max(pos);
                }
            }
        }
    }

    /// How shardplan's executor runs the graph (`kernels: fused`): attention's backward
    /// blockwise ([`ExecOrder::blockwise_attention`]) and the cross-entropy's backward in
    /// place ([`ExecOrder::in_place_cross_entropy`]).
    fn shardplan_kernels(&mut self, g: &shardplan_ir::Graph) {
        self.blockwise_attention(g);
        self.in_place_cross_entropy(g);
    }

    /// Runs the cross-entropy's backward in place, as fused cross-entropy kernels do: a
    /// `cross_entropy_grad` whose logits die at it, of its own type, writes the gradient
    /// over them, so the loss backward holds one logits-sized tensor, not two. Only where
    /// nothing else can share the logits' memory: they and every value they view (through
    /// reshapes, transposes, narrows, broadcasts, casts and sums to a shape) die at or
    /// before it, and none of them is a parameter or a fed input.
    fn in_place_cross_entropy(&mut self, g: &shardplan_ir::Graph) {
        let n = g.node_count();
        let mut pos_of = vec![usize::MAX; n];
        for (pos, &(id, copy)) in self.order.iter().enumerate() {
            if !copy {
                pos_of[id.index()] = pos;
            }
        }
        self.in_place = vec![None; n];
        for (id, node) in g.nodes() {
            if !matches!(node.op, Op::CrossEntropyGrad) {
                continue;
            }
            let pos = pos_of[id.index()];
            let x = node.inputs[0];
            if pos == usize::MAX || g.node(x).ty != node.ty {
                continue;
            }
            let dies_here =
                |v: NodeId, read_copy: bool| self.last_use(ValueSlot::of(v, read_copy)).is_none_or(|lu| lu <= pos);
            if self.last_use(self.read_slot(id, false, x)) != Some(pos) {
                continue;
            }
            let mut v = x;
            let ok = loop {
                let vn = g.node(v);
                if self.param_of_node[v.index()].is_some() || vn.op.is_leaf() {
                    break false;
                }
                if !(dies_here(v, false) && (!self.recomputed(v) || dies_here(v, true))) {
                    break false;
                }
                match vn.op {
                    Op::Reshape { .. }
                    | Op::Transpose { .. }
                    | Op::Narrow { .. }
                    | Op::BroadcastTo { .. }
                    | Op::Cast { .. }
                    | Op::SumTo { .. } => v = vn.inputs[0],
                    _ => break true,
                }
            };
            if ok {
                self.in_place[id.index()] = Some(x);
            }
        }
    }

    /// The input whose memory `id` writes its value into, if any
    /// ([`ExecOrder::in_place_cross_entropy`]).
    #[inline]
    pub fn in_place(&self, id: NodeId) -> Option<NodeId> {
        self.in_place.get(id.index()).copied().flatten()
    }

    /// The blockwise attention backward `id` is part of, if any.
    #[inline]
    pub fn blockwise_group(&self, id: NodeId) -> Option<&BlockwiseAttention> {
        let i = (*self.blockwise_of.get(id.index())?)?;
        self.blockwise.get(i as usize)
    }

    /// Values `id` reads beyond its graph inputs: a blockwise attention's gradient node
    /// reads q, k, v and the output gradient (through the placeholders); nothing else does.
    /// Frees at a node's position go over its inputs and these.
    #[inline]
    pub fn extra_reads(&self, g: &shardplan_ir::Graph, id: NodeId) -> &[NodeId] {
        match self.blockwise_group(id) {
            Some(b) if !matches!(g.node(id).op, Op::AttnProbs { .. } | Op::AttnGradScores) => &b.operands,
            _ => &[],
        }
    }

    /// Whether `id` is a placeholder of a blockwise attention backward (no memory).
    #[inline]
    pub fn placeholder(&self, id: NodeId) -> bool {
        self.blockwise_group(id)
            .is_some_and(|b| b.probs == id || b.scores == Some(id))
    }

    /// Whether forward node `id` runs again in its block's recompute (checkpointed and not
    /// saved), so what its original run saves dies with it.
    #[inline]
    pub fn recomputed(&self, id: NodeId) -> bool {
        id.index() < self.forward_len && self.ckpt[id].is_some() && !self.saved[id]
    }

    /// The value slot `reader` (itself a copy or not) reads for `input`: its own, its
    /// recomputed copy ([`ExecOrder::reads_copy`]), or, for a backward recomputation the
    /// block's recompute already makes, that copy.
    #[inline]
    pub fn read_slot(&self, reader: NodeId, reader_copy: bool, input: NodeId) -> ValueSlot {
        match self.alias.get(input.index()).copied().flatten() {
            Some(f) => ValueSlot::of(f, true),
            None => ValueSlot::of(input, self.reads_copy(reader, reader_copy, input)),
        }
    }

    /// Whether `reader` (itself a copy or not) reads the recomputed copy of `input`: inside
    /// a checkpointed block, its recompute and backward read the block's recomputed values.
    #[inline]
    pub fn reads_copy(&self, reader: NodeId, reader_copy: bool, input: NodeId) -> bool {
        if self.saved[input] {
            return false;
        }
        match self.ckpt[input] {
            Some(block) if input.index() < self.forward_len => {
                (reader_copy || reader.index() >= self.forward_len) && self.ckpt[reader] == Some(block)
            }
            _ => false,
        }
    }

    /// Bytes a value holds as an activation: 0 for parameters and final parameter
    /// gradients (they live in group buffers), and for a parameter read through `tp_copy`
    /// (the parameter itself).
    #[inline]
    pub fn value_bytes(&self, g: &shardplan_ir::Graph, id: NodeId) -> u64 {
        let node = g.node(id);
        if self.param_of_node[id.index()].is_some()
            || self.is_param_grad[id.index()]
            || (matches!(node.op, shardplan_ir::Op::TpCopy { .. })
                && self.param_of_node[node.inputs[0].index()].is_some())
            || (self.flash_attention
                && self.blockwise_of.is_empty()
                && matches!(
                    g.node(id).op,
                    shardplan_ir::Op::AttnProbs { .. } | shardplan_ir::Op::AttnGradScores
                ))
            || self.placeholder(id)
            || self.compiled.fused(id)
        {
            0
        } else {
            g.node(id).ty.bytes().unwrap_or(u64::MAX)
        }
    }
}

/// Per node: the attention backward's nodes that read it, and every node that reads an
/// `attn_probs` or `attn_grad_scores` (which must be attention backward's own for it to
/// run blockwise).
fn attention_readers(g: &shardplan_ir::Graph) -> Vec<Vec<NodeId>> {
    let mut readers: Vec<Vec<NodeId>> = vec![Vec::new(); g.node_count()];
    for (id, node) in g.nodes() {
        let backward = matches!(
            node.op,
            Op::AttnProbs { .. } | Op::AttnGradScores | Op::AttnGradV { .. } | Op::AttnGradQ | Op::AttnGradK { .. }
        );
        for &i in &node.inputs {
            if backward || matches!(g.node(i).op, Op::AttnProbs { .. } | Op::AttnGradScores) {
                readers[i.index()].push(id);
            }
        }
    }
    readers
}

/// The checkpointed block each node belongs to under `ac`: the nearest block ancestor of
/// its scope, when that block is checkpointed.
fn checkpointed_blocks(g: &shardplan_ir::Graph, ac: ActivationCheckpointing) -> IdVec<NodeId, Option<ScopeId>> {
    let mut block_index = 0u64;
    let mut ckpt_of_scope: IdVec<ScopeId, Option<ScopeId>> = IdVec::with_capacity(g.scopes().len());
    for (id, s) in g.scopes() {
        let inherited = s.parent.and_then(|p| ckpt_of_scope[p]);
        let own = if s.kind == ModuleKind::Block {
            let chosen = match ac {
                ActivationCheckpointing::None => false,
                ActivationCheckpointing::Full | ActivationCheckpointing::Selective(_) => true,
                ActivationCheckpointing::Every(k) => block_index.is_multiple_of(k),
            };
            block_index += 1;
            chosen.then_some(id)
        } else {
            None
        };
        ckpt_of_scope.push(own.or(inherited));
    }
    g.nodes().map(|(_, node)| ckpt_of_scope[node.scope]).collect()
}

/// Selective checkpointing: the forward nodes whose outputs a checkpointed block keeps
/// (they are not recomputed; its recompute and backward read the originals).
fn selective_saves(
    joint: &JointGraph,
    ckpt: &IdVec<NodeId, Option<ScopeId>>,
    policy: shardplan_frontends::SavePolicy,
) -> IdVec<NodeId, bool> {
    let g = &joint.graph;
    let mut saved: IdVec<NodeId, bool> = IdVec::from_elem(false, g.node_count());
    let mut matmuls: Vec<(ScopeId, u64)> = Vec::new();
    for j in saved.keys().take(joint.forward_len) {
        let Some(block) = ckpt[j] else { continue };
        saved[j] = match &g.node(j).op {
            Op::Attention { .. } => policy.attention,
            Op::Linear { .. } | Op::MatMul => {
                let count = match matmuls.iter_mut().find(|(b, _)| *b == block) {
                    Some((_, c)) => {
                        *c += 1;
                        *c
                    }
                    None => {
                        matmuls.push((block, 1));
                        1
                    }
                };
                match policy.matmuls {
                    SavedMatmuls::None => false,
                    SavedMatmuls::All => true,
                    SavedMatmuls::Odd => count % 2 == 1,
                }
            }
            _ => false,
        };
    }
    saved
}

/// Node order with each checkpointed block's forward run again (as copies) just before its
/// first backward node; parameters, and backward recomputations a block's recompute makes
/// (`alias`), do not run.
fn recompute_order(
    joint: &JointGraph,
    ckpt: &IdVec<NodeId, Option<ScopeId>>,
    saved: &IdVec<NodeId, bool>,
    param_of_node: &[Option<u32>],
    alias: &[Option<NodeId>],
) -> Vec<(NodeId, bool)> {
    let g = &joint.graph;
    let n = g.node_count();
    // The forward nodes each checkpointed block recomputes, in order.
    let mut block_nodes: Vec<(ScopeId, Vec<NodeId>)> = Vec::new();
    for (j, param) in param_of_node.iter().enumerate().take(joint.forward_len) {
        let f = NodeId::new(j);
        if param.is_some() || g.node(f).op.is_leaf() || saved[f] {
            continue;
        }
        if let Some(block) = ckpt[f] {
            match block_nodes.iter_mut().find(|(b, _)| *b == block) {
                Some((_, v)) => v.push(f),
                None => block_nodes.push((block, vec![f])),
            }
        }
    }
    let mut order: Vec<(NodeId, bool)> = Vec::with_capacity(n + n / 2);
    let mut recomputed: Vec<ScopeId> = Vec::new();
    for (i, param) in param_of_node.iter().enumerate() {
        let id = NodeId::new(i);
        if param.is_some() || alias[i].is_some() {
            continue;
        }
        if i >= joint.forward_len {
            if let Some(block) = ckpt[id] {
                if !recomputed.contains(&block) {
                    recomputed.push(block);
                    if let Some((_, nodes)) = block_nodes.iter().find(|(b, _)| *b == block) {
                        order.extend(nodes.iter().map(|&f| (f, true)));
                    }
                }
            }
        }
        order.push((id, false));
    }
    order
}

mod ring;
#[cfg(test)]
mod tests;
