//! Vectorised f32 row kernels: `exp` and what is built on it (softmax, log-sum-exp, silu
//! and its gradient), for the fused CPU kernels.
//!
//! `exp` is a range reduction to `[-ln 2 / 2, ln 2 / 2]` and a degree-6 polynomial
//! (Cephes' `expf` coefficients), written with plain arithmetic so that LLVM vectorises
//! the loops that call it; libm's `expf` is a call per element. It is within 2 ulp of the
//! correctly rounded result over the normal range (checked below against `f32::exp`).
//! Each kernel is compiled three times, for AVX-512, for AVX2 + FMA and for the baseline
//! target, and picks the widest the CPU has at run time. The versions compute the same
//! IEEE operations in the same order (`mul_add` is a fused multiply-add everywhere, in
//! software where the CPU has none; sums use 16 lane accumulators added in a fixed order),
//! so they give the same bits.

/// Compiles `body` once per instruction set and dispatches on what the CPU supports.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has the features `v4` was compiled for.
                    return unsafe { v4($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: as above, for `v3`.
                    return unsafe { v3($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

use crate::adamw::AdamW;
use std::mem::MaybeUninit;

const LANES: usize = 16;

/// `e^x`. Overflows to infinity above `ln(f32::MAX)`, flushes to 0 below the smallest
/// subnormal's log, and keeps NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const HI: f32 = 88.722_83;
    const LO: f32 = -103.972_08;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts: `n * LN2_HI` is exact for |n| < 2^9.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // NaN stays NaN.
    let xc = x.clamp(LO, HI);
    // Round to the nearest integer by adding 1.5 * 2^23: the sum's low mantissa bits are
    // the integer (a float-to-int `as` would saturate lane by lane and not vectorise).
    const MAGIC: f32 = 12_582_912.0;
    let t = xc.mul_add(LOG2E, MAGIC);
    let n = t - MAGIC;
    let ni = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
    let mut p = 1.987_569_1e-4_f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let y = p.mul_add(r * r, r) + 1.0;
    // 2^n in two factors, so that n = 128 and subnormal results need no special case.
    let (n1, n2) = (ni >> 1, ni - (ni >> 1));
    let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((n2 + 127) as u32) << 23);
    let y = y * s1 * s2;
    if x > HI {
        f32::INFINITY
    } else if x < LO {
        0.0
    } else {
        y
    }
}

/// `1 / (1 + e^-x)`.
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

multiversion! {
    /// Largest element (`-inf` for an empty row; NaN-free rows only).
    pub fn max(row: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; LANES];
        let chunks = row.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for l in 0..LANES {
                acc[l] = acc[l].max(c[l]);
            }
        }
        tail.iter().fold(acc.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)), |a, &b| a.max(b))
    }
}

multiversion! {
    /// `row[j] = e^(scale * row[j] - shift)` in place; returns the sum of the new row.
    pub fn exp_shifted(row: &mut [f32], scale: f32, shift: f32) -> f32 {
        let mut acc = [0f32; LANES];
        let mut chunks = row.chunks_exact_mut(LANES);
        for c in &mut chunks {
            for l in 0..LANES {
                let e = exp(c[l].mul_add(scale, -shift));
                c[l] = e;
                acc[l] += e;
            }
        }
        let mut sum = acc.iter().sum::<f32>();
        for x in chunks.into_remainder() {
            *x = exp(x.mul_add(scale, -shift));
            sum += *x;
        }
        sum
    }
}

multiversion! {
    /// `sum_j e^(row[j] - shift)`.
    pub fn sum_exp(row: &[f32], shift: f32) -> f32 {
        let mut acc = [0f32; LANES];
        let chunks = row.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for l in 0..LANES {
                acc[l] += exp(c[l] - shift);
            }
        }
        acc.iter().sum::<f32>() + tail.iter().map(|&x| exp(x - shift)).sum::<f32>()
    }
}

multiversion! {
    /// `out[j] *= k`.
    pub fn scale(out: &mut [f32], k: f32) {
        for o in out.iter_mut() {
            *o *= k;
        }
    }
}

multiversion! {
    /// `sum_j a[j] * b[j]`.
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (a, b) = (&a[..n], &b[..n]);
        let mut acc = [0f32; LANES];
        let full = n - n % LANES;
        for (x, y) in a[..full].chunks_exact(LANES).zip(b[..full].chunks_exact(LANES)) {
            for l in 0..LANES {
                acc[l] = x[l].mul_add(y[l], acc[l]);
            }
        }
        acc.iter().sum::<f32>() + (full..n).map(|j| a[j] * b[j]).sum::<f32>()
    }
}

multiversion! {
    /// `out = x * sigmoid(x)`.
    pub fn silu(x: &[f32], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = v * sigmoid(v);
        }
    }
}

multiversion! {
    /// `out = g * silu'(x)`, with `silu'(x) = s (1 + x (1 - s))`, `s = sigmoid(x)`.
    pub fn silu_grad(x: &[f32], g: &[f32], out: &mut [f32]) {
        for ((o, &v), &gv) in out.iter_mut().zip(x).zip(g) {
            let s = sigmoid(v);
            *o = gv * (s * (1.0 + v * (1.0 - s)));
        }
    }
}

multiversion! {
    /// One past the last non-zero element (0 when all are zero; -0.0 counts as zero).
    pub fn extent(row: &[f32]) -> usize {
        const C: usize = 64;
        let mut end = row.len();
        while end > 0 {
            let start = end.saturating_sub(C);
            // The bits of every element but its sign, or-ed: zero iff all are +-0.
            let any = row[start..end].iter().fold(0u32, |a, &x| a | (x.to_bits() << 1));
            if any != 0 {
                return start + row[start..end].iter().rposition(|&x| x != 0.0).map_or(0, |j| j + 1);
            }
            end = start;
        }
        0
    }
}

multiversion! {
    /// One AdamW update of a run of parameters: the new parameters, first and second
    /// moments go to `op`, `om`, `ov`, every element of which is written.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw(
        p: &[f32],
        g: &[f32],
        m: &[f32],
        v: &[f32],
        op: &mut [MaybeUninit<f32>],
        om: &mut [MaybeUninit<f32>],
        ov: &mut [MaybeUninit<f32>],
        h: AdamW,
    ) {
        let n = op.len();
        assert!(p.len() == n && g.len() == n && m.len() == n && v.len() == n && om.len() == n && ov.len() == n);
        let decay = 1.0 - h.lr * h.weight_decay;
        for i in 0..n {
            let grad = g[i] * h.grad_scale;
            let mi = h.beta1 * m[i] + (1.0 - h.beta1) * grad;
            let vi = h.beta2 * v[i] + (1.0 - h.beta2) * grad * grad;
            let update = (mi / h.bias1) / ((vi / h.bias2).sqrt() + h.eps);
            op[i].write(p[i] * decay - h.lr * update);
            om[i].write(mi);
            ov[i].write(vi);
        }
    }
}

multiversion! {
    /// `sum x^2` in f64 (8 lane accumulators).
    pub fn sum_sq_f64(row: &[f32]) -> f64 {
        let mut acc = [0f64; 8];
        let chunks = row.chunks_exact(8);
        let tail = chunks.remainder();
        for c in chunks {
            for l in 0..8 {
                let x = f64::from(c[l]);
                acc[l] = x.mul_add(x, acc[l]);
            }
        }
        acc.iter().sum::<f64>() + tail.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>()
    }
}

multiversion! {
    /// Input gradient of one row of `rms_norm(x, w)` with `inv = 1 / rms(x)`:
    /// `inv * (g w - x inv mean(g w x inv))`.
    pub fn rms_norm_grad_row(x: &[f32], w: &[f32], g: &[f32], inv: f32, out: &mut [f32]) {
        let d = out.len();
        let (x, w, g) = (&x[..d], &w[..d], &g[..d]);
        let mut acc = [0f32; LANES];
        let full = d - d % LANES;
        let (xs, ws, gs) = (x[..full].chunks_exact(LANES), w[..full].chunks_exact(LANES), g[..full].chunks_exact(LANES));
        for ((xc, wc), gc) in xs.zip(ws).zip(gs) {
            for l in 0..LANES {
                acc[l] = (gc[l] * wc[l]).mul_add(xc[l], acc[l]);
            }
        }
        let dot = acc.iter().sum::<f32>() + (full..d).map(|j| g[j] * w[j] * x[j]).sum::<f32>();
        let mean = dot * inv / d as f32;
        for j in 0..d {
            out[j] = inv * (g[j] * w[j] - x[j] * inv * mean);
        }
    }
}

multiversion! {
    /// `acc += k * a * b`, elementwise.
    pub fn add_scaled_product(acc: &mut [f32], a: &[f32], b: &[f32], k: f32) {
        for ((o, &x), &y) in acc.iter_mut().zip(a).zip(b) {
            *o = (x * y).mul_add(k, *o);
        }
    }
}

multiversion! {
    /// `out = a * b` (`mul`) or `a + b`, every element written.
    pub fn elementwise(a: &[f32], b: &[f32], out: &mut [MaybeUninit<f32>], mul: bool) {
        let n = out.len();
        assert!(a.len() == n && b.len() == n);
        if mul {
            for i in 0..n {
                out[i].write(a[i] * b[i]);
            }
        } else {
            for i in 0..n {
                out[i].write(a[i] + b[i]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulp_over_the_normal_range() {
        let mut worst = 0;
        let mut x = -87.0f32;
        while x < 88.7 {
            let (got, want) = (exp(x), x.exp());
            worst = worst.max(ulps(got, want));
            x += 0.000_37;
        }
        assert!(worst <= 2, "worst error {worst} ulp");
    }

    #[test]
    fn exp_edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(-110.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
        // Just below ln(f32::MAX) stays finite; subnormal results are close.
        assert!(exp(88.72).is_finite());
        let (got, want) = (exp(-100.0), (-100.0f32).exp());
        assert!((got - want).abs() <= want * 1e-3, "{got} vs {want}");
    }

    #[test]
    fn row_kernels_match_scalar_code() {
        for n in [0usize, 1, 15, 16, 17, 100, 1000] {
            let row: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
            let g: Vec<f32> = (0..n).map(|i| ((i * 53 % 89) as f32 - 44.0) / 9.0).collect();
            let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            assert_eq!(max(&row), m);
            let mut out = row.clone();
            let s = exp_shifted(&mut out, 0.5, 1.0);
            let want: Vec<f32> = row.iter().map(|&x| (0.5 * x - 1.0).exp()).collect();
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0));
            }
            assert!((s - want.iter().sum::<f32>()).abs() <= 1e-5 * s.abs().max(1.0));
            scale(&mut out, 2.0);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - 2.0 * b).abs() <= 2e-6 * b.abs().max(1.0));
            }
            let se = sum_exp(&row, m);
            let want_se: f32 = row.iter().map(|&x| (x - m).exp()).sum();
            assert!((se - want_se).abs() <= 1e-5 * want_se.max(1.0));
            let d = dot(&row, &g);
            let want_d: f32 = row.iter().zip(&g).map(|(a, b)| a * b).sum();
            assert!((d - want_d).abs() <= 1e-4 * want_d.abs().max(1.0));
            for cut in [0, n / 3, n] {
                let mut r = row.clone();
                r[cut..].fill(0.0);
                if cut > 0 {
                    r[cut - 1] = -0.5;
                }
                assert_eq!(extent(&r), cut);
                if cut > 0 {
                    r[cut - 1] = -0.0;
                    assert!(extent(&r) < cut);
                }
            }
            silu(&row, &mut out);
            for (o, &x) in out.iter().zip(&row) {
                let want = x / (1.0 + (-x).exp());
                assert!((o - want).abs() <= 1e-6 * want.abs().max(1.0));
            }
            silu_grad(&row, &g, &mut out);
            for ((o, &x), &gv) in out.iter().zip(&row).zip(&g) {
                let s = 1.0 / (1.0 + (-x).exp());
                let want = gv * s * (1.0 + x * (1.0 - s));
                assert!((o - want).abs() <= 1e-5 * want.abs().max(1.0));
            }
        }
    }
}
