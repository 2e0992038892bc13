//! PyTorch FSDP2 runs measured on one H200 (the program `shardplan export fsdp2` writes, foreach
//! AdamW, `torch.cuda.max_memory_allocated` / `max_memory_reserved`, the median step after
//! two), each planned as `runtime: fsdp2` on the built-in `h200` profile, and the plan held
//! against what was measured. The book's docs/src/measured.md, "Held against an H200", has
//! the same table.
//!
//! The `h200` profile's efficiencies and launch cost are `benches/gpu_profile.py`'s
//! measurements on that GPU; `fsdp2_unit_host_us` (FSDP2's host time per unit) is the one
//! constant fitted to these rows, together, and `fitted_without_a_row_that_row_holds`
//! checks that it is not tuned to each: fitted to three rows, it predicts the fourth within
//! the speed tolerance.

mod common;

use common::plan_model;
use shardplan_frontends::{parse_model_spec, Source, FSDP2_UNIT_HOST_US};
use shardplan_planner::{Plan, WorkKind};

const GIB: f64 = (1u64 << 30) as f64;

/// Speed: how far predicted tokens/s may be from the measured ones (issue target 15%).
const SPEED_TOLERANCE: f64 = 0.15;
/// Allocated memory: within 5%.
const MEMORY_TOLERANCE: f64 = 0.05;

const LLAMA_1B: &str = include_str!("../../examples/models/llama-1b.yaml");
/// The 3.2B of the last row: Llama 3.2 3B's shape with a 32,000-token vocabulary.
const LLAMA_3B: &str = "family: llama\nvocab_size: 32000\ndim: 3072\nn_layers: 28\nn_heads: 24\n\
n_kv_heads: 8\nffn_dim: 8192\nnorm_eps: 1.0e-5\nrope_theta: 500000\ntie_embeddings: false\nmax_seq_len: 4096\n";

struct Row {
    name: &'static str,
    model: &'static str,
    checkpointing: &'static str,
    batch: u64,
    seq: u64,
    /// Measured tokens/s: the range over the machines it ran on.
    tokens_per_s: (f64, f64),
    allocated_gib: f64,
    reserved_gib: f64,
    /// The most the reserved prediction may be below the measured peak, where the model
    /// does not yet hold it within 5%. The plan's requests are torch's own on the CPU
    /// (tests/alloc_trace.rs: each stream's peak within 0.1%, FSDP2's world-size-1 path
    /// included), and torch's own requests replayed reserve more than the plan's (1.08 at
    /// these shapes with full checkpointing): how they lie in the segments, which a GPU
    /// trace of these runs (gpu-check's export check) shows.
    reserved_floor: f64,
}

const ROWS: &[Row] = &[
    Row {
        name: "1.1B, 2 x 2048, no AC",
        model: LLAMA_1B,
        checkpointing: "none",
        batch: 2,
        seq: 2048,
        tokens_per_s: (25_292.0, 30_800.0),
        allocated_gib: 20.81,
        reserved_gib: 25.86,
        reserved_floor: 0.95,
    },
    Row {
        name: "1.1B, 4 x 2048, full AC",
        model: LLAMA_1B,
        checkpointing: "full",
        batch: 4,
        seq: 2048,
        tokens_per_s: (35_900.0, 35_900.0),
        allocated_gib: 20.63,
        reserved_gib: 24.47,
        reserved_floor: 0.83,
    },
    Row {
        name: "1.1B, 4 x 2048, selective AC",
        model: LLAMA_1B,
        checkpointing: "selective",
        batch: 4,
        seq: 2048,
        tokens_per_s: (34_083.0, 34_083.0),
        allocated_gib: 20.63,
        reserved_gib: 26.49,
        reserved_floor: 0.90,
    },
    Row {
        name: "3.2B, 1 x 4096, no AC",
        model: LLAMA_3B,
        checkpointing: "none",
        batch: 1,
        seq: 4096,
        tokens_per_s: (12_590.0, 12_590.0),
        allocated_gib: 56.24,
        reserved_gib: 65.47,
        reserved_floor: 0.93,
    },
];

/// `examples/parallel/gpu-check-llama-1b.yaml` as the exported program ran it.
fn spec(r: &Row, extra: &str) -> String {
    format!(
        "mesh: {{replicate: 1, shard: 1}}\ngpus_per_node: 1\nhardware: {{base: h200{extra}}}\nruntime: fsdp2\n\
wrap: [block]\nreshard_after_forward: true\nmixed_precision: {{param: bf16, reduce: f32}}\n\
activation_checkpointing: {}\nbatch: {{per_rank: {}, seq_len: {}, grad_accum: 1}}\n\
optimizer: {{adamw: {{lr: 3.0e-4, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.1, implementation: foreach}}}}\n\
lr_schedule: {{warmup_steps: 0, min_lr_ratio: 1.0}}\ngrad_clip: 1.0\nseed: 0\ndata: synthetic\n",
        r.checkpointing, r.batch, r.seq
    )
}

fn plan_row(r: &Row, extra: &str) -> Plan {
    plan_spec(r, &spec(r, extra))
}

/// `r`'s model planned under `yaml`.
fn plan_spec(r: &Row, yaml: &str) -> Plan {
    let (model, _) = parse_model_spec(&Source::from_text("model.yaml", r.model)).unwrap_or_else(|e| panic!("{e}"));
    plan_model(&model, yaml)
}

/// Predicted over measured, or 1 inside a measured range.
fn ratio(predicted: f64, (lo, hi): (f64, f64)) -> f64 {
    if predicted < lo {
        predicted / lo
    } else if predicted > hi {
        predicted / hi
    } else {
        1.0
    }
}

#[test]
fn every_h200_run_is_predicted() {
    let mut failures = Vec::new();
    for r in ROWS {
        let p = plan_row(r, "");
        let speed = ratio(p.estimate.tokens_per_s, r.tokens_per_s);
        let allocated = p.memory.peak as f64 / GIB / r.allocated_gib;
        let reserved = p.memory.reserved_peak as f64 / GIB / r.reserved_gib;
        println!(
            "{}: {:.0} tokens/s ({speed:.3}), allocated {:.2} GiB ({allocated:.3}), reserved {:.2} GiB ({reserved:.3}); \
hooks {:.1} ms of {:.1} ms",
            r.name,
            p.estimate.tokens_per_s,
            p.memory.peak as f64 / GIB,
            p.memory.reserved_peak as f64 / GIB,
            p.estimate.breakdown.get(WorkKind::Hooks) * 1e3,
            p.estimate.step_s * 1e3,
        );
        let row = |what: &str, predicted: String, measured: String, ratio: f64| {
            println!("row: H200 {} | {what} | {predicted} | {measured} | {ratio:.3}", r.name)
        };
        let (lo, hi) = r.tokens_per_s;
        let range = if lo == hi {
            format!("{lo:.0}")
        } else {
            format!("{lo:.0}-{hi:.0}")
        };
        row("tokens/s", format!("{:.0}", p.estimate.tokens_per_s), range, speed);
        row(
            "allocated GiB",
            format!("{:.2}", p.memory.peak as f64 / GIB),
            r.allocated_gib.to_string(),
            allocated,
        );
        row(
            "reserved GiB",
            format!("{:.2}", p.memory.reserved_peak as f64 / GIB),
            r.reserved_gib.to_string(),
            reserved,
        );
        if (speed - 1.0).abs() > SPEED_TOLERANCE {
            failures.push(format!("{}: tokens/s {speed:.3}x the measured", r.name));
        }
        if (allocated - 1.0).abs() > MEMORY_TOLERANCE {
            failures.push(format!("{}: allocated {allocated:.3}x the measured", r.name));
        }
        if reserved > 1.0 + MEMORY_TOLERANCE || reserved < r.reserved_floor {
            failures.push(format!(
                "{}: reserved {reserved:.3}x the measured (held at [{}, {}])",
                r.name,
                r.reserved_floor,
                1.0 + MEMORY_TOLERANCE
            ));
        }
        // The hooks are FSDP2's and FSDP2's only.
        let own = p.shardplan_executor.as_ref().expect("the executor's twin");
        assert!(own.step_s < p.estimate.step_s, "{}", r.name);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `fsdp2_unit_host_us` that puts `r`'s prediction on its measured speed (the middle of a
/// range): the step is linear in it, one half per unit before its forward and its backward.
fn fitted_to(r: &Row) -> f64 {
    let none = plan_row(r, ", fsdp2_unit_host_us: 0");
    let units = none.groups.len() as f64;
    let measured_s = (r.batch * r.seq) as f64 / ((r.tokens_per_s.0 + r.tokens_per_s.1) / 2.0);
    (measured_s - none.estimate.step_s) / units * 1e6
}

#[test]
fn fitted_without_a_row_that_row_holds() {
    let fits: Vec<f64> = ROWS.iter().map(fitted_to).collect();
    println!("per-row fits (us per unit): {fits:.0?}; built in: {FSDP2_UNIT_HOST_US}");
    // Every row asks for host time, and the built-in value lies among the rows' own fits.
    assert!(fits.iter().all(|&f| f > 0.0), "{fits:?}");
    let (lo, hi) = fits
        .iter()
        .fold((f64::MAX, 0.0f64), |(lo, hi), &f| (lo.min(f), hi.max(f)));
    assert!((lo..=hi).contains(&FSDP2_UNIT_HOST_US), "{fits:?}");
    // Leave one out: the mean of the other three rows' fits predicts the row left out.
    let mut failures = Vec::new();
    for (i, r) in ROWS.iter().enumerate() {
        let others = fits
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, f)| f)
            .sum::<f64>()
            / 3.0;
        let p = plan_row(r, &format!(", fsdp2_unit_host_us: {others}"));
        let speed = ratio(p.estimate.tokens_per_s, r.tokens_per_s);
        println!("{} from the others' {others:.0} us: {speed:.3}", r.name);
        if (speed - 1.0).abs() > SPEED_TOLERANCE {
            failures.push(format!("{}: {speed:.3}x from the other rows' fit", r.name));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn shardplans_own_runtime_pays_no_hooks() {
    let r = &ROWS[0];
    let p = plan_spec(r, &spec(r, "").replace("runtime: fsdp2\n", ""));
    assert_eq!(p.estimate.breakdown.get(WorkKind::Hooks), 0.0);
    let fsdp2 = plan_row(r, "");
    let hooks = fsdp2.estimate.breakdown.get(WorkKind::Hooks);
    assert!(
        (hooks - fsdp2.groups.len() as f64 * FSDP2_UNIT_HOST_US * 1e-6).abs() < 1e-9,
        "{hooks}"
    );
}

/// The compiled run of ANCHORS.md's H200 table (an independent torchtitan-style FSDP2
/// script, fused AdamW, `torch.compile` of each block), beside its eager twin: the 1.1B at
/// 2 x 2048, no checkpointing. Measured tokens/s and peak allocated GiB.
const H200_EAGER_FUSED: (f64, f64) = (31_017.0, 21.07);
const H200_COMPILED: (f64, f64) = (44_694.0, 19.05);

/// How slow the compiled prediction may read today: the host time a compiled unit keeps
/// (`fsdp2_compiled_unit_host_us`) is a CPU's ratio, not an H200's, and the rest of the
/// gap is open (docs/src/measured.md, "Compiled").
const COMPILED_SPEED_FLOOR: f64 = 0.84;

#[test]
fn the_compiled_h200_run_is_predicted() {
    let r = &ROWS[0];
    let yaml = |compile: &str| spec(r, "").replace("implementation: foreach", "implementation: fused") + compile;
    let eager = plan_spec(r, &yaml(""));
    let compiled = plan_spec(r, &yaml("compile: {model: true}\n"));
    let tokens = (r.batch * r.seq) as f64;
    let show = |p: &Plan, (tps, gib): (f64, f64)| {
        let speed = tokens / p.estimate.step_s / tps;
        let allocated = p.memory.peak as f64 / GIB / gib;
        (speed, allocated)
    };
    let (es, ea) = show(&eager, H200_EAGER_FUSED);
    let (cs, ca) = show(&compiled, H200_COMPILED);
    println!(
        "eager (fused AdamW): {:.0} tokens/s ({es:.3}), allocated {ea:.3}; compiled: {:.0} tokens/s ({cs:.3}), allocated {:.2} GiB ({ca:.3}); hooks {:.1} ms",
        tokens / eager.estimate.step_s,
        tokens / compiled.estimate.step_s,
        compiled.memory.peak as f64 / GIB,
        compiled.estimate.breakdown.get(WorkKind::Hooks) * 1e3
    );
    for (what, p, (tps, gib), speed, allocated) in [
        ("fused AdamW, eager", &eager, H200_EAGER_FUSED, es, ea),
        ("fused AdamW, compiled", &compiled, H200_COMPILED, cs, ca),
    ] {
        println!(
            "row: H200 1.1B, 2 x 2048, {what} | tokens/s | {:.0} | {tps:.0} | {speed:.3}",
            tokens / p.estimate.step_s
        );
        println!(
            "row: H200 1.1B, 2 x 2048, {what} | allocated GiB | {:.2} | {gib} | {allocated:.3}",
            p.memory.peak as f64 / GIB
        );
    }
    print_by_kind(&eager);
    assert!((es - 1.0).abs() <= SPEED_TOLERANCE, "eager speed {es:.3}");
    assert!((ea - 1.0).abs() <= MEMORY_TOLERANCE, "eager allocated {ea:.3}");
    assert!((ca - 1.0).abs() <= MEMORY_TOLERANCE, "compiled allocated {ca:.3}");
    assert!(
        (COMPILED_SPEED_FLOOR..=1.0 + SPEED_TOLERANCE).contains(&cs),
        "compiled speed {cs:.3}"
    );
    // Measured, compiling sped the step 1.44x; the plan must see at least part of it.
    assert!(compiled.estimate.step_s < eager.estimate.step_s);
}

/// torch.profiler's GPU kernel time of the eager fused-AdamW run above, by kind, ms per
/// step (`../shared/GPU-NOTES.md`, "Where FSDP2's step goes", H200, 2026-11-26): GEMMs,
/// cuDNN flash attention (forward 1.6 + backward 4.1), FSDP2's copy-in and copy-out with
/// the casts, other elementwise kernels, norms, fused AdamW; the step's wall time is 131 ms.
const H200_PROFILE_MS: [(&str, f64); 6] = [
    ("matmul", 31.0),
    ("attention", 5.7),
    ("fsdp copy-in/out and casts", 20.0),
    ("elementwise (rotary, activations, loss, casts)", 7.0),
    ("norms", 2.0),
    ("optimizer", 12.5),
];

/// The plan's device time of `p` by the profile's kinds, beside the profile, as rows of
/// `benches/predictions.sh`'s table. FSDP2's copies count on every stream (the profile sums
/// kernels of all streams): the compute stream's copies and packs, and the all-gather
/// stream's copy-in.
fn print_by_kind(p: &Plan) {
    let b = &p.estimate.breakdown;
    let ms = |k: WorkKind| b.get(k) * 1e3;
    let side_copies: f64 = p.programs[0]
        .instrs
        .iter()
        .enumerate()
        .filter(|(_, x)| {
            x.stream != shardplan_planner::Stream::Compute && matches!(x.instr, shardplan_planner::Instr::Copy { .. })
        })
        .map(|(i, _)| (p.timing.end[i] - p.timing.start[i]) * 1e3)
        .sum();
    let planned = [
        ms(WorkKind::Matmul),
        ms(WorkKind::Attention),
        ms(WorkKind::FsdpCopies) + side_copies,
        ms(WorkKind::Elementwise) + ms(WorkKind::Rotary) + ms(WorkKind::CrossEntropy) + ms(WorkKind::Layout),
        ms(WorkKind::Norm),
        ms(WorkKind::Optimizer),
    ];
    for ((kind, measured), plan) in H200_PROFILE_MS.iter().zip(planned) {
        println!(
            "row: H200 1.1B, 2 x 2048, fused AdamW, eager: {kind} | device ms | {plan:.1} | {measured} | {:.3}",
            plan / measured
        );
    }
    let (plan_sum, measured_sum) = (
        planned.iter().sum::<f64>(),
        H200_PROFILE_MS.iter().map(|(_, m)| m).sum::<f64>(),
    );
    println!(
        "row: H200 1.1B, 2 x 2048, fused AdamW, eager: these kernels | device ms | {plan_sum:.1} | {measured_sum} | {:.3}",
        plan_sum / measured_sum
    );
    println!(
        "row: H200 1.1B, 2 x 2048, fused AdamW, eager: the rest of the step (host) | ms | {:.1} | {:.1} | {:.3}",
        p.estimate.step_s * 1e3 - plan_sum,
        131.0 - measured_sum,
        (p.estimate.step_s * 1e3 - plan_sum) / (131.0 - measured_sum)
    );
}
