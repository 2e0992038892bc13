//! The executor: runs shardplan graphs and Plans on candle tensors. Layers, lowest first
//! (a module imports only from layers below its own; `scripts/import-cycles.py` checks):
//!
//! - leaves: `adamw` (one AdamW update's hyper-parameters), `clock` (where a stream's
//!   time is read), `host` (host memory and cores), `init` (counter-based initialisation);
//! - `comm`: the `Collectives` trait and its backends (Local, MPI, NCCL), the launcher
//!   environment, the TCP process world; `gpu`: shardplan's CUDA kernels;
//! - `cpu`: kernels (one per IR op), the fused CPU kernels behind them, tensor-parallel ops;
//! - `runtime`: the reference interpreter, the rank runtime that executes a Plan, the
//!   optimizers, devices;
//! - `train`: the reference and sharded trainers, data, evaluation, profiles, traces;
//! - `checkpoint` (sharded, resharding checkpoints and HF safetensors import/export),
//!   `infer` (one-rank decoding with a KV cache and token sampling), `selftest` (the GPU
//!   kernels against their CPU twins).
//!
//! Architecture invariant: the executor never makes a planning decision; it runs the graph
//! or Plan it is given, in the order it is given.

pub mod adamw;
pub mod checkpoint;
pub mod clock;
pub mod comm;
pub mod cpu;
mod error;
pub mod gpu;
pub mod host;
pub mod infer;
pub mod init;
pub mod runtime;
pub mod selftest;
pub mod train;

pub use cpu::kernels::{cdtype, Ctx};
pub use error::ExecError;
pub use runtime::interp::{Interpreter, RunOutput};
pub use train::sharded::{ShardedMetrics, ShardedTrainer};
pub use train::trainer::{StepMetrics, Trainer};
