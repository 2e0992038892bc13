//! Errors of the executor.

use thiserror::Error;

/// What can go wrong running a graph or training.
#[derive(Debug, Error)]
pub enum ExecError {
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    /// The model cannot be traced at the spec's shape (kept whole, so callers can place it in
    /// the spec that caused it).
    #[error(transparent)]
    Trace(#[from] shardplan_models::TraceError),
    /// A data file that cannot be used (names the file and, where it applies, the offset).
    #[error("{0}")]
    Data(String),
    /// The loss (or a gradient) stopped being finite.
    #[error("step {step}: non-finite loss {loss}; the first non-finite value appears in `{module}` ({node}: {op})")]
    NonFinite {
        step: u64,
        loss: f32,
        module: String,
        node: String,
        op: String,
    },
    /// A configuration the executor cannot run (yet).
    #[error("{0}")]
    Unsupported(String),
    /// A checkpoint that cannot be written or read (names the file and, where it applies,
    /// the tensor).
    #[error("{0}")]
    Checkpoint(String),
    /// A sharded run stopped: the first failure any rank reported (rank, instruction,
    /// cause), or a collective that timed out.
    #[error("{0}")]
    Aborted(String),
    /// A bug: the graph or the feeds broke an invariant the executor relies on.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ExecError {
    /// Whether the device ran out of memory: a CUDA allocation (cudarc's
    /// `DriverError(CUDA_ERROR_OUT_OF_MEMORY, ..)`, what candle's and shardplan's own
    /// kernels return), cuBLAS's workspace (`CUBLAS_STATUS_ALLOC_FAILED`) or the cuDNN
    /// attention's workspace (the shim's `cannot allocate N bytes of cuDNN workspace`).
    /// Read from the message: the CUDA error types exist only in a CUDA build, and every
    /// layer above them keeps their text.
    pub fn is_out_of_memory(&self) -> bool {
        let text = self.to_string();
        [
            "CUDA_ERROR_OUT_OF_MEMORY",
            "CUBLAS_STATUS_ALLOC_FAILED",
            "bytes of cuDNN workspace",
        ]
        .iter()
        .any(|s| text.contains(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for a CUDA library error, carrying its text as the library prints it.
    #[derive(Debug)]
    struct Text(&'static str);

    impl std::fmt::Display for Text {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Text {}

    fn cuda(text: &'static str) -> ExecError {
        ExecError::Candle(candle_core::Error::Cuda(Box::new(Text(text))))
    }

    #[test]
    fn out_of_memory_is_told_from_other_device_errors() {
        // cudarc's Display of a driver error is its Debug.
        assert!(cuda("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")").is_out_of_memory());
        assert!(cuda("CublasError(CUBLAS_STATUS_ALLOC_FAILED)").is_out_of_memory());
        assert!(
            ExecError::Unsupported("cuDNN attention: cannot allocate 1048576 bytes of cuDNN workspace".into())
                .is_out_of_memory()
        );
        // Kept through the abort's wrapping.
        assert!(ExecError::Aborted(format!(
            "step 3: rank 1: instruction #5 `compute s2` failed: {}",
            cuda("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")")
        ))
        .is_out_of_memory());
        assert!(!cuda("DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, \"an illegal memory access\")").is_out_of_memory());
        assert!(!ExecError::Data("tokens.bin: token 70000 is past the vocabulary".into()).is_out_of_memory());
    }
}
