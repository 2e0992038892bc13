//! Ring attention's exchanges overlapped with the work that does not need them, under
//! shardplan's runtime (which runs them on the all-to-all stream): within one attention
//! module's forward (or its recompute), the keys' and values' gathers are issued as soon
//! as their operands exist, before the queries' projection and rotary; within its
//! backward, the work that does not read their gradients' reduction (the queries'
//! gradient path) runs before the work that does. torch's ring attention overlaps its
//! exchanges with attention blocks instead; the graph's attention is one op, so here the
//! overlap is with the projections around it.

use shardplan_ir::{Graph, ModuleKind, NodeId, ScopeId};
use std::collections::HashMap;

/// Reorders each run of `order` that belongs to one module, one pass and one copy and
/// holds a context-group collective; every run stays a topological order of its nodes.
pub(super) fn overlap_context_collectives(g: &Graph, forward_len: usize, order: &mut [(NodeId, bool)]) {
    let key = |&(id, copy): &(NodeId, bool)| -> (ScopeId, bool, bool) {
        (attention_scope(g, g.node(id).scope), copy, id.index() >= forward_len)
    };
    let mut start = 0;
    while start < order.len() {
        let k = key(&order[start]);
        let end = start + order[start..].iter().take_while(|e| key(e) == k).count();
        let run = &mut order[start..end];
        if run.iter().any(|(id, _)| g.node(*id).op.is_context_collective()) {
            let reordered = reorder_run(g, run, !k.2);
            run.copy_from_slice(&reordered);
        }
        start = end;
    }
}

/// One run: in a forward run each collective right after its own operands' work in the
/// run; then, in either pass, the rest that reads no collective (directly or not) before
/// the rest that does.
fn reorder_run(g: &Graph, run: &[(NodeId, bool)], hoist: bool) -> Vec<(NodeId, bool)> {
    let at: HashMap<NodeId, usize> = run.iter().enumerate().map(|(i, (id, _))| (*id, i)).collect();
    let inputs = |i: usize| -> Vec<usize> {
        g.node(run[i].0)
            .inputs
            .iter()
            .filter_map(|x| at.get(x).copied())
            .collect()
    };
    let collective: Vec<bool> = run
        .iter()
        .map(|(id, _)| g.node(*id).op.is_context_collective())
        .collect();
    let mut placed = vec![false; run.len()];
    let mut out = Vec::with_capacity(run.len());
    if hoist {
        for c in (0..run.len()).filter(|&i| collective[i]) {
            let mut needed = vec![false; run.len()];
            let mut stack = vec![c];
            while let Some(i) = stack.pop() {
                for j in inputs(i) {
                    if !placed[j] && !needed[j] {
                        needed[j] = true;
                        stack.push(j);
                    }
                }
            }
            needed[c] = true;
            for i in (0..run.len()).filter(|&i| needed[i]) {
                placed[i] = true;
                out.push(run[i]);
            }
        }
    }
    // In run order, which is topological: a node reads a collective if an operand is one
    // or reads one.
    let mut reads = vec![false; run.len()];
    for i in 0..run.len() {
        reads[i] = inputs(i).into_iter().any(|j| collective[j] || reads[j]);
    }
    for wanted in [false, true] {
        for i in 0..run.len() {
            if !placed[i] && reads[i] == wanted {
                placed[i] = true;
                out.push(run[i]);
            }
        }
    }
    out
}

/// The attention module `scope` is in (its projections' scopes are below it), else itself.
fn attention_scope(g: &Graph, scope: ScopeId) -> ScopeId {
    let mut at = Some(scope);
    while let Some(s) = at {
        if g.scope(s).kind == ModuleKind::Attention {
            return s;
        }
        at = g.scope(s).parent;
    }
    scope
}
