//! The `float8` and `mxfp8` sections, checked as torchao and torchtitan check them.

use super::*;

/// `float8:`, its recipe (default tensorwise) and options, refused on hardware without
/// float8 tensor cores and where torchao refuses a combination.
pub(super) fn float8(
    o: &mut Origin,
    spec: Option<Spanned<Float8File>>,
    hardware: &HardwareProfile,
) -> Result<Option<Float8>, SpecError> {
    let Some(spec) = spec else { return Ok(None) };
    o.insert("float8", pos(&spec));
    let f = spec.value;
    if hardware.fp8_tflops <= 0.0 {
        return Err(o.error(
            "float8",
            format!(
                "hardware `{}` has no float8 tensor cores (fp8_tflops is 0; torchtitan refuses Float8 below SM89)",
                hardware.name
            ),
            "plan it on hardware with them (h100-sxm, h200, b200), give `hardware.fp8_tflops`, or remove `float8`",
        ));
    }
    record(o, "float8.recipe", &f.recipe);
    let recipe = f.recipe.map_or(Float8Recipe::Tensorwise, |r| r.value);
    let filter_fqns = filter_fqns(o, "float8.filter_fqns", f.filter_fqns)?;
    if recipe == Float8Recipe::RowwiseWithGwHp && filter_fqns.iter().any(|f| f == AUTO_FILTER) {
        return Err(o.error(
            "float8.filter_fqns",
            format!("torchao has no `{AUTO_FILTER}` heuristics for rowwise_with_gw_hp"),
            format!("name the linears to leave out, or use `{AUTO_FILTER}` with tensorwise or rowwise"),
        ));
    }
    record(o, "float8.fsdp_float8_all_gather", &f.fsdp_float8_all_gather);
    let fsdp_float8_all_gather = f.fsdp_float8_all_gather.is_some_and(|b| b.value);
    if fsdp_float8_all_gather && recipe != Float8Recipe::Tensorwise {
        return Err(o.error(
            "float8.fsdp_float8_all_gather",
            format!(
                "the float8 all-gather needs one scale per weight, and recipe `{}` scales per row (torchao allows it only with tensorwise)",
                recipe.name()
            ),
            "set `recipe: tensorwise`, or remove `fsdp_float8_all_gather`",
        ));
    }
    record(o, "float8.precompute_scale", &f.precompute_scale);
    let precompute_scale = f.precompute_scale.is_some_and(|b| b.value);
    if precompute_scale && !fsdp_float8_all_gather {
        return Err(o.error(
            "float8.precompute_scale",
            "precomputed scales are those of the float8 all-gather, which is off",
            "add `fsdp_float8_all_gather: true`, or remove `precompute_scale`",
        ));
    }
    Ok(Some(Float8 {
        recipe,
        filter_fqns,
        fsdp_float8_all_gather,
        precompute_scale,
    }))
}

/// `mxfp8:`, refused on hardware without MX tensor cores and beside `float8`.
pub(super) fn mxfp8(
    o: &mut Origin,
    spec: Option<Spanned<Mxfp8File>>,
    hardware: &HardwareProfile,
    float8: Option<&Float8>,
) -> Result<Option<Mxfp8>, SpecError> {
    let Some(spec) = spec else { return Ok(None) };
    o.insert("mxfp8", pos(&spec));
    if float8.is_some() {
        return Err(o.error(
            "mxfp8",
            "a linear trains in Float8 or in MXFP8, and the spec asks for both",
            "keep one of `float8` and `mxfp8`",
        ));
    }
    if hardware.mxfp8_tflops <= 0.0 {
        return Err(o.error(
            "mxfp8",
            format!(
                "hardware `{}` has no MX tensor cores (mxfp8_tflops is 0; MXFP8 GEMMs need Blackwell, SM100)",
                hardware.name
            ),
            "plan it on b200, give `hardware.mxfp8_tflops`, or use `float8`",
        ));
    }
    let m = spec.value;
    record(o, "mxfp8.recipe", &m.recipe);
    let recipe = m.recipe.map_or(Mxfp8Recipe::Mxfp8Cublas, |r| r.value);
    let filter_fqns = filter_fqns(o, "mxfp8.filter_fqns", m.filter_fqns)?;
    Ok(Some(Mxfp8 { recipe, filter_fqns }))
}

/// The filter's entries, none empty (an empty one would match every linear); absent,
/// `[lm_head]`.
fn filter_fqns(
    o: &mut Origin,
    field: &str,
    spec: Option<Spanned<Vec<Spanned<String>>>>,
) -> Result<Vec<String>, SpecError> {
    let Some(list) = spec else {
        return Ok(vec!["lm_head".to_string()]);
    };
    o.insert(field, pos(&list));
    let mut out = Vec::new();
    for (i, entry) in list.value.into_iter().enumerate() {
        let at = format!("{field}[{i}]");
        o.insert(&at, pos(&entry));
        if entry.value.trim().is_empty() {
            return Err(o.error(
                &at,
                "an empty entry matches every linear, leaving none in Float8",
                "remove it, or name a module path (Hugging Face's: `lm_head`, `mlp.down_proj`)",
            ));
        }
        out.push(entry.value);
    }
    Ok(out)
}
