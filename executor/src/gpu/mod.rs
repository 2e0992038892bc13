//! shardplan's own GPU kernels: CUDA C files (`executor/kernels/*.cu`, compiled to CUBIN by
//! the build) and cuDNN's fused flash attention behind a small C++ shim
//! (`executor/cudnn/attn.cpp`), with a switch that keeps candle's ops, the verified path,
//! one flag away (`train --kernels candle`).
//!
//! Every kernel has a CPU twin: the CPU executor's kernel for the same op (`cpu::kernels`,
//! `cpu::fused`), which the rest of the test suite checks against finite differences and
//! the single-rank reference. `shardplan gpu-selftest` ([`crate::selftest`]) runs each kernel
//! against its twin on random inputs and edge shapes.
//!
//! Without the `cuda` feature the same functions exist and return "built without CUDA"
//! errors; nothing calls them, since native kernels are only chosen on a CUDA device.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(not(feature = "cuda"))]
mod nocuda;

#[cfg(feature = "cuda")]
pub use cuda::*;
#[cfg(not(feature = "cuda"))]
pub use nocuda::*;

use crate::ExecError;

/// Which kernels a CUDA run uses for the ops shardplan has its own kernels for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum Kernels {
    /// candle's ops, composed where candle has no fused kernel: the path checked against
    /// the CPU on GPUs (gpu-check's parity row).
    #[default]
    Candle,
    /// shardplan's CUDA kernels and cuDNN flash attention ([`KERNEL_OPS`]); every other op
    /// stays on candle's.
    Native,
}

/// The ops and steps `Kernels::Native` runs on shardplan's own kernels.
pub const KERNEL_OPS: &str = "attention forward and backward (cuDNN), rms_norm and its gradients, silu and its \
     gradient, rope and its gradient, cross_entropy and its gradient, embedding_grad, the gradient norm and AdamW";

impl Kernels {
    /// What `--kernels` accepts.
    pub const CHOICES: &'static str = "`candle` or `native`";

    pub fn parse(s: &str) -> Result<Self, ExecError> {
        match s.trim() {
            "candle" => Ok(Kernels::Candle),
            "native" => Ok(Kernels::Native),
            other => Err(ExecError::Unsupported(format!(
                "unknown kernels `{other}`: use {}",
                Self::CHOICES
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernels::Candle => "candle",
            Kernels::Native => "native",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_parse_their_names_and_refuse_others() {
        for k in [Kernels::Candle, Kernels::Native] {
            assert_eq!(Kernels::parse(k.name()).unwrap(), k);
        }
        let e = Kernels::parse("fast").unwrap_err().to_string();
        assert!(e.contains("unknown kernels `fast`") && e.contains("`native`"), "{e}");
    }
}
