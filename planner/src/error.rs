//! Errors of planning.

use thiserror::Error;

/// ` x tensor T` when the mesh has a tensor axis.
fn tensor_axis(t: u64) -> String {
    if t == 1 {
        String::new()
    } else {
        format!(" x tensor {t}")
    }
}

/// A parallel configuration the planner cannot plan for this model.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PlanError {
    /// `replicate x shard (x tensor)` is not the world size.
    #[error("mesh replicate {replicate} x shard {shard}{} = {product} ranks, but the world has {world}", tensor_axis(*tensor))]
    MeshWorld {
        replicate: u64,
        shard: u64,
        tensor: u64,
        product: u64,
        world: u64,
    },
    /// An axis of size 0.
    #[error("mesh axes must be at least 1 (replicate {replicate}, shard {shard}{})", tensor_axis(*tensor).replace(" x", ","))]
    EmptyAxis { replicate: u64, shard: u64, tensor: u64 },
    /// `mesh.expert` does not divide the shard axis.
    #[error("an expert group of {expert} ranks does not divide the shard axis ({shard})")]
    ExpertDoesNotDivide { expert: u64, shard: u64 },
    /// `mesh.context` does not divide the shard axis it is carved from (a planner bug: the
    /// spec's shard axis is multiplied by it).
    #[error("a context group of {context} ranks does not divide the FSDP shard axis ({shard})")]
    ContextDoesNotDivide { context: u64, shard: u64 },
    /// A wrap policy kind that matches no module of the model.
    #[error("wrap policy `{kind}` matches no module of this model (its module kinds: {present})")]
    WrapMatchesNothing { kind: String, present: String },
    /// `wrap_modules` names a module the model does not have.
    #[error("wrap_modules names `{module}`, which is not a module of this model{}", suggestion.as_ref().map(|s| format!(" (did you mean `{s}`?)")).unwrap_or_default())]
    NoSuchModule { module: String, suggestion: Option<String> },
    /// An explicit prefetch list names a module that is not an FSDP unit.
    #[error("prefetch.explicit names `{module}`, which is not a wrapped module (an FSDP unit){}", suggestion.as_ref().map(|s| format!(" (did you mean `{s}`?)")).unwrap_or_default())]
    PrefetchModule { module: String, suggestion: Option<String> },
    /// `reshard_after_forward: N` with N not dividing the shard axis.
    #[error("reshard_after_forward {n} does not divide the shard axis ({shard})")]
    ReshardDoesNotDivide { n: u64, shard: u64 },
    /// A pipeline the schedule or the model cannot run: the spec field, the reason, the fix.
    #[error("{message}")]
    Pipeline {
        field: &'static str,
        message: String,
        fix: String,
    },
    /// A spec option the checks accept that the planner does not plan yet: the field, the
    /// reason, the fix.
    #[error("{message}")]
    NotPlanned {
        field: &'static str,
        message: String,
        fix: String,
    },
    /// The model's graph cannot be differentiated or planned.
    #[error("{0}")]
    Graph(String),
    /// The verifier rejected a plan the planner made: a bug in shardplan.
    #[error("internal error, the verifier rejected the plan: {0}")]
    Bug(String),
}

impl PlanError {
    /// The parallel-spec field the error is about, for locating it in the file.
    pub fn field(&self) -> &'static str {
        match self {
            PlanError::MeshWorld { .. } | PlanError::EmptyAxis { .. } => "mesh",
            PlanError::ExpertDoesNotDivide { .. } => "mesh.expert",
            PlanError::ContextDoesNotDivide { .. } => "mesh.context",
            PlanError::WrapMatchesNothing { .. } => "wrap",
            PlanError::NoSuchModule { .. } => "wrap_modules",
            PlanError::PrefetchModule { .. } => "prefetch.explicit",
            PlanError::ReshardDoesNotDivide { .. } => "reshard_after_forward",
            PlanError::Pipeline { field, .. } | PlanError::NotPlanned { field, .. } => field,
            PlanError::Graph(_) | PlanError::Bug(_) => "batch",
        }
    }

    /// How to fix it.
    pub fn help(&self) -> String {
        match self {
            PlanError::MeshWorld { .. } | PlanError::EmptyAxis { .. } => {
                "make replicate x shard x tensor equal the number of ranks".into()
            }
            PlanError::ExpertDoesNotDivide { shard, .. } => {
                format!("set mesh.expert to a divisor of mesh.shard ({shard})")
            }
            PlanError::ContextDoesNotDivide { .. } => "set mesh.context to a positive integer".into(),
            PlanError::WrapMatchesNothing { present, .. } => format!("wrap one of: {present}"),
            PlanError::NoSuchModule { .. } => "use a dotted module path as `shardplan inspect` prints it".into(),
            PlanError::PrefetchModule { .. } => {
                "name modules that `wrap` or `wrap_modules` makes units, as the plan's groups table lists them".into()
            }
            PlanError::ReshardDoesNotDivide { shard, .. } => {
                format!("use true, false, or a divisor of {shard} (usually gpus_per_node)")
            }
            PlanError::Pipeline { fix, .. } | PlanError::NotPlanned { fix, .. } => fix.clone(),
            PlanError::Graph(_) => "use smaller sizes in the model or the batch".into(),
            PlanError::Bug(_) => "please report this with the model and parallel spec".into(),
        }
    }
}
