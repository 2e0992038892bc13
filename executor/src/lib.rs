//! The executor: runs shardplan graphs on candle tensors.
//!
//! The single-rank reference interpreter (`interp`) and `Trainer`, the kernels they share,
//! the sharded executor (`sharded`, `rank`) that runs a Plan on Local ranks, collectives,
//! checkpoints and the multi-process environment. Architecture invariant: the executor
//! never makes a planning decision; it runs the graph or Plan it is given, in the order it
//! is given.

mod attention;
pub mod checkpoint;
pub mod collectives;
pub mod data;
pub mod device;
pub mod dist;
mod error;
mod fused;
pub mod host;
pub mod init;
pub mod interp;
pub mod kernels;
pub mod optim;
mod rank;
pub mod sharded;
pub mod train;
mod vmath;

pub use error::ExecError;
pub use interp::{Interpreter, RunOutput};
pub use kernels::{cdtype, Ctx};
pub use sharded::{ShardedMetrics, ShardedTrainer};
pub use train::{StepMetrics, Trainer};
