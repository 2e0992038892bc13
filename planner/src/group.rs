//! FSDP parameter groups: FSDP2's bottom-up `fully_shard` on every module of a wrapped
//! kind, and on the root last.
//!
//! A parameter belongs to the innermost wrapped module containing its owner scope; what no
//! unit takes (embeddings, final norm, output head for `wrap: [block]`) forms the root group,
//! as torchtitan does. Units are ordered by their first use in the forward pass; the root
//! group is always last.

use crate::PlanError;
use serde::{Deserialize, Serialize};
use shardplan_ir::{Graph, ModuleKind, NodeId, ParamId, ScopeId};
use std::fmt;

/// An FSDP unit (printed `g3`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct GroupId(pub u32);

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// One FSDP unit: the parameters gathered, freed and reduced together.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsdpGroup {
    pub id: GroupId,
    /// The wrapped module's path, or `<root>`.
    pub module: String,
    /// The wrapped module (`None` for the root group).
    pub scope: Option<ScopeId>,
    /// In parameter-id order.
    pub params: Vec<ParamId>,
}

impl FsdpGroup {
    pub fn is_root(&self) -> bool {
        self.scope.is_none()
    }
}

/// Groups the parameters of `g` for the wrap policy `wrap`.
pub fn group(g: &Graph, wrap: &[ModuleKind]) -> Result<Vec<FsdpGroup>, PlanError> {
    for kind in wrap {
        if !g.scopes().any(|(_, s)| s.kind == *kind) {
            let mut present: Vec<&str> = g
                .scopes()
                .map(|(_, s)| s.kind.name())
                .filter(|k| *k != "root")
                .collect();
            present.sort_unstable();
            present.dedup();
            return Err(PlanError::WrapMatchesNothing {
                kind: kind.name().to_string(),
                present: present.join(", "),
            });
        }
    }
    // The innermost wrapped ancestor (or self) of each scope.
    let unit_of = |mut s: ScopeId| -> Option<ScopeId> {
        loop {
            if wrap.contains(&g.scope(s).kind) {
                return Some(s);
            }
            s = g.scope(s).parent?;
        }
    };
    // Where each parameter is first read in the forward pass.
    let first_use = |node: NodeId| -> usize { g.users(node).first().map_or(usize::MAX, |u| u.index()) };

    let mut units: Vec<(usize, ScopeId, Vec<ParamId>)> = Vec::new();
    let mut root = Vec::new();
    for (p, param) in g.params() {
        match unit_of(param.scope) {
            Some(unit) => match units.iter_mut().find(|u| u.1 == unit) {
                Some(u) => {
                    u.0 = u.0.min(first_use(param.node));
                    u.2.push(p);
                }
                None => units.push((first_use(param.node), unit, vec![p])),
            },
            None => root.push(p),
        }
    }
    units.sort_by_key(|u| (u.0, u.1));
    let mut groups: Vec<FsdpGroup> = units
        .into_iter()
        .enumerate()
        .map(|(i, (_, scope, params))| FsdpGroup {
            id: GroupId(i as u32),
            module: g.scope(scope).display_path().to_string(),
            scope: Some(scope),
            params,
        })
        .collect();
    if !root.is_empty() || groups.is_empty() {
        groups.push(FsdpGroup {
            id: GroupId(groups.len() as u32),
            module: "<root>".into(),
            scope: None,
            params: root,
        });
    }
    Ok(groups)
}
