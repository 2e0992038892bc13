//! Training: the single-rank reference `Trainer`, the `ShardedTrainer` that runs a Plan
//! on every rank this process holds, data sources, evaluation, profiles and traces. The
//! optimizers are the rank runtime's (`runtime::optim`), the initialisation a leaf
//! (`crate::init`).

pub mod data;
pub mod engine;
pub mod eval;
pub mod pipeline;
pub mod profile;
pub mod sharded;
pub mod trace;
pub mod trainer;
