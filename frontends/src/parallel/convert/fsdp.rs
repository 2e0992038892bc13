//! The sharding policy's sections: what is wrapped into units, how units reshard and
//! prefetch, their precision, and activation checkpointing.

use super::{at_least_1, record};
use crate::either::{BoolOrInt, NameOr};
use crate::parallel::file::*;
use crate::parallel::*;
use crate::yaml::pos;
use crate::{did_you_mean, Origin, SpecError};
use serde_saphyr::Spanned;
use shardplan_ir::{DType, ModuleKind};

/// The module kinds wrapped into units (blocks unless written), each once; never the root
/// or the loss.
pub(super) fn wrap(
    o: &mut Origin,
    spec: Option<Spanned<Vec<Spanned<ModuleKind>>>>,
) -> Result<Vec<ModuleKind>, SpecError> {
    let Some(list) = spec else {
        return Ok(vec![ModuleKind::Block]);
    };
    o.insert("wrap", pos(&list));
    let mut kinds = Vec::new();
    for k in list.value {
        if matches!(k.value, ModuleKind::Root | ModuleKind::Loss) {
            let e = o.error(
                "wrap",
                format!("`{}` cannot be wrapped", k.value),
                "the root group is always the last group and holds what no unit took; remove it from `wrap`",
            );
            return Err(e.at(Some(pos(&k))));
        }
        if !kinds.contains(&k.value) {
            kinds.push(k.value);
        }
    }
    Ok(kinds)
}

/// The modules wrapped into units by name, each once.
pub(super) fn wrap_modules(o: &mut Origin, spec: Option<Spanned<Vec<Spanned<String>>>>) -> Vec<String> {
    let mut wrap_modules = Vec::new();
    if let Some(list) = spec {
        o.insert("wrap_modules", pos(&list));
        for m in list.value {
            if !wrap_modules.contains(&m.value) {
                wrap_modules.push(m.value);
            }
        }
    }
    wrap_modules
}

/// What a unit does with its gathered parameters after the forward: free them (the
/// default), keep them, or reshard them to groups of `n` dividing the shard axis.
pub(super) fn reshard_after_forward(
    o: &mut Origin,
    spec: Option<Spanned<BoolOrInt>>,
    shard: u64,
) -> Result<Reshard, SpecError> {
    record(o, "reshard_after_forward", &spec);
    Ok(match spec.map(|s| s.value) {
        None | Some(BoolOrInt::Bool(true)) => Reshard::AfterForward,
        Some(BoolOrInt::Bool(false)) => Reshard::Keep,
        Some(BoolOrInt::Int(n)) => {
            if n == 0 || !shard.is_multiple_of(n) {
                return Err(o.error(
                    "reshard_after_forward",
                    format!("{n} does not divide the shard axis ({shard})"),
                    format!("use true, false, or a divisor of {shard} (usually gpus_per_node)"),
                ));
            }
            Reshard::ToGroupOf(n)
        }
    })
}

/// The prefetch depths (`auto`: 1 each way) and explicit prefetches, depths at most 64.
pub(super) fn prefetch(o: &mut Origin, spec: Option<Spanned<NameOr<PrefetchFile>>>) -> Result<Prefetch, SpecError> {
    let mut prefetch = Prefetch::auto();
    let Some(p) = spec else {
        return Ok(prefetch);
    };
    o.insert("prefetch", pos(&p));
    match p.value {
        NameOr::Name(n) if n == "auto" => {}
        NameOr::Name(n) => {
            return Err(o.error(
                "prefetch",
                format!("unknown prefetch `{n}`"),
                "use auto (the default) or {forward: N, backward: N}",
            ));
        }
        NameOr::Map(m) => {
            record(o, "prefetch.forward", &m.forward);
            record(o, "prefetch.backward", &m.backward);
            record(o, "prefetch.peak_aware", &m.peak_aware);
            prefetch.forward = m.forward.map_or(1, |s| s.value);
            prefetch.backward = m.backward.map_or(1, |s| s.value);
            prefetch.peak_aware = m.peak_aware.is_some_and(|s| s.value);
            if let Some(e) = m.explicit {
                o.insert("prefetch.explicit", pos(&e));
                prefetch.explicit_forward = e.value.forward;
                prefetch.explicit_backward = e.value.backward;
            }
        }
    }
    for (field, v) in [
        ("prefetch.forward", prefetch.forward),
        ("prefetch.backward", prefetch.backward),
    ] {
        if v > 64 {
            return Err(o.error(
                field,
                format!("prefetch depth {v} is more than 64"),
                "FSDP2 uses 1; depths beyond 2-3 only add memory",
            ));
        }
    }
    Ok(prefetch)
}

/// The dtypes parameters are gathered and gradients reduced in (f32 unless written),
/// floating-point both.
pub(super) fn mixed_precision(
    o: &mut Origin,
    spec: Option<Spanned<MixedPrecisionFile>>,
) -> Result<MixedPrecision, SpecError> {
    let mut mixed_precision = MixedPrecision {
        param: DType::F32,
        reduce: DType::F32,
    };
    if let Some(mp) = spec {
        o.insert("mixed_precision", pos(&mp));
        for (field, v, slot) in [
            ("mixed_precision.param", &mp.value.param, &mut mixed_precision.param),
            ("mixed_precision.reduce", &mp.value.reduce, &mut mixed_precision.reduce),
        ] {
            if let Some(s) = v {
                o.insert(field, pos(s));
                if !s.value.is_float() {
                    return Err(o.error(
                        field,
                        format!("{} is not a floating-point dtype", s.value),
                        "use f32, bf16 or f16",
                    ));
                }
                *slot = s.value;
            }
        }
    }
    Ok(mixed_precision)
}

/// Activation checkpointing: a mode by name, every N-th block, or selective by op class.
pub(super) fn activation_checkpointing(
    o: &mut Origin,
    spec: Option<Spanned<NameOr<AcEveryFile>>>,
) -> Result<ActivationCheckpointing, SpecError> {
    record(o, "activation_checkpointing", &spec);
    Ok(match spec.map(|s| s.value) {
        None => ActivationCheckpointing::None,
        Some(NameOr::Name(n)) => match n.as_str() {
            "none" => ActivationCheckpointing::None,
            "full" => ActivationCheckpointing::Full,
            "selective" => ActivationCheckpointing::Selective(SavePolicy::TORCHTITAN),
            other => {
                let help = did_you_mean(other, ["none", "full", "selective"]).map_or_else(
                    || "use none, full, selective, {every: N} or {selective: {save: [...]}}".to_string(),
                    |m| format!("did you mean `{m}`? (none, full, selective, {{every: N}} or {{selective: {{save: [...]}}}})"),
                );
                return Err(o.error("activation_checkpointing", format!("unknown mode `{other}`"), help));
            }
        },
        Some(NameOr::Map(m)) => match (m.every, m.selective) {
            (Some(every), None) => {
                o.insert("activation_checkpointing.every", pos(&every));
                ActivationCheckpointing::Every(at_least_1(o, "activation_checkpointing.every", every.value)?)
            }
            (None, Some(sel)) => ActivationCheckpointing::Selective(save_policy(o, sel)?),
            _ => {
                return Err(o.error(
                    "activation_checkpointing",
                    "give either `every` or `selective`".to_string(),
                    "{every: N} checkpoints every N-th block whole; {selective: {save: [...]}} checkpoints every block by op",
                ))
            }
        },
    })
}

/// What selective checkpointing saves: attention, and all or the odd matmuls, each once.
fn save_policy(o: &mut Origin, sel: Spanned<AcSelectiveFile>) -> Result<SavePolicy, SpecError> {
    o.insert("activation_checkpointing.selective", pos(&sel));
    o.insert("activation_checkpointing.selective.save", pos(&sel.value.save));
    let mut policy = SavePolicy {
        attention: false,
        matmuls: SavedMatmuls::None,
    };
    for (i, name) in sel.value.save.value.iter().enumerate() {
        let field = format!("activation_checkpointing.selective.save[{i}]");
        o.insert(&field, pos(name));
        let matmuls = |p: &SavePolicy| p.matmuls != SavedMatmuls::None;
        match name.value.as_str() {
            "attention" if !policy.attention => policy.attention = true,
            "matmuls" if !matmuls(&policy) => policy.matmuls = SavedMatmuls::All,
            "odd_matmuls" if !matmuls(&policy) => policy.matmuls = SavedMatmuls::Odd,
            "attention" | "matmuls" | "odd_matmuls" => {
                return Err(o.error(
                    &field,
                    format!("`{}` repeats what the list already saves", name.value),
                    "list each of attention, and matmuls or odd_matmuls, at most once",
                ))
            }
            other => {
                let help = did_you_mean(other, SAVE_NAMES).map_or_else(
                    || format!("save lists some of {}", SAVE_NAMES.join(", ")),
                    |m| format!("did you mean `{m}`? (save lists some of {})", SAVE_NAMES.join(", ")),
                );
                return Err(o.error(&field, format!("unknown op class `{other}`"), help));
            }
        }
    }
    Ok(policy)
}
