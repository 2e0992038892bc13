//! Device memory as the GPU sees it, on whole plans: the caching allocator's reserved peak
//! against the allocated peak, the fixed overheads, and a published FSDP2 run
//! (`../shared/ANCHORS.md`, row P3).

mod common;

use common::{parallel, plan_preset};
use shardplan_ir::differentiate;
use shardplan_models::{preset, trace, TraceOptions};
use shardplan_planner::allocator::replay;
use shardplan_planner::steps_and_events;
use shardplan_planner::{plan, Plan};

const GIB: f64 = (1u64 << 30) as f64;

/// Reserved >= allocated blocks >= requested bytes, and the device total adds the overheads.
fn check_levels(p: &Plan) {
    let m = &p.memory;
    assert!(m.active_peak >= m.peak, "{} < {}", m.active_peak, m.peak);
    assert!(
        m.reserved_peak >= m.active_peak,
        "{} < {}",
        m.reserved_peak,
        m.active_peak
    );
    assert_eq!(
        m.device_total,
        m.reserved_peak + m.overhead.cuda_context + m.overhead.nccl
    );
    let comms = p.programs[0]
        .communicators()
        .iter()
        .filter(|(c, _)| c.size(&p.mesh) > 1)
        .count() as u64;
    assert_eq!(u64::from(m.overhead.communicators), comms);
    assert_eq!(m.overhead.nccl, comms * p.hardware.nccl_bytes_per_communicator());
    assert_eq!(m.overhead.cuda_context, p.hardware.cuda_context_bytes());
}

#[test]
fn tiny_plans_reserve_a_few_segments_above_their_peak() {
    let base = "gpus_per_node: 4\nmixed_precision: {param: bf16, reduce: f32}\n";
    let batch = "batch: {per_rank: 2, seq_len: 16}\n";
    for extra in [
        "mesh: {shard: 4}\n",
        "mesh: {replicate: 2, shard: 2}\n",
        "mesh: {shard: 4}\nreshard_after_forward: 2\n",
        "mesh: {shard: 4}\nactivation_checkpointing: full\n",
        "mesh: {shard: 4}\noffload: cpu\n",
        "mesh: {shard: 4}\nbatch: {per_rank: 2, seq_len: 16, grad_accum: 4}\n",
    ] {
        let batch = if extra.contains("batch:") { "" } else { batch };
        let p = plan_preset("tiny-llama", &format!("{base}{batch}{extra}"));
        check_levels(&p);
        let m = &p.memory;
        // Every tensor is below 1 MiB: 2 MiB small-pool segments, a few per stream.
        assert_eq!(m.reserved_peak % (2 << 20), 0, "{extra}");
        assert!(m.reserved_peak - m.peak <= 16 << 20, "{extra}: {m:?}");
    }
}

#[test]
fn the_replay_requests_exactly_the_planned_peak() {
    // The allocator sees the bytes the memory model counts, in the same order.
    let config = parallel("mesh: {shard: 4}\ngpus_per_node: 4\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 2, seq_len: 32}\nactivation_checkpointing: {every: 2}\n");
    let g = trace(
        &preset("tiny-llama").unwrap(),
        TraceOptions {
            batch: 2,
            seq_len: Some(32),
            dtype: config.mixed_precision.param,
            ..Default::default()
        },
    )
    .unwrap();
    let joint = differentiate(&g).unwrap();
    let p = plan(&joint, &config).unwrap();
    let groups: Vec<_> = p.groups.iter().map(|g| g.group.clone()).collect();
    let runner = shardplan_planner::Runner::of(&config);
    let (steps, acts) = steps_and_events(&joint, &groups, config.activation_checkpointing, runner);
    assert_eq!(steps, p.steps);
    let r = replay(&p.programs[0], &p.buffers, &acts, p.policy.allocator);
    assert_eq!(r.requested_peak, p.memory.peak);
    assert_eq!(
        (r.allocated_peak, r.reserved),
        (p.memory.active_peak, p.memory.reserved_peak)
    );
    assert!(r.steps >= 2, "a second step checks the first reserved enough");
}

#[test]
fn llama3_8b_reserves_within_a_sane_ratio_of_its_peak() {
    let p = plan_preset(
        "llama3-8b",
        "mesh: {shard: 8}\ngpus_per_node: 8\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 1, seq_len: 8192}\n",
    );
    check_levels(&p);
    let m = &p.memory;
    let ratio = m.reserved_peak as f64 / m.peak as f64;
    // Published FSDP2 runs reserve 1.20-1.36x what they allocate (ANCHORS.md).
    assert!((1.0..1.6).contains(&ratio), "reserved / allocated = {ratio:.3}");
    // One communicator per (group, stream): shard all-gather, reduce-scatter, all-reduce.
    assert_eq!(m.overhead.communicators, 3);
}

/// Expandable segments (the default, as torchtitan launches) against PyTorch's own
/// default on whole plans: never below the allocated peak, and on these representative
/// FSDP steps never above one `cudaMalloc` segment per miss (tensors of a few sizes, made
/// and freed in waves, tile one growing mapping with less waste than segments cut to the
/// first request that needed them).
#[test]
fn expandable_segments_reserve_between_allocated_and_cuda_malloc() {
    let specs = [
        ("tiny-llama", "mesh: {shard: 4}\ngpus_per_node: 4\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 2, seq_len: 16}\n"),
        ("tiny-llama", "mesh: {replicate: 2, shard: 2}\ngpus_per_node: 4\nbatch: {per_rank: 2, seq_len: 64}\nactivation_checkpointing: full\n"),
        ("llama3-8b", "mesh: {shard: 8}\ngpus_per_node: 8\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 1, seq_len: 8192}\n"),
        ("llama3-8b", "mesh: {shard: 8}\ngpus_per_node: 8\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 1, seq_len: 8192}\nactivation_checkpointing: selective\nreshard_after_forward: false\n"),
        ("llama2-7b", P3),
    ];
    for (model, spec) in specs {
        let on = plan_preset(model, spec);
        let off = plan_preset(model, &format!("{spec}allocator: {{expandable_segments: false}}\n"));
        check_levels(&on);
        check_levels(&off);
        let (a, b) = (&on.memory, &off.memory);
        assert!(on.policy.allocator.expandable_segments && !off.policy.allocator.expandable_segments);
        // The allocator changes what is reserved, nothing else.
        assert_eq!((a.peak, on.estimate.step_s), (b.peak, off.estimate.step_s), "{model}");
        // Expandable blocks are their rounded requests exactly; segments may hold unsplit
        // remainders.
        assert!(a.active_peak <= b.active_peak, "{model}: {a:?} vs {b:?}");
        assert!(a.reserved_peak >= a.active_peak, "{model}");
        assert!(
            a.reserved_peak <= b.reserved_peak,
            "{model}: expandable {} > cudaMalloc {}",
            a.reserved_peak,
            b.reserved_peak
        );
    }
}

/// ANCHORS.md P3 (torchtitan pull request #165): Llama 2 7B on 8 H100 96GB, batch 8 x 2048
/// per GPU, full activation checkpointing.
const P3: &str = "mesh: {shard: 8}\ngpus_per_node: 8\nhardware: {base: h100-sxm, hbm_gib: 94}\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 8, seq_len: 2048}\nactivation_checkpointing: full\n";

/// ANCHORS.md P3 and P4 (P3 with torchtitan's op-SAC): active 22.7 and 49.5 GiB,
/// reserved 31.0 and 59.4 GiB published. The runs predate torchtitan's launch script
/// setting expandable segments (torchtitan pull request #643, 2024-10-22; #165 is from
/// 2024-03-28), so they are held to PyTorch's default allocator; the expandable-segments
/// prediction is printed beside it. Nothing here is fitted to the rows; the bounds catch a
/// model that drifts far from them.
#[test]
fn llama2_7b_is_near_the_published_runs() {
    for (row, ac, pub_active, pub_reserved) in [("P3", "full", 22.7, 31.0), ("P4", "selective", 49.5, 59.4)] {
        for (allocator, held) in [("", false), ("allocator: {expandable_segments: false}\n", true)] {
            let spec = P3.replace(
                "activation_checkpointing: full",
                &format!("activation_checkpointing: {ac}"),
            );
            let p = plan_preset("llama2-7b", &format!("{spec}{allocator}"));
            check_levels(&p);
            let m = &p.memory;
            let (active, reserved) = (m.active_peak as f64 / GIB, m.reserved_peak as f64 / GIB);
            eprintln!(
                "{row} predicted (expandable_segments: {}): allocated {:.2} GiB, active {active:.2} GiB, reserved {reserved:.2} GiB, device total {:.2} GiB (published: active {pub_active}, reserved {pub_reserved})",
                p.policy.allocator.expandable_segments,
                m.peak as f64 / GIB,
                m.device_total as f64 / GIB
            );
            if held {
                assert!(
                    (0.75..1.25).contains(&(active / pub_active)),
                    "{row}: active {active:.2} GiB"
                );
                assert!(
                    (0.75..1.25).contains(&(reserved / pub_reserved)),
                    "{row}: reserved {reserved:.2} GiB"
                );
            }
        }
    }
}
