//! The executor: runs shardplan graphs on candle tensors.
//!
//! Today: the single-rank reference interpreter (`interp`), its kernels, and the training
//! loop built on it. Architecture invariant: the executor never makes a planning decision;
//! it runs the graph (and later the Plan) it is given, in the order it is given.

mod error;
pub mod interp;
pub mod kernels;

pub use error::ExecError;
pub use interp::{Interpreter, RunOutput};
pub use kernels::{cdtype, Ctx};
