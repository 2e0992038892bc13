//! The oracle: for tiny Llama and tiny GPT-2, every parameter gradient from the IR's
//! autodiff equals what candle's own autograd (`Var` + `backward`) computes on a forward
//! pass written here independently (plain tensor ops, no shardplan kernel). f32, tolerance:
//! |ours - candle| <= 1e-4 * max(1, max|candle|) per tensor.

use candle_core::{DType, Device, Tensor, Var, D};
use shardplan_executor::init::init_elements;
use shardplan_executor::{Ctx, Interpreter};
use shardplan_ir::{differentiate, Graph, Op};
use shardplan_models::{preset, trace, Gpt2Config, LlamaConfig, ModelConfig, TraceOptions};
use std::collections::HashMap;

const B: usize = 2;
const S: usize = 8;

type R<T> = candle_core::Result<T>;

/// Weights by HF name, from shardplan's initialisation (seed 11).
fn weights(g: &Graph) -> HashMap<String, Tensor> {
    g.params()
        .map(|(p, param)| {
            let dims: Vec<usize> = param.ty.shape.dims().iter().map(|&d| d as usize).collect();
            let n = param.ty.numel().unwrap();
            // Perturb norms away from 1 and biases from 0 so their gradients are exercised.
            let mut v = init_elements(g, p, 11, 0..n);
            for (i, x) in v.iter_mut().enumerate() {
                *x += 0.01 * ((i % 7) as f32 - 3.0);
            }
            (
                param.name.to_string(),
                Tensor::from_vec(v, dims.as_slice(), &Device::Cpu).unwrap(),
            )
        })
        .collect()
}

fn batch(vocab: u32) -> (Tensor, Tensor) {
    let toks: Vec<u32> = (0..(B * S) as u32).map(|i| (i * 37 + 5) % vocab).collect();
    let tgts: Vec<u32> = (0..(B * S) as u32).map(|i| (i * 53 + 11) % vocab).collect();
    (
        Tensor::from_vec(toks, (B, S), &Device::Cpu).unwrap(),
        Tensor::from_vec(tgts, B * S, &Device::Cpu).unwrap(),
    )
}

/// shardplan's gradients, by parameter name.
fn ours(
    cfg: &ModelConfig,
    w: &HashMap<String, Tensor>,
    tokens: &Tensor,
    targets: &Tensor,
) -> (f32, HashMap<String, Tensor>) {
    let g = trace(
        cfg,
        TraceOptions {
            batch: B as u64,
            seq_len: Some(S as u64),
            ..TraceOptions::default()
        },
    )
    .unwrap();
    let joint = differentiate(&g).unwrap();
    let mut keep = vec![joint.loss];
    let names: Vec<String> = joint
        .graph
        .params()
        .map(|(p, param)| {
            keep.push(joint.grad(p).unwrap());
            param.name.to_string()
        })
        .collect();
    let interp = Interpreter::new(joint.graph.clone(), &keep);
    let out = interp
        .run(&Ctx::new(Device::Cpu), &keep, &mut |id| {
            Ok(match &joint.graph.node(id).op {
                Op::Param { param } => w[&*joint.graph.param(*param).name].clone(),
                Op::Input { name } if name == "tokens" => tokens.clone(),
                _ => targets.clone(),
            })
        })
        .unwrap();
    let loss = out.kept[0].to_scalar::<f32>().unwrap();
    (loss, names.into_iter().zip(out.kept[1..].iter().cloned()).collect())
}

fn softmax(x: &Tensor) -> R<Tensor> {
    let e = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

fn mean_cross_entropy(logits: &Tensor, targets: &Tensor) -> R<Tensor> {
    let m = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&m)?;
    let logp = shifted.broadcast_sub(&shifted.exp()?.sum_keepdim(D::Minus1)?.log()?)?;
    let n = targets.dim(0)?;
    logp.gather(&targets.reshape((n, 1))?, 1)?
        .sum_all()?
        .affine(-1.0 / n as f64, 0.0)
}

fn causal_mask(s: usize) -> R<Tensor> {
    let m: Vec<f32> = (0..s)
        .flat_map(|i| (0..s).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Tensor::from_vec(m, (s, s), &Device::Cpu)
}

/// `q`, `k`, `v` as `[b, heads, s, d]` (k/v already repeated to all heads).
fn attention(q: &Tensor, k: &Tensor, v: &Tensor) -> R<Tensor> {
    let d = q.dim(3)?;
    let scores = (q.matmul(&k.transpose(2, 3)?)? / (d as f64).sqrt())?.broadcast_add(&causal_mask(q.dim(2)?)?)?;
    softmax(&scores)?.matmul(v)
}

fn llama_forward(c: &LlamaConfig, w: &HashMap<String, Var>, tokens: &Tensor, targets: &Tensor) -> R<Tensor> {
    let (h, kv, hd) = (c.n_heads as usize, c.n_kv_heads as usize, c.head_dim() as usize);
    let d = c.dim as usize;
    let p = |n: &str| w[n].as_tensor().clone();
    let rms = |x: &Tensor, wt: &Tensor| -> R<Tensor> {
        let r = (x.sqr()?.mean_keepdim(D::Minus1)? + c.norm_eps)?.sqrt()?.recip()?;
        x.broadcast_mul(&r)?.broadcast_mul(wt)
    };
    // Rotary tables written out here (rotate-half convention), independent of the kernels.
    let half = hd / 2;
    let ang: Vec<f32> = (0..S)
        .flat_map(|pos| {
            (0..hd).map(move |i| (pos as f64 * c.rope_theta.powf(-2.0 * (i % half) as f64 / hd as f64)) as f32)
        })
        .collect();
    let ang = Tensor::from_vec(ang, (1, 1, S, hd), &Device::Cpu)?;
    let (cos, sin) = (ang.cos()?, ang.sin()?);
    let rope = |x: &Tensor| -> R<Tensor> {
        let x1 = x.narrow(3, 0, half)?;
        let x2 = x.narrow(3, half, half)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
        x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
    };
    let repeat = |x: &Tensor| -> R<Tensor> {
        let (b, n, s, dd) = x.dims4()?;
        x.unsqueeze(2)?.expand((b, n, h / kv, s, dd))?.reshape((b, h, s, dd))
    };
    let mut x = p("model.embed_tokens.weight")
        .index_select(&tokens.flatten_all()?, 0)?
        .reshape((B, S, d))?;
    for l in 0..c.n_layers {
        let pre = format!("model.layers.{l}");
        let hn = rms(&x, &p(&format!("{pre}.input_layernorm.weight")))?;
        let proj = |name: &str, heads: usize| -> R<Tensor> {
            hn.broadcast_matmul(&p(&format!("{pre}.self_attn.{name}.weight")).t()?)?
                .reshape((B, S, heads, hd))?
                .transpose(1, 2)
        };
        let q = rope(&proj("q_proj", h)?.contiguous()?)?;
        let k = repeat(&rope(&proj("k_proj", kv)?.contiguous()?)?)?;
        let v = repeat(&proj("v_proj", kv)?.contiguous()?)?;
        let a = attention(&q, &k, &v)?.transpose(1, 2)?.reshape((B, S, h * hd))?;
        x = (x + a.broadcast_matmul(&p(&format!("{pre}.self_attn.o_proj.weight")).t()?)?)?;
        let hn = rms(&x, &p(&format!("{pre}.post_attention_layernorm.weight")))?;
        let gate = hn.broadcast_matmul(&p(&format!("{pre}.mlp.gate_proj.weight")).t()?)?;
        let up = hn.broadcast_matmul(&p(&format!("{pre}.mlp.up_proj.weight")).t()?)?;
        let silu = (&gate * (gate.neg()?.exp()? + 1.0)?.recip()?)?;
        x = (x + (silu * up)?.broadcast_matmul(&p(&format!("{pre}.mlp.down_proj.weight")).t()?)?)?;
    }
    let x = rms(&x, &p("model.norm.weight"))?;
    let logits = x
        .broadcast_matmul(&p("lm_head.weight").t()?)?
        .reshape((B * S, c.vocab_size as usize))?;
    mean_cross_entropy(&logits, targets)
}

fn gpt2_forward(c: &Gpt2Config, w: &HashMap<String, Var>, tokens: &Tensor, targets: &Tensor) -> R<Tensor> {
    let (d, h) = (c.dim as usize, c.n_heads as usize);
    let hd = d / h;
    let p = |n: &str| w[n].as_tensor().clone();
    let ln = |x: &Tensor, pre: &str| -> R<Tensor> {
        let mu = x.mean_keepdim(D::Minus1)?;
        let xc = x.broadcast_sub(&mu)?;
        let r = (xc.sqr()?.mean_keepdim(D::Minus1)? + c.norm_eps)?.sqrt()?.recip()?;
        xc.broadcast_mul(&r)?
            .broadcast_mul(&p(&format!("{pre}.weight")))?
            .broadcast_add(&p(&format!("{pre}.bias")))
    };
    let conv1d = |x: &Tensor, pre: &str| -> R<Tensor> {
        x.broadcast_matmul(&p(&format!("{pre}.weight")))?
            .broadcast_add(&p(&format!("{pre}.bias")))
    };
    let gelu = |x: &Tensor| -> R<Tensor> {
        let inner = ((x + (x.powf(3.0)? * 0.044715)?)? * (2.0 / std::f64::consts::PI).sqrt())?;
        x * ((inner.tanh()? + 1.0)? * 0.5)?
    };
    let wte = p("transformer.wte.weight");
    let mut x = wte
        .index_select(&tokens.flatten_all()?, 0)?
        .reshape((B, S, d))?
        .broadcast_add(&p("transformer.wpe.weight").narrow(0, 0, S)?)?;
    for l in 0..c.n_layers {
        let pre = format!("transformer.h.{l}");
        let qkv = conv1d(&ln(&x, &format!("{pre}.ln_1"))?, &format!("{pre}.attn.c_attn"))?;
        let split = |i: usize| -> R<Tensor> {
            qkv.narrow(2, i * d, d)?
                .reshape((B, S, h, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let a = attention(&split(0)?, &split(1)?, &split(2)?)?
            .transpose(1, 2)?
            .reshape((B, S, d))?;
        x = (x + conv1d(&a, &format!("{pre}.attn.c_proj"))?)?;
        let f = gelu(&conv1d(&ln(&x, &format!("{pre}.ln_2"))?, &format!("{pre}.mlp.c_fc"))?)?;
        x = (x + conv1d(&f, &format!("{pre}.mlp.c_proj"))?)?;
    }
    let x = ln(&x, "transformer.ln_f")?;
    let logits = x.broadcast_matmul(&wte.t()?)?.reshape((B * S, c.vocab_size as usize))?;
    mean_cross_entropy(&logits, targets)
}

fn compare(name: &str) {
    let cfg = preset(name).unwrap();
    let g = trace(
        &cfg,
        TraceOptions {
            batch: B as u64,
            seq_len: Some(S as u64),
            ..TraceOptions::default()
        },
    )
    .unwrap();
    let w = weights(&g);
    let vocab = match &cfg {
        ModelConfig::Llama(c) => c.vocab_size,
        ModelConfig::Gpt2(c) => c.vocab_size,
        ModelConfig::Mlp(_) => unreachable!(),
    } as u32;
    let (tokens, targets) = batch(vocab);
    let (our_loss, our_grads) = ours(&cfg, &w, &tokens, &targets);

    let vars: HashMap<String, Var> = w
        .iter()
        .map(|(n, t)| (n.clone(), Var::from_tensor(t).unwrap()))
        .collect();
    let loss = match &cfg {
        ModelConfig::Llama(c) => llama_forward(c, &vars, &tokens, &targets),
        ModelConfig::Gpt2(c) => gpt2_forward(c, &vars, &tokens, &targets),
        ModelConfig::Mlp(_) => unreachable!(),
    }
    .unwrap();
    let their_loss = loss.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap();
    assert!(
        (our_loss - their_loss).abs() < 1e-5 * their_loss.abs().max(1.0),
        "{name} loss: ours {our_loss}, candle {their_loss}"
    );
    let store = loss.backward().unwrap();
    assert_eq!(our_grads.len(), vars.len());
    for (pname, var) in &vars {
        let theirs = store
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("candle has no gradient for {pname}"));
        let ours = &our_grads[pname];
        let scale = theirs
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            .max(1.0);
        let diff = (ours - theirs)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(
            diff <= 1e-4 * scale,
            "{name}: gradient of {pname} differs by {diff} (scale {scale})"
        );
    }
}

#[test]
fn tiny_llama_gradients_equal_candle_autograd() {
    compare("tiny-llama");
}

#[test]
fn tiny_gpt2_gradients_equal_candle_autograd() {
    compare("tiny-gpt2");
}
