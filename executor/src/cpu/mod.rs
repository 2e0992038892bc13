//! CPU compute: one kernel per IR op (`kernels`), the fused f32 kernels behind them
//! (`fused`, `attention`, `vmath`), and host-memory tuning (`host`).
//!
//! On CUDA, `kernels` dispatches to candle's own ops; the fused kernels are CPU-only.

mod attention;
pub(crate) mod fused;
pub mod host;
pub mod kernels;
pub mod tensor;
mod vmath;
