//! GPT-2 with HF names (`transformer.h.3.attn.c_attn.weight`, Conv1D `[in, out]` weights)
//! and HF module paths without the `transformer.` prefix (`h.3.attn`).

use crate::tracer::Tracer;
use crate::Gpt2Config;
use shardplan_ir::{DType, IrError, ModuleKind, NodeId, Op, ScopeId, WeightLayout};

fn layer_norm(t: &mut Tracer, scope: ScopeId, x: NodeId, prefix: &str, d: u64, eps: f64) -> Result<NodeId, IrError> {
    let w = t.param(scope, &format!("{prefix}.weight"), &[d])?;
    let b = t.param(scope, &format!("{prefix}.bias"), &[d])?;
    let w = t.tp_replicated(scope, w)?;
    let b = t.tp_replicated(scope, b)?;
    t.op(scope, Op::LayerNorm { eps }, &[x, w, b])
}

/// Builds the model, or with tensor parallelism one tensor rank's program of it: the
/// fused q/k/v projection split per head (each rank its heads' q, k and v columns),
/// `c_fc` column-wise, both `c_proj` row-wise, the tied embedding and head split by
/// vocabulary when it divides.
pub(crate) fn build(t: &mut Tracer, c: &Gpt2Config, batch: u64, seq: u64) -> Result<(), IrError> {
    let n = t.tp.degree;
    let (d, hd) = (c.dim, c.dim / c.n_heads);
    // This tensor rank's heads and width (all of them without tensor parallelism).
    let (heads, width) = (c.n_heads / n, d / n);
    let split_vocab = t.tp.is_parallel() && c.vocab_size.is_multiple_of(n);
    let tokens = t.input("tokens", DType::U32, &[batch, seq])?;
    let targets = t.input("targets", DType::U32, &[batch * seq])?;
    let root = t.g.root();

    let wte_scope = t.scope(root, "wte", ModuleKind::Embedding);
    let (wte, tok) = if split_vocab {
        let wte = t.split_param(wte_scope, "transformer.wte.weight", &[c.vocab_size / n, d], 0, 1)?;
        let tok = t.op(wte_scope, Op::VocabEmbedding { degree: n }, &[wte, tokens])?;
        (wte, t.tp_exit(wte_scope, tok)?)
    } else {
        let wte = t.param(wte_scope, "transformer.wte.weight", &[c.vocab_size, d])?;
        (wte, t.op(wte_scope, Op::Embedding, &[wte, tokens])?)
    };
    let wpe_scope = t.scope(root, "wpe", ModuleKind::Embedding);
    let wpe = t.param(wpe_scope, "transformer.wpe.weight", &[c.max_seq_len, d])?;
    let pos = t.op(
        wpe_scope,
        Op::Narrow {
            dim: 0,
            start: 0,
            len: seq,
        },
        &[wpe],
    )?;
    // Under sequence parallelism the block inputs are sequence chunks: the positions'
    // rows of this rank's chunk, and the tokens' too when the table is whole.
    let sp = t.sequence_parallel();
    let pos = if sp {
        t.tp_op(wpe_scope, |degree| Op::TpSlice { dim: 0, degree }, pos)?
    } else {
        pos
    };
    let tok = if sp && !split_vocab {
        t.tp_op(wte_scope, |degree| Op::TpSlice { dim: 1, degree }, tok)?
    } else {
        tok
    };
    let mut x = t.op(root, Op::Add, &[tok, pos])?;

    for i in 0..c.n_layers {
        let block = t.scope(root, &format!("h.{i}"), ModuleKind::Block);
        let p = format!("transformer.h.{i}");

        let ln = t.scope(block, "ln_1", ModuleKind::Norm);
        let h = layer_norm(t, ln, x, &format!("{p}.ln_1"), d, c.norm_eps)?;
        let attn = t.scope(block, "attn", ModuleKind::Attention);
        let h = t.tp_enter(attn, h)?;
        let qkv = t.col_linear(
            attn,
            h,
            &format!("{p}.attn.c_attn"),
            [d, 3 * d],
            WeightLayout::InOut,
            true,
            3,
        )?;
        let mut qkv_heads = Vec::with_capacity(3);
        for j in 0..3 {
            let part = t.op(
                attn,
                Op::Narrow {
                    dim: 2,
                    start: j * width,
                    len: width,
                },
                &[qkv],
            )?;
            qkv_heads.push(t.reshape(attn, part, &[batch, seq, heads, hd])?);
        }
        let a = t.op(
            attn,
            Op::Attention {
                causal: true,
                context: None,
            },
            &qkv_heads,
        )?;
        let a = t.reshape(attn, a, &[batch, seq, width])?;
        let o = t.row_linear(attn, a, &format!("{p}.attn.c_proj"), [d, d], WeightLayout::InOut, true)?;
        x = t.op(block, Op::Add, &[x, o])?;

        let ln = t.scope(block, "ln_2", ModuleKind::Norm);
        let h = layer_norm(t, ln, x, &format!("{p}.ln_2"), d, c.norm_eps)?;
        let mlp = t.scope(block, "mlp", ModuleKind::Mlp);
        let h = t.tp_enter(mlp, h)?;
        let f = t.col_linear(
            mlp,
            h,
            &format!("{p}.mlp.c_fc"),
            [d, c.ffn_dim],
            WeightLayout::InOut,
            true,
            1,
        )?;
        let f = t.op(mlp, c.activation.map_or(Op::Gelu, |a| a.op()), &[f])?;
        let o = t.row_linear(
            mlp,
            f,
            &format!("{p}.mlp.c_proj"),
            [c.ffn_dim, d],
            WeightLayout::InOut,
            true,
        )?;
        x = t.op(block, Op::Add, &[x, o])?;
    }

    let ln = t.scope(root, "ln_f", ModuleKind::Norm);
    let x = layer_norm(t, ln, x, "transformer.ln_f", d, c.norm_eps)?;
    // The head is tied to the token embedding, as in GPT2LMHeadModel: no parameter of its own.
    let head = t.scope(root, "lm_head", ModuleKind::Head);
    let x = crate::llama::head_input(t, head, x, split_vocab)?;
    let logits = t.op(
        head,
        Op::Linear {
            bias: false,
            layout: WeightLayout::OutIn,
            float8: None,
        },
        &[x, wte],
    )?;
    crate::llama::tp_loss(t, head, logits, targets, split_vocab)?;
    Ok(())
}
