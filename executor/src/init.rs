//! Deterministic initialisation: every element is a pure function of (seed, parameter,
//! element index), computed on the host, so weights are the same on any device and any
//! rank can compute just its own slice of a parameter. Large ranges are made in blocks on
//! every core (rayon); the values do not depend on the split.

use shardplan_ir::{Graph, ModuleKind, ParamId};

/// splitmix64's finaliser: a well-mixed 64-bit hash of a counter.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uniform in (0, 1) from the counter `(seed, stream, index)`.
pub fn uniform(seed: u64, stream: u64, index: u64) -> f64 {
    let h = mix(mix(mix(seed ^ 0x5851_f42d_4c95_7f2d).wrapping_add(stream)).wrapping_add(index));
    ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// A standard normal for element `index` of stream `stream` (Box-Muller on the pair of
/// uniforms that the even/odd pair of elements shares).
pub fn normal(seed: u64, stream: u64, index: u64) -> f64 {
    let (even, odd) = normal_pair(seed, stream, index & !1);
    if index & 1 == 0 {
        even
    } else {
        odd
    }
}

/// The normals of elements `pair` (even) and `pair + 1`: one Box-Muller transform for both.
fn normal_pair(seed: u64, stream: u64, pair: u64) -> (f64, f64) {
    let (u1, u2) = (uniform(seed, stream, pair), uniform(seed, stream, pair + 1));
    let r = (-2.0 * u1.ln()).sqrt();
    let angle = std::f64::consts::TAU * u2;
    (r * angle.cos(), r * angle.sin())
}

/// Elements below this many are made on the calling thread.
const PARALLEL_ELEMS: usize = 1 << 16;

/// `f32` elements `range` of a counter-based generator, made in blocks on every core of
/// rayon's pool: each element is a pure function of its index, so the values are those of
/// a loop over `range` on one thread. `block(out, start)` fills `out` with elements
/// `start..start + out.len()`.
fn par_elements(range: std::ops::Range<u64>, block: impl Fn(&mut [f32], u64) + Sync) -> Vec<f32> {
    use rayon::prelude::*;
    let n = range.end.saturating_sub(range.start) as usize;
    // Zeroed by the allocator (fresh pages), then written once.
    let mut out = vec![0f32; n];
    if n < PARALLEL_ELEMS {
        block(&mut out, range.start);
    } else {
        out.par_chunks_mut(PARALLEL_ELEMS)
            .enumerate()
            .for_each(|(c, chunk)| block(chunk, range.start + (c * PARALLEL_ELEMS) as u64));
    }
    out
}

/// Fills `out` with `std` x the normals of elements `start..` of `stream`, a Box-Muller
/// transform per pair of elements (the values `normal` gives one by one).
fn normal_block(out: &mut [f32], start: u64, seed: u64, stream: u64, std: f64) {
    let mut k = 0;
    let mut i = start;
    if i & 1 == 1 && k < out.len() {
        out[k] = (std * normal(seed, stream, i)) as f32;
        (k, i) = (k + 1, i + 1);
    }
    while k + 1 < out.len() {
        let (even, odd) = normal_pair(seed, stream, i);
        out[k] = (std * even) as f32;
        out[k + 1] = (std * odd) as f32;
        (k, i) = (k + 2, i + 2);
    }
    if k < out.len() {
        out[k] = (std * normal(seed, stream, i)) as f32;
    }
}

/// How a parameter starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum InitRule {
    Constant(f32),
    Normal { std: f64 },
}

/// GPT-2 / Llama practice: norms start at weight 1 and bias 0, other biases at 0, weights
/// at N(0, 0.02), and the projections that write into the residual stream at
/// N(0, 0.02 / sqrt(2 * layers)).
pub fn rule(graph: &Graph, p: ParamId) -> InitRule {
    let param = graph.param(p);
    let in_norm = graph.scope(param.scope).kind == ModuleKind::Norm;
    let is_bias = param.name.ends_with(".bias");
    if in_norm {
        return InitRule::Constant(if is_bias { 0.0 } else { 1.0 });
    }
    if is_bias {
        return InitRule::Constant(0.0);
    }
    let residual = [
        "o_proj.weight",
        "down_proj.weight",
        "attn.c_proj.weight",
        "mlp.c_proj.weight",
        "fc2.weight",
    ];
    if residual.iter().any(|s| param.name.ends_with(s)) {
        let layers = graph
            .scopes()
            .filter(|(_, s)| s.kind == ModuleKind::Block)
            .count()
            .max(1);
        return InitRule::Normal {
            std: 0.02 / (2.0 * layers as f64).sqrt(),
        };
    }
    InitRule::Normal { std: 0.02 }
}

/// Elements `range` of parameter `p` (row-major), as f32.
pub fn init_elements(graph: &Graph, p: ParamId, seed: u64, range: std::ops::Range<u64>) -> Vec<f32> {
    keyed_elements(graph, p, u64::from(p.0), seed, range)
}

/// As [`init_elements`], drawn as the parameter numbered `key` of the whole model.
fn keyed_elements(graph: &Graph, p: ParamId, key: u64, seed: u64, range: std::ops::Range<u64>) -> Vec<f32> {
    match rule(graph, p) {
        InitRule::Constant(c) => vec![c; (range.end - range.start) as usize],
        InitRule::Normal { std } => par_elements(range, |out, start| normal_block(out, start, seed, key, std)),
    }
}

/// Elements `range` (row-major, of this rank's slice) of parameter `p` on tensor rank
/// `tensor_rank`: the whole parameter's elements at the same places, so a tensor-parallel
/// model starts as the whole one does. `key` is the parameter's number in the whole
/// model's graph (under expert parallelism a rank's graph holds only its experts, so its
/// own numbers differ).
pub fn init_slice_elements(
    graph: &Graph,
    p: ParamId,
    key: u64,
    seed: u64,
    range: std::ops::Range<u64>,
    tensor_rank: u64,
) -> Vec<f32> {
    let param = graph.param(p);
    let Some(split) = param.tensor else {
        return keyed_elements(graph, p, key, seed, range);
    };
    let local = param.ty.shape.dims();
    match rule(graph, p) {
        InitRule::Constant(c) => vec![c; (range.end - range.start) as usize],
        InitRule::Normal { std } => par_elements(range, |out, start| {
            for (o, i) in out.iter_mut().zip(start..) {
                *o = (std * normal(seed, key, split.whole_index(local, tensor_rank, i))) as f32;
            }
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normals_look_normal_and_slices_agree() {
        let n = 200_000u64;
        let xs: Vec<f64> = (0..n).map(|i| normal(7, 3, i)).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "variance {var}");
        // Any slice equals the same elements of the whole: what sharded init relies on.
        assert_eq!(normal(7, 3, 12_345), xs[12_345]);
        assert_ne!(normal(7, 3, 5), normal(8, 3, 5));
        assert_ne!(normal(7, 3, 5), normal(7, 4, 5));
    }

    /// The blocked, paired, parallel path gives every element of the one-by-one loop, bit
    /// for bit, from any start (odd or even) and for any length around the block size.
    #[test]
    fn blocks_in_parallel_equal_the_element_loop() {
        let (seed, stream, std) = (11u64, 9u64, 0.02f64);
        let one = |i: u64| (std * normal(seed, stream, i)) as f32;
        for (start, len) in [
            (0u64, 0u64),
            (0, 1),
            (1, 1),
            (3, 6),
            (7, 2 * PARALLEL_ELEMS as u64 + 3),
            (4, PARALLEL_ELEMS as u64),
        ] {
            let got = par_elements(start..start + len, |out, s| normal_block(out, s, seed, stream, std));
            let want: Vec<f32> = (start..start + len).map(one).collect();
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "start {start}, len {len}"
            );
        }
    }
}
