//! Fused f32 CPU kernels for scaled dot-product attention and its gradients.
//!
//! The IR's attention ops work per head on `q [b, s, h, d]`, `k`, `v [b, t, kv, d]`
//! (grouped-query: query head `j` reads k/v head `j / (h / kv)`) and on probabilities and
//! score gradients `[b, h, s, t]`. The composed versions in `kernels` run them as batched
//! candle matmuls over copied, head-first operands, always over the whole `s x t` square.
//! Here each (batch, head) is one task on the rayon pool, its matmuls are single-threaded
//! `gemm` calls that read q, k, v and the output gradient in place through their strides,
//! and work is done in blocks of [`BLOCK`] query rows that stop at the last key any row of
//! the block can see. Under a causal mask that skips the masked upper triangle: at
//! `s = t = 256` the blocks cover 62.5% of the square.
//!
//! The backward ops do not carry the mask; they find each row's extent (its last non-zero
//! probability) instead, which is exact: a skipped term is a zero probability times a
//! finite value.

use crate::cpu::fused::with_slice;
use crate::cpu::mask::Mask;
use crate::cpu::vmath;
use crate::ExecError;
use candle_core::Tensor;
use gemm::Parallelism;
use rayon::prelude::*;

type Result<T> = std::result::Result<T, ExecError>;

/// Query rows per block.
const BLOCK: usize = 64;

/// A strided view of an f32 matrix inside a slice; constructing one checks that every
/// element it addresses lies inside the slice.
#[derive(Clone, Copy)]
struct View {
    ptr: *const f32,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl View {
    fn new(data: &[f32], offset: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> View {
        if rows > 0 && cols > 0 {
            let last = offset + (rows - 1) * rs + (cols - 1) * cs;
            assert!(last < data.len(), "matrix view out of bounds");
        }
        View {
            ptr: data.as_ptr().wrapping_add(offset),
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// The transpose (same elements).
    fn t(self) -> View {
        View {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32, usize);
// SAFETY: every task writes only its own heads' elements (see the callers).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn new(v: &mut [f32]) -> OutPtr {
        OutPtr(v.as_mut_ptr(), v.len())
    }

    /// A view for writing; checked against the buffer's length like [`View::new`].
    fn view(self, offset: usize, rows: usize, cols: usize, rs: usize) -> View {
        if rows > 0 && cols > 0 {
            assert!(
                offset + (rows - 1) * rs + cols - 1 < self.1,
                "output view out of bounds"
            );
        }
        View {
            ptr: self.0.wrapping_add(offset),
            rows,
            cols,
            rs,
            cs: 1,
        }
    }
}

/// `dst = alpha * a b` (or `dst += alpha * a b` when `accumulate`), single-threaded.
///
/// # Safety
/// `dst` must be a view of memory this thread may write and no other thread touches
/// meanwhile; `a` and `b` views of live memory (all views are bounds-checked on creation).
unsafe fn mm(dst: View, a: View, b: View, alpha: f32, accumulate: bool) {
    assert!(
        a.rows == dst.rows && b.cols == dst.cols && a.cols == b.rows,
        "matmul shapes"
    );
    if dst.rows == 0 || dst.cols == 0 {
        return;
    }
    if a.cols == 0 {
        if !accumulate {
            for i in 0..dst.rows {
                for j in 0..dst.cols {
                    *(dst.ptr as *mut f32).add(i * dst.rs + j * dst.cs) = 0.0;
                }
            }
        }
        return;
    }
    gemm::gemm(
        dst.rows,
        dst.cols,
        a.cols,
        dst.ptr as *mut f32,
        dst.cs as isize,
        dst.rs as isize,
        accumulate,
        a.ptr,
        a.cs as isize,
        a.rs as isize,
        b.ptr,
        b.cs as isize,
        b.rs as isize,
        1.0,
        alpha,
        false,
        false,
        false,
        Parallelism::None,
    );
}

/// Softmax of `scale * row[..n]` in place; the rest of the row becomes 0.
fn softmax_row(row: &mut [f32], n: usize, scale: f32) {
    let (head, rest) = row.split_at_mut(n);
    // `scale > 0`, so the largest scaled score is the scaled largest score.
    let m = vmath::max(head) * scale;
    let sum = vmath::exp_shifted(head, scale, m);
    vmath::scale(head, 1.0 / sum);
    rest.fill(0.0);
}

/// Shapes of one attention call.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    s: usize,
    t: usize,
    h: usize,
    kv: usize,
    d: usize,
}

impl Dims {
    fn of(q: &Tensor, k: &Tensor) -> Result<Dims> {
        let (b, s, h, d) = q.dims4()?;
        let (_, t, kv, _) = k.dims4()?;
        if kv == 0 || h % kv != 0 {
            return Err(ExecError::Internal(format!("{h} query heads over {kv} k/v heads")));
        }
        Ok(Dims { b, s, t, h, kv, d })
    }
    /// Query head `hi` of batch `bi` in a `[b, s, h, d]` tensor: (offset, row stride).
    fn q_head(&self, bi: usize, hi: usize) -> (usize, usize) {
        ((bi * self.s * self.h + hi) * self.d, self.h * self.d)
    }
    /// The k/v head that query head `hi` reads, in a `[b, t, kv, d]` tensor.
    fn kv_head(&self, bi: usize, hi: usize) -> (usize, usize) {
        let c = hi / (self.h / self.kv);
        ((bi * self.t * self.kv + c) * self.d, self.kv * self.d)
    }
    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }
}

/// Last non-zero column + 1 of each row of an `s x t` matrix.
fn extents(m: &[f32], t: usize) -> Vec<usize> {
    m.chunks(t.max(1)).map(vmath::extent).collect()
}

/// The probabilities of query rows `r0..r1` of head `hi` of batch `bi` into `p` (one row
/// of `t` per query row): scaled scores up to the block's last visible key, softmax, zeros
/// beyond each row's visible keys. Returns that last visible key + 1.
#[allow(clippy::too_many_arguments)]
fn probs_block(
    qs: &[f32],
    ks: &[f32],
    dm: Dims,
    bi: usize,
    hi: usize,
    r0: usize,
    r1: usize,
    mask: &Mask,
    p: &mut [f32],
) -> usize {
    let Dims { s, t, d, .. } = dm;
    let (qo, qrs) = dm.q_head(bi, hi);
    let (ko, krs) = dm.kv_head(bi, hi);
    let cols = mask.block_keys(r0, r1, s, t);
    // SAFETY: `p` is borrowed mutably for the call; the view is checked against it.
    unsafe {
        mm(
            OutPtr::new(p).view(0, r1 - r0, cols, t),
            View::new(qs, qo + r0 * qrs, r1 - r0, d, qrs, 1),
            View::new(ks, ko, cols, d, krs, 1).t(),
            1.0,
            false,
        )
    };
    for i in r0..r1 {
        softmax_row(&mut p[(i - r0) * t..(i - r0 + 1) * t], mask.keys(i, s, t), dm.scale());
    }
    cols
}

/// Softmax of the scaled scores `q k^T / sqrt(d)`, `[b, h, s, t]`.
pub fn probs(q: &Tensor, k: &Tensor, mask: &Mask) -> Result<Tensor> {
    let dm = Dims::of(q, k)?;
    let Dims { b, s, t, h, .. } = dm;
    let mut out = vec![0f32; b * h * s * t];
    with_slice(q, |qs| {
        with_slice(k, |ks| {
            out.par_chunks_mut((s * t).max(1)).enumerate().for_each(|(bh, p)| {
                for r0 in (0..s).step_by(BLOCK) {
                    let r1 = (r0 + BLOCK).min(s);
                    probs_block(qs, ks, dm, bh / h, bh % h, r0, r1, mask, &mut p[r0 * t..r1 * t]);
                }
            })
        })
    })??;
    Ok(Tensor::from_vec(out, (b, h, s, t), q.device())?)
}

/// Attention output `softmax(q k^T / sqrt(d)) v`, `[b, s, h, d]`, without keeping the
/// probabilities.
pub fn forward(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask) -> Result<Tensor> {
    let dm = Dims::of(q, k)?;
    let Dims { b, s, t, h, d, .. } = dm;
    let mut out = vec![0f32; b * s * h * d];
    let o = OutPtr::new(&mut out);
    with_slice(q, |qs| {
        with_slice(k, |ks| {
            with_slice(v, |vs| {
                (0..b * h).into_par_iter().for_each_init(
                    || vec![0f32; BLOCK * t],
                    |p, bh| {
                        let (bi, hi) = (bh / h, bh % h);
                        let (oo, ors) = dm.q_head(bi, hi);
                        let (vo, vrs) = dm.kv_head(bi, hi);
                        for r0 in (0..s).step_by(BLOCK) {
                            let r1 = (r0 + BLOCK).min(s);
                            let cols = probs_block(qs, ks, dm, bi, hi, r0, r1, mask, &mut p[..(r1 - r0) * t]);
                            // SAFETY: the output rows written are head `hi` of batch `bi`,
                            // which no other task writes.
                            unsafe {
                                mm(
                                    o.view(oo + r0 * ors, r1 - r0, d, ors),
                                    View::new(p, 0, r1 - r0, cols, t, 1),
                                    View::new(vs, vo, cols, d, vrs, 1),
                                    1.0,
                                    false,
                                )
                            };
                        }
                    },
                )
            })
        })
    })???;
    Ok(Tensor::from_vec(out, (b, s, h, d), q.device())?)
}

/// Attention's gradients `[dq, dk, dv]` from `q [b, s, h, d]`, `k`, `v [b, t, kv, d]` and
/// the output gradient `dy [b, s, h, d]`, without the `[b, h, s, t]` probabilities: one
/// task per (batch, k/v head) runs each of its query heads in blocks of [`BLOCK`] rows,
/// recomputing the block's probabilities into a `BLOCK x t` scratch row set, making the
/// score gradient in a second one, writing the block's dq rows and summing its dk and dv
/// rows for the k/v head (which only this task writes). The same blocks, in the same order,
/// as [`probs`], [`grad_scores`], [`grad_q`], [`grad_k`] and [`grad_v`] one after another.
pub fn backward(q: &Tensor, k: &Tensor, v: &Tensor, dy: &Tensor, mask: &Mask) -> Result<[Tensor; 3]> {
    let dm = Dims::of(q, k)?;
    let Dims { b, s, t, h, kv, d } = dm;
    let group = h / kv;
    let mut dq = vec![0f32; b * s * h * d];
    let mut dk = vec![0f32; b * t * kv * d];
    let mut dv = vec![0f32; b * t * kv * d];
    let (oq, ok, ov) = (OutPtr::new(&mut dq), OutPtr::new(&mut dk), OutPtr::new(&mut dv));
    with_slice(q, |qs| {
        with_slice(k, |ks| {
            with_slice(v, |vs| {
                with_slice(dy, |gs| {
                    (0..b * kv).into_par_iter().for_each_init(
                        || (vec![0f32; BLOCK * t], vec![0f32; BLOCK * t]),
                        |(p, ds), bc| {
                            let (bi, c) = (bc / kv, bc % kv);
                            for hi in c * group..(c + 1) * group {
                                let (qo, qrs) = dm.q_head(bi, hi);
                                let (ko, krs) = dm.kv_head(bi, hi);
                                for r0 in (0..s).step_by(BLOCK) {
                                    let r1 = (r0 + BLOCK).min(s);
                                    let rows = r1 - r0;
                                    let cols = probs_block(qs, ks, dm, bi, hi, r0, r1, mask, &mut p[..rows * t]);
                                    let gb = View::new(gs, qo + r0 * qrs, rows, d, qrs, 1);
                                    // SAFETY: dk and dv rows of k/v head `c` of batch `bi` and dq
                                    // rows of query head `hi` are this task's alone; `p` and `ds`
                                    // are its own scratch.
                                    unsafe {
                                        // dv += p^T dy
                                        mm(
                                            ov.view(ko, cols, d, krs),
                                            View::new(p, 0, rows, cols, t, 1).t(),
                                            gb,
                                            1.0,
                                            true,
                                        );
                                        // dp = dy v^T
                                        mm(
                                            OutPtr::new(ds).view(0, rows, cols, t),
                                            gb,
                                            View::new(vs, ko, cols, d, krs, 1).t(),
                                            1.0,
                                            false,
                                        );
                                    }
                                    for i in 0..rows {
                                        let (prow, drow) = (&p[i * t..i * t + cols], &mut ds[i * t..i * t + cols]);
                                        let dot = vmath::dot(prow, drow);
                                        for (x, &pv) in drow.iter_mut().zip(prow) {
                                            *x = pv * (*x - dot);
                                        }
                                    }
                                    let dsb = View::new(ds, 0, rows, cols, t, 1);
                                    // SAFETY: as above.
                                    unsafe {
                                        // dq = ds k / sqrt(d)
                                        mm(
                                            oq.view(qo + r0 * qrs, rows, d, qrs),
                                            dsb,
                                            View::new(ks, ko, cols, d, krs, 1),
                                            dm.scale(),
                                            false,
                                        );
                                        // dk += ds^T q / sqrt(d)
                                        mm(
                                            ok.view(ko, cols, d, krs),
                                            dsb.t(),
                                            View::new(qs, qo + r0 * qrs, rows, d, qrs, 1),
                                            dm.scale(),
                                            true,
                                        );
                                    }
                                }
                            }
                        },
                    )
                })
            })
        })
    })????;
    let dev = q.device();
    Ok([
        Tensor::from_vec(dq, (b, s, h, d), dev)?,
        Tensor::from_vec(dk, (b, t, kv, d), dev)?,
        Tensor::from_vec(dv, (b, t, kv, d), dev)?,
    ])
}

/// `dv [b, t, kv, d]`: for each k/v head, the sum over its query heads of `p^T g`, from the
/// probabilities `p [b, h, s, t]` and the output gradient `g [b, s, h, d]`.
pub fn grad_v(p: &Tensor, g: &Tensor, kv: usize) -> Result<Tensor> {
    let (b, h, s, t) = p.dims4()?;
    let d = g.dim(3)?;
    weighted_sum_t(p, g, Dims { b, s, t, h, kv, d }, 1.0)
}

/// `dk [b, t, kv, d]`: the sum over each k/v head's query heads of `ds^T q / sqrt(d)`.
pub fn grad_k(ds: &Tensor, q: &Tensor, kv: usize) -> Result<Tensor> {
    let (b, h, s, t) = ds.dims4()?;
    let d = q.dim(3)?;
    let dm = Dims { b, s, t, h, kv, d };
    weighted_sum_t(ds, q, dm, dm.scale())
}

/// `alpha * sum_{heads of kv head c} m_h^T x_h` for `m [b, h, s, t]`, `x [b, s, h, d]`,
/// into `[b, t, kv, d]`. One task per (batch, k/v head).
fn weighted_sum_t(m: &Tensor, x: &Tensor, dm: Dims, alpha: f32) -> Result<Tensor> {
    let Dims { b, s, t, h, kv, d } = dm;
    if kv == 0 || h % kv != 0 {
        return Err(ExecError::Internal(format!("{h} query heads over {kv} k/v heads")));
    }
    let group = h / kv;
    let mut out = vec![0f32; b * t * kv * d];
    let o = OutPtr::new(&mut out);
    with_slice(m, |ms| {
        with_slice(x, |xs| {
            (0..b * kv).into_par_iter().for_each(|bc| {
                let (bi, c) = (bc / kv, bc % kv);
                let (oo, ors) = ((bi * t * kv + c) * d, kv * d);
                for hi in c * group..(c + 1) * group {
                    let mo = (bi * h + hi) * s * t;
                    let ext = extents(&ms[mo..mo + s * t], t);
                    let (xo, xrs) = dm.q_head(bi, hi);
                    for r0 in (0..s).step_by(BLOCK) {
                        let r1 = (r0 + BLOCK).min(s);
                        let cols = ext[r0..r1].iter().copied().max().unwrap_or(0);
                        // SAFETY: this task alone writes k/v head `c` of batch `bi`.
                        unsafe {
                            mm(
                                o.view(oo, cols, d, ors),
                                View::new(ms, mo + r0 * t, r1 - r0, cols, t, 1).t(),
                                View::new(xs, xo + r0 * xrs, r1 - r0, d, xrs, 1),
                                alpha,
                                true,
                            )
                        };
                    }
                }
            })
        })
    })??;
    Ok(Tensor::from_vec(out, (b, t, kv, d), m.device())?)
}

/// Gradient of the (unscaled) scores, `[b, h, s, t]`: `p * (dp - rowsum(dp * p))` with
/// `dp = g v^T`, from `p [b, h, s, t]`, `g [b, s, h, d]` and `v [b, t, kv, d]`.
pub fn grad_scores(p: &Tensor, g: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, h, s, t) = p.dims4()?;
    let (_, _, kv, d) = v.dims4()?;
    let dm = Dims { b, s, t, h, kv, d };
    if kv == 0 || h % kv != 0 {
        return Err(ExecError::Internal(format!("{h} query heads over {kv} k/v heads")));
    }
    let mut out = vec![0f32; b * h * s * t];
    with_slice(p, |ps| {
        with_slice(g, |gs| {
            with_slice(v, |vs| {
                out.par_chunks_mut((s * t).max(1)).enumerate().for_each(|(bh, ds)| {
                    let (bi, hi) = (bh / h, bh % h);
                    let po = bh * s * t;
                    let pr = &ps[po..po + s * t];
                    let ext = extents(pr, t);
                    let (go, grs) = dm.q_head(bi, hi);
                    let (vo, vrs) = dm.kv_head(bi, hi);
                    for r0 in (0..s).step_by(BLOCK) {
                        let r1 = (r0 + BLOCK).min(s);
                        let cols = ext[r0..r1].iter().copied().max().unwrap_or(0);
                        // SAFETY: `ds` is this task's own chunk.
                        unsafe {
                            mm(
                                OutPtr::new(ds).view(r0 * t, r1 - r0, cols, t),
                                View::new(gs, go + r0 * grs, r1 - r0, d, grs, 1),
                                View::new(vs, vo, cols, d, vrs, 1).t(),
                                1.0,
                                false,
                            )
                        };
                        for i in r0..r1 {
                            let (prow, drow) = (&pr[i * t..i * t + cols], &mut ds[i * t..i * t + cols]);
                            let dot = vmath::dot(prow, drow);
                            for (x, &pv) in drow.iter_mut().zip(prow) {
                                *x = pv * (*x - dot);
                            }
                        }
                    }
                })
            })
        })
    })???;
    Ok(Tensor::from_vec(out, (b, h, s, t), p.device())?)
}

/// `dq [b, s, h, d] = ds k / sqrt(d)` from `ds [b, h, s, t]` and `k [b, t, kv, d]`.
pub fn grad_q(ds: &Tensor, k: &Tensor) -> Result<Tensor> {
    let (b, h, s, t) = ds.dims4()?;
    let (_, _, kv, d) = k.dims4()?;
    let dm = Dims { b, s, t, h, kv, d };
    if kv == 0 || h % kv != 0 {
        return Err(ExecError::Internal(format!("{h} query heads over {kv} k/v heads")));
    }
    let mut out = vec![0f32; b * s * h * d];
    let o = OutPtr::new(&mut out);
    with_slice(ds, |dss| {
        with_slice(k, |ks| {
            (0..b * h).into_par_iter().for_each(|bh| {
                let (bi, hi) = (bh / h, bh % h);
                let mo = bh * s * t;
                let ext = extents(&dss[mo..mo + s * t], t);
                let (oo, ors) = dm.q_head(bi, hi);
                let (ko, krs) = dm.kv_head(bi, hi);
                for r0 in (0..s).step_by(BLOCK) {
                    let r1 = (r0 + BLOCK).min(s);
                    let cols = ext[r0..r1].iter().copied().max().unwrap_or(0);
                    // SAFETY: this task alone writes query head `hi` of batch `bi`.
                    unsafe {
                        mm(
                            o.view(oo + r0 * ors, r1 - r0, d, ors),
                            View::new(dss, mo + r0 * t, r1 - r0, cols, t, 1),
                            View::new(ks, ko, cols, d, krs, 1),
                            dm.scale(),
                            false,
                        )
                    };
                }
            })
        })
    })??;
    Ok(Tensor::from_vec(out, (b, s, h, d), ds.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::fused::tests::close;
    use candle_core::{Device, D};

    fn randn(dims: &[usize], seed: u64) -> Tensor {
        // Deterministic values without a global RNG: a scrambled counter mapped to [-1, 1).
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n as u64)
            .map(|i| {
                let x = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
                let x = (x ^ (x >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    /// `[b, s, h, d] -> [b, h, s, d]`, with k/v heads repeated to `h` query heads.
    fn heads(x: &Tensor, h: usize) -> Tensor {
        let x = x.transpose(1, 2).unwrap().contiguous().unwrap();
        let (b, kv, s, d) = x.dims4().unwrap();
        x.unsqueeze(2)
            .unwrap()
            .broadcast_as((b, kv, h / kv, s, d))
            .unwrap()
            .reshape((b, h, s, d))
            .unwrap()
    }

    /// The composed reference: every head's full `s x t` products through candle.
    struct Reference {
        p: Tensor,
        out: Tensor,
    }

    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Reference {
        let (_, s, h, d) = q.dims4().unwrap();
        let t = k.dim(1).unwrap();
        let (qh, kh, vh) = (heads(q, h), heads(k, h), heads(v, h));
        let mut scores = (qh.matmul(&kh.transpose(2, 3).unwrap()).unwrap() / (d as f64).sqrt()).unwrap();
        if causal {
            let mask: Vec<f32> = (0..s)
                .flat_map(|i| (0..t).map(move |j| if j + s > i + t { f32::NEG_INFINITY } else { 0.0 }))
                .collect();
            scores = scores
                .broadcast_add(&Tensor::from_vec(mask, (s, t), &Device::Cpu).unwrap())
                .unwrap();
        }
        let p = candle_nn::ops::softmax_last_dim(&scores).unwrap();
        let out = p.matmul(&vh).unwrap().transpose(1, 2).unwrap().contiguous().unwrap();
        Reference { p, out }
    }

    /// Sums `[b, h, t, d]` over each k/v head's query heads into `[b, t, kv, d]`.
    fn group_sum(x: &Tensor, kv: usize) -> Tensor {
        let (b, h, t, d) = x.dims4().unwrap();
        x.reshape((b, kv, h / kv, t, d))
            .unwrap()
            .sum(2)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    }

    #[test]
    fn kernels_match_the_composed_products() {
        // (b, s, t, h, kv, d): blocks that end mid-way, GQA and MHA, causal and not, one
        // query row against many keys.
        let cases = [
            (2, 5, 5, 2, 1, 4),
            (1, 70, 70, 4, 2, 8),
            (2, 130, 130, 6, 2, 16),
            (1, 3, 9, 3, 3, 5),
            (1, 1, 17, 2, 1, 8),
        ];
        for (n, &(b, s, t, h, kv, d)) in cases.iter().enumerate() {
            let seed = n as u64 * 10;
            let (q, k, v) = (
                randn(&[b, s, h, d], seed),
                randn(&[b, t, kv, d], seed + 1),
                randn(&[b, t, kv, d], seed + 2),
            );
            let g = randn(&[b, s, h, d], seed + 3);
            for causal in [true, false] {
                let want = reference(&q, &k, &v, causal);
                let mask = Mask::of(causal, None, 0, s);
                let p = probs(&q, &k, &mask).unwrap();
                close(&p, &want.p, 1e-5);
                close(&forward(&q, &k, &v, &mask).unwrap(), &want.out, 1e-5);

                let gh = g.transpose(1, 2).unwrap().contiguous().unwrap();
                let dv = group_sum(&want.p.transpose(2, 3).unwrap().matmul(&gh).unwrap(), kv);
                close(&grad_v(&p, &g, kv).unwrap(), &dv, 1e-5);

                let dp = gh.matmul(&heads(&v, h).transpose(2, 3).unwrap()).unwrap();
                let row = (&dp * &want.p).unwrap().sum_keepdim(D::Minus1).unwrap();
                let ds_want = (&want.p * dp.broadcast_sub(&row).unwrap()).unwrap();
                let ds = grad_scores(&p, &g, &v).unwrap();
                close(&ds, &ds_want, 1e-5);

                let scale = 1.0 / (d as f64).sqrt();
                let dq = (ds_want.matmul(&heads(&k, h)).unwrap() * scale)
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap()
                    .contiguous()
                    .unwrap();
                close(&grad_q(&ds, &k).unwrap(), &dq, 1e-5);
                let qh = q.transpose(1, 2).unwrap().contiguous().unwrap();
                let dk = (group_sum(&ds_want.transpose(2, 3).unwrap().matmul(&qh).unwrap(), kv) * scale).unwrap();
                close(&grad_k(&ds, &q, kv).unwrap(), &dk, 1e-5);
            }
        }
    }

    #[test]
    fn causal_blocks_skip_only_masked_keys() {
        // Every probability above the diagonal is exactly zero, every row sums to one.
        let (q, k) = (randn(&[1, 150, 2, 8], 7), randn(&[1, 150, 1, 8], 8));
        let p = probs(&q, &k, &Mask::Causal).unwrap();
        let rows = p.reshape((300, 150)).unwrap().to_vec2::<f32>().unwrap();
        for (r, row) in rows.iter().enumerate() {
            let i = r % 150;
            assert!(row[i + 1..].iter().all(|&x| x == 0.0), "row {i} sees the future");
            assert!(row[..=i].iter().all(|&x| x > 0.0));
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
    }
}
