//! The arena: every plan's device buffers get fixed offsets that its proof accepts, close to
//! their live peak; a layout that lets two live buffers share addresses, or that leaves
//! out an ordering the reuse needs, is refused naming both buffers.

mod common;

use common::gen::{llama, model, policy, spec};
use common::{plan_model, plan_preset};
use proptest::prelude::*;
use shardplan_planner::arena::{self, aligned, Arena, ALIGN};
use shardplan_planner::{Instr, Plan, Pool};

fn fsdp4() -> Plan {
    plan_preset(
        "tiny-llama",
        "mesh: {shard: 4}\ngpus_per_node: 4\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 2, seq_len: 16}\n",
    )
}

/// Two non-persistent buffers alive at one point of the issue order.
fn live_together(plan: &Plan) -> (usize, usize) {
    let instrs = &plan.programs[0].instrs;
    let mut live = Vec::new();
    for x in instrs {
        match x.instr {
            Instr::Alloc { buf } if plan.buffer(buf).pool == Pool::Device => {
                if let Some(&other) = live.last() {
                    return (other, buf.index());
                }
                live.push(buf.index());
            }
            Instr::Free { buf } => live.retain(|&b| b != buf.index()),
            _ => {}
        }
    }
    panic!("no two buffers live at once");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Generated models, meshes and policies (offload and accumulation included): the
    /// layout passes its proof, holds every device buffer the program uses, and is at least
    /// the live peak (a lower bound).
    #[test]
    fn every_plan_has_a_proven_arena(
        m in model(),
        replicate in 1u64..3,
        shard in prop::sample::select(vec![1u64, 2, 4]),
        p in policy(),
    ) {
        let plan = plan_model(&m, &spec(replicate, shard, &p));
        let a = arena::layout(&plan, 0).unwrap();
        arena::check(&plan, 0, &a).unwrap();
        prop_assert!(a.bytes >= a.peak, "arena {} below the live peak {}", a.bytes, a.peak);
        // Best fit on intervals can leave holes the live peak does not count (the least
        // arena may lie above it); on these toy models it stays within 14% of it, and on
        // the examples' plans within 1% (below). Half again is no reuse at all.
        prop_assert!(a.bytes as f64 <= a.peak as f64 * 1.5, "arena {} vs live peak {}", a.bytes, a.peak);
        let used = plan.buffers.iter().filter(|b| {
            b.pool == Pool::Device
                && (b.persistent
                    || plan.programs[0].instrs.iter().any(|x| matches!(x.instr, Instr::Alloc { buf } if buf == b.id)))
        });
        for b in used {
            let o = a.offset(b.id);
            prop_assert!(o.is_some_and(|o| o % ALIGN == 0 && o + aligned(b.bytes()) <= a.bytes), "{} at {:?}", b.name, o);
        }
        // Host buffers are not in it.
        for b in plan.buffers.iter().filter(|b| b.pool == Pool::Host) {
            prop_assert!(a.offset(b.id).is_none());
        }
        // The waits cost nothing in the simulated timeline: every allocation there starts
        // after every free issued before it has ended.
        for &(f, al) in &a.waits {
            prop_assert!(plan.timing.end[f] <= plan.timing.start[al] + 1e-12,
                "wait #{} -> #{}: free ends at {} after the allocation starts at {}",
                f, al, plan.timing.end[f], plan.timing.start[al]);
        }
        // The report says the same.
        let r = plan.memory.arena.unwrap();
        prop_assert_eq!((r.bytes, r.peak, r.waits), (a.bytes, a.peak, a.waits.len() as u64));
    }
}

#[test]
fn persistent_buffers_sit_at_the_bottom_one_after_another() {
    let plan = fsdp4();
    let a = arena::layout(&plan, 0).unwrap();
    let mut end = 0;
    for b in plan.buffers.iter().filter(|b| b.persistent && b.pool == Pool::Device) {
        assert_eq!(a.offset(b.id), Some(end), "{}", b.name);
        end += aligned(b.bytes());
    }
    assert!(end > 0);
    for b in plan.buffers.iter().filter(|b| !b.persistent) {
        if let Some(o) = a.offset(b.id) {
            assert!(o >= end, "{} at {o} below the persistent buffers' {end}", b.name);
        }
    }
}

#[test]
fn buffers_whose_lives_do_not_overlap_share_addresses() {
    let plan = plan_model(
        &llama(64, 64, 6, 4, 2, 128, false),
        "mesh: {shard: 4}\ngpus_per_node: 4\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 2, seq_len: 16}\n",
    );
    let a = arena::layout(&plan, 0).unwrap();
    // Each block's gathered parameters are freed before the block two ahead is gathered:
    // the arena reuses their addresses instead of growing per block.
    let unsharded: Vec<u64> = plan
        .buffers
        .iter()
        .filter(|b| b.name.ends_with(".unsharded.fwd"))
        .filter_map(|b| a.offset(b.id))
        .collect();
    let mut distinct = unsharded.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert!(
        distinct.len() < unsharded.len(),
        "{} gathered buffers at {} distinct offsets",
        unsharded.len(),
        distinct.len()
    );
    // The step reuses memory: the arena is far below the sum of its buffers.
    let sum: u64 = plan
        .buffers
        .iter()
        .filter(|b| a.offset(b.id).is_some())
        .map(|b| aligned(b.bytes()))
        .sum();
    assert!(a.bytes < sum / 2, "arena {} of {sum}", a.bytes);
}

#[test]
fn two_live_buffers_at_one_address_are_refused_naming_both() {
    let plan = fsdp4();
    let mut a = arena::layout(&plan, 0).unwrap();
    let (x, y) = live_together(&plan);
    a.offsets[y] = a.offsets[x];
    let e = arena::check(&plan, 0, &a).unwrap_err();
    assert_eq!(e.rule, "arena", "{e}");
    assert!(e.message.contains(&plan.buffers[x].name), "{e}");
    assert!(e.message.contains(&plan.buffers[y].name), "{e}");
    assert!(e.message.contains("may be live at once"), "{e}");
}

#[test]
fn a_persistent_buffer_shares_with_nothing() {
    let plan = fsdp4();
    let mut a = arena::layout(&plan, 0).unwrap();
    let p = plan.buffers.iter().find(|b| b.persistent).unwrap().id;
    let t = plan
        .buffers
        .iter()
        .find(|b| !b.persistent && a.offset(b.id).is_some())
        .unwrap()
        .id;
    a.offsets[t.index()] = a.offsets[p.index()];
    let e = arena::check(&plan, 0, &a).unwrap_err();
    assert!(e.message.contains("may be live at once"), "{e}");
}

#[test]
fn reuse_across_streams_needs_its_waits() {
    // The reduce-scatter input is made on the compute stream and freed on the
    // reduce-scatter stream, which the compute stream never waits for inside the step:
    // the next one may take its addresses only after an added wait.
    let plan = fsdp4();
    let a = arena::layout(&plan, 0).unwrap();
    assert!(!a.waits.is_empty());
    let instrs = &plan.programs[0].instrs;
    for &(f, al) in &a.waits {
        assert!(f < al);
        assert!(matches!(instrs[f].instr, Instr::Free { .. }), "{:?}", instrs[f]);
        assert!(matches!(instrs[al].instr, Instr::Alloc { .. }), "{:?}", instrs[al]);
        assert_ne!(instrs[f].stream, instrs[al].stream);
    }
    let without = Arena { waits: Vec::new(), ..a };
    let e = arena::check(&plan, 0, &without).unwrap_err();
    assert!(e.message.contains("may be live at once"), "{e}");
}

#[test]
fn places_outside_the_arena_or_unaligned_are_refused() {
    let plan = fsdp4();
    let a = arena::layout(&plan, 0).unwrap();
    let b = plan
        .buffers
        .iter()
        .find(|b| a.offset(b.id).is_some() && b.bytes() > 0)
        .unwrap();
    let mut past = a.clone();
    past.offsets[b.id.index()] = Some(a.bytes);
    assert!(arena::check(&plan, 0, &past)
        .unwrap_err()
        .message
        .contains("past the arena"));
    let mut odd = a.clone();
    odd.offsets[b.id.index()] = Some(a.offset(b.id).unwrap() + 8);
    assert!(arena::check(&plan, 0, &odd)
        .unwrap_err()
        .message
        .contains("not a multiple"));
    let mut gone = a;
    gone.offsets[b.id.index()] = None;
    assert!(arena::check(&plan, 0, &gone).unwrap_err().message.contains("no place"));
}

#[test]
fn another_runtimes_plan_has_no_arena() {
    let plan = plan_preset(
        "tiny-llama",
        "runtime: fsdp2\nmesh: {shard: 4}\ngpus_per_node: 4\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 2, seq_len: 16}\n",
    );
    assert!(plan.memory.arena.is_none());
    assert!(fsdp4().memory.arena.is_some());
}

/// The bundled examples' plans (full-size models on GPU meshes): the arena within 1% of the
/// buffers' live peak.
#[test]
fn the_examples_arenas_are_within_one_percent_of_their_live_peak() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");
    for (model, parallel) in [
        ("llama3-8b.yaml", "fsdp-8.yaml"),
        ("llama3-70b.yaml", "hsdp-64x8.yaml"),
        ("llama3-70b.yaml", "fsdp-32-tp-8.yaml"),
        ("llama3-405b.yaml", "fsdp-1x8-405b.yaml"),
        ("qwen3-30b-a3b.config.json", "ep-8-fsdp-64.yaml"),
        ("llama-1b.yaml", "gpu-check-llama-1b.yaml"),
    ] {
        let m = shardplan_frontends::load_model(std::path::Path::new(&format!("{root}/models/{model}")))
            .unwrap()
            .config;
        let config = shardplan_frontends::load_parallel(std::path::Path::new(&format!("{root}/parallel/{parallel}")))
            .unwrap()
            .config;
        let plan = shardplan_planner::plan(&common::joint_of(&m, &config), &config).unwrap();
        let a = arena::layout(&plan, 0).unwrap();
        arena::check(&plan, 0, &a).unwrap();
        for &(f, al) in &a.waits {
            assert!(
                plan.timing.end[f] <= plan.timing.start[al] + 1e-12,
                "{model} on {parallel}: #{f} -> #{al}"
            );
        }
        assert!(
            a.bytes >= a.peak && a.bytes as f64 <= a.peak as f64 * 1.01,
            "{model} on {parallel}: arena {} vs live peak {}",
            a.bytes,
            a.peak
        );
    }
}
