//! The text form of a plan: a summary, the groups table, and one rank's schedule as aligned
//! columns per stream, in the module names of the user's model.

use crate::plan::{Comm, Instr, Issued, Plan, Stream};
use std::fmt::Write;

mod summary;
pub(crate) use summary::summary;

/// `1.50 GiB`-style sizes (powers of 1024).
pub fn bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// Seconds as `12.345 ms`.
pub fn ms(s: f64) -> String {
    format!("{:.3} ms", s * 1e3)
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn group_name(plan: &Plan, g: crate::GroupId) -> String {
    match plan.groups.get(g.index()) {
        Some(grp) => format!("{g} {}", grp.group.module),
        None => g.to_string(),
    }
}

/// Ranks of a group, compactly: `0-7`, or `3,11,..,16379 (2048 ranks)`.
pub(crate) fn ranks(members: &[u64]) -> String {
    match members {
        [] => String::new(),
        [one] => one.to_string(),
        [a, b, ..] => {
            let step = b - a;
            let last = members[members.len() - 1];
            if step == 1 {
                format!("{a}-{last}")
            } else if members.len() <= 4 {
                members.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
            } else {
                format!("{a},{b},..,{last} ({} ranks)", members.len())
            }
        }
    }
}

/// One instruction in words (no rank-specific detail).
pub fn describe(plan: &Plan, issued: &Issued) -> String {
    describe_for(plan, issued, None)
}

fn describe_for(plan: &Plan, issued: &Issued, rank: Option<u64>) -> String {
    let buf = |b: crate::BufId| match plan.buffers.get(b.index()) {
        Some(x) => x.name.clone(),
        None => b.to_string(),
    };
    let over = |c: Comm| match rank {
        Some(r) => format!("{c} {}", ranks(&c.members(&plan.mesh, r))),
        None => c.to_string(),
    };
    match &issued.instr {
        Instr::Compute { step, micro, .. } => match plan.steps.get(step.index()) {
            Some(s) => {
                let mb = if plan.policy.grad_accum > 1 {
                    format!(" mb{micro}")
                } else {
                    String::new()
                };
                if s.stream == Stream::AllToAll {
                    // One expert- or context-group collective: its op, size and group.
                    let (op, b, comm) = s.tensor_ops.first().map_or(("collective", 0, Comm::Expert), |t| {
                        let comm = if t.op.is_context() { Comm::Context } else { Comm::Expert };
                        (t.op.name(), t.bytes, comm)
                    });
                    return format!(
                        "{op} {} {}{mb} [{step}] {} over {}",
                        s.phase.name(),
                        s.label,
                        bytes(b),
                        over(comm)
                    );
                }
                let tp = if s.tensor_ops.is_empty() {
                    String::new()
                } else {
                    let b: u64 = s.tensor_ops.iter().map(|t| t.bytes).sum();
                    let mut axes: Vec<&str> = s.tensor_ops.iter().map(|t| t.op.axis()).collect();
                    axes.dedup();
                    format!(" +{} {} collectives {}", s.tensor_ops.len(), axes.join("/"), bytes(b))
                };
                format!("{} {}{mb} [{step}]{tp}", s.phase.name(), s.label)
            }
            None => format!("compute {step}"),
        },
        Instr::Alloc { buf: b } => match plan.buffers.get(b.index()) {
            Some(x) => format!("alloc {} {}", x.name, bytes(x.bytes())),
            None => format!("alloc {b}"),
        },
        Instr::Free { buf: b } => format!("free {}", buf(*b)),
        Instr::Record { event } => format!("record {event}"),
        Instr::Wait { event } => format!("wait {event}"),
        Instr::AllGather { group, comm, .. } => {
            format!("all-gather {} over {}", group_name(plan, *group), over(*comm))
        }
        Instr::PackGrads { group, srcs, dst } => format!(
            "pack {} gradient piece{} of {} -> {}",
            srcs.len(),
            if srcs.len() == 1 { "" } else { "s" },
            group_name(plan, *group),
            buf(*dst)
        ),
        Instr::ReduceScatter { group, comm, op, .. } => format!(
            "reduce-scatter {} {op:?} over {}",
            group_name(plan, *group),
            over(*comm)
        )
        .replace("Avg", "avg")
        .replace("Sum", "sum"),
        Instr::AllReduce { comm, op, buf: b, .. } => format!("all-reduce {} {op:?} over {}", buf(*b), over(*comm))
            .replace("Avg", "avg")
            .replace("Sum", "sum"),
        Instr::Copy { src, dst, .. } => format!("copy {} -> {}", buf(*src), buf(*dst)),
        Instr::PostForwardSlice { src, dst, ranks } => {
            format!("keep 1/{ranks} of {} -> {}", buf(*src), buf(*dst))
        }
        Instr::GradNorm { dst, grads } => format!("grad norm of {} shards -> {}", grads.len(), buf(*dst)),
        Instr::OptimizerStep { group, .. } => format!("{} step {}", plan.policy.optimizer, group_name(plan, *group)),
    }
}

/// Summary, groups table and the schedule of `rank`.
pub fn text(plan: &Plan, rank: u64) -> String {
    let mut o = String::new();
    summary(&mut o, plan);
    o.push('\n');
    groups_table(&mut o, plan);
    o.push('\n');
    schedule_table(&mut o, plan, rank);
    o
}

/// `s` seconds in the unit that shows it best: s, ms or us, three decimals.
pub(crate) fn duration(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.3} us", s * 1e6)
    }
}

/// The groups table.
pub(crate) fn groups_table(o: &mut String, plan: &Plan) {
    let p = &plan.policy.mixed_precision;
    let _ = writeln!(
        o,
        "groups ({}):\n  {:<5} {:<28} {:>14} {:>16} {:>16} {:>10}  reshard_after_forward",
        plan.groups.len(),
        "group",
        "module",
        "params",
        format!("unsharded {}", p.param),
        format!("shard/rank {}", p.master()),
        "padding"
    );
    for grp in &plan.groups {
        let l = &grp.layout;
        let after = grp.reshard;
        let mut module = grp.group.module.clone();
        if module.len() > 28 {
            module.truncate(25);
            module.push_str("...");
        }
        let _ = writeln!(
            o,
            "  {:<5} {:<28} {:>14} {:>16} {:>16} {:>10}  {after}",
            grp.group.id.to_string(),
            module,
            thousands(l.numel),
            bytes(l.gathered_bytes(p.param)),
            bytes(l.shard_bytes(p.master())),
            thousands(l.padding())
        );
    }
}

/// One rank's schedule: a row per instruction in issue order, in its stream's column.
pub(crate) fn schedule_table(o: &mut String, plan: &Plan, rank: u64) {
    let Some(program) = plan.program_of(rank) else {
        let _ = writeln!(o, "rank {rank} is not in the mesh");
        return;
    };
    let used: Vec<Stream> = Stream::ALL
        .iter()
        .copied()
        .filter(|s| program.instrs.iter().any(|i| i.stream == *s))
        .collect();
    let coords = plan.mesh.coords(rank);
    if plan.mesh.tensor() > 1 {
        let _ = writeln!(
            o,
            "schedule of rank {rank} (replicate {}, shard {}, tensor {}), start times in ms:",
            coords.replicate, coords.shard, coords.tensor
        );
    } else {
        let _ = writeln!(
            o,
            "schedule of rank {rank} (replicate {}, shard {}), start times in ms:",
            coords.replicate, coords.shard
        );
    }
    let cells: Vec<String> = program
        .instrs
        .iter()
        .map(|i| describe_for(plan, i, Some(rank)))
        .collect();
    let width: Vec<usize> = used
        .iter()
        .map(|s| {
            program
                .instrs
                .iter()
                .zip(&cells)
                .filter(|(i, _)| i.stream == *s)
                .map(|(_, c)| c.len())
                .max()
                .unwrap_or(0)
                .max(s.name().len())
        })
        .collect();
    let mut head = format!("  {:>5} {:>9}", "#", "t");
    for (s, w) in used.iter().zip(&width) {
        head.push_str(&format!("  {:<w$}", s.name(), w = *w));
    }
    let _ = writeln!(o, "{}", head.trim_end());
    for (i, (issued, cell)) in program.instrs.iter().zip(&cells).enumerate() {
        let mut row = format!(
            "  {:>5} {:>9.3}",
            i,
            plan.timing.start.get(i).copied().unwrap_or(0.0) * 1e3
        );
        for (s, w) in used.iter().zip(&width) {
            let c = if *s == issued.stream { cell.as_str() } else { "" };
            row.push_str(&format!("  {c:<w$}", w = *w));
        }
        let _ = writeln!(o, "{}", row.trim_end());
    }
}
