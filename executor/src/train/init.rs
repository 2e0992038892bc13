//! Deterministic initialisation: every element is a pure function of (seed, parameter,
//! element index), computed on the host, so weights are the same on any device and any
//! rank can compute just its own slice of a parameter.

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
    let pair = index & !1;
    let (u1, u2) = (uniform(seed, stream, pair), uniform(seed, stream, pair + 1));
    let r = (-2.0 * u1.ln()).sqrt();
    let angle = std::f64::consts::TAU * u2;
    if index & 1 == 0 {
        r * angle.cos()
    } else {
        r * angle.sin()
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
    match rule(graph, p) {
        InitRule::Constant(c) => vec![c; (range.end - range.start) as usize],
        InitRule::Normal { std } => range.map(|i| (std * normal(seed, u64::from(p.0), i)) as f32).collect(),
    }
}

/// Elements `range` (row-major, of this rank's slice) of parameter `p` on tensor rank
/// `tensor_rank`: the whole parameter's elements at the same places, so a tensor-parallel
/// model starts as the whole one does.
pub fn init_slice_elements(
    graph: &Graph,
    p: ParamId,
    seed: u64,
    range: std::ops::Range<u64>,
    tensor_rank: u64,
) -> Vec<f32> {
    let param = graph.param(p);
    let Some(split) = param.tensor else {
        return init_elements(graph, p, seed, range);
    };
    let local = param.ty.shape.dims();
    match rule(graph, p) {
        InitRule::Constant(c) => vec![c; (range.end - range.start) as usize],
        InitRule::Normal { std } => range
            .map(|i| (std * normal(seed, u64::from(p.0), split.whole_index(local, tensor_rank, i))) as f32)
            .collect(),
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
}
