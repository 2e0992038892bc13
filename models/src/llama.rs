//! The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3), with HF parameter names and torchtitan
//! module paths (`layers.3.attention`, `layers.3.feed_forward`).

use crate::tracer::Tracer;
use crate::LlamaConfig;
use shardplan_ir::{DType, IrError, ModuleKind, NodeId, Op, ScopeId, TpGrad, WeightLayout};

mod moe;

/// The sizes one tensor rank's blocks work in.
struct Dims {
    batch: u64,
    seq: u64,
    /// The model width.
    d: u64,
    head_dim: u64,
    /// Query and key/value heads this tensor rank holds (all of them without tensor
    /// parallelism).
    heads: u64,
    kv_heads: u64,
    /// The whole query and key/value projections' widths.
    q_width: u64,
    kv_width: u64,
}

impl Dims {
    fn new(c: &LlamaConfig, tp_degree: u64, batch: u64, seq: u64) -> Self {
        let hd = c.head_dim();
        Dims {
            batch,
            seq,
            d: c.dim,
            head_dim: hd,
            heads: c.n_heads / tp_degree,
            kv_heads: c.n_kv_heads / tp_degree,
            q_width: c.n_heads * hd,
            kv_width: c.n_kv_heads * hd,
        }
    }
}

/// Builds the model, or with tensor parallelism one tensor rank's program of it
/// (torchtitan's Llama plan: q/k/v and w1/w3 column-wise, the attention output and w2
/// row-wise, the embedding and output split by vocabulary when it divides).
pub(crate) fn build(t: &mut Tracer, c: &LlamaConfig, batch: u64, seq: u64) -> Result<(), IrError> {
    let dims = Dims::new(c, t.tp.degree, batch, seq);
    let split_vocab = t.tp.is_parallel() && c.vocab_size.is_multiple_of(t.tp.degree);
    let tokens = t.input("tokens", DType::U32, &[batch, seq])?;
    let targets = t.input("targets", DType::U32, &[batch * seq])?;
    let root = t.g.root();

    let emb_scope = t.scope(root, "tok_embeddings", ModuleKind::Embedding);
    let (table, mut x) = embed(
        t,
        emb_scope,
        "model.embed_tokens.weight",
        [c.vocab_size, c.dim],
        tokens,
        split_vocab,
    )?;

    // Every MoE layer's router logits (f32), for the load-balancing loss.
    let mut router_logits = Vec::new();
    for i in 0..c.n_layers {
        x = block(t, c, &dims, i, x, &mut router_logits)?;
    }

    if let Some(m) = c
        .moe
        .as_ref()
        .filter(|m| m.aux_loss_coef > 0.0 && !router_logits.is_empty())
    {
        let op = Op::MoeAuxLoss {
            top_k: m.top_k,
            coef: m.aux_loss_coef,
        };
        t.aux_loss = Some((op, router_logits));
    }
    output(t, c, x, table, targets, split_vocab)
}

/// Block `i` (`layers.{i}`): attention and feed-forward, each behind its RMSNorm and added
/// to the residual stream `x`; returns the new stream. An MoE layer's router logits join
/// `router_logits`.
fn block(
    t: &mut Tracer,
    c: &LlamaConfig,
    dims: &Dims,
    i: u64,
    x: NodeId,
    router_logits: &mut Vec<NodeId>,
) -> Result<NodeId, IrError> {
    let root = t.g.root();
    let block = t.scope(root, &format!("layers.{i}"), ModuleKind::Block);
    let p = format!("model.layers.{i}");

    let norm = t.scope(block, "attention_norm", ModuleKind::Norm);
    let h = rms_norm(t, norm, x, &format!("{p}.input_layernorm.weight"), c.dim, c.norm_eps)?;
    let o = attention(t, c, dims, block, h, &format!("{p}.self_attn"))?;
    let x = t.op(block, Op::Add, &[x, o])?;

    let norm = t.scope(block, "ffn_norm", ModuleKind::Norm);
    let h = rms_norm(
        t,
        norm,
        x,
        &format!("{p}.post_attention_layernorm.weight"),
        c.dim,
        c.norm_eps,
    )?;

    let ff = t.scope(block, "feed_forward", ModuleKind::Mlp);
    let y = match c.moe.as_ref().filter(|m| m.is_moe_layer(i)) {
        Some(m) => {
            let (y, logits) = moe::moe_ffn(t, ff, c, m, h, &p, [dims.batch, dims.seq])?;
            router_logits.push(logits);
            y
        }
        None => dense_ffn(t, ff, c, h, &format!("{p}.mlp"))?,
    };
    t.op(block, Op::Add, &[x, y])
}

/// The attention of a block (scope `attention`, parameters under `sa`, HF's
/// `model.layers.{i}.self_attn`) on its normed input `h`: q/k/v projections, Qwen3's
/// per-head norms, rotary, causal attention and the output projection.
fn attention(
    t: &mut Tracer,
    c: &LlamaConfig,
    dims: &Dims,
    block: ScopeId,
    h: NodeId,
    sa: &str,
) -> Result<NodeId, IrError> {
    let Dims {
        batch, seq, head_dim, ..
    } = *dims;
    let attn = t.scope(block, "attention", ModuleKind::Attention);
    let h = t.tp_enter(attn, h)?;
    let [q, k, v] = qkv_heads(t, c, dims, attn, h, sa)?;
    let context = t.cp.layout();
    let rope = || Op::Rope {
        theta: c.rope_theta,
        scaling: c.rope_scaling,
        context,
    };
    let q = t.op(attn, rope(), &[q])?;
    let mut k = t.op(attn, rope(), &[k])?;
    let mut v = v;
    if let Some(layout) = context {
        // Ring attention: every context rank's keys and values, in position order.
        let rotate = t.cp.rotate;
        let gather = || Op::CpAllGather { layout, rotate };
        k = t.op(attn, gather(), &[k])?;
        v = t.op(attn, gather(), &[v])?;
    }
    let a = t.op(attn, Op::Attention { causal: true, context }, &[q, k, v])?;
    let a = t.reshape(attn, a, &[batch, seq, dims.heads * head_dim])?;
    t.row_linear(
        attn,
        a,
        &format!("{sa}.o_proj"),
        [dims.d, dims.q_width],
        WeightLayout::OutIn,
        false,
    )
}

/// The queries, keys and values of `h` as `[batch, seq, heads, head_dim]` (this tensor
/// rank's heads), the queries and keys normed per head under `qk_norm` (Qwen3).
fn qkv_heads(
    t: &mut Tracer,
    c: &LlamaConfig,
    dims: &Dims,
    attn: ScopeId,
    h: NodeId,
    sa: &str,
) -> Result<[NodeId; 3], IrError> {
    let Dims {
        batch,
        seq,
        d,
        head_dim: hd,
        ..
    } = *dims;
    let mut qkv = [h; 3];
    for (i, (proj, width, n)) in [
        ("q_proj", dims.q_width, dims.heads),
        ("k_proj", dims.kv_width, dims.kv_heads),
        ("v_proj", dims.kv_width, dims.kv_heads),
    ]
    .into_iter()
    .enumerate()
    {
        let y = t.col_linear(
            attn,
            h,
            &format!("{sa}.{proj}"),
            [width, d],
            WeightLayout::OutIn,
            c.qkv_bias,
            1,
        )?;
        qkv[i] = t.reshape(attn, y, &[batch, seq, n, hd])?;
    }
    if c.qk_norm {
        // Qwen3: each head's queries and keys normalised over head_dim before rotary.
        for (i, name) in [(0, "q_norm"), (1, "k_norm")] {
            let norm = t.scope(attn, name, ModuleKind::Norm);
            qkv[i] = head_norm(t, norm, qkv[i], &format!("{sa}.{name}.weight"), hd, c.norm_eps)?;
        }
    }
    Ok(qkv)
}

/// The dense SwiGLU feed-forward of a block (scope `ff`, parameters under `mlp`, HF's
/// `model.layers.{i}.mlp`): gate and up projections column-wise, down row-wise.
fn dense_ffn(t: &mut Tracer, ff: ScopeId, c: &LlamaConfig, h: NodeId, mlp: &str) -> Result<NodeId, IrError> {
    let d = c.dim;
    let h = t.tp_enter(ff, h)?;
    let gate = t.col_linear(
        ff,
        h,
        &format!("{mlp}.gate_proj"),
        [c.ffn_dim, d],
        WeightLayout::OutIn,
        false,
        1,
    )?;
    let up = t.col_linear(
        ff,
        h,
        &format!("{mlp}.up_proj"),
        [c.ffn_dim, d],
        WeightLayout::OutIn,
        false,
        1,
    )?;
    let gate = t.op(ff, c.activation.map_or(Op::Silu, |a| a.op()), &[gate])?;
    let m = t.op(ff, Op::Mul, &[gate, up])?;
    t.row_linear(
        ff,
        m,
        &format!("{mlp}.down_proj"),
        [d, c.ffn_dim],
        WeightLayout::OutIn,
        false,
    )
}

/// The final norm, the output projection (tied to the embedding `table`, split by
/// vocabulary, or whole) and the loss against `targets`.
fn output(
    t: &mut Tracer,
    c: &LlamaConfig,
    x: NodeId,
    table: NodeId,
    targets: NodeId,
    split_vocab: bool,
) -> Result<(), IrError> {
    let (d, root) = (c.dim, t.g.root());
    let norm = t.scope(root, "norm", ModuleKind::Norm);
    let x = rms_norm(t, norm, x, "model.norm.weight", d, c.norm_eps)?;

    let head = t.scope(root, "output", ModuleKind::Head);
    let x = head_input(t, head, x, split_vocab)?;
    let logits = if c.tie_embeddings {
        t.op(
            head,
            Op::Linear {
                bias: false,
                layout: WeightLayout::OutIn,
                float8: None,
            },
            &[x, table],
        )?
    } else if split_vocab {
        t.col_linear(head, x, "lm_head", [c.vocab_size, d], WeightLayout::OutIn, false, 1)?
    } else {
        t.linear(head, x, "lm_head", [c.vocab_size, d], WeightLayout::OutIn, false)?
    };
    tp_loss(t, head, logits, targets, split_vocab)?;
    Ok(())
}

/// `x * rsqrt(mean(x^2) + eps) * w`, the weight read through `tp_copy` under sequence
/// parallelism.
fn rms_norm(t: &mut Tracer, scope: ScopeId, x: NodeId, name: &str, d: u64, eps: f64) -> Result<NodeId, IrError> {
    let w = t.param(scope, name, &[d])?;
    let w = t.tp_replicated(scope, w)?;
    t.op(scope, Op::RmsNorm { eps }, &[x, w])
}

/// RMSNorm over the last dim of `[b, s, heads, head_dim]` (Qwen3's q_norm / k_norm).
/// Under tensor parallelism each rank holds some of the heads, so the whole weight's
/// gradient is partial on each: it is read through `tp_copy`, whose gradient sums over the
/// group, with or without sequence parallelism.
fn head_norm(t: &mut Tracer, scope: ScopeId, x: NodeId, name: &str, hd: u64, eps: f64) -> Result<NodeId, IrError> {
    let w = t.param(scope, name, &[hd])?;
    let w = t.tp_summed(scope, w)?;
    t.op(scope, Op::RmsNorm { eps }, &[x, w])
}

/// The token embedding: its table and output. Split by vocabulary (`split_vocab`), each
/// rank looks up its rows and the partial rows leave through [`Tracer::tp_exit`]; whole,
/// under sequence parallelism each rank keeps its sequence chunk.
pub(crate) fn embed(
    t: &mut Tracer,
    scope: ScopeId,
    name: &str,
    shape: [u64; 2],
    tokens: NodeId,
    split_vocab: bool,
) -> Result<(NodeId, NodeId), IrError> {
    if split_vocab {
        let n = t.tp.degree;
        let table = t.split_param(scope, name, &[shape[0] / n, shape[1]], 0, 1)?;
        let x = t.op(scope, Op::VocabEmbedding { degree: n }, &[table, tokens])?;
        Ok((table, t.tp_exit(scope, x)?))
    } else {
        let table = t.param(scope, name, &shape)?;
        let x = t.op(scope, Op::Embedding, &[table, tokens])?;
        let x = if t.sequence_parallel() {
            t.tp_op(scope, |degree| Op::TpSlice { dim: 1, degree }, x)?
        } else {
            x
        };
        Ok((table, x))
    }
}

/// The output projection's input: under sequence parallelism gathered along the
/// sequence (its gradient partial when the projection is split by vocabulary, else the
/// same on every rank); without it, read through `tp_copy` when the projection is split.
pub(crate) fn head_input(t: &mut Tracer, scope: ScopeId, x: NodeId, split_vocab: bool) -> Result<NodeId, IrError> {
    if t.sequence_parallel() {
        let grad = if split_vocab {
            TpGrad::Partial
        } else {
            TpGrad::Replicated
        };
        t.tp_op(scope, |degree| Op::TpAllGather { dim: 1, degree, grad }, x)
    } else if split_vocab {
        t.tp_op(scope, |degree| Op::TpCopy { degree }, x)
    } else {
        Ok(x)
    }
}

/// The loss of vocabulary-split logits: vocabulary-parallel with loss parallelism, else
/// on logits gathered over the group first.
pub(crate) fn tp_loss(
    t: &mut Tracer,
    head: ScopeId,
    logits: NodeId,
    targets: NodeId,
    split_vocab: bool,
) -> Result<NodeId, IrError> {
    if !split_vocab {
        return t.loss(logits, targets);
    }
    if t.tp.loss_parallel {
        let n = t.tp.degree;
        return t.loss_split(logits, targets, Some(n));
    }
    let last = t.g.node(logits).ty.shape.rank() - 1;
    let full = t.tp_op(
        head,
        |degree| Op::TpAllGather {
            dim: last,
            degree,
            grad: TpGrad::Replicated,
        },
        logits,
    )?;
    t.loss(full, targets)
}
