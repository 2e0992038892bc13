//! The verifier: proves the invariants of a Plan, or names the instruction that breaks one.
//!
//! Happens-before is computed with vector clocks over the streams: an instruction follows
//! everything earlier on its stream and, through a wait, everything up to the awaited
//! record. On that order, for every rank's program:
//! - events: every event is recorded once, and every wait names an event recorded earlier in
//!   issue order (a wait issued before its record does not wait; a cycle cannot form);
//! - buffers: a non-persistent buffer is allocated once and freed once; every access happens
//!   after its allocation and before its free (no use after free);
//! - data: every read follows some write (no use before gather); two accesses of which one
//!   writes are ordered (no race); every write is read before the buffer dies (gradients
//!   are reduce-scattered after their last contribution, and the optimizer reads them after
//!   the reduction);
//! - collectives: every rank of a process group issues that group's collectives in the same
//!   order with the same sizes (a mismatch hangs NCCL);
//! - memory: the device memory the plan needs (the allocator's reserved peak, the CUDA
//!   context and NCCL's buffers) fits the budget, when one is given.

use crate::plan::{Access, BufId, Comm, EventId, Instr, Plan, Program, Stream};
use crate::print::describe;
use shardplan_ir::IdVec;
use std::fmt;

/// A broken invariant, naming the instruction.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyError {
    pub rule: &'static str,
    pub program: usize,
    /// Issue index of the offending instruction.
    pub instr: Option<usize>,
    pub message: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.instr {
            Some(i) => write!(
                f,
                "{}: program {} instruction #{}: {}",
                self.rule, self.program, i, self.message
            ),
            None => write!(f, "{}: {}", self.rule, self.message),
        }
    }
}

impl std::error::Error for VerifyError {}

const STREAMS: usize = Stream::ALL.len();

/// Checks every invariant of `plan`; `budget` is a per-rank device memory limit in bytes.
pub fn verify(plan: &Plan, budget: Option<u64>) -> Result<(), VerifyError> {
    let world = verify_mesh(plan)?;
    verify_rank_cover(plan, world)?;
    verify_event_count(plan)?;
    verify_collective_order(plan)?;
    for (p, program) in plan.programs.iter().enumerate() {
        verify_program(plan, p, program)?;
    }
    if let Some(b) = budget {
        verify_budget(plan, b)?;
    }
    Ok(())
}

/// A broken invariant of the plan as a whole (no instruction to name).
fn plan_error(rule: &'static str, message: String) -> VerifyError {
    VerifyError {
        rule,
        program: 0,
        instr: None,
        message,
    }
}

/// The mesh and the layouts agree (a Plan read from a file may say anything): the axes are
/// positive and their product is the world, which is returned; the expert axis divides the
/// shard axis; every group is laid out over the ranks the mesh shards it over.
fn verify_mesh(plan: &Plan) -> Result<u64, VerifyError> {
    let m = &plan.mesh;
    let world = match m
        .replicate()
        .checked_mul(m.shard())
        .and_then(|w| w.checked_mul(m.tensor()))
    {
        Some(w) if m.replicate() > 0 && m.shard() > 0 && m.tensor() > 0 && m.gpus_per_node() > 0 => w,
        _ => {
            return Err(plan_error(
                "mesh",
                format!(
                    "mesh replicate {} x shard {} x tensor {} on nodes of {} is not a valid mesh",
                    m.replicate(),
                    m.shard(),
                    m.tensor(),
                    m.gpus_per_node()
                ),
            ))
        }
    };
    if m.expert() == 0 || !m.shard().is_multiple_of(m.expert()) {
        return Err(plan_error(
            "mesh",
            format!(
                "an expert axis of {} ranks does not divide the shard axis of {}",
                m.expert(),
                m.shard()
            ),
        ));
    }
    if let Some(g) = plan.groups.iter().find(|g| g.layout.shard != m.shard_of(&g.group)) {
        return Err(plan_error(
            "mesh",
            format!(
                "group {} is laid out over {} ranks, the mesh shards it over {}",
                g.group.id,
                g.layout.shard,
                m.shard_of(&g.group)
            ),
        ));
    }
    Ok(world)
}

/// Ranks: the spans cover `0..world` once, each naming a program.
fn verify_rank_cover(plan: &Plan, world: u64) -> Result<(), VerifyError> {
    let mut next = 0u64;
    for s in &plan.ranks {
        if s.first != next || s.count == 0 || s.program as usize >= plan.programs.len() {
            return Err(plan_error(
                "ranks",
                format!(
                    "rank span {}..{} -> program {} does not continue the cover at rank {next}",
                    s.first,
                    s.first.saturating_add(s.count),
                    s.program
                ),
            ));
        }
        next = s.first.saturating_add(s.count);
    }
    if next != world {
        return Err(plan_error(
            "ranks",
            format!("rank spans cover {next} ranks, the mesh has {world}"),
        ));
    }
    Ok(())
}

/// Every event is recorded once: more events than instructions cannot all be recorded
/// (and a count read from a file must not size the clocks' tables unchecked).
fn verify_event_count(plan: &Plan) -> Result<(), VerifyError> {
    let instrs: usize = plan.programs.iter().map(|p| p.instrs.len()).sum();
    if plan.events as usize > instrs {
        return Err(plan_error(
            "events",
            format!(
                "the plan declares {} events, more than its {instrs} instructions can record",
                plan.events
            ),
        ));
    }
    Ok(())
}

/// Memory: the device total (reserved peak, CUDA context, NCCL) is within `budget` bytes.
fn verify_budget(plan: &Plan, budget: u64) -> Result<(), VerifyError> {
    let need = plan.memory.device_total;
    if need <= budget {
        return Ok(());
    }
    Err(VerifyError {
        rule: "budget",
        program: 0,
        instr: Some(plan.memory.peak_instr as usize),
        message: format!(
            "device memory {} per rank (reserved {} + CUDA context and NCCL {}) exceeds the budget {} by {}",
            crate::print::bytes(need),
            crate::print::bytes(plan.memory.reserved_peak),
            crate::print::bytes(plan.memory.overhead.total()),
            crate::print::bytes(budget),
            crate::print::bytes(need - budget)
        ),
    })
}

/// The happens-before order of one program's instructions (by issue index).
pub(crate) struct HappensBefore {
    clock: Vec<[u32; STREAMS]>,
    pos: Vec<u32>,
    stream: Vec<usize>,
}

impl HappensBefore {
    /// Whether instruction `a` happens before instruction `b`.
    pub(crate) fn before(&self, a: usize, b: usize) -> bool {
        a != b && self.clock[b][self.stream[a]] > self.pos[a]
    }
}

/// Program `p`'s happens-before order; the verifier's event errors if its events are broken.
/// `extra` adds orderings the program's events do not make: `(a, b)` makes instruction `a`
/// happen before instruction `b` (`a` issued first), as a record after `a` and a wait before
/// `b` would.
pub(crate) fn happens_before(
    plan: &Plan,
    p: usize,
    program: &Program,
    extra: &[(usize, usize)],
) -> Result<HappensBefore, VerifyError> {
    let (clock, pos) = clocks_with(plan, p, program, extra)?;
    Ok(HappensBefore {
        clock,
        pos,
        stream: program.instrs.iter().map(|x| x.stream.index()).collect(),
    })
}

/// Vector clocks: `clock[i][s]` = how many instructions of stream `s` happen before or at `i`,
/// with the orderings `extra` (see [`happens_before`]) added.
fn clocks_with(
    plan: &Plan,
    p: usize,
    program: &Program,
    extra: &[(usize, usize)],
) -> Result<(Vec<[u32; STREAMS]>, Vec<u32>), VerifyError> {
    let n = program.instrs.len();
    let mut into: Vec<Vec<usize>> = vec![Vec::new(); if extra.is_empty() { 0 } else { n }];
    for &(a, b) in extra {
        if a >= b || b >= n {
            return Err(VerifyError {
                rule: "events",
                program: p,
                instr: Some(b.min(n.saturating_sub(1))),
                message: format!("an ordering from instruction #{a} to #{b} does not go forward in issue order"),
            });
        }
        into[b].push(a);
    }
    let mut clock = Vec::with_capacity(n);
    let mut pos = Vec::with_capacity(n);
    let mut stream_clock = [[0u32; STREAMS]; STREAMS];
    let mut recorded: IdVec<EventId, Option<[u32; STREAMS]>> = IdVec::from_elem(None, plan.events as usize);
    for (i, issued) in program.instrs.iter().enumerate() {
        let s = issued.stream.index();
        let mut c = stream_clock[s];
        c[s] += 1;
        if let Some(from) = into.get(i) {
            for &a in from {
                let r: &[u32; STREAMS] = &clock[a];
                for k in 0..STREAMS {
                    c[k] = c[k].max(r[k]);
                }
            }
        }
        match issued.instr {
            Instr::Wait { event } => match recorded.get(event) {
                Some(Some(r)) => {
                    for k in 0..STREAMS {
                        c[k] = c[k].max(r[k]);
                    }
                }
                Some(None) => {
                    return Err(VerifyError {
                        rule: "events",
                        program: p,
                        instr: Some(i),
                        message: format!(
                            "`{}` waits on {event}, which is not recorded before it in issue order: the wait would not order anything",
                            describe(plan, issued)
                        ),
                    })
                }
                None => {
                    return Err(VerifyError {
                        rule: "events",
                        program: p,
                        instr: Some(i),
                        message: format!("`{}` names {event}, but the plan has {} events", describe(plan, issued), plan.events),
                    })
                }
            },
            Instr::Record { event } => match recorded.get_mut(event) {
                Some(slot @ None) => *slot = Some(c),
                Some(Some(_)) => {
                    return Err(VerifyError {
                        rule: "events",
                        program: p,
                        instr: Some(i),
                        message: format!("{event} is recorded twice"),
                    })
                }
                None => {
                    return Err(VerifyError {
                        rule: "events",
                        program: p,
                        instr: Some(i),
                        message: format!("`{}` names {event}, but the plan has {} events", describe(plan, issued), plan.events),
                    })
                }
            },
            _ => {}
        }
        stream_clock[s] = c;
        pos.push(c[s] - 1);
        clock.push(c);
    }
    Ok((clock, pos))
}

/// Checks the rules of one program (`p`): references, events, activation streams,
/// buffers' lifetimes and the order of their accesses.
fn verify_program(plan: &Plan, p: usize, program: &Program) -> Result<(), VerifyError> {
    verify_references(plan, p, program)?;
    let check = ProgramCheck {
        plan,
        p,
        program,
        hb: happens_before(plan, p, program, &[])?,
    };
    check.verify_activation_streams()?;
    let uses = check.buffer_uses()?;
    // `plan.buffers` is a plain `Vec` (the Plan's JSON); slot `i` is buffer `b{i}`.
    for (bi, buf) in plan.buffers.iter().enumerate() {
        check.verify_lifetime(buf, &uses, BufId::new(bi))?;
    }
    for (bi, buf) in plan.buffers.iter().enumerate() {
        check.verify_accesses(buf, &uses.accesses[BufId::new(bi)])?;
    }
    Ok(())
}

/// A broken invariant at instruction `i` of program `p`.
fn instr_error(p: usize, i: usize, rule: &'static str, message: String) -> VerifyError {
    VerifyError {
        rule,
        program: p,
        instr: Some(i),
        message,
    }
}

/// References: every buffer and step an instruction of program `p` names is in the plan.
fn verify_references(plan: &Plan, p: usize, program: &Program) -> Result<(), VerifyError> {
    let n_buf = plan.buffers.len();
    for (i, issued) in program.instrs.iter().enumerate() {
        let bufs: Vec<BufId> = match &issued.instr {
            Instr::Alloc { buf } | Instr::Free { buf } => vec![*buf],
            other => other.accesses().into_iter().map(|(b, _)| b).collect(),
        };
        if let Some(b) = bufs.iter().find(|b| b.index() >= n_buf) {
            return Err(instr_error(
                p,
                i,
                "references",
                format!("names {b}, but the plan has {n_buf} buffers"),
            ));
        }
        if let Instr::Compute { step, .. } = issued.instr {
            if step.index() >= plan.steps.len() {
                return Err(instr_error(
                    p,
                    i,
                    "references",
                    format!("names {step}, but the plan has {} steps", plan.steps.len()),
                ));
            }
        }
    }
    Ok(())
}

/// One program under check, its references in range and its events sound: the plan it
/// belongs to, its index, and the happens-before order of its instructions.
struct ProgramCheck<'a> {
    plan: &'a Plan,
    p: usize,
    program: &'a Program,
    hb: HappensBefore,
}

/// Where a program allocates, frees and accesses each buffer (issue indices).
struct BufferUses {
    alloc: IdVec<BufId, Option<usize>>,
    free: IdVec<BufId, Option<usize>>,
    accesses: IdVec<BufId, Vec<(usize, Access)>>,
}

impl ProgramCheck<'_> {
    /// Whether instruction `a` happens before instruction `b`.
    fn hb(&self, a: usize, b: usize) -> bool {
        self.hb.before(a, b)
    }

    /// A broken invariant at instruction `i`.
    fn fail(&self, i: usize, rule: &'static str, message: String) -> VerifyError {
        instr_error(self.p, i, rule, message)
    }

    /// Instruction `i` in words.
    fn describe(&self, i: usize) -> String {
        describe(self.plan, &self.program.instrs[i])
    }

    /// Buffers: gathers where each buffer is allocated, freed and accessed; a persistent
    /// buffer is never allocated or freed, any other at most once each.
    fn buffer_uses(&self) -> Result<BufferUses, VerifyError> {
        let plan = self.plan;
        let n_buf = plan.buffers.len();
        let mut uses = BufferUses {
            alloc: IdVec::from_elem(None, n_buf),
            free: IdVec::from_elem(None, n_buf),
            accesses: IdVec::from_elem(Vec::new(), n_buf),
        };
        for (i, issued) in self.program.instrs.iter().enumerate() {
            match issued.instr {
                Instr::Alloc { buf } | Instr::Free { buf } => {
                    let b = &plan.buffers[buf.index()];
                    let is_alloc = matches!(issued.instr, Instr::Alloc { .. });
                    if b.persistent {
                        return Err(self.fail(
                            i,
                            "buffers",
                            format!(
                                "`{}`: {} is persistent and must not be allocated or freed",
                                describe(plan, issued),
                                b.name
                            ),
                        ));
                    }
                    let slot = if is_alloc { &mut uses.alloc } else { &mut uses.free };
                    if slot[buf].is_some() {
                        return Err(self.fail(
                            i,
                            "buffers",
                            format!(
                                "`{}`: {buf} ({}) is {} twice",
                                describe(plan, issued),
                                b.name,
                                if is_alloc { "allocated" } else { "freed" }
                            ),
                        ));
                    }
                    slot[buf] = Some(i);
                }
                ref other => {
                    for (b, a) in other.accesses() {
                        uses.accesses[b].push((i, a));
                    }
                }
            }
        }
        Ok(uses)
    }

    /// Buffers: a non-persistent buffer this program uses is allocated and freed, and every
    /// access happens after its allocation and before its free (no use after free).
    fn verify_lifetime(&self, buf: &crate::Buffer, uses: &BufferUses, bi: BufId) -> Result<(), VerifyError> {
        let acc = &uses.accesses[bi];
        if buf.persistent {
            return Ok(());
        }
        if acc.is_empty() && uses.alloc[bi].is_none() {
            return Ok(()); // another program's buffer
        }
        let (Some(a), Some(f)) = (uses.alloc[bi], uses.free[bi]) else {
            let at = uses.alloc[bi]
                .or(uses.free[bi])
                .or(acc.first().map(|x| x.0))
                .unwrap_or(0);
            return Err(self.fail(
                at,
                "buffers",
                format!(
                    "{} ({}) is {}",
                    buf.id,
                    buf.name,
                    if uses.alloc[bi].is_none() {
                        "used without being allocated"
                    } else {
                        "never freed"
                    }
                ),
            ));
        };
        for &(i, _) in acc {
            if !self.hb(a, i) {
                return Err(self.fail(
                    i,
                    "use before alloc",
                    format!(
                        "`{}` uses {} ({}) before it is allocated",
                        self.describe(i),
                        buf.id,
                        buf.name
                    ),
                ));
            }
            if !self.hb(i, f) {
                return Err(self.fail(
                    i,
                    "use after free",
                    format!(
                        "`{}` uses {} ({}) but is not ordered before its free (#{f} `{}`)",
                        self.describe(i),
                        buf.id,
                        buf.name,
                        self.describe(f)
                    ),
                ));
            }
        }
        if !self.hb(a, f) {
            return Err(self.fail(
                f,
                "buffers",
                format!(
                    "`{}` is not ordered after the allocation of {}",
                    self.describe(f),
                    buf.name
                ),
            ));
        }
        Ok(())
    }

    /// Data: of a buffer's accesses `acc`, two of which one writes are ordered (no race);
    /// unless it is persistent, every read follows some write (no use before gather) and
    /// every write is read afterwards (no lost write).
    fn verify_accesses(&self, buf: &crate::Buffer, acc: &[(usize, Access)]) -> Result<(), VerifyError> {
        for (x, &(i, ai)) in acc.iter().enumerate() {
            for &(j, aj) in &acc[x + 1..] {
                if i == j {
                    continue;
                }
                let writes = ai == Access::Write || aj == Access::Write;
                if writes && !self.hb(i, j) && !self.hb(j, i) {
                    return Err(self.fail(
                        j,
                        "race",
                        format!(
                            "`{}` and #{i} `{}` both touch {} ({}), one writes, and no event orders them",
                            self.describe(j),
                            self.describe(i),
                            buf.id,
                            buf.name
                        ),
                    ));
                }
            }
            if ai == Access::Read && !buf.persistent && !acc.iter().any(|&(w, aw)| aw == Access::Write && self.hb(w, i))
            {
                let what = if matches!(self.program.instrs[i].instr, Instr::Compute { .. }) {
                    "no all-gather writes it before this read"
                } else {
                    "nothing writes it before this read"
                };
                return Err(self.fail(
                    i,
                    "use before write",
                    format!("`{}` reads {} ({}): {what}", self.describe(i), buf.id, buf.name),
                ));
            }
            if ai == Access::Write && !buf.persistent && !acc.iter().any(|&(r, ar)| ar == Access::Read && self.hb(i, r))
            {
                return Err(self.fail(
                    i,
                    "lost write",
                    format!(
                        "`{}` writes {} ({}) but nothing reads it afterwards (a contribution after the last reduction?)",
                        self.describe(i),
                        buf.id,
                        buf.name
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Activations: every step runs on the stream it names; a step off the compute stream (an
    /// expert-group collective on the all-to-all stream) happens after the compute stream's
    /// step before it, and before the compute step that names it in `waits_for` (the first to
    /// touch its values) and the compute stream's end. Activations have no buffers of their
    /// own: the compute steps make, read and free them in the execution order, and the steps
    /// between an all-to-all and its join touch none of its values (the planner's walk), so
    /// this order is what makes running them at once safe.
    fn verify_activation_streams(&self) -> Result<(), VerifyError> {
        let (plan, program) = (self.plan, self.program);
        let mut before: Option<usize> = None;
        // All-to-all steps issued and not yet joined: (issue index, step, micro).
        let mut pending: Vec<(usize, crate::StepId, u32)> = Vec::new();
        let mut all: Vec<usize> = Vec::new();
        for (i, issued) in program.instrs.iter().enumerate() {
            let Instr::Compute { step, micro, .. } = issued.instr else {
                continue;
            };
            let Some(s) = plan.steps.get(step.index()) else {
                continue;
            };
            if issued.stream != s.stream {
                return Err(self.fail(
                    i,
                    "streams",
                    format!(
                        "`{}` runs on the {} stream, but {step} belongs on the {} stream",
                        describe(plan, issued),
                        issued.stream.name(),
                        s.stream.name()
                    ),
                ));
            }
            if issued.stream != Stream::Compute {
                if let Some(b) = before.filter(|&b| !self.hb(b, i)) {
                    return Err(self.fail(
                        i,
                        "activation order",
                        format!(
                            "`{}` may start before #{b} `{}`, the compute step before it, has made its input",
                            describe(plan, issued),
                            describe(plan, &program.instrs[b])
                        ),
                    ));
                }
                pending.push((i, step, micro));
                all.push(i);
                continue;
            }
            for x in &s.waits_for {
                let Some(k) = pending.iter().position(|&(_, st, m)| st == *x && m == micro) else {
                    return Err(self.fail(
                        i,
                        "activation order",
                        format!(
                            "`{}` waits for {x}, which is not an all-to-all step issued before it in its micro-batch",
                            describe(plan, issued)
                        ),
                    ));
                };
                let (a, _, _) = pending.swap_remove(k);
                if !self.hb(a, i) {
                    return Err(self.fail(
                        i,
                        "activation order",
                        format!(
                            "`{}` touches the values of #{a} `{}` but may start before it has finished",
                            describe(plan, issued),
                            describe(plan, &program.instrs[a])
                        ),
                    ));
                }
            }
            before = Some(i);
        }
        // The compute stream's last instruction ends the step after every all-to-all.
        if let Some(last) = program.instrs.iter().rposition(|x| x.stream == Stream::Compute) {
            if let Some(&a) = all.iter().find(|&&a| !self.hb(a, last)) {
                return Err(self.fail(
                    a,
                    "activation order",
                    format!(
                        "`{}` is not waited for by the compute stream before the step ends",
                        describe(plan, &program.instrs[a])
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// One collective as the other ranks of its group must see it.
fn collectives(plan: &Plan, program: &Program, comm: Comm) -> Vec<(&'static str, Option<u32>, u64, usize)> {
    program
        .instrs
        .iter()
        .enumerate()
        .filter_map(|(i, issued)| {
            let (c, kind, group) = issued.instr.collective()?;
            if c != comm {
                return None;
            }
            let bytes = issued
                .instr
                .accesses()
                .iter()
                .find(|(_, a)| *a == Access::Write)
                .map_or(0, |(b, _)| plan.buffers[b.index()].bytes());
            Some((kind, group.map(|g| g.0), bytes, i))
        })
        .collect()
}

/// A compute step that runs tensor-parallel collectives: the step, each collective's op
/// and bytes, and the instruction.
type TensorStep = (u32, Vec<(crate::steps::StepCollective, u64)>, usize);

/// The tensor-parallel collectives a program's compute steps run, in issue order.
fn tensor_ops(plan: &Plan, program: &Program) -> Vec<TensorStep> {
    program
        .instrs
        .iter()
        .enumerate()
        .filter_map(|(i, issued)| match &issued.instr {
            Instr::Compute { step, .. } => {
                let s = plan.steps.get(step.index())?;
                (!s.tensor_ops.is_empty()).then(|| (step.0, s.tensor_ops.iter().map(|t| (t.op, t.bytes)).collect(), i))
            }
            _ => None,
        })
        .collect()
}

fn verify_collective_order(plan: &Plan) -> Result<(), VerifyError> {
    if plan.programs.len() < 2 {
        return Ok(()); // every rank runs the same program: orders agree by construction
    }
    // A tensor or expert group's activation collectives run inside compute steps: every
    // member must run the same ones in the same order.
    let seqs: Vec<_> = plan.programs.iter().map(|p| tensor_ops(plan, p)).collect();
    let program_of = |rank: u64| -> usize {
        plan.ranks
            .iter()
            .find(|s| rank >= s.first && rank - s.first < s.count)
            .map_or(0, |s| s.program as usize)
    };
    for (axis, size) in [
        ("tensor", plan.mesh.tensor()),
        ("expert", plan.mesh.expert()),
        ("context", plan.mesh.context()),
    ] {
        if size <= 1 {
            continue;
        }
        for rank in 0..plan.mesh.world() {
            let first = match axis {
                "tensor" => plan.mesh.tensor_group(rank)[0],
                "expert" => plan.mesh.expert_group(rank)[0],
                _ => plan.mesh.context_group(rank)[0],
            };
            let (a, b) = (program_of(first), program_of(rank));
            let (sa, sb) = (&seqs[a], &seqs[b]);
            let n = sa.len().max(sb.len());
            if let Some(k) = (0..n).find(|&k| sa.get(k).map(|x| (x.0, &x.1)) != sb.get(k).map(|x| (x.0, &x.1))) {
                return Err(VerifyError {
                    rule: "collective order",
                    program: b,
                    instr: sb.get(k).map(|x| x.2),
                    message: format!(
                        "on the {axis} group of rank {rank}, the compute steps' {axis} collectives differ from rank {first}'s at the {}-th step that runs any: NCCL would hang",
                        k + 1
                    ),
                });
            }
        }
    }
    let mut comms: Vec<Comm> = vec![Comm::Shard, Comm::Replicate];
    if plan.mesh.tensor() > 1 {
        comms.push(Comm::Tensor);
    }
    if plan.mesh.expert() > 1 {
        comms.push(Comm::ExpertShard);
    }
    for program in &plan.programs {
        for issued in &program.instrs {
            if let Some((c @ Comm::Reshard(_), _, _)) = issued.instr.collective() {
                if !comms.contains(&c) {
                    comms.push(c);
                }
            }
        }
    }
    for comm in comms {
        let seqs: Vec<_> = plan.programs.iter().map(|p| collectives(plan, p, comm)).collect();
        for rank in 0..plan.mesh.world() {
            let members = comm.members(&plan.mesh, rank);
            let (a, b) = (program_of(members[0]), program_of(rank));
            if a == b {
                continue;
            }
            let (sa, sb) = (&seqs[a], &seqs[b]);
            for k in 0..sa.len().max(sb.len()) {
                let (x, y) = (sa.get(k), sb.get(k));
                let same = matches!((x, y), (Some(x), Some(y)) if (x.0, x.1, x.2) == (y.0, y.1, y.2));
                if !same {
                    let show = |s: Option<&(&str, Option<u32>, u64, usize)>, p: usize| match s {
                        Some(&(_, _, _, i)) => format!("#{i} `{}`", describe(plan, &plan.programs[p].instrs[i])),
                        None => "nothing".into(),
                    };
                    return Err(VerifyError {
                        rule: "collective order",
                        program: b,
                        instr: y.map(|y| y.3),
                        message: format!(
                            "on the {comm} group of rank {rank}, collective {k} is {} on rank {rank} but {} on rank {} (program {a}): NCCL would hang",
                            show(y, b),
                            show(x, a),
                            members[0]
                        ),
                    });
                }
            }
        }
    }
    Ok(())
}
