//! The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3), with HF parameter names and torchtitan
//! module paths (`layers.3.attention`, `layers.3.feed_forward`).

use crate::tracer::Tracer;
use crate::{LlamaConfig, MoeConfig, MoeNames, Router};
use shardplan_ir::{DType, IrError, ModuleKind, NodeId, Op, RouterScore, ScopeId, TpGrad, WeightLayout};

/// Builds the model, or with tensor parallelism one tensor rank's program of it
/// (torchtitan's Llama plan: q/k/v and w1/w3 column-wise, the attention output and w2
/// row-wise, the embedding and output split by vocabulary when it divides).
pub(crate) fn build(t: &mut Tracer, c: &LlamaConfig, batch: u64, seq: u64) -> Result<(), IrError> {
    let n = t.tp.degree;
    let (d, hd) = (c.dim, c.head_dim());
    // Heads and widths this tensor rank holds (all of them without tensor parallelism).
    let (heads, kv_heads) = (c.n_heads / n, c.n_kv_heads / n);
    let (q_width, kv_width) = (c.n_heads * hd, c.n_kv_heads * hd);
    let split_vocab = t.tp.is_parallel() && c.vocab_size.is_multiple_of(n);
    let tokens = t.input("tokens", DType::U32, &[batch, seq])?;
    let targets = t.input("targets", DType::U32, &[batch * seq])?;
    let root = t.g.root();

    let emb_scope = t.scope(root, "tok_embeddings", ModuleKind::Embedding);
    let (table, mut x) = embed(
        t,
        emb_scope,
        "model.embed_tokens.weight",
        [c.vocab_size, d],
        tokens,
        split_vocab,
    )?;

    // Every MoE layer's router logits (f32), for the load-balancing loss.
    let mut router_logits = Vec::new();
    for i in 0..c.n_layers {
        let block = t.scope(root, &format!("layers.{i}"), ModuleKind::Block);
        let p = format!("model.layers.{i}");

        let norm = t.scope(block, "attention_norm", ModuleKind::Norm);
        let h = rms_norm(t, norm, x, &format!("{p}.input_layernorm.weight"), d, c.norm_eps)?;

        let attn = t.scope(block, "attention", ModuleKind::Attention);
        let h = t.tp_enter(attn, h)?;
        let sa = format!("{p}.self_attn");
        let mut qkv = Vec::with_capacity(3);
        for (proj, width, n) in [
            ("q_proj", q_width, heads),
            ("k_proj", kv_width, kv_heads),
            ("v_proj", kv_width, kv_heads),
        ] {
            let y = t.col_linear(
                attn,
                h,
                &format!("{sa}.{proj}"),
                [width, d],
                WeightLayout::OutIn,
                c.qkv_bias,
                1,
            )?;
            qkv.push(t.reshape(attn, y, &[batch, seq, n, hd])?);
        }
        let mut heads_in = qkv;
        if c.qk_norm {
            // Qwen3: each head's queries and keys normalised over head_dim before rotary.
            for (i, name) in [(0, "q_norm"), (1, "k_norm")] {
                let norm = t.scope(attn, name, ModuleKind::Norm);
                heads_in[i] = head_norm(t, norm, heads_in[i], &format!("{sa}.{name}.weight"), hd, c.norm_eps)?;
            }
        }
        let q = t.op(
            attn,
            Op::Rope {
                theta: c.rope_theta,
                scaling: c.rope_scaling,
            },
            &[heads_in[0]],
        )?;
        let k = t.op(
            attn,
            Op::Rope {
                theta: c.rope_theta,
                scaling: c.rope_scaling,
            },
            &[heads_in[1]],
        )?;
        let a = t.op(attn, Op::Attention { causal: true }, &[q, k, heads_in[2]])?;
        let a = t.reshape(attn, a, &[batch, seq, heads * hd])?;
        let o = t.row_linear(
            attn,
            a,
            &format!("{sa}.o_proj"),
            [d, q_width],
            WeightLayout::OutIn,
            false,
        )?;
        x = t.op(block, Op::Add, &[x, o])?;

        let norm = t.scope(block, "ffn_norm", ModuleKind::Norm);
        let h = rms_norm(
            t,
            norm,
            x,
            &format!("{p}.post_attention_layernorm.weight"),
            d,
            c.norm_eps,
        )?;

        let ff = t.scope(block, "feed_forward", ModuleKind::Mlp);
        if let Some(m) = c.moe.as_ref().filter(|m| m.is_moe_layer(i)) {
            let (y, logits) = moe_ffn(t, ff, c, m, h, &p, [batch, seq])?;
            router_logits.push(logits);
            x = t.op(block, Op::Add, &[x, y])?;
            continue;
        }
        let h = t.tp_enter(ff, h)?;
        let mlp = format!("{p}.mlp");
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
        let down = t.row_linear(
            ff,
            m,
            &format!("{mlp}.down_proj"),
            [d, c.ffn_dim],
            WeightLayout::OutIn,
            false,
        )?;
        x = t.op(block, Op::Add, &[x, down])?;
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

/// The mixture-of-experts feed-forward of one layer, as Hugging Face's Mixtral / Qwen2-MoE /
/// Qwen3-MoE sparse blocks compute it: router logits (a linear layer, then f32), each token's
/// `top_k` experts and their weights, the tokens permuted to expert order, every expert's
/// SwiGLU as grouped matmuls over its rows, the rows scaled by their weights and summed back
/// per token; plus the shared expert (behind its sigmoid gate) on every token. Returns the
/// output `[batch, seq, dim]` (under sequence parallelism this rank's sequence chunk, as
/// `h`) and the f32 router logits `[tokens, experts]` of every token.
///
/// Under tensor parallelism the experts split as the dense feed-forward does (torchtitan's
/// expert tensor parallelism at the tensor degree): each tensor rank holds a column slice of
/// every gate and up projection and a row slice of every down projection, routes every
/// token of its group the same way and sums its partial outputs with the group at
/// [`Tracer::tp_exit`]. The router runs where its input is (on the sequence chunk, its
/// logits then gathered, its weight read through `tp_copy`; or on the whole input), so its
/// logits and the routing are the same on every tensor rank; the routing weights are read
/// through `tp_copy`, whose gradient sums the partial products they meet, so the router's
/// gradient is whole on every rank, the load-balancing loss's included.
fn moe_ffn(
    t: &mut Tracer,
    ff: ScopeId,
    c: &LlamaConfig,
    m: &MoeConfig,
    h: NodeId,
    layer: &str,
    [batch, seq]: [u64; 2],
) -> Result<(NodeId, NodeId), IrError> {
    let (d, tokens, dtype) = (c.dim, batch * seq, t.dtype);
    let (prefix, [gate_name, up_name, down_name]) = match m.hf_names {
        MoeNames::Mixtral => (format!("{layer}.block_sparse_moe"), ["w1", "w3", "w2"]),
        MoeNames::Qwen => (format!("{layer}.mlp"), ["gate_proj", "up_proj", "down_proj"]),
    };
    let (tp, sp, n) = (t.tp.is_parallel(), t.sequence_parallel(), t.tp.degree);
    // Every token, `[tokens, dim]`, where `h` holds them all.
    let flat = if sp {
        None
    } else {
        Some(t.reshape(ff, h, &[tokens, d])?)
    };
    let router = ff;
    let gate_w = t.param(router, &format!("{prefix}.gate.weight"), &[m.experts, d])?;
    let gate_w = t.tp_replicated(router, gate_w)?;
    let linear = Op::Linear {
        bias: false,
        layout: WeightLayout::OutIn,
    };
    // Under sequence parallelism on this rank's chunk `[batch, seq / n, dim]`, else on every token.
    let router_in = flat.unwrap_or(h);
    let mut logits = t.op(router, linear.clone(), &[router_in, gate_w])?;
    if dtype != DType::F32 {
        logits = t.op(router, Op::Cast { dtype: DType::F32 }, &[logits])?;
    }
    if sp {
        // Every rank's logits: the same on each, so the gradient is each rank's chunk of it.
        let all = t.tp_op(
            router,
            |degree| Op::TpAllGather {
                dim: 1,
                degree,
                grad: TpGrad::Replicated,
            },
            logits,
        )?;
        logits = t.reshape(router, all, &[tokens, m.experts])?;
    }
    let score = match m.router {
        Router::SoftmaxTopk => RouterScore::Softmax,
        Router::SigmoidTopk => RouterScore::Sigmoid,
    };
    let ids = t.op(router, Op::MoeTopK { k: m.top_k, score }, &[logits])?;
    // Token dropping: each expert's assignments past its capacity leave the expert path
    // (their rows are zero); the routing weights are still the top-k's.
    let ep = t.ep;
    let routed = match ep.per_expert(tokens * m.top_k, m.experts) {
        Some(capacity) => t.op(
            router,
            Op::MoeDrop {
                experts: m.experts,
                capacity,
            },
            &[ids],
        )?,
        None => ids,
    };
    let experts = ff;
    // Under expert parallelism every rank's routing: traced for overlap, the table's
    // all-gather runs on the all-to-all stream while this rank computes its weights and
    // permutes its rows; else after them, as torchtitan orders it.
    let gather_ids = |t: &mut Tracer| t.op(experts, Op::MoeGatherIds { degree: ep.degree }, &[routed]);
    let early = ep.is_parallel() && ep.overlap;
    let mut table = if early { Some(gather_ids(t)?) } else { None };
    let mut weights = t.op(
        router,
        Op::MoeRouterWeights {
            score,
            norm: m.norm_topk_prob,
        },
        &[logits, ids],
    )?;
    if dtype != DType::F32 {
        weights = t.op(router, Op::Cast { dtype }, &[weights])?;
    }
    let weights = t.tp_summed(router, weights)?;
    // The experts' input: every token, on every tensor rank.
    let x = match flat {
        Some(x) if !tp => x,
        _ => {
            let x = t.tp_enter(ff, h)?;
            t.reshape(ff, x, &[tokens, d])?
        }
    };
    let ids = routed;
    let rows = t.op(experts, Op::MoePermute, &[x, ids])?;
    if ep.is_parallel() && !early {
        table = Some(gather_ids(t)?);
    }
    // Under expert parallelism the rows travel to the ranks holding their experts and back;
    // this rank computes its own experts over what it received.
    let per_rank = if ep.is_parallel() {
        m.experts / ep.degree
    } else {
        m.experts
    };
    let (rows, local_ids) = match table {
        Some(table) => {
            let cap = ep.rows(tokens * m.top_k, m.experts);
            let (degree, e) = (ep.degree, m.experts);
            let recv = t.op(
                experts,
                Op::MoeDispatch {
                    degree,
                    experts: e,
                    rows: cap,
                },
                &[rows, table],
            )?;
            let lids = t.op(
                experts,
                Op::MoeLocalIds {
                    degree,
                    experts: e,
                    rows: cap,
                },
                &[table],
            )?;
            (recv, lids)
        }
        None => (rows, ids),
    };
    // `shape` is this tensor rank's slice, cut along `dim` (0: the gate and up projections'
    // hidden units, 1: the down projection's). Every routed weight is made before the
    // shared expert, whatever the order of the ops (parameters keep their numbers).
    let expert_params = |t: &mut Tracer, name: &str, shape: [u64; 2], dim: usize| -> Result<Vec<NodeId>, IrError> {
        let at = prefix.len() + ".experts.".len();
        (0..per_rank)
            .map(|e| {
                let pname = format!("{prefix}.experts.{e}.{name}.weight");
                t.routed_param(experts, &pname, &shape, dim, e, per_rank, at)
            })
            .collect()
    };
    let f = m.expert_ffn_dim / n;
    let gate_ps = expert_params(t, gate_name, [f, d], 0)?;
    let up_ps = expert_params(t, up_name, [f, d], 0)?;
    let down_ps = expert_params(t, down_name, [d, f], 1)?;
    let grouped = |t: &mut Tracer, x: NodeId, weights: &[NodeId]| -> Result<NodeId, IrError> {
        let mut ins = vec![x, local_ids];
        ins.extend_from_slice(weights);
        t.op(
            experts,
            Op::GroupedLinear {
                layout: WeightLayout::OutIn,
            },
            &ins,
        )
    };
    // The shared expert's partial output, which joins the routed one's. Under expert
    // parallelism it runs while the rows travel (the compute stream does not wait for the
    // dispatch until the routed experts read what it received).
    let shared_expert = |t: &mut Tracer| -> Result<Option<NodeId>, IrError> {
        if m.shared_experts == 0 {
            return Ok(None);
        }
        // Split as a dense feed-forward.
        let shared = ff;
        let sp_name = format!("{prefix}.shared_expert");
        let fs = m.shared_expert_ffn_dim;
        let col = |t: &mut Tracer, name: &str| {
            t.col_linear(
                shared,
                x,
                &format!("{sp_name}.{name}"),
                [fs, d],
                WeightLayout::OutIn,
                false,
                1,
            )
        };
        let gate = col(t, "gate_proj")?;
        let up = col(t, "up_proj")?;
        let gate = t.op(shared, c.activation.map_or(Op::Silu, |a| a.op()), &[gate])?;
        let hidden = t.op(shared, Op::Mul, &[gate, up])?;
        let down_w = t.split_param(shared, &format!("{sp_name}.down_proj.weight"), &[d, fs / n], 1, 1)?;
        let mut out = t.op(shared, linear.clone(), &[hidden, down_w])?;
        if m.shared_expert_gate {
            // Its gradient meets the partial output: summed over the group.
            let g_w = t.param(shared, &format!("{prefix}.shared_expert_gate.weight"), &[1, d])?;
            let g_w = t.tp_summed(shared, g_w)?;
            let g = t.op(shared, linear.clone(), &[x, g_w])?;
            let g = t.op(shared, Op::Sigmoid, &[g])?;
            out = t.op(shared, Op::Mul, &[g, out])?;
        }
        Ok(Some(out))
    };
    let shared_out = if early { shared_expert(t)? } else { None };
    let gate = grouped(t, rows, &gate_ps)?;
    let up = grouped(t, rows, &up_ps)?;
    let gate = t.op(experts, c.activation.map_or(Op::Silu, |a| a.op()), &[gate])?;
    let hidden = t.op(experts, Op::Mul, &[gate, up])?;
    let mut down = grouped(t, hidden, &down_ps)?;
    if let Some(table) = table {
        down = t.op(
            experts,
            Op::MoeCombine {
                degree: ep.degree,
                experts: m.experts,
            },
            &[down, table],
        )?;
    }
    let weights = t.reshape(experts, weights, &[tokens, m.top_k, 1])?;
    let weights = t.op(experts, Op::MoePermute, &[weights, ids])?;
    let down = t.op(experts, Op::Mul, &[down, weights])?;
    let mut y = t.op(experts, Op::MoeUnpermute { sum: true }, &[down, ids])?;
    let shared_out = match shared_out {
        Some(out) => Some(out),
        None if !early => shared_expert(t)?,
        None => None,
    };
    if let Some(out) = shared_out {
        y = t.op(ff, Op::Add, &[y, out])?;
    }
    let y = t.reshape(ff, y, &[batch, seq, d])?;
    let y = t.tp_exit(ff, y)?;
    Ok((y, logits))
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
