//! The reference interpreter: runs a graph's nodes in id (topological) order on candle
//! tensors, keeping each value in a table keyed by node id and freeing it after its last
//! reader.

use crate::cpu::kernels::{self, Ctx};
use crate::ExecError;
use candle_core::Tensor;
use shardplan_ir::{Graph, NodeId, Op};

/// Bytes a value occupies in the table: its logical size, except a reshape, which is a view
/// of its operand (the same rule as `ir::stats`).
fn value_bytes(graph: &Graph, id: NodeId) -> u64 {
    let n = graph.node(id);
    match n.op {
        Op::Reshape { .. } => 0,
        _ => n.ty.bytes().unwrap_or(0),
    }
}

/// A graph prepared for repeated runs: last uses computed once.
pub struct Interpreter {
    graph: Graph,
    /// Index of the last node that reads each value (`usize::MAX`: never freed).
    last_use: Vec<usize>,
}

/// What one run produced.
pub struct RunOutput {
    /// The values asked to be kept, in the order asked.
    pub kept: Vec<Tensor>,
    /// Largest number of bytes the value table held at once.
    pub peak_bytes: u64,
}

impl Interpreter {
    /// Prepares `graph`; the values of `keep` survive the run.
    pub fn new(graph: Graph, keep: &[NodeId]) -> Self {
        let mut last_use = vec![0usize; graph.node_count()];
        for (id, n) in graph.nodes() {
            last_use[id.index()] = last_use[id.index()].max(id.index());
            for i in &n.inputs {
                last_use[i.index()] = last_use[i.index()].max(id.index());
            }
        }
        for k in keep {
            last_use[k.index()] = usize::MAX;
        }
        Interpreter { graph, last_use }
    }

    /// Runs every node. `feed(id)` supplies the value of each input and parameter node.
    pub fn run(
        &self,
        ctx: &Ctx,
        keep: &[NodeId],
        feed: &mut dyn FnMut(NodeId) -> Result<Tensor, ExecError>,
    ) -> Result<RunOutput, ExecError> {
        self.run_timed(ctx, keep, feed, None)
    }

    /// As [`Interpreter::run`], adding each node's wall time to `times[node]` when given
    /// (for profiles).
    pub fn run_timed(
        &self,
        ctx: &Ctx,
        keep: &[NodeId],
        feed: &mut dyn FnMut(NodeId) -> Result<Tensor, ExecError>,
        mut times: Option<&mut Vec<std::time::Duration>>,
    ) -> Result<RunOutput, ExecError> {
        let n = self.graph.node_count();
        let mut table: Vec<Option<Tensor>> = vec![None; n];
        let (mut live, mut peak) = (0u64, 0u64);
        for (id, node) in self.graph.nodes() {
            let start = std::time::Instant::now();
            let value = eval(ctx, id, node, &table, feed)?;
            if let Some(t) = times.as_deref_mut() {
                t[id.index()] += start.elapsed();
            }
            check_shape(id, node, &value)?;
            table[id.index()] = Some(value);
            live += value_bytes(&self.graph, id);
            peak = peak.max(live);
            // Free what this node was the last to read (and itself, if nothing reads it).
            for v in node.inputs.iter().copied().chain(std::iter::once(id)) {
                if self.last_use[v.index()] == id.index() && table[v.index()].take().is_some() {
                    live -= value_bytes(&self.graph, v);
                }
            }
        }
        let kept = keep
            .iter()
            .map(|k| {
                table[k.index()]
                    .clone()
                    .ok_or_else(|| ExecError::Internal(format!("{k} was not kept")))
            })
            .collect::<Result<_, _>>()?;
        Ok(RunOutput { kept, peak_bytes: peak })
    }

    /// Evaluates `nodes` in the order given into `table` (one slot per node), which holds
    /// every value they read that is not among them; frees nothing: a pipeline stage keeps
    /// a micro-batch's values from its forward to its backward.
    pub fn eval_nodes(
        &self,
        ctx: &Ctx,
        nodes: impl IntoIterator<Item = NodeId>,
        table: &mut [Option<Tensor>],
        feed: &mut dyn FnMut(NodeId) -> Result<Tensor, ExecError>,
    ) -> Result<(), ExecError> {
        for id in nodes {
            let node = self.graph.node(id);
            let value = eval(ctx, id, node, table, feed)?;
            check_shape(id, node, &value)?;
            table[id.index()] = Some(value);
        }
        Ok(())
    }

    /// Reruns the nodes up to `until` (exclusive) and returns the first whose value holds a
    /// NaN or an infinity: where a divergence starts.
    pub fn first_non_finite(
        &self,
        ctx: &Ctx,
        until: usize,
        feed: &mut dyn FnMut(NodeId) -> Result<Tensor, ExecError>,
    ) -> Result<Option<NodeId>, ExecError> {
        let mut table: Vec<Option<Tensor>> = vec![None; self.graph.node_count()];
        for (id, node) in self.graph.nodes().take(until) {
            let value = eval(ctx, id, node, &table, feed)?;
            if node.ty.dtype.is_float() && !all_finite(&value)? {
                return Ok(Some(id));
            }
            table[id.index()] = Some(value);
        }
        Ok(None)
    }
}

/// Fails when `value` does not have the shape `node` was typed with.
fn check_shape(id: NodeId, node: &shardplan_ir::Node, value: &Tensor) -> Result<(), ExecError> {
    if value
        .dims()
        .iter()
        .map(|&d| d as u64)
        .ne(node.ty.shape.dims().iter().copied())
    {
        return Err(ExecError::Internal(format!(
            "{id} ({}) produced {:?}, expected {}",
            node.op.name(),
            value.dims(),
            node.ty
        )));
    }
    Ok(())
}

/// The value of one node: fed for inputs and parameters, computed from the table otherwise.
fn eval(
    ctx: &Ctx,
    id: NodeId,
    node: &shardplan_ir::Node,
    table: &[Option<Tensor>],
    feed: &mut dyn FnMut(NodeId) -> Result<Tensor, ExecError>,
) -> Result<Tensor, ExecError> {
    if matches!(node.op, Op::Input { .. } | Op::Param { .. }) {
        return feed(id);
    }
    let ins: Vec<&Tensor> = node
        .inputs
        .iter()
        .map(|i| {
            table[i.index()]
                .as_ref()
                .ok_or_else(|| ExecError::Internal(format!("{i} read after it was freed")))
        })
        .collect::<Result<_, _>>()?;
    kernels::apply(ctx, &node.op, &ins, &node.ty)
}

/// True when every element is finite.
pub fn all_finite(t: &Tensor) -> Result<bool, ExecError> {
    let s = t
        .to_dtype(candle_core::DType::F64)?
        .abs()?
        .sum_all()?
        .to_scalar::<f64>()?;
    Ok(s.is_finite())
}
