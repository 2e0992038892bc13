//! The summary block of a plan's text: the mesh and policy it was made with, its memory
//! per rank, and its predicted step, one section after another.

use super::{bytes, describe, duration, group_name, ms, thousands};
use crate::cost::pool_name;
use crate::plan::{Category, ExpertRouting, MemoryReport, Plan, Policy};
use shardplan_frontends::{ActivationCheckpointing, GradSync, Offload};
use std::fmt::Write;

/// The summary block alone.
pub(crate) fn summary(o: &mut String, plan: &Plan) {
    mesh_line(o, plan);
    tensor_parallel_line(o, plan);
    context_parallel_lines(o, plan);
    if let Some(e) = &plan.experts {
        expert_lines(o, plan, e);
    }
    policy_lines(o, plan);
    float8_lines(o, plan);
    batch_line(o, plan);
    o.push('\n');
    memory_table(o, plan);
    prefetch_moves(o, plan);
    allocator_lines(o, &plan.memory);
    device_total_lines(o, plan);
    host_memory_line(o, &plan.memory);
    estimate_lines(o, plan);
    runtime_lines(o, plan);
}

/// The first line: the model, its parameters, the mesh, the nodes and the hardware.
fn mesh_line(o: &mut String, plan: &Plan) {
    let m = &plan.mesh;
    let nodes = m.world().div_ceil(m.gpus_per_node());
    let _ = writeln!(
        o,
        "plan: {} ({} params) on {} ranks: mesh {} replicate x {} shard{}{}, {} node{} of {} GPUs, {}",
        plan.model,
        thousands(plan.params),
        m.world(),
        m.replicate(),
        m.shard() / m.context(),
        if m.context() > 1 {
            format!(" x {} context", m.context())
        } else {
            String::new()
        } + &if m.tensor() > 1 {
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
}

/// How the tensor axis lays out ranks and its options, when there is one.
fn tensor_parallel_line(o: &mut String, plan: &Plan) {
    let m = &plan.mesh;
    if m.tensor() <= 1 {
        return;
    }
    let tp = &plan.policy.tensor_parallel;
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

/// How the context axis deals each sequence and moves keys and values, and the ring's
/// traffic and time per layer (the first block's steps) and per step, when there is one.
fn context_parallel_lines(o: &mut String, plan: &Plan) {
    let m = &plan.mesh;
    if m.context() <= 1 {
        return;
    }
    let c = m.context();
    let cp = &plan.policy.context_parallel;
    let chunks = cp.load_balance.chunks(c);
    let held = match cp.load_balance {
        shardplan_ir::ContextBalance::HeadTail => format!("rank r holds chunks r and {} - r of {chunks}", 2 * c - 1),
        shardplan_ir::ContextBalance::None => format!("rank r holds chunk r of {chunks}"),
    };
    let _ = writeln!(
        o,
        "context parallel: groups of {c} consecutive shard ranks (FSDP shards over shard x context = {}), {} balance ({held}, {} tokens each), rotate {}",
        m.shard(),
        cp.load_balance.name(),
        thousands(plan.policy.seq_len / chunks),
        cp.rotate.name(),
    );
    let first = plan
        .steps
        .iter()
        .find(|s| s.tensor_ops.iter().any(|t| t.op.is_context()))
        .map(|s| s.label.as_str());
    let parts: Vec<String> = ring_rows(plan, first)
        .iter()
        .map(|r| {
            let what = if r.op == crate::steps::StepCollective::CpAllGather {
                "all-gather"
            } else {
                "reduce-scatter (f32)"
            };
            format!(
                "{} {} x {what} {} in {}",
                r.phase.name(),
                r.count,
                bytes(r.bytes / r.count.max(1)),
                ms(r.secs)
            )
        })
        .collect();
    let all = ring_rows(plan, None);
    let _ = writeln!(
        o,
        "  ring per layer ({}): {}; per step {} exchanges, {} per rank, {} on the {} stream",
        first.unwrap_or("-"),
        parts.join(", "),
        all.iter().map(|r| r.count).sum::<u64>(),
        bytes(all.iter().map(|r| r.bytes).sum()),
        ms(all.iter().map(|r| r.secs).sum()),
        all.first().map_or("compute", |r| r.stream.name()),
    );
}

/// The context ring's exchanges of one kind in one phase: how many, their bytes and time.
struct RingRow {
    phase: crate::Phase,
    /// The stream that runs them.
    stream: crate::Stream,
    op: crate::steps::StepCollective,
    count: u64,
    bytes: u64,
    secs: f64,
}

/// The context ring's exchanges of the steps labelled `label` (every step: `None`) by
/// phase and kind, in phase order.
fn ring_rows(plan: &Plan, label: Option<&str>) -> Vec<RingRow> {
    let mut rows: Vec<RingRow> = Vec::new();
    for s in plan.steps.iter().filter(|s| label.is_none_or(|l| s.label == l)) {
        for t in s.tensor_ops.iter().filter(|t| t.op.is_context()) {
            let i = match rows.iter().position(|r| r.phase == s.phase && r.op == t.op) {
                Some(i) => i,
                None => {
                    rows.push(RingRow {
                        phase: s.phase,
                        stream: s.stream,
                        op: t.op,
                        count: 0,
                        bytes: 0,
                        secs: 0.0,
                    });
                    rows.len() - 1
                }
            };
            rows[i].count += 1;
            rows[i].bytes += t.bytes;
            rows[i].secs += t.dur_s;
        }
    }
    rows.sort_by_key(|r| (r.phase as u8, r.op.name()));
    rows
}

/// The experts' placement over the expert and tensor axes, and what bounds their routing.
fn expert_lines(o: &mut String, plan: &Plan, e: &ExpertRouting) {
    let m = &plan.mesh;
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
    routing_line(o, plan, e);
}

/// What sizes the experts' rows: token dropping's per-expert cap, or the routing bound.
fn routing_line(o: &mut String, plan: &Plan, e: &ExpertRouting) {
    match (e.capacity_factor, e.per_expert) {
        (Some(f), Some(c)) => {
            let received = if plan.mesh.expert() > 1 {
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

/// The policy: wrapping, resharding and prefetch, then precision, offload and
/// checkpointing.
fn policy_lines(o: &mut String, plan: &Plan) {
    let (p, reshard) = (&plan.policy, plan.reshard_after_forward());
    let mut wrap = p.wrap.join(", ");
    if !p.wrap_modules.is_empty() {
        wrap.push_str(&format!(" + modules {}", p.wrap_modules.join(", ")));
    }
    if let Some(b) = p.bucket_mib {
        wrap.push_str(&format!(", buckets up to {b} MiB"));
    }
    let prefetch = prefetch_words(p);
    let _ = writeln!(
        o,
        "policy: wrap [{wrap}], reshard_after_forward {reshard} (root keeps), {prefetch}"
    );
    let ac = match p.activation_checkpointing {
        ActivationCheckpointing::None => "none".to_string(),
        ActivationCheckpointing::Full => "full".to_string(),
        ActivationCheckpointing::Every(n) => format!("every {n} blocks"),
        s @ ActivationCheckpointing::Selective(_) => s.to_string(),
    };
    let _ = writeln!(
        o,
        "        params {} / reduce {} / master {}, offload {}, activation checkpointing {ac}",
        p.mixed_precision.param,
        p.mixed_precision.reduce,
        p.mixed_precision.master(),
        if p.offload == Offload::Cpu { "cpu" } else { "none" },
    );
}

/// The Float8 linears, when there are any: the recipe and its FSDP options, how many of the
/// linears it makes Float8, and those it leaves in high precision by reason (the first
/// three names of each).
fn float8_lines(o: &mut String, plan: &Plan) {
    let Some(f) = &plan.float8 else { return };
    let mut options = Vec::new();
    if f.fsdp_float8_all_gather {
        options.push("float8 all-gather");
    }
    if f.precompute_scale {
        options.push("precomputed scales");
    }
    let options = if options.is_empty() {
        String::new()
    } else {
        format!(" ({})", options.join(", "))
    };
    let total = f.linears.len() + f.high_precision.len();
    let _ = writeln!(
        o,
        "float8: {}{options}, {} of {total} linears",
        f.recipe.name(),
        f.linears.len()
    );
    let mut reasons: Vec<(&str, Vec<&str>)> = Vec::new();
    for (module, reason) in &f.high_precision {
        match reasons.iter_mut().find(|(r, _)| r == reason) {
            Some((_, ms)) => ms.push(module),
            None => reasons.push((reason, vec![module])),
        }
    }
    for (reason, modules) in reasons {
        let more = match modules.len() {
            n if n > 3 => format!(" and {} more", n - 3),
            _ => String::new(),
        };
        let names: Vec<&str> = modules.iter().take(3).copied().collect();
        let _ = writeln!(o, "        high precision: {}{more}: {reason}", names.join(", "));
    }
}

/// The prefetch policy in words: its depths, and the explicit lists of each pass.
fn prefetch_words(p: &Policy) -> String {
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
    prefetch
}

/// The batch: per rank, accumulation and gradient sync, tokens per step, the optimizer.
fn batch_line(o: &mut String, plan: &Plan) {
    let m = &plan.mesh;
    let p = &plan.policy;
    let sync = match p.grad_sync {
        GradSync::EveryMicroBatch => "reduce-scatter every micro-batch",
        GradSync::FinalMicroBatch => "reduce-scatter on the final micro-batch",
    };
    let tokens = m.data_parallel() * p.batch_per_rank * p.seq_len * p.grad_accum;
    let per = match (m.tensor() > 1, m.context() > 1) {
        (true, false) => format!("per data-parallel rank (its {} tensor ranks share them)", m.tensor()),
        (_, true) => format!(
            "per data-parallel rank (each of its {} context ranks holds {} tokens of each{})",
            m.context(),
            p.seq_len / m.context(),
            if m.tensor() > 1 {
                format!(", shared by {} tensor ranks", m.tensor())
            } else {
                String::new()
            }
        ),
        (false, false) => "per rank".to_string(),
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
}

/// The device peak and where it falls, then each category at the peak and at its most.
fn memory_table(o: &mut String, plan: &Plan) {
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
}

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

/// The allocated and reserved peaks, and the arena's layout of the plan's buffers.
fn allocator_lines(o: &mut String, mem: &MemoryReport) {
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
}

/// The device total and its parts, and whether it fits the hardware's memory.
fn device_total_lines(o: &mut String, plan: &Plan) {
    let mem = &plan.memory;
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
}

/// Host memory per rank by category, when the plan holds any there.
fn host_memory_line(o: &mut String, mem: &MemoryReport) {
    if mem.host.total() == 0 {
        return;
    }
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

/// Communication per step, the predicted step and MFU, and where the step goes.
fn estimate_lines(o: &mut String, plan: &Plan) {
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
}

/// Where the predicted step goes: the compute stream's time by kind of work, then its
/// waits on communication and the step's fixed overhead, each with its share of the step.
/// Kinds that take no time are left out.
pub(crate) fn breakdown(o: &mut String, e: &crate::Estimate) {
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

/// Under another runtime than shardplan's: whose run the figures predict, and shardplan's
/// executor's figures on the same spec beside them.
fn runtime_lines(o: &mut String, plan: &Plan) {
    let p = &plan.policy;
    if p.runtime.is_shardplan() {
        return;
    }
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
