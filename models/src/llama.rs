//! The Llama family (Llama 2/3, Mistral, Qwen2), with HF parameter names and torchtitan
//! module paths (`layers.3.attention`, `layers.3.feed_forward`).

use crate::trace::Tracer;
use crate::LlamaConfig;
use shardplan_ir::{DType, IrError, ModuleKind, Op, WeightLayout};

pub(crate) fn build(t: &mut Tracer, c: &LlamaConfig, batch: u64, seq: u64) -> Result<(), IrError> {
    let (d, hd) = (c.dim, c.head_dim());
    let (q_width, kv_width) = (c.n_heads * hd, c.n_kv_heads * hd);
    let tokens = t.input("tokens", DType::U32, &[batch, seq])?;
    let targets = t.input("targets", DType::U32, &[batch * seq])?;
    let root = t.g.root();

    let emb_scope = t.scope(root, "tok_embeddings", ModuleKind::Embedding);
    let table = t.param(emb_scope, "model.embed_tokens.weight", &[c.vocab_size, d])?;
    let mut x = t.op(emb_scope, Op::Embedding, &[table, tokens])?;

    for i in 0..c.n_layers {
        let block = t.scope(root, &format!("layers.{i}"), ModuleKind::Block);
        let p = format!("model.layers.{i}");

        let norm = t.scope(block, "attention_norm", ModuleKind::Norm);
        let w = t.param(norm, &format!("{p}.input_layernorm.weight"), &[d])?;
        let h = t.op(norm, Op::RmsNorm { eps: c.norm_eps }, &[x, w])?;

        let attn = t.scope(block, "attention", ModuleKind::Attention);
        let sa = format!("{p}.self_attn");
        let mut heads = Vec::with_capacity(3);
        for (proj, width, n) in [
            ("q_proj", q_width, c.n_heads),
            ("k_proj", kv_width, c.n_kv_heads),
            ("v_proj", kv_width, c.n_kv_heads),
        ] {
            let y = t.linear(
                attn,
                h,
                &format!("{sa}.{proj}"),
                [width, d],
                WeightLayout::OutIn,
                c.qkv_bias,
            )?;
            heads.push(t.reshape(attn, y, &[batch, seq, n, hd])?);
        }
        let q = t.op(
            attn,
            Op::Rope {
                theta: c.rope_theta,
                scaling: c.rope_scaling,
            },
            &[heads[0]],
        )?;
        let k = t.op(
            attn,
            Op::Rope {
                theta: c.rope_theta,
                scaling: c.rope_scaling,
            },
            &[heads[1]],
        )?;
        let a = t.op(attn, Op::Attention { causal: true }, &[q, k, heads[2]])?;
        let a = t.reshape(attn, a, &[batch, seq, q_width])?;
        let o = t.linear(
            attn,
            a,
            &format!("{sa}.o_proj"),
            [d, q_width],
            WeightLayout::OutIn,
            false,
        )?;
        x = t.op(block, Op::Add, &[x, o])?;

        let norm = t.scope(block, "ffn_norm", ModuleKind::Norm);
        let w = t.param(norm, &format!("{p}.post_attention_layernorm.weight"), &[d])?;
        let h = t.op(norm, Op::RmsNorm { eps: c.norm_eps }, &[x, w])?;

        let ff = t.scope(block, "feed_forward", ModuleKind::Mlp);
        let mlp = format!("{p}.mlp");
        let gate = t.linear(
            ff,
            h,
            &format!("{mlp}.gate_proj"),
            [c.ffn_dim, d],
            WeightLayout::OutIn,
            false,
        )?;
        let up = t.linear(
            ff,
            h,
            &format!("{mlp}.up_proj"),
            [c.ffn_dim, d],
            WeightLayout::OutIn,
            false,
        )?;
        let gate = t.op(ff, c.activation.map_or(Op::Silu, |a| a.op()), &[gate])?;
        let m = t.op(ff, Op::Mul, &[gate, up])?;
        let down = t.linear(
            ff,
            m,
            &format!("{mlp}.down_proj"),
            [d, c.ffn_dim],
            WeightLayout::OutIn,
            false,
        )?;
        x = t.op(block, Op::Add, &[x, down])?;
    }

    let norm = t.scope(root, "norm", ModuleKind::Norm);
    let w = t.param(norm, "model.norm.weight", &[d])?;
    let x = t.op(norm, Op::RmsNorm { eps: c.norm_eps }, &[x, w])?;

    let head = t.scope(root, "output", ModuleKind::Head);
    let logits = if c.tie_embeddings {
        t.op(
            head,
            Op::Linear {
                bias: false,
                layout: WeightLayout::OutIn,
            },
            &[x, table],
        )?
    } else {
        t.linear(head, x, "lm_head", [c.vocab_size, d], WeightLayout::OutIn, false)?
    };
    t.loss(logits, targets)?;
    Ok(())
}
