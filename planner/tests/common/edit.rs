//! Editing a plan's schedule as a user would: the program of another plan of the same specs
//! (a deeper prefetch) written into a plan file, its buffers renumbered to the file's.

use shardplan_planner::{BufId, Buffer, Instr, Plan, Program};

/// `program` (over `from`'s buffers) with every buffer renamed to the buffer of `to` with the
/// same name and occurrence (the n-th `g1.all_gather_in` is the n-th in both); `None` when
/// the two buffer lists differ in more than numbering.
pub fn renumber(program: &Program, from: &[Buffer], to: &[Buffer]) -> Option<Program> {
    let key = |bufs: &[Buffer], i: usize| {
        let b = &bufs[i];
        let n = bufs[..i].iter().filter(|x| x.name == b.name).count();
        (b.name.clone(), n, b.numel, b.dtype, b.category, b.persistent)
    };
    let mut map = Vec::with_capacity(from.len());
    for i in 0..from.len() {
        let k = key(from, i);
        map.push(BufId((0..to.len()).find(|&j| key(to, j) == k)? as u32));
    }
    let m = |b: &mut BufId| *b = map[b.index()];
    let mut p = program.clone();
    for x in &mut p.instrs {
        match &mut x.instr {
            Instr::Compute { reads, writes, .. } => reads.iter_mut().chain(writes.iter_mut()).for_each(m),
            Instr::Alloc { buf } | Instr::Free { buf } | Instr::AllReduce { buf, .. } => m(buf),
            Instr::AllGather { src, dst, .. }
            | Instr::ReduceScatter { src, dst, .. }
            | Instr::Copy { src, dst, .. }
            | Instr::PostForwardSlice { src, dst, .. } => {
                m(src);
                m(dst);
            }
            Instr::GradNorm { grads: srcs, dst } | Instr::PackGrads { srcs, dst, .. } => {
                srcs.iter_mut().for_each(m);
                m(dst);
            }
            Instr::OptimizerStep {
                params,
                state,
                grads,
                norm,
                ..
            } => {
                m(params);
                state.iter_mut().for_each(m);
                m(grads);
                norm.iter_mut().for_each(m);
            }
            Instr::Record { .. } | Instr::Wait { .. } => {}
        }
    }
    Some(p)
}

/// `base` as JSON with `deeper`'s schedule (programs, events) written in, with its simulated
/// timing, memory and estimate and its FSDP2 hooks: what a user writes after editing the
/// prefetch by hand.
pub fn with_schedule_of(base: &Plan, deeper: &Plan) -> serde_json::Value {
    let program = renumber(&deeper.programs[0], &deeper.buffers, &base.buffers).expect("same buffers");
    let mut v = serde_json::to_value(base).unwrap();
    v["programs"] = serde_json::to_value(vec![program]).unwrap();
    let w = serde_json::to_value(deeper).unwrap();
    for k in ["events", "timing", "memory", "estimate", "fsdp2_hooks"] {
        v[k] = w[k].clone();
    }
    v
}
