//! FSDP parameter groups: FSDP2's bottom-up `fully_shard` on every module of a wrapped
//! kind (and every module named explicitly), and on the root last.
//!
//! A parameter belongs to the innermost wrapped module containing its owner scope; what no
//! unit takes (embeddings, final norm, output head for `wrap: [block]`) forms the root group,
//! as torchtitan does. Units are ordered by their first use in the forward pass; the root
//! group is always last. Bucketing merges runs of consecutive units while their parameters
//! fit a byte budget (fewer, larger collectives).

use crate::PlanError;
use serde::{Deserialize, Serialize};
use shardplan_ir::{DType, Graph, IdVec, ModuleKind, NodeId, ParamId, ScopeId};

shardplan_ir::entity! {
    /// An FSDP unit (printed `g3`).
    pub struct GroupId("g");
}

/// One FSDP unit: the parameters gathered, freed and reduced together.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsdpGroup {
    pub id: GroupId,
    /// The wrapped modules' paths joined by `+` (bucketed units), or `<root>`.
    pub module: String,
    /// The wrapped modules (empty for the root group).
    pub scopes: Vec<ScopeId>,
    /// In parameter-id order.
    pub params: Vec<ParamId>,
    /// Routed experts' parameters under expert parallelism: sharded over the ranks that
    /// hold the same experts (`Comm::ExpertShard`), not the whole shard group.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub experts: bool,
}

impl FsdpGroup {
    pub fn is_root(&self) -> bool {
        self.scopes.is_empty()
    }
}

/// Which modules become FSDP units.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WrapPolicy {
    /// Module kinds wrapped wherever they occur.
    pub kinds: Vec<ModuleKind>,
    /// Module paths wrapped explicitly (`layers.0.feed_forward`, `output`).
    pub modules: Vec<String>,
    /// Merge consecutive units while their parameters (in `bucket_dtype`) fit this many bytes.
    pub bucket_bytes: Option<u64>,
    pub bucket_dtype: DType,
}

impl WrapPolicy {
    /// Wrap every module of these kinds, nothing else.
    pub fn kinds(kinds: &[ModuleKind]) -> Self {
        WrapPolicy {
            kinds: kinds.to_vec(),
            modules: Vec::new(),
            bucket_bytes: None,
            bucket_dtype: DType::F32,
        }
    }
}

/// Groups the parameters of `g` by `policy`.
pub fn group(g: &Graph, policy: &WrapPolicy) -> Result<Vec<FsdpGroup>, PlanError> {
    let explicit = wrapped_scopes(g, policy)?;
    let (units, root) = units(g, policy, &explicit);
    let mut groups: Vec<FsdpGroup> = bucketed(g, policy, units)
        .into_iter()
        .enumerate()
        .map(|(i, (scopes, params, experts))| FsdpGroup {
            id: GroupId::new(i),
            module: scopes
                .iter()
                .map(|&s| {
                    let path = g.scope(s).display_path();
                    if experts {
                        format!("{path}.experts")
                    } else {
                        path.to_string()
                    }
                })
                .collect::<Vec<_>>()
                .join("+"),
            scopes,
            params,
            experts,
        })
        .collect();
    if !root.is_empty() || groups.is_empty() {
        groups.push(FsdpGroup {
            id: GroupId::new(groups.len()),
            module: "<root>".into(),
            scopes: Vec::new(),
            params: root,
            experts: false,
        });
    }
    Ok(groups)
}

/// Checks that every wrapped kind of `policy` occurs in `g`, and returns the scopes its
/// `wrap_modules` name.
fn wrapped_scopes(g: &Graph, policy: &WrapPolicy) -> Result<Vec<ScopeId>, PlanError> {
    for kind in &policy.kinds {
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
    let mut explicit = Vec::new();
    for m in &policy.modules {
        match g.scopes().find(|(_, s)| s.display_path() == m && s.parent.is_some()) {
            Some((id, _)) => explicit.push(id),
            None => {
                let paths: Vec<&str> = g.scopes().skip(1).map(|(_, s)| s.display_path()).collect();
                return Err(PlanError::NoSuchModule {
                    module: m.clone(),
                    suggestion: shardplan_frontends::did_you_mean(m, paths.iter().copied()).map(str::to_string),
                });
            }
        }
    }
    Ok(explicit)
}

/// One wrapped unit before bucketing: where its parameters are first read in forward, its
/// scope, whether it holds routed experts, and its parameters.
type Unit = (usize, ScopeId, bool, Vec<ParamId>);

/// The wrapped units of `g` in forward order (by first read), and the parameters no unit
/// takes (the root group's).
///
/// Under expert parallelism a unit's routed experts are a unit of their own (sharded over
/// another group: torchtitan's `fully_shard` of `moe.experts` on the expert-FSDP mesh),
/// wrapped even where their module is not.
fn units(g: &Graph, policy: &WrapPolicy, explicit: &[ScopeId]) -> (Vec<Unit>, Vec<ParamId>) {
    let wrapped = |s: ScopeId| policy.kinds.contains(&g.scope(s).kind) || explicit.contains(&s);
    // The innermost wrapped ancestor (or self) of each scope.
    let unit_of = |mut s: ScopeId| -> Option<ScopeId> {
        loop {
            if wrapped(s) {
                return Some(s);
            }
            s = g.scope(s).parent?;
        }
    };
    // Where each parameter is first read in the forward pass.
    let first_use = |node: NodeId| -> usize { g.users(node).first().map_or(usize::MAX, |u| u.index()) };
    let mut units: Vec<Unit> = Vec::new();
    let mut root = Vec::new();
    for (p, param) in g.params() {
        let experts = param.expert.is_some();
        let unit = if experts {
            Some(unit_of(param.scope).unwrap_or(param.scope))
        } else {
            unit_of(param.scope)
        };
        match unit {
            Some(unit) => match units.iter_mut().find(|u| u.1 == unit && u.2 == experts) {
                Some(u) => {
                    u.0 = u.0.min(first_use(param.node));
                    u.3.push(p);
                }
                None => units.push((first_use(param.node), unit, experts, vec![p])),
            },
            None => root.push(p),
        }
    }
    units.sort_by_key(|u| (u.0, u.1, u.2));
    (units, root)
}

/// Consecutive units of one kind (dense or routed experts) merged while their parameters
/// fit `policy.bucket_bytes`: `(scopes, parameters, experts)` per group.
fn bucketed(g: &Graph, policy: &WrapPolicy, units: Vec<Unit>) -> Vec<(Vec<ScopeId>, Vec<ParamId>, bool)> {
    let bytes = |ps: &[ParamId]| -> u64 {
        ps.iter()
            .map(|&p| g.param(p).ty.numel().unwrap_or(u64::MAX))
            .fold(0u64, |a, n| {
                a.saturating_add(n.saturating_mul(policy.bucket_dtype.size_bytes()))
            })
    };
    let mut merged: Vec<(Vec<ScopeId>, Vec<ParamId>, bool)> = Vec::new();
    for (_, scope, experts, params) in units {
        match (merged.last_mut(), policy.bucket_bytes) {
            (Some(last), Some(budget))
                if last.2 == experts && bytes(&last.1).saturating_add(bytes(&params)) <= budget =>
            {
                last.0.push(scope);
                last.1.extend(params);
                last.1.sort_unstable();
            }
            _ => merged.push((vec![scope], params, experts)),
        }
    }
    merged
}

/// The group whose parameters a node of each scope belongs to: the group of its innermost
/// wrapped ancestor, else the root group (the last).
pub(crate) fn scope_groups(g: &Graph, groups: &[FsdpGroup]) -> IdVec<ScopeId, GroupId> {
    let root = groups.last().map_or(GroupId::new(0), |r| r.id);
    let mut unit: IdVec<ScopeId, Option<GroupId>> = IdVec::from_elem(None, g.scopes().len());
    for grp in groups {
        for &s in &grp.scopes {
            unit[s] = Some(grp.id);
        }
    }
    // Scopes are created after their parents, so one pass in id order resolves ancestors.
    let mut out: IdVec<ScopeId, GroupId> = IdVec::with_capacity(unit.len());
    for (id, s) in g.scopes() {
        let own = unit[id];
        let inherited = s.parent.map(|p| out[p]);
        out.push(own.or(inherited.filter(|&p| p != root)).unwrap_or(root));
    }
    out
}

#[cfg(test)]
mod tests {
    //! FSDP2's bottom-up wrapping: units in forward order, the root group last.

    use super::{group, WrapPolicy};
    use crate::testing::tiny;
    use crate::PlanError;
    use shardplan_ir::ModuleKind;

    #[test]
    fn block_wrap_puts_embeddings_norm_and_head_in_the_root_group_last() {
        let g = tiny("tiny-llama");
        let groups = group(&g, &WrapPolicy::kinds(&[ModuleKind::Block])).unwrap();
        let names: Vec<&str> = groups.iter().map(|gr| gr.module.as_str()).collect();
        assert_eq!(names, ["layers.0", "layers.1", "<root>"]);
        let root: Vec<&str> = groups[2].params.iter().map(|&p| &*g.param(p).name).collect();
        assert_eq!(
            root,
            ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        );
        // Every parameter in exactly one group.
        let mut all: Vec<_> = groups.iter().flat_map(|gr| gr.params.clone()).collect();
        all.sort();
        assert_eq!(all, g.params().map(|(p, _)| p).collect::<Vec<_>>());
    }

    #[test]
    fn nested_wrap_is_bottom_up() {
        let g = tiny("tiny-llama");
        let groups = group(&g, &WrapPolicy::kinds(&[ModuleKind::Attention, ModuleKind::Block])).unwrap();
        let names: Vec<&str> = groups.iter().map(|gr| gr.module.as_str()).collect();
        // Forward order, as FSDP2's hooks fire: the block (its attention_norm is read first),
        // then its attention unit.
        assert_eq!(
            names,
            [
                "layers.0",
                "layers.0.attention",
                "layers.1",
                "layers.1.attention",
                "<root>"
            ]
        );
        // The block unit keeps what its attention unit did not take: norms and the MLP.
        assert!(groups[0].params.iter().all(|&p| !g.param(p).name.contains("self_attn")));
        assert_eq!(groups[0].params.len(), 5);
        assert_eq!(groups[1].params.len(), 4);
        // Tied GPT-2: the shared table stays in the root group.
        let g = tiny("tiny-gpt2");
        let groups = group(&g, &WrapPolicy::kinds(&[ModuleKind::Block])).unwrap();
        let root = groups.last().unwrap();
        assert!(root.is_root());
        assert!(root
            .params
            .iter()
            .any(|&p| &*g.param(p).name == "transformer.wte.weight"));
    }

    #[test]
    fn a_wrap_kind_the_model_lacks_is_an_error() {
        let e = group(&tiny("tiny-mlp"), &WrapPolicy::kinds(&[ModuleKind::Attention])).unwrap_err();
        assert!(matches!(e, PlanError::WrapMatchesNothing { .. }));
        assert_eq!(
            e.to_string(),
            "wrap policy `attention` matches no module of this model (its module kinds: block, head, loss)"
        );
        // No wrap at all: one root group holding everything (fully_shard on the root only).
        let g = tiny("tiny-mlp");
        let groups = group(&g, &WrapPolicy::kinds(&[])).unwrap();
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].params.len(), g.params().len());
    }
}
