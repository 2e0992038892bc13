//! Human-readable text form of a graph, one aligned line per node.

use crate::{Graph, Node, Op};
use std::fmt::Write;

/// The "call" column of a node: `param model.norm.weight`, `linear(n3, n4) bias`.
fn call(g: &Graph, node: &Node) -> String {
    match &node.op {
        Op::Input { name } => format!("input {name}"),
        Op::Param { param } => format!("param {}", g.param(*param).name),
        op => {
            let args: Vec<String> = node.inputs.iter().map(|i| i.to_string()).collect();
            let attrs = op.attrs();
            if attrs.is_empty() {
                format!("{}({})", op.name(), args.join(", "))
            } else {
                format!("{}({}) {attrs}", op.name(), args.join(", "))
            }
        }
    }
}

/// The graph as text: a header, then `id = call : type  @ scope` per node.
pub fn to_text(g: &Graph) -> String {
    let rows: Vec<(String, String, String, &str, String)> = g
        .nodes()
        .map(|(id, n)| {
            (
                id.to_string(),
                call(g, n),
                n.ty.to_string(),
                g.scope(n.scope).display_path(),
                n.grad_of.map_or_else(String::new, |f| format!("  (grad of {f})")),
            )
        })
        .collect();
    let w_id = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let w_call = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
    let w_ty = rows.iter().map(|r| r.2.len()).max().unwrap_or(0);

    let mut out = String::new();
    let elements: u64 = g.params().map(|(_, p)| p.ty.numel().unwrap_or(0)).sum();
    let _ = writeln!(out, "graph {}", g.name());
    let _ = writeln!(
        out,
        "  {} nodes, {} edges, {} parameters ({} elements), {} scopes",
        g.node_count(),
        g.edge_count(),
        g.params().len(),
        elements,
        g.scopes().len()
    );
    let outputs: Vec<String> = g.outputs().iter().map(|o| o.to_string()).collect();
    let _ = writeln!(out, "  outputs: {}", outputs.join(", "));
    for (id, call, ty, scope, grad) in &rows {
        let _ = writeln!(out, "{id:<w_id$} = {call:<w_call$} : {ty:<w_ty$}  @ {scope}{grad}");
    }
    out
}
