//! Training: the single-rank reference `Trainer`, the `ShardedTrainer` that runs a Plan
//! on every rank this process holds, optimizers, data sources, and counter-based
//! initialisation.

pub mod data;
pub mod eval;
pub mod init;
pub mod optim;
pub mod profile;
pub mod sharded;
pub mod trace;
pub mod trainer;
