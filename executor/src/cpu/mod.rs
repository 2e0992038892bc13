//! CPU compute: one kernel per IR op (`kernels`), the fused f32 kernels behind them
//! (`fused`, `attention`, `vmath`), the mixture-of-experts routing kernels (`moe`), and
//! host-memory tuning (`host`).
//!
//! On CUDA, `kernels` dispatches to candle's own ops; the fused kernels are CPU-only.

mod attention;
pub(crate) mod fused;
pub mod host;
pub mod kernels;
mod linear;
mod moe;
pub mod tensor;
mod vmath;
