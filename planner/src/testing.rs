//! What the planner's unit tests share: specs and graphs of the preset models.

use shardplan_frontends::{parse_parallel_spec, ParallelConfig, Source};
use shardplan_ir::{differentiate, Graph, JointGraph};
use shardplan_models::{preset, trace, ModelConfig, TraceOptions};

/// The parallel spec `yaml` (a test's own text: it must parse).
pub(crate) fn parallel(yaml: &str) -> ParallelConfig {
    parse_parallel_spec(&Source::from_text("test.yaml", yaml))
        .unwrap_or_else(|e| panic!("{e}"))
        .0
}

/// The joint graph of `model` traced at `config`'s micro-batch shape.
pub(crate) fn joint_of(model: &ModelConfig, config: &ParallelConfig) -> JointGraph {
    differentiate(&trace(model, config.trace_options()).unwrap()).unwrap()
}

/// The preset model `name` traced at one sequence of 4 tokens.
pub(crate) fn tiny(name: &str) -> Graph {
    trace(
        &preset(name).unwrap(),
        TraceOptions {
            batch: 1,
            seq_len: Some(4),
            ..TraceOptions::default()
        },
    )
    .unwrap()
}
