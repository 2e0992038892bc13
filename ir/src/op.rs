//! The closed set of tensor ops and their shape inference.
//!
//! Ops are coarse where kernels are coarse (attention, rms_norm, cross_entropy), so the
//! planner and cost model see the same units the executor runs.

use crate::{ContextLayout, ContextRotate, DType, Float8Cast, Float8Recipe, ParamId, Shape, TensorType};
use serde::{Deserialize, Serialize};
use std::fmt;

/// How a linear layer's weight is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightLayout {
    /// `[out, in]`, as `torch.nn.Linear` (Llama, Mistral, Qwen2).
    OutIn,
    /// `[in, out]`, as GPT-2's `Conv1D`.
    InOut,
}

/// How rotary frequencies are rescaled for contexts longer than pretraining (Hugging Face's
/// `rope_scaling` / `rope_parameters`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// The frequencies `theta^(-2i/d)` as they are.
    #[default]
    Default,
    /// Every frequency divided by `factor` (positions interpolated).
    Linear { factor: f64 },
    /// Llama 3.1's: long wavelengths (beyond `original_max_position_embeddings /
    /// low_freq_factor`) divided by `factor`, short ones (below `... / high_freq_factor`)
    /// kept, and a smooth blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: u64,
    },
    /// YaRN: frequencies blended between divided by `factor` and kept along a linear ramp
    /// over the dimensions between `beta_fast` and `beta_slow` rotations in the original
    /// context, and cos / sin scaled by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: u64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
}

impl RopeScaling {
    /// The factor cos and sin are multiplied by (YaRN's attention scaling; 1 otherwise).
    pub fn attention_factor(&self) -> f64 {
        match *self {
            RopeScaling::Yarn { attention_factor, .. } => attention_factor,
            _ => 1.0,
        }
    }

    /// The inverse frequency of rotary pair `i` of a `head_dim`-wide head with base `theta`.
    pub fn inv_freq(&self, theta: f64, head_dim: usize, i: usize) -> f64 {
        let f = theta.powf(-(2.0 * i as f64) / head_dim as f64);
        match *self {
            RopeScaling::Default => f,
            RopeScaling::Linear { factor } => f / factor,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = original_max_position_embeddings as f64;
                let wavelen = 2.0 * std::f64::consts::PI / f;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                if wavelen < high_wavelen {
                    f
                } else if wavelen > low_wavelen {
                    f / factor
                } else {
                    let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * f / factor + smooth * f
                }
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                // The dimension at which a frequency makes `rotations` turns over the
                // original context.
                let d = head_dim as f64;
                let at = |rotations: f64| {
                    d * (original_max_position_embeddings as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (at(beta_fast), at(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001;
                }
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                f / factor * (1.0 - keep) + f * keep
            }
        }
    }
}

fn is_default_scaling(s: &RopeScaling) -> bool {
    *s == RopeScaling::Default
}

/// One tensor operation. Operand order is part of each op's contract (see [`Op::infer`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// A graph input fed by the data pipeline (`tokens`, `targets`, `features`).
    Input { name: String },
    /// A trainable parameter.
    Param { param: ParamId },
    /// `(table [V, D], ids [...] int) -> [..., D]`.
    Embedding,
    /// `(x [..., in], w, bias? [out]) -> [..., out]`. With `float8`, a torchao Float8 linear
    /// (`[out, in]` weights only): `x` and `w` are each cast under the recipe's output casts
    /// and the product taken of the values read back; the bias is added in high precision.
    /// Its backward casts its operands with [`Op::Float8Cast`].
    Linear {
        bias: bool,
        layout: WeightLayout,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        float8: Option<Float8Recipe>,
    },
    /// `(a [..., m, k], b [..., k, n]) -> [..., m, n]`, batch dims broadcast.
    MatMul,
    /// Elementwise sum with broadcasting.
    Add,
    /// Elementwise product with broadcasting.
    Mul,
    /// `(x [..., d], w [d]) -> [..., d]`.
    RmsNorm { eps: f64 },
    /// `(x [..., d], w [d], b [d]) -> [..., d]`.
    LayerNorm { eps: f64 },
    /// Rotary position embedding over positions `0..seq`: `(x [b, s, h, d]) -> same`, d even.
    /// With `context`, the rows are this context rank's of a longer sequence, at their
    /// positions in it ([`ContextLayout::positions`]).
    Rope {
        theta: f64,
        #[serde(default, skip_serializing_if = "is_default_scaling")]
        scaling: RopeScaling,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        context: Option<ContextLayout>,
    },
    /// Scaled dot-product attention with grouped-query heads:
    /// `(q [b, s, h, d], k [b, t, kv, d], v [b, t, kv, d]) -> [b, s, h, d]`, h % kv == 0.
    /// Causal, query `i` sees keys `0..=i + t - s`. With `context`, the queries are this
    /// context rank's rows and the keys the whole sequence in position order
    /// (`cp_all_gather`'s), and a query sees the keys up to its own position.
    Attention {
        causal: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        context: Option<ContextLayout>,
    },
    /// `x * sigmoid(x)`.
    Silu,
    /// GELU, tanh approximation (GPT-2's `gelu_new`, `gelu_pytorch_tanh`).
    Gelu,
    /// GELU, exact: `x * Phi(x)` (Hugging Face's `gelu`).
    GeluErf,
    /// `max(x, 0)`.
    Relu,
    /// `1 / (1 + exp(-x))` (Qwen2-MoE's shared-expert gate).
    Sigmoid,
    /// Softmax over one dim.
    Softmax { dim: usize },
    /// Mean token cross-entropy: `(logits [n, v] float, targets [n] int) -> f32 []`
    /// (f64 for f64 logits).
    CrossEntropy,
    /// Same elements, new shape.
    Reshape { shape: Shape },
    /// Swap two dims.
    Transpose { dim0: usize, dim1: usize },
    /// `len` entries of `dim` starting at `start`.
    Narrow { dim: usize, start: u64, len: u64 },
    /// Join operands along `dim`; all other dims equal.
    Concat { dim: usize },
    /// Change the element type.
    Cast { dtype: DType },
    /// A matmul operand as a Float8 matmul reads it (backward only: a Float8 linear's
    /// gradients): `(x) -> x`'s type, each value scaled, cast to float8 and read back,
    /// the matrix `[numel / last, last]` scaled per `cast`'s granularity.
    Float8Cast { cast: Float8Cast },
    /// Sum of all elements: `(x) -> []`, same dtype.
    Sum,

    // ---- leaves and ops that only the backward pass (ir::autodiff) creates ----
    /// A tensor filled with one value (the seed `dloss/dloss = 1`); type given when added.
    Fill { value: f64 },
    /// Sums a broadcast gradient back to an operand's shape: `(g) -> shape`.
    SumTo { shape: Shape },
    /// Broadcasts to a larger shape: `(g) -> shape`.
    BroadcastTo { shape: Shape },
    /// Weight gradient of `linear`: `(x [..., in], g [..., out]) -> w`'s shape.
    WeightGrad { layout: WeightLayout },
    /// Table gradient of `embedding` (scatter-add): `(ids [...], g [..., d]) -> [vocab, d]`.
    EmbeddingGrad { vocab: u64 },
    /// `rms_norm` gradient wrt its input or its weight: `(x, w, g) -> x or w`'s shape.
    RmsNormGrad { eps: f64, wrt: NormWrt },
    /// `layer_norm` gradient wrt its input or its weight: `(x, w, g) -> x or w`'s shape.
    LayerNormGrad { eps: f64, wrt: NormWrt },
    /// Inverse rotation of `rope`: `(g [b, s, h, d]) -> same`.
    RopeGrad {
        theta: f64,
        #[serde(default, skip_serializing_if = "is_default_scaling")]
        scaling: RopeScaling,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        context: Option<ContextLayout>,
    },
    /// Attention probabilities, recomputed in backward: `(q, k) -> [b, h, s, t]`, masked as
    /// its `attention`.
    AttnProbs {
        causal: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        context: Option<ContextLayout>,
    },
    /// `(p [b, h, s, t], g [b, s, h, d]) -> dv [b, t, kv, d]`.
    AttnGradV { kv_heads: u64 },
    /// Gradient of the (scaled) scores through the softmax: `(p, g, v) -> [b, h, s, t]`.
    AttnGradScores,
    /// `(ds [b, h, s, t], k [b, t, kv, d]) -> dq [b, s, h, d]`.
    AttnGradQ,
    /// `(ds [b, h, s, t], q [b, s, h, d]) -> dk [b, t, kv, d]`.
    AttnGradK { kv_heads: u64 },
    /// `(x, g) -> dx` of silu.
    SiluGrad,
    /// `(x, g) -> dx` of gelu (tanh approximation).
    GeluGrad,
    /// `(x, g) -> dx` of exact gelu.
    GeluErfGrad,
    /// `(x, g) -> dx` of relu.
    ReluGrad,
    /// `(x, g) -> dx` of sigmoid.
    SigmoidGrad,
    /// `(y, g) -> dx` of softmax, from its output `y`.
    SoftmaxGrad { dim: usize },
    /// `(logits [n, v], targets [n], g []) -> dlogits [n, v]` of mean cross-entropy.
    CrossEntropyGrad,
    /// `(logits [T, E], experts [T, k], g [T, k]) -> dlogits [T, E]` of `moe_router_weights`.
    MoeRouterWeightsGrad { score: RouterScore, norm: bool },
    /// Weight gradient of expert `expert` (of `experts`) of `grouped_linear`: `(x [T * k, in], g [T * k,
    /// out], experts [T, k] int) -> its weight's shape` from its run of rows.
    GroupedWeightGrad {
        expert: u64,
        experts: u64,
        layout: WeightLayout,
    },
    /// `(g [], logits_0, ..., logits_{L-1}) -> dlogits_layer` of `moe_aux_loss`.
    MoeAuxLossGrad { layer: usize, top_k: u64, coef: f64 },
    /// Zero padding along `dim` (the gradient of `narrow`).
    Pad { dim: usize, before: u64, after: u64 },

    // ---- mixture of experts: routing ----
    // `T` tokens (rows), `E` experts, `k` experts per token. An assignment is one (token,
    // slot) pair; the "expert order" of the `T * k` assignments sorts them by expert, stably
    // (ties by token, then slot): the rows of a permuted buffer, each expert's rows a run.
    /// The `k` experts each token is routed to: `(logits [T, E] float) -> u32 [T, k]`, the
    /// highest scores (`score` of the logits, in f32) first, ties to the lower expert (torch's
    /// `topk` of the routing probabilities). No gradient.
    MoeTopK { k: u64, score: RouterScore },
    /// Token dropping (GShard's capacity): `(experts [T, k] int) -> u32 [T, k]`, the same
    /// ids except that each expert keeps at most `capacity` assignments and the others become
    /// `experts` (no expert: `moe_permute` puts them after every expert's rows,
    /// `grouped_linear` leaves them zero, an expert-parallel dispatch sends them nowhere).
    /// Priority: every token's first choice before any second choice, then token order.
    /// No gradient.
    MoeDrop { experts: u64, capacity: u64 },
    /// The chosen experts' routing weights: `(logits [T, E] float, experts [T, k] int) -> [T,
    /// k]` of the logits' dtype (Hugging Face routes f32 logits), `score` (softmax over all
    /// `E`, or sigmoid) of the logits at the chosen experts, divided by their sum when `norm`
    /// (Hugging Face's `norm_topk_prob`; Mixtral always).
    MoeRouterWeights { score: RouterScore, norm: bool },
    /// Rows to expert order: `(x [T, D] | [T, k, D], experts [T, k] int) -> [T * k, D]`, the
    /// row of assignment (t, j) is `x[t]` (or `x[t, j]`).
    MoePermute,
    /// Rows back from expert order: `(y [T * k, D], experts [T, k] int) -> [T, k, D]`, or with
    /// `sum` `[T, D]`, each token's `k` rows summed in increasing expert order (Hugging
    /// Face's `index_add_` over the experts).
    MoeUnpermute { sum: bool },
    /// The grouped expert matmul: `(x [T * k, in] in expert order, experts [T, k] int, w_0,
    /// ..., w_{E-1}) -> [T * k, out]`, each expert's run of rows times its own weight (as
    /// [`Op::Linear`] without bias, in `layout`).
    GroupedLinear { layout: WeightLayout },
    /// The load-balancing loss (Switch; Hugging Face's `load_balancing_loss_func` over every
    /// MoE layer's router logits together): `(logits_0 [T, E], ..., logits_{L-1}) -> f32 []`
    /// (f64 for f64 logits)
    /// = `coef * E * sum_e f_e * P_e`, `f_e` the share of the `L * T` tokens' `top_k` picks
    /// (by softmax) that went to `e` (summed over the slots), `P_e` the mean softmax
    /// probability of `e`.
    MoeAuxLoss { top_k: u64, coef: f64 },

    // ---- expert parallelism: ops over the `degree` ranks of one expert group ----
    // Each rank of an expert group holds `experts / degree` of every MoE layer's routed
    // experts (rank `r` the experts `r * n .. (r + 1) * n`); tokens travel to their experts
    // and back. The received rows are bounded by `rows` (the plan's capacity), so every
    // shape stays static; routing is data-dependent, so the counts are checked at run time.
    /// Every expert rank's routing: `(experts [T, k] int) -> u32 [degree * T, k]`, the ranks'
    /// tables one after another in rank order: what the dispatch and the combine read to
    /// know which rows go where. No gradient.
    MoeGatherIds { degree: u64 },
    /// Rows to the ranks holding their experts: `(x [T * k, D] in expert order, table
    /// [degree * T, k]) -> [rows, D]`, this rank's experts' rows from every rank ordered by
    /// (local expert, source rank, source order), then zero rows. More than `rows` arriving
    /// is a run-time error. Backward: `moe_combine` of the gradient.
    MoeDispatch { degree: u64, experts: u64, rows: u64 },
    /// The dispatch undone: `(y [rows, D], table [degree * T, k]) -> [T * k, D]` in this
    /// rank's expert order. Backward: `moe_dispatch` of the gradient.
    MoeCombine { degree: u64, experts: u64 },
    /// The local expert of each received row: `(table [degree * T, k]) -> u32 [rows, 1]`,
    /// `experts / degree` (no expert) for the padding rows after them; `grouped_linear`
    /// leaves those rows zero. No gradient.
    MoeLocalIds { degree: u64, experts: u64, rows: u64 },

    // ---- tensor parallelism: ops over the `degree` ranks of one tensor group ----
    // A tensor-parallel graph is one tensor rank's program: every rank of the group runs
    // the same nodes on its own slices. These ops are where the slices meet. Each names how
    // its gradient flows back, so autodiff needs no knowledge of the layout around it.
    /// Concatenates every tensor rank's `x` along `dim`: `[.., n, ..] -> [.., n * degree, ..]`.
    /// Backward: a reduce-scatter when the output's gradient is partial on each rank (the
    /// gathered value feeds column-parallel work), this rank's chunk when it is the same on
    /// every rank ([`TpGrad`]).
    TpAllGather { dim: usize, degree: u64, grad: TpGrad },
    /// Sums every tensor rank's `x` and keeps this rank's chunk of `dim`:
    /// `[.., n, ..] -> [.., n / degree, ..]`. Backward: an all-gather.
    TpReduceScatter { dim: usize, degree: u64 },
    /// Sums every tensor rank's `x`; every rank gets the sum. Backward: the identity (the
    /// sum's gradient is the same on every rank).
    TpAllReduce { degree: u64 },
    /// The identity, whose gradient is summed over the tensor group: a value every rank
    /// holds whole, read by work that leaves each rank only part of its gradient (Megatron's
    /// `f`; also a replicated parameter read by sequence-parallel work).
    TpCopy { degree: u64 },
    /// This tensor rank's chunk of `dim` of a value every rank holds whole:
    /// `[.., n, ..] -> [.., n / degree, ..]`. Backward: an all-gather.
    TpSlice { dim: usize, degree: u64 },
    /// Vocabulary-parallel embedding: `(table [V / degree, D], ids [...] int) -> [..., D]`,
    /// the rows this tensor rank holds (rank r: ids `r * V / degree ..`), zeros elsewhere; the
    /// output is partial, summed over the group after.
    VocabEmbedding { degree: u64 },
    /// Table gradient of `vocab_embedding`: `(ids [...], g [..., d]) -> [vocab, d]` for
    /// this rank's `vocab` rows.
    VocabEmbeddingGrad { vocab: u64, degree: u64 },
    /// Mean token cross-entropy over logits split by vocabulary across the tensor group:
    /// `(logits [n, V / degree] float, targets [n] int) -> f32 []`, the same loss on every
    /// rank (the row maxima, exponential sums and target logits are reduced over the group).
    VocabCrossEntropy { degree: u64 },
    /// `(logits [n, V / degree], targets [n], g []) -> dlogits [n, V / degree]` of
    /// `vocab_cross_entropy` (the log-sum-exp reduced over the group again).
    VocabCrossEntropyGrad { degree: u64 },

    // ---- context parallelism: ops over the `layout.degree` ranks of one context group ----
    // A context-parallel graph is one context rank's program: each rank holds its rows of
    // every sequence ([`ContextLayout`]); attention is where they meet.
    /// Every context rank's rows of dim 1 (keys or values), the whole sequence in position
    /// order: `[b, s, ..] -> [b, s * degree, ..]`, moved as `rotate` says. Backward:
    /// `cp_reduce_scatter`.
    CpAllGather {
        layout: ContextLayout,
        rotate: ContextRotate,
    },
    /// The sum over the context group of `x` (a whole sequence in position order), this
    /// rank's rows: `[b, s * degree, ..] -> [b, s, ..]` (keys' and values' gradients).
    /// Backward: `cp_all_gather`.
    CpReduceScatter {
        layout: ContextLayout,
        rotate: ContextRotate,
    },
}

/// How a tensor-parallel all-gather's gradient comes back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TpGrad {
    /// Each rank holds part of the gathered value's gradient: reduce-scatter it
    /// (sequence parallelism's gather into a column-parallel layer).
    Partial,
    /// Every rank holds the whole gradient: keep this rank's chunk (logits gathered for a
    /// replicated loss).
    Replicated,
}

/// How a router turns logits into scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterScore {
    /// Softmax over all experts (Mixtral, Qwen2-MoE, Qwen3-MoE).
    Softmax,
    /// Each expert's sigmoid on its own.
    Sigmoid,
}

/// Which operand a normalisation gradient is taken with respect to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormWrt {
    Input,
    Weight,
}

impl Op {
    /// Short lowercase name used in printouts and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Param { .. } => "param",
            Op::Embedding => "embedding",
            Op::Linear { .. } => "linear",
            Op::MatMul => "matmul",
            Op::Add => "add",
            Op::Mul => "mul",
            Op::RmsNorm { .. } => "rms_norm",
            Op::LayerNorm { .. } => "layer_norm",
            Op::Rope { .. } => "rope",
            Op::Attention { .. } => "attention",
            Op::Silu => "silu",
            Op::Gelu => "gelu",
            Op::GeluErf => "gelu_erf",
            Op::Relu => "relu",
            Op::Sigmoid => "sigmoid",
            Op::Softmax { .. } => "softmax",
            Op::CrossEntropy => "cross_entropy",
            Op::Reshape { .. } => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Narrow { .. } => "narrow",
            Op::Concat { .. } => "concat",
            Op::Cast { .. } => "cast",
            Op::Float8Cast { .. } => "float8_cast",
            Op::Sum => "sum",
            Op::Fill { .. } => "fill",
            Op::SumTo { .. } => "sum_to",
            Op::BroadcastTo { .. } => "broadcast_to",
            Op::WeightGrad { .. } => "weight_grad",
            Op::EmbeddingGrad { .. } => "embedding_grad",
            Op::RmsNormGrad { .. } => "rms_norm_grad",
            Op::LayerNormGrad { .. } => "layer_norm_grad",
            Op::RopeGrad { .. } => "rope_grad",
            Op::AttnProbs { .. } => "attn_probs",
            Op::AttnGradV { .. } => "attn_grad_v",
            Op::AttnGradScores => "attn_grad_scores",
            Op::AttnGradQ => "attn_grad_q",
            Op::AttnGradK { .. } => "attn_grad_k",
            Op::SiluGrad => "silu_grad",
            Op::GeluGrad => "gelu_grad",
            Op::GeluErfGrad => "gelu_erf_grad",
            Op::ReluGrad => "relu_grad",
            Op::SigmoidGrad => "sigmoid_grad",
            Op::SoftmaxGrad { .. } => "softmax_grad",
            Op::CrossEntropyGrad => "cross_entropy_grad",
            Op::Pad { .. } => "pad",
            Op::TpAllGather { .. } => "tp_all_gather",
            Op::TpReduceScatter { .. } => "tp_reduce_scatter",
            Op::TpAllReduce { .. } => "tp_all_reduce",
            Op::TpCopy { .. } => "tp_copy",
            Op::TpSlice { .. } => "tp_slice",
            Op::VocabEmbedding { .. } => "vocab_embedding",
            Op::VocabEmbeddingGrad { .. } => "vocab_embedding_grad",
            Op::VocabCrossEntropy { .. } => "vocab_cross_entropy",
            Op::VocabCrossEntropyGrad { .. } => "vocab_cross_entropy_grad",
            Op::MoeTopK { .. } => "moe_top_k",
            Op::MoeDrop { .. } => "moe_drop",
            Op::MoeRouterWeights { .. } => "moe_router_weights",
            Op::MoePermute => "moe_permute",
            Op::MoeUnpermute { .. } => "moe_unpermute",
            Op::GroupedLinear { .. } => "grouped_linear",
            Op::MoeAuxLoss { .. } => "moe_aux_loss",
            Op::MoeRouterWeightsGrad { .. } => "moe_router_weights_grad",
            Op::GroupedWeightGrad { .. } => "grouped_weight_grad",
            Op::MoeAuxLossGrad { .. } => "moe_aux_loss_grad",
            Op::MoeGatherIds { .. } => "moe_gather_ids",
            Op::MoeDispatch { .. } => "moe_dispatch",
            Op::MoeCombine { .. } => "moe_combine",
            Op::MoeLocalIds { .. } => "moe_local_ids",
            Op::CpAllGather { .. } => "cp_all_gather",
            Op::CpReduceScatter { .. } => "cp_reduce_scatter",
        }
    }

    /// True for ops without operands (inputs, parameters, constants).
    pub fn is_leaf(&self) -> bool {
        matches!(self, Op::Input { .. } | Op::Param { .. } | Op::Fill { .. })
    }

    /// Attributes for printing (`eps=1e-5`), empty when the op has none.
    pub fn attrs(&self) -> String {
        match self {
            Op::Linear { bias, layout, float8 } => {
                let mut parts = Vec::new();
                if *bias {
                    parts.push("bias".to_string());
                }
                if *layout == WeightLayout::InOut {
                    parts.push("w=[in,out]".to_string());
                }
                if let Some(r) = float8 {
                    parts.push(format!("float8={}", r.name()));
                }
                parts.join(" ")
            }
            Op::RmsNorm { eps } | Op::LayerNorm { eps } => format!("eps={eps:e}"),
            Op::Rope {
                theta,
                scaling,
                context,
            } => rope_attrs(*theta, scaling, context),
            Op::Attention { causal, context } | Op::AttnProbs { causal, context } => mask_attrs(*causal, context),
            Op::Softmax { dim } => format!("dim={dim}"),
            Op::Reshape { shape } => format!("to={shape}"),
            Op::Transpose { dim0, dim1 } => format!("dims={dim0},{dim1}"),
            Op::Narrow { dim, start, len } => format!("dim={dim} start={start} len={len}"),
            Op::Concat { dim } => format!("dim={dim}"),
            Op::Cast { dtype } => format!("to={dtype}"),
            Op::Float8Cast { cast } => cast.to_string(),
            Op::Fill { value } => format!("value={value}"),
            Op::SumTo { shape } | Op::BroadcastTo { shape } => format!("to={shape}"),
            Op::WeightGrad {
                layout: WeightLayout::InOut,
            } => "w=[in,out]".to_string(),
            Op::EmbeddingGrad { vocab } => format!("vocab={vocab}"),
            Op::RmsNormGrad { eps, wrt } | Op::LayerNormGrad { eps, wrt } => {
                format!(
                    "eps={eps:e} wrt={}",
                    if *wrt == NormWrt::Input { "input" } else { "weight" }
                )
            }
            Op::RopeGrad { theta, context, .. } => format!("theta={theta}") + &context_attrs(context),
            Op::AttnGradV { kv_heads } | Op::AttnGradK { kv_heads } => format!("kv_heads={kv_heads}"),
            Op::SoftmaxGrad { dim } => format!("dim={dim}"),
            Op::Pad { dim, before, after } => format!("dim={dim} before={before} after={after}"),
            Op::TpAllGather { dim, degree, grad } => format!(
                "dim={dim} tp={degree} grad={}",
                match grad {
                    TpGrad::Partial => "reduce_scatter",
                    TpGrad::Replicated => "slice",
                }
            ),
            Op::TpReduceScatter { dim, degree } | Op::TpSlice { dim, degree } => format!("dim={dim} tp={degree}"),
            Op::TpAllReduce { degree }
            | Op::TpCopy { degree }
            | Op::VocabEmbedding { degree }
            | Op::VocabCrossEntropy { degree }
            | Op::VocabCrossEntropyGrad { degree } => format!("tp={degree}"),
            Op::VocabEmbeddingGrad { vocab, degree } => format!("vocab={vocab} tp={degree}"),
            Op::MoeTopK { k, score } => format!("k={k} score={}", score.name()),
            Op::MoeRouterWeights { score, norm } | Op::MoeRouterWeightsGrad { score, norm } => {
                format!("score={}{}", score.name(), if *norm { " norm" } else { "" })
            }
            Op::MoeUnpermute { sum: true } => "sum".to_string(),
            Op::GroupedLinear {
                layout: WeightLayout::InOut,
            } => "w=[in,out]".to_string(),
            Op::GroupedWeightGrad {
                expert,
                experts,
                layout,
            } => format!(
                "expert={expert}/{experts}{}",
                if *layout == WeightLayout::InOut {
                    " w=[in,out]"
                } else {
                    ""
                }
            ),
            Op::MoeAuxLoss { top_k, coef } => format!("top_k={top_k} coef={coef}"),
            Op::MoeAuxLossGrad { layer, top_k, coef } => format!("layer={layer} top_k={top_k} coef={coef}"),
            Op::MoeGatherIds { degree } => format!("degree={degree}"),
            Op::MoeDrop { experts, capacity } => format!("experts={experts} capacity={capacity}"),
            Op::MoeDispatch { degree, experts, rows } | Op::MoeLocalIds { degree, experts, rows } => {
                format!("degree={degree} experts={experts} rows={rows}")
            }
            Op::MoeCombine { degree, experts } => format!("degree={degree} experts={experts}"),
            Op::CpAllGather { layout, rotate } | Op::CpReduceScatter { layout, rotate } => ring_attrs(layout, *rotate),
            _ => String::new(),
        }
    }

    /// Number of operands the op takes, or `None` when variadic (concat).
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Op::Input { .. } | Op::Param { .. } | Op::Fill { .. } => 0,
            Op::Embedding | Op::MatMul | Op::Add | Op::Mul | Op::RmsNorm { .. } => 2,
            Op::Sum | Op::SumTo { .. } | Op::BroadcastTo { .. } | Op::RopeGrad { .. } | Op::Pad { .. } => 1,
            Op::WeightGrad { .. } | Op::EmbeddingGrad { .. } | Op::AttnProbs { .. } | Op::AttnGradV { .. } => 2,
            Op::AttnGradQ
            | Op::AttnGradK { .. }
            | Op::SiluGrad
            | Op::GeluGrad
            | Op::GeluErfGrad
            | Op::ReluGrad
            | Op::SigmoidGrad
            | Op::SoftmaxGrad { .. } => 2,
            Op::RmsNormGrad { .. } | Op::LayerNormGrad { .. } | Op::AttnGradScores | Op::CrossEntropyGrad => 3,
            Op::CrossEntropy => 2,
            Op::Linear { bias, .. } => 2 + usize::from(*bias),
            Op::LayerNorm { .. } | Op::Attention { .. } => 3,
            Op::Rope { .. } | Op::Silu | Op::Gelu | Op::GeluErf | Op::Relu | Op::Sigmoid | Op::Softmax { .. } => 1,
            Op::Reshape { .. } | Op::Transpose { .. } | Op::Narrow { .. } | Op::Cast { .. } | Op::Float8Cast { .. } => {
                1
            }
            Op::TpAllGather { .. }
            | Op::TpReduceScatter { .. }
            | Op::TpAllReduce { .. }
            | Op::TpCopy { .. }
            | Op::TpSlice { .. }
            | Op::CpAllGather { .. }
            | Op::CpReduceScatter { .. } => 1,
            Op::VocabEmbedding { .. } | Op::VocabEmbeddingGrad { .. } | Op::VocabCrossEntropy { .. } => 2,
            Op::VocabCrossEntropyGrad { .. } => 3,
            Op::MoeTopK { .. } | Op::MoeDrop { .. } | Op::MoeGatherIds { .. } | Op::MoeLocalIds { .. } => 1,
            Op::MoeDispatch { .. } | Op::MoeCombine { .. } => 2,
            Op::MoeRouterWeights { .. } | Op::MoePermute | Op::MoeUnpermute { .. } => 2,
            Op::MoeRouterWeightsGrad { .. } | Op::GroupedWeightGrad { .. } => 3,
            Op::Concat { .. } | Op::GroupedLinear { .. } | Op::MoeAuxLoss { .. } | Op::MoeAuxLossGrad { .. } => {
                return None
            }
        })
    }

    /// Infers the output type from the operand types, or says what is wrong.
    ///
    /// Leaf ops have no operands; their type is given when they are added to the graph.
    pub fn infer(&self, ins: &[&TensorType]) -> Result<TensorType, String> {
        match self.arity() {
            Some(n) if ins.len() != n => return Err(format!("expects {n} operand(s), got {}", ins.len())),
            None if ins.is_empty() => return Err("expects at least one operand".into()),
            _ => {}
        }
        match self {
            Op::Input { .. } | Op::Param { .. } | Op::Fill { .. } => Err("leaf ops take their type as given".into()),
            Op::Embedding | Op::VocabEmbedding { .. } => infer_embedding(ins[0], ins[1]),
            Op::Linear {
                layout: WeightLayout::InOut,
                float8: Some(_),
                ..
            } => Err("a Float8 linear takes [out, in] weights (torch.nn.Linear's)".into()),
            Op::Linear { layout, .. } => infer_linear(*layout, ins),
            Op::MatMul => infer_matmul(ins[0], ins[1]),
            Op::Add | Op::Mul => {
                same_float_dtype(ins)?;
                let shape = ins[0]
                    .shape
                    .broadcast(&ins[1].shape)
                    .ok_or_else(|| format!("shapes {} and {} do not broadcast", ins[0].shape, ins[1].shape))?;
                Ok(TensorType::new(ins[0].dtype, shape))
            }
            Op::RmsNorm { .. } | Op::LayerNorm { .. } => infer_norm(ins),
            Op::Rope { .. } => {
                float(ins[0], "input")?;
                let d = ins[0].shape.dims();
                if d.len() != 4 {
                    return Err(format!(
                        "input must be [batch, seq, heads, head_dim], got {}",
                        ins[0].shape
                    ));
                }
                if !d[3].is_multiple_of(2) {
                    return Err(format!("head_dim {} must be even", d[3]));
                }
                Ok(ins[0].clone())
            }
            Op::Attention { .. } => infer_attention(ins[0], ins[1], ins[2]),
            Op::Silu | Op::Gelu | Op::GeluErf | Op::Relu | Op::Sigmoid => {
                float(ins[0], "input")?;
                Ok(ins[0].clone())
            }
            Op::Softmax { dim } => {
                float(ins[0], "input")?;
                check_dim(*dim, ins[0])?;
                Ok(ins[0].clone())
            }
            Op::CrossEntropy | Op::VocabCrossEntropy { .. } => infer_cross_entropy(ins[0], ins[1]),
            Op::Reshape { shape } => {
                let (from, to) = (ins[0].shape.numel(), shape.numel());
                if from != to || from.is_none() {
                    return Err(format!(
                        "cannot reshape {} ({} elements) to {} ({} elements)",
                        ins[0].shape,
                        show_numel(from),
                        shape,
                        show_numel(to)
                    ));
                }
                Ok(TensorType::new(ins[0].dtype, shape.clone()))
            }
            Op::Transpose { dim0, dim1 } => {
                check_dim(*dim0, ins[0])?;
                check_dim(*dim1, ins[0])?;
                let mut dims = ins[0].shape.dims().to_vec();
                dims.swap(*dim0, *dim1);
                Ok(TensorType::new(ins[0].dtype, dims))
            }
            Op::Narrow { dim, start, len } => {
                check_dim(*dim, ins[0])?;
                let size = ins[0].shape.dims()[*dim];
                match start.checked_add(*len) {
                    Some(end) if end <= size => {}
                    _ => {
                        return Err(format!(
                            "range {start}..{start}+{len} is outside dim {dim} of size {size}"
                        ))
                    }
                }
                let mut dims = ins[0].shape.dims().to_vec();
                dims[*dim] = *len;
                Ok(TensorType::new(ins[0].dtype, dims))
            }
            Op::Concat { dim } => infer_concat(*dim, ins),
            Op::Cast { dtype } => Ok(TensorType::new(*dtype, ins[0].shape.clone())),
            Op::Float8Cast { .. } => Ok(ins[0].clone()),
            Op::Sum => {
                float(ins[0], "input")?;
                Ok(TensorType::new(ins[0].dtype, Shape::scalar()))
            }
            Op::SumTo { shape } => {
                if shape.broadcast(&ins[0].shape).as_ref() != Some(&ins[0].shape) {
                    return Err(format!(
                        "{} does not broadcast to {}, so {} cannot be summed to it",
                        shape, ins[0].shape, ins[0].shape
                    ));
                }
                Ok(TensorType::new(ins[0].dtype, shape.clone()))
            }
            Op::BroadcastTo { shape } => {
                if ins[0].shape.broadcast(shape).as_ref() != Some(shape) {
                    return Err(format!("{} does not broadcast to {shape}", ins[0].shape));
                }
                Ok(TensorType::new(ins[0].dtype, shape.clone()))
            }
            Op::WeightGrad { layout } => infer_weight_grad(*layout, ins[0], ins[1]),
            Op::EmbeddingGrad { vocab } | Op::VocabEmbeddingGrad { vocab, .. } => {
                if ins[0].dtype.is_float() {
                    return Err(format!("ids must be an integer tensor, got {}", ins[0]));
                }
                float(ins[1], "gradient")?;
                let (id, gd) = (ins[0].shape.dims(), ins[1].shape.dims());
                if gd.len() != id.len() + 1 || &gd[..id.len()] != id {
                    return Err(format!(
                        "gradient {} must be ids {} plus a feature dim",
                        ins[1].shape, ins[0].shape
                    ));
                }
                Ok(TensorType::new(ins[1].dtype, [*vocab, gd[id.len()]]))
            }
            Op::RmsNormGrad { wrt, .. } | Op::LayerNormGrad { wrt, .. } => {
                same_float_dtype(ins)?;
                if ins[2].shape != ins[0].shape {
                    return Err(format!("gradient {} must match input {}", ins[2].shape, ins[0].shape));
                }
                infer_norm(&ins[..2])?;
                Ok(if *wrt == NormWrt::Input {
                    ins[0].clone()
                } else {
                    ins[1].clone()
                })
            }
            Op::RopeGrad {
                theta,
                scaling,
                context,
            } => Op::Rope {
                theta: *theta,
                scaling: *scaling,
                context: *context,
            }
            .infer(ins),
            Op::AttnProbs { .. } => {
                let out = infer_attention(ins[0], ins[1], ins[1])?;
                let (q, k) = (out.shape.dims(), ins[1].shape.dims());
                Ok(TensorType::new(ins[0].dtype, [q[0], q[2], q[1], k[1]]))
            }
            Op::AttnGradV { kv_heads } => {
                same_float_dtype(ins)?;
                let (p, g) = (ins[0].shape.dims(), ins[1].shape.dims());
                if p.len() != 4
                    || g.len() != 4
                    || p[0] != g[0]
                    || p[1] != g[2]
                    || p[2] != g[1]
                    || *kv_heads == 0
                    || p[1] % kv_heads != 0
                {
                    return Err(format!(
                        "probs {} and gradient {} do not match ({kv_heads} kv heads)",
                        ins[0].shape, ins[1].shape
                    ));
                }
                Ok(TensorType::new(ins[1].dtype, [g[0], p[3], *kv_heads, g[3]]))
            }
            Op::AttnGradScores => {
                same_float_dtype(ins)?;
                let (p, g, v) = (ins[0].shape.dims(), ins[1].shape.dims(), ins[2].shape.dims());
                if p.len() != 4
                    || g.len() != 4
                    || v.len() != 4
                    || p[2] != g[1]
                    || p[1] != g[2]
                    || p[3] != v[1]
                    || g[3] != v[3]
                {
                    return Err(format!(
                        "probs {}, gradient {} and v {} do not match",
                        ins[0].shape, ins[1].shape, ins[2].shape
                    ));
                }
                Ok(ins[0].clone())
            }
            Op::AttnGradQ => {
                same_float_dtype(ins)?;
                let (ds, k) = (ins[0].shape.dims(), ins[1].shape.dims());
                if ds.len() != 4 || k.len() != 4 || ds[3] != k[1] || k[2] == 0 || ds[1] % k[2] != 0 {
                    return Err(format!(
                        "score gradient {} and k {} do not match",
                        ins[0].shape, ins[1].shape
                    ));
                }
                Ok(TensorType::new(ins[0].dtype, [ds[0], ds[2], ds[1], k[3]]))
            }
            Op::AttnGradK { kv_heads } => {
                same_float_dtype(ins)?;
                let (ds, q) = (ins[0].shape.dims(), ins[1].shape.dims());
                if ds.len() != 4
                    || q.len() != 4
                    || ds[2] != q[1]
                    || ds[1] != q[2]
                    || *kv_heads == 0
                    || ds[1] % kv_heads != 0
                {
                    return Err(format!(
                        "score gradient {} and q {} do not match ({kv_heads} kv heads)",
                        ins[0].shape, ins[1].shape
                    ));
                }
                Ok(TensorType::new(ins[0].dtype, [ds[0], ds[3], *kv_heads, q[3]]))
            }
            Op::SiluGrad | Op::GeluGrad | Op::GeluErfGrad | Op::ReluGrad | Op::SigmoidGrad | Op::SoftmaxGrad { .. } => {
                same_float_dtype(ins)?;
                if ins[0].shape != ins[1].shape {
                    return Err(format!("shapes {} and {} must be equal", ins[0].shape, ins[1].shape));
                }
                if let Op::SoftmaxGrad { dim } = self {
                    check_dim(*dim, ins[0])?;
                }
                Ok(ins[0].clone())
            }
            Op::CrossEntropyGrad | Op::VocabCrossEntropyGrad { .. } => {
                infer_cross_entropy(ins[0], ins[1])?;
                float(ins[2], "gradient")?;
                if ins[2].shape.rank() != 0 {
                    return Err(format!("gradient of the loss must be a scalar, got {}", ins[2].shape));
                }
                Ok(ins[0].clone())
            }
            Op::Pad { dim, before, after } => {
                check_dim(*dim, ins[0])?;
                let mut dims = ins[0].shape.dims().to_vec();
                dims[*dim] = before
                    .checked_add(*after)
                    .and_then(|p| p.checked_add(dims[*dim]))
                    .ok_or_else(|| "padded size overflows u64".to_string())?;
                Ok(TensorType::new(ins[0].dtype, dims))
            }
            Op::TpAllGather { dim, degree, .. } => {
                check_dim(*dim, ins[0])?;
                let mut dims = ins[0].shape.dims().to_vec();
                dims[*dim] = dims[*dim]
                    .checked_mul(*degree)
                    .ok_or_else(|| "gathered size overflows u64".to_string())?;
                Ok(TensorType::new(ins[0].dtype, dims))
            }
            Op::TpReduceScatter { dim, degree } | Op::TpSlice { dim, degree } => {
                check_dim(*dim, ins[0])?;
                let n = ins[0].shape.dims()[*dim];
                if *degree == 0 || !n.is_multiple_of(*degree) {
                    return Err(format!(
                        "dim {dim} of {} does not split into {degree} equal chunks",
                        ins[0].shape
                    ));
                }
                let mut dims = ins[0].shape.dims().to_vec();
                dims[*dim] = n / degree;
                Ok(TensorType::new(ins[0].dtype, dims))
            }
            Op::TpAllReduce { .. } | Op::TpCopy { .. } => {
                float(ins[0], "input")?;
                Ok(ins[0].clone())
            }
            Op::CpAllGather { layout, .. } => Op::TpAllGather {
                dim: 1,
                degree: layout.degree,
                grad: TpGrad::Partial,
            }
            .infer(ins),
            Op::CpReduceScatter { layout, .. } => {
                float(ins[0], "input")?;
                let n = ins[0].shape.dims().get(1).copied().unwrap_or(0);
                let chunks = layout.balance.chunks(layout.degree);
                if !n.is_multiple_of(chunks) {
                    return Err(format!(
                        "dim 1 of {} does not split into {chunks} equal chunks",
                        ins[0].shape
                    ));
                }
                Op::TpReduceScatter {
                    dim: 1,
                    degree: layout.degree,
                }
                .infer(ins)
            }
            Op::MoeTopK { k, .. } => {
                let (t, e) = router_logits(ins[0])?;
                if *k == 0 || *k > e {
                    return Err(format!("k = {k} must be in 1..={e} (the experts of {})", ins[0].shape));
                }
                Ok(TensorType::new(DType::U32, [t, *k]))
            }
            Op::MoeRouterWeights { .. } => {
                let (t, _) = router_logits(ins[0])?;
                let k = expert_ids(ins[1], t)?;
                Ok(TensorType::new(ins[0].dtype, [t, k]))
            }
            Op::MoeRouterWeightsGrad { .. } => {
                let (t, _) = router_logits(ins[0])?;
                let k = expert_ids(ins[1], t)?;
                float(ins[2], "gradient")?;
                if ins[2].shape.dims() != [t, k] {
                    return Err(format!("gradient must be [{t}, {k}], got {}", ins[2].shape));
                }
                Ok(ins[0].clone())
            }
            Op::MoePermute => {
                float(ins[0], "input")?;
                let x = ins[0].shape.dims();
                let t = *x.first().ok_or_else(|| "input must be [tokens, dim]".to_string())?;
                let k = expert_ids(ins[1], t)?;
                let d = match x.len() {
                    2 => x[1],
                    3 if x[1] == k => x[2],
                    _ => {
                        return Err(format!(
                            "input must be [{t}, dim] or [{t}, {k}, dim], got {}",
                            ins[0].shape
                        ))
                    }
                };
                Ok(TensorType::new(ins[0].dtype, [assignments(t, k)?, d]))
            }
            Op::MoeUnpermute { sum } => {
                float(ins[0], "input")?;
                let (t, k) = routing_ids(ins[1])?;
                let y = ins[0].shape.dims();
                if y.len() != 2 || y[0] != assignments(t, k)? {
                    return Err(format!(
                        "input must be [{t} * {k}, dim] (one row per assignment), got {}",
                        ins[0].shape
                    ));
                }
                Ok(if *sum {
                    TensorType::new(ins[0].dtype, [t, y[1]])
                } else {
                    TensorType::new(ins[0].dtype, [t, k, y[1]])
                })
            }
            Op::MoeDrop { experts, capacity } => {
                let (t, k) = routing_ids(ins[0])?;
                if *experts == 0 || *capacity == 0 {
                    return Err(format!(
                        "experts ({experts}) and capacity ({capacity}) must be at least 1"
                    ));
                }
                Ok(TensorType::new(DType::U32, [t, k]))
            }
            Op::MoeGatherIds { degree } => {
                let (t, k) = routing_ids(ins[0])?;
                let all = t
                    .checked_mul(*degree)
                    .ok_or_else(|| "gathered size overflows u64".to_string())?;
                Ok(TensorType::new(DType::U32, [all, k]))
            }
            Op::MoeDispatch { degree, experts, rows } => {
                float(ins[0], "input")?;
                let (t, k) = routing_table(ins[1], *degree, *experts)?;
                let x = ins[0].shape.dims();
                if x.len() != 2 || x[0] != assignments(t, k)? {
                    return Err(format!(
                        "input must be [{t} * {k}, dim] (this rank's assignments in expert order), got {}",
                        ins[0].shape
                    ));
                }
                Ok(TensorType::new(ins[0].dtype, [*rows, x[1]]))
            }
            Op::MoeCombine { degree, experts } => {
                float(ins[0], "input")?;
                let (t, k) = routing_table(ins[1], *degree, *experts)?;
                match ins[0].shape.dims() {
                    [_, d] => Ok(TensorType::new(ins[0].dtype, [assignments(t, k)?, *d])),
                    _ => Err(format!("input must be [rows, dim], got {}", ins[0].shape)),
                }
            }
            Op::MoeLocalIds { degree, experts, rows } => {
                routing_table(ins[0], *degree, *experts)?;
                Ok(TensorType::new(DType::U32, [*rows, 1]))
            }
            Op::GroupedLinear { layout } => {
                if ins.len() < 3 {
                    return Err("expects the input, the expert ids and at least one weight".into());
                }
                let (t, k) = routing_ids(ins[1])?;
                let x = ins[0];
                if x.shape.rank() != 2 || x.shape.dims()[0] != assignments(t, k)? {
                    return Err(format!(
                        "input must be [{t} * {k}, in] (one row per assignment), got {}",
                        x.shape
                    ));
                }
                let w0 = ins[2];
                if ins[3..].iter().any(|w| w.shape != w0.shape || w.dtype != w0.dtype) {
                    return Err("every expert's weight must have the same type".into());
                }
                infer_linear(*layout, &[x, w0])
            }
            Op::GroupedWeightGrad {
                expert,
                experts,
                layout,
            } => {
                if expert >= experts {
                    return Err(format!("expert {expert} is out of range ({experts} experts)"));
                }
                let (t, k) = routing_ids(ins[2])?;
                let n = assignments(t, k)?;
                if ins[0].shape.rank() != 2 || ins[0].shape.dims()[0] != n {
                    return Err(format!("input must be [{n}, in], got {}", ins[0].shape));
                }
                infer_weight_grad(*layout, ins[0], ins[1])
            }
            Op::MoeAuxLoss { top_k, .. } => {
                let (t, e) = router_logits(ins[0])?;
                for l in ins {
                    if l.shape.dims() != [t, e] {
                        return Err(format!(
                            "every layer's logits must be [{t}, {e}] like the first, got {}",
                            l.shape
                        ));
                    }
                    float(l, "logits")?;
                }
                if *top_k == 0 || *top_k > e {
                    return Err(format!("top_k = {top_k} must be in 1..={e}"));
                }
                let dtype = if ins[0].dtype == DType::F64 {
                    DType::F64
                } else {
                    DType::F32
                };
                Ok(TensorType::new(dtype, Shape::scalar()))
            }
            Op::MoeAuxLossGrad { layer, top_k, coef } => {
                float(ins[0], "gradient")?;
                if ins[0].shape.rank() != 0 {
                    return Err(format!("gradient of the loss must be a scalar, got {}", ins[0].shape));
                }
                Op::MoeAuxLoss {
                    top_k: *top_k,
                    coef: *coef,
                }
                .infer(&ins[1..])?;
                ins.get(1 + layer)
                    .map(|t| (*t).clone())
                    .ok_or_else(|| format!("layer {layer} is out of range ({} layers)", ins.len() - 1))
            }
        }
    }

    /// True for the ops that only a backward pass contains.
    pub fn is_backward_only(&self) -> bool {
        matches!(
            self,
            Op::Fill { .. }
                | Op::SumTo { .. }
                | Op::BroadcastTo { .. }
                | Op::WeightGrad { .. }
                | Op::EmbeddingGrad { .. }
                | Op::RmsNormGrad { .. }
                | Op::LayerNormGrad { .. }
                | Op::RopeGrad { .. }
                | Op::AttnProbs { .. }
                | Op::AttnGradV { .. }
                | Op::AttnGradScores
                | Op::AttnGradQ
                | Op::AttnGradK { .. }
                | Op::SiluGrad
                | Op::GeluGrad
                | Op::GeluErfGrad
                | Op::ReluGrad
                | Op::SigmoidGrad
                | Op::SoftmaxGrad { .. }
                | Op::CrossEntropyGrad
                | Op::Pad { .. }
                | Op::VocabEmbeddingGrad { .. }
                | Op::VocabCrossEntropyGrad { .. }
                | Op::MoeRouterWeightsGrad { .. }
                | Op::GroupedWeightGrad { .. }
                | Op::MoeAuxLossGrad { .. }
                | Op::CpReduceScatter { .. }
        )
    }

    /// True for the ops that exchange data within the expert-parallel group.
    pub fn is_expert_collective(&self) -> bool {
        matches!(
            self,
            Op::MoeGatherIds { .. } | Op::MoeDispatch { .. } | Op::MoeCombine { .. }
        )
    }

    /// True for the ops that exchange data within the context-parallel group.
    pub fn is_context_collective(&self) -> bool {
        matches!(self, Op::CpAllGather { .. } | Op::CpReduceScatter { .. })
    }

    /// The context layout an op's rows follow, for the ops that read it.
    pub fn context(&self) -> Option<ContextLayout> {
        match self {
            Op::Rope { context, .. }
            | Op::RopeGrad { context, .. }
            | Op::Attention { context, .. }
            | Op::AttnProbs { context, .. } => *context,
            Op::CpAllGather { layout, .. } | Op::CpReduceScatter { layout, .. } => Some(*layout),
            _ => None,
        }
    }

    /// True for the ops that exchange data within the tensor-parallel group.
    pub fn is_tensor_collective(&self) -> bool {
        matches!(
            self,
            Op::TpAllGather { .. }
                | Op::TpReduceScatter { .. }
                | Op::TpAllReduce { .. }
                | Op::VocabCrossEntropy { .. }
                | Op::VocabCrossEntropyGrad { .. }
        )
    }
}

impl RouterScore {
    pub fn name(&self) -> &'static str {
        match self {
            RouterScore::Softmax => "softmax",
            RouterScore::Sigmoid => "sigmoid",
        }
    }
}

/// `theta=500000 scaling=...` of a rotary embedding, with its context layout.
fn rope_attrs(theta: f64, scaling: &RopeScaling, context: &Option<ContextLayout>) -> String {
    let scaling = match scaling {
        RopeScaling::Default => String::new(),
        s => format!(" scaling={s:?}"),
    };
    format!("theta={theta}{scaling}") + &context_attrs(context)
}

/// `causal` or `full`, with the context layout of a context rank's queries.
fn mask_attrs(causal: bool, context: &Option<ContextLayout>) -> String {
    if causal { "causal" } else { "full" }.to_string() + &context_attrs(context)
}

/// `cp=2 balance=head_tail rotate=allgather` of a context group's exchange.
fn ring_attrs(layout: &ContextLayout, rotate: ContextRotate) -> String {
    format!(
        "cp={} balance={} rotate={}",
        layout.degree,
        layout.balance.name(),
        rotate.name()
    )
}

/// ` cp=2 balance=head_tail` for an op over a context group; empty without.
fn context_attrs(context: &Option<ContextLayout>) -> String {
    context.map_or(String::new(), |l| {
        format!(" cp={} balance={}", l.degree, l.balance.name())
    })
}

/// `(tokens, experts)` of router logits `[T, E]`.
fn router_logits(l: &TensorType) -> Result<(u64, u64), String> {
    float(l, "logits")?;
    match l.shape.dims() {
        [t, e] if *e > 0 => Ok((*t, *e)),
        _ => Err(format!("logits must be [tokens, experts], got {}", l.shape)),
    }
}

/// `k` of expert ids `[tokens, k]` (integer, `tokens` rows).
/// `(T, k)` of expert ids `[T, k]`.
fn routing_ids(ids: &TensorType) -> Result<(u64, u64), String> {
    let t = *ids
        .shape
        .dims()
        .first()
        .ok_or_else(|| "experts must be [tokens, k]".to_string())?;
    Ok((t, expert_ids(ids, t)?))
}

fn expert_ids(ids: &TensorType, tokens: u64) -> Result<u64, String> {
    if ids.dtype.is_float() {
        return Err(format!("expert ids must be an integer tensor, got {ids}"));
    }
    match ids.shape.dims() {
        [t, k] if *t == tokens && *k > 0 => Ok(*k),
        _ => Err(format!("expert ids must be [{tokens}, k], got {}", ids.shape)),
    }
}

/// `(tokens per rank, k)` of an expert group's routing table `[degree * T, k]`, whose
/// `experts` split evenly over the `degree` ranks.
fn routing_table(table: &TensorType, degree: u64, experts: u64) -> Result<(u64, u64), String> {
    if degree == 0 || experts == 0 || !experts.is_multiple_of(degree) {
        return Err(format!(
            "{experts} experts do not split evenly over {degree} expert ranks"
        ));
    }
    let all = *table
        .shape
        .dims()
        .first()
        .ok_or_else(|| "routing table must be [ranks * tokens, k]".to_string())?;
    if !all.is_multiple_of(degree) {
        return Err(format!("routing table {} is not {degree} ranks' tables", table.shape));
    }
    let k = expert_ids(table, all)?;
    Ok((all / degree, k))
}

fn assignments(t: u64, k: u64) -> Result<u64, String> {
    t.checked_mul(k).ok_or_else(|| "tokens * k overflows u64".to_string())
}

fn infer_weight_grad(layout: WeightLayout, x: &TensorType, g: &TensorType) -> Result<TensorType, String> {
    same_float_dtype(&[x, g])?;
    let (xd, gd) = (x.shape.dims(), g.shape.dims());
    if xd.is_empty() || xd.len() != gd.len() || xd[..xd.len() - 1] != gd[..gd.len() - 1] {
        return Err(format!(
            "input {} and gradient {} must agree on all but the last dim",
            x.shape, g.shape
        ));
    }
    let (fin, fout) = (xd[xd.len() - 1], gd[gd.len() - 1]);
    let dims = match layout {
        WeightLayout::OutIn => [fout, fin],
        WeightLayout::InOut => [fin, fout],
    };
    Ok(TensorType::new(x.dtype, dims))
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn show_numel(n: Option<u64>) -> String {
    n.map_or_else(|| "overflowing".to_string(), |n| n.to_string())
}

fn float(t: &TensorType, what: &str) -> Result<(), String> {
    if t.dtype.is_float() {
        Ok(())
    } else {
        Err(format!("{what} must be a float tensor, got {t}"))
    }
}

fn same_float_dtype(ins: &[&TensorType]) -> Result<(), String> {
    for t in ins {
        float(t, "operand")?;
    }
    if ins.windows(2).any(|w| w[0].dtype != w[1].dtype) {
        let list: Vec<String> = ins.iter().map(|t| t.dtype.to_string()).collect();
        return Err(format!("operand dtypes differ ({}); insert a cast", list.join(" vs ")));
    }
    Ok(())
}

fn check_dim(dim: usize, t: &TensorType) -> Result<(), String> {
    if dim < t.shape.rank() {
        Ok(())
    } else {
        Err(format!(
            "dim {dim} is out of range for {} (rank {})",
            t.shape,
            t.shape.rank()
        ))
    }
}

fn infer_embedding(table: &TensorType, ids: &TensorType) -> Result<TensorType, String> {
    float(table, "table")?;
    if table.shape.rank() != 2 {
        return Err(format!("table must be [vocab, dim], got {}", table.shape));
    }
    if ids.dtype.is_float() {
        return Err(format!("ids must be an integer tensor, got {ids}"));
    }
    let mut dims = ids.shape.dims().to_vec();
    dims.push(table.shape.dims()[1]);
    Ok(TensorType::new(table.dtype, dims))
}

fn infer_linear(layout: WeightLayout, ins: &[&TensorType]) -> Result<TensorType, String> {
    same_float_dtype(ins)?;
    let (x, w) = (ins[0], ins[1]);
    if w.shape.rank() != 2 {
        return Err(format!("weight must be 2-D, got {}", w.shape));
    }
    let (wd_in, wd_out) = match layout {
        WeightLayout::OutIn => (w.shape.dims()[1], w.shape.dims()[0]),
        WeightLayout::InOut => (w.shape.dims()[0], w.shape.dims()[1]),
    };
    let x_in = x
        .shape
        .last()
        .ok_or_else(|| "input must have at least one dim".to_string())?;
    if x_in != wd_in {
        return Err(format!(
            "input features {x_in} (last dim of {}) do not match the weight's input features {wd_in} (weight {})",
            x.shape, w.shape
        ));
    }
    if let Some(b) = ins.get(2) {
        if b.shape.dims() != [wd_out] {
            return Err(format!("bias must be [{wd_out}], got {}", b.shape));
        }
    }
    let mut dims = x.shape.dims().to_vec();
    *dims.last_mut().expect("checked non-empty") = wd_out;
    Ok(TensorType::new(x.dtype, dims))
}

fn infer_matmul(a: &TensorType, b: &TensorType) -> Result<TensorType, String> {
    same_float_dtype(&[a, b])?;
    let (ad, bd) = (a.shape.dims(), b.shape.dims());
    if ad.len() < 2 || bd.len() < 2 {
        return Err(format!(
            "operands must be at least 2-D, got {} and {}",
            a.shape, b.shape
        ));
    }
    let (m, k) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (k2, n) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    if k != k2 {
        return Err(format!(
            "inner dims differ: {} has k={k}, {} has k={k2}",
            a.shape, b.shape
        ));
    }
    let batch_a = Shape::new(&ad[..ad.len() - 2]);
    let batch_b = Shape::new(&bd[..bd.len() - 2]);
    let batch = batch_a
        .broadcast(&batch_b)
        .ok_or_else(|| format!("batch dims {batch_a} and {batch_b} do not broadcast"))?;
    let mut dims = batch.dims().to_vec();
    dims.extend([m, n]);
    Ok(TensorType::new(a.dtype, dims))
}

fn infer_norm(ins: &[&TensorType]) -> Result<TensorType, String> {
    same_float_dtype(ins)?;
    let x = ins[0];
    let d = x
        .shape
        .last()
        .ok_or_else(|| "input must have at least one dim".to_string())?;
    for (t, what) in ins[1..].iter().zip(["weight", "bias"]) {
        if t.shape.dims() != [d] {
            return Err(format!(
                "{what} must be [{d}] to match input {}, got {}",
                x.shape, t.shape
            ));
        }
    }
    Ok(x.clone())
}

fn infer_attention(q: &TensorType, k: &TensorType, v: &TensorType) -> Result<TensorType, String> {
    same_float_dtype(&[q, k, v])?;
    for (t, what) in [(q, "q"), (k, "k"), (v, "v")] {
        if t.shape.rank() != 4 {
            return Err(format!("{what} must be [batch, seq, heads, head_dim], got {}", t.shape));
        }
    }
    let (qd, kd, vd) = (q.shape.dims(), k.shape.dims(), v.shape.dims());
    if kd != vd {
        return Err(format!("k {} and v {} must have the same shape", k.shape, v.shape));
    }
    if qd[0] != kd[0] || qd[3] != kd[3] {
        return Err(format!(
            "q {} and k {} must agree on batch and head_dim",
            q.shape, k.shape
        ));
    }
    if kd[2] == 0 || qd[2] % kd[2] != 0 {
        return Err(format!(
            "query heads {} are not a multiple of key/value heads {} (q {}, k {})",
            qd[2], kd[2], q.shape, k.shape
        ));
    }
    Ok(q.clone())
}

fn infer_cross_entropy(logits: &TensorType, targets: &TensorType) -> Result<TensorType, String> {
    float(logits, "logits")?;
    if targets.dtype.is_float() {
        return Err(format!("targets must be an integer tensor, got {targets}"));
    }
    let (ld, td) = (logits.shape.dims(), targets.shape.dims());
    if ld.len() != 2 || td.len() != 1 || ld[0] != td[0] {
        return Err(format!(
            "logits must be [n, vocab] and targets [n], got logits {} and targets {}",
            logits.shape, targets.shape
        ));
    }
    let dtype = if logits.dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    Ok(TensorType::new(dtype, Shape::scalar()))
}

fn infer_concat(dim: usize, ins: &[&TensorType]) -> Result<TensorType, String> {
    let first = ins[0];
    check_dim(dim, first)?;
    let mut total: u64 = 0;
    for t in ins {
        if t.dtype != first.dtype {
            return Err(format!("operand dtypes differ ({} vs {})", first.dtype, t.dtype));
        }
        let same_rest = t.shape.rank() == first.shape.rank()
            && t.shape
                .dims()
                .iter()
                .zip(first.shape.dims())
                .enumerate()
                .all(|(i, (a, b))| i == dim || a == b);
        if !same_rest {
            return Err(format!(
                "{} and {} differ outside concat dim {dim}",
                first.shape, t.shape
            ));
        }
        total = total
            .checked_add(t.shape.dims()[dim])
            .ok_or_else(|| "concatenated size overflows u64".to_string())?;
    }
    let mut dims = first.shape.dims().to_vec();
    dims[dim] = total;
    Ok(TensorType::new(first.dtype, dims))
}
