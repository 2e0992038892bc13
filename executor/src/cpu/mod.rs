//! CPU compute: one kernel per IR op (`kernels`), the fused f32 kernels behind them
//! (`fused`, `attention`, `vmath`), the linear layers (`linear`), the mixture-of-experts
//! routing kernels (`moe`), the tensor-, expert- and context-parallel ops (`tensor`,
//! `expert`, `context`), and torchao's emulated Float8 casts (`float8`).
//!
//! On CUDA, `kernels` dispatches to candle's own ops; the fused kernels are CPU-only.

pub(crate) mod attention;
pub mod context;
pub mod expert;
pub mod float8;
pub(crate) mod fused;
pub mod kernels;
mod linear;
pub(crate) mod mask;
pub(crate) mod moe;
pub mod tensor;
mod vmath;
