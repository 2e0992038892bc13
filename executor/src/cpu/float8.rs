//! Float8 training numerics as torchao's `emulate=True` computes them: each operand of a
//! linear layer's three matmuls scaled, cast to float8 and read back in f32, per recipe.
//!
//! torchao (`torchao.float8`, the library torchtitan's Float8 runs on) casts a matmul's
//! operand `x` with a scale `s = max_f8 / max(amax, 1e-12)` (the division in f64, the scale
//! stored as f32; rounded down to a power of two where the recipe says), `bits =
//! to_fp8_saturated(x * s)` (clamped to the format's largest finite value, then rounded to
//! nearest, ties to even), and its emulated matmul reads `bits / s` in f32. The amax is the
//! whole tensor's (tensorwise) or one per row or column (axiswise: rowwise recipes).
//!
//! The float8 rounding itself is the `float8` crate's (CUDA's `cuda_fp8.hpp` conversion,
//! saturating to finite); `tests/fixtures/float8/casts.json`, written by
//! `scripts/float8-fixtures.py` with torch and torchao, holds every cast, scale and
//! operand here to torch's bits.

use candle_core::{DType, Tensor};
use float8::{F8E4M3, F8E5M2};
pub use shardplan_ir::{
    Float8Cast as Cast, Float8Format as Format, Float8Granularity as Granularity, Float8Recipe as Recipe,
};

/// The largest finite value of `format` (`torch.finfo(dtype).max`).
pub fn max(format: Format) -> f32 {
    match format {
        Format::E4m3 => 448.0,
        Format::E5m2 => 57344.0,
    }
}

/// `x` clamped to the largest finite value and rounded to `format` (ties to even), read
/// back as f32: torchao's `to_fp8_saturated(x, dtype).float()`. NaN stays NaN.
pub fn cast_saturated(format: Format, x: f32) -> f32 {
    let top = max(format);
    let x = if x.is_nan() { x } else { x.clamp(-top, top) };
    match format {
        Format::E4m3 => F8E4M3::from_f32(x).to_f32(),
        Format::E5m2 => F8E5M2::from_f32(x).to_f32(),
    }
}

/// The scale of values whose largest magnitude is `amax`: torchao's `amax_to_scale`.
pub fn scale(format: Format, amax: f32, power_of_two: bool) -> f32 {
    let scale = (f64::from(max(format)) / f64::from(amax).max(1e-12)) as f32;
    if power_of_two {
        scale.log2().floor().exp2()
    } else {
        scale
    }
}

/// The tensor `t` as a Float8 matmul reads it under `cast`, in f32: `t` read as the
/// matrix `[numel / last, last]`, each scale group cast and read back.
pub fn cast_tensor(t: &Tensor, cast: Cast) -> candle_core::Result<Tensor> {
    let t32 = t.to_dtype(DType::F32)?;
    if cast.scaled.is_none() {
        return Ok(t32);
    }
    let cols = t.dims().last().copied().unwrap_or(1);
    let data = t32.flatten_all()?.to_vec1::<f32>()?;
    let rows = data.len().checked_div(cols).unwrap_or(0);
    let out = operand(
        cast,
        Matrix {
            data: &data,
            rows,
            cols,
        },
    );
    Tensor::from_vec(out, t.dims(), t.device())
}

/// A matrix of `rows x cols`, row-major.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
}

/// The operand `m` as torchao's emulated matmul reads it under `cast`: `cast(m * s) / s`
/// per scale group, or `m` itself in high precision.
pub fn operand(cast: Cast, m: Matrix<'_>) -> Vec<f32> {
    {
        let Some((granularity, format)) = cast.scaled else {
            return m.data.to_vec();
        };
        assert_eq!(m.data.len(), m.rows * m.cols, "a {} x {} matrix", m.rows, m.cols);
        let amax = |it: &mut dyn Iterator<Item = f32>| it.fold(0.0f32, |a, v| a.max(v.abs()));
        let scales: Vec<f32> = match granularity {
            Granularity::Tensorwise => vec![amax(&mut m.data.iter().copied())],
            Granularity::Rows => m
                .data
                .chunks(m.cols.max(1))
                .map(|r| amax(&mut r.iter().copied()))
                .collect(),
            Granularity::Columns => (0..m.cols)
                .map(|c| amax(&mut (0..m.rows).map(|r| m.data[r * m.cols + c])))
                .collect(),
        }
        .into_iter()
        .map(|a| scale(format, a, cast.power_of_two))
        .collect();
        m.data
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let s = match granularity {
                    Granularity::Tensorwise => scales[0],
                    Granularity::Rows => scales[i / m.cols],
                    Granularity::Columns => scales[i % m.cols],
                };
                cast_saturated(format, v * s) / s
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn fixture() -> Value {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/float8/casts.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn floats(v: &Value) -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|b| f32::from_bits(b.as_i64().unwrap() as u32))
            .collect()
    }

    fn same_bits(what: &str, ours: &[f32], theirs: &[f32]) {
        assert_eq!(ours.len(), theirs.len(), "{what}");
        for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{what}[{i}]: ours {a:e} ({:#x}), torch {b:e} ({:#x})",
                a.to_bits(),
                b.to_bits()
            );
        }
    }

    fn format(name: &str) -> Format {
        match name {
            "e4m3" => Format::E4m3,
            "e5m2" => Format::E5m2,
            _ => panic!("format {name}"),
        }
    }

    #[test]
    fn casts_are_torchs_bit_for_bit() {
        let f = fixture();
        for (name, case) in f["casts"].as_object().unwrap() {
            let fmt = format(name);
            let ours: Vec<f32> = floats(&case["input"]).iter().map(|&x| cast_saturated(fmt, x)).collect();
            same_bits(&format!("{name} casts"), &ours, &floats(&case["output"]));
        }
    }

    #[test]
    fn scales_are_torchaos() {
        let f = fixture();
        for (name, case) in f["scales"].as_object().unwrap() {
            let fmt = format(name);
            let amax = floats(&case["amax"]);
            for (key, pow2) in [("scale", false), ("scale_power_of_two", true)] {
                let ours: Vec<f32> = amax.iter().map(|&a| scale(fmt, a, pow2)).collect();
                same_bits(&format!("{name} {key}"), &ours, &floats(&case[key]));
            }
        }
    }

    #[test]
    fn every_recipes_operands_are_torchaos() {
        let f = fixture();
        for case in f["operands"].as_array().unwrap() {
            let recipe = match case["recipe"].as_str().unwrap() {
                "tensorwise" => Recipe::Tensorwise,
                "rowwise" => Recipe::Rowwise,
                "rowwise_with_gw_hp" => Recipe::RowwiseWithGwHp,
                r => panic!("recipe {r}"),
            };
            let dim = |k: &str| case[k].as_u64().unwrap() as usize;
            let (m, k, n) = (dim("m"), dim("k"), dim("n"));
            let (x, w, dy) = (
                floats(&case["input"]),
                floats(&case["weight"]),
                floats(&case["grad_output"]),
            );
            // The weight transposed, [k, n], as torchao's matmul takes it.
            let w_t: Vec<f32> = (0..k)
                .flat_map(|i| (0..n).map(move |j| (i, j)))
                .map(|(i, j)| w[j * k + i])
                .collect();
            let c = recipe.casts();
            let xm = Matrix {
                data: &x,
                rows: m,
                cols: k,
            };
            let wm = Matrix {
                data: &w_t,
                rows: k,
                cols: n,
            };
            let dym = Matrix {
                data: &dy,
                rows: m,
                cols: n,
            };
            let want = &case["expected"];
            for (key, cast, m) in [
                ("output.input", c.output_input, xm),
                ("output.weight_t", c.output_weight_t, wm),
                ("grad_input.grad_output", c.grad_input_grad_output, dym),
                ("grad_input.weight_t", c.grad_input_weight_t, wm),
                ("grad_weight.grad_output", c.grad_weight_grad_output, dym),
                ("grad_weight.input", c.grad_weight_input, xm),
            ] {
                same_bits(&format!("{recipe:?} {key}"), &operand(cast, m), &floats(&want[key]));
            }
        }
    }

    #[test]
    fn a_zero_row_keeps_its_zeros_and_its_neighbours_scale() {
        let data = [0.0, 0.0, 3.0, -1.5];
        let cast = Recipe::Rowwise.casts().output_input;
        let out = operand(
            cast,
            Matrix {
                data: &data,
                rows: 2,
                cols: 2,
            },
        );
        assert_eq!(out, vec![0.0, 0.0, 3.0, -1.5]);
    }
}
