//! Simulation of one rank's program: a multi-stream timeline, the memory it holds, and the
//! step-time estimate.
//!
//! Timing: every stream runs its instructions in order; an instruction starts when its
//! stream is free and, for a wait, when the awaited event has been recorded. Since every
//! wait follows its record in issue order, one pass in issue order computes all times.
//! A compute step that starts while collectives issued before it still run is
//! `overlap_slowdown` slower for as long as they do (collectives issued after it are
//! not counted, which one pass cannot see). Every stream starts `step_overhead_us` into
//! the step (the CPU executor's thread start; 0 on the built-in GPU profiles).
//!
//! Allocations and frees are sequenced in issue order across the streams (an `alloc` waits
//! until every earlier-issued `free` has happened on its stream; the executor enforces the
//! same), so memory over stream time passes through exactly the levels of issue order: a
//! buffer counts from its `alloc` to its `free`; activations rise to a compute step's peak
//! while it runs and fall to its end level after. The price is a possible stall of an
//! allocating stream on a slower stream's free, which the timeline includes. Every rank
//! of a plan holds the same bytes (shards are padded to equal size), so one rank stands for
//! all. Samples carry the simulated time of the instruction for the trace's counter track.

use crate::allocator::replay;
use crate::cache::CachedSteps;
use crate::cost::{compute_copies, instr_seconds};
use crate::mesh::Mesh;
use crate::plan::{
    Breakdown, Buffer, ByCategory, Category, Estimate, Instr, MemoryReport, MemorySample, Overhead, Policy, Pool,
    Program, Stream, Timing, WorkKind,
};
use crate::steps::{ActEvents, Step};
use shardplan_frontends::{AllocatorConfig, HardwareProfile};
use shardplan_ir::DType;

/// A schedule's timeline (with its stalls) and memory, as [`timeline`] and [`memory`] give
/// them: the plan keeps those of the schedule the prefetch placement chose instead of
/// simulating it again.
pub(crate) struct Simulated {
    pub timing: Timing,
    pub stall: Vec<f64>,
    pub memory: MemoryReport,
}

/// What the simulation of one rank's program reads besides the program: its compute
/// steps with their durations and parts, the mesh, the hardware and the policy.
pub(crate) struct Setting<'a> {
    pub steps: &'a [Step],
    pub compute: &'a CachedSteps,
    pub mesh: &'a Mesh,
    pub hw: &'a HardwareProfile,
    pub policy: &'a Policy,
}

impl<'a> Setting<'a> {
    /// The setting of `plan`'s program over `steps` (the plan's, or a candidate's kept
    /// apart in `compute`).
    pub(crate) fn of(plan: &'a crate::plan::Plan, steps: &'a [Step], compute: &'a CachedSteps) -> Self {
        Setting {
            steps,
            compute,
            mesh: &plan.mesh,
            hw: &plan.hardware,
            policy: &plan.policy,
        }
    }
}

/// The simulate pass: the timeline and memory of `program` (those `done` already, where
/// the prefetch placement simulated it), with the process's fixed overheads.
pub(crate) fn simulate(
    program: &Program,
    buffers: &[Buffer],
    events: u32,
    s: &Setting,
    done: Option<Simulated>,
) -> Simulated {
    let mut sim = done.unwrap_or_else(|| {
        let traffic = crate::cost::OptimizerTraffic::of(s.policy);
        let (timing, stall) = timeline(program, buffers, &s.compute.step_s, events, s.mesh, s.hw, traffic);
        let memory = memory(program, buffers, s.steps, &timing);
        Simulated { timing, stall, memory }
    });
    sim.memory.overhead = overhead(program, s.mesh, s.hw);
    sim
}

/// The estimate pass: [`estimate`] of a simulated program, `model_flops` being the
/// forward and backward FLOPs of one micro-batch.
pub(crate) fn estimate_step(
    program: &Program,
    buffers: &[Buffer],
    sim: &Simulated,
    s: &Setting,
    model_flops: f64,
) -> Estimate {
    let policy = s.policy;
    let peak_flops = if matches!(policy.mixed_precision.param, DType::F32 | DType::F64) {
        s.hw.f32_tflops
    } else {
        s.hw.bf16_tflops
    } * 1e12;
    let tokens = (s.mesh.data_parallel() * policy.batch_per_rank * policy.seq_len * policy.grad_accum) as f64;
    let costed = Costed {
        step_parts: &s.compute.step_parts,
        mesh: s.mesh,
        hw: s.hw,
    };
    estimate(
        program,
        buffers,
        &sim.timing,
        &sim.stall,
        &costed,
        model_flops * policy.grad_accum as f64,
        peak_flops,
        tokens,
    )
}

/// Most bytes one rank's buffers and activations may add up to (1 EiB, beyond any device):
/// the memory simulation and the allocator model (which replays up to three steps) add
/// sizes and addresses in u64 and stay far from overflow below it.
pub(crate) const MAX_RANK_BYTES: u64 = 1 << 60;

/// Refuses a plan whose buffers and activations, summed, exceed [`MAX_RANK_BYTES`].
pub(crate) fn rank_bytes_fit(buffers: &[Buffer], acts: &ActEvents) -> Result<(), crate::PlanError> {
    let total = buffers
        .iter()
        .map(|b| b.numel.checked_mul(b.dtype.size_bytes()))
        .chain(acts.events.iter().map(|e| Some(e.bytes)))
        .try_fold(0u64, |sum, x| sum.checked_add(x?));
    match total {
        Some(t) if t <= MAX_RANK_BYTES => Ok(()),
        _ => Err(crate::PlanError::Graph(format!(
            "one rank's buffers and activations add up to more than {MAX_RANK_BYTES} bytes (1 EiB), the most shardplan plans for"
        ))),
    }
}

/// The timeline of `program`, and how long the compute stream waited before each
/// instruction (non-zero only for waits).
pub(crate) fn timeline(
    program: &Program,
    buffers: &[Buffer],
    step_s: &[f64],
    events: u32,
    mesh: &Mesh,
    hw: &HardwareProfile,
    optimizer: crate::cost::OptimizerTraffic,
) -> (Timing, Vec<f64>) {
    let n = program.instrs.len();
    let mut start = Vec::with_capacity(n);
    let mut end = Vec::with_capacity(n);
    let mut stall = Vec::with_capacity(n);
    // What a step costs before its first instruction runs (the executor's threads
    // starting; 0 on the built-in GPU profiles).
    let mut free_at = [hw.step_overhead_us * 1e-6; Stream::ALL.len()];
    let mut recorded = vec![0.0f64; events as usize];
    // Allocations and frees happen in issue order on every stream (the executor sequences
    // them), so memory over time follows issue order exactly.
    let mut last_mem_op = 0.0f64;
    for issued in &program.instrs {
        let s = issued.stream.index();
        let mut t = free_at[s];
        match issued.instr {
            Instr::Wait { event } => t = t.max(recorded.get(event.index()).copied().unwrap_or(0.0)),
            Instr::Alloc { .. } | Instr::Free { .. } => {
                t = t.max(last_mem_op);
                last_mem_op = t;
            }
            _ => {}
        }
        stall.push(t - free_at[s]);
        let mut d = instr_seconds(&issued.instr, issued.stream, buffers, step_s, mesh, hw, optimizer);
        if issued.stream == Stream::Compute && matches!(issued.instr, Instr::Compute { .. }) {
            // Collectives issued before this step that are still running take SMs from it.
            let busy = [Stream::AllGather, Stream::ReduceScatter, Stream::AllReduce]
                .iter()
                .map(|c| free_at[c.index()])
                .fold(t, f64::max);
            d += (busy - t).min(d) * hw.overlap_slowdown;
        }
        if let Instr::Record { event } = issued.instr {
            if let Some(slot) = recorded.get_mut(event.index()) {
                *slot = t;
            }
        }
        start.push(t);
        end.push(t + d);
        free_at[s] = t + d;
    }
    (Timing { start, end }, stall)
}

/// Device and host memory over `program`.
pub(crate) fn memory(program: &Program, buffers: &[Buffer], steps: &[Step], timing: &Timing) -> MemoryReport {
    let mut device = ByCategory::default();
    let mut host = ByCategory::default();
    let mut host_max = ByCategory::default();
    for b in buffers.iter().filter(|b| b.persistent) {
        let level = if b.pool == Pool::Device { &mut device } else { &mut host };
        *level.slot(b.category) += b.bytes();
    }
    host_max = max_each(host_max, host);
    let mut peak = device.total();
    let mut at_peak = device;
    let mut peak_instr = 0u32;
    let mut max_by_category = device;
    let mut timeline = vec![MemorySample {
        t: 0.0,
        instr: 0,
        total: peak,
    }];
    for (i, issued) in program.instrs.iter().enumerate() {
        let t = timing.start[i];
        let changed = match &issued.instr {
            Instr::Alloc { buf } | Instr::Free { buf } => {
                let b = &buffers[buf.index()];
                let level = if b.pool == Pool::Device { &mut device } else { &mut host };
                let slot = level.slot(b.category);
                if matches!(issued.instr, Instr::Alloc { .. }) {
                    *slot = slot.saturating_add(b.bytes());
                } else {
                    *slot = slot.saturating_sub(b.bytes());
                }
                host_max = max_each(host_max, host);
                b.pool == Pool::Device
            }
            Instr::Compute { step, .. } => {
                let s = &steps[step.index()];
                device.activations = s.act_peak;
                observe(
                    &device,
                    i,
                    &mut peak,
                    &mut at_peak,
                    &mut peak_instr,
                    &mut max_by_category,
                );
                timeline.push(MemorySample {
                    t,
                    instr: i as u32,
                    total: device.total(),
                });
                device.activations = s.act_end;
                true
            }
            _ => false,
        };
        if changed {
            observe(
                &device,
                i,
                &mut peak,
                &mut at_peak,
                &mut peak_instr,
                &mut max_by_category,
            );
            let t = if matches!(issued.instr, Instr::Compute { .. }) {
                timing.end[i]
            } else {
                t
            };
            timeline.push(MemorySample {
                t,
                instr: i as u32,
                total: device.total(),
            });
        }
    }
    MemoryReport {
        at_peak,
        peak,
        peak_instr,
        max_by_category,
        host: host_max,
        timeline,
        active_peak: 0,
        reserved_peak: 0,
        overhead: Overhead::default(),
        device_total: 0,
        arena: None,
    }
}

/// Device memory as the GPU sees it: `report` (from [`memory`]) with the caching
/// allocator's peaks for `program` under `allocator`'s settings, the process's fixed
/// overheads on `hw` and their total.
pub(crate) fn device_memory(
    report: MemoryReport,
    program: &Program,
    buffers: &[Buffer],
    acts: &ActEvents,
    mesh: &Mesh,
    hw: &HardwareProfile,
    allocator: AllocatorConfig,
) -> MemoryReport {
    with_replay(report, &replay(program, buffers, acts, allocator), program, mesh, hw)
}

/// [`device_memory`] from a replay `r` of `program` already made.
pub(crate) fn with_replay(
    mut report: MemoryReport,
    r: &crate::allocator::Replay,
    program: &Program,
    mesh: &Mesh,
    hw: &HardwareProfile,
) -> MemoryReport {
    report.active_peak = r.allocated_peak;
    report.reserved_peak = r.reserved;
    report.overhead = overhead(program, mesh, hw);
    report.device_total = r.reserved.saturating_add(report.overhead.total());
    report
}

/// The CUDA context and NCCL's buffers: every communicator of more than one rank holds its
/// channels' buffers (a group of one talks to nobody).
pub(crate) fn overhead(program: &Program, mesh: &Mesh, hw: &HardwareProfile) -> Overhead {
    let mut communicators = program.communicators().iter().filter(|(c, _)| c.size(mesh) > 1).count() as u32;
    // The expert group's all-to-all runs on a communicator of its own (the compute
    // stream's graph ops, not the program's instructions).
    if mesh.expert() > 1 {
        communicators += 1;
    }
    // So does the context group's ring (the compute stream's graph ops too).
    if mesh.context() > 1 {
        communicators += 1;
    }
    Overhead {
        cuda_context: hw.cuda_context_bytes(),
        nccl: hw
            .nccl_bytes_per_communicator()
            .saturating_mul(u64::from(communicators)),
        communicators,
    }
}

fn observe(
    level: &ByCategory,
    i: usize,
    peak: &mut u64,
    at_peak: &mut ByCategory,
    peak_instr: &mut u32,
    max: &mut ByCategory,
) {
    let total = level.total();
    if total > *peak {
        *peak = total;
        *at_peak = *level;
        *peak_instr = i as u32;
    }
    *max = max_each(*max, *level);
}

fn max_each(a: ByCategory, b: ByCategory) -> ByCategory {
    let mut out = a;
    for c in Category::ALL {
        *out.slot(c) = a.get(c).max(b.get(c));
    }
    out
}

/// The timed program's cost figures: the compute steps' parts by kind of work (from
/// [`crate::cost::step_parts`]), the mesh and the profile it was timed on.
pub(crate) struct Costed<'a> {
    pub step_parts: &'a [Breakdown],
    pub mesh: &'a Mesh,
    pub hw: &'a HardwareProfile,
}

/// Step time, exposed communication, MFU, communication volume, and where the compute
/// stream's time goes: each compute step's parts as the cost model timed its ops, the
/// copies it makes (`kernels: fused`), the slowdown from collectives beside it (what the
/// timeline added beyond those), and the copies and optimizer work between steps.
#[allow(clippy::too_many_arguments)]
pub(crate) fn estimate(
    program: &Program,
    buffers: &[Buffer],
    timing: &Timing,
    stall: &[f64],
    costed: &Costed,
    model_flops_per_rank: f64,
    peak_flops: f64,
    tokens_per_step: f64,
) -> Estimate {
    let step_s = timing.end.iter().copied().fold(0.0, f64::max);
    let mut compute_s = 0.0;
    let mut exposed = 0.0;
    let mut breakdown = Breakdown::default();
    let (mut ag, mut rs, mut ar, mut n) = (0u64, 0u64, 0u64, 0u64);
    // Events the all-to-all stream records: the compute stream's waits on them are the
    // expert group's collectives (or, with a context axis, the context ring's), not FSDP's
    // communication.
    let mut expert_event = vec![false; timing.start.len()];
    for issued in &program.instrs {
        if let (Stream::AllToAll, Instr::Record { event }) = (issued.stream, &issued.instr) {
            if let Some(x) = expert_event.get_mut(event.index()) {
                *x = true;
            }
        }
    }
    let group_comm = if costed.mesh.context() > 1 {
        WorkKind::ContextComm
    } else {
        WorkKind::ExpertComm
    };
    for (i, issued) in program.instrs.iter().enumerate() {
        if issued.stream == Stream::Compute {
            let d = timing.end[i] - timing.start[i];
            compute_s += d;
            match issued.instr {
                Instr::Wait { event } if expert_event.get(event.index()).copied().unwrap_or(false) => {
                    breakdown.add(group_comm, stall[i]);
                }
                _ => exposed += stall[i],
            }
            match &issued.instr {
                Instr::Compute {
                    step, reads, writes, ..
                } => {
                    let parts = costed.step_parts.get(step.index()).copied().unwrap_or_default();
                    let copies = compute_copies(reads, writes, buffers, costed.mesh, costed.hw);
                    breakdown.add_all(&parts, 1.0);
                    breakdown.add(WorkKind::FsdpCopies, copies);
                    breakdown.add(WorkKind::Overlap, d - parts.total() - copies);
                }
                Instr::Copy { .. } | Instr::PostForwardSlice { .. } | Instr::PackGrads { .. } => {
                    breakdown.add(WorkKind::FsdpCopies, d)
                }
                Instr::GradNorm { .. } | Instr::OptimizerStep { .. } => breakdown.add(WorkKind::Optimizer, d),
                // Allocs, frees and events take no time; a collective on the compute stream
                // (none today) would count as its overlap-free remainder.
                _ => breakdown.add(WorkKind::Overlap, d),
            }
        }
        match &issued.instr {
            Instr::AllGather { dst, .. } => {
                ag += buffers[dst.index()].bytes();
                n += 1;
            }
            Instr::ReduceScatter { src, .. } => {
                rs += buffers[src.index()].bytes();
                n += 1;
            }
            Instr::AllReduce { buf, .. } => {
                ar += buffers[buf.index()].bytes();
                n += 1;
            }
            _ => {}
        }
    }
    let tail = (step_s
        - timing
            .end
            .iter()
            .zip(&program.instrs)
            .filter(|(_, i)| i.stream == Stream::Compute)
            .map(|(e, _)| *e)
            .fold(0.0, f64::max))
    .max(0.0);
    Estimate {
        step_s,
        compute_s,
        exposed_comm_s: exposed + tail,
        mfu: if step_s > 0.0 {
            model_flops_per_rank / (step_s * peak_flops)
        } else {
            0.0
        },
        model_flops_per_rank,
        tokens_per_s: if step_s > 0.0 { tokens_per_step / step_s } else { 0.0 },
        all_gather_bytes: ag,
        reduce_scatter_bytes: rs,
        all_reduce_bytes: ar,
        collectives: n,
        breakdown,
        step_overhead_s: costed.hw.step_overhead_us * 1e-6,
    }
}
