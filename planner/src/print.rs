//! The text form of a plan: a summary, the groups table, and one rank's schedule as aligned
//! columns per stream, in the module names of the user's model.

use crate::cost::pool_name;
use crate::plan::{Category, Comm, GroupReshard, Instr, Issued, Plan, Stream};
use shardplan_frontends::{GradSync, Offload};
use std::fmt::Write;

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
pub fn ranks(members: &[u64]) -> String {
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
                    // One expert-group collective: its op, size and group.
                    let (op, b) = s
                        .tensor_ops
                        .first()
                        .map_or(("expert collective", 0), |t| (t.op.as_str(), t.bytes));
                    return format!(
                        "{op} {} {}{mb} [{step}] {} over {}",
                        s.phase.name(),
                        s.label,
                        bytes(b),
                        over(Comm::Expert)
                    );
                }
                let tp = if s.tensor_ops.is_empty() {
                    String::new()
                } else {
                    let b: u64 = s.tensor_ops.iter().map(|t| t.bytes).sum();
                    let axis = if plan.mesh.tensor() > 1 { "tensor" } else { "expert" };
                    format!(" +{} {axis} collectives {}", s.tensor_ops.len(), bytes(b))
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

/// The summary block alone.
pub fn summary(o: &mut String, plan: &Plan) {
    let m = &plan.mesh;
    let p = &plan.policy;
    let nodes = m.world().div_ceil(m.gpus_per_node());
    let _ = writeln!(
        o,
        "plan: {} ({} params) on {} ranks: mesh {} replicate x {} shard{}{}, {} node{} of {} GPUs, {}",
        plan.model,
        thousands(plan.params),
        m.world(),
        m.replicate(),
        m.shard(),
        if m.tensor() > 1 {
            format!(" x {} tensor", m.tensor())
        } else {
            String::new()
        } + &if m.expert() > 1 {
            format!(" (expert {} inside shard)", m.expert())
        } else {
            String::new()
        },
        if m.replicate() > 1 { " (HSDP)" } else { "" },
        nodes,
        if nodes == 1 { "" } else { "s" },
        m.gpus_per_node(),
        plan.hardware.name
    );
    if m.tensor() > 1 {
        let tp = &p.tensor_parallel;
        let _ = writeln!(
            o,
            "tensor parallel: groups of {} consecutive ranks (rank = (replicate x {} + shard) x {} + tensor), sequence parallel {}, loss parallel {}",
            m.tensor(),
            m.shard(),
            m.tensor(),
            if tp.sequence_parallel { "on" } else { "off" },
            if tp.loss_parallel { "on" } else { "off" },
        );
    }
    if let Some(e) = &plan.experts {
        if m.expert() > 1 {
            let _ = writeln!(
                o,
                "expert parallel: groups of {} consecutive shard ranks, each holding {} of every MoE layer's {} routed experts, {}",
                m.expert(),
                e.per_rank,
                e.experts,
                match m.expert_shard() {
                    1 => "not sharded further (no other rank of a replica holds the same ones)".to_string(),
                    n => format!("sharded over the {n} ranks holding the same ones"),
                }
            );
        }
        if m.tensor() > 1 {
            let _ = writeln!(
                o,
                "  experts under tensor parallelism: each tensor rank holds 1/{} of every expert's hidden units (the shared expert's too), as of the dense feed-forward; the router is whole on each, so every tensor rank routes alike",
                m.tensor()
            );
        }
        match (e.capacity_factor, e.per_expert) {
            (Some(f), Some(c)) => {
                let received = if m.expert() > 1 {
                    format!("; each rank receives at most {} rows per MoE layer", thousands(e.rows))
                } else {
                    String::new()
                };
                let _ = writeln!(
                    o,
                    "  token dropping: each expert keeps at most {} of a rank's {} assignments per MoE layer (moe.capacity_factor {f}; first choices first, then token order), the rest add nothing; every shape is exact{received}",
                    thousands(c),
                    thousands(e.even_rows),
                );
            }
            _ => {
                let even = match e.even {
                    Some([peak, reserved, total]) => format!(
                        "; at the even split ({} rows) allocated peak {}, reserved {}, device total {}",
                        thousands(e.even_rows),
                        bytes(peak),
                        bytes(reserved),
                        bytes(total)
                    ),
                    None => format!("; the even split is {} rows", thousands(e.even_rows)),
                };
                let _ = writeln!(
                    o,
                    "  routing bound: each rank receives at most {} rows per MoE layer (moe.capacity {} x the even split), memory below is at the bound{even}",
                    thousands(e.rows),
                    e.capacity,
                );
            }
        }
    }
    let reshard = match p.reshard_after_forward {
        GroupReshard::Free => "true".to_string(),
        GroupReshard::Keep => "false".to_string(),
        GroupReshard::ToGroupOf(n) => n.to_string(),
    };
    let mut wrap = p.wrap.join(", ");
    if !p.wrap_modules.is_empty() {
        wrap.push_str(&format!(" + modules {}", p.wrap_modules.join(", ")));
    }
    if let Some(b) = p.bucket_mib {
        wrap.push_str(&format!(", buckets up to {b} MiB"));
    }
    let mut prefetch = format!(
        "prefetch {}forward {} / backward {}",
        if p.prefetch.peak_aware { "auto: " } else { "" },
        p.prefetch.forward,
        p.prefetch.backward
    );
    if p.prefetch.peak_aware {
        prefetch.push_str(", peak-aware");
    }
    for (pass, list) in [
        ("forward", &p.prefetch.explicit_forward),
        ("backward", &p.prefetch.explicit_backward),
    ] {
        for (t, gs) in list {
            let gs: Vec<String> = gs.iter().map(|g| g.to_string()).collect();
            prefetch.push_str(&format!(", {pass} of {t} gathers {}", gs.join(" ")));
        }
    }
    let _ = writeln!(
        o,
        "policy: wrap [{wrap}], reshard_after_forward {reshard} (root keeps), {prefetch}"
    );
    let ac = match p.activation_checkpointing {
        crate::Checkpointing::None => "none".to_string(),
        crate::Checkpointing::Full => "full".to_string(),
        crate::Checkpointing::Every(n) => format!("every {n} blocks"),
        crate::Checkpointing::Selective(s) => shardplan_frontends::ActivationCheckpointing::Selective(s).to_string(),
    };
    let _ = writeln!(
        o,
        "        params {} / reduce {} / master {}, offload {}, activation checkpointing {ac}",
        p.mixed_precision.param,
        p.mixed_precision.reduce,
        p.mixed_precision.master,
        if p.offload == Offload::Cpu { "cpu" } else { "none" },
    );
    let sync = match p.grad_sync {
        GradSync::EveryMicroBatch => "reduce-scatter every micro-batch",
        GradSync::FinalMicroBatch => "reduce-scatter on the final micro-batch",
    };
    let tokens = m.data_parallel() * p.batch_per_rank * p.seq_len * p.grad_accum;
    let per = if m.tensor() > 1 {
        format!("per data-parallel rank (its {} tensor ranks share them)", m.tensor())
    } else {
        "per rank".to_string()
    };
    let _ = writeln!(
        o,
        "batch: {} x {} tokens {per}, grad_accum {} ({sync}); {} tokens per step; {}{}",
        p.batch_per_rank,
        p.seq_len,
        p.grad_accum,
        thousands(tokens),
        p.optimizer,
        p.grad_clip.map(|c| format!(", grad_clip {c}")).unwrap_or_default()
    );
    o.push('\n');
    let mem = &plan.memory;
    let peak_at = plan
        .programs
        .first()
        .and_then(|pr| pr.instrs.get(mem.peak_instr as usize))
        .map(|i| describe(plan, i))
        .unwrap_or_default();
    let _ = writeln!(
        o,
        "memory per rank (device): peak {} at #{} ({peak_at}); every rank alike",
        bytes(mem.peak),
        mem.peak_instr
    );
    let _ = writeln!(o, "  {:<36} {:>12} {:>12}", "category", "at peak", "max");
    for c in Category::ALL {
        let _ = writeln!(
            o,
            "  {:<36} {:>12} {:>12}",
            c.name(),
            bytes(mem.at_peak.get(c)),
            bytes(mem.max_by_category.get(c))
        );
    }
    let _ = writeln!(o, "  {:<36} {:>12}", "total", bytes(mem.at_peak.total()));
    prefetch_moves(o, plan);
    let _ = writeln!(
        o,
        "  allocated peak {} ({} in allocator blocks), reserved peak {} (PyTorch's caching allocator)",
        bytes(mem.peak),
        bytes(mem.active_peak),
        bytes(mem.reserved_peak)
    );
    if let Some(a) = &mem.arena {
        let over = if a.peak > 0 {
            format!(", {:+.1}%", (a.bytes as f64 / a.peak as f64 - 1.0) * 100.0)
        } else {
            String::new()
        };
        let _ = writeln!(
            o,
            "  arena {}: the plan's {} device buffers at fixed offsets (their live peak {}{over}, {} reuse wait{}); activations from the allocator",
            bytes(a.bytes),
            a.buffers,
            bytes(a.peak),
            a.waits,
            if a.waits == 1 { "" } else { "s" }
        );
    }
    let ov = &mem.overhead;
    let _ = writeln!(
        o,
        "  device total {} = reserved {} + CUDA context {} + NCCL {} ({} communicator{})",
        bytes(mem.device_total),
        bytes(mem.reserved_peak),
        bytes(ov.cuda_context),
        bytes(ov.nccl),
        ov.communicators,
        if ov.communicators == 1 { "" } else { "s" }
    );
    let hbm = plan.hardware.hbm_bytes();
    let _ = writeln!(
        o,
        "  {}",
        if mem.device_total <= hbm {
            format!(
                "fits {}'s {} ({} spare)",
                plan.hardware.name,
                bytes(hbm),
                bytes(hbm - mem.device_total)
            )
        } else {
            format!(
                "DOES NOT FIT {}'s {}: {} over",
                plan.hardware.name,
                bytes(hbm),
                bytes(mem.device_total - hbm)
            )
        }
    );
    if mem.host.total() > 0 {
        let parts: Vec<String> = Category::ALL
            .iter()
            .filter(|&&c| mem.host.get(c) > 0)
            .map(|&c| format!("{} {}", c.name(), bytes(mem.host.get(c))))
            .collect();
        let _ = writeln!(
            o,
            "memory per rank ({}): {} ({})",
            pool_name(crate::Pool::Host),
            bytes(mem.host.total()),
            parts.join(", ")
        );
    }
    let e = &plan.estimate;
    let _ = writeln!(
        o,
        "communication per rank per step: all-gather {}, reduce-scatter {}, all-reduce {} ({} collectives)",
        bytes(e.all_gather_bytes),
        bytes(e.reduce_scatter_bytes),
        bytes(e.all_reduce_bytes),
        e.collectives
    );
    let _ = writeln!(
        o,
        "predicted step: {} (compute {}, exposed communication {}), MFU {:.1}%, {} tokens/s",
        ms(e.step_s),
        ms(e.compute_s),
        ms(e.exposed_comm_s),
        e.mfu * 100.0,
        thousands(e.tokens_per_s.round() as u64)
    );
    breakdown(o, e);
    if !p.runtime.is_shardplan() {
        let _ = writeln!(
            o,
            "runtime: {} — the figures above predict PyTorch FSDP2 running this plan (its buffers and hooks, eager kernels)",
            p.runtime.name()
        );
        if let Some(x) = &plan.shardplan_executor {
            let _ = writeln!(
                o,
                "  shardplan's executor on the same spec (kernels {}): peak {} allocated / {} reserved per rank, step {}, {} tokens/s",
                x.kernels.name(),
                bytes(x.peak),
                bytes(x.reserved_peak),
                ms(x.step_s),
                thousands(x.tokens_per_s.round() as u64)
            );
        }
    }
}

/// Where the predicted step goes: the compute stream's time by kind of work, then its
/// waits on communication and the step's fixed overhead, each with its share of the step.
/// Kinds that take no time are left out.
pub fn breakdown(o: &mut String, e: &crate::Estimate) {
    let share = |s: f64| if e.step_s > 0.0 { s / e.step_s * 100.0 } else { 0.0 };
    let _ = writeln!(o, "step by kind of work (compute stream, then waits):");
    let rows = crate::WorkKind::ALL
        .iter()
        .map(|&k| (k.name(), e.breakdown.get(k)))
        .chain([
            ("exposed communication", e.exposed_comm_s),
            ("step overhead", e.step_overhead_s),
        ]);
    for (name, s) in rows.filter(|&(_, s)| s > 0.0) {
        let _ = writeln!(o, "  {name:<22} {:>12} {:>6.1}%", duration(s), share(s));
    }
}

/// `s` seconds in the unit that shows it best: s, ms or us, three decimals.
pub fn duration(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.3} us", s * 1e6)
    }
}

/// The groups table.
/// What `prefetch: auto` moved, and what each move saved.
fn prefetch_moves(o: &mut String, plan: &Plan) {
    let moves = &plan.prefetch_moves;
    if moves.is_empty() {
        return;
    }
    let step = |id: crate::StepId| {
        let s = plan.step(id);
        format!("{} {} [{id}]", s.phase.name(), s.label)
    };
    let first = moves[0].peak_before;
    let last = moves[moves.len() - 1].peak_after;
    let _ = writeln!(
        o,
        "  prefetch auto moved {} all-gather{} later, peak {} -> {} (-{}), step time not longer:",
        moves.len(),
        if moves.len() == 1 { "" } else { "s" },
        bytes(first),
        bytes(last),
        bytes(first.saturating_sub(last))
    );
    for m in moves {
        let _ = writeln!(
            o,
            "    {} (read by {}): issued with {} instead of {}, -{}",
            group_name(plan, m.group),
            step(m.need),
            step(m.to),
            step(m.from),
            bytes(m.peak_before.saturating_sub(m.peak_after))
        );
    }
}

pub fn groups_table(o: &mut String, plan: &Plan) {
    let p = &plan.policy.mixed_precision;
    let _ = writeln!(
        o,
        "groups ({}):\n  {:<5} {:<28} {:>14} {:>16} {:>16} {:>10}  after forward",
        plan.groups.len(),
        "group",
        "module",
        "params",
        format!("unsharded {}", p.param),
        format!("shard/rank {}", p.master),
        "padding"
    );
    for grp in &plan.groups {
        let l = &grp.layout;
        let after = match grp.reshard {
            GroupReshard::Free => "free".to_string(),
            GroupReshard::Keep => "keep".to_string(),
            GroupReshard::ToGroupOf(n) => format!("keep 1/{n}"),
        };
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
            bytes(l.shard_bytes(p.master)),
            thousands(l.padding())
        );
    }
}

/// One rank's schedule: a row per instruction in issue order, in its stream's column.
pub fn schedule_table(o: &mut String, plan: &Plan, rank: u64) {
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
