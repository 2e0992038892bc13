//! The simulated timeline as a Chrome / Perfetto trace (the JSON "trace event" format):
//! one track per stream, one slice per instruction that takes time, and a counter track of
//! device memory.

use crate::plan::{Instr, Plan, Program, Stream};
use crate::print::describe;
use serde_json::{json, Value};

/// Whether an instruction gets a slice in a trace (those that take time and move data).
pub fn traced(instr: &Instr) -> bool {
    !matches!(
        instr,
        Instr::Alloc { .. } | Instr::Free { .. } | Instr::Record { .. } | Instr::Wait { .. }
    )
}

/// The metadata events naming `rank`'s track (a process) and one thread per stream its
/// program uses: the layout every shardplan trace shares, planned or measured.
pub fn tracks(program: &Program, rank: u64) -> Vec<Value> {
    let mut events =
        vec![json!({"ph": "M", "pid": rank, "name": "process_name", "args": {"name": format!("rank {rank}")}})];
    for s in Stream::ALL {
        if program.instrs.iter().any(|i| i.stream == s) {
            events.push(json!({
                "ph": "M", "pid": rank, "tid": s.index(), "name": "thread_name",
                "args": {"name": s.name()}
            }));
        }
    }
    events
}

/// The trace of `rank`'s program.
pub fn chrome_trace(plan: &Plan, rank: u64) -> Value {
    let mut events = Vec::new();
    let Some(program) = plan.program_of(rank) else {
        return json!({ "traceEvents": events });
    };
    let pid = rank;
    events.extend(tracks(program, rank));
    for (i, issued) in program.instrs.iter().enumerate() {
        if !traced(&issued.instr) {
            continue;
        }
        let (start, end) = (plan.timing.start[i], plan.timing.end[i]);
        events.push(json!({
            "ph": "X",
            "pid": pid,
            "tid": issued.stream.index(),
            "name": describe(plan, issued),
            "ts": start * 1e6,
            "dur": (end - start) * 1e6,
            "args": {"instr": i},
        }));
        // A step's tensor-parallel collectives, nested in its slice where the cost model
        // puts them (kept inside it: the timeline may stretch or pad the step).
        if let crate::plan::Instr::Compute { step, .. } = &issued.instr {
            if let Some(s) = plan.steps.get(step.index()) {
                for t in &s.tensor_ops {
                    let ts = (start + t.at_s).min(end);
                    events.push(json!({
                        "ph": "X",
                        "pid": pid,
                        "tid": issued.stream.index(),
                        "name": format!("{} {}", t.op, t.node),
                        "ts": ts * 1e6,
                        "dur": t.dur_s.min(end - ts) * 1e6,
                        "args": {"instr": i, "bytes": t.bytes, "group": "tensor"},
                    }));
                }
            }
        }
    }
    for s in &plan.memory.timeline {
        events.push(json!({
            "ph": "C",
            "pid": pid,
            "name": "device memory",
            "ts": s.t * 1e6,
            "args": {"bytes": s.total},
        }));
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}
