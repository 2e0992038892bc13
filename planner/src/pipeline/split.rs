//! The model cut into pipeline stages: torchtitan's split by layers (the embedding and the
//! head weighted as blocks) or the spec's module lists, over the graph's top-level modules
//! in forward order.

use crate::PlanError;
use shardplan_frontends::{did_you_mean, PipelineSchedule, StageSplit};
use shardplan_ir::{Graph, ModuleKind};

/// The graph's top-level modules (`tok_embeddings`, `layers.0`, ..., `norm`, `output`,
/// `loss`) in the order their forward first runs, with their kinds.
pub fn top_level_modules(graph: &Graph) -> Vec<(String, ModuleKind)> {
    let mut modules: Vec<(String, ModuleKind)> = Vec::new();
    for (_, node) in graph.nodes() {
        if node.is_backward() {
            continue;
        }
        let top = graph.top_level(node.scope);
        if top == graph.root() {
            continue;
        }
        let scope = graph.scope(top);
        if !modules.iter().any(|(p, _)| *p == scope.path) {
            modules.push((scope.path.clone(), scope.kind));
        }
    }
    modules
}

fn error(field: &'static str, message: impl Into<String>, fix: impl Into<String>) -> PlanError {
    PlanError::Pipeline {
        field,
        message: message.into(),
        fix: fix.into(),
    }
}

/// Stages a rank: as written, from `layers_per_stage` (torchtitan's ceil((L + first +
/// last) / K) stages), from the module lists, or the schedule's default.
pub fn stages_per_rank(
    split: &StageSplit,
    written: Option<u64>,
    schedule: PipelineSchedule,
    ranks: u64,
    layers: u64,
) -> Result<u64, PlanError> {
    let derived = match split {
        StageSplit::Modules(stages) => Some(stages.len() as u64 / ranks),
        StageSplit::Layers {
            layers_per_stage: Some(k),
            first_stage_less_layers,
            last_stage_less_layers,
        } => {
            let effective = layers + first_stage_less_layers + last_stage_less_layers;
            let stages = effective.div_ceil(*k);
            if !stages.is_multiple_of(ranks) {
                return Err(error(
                    "pipeline.layers_per_stage",
                    format!("{layers} blocks with the embedding and head counted as {first_stage_less_layers} and {last_stage_less_layers} make {stages} stages of {k}, which do not divide over {ranks} pipeline ranks"),
                    format!("pick layers_per_stage so that ceil({effective} / layers_per_stage) is a multiple of {ranks}"),
                ));
            }
            let v = stages / ranks;
            if schedule.is_single_stage() && v != 1 {
                return Err(error(
                    "pipeline.layers_per_stage",
                    format!("{schedule} runs one stage a rank, but {stages} stages of {k} blocks are {v} a rank"),
                    format!(
                        "raise layers_per_stage to {} or more, or pick a multi-stage schedule",
                        effective.div_ceil(ranks)
                    ),
                ));
            }
            if !schedule.is_single_stage() && v < 2 {
                return Err(error(
                    "pipeline.layers_per_stage",
                    format!(
                        "{schedule} needs at least two stages a rank, but {stages} stages of {k} blocks are {v} a rank"
                    ),
                    "lower layers_per_stage, or pick GPipe or 1F1B",
                ));
            }
            Some(v)
        }
        StageSplit::Layers { .. } => None,
    };
    match (written, derived) {
        (Some(w), Some(d)) if w != d => Err(error(
            "pipeline.stages_per_rank",
            format!("stages_per_rank is {w}, but the stage split makes {d} a rank"),
            "remove pipeline.stages_per_rank: the split sets it",
        )),
        (Some(v), _) | (None, Some(v)) => Ok(v),
        (None, None) => Ok(schedule.default_stages_per_rank()),
    }
}

/// The module names of each of `stages` stages, from the graph's [`top_level_modules`].
pub fn split_stages(
    modules: &[(String, ModuleKind)],
    split: &StageSplit,
    stages: u64,
) -> Result<Vec<Vec<String>>, PlanError> {
    match split {
        StageSplit::Modules(lists) => check_module_lists(modules, lists),
        StageSplit::Layers {
            first_stage_less_layers,
            last_stage_less_layers,
            ..
        } => split_by_layers(modules, stages, *first_stage_less_layers, *last_stage_less_layers),
    }
}

/// torchtitan's `generate_llm_fqn_per_model_part` over any family: the modules before the
/// first block go first (weighted `first` blocks), those after the last block last
/// (weighted `last`), and the first `effective % stages` stages take one block more.
fn split_by_layers(
    modules: &[(String, ModuleKind)],
    stages: u64,
    first: u64,
    last: u64,
) -> Result<Vec<Vec<String>>, PlanError> {
    let Some(first_block) = modules.iter().position(|(_, k)| *k == ModuleKind::Block) else {
        return Err(error(
            "pipeline",
            "the model has no blocks to split into stages",
            "list the stages' modules in pipeline.modules_per_stage",
        ));
    };
    let last_block = modules
        .iter()
        .rposition(|(_, k)| *k == ModuleKind::Block)
        .unwrap_or(first_block);
    let names = |r: std::ops::Range<usize>| modules[r].iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    let (inputs, blocks, outputs) = (
        names(0..first_block),
        names(first_block..last_block + 1),
        names(last_block + 1..modules.len()),
    );
    let effective = blocks.len() as u64 + first + last;
    let per_stage = effective / stages;
    let fix_fewer = "use fewer stages (mesh.pipeline, stages_per_rank or layers_per_stage), or lower first_stage_less_layers / last_stage_less_layers";
    if per_stage == 0 {
        return Err(error(
            "pipeline",
            format!("{stages} stages of {effective} blocks (embedding and head counted) leave some stage empty"),
            fix_fewer,
        ));
    }
    if first > per_stage || last > per_stage {
        return Err(error(
            "pipeline",
            format!(
                "the embedding and head weigh {first} and {last} blocks, more than the {per_stage} blocks of a stage"
            ),
            fix_fewer,
        ));
    }
    let extra = effective % stages;
    let mut blocks = blocks.into_iter();
    let out = (0..stages)
        .map(|s| {
            let mut size = per_stage + u64::from(s < extra);
            let mut stage = Vec::new();
            if s == 0 {
                stage.extend(inputs.iter().cloned());
                size -= first;
            } else if s == stages - 1 {
                size -= last;
            }
            stage.extend(blocks.by_ref().take(size as usize));
            if s == stages - 1 {
                stage.extend(outputs.iter().cloned());
            }
            stage
        })
        .collect();
    Ok(out)
}

/// The spec's module lists: every top-level module in exactly one stage, the stages in
/// forward order; the loss joins the last stage unless listed.
fn check_module_lists(modules: &[(String, ModuleKind)], lists: &[Vec<String>]) -> Result<Vec<Vec<String>>, PlanError> {
    let field = "pipeline.modules_per_stage";
    let order = |name: &str| modules.iter().position(|(n, _)| n == name);
    let mut stages = lists.to_vec();
    if let Some((loss, _)) = modules.iter().find(|(_, k)| *k == ModuleKind::Loss) {
        if !lists.iter().flatten().any(|m| m == loss) {
            stages
                .last_mut()
                .expect("frontends refuse an empty list")
                .push(loss.clone());
        }
    }
    let mut last_seen: Option<usize> = None;
    for (s, stage) in stages.iter().enumerate() {
        for name in stage {
            let Some(at) = order(name) else {
                let hint = did_you_mean(name, modules.iter().map(|(n, _)| n.as_str()))
                    .map(|m| format!(" (did you mean `{m}`?)"))
                    .unwrap_or_default();
                return Err(error(
                    field,
                    format!("stage {s} names `{name}`, which is not a top-level module of this model{hint}"),
                    "name top-level modules as `shardplan inspect` lists them",
                ));
            };
            if last_seen.is_some_and(|l| at <= l) {
                return Err(error(
                    field,
                    format!("stage {s} lists `{name}` after a module that runs later (or twice)"),
                    "list each module once, the stages and their modules in the order the forward runs them",
                ));
            }
            last_seen = Some(at);
        }
    }
    let listed: usize = stages.iter().map(Vec::len).sum();
    if listed != modules.len() {
        let missing: Vec<&str> = modules
            .iter()
            .map(|(n, _)| n.as_str())
            .filter(|n| !stages.iter().flatten().any(|m| m == n))
            .collect();
        return Err(error(
            field,
            format!("no stage holds {}", missing.join(", ")),
            "put every top-level module in one stage",
        ));
    }
    Ok(stages)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama(layers: usize) -> Vec<(String, ModuleKind)> {
        let mut m = vec![("tok_embeddings".to_string(), ModuleKind::Embedding)];
        m.extend((0..layers).map(|i| (format!("layers.{i}"), ModuleKind::Block)));
        m.extend([
            ("norm".to_string(), ModuleKind::Norm),
            ("output".to_string(), ModuleKind::Head),
            ("loss".to_string(), ModuleKind::Loss),
        ]);
        m
    }

    #[test]
    fn layers_split_as_torchtitan() {
        // 16 blocks + 1 + 1 over 8 stages: 18 / 8 = 2 rem 2; stages 0 and 1 take 3.
        let stages = split_by_layers(&llama(16), 8, 1, 1).unwrap();
        assert_eq!(stages[0], ["tok_embeddings", "layers.0", "layers.1"]);
        assert_eq!(stages[1], ["layers.2", "layers.3", "layers.4"]);
        assert_eq!(stages[2], ["layers.5", "layers.6"]);
        assert_eq!(stages[7], ["layers.15", "norm", "output", "loss"]);
        let blocks: usize = stages.iter().flatten().filter(|m| m.starts_with("layers.")).count();
        assert_eq!(blocks, 16);
    }

    #[test]
    fn too_many_stages_are_refused() {
        let err = split_by_layers(&llama(2), 8, 1, 1).unwrap_err();
        assert!(err.to_string().contains("leave some stage empty"), "{err}");
        let err = split_by_layers(&llama(4), 3, 3, 1).unwrap_err();
        assert!(err.to_string().contains("weigh 3 and 1 blocks"), "{err}");
    }

    #[test]
    fn module_lists_are_checked() {
        let m = llama(2);
        let ok = vec![
            vec!["tok_embeddings".into(), "layers.0".into()],
            vec!["layers.1".into(), "norm".into(), "output".into()],
        ];
        assert_eq!(check_module_lists(&m, &ok).unwrap()[1].last().unwrap(), "loss");
        let typo = vec![
            vec!["tok_embedings".into(), "layers.0".into()],
            vec!["layers.1".into(), "norm".into(), "output".into()],
        ];
        assert!(check_module_lists(&m, &typo)
            .unwrap_err()
            .to_string()
            .contains("did you mean `tok_embeddings`"));
        let swapped = vec![
            vec!["tok_embeddings".into(), "layers.1".into()],
            vec!["layers.0".into(), "norm".into(), "output".into()],
        ];
        assert!(check_module_lists(&m, &swapped)
            .unwrap_err()
            .to_string()
            .contains("runs later"));
        let missing = vec![
            vec!["tok_embeddings".into(), "layers.0".into()],
            vec!["norm".into(), "output".into()],
        ];
        assert!(check_module_lists(&m, &missing)
            .unwrap_err()
            .to_string()
            .contains("no stage holds layers.1"));
    }

    #[test]
    fn stage_count_from_layers_per_stage() {
        let split = |k| StageSplit::Layers {
            layers_per_stage: Some(k),
            first_stage_less_layers: 1,
            last_stage_less_layers: 1,
        };
        // 126 blocks + 2 = 128 effective: 4 a stage is 32 stages, 4 a rank over 8.
        assert_eq!(
            stages_per_rank(&split(4), None, PipelineSchedule::Interleaved1F1B, 8, 126).unwrap(),
            4
        );
        assert!(stages_per_rank(&split(4), None, PipelineSchedule::OneFOneB, 8, 126).is_err());
        assert!(stages_per_rank(&split(5), None, PipelineSchedule::Interleaved1F1B, 8, 126).is_err());
        assert!(stages_per_rank(&split(4), Some(2), PipelineSchedule::Interleaved1F1B, 8, 126).is_err());
        assert_eq!(
            stages_per_rank(&StageSplit::DEFAULT, None, PipelineSchedule::DualPipeV, 8, 126).unwrap(),
            2
        );
    }
}
