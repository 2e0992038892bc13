//! What `torch.compile` runs of a plan (`compile` in the spec, under `runtime: fsdp2`):
//! which nodes inductor compiles, and which of them it fuses into a neighbour's kernel so
//! that their values are never written to memory.
//!
//! torchtitan compiles each transformer block on its own and the loss function apart
//! (`apply_compile`; `compile.model`, `compile.loss`). A compiled region is one block (or
//! the loss) in one pass: its forward is one graph, its backward (AOTAutograd's, which also
//! runs a checkpointed block's recomputation) another. Inside a region inductor fuses
//! every chain of pointwise ops, norms, rotary embeddings, casts, views and reductions into
//! as few kernels as it can; matmuls, attention, embeddings and collectives stay library
//! kernels. The rule modelled: a fusible node whose every reader is a fusible node of the
//! same region and pass is computed inside its readers' kernel, so its value is neither
//! written nor read back; every other node is a kernel of its own that writes its value.
//! Between regions, and from a region to the eager ops around it, values are tensors as in
//! eager mode.

use shardplan_frontends::Compile;
use shardplan_ir::{Graph, ModuleKind, NodeId, Op, ScopeId};

/// The compiled region of every node, and the nodes fused into their readers.
#[derive(Clone, Debug, Default)]
pub(crate) struct Compiled {
    /// Per node: its region (the block or loss scope, and whether it is in the backward
    /// pass), or `None` for an eager node. Empty when nothing is compiled.
    region: Vec<Option<(ScopeId, bool)>>,
    /// Per node: computed inside its readers' kernel. Empty when nothing is compiled.
    fused: Vec<bool>,
}

impl Compiled {
    /// What `compile` compiles of `g` (a joint graph: backward nodes carry their forward
    /// node's scope).
    pub(crate) fn new(g: &Graph, compile: Compile) -> Self {
        if !compile.any() {
            return Compiled::default();
        }
        let region: Vec<Option<(ScopeId, bool)>> = g
            .nodes()
            .map(|(_, n)| region_scope(g, n.scope, compile).map(|s| (s, n.is_backward())))
            .collect();
        let mut fused = vec![false; g.node_count()];
        let outputs: std::collections::HashSet<NodeId> = g.outputs().iter().copied().collect();
        for (id, n) in g.nodes() {
            let here = region[id.index()];
            if here.is_none() || !fusible(&n.op) || outputs.contains(&id) {
                continue;
            }
            let users = g.users(id);
            fused[id.index()] = !users.is_empty()
                && users
                    .iter()
                    .all(|&u| region[u.index()] == here && fusible(&g.node(u).op));
        }
        Compiled { region, fused }
    }

    /// Whether node `id` runs in a compiled region.
    pub(crate) fn compiled(&self, id: NodeId) -> bool {
        self.region.get(id.index()).is_some_and(|r| r.is_some())
    }

    /// Whether node `id` is computed inside its readers' kernel (its value never written).
    pub(crate) fn fused(&self, id: NodeId) -> bool {
        self.fused.get(id.index()).copied().unwrap_or(false)
    }
}

/// The compiled block that holds `scope` (`compile.model`), if any.
pub(crate) fn compiled_block(g: &Graph, scope: ScopeId, compile: Compile) -> Option<ScopeId> {
    compile.model.then(|| g.enclosing(scope, ModuleKind::Block)).flatten()
}

/// The compiled region that holds `scope`: its compiled block, or the compiled loss
/// (`compile.loss`), if any.
pub(crate) fn region_scope(g: &Graph, scope: ScopeId, compile: Compile) -> Option<ScopeId> {
    compiled_block(g, scope, compile).or_else(|| compile.loss.then(|| g.enclosing(scope, ModuleKind::Loss)).flatten())
}

/// Ops inductor generates code for and fuses with their neighbours: pointwise ops, norms
/// and their gradients (reductions over a row), rotary embeddings, casts, views, sums and
/// the cross-entropy. Matmuls, attention, embeddings, collectives and the experts' routing
/// are library kernels (cuBLAS, flash attention, NCCL) or data-dependent, and are not.
pub(crate) fn fusible(op: &Op) -> bool {
    matches!(
        op,
        Op::Add
            | Op::Mul
            | Op::Silu
            | Op::SiluGrad
            | Op::Gelu
            | Op::GeluGrad
            | Op::GeluErf
            | Op::GeluErfGrad
            | Op::Relu
            | Op::ReluGrad
            | Op::Sigmoid
            | Op::SigmoidGrad
            | Op::Softmax { .. }
            | Op::SoftmaxGrad { .. }
            | Op::RmsNorm { .. }
            | Op::RmsNormGrad { .. }
            | Op::LayerNorm { .. }
            | Op::LayerNormGrad { .. }
            | Op::Rope { .. }
            | Op::RopeGrad { .. }
            | Op::Cast { .. }
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Narrow { .. }
            | Op::Concat { .. }
            | Op::Pad { .. }
            | Op::Sum
            | Op::SumTo { .. }
            | Op::BroadcastTo { .. }
            | Op::Fill { .. }
            | Op::CrossEntropy
            | Op::CrossEntropyGrad
    )
}
