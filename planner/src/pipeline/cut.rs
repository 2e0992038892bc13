//! The model's forward graph cut into one graph per pipeline stage, each differentiated on
//! its own: what a pipeline rank runs for a stage's F, I, W and B, and what crosses
//! between stages (one activation forward, its gradient backward).
//!
//! A stage's graph keeps the model's parameter names and scopes; the first stage reads the
//! model's token input, the last its targets and makes the loss; every other boundary is
//! an input named `activation` and the stage's output, whose gradient comes in through the
//! joint graph's `output_grad` input.

use crate::PlanError;
use shardplan_ir::{differentiate_stage, DiffOptions, Graph, JointGraph, NodeId, Op, ParamId, ScopeId};
use std::collections::HashMap;

/// One stage's graphs and where its boundary values are.
#[derive(Clone, Debug)]
pub struct StageGraph {
    /// The stage's forward differentiated: forward nodes first, then backward.
    pub joint: JointGraph,
    /// The activation the stage receives (every stage but the first).
    pub input: Option<NodeId>,
    /// That activation's gradient, which the stage sends back.
    pub input_grad: Option<NodeId>,
    /// What the stage sends forward; the loss on the last stage.
    pub output: NodeId,
    /// The input fed with the gradient of `output` (every stage but the last).
    pub output_grad: Option<NodeId>,
    /// The model's id of each of the stage's parameters, by the stage's parameter id.
    pub params: Vec<ParamId>,
}

impl StageGraph {
    /// Backward nodes the input gradient needs (the I half of a split backward), in id
    /// order, with the output gradient's input, which the I half receives.
    pub fn input_half(&self) -> Vec<NodeId> {
        let g = &self.joint.graph;
        let mut needed = vec![false; g.node_count()];
        for n in self.input_grad.iter().chain(&self.output_grad) {
            needed[n.index()] = true;
        }
        for (id, node) in g.nodes().collect::<Vec<_>>().into_iter().rev() {
            if needed[id.index()] {
                for i in &node.inputs {
                    needed[i.index()] = true;
                }
            }
        }
        (self.joint.forward_len..g.node_count())
            .filter(|&i| needed[i])
            .map(NodeId::new)
            .collect()
    }

    /// The backward nodes the input half leaves (the W half), in id order.
    pub fn weight_half(&self) -> Vec<NodeId> {
        let input = self.input_half();
        (self.joint.forward_len..self.joint.graph.node_count())
            .map(NodeId::new)
            .filter(|n| input.binary_search(n).is_err())
            .collect()
    }
}

/// The graph of every stage of `modules` (each stage's top-level modules, as
/// [`PipelinePlan::stages`](super::PipelinePlan) lists them) cut from `forward`.
pub fn stage_graphs(
    forward: &Graph,
    modules: &[Vec<String>],
    options: DiffOptions,
) -> Result<Vec<StageGraph>, PlanError> {
    let stage_of = stage_of_nodes(forward, modules);
    cut_stages(forward, &stage_of, modules.len(), options)
}

/// Each node's stage (`None` for the model's inputs, which any stage may read): a node
/// goes with its top-level module, a backward node with its forward node.
pub(crate) fn stage_of_nodes(g: &Graph, stages: &[Vec<String>]) -> Vec<Option<usize>> {
    let stage_of_module: HashMap<&str, usize> = stages
        .iter()
        .enumerate()
        .flat_map(|(s, modules)| modules.iter().map(move |m| (m.as_str(), s)))
        .collect();
    let stage_of_scope: HashMap<ScopeId, usize> = g
        .scopes()
        .filter_map(|(id, _)| {
            let top = g.top_level(id);
            let stage = stage_of_module.get(g.scope(top).path.as_str())?;
            (top != g.root()).then_some((id, *stage))
        })
        .collect();
    let mut stage_of: Vec<Option<usize>> = Vec::with_capacity(g.node_count());
    for (_, node) in g.nodes() {
        let stage = match (stage_of_scope.get(&node.scope), &node.op, node.grad_of) {
            (Some(&s), _, _) => Some(s),
            (None, Op::Input { .. }, None) => None,
            (None, _, Some(of)) => stage_of[of.index()],
            // An op at the model's root (GPT-2's sum of token and position embeddings)
            // goes with the latest stage of its operands.
            (None, _, None) => node.inputs.iter().filter_map(|i| stage_of[i.index()]).max(),
        };
        stage_of.push(stage);
    }
    stage_of
}

/// Cuts `forward` (the model's forward graph) into a graph per stage, `stage_of[node]`
/// giving each node's stage (`None` for the model's inputs), and differentiates each.
pub fn cut_stages(
    forward: &Graph,
    stage_of: &[Option<usize>],
    stages: usize,
    options: DiffOptions,
) -> Result<Vec<StageGraph>, PlanError> {
    let loss = *forward
        .outputs()
        .first()
        .ok_or_else(|| PlanError::Bug("the model's graph has no loss".into()))?;
    if stages == 0 {
        return Err(PlanError::Bug("a pipeline of no stages".into()));
    }
    if stage_of[loss.index()] != Some(stages - 1) {
        return Err(cut_error("the loss is not made on the last stage".into()));
    }
    let crossing = boundaries(forward, stage_of, stages)?;
    (0..stages)
        .map(|s| {
            let input = s.checked_sub(1).map(|b| crossing[b]);
            let output = if s + 1 == stages { loss } else { crossing[s] };
            cut_one(forward, stage_of, s, input, output, options)
        })
        .collect()
}

/// The one value crossing each boundary `b` (from stage `b` to `b + 1`): what stages up to
/// `b` make and later stages read. Refused where it is not exactly one activation.
fn boundaries(forward: &Graph, stage_of: &[Option<usize>], stages: usize) -> Result<Vec<NodeId>, PlanError> {
    let mut crossing: Vec<Vec<NodeId>> = vec![Vec::new(); stages.saturating_sub(1)];
    for (id, node) in forward.nodes() {
        let Some(reader) = stage_of[id.index()] else {
            continue;
        };
        for &value in &node.inputs {
            let Some(maker) = stage_of[value.index()] else {
                continue;
            };
            if maker > reader {
                return Err(cut_error(format!(
                    "stage {reader} reads {value}, which the later stage {maker} makes: stages must follow the model's order"
                )));
            }
            for values in &mut crossing[maker..reader] {
                if !values.contains(&value) {
                    values.push(value);
                }
            }
        }
    }
    crossing
        .into_iter()
        .enumerate()
        .map(|(b, values)| match values.as_slice() {
            [one] if matches!(forward.node(*one).op, Op::Param { .. }) => Err(shared_param(forward, *one, b)),
            [one] if stage_of[one.index()] == Some(b) => Ok(*one),
            [one] => Err(cut_error(format!(
                "stage {} passes on {one} from an earlier stage without reading it",
                b
            ))),
            many if many.iter().any(|v| read_by_aux_loss(forward, *v)) => Err(PlanError::Pipeline {
                field: "pipeline",
                message: format!(
                    "the load-balancing loss reads every MoE layer's router logits, which cross from stage {b} to stage {} beside the activation, and a stage sends one activation",
                    b + 1
                ),
                fix: "set the model's moe.aux_loss_coef to 0 to train it with a pipeline".into(),
            }),
            many => match many.iter().find(|v| matches!(forward.node(**v).op, Op::Param { .. })) {
                Some(p) => Err(shared_param(forward, *p, b)),
                None => Err(cut_error(format!(
                    "{} values cross from stage {b} to stage {} ({}), but a stage sends one activation",
                    many.len(),
                    b + 1,
                    many.iter()
                        .map(|v| format!("{v} in {}", forward.scope(forward.node(*v).scope).display_path()))
                        .collect::<Vec<_>>()
                        .join(", ")
                ))),
            },
        })
        .collect()
}

/// Whether the MoE load-balancing loss reads `value` (a layer's router logits).
fn read_by_aux_loss(forward: &Graph, value: NodeId) -> bool {
    forward
        .users(value)
        .iter()
        .any(|u| matches!(forward.node(*u).op, Op::MoeAuxLoss { .. }))
}

fn shared_param(forward: &Graph, node: NodeId, boundary: usize) -> PlanError {
    let name = match forward.node(node).op {
        Op::Param { param } => forward.param(param).name.to_string(),
        _ => node.to_string(),
    };
    PlanError::Pipeline {
        field: "pipeline",
        message: format!(
            "parameter `{name}` is read on both sides of the boundary after stage {boundary} (tied weights), and pipeline stages hold disjoint parameters"
        ),
        fix: "untie the weights (tie_word_embeddings: false), or train without a pipeline".into(),
    }
}

fn cut_error(message: String) -> PlanError {
    PlanError::Pipeline {
        field: "pipeline",
        message,
        fix: "split the model between blocks, so one activation crosses each boundary".into(),
    }
}

/// Stage `s`'s graph: its nodes, the model inputs they read, and `input` (the activation
/// from the previous stage) as an input named `activation`.
fn cut_one(
    forward: &Graph,
    stage_of: &[Option<usize>],
    s: usize,
    input: Option<NodeId>,
    output: NodeId,
    options: DiffOptions,
) -> Result<StageGraph, PlanError> {
    let mut g = Graph::new(forward.name());
    g.set_expert_overlap(forward.expert_overlap());
    let mut scopes: HashMap<ScopeId, ScopeId> = HashMap::from([(forward.root(), g.root())]);
    let mut nodes: HashMap<NodeId, NodeId> = HashMap::new();
    let mut params = Vec::new();
    let ir = |e: shardplan_ir::IrError| PlanError::Graph(e.to_string());
    if let Some(x) = input {
        let root = g.root();
        let local = g
            .add_input("activation", forward.node(x).ty.clone(), root)
            .map_err(ir)?;
        nodes.insert(x, local);
    }
    for (id, node) in forward.nodes() {
        let mine = stage_of[id.index()] == Some(s);
        let model_input = stage_of[id.index()].is_none()
            && matches!(node.op, Op::Input { .. })
            && forward.users(id).iter().any(|u| stage_of[u.index()] == Some(s));
        if !mine && !model_input {
            continue;
        }
        let scope = copy_scope(forward, &mut g, &mut scopes, node.scope);
        let local = match &node.op {
            Op::Input { name } => g.add_input(name, node.ty.clone(), scope).map_err(ir)?,
            Op::Param { param } => {
                params.push(*param);
                g.add_param_like(forward.param(*param), scope).map_err(ir)?
            }
            op => {
                let ins = node
                    .inputs
                    .iter()
                    .map(|i| {
                        nodes
                            .get(i)
                            .copied()
                            .ok_or_else(|| PlanError::Bug(format!("stage {s} reads {i}, which it lacks")))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                g.add_node(op.clone(), &ins, scope).map_err(ir)?
            }
        };
        nodes.insert(id, local);
    }
    g.set_tensor_degree(forward.tensor_degree());
    let out = nodes[&output];
    g.add_output(out);
    let local_input = input.map(|x| nodes[&x]);
    let diff = differentiate_stage(&g, options, local_input.as_slice()).map_err(ir)?;
    Ok(StageGraph {
        input: local_input,
        input_grad: diff.input_grads.first().copied(),
        output: out,
        output_grad: diff.output_grad,
        params,
        joint: diff.joint,
    })
}

/// The stage graph's copy of `scope` (and its ancestors), made on first use.
fn copy_scope(forward: &Graph, g: &mut Graph, scopes: &mut HashMap<ScopeId, ScopeId>, scope: ScopeId) -> ScopeId {
    if let Some(&local) = scopes.get(&scope) {
        return local;
    }
    let s = forward.scope(scope);
    let parent = s.parent.unwrap_or_else(|| forward.root());
    let local_parent = copy_scope(forward, g, scopes, parent);
    let segment = s.path.rsplit('.').next().unwrap_or(&s.path).to_string();
    let segment = match forward.scope(parent).path.as_str() {
        "" => s.path.clone(),
        p => s.path.strip_prefix(&format!("{p}.")).map_or(segment, str::to_string),
    };
    let local = g.add_scope(local_parent, &segment, s.kind);
    scopes.insert(scope, local);
    local
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardplan_models::{preset, trace, ModelConfig, TraceOptions};

    fn modules(model: &ModelConfig, stages: &[&[&str]]) -> Result<Vec<StageGraph>, PlanError> {
        let forward = trace(model, TraceOptions::default()).unwrap();
        let lists: Vec<Vec<String>> = stages
            .iter()
            .map(|s| s.iter().map(|m| m.to_string()).collect())
            .collect();
        stage_graphs(&forward, &lists, DiffOptions::default())
    }

    #[test]
    fn a_llama_cuts_into_stages_that_hold_every_parameter_once() {
        let model = preset("tiny-llama").unwrap();
        let stages = modules(
            &model,
            &[
                &["tok_embeddings", "layers.0"],
                &["layers.1"],
                &["norm", "output", "loss"],
            ],
        )
        .unwrap();
        let forward = trace(&model, TraceOptions::default()).unwrap();
        let mut held: Vec<ParamId> = stages.iter().flat_map(|s| s.params.clone()).collect();
        held.sort();
        assert_eq!(held, forward.params().map(|(p, _)| p).collect::<Vec<_>>());
        assert!(stages[0].input.is_none() && stages[0].output_grad.is_some());
        assert!(stages[2].input.is_some() && stages[2].output_grad.is_none());
        // The hidden state crosses each boundary, and its gradient comes back.
        for pair in stages.windows(2) {
            let sent = &pair[0].joint.graph.node(pair[0].output).ty;
            let got = &pair[1].joint.graph.node(pair[1].input.unwrap()).ty;
            assert_eq!(sent, got);
            assert_eq!(&pair[1].joint.graph.node(pair[1].input_grad.unwrap()).ty, got);
        }
        // Every backward node is in exactly one half.
        for s in &stages {
            let halves = s.input_half().len() + s.weight_half().len();
            assert_eq!(halves, s.joint.graph.node_count() - s.joint.forward_len);
        }
    }

    #[test]
    fn tied_weights_across_stages_are_refused_by_name() {
        // GPT-2's head reads the token embedding's table.
        let model = preset("tiny-gpt2").unwrap();
        let err = modules(&model, &[&["wte", "wpe", "h.0"], &["h.1", "ln_f", "lm_head", "loss"]])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`transformer.wte.weight`") && err.contains("tied"),
            "{err}"
        );
    }

    #[test]
    fn an_op_at_the_root_goes_with_its_operands_stage() {
        // GPT-2 adds token and position embeddings at its root: stage 0 sends the sum.
        let model = preset("tiny-gpt2").unwrap();
        let forward = trace(&model, TraceOptions::default()).unwrap();
        let lists = vec![vec!["wte".to_string(), "wpe".into(), "h.0".into()], vec!["h.1".into()]];
        let stage_of = super::stage_of_nodes(&forward, &lists);
        let add = forward
            .nodes()
            .find(|(_, n)| n.scope == forward.root() && matches!(n.op, Op::Add))
            .map(|(id, _)| id)
            .unwrap();
        assert_eq!(stage_of[add.index()], Some(0));
    }

    #[test]
    fn the_moe_load_balancing_loss_across_stages_is_refused_with_its_fix() {
        // tiny-moe: three layers, the first dense, the load-balancing loss on.
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-moe.yaml");
        let model = shardplan_frontends::load_model(&path).unwrap().config;
        let err = modules(
            &model,
            &[
                &["tok_embeddings", "layers.0", "layers.1"],
                &["layers.2", "norm", "output", "loss"],
            ],
        )
        .unwrap_err();
        assert!(err.to_string().contains("load-balancing loss"), "{err}");
        assert!(err.help().contains("aux_loss_coef to 0"), "{}", err.help());
    }

    #[test]
    fn stages_out_of_model_order_are_refused() {
        let model = preset("tiny-llama").unwrap();
        let err = modules(
            &model,
            &[&["tok_embeddings", "layers.1"], &["layers.0", "norm", "output", "loss"]],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("model's order"), "{err}");
    }
}
