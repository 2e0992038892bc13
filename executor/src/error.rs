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
