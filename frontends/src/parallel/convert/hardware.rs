//! The hardware section: a built-in profile by name, or a profile given as numbers over
//! a built-in base (or over none, when every number must be given).

use super::number;
use crate::either::NameOr;
use crate::hardware::{builtin, HardwareProfile, HARDWARE_NAMES};
use crate::parallel::file::HardwareFile;
use crate::yaml::pos;
use crate::{did_you_mean, Origin, SpecError};
use serde_saphyr::Spanned;

/// The hardware profile: the H100 SXM's unless written.
pub(super) fn hardware(
    o: &mut Origin,
    spec: Option<Spanned<NameOr<HardwareFile>>>,
) -> Result<HardwareProfile, SpecError> {
    let Some(spec) = spec else {
        return Ok(builtin("h100-sxm").expect("built-in profile"));
    };
    o.insert("hardware", pos(&spec));
    match spec.value {
        NameOr::Name(n) => builtin(&n).ok_or_else(|| unknown_profile(o, "hardware", &n)),
        NameOr::Map(h) => custom_profile(o, h),
    }
}

/// The error for a profile name at `field` that is no built-in one.
fn unknown_profile(o: &Origin, field: &str, name: &str) -> SpecError {
    let help = match did_you_mean(name, HARDWARE_NAMES.iter().copied()) {
        Some(m) => format!("did you mean `{m}`? built-in profiles: {}", HARDWARE_NAMES.join(", ")),
        None => format!(
            "built-in profiles: {}; or give the numbers as a mapping",
            HARDWARE_NAMES.join(", ")
        ),
    };
    o.error(field, format!("unknown hardware profile `{name}`"), help)
}

/// A profile given as a mapping: its base with the numbers written over it; without a
/// base, every hardware number must be written.
fn custom_profile(o: &mut Origin, h: HardwareFile) -> Result<HardwareProfile, SpecError> {
    let mut profile = base_profile(o, &h.base)?;
    if let Some(n) = &h.name {
        profile.name = n.clone();
    } else if h.base.is_some() {
        profile.name.push_str("-custom");
    }
    if let Some(k) = &h.kernels {
        o.insert("hardware.kernels", pos(k));
        profile.kernels = k.value;
    }
    let mut missing = Vec::new();
    for (name, value, slot) in number_fields(&h, &mut profile) {
        match value {
            Some(v) => *slot = custom_number(o, name, v)?,
            None if slot.is_nan() => missing.push(name),
            None => {}
        }
    }
    if !missing.is_empty() {
        return Err(o.error(
            "hardware",
            format!("custom hardware is missing {}", missing.join(", ")),
            format!(
                "give every number, or start from a built-in with `base: h100-sxm` ({})",
                HARDWARE_NAMES.join(", ")
            ),
        ));
    }
    Ok(profile)
}

/// The profile a mapping starts from: its `base`, or one whose hardware numbers are all
/// unknown (NaN) until written.
fn base_profile(o: &mut Origin, base: &Option<Spanned<String>>) -> Result<HardwareProfile, SpecError> {
    Ok(match base {
        Some(b) => {
            o.insert("hardware.base", pos(b));
            builtin(&b.value).ok_or_else(|| unknown_profile(o, "hardware.base", &b.value))?
        }
        None => HardwareProfile {
            name: "custom".into(),
            bf16_tflops: f64::NAN,
            f32_tflops: f64::NAN,
            hbm_gib: f64::NAN,
            hbm_gbps: f64::NAN,
            intra_node_gbps: f64::NAN,
            inter_node_gbps: f64::NAN,
            intra_node_latency_us: f64::NAN,
            inter_node_latency_us: f64::NAN,
            matmul_efficiency: f64::NAN,
            host_link_gbps: f64::NAN,
            host_mem_gbps: f64::NAN,
            // No float8 tensor cores unless written.
            fp8_tflops: 0.0,
            mxfp8_tflops: 0.0,
            // Not hardware numbers a user must know: NCCL's, CUDA's and the
            // kernels' typical figures (the H100's where they differ by GPU).
            ..builtin("h100-sxm").expect("built-in profile")
        },
    })
}

/// One number of a hardware mapping: its key, its value where written, and the profile's
/// field it sets.
type NumberField<'a> = (&'static str, Option<&'a Spanned<f64>>, &'a mut f64);

/// Every number a hardware mapping may give, with the profile field each sets, in the
/// order they are checked (and named when missing).
fn number_fields<'a>(h: &'a HardwareFile, p: &'a mut HardwareProfile) -> [NumberField<'a>; 31] {
    [
        ("bf16_tflops", h.bf16_tflops.as_ref(), &mut p.bf16_tflops),
        ("f32_tflops", h.f32_tflops.as_ref(), &mut p.f32_tflops),
        ("fp8_tflops", h.fp8_tflops.as_ref(), &mut p.fp8_tflops),
        ("mxfp8_tflops", h.mxfp8_tflops.as_ref(), &mut p.mxfp8_tflops),
        ("hbm_gib", h.hbm_gib.as_ref(), &mut p.hbm_gib),
        ("hbm_gbps", h.hbm_gbps.as_ref(), &mut p.hbm_gbps),
        ("intra_node_gbps", h.intra_node_gbps.as_ref(), &mut p.intra_node_gbps),
        ("inter_node_gbps", h.inter_node_gbps.as_ref(), &mut p.inter_node_gbps),
        (
            "intra_node_latency_us",
            h.intra_node_latency_us.as_ref(),
            &mut p.intra_node_latency_us,
        ),
        (
            "inter_node_latency_us",
            h.inter_node_latency_us.as_ref(),
            &mut p.inter_node_latency_us,
        ),
        (
            "matmul_efficiency",
            h.matmul_efficiency.as_ref(),
            &mut p.matmul_efficiency,
        ),
        ("host_link_gbps", h.host_link_gbps.as_ref(), &mut p.host_link_gbps),
        ("host_mem_gbps", h.host_mem_gbps.as_ref(), &mut p.host_mem_gbps),
        ("cuda_context_mib", h.cuda_context_mib.as_ref(), &mut p.cuda_context_mib),
        ("nccl_channels", h.nccl_channels.as_ref(), &mut p.nccl_channels),
        ("nccl_channel_mib", h.nccl_channel_mib.as_ref(), &mut p.nccl_channel_mib),
        ("sm_count", h.sm_count.as_ref(), &mut p.sm_count),
        ("matmul_tile_m", h.matmul_tile_m.as_ref(), &mut p.matmul_tile_m),
        ("matmul_tile_n", h.matmul_tile_n.as_ref(), &mut p.matmul_tile_n),
        (
            "attention_fwd_efficiency",
            h.attention_fwd_efficiency.as_ref(),
            &mut p.attention_fwd_efficiency,
        ),
        (
            "attention_bwd_efficiency",
            h.attention_bwd_efficiency.as_ref(),
            &mut p.attention_bwd_efficiency,
        ),
        ("attention_block", h.attention_block.as_ref(), &mut p.attention_block),
        (
            "memory_efficiency",
            h.memory_efficiency.as_ref(),
            &mut p.memory_efficiency,
        ),
        ("kernel_launch_us", h.kernel_launch_us.as_ref(), &mut p.kernel_launch_us),
        (
            "collective_efficiency",
            h.collective_efficiency.as_ref(),
            &mut p.collective_efficiency,
        ),
        ("overlap_slowdown", h.overlap_slowdown.as_ref(), &mut p.overlap_slowdown),
        (
            "parallel_launch_us",
            h.parallel_launch_us.as_ref(),
            &mut p.parallel_launch_us,
        ),
        ("copy_gbps", h.copy_gbps.as_ref(), &mut p.copy_gbps),
        ("step_overhead_us", h.step_overhead_us.as_ref(), &mut p.step_overhead_us),
        (
            "fsdp2_unit_host_us",
            h.fsdp2_unit_host_us.as_ref(),
            &mut p.fsdp2_unit_host_us,
        ),
        (
            "fsdp2_compiled_unit_host_us",
            h.fsdp2_compiled_unit_host_us.as_ref(),
            &mut p.fsdp2_compiled_unit_host_us,
        ),
    ]
}

/// The number written for hardware key `name`, recorded and checked against its range.
fn custom_number(o: &mut Origin, name: &str, v: &Spanned<f64>) -> Result<f64, SpecError> {
    let field = format!("hardware.{name}");
    o.insert(&field, pos(v));
    let (rule, ok) = number_range(name);
    number(o, &field, v.value, ok, rule)
}

/// The range of hardware key `name`, as errors write it and as a test: efficiencies are
/// fractions in (0, 1], the rest positive, or non-negative where none is possible.
fn number_range(name: &str) -> (&'static str, fn(f64) -> bool) {
    // Memory outside the allocator may be none (no NCCL, no context), and so may launch
    // costs and overlap slowdowns.
    let may_be_zero = matches!(
        name,
        "cuda_context_mib"
            | "nccl_channels"
            | "nccl_channel_mib"
            | "kernel_launch_us"
            | "overlap_slowdown"
            | "parallel_launch_us"
            | "copy_gbps"
            | "step_overhead_us"
            | "fsdp2_unit_host_us"
            | "fsdp2_compiled_unit_host_us"
            | "fp8_tflops"
            | "mxfp8_tflops"
    );
    if name.ends_with("_efficiency") {
        ("in (0, 1]", |x| x > 0.0 && x <= 1.0)
    } else if may_be_zero {
        (">= 0", |x| x >= 0.0)
    } else {
        ("> 0", |x| x > 0.0)
    }
}
