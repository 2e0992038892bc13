//! The self-test's cases, one function per kernel family, in the order they run (each
//! case's inputs are seeded by its place in the list).

use super::{Case, Input, Kind, Precision};
use shardplan_ir::{NormWrt, Op, RopeScaling};
use Input::*;

/// Which cases: `full` for a GPU (the edge shapes at sizes the 1.1B step runs),
/// otherwise small shapes of the same kinds that a CPU reference checks in seconds.
pub fn cases(full: bool) -> Vec<Case> {
    let mut v = Vec::new();
    v.extend(rms_norm(full));
    v.extend(silu(full));
    v.extend(rope(full));
    v.extend(cross_entropy(full));
    v.extend(embedding_grad(full));
    v.extend(attention(full));
    v.push(grad_sum_squares(full));
    v.extend(adamw(full));
    v
}

/// Both storage dtypes, bf16 first.
const PRECISIONS: [Precision; 2] = [Precision::Bf16, Precision::F32];

/// A case of one graph op on `inputs`.
fn op(kernel: &'static str, label: String, p: Precision, op: Op, inputs: Vec<Input>) -> Case {
    Case {
        kernel,
        label,
        precision: p,
        kind: Kind::Op { op, inputs },
    }
}

/// RMSNorm and its gradients with respect to the input and to the weight.
fn rms_norm(full: bool) -> Vec<Case> {
    let norms: &[(usize, usize)] = if full {
        &[(333, 2048), (1554, 4096), (1000, 64), (4096, 2048), (1, 5120)]
    } else {
        &[(5, 64), (3, 333), (1, 8)]
    };
    let eps = 1e-5;
    let mut v = Vec::new();
    for &(r, c) in norms {
        for p in PRECISIONS {
            let label = format!("rows {r} x {c}");
            v.push(op(
                "rms_norm",
                label.clone(),
                p,
                Op::RmsNorm { eps },
                vec![Float(vec![r, c], 2.0), Float(vec![c], 1.5)],
            ));
            for (kernel, wrt) in [("rms_norm_dx", NormWrt::Input), ("rms_norm_dw", NormWrt::Weight)] {
                v.push(op(
                    kernel,
                    label.clone(),
                    p,
                    Op::RmsNormGrad { eps, wrt },
                    vec![Float(vec![r, c], 2.0), Float(vec![c], 1.5), Float(vec![r, c], 1.0)],
                ));
            }
        }
    }
    v
}

/// SiLU and its gradient.
fn silu(full: bool) -> Vec<Case> {
    let acts: &[usize] = if full {
        &[333 * 5632, 4096 * 5632, 1]
    } else {
        &[1000, 1]
    };
    let mut v = Vec::new();
    for &n in acts {
        for p in PRECISIONS {
            v.push(op(
                "silu",
                format!("{n} elements"),
                p,
                Op::Silu,
                vec![Float(vec![n], 6.0)],
            ));
            v.push(op(
                "silu_grad",
                format!("{n} elements"),
                p,
                Op::SiluGrad,
                vec![Float(vec![n], 6.0), Float(vec![n], 1.0)],
            ));
        }
    }
    v
}

/// Rotary embedding and its gradient, on `[b, s, h, d]`.
fn rope(full: bool) -> Vec<Case> {
    let ropes: &[[usize; 4]] = if full {
        &[[1, 333, 8, 64], [2, 777, 32, 128], [2, 2048, 32, 64], [1, 1000, 8, 128]]
    } else {
        &[[1, 7, 2, 8], [2, 5, 3, 16]]
    };
    let mut v = Vec::new();
    for &[b, s, h, d] in ropes {
        for p in PRECISIONS {
            let label = format!("[{b}, {s}, {h}, {d}]");
            for (kernel, op_) in [
                (
                    "rope",
                    Op::Rope {
                        theta: 500_000.0,
                        scaling: RopeScaling::Default,
                        context: None,
                    },
                ),
                (
                    "rope_grad",
                    Op::RopeGrad {
                        theta: 10_000.0,
                        scaling: RopeScaling::Default,
                        context: None,
                    },
                ),
            ] {
                v.push(op(kernel, label.clone(), p, op_, vec![Float(vec![b, s, h, d], 1.0)]));
            }
        }
    }
    v
}

/// Cross-entropy and its gradient, up to Llama 3's vocabulary.
fn cross_entropy(full: bool) -> Vec<Case> {
    let xents: &[(usize, usize)] = if full {
        &[(333, 256), (1554, 32000), (1000, 128_256), (1, 256)]
    } else {
        &[(5, 256), (3, 1000), (1, 7)]
    };
    let mut v = Vec::new();
    for &(n, vocab) in xents {
        for p in PRECISIONS {
            let label = format!("{n} rows x vocab {vocab}");
            v.push(op(
                "cross_entropy",
                label.clone(),
                p,
                Op::CrossEntropy,
                vec![Float(vec![n, vocab], 8.0), Ids(vec![n], vocab as u32)],
            ));
            v.push(op(
                "cross_entropy_grad",
                label,
                p,
                Op::CrossEntropyGrad,
                vec![Float(vec![n, vocab], 8.0), Ids(vec![n], vocab as u32), Scalar(1.0)],
            ));
        }
    }
    v
}

/// The embedding's gradient (rows scattered by token id).
fn embedding_grad(full: bool) -> Vec<Case> {
    let embeds: &[(usize, usize, usize)] = if full {
        &[(333, 256, 64), (4096, 32000, 2048), (1000, 128_256, 128)]
    } else {
        &[(7, 50, 16), (40, 3, 8)]
    };
    let mut v = Vec::new();
    for &(tokens, vocab, dim) in embeds {
        for p in PRECISIONS {
            v.push(op(
                "embedding_grad",
                format!("{tokens} ids, {vocab} x {dim}"),
                p,
                Op::EmbeddingGrad { vocab: vocab as u64 },
                vec![Ids(vec![tokens], vocab as u32), Float(vec![tokens, dim], 1.0)],
            ));
        }
    }
    v
}

/// Fused attention, forward and backward, causal and not (the full cases' longest
/// sequences causal only).
fn attention(full: bool) -> Vec<Case> {
    // (b, s, h, kv, d): every grouped-query ratio of the presets (1: GPT-2, 4: Llama 3 8B and
    // Mistral, 7: Qwen2 0.5B, 8: Llama 3 70B, 16: Llama 3 405B), sequences off the tile.
    let attns: &[(usize, usize, usize, usize, usize)] = if full {
        &[
            (1, 333, 12, 12, 64),
            (2, 777, 14, 2, 64),
            (1, 1000, 32, 8, 128),
            (1, 1000, 64, 8, 128),
            (1, 777, 128, 8, 128),
            (4, 333, 16, 2, 64),
            (2, 2048, 32, 8, 64),
        ]
    } else {
        &[(1, 33, 4, 2, 16), (2, 17, 3, 3, 8), (1, 9, 8, 1, 16)]
    };
    let mut v = Vec::new();
    for &(b, s, h, kv, d) in attns {
        for causal in [true, false] {
            if !causal && full && s > 1000 {
                continue;
            }
            v.push(Case {
                kernel: "attention",
                label: format!("b{b} s{s} h{h}/{kv} d{d}{}", if causal { " causal" } else { "" }),
                precision: Precision::Bf16,
                kind: Kind::Attention { b, s, h, kv, d, causal },
            });
        }
    }
    v
}

/// The gradients' sum of squares over many tensors, at and around one block's size.
fn grad_sum_squares(full: bool) -> Case {
    let mut lens: Vec<usize> = if full {
        vec![1, 7, 65_535, 65_536, 65_537, 1_000_003, 66_000_000]
    } else {
        vec![1, 7, 65_537, 3]
    };
    // More tensors than one launch takes (48).
    lens.extend(std::iter::repeat_n(if full { 10_000 } else { 100 }, 50));
    Case {
        kernel: "grad_sum_squares",
        label: format!("{} tensors", lens.len()),
        precision: Precision::F32,
        kind: Kind::SumSquares { lens },
    }
}

/// The AdamW update, with and without a gradient factor.
fn adamw(full: bool) -> Vec<Case> {
    let mut v = Vec::new();
    for factor in [None, Some(0.37)] {
        let n = if full { 66_000_003 } else { 1001 };
        v.push(Case {
            kernel: "adamw",
            label: format!(
                "{n} params, factor {}",
                factor.map_or("none".into(), |f: f64| f.to_string())
            ),
            precision: Precision::F32,
            kind: Kind::AdamW { n, factor },
        });
    }
    v
}
