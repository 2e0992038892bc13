//! Helpers shared by the planner's tests: plans from YAML text.

#![allow(dead_code)]

pub mod edit;
pub mod gen;

use shardplan_frontends::{parse_parallel_spec, ParallelConfig, Source};
use shardplan_ir::{differentiate_with, DiffOptions, JointGraph};
use shardplan_models::{preset, trace, ModelConfig};
use shardplan_planner::{plan_in, shardplan_executor_prediction, Plan, PlanCache};

/// A validated parallel config from YAML text.
pub fn parallel(yaml: &str) -> ParallelConfig {
    parse_parallel_spec(&Source::from_text("test.yaml", yaml))
        .unwrap_or_else(|e| panic!("{e}"))
        .0
}

/// The joint graph of `model` traced at `config`'s micro-batch shape and parameter dtype:
/// under `runtime: fsdp2` differentiated as `shardplan plan` does (a compiled loss
/// recomputes its f32 logits), else as PyTorch eager keeps values, whatever the kernels.
pub fn joint_of(model: &ModelConfig, config: &ParallelConfig) -> JointGraph {
    let g = trace(model, config.trace_options()).unwrap();
    let options = if config.runtime.is_shardplan() {
        DiffOptions::default()
    } else {
        config.diff_options()
    };
    differentiate_with(&g, options).unwrap()
}

/// Plans `joint` for `config` as `shardplan plan` does: under another runtime, with
/// shardplan's own executor's prediction of the same spec beside it.
pub fn plan_as_cli(joint: &JointGraph, config: &ParallelConfig) -> Plan {
    let mut cache = PlanCache::default();
    let (mut p, _) = plan_in(joint, config, &mut cache).unwrap_or_else(|e| panic!("{e}"));
    p.shardplan_executor = shardplan_executor_prediction(joint, config, &mut cache).unwrap_or_else(|e| panic!("{e}"));
    p
}

/// Plans `model` under the YAML parallel spec ([`plan_as_cli`]).
pub fn plan_model(model: &ModelConfig, yaml: &str) -> Plan {
    let config = parallel(yaml);
    plan_as_cli(&joint_of(model, &config), &config)
}

/// Plans a preset.
pub fn plan_preset(name: &str, yaml: &str) -> Plan {
    plan_model(&preset(name).unwrap(), yaml)
}

/// The Python with torch.distributed.pipelining, when there is one: SHARDPLAN_TORCH_PYTHON
/// (which must have it), else `python3` if it has it.
pub fn torch_python() -> Option<String> {
    if let Ok(py) = std::env::var("SHARDPLAN_TORCH_PYTHON") {
        return Some(py);
    }
    let has_torch = std::process::Command::new("python3")
        .args(["-c", "import torch.distributed.pipelining"])
        .output()
        .is_ok_and(|o| o.status.success());
    has_torch.then(|| "python3".to_string())
}
