//! The mixture-of-experts routing kernels: top-k selection, routing weights and their
//! gradient, the permutation of rows to expert order and back, the grouped expert matmul and
//! the load-balancing loss, as Hugging Face's Mixtral / Qwen2-MoE / Qwen3-MoE compute them.
//!
//! Routing math (scores, weights, the aux loss) runs in f64 on the host and is cast to the
//! op's dtype; row movement is `index_select` on the operand's own dtype, and the expert
//! matmuls are the dense `linear` / `weight_grad` kernels on each expert's run of rows.

use crate::cpu::fused;
use crate::cpu::linear::{linear, weight_grad};
use crate::ExecError;
use candle_core::{DType as CDType, Tensor};
use shardplan_ir::{RouterScore, WeightLayout};

type Result<T> = std::result::Result<T, ExecError>;

fn host(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(CDType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// Expert ids `[T, k]` as a flat row-major list.
fn ids(t: &Tensor) -> Result<(Vec<usize>, usize, usize)> {
    let (tokens, k) = t.dims2()?;
    let v = t.to_dtype(CDType::U32)?.flatten_all()?.to_vec1::<u32>()?;
    Ok((v.into_iter().map(|e| e as usize).collect(), tokens, k))
}

/// The scores of one token's logits.
fn scores(logits: &[f64], score: RouterScore) -> Vec<f64> {
    match score {
        RouterScore::Softmax => softmax(logits),
        RouterScore::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
    }
}

fn softmax(logits: &[f64]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logits.iter().map(|&l| (l - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

/// The `k` highest of `s`, highest first, ties to the lower index.
fn top_k_of(s: &[f64], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..s.len()).collect();
    order.sort_by(|&a, &b| s[b].total_cmp(&s[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// `moe_top_k`: `(logits [T, E]) -> u32 [T, k]`.
pub fn top_k(logits: &Tensor, k: usize, score: RouterScore) -> Result<Tensor> {
    let (tokens, e) = logits.dims2()?;
    let l = host(logits)?;
    let mut out = Vec::with_capacity(tokens * k);
    for t in 0..tokens {
        let s = scores(&l[t * e..(t + 1) * e], score);
        out.extend(top_k_of(&s, k).into_iter().map(|i| i as u32));
    }
    Ok(Tensor::from_vec(out, (tokens, k), logits.device())?)
}

/// `moe_drop`: each expert keeps its first `capacity` assignments, in priority order (every
/// token's slot 0 before any slot 1, ..., each slot in token order); the others become
/// `experts` (dropped).
pub fn drop_over_capacity(experts: &Tensor, n: usize, capacity: usize) -> Result<Tensor> {
    let (ids, tokens, k) = ids(experts)?;
    let mut kept = vec![0usize; n];
    let mut out: Vec<u32> = ids.iter().map(|&e| e as u32).collect();
    for j in 0..k {
        for t in 0..tokens {
            let e = ids[t * k + j];
            check_expert(e, n)?;
            if kept[e] < capacity {
                kept[e] += 1;
            } else {
                out[t * k + j] = n as u32;
            }
        }
    }
    Ok(Tensor::from_vec(out, (tokens, k), experts.device())?)
}

fn check_expert(e: usize, experts: usize) -> Result<()> {
    if e < experts {
        Ok(())
    } else {
        Err(ExecError::Unsupported(format!(
            "expert id {e} is out of range ({experts} experts)"
        )))
    }
}

/// `moe_router_weights`: `(logits [T, E], ids [T, k]) -> [T, k]`.
pub fn router_weights(logits: &Tensor, experts: &Tensor, score: RouterScore, norm: bool) -> Result<Tensor> {
    let (_, e) = logits.dims2()?;
    let l = host(logits)?;
    let (ids, tokens, k) = ids(experts)?;
    let mut out = Vec::with_capacity(tokens * k);
    for t in 0..tokens {
        let s = scores(&l[t * e..(t + 1) * e], score);
        let chosen = &ids[t * k..(t + 1) * k];
        for &i in chosen {
            check_expert(i, e)?;
        }
        let sum: f64 = if norm { chosen.iter().map(|&i| s[i]).sum() } else { 1.0 };
        out.extend(chosen.iter().map(|&i| s[i] / sum));
    }
    Ok(Tensor::from_vec(out, (tokens, k), logits.device())?.to_dtype(logits.dtype())?)
}

/// `moe_router_weights_grad`: `(logits [T, E], ids [T, k], g [T, k]) -> [T, E]`.
pub fn router_weights_grad(
    logits: &Tensor,
    experts: &Tensor,
    g: &Tensor,
    score: RouterScore,
    norm: bool,
) -> Result<Tensor> {
    let (_, e) = logits.dims2()?;
    let (l, gv) = (host(logits)?, host(g)?);
    let (ids, tokens, k) = ids(experts)?;
    let mut out = vec![0.0f64; tokens * e];
    for t in 0..tokens {
        let s = scores(&l[t * e..(t + 1) * e], score);
        let chosen = &ids[t * k..(t + 1) * k];
        let gt = &gv[t * k..(t + 1) * k];
        // d loss / d score of each expert.
        let mut ds = vec![0.0f64; e];
        if norm {
            let sum: f64 = chosen.iter().map(|&i| s[i]).sum();
            let dot: f64 = chosen.iter().zip(gt).map(|(&i, &g)| g * s[i]).sum();
            for (&i, &g) in chosen.iter().zip(gt) {
                check_expert(i, e)?;
                ds[i] += g / sum - dot / (sum * sum);
            }
        } else {
            for (&i, &g) in chosen.iter().zip(gt) {
                check_expert(i, e)?;
                ds[i] += g;
            }
        }
        let row = &mut out[t * e..(t + 1) * e];
        match score {
            RouterScore::Softmax => {
                let dot: f64 = ds.iter().zip(&s).map(|(d, p)| d * p).sum();
                for ((o, d), p) in row.iter_mut().zip(&ds).zip(&s) {
                    *o = p * (d - dot);
                }
            }
            RouterScore::Sigmoid => {
                for ((o, d), p) in row.iter_mut().zip(&ds).zip(&s) {
                    *o = d * p * (1.0 - p);
                }
            }
        }
    }
    Ok(Tensor::from_vec(out, (tokens, e), logits.device())?.to_dtype(logits.dtype())?)
}

/// The expert order of the `T * k` assignments (flat `t * k + j`): sorted by expert, stably.
fn expert_order(ids: &[usize]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&a| ids[a]);
    order
}

fn index(v: Vec<u32>, t: &Tensor) -> Result<Tensor> {
    let n = v.len();
    Ok(Tensor::from_vec(v, n, t.device())?)
}

/// `moe_permute`: `(x [T, D] | [T, k, D], ids [T, k]) -> [T * k, D]`.
pub fn permute(x: &Tensor, experts: &Tensor) -> Result<Tensor> {
    let (ids, _, k) = ids(experts)?;
    let order = expert_order(&ids);
    let per_slot = x.rank() == 3;
    let src: Vec<u32> = order
        .into_iter()
        .map(|a| if per_slot { a as u32 } else { (a / k) as u32 })
        .collect();
    let d = *x.dims().last().unwrap_or(&1);
    let rows = x.contiguous()?.reshape(((), d))?;
    Ok(rows.index_select(&index(src, x)?, 0)?)
}

/// `moe_unpermute`: `(y [T * k, D], ids [T, k]) -> [T, k, D]`, or with `sum` `[T, D]`
/// (each token's rows added in increasing expert order).
pub fn unpermute(y: &Tensor, experts: &Tensor, sum: bool) -> Result<Tensor> {
    let (ids, tokens, k) = ids(experts)?;
    let order = expert_order(&ids);
    // Row (in expert order) of each assignment.
    let mut row_of = vec![0u32; ids.len()];
    for (r, &a) in order.iter().enumerate() {
        row_of[a] = r as u32;
    }
    let d = y.dim(1)?;
    let y = y.contiguous()?;
    if !sum {
        return Ok(y.index_select(&index(row_of, &y)?, 0)?.reshape((tokens, k, d))?);
    }
    // Slot rank r of token t: the slot with its r-th smallest expert.
    let slots: Vec<Vec<usize>> = (0..tokens)
        .map(|t| {
            let mut s: Vec<usize> = (0..k).collect();
            s.sort_by_key(|&j| ids[t * k + j]);
            s
        })
        .collect();
    if fused::applies(&[&y]) && k > 0 {
        let src: Vec<u32> = (0..tokens)
            .flat_map(|t| slots[t].iter().map(move |&j| (t, j)))
            .map(|(t, j)| row_of[t * k + j])
            .collect();
        return fused::gather_sum(&y, &src, k);
    }
    sum_composed(&y, &slots, &row_of, k)
}

/// The summing [`unpermute`] as `k` row selections added in turn (slot rank `r` of every
/// token, then the next): the path for other dtypes and devices, and the reference the
/// fused kernel is tested against.
fn sum_composed(y: &Tensor, slots: &[Vec<usize>], row_of: &[u32], k: usize) -> Result<Tensor> {
    let tokens = slots.len();
    let mut acc: Option<Tensor> = None;
    for r in 0..k {
        let src: Vec<u32> = (0..tokens).map(|t| row_of[t * k + slots[t][r]]).collect();
        let part = y.index_select(&index(src, y)?, 0)?;
        acc = Some(match acc {
            None => part,
            Some(a) => (a + part)?,
        });
    }
    acc.ok_or_else(|| ExecError::Internal("moe_unpermute with k = 0".into()))
}

/// Rows per expert, in expert order, then the padding rows (id `experts`: the rows an
/// expert-parallel dispatch left empty, after every expert's).
fn counts(ids: &[usize], experts: usize) -> Result<Vec<usize>> {
    let mut c = vec![0usize; experts + 1];
    for &e in ids {
        check_expert(e, experts + 1)?;
        c[e] += 1;
    }
    Ok(c)
}

/// `grouped_linear`: `(x [T * k, in], ids [T, k], w_0..w_{E-1}) -> [T * k, out]`.
pub fn grouped_linear(x: &Tensor, experts: &Tensor, ws: &[&Tensor], layout: WeightLayout) -> Result<Tensor> {
    let (ids, _, _) = ids(experts)?;
    let counts = counts(&ids, ws.len())?;
    let x = x.contiguous()?;
    if fused::applies(&[&x]) && fused::applies(ws) && !ws.is_empty() {
        let transposed = layout == WeightLayout::OutIn;
        if let Some(y) = fused::grouped_matmul(&x, ws, &counts[..ws.len()], transposed)? {
            return Ok(y);
        }
    }
    grouped_linear_composed(&x, &counts, ws, layout)
}

/// [`grouped_linear`] as one `linear` per expert and a concatenation: the path for other
/// dtypes and devices, and the reference the fused kernel is tested against.
fn grouped_linear_composed(x: &Tensor, counts: &[usize], ws: &[&Tensor], layout: WeightLayout) -> Result<Tensor> {
    let mut parts = Vec::new();
    let mut start = 0;
    for (w, &n) in ws.iter().zip(counts) {
        if n == 0 {
            continue;
        }
        let out = match layout {
            WeightLayout::OutIn => w.dim(0)?,
            WeightLayout::InOut => w.dim(1)?,
        };
        parts.push(linear(&x.narrow(0, start, n)?, w, layout, &[n, out])?);
        start += n;
    }
    let pad = counts[ws.len()];
    if pad > 0 {
        let out = match (layout, ws.first()) {
            (WeightLayout::OutIn, Some(w)) => w.dim(0)?,
            (WeightLayout::InOut, Some(w)) => w.dim(1)?,
            (_, None) => return Err(ExecError::Internal("grouped_linear without weights".into())),
        };
        parts.push(Tensor::zeros((pad, out), x.dtype(), x.device())?);
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// `grouped_weight_grad`: expert `expert`'s weight gradient from its run of rows (zeros when
/// no token chose it).
pub fn grouped_weight_grad(
    x: &Tensor,
    g: &Tensor,
    experts: &Tensor,
    expert: usize,
    n_experts: usize,
    layout: WeightLayout,
    out: &[usize],
) -> Result<Tensor> {
    let (ids, _, _) = ids(experts)?;
    let counts = counts(&ids, n_experts)?;
    let (start, n) = (counts[..expert].iter().sum::<usize>(), counts[expert]);
    if n == 0 {
        return Ok(Tensor::zeros(out, x.dtype(), x.device())?);
    }
    let (x, g) = (
        x.contiguous()?.narrow(0, start, n)?,
        g.contiguous()?.narrow(0, start, n)?,
    );
    weight_grad(&x, &g, layout)
}

/// What the load-balancing loss reads of every layer's logits.
struct AuxStats {
    /// Per layer, each token's softmax probabilities (`[T, E]` row-major).
    probs: Vec<Vec<f64>>,
    /// Top-k picks per expert over all layers and tokens.
    picks: Vec<f64>,
    tokens: usize,
    experts: usize,
}

fn aux_stats(logits: &[&Tensor], top_k: usize) -> Result<AuxStats> {
    let (tokens, e) = logits[0].dims2()?;
    let mut probs = Vec::with_capacity(logits.len());
    let mut picks = vec![0.0f64; e];
    for l in logits {
        let v = host(l)?;
        let mut p = Vec::with_capacity(tokens * e);
        for t in 0..tokens {
            let s = softmax(&v[t * e..(t + 1) * e]);
            for i in top_k_of(&s, top_k) {
                picks[i] += 1.0;
            }
            p.extend(s);
        }
        probs.push(p);
    }
    Ok(AuxStats {
        probs,
        picks,
        tokens,
        experts: e,
    })
}

/// `moe_aux_loss`: `coef * E * sum_e f_e * P_e` over every layer's tokens together.
pub fn aux_loss(logits: &[&Tensor], top_k: usize, coef: f64) -> Result<Tensor> {
    let AuxStats {
        probs,
        picks,
        tokens,
        experts: e,
    } = aux_stats(logits, top_k)?;
    let n = (tokens * logits.len()) as f64;
    let mut mean_p = vec![0.0f64; e];
    for p in &probs {
        for (i, x) in p.iter().enumerate() {
            mean_p[i % e] += x;
        }
    }
    let loss: f64 = picks.iter().zip(&mean_p).map(|(f, p)| (f / n) * (p / n)).sum();
    let out = Tensor::new(coef * e as f64 * loss, logits[0].device())?;
    let dtype = if logits[0].dtype() == CDType::F64 {
        CDType::F64
    } else {
        CDType::F32
    };
    Ok(out.to_dtype(dtype)?)
}

/// `moe_aux_loss_grad`: the gradient of the loss wrt layer `layer`'s logits.
pub fn aux_loss_grad(g: &Tensor, logits: &[&Tensor], layer: usize, top_k: usize, coef: f64) -> Result<Tensor> {
    let AuxStats {
        probs,
        picks,
        tokens,
        experts: e,
    } = aux_stats(logits, top_k)?;
    let n = (tokens * logits.len()) as f64;
    let g = g.to_dtype(CDType::F64)?.to_scalar::<f64>()?;
    // d loss / d p_{t,e} = coef * E * f_e / n^2 (the picks are constant).
    let scale = g * coef * e as f64 / (n * n);
    let p = &probs[layer];
    let mut out = vec![0.0f64; tokens * e];
    for t in 0..tokens {
        let (pt, row) = (&p[t * e..(t + 1) * e], &mut out[t * e..(t + 1) * e]);
        let dot: f64 = pt.iter().zip(&picks).map(|(p, f)| p * f).sum();
        for ((o, p), f) in row.iter_mut().zip(pt).zip(&picks) {
            *o = scale * p * (f - dot);
        }
    }
    let l = logits[layer];
    Ok(Tensor::from_vec(out, (tokens, e), l.device())?.to_dtype(l.dtype())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Random `[tokens, k]` expert ids of `experts` (each token's distinct), leaving expert
    /// 1 without a row so an empty run is covered, and `pad` padding ids (`experts`) on the
    /// last tokens' last slots as an expert-parallel dispatch leaves them.
    fn routing(tokens: usize, k: usize, experts: usize, pad: usize) -> Tensor {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut v = Vec::with_capacity(tokens * k);
        for _ in 0..tokens {
            let mut mine: Vec<u32> = Vec::new();
            while mine.len() < k {
                let e = (next() % experts as u64) as u32;
                if e != 1 && !mine.contains(&e) {
                    mine.push(e);
                }
            }
            v.extend(mine);
        }
        let n = v.len();
        v[n - pad..].iter_mut().for_each(|e| *e = experts as u32);
        Tensor::from_vec(v, (tokens, k), &Device::Cpu).unwrap()
    }

    fn same_bits(a: &Tensor, b: &Tensor) {
        assert_eq!(a.dims(), b.dims());
        let (a, b) = (
            a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }

    #[test]
    fn fused_grouped_linear_is_the_composed_one_to_the_bit() {
        // 300 tokens x top 3 over 6 experts: runs longer than a block (128 rows), an empty
        // run, padding rows; both weight layouts.
        let (tokens, k, experts, d, f) = (300, 3, 6, 40, 24);
        for pad in [0, 5] {
            let ids = routing(tokens, k, experts, pad);
            let (flat, _, _) = super::ids(&ids).unwrap();
            let counts = counts(&flat, experts).unwrap();
            let x = Tensor::randn(0f32, 1.0, (tokens * k, d), &Device::Cpu).unwrap();
            for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
                let shape = if layout == WeightLayout::OutIn { (f, d) } else { (d, f) };
                let ws: Vec<Tensor> = (0..experts)
                    .map(|_| Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap())
                    .collect();
                let refs: Vec<&Tensor> = ws.iter().collect();
                let fused = grouped_linear(&x, &ids, &refs, layout).unwrap();
                let composed = grouped_linear_composed(&x, &counts, &refs, layout).unwrap();
                same_bits(&fused, &composed);
                if pad > 0 {
                    let tail = fused.narrow(0, tokens * k - pad, pad).unwrap();
                    assert_eq!(tail.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
                }
            }
        }
    }

    #[test]
    fn fused_unpermute_sum_is_the_composed_one_to_the_bit() {
        let (tokens, k, experts, d) = (257, 4, 8, 33);
        let ids = routing(tokens, k, experts, 0);
        let y = Tensor::randn(0f32, 1.0, (tokens * k, d), &Device::Cpu).unwrap();
        let fused = unpermute(&y, &ids, true).unwrap();
        let (flat, _, _) = super::ids(&ids).unwrap();
        let order = expert_order(&flat);
        let mut row_of = vec![0u32; flat.len()];
        for (r, &a) in order.iter().enumerate() {
            row_of[a] = r as u32;
        }
        let slots: Vec<Vec<usize>> = (0..tokens)
            .map(|t| {
                let mut s: Vec<usize> = (0..k).collect();
                s.sort_by_key(|&j| flat[t * k + j]);
                s
            })
            .collect();
        same_bits(&fused, &sum_composed(&y, &slots, &row_of, k).unwrap());
    }

    fn logits() -> Tensor {
        // Token 1 ties experts 0 and 2: the lower one comes first, as in the weights.
        Tensor::new(&[[0.0f64, 1.0, 2.0], [3.0, 0.0, 3.0], [0.0, 5.0, 1.0]], &Device::Cpu).unwrap()
    }

    fn ids_of(t: &Tensor) -> Vec<Vec<u32>> {
        t.to_vec2::<u32>().unwrap()
    }

    #[test]
    fn top_k_takes_the_highest_scores_lower_expert_on_ties() {
        let ids = top_k(&logits(), 2, RouterScore::Softmax).unwrap();
        assert_eq!(ids_of(&ids), [[2, 1], [0, 2], [1, 2]]);
        let ids = top_k(&logits(), 2, RouterScore::Sigmoid).unwrap();
        assert_eq!(ids_of(&ids), [[2, 1], [0, 2], [1, 2]]);
    }

    #[test]
    fn drop_keeps_first_choices_first_then_token_order() {
        // 4 tokens, top 2, 3 experts, 2 assignments per expert. First choices: 0, 0, 0, 1
        // (token 2's expert 0 is the third: dropped); second choices, in token order:
        // 1 (kept: expert 1's second), 2, 1 (dropped: expert 1 is full), 2.
        let ids = Tensor::new(&[[0u32, 1], [0, 2], [0, 1], [1, 2]], &Device::Cpu).unwrap();
        let d = drop_over_capacity(&ids, 3, 2).unwrap();
        assert_eq!(ids_of(&d), [[0, 1], [0, 2], [3, 3], [1, 2]]);
        // Room for everything: unchanged.
        assert_eq!(ids_of(&drop_over_capacity(&ids, 3, 8).unwrap()), ids_of(&ids));
        // Dropped rows go after every expert's in the permuted order and come back zero
        // from the grouped matmul, so they add nothing to their token.
        let x = Tensor::new(&[[1.0f32], [2.0], [3.0], [4.0]], &Device::Cpu).unwrap();
        let rows = permute(&x, &d).unwrap();
        assert_eq!(
            rows.to_vec2::<f32>().unwrap(),
            [[1.0], [2.0], [1.0], [4.0], [2.0], [4.0], [3.0], [3.0]]
        );
        let w: Vec<Tensor> = (1..=3)
            .map(|e| Tensor::new(&[[e as f32]], &Device::Cpu).unwrap())
            .collect();
        let ws: Vec<&Tensor> = w.iter().collect();
        let y = grouped_linear(&rows, &d, &ws, WeightLayout::OutIn).unwrap();
        let back = unpermute(&y, &d, true).unwrap();
        // Token 0: experts 0 and 1 (1 + 2); token 2: nothing; token 3: experts 1 and 2.
        assert_eq!(back.to_vec2::<f32>().unwrap(), [[3.0], [8.0], [0.0], [20.0]]);
        // An out-of-range id is refused, not dropped.
        let bad = Tensor::new(&[[0u32, 3]], &Device::Cpu).unwrap();
        assert!(drop_over_capacity(&bad, 3, 2).is_err());
    }

    #[test]
    fn router_weights_renormalise_only_when_asked() {
        let l = logits();
        let ids = top_k(&l, 2, RouterScore::Softmax).unwrap();
        let w = router_weights(&l, &ids, RouterScore::Softmax, true).unwrap();
        let w: Vec<Vec<f64>> = w.to_vec2().unwrap();
        // e^2 / (e^2 + e^1) = sigmoid(1).
        let s1 = 1.0 / (1.0 + (-1.0f64).exp());
        assert!(
            (w[0][0] - s1).abs() < 1e-12 && (w[0][1] - (1.0 - s1)).abs() < 1e-12,
            "{w:?}"
        );
        assert!((w[1][0] - 0.5).abs() < 1e-12, "{w:?}");
        let raw: Vec<Vec<f64>> = router_weights(&l, &ids, RouterScore::Softmax, false)
            .unwrap()
            .to_vec2()
            .unwrap();
        let z = 1.0 + 1f64.exp() + 2f64.exp();
        assert!((raw[0][0] - 2f64.exp() / z).abs() < 1e-12, "{raw:?}");
        let sig: Vec<Vec<f64>> = router_weights(&l, &ids, RouterScore::Sigmoid, false)
            .unwrap()
            .to_vec2()
            .unwrap();
        assert!((sig[2][0] - 1.0 / (1.0 + (-5.0f64).exp())).abs() < 1e-12, "{sig:?}");
    }

    #[test]
    fn permute_sorts_rows_by_expert_and_unpermute_sums_them_back() {
        let ids = Tensor::new(&[[2u32, 1], [0, 2], [1, 2]], &Device::Cpu).unwrap();
        let x = Tensor::new(&[[10.0f64], [20.0], [30.0]], &Device::Cpu).unwrap();
        let p = permute(&x, &ids).unwrap();
        // Expert 0: (t1); expert 1: (t0), (t2); expert 2: (t0), (t1), (t2).
        let rows: Vec<f64> = p.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(rows, [20.0, 10.0, 30.0, 10.0, 20.0, 30.0]);
        let y = Tensor::new(&[[1.0f64], [2.0], [3.0], [4.0], [5.0], [6.0]], &Device::Cpu).unwrap();
        let per_slot: Vec<Vec<Vec<f64>>> = unpermute(&y, &ids, false).unwrap().to_vec3().unwrap();
        assert_eq!(per_slot, [[[4.0], [2.0]], [[1.0], [5.0]], [[3.0], [6.0]]]);
        let summed: Vec<Vec<f64>> = unpermute(&y, &ids, true).unwrap().to_vec2().unwrap();
        assert_eq!(summed, [[6.0], [6.0], [9.0]]);
    }

    #[test]
    fn grouped_linear_applies_each_experts_weight_to_its_rows() {
        let ids = Tensor::new(&[[2u32, 1], [0, 2], [1, 2]], &Device::Cpu).unwrap();
        let x = Tensor::new(&[[1.0f64], [2.0], [3.0], [4.0], [5.0], [6.0]], &Device::Cpu).unwrap();
        let w: Vec<Tensor> = [10.0f64, 100.0, 1000.0]
            .iter()
            .map(|&s| Tensor::new(&[[s]], &Device::Cpu).unwrap())
            .collect();
        let refs: Vec<&Tensor> = w.iter().collect();
        let y: Vec<f64> = grouped_linear(&x, &ids, &refs, WeightLayout::OutIn)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(y, [10.0, 200.0, 300.0, 4000.0, 5000.0, 6000.0]);
        let g = Tensor::ones((6, 1), CDType::F64, &Device::Cpu).unwrap();
        let dw: Vec<Vec<f64>> = grouped_weight_grad(&x, &g, &ids, 2, 3, WeightLayout::OutIn, &[1, 1])
            .unwrap()
            .to_vec2()
            .unwrap();
        assert_eq!(dw, [[15.0]]);
    }

    /// Hugging Face's `load_balancing_loss_func`: `E * sum_e mean(picks of e) * mean(p_e)`.
    #[test]
    fn aux_loss_is_experts_times_pick_share_times_mean_probability() {
        let l = logits();
        let got = aux_loss(&[&l], 2, 0.5).unwrap().to_scalar::<f64>().unwrap();
        let rows = [[0.0f64, 1.0, 2.0], [3.0, 0.0, 3.0], [0.0, 5.0, 1.0]];
        let mut mean_p = [0.0f64; 3];
        for r in rows {
            let z: f64 = r.iter().map(|x| x.exp()).sum();
            for e in 0..3 {
                mean_p[e] += r[e].exp() / z / 3.0;
            }
        }
        // Picks: expert 0 once, expert 1 twice, expert 2 three times, of 3 tokens.
        let want = 0.5 * 3.0 * (mean_p[0] / 3.0 + 2.0 * mean_p[1] / 3.0 + 3.0 * mean_p[2] / 3.0);
        assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    }
}
