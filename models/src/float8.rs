//! Float8 linears chosen as torchao's `convert_to_float8_training` chooses them, with
//! torchtitan's filter: every `torch.nn.Linear` whose module path contains none of
//! `filter_fqns`, whose dims are multiples of 16 and (with `auto_filter_small_kn`) which
//! torchao's size heuristics would speed up.

use shardplan_ir::{Float8Recipe, Graph, IrError, NodeId, Op, WeightLayout};

/// torchtitan's filter entry that turns on torchao's `_auto_filter_for_recipe`.
pub const AUTO_FILTER: &str = "auto_filter_small_kn";

/// Which linear layers train in Float8, and how.
#[derive(Clone, Debug, PartialEq)]
pub struct Float8Options {
    pub recipe: Float8Recipe,
    /// Linears whose module path (Hugging Face's, `model.layers.0.mlp.down_proj`)
    /// contains any of these stay in high precision; [`AUTO_FILTER`] among them adds
    /// torchao's size heuristics.
    pub filter_fqns: Vec<String>,
}

/// A linear layer left in high precision, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Float8Skip {
    /// The module path (`lm_head`), or the tied weight's name.
    pub module: String,
    pub reason: String,
}

/// What a conversion did: the module paths of the Float8 linears, in forward order, and
/// the linears it left.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Float8Linears {
    pub converted: Vec<String>,
    pub skipped: Vec<Float8Skip>,
}

impl Float8Options {
    /// Why the linear `module` with a weight of `out x in` stays in high precision
    /// (`None`: it converts).
    pub fn skip_reason(&self, module: &str, out: u64, inp: u64) -> Option<String> {
        if let Some(f) = self
            .filter_fqns
            .iter()
            .find(|f| *f != AUTO_FILTER && module.contains(f.as_str()))
        {
            return Some(format!("filter_fqns has `{f}`"));
        }
        if !out.is_multiple_of(16) || !inp.is_multiple_of(16) {
            return Some(format!(
                "its weight is {out} x {inp}; float8 GEMMs need multiples of 16"
            ));
        }
        if !self.filter_fqns.iter().any(|f| f == AUTO_FILTER) {
            return None;
        }
        // torchao's thresholds, N the output features and K the input ones.
        let (n, k) = (out, inp);
        let small = match self.recipe {
            Float8Recipe::Tensorwise => k <= 4096 && n <= 1024,
            _ => n <= 2048 || k <= 1024 || (n <= 4096 && k <= 2048),
        };
        small.then(|| {
            format!(
                "{AUTO_FILTER}: a {n} x {k} GEMM is too small for {} to pay",
                self.recipe.name()
            )
        })
    }
}

/// Which of the forward graph's linear layers `opts` makes Float8 (their nodes, and their
/// module paths in `converted`) and which it leaves, with why; the graph is not changed.
pub fn classify(g: &Graph, opts: &Float8Options) -> (Vec<NodeId>, Float8Linears) {
    let mut nodes = Vec::new();
    let mut done = Float8Linears::default();
    for (id, node) in g.nodes().filter(|(_, n)| !n.is_backward()) {
        let Op::Linear { layout, .. } = node.op else { continue };
        let Op::Param { param } = g.node(node.inputs[1]).op else {
            continue;
        };
        let p = g.param(param);
        let name = p.name.strip_suffix(".weight").unwrap_or(&p.name).to_string();
        let reason = if p.scope != node.scope {
            Some("its weight is tied to another module's".to_string())
        } else if layout == WeightLayout::InOut {
            Some("its weight is [in, out] (GPT-2's Conv1D, not a torch.nn.Linear)".to_string())
        } else {
            let local = p.ty.shape.dims();
            let whole = p.tensor.map_or_else(|| local.to_vec(), |t| t.whole_dims(local));
            opts.skip_reason(&name, whole[0], whole[1])
        };
        match reason {
            Some(reason) => done.skipped.push(Float8Skip { module: name, reason }),
            None => {
                nodes.push(id);
                done.converted.push(name);
            }
        }
    }
    (nodes, done)
}

/// Makes the forward graph's eligible linear layers Float8 ones ([`classify`]).
pub fn convert(g: &mut Graph, opts: &Float8Options) -> Result<Float8Linears, IrError> {
    let (nodes, done) = classify(g, opts);
    for id in nodes {
        g.set_float8(id, opts.recipe)?;
    }
    Ok(done)
}

/// The Float8 linears of a graph already converted, by module path, in forward order.
pub fn float8_linears(g: &Graph) -> Vec<String> {
    g.nodes()
        .filter(|(_, n)| matches!(n.op, Op::Linear { float8: Some(_), .. }) && !n.is_backward())
        .filter_map(|(_, n)| match g.node(n.inputs[1]).op {
            Op::Param { param } => {
                let name = &g.param(param).name;
                Some(name.strip_suffix(".weight").unwrap_or(name).to_string())
            }
            _ => None,
        })
        .collect()
}
