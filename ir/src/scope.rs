//! Module scopes: where in the user's model a node was traced.

use crate::ScopeId;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The kind of module a scope is, the vocabulary of wrap policies (`wrap: [block]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModuleKind {
    /// The whole model; holds what no other scope took.
    Root,
    /// Token or position embedding table.
    Embedding,
    /// A repeated transformer block (or MLP layer): the default FSDP unit.
    Block,
    /// Self-attention inside a block.
    Attention,
    /// Feed-forward network inside a block.
    Mlp,
    /// A normalisation layer.
    Norm,
    /// The output projection to the vocabulary (or classes).
    Head,
    /// The loss computation.
    Loss,
}

impl ModuleKind {
    /// Every kind, in declaration order.
    pub const ALL: [ModuleKind; 8] = [
        ModuleKind::Root,
        ModuleKind::Embedding,
        ModuleKind::Block,
        ModuleKind::Attention,
        ModuleKind::Mlp,
        ModuleKind::Norm,
        ModuleKind::Head,
        ModuleKind::Loss,
    ];

    /// The snake_case name used in specs and printouts.
    pub fn name(self) -> &'static str {
        match self {
            ModuleKind::Root => "root",
            ModuleKind::Embedding => "embedding",
            ModuleKind::Block => "block",
            ModuleKind::Attention => "attention",
            ModuleKind::Mlp => "mlp",
            ModuleKind::Norm => "norm",
            ModuleKind::Head => "head",
            ModuleKind::Loss => "loss",
        }
    }
}

impl fmt::Display for ModuleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A module of the traced model: its dotted path, kind and parent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scope {
    /// Dotted path from the root (`layers.3.attention`); empty for the root.
    pub path: String,
    pub kind: ModuleKind,
    pub parent: Option<ScopeId>,
}

impl Scope {
    /// The path, or `<root>` for the root scope, for messages and printouts.
    pub fn display_path(&self) -> &str {
        if self.path.is_empty() {
            "<root>"
        } else {
            &self.path
        }
    }
}
