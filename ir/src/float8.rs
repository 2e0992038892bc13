//! Float8 training as torchao runs it (`torchao.float8`, what torchtitan's Float8 uses), as
//! plain data: the recipes, and for each the cast of every operand of a linear layer's three
//! matmuls. The numerics (scales, rounding) are the executor's; the planner costs the casts.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A float8 format: torch's `float8_e4m3fn` (no infinities, largest 448) or `float8_e5m2`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Float8Format {
    E4m3,
    E5m2,
}

/// Which values share a scale: the whole tensor, or (axiswise) each row or each column of
/// a row-major matrix (torchao's `axiswise_dim` -1 and 0). A tensor of higher rank is read
/// as the matrix `[numel / last, last]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Float8Granularity {
    Tensorwise,
    Rows,
    Columns,
}

/// How one matmul operand is read: cast to `format` under `granularity`, or (`scaled:
/// None`) in high precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Float8Cast {
    pub scaled: Option<(Float8Granularity, Float8Format)>,
    /// Scales rounded down to a power of two (the rowwise recipes).
    pub power_of_two: bool,
}

impl Float8Cast {
    /// The same cast of the transposed matrix: rows become columns.
    pub fn transposed(self) -> Float8Cast {
        let flip = |g| match g {
            Float8Granularity::Rows => Float8Granularity::Columns,
            Float8Granularity::Columns => Float8Granularity::Rows,
            Float8Granularity::Tensorwise => Float8Granularity::Tensorwise,
        };
        Float8Cast {
            scaled: self.scaled.map(|(g, f)| (flip(g), f)),
            power_of_two: self.power_of_two,
        }
    }
}

impl fmt::Display for Float8Cast {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.scaled {
            None => write!(f, "high"),
            Some((g, fmt_)) => {
                let g = match g {
                    Float8Granularity::Tensorwise => "tensor",
                    Float8Granularity::Rows => "rows",
                    Float8Granularity::Columns => "cols",
                };
                let fm = match fmt_ {
                    Float8Format::E4m3 => "e4m3",
                    Float8Format::E5m2 => "e5m2",
                };
                write!(f, "{fm} {g}{}", if self.power_of_two { " pow2" } else { "" })
            }
        }
    }
}

/// torchao's Float8 recipes (`Float8LinearConfig.from_recipe_name`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Float8Recipe {
    /// One scale a tensor; e4m3 operands, e5m2 output gradients.
    Tensorwise,
    /// A scale a row (of each matmul's contraction), powers of two, e4m3 throughout.
    Rowwise,
    /// As rowwise, but the weight's gradient matmul in high precision and the weight read
    /// tensorwise for the input's gradient.
    RowwiseWithGwHp,
}

impl Float8Recipe {
    /// The recipe's name in torchao and in the spec.
    pub fn name(self) -> &'static str {
        match self {
            Float8Recipe::Tensorwise => "tensorwise",
            Float8Recipe::Rowwise => "rowwise",
            Float8Recipe::RowwiseWithGwHp => "rowwise_with_gw_hp",
        }
    }
}

/// The casts of a linear layer `y = x @ w_t` (`w_t` the weight transposed, `[in, out]`)
/// for its three matmuls: the output (`x`, `w_t`), the input's gradient (`dy`, `w_t`, read
/// as `w_t.t()`) and the weight's gradient (`dy`, `x`, read as `dy.t() @ x`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Float8LinearCasts {
    pub output_input: Float8Cast,
    pub output_weight_t: Float8Cast,
    pub grad_input_grad_output: Float8Cast,
    pub grad_input_weight_t: Float8Cast,
    pub grad_weight_grad_output: Float8Cast,
    pub grad_weight_input: Float8Cast,
}

impl Float8Recipe {
    /// Every cast of the recipe, with torchao's axes: each scale group runs along the
    /// matmul's contraction dim.
    pub fn casts(self) -> Float8LinearCasts {
        use Float8Format::{E4m3, E5m2};
        use Float8Granularity::{Columns, Rows, Tensorwise};
        let pow2 = self != Float8Recipe::Tensorwise;
        let cast = |g: Float8Granularity, f: Float8Format| Float8Cast {
            scaled: Some((g, f)),
            power_of_two: pow2,
        };
        let high = Float8Cast {
            scaled: None,
            power_of_two: pow2,
        };
        match self {
            Float8Recipe::Tensorwise => Float8LinearCasts {
                output_input: cast(Tensorwise, E4m3),
                output_weight_t: cast(Tensorwise, E4m3),
                grad_input_grad_output: cast(Tensorwise, E5m2),
                grad_input_weight_t: cast(Tensorwise, E4m3),
                grad_weight_grad_output: cast(Tensorwise, E5m2),
                grad_weight_input: cast(Tensorwise, E4m3),
            },
            Float8Recipe::Rowwise => Float8LinearCasts {
                output_input: cast(Rows, E4m3),
                output_weight_t: cast(Columns, E4m3),
                grad_input_grad_output: cast(Rows, E4m3),
                grad_input_weight_t: cast(Rows, E4m3),
                grad_weight_grad_output: cast(Columns, E4m3),
                grad_weight_input: cast(Columns, E4m3),
            },
            Float8Recipe::RowwiseWithGwHp => Float8LinearCasts {
                output_input: cast(Rows, E4m3),
                output_weight_t: cast(Columns, E4m3),
                grad_input_grad_output: cast(Rows, E4m3),
                grad_input_weight_t: cast(Tensorwise, E4m3),
                grad_weight_grad_output: high,
                grad_weight_input: high,
            },
        }
    }
}
