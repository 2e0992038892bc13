//! The executor: runs shardplan graphs and Plans on candle tensors.
//!
//! - `cpu`: kernels (one per IR op) and the fused CPU kernels behind them;
//! - `comm`: the `Collectives` trait and its backends (Local, MPI, NCCL), the launcher
//!   environment, the TCP process world;
//! - `runtime`: the reference interpreter and the rank runtime that executes a Plan;
//! - `train`: the reference and sharded trainers, optimizers, data, initialisation;
//! - `checkpoint`: sharded, resharding checkpoints and HF safetensors import/export;
//! - `infer`: one-rank decoding with a KV cache and token sampling (`shardplan generate`).
//!
//! Architecture invariant: the executor never makes a planning decision; it runs the graph
//! or Plan it is given, in the order it is given.

pub mod checkpoint;
pub mod clock;
pub mod comm;
pub mod cpu;
mod error;
pub mod gpu;
pub mod infer;
pub mod runtime;
pub mod train;

pub use cpu::kernels::{cdtype, Ctx};
pub use error::ExecError;
pub use runtime::interp::{Interpreter, RunOutput};
pub use train::sharded::{ShardedMetrics, ShardedTrainer};
pub use train::trainer::{StepMetrics, Trainer};
