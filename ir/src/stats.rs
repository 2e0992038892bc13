//! Summaries of a traced graph: parameter counts and per-module tables.

use crate::{Cost, Graph, ModuleKind, Op, ScopeId};
use serde::Serialize;
use std::collections::BTreeMap;

/// Parameter element counts of a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ParamCounts {
    pub total: u64,
    /// Token and position embedding tables (a tied output head adds nothing).
    pub embedding: u64,
    /// `total - embedding`, as in the scaling-law literature (an untied head counts here).
    pub non_embedding: u64,
    /// By the kind of the module that owns each parameter.
    pub by_kind: BTreeMap<ModuleKind, u64>,
}

/// Parameter counts of `g`, each parameter counted once even when tied.
pub fn param_counts(g: &Graph) -> ParamCounts {
    let mut total = 0u64;
    let mut by_kind = BTreeMap::new();
    for (_, p) in g.params() {
        let n = p.ty.numel().unwrap_or(u64::MAX);
        total = total.saturating_add(n);
        let slot = by_kind.entry(g.scope(p.scope).kind).or_insert(0u64);
        *slot = slot.saturating_add(n);
    }
    let embedding = by_kind.get(&ModuleKind::Embedding).copied().unwrap_or(0);
    ParamCounts {
        total,
        embedding,
        non_embedding: total - embedding,
        by_kind,
    }
}

/// What one top-level module (a block, the embedding, the head...) holds and costs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ModuleStats {
    #[serde(skip)]
    pub scope: ScopeId,
    pub path: String,
    pub kind: ModuleKind,
    pub params: u64,
    #[serde(flatten)]
    pub cost: Cost,
    /// Bytes of the values computed inside the module, views excluded (an upper bound on
    /// what it saves for backward without activation checkpointing).
    pub activation_bytes: u64,
}

/// One row per top-level module, in the order the forward pass first enters them.
pub fn module_stats(g: &Graph) -> Vec<ModuleStats> {
    let mut rows: Vec<ModuleStats> = Vec::new();
    let mut row_of: BTreeMap<ScopeId, usize> = BTreeMap::new();
    for (id, node) in g.nodes() {
        let top = g.top_level(node.scope);
        let idx = *row_of.entry(top).or_insert_with(|| {
            let s = g.scope(top);
            rows.push(ModuleStats {
                scope: top,
                path: s.display_path().to_string(),
                kind: s.kind,
                params: 0,
                cost: Cost::default(),
                activation_bytes: 0,
            });
            rows.len() - 1
        });
        let row = &mut rows[idx];
        match node.op {
            Op::Param { .. } => row.params = row.params.saturating_add(node.ty.numel().unwrap_or(u64::MAX)),
            Op::Input { .. } => {}
            // A reshape is a view of its operand: no new bytes.
            Op::Reshape { .. } => {}
            _ => {
                row.cost += g.node_cost(id);
                let bytes = node.ty.bytes().unwrap_or(u64::MAX);
                row.activation_bytes = row.activation_bytes.saturating_add(bytes);
            }
        }
    }
    rows
}
