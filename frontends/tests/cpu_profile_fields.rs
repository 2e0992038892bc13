//! The CPU executor's profile fields (`parallel_launch_us`, `copy_gbps`,
//! `step_overhead_us`): read from a spec, 0 when absent, refused when negative, and listed
//! by `numbers()` (which `calibrate` and `--emit-spec` print) so they round-trip.

use shardplan_frontends::{builtin_hardware, parse_parallel_spec, Source};

fn parse(hw: &str) -> Result<shardplan_frontends::ParallelConfig, shardplan_frontends::SpecError> {
    let yaml = format!("mesh: {{shard: 1}}\nbatch: {{per_rank: 1, seq_len: 8}}\nhardware: {hw}\n");
    parse_parallel_spec(&Source::from_text("p.yaml", &yaml)).map(|(c, _)| c)
}

#[test]
fn cpu_fields_are_read_and_default_to_zero() {
    let c = parse("{base: h100-sxm, kernels: fused, parallel_launch_us: 21.5, copy_gbps: 9.25, step_overhead_us: 310}")
        .unwrap();
    assert_eq!(c.hardware.parallel_launch_us, 21.5);
    assert_eq!(c.hardware.copy_gbps, 9.25);
    assert_eq!(c.hardware.step_overhead_us, 310.0);
    let d = parse("h100-sxm").unwrap();
    assert_eq!(
        (
            d.hardware.parallel_launch_us,
            d.hardware.copy_gbps,
            d.hardware.step_overhead_us
        ),
        (0.0, 0.0, 0.0)
    );
    // Every built-in profile leaves them out of its model.
    for name in shardplan_frontends::HARDWARE_NAMES {
        let h = builtin_hardware(name).unwrap();
        assert_eq!((h.parallel_launch_us, h.copy_gbps, h.step_overhead_us), (0.0, 0.0, 0.0));
    }
}

#[test]
fn cpu_fields_must_not_be_negative() {
    for field in ["parallel_launch_us", "copy_gbps", "step_overhead_us"] {
        let e = parse(&format!("{{base: h100-sxm, {field}: -1}}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("hardware.{field}")) && e.contains(">= 0"), "{e}");
    }
}

#[test]
fn cpu_fields_round_trip_through_numbers() {
    let c =
        parse("{base: h100-sxm, kernels: fused, parallel_launch_us: 3, copy_gbps: 4, step_overhead_us: 5}").unwrap();
    let nums = c.hardware.numbers();
    let line: Vec<String> = nums.iter().map(|(k, v)| format!("{k}: {v:?}")).collect();
    let back = parse(&format!("{{name: again, kernels: fused, {}}}", line.join(", "))).unwrap();
    assert_eq!(back.hardware.numbers(), nums);
}

/// FSDP2's host time per unit: the built-in fit unless the spec sets it, 0 allowed (no host
/// time), negative refused at the field, and listed by `numbers()`.
#[test]
fn fsdp2_unit_host_time_is_read_checked_and_listed() {
    let d = parse("h200").unwrap();
    assert_eq!(d.hardware.fsdp2_unit_host_us, shardplan_frontends::FSDP2_UNIT_HOST_US);
    assert_eq!(
        parse("{base: h200, fsdp2_unit_host_us: 0}")
            .unwrap()
            .hardware
            .fsdp2_unit_host_us,
        0.0
    );
    assert_eq!(
        parse("{base: h200, fsdp2_unit_host_us: 1250}")
            .unwrap()
            .hardware
            .fsdp2_unit_host_us,
        1250.0
    );
    let e = parse("{base: h200, fsdp2_unit_host_us: -1}").unwrap_err().to_string();
    assert!(e.contains("hardware.fsdp2_unit_host_us") && e.contains(">= 0"), "{e}");
    assert!(d.hardware.numbers().iter().any(|(k, _)| *k == "fsdp2_unit_host_us"));
}

/// The H200 profile carries the constants measured on an H200; the H100's keep the
/// published ones.
#[test]
fn h200_profile_carries_its_measured_constants() {
    let h = builtin_hardware("h200").unwrap();
    let m = shardplan_frontends::H200_MEASURED;
    assert_eq!(
        (
            h.matmul_efficiency,
            h.attention_fwd_efficiency,
            h.attention_bwd_efficiency,
            h.memory_efficiency,
            h.kernel_launch_us
        ),
        (m.matmul, m.attention.0, m.attention.1, m.memory, m.launch_us)
    );
    let h100 = builtin_hardware("h100-sxm").unwrap();
    assert_eq!((h100.matmul_efficiency, h100.kernel_launch_us), (0.70, 5.0));
}
