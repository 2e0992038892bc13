//! Inference on one rank: a forward pass over the model's weights by their Hugging Face
//! names, with a per-layer KV cache so each new token costs one position's work.
//!
//! The math is the training graph's (`models::llama`, `models::gpt2`): the same RMS /
//! layer norms, rotary tables (with the model's scaling; angles in f64, as the training
//! kernel makes them), grouped-query attention, activations and tied heads. What differs is
//! the shape: batch 1, positions `start..start + n` against every cached key, and logits
//! for the new positions only. `tests/generate.rs` checks the full-sequence logits against
//! the training forward and greedy tokens against transformers' `generate`.

pub mod sample;

use crate::ExecError;
use candle_core::{DType, Device, Tensor};
use shardplan_ir::RouterScore;
use shardplan_models::{Activation, Gpt2Config, LlamaConfig, ModelConfig, MoeConfig, MoeNames, Router, TraceOptions};
use std::collections::HashMap;

type Result<T> = std::result::Result<T, ExecError>;

/// A language model ready to decode: its config and f32 weights by HF name.
pub struct Model {
    config: ModelConfig,
    w: HashMap<String, Tensor>,
    device: Device,
}

/// Keys and values of every position decoded so far, per layer (`[positions, kv heads,
/// head dim]`).
#[derive(Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The parameters `config` has (HF name, shape), in the training graph's order.
pub fn param_shapes(config: &ModelConfig) -> Result<Vec<(String, Vec<u64>)>> {
    if let ModelConfig::Mlp(_) = config {
        return Err(ExecError::Unsupported(
            "generation needs a language model (llama or gpt2 family); this is an mlp classifier".into(),
        ));
    }
    let g = shardplan_models::trace(
        config,
        TraceOptions {
            batch: 1,
            seq_len: Some(1),
            dtype: shardplan_ir::DType::F32,
            ..Default::default()
        },
    )?;
    Ok(g.params()
        .map(|(_, p)| (p.name.to_string(), p.ty.shape.dims().to_vec()))
        .collect())
}

/// `x W^T (+ b)` for an `[out, in]` weight.
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    Ok(match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

/// `x W + b` for GPT-2's `[in, out]` (Conv1D) weights.
fn conv1d(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok(x.matmul(w)?.broadcast_add(b)?)
}

fn activate(x: &Tensor, a: Activation) -> Result<Tensor> {
    Ok(match a {
        Activation::Silu => x.silu()?,
        Activation::Gelu => x.gelu_erf()?,
        Activation::GeluTanh => x.gelu()?,
        Activation::Relu => x.relu()?,
    })
}

/// Causal attention of `n` new queries at positions `start..start + n` over all `s` keys.
/// `q`: `[n, heads, hd]`; `k`, `v`: `[s, kv_heads, hd]`; returns `[n, heads * hd]`.
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, start: usize) -> Result<Tensor> {
    let (n, h, hd) = q.dims3()?;
    let (s, kv, _) = k.dims3()?;
    let rep = h / kv;
    // Query heads j*rep .. (j+1)*rep share kv head j (HF's repeat_kv).
    let q = q.transpose(0, 1)?.contiguous()?.reshape((kv, rep * n, hd))?;
    let k = k.transpose(0, 1)?.contiguous()?;
    let v = v.transpose(0, 1)?.contiguous()?;
    let scale = 1.0 / (hd as f64).sqrt();
    let scores = (q.matmul(&k.t()?)? * scale)?.reshape((h, n, s))?;
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..s).map(move |j| if j <= start + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(mask, (n, s), q.device())?;
    let p = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?.contiguous()?)?;
    let o = p.reshape((kv, rep * n, s))?.matmul(&v)?.reshape((h, n, hd))?;
    Ok(o.transpose(0, 1)?.contiguous()?.reshape((n, h * hd))?)
}

impl Model {
    /// Checks `weights` against the parameters `config` needs (names and shapes) and
    /// keeps them as f32 on the CPU.
    pub fn new(config: ModelConfig, mut weights: HashMap<String, Tensor>) -> Result<Self> {
        let device = Device::Cpu;
        let mut w = HashMap::new();
        for (name, shape) in param_shapes(&config)? {
            let t = weights
                .remove(&name)
                .ok_or_else(|| ExecError::Checkpoint(format!("the weights have no tensor `{name}`")))?;
            let want: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
            if t.dims() != want.as_slice() {
                return Err(ExecError::Checkpoint(format!(
                    "tensor `{name}` has shape {:?}, the model needs {want:?}",
                    t.dims()
                )));
            }
            w.insert(name, t.to_dtype(DType::F32)?.to_device(&device)?);
        }
        Ok(Model { config, w, device })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Token ids the model knows.
    pub fn vocab_size(&self) -> u64 {
        match &self.config {
            ModelConfig::Llama(c) => c.vocab_size,
            ModelConfig::Gpt2(c) => c.vocab_size,
            ModelConfig::Mlp(_) => 0,
        }
    }

    /// The longest sequence (prompt and generated tokens) the model takes.
    pub fn max_positions(&self) -> u64 {
        match &self.config {
            ModelConfig::Llama(c) => c.max_seq_len,
            ModelConfig::Gpt2(c) => c.max_seq_len,
            ModelConfig::Mlp(_) => 0,
        }
    }

    fn get(&self, name: &str) -> Result<&Tensor> {
        self.w
            .get(name)
            .ok_or_else(|| ExecError::Internal(format!("weight `{name}` was not loaded")))
    }

    /// Runs `tokens` at the positions after those in `cache` and appends their keys and
    /// values to it; returns their logits, `[tokens.len(), vocab]` (f32).
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let start = cache.len;
        let end = start + tokens.len();
        if tokens.is_empty() {
            return Err(ExecError::Internal("forward over no tokens".into()));
        }
        if end as u64 > self.max_positions() {
            return Err(ExecError::Unsupported(format!(
                "{end} positions exceed the model's {} (max_position_embeddings)",
                self.max_positions()
            )));
        }
        let vocab = self.vocab_size();
        if let Some(&t) = tokens.iter().find(|&&t| u64::from(t) >= vocab) {
            return Err(ExecError::Data(format!(
                "token id {t} is outside the model's vocabulary of {vocab}"
            )));
        }
        let ids = Tensor::from_vec(tokens.to_vec(), tokens.len(), &self.device)?;
        let logits = match &self.config {
            ModelConfig::Llama(c) => self.llama(c, &ids, start, cache)?,
            ModelConfig::Gpt2(c) => self.gpt2(c, &ids, start, cache)?,
            ModelConfig::Mlp(_) => return Err(ExecError::Unsupported("generation needs a language model".into())),
        };
        cache.len = end;
        Ok(logits)
    }

    /// Appends layer `i`'s new keys and values; returns all of them.
    fn cached(cache: &mut KvCache, i: usize, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        if cache.layers.len() <= i {
            cache.layers.resize(i + 1, None);
        }
        let kv = match cache.layers[i].take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 0)?, Tensor::cat(&[&pv, &v], 0)?),
            None => (k, v),
        };
        cache.layers[i] = Some(kv.clone());
        Ok(kv)
    }

    /// cos and sin `[n, hd / 2]` of positions `start..start + n` (angles in f64, then f32,
    /// times YaRN's attention factor), as the training kernel's tables.
    fn rope_tables(c: &LlamaConfig, start: usize, n: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        let hd = c.head_dim() as usize;
        let half = hd / 2;
        let mut angles = Vec::with_capacity(n * half);
        for pos in start..start + n {
            for i in 0..half {
                angles.push(pos as f64 * c.rope_scaling.inv_freq(c.rope_theta, hd, i));
            }
        }
        let a = Tensor::from_vec(angles, (n, half), device)?;
        let m = c.rope_scaling.attention_factor();
        Ok((
            (a.cos()? * m)?.to_dtype(DType::F32)?,
            (a.sin()? * m)?.to_dtype(DType::F32)?,
        ))
    }

    fn llama(&self, c: &LlamaConfig, ids: &Tensor, start: usize, cache: &mut KvCache) -> Result<Tensor> {
        let n = ids.dim(0)?;
        let (hd, h, kvh) = (c.head_dim() as usize, c.n_heads as usize, c.n_kv_heads as usize);
        let eps = c.norm_eps as f32;
        let act = c.activation.unwrap_or(Activation::Silu);
        let table = self.get("model.embed_tokens.weight")?;
        let mut x = table.index_select(ids, 0)?;
        let (cos, sin) = Self::rope_tables(c, start, n, &self.device)?;
        for i in 0..c.n_layers as usize {
            let p = format!("model.layers.{i}");
            let hx = candle_nn::ops::rms_norm(&x, self.get(&format!("{p}.input_layernorm.weight"))?, eps)?;
            let proj = |name: &str, heads: usize| -> Result<Tensor> {
                let b = if c.qkv_bias {
                    Some(self.get(&format!("{p}.self_attn.{name}.bias"))?)
                } else {
                    None
                };
                Ok(linear(&hx, self.get(&format!("{p}.self_attn.{name}.weight"))?, b)?.reshape((1, n, heads, hd))?)
            };
            // Qwen3: each head's queries and keys RMS-normalised before rotary.
            let head_norm = |t: Tensor, name: &str| -> Result<Tensor> {
                if !c.qk_norm {
                    return Ok(t);
                }
                let w = self.get(&format!("{p}.self_attn.{name}.weight"))?;
                Ok(candle_nn::ops::rms_norm(&t.contiguous()?, w, eps)?)
            };
            let q = head_norm(proj("q_proj", h)?, "q_norm")?;
            let k = head_norm(proj("k_proj", kvh)?, "k_norm")?;
            let q = candle_nn::rotary_emb::rope_thd(&q, &cos, &sin)?.squeeze(0)?;
            let k = candle_nn::rotary_emb::rope_thd(&k, &cos, &sin)?.squeeze(0)?;
            let v = proj("v_proj", kvh)?.squeeze(0)?;
            let (k, v) = Self::cached(cache, i, k, v)?;
            let a = attention(&q, &k, &v, start)?;
            x = (x + linear(&a, self.get(&format!("{p}.self_attn.o_proj.weight"))?, None)?)?;
            let hx = candle_nn::ops::rms_norm(&x, self.get(&format!("{p}.post_attention_layernorm.weight"))?, eps)?;
            let y = match &c.moe {
                Some(m) if m.is_moe_layer(i as u64) => self.moe(m, &p, &hx, act)?,
                _ => self.swiglu(&format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"], &hx, act)?,
            };
            x = (x + y)?;
        }
        let x = candle_nn::ops::rms_norm(&x, self.get("model.norm.weight")?, eps)?;
        let head = if c.tie_embeddings {
            table
        } else {
            self.get("lm_head.weight")?
        };
        linear(&x, head, None)
    }

    /// `down(act(gate(x)) * up(x))` with the weights `{prefix}.{name}.weight`.
    fn swiglu(&self, prefix: &str, [g, u, d]: [&str; 3], x: &Tensor, act: Activation) -> Result<Tensor> {
        let w = |name: &str| self.get(&format!("{prefix}.{name}.weight"));
        let gate = activate(&linear(x, w(g)?, None)?, act)?;
        let up = linear(x, w(u)?, None)?;
        linear(&(gate * up)?, w(d)?, None)
    }

    /// The mixture of experts of one layer over `x` `[n, dim]`, as the training graph routes
    /// it (`models::llama::moe_ffn`, with the training kernels' `top_k` and
    /// `router_weights` over the f32 logits), each expert's SwiGLU over its tokens scaled by
    /// their scores and summed per token; plus the shared expert behind its sigmoid gate.
    fn moe(&self, m: &MoeConfig, layer: &str, x: &Tensor, act: Activation) -> Result<Tensor> {
        let (prefix, names) = match m.hf_names {
            MoeNames::Mixtral => (format!("{layer}.block_sparse_moe"), ["w1", "w3", "w2"]),
            MoeNames::Qwen => (format!("{layer}.mlp"), ["gate_proj", "up_proj", "down_proj"]),
        };
        let logits = linear(x, self.get(&format!("{prefix}.gate.weight"))?, None)?.to_dtype(DType::F32)?;
        // The training kernels' own routing, so decoding picks the experts training does.
        let score = match m.router {
            Router::SoftmaxTopk => RouterScore::Softmax,
            Router::SigmoidTopk => RouterScore::Sigmoid,
        };
        let ids = crate::cpu::moe::top_k(&logits, m.top_k as usize, score)?;
        let weights = crate::cpu::moe::router_weights(&logits, &ids, score, m.norm_topk_prob)?;
        let (ids, weights): (Vec<Vec<u32>>, Vec<Vec<f32>>) = (ids.to_vec2()?, weights.to_vec2()?);
        // Per expert: the tokens routed to it and their weights.
        let mut routed: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); m.experts as usize];
        for (t, (chosen, w)) in ids.iter().zip(&weights).enumerate() {
            for (&e, &w) in chosen.iter().zip(w) {
                let r = routed
                    .get_mut(e as usize)
                    .ok_or_else(|| ExecError::Internal(format!("expert {e} routed, of {}", m.experts)))?;
                r.0.push(t as u32);
                r.1.push(w);
            }
        }
        let mut y = x.zeros_like()?;
        for (e, (tokens, weights)) in routed.iter().enumerate() {
            if tokens.is_empty() {
                continue;
            }
            let n = tokens.len();
            let ids = Tensor::from_vec(tokens.clone(), n, &self.device)?;
            let out = self.swiglu(&format!("{prefix}.experts.{e}"), names, &x.index_select(&ids, 0)?, act)?;
            let w = Tensor::from_vec(weights.clone(), (n, 1), &self.device)?.to_dtype(out.dtype())?;
            y = y.index_add(&ids, &out.broadcast_mul(&w)?, 0)?;
        }
        if m.shared_experts > 0 {
            let mut s = self.swiglu(
                &format!("{prefix}.shared_expert"),
                ["gate_proj", "up_proj", "down_proj"],
                x,
                act,
            )?;
            if m.shared_expert_gate {
                let g = linear(x, self.get(&format!("{prefix}.shared_expert_gate.weight"))?, None)?;
                s = candle_nn::ops::sigmoid(&g)?.broadcast_mul(&s)?;
            }
            y = (y + s)?;
        }
        Ok(y)
    }

    fn gpt2(&self, c: &Gpt2Config, ids: &Tensor, start: usize, cache: &mut KvCache) -> Result<Tensor> {
        let n = ids.dim(0)?;
        let (d, h) = (c.dim as usize, c.n_heads as usize);
        let hd = d / h;
        let eps = c.norm_eps as f32;
        let act = c.activation.unwrap_or(Activation::GeluTanh);
        let ln = |x: &Tensor, prefix: &str| -> Result<Tensor> {
            Ok(candle_nn::ops::layer_norm(
                &x.contiguous()?,
                self.get(&format!("{prefix}.weight"))?,
                self.get(&format!("{prefix}.bias"))?,
                eps,
            )?)
        };
        let wte = self.get("transformer.wte.weight")?;
        let pos = self.get("transformer.wpe.weight")?.narrow(0, start, n)?;
        let mut x = (wte.index_select(ids, 0)? + pos)?;
        for i in 0..c.n_layers as usize {
            let p = format!("transformer.h.{i}");
            let hx = ln(&x, &format!("{p}.ln_1"))?;
            let qkv = conv1d(
                &hx,
                self.get(&format!("{p}.attn.c_attn.weight"))?,
                self.get(&format!("{p}.attn.c_attn.bias"))?,
            )?;
            let part = |j: usize| -> Result<Tensor> { Ok(qkv.narrow(1, j * d, d)?.reshape((n, h, hd))?) };
            let (k, v) = Self::cached(cache, i, part(1)?, part(2)?)?;
            let a = attention(&part(0)?, &k, &v, start)?;
            x = (x + conv1d(
                &a,
                self.get(&format!("{p}.attn.c_proj.weight"))?,
                self.get(&format!("{p}.attn.c_proj.bias"))?,
            )?)?;
            let hx = ln(&x, &format!("{p}.ln_2"))?;
            let f = conv1d(
                &hx,
                self.get(&format!("{p}.mlp.c_fc.weight"))?,
                self.get(&format!("{p}.mlp.c_fc.bias"))?,
            )?;
            let f = activate(&f, act)?;
            x = (x + conv1d(
                &f,
                self.get(&format!("{p}.mlp.c_proj.weight"))?,
                self.get(&format!("{p}.mlp.c_proj.bias"))?,
            )?)?;
        }
        let x = ln(&x, "transformer.ln_f")?;
        linear(&x, wte, None)
    }

    /// Generates up to `s.max_new_tokens` tokens after `prompt` (one forward over the
    /// prompt, then one position per token, reusing the cache); stops early after a token
    /// in `stop`. Calls `each` with every new token as it is chosen.
    pub fn generate(
        &self,
        prompt: &[u32],
        s: &sample::Sampling,
        stop: &[u32],
        each: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(ExecError::Data("the prompt has no tokens".into()));
        }
        let total = prompt.len() as u64 + s.max_new_tokens;
        if prompt.len() as u64 >= self.max_positions() {
            return Err(ExecError::Data(format!(
                "the prompt has {} tokens; the model takes at most {} positions, so it leaves no room for a new token",
                prompt.len(),
                self.max_positions()
            )));
        }
        let budget = total.min(self.max_positions()) - prompt.len() as u64;
        let mut cache = KvCache::default();
        let mut logits = self.forward(prompt, &mut cache)?;
        let mut out = Vec::with_capacity(budget as usize);
        for i in 0..budget {
            let last = logits.get(logits.dim(0)? - 1)?;
            let t = sample::choose(&last.to_dtype(DType::F32)?.to_vec1::<f32>()?, s, i)?;
            out.push(t);
            each(t)?;
            if stop.contains(&t) || i + 1 == budget {
                break;
            }
            logits = self.forward(&[t], &mut cache)?;
        }
        Ok(out)
    }
}

/// Index of the largest value (the first of equal ones, as torch's argmax).
pub(crate) fn argmax(v: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in v.iter().enumerate() {
        if x.is_nan() {
            return None;
        }
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map(|b| b.0)
}

/// Logits `[vocab]` of the last position, as a vector.
pub fn last_logits(logits: &Tensor) -> Result<Vec<f32>> {
    Ok(logits.get(logits.dim(0)? - 1)?.to_vec1::<f32>()?)
}
