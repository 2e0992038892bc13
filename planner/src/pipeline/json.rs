//! A pipeline plan as data: its JSON form (`plan --format json`) and its Chrome / Perfetto
//! trace (`plan --format trace`).
//!
//! The JSON holds the schedule and its size, every stage (modules, rank, parameters,
//! times, memory, and which FSDP plan it runs), every rank's compute-only and lowered
//! programs in torch's text form, the timeline, every rank's memory at its peak, and the
//! stages' FSDP plans, each written once however many stages share it.

use super::plan::PipelinePlan;
use super::{Action, OpKind};
use crate::Plan;
use serde_json::{json, Value};
use std::sync::Arc;

/// The version of the pipeline plan's JSON form.
pub const PIPELINE_PLAN_VERSION: u32 = 1;

/// The plan as JSON.
pub fn to_json(plan: &PipelinePlan) -> Value {
    let mut fsdp: Vec<&Arc<Plan>> = Vec::new();
    let mut stages = Vec::with_capacity(plan.stages.len());
    for (s, st) in plan.stages.iter().enumerate() {
        let k = match fsdp.iter().position(|p| Arc::ptr_eq(p, &st.fsdp)) {
            Some(k) => k,
            None => {
                fsdp.push(&st.fsdp);
                fsdp.len() - 1
            }
        };
        stages.push(json!({
            "stage": s,
            "rank": st.rank,
            "modules": st.modules,
            "params": st.params,
            "seconds": {
                "forward": st.times.forward,
                "backward_input": st.times.backward_input,
                "backward_weight": st.times.backward_weight,
                "accumulate": st.times.accumulate,
                "unshard": st.times.unshard,
                "reduce": st.times.reduce,
            },
            "memory": st.memory,
            "fsdp_plan": k,
        }));
    }
    let p = &plan.program;
    let text = |programs: &[Vec<Action>]| -> Value {
        programs
            .iter()
            .map(|r| r.iter().map(|a| a.to_string()).collect::<Vec<_>>())
            .collect()
    };
    let compute: Vec<Vec<Option<String>>> = p
        .compute
        .iter()
        .map(|r| r.iter().map(|slot| slot.as_ref().map(|a| a.to_string())).collect())
        .collect();
    let timeline: Vec<Vec<Value>> = plan
        .timeline
        .ranks
        .iter()
        .map(|spans| {
            spans
                .iter()
                .map(|s| json!({"action": s.action.to_string(), "start": s.start, "end": s.end}))
                .collect()
        })
        .collect();
    json!({
        "version": PIPELINE_PLAN_VERSION,
        "kind": "pipeline",
        "schedule": p.schedule.map(|s| s.to_string()),
        "ranks": p.shape.ranks,
        "stages_per_rank": p.shape.stages_per_rank,
        "microbatches": p.shape.microbatches,
        "rank_of_stage": p.rank_of_stage,
        "stages": stages,
        "compute": compute,
        "lowered": text(&p.lowered),
        "timeline": {
            "makespan": plan.timeline.makespan,
            "bubble": plan.timeline.bubble(),
            "ranks": timeline,
        },
        "memory": plan.memory,
        "step_seconds": plan.step_s,
        "p2p_seconds": plan.p2p_s,
        "boundary_bytes": plan.boundary_bytes,
        "fsdp_plans": fsdp.iter().map(|p| serde_json::to_value(p.as_ref()).unwrap_or(Value::Null)).collect::<Vec<_>>(),
    })
}

/// The timeline as a Chrome / Perfetto trace: a track per pipeline rank with a slice per
/// forward, backward and weight-gradient action, and a flow from each activation's (or
/// gradient's) maker to its reader on another rank.
pub fn chrome_trace(plan: &PipelinePlan) -> Value {
    let mut events = Vec::new();
    for (rank, spans) in plan.timeline.ranks.iter().enumerate() {
        events.push(
            json!({"ph": "M", "pid": rank, "name": "process_name", "args": {"name": format!("pipeline rank {rank}")}}),
        );
        events.push(json!({"ph": "M", "pid": rank, "tid": 0, "name": "thread_name", "args": {"name": "compute"}}));
        for s in spans {
            let op = s.action.ops().first().copied();
            events.push(json!({
                "ph": "X",
                "pid": rank,
                "tid": 0,
                "name": s.action.to_string(),
                "ts": s.start * 1e6,
                "dur": (s.end - s.start) * 1e6,
                "args": {
                    "stage": op.map(|o| o.stage),
                    "microbatch": op.and_then(|o| o.microbatch),
                    "kind": op.map(|o| o.kind.name()),
                },
            }));
        }
    }
    events.extend(flows(plan));
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// Flow events from the end of each compute that makes a value another rank reads (a
/// forward's activation, a backward's input gradient) to the start of its reader.
fn flows(plan: &PipelinePlan) -> Vec<Value> {
    let rank_of = &plan.program.rank_of_stage;
    let stages = rank_of.len() as u32;
    // (rank, start, end) of each compute op, by (stage, kind class, micro-batch).
    let mut at: std::collections::BTreeMap<(u32, bool, u32), (usize, f64, f64)> = Default::default();
    for (rank, spans) in plan.timeline.ranks.iter().enumerate() {
        for s in spans {
            for op in s.action.ops() {
                let backward = matches!(op.kind, OpKind::Backward | OpKind::BackwardInput);
                if let (Some(m), true) = (op.microbatch, op.kind == OpKind::Forward || backward) {
                    at.insert((op.stage, backward, m), (rank, s.start, s.end));
                }
            }
        }
    }
    let mut events = Vec::new();
    let mut id = 0u64;
    for (&(stage, backward, m), &(rank, _, end)) in &at {
        let reader = match backward {
            false if stage + 1 < stages => stage + 1,
            true if stage > 0 => stage - 1,
            _ => continue,
        };
        if rank_of[reader as usize] as usize == rank {
            continue;
        }
        let Some(&(to, start, _)) = at.get(&(reader, backward, m)) else {
            continue;
        };
        id += 1;
        let name = if backward { "gradient" } else { "activation" };
        events.push(json!({"ph": "s", "id": id, "pid": rank, "tid": 0, "ts": end * 1e6, "name": name, "cat": "p2p"}));
        events.push(
            json!({"ph": "f", "bp": "e", "id": id, "pid": to, "tid": 0, "ts": start * 1e6, "name": name, "cat": "p2p"}),
        );
    }
    events
}
