//! Low-precision linears of a run: torchao's Float8 training (`float8`) and MXFP8
//! (`mxfp8`), as torchtitan's `float8` and `mx` model converters apply them.

use serde::{Deserialize, Serialize};
pub use shardplan_ir::Float8Recipe;

/// torchtitan's filter entry that turns on torchao's size heuristics.
pub use shardplan_models::float8::AUTO_FILTER;

/// Float8 linears (`float8:` in the spec): torchao's `convert_to_float8_training`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Float8 {
    pub recipe: Float8Recipe,
    /// Linears whose module path (Hugging Face's: `lm_head`, `model.layers.0.mlp.up_proj`)
    /// contains one of these stay in high precision; `auto_filter_small_kn` adds torchao's
    /// size heuristics. Default `[lm_head]` (torchtitan's `[output]`).
    pub filter_fqns: Vec<String>,
    /// FSDP all-gathers the Float8 weights in float8 (torchao's
    /// `enable_fsdp_float8_all_gather`; tensorwise only).
    #[serde(default)]
    pub fsdp_float8_all_gather: bool,
    /// The weights' scales computed once after the optimizer step, for every weight in one
    /// all-reduce (torchao's `precompute_float8_dynamic_scale_for_fsdp`; needs the float8
    /// all-gather).
    #[serde(default)]
    pub precompute_scale: bool,
}

impl Float8 {
    /// The linears to convert, for the tracer.
    pub fn options(&self) -> shardplan_models::Float8Options {
        shardplan_models::Float8Options {
            recipe: self.recipe,
            filter_fqns: self.filter_fqns.clone(),
        }
    }
}

/// torchao's MXFP8 recipes (`MXLinearConfig.from_recipe_name`): e4m3 values with one
/// power-of-two (e8m0) scale per 32 elements, the GEMMs in cuBLAS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mxfp8Recipe {
    /// Scales rounded down (floor), as the OCP MX spec writes them.
    Mxfp8Cublas,
    /// Scales rounded up (`rceil`), as NVIDIA recommends.
    Mxfp8CublasRceil,
}

/// MXFP8 linears (`mxfp8:` in the spec).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mxfp8 {
    pub recipe: Mxfp8Recipe,
    pub filter_fqns: Vec<String>,
}
