//! The verifier accepts the planner's plans and rejects broken ones, naming the instruction.

mod common;

use common::plan_preset;
use shardplan_planner::{verify, Instr, Plan, RankSpan, Stream};

fn tiny() -> Plan {
    plan_preset(
        "tiny-llama",
        "mesh: {shard: 4}\ngpus_per_node: 4\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 2, seq_len: 16}\n",
    )
}

#[test]
fn planned_schedules_verify() {
    verify(&tiny(), None).unwrap();
}

#[test]
fn deleting_an_all_gather_is_a_use_before_write() {
    let mut plan = tiny();
    let instrs = &mut plan.programs[0].instrs;
    // The all-gather of the first block (g0).
    let at = instrs
        .iter()
        .position(|i| matches!(i.instr, Instr::AllGather { group, .. } if group.0 == 0))
        .unwrap();
    instrs.remove(at);
    let e = verify(&plan, None).unwrap_err();
    assert_eq!(e.rule, "use before write", "{e}");
    assert!(e.message.contains("forward layers.0"), "{e}");
    assert!(e.message.contains("g0.unsharded.fwd"), "{e}");
    assert!(e.message.contains("no all-gather writes it"), "{e}");
}

#[test]
fn a_free_moved_before_a_use_is_a_use_after_free() {
    let mut plan = tiny();
    let instrs = &mut plan.programs[0].instrs;
    let compute = instrs
        .iter()
        .position(|i| {
            matches!(&i.instr, Instr::Compute { reads, .. } if !reads.is_empty()) && i.stream == Stream::Compute
        })
        .map(|p| p + 1)
        .unwrap();
    // The first compute that reads a gathered group is followed by the free of a buffer it read?
    let (free_at, buf) = instrs
        .iter()
        .enumerate()
        .skip(compute)
        .find_map(|(i, x)| match x.instr {
            Instr::Free { buf } if x.stream == Stream::Compute => Some((i, buf)),
            _ => None,
        })
        .unwrap();
    let user = instrs[..free_at]
        .iter()
        .rposition(|x| matches!(&x.instr, Instr::Compute { reads, .. } if reads.contains(&buf)))
        .unwrap();
    let free = instrs.remove(free_at);
    instrs.insert(user, free);
    let e = verify(&plan, None).unwrap_err();
    assert_eq!(e.rule, "use after free", "{e}");
    assert_eq!(e.instr, Some(user + 1), "{e}");
    assert!(e.message.contains("forward"), "{e}");
}

#[test]
fn swapping_two_collectives_on_one_rank_breaks_the_group_order() {
    let mut plan = tiny();
    let mut other = plan.programs[0].clone();
    let ags: Vec<usize> = other
        .instrs
        .iter()
        .enumerate()
        .filter(|(_, i)| matches!(i.instr, Instr::AllGather { .. }))
        .map(|(k, _)| k)
        .take(2)
        .collect();
    let (a, b) = (ags[0], ags[1]);
    let (x, y) = (other.instrs[a].clone(), other.instrs[b].clone());
    other.instrs[a] = y;
    other.instrs[b] = x;
    plan.programs.push(other);
    plan.ranks = vec![
        RankSpan {
            first: 0,
            count: 2,
            program: 0,
        },
        RankSpan {
            first: 2,
            count: 1,
            program: 1,
        },
        RankSpan {
            first: 3,
            count: 1,
            program: 0,
        },
    ];
    let e = verify(&plan, None).unwrap_err();
    assert_eq!(e.rule, "collective order", "{e}");
    assert_eq!(e.instr, Some(a), "{e}");
    assert!(e.message.contains("rank 2"), "{e}");
    assert!(
        e.message.contains("all-gather g0 layers.0") || e.message.contains("all-gather g2 <root>"),
        "{e}"
    );
}

#[test]
fn a_wait_before_its_record_is_rejected() {
    let mut plan = tiny();
    let instrs = &mut plan.programs[0].instrs;
    let rec = instrs
        .iter()
        .position(|i| matches!(i.instr, Instr::Record { .. }))
        .unwrap();
    let Instr::Record { event } = instrs[rec].instr else {
        unreachable!()
    };
    let wait = instrs.iter().position(|i| i.instr == Instr::Wait { event }).unwrap();
    let w = instrs.remove(wait);
    instrs.insert(rec, w);
    let e = verify(&plan, None).unwrap_err();
    assert_eq!(e.rule, "events", "{e}");
    assert!(e.message.contains("not recorded before it"), "{e}");
}

#[test]
fn a_missing_wait_is_a_race() {
    let mut plan = tiny();
    // Drop the compute stream's wait for the first block's all-gather.
    let instrs = &mut plan.programs[0].instrs;
    let compute = instrs
        .iter()
        .position(|i| matches!(&i.instr, Instr::Compute { step, .. } if step.0 == 1))
        .unwrap();
    let wait = instrs[..compute]
        .iter()
        .rposition(|i| i.stream == Stream::Compute && matches!(i.instr, Instr::Wait { .. }))
        .unwrap();
    instrs.remove(wait);
    let e = verify(&plan, None).unwrap_err();
    assert!(["race", "use after free", "use before write"].contains(&e.rule), "{e}");
    assert!(e.message.contains("g0.unsharded.fwd"), "{e}");
}

#[test]
fn a_reduce_scatter_not_ordered_after_the_last_contribution_is_rejected() {
    let mut plan = tiny();
    let instrs = &mut plan.programs[0].instrs;
    // Move the first reduce-scatter's wait (and so the reduce-scatter) ahead of the backward
    // step that produced the gradients: issue the backward compute after its reduction.
    let rs = instrs
        .iter()
        .position(|i| matches!(i.instr, Instr::ReduceScatter { .. }))
        .unwrap();
    let Instr::ReduceScatter { src, .. } = instrs[rs].instr.clone() else {
        unreachable!()
    };
    let producer = instrs
        .iter()
        .position(|i| matches!(&i.instr, Instr::PackGrads { dst, .. } if *dst == src))
        .unwrap();
    // Record an event before the producer and make the RS stream wait on that instead.
    let rs_wait = instrs[..rs]
        .iter()
        .rposition(|i| i.stream == Stream::ReduceScatter && matches!(i.instr, Instr::Wait { .. }))
        .unwrap();
    let Instr::Wait { event } = instrs[rs_wait].instr else {
        unreachable!()
    };
    let rec = instrs.iter().position(|i| i.instr == Instr::Record { event }).unwrap();
    let r = instrs.remove(rec);
    instrs.insert(producer, r);
    let e = verify(&plan, None).unwrap_err();
    assert!(["race", "lost write", "use after free"].contains(&e.rule), "{e}");
    assert!(e.message.contains("g1.rs_in"), "{e}");
}

#[test]
fn the_budget_is_checked() {
    let plan = tiny();
    // The budget is for the device total: reserved peak + CUDA context + NCCL.
    let need = plan.memory.device_total;
    assert!(need >= plan.memory.reserved_peak && plan.memory.reserved_peak >= plan.memory.peak);
    verify(&plan, Some(need)).unwrap();
    let e = verify(&plan, Some(need - 1024)).unwrap_err();
    assert_eq!(e.rule, "budget");
    assert!(e.message.contains("exceeds the budget"), "{e}");
    assert!(e.message.contains("by 1.00 KiB"), "{e}");
}

#[test]
fn rank_spans_must_cover_the_mesh() {
    let mut plan = tiny();
    plan.ranks[0].count = 3;
    let e = verify(&plan, None).unwrap_err();
    assert_eq!(e.rule, "ranks");
    assert!(e.message.contains("the mesh has 4"), "{e}");
}

#[test]
fn out_of_range_references_do_not_panic() {
    let mut plan = tiny();
    plan.programs[0].instrs.push(shardplan_planner::Issued {
        stream: Stream::Compute,
        instr: Instr::Free {
            buf: shardplan_planner::BufId(1_000_000),
        },
    });
    let e = verify(&plan, None).unwrap_err();
    assert_eq!(e.rule, "references");
}

#[test]
fn a_plan_file_with_a_broken_mesh_is_rejected() {
    let plan = tiny();
    let mut json: serde_json::Value = serde_json::to_value(&plan).unwrap();
    json["mesh"]["shard"] = serde_json::json!(0);
    let broken: Plan = serde_json::from_value(json.clone()).unwrap();
    let e = verify(&broken, None).unwrap_err();
    assert_eq!(e.rule, "mesh", "{e}");
    json["mesh"]["shard"] = serde_json::json!(2);
    json["mesh"]["replicate"] = serde_json::json!(2);
    let relaid: Plan = serde_json::from_value(json).unwrap();
    let e = verify(&relaid, None).unwrap_err();
    assert!(e.message.contains("laid out over 4 ranks"), "{e}");
}

/// examples/models/tiny-moe.yaml on 1x4 with an expert axis of 2, under `runtime`.
fn tiny_moe(runtime: &str) -> Plan {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-moe.yaml");
    let model = shardplan_frontends::load_model(&path).unwrap().config;
    common::plan_model(
        &model,
        &format!(
            "mesh: {{shard: 4, expert: 2}}\ngpus_per_node: 4\nbatch: {{per_rank: 2, seq_len: 16}}\nruntime: {runtime}\n"
        ),
    )
}

/// Issue indexes of the steps on the all-to-all stream.
fn all_to_all_steps(plan: &Plan) -> Vec<usize> {
    plan.programs[0]
        .instrs
        .iter()
        .enumerate()
        .filter(|(_, x)| x.stream == Stream::AllToAll && matches!(x.instr, Instr::Compute { .. }))
        .map(|(i, _)| i)
        .collect()
}

#[test]
fn expert_collectives_are_steps_of_their_own_on_the_all_to_all_stream() {
    let plan = tiny_moe("shardplan");
    verify(&plan, None).unwrap();
    // Two MoE layers: the routing table's all-gather, the dispatch and the combine in
    // forward; the combine's and dispatch's gradients (the table is kept) in backward.
    let steps = all_to_all_steps(&plan);
    let ops: Vec<&str> = steps
        .iter()
        .map(|&i| match plan.programs[0].instrs[i].instr {
            Instr::Compute { step, .. } => plan.steps[step.index()].tensor_ops[0].op.name(),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(ops.len(), 10, "{ops:?}");
    assert_eq!(ops.iter().filter(|o| **o == "moe_gather_ids").count(), 2, "{ops:?}");
    for s in &plan.steps {
        let expert = s.tensor_ops.iter().any(|t| t.op.is_expert());
        assert_eq!(s.stream == Stream::AllToAll, expert, "{} {}", s.id, s.label);
        if s.stream == Stream::AllToAll {
            assert_eq!(s.tensor_ops.len(), 1, "one collective a step: {}", s.id);
            assert!(s.reads.is_empty() && s.grads.is_empty(), "{}", s.id);
        }
    }
    // Every one waits for the compute stream and is waited for by it.
    let instrs = &plan.programs[0].instrs;
    for &i in &steps {
        assert!(matches!(instrs[i - 1].instr, Instr::Wait { .. }) && instrs[i - 1].stream == Stream::AllToAll);
        let Instr::Record { event } = instrs[i + 1].instr else {
            panic!("#{} records", i + 1)
        };
        assert!(instrs[i + 2..]
            .iter()
            .any(|x| x.stream == Stream::Compute && x.instr == Instr::Wait { event }));
    }
    // Under FSDP2 the collectives run inside compute steps, as torchtitan runs them.
    let fsdp2 = tiny_moe("fsdp2");
    verify(&fsdp2, None).unwrap();
    assert!(all_to_all_steps(&fsdp2).is_empty());
    assert!(fsdp2.steps.iter().all(|s| s.stream == Stream::Compute));
}

/// Removes the compute stream's wait for the event recorded after rank 0's all-to-all
/// step at issue index `i`.
fn remove_compute_wait_after(plan: &mut Plan, i: usize) {
    let instrs = &mut plan.programs[0].instrs;
    let Instr::Record { event } = instrs[i + 1].instr else {
        panic!("#{} records", i + 1)
    };
    let wait = instrs
        .iter()
        .position(|x| x.stream == Stream::Compute && x.instr == Instr::Wait { event })
        .unwrap();
    instrs.remove(wait);
}

#[test]
fn a_compute_step_not_waiting_for_an_all_to_all_is_an_activation_order_error() {
    let mut plan = tiny_moe("shardplan");
    let i = all_to_all_steps(&plan)[1];
    remove_compute_wait_after(&mut plan, i);
    let e = verify(&plan, None).unwrap_err();
    assert_eq!(e.rule, "activation order", "{e}");
    assert!(e.message.contains("moe_dispatch"), "{e}");
}

/// tiny-llama on 2 shard x 2 context ranks: the ring's exchanges are steps on the
/// all-to-all stream, and a compute step that does not wait for its gathered keys is caught.
#[test]
fn a_compute_step_not_waiting_for_the_ring_is_an_activation_order_error() {
    let config =
        common::parallel("mesh: {shard: 2, context: 2}\ngpus_per_node: 4\nbatch: {per_rank: 2, seq_len: 16}\n");
    let joint = common::joint_of(&shardplan_models::preset("tiny-llama").unwrap(), &config);
    let mut plan = shardplan_planner::plan(&joint, &config).unwrap();
    verify(&plan, None).unwrap();
    let steps = all_to_all_steps(&plan);
    // Two layers: keys and values gathered in forward, their gradients reduced in backward.
    assert_eq!(steps.len(), 8, "{steps:?}");
    // The values' gather: the keys' is ordered before it on the all-to-all stream, so the
    // attention waiting for the values' alone also waits for the keys'.
    remove_compute_wait_after(&mut plan, steps[1]);
    let e = verify(&plan, None).unwrap_err();
    assert_eq!(e.rule, "activation order", "{e}");
    assert!(e.message.contains("cp_all_gather"), "{e}");
}

#[test]
fn an_all_to_all_not_waiting_for_its_input_is_an_activation_order_error() {
    let mut plan = tiny_moe("shardplan");
    let i = all_to_all_steps(&plan)[0];
    plan.programs[0].instrs.remove(i - 1);
    let e = verify(&plan, None).unwrap_err();
    assert_eq!(e.rule, "activation order", "{e}");
    assert!(e.message.contains("moe_gather_ids"), "{e}");
    assert!(e.message.contains("has made its input"), "{e}");
}

#[test]
fn a_step_on_another_stream_than_its_own_is_refused() {
    let mut plan = tiny_moe("shardplan");
    let i = all_to_all_steps(&plan)[0];
    plan.programs[0].instrs[i].stream = Stream::Compute;
    let e = verify(&plan, None).unwrap_err();
    assert_eq!(e.rule, "streams", "{e}");
    assert!(e.message.contains("belongs on the all-to-all stream"), "{e}");
}

/// The steps the compute stream runs while an all-to-all step is in flight (after it, before
/// the step naming it in `waits_for`) touch none of its values: they read neither its output
/// nor an operand whose last reader they are. Checked against the graph's own reads, on
/// tiny-moe with and without checkpointing, with tensor parallelism, and with Qwen2-MoE's
/// shared expert.
#[test]
fn compute_steps_beside_an_all_to_all_touch_none_of_its_values() {
    use shardplan_planner::{ExecOrder, Phase, Runner, ValueSlot};
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-moe.yaml");
    let tiny = shardplan_frontends::load_model(&path).unwrap().config;
    let mut shared = tiny.clone();
    if let shardplan_models::ModelConfig::Llama(l) = &mut shared {
        let m = l.moe.as_mut().unwrap();
        m.shared_experts = 1;
        m.shared_expert_ffn_dim = 64;
        m.shared_expert_gate = true;
    }
    let llama = shardplan_models::preset("tiny-llama").unwrap();
    let llama = match llama {
        shardplan_models::ModelConfig::Llama(l) => {
            shardplan_models::ModelConfig::Llama(shardplan_models::LlamaConfig { n_kv_heads: 4, ..l })
        }
        other => other,
    };
    let mut overlapped = 0;
    for (model, extra) in [
        (&tiny, ""),
        (&tiny, "activation_checkpointing: full\n"),
        (&tiny, "mesh: {shard: 2, tensor: 2, expert: 2}\n"),
        (&shared, ""),
        // The context ring, both rotations, under checkpointing and with tensor parallelism.
        (&llama, "mesh: {shard: 2, context: 2}\n"),
        (
            &llama,
            "mesh: {shard: 2, context: 2}\ncontext_parallel: {rotate: alltoall, load_balance: none}\n",
        ),
        (&llama, "mesh: {shard: 2, context: 2}\nactivation_checkpointing: full\n"),
        (&llama, "mesh: {shard: 1, context: 2, tensor: 2}\n"),
    ] {
        let mesh = if extra.starts_with("mesh") {
            ""
        } else {
            "mesh: {shard: 4, expert: 2}\n"
        };
        let yaml = format!("{mesh}{extra}gpus_per_node: 4\nbatch: {{per_rank: 2, seq_len: 16}}\n");
        let config = common::parallel(&yaml);
        let joint = common::joint_of(model, &config);
        let plan = shardplan_planner::plan(&joint, &config).unwrap();
        verify(&plan, None).unwrap();
        let exec = ExecOrder::new(&joint, config.activation_checkpointing, Runner::of(&config));
        let g = &joint.graph;
        // Each step's (node, copy, position) in the execution order.
        let mut pos = 0;
        let mut nodes = Vec::new();
        for s in &plan.steps {
            let copy = s.phase == Phase::Recompute;
            let mut v = Vec::new();
            for i in s.nodes.iter().flat_map(|r| r.clone()) {
                assert_eq!(exec.order()[pos], (shardplan_ir::NodeId(i), copy));
                v.push((shardplan_ir::NodeId(i), copy, pos));
                pos += 1;
            }
            nodes.push(v);
        }
        for (k, x) in plan
            .steps
            .iter()
            .enumerate()
            .filter(|(_, s)| s.stream == Stream::AllToAll)
        {
            let (id, copy, _) = nodes[k][0];
            let out = ValueSlot::of(id, copy);
            let operands: Vec<ValueSlot> = g.node(id).inputs.iter().map(|&i| exec.read_slot(id, copy, i)).collect();
            let join = (k + 1..plan.steps.len())
                .find(|&j| plan.steps[j].waits_for.contains(&x.id))
                .unwrap_or_else(|| panic!("{} is joined by no step ({yaml})", x.id));
            for (j, step_nodes) in nodes.iter().enumerate().take(join).skip(k + 1) {
                if plan.steps[j].stream != Stream::Compute {
                    continue;
                }
                overlapped += 1;
                for &(r, rc, rpos) in step_nodes {
                    for &input in g.node(r).inputs.iter().chain(exec.extra_reads(g, r)) {
                        if exec.param_of(input).is_some() {
                            continue;
                        }
                        let s = exec.read_slot(r, rc, input);
                        assert_ne!(s, out, "{r} in {} reads {}'s output ({yaml})", plan.steps[j].id, x.id);
                        assert!(
                            !(operands.contains(&s) && exec.last_use(s) == Some(rpos)),
                            "{r} in {} frees an operand of {} ({yaml})",
                            plan.steps[j].id,
                            x.id
                        );
                    }
                }
            }
        }
    }
    assert!(overlapped > 0, "some compute step runs beside an all-to-all");
}
