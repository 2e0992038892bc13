//! Errors of planning.

use thiserror::Error;

/// A parallel configuration the planner cannot plan for this model.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PlanError {
    /// `replicate x shard` is not the world size.
    #[error("mesh replicate {replicate} x shard {shard} = {product} ranks, but the world has {world}")]
    MeshWorld {
        replicate: u64,
        shard: u64,
        product: u64,
        world: u64,
    },
    /// An axis of size 0.
    #[error("mesh axes must be at least 1 (replicate {replicate}, shard {shard})")]
    EmptyAxis { replicate: u64, shard: u64 },
    /// A wrap policy kind that matches no module of the model.
    #[error("wrap policy `{kind}` matches no module of this model (its module kinds: {present})")]
    WrapMatchesNothing { kind: String, present: String },
}
