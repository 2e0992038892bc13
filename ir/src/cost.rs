//! FLOPs and bytes per node, forward and backward.
//!
//! Conventions (documented so MFU figures can be compared with other tools):
//! - a multiply-add counts as 2 FLOPs;
//! - attention counts the full `s x t` score matrix even when causal, as torchtitan's and
//!   PaLM's MFU formulas do (`12 * layers * heads * head_dim * seq` per token, fwd+bwd);
//! - backward of a matmul-like op is twice its forward (input and weight gradients);
//! - elementwise ops use the small per-element constants in [`elementwise_flops`]; they are
//!   approximate and negligible next to the matmuls;
//! - bytes are operand bytes read plus result bytes written (reshape is a view: 0).
//!
//! Arithmetic saturates: a graph only holds tensors whose byte sizes fit u64, but FLOP
//! products of absurd models may not, and a saturated count is still "too big".

use crate::{Graph, NodeId, Op};
use serde::Serialize;
use std::ops::AddAssign;

/// Work of one node, or a sum of nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Cost {
    pub fwd_flops: u64,
    pub bwd_flops: u64,
    /// Bytes moved by the forward op (operands read + result written).
    pub fwd_bytes: u64,
}

impl AddAssign for Cost {
    fn add_assign(&mut self, o: Cost) {
        self.fwd_flops = self.fwd_flops.saturating_add(o.fwd_flops);
        self.bwd_flops = self.bwd_flops.saturating_add(o.bwd_flops);
        self.fwd_bytes = self.fwd_bytes.saturating_add(o.fwd_bytes);
    }
}

/// `(forward, backward)` FLOPs per output element of the elementwise-like ops.
pub fn elementwise_flops(op: &Op) -> (u64, u64) {
    match op {
        Op::Add => (1, 1),
        Op::Mul => (1, 2),
        Op::Silu => (4, 8),
        Op::Gelu | Op::GeluErf => (8, 16),
        Op::Relu => (1, 1),
        Op::Sigmoid => (4, 3),
        Op::RmsNorm { .. } => (4, 8),
        Op::LayerNorm { .. } => (7, 14),
        Op::Rope { .. } => (3, 3),
        Op::Softmax { .. } => (5, 5),
        _ => (0, 0),
    }
}

fn mul(xs: &[u64]) -> u64 {
    xs.iter().fold(1u64, |acc, &x| acc.saturating_mul(x))
}

impl Graph {
    /// FLOPs and bytes of one node.
    pub fn node_cost(&self, id: NodeId) -> Cost {
        let node = self.node(id);
        // (Inline: called for every node by every plan; only grouped expert ops have more.)
        let ins: smallvec::SmallVec<[&crate::TensorType; 4]> = node.inputs.iter().map(|&i| &self.node(i).ty).collect();
        let out_numel = node.ty.numel().unwrap_or(u64::MAX);
        let (fwd_flops, bwd_flops) = match &node.op {
            Op::Input { .. } | Op::Param { .. } | Op::Fill { .. } => (0, 0),
            Op::Embedding | Op::VocabEmbedding { .. } => (0, out_numel),
            Op::Linear { bias, .. } => {
                let w = ins[1].shape.dims();
                let rows = mul(&ins[0].shape.dims()[..ins[0].shape.rank() - 1]);
                let mm = mul(&[2, rows, w[0], w[1]]);
                let b = if *bias { out_numel } else { 0 };
                (mm.saturating_add(b), mm.saturating_mul(2).saturating_add(b))
            }
            Op::MatMul => {
                let k = ins[0].shape.last().unwrap_or(0);
                let mm = mul(&[2, out_numel, k]);
                (mm, mm.saturating_mul(2))
            }
            Op::Attention { .. } => {
                let q = ins[0].shape.dims();
                let t = ins[1].shape.dims()[1];
                let f = mul(&[4, q[0], q[2], q[1], t, q[3]]);
                (f, f.saturating_mul(2))
            }
            Op::CrossEntropy | Op::VocabCrossEntropy { .. } => {
                let n = ins[0].numel().unwrap_or(u64::MAX);
                (n.saturating_mul(5), n.saturating_mul(2))
            }
            Op::Sum => (ins[0].numel().unwrap_or(u64::MAX), ins[0].numel().unwrap_or(u64::MAX)),
            // Backward-only ops: their cost is all "forward" (they are never differentiated).
            Op::WeightGrad { .. } => {
                let x = ins[0].shape.dims();
                let rows = mul(&x[..x.len() - 1]);
                (mul(&[2, rows, out_numel]), 0)
            }
            Op::AttnProbs { .. } | Op::AttnGradV { .. } | Op::AttnGradScores | Op::AttnGradQ | Op::AttnGradK { .. } => {
                // Every part is one [s, t] x [t|s, d] matmul per head, plus softmax work on
                // the [b, h, s, t] probabilities for the two that touch them.
                let (bhst, d) = match &node.op {
                    Op::AttnProbs { .. } => (
                        mul(&[
                            ins[0].shape.dims()[0],
                            ins[0].shape.dims()[2],
                            ins[0].shape.dims()[1],
                            ins[1].shape.dims()[1],
                        ]),
                        ins[0].shape.dims()[3],
                    ),
                    Op::AttnGradV { .. } | Op::AttnGradScores => {
                        (ins[0].numel().unwrap_or(u64::MAX), ins[1].shape.dims()[3])
                    }
                    _ => (ins[0].numel().unwrap_or(u64::MAX), ins[1].shape.dims()[3]),
                };
                let extra = if matches!(node.op, Op::AttnProbs { .. } | Op::AttnGradScores) {
                    bhst.saturating_mul(5)
                } else {
                    0
                };
                (mul(&[2, bhst, d]).saturating_add(extra), 0)
            }
            Op::CrossEntropyGrad | Op::VocabCrossEntropyGrad { .. } => (out_numel.saturating_mul(5), 0),
            // Collectives move bytes (costed by the planner on the tensor group's links);
            // a reduction adds each arriving element once.
            Op::TpReduceScatter { .. } | Op::TpAllReduce { .. } => (ins[0].numel().unwrap_or(u64::MAX), 0),
            Op::TpAllGather { .. } | Op::TpCopy { .. } | Op::TpSlice { .. } | Op::CpAllGather { .. } => (0, 0),
            Op::CpReduceScatter { .. } => (ins[0].numel().unwrap_or(u64::MAX), 0),
            Op::SumTo { .. }
            | Op::BroadcastTo { .. }
            | Op::Pad { .. }
            | Op::EmbeddingGrad { .. }
            | Op::VocabEmbeddingGrad { .. } => (ins[0].numel().unwrap_or(u64::MAX).max(out_numel), 0),
            Op::RmsNormGrad { .. } | Op::LayerNormGrad { .. } => {
                let per = if matches!(node.op, Op::RmsNormGrad { .. }) {
                    8
                } else {
                    14
                };
                (ins[0].numel().unwrap_or(u64::MAX).saturating_mul(per), 0)
            }
            Op::RopeGrad { .. } => (out_numel.saturating_mul(3), 0),
            // Routing: a softmax (or sigmoid) over each token's logits and a top-k pass; the
            // backward through the weights is a softmax gradient on the same logits.
            Op::MoeTopK { k, .. } => {
                let n = ins[0].numel().unwrap_or(u64::MAX);
                (n.saturating_mul(5).saturating_add(n.saturating_mul(*k)), 0)
            }
            Op::MoeRouterWeights { .. } => (ins[0].numel().unwrap_or(u64::MAX).saturating_mul(5), 0),
            Op::MoeRouterWeightsGrad { .. } => (ins[0].numel().unwrap_or(u64::MAX).saturating_mul(5), 0),
            // Pure data movement; the summing unpermute adds each row once.
            Op::MoePermute
            | Op::MoeUnpermute { sum: false }
            | Op::MoeGatherIds { .. }
            | Op::MoeDrop { .. }
            | Op::MoeDispatch { .. }
            | Op::MoeCombine { .. }
            | Op::MoeLocalIds { .. } => (0, 0),
            Op::MoeUnpermute { sum: true } => (ins[0].numel().unwrap_or(u64::MAX), 0),
            // Every assignment's row meets exactly one expert's weight: `2 * T * k * in * out`
            // whatever the routing.
            Op::GroupedLinear { .. } => {
                let w = ins[2].shape.dims();
                let mm = mul(&[2, ins[0].shape.dims()[0], w[0], w[1]]);
                (mm, mm.saturating_mul(2))
            }
            // One expert's weight gradient over its rows, `T * k / E` of them at the even
            // split: the experts' nodes together cost the exact `2 * T * k * in * out`.
            Op::GroupedWeightGrad { experts, .. } => {
                let rows = ins[0].shape.dims()[0] / (*experts).max(1);
                (mul(&[2, rows, out_numel]), 0)
            }
            Op::MoeAuxLoss { .. } | Op::MoeAuxLossGrad { .. } => {
                let n = ins
                    .iter()
                    .fold(0u64, |a, t| a.saturating_add(t.numel().unwrap_or(u64::MAX)));
                (n.saturating_mul(6), 0)
            }
            Op::SiluGrad => (out_numel.saturating_mul(8), 0),
            Op::GeluGrad | Op::GeluErfGrad => (out_numel.saturating_mul(16), 0),
            Op::ReluGrad => (out_numel, 0),
            Op::SigmoidGrad => (out_numel.saturating_mul(7), 0),
            Op::SoftmaxGrad { .. } => (out_numel.saturating_mul(5), 0),
            op => {
                let (f, b) = elementwise_flops(op);
                (out_numel.saturating_mul(f), out_numel.saturating_mul(b))
            }
        };
        let fwd_bytes = match node.op {
            Op::Input { .. } | Op::Param { .. } | Op::Fill { .. } | Op::Reshape { .. } | Op::TpCopy { .. } => 0,
            // One expert's weight gradient reads its own run of rows (`1 / E` of them at the
            // even split), not the whole permuted buffers.
            Op::GroupedWeightGrad { experts, .. } => {
                let rows = |t: &crate::TensorType| t.bytes().unwrap_or(u64::MAX) / experts.max(1);
                rows(ins[0])
                    .saturating_add(rows(ins[1]))
                    .saturating_add(ins[2].bytes().unwrap_or(u64::MAX))
                    .saturating_add(node.ty.bytes().unwrap_or(u64::MAX))
            }
            _ => ins
                .iter()
                .chain(std::iter::once(&&node.ty))
                .fold(0u64, |acc, t| acc.saturating_add(t.bytes().unwrap_or(u64::MAX))),
        };
        Cost {
            fwd_flops,
            bwd_flops,
            fwd_bytes,
        }
    }

    /// Sum of [`Graph::node_cost`] over all nodes.
    pub fn total_cost(&self) -> Cost {
        let mut total = Cost::default();
        for (id, _) in self.nodes() {
            total += self.node_cost(id);
        }
        total
    }
}
