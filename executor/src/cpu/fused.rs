//! Fused f32 CPU kernels for the row-wise parts of the step that candle would run as
//! several passes (each with its own broadcast): masked softmax, softmax backward,
//! cross-entropy and its gradient, the rms_norm gradients, silu/gelu gradients, AdamW;
//! and the 2-D matmul of linear layers and their weight gradients (`gemm` on operands read
//! in place, transposed through strides, into an output that is not zeroed first).
//!
//! Each works on contiguous rows in parallel (rayon). `kernels` calls them for f32 tensors
//! on the CPU and keeps its composed candle versions for every other case; the tests in
//! this file check that both agree.

pub use crate::adamw::AdamW;
use crate::cpu::vmath;
use crate::ExecError;
use candle_core::{CpuStorage, Device, Storage, Tensor};
use rayon::prelude::*;

type Result<T> = std::result::Result<T, ExecError>;

/// Rows below this many elements in total are not worth spreading over threads (the
/// planner's CPU cost model charges the pool's start from the same threshold).
const PAR_MIN: usize = shardplan_planner::PARALLEL_MIN_ELEMS as usize;

/// True when the fused kernels can take these tensors.
pub fn applies(ts: &[&Tensor]) -> bool {
    ts.iter()
        .all(|t| t.dtype() == candle_core::DType::F32 && matches!(t.device(), Device::Cpu))
}

/// Runs `f` on the tensor's elements as one contiguous f32 slice.
pub(crate) fn with_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
        return Err(ExecError::Internal("fused kernels take f32 CPU tensors".into()));
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| ExecError::Internal("not contiguous".into()))?;
    Ok(f(&data[start..end]))
}

/// The gradient of an embedding table `[vocab, dim]` from the gradient `g` of its rows
/// looked up by `ids` (`[ids.len(), dim]`): one pass, each id's row added in token order
/// (the sum does not depend on threads). An id outside the table is an error.
pub fn embedding_grad(ids: &[u32], g: &Tensor, vocab: usize, dim: usize) -> Result<Tensor> {
    let table = with_slice(g, |gs| -> Result<Vec<f32>> {
        if gs.len() != ids.len() * dim {
            return Err(ExecError::Internal(format!(
                "embedding gradient of {} elements for {} ids of width {dim}",
                gs.len(),
                ids.len()
            )));
        }
        let mut table = vec![0f32; vocab * dim];
        for (t, &id) in ids.iter().enumerate() {
            let row = id as usize;
            if row >= vocab {
                return Err(ExecError::Internal(format!(
                    "token id {id} outside the embedding table of {vocab} rows"
                )));
            }
            let dst = &mut table[row * dim..(row + 1) * dim];
            for (d, s) in dst.iter_mut().zip(&gs[t * dim..(t + 1) * dim]) {
                *d += s;
            }
        }
        Ok(table)
    })??;
    Ok(Tensor::from_vec(table, (vocab, dim), g.device())?)
}

fn out(v: Vec<f32>, like: &Tensor) -> Result<Tensor> {
    Ok(Tensor::from_vec(v, like.dims(), like.device())?)
}

/// `rows x width` output, each row computed by `f(row index, row out)`.
fn rows_par(rows: usize, width: usize, f: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    let mut v = vec![0f32; rows * width];
    if rows * width >= PAR_MIN && width > 0 {
        v.par_chunks_mut(width).enumerate().for_each(|(r, o)| f(r, o));
    } else if width > 0 {
        v.chunks_mut(width).enumerate().for_each(|(r, o)| f(r, o));
    }
    v
}

/// Softmax over the last dim of `scale * x` under `mask`: `x` is `[..., s, t]`; query row
/// `i` sees keys `0..mask.keys(i, s, t)`.
pub fn masked_softmax(x: &Tensor, scale: f64, mask: &crate::cpu::mask::Mask) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let (s, t) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let rows = x.elem_count() / t.max(1);
    let scale = scale as f32;
    let v = with_slice(x, |xs| {
        rows_par(rows, t, |r, o| {
            let row = &xs[r * t..(r + 1) * t];
            let visible = mask.keys(r % s, s, t);
            let o = &mut o[..visible];
            o.copy_from_slice(&row[..visible]);
            // `scale > 0`, so the largest scaled score is the scaled largest score.
            let m = vmath::max(o) * scale;
            let sum = vmath::exp_shifted(o, scale, m);
            vmath::scale(o, 1.0 / sum);
        })
    })?;
    out(v, x)
}

/// Gradient of a last-dim softmax from its output `p` and the output gradient `g`:
/// `p * (g - sum(g * p))` per row.
pub fn softmax_backward(p: &Tensor, g: &Tensor) -> Result<Tensor> {
    let t = *p.dims().last().unwrap_or(&1);
    let rows = p.elem_count() / t.max(1);
    let v = with_slice(p, |ps| {
        with_slice(g, |gs| {
            rows_par(rows, t, |r, o| {
                let (pr, gr) = (&ps[r * t..(r + 1) * t], &gs[r * t..(r + 1) * t]);
                let dot = vmath::dot(pr, gr);
                for j in 0..t {
                    o[j] = pr[j] * (gr[j] - dot);
                }
            })
        })
    })??;
    out(v, p)
}

/// Target ids as usize, checked against the number of classes.
fn targets_of(targets: &Tensor, classes: usize) -> Result<Vec<usize>> {
    let ids = targets
        .to_dtype(candle_core::DType::U32)?
        .flatten_all()?
        .to_vec1::<u32>()?;
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= classes) {
        return Err(ExecError::Internal(format!(
            "target {bad} is outside {classes} classes"
        )));
    }
    Ok(ids.into_iter().map(|i| i as usize).collect())
}

/// Per row: `(max, log-sum-exp)` of the logits.
fn lse(row: &[f32]) -> (f32, f32) {
    let m = vmath::max(row);
    (m, m + vmath::sum_exp(row, m).ln())
}

/// Mean cross-entropy of `logits [n, v]` against `targets [n]`, as an f32 scalar.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    let ids = targets_of(targets, v)?;
    let total: f64 = with_slice(logits, |ls| {
        let per_row = |r: usize| -> f64 {
            let row = &ls[r * v..(r + 1) * v];
            f64::from(lse(row).1 - row[ids[r]])
        };
        // Rows in parallel, summed in row order: rayon's own `sum` may regroup the additions
        // from run to run, and the loss must repeat bit for bit.
        let losses: Vec<f64> = if n * v >= PAR_MIN {
            (0..n).into_par_iter().map(per_row).collect()
        } else {
            (0..n).map(per_row).collect()
        };
        losses.iter().sum()
    })?;
    Ok(Tensor::new((total / n as f64) as f32, logits.device())?)
}

/// `dlogits = (softmax(logits) - onehot(targets)) * g / n`.
pub fn cross_entropy_grad(logits: &Tensor, targets: &Tensor, g: &Tensor) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    let ids = targets_of(targets, v)?;
    let scale = g.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()? / n as f32;
    let out_v = with_slice(logits, |ls| {
        rows_par(n, v, |r, o| {
            let row = &ls[r * v..(r + 1) * v];
            o.copy_from_slice(row);
            let m = vmath::max(o);
            let sum = vmath::exp_shifted(o, 1.0, m);
            vmath::scale(o, scale / sum);
            o[ids[r]] -= scale;
        })
    })?;
    out(out_v, logits)
}

/// [`cross_entropy_grad`] written over the logits: after it, `logits` holds the gradient
/// (a fused cross-entropy's in-place backward, so the loss backward never holds the logits
/// and their gradient at once). The caller owns the logits' storage: no other live tensor
/// may share it.
pub fn cross_entropy_grad_in_place(logits: &Tensor, targets: &Tensor, g: &Tensor) -> Result<()> {
    let (n, v) = logits.dims2()?;
    let ids = targets_of(targets, v)?;
    let scale = g.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()? / n as f32;
    logits.inplace_op1(&CrossEntropyGradInPlace { ids, scale, v })?;
    Ok(())
}

struct CrossEntropyGradInPlace {
    ids: Vec<usize>,
    scale: f32,
    v: usize,
}

impl candle_core::InplaceOp1 for CrossEntropyGradInPlace {
    fn name(&self) -> &'static str {
        "cross_entropy_grad_in_place"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &candle_core::Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("cross_entropy_grad_in_place takes f32 logits");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("cross_entropy_grad_in_place takes contiguous logits");
        };
        let (v, scale) = (self.v, self.scale);
        let rows = &mut data[start..end];
        if v == 0 || rows.len() != self.ids.len() * v {
            candle_core::bail!(
                "cross_entropy_grad_in_place: {} elements for {} rows of {v}",
                rows.len(),
                self.ids.len()
            );
        }
        let row = |(r, o): (usize, &mut [f32])| {
            let m = vmath::max(o);
            let sum = vmath::exp_shifted(o, 1.0, m);
            vmath::scale(o, scale / sum);
            o[self.ids[r]] -= scale;
        };
        if rows.len() >= PAR_MIN {
            rows.par_chunks_mut(v).enumerate().for_each(row);
        } else {
            rows.chunks_mut(v).enumerate().for_each(row);
        }
        Ok(())
    }
}

/// `1 / sqrt(mean(x^2) + eps)` of one row.
fn rms_inv(row: &[f32], eps: f64) -> f32 {
    let ms = vmath::sum_sq_f64(row) / row.len() as f64;
    (1.0 / (ms + eps).sqrt()) as f32
}

/// Input gradient of `rms_norm(x, w)`: `r * (g*w - xhat * mean(g*w*xhat))` per row.
pub fn rms_norm_grad_input(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64) -> Result<Tensor> {
    let d = *x.dims().last().unwrap_or(&1);
    let rows = x.elem_count() / d.max(1);
    let v = with_slice(x, |xs| {
        with_slice(w, |ws| {
            with_slice(g, |gs| {
                rows_par(rows, d, |r, o| {
                    let (xr, gr) = (&xs[r * d..(r + 1) * d], &gs[r * d..(r + 1) * d]);
                    vmath::rms_norm_grad_row(xr, ws, gr, rms_inv(xr, eps), o);
                })
            })
        })
    })???;
    out(v, x)
}

/// Weight gradient of `rms_norm(x, w)`: `sum over rows of g * xhat`.
pub fn rms_norm_grad_weight(x: &Tensor, g: &Tensor, eps: f64) -> Result<Tensor> {
    let d = *x.dims().last().unwrap_or(&1);
    let rows = x.elem_count() / d.max(1);
    let v = with_slice(x, |xs| {
        with_slice(g, |gs| {
            let partial = |range: std::ops::Range<usize>| -> Vec<f32> {
                let mut acc = vec![0f32; d];
                for r in range {
                    let (xr, gr) = (&xs[r * d..(r + 1) * d], &gs[r * d..(r + 1) * d]);
                    vmath::add_scaled_product(&mut acc, gr, xr, rms_inv(xr, eps));
                }
                acc
            };
            // Fixed chunks summed in a fixed order: the result does not depend on threads.
            let chunk = rows.div_ceil(8).max(1);
            let parts: Vec<Vec<f32>> = (0..rows.div_ceil(chunk))
                .into_par_iter()
                .map(|c| partial(c * chunk..((c + 1) * chunk).min(rows)))
                .collect();
            parts.into_iter().fold(vec![0f32; d], |mut a, p| {
                a.iter_mut().zip(p).for_each(|(x, y)| *x += y);
                a
            })
        })
    })??;
    Ok(Tensor::from_vec(v, d, x.device())?)
}

/// An `n`-element output computed in chunks of 4096, `f(start, out chunk)`, in parallel
/// when there is enough of it.
fn chunks_par(n: usize, f: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    const WIDTH: usize = 4096;
    let mut v = vec![0f32; n];
    let body = |(c, o): (usize, &mut [f32])| f(c * WIDTH, o);
    if n >= PAR_MIN {
        v.par_chunks_mut(WIDTH).enumerate().for_each(body);
    } else {
        v.chunks_mut(WIDTH).enumerate().for_each(body);
    }
    v
}

/// `x * sigmoid(x)`, elementwise.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    let v = with_slice(x, |xs| chunks_par(xs.len(), |i, o| vmath::silu(&xs[i..i + o.len()], o)))?;
    out(v, x)
}

/// `g * silu'(x)` and `g * gelu'(x)` (tanh approximation), elementwise.
pub fn activation_grad(x: &Tensor, g: &Tensor, gelu: bool) -> Result<Tensor> {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    const A: f32 = 0.044_715;
    let v = with_slice(x, |xs| {
        with_slice(g, |gs| {
            chunks_par(xs.len(), |i, o| {
                let (xs, gs) = (&xs[i..i + o.len()], &gs[i..i + o.len()]);
                if !gelu {
                    return vmath::silu_grad(xs, gs, o);
                }
                for ((slot, &x), &g) in o.iter_mut().zip(xs).zip(gs) {
                    let t = (C * (x + A * x * x * x)).tanh();
                    *slot = g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C * (1.0 + 3.0 * A * x * x));
                }
            })
        })
    })??;
    out(v, x)
}

/// Sum of squares of all elements, in f64 (for the global gradient norm). Chunks are summed
/// in a fixed order so the result does not depend on thread timing.
pub fn sum_squares(t: &Tensor) -> Result<f64> {
    with_slice(t, |xs| {
        let parts: Vec<f64> = xs
            .par_chunks(1 << 16)
            .map(|c| {
                // Eight running sums (one dependent f64 add at a time is 3-4x slower than
                // reading the memory), added in a fixed order.
                let mut acc = [0f64; 8];
                let mut lanes = c.chunks_exact(8);
                for l in &mut lanes {
                    for (a, &x) in acc.iter_mut().zip(l) {
                        *a += f64::from(x) * f64::from(x);
                    }
                }
                for (a, &x) in acc.iter_mut().zip(lanes.remainder()) {
                    *a += f64::from(x) * f64::from(x);
                }
                acc.iter().sum::<f64>()
            })
            .collect();
        parts.iter().sum()
    })
}

/// One AdamW update in a single pass: returns the new `(param, m, v)`.
pub fn adamw(
    p: &Tensor,
    g: &Tensor,
    m: Option<&Tensor>,
    v: Option<&Tensor>,
    h: AdamW,
) -> Result<(Tensor, Tensor, Tensor)> {
    let n = p.elem_count();
    let zeros;
    let (m, v) = match (m, v) {
        (Some(m), Some(v)) => (m.clone(), v.clone()),
        _ => {
            zeros = Tensor::zeros(p.dims(), candle_core::DType::F32, p.device())?;
            (zeros.clone(), zeros)
        }
    };
    // Every element of the three outputs is written below, so they start uninitialised
    // (zeroing 3 x 4 bytes per parameter first costs as much again as the update).
    let (mut np, mut nm, mut nv) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    with_slice(p, |ps| {
        with_slice(g, |gs| {
            with_slice(&m, |ms| {
                with_slice(&v, |vs| {
                    const CHUNK: usize = 1 << 14;
                    np.spare_capacity_mut()[..n]
                        .par_chunks_mut(CHUNK)
                        .zip(nm.spare_capacity_mut()[..n].par_chunks_mut(CHUNK))
                        .zip(nv.spare_capacity_mut()[..n].par_chunks_mut(CHUNK))
                        .enumerate()
                        .for_each(|(c, ((op, om), ov))| {
                            let r = c * CHUNK..c * CHUNK + op.len();
                            vmath::adamw(&ps[r.clone()], &gs[r.clone()], &ms[r.clone()], &vs[r], op, om, ov, h);
                        });
                })
            })
        })
    })????;
    // SAFETY: `vmath::adamw` wrote all `n` elements of each (it covers its output slices
    // whole, and the chunks cover `0..n`).
    unsafe {
        np.set_len(n);
        nm.set_len(n);
        nv.set_len(n);
    }
    Ok((out(np, p)?, out(nm, p)?, out(nv, p)?))
}

/// `[a, b, c, d] -> [a, c, b, d]` as a new contiguous tensor, copying runs of `d` elements
/// (candle's general strided copy moves one element at a time).
pub fn swap_dims_1_2(x: &Tensor) -> Result<Tensor> {
    let (a, b, c, d) = x.dims4()?;
    let v = with_slice(x, |xs| {
        let mut o = vec![0f32; a * b * c * d];
        if d > 0 && b > 0 {
            o.par_chunks_mut(b * d).enumerate().for_each(|(ac, chunk)| {
                let (ai, ci) = (ac / c, ac % c);
                for bi in 0..b {
                    let src = ((ai * b + bi) * c + ci) * d;
                    chunk[bi * d..(bi + 1) * d].copy_from_slice(&xs[src..src + d]);
                }
            });
        }
        o
    })?;
    Ok(Tensor::from_vec(v, (a, c, b, d), x.device())?)
}

/// `a + b` or `a * b` of two f32 tensors of one shape, on rayon's threads, into an output
/// that is not zeroed first.
pub fn elementwise(a: &Tensor, b: &Tensor, mul: bool) -> Result<Tensor> {
    let n = a.elem_count();
    if a.dims() != b.dims() {
        return Err(ExecError::Internal(format!(
            "elementwise {:?} with {:?}",
            a.dims(),
            b.dims()
        )));
    }
    const CHUNK: usize = 1 << 14;
    let mut out: Vec<f32> = Vec::with_capacity(n);
    with_slice(a, |xa| {
        with_slice(b, |xb| {
            let body = |(c, o): (usize, &mut [std::mem::MaybeUninit<f32>])| {
                let r = c * CHUNK..c * CHUNK + o.len();
                vmath::elementwise(&xa[r.clone()], &xb[r], o, mul);
            };
            let slots = &mut out.spare_capacity_mut()[..n];
            if n >= PAR_MIN {
                slots.par_chunks_mut(CHUNK).enumerate().for_each(body);
            } else {
                slots.chunks_mut(CHUNK).enumerate().for_each(body);
            }
        })
    })??;
    // SAFETY: the chunks cover 0..n and `vmath::elementwise` writes every element of each.
    unsafe { out.set_len(n) };
    self::out(out, a)
}

/// Row strides (elements) at which a transposed operand is copied with [`PAD`] more.
const ALIAS_STRIDE: usize = 1024;
/// Padding that moves consecutive rows to different cache sets.
const PAD: usize = 16;

/// One row-major `[r, c]` operand of [`matmul`]: its elements and whether to use it
/// transposed.
pub struct Operand<'a> {
    pub data: &'a Tensor,
    pub transposed: bool,
}

/// `a · b` for 2-D f32 operands (each possibly transposed, read in place through strides)
/// into a new row-major `[m, n]` tensor, on all of rayon's threads. The output is not
/// zeroed first: the product writes every element.
pub fn matmul(a: Operand, b: Operand) -> Result<Tensor> {
    let dims = |o: &Operand| -> Result<(usize, usize, usize, usize)> {
        let (r, c) = o.data.dims2()?;
        // (rows, cols, row stride, col stride) of the operand as used.
        Ok(if o.transposed { (c, r, 1, c) } else { (r, c, c, 1) })
    };
    let (m, k, a_rs, a_cs) = dims(&a)?;
    let (k2, n, b_rs, b_cs) = dims(&b)?;
    if k != k2 {
        return Err(ExecError::Internal(format!("matmul of [{m}, {k}] by [{k2}, {n}]")));
    }
    // A transposed right operand (a linear layer's `[out, in]` weight) whose rows lie a
    // multiple of 4 KiB apart is read by gemm's packing one element per row, every access
    // in the same cache set: 3-5x slower than the product itself. A copy with padded rows
    // (bit-identical products: gemm packs the same values) costs one pass over it.
    let padded;
    let (xb_src, b_cs) = if b.transposed && b_cs % ALIAS_STRIDE == 0 && n >= 64 {
        let stride = b_cs + PAD;
        padded = with_slice(b.data, |xb| {
            let mut v = vec![0f32; n * stride];
            v.chunks_mut(stride)
                .zip(xb.chunks(b_cs))
                .for_each(|(d, s)| d[..b_cs].copy_from_slice(s));
            v
        })?;
        (Some(&padded), stride)
    } else {
        (None, b_cs)
    };
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    with_slice(a.data, |xa| {
        with_slice(b.data, |xb| {
            let xb = xb_src.map_or(xb, |v| v.as_slice());
            if m * n == 0 {
                return;
            }
            if k == 0 {
                out.resize(m * n, 0.0);
                return;
            }
            let threads = rayon::current_num_threads();
            let parallelism = if threads > 1 {
                gemm::Parallelism::Rayon(threads)
            } else {
                gemm::Parallelism::None
            };
            // SAFETY: the operand slices hold m x k and k x n elements at the strides given
            // (checked by `dims2` on contiguous tensors); `out` has room for m x n, all of
            // which gemm writes (`read_dst` false), before `set_len`.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    out.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    xa.as_ptr(),
                    a_cs as isize,
                    a_rs as isize,
                    xb.as_ptr(),
                    b_cs as isize,
                    b_rs as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    parallelism,
                );
                out.set_len(m * n);
            }
        })
    })??;
    Ok(Tensor::from_vec(out, (m, n), a.data.device())?)
}

/// `moe_unpermute` with `sum`: row `t` of the output is rows `src[t * k..(t + 1) * k]` of
/// `y` (`[n, d]`) added left to right, one pass over the tokens on rayon's threads. The
/// caller orders each token's rows as the composed kernel adds them (increasing expert), so
/// the sums are its bits.
pub fn gather_sum(y: &Tensor, src: &[u32], k: usize) -> Result<Tensor> {
    let (n, d) = y.dims2()?;
    if k == 0 || !src.len().is_multiple_of(k) {
        return Err(ExecError::Internal(format!(
            "gather_sum of {} rows in groups of {k}",
            src.len()
        )));
    }
    if let Some(&r) = src.iter().find(|&&r| r as usize >= n) {
        return Err(ExecError::Internal(format!("gather_sum of row {r} of {n}")));
    }
    let tokens = src.len() / k;
    let v = with_slice(y, |ys| {
        rows_par(tokens, d, |t, o| {
            let rows = &src[t * k..(t + 1) * k];
            let at = |r: u32| &ys[r as usize * d..(r as usize + 1) * d];
            o.copy_from_slice(at(rows[0]));
            for &r in &rows[1..] {
                o.iter_mut().zip(at(r)).for_each(|(a, b)| *a += *b);
            }
        })
    })?;
    Ok(Tensor::from_vec(v, (tokens, d), y.device())?)
}

/// Rows per task of [`grouped_matmul`]: a run of one expert's rows is cut into blocks of
/// this many so that a few busy experts still spread over every thread.
const GROUP_BLOCK: usize = 128;

/// `grouped_linear` for f32: the rows of `x` (`[rows, in]`) in runs of `counts[e]`, run `e`
/// times weight `ws[e]` (`[out, in]` used transposed when `transposed`, else `[in, out]`),
/// the rows after the runs zero; every block of a run one single-threaded `gemm` on
/// rayon's threads, written straight into one output (no product per expert, no
/// concatenation). The products are [`matmul`]'s bits: each output row is the same dot
/// products in the same order, whichever block computes it. `None` where `matmul` would
/// copy a weight to pad its rows (rows a multiple of 4 KiB apart): the caller takes that
/// path.
pub fn grouped_matmul(x: &Tensor, ws: &[&Tensor], counts: &[usize], transposed: bool) -> Result<Option<Tensor>> {
    let (rows, k) = x.dims2()?;
    let Some(first) = ws.first() else {
        return Err(ExecError::Internal("grouped_matmul without weights".into()));
    };
    let (r, c) = first.dims2()?;
    let (in_dim, n) = if transposed { (c, r) } else { (r, c) };
    if in_dim != k || counts.len() != ws.len() || counts.iter().sum::<usize>() > rows {
        return Err(ExecError::Internal(format!(
            "grouped_matmul of [{rows}, {k}] by {} weights of [{r}, {c}] over {} runs",
            ws.len(),
            counts.len()
        )));
    }
    if transposed && k.is_multiple_of(ALIAS_STRIDE) && n >= 64 {
        return Ok(None);
    }
    let wc: Vec<Tensor> = ws
        .iter()
        .map(|w| {
            if w.dims2()? != (r, c) {
                return Err(ExecError::Internal(format!(
                    "grouped_matmul weights of [{r}, {c}] and {:?}",
                    w.dims()
                )));
            }
            Ok(w.contiguous()?)
        })
        .collect::<Result<_>>()?;
    let guards: Vec<_> = wc.iter().map(|w| w.storage_and_layout()).collect();
    let mut wsl: Vec<&[f32]> = Vec::with_capacity(guards.len());
    for (storage, layout) in &guards {
        let Storage::Cpu(CpuStorage::F32(data)) = &**storage else {
            return Err(ExecError::Internal("fused kernels take f32 CPU tensors".into()));
        };
        let (a, b) = layout
            .contiguous_offsets()
            .ok_or_else(|| ExecError::Internal("not contiguous".into()))?;
        wsl.push(&data[a..b]);
    }
    let (rhs_cs, rhs_rs) = if transposed { (k as isize, 1) } else { (1, n as isize) };
    let mut out = vec![0f32; rows * n];
    with_slice(x, |xs| {
        // (expert, first row, its block of the output)
        let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
        let mut rest = out.as_mut_slice();
        let mut row = 0;
        for (e, &m) in counts.iter().enumerate() {
            let (run, tail) = rest.split_at_mut(m * n);
            rest = tail;
            for (b, block) in run.chunks_mut(GROUP_BLOCK * n.max(1)).enumerate() {
                tasks.push((e, row + b * GROUP_BLOCK, block));
            }
            row += m;
        }
        if n == 0 || k == 0 {
            return;
        }
        tasks.into_par_iter().for_each(|(e, row0, o)| {
            let m = o.len() / n;
            // SAFETY: `x` holds `rows x k` elements and rows `row0..row0 + m` lie inside it
            // (the runs sum to at most `rows`); weight `e` holds `k x n` elements at the
            // strides given; `o` has room for `m x n`, all of which gemm writes.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    o.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    xs[row0 * k..].as_ptr(),
                    1,
                    k as isize,
                    wsl[e].as_ptr(),
                    rhs_cs,
                    rhs_rs,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        });
    })?;
    Ok(Some(Tensor::from_vec(out, (rows, n), x.device())?))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cpu::mask::Mask;
    use candle_core::D;

    /// `a` equals `b` within `tol` relative to `b`'s largest magnitude (at least 1).
    pub(crate) fn close(a: &Tensor, b: &Tensor, tol: f32) {
        assert_eq!(a.dims(), b.dims());
        let d = (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let s = b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1.0);
        assert!(d <= tol * s, "max difference {d} (scale {s})");
    }

    fn randn(dims: &[usize]) -> Tensor {
        Tensor::randn(0f32, 1.0, dims, &Device::Cpu).unwrap()
    }

    #[test]
    fn embedding_grad_equals_index_add_bit_for_bit() {
        let ids: Vec<u32> = (0..97u32).map(|i| (i * 31 + 7) % 13).collect();
        let g = randn(&[97, 24]);
        let got = embedding_grad(&ids, &g, 13, 24).unwrap();
        let idx = Tensor::from_vec(ids.clone(), 97, &Device::Cpu).unwrap();
        let want = Tensor::zeros((13, 24), candle_core::DType::F32, &Device::Cpu)
            .unwrap()
            .index_add(&idx, &g, 0)
            .unwrap();
        let (a, b) = (
            got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert_eq!(a, b);
        assert!(
            embedding_grad(&[13], &randn(&[1, 24]), 13, 24).is_err(),
            "id past the table"
        );
    }

    #[test]
    fn masked_softmax_matches_composed() {
        for (s, t) in [(5, 5), (3, 7), (64, 64)] {
            let x = randn(&[2, 3, s, t]);
            let mask: Vec<f32> = (0..s)
                .flat_map(|i| (0..t).map(move |j| if j > i + t - s { f32::NEG_INFINITY } else { 0.0 }))
                .collect();
            let mask = Tensor::from_vec(mask, (s, t), &Device::Cpu).unwrap();
            let want =
                candle_nn::ops::softmax_last_dim(&x.affine(0.5, 0.0).unwrap().broadcast_add(&mask).unwrap()).unwrap();
            close(&masked_softmax(&x, 0.5, &Mask::Causal).unwrap(), &want, 1e-6);
            let want = candle_nn::ops::softmax_last_dim(&x.affine(0.5, 0.0).unwrap()).unwrap();
            close(&masked_softmax(&x, 0.5, &Mask::Full).unwrap(), &want, 1e-6);
        }
    }

    #[test]
    fn softmax_backward_matches_composed() {
        let p = candle_nn::ops::softmax_last_dim(&randn(&[4, 9, 33])).unwrap();
        let g = randn(&[4, 9, 33]);
        let want = (&p
            * g.broadcast_sub(&(&g * &p).unwrap().sum_keepdim(D::Minus1).unwrap())
                .unwrap())
        .unwrap();
        close(&softmax_backward(&p, &g).unwrap(), &want, 1e-6);
    }

    #[test]
    fn cross_entropy_and_grad_match_composed() {
        let (n, v) = (300, 77);
        let logits = randn(&[n, v]);
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 31) % v as u32).collect();
        let targets = Tensor::from_vec(ids, n, &Device::Cpu).unwrap();
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
        let want = (logp
            .gather(&targets.reshape((n, 1)).unwrap(), 1)
            .unwrap()
            .sum_all()
            .unwrap()
            * (-1.0 / n as f64))
            .unwrap();
        close(&cross_entropy(&logits, &targets).unwrap(), &want, 1e-5);
        let g = Tensor::new(2.0f32, &Device::Cpu).unwrap();
        let onehot = Tensor::zeros((n, v), candle_core::DType::F32, &Device::Cpu)
            .unwrap()
            .scatter_add(
                &targets.reshape((n, 1)).unwrap(),
                &Tensor::ones((n, 1), candle_core::DType::F32, &Device::Cpu).unwrap(),
                1,
            )
            .unwrap();
        let want = ((candle_nn::ops::softmax_last_dim(&logits).unwrap() - onehot).unwrap() * (2.0 / n as f64)).unwrap();
        close(&cross_entropy_grad(&logits, &targets, &g).unwrap(), &want, 1e-6);
    }

    #[test]
    fn swap_dims_1_2_matches_transpose() {
        let x = randn(&[2, 5, 3, 7]);
        let want = x.transpose(1, 2).unwrap().contiguous().unwrap();
        let got = swap_dims_1_2(&x).unwrap();
        assert!(got.is_contiguous());
        close(&got, &want, 0.0);
    }

    #[test]
    fn elementwise_matches_candle() {
        for dims in [&[3usize, 5][..], &[4, 256, 384]] {
            let (a, b) = (randn(dims), randn(dims));
            close(&elementwise(&a, &b, false).unwrap(), &(&a + &b).unwrap(), 0.0);
            close(&elementwise(&a, &b, true).unwrap(), &(&a * &b).unwrap(), 0.0);
        }
        let empty = randn(&[0, 7]);
        assert_eq!(elementwise(&empty, &empty, true).unwrap().dims(), &[0, 7]);
    }

    #[test]
    fn matmul_matches_candle_for_every_transposition() {
        for (m, k, n) in [(1, 1, 1), (37, 5, 70), (64, 384, 130), (3, 0, 4)] {
            let (a, b) = (randn(&[m, k]), randn(&[k, n]));
            let (at, bt) = (
                a.t().unwrap().contiguous().unwrap(),
                b.t().unwrap().contiguous().unwrap(),
            );
            let want = if k == 0 {
                Tensor::zeros((m, n), candle_core::DType::F32, &Device::Cpu).unwrap()
            } else {
                a.matmul(&b).unwrap()
            };
            let op = |t, transposed| Operand { data: t, transposed };
            for (x, y) in [
                (op(&a, false), op(&b, false)),
                (op(&at, true), op(&b, false)),
                (op(&a, false), op(&bt, true)),
                (op(&at, true), op(&bt, true)),
            ] {
                close(&matmul(x, y).unwrap(), &want, 1e-5);
            }
        }
    }

    #[test]
    fn rms_norm_grads_match_composed() {
        let (x, w, g) = (randn(&[3, 50, 64]), randn(&[64]), randn(&[3, 50, 64]));
        let r = (x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap() + 1e-5)
            .unwrap()
            .sqrt()
            .unwrap()
            .recip()
            .unwrap();
        let xhat = x.broadcast_mul(&r).unwrap();
        let gw = g.broadcast_mul(&w).unwrap();
        let m = (&gw * &xhat).unwrap().mean_keepdim(D::Minus1).unwrap();
        let want = (gw - xhat.broadcast_mul(&m).unwrap())
            .unwrap()
            .broadcast_mul(&r)
            .unwrap();
        close(&rms_norm_grad_input(&x, &w, &g, 1e-5).unwrap(), &want, 1e-5);
        let want = (&g * &xhat)
            .unwrap()
            .sum_keepdim(0)
            .unwrap()
            .sum_keepdim(1)
            .unwrap()
            .flatten_all()
            .unwrap();
        close(&rms_norm_grad_weight(&x, &g, 1e-5).unwrap(), &want, 1e-5);
    }

    #[test]
    fn activation_grads_match_composed() {
        let (x, g) = (randn(&[7, 1000]), randn(&[7, 1000]));
        let s = candle_nn::ops::sigmoid(&x).unwrap();
        let want = (&g * (&s * ((&x * (1.0 - &s).unwrap()).unwrap() + 1.0).unwrap()).unwrap()).unwrap();
        close(&activation_grad(&x, &g, false).unwrap(), &want, 1e-5);
        close(&silu(&x).unwrap(), &x.silu().unwrap(), 1e-6);
        // gelu: check against a central difference of candle's own gelu.
        let h = 1e-2;
        let num = ((x.affine(1.0, h).unwrap().gelu().unwrap() - x.affine(1.0, -h).unwrap().gelu().unwrap()).unwrap()
            * (1.0 / (2.0 * h)))
            .unwrap();
        close(&activation_grad(&x, &g, true).unwrap(), &(&g * num).unwrap(), 1e-3);
    }
}
