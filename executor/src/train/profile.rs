//! `shardplan train --profile`: where each rank's step goes. Every instruction's time on its
//! stream is totalled by instruction kind, the compute stream's time by IR op, over the
//! steps after the first (warm-up); `Profile` is the JSON file that carries the totals, and
//! `read` takes one back as untrusted input (`plan --compare`).
//!
//! The times come from the rank runtime: `RankStepOut::times` (each instruction's start
//! and end) and `RankStepOut::node_seconds` (each node of a compute step, when
//! `Shared::profile` is on). On the CPU both are host timers; a GPU run fills the same
//! two fields from CUDA events (`Shared::device_clock`, `crate::clock`), and nothing here
//! depends on where they come from (the file's `clock` says which).

use crate::runtime::rank::{RankStepOut, Shared};
use crate::ExecError;
use serde::{Deserialize, Deserializer, Serialize};
use shardplan_frontends::{Pos, SpecError};
use shardplan_ir::{Graph, NodeId};
use shardplan_planner::{Instr, Issued, Plan, Program, Stream};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// The `format` field of every profile file.
pub const FORMAT: &str = "shardplan-profile";
/// The profile file's format version.
pub const VERSION: u32 = 1;
/// What measured the times: host timers around each instruction and node (the CPU, or a
/// GPU run with `--profile-clock host`).
pub const CLOCK: &str = "host timers";
/// What measured a GPU run's times: CUDA events on the stream each instruction's work was
/// issued to (`crate::clock`).
pub const DEVICE_CLOCK: &str = "CUDA events";

/// What an instruction does, the unit of the profile's `by_instruction` totals.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Compute,
    Pack,
    AllGather,
    ReduceScatter,
    AllReduce,
    GradNorm,
    Optimizer,
    Copy,
    AllocFree,
    Wait,
    Record,
    /// An expert-group collective, a step of its own on the all-to-all stream.
    AllToAll,
}

impl Kind {
    /// Every kind, in the order tables print them.
    pub const ALL: [Kind; 12] = [
        Kind::Compute,
        Kind::Pack,
        Kind::AllGather,
        Kind::ReduceScatter,
        Kind::AllReduce,
        Kind::GradNorm,
        Kind::Optimizer,
        Kind::Copy,
        Kind::AllocFree,
        Kind::Wait,
        Kind::Record,
        Kind::AllToAll,
    ];

    /// The kind of an issued instruction.
    pub fn of(issued: &Issued) -> Kind {
        match &issued.instr {
            Instr::Compute { .. } if issued.stream == Stream::AllToAll => Kind::AllToAll,
            Instr::Compute { .. } => Kind::Compute,
            Instr::PackGrads { .. } => Kind::Pack,
            Instr::AllGather { .. } => Kind::AllGather,
            Instr::ReduceScatter { .. } => Kind::ReduceScatter,
            Instr::AllReduce { .. } => Kind::AllReduce,
            Instr::GradNorm { .. } => Kind::GradNorm,
            Instr::OptimizerStep { .. } => Kind::Optimizer,
            Instr::Copy { .. } | Instr::PostForwardSlice { .. } => Kind::Copy,
            Instr::Alloc { .. } | Instr::Free { .. } => Kind::AllocFree,
            Instr::Wait { .. } => Kind::Wait,
            Instr::Record { .. } => Kind::Record,
        }
    }

    /// Its name in files and tables.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Compute => "compute",
            Kind::Pack => "pack",
            Kind::AllGather => "all-gather",
            Kind::ReduceScatter => "reduce-scatter",
            Kind::AllReduce => "all-reduce",
            Kind::GradNorm => "grad norm",
            Kind::Optimizer => "optimizer",
            Kind::Copy => "copy",
            Kind::AllocFree => "alloc/free",
            Kind::Wait => "wait",
            Kind::Record => "record",
            Kind::AllToAll => "all-to-all",
        }
    }

    /// The kind named `name`.
    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Its position in `ALL`.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Seconds and counts of one rank over some steps, summed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sums {
    /// Steps summed.
    pub steps: u64,
    /// The rank's step: its first instruction's start to its last one's end.
    pub span: f64,
    /// Per kind (`Kind::index`): seconds and instructions.
    pub kinds: [(f64, u64); Kind::ALL.len()],
    /// Per IR op name: seconds and nodes run.
    pub ops: BTreeMap<String, (f64, u64)>,
}

impl Sums {
    /// One step of one rank: `times[i]` is instruction `i` of `program`'s start and end,
    /// `node_seconds` each node the compute stream ran.
    pub fn of_step(program: &Program, graph: &Graph, times: &[[f64; 2]], node_seconds: &[(NodeId, f64)]) -> Sums {
        let mut s = Sums {
            steps: 1,
            ..Sums::default()
        };
        let (mut first, mut last) = (f64::INFINITY, f64::NEG_INFINITY);
        for (issued, t) in program.instrs.iter().zip(times) {
            let k = &mut s.kinds[Kind::of(issued).index()];
            k.0 += (t[1] - t[0]).max(0.0);
            k.1 += 1;
            first = first.min(t[0]);
            last = last.max(t[1]);
        }
        s.span = if last > first { last - first } else { 0.0 };
        for &(id, secs) in node_seconds {
            let name = graph.node(id).op.name();
            let o = s.ops.entry(name.to_string()).or_default();
            o.0 += secs.max(0.0);
            o.1 += 1;
        }
        s
    }

    /// Adds `other` (more steps of the same rank).
    pub fn add(&mut self, other: &Sums) {
        self.steps += other.steps;
        self.span += other.span;
        for (a, b) in self.kinds.iter_mut().zip(&other.kinds) {
            a.0 += b.0;
            a.1 += b.1;
        }
        for (name, (secs, n)) in &other.ops {
            let o = self.ops.entry(name.clone()).or_default();
            o.0 += secs;
            o.1 += n;
        }
    }

    /// Per step: totals, counts and shares of the step.
    pub fn figures(&self, rank: Option<u64>) -> Figures {
        let n = self.steps.max(1) as f64;
        let step = self.span / n;
        let share = |secs: f64| if step > 0.0 { secs / step } else { 0.0 };
        let row = |name: &str, (secs, count): (f64, u64)| Row {
            name: Name(name.to_string()),
            seconds: Number(secs / n),
            count: count / self.steps.max(1),
            share: Number(share(secs / n)),
        };
        let by_instruction = Kind::ALL
            .iter()
            .filter(|k| self.kinds[k.index()].1 > 0)
            .map(|k| row(k.name(), self.kinds[k.index()]))
            .collect();
        let mut by_op: Vec<Row> = self.ops.iter().map(|(name, &v)| row(name, v)).collect();
        by_op.sort_by(|a, b| b.seconds.0.total_cmp(&a.seconds.0).then(a.name.0.cmp(&b.name.0)));
        Figures {
            rank,
            step_seconds: Number(step),
            by_instruction: Rows(by_instruction),
            by_op: Rows(by_op),
        }
    }
}

/// The first and last step covered, and each local rank with its sums over them.
type Covered<'a> = (u64, u64, Vec<(u64, &'a Sums)>);

/// Each local rank's sums: the first step this process ran (warm-up) apart from the rest.
#[derive(Debug)]
pub struct Recorder {
    ranks: Vec<u64>,
    first: Option<(u64, Vec<Sums>)>,
    rest: Vec<Sums>,
    last: u64,
}

impl Recorder {
    /// Nothing recorded yet, for the local ranks `ranks`.
    pub fn new(ranks: Vec<u64>) -> Recorder {
        let rest = vec![Sums::default(); ranks.len()];
        Recorder {
            ranks,
            first: None,
            rest,
            last: 0,
        }
    }

    /// Adds step `step` (1-based) of every local rank.
    pub fn add(&mut self, shared: &Shared, step: u64, outs: &[RankStepOut]) {
        let program = &shared.plan.programs[0];
        let g = &shared.joint.graph;
        let sums: Vec<Sums> = outs
            .iter()
            .map(|o| Sums::of_step(program, g, &o.times, &o.node_seconds))
            .collect();
        if self.first.is_none() {
            self.first = Some((step, sums));
        } else {
            for (a, b) in self.rest.iter_mut().zip(&sums) {
                a.add(b);
            }
        }
        self.last = step;
    }

    /// The steps covered (first and last, 1-based) and each local rank's sums over them:
    /// the steps after the warm-up, or the warm-up alone when it is all that ran.
    fn covered(&self) -> Option<Covered<'_>> {
        let (first, warm) = self.first.as_ref()?;
        let (from, sums) = if self.last > *first {
            (first + 1, &self.rest)
        } else {
            (*first, warm)
        };
        Some((from, self.last, self.ranks.iter().copied().zip(sums.iter()).collect()))
    }
}

/// A name in a profile file (at most 256 bytes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Name(pub String);

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.is_empty() || s.len() > 256 {
            return Err(serde::de::Error::custom(format!(
                "a name of {} bytes (give 1 to 256)",
                s.len()
            )));
        }
        Ok(Name(s))
    }
}

/// Seconds or a share in a profile file: finite, non-negative and at most 1e9.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Number(pub f64);

impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let x = f64::deserialize(d)?;
        if !(x.is_finite() && (0.0..=1e9).contains(&x)) {
            return Err(serde::de::Error::custom(format!(
                "{x} is not a number of seconds or a share (0 to 1e9)"
            )));
        }
        Ok(Number(x))
    }
}

/// One line of a table: a kind or an op, per step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Row {
    /// The instruction kind (`Kind::name`) or the IR op (`Op::name`).
    pub name: Name,
    /// Seconds per step.
    pub seconds: Number,
    /// Instructions or nodes per step.
    pub count: u64,
    /// `seconds` over the rank's step (streams overlap: shares add up to more than 1).
    pub share: Number,
}

/// Rows with distinct names; with `KINDS`, each an instruction kind.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Rows<const KINDS: bool>(pub Vec<Row>);

impl<'de, const KINDS: bool> Deserialize<'de> for Rows<KINDS> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(RowsVisitor::<KINDS>)
    }
}

/// Checks each row as it is read, so an error's line is the row's.
struct RowsVisitor<const KINDS: bool>;

impl<'de, const KINDS: bool> serde::de::Visitor<'de> for RowsVisitor<KINDS> {
    type Value = Rows<KINDS>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of rows")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut rows: Vec<Row> = Vec::new();
        while let Some(r) = seq.next_element::<Row>()? {
            if rows.len() == 4096 {
                return Err(serde::de::Error::custom("more than 4096 rows"));
            }
            if KINDS && Kind::from_name(&r.name.0).is_none() {
                let known: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
                return Err(serde::de::Error::custom(format!(
                    "row {}: `{}` is not an instruction kind (one of: {})",
                    rows.len(),
                    r.name.0,
                    known.join(", ")
                )));
            }
            if rows.iter().any(|q| q.name == r.name) {
                return Err(serde::de::Error::custom(format!(
                    "row {}: `{}` appears twice",
                    rows.len(),
                    r.name.0
                )));
            }
            rows.push(r);
        }
        Ok(Rows(rows))
    }
}

/// One rank's figures, or their mean over ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Figures {
    /// The rank (absent in the mean).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u64>,
    /// The rank's step, seconds: its first instruction's start to its last one's end.
    pub step_seconds: Number,
    /// Per instruction kind, in `Kind::ALL` order, the kinds the program has.
    pub by_instruction: Rows<true>,
    /// Per IR op of the compute stream, the largest first.
    pub by_op: Rows<false>,
}

impl Figures {
    /// The row of kind `k`, if the program has such instructions.
    pub fn kind(&self, k: Kind) -> Option<&Row> {
        self.by_instruction.0.iter().find(|r| r.name.0 == k.name())
    }
}

/// The mesh a profile was measured on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeshDims {
    /// Replicas (HSDP; 1 for FSDP).
    pub replicate: u64,
    /// Ranks each parameter is sharded over.
    pub shard: u64,
}

/// Which steps a profile covers (1-based, inclusive) of how many the run took.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Steps {
    /// The first step covered.
    pub first: u64,
    /// The last step covered.
    pub last: u64,
    /// Steps the run took in this process, the warm-up included.
    pub run: u64,
}

/// A `--profile` file: per rank and the mean over ranks, per instruction kind and per op.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Always `FORMAT`.
    pub format: String,
    /// Always `VERSION` for files this build writes.
    pub version: u32,
    /// The plan's model (plans carry no hash; model and mesh identify them).
    pub model: Name,
    /// The plan's mesh.
    pub mesh: MeshDims,
    /// Instructions in one step of a rank's program.
    pub instructions: u64,
    /// Where the ranks computed (`cpu`, `cuda:0`).
    pub device: Name,
    /// How ranks exchanged data (`local`, `mpi`, `nccl`).
    pub backend: Name,
    /// What measured the times (`CLOCK`).
    pub clock: Name,
    /// The steps the figures cover.
    pub steps: Steps,
    /// The mean over ranks.
    pub mean: Figures,
    /// Every rank, in rank order.
    pub ranks: Vec<Figures>,
}

/// The mean over ranks of `ranks` (each from the same program).
fn mean(ranks: &[Figures]) -> Figures {
    let n = ranks.len().max(1) as f64;
    let step = ranks.iter().map(|r| r.step_seconds.0).sum::<f64>() / n;
    let share = |secs: f64| Number(if step > 0.0 { secs / step } else { 0.0 });
    let mut by_instruction = Vec::new();
    for k in Kind::ALL {
        let rows: Vec<&Row> = ranks.iter().filter_map(|r| r.kind(k)).collect();
        if let Some(first) = rows.first() {
            let secs = rows.iter().map(|r| r.seconds.0).sum::<f64>() / n;
            by_instruction.push(Row {
                name: Name(k.name().into()),
                seconds: Number(secs),
                count: first.count,
                share: share(secs),
            });
        }
    }
    // Every rank runs the same program: an op's count is the same on each.
    let mut ops: BTreeMap<String, (f64, u64)> = BTreeMap::new();
    for r in ranks.iter().flat_map(|r| &r.by_op.0) {
        let e = ops.entry(r.name.0.clone()).or_default();
        e.0 += r.seconds.0;
        e.1 = e.1.max(r.count);
    }
    let mut by_op: Vec<Row> = ops
        .into_iter()
        .map(|(name, (secs, count))| Row {
            name: Name(name),
            seconds: Number(secs / n),
            count,
            share: share(secs / n),
        })
        .collect();
    by_op.sort_by(|a, b| b.seconds.0.total_cmp(&a.seconds.0).then(a.name.0.cmp(&b.name.0)));
    Figures {
        rank: None,
        step_seconds: Number(step),
        by_instruction: Rows(by_instruction),
        by_op: Rows(by_op),
    }
}

/// What a profile says of the plan it measured.
pub(crate) struct About {
    pub model: String,
    pub replicate: u64,
    pub shard: u64,
    /// Instructions in one step of a rank's program.
    pub instructions: u64,
}

impl About {
    pub fn of(plan: &Plan) -> About {
        About {
            model: plan.model.clone(),
            replicate: plan.mesh.replicate(),
            shard: plan.mesh.shard(),
            instructions: plan.programs.first().map_or(0, |p| p.instrs.len() as u64),
        }
    }
}

/// The profile of the steps `recorder` covers (`None` before any), every process's ranks
/// gathered by `gather` (which every process calls with its own ranks' figures and which
/// returns every process's), for the plan `about` describes run on `device` over
/// `backend`, timed by CUDA events where `device_clock`.
pub(crate) fn assemble(
    recorder: Option<&Recorder>,
    about: About,
    device: &str,
    backend: &str,
    device_clock: bool,
    gather: impl FnOnce(Vec<u8>) -> Result<Vec<Vec<u8>>, ExecError>,
) -> Result<Option<Profile>, ExecError> {
    let Some(rec) = recorder else {
        return Ok(None);
    };
    let Some((first, last, sums)) = rec.covered() else {
        return Ok(None);
    };
    let run = rec.last + 1 - rec.first.as_ref().map_or(0, |f| f.0);
    let mine: Vec<Figures> = sums.iter().map(|(rank, s)| s.figures(Some(*rank))).collect();
    let bytes = serde_json::to_vec(&mine).map_err(|e| ExecError::Internal(e.to_string()))?;
    let mut ranks: Vec<Figures> = Vec::new();
    for part in gather(bytes)? {
        let theirs: Vec<Figures> = serde_json::from_slice(&part)
            .map_err(|e| ExecError::Internal(format!("a process sent a malformed profile: {e}")))?;
        ranks.extend(theirs);
    }
    ranks.sort_by_key(|r| r.rank);
    Ok(Some(Profile {
        format: FORMAT.into(),
        version: VERSION,
        model: Name(about.model),
        mesh: MeshDims {
            replicate: about.replicate,
            shard: about.shard,
        },
        instructions: about.instructions,
        device: Name(device.to_string()),
        backend: Name(backend.to_string()),
        clock: Name(if device_clock { DEVICE_CLOCK } else { CLOCK }.into()),
        steps: Steps { first, last, run },
        mean: mean(&ranks),
        ranks,
    }))
}

/// The plan's predicted seconds and instructions per kind for one step: each instruction's
/// time on its stream, from the previous instruction's end there (so a wait counts the
/// time it waits, as the executor measures it) to its own end.
pub fn predicted(plan: &Plan) -> [(f64, u64); Kind::ALL.len()] {
    let mut out = [(0.0, 0); Kind::ALL.len()];
    let Some(program) = plan.programs.first() else {
        return out;
    };
    // Every stream starts `step_overhead_us` into the step, as the simulation has it.
    let mut free_at = [plan.hardware.step_overhead_us * 1e-6; Stream::ALL.len()];
    for (issued, &end) in program.instrs.iter().zip(&plan.timing.end) {
        let s = issued.stream.index();
        let k = &mut out[Kind::of(issued).index()];
        k.0 += (end - free_at[s]).max(0.0);
        k.1 += 1;
        free_at[s] = free_at[s].max(end);
    }
    out
}

/// Milliseconds with a precision that suits them.
fn ms(secs: f64) -> String {
    let m = secs * 1e3;
    if m >= 100.0 {
        format!("{m:.1}")
    } else if m >= 1.0 {
        format!("{m:.2}")
    } else {
        format!("{m:.3}")
    }
}

/// The table printed at the end of a profiled run: the mean over ranks by instruction
/// kind, then the compute stream's largest ops.
pub fn summary(p: &Profile, path: &Path) -> String {
    let mut o = String::new();
    let m = &p.mean;
    let step = m.step_seconds.0;
    let steps = if p.steps.first == p.steps.last {
        format!("step {}", p.steps.first)
    } else {
        format!("steps {}-{}", p.steps.first, p.steps.last)
    };
    let _ = writeln!(
        o,
        "profile ({}; mean of {} rank(s), {steps}, {}; step {} ms; streams overlap, so shares add up to more than 100%) -> {}:",
        p.clock.0,
        p.ranks.len(),
        p.device.0,
        ms(step),
        path.display()
    );
    let _ = writeln!(
        o,
        "  {:<30} {:>10} {:>8} {:>7}",
        "instruction kind", "ms/step", "count", "share"
    );
    for r in &m.by_instruction.0 {
        let _ = writeln!(
            o,
            "  {:<30} {:>10} {:>8} {:>6.1}%",
            r.name.0,
            ms(r.seconds.0),
            r.count,
            r.share.0 * 100.0
        );
    }
    let _ = writeln!(
        o,
        "  {:<30} {:>10} {:>8} {:>7}",
        "compute by op", "ms/step", "count", "share"
    );
    const TOP: usize = 8;
    for r in m.by_op.0.iter().take(TOP) {
        let _ = writeln!(
            o,
            "  {:<30} {:>10} {:>8} {:>6.1}%",
            r.name.0,
            ms(r.seconds.0),
            r.count,
            r.share.0 * 100.0
        );
    }
    if m.by_op.0.len() > TOP {
        let rest = &m.by_op.0[TOP..];
        let secs: f64 = rest.iter().map(|r| r.seconds.0).sum();
        let _ = writeln!(
            o,
            "  {:<30} {:>10} {:>8} {:>6.1}%",
            format!("({} other ops)", rest.len()),
            ms(secs),
            // Counts come from files too: no overflow.
            rest.iter().fold(0u64, |a, r| a.saturating_add(r.count)),
            if step > 0.0 { secs / step * 100.0 } else { 0.0 }
        );
    }
    if let Some(c) = m.kind(Kind::Compute) {
        let in_ops: f64 = m.by_op.0.iter().map(|r| r.seconds.0).sum();
        let outside = (c.seconds.0 - in_ops).max(0.0);
        let _ = writeln!(
            o,
            "  {:<30} {:>10} {:>8} {:>6.1}%",
            "(compute outside ops)",
            ms(outside),
            "",
            if step > 0.0 { outside / step * 100.0 } else { 0.0 }
        );
    }
    o
}

/// Whether `v` (a JSON file's whole value) claims to be a profile.
pub fn is_profile(v: &serde_json::Value) -> bool {
    v.get("format").and_then(|f| f.as_str()) == Some(FORMAT)
}

/// Line and column of the first `"key":` in `text`.
fn key_pos(text: &str, key: &str) -> Option<Pos> {
    let quoted = format!("\"{key}\"");
    text.match_indices(&quoted).find_map(|(i, _)| {
        let rest = text[i + quoted.len()..].trim_start();
        rest.starts_with(':').then(|| {
            let before = &text[..i];
            let line = before.matches('\n').count() as u64 + 1;
            let column = (i - before.rfind('\n').map_or(0, |n| n + 1)) as u64 + 1;
            Pos { line, column }
        })
    })
}

/// Reads a profile file's text (untrusted): JSON errors by line, column and field path;
/// every number finite and non-negative, every kind known, every name bounded; the steps
/// and ranks consistent with the mesh.
pub fn read(path: &Path, text: &str) -> Result<Profile, SpecError> {
    let help = "give a file written by `shardplan train --profile FILE`";
    let refuse = |field: &str, msg: String| {
        SpecError::file(path, msg)
            .at(key_pos(text, field.rsplit('.').next().unwrap_or(field)))
            .field(field)
            .help(help)
    };
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
        SpecError::file(path, format!("not a shardplan profile: {e}"))
            .at(Some(Pos {
                line: e.line() as u64,
                column: e.column() as u64,
            }))
            .help(help)
    })?;
    if !is_profile(&value) {
        return Err(refuse(
            "format",
            format!("`format` is not \"{FORMAT}\": not a shardplan profile"),
        ));
    }
    if value.get("version").and_then(|v| v.as_u64()) != Some(u64::from(VERSION)) {
        return Err(refuse(
            "version",
            format!(
                "profile format version {} (this shardplan reads version {VERSION})",
                value.get("version").unwrap_or(&serde_json::Value::Null)
            ),
        ));
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let p: Profile = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        let err = SpecError::file(path, format!("not a shardplan profile: {inner}"))
            .at(Some(Pos {
                line: inner.line() as u64,
                column: inner.column() as u64,
            }))
            .help(help);
        if field.is_empty() || field == "." {
            err
        } else {
            err.field(field)
        }
    })?;
    let world = match p.mesh.replicate.checked_mul(p.mesh.shard) {
        Some(w) if p.mesh.replicate > 0 && p.mesh.shard > 0 => w,
        _ => {
            return Err(refuse(
                "mesh",
                format!(
                    "the mesh {}x{} holds no ranks or more than 2^64",
                    p.mesh.replicate, p.mesh.shard
                ),
            ))
        }
    };
    if p.steps.first == 0 || p.steps.first > p.steps.last {
        return Err(refuse(
            "steps.first",
            format!(
                "steps {}-{}: the first step is 1 or later and at most the last",
                p.steps.first, p.steps.last
            ),
        ));
    }
    if p.steps.run == 0 || p.steps.last - p.steps.first >= p.steps.run {
        return Err(refuse(
            "steps.run",
            format!(
                "{} step(s) run cannot cover steps {}-{}",
                p.steps.run, p.steps.first, p.steps.last
            ),
        ));
    }
    if p.ranks.is_empty() || p.ranks.len() as u64 > world {
        return Err(refuse(
            "ranks",
            format!("{} ranks listed for a mesh of {world}", p.ranks.len()),
        ));
    }
    for (i, r) in p.ranks.iter().enumerate() {
        match r.rank {
            Some(k) if k < world && p.ranks[..i].iter().all(|q| q.rank != Some(k)) => {}
            other => {
                return Err(refuse(
                    &format!("ranks[{i}].rank"),
                    format!(
                        "rank {} is missing, repeated, or not a rank of the {world}-rank mesh",
                        other.map_or("(none)".into(), |k| k.to_string())
                    ),
                ))
            }
        }
    }
    if p.mean.rank.is_some() {
        return Err(refuse("mean.rank", "the mean over ranks has no rank".into()));
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardplan_planner::{EventId, Issued};

    fn issued(stream: Stream, instr: Instr) -> Issued {
        Issued { stream, instr }
    }

    /// A two-stream program with every time known.
    fn program() -> (Program, Vec<[f64; 2]>) {
        let wait = Instr::Wait { event: EventId(0) };
        let record = Instr::Record { event: EventId(0) };
        let instrs = vec![
            issued(Stream::Compute, record),
            issued(Stream::AllGather, wait.clone()),
            issued(Stream::Compute, wait),
        ];
        let times = vec![[10.0, 10.25], [10.0, 10.5], [10.5, 11.5]];
        (Program { instrs }, times)
    }

    #[test]
    fn kinds_and_totals_add_up_to_the_instruction_times() {
        let (program, times) = program();
        let graph = Graph::new("empty");
        let s = Sums::of_step(&program, &graph, &times, &[]);
        let total: f64 = s.kinds.iter().map(|k| k.0).sum();
        let direct: f64 = times.iter().map(|t| t[1] - t[0]).sum();
        assert!((total - direct).abs() < 1e-12, "{total} vs {direct}");
        assert_eq!(s.kinds[Kind::Wait.index()], (1.5, 2));
        assert_eq!(s.kinds[Kind::Record.index()], (0.25, 1));
        assert_eq!(s.span, 1.5);
        // Two steps: per-step figures are the means, counts per step, shares of the step.
        let mut two = s.clone();
        let mut later = times.clone();
        for t in &mut later {
            t[1] += 0.5;
        }
        two.add(&Sums::of_step(&program, &graph, &later, &[]));
        let f = two.figures(Some(3));
        assert_eq!(f.rank, Some(3));
        assert_eq!(f.step_seconds.0, 1.75);
        let w = f.kind(Kind::Wait).unwrap();
        assert_eq!((w.seconds.0, w.count), (2.0, 2));
        assert!((w.share.0 - 2.0 / 1.75).abs() < 1e-12);
        let rows: f64 = f.by_instruction.0.iter().map(|r| r.seconds.0).sum();
        let per_step: f64 = (direct * 2.0 + 1.5) / 2.0;
        assert!((rows - per_step).abs() < 1e-12, "{rows} vs {per_step}");
        assert!(f.kind(Kind::Compute).is_none(), "kinds the program lacks are left out");
    }

    #[test]
    fn the_mean_is_over_ranks_and_ops_are_largest_first() {
        let row = |n: &str, s: f64, c: u64| Row {
            name: Name(n.into()),
            seconds: Number(s),
            count: c,
            share: Number(0.0),
        };
        let fig = |rank, step, wait, ops: Vec<Row>| Figures {
            rank: Some(rank),
            step_seconds: Number(step),
            by_instruction: Rows(vec![row("wait", wait, 2)]),
            by_op: Rows(ops),
        };
        let m = mean(&[
            fig(0, 2.0, 1.0, vec![row("linear", 1.0, 4), row("add", 0.5, 1)]),
            fig(1, 4.0, 2.0, vec![row("linear", 3.0, 4)]),
        ]);
        assert_eq!(m.step_seconds.0, 3.0);
        let w = m.kind(Kind::Wait).unwrap();
        assert_eq!((w.seconds.0, w.count, w.share.0), (1.5, 2, 0.5));
        let names: Vec<&str> = m.by_op.0.iter().map(|r| r.name.0.as_str()).collect();
        assert_eq!(names, ["linear", "add"]);
        assert_eq!(m.by_op.0[1].seconds.0, 0.25);
    }
}
