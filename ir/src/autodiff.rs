//! Reverse-mode autodiff on the IR: a forward graph ending in a scalar loss becomes one
//! joint graph, forward nodes then backward nodes.
//!
//! Every backward node carries `grad_of` (the forward node whose rule made it) and that
//! node's scope, so the planner can cut the backward pass into per-module segments; the
//! forward values a backward node reads are its operands that are not backward nodes.
//!
//! Architecture invariant: autodiff only appends nodes; forward node ids are unchanged, so a
//! plan can refer to forward values of the joint graph by their forward ids.

use crate::{
    DType, Float8Cast, Graph, IdVec, IrError, NodeId, NormWrt, Op, ParamId, Shape, TensorType, TpGrad, WeightLayout,
};

/// A forward+backward graph and where its results are.
#[derive(Clone, Debug)]
pub struct JointGraph {
    pub graph: Graph,
    /// The scalar loss (a forward node).
    pub loss: NodeId,
    /// Gradient of each parameter, indexed by [`ParamId`]; `None` for a parameter the loss
    /// does not depend on. A plain `Vec` (not an `IdVec`) because the executor searches it
    /// as a slice.
    pub param_grads: Vec<Option<NodeId>>,
    /// Number of forward nodes: ids below this are forward, from it on backward.
    pub forward_len: usize,
    /// Per node: the forward node a backward node recomputes (see
    /// [`DiffOptions::recompute_pointwise`]); `None` for every other node.
    pub recompute_of: Vec<Option<NodeId>>,
}

impl JointGraph {
    /// The gradient node of `p`, if the loss depends on it.
    pub fn grad(&self, p: ParamId) -> Option<NodeId> {
        self.param_grads[p.index()]
    }

    /// Forward values that backward nodes read: what must stay alive (or be recomputed)
    /// between the two passes.
    pub fn saved_for_backward(&self) -> Vec<NodeId> {
        let mut saved: Vec<NodeId> = self
            .graph
            .nodes()
            .filter(|(_, n)| n.is_backward())
            .flat_map(|(_, n)| n.inputs.iter().copied())
            .filter(|i| i.index() < self.forward_len)
            .collect();
        saved.sort_unstable();
        saved.dedup();
        saved
    }
}

/// How [`differentiate_with`] builds the backward pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiffOptions {
    /// Backward reads the outputs of pointwise ops and norms (`silu`, `gelu`, `relu`, `mul`,
    /// `rms_norm`, `layer_norm`) from copies it recomputes from their operands, which the
    /// ops' own backward reads anyway, so the outputs die in the forward pass: what a
    /// compiler's partitioner does (torch.compile's min-cut recomputes pointwise ops). Off,
    /// backward reads the forward values, as PyTorch eager saves them.
    pub recompute_pointwise: bool,
    /// Backward recomputes a cast to a wider dtype inside the loss module from its operand,
    /// which it keeps instead (a compiled loss keeps the bf16 logits, not their f32 copy).
    /// Independent of `recompute_pointwise`.
    pub recompute_widening_casts: bool,
    /// Backward recomputes the output of an activation function (`silu`, `gelu`, `relu`)
    /// inside a transformer block from its input, which the activation's own backward reads
    /// anyway, instead of keeping it: torch.compile's partitioner in a compiled block.
    /// Independent of `recompute_pointwise`.
    pub recompute_block_activations: bool,
}

/// Whether `id` is a cast to a wider dtype inside the loss that
/// [`DiffOptions::recompute_widening_casts`] recomputes.
fn widening_cast(forward: &Graph, id: NodeId, options: DiffOptions) -> bool {
    let n = forward.node(id);
    options.recompute_widening_casts
        && matches!(n.op, Op::Cast { .. })
        && forward.enclosing(n.scope, crate::ModuleKind::Loss).is_some()
        && n.ty.dtype.size_bytes() > forward.node(n.inputs[0]).ty.dtype.size_bytes()
}

/// Whether `id` is an activation inside a block that
/// [`DiffOptions::recompute_block_activations`] recomputes.
fn block_activation(forward: &Graph, id: NodeId, options: DiffOptions) -> bool {
    let n = forward.node(id);
    options.recompute_block_activations
        && matches!(n.op, Op::Silu | Op::Gelu | Op::GeluErf | Op::Relu)
        && forward.enclosing(n.scope, crate::ModuleKind::Block).is_some()
}

/// Builds the joint graph of `forward`, whose first output must be a scalar float loss;
/// backward reads forward values as PyTorch eager saves them.
pub fn differentiate(forward: &Graph) -> Result<JointGraph, IrError> {
    differentiate_with(forward, DiffOptions::default())
}

/// [`differentiate`] with `options`.
pub fn differentiate_with(forward: &Graph, options: DiffOptions) -> Result<JointGraph, IrError> {
    let loss = *forward
        .outputs()
        .first()
        .ok_or_else(|| IrError::Autodiff("the graph has no output to differentiate".into()))?;
    let loss_ty = forward.node(loss).ty.clone();
    if loss_ty.shape.rank() != 0 || !loss_ty.dtype.is_float() {
        return Err(IrError::Autodiff(format!(
            "the loss must be a float scalar, got {loss_ty}"
        )));
    }
    Ok(differentiate_from(forward, options, Seed::Ones, &[])?.joint)
}

/// A pipeline stage's joint graph: its forward differentiated from its output, whose
/// gradient is an input, to its parameters and to its own input.
#[derive(Clone, Debug)]
pub struct StageJoint {
    pub joint: JointGraph,
    /// The input node (a backward node named `output_grad`) fed with the gradient of the
    /// output; `None` when the output is a scalar loss, whose gradient is 1.
    pub output_grad: Option<NodeId>,
    /// The gradient of each input asked for, in the order asked.
    pub input_grads: Vec<NodeId>,
}

/// Differentiates `forward` from its first output to its parameters and to the inputs
/// `wrt`. A scalar float output is a loss (its gradient is 1); any other float output's
/// gradient is fed through an input: what a pipeline stage receives from the next.
pub fn differentiate_stage(forward: &Graph, options: DiffOptions, wrt: &[NodeId]) -> Result<StageJoint, IrError> {
    let out = *forward
        .outputs()
        .first()
        .ok_or_else(|| IrError::Autodiff("the graph has no output to differentiate".into()))?;
    let ty = &forward.node(out).ty;
    if !ty.dtype.is_float() {
        return Err(IrError::Autodiff(format!(
            "the output must be a float tensor, got {ty}"
        )));
    }
    let seed = if ty.shape.rank() == 0 { Seed::Ones } else { Seed::Input };
    for &i in wrt {
        if !matches!(forward.node(i).op, Op::Input { .. }) || !forward.node(i).ty.dtype.is_float() {
            return Err(IrError::Autodiff(format!("{i} is not a float input")));
        }
    }
    differentiate_from(forward, options, seed, wrt)
}

/// How backward starts from the output.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Seed {
    /// A scalar loss: its gradient is 1.
    Ones,
    /// The gradient comes in through an input node.
    Input,
}

fn differentiate_from(
    forward: &Graph,
    options: DiffOptions,
    seed: Seed,
    wrt: &[NodeId],
) -> Result<StageJoint, IrError> {
    let loss = *forward
        .outputs()
        .first()
        .ok_or_else(|| IrError::Autodiff("the graph has no output to differentiate".into()))?;
    let loss_ty = forward.node(loss).ty.clone();
    if let Some((id, n)) = forward
        .nodes()
        .find(|(_, n)| n.is_backward() || n.op.is_backward_only())
    {
        return Err(IrError::Autodiff(format!(
            "{id} ({}) is already a backward node; differentiate a forward graph",
            n.op.name()
        )));
    }
    let forward_len = forward.node_count();

    // A node needs a gradient when it depends on a parameter (or an input asked for) and the
    // loss depends on it.
    let mut depends_on_param: IdVec<NodeId, bool> = IdVec::from_elem(false, forward_len);
    for (id, n) in forward.nodes() {
        depends_on_param[id] =
            matches!(n.op, Op::Param { .. }) || wrt.contains(&id) || n.inputs.iter().any(|&i| depends_on_param[i]);
    }
    let mut reaches_loss: IdVec<NodeId, bool> = IdVec::from_elem(false, forward_len);
    reaches_loss[loss] = true;
    for (id, n) in forward.nodes().collect::<Vec<_>>().into_iter().rev() {
        if reaches_loss[id] {
            for &i in &n.inputs {
                reaches_loss[i] = true;
            }
        }
    }
    let wants = |id: NodeId| depends_on_param[id] && reaches_loss[id];
    // Forward values backward recomputes rather than reads: a pointwise op or a norm whose
    // own gradient is taken, so its backward reads its operands anyway (all of them, for a
    // product: each operand's gradient reads the other).
    let recomputable: IdVec<NodeId, bool> = forward
        .nodes()
        .map(|(id, n)| {
            options.recompute_pointwise
                && wants(id)
                && match n.op {
                    Op::Silu | Op::Gelu | Op::GeluErf | Op::Relu => wants(n.inputs[0]),
                    Op::Mul => n.inputs.iter().all(|&i| wants(i)),
                    Op::RmsNorm { .. } | Op::LayerNorm { .. } => true,
                    _ => false,
                }
                || widening_cast(forward, id, options) && wants(id)
                || block_activation(forward, id, options) && wants(id) && wants(forward.node(id).inputs[0])
        })
        .collect();
    let mut copies: IdVec<NodeId, Option<NodeId>> = IdVec::from_elem(None, forward_len);

    let mut g = forward.clone();
    let mut contributions: IdVec<NodeId, Vec<NodeId>> = IdVec::from_elem(Vec::new(), forward_len);
    let output_grad = match seed {
        Seed::Ones => {
            contributions[loss].push(g.add_fill(1.0, loss_ty, loss)?);
            None
        }
        Seed::Input => {
            let grad = g.add_input("output_grad", loss_ty, forward.node(loss).scope)?;
            g.mark_backward(grad, loss);
            contributions[loss].push(grad);
            Some(grad)
        }
    };
    let mut param_grads: IdVec<ParamId, Option<NodeId>> = IdVec::from_elem(None, forward.params().len());
    let mut input_grads: Vec<Option<NodeId>> = vec![None; wrt.len()];

    for id in contributions.keys().rev() {
        let parts = std::mem::take(&mut contributions[id]);
        if parts.is_empty() {
            continue;
        }
        let grad = sum_all(&mut g, &parts, id)?;
        let node = g.node(id).clone();
        if let Op::Param { param } = node.op {
            param_grads[param] = Some(grad);
            continue;
        }
        if let Some(k) = wrt.iter().position(|&w| w == id) {
            input_grads[k] = Some(grad);
            continue;
        }
        let wanted: Vec<bool> = node.inputs.iter().map(|&i| wants(i)).collect();
        let mut ins = Vec::with_capacity(node.inputs.len());
        for &i in &node.inputs {
            ins.push(backward_copy(&mut g, &mut copies, &recomputable, i)?);
        }
        for (operand, dx) in vjp(&mut g, id, &ins, grad, &wanted)? {
            contributions[node.inputs[operand]].push(dx);
        }
    }
    let mut recompute_of = vec![None; g.node_count()];
    for (f, c) in copies.iter() {
        if let Some(c) = c {
            recompute_of[c.index()] = Some(f);
        }
    }
    let input_grads = input_grads
        .into_iter()
        .zip(wrt)
        .map(|(grad, i)| grad.ok_or_else(|| IrError::Autodiff(format!("the output does not depend on input {i}"))))
        .collect::<Result<_, _>>()?;
    Ok(StageJoint {
        joint: JointGraph {
            graph: g,
            loss,
            param_grads: param_grads.into_vec(),
            forward_len,
            recompute_of,
        },
        output_grad,
        input_grads,
    })
}

/// The value backward reads for forward value `v`: `v` itself, or (when `recomputable`) a
/// copy made once, in backward, from the values backward reads for its operands.
fn backward_copy(
    g: &mut Graph,
    copies: &mut IdVec<NodeId, Option<NodeId>>,
    recomputable: &IdVec<NodeId, bool>,
    v: NodeId,
) -> Result<NodeId, IrError> {
    if !recomputable.get(v).copied().unwrap_or(false) {
        return Ok(v);
    }
    if let Some(c) = copies[v] {
        return Ok(c);
    }
    let node = g.node(v).clone();
    let mut ins = Vec::with_capacity(node.inputs.len());
    for &u in &node.inputs {
        ins.push(backward_copy(g, copies, recomputable, u)?);
    }
    let c = g.add_grad_node(node.op.clone(), &ins, v)?;
    copies[v] = Some(c);
    Ok(c)
}

/// Sums the gradient contributions of one value (several users, or a tied weight).
fn sum_all(g: &mut Graph, parts: &[NodeId], of: NodeId) -> Result<NodeId, IrError> {
    let mut acc = parts[0];
    for &p in &parts[1..] {
        acc = g.add_grad_node(Op::Add, &[acc, p], of)?;
    }
    Ok(acc)
}

/// `dx` summed to `shape` when the forward op broadcast it, else `dx` itself.
/// `x` as a Float8 matmul reads it under `cast`; `x` itself in high precision.
fn float8_cast(g: &mut Graph, x: NodeId, cast: Option<Float8Cast>, of: NodeId) -> Result<NodeId, IrError> {
    match cast {
        Some(cast) if cast.scaled.is_some() => g.add_grad_node(Op::Float8Cast { cast }, &[x], of),
        _ => Ok(x),
    }
}

fn unbroadcast(g: &mut Graph, dx: NodeId, shape: &Shape, of: NodeId) -> Result<NodeId, IrError> {
    if &g.node(dx).ty.shape == shape {
        Ok(dx)
    } else {
        g.add_grad_node(Op::SumTo { shape: shape.clone() }, &[dx], of)
    }
}

/// The vector-Jacobian products of node `id` given its output gradient `dy`: one
/// `(operand index, gradient)` per operand with `wanted[i]`. `ins` are the values backward
/// reads for its operands (the operands, or their recomputed copies).
fn vjp(
    g: &mut Graph,
    id: NodeId,
    ins: &[NodeId],
    dy: NodeId,
    wanted: &[bool],
) -> Result<Vec<(usize, NodeId)>, IrError> {
    let node = g.node(id).clone();
    let ins = ins.to_vec();
    let ty = |g: &Graph, i: usize| -> TensorType { g.node(ins[i]).ty.clone() };
    let mut out = Vec::new();
    let mut put = |i: usize, v: NodeId| out.push((i, v));
    match &node.op {
        Op::Input { .. } | Op::Param { .. } | Op::Fill { .. } => {}
        Op::Add => {
            for (i, _) in wanted.iter().enumerate().filter(|(_, w)| **w) {
                {
                    let shape = ty(g, i).shape;
                    put(i, unbroadcast(g, dy, &shape, id)?);
                }
            }
        }
        Op::Mul => {
            for (i, _) in wanted.iter().enumerate().filter(|(_, w)| **w) {
                {
                    let prod = g.add_grad_node(Op::Mul, &[dy, ins[1 - i]], id)?;
                    let shape = ty(g, i).shape;
                    put(i, unbroadcast(g, prod, &shape, id)?);
                }
            }
        }
        Op::Linear { bias, layout, float8 } => {
            let flipped = match layout {
                WeightLayout::OutIn => WeightLayout::InOut,
                WeightLayout::InOut => WeightLayout::OutIn,
            };
            let casts = float8.map(|r| r.casts());
            // One cast of `dy` where both gradients read it alike (tensorwise).
            let mut dy_casts: Vec<(Option<Float8Cast>, NodeId)> = Vec::new();
            let mut cast_dy = |g: &mut Graph, cast: Option<Float8Cast>| -> Result<NodeId, IrError> {
                if let Some(&(_, n)) = dy_casts.iter().find(|(c, _)| *c == cast) {
                    return Ok(n);
                }
                let n = float8_cast(g, dy, cast, id)?;
                dy_casts.push((cast, n));
                Ok(n)
            };
            if wanted[0] {
                // The weight is `[out, in]`: `w_t`'s casts read it transposed.
                let dy_q = cast_dy(g, casts.map(|c| c.grad_input_grad_output))?;
                let w_q = float8_cast(g, ins[1], casts.map(|c| c.grad_input_weight_t.transposed()), id)?;
                put(
                    0,
                    g.add_grad_node(
                        Op::Linear {
                            bias: false,
                            layout: flipped,
                            float8: None,
                        },
                        &[dy_q, w_q],
                        id,
                    )?,
                );
            }
            if wanted[1] {
                let x_q = float8_cast(g, ins[0], casts.map(|c| c.grad_weight_input), id)?;
                let dy_q = cast_dy(g, casts.map(|c| c.grad_weight_grad_output))?;
                put(
                    1,
                    g.add_grad_node(Op::WeightGrad { layout: *layout }, &[x_q, dy_q], id)?,
                );
            }
            if *bias && wanted[2] {
                let shape = ty(g, 2).shape;
                put(2, g.add_grad_node(Op::SumTo { shape }, &[dy], id)?);
            }
        }
        Op::MatMul => {
            let last_two = |g: &mut Graph, x: NodeId| {
                let r = g.node(x).ty.shape.rank();
                g.add_grad_node(
                    Op::Transpose {
                        dim0: r - 2,
                        dim1: r - 1,
                    },
                    &[x],
                    id,
                )
            };
            if wanted[0] {
                let bt = last_two(g, ins[1])?;
                let da = g.add_grad_node(Op::MatMul, &[dy, bt], id)?;
                let shape = ty(g, 0).shape;
                put(0, unbroadcast(g, da, &shape, id)?);
            }
            if wanted[1] {
                let at = last_two(g, ins[0])?;
                let db = g.add_grad_node(Op::MatMul, &[at, dy], id)?;
                let shape = ty(g, 1).shape;
                put(1, unbroadcast(g, db, &shape, id)?);
            }
        }
        Op::RmsNorm { eps } => {
            for (i, wrt) in [(0, NormWrt::Input), (1, NormWrt::Weight)] {
                if wanted[i] {
                    put(
                        i,
                        g.add_grad_node(Op::RmsNormGrad { eps: *eps, wrt }, &[ins[0], ins[1], dy], id)?,
                    );
                }
            }
        }
        Op::LayerNorm { eps } => {
            for (i, wrt) in [(0, NormWrt::Input), (1, NormWrt::Weight)] {
                if wanted[i] {
                    put(
                        i,
                        g.add_grad_node(Op::LayerNormGrad { eps: *eps, wrt }, &[ins[0], ins[1], dy], id)?,
                    );
                }
            }
            if wanted[2] {
                let shape = ty(g, 2).shape;
                put(2, g.add_grad_node(Op::SumTo { shape }, &[dy], id)?);
            }
        }
        Op::Rope {
            theta,
            scaling,
            context,
        } => {
            if wanted[0] {
                put(
                    0,
                    g.add_grad_node(
                        Op::RopeGrad {
                            theta: *theta,
                            scaling: *scaling,
                            context: *context,
                        },
                        &[dy],
                        id,
                    )?,
                );
            }
        }
        Op::Attention { causal, context } => {
            let kv_heads = ty(g, 1).shape.dims()[2];
            let probs = g.add_grad_node(
                Op::AttnProbs {
                    causal: *causal,
                    context: *context,
                },
                &[ins[0], ins[1]],
                id,
            )?;
            if wanted[2] {
                put(2, g.add_grad_node(Op::AttnGradV { kv_heads }, &[probs, dy], id)?);
            }
            if wanted[0] || wanted[1] {
                let ds = g.add_grad_node(Op::AttnGradScores, &[probs, dy, ins[2]], id)?;
                if wanted[0] {
                    put(0, g.add_grad_node(Op::AttnGradQ, &[ds, ins[1]], id)?);
                }
                if wanted[1] {
                    put(1, g.add_grad_node(Op::AttnGradK { kv_heads }, &[ds, ins[0]], id)?);
                }
            }
        }
        Op::Silu | Op::Gelu | Op::GeluErf | Op::Relu | Op::Sigmoid => {
            if wanted[0] {
                let op = match node.op {
                    Op::Silu => Op::SiluGrad,
                    Op::Gelu => Op::GeluGrad,
                    Op::GeluErf => Op::GeluErfGrad,
                    Op::Sigmoid => Op::SigmoidGrad,
                    _ => Op::ReluGrad,
                };
                put(0, g.add_grad_node(op, &[ins[0], dy], id)?);
            }
        }
        Op::Softmax { dim } => {
            if wanted[0] {
                put(0, g.add_grad_node(Op::SoftmaxGrad { dim: *dim }, &[id, dy], id)?);
            }
        }
        Op::CrossEntropy => {
            if wanted[0] {
                put(0, g.add_grad_node(Op::CrossEntropyGrad, &[ins[0], ins[1], dy], id)?);
            }
        }
        Op::Embedding => {
            if wanted[0] {
                let vocab = ty(g, 0).shape.dims()[0];
                put(0, g.add_grad_node(Op::EmbeddingGrad { vocab }, &[ins[1], dy], id)?);
            }
        }
        Op::Reshape { .. } => {
            if wanted[0] {
                let shape = ty(g, 0).shape;
                put(0, g.add_grad_node(Op::Reshape { shape }, &[dy], id)?);
            }
        }
        Op::Transpose { dim0, dim1 } => {
            if wanted[0] {
                put(
                    0,
                    g.add_grad_node(
                        Op::Transpose {
                            dim0: *dim0,
                            dim1: *dim1,
                        },
                        &[dy],
                        id,
                    )?,
                );
            }
        }
        Op::Narrow { dim, start, len } => {
            if wanted[0] {
                let size = ty(g, 0).shape.dims()[*dim];
                let pad = Op::Pad {
                    dim: *dim,
                    before: *start,
                    after: size - start - len,
                };
                put(0, g.add_grad_node(pad, &[dy], id)?);
            }
        }
        Op::Concat { dim } => {
            let mut start = 0;
            for (i, &w) in wanted.iter().enumerate() {
                let len = ty(g, i).shape.dims()[*dim];
                if w {
                    put(i, g.add_grad_node(Op::Narrow { dim: *dim, start, len }, &[dy], id)?);
                }
                start += len;
            }
        }
        Op::Cast { .. } => {
            if wanted[0] {
                let dtype: DType = ty(g, 0).dtype;
                put(0, g.add_grad_node(Op::Cast { dtype }, &[dy], id)?);
            }
        }
        Op::Sum => {
            if wanted[0] {
                let shape = ty(g, 0).shape;
                put(0, g.add_grad_node(Op::BroadcastTo { shape }, &[dy], id)?);
            }
        }
        Op::TpAllGather { dim, degree, grad } => {
            if wanted[0] {
                let back = match grad {
                    TpGrad::Partial => Op::TpReduceScatter {
                        dim: *dim,
                        degree: *degree,
                    },
                    TpGrad::Replicated => Op::TpSlice {
                        dim: *dim,
                        degree: *degree,
                    },
                };
                put(0, g.add_grad_node(back, &[dy], id)?);
            }
        }
        Op::TpReduceScatter { dim, degree } | Op::TpSlice { dim, degree } => {
            if wanted[0] {
                let gather = Op::TpAllGather {
                    dim: *dim,
                    degree: *degree,
                    grad: TpGrad::Replicated,
                };
                put(0, g.add_grad_node(gather, &[dy], id)?);
            }
        }
        Op::TpAllReduce { .. } => {
            if wanted[0] {
                put(0, dy);
            }
        }
        Op::CpAllGather { layout, rotate } => {
            if wanted[0] {
                let back = Op::CpReduceScatter {
                    layout: *layout,
                    rotate: *rotate,
                };
                put(0, g.add_grad_node(back, &[dy], id)?);
            }
        }
        Op::CpReduceScatter { layout, rotate } => {
            if wanted[0] {
                let gather = Op::CpAllGather {
                    layout: *layout,
                    rotate: *rotate,
                };
                put(0, g.add_grad_node(gather, &[dy], id)?);
            }
        }
        Op::TpCopy { degree } => {
            if wanted[0] {
                put(0, g.add_grad_node(Op::TpAllReduce { degree: *degree }, &[dy], id)?);
            }
        }
        Op::VocabEmbedding { degree } => {
            if wanted[0] {
                let vocab = ty(g, 0).shape.dims()[0];
                let op = Op::VocabEmbeddingGrad { vocab, degree: *degree };
                put(0, g.add_grad_node(op, &[ins[1], dy], id)?);
            }
        }
        Op::VocabCrossEntropy { degree } => {
            if wanted[0] {
                let op = Op::VocabCrossEntropyGrad { degree: *degree };
                put(0, g.add_grad_node(op, &[ins[0], ins[1], dy], id)?);
            }
        }
        // The chosen experts are integers: no gradient flows through the selection.
        Op::MoeTopK { .. } | Op::MoeDrop { .. } | Op::MoeGatherIds { .. } | Op::MoeLocalIds { .. } => {}
        // The dispatch and the combine move rows between ranks without changing them: each
        // is the other's adjoint (padding rows get no gradient).
        Op::MoeDispatch { degree, experts, .. } => {
            if wanted[0] {
                let op = Op::MoeCombine {
                    degree: *degree,
                    experts: *experts,
                };
                put(0, g.add_grad_node(op, &[dy, ins[1]], id)?);
            }
        }
        Op::MoeCombine { degree, experts } => {
            if wanted[0] {
                let op = Op::MoeDispatch {
                    degree: *degree,
                    experts: *experts,
                    rows: ty(g, 0).shape.dims()[0],
                };
                put(0, g.add_grad_node(op, &[dy, ins[1]], id)?);
            }
        }
        Op::MoeRouterWeights { score, norm } => {
            if wanted[0] {
                let op = Op::MoeRouterWeightsGrad {
                    score: *score,
                    norm: *norm,
                };
                put(0, g.add_grad_node(op, &[ins[0], ins[1], dy], id)?);
            }
        }
        Op::MoePermute => {
            if wanted[0] {
                let sum = ty(g, 0).shape.rank() == 2;
                put(0, g.add_grad_node(Op::MoeUnpermute { sum }, &[dy, ins[1]], id)?);
            }
        }
        Op::MoeUnpermute { .. } => {
            if wanted[0] {
                put(0, g.add_grad_node(Op::MoePermute, &[dy, ins[1]], id)?);
            }
        }
        Op::GroupedLinear { layout } => {
            if wanted[0] {
                let flipped = match layout {
                    WeightLayout::OutIn => WeightLayout::InOut,
                    WeightLayout::InOut => WeightLayout::OutIn,
                };
                let mut operands = vec![dy, ins[1]];
                operands.extend_from_slice(&ins[2..]);
                put(
                    0,
                    g.add_grad_node(Op::GroupedLinear { layout: flipped }, &operands, id)?,
                );
            }
            for (i, _) in wanted.iter().enumerate().skip(2).filter(|(_, w)| **w) {
                let op = Op::GroupedWeightGrad {
                    expert: (i - 2) as u64,
                    experts: (ins.len() - 2) as u64,
                    layout: *layout,
                };
                put(i, g.add_grad_node(op, &[ins[0], dy, ins[1]], id)?);
            }
        }
        Op::MoeAuxLoss { top_k, coef } => {
            let mut operands = vec![dy];
            operands.extend_from_slice(&ins);
            for (layer, _) in wanted.iter().enumerate().filter(|(_, w)| **w) {
                let op = Op::MoeAuxLossGrad {
                    layer,
                    top_k: *top_k,
                    coef: *coef,
                };
                put(layer, g.add_grad_node(op, &operands, id)?);
            }
        }
        op => return Err(IrError::Autodiff(format!("{id} ({}) has no gradient rule", op.name()))),
    }
    Ok(out)
}
