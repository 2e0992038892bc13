//! The graph: nodes on petgraph, with parameter and scope side tables.

use crate::{IdVec, IrError, ModuleKind, NodeId, Op, ParamId, Scope, ScopeId, TensorType};
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::Direction;
use std::collections::HashSet;

/// A node's operands: held inline up to four (every op but a concatenation of more), so
/// making and dropping a large graph does not allocate per node.
pub type Operands = smallvec::SmallVec<[NodeId; 4]>;

/// One op application; it produces exactly one value, named by its [`NodeId`].
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    /// Operands in the order the op's contract gives.
    pub inputs: Operands,
    /// Type of the value the node produces.
    pub ty: TensorType,
    /// Module the node was traced in; for a backward node, the module of the forward node
    /// it differentiates.
    pub scope: ScopeId,
    /// For a backward node: the forward node whose gradient rule created it.
    pub grad_of: Option<NodeId>,
}

impl Node {
    /// True for nodes of the backward pass.
    pub fn is_backward(&self) -> bool {
        self.grad_of.is_some()
    }
}

/// A trainable parameter, named exactly as in Hugging Face checkpoints.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    pub name: std::sync::Arc<str>,
    pub ty: TensorType,
    /// Module that owns the parameter (a tied weight is owned by its first user).
    pub scope: ScopeId,
    /// The `param` node that yields it.
    pub node: NodeId,
    /// In a tensor-parallel graph: how this rank's tensor is cut from the whole one
    /// (`None`: every tensor rank holds it whole).
    pub tensor: Option<TensorSplit>,
    /// In an expert-parallel graph: a routed expert's parameter, which each expert rank
    /// holds for its own experts (`None`: every expert rank holds it).
    pub expert: Option<ExpertSplit>,
}

impl Param {
    /// Elements of the whole parameter (every tensor rank's slice together).
    /// Under expert parallelism, every expert rank's copy of a routed expert's parameter
    /// counts (the whole model's experts).
    pub fn whole_numel(&self) -> u64 {
        let local = self.ty.numel().unwrap_or(0);
        let whole = match &self.tensor {
            Some(s) => local.saturating_mul(s.degree),
            None => local,
        };
        match &self.expert {
            Some(e) => whole.saturating_mul(e.degree),
            None => whole,
        }
    }
}

impl Param {
    /// Its Hugging Face name on expert rank `rank` (the graph names expert rank 0's).
    pub fn name_on(&self, rank: u64) -> std::borrow::Cow<'_, str> {
        match &self.expert {
            Some(e) if rank > 0 => std::borrow::Cow::Owned(e.name_on(&self.name, rank)),
            _ => std::borrow::Cow::Borrowed(&self.name),
        }
    }
}

/// Which routed expert a parameter of an expert-parallel graph belongs to: expert rank `r`
/// holds experts `r * per_rank .. (r + 1) * per_rank` of every MoE layer, and this
/// parameter is its expert `local` of them. The graph names the parameter as on rank 0,
/// where the expert's number is `local`, written at byte `name_at` of the name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ExpertSplit {
    pub local: u64,
    pub per_rank: u64,
    pub degree: u64,
    pub name_at: u32,
}

impl ExpertSplit {
    /// The expert's number (of `per_rank * degree`) on expert rank `rank`.
    pub fn expert(&self, rank: u64) -> u64 {
        rank * self.per_rank + self.local
    }

    /// `name` (rank 0's) with the expert's number on `rank`.
    pub fn name_on(&self, name: &str, rank: u64) -> String {
        let at = (self.name_at as usize).min(name.len());
        let digits = self.local.to_string().len();
        let rest = name.get(at + digits..).unwrap_or("");
        format!("{}{}{rest}", &name[..at], self.expert(rank))
    }
}

/// Where a tensor-parallel parameter's slice sits in the whole parameter: `dim` is cut
/// into `parts` equal blocks (3 for GPT-2's fused q/k/v projection, else 1), and each
/// block into `degree` equal chunks, of which tensor rank `r` holds chunk `r` of every
/// block, in block order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TensorSplit {
    pub dim: usize,
    pub parts: u64,
    pub degree: u64,
}

impl TensorSplit {
    /// The whole parameter's dims, from this rank's slice's.
    pub fn whole_dims(&self, local: &[u64]) -> Vec<u64> {
        let mut d = local.to_vec();
        d[self.dim] *= self.degree;
        d
    }

    /// The row-major index in the whole parameter of element `i` of tensor rank `rank`'s
    /// slice, whose dims are `local`.
    pub fn whole_index(&self, local: &[u64], rank: u64, i: u64) -> u64 {
        let whole = self.whole_dims(local);
        // Split `i` into the local coordinates, move the split dim's, recompose.
        let mut rest = i;
        let mut coords = vec![0u64; local.len()];
        for d in (0..local.len()).rev() {
            coords[d] = rest % local[d].max(1);
            rest /= local[d].max(1);
        }
        let chunk = local[self.dim] / self.parts.max(1);
        let (part, within) = (coords[self.dim] / chunk.max(1), coords[self.dim] % chunk.max(1));
        coords[self.dim] = part * (whole[self.dim] / self.parts.max(1)) + rank * chunk + within;
        coords.iter().zip(&whole).fold(0u64, |acc, (&c, &n)| acc * n + c)
    }

    /// The ranges of `dim` of the whole parameter that tensor rank `rank` holds, in order:
    /// `(start, len)` per block.
    pub fn ranges(&self, whole: u64, rank: u64) -> Vec<(u64, u64)> {
        let block = whole / self.parts;
        let chunk = block / self.degree;
        (0..self.parts).map(|p| (p * block + rank * chunk, chunk)).collect()
    }
}

/// A traced model: a DAG of tensor ops with concrete types.
///
/// Nodes are appended after their operands, so id order is a topological order.
/// Architecture invariant: petgraph indices never leave this module; callers see [`NodeId`].
#[derive(Clone, Debug)]
pub struct Graph {
    name: String,
    dag: DiGraph<Node, u32, u32>,
    params: IdVec<ParamId, Param>,
    /// Names in `params`, for the uniqueness check.
    param_names: HashSet<String>,
    scopes: IdVec<ScopeId, Scope>,
    inputs: Vec<NodeId>,
    outputs: Vec<NodeId>,
    tensor_degree: u64,
    expert_degree: u64,
    expert_overlap: bool,
    /// The context layout of a context-parallel graph's ops (`None`: every rank holds
    /// whole sequences).
    context: Option<crate::ContextLayout>,
}

impl Graph {
    /// An empty graph whose root scope has id `m0`.
    pub fn new(name: impl Into<String>) -> Self {
        Graph {
            name: name.into(),
            dag: DiGraph::default(),
            params: IdVec::new(),
            param_names: HashSet::new(),
            scopes: IdVec::from(vec![Scope {
                path: String::new(),
                kind: ModuleKind::Root,
                parent: None,
            }]),
            inputs: Vec::new(),
            outputs: Vec::new(),
            tensor_degree: 1,
            expert_degree: 1,
            expert_overlap: true,
            context: None,
        }
    }

    /// The root scope.
    pub fn root(&self) -> ScopeId {
        ScopeId::new(0)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// A child scope of `parent` named `segment` (paths join with `.`).
    pub fn add_scope(&mut self, parent: ScopeId, segment: &str, kind: ModuleKind) -> ScopeId {
        let parent_path = &self.scopes[parent].path;
        let path = if parent_path.is_empty() {
            segment.to_string()
        } else {
            format!("{parent_path}.{segment}")
        };
        self.scopes.push(Scope {
            path,
            kind,
            parent: Some(parent),
        })
    }

    /// A data input of the given type.
    pub fn add_input(&mut self, name: &str, ty: TensorType, scope: ScopeId) -> Result<NodeId, IrError> {
        self.check_size(name, &ty, scope)?;
        let id = self.push(Op::Input { name: name.to_string() }, &[], ty, scope);
        self.inputs.push(id);
        Ok(id)
    }

    /// A parameter named as in HF checkpoints; names are unique.
    pub fn add_param(&mut self, name: &str, ty: TensorType, scope: ScopeId) -> Result<NodeId, IrError> {
        self.check_size(name, &ty, scope)?;
        if !self.param_names.insert(name.to_string()) {
            return Err(IrError::DuplicateParam(name.to_string()));
        }
        let param = self.params.next_key();
        let node = self.push(Op::Param { param }, &[], ty.clone(), scope);
        let pushed = self.params.push(Param {
            name: name.into(),
            ty,
            scope,
            node,
            tensor: None,
            expert: None,
        });
        debug_assert_eq!(pushed, param);
        Ok(node)
    }

    /// As [`Graph::add_param`], for a tensor-parallel parameter this rank holds a slice of.
    pub fn add_split_param(
        &mut self,
        name: &str,
        ty: TensorType,
        scope: ScopeId,
        split: TensorSplit,
    ) -> Result<NodeId, IrError> {
        let node = self.add_param(name, ty, scope)?;
        if let Op::Param { param } = self.dag[NodeIndex::new(node.index())].op {
            self.params[param].tensor = Some(split);
        }
        self.tensor_degree = self.tensor_degree.max(split.degree);
        Ok(node)
    }

    /// As [`Graph::add_param`], for a routed expert's parameter of an expert-parallel graph.
    pub fn add_expert_param(
        &mut self,
        name: &str,
        ty: TensorType,
        scope: ScopeId,
        split: ExpertSplit,
    ) -> Result<NodeId, IrError> {
        let node = self.add_param(name, ty, scope)?;
        if let Op::Param { param } = self.dag[NodeIndex::new(node.index())].op {
            self.params[param].expert = Some(split);
        }
        self.expert_degree = self.expert_degree.max(split.degree);
        Ok(node)
    }

    /// As [`Graph::add_param`], for a routed expert's parameter that is also split over the
    /// tensor group (expert tensor parallelism: each tensor rank holds a slice of each of
    /// its expert rank's experts).
    pub fn add_expert_split_param(
        &mut self,
        name: &str,
        ty: TensorType,
        scope: ScopeId,
        expert: ExpertSplit,
        tensor: TensorSplit,
    ) -> Result<NodeId, IrError> {
        let node = self.add_expert_param(name, ty, scope, expert)?;
        if let Op::Param { param } = self.dag[NodeIndex::new(node.index())].op {
            self.params[param].tensor = Some(tensor);
        }
        self.tensor_degree = self.tensor_degree.max(tensor.degree);
        Ok(node)
    }

    /// A parameter like `param` of another graph (its name, type and tensor or expert
    /// split), owned by `scope` of this one: how a pipeline stage's graph takes the model's
    /// parameters.
    pub fn add_param_like(&mut self, param: &Param, scope: ScopeId) -> Result<NodeId, IrError> {
        let node = self.add_param(&param.name, param.ty.clone(), scope)?;
        if let Op::Param { param: id } = self.dag[NodeIndex::new(node.index())].op {
            self.params[id].tensor = param.tensor;
            self.params[id].expert = param.expert;
        }
        if let Some(s) = param.tensor {
            self.tensor_degree = self.tensor_degree.max(s.degree);
        }
        if let Some(s) = param.expert {
            self.expert_degree = self.expert_degree.max(s.degree);
        }
        Ok(node)
    }

    /// Ranks of the expert-parallel group this graph is one rank's program for (1: every
    /// rank holds every expert).
    pub fn expert_degree(&self) -> u64 {
        self.expert_degree
    }

    /// Whether the expert group's collectives were traced for overlap (shardplan's runtime:
    /// each a step of its own on the all-to-all stream), or in torchtitan's order inside the
    /// experts' module (`runtime: fsdp2` and `export fsdp2`): the planner cuts them into
    /// steps of their own only in the first case.
    pub fn expert_overlap(&self) -> bool {
        self.expert_overlap
    }

    pub fn set_expert_overlap(&mut self, overlap: bool) {
        self.expert_overlap = overlap;
    }

    /// Ranks of the tensor-parallel group this graph is one rank's program for (1: not
    /// tensor-parallel).
    pub fn tensor_degree(&self) -> u64 {
        self.tensor_degree
    }

    /// How a context-parallel graph's rows sit in their sequences (from its first op that
    /// reads a position); `None` without context parallelism.
    pub fn context_layout(&self) -> Option<crate::ContextLayout> {
        self.context
    }

    /// Ranks of the context group this graph is one rank's program of (1: none).
    pub fn context_degree(&self) -> u64 {
        self.context.map_or(1, |l| l.degree)
    }

    /// Marks the graph as one rank's program of a `degree`-rank tensor group.
    pub fn set_tensor_degree(&mut self, degree: u64) {
        self.tensor_degree = degree.max(1);
    }

    /// Applies `op` to `inputs`, inferring the result type.
    pub fn add_node(&mut self, op: Op, inputs: &[NodeId], scope: ScopeId) -> Result<NodeId, IrError> {
        if let Some(bad) = inputs.iter().find(|i| i.index() >= self.dag.node_count()) {
            return Err(IrError::UnknownOperand {
                op: op.name(),
                scope: self.scope(scope).display_path().to_string(),
                operand: bad.to_string(),
            });
        }
        let types: Vec<&TensorType> = inputs.iter().map(|&i| &self.node(i).ty).collect();
        let ty = op.infer(&types).map_err(|reason| IrError::Shape {
            op: op.name(),
            scope: self.scope(scope).display_path().to_string(),
            operands: types.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", "),
            reason,
        })?;
        self.check_size(op.name(), &ty, scope)?;
        Ok(self.push(op, inputs, ty, scope))
    }

    /// A backward node: `op` applied to `inputs`, part of the gradient rule of `grad_of`,
    /// in that node's scope.
    pub fn add_grad_node(&mut self, op: Op, inputs: &[NodeId], grad_of: NodeId) -> Result<NodeId, IrError> {
        let scope = self.node(grad_of).scope;
        let id = self.add_node(op, inputs, scope)?;
        self.dag[NodeIndex::new(id.index())].grad_of = Some(grad_of);
        Ok(id)
    }

    /// A constant tensor of `ty` filled with `value`, in the backward pass of `grad_of`.
    pub fn add_fill(&mut self, value: f64, ty: TensorType, grad_of: NodeId) -> Result<NodeId, IrError> {
        let scope = self.node(grad_of).scope;
        self.check_size("fill", &ty, scope)?;
        let id = self.push(Op::Fill { value }, &[], ty, scope);
        self.dag[NodeIndex::new(id.index())].grad_of = Some(grad_of);
        Ok(id)
    }

    /// Marks node `id` (an input) as part of the backward pass of `grad_of`: the gradient
    /// a pipeline stage receives for its output.
    pub fn mark_backward(&mut self, id: NodeId, grad_of: NodeId) {
        self.dag[NodeIndex::new(id.index())].grad_of = Some(grad_of);
    }

    /// Makes the forward linear layer `id` a Float8 one under `recipe` (torchao's
    /// `convert_to_float8_training` swaps the module; its value's type is unchanged).
    /// Errors for any other node, or for `[in, out]` weights.
    pub fn set_float8(&mut self, id: NodeId, recipe: crate::Float8Recipe) -> Result<(), IrError> {
        let scope = self.scope(self.node(id).scope).display_path().to_string();
        let node = &mut self.dag[NodeIndex::new(id.index())];
        match &mut node.op {
            Op::Linear {
                layout: crate::WeightLayout::OutIn,
                float8,
                ..
            } if node.grad_of.is_none() => {
                *float8 = Some(recipe);
                Ok(())
            }
            op => Err(IrError::Shape {
                op: op.name(),
                scope,
                operands: String::new(),
                reason: "only a forward linear layer with [out, in] weights trains in Float8".into(),
            }),
        }
    }

    /// Marks a node as a graph output (the loss).
    pub fn add_output(&mut self, node: NodeId) {
        self.outputs.push(node);
    }

    fn check_size(&self, what: &str, ty: &TensorType, scope: ScopeId) -> Result<(), IrError> {
        match ty.bytes() {
            Some(_) => Ok(()),
            None => Err(IrError::Overflow {
                what: what.to_string(),
                scope: self.scope(scope).display_path().to_string(),
                ty: ty.to_string(),
            }),
        }
    }

    fn push(&mut self, op: Op, inputs: &[NodeId], ty: TensorType, scope: ScopeId) -> NodeId {
        self.context = self.context.or(op.context());
        let idx = self.dag.add_node(Node {
            op,
            inputs: Operands::from_slice(inputs),
            ty,
            scope,
            grad_of: None,
        });
        for (pos, src) in inputs.iter().enumerate() {
            self.dag.add_edge(NodeIndex::new(src.index()), idx, pos as u32);
        }
        NodeId::new(idx.index())
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.dag[NodeIndex::new(id.index())]
    }

    /// All nodes in id (topological) order.
    pub fn nodes(&self) -> impl Iterator<Item = (NodeId, &Node)> + '_ {
        self.dag.node_weights().enumerate().map(|(i, n)| (NodeId::new(i), n))
    }

    pub fn node_count(&self) -> usize {
        self.dag.node_count()
    }

    pub fn edge_count(&self) -> usize {
        self.dag.edge_count()
    }

    /// Nodes that read `id`'s value, in id order (a node reading it twice appears once).
    pub fn users(&self, id: NodeId) -> Vec<NodeId> {
        let mut users: Vec<NodeId> = self
            .dag
            .neighbors_directed(NodeIndex::new(id.index()), Direction::Outgoing)
            .map(|n| NodeId::new(n.index()))
            .collect();
        users.sort_unstable();
        users.dedup();
        users
    }

    pub fn param(&self, id: ParamId) -> &Param {
        &self.params[id]
    }

    pub fn params(&self) -> impl ExactSizeIterator<Item = (ParamId, &Param)> + '_ {
        self.params.iter()
    }

    pub fn scope(&self, id: ScopeId) -> &Scope {
        &self.scopes[id]
    }

    pub fn scopes(&self) -> impl ExactSizeIterator<Item = (ScopeId, &Scope)> + '_ {
        self.scopes.iter()
    }

    /// The innermost scope of kind `kind` that is `id` or holds it, if any.
    pub fn enclosing(&self, id: ScopeId, kind: crate::ModuleKind) -> Option<ScopeId> {
        let mut cur = Some(id);
        while let Some(c) = cur {
            if self.scope(c).kind == kind {
                return Some(c);
            }
            cur = self.scope(c).parent;
        }
        None
    }

    /// The outermost non-root ancestor of `id` (itself when it is top level), or the root.
    pub fn top_level(&self, id: ScopeId) -> ScopeId {
        let mut cur = id;
        while let Some(parent) = self.scope(cur).parent {
            if parent == self.root() {
                return cur;
            }
            cur = parent;
        }
        cur
    }

    pub fn inputs(&self) -> &[NodeId] {
        &self.inputs
    }

    pub fn outputs(&self) -> &[NodeId] {
        &self.outputs
    }

    /// True when both graphs have the same nodes, parameters, scopes, inputs and outputs
    /// (names of the graphs themselves may differ).
    pub fn same_structure(&self, other: &Graph) -> bool {
        self.params == other.params
            && self.scopes == other.scopes
            && self.inputs == other.inputs
            && self.outputs == other.outputs
            && self.dag.node_weights().eq(other.dag.node_weights())
    }

    /// Iterates the petgraph edges as `(from, to, operand position)`.
    pub fn edges(&self) -> impl Iterator<Item = (NodeId, NodeId, u32)> + '_ {
        self.dag.raw_edges().iter().map(|e| {
            (
                NodeId::new(e.source().index()),
                NodeId::new(e.target().index()),
                e.weight,
            )
        })
    }
}
