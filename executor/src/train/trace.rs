//! The measured timeline of a run as a Chrome / Perfetto trace, in the track layout of the
//! planner's (`plan --format trace`): a process per rank, a thread per stream, one slice
//! per instruction that takes time, so planned and measured open side by side.

use super::sharded::ShardedTrainer;
use crate::ExecError;
use serde_json::{json, Value};
use shardplan_planner::print::describe;
use shardplan_planner::trace::{traced, tracks};

impl ShardedTrainer {
    /// Every rank's measured instruction times since `record_times`, as a Chrome trace
    /// (a collective: every process calls it; each returns the whole trace).
    pub fn measured_trace(&mut self) -> Result<Value, ExecError> {
        let plan = &self.shared.plan;
        let n = plan.programs[0].instrs.len();
        let steps = self.times.as_ref().map_or(0, Vec::len);
        // This process's ranks, each: steps x instructions x [start, end].
        let mut mine: Vec<f64> = Vec::new();
        for (k, r) in self.ranks.iter().enumerate() {
            mine.push(r.rank as f64);
            for step in self.times.iter().flatten() {
                for t in &step[k] {
                    mine.extend_from_slice(t);
                }
            }
        }
        let bytes: Vec<u8> = bytemuck::cast_slice(&mine).to_vec();
        let mut per_rank: Vec<(u64, Vec<f64>)> = Vec::new();
        for part in self.gather_bytes(bytes)? {
            if part.len() % 8 != 0 {
                return Err(ExecError::Internal("a process sent a malformed trace".into()));
            }
            let vals: Vec<f64> = part
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect();
            let width = 1 + steps * n * 2;
            for r in vals.chunks(width) {
                per_rank.push((r[0] as u64, r[1..].to_vec()));
            }
        }
        per_rank.sort_by_key(|r| r.0);
        let plan = &self.shared.plan;
        let program = &plan.programs[0];
        let origin = per_rank
            .iter()
            .flat_map(|r| r.1.iter().step_by(2).copied())
            .fold(f64::INFINITY, f64::min);
        let mut events = Vec::new();
        for (rank, times) in &per_rank {
            events.extend(tracks(program, *rank));
            for step in 0..steps {
                for (i, issued) in program.instrs.iter().enumerate() {
                    if !traced(&issued.instr) {
                        continue;
                    }
                    let at = (step * n + i) * 2;
                    let (start, end) = (times[at], times[at + 1]);
                    events.push(json!({
                        "ph": "X",
                        "pid": rank,
                        "tid": issued.stream.index(),
                        "name": describe(plan, issued),
                        "ts": (start - origin) * 1e6,
                        "dur": ((end - start) * 1e6).max(0.0),
                        "args": {"instr": i, "step": step + 1},
                    }));
                }
            }
        }
        Ok(json!({ "traceEvents": events, "displayTimeUnit": "ms" }))
    }
}
