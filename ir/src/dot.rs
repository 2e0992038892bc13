//! Graphviz DOT export (via petgraph's writer), for `shardplan inspect --dot`.

use crate::{Graph, Op};
use petgraph::dot::{Config, Dot};
use petgraph::graph::DiGraph;

/// The graph in DOT: parameters and inputs as boxes, ops as ellipses, labelled with id,
/// op, type and scope.
pub fn to_dot(g: &Graph) -> String {
    // A label-only copy, so petgraph's writer does the DOT syntax and escaping.
    let mut view: DiGraph<Label, u32> = DiGraph::with_capacity(g.node_count(), g.edge_count());
    for (id, node) in g.nodes() {
        let head = match &node.op {
            Op::Input { name } => format!("input {name}"),
            Op::Param { param } => g.param(*param).name.to_string(),
            op => format!("{id} {}", op.name()),
        };
        view.add_node(Label {
            text: format!("{head}\n{}\n@ {}", node.ty, g.scope(node.scope).display_path()),
            leaf: node.op.is_leaf(),
        });
    }
    for (from, to, pos) in g.edges() {
        view.add_edge(
            petgraph::graph::NodeIndex::new(from.index()),
            petgraph::graph::NodeIndex::new(to.index()),
            pos,
        );
    }
    let dot = Dot::with_attr_getters(
        &view,
        &[Config::EdgeNoLabel],
        &|_, _| String::new(),
        &|_, (_, label)| {
            if label.leaf {
                "shape=box".to_string()
            } else {
                String::new()
            }
        },
    );
    format!("{dot:?}")
}

struct Label {
    text: String,
    leaf: bool,
}

impl std::fmt::Debug for Label {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::fmt::Display for Label {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}
