//! A plan read from a file, checked against what it claims to be.
//!
//! A plan file records the model and parallel specs it was made from (`source`). Everything
//! else in it is either *derived* from them — the mesh, the hardware, the policy, the groups
//! and their layouts (offsets, padding, shapes), the compute steps, the buffers (sizes,
//! dtypes, categories), the rank spans — or a *choice* of the schedule: where in issue order
//! each instruction of `programs` sits (how early an all-gather is issued, i.e. prefetch;
//! where buffers are allocated and freed) and the events that order the streams
//! (`events`, `record` / `wait`). The simulated `timing`, `memory` and `estimate` follow
//! from the derived fields and the program, and so does `fsdp2_hooks`, FSDP2's hooks for
//! the program (`hooks.rs`).
//!
//! [`rederive`] plans the source again and refuses any derived field that differs, naming
//! its JSON path, the value found and the value expected. An edited program is accepted
//! only when it does the same work — on each stream the same instructions in the same
//! order, the same buffers allocated and freed on the same streams — and the verifier proves
//! the edited interleaving safe; its timing, memory and estimate are then simulated again,
//! its FSDP2 hooks derived again (with its reductions held where the planned program has
//! them), and both must match the file too. Same work in the same order on every stream, each operand
//! ready when read, is the same computation: the results are identical.

use crate::plan::{Instr, Issued, Plan, Program, Stream};
use crate::simulate::{device_memory, estimate_step, simulate, Setting, Simulated};
use crate::{plan_in, shardplan_executor_prediction, verify, PlanCache, PlanError, VerifyError};
use serde_json::Value;
use shardplan_frontends::ParallelConfig;
use shardplan_frontends::SpecError;
use shardplan_ir::JointGraph;
use shardplan_models::ModelConfig;
use std::fmt::Write as _;
use std::path::Path;
use thiserror::Error;

/// Why a plan file is refused.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum Refusal {
    /// A derived field differs from what the plan's source gives.
    #[error("`{path}` is {found}, but the plan's model and parallel specs (`source`) give {expected}")]
    Derived {
        path: String,
        found: String,
        expected: String,
    },
    /// After an edit of the program, a simulated field (`timing`, `memory`, `estimate`)
    /// differs from the simulation of the edited program.
    #[error("`{path}` is {found}, but simulating the edited program gives {expected}")]
    Simulated {
        path: String,
        found: String,
        expected: String,
    },
    /// The recorded source itself is not a valid spec.
    #[error("`{path}`: {message}")]
    Source {
        path: String,
        message: String,
        help: String,
    },
    /// `fsdp2_hooks` differs from the hooks derived from the file's program.
    #[error("`{path}` is {found}, but the plan's program (`programs`) gives {expected}")]
    Hooks {
        path: String,
        found: String,
        expected: String,
    },
    /// The recorded source cannot be planned.
    #[error("`source.parallel.{field}`: {0}", field = .0.field())]
    Plan(PlanError),
    /// An edited program does other work than the planned one.
    #[error("`programs[{program}]`: {message}")]
    Schedule { program: usize, message: String },
    /// An edited program the verifier rejects.
    #[error("the edited schedule fails verification: {0}")]
    Verify(VerifyError),
}

impl Refusal {
    /// The JSON path the refusal is about.
    pub fn path(&self) -> String {
        match self {
            Refusal::Derived { path, .. }
            | Refusal::Simulated { path, .. }
            | Refusal::Hooks { path, .. }
            | Refusal::Source { path, .. } => path.clone(),
            Refusal::Plan(e) => format!("source.parallel.{}", e.field()),
            Refusal::Schedule { program, .. } => format!("programs[{program}]"),
            Refusal::Verify(e) => format!("programs[{}]", e.program),
        }
    }

    /// How to fix it.
    pub(crate) fn help(&self) -> String {
        match self {
            Refusal::Derived { .. } => "this field is derived from the specs, not a choice; to change it, change `source` (or the spec files) and write the plan again with `shardplan plan --format json`".into(),
            Refusal::Simulated { .. } => "`timing`, `memory` and `estimate` follow from the program: after editing `programs`, write the simulated values".into(),
            Refusal::Hooks { .. } => "`fsdp2_hooks` follows from the program (where each all-gather is issued): after editing `programs`, write the derived value".into(),
            Refusal::Source { help, .. } => help.clone(),
            Refusal::Plan(e) => e.help(),
            Refusal::Schedule { .. } | Refusal::Verify(_) => "an edited program may only move instructions in issue order (issue an all-gather earlier, allocate or free elsewhere) and change the events between streams; write it again with `shardplan plan --format json`".into(),
        }
    }
}

/// Checks the recorded parallel spec by writing it as YAML and reading it back through the
/// spec parser, which holds every bound a spec must satisfy; `spec_yaml` covers every field.
pub fn check_parallel(config: &ParallelConfig) -> Result<(), Refusal> {
    let yaml = shardplan_frontends::spec_yaml(config);
    // A path without a folder: a relative token-file path stays as recorded.
    let src = shardplan_frontends::Source::from_text("source.parallel", yaml);
    let parsed = match shardplan_frontends::parse_parallel_spec(&src) {
        Ok((c, _)) => c,
        Err(e) => {
            let d = &*e;
            let field = d.field.clone().unwrap_or_default();
            return Err(Refusal::Source {
                path: if field.is_empty() {
                    "source.parallel".into()
                } else {
                    format!("source.parallel.{field}")
                },
                message: d.message.clone(),
                help: d
                    .help
                    .clone()
                    .unwrap_or_else(|| "fix the recorded parallel spec".into()),
            });
        }
    };
    if &parsed != config {
        let (a, b) = (to_value(config), to_value(&parsed));
        let mut path = "source.parallel".to_string();
        if let Some((p, found, expected)) = diff(&mut path, &a, &b, &[]) {
            return Err(Refusal::Source {
                path: p,
                message: format!("{found} is not a value a parallel spec can hold (read back as {expected})"),
                help: "write the value as a spec would".into(),
            });
        }
    }
    Ok(())
}

/// A plan file, checked: the plan, its model and parallel specs, and the joint graph it was
/// made for.
pub struct CheckedPlan {
    pub plan: Plan,
    pub model: ModelConfig,
    pub parallel: ParallelConfig,
    pub joint: JointGraph,
}

/// Reads the plan file `path` holding `text` and checks it against what it claims to be:
/// JSON errors name the line, column and field path; a plan without its specs or of
/// another format version is refused; the recorded specs are validated as spec files are;
/// then [`rederive`] and the verifier. Every refusal names the file and the JSON path.
pub fn read_plan(path: &Path, text: &str) -> Result<CheckedPlan, SpecError> {
    let pos = |e: &serde_json::Error| {
        Some(shardplan_frontends::Pos {
            line: e.line() as u64,
            column: e.column() as u64,
        })
    };
    let rewrite = "write one with `shardplan plan --model ... --parallel ... --format json --out plan.json`";
    let value: Value = serde_json::from_str(text).map_err(|e| {
        SpecError::file(path, format!("not a shardplan plan: {e}"))
            .at(pos(&e))
            .help(rewrite)
    })?;
    if value.get("kind").and_then(Value::as_str) == Some("pipeline") {
        return Err(SpecError::file(
            path,
            "a pipeline plan: its stages' programs are planned again from its specs, not read from its JSON",
        )
        .field("kind")
        .help("give the pipeline's specs instead: --model ... --parallel ..."));
    }
    // Before the fields are read: another version's fields may have another shape.
    if let Some(version) = value.get("version").and_then(Value::as_u64) {
        if version != u64::from(crate::PLAN_VERSION) {
            return Err(version_refusal(path, version));
        }
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let plan: Plan = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        let err = SpecError::file(path, format!("not a shardplan plan: {inner}")).at(pos(&inner));
        if field.is_empty() || field == "." {
            err
        } else {
            err.field(field)
        }
        .help(rewrite)
    })?;
    if plan.version != crate::PLAN_VERSION {
        return Err(version_refusal(path, plan.version.into()));
    }
    let Some(source) = plan.source.clone() else {
        return Err(SpecError::file(
            path,
            "the plan does not record the model and parallel specs it was made from",
        )
        .field("source")
        .help("write it with `shardplan plan --format json`, which records them"));
    };
    let refuse = |r: Refusal| SpecError::file(path, r.to_string()).help(r.help());
    check_parallel(&source.parallel).map_err(refuse)?;
    let graph = shardplan_models::trace(&source.model, source.parallel.trace_options()).map_err(|e| {
        let (field, help) = match &e {
            shardplan_models::TraceError::Config(c) => (format!("source.model.{}", c.field), c.help.clone()),
            shardplan_models::TraceError::Shape { field, help, .. } => {
                (format!("source.parallel.{field}"), help.clone())
            }
            _ => (
                "source".to_string(),
                "use realistic sizes in the recorded specs".to_string(),
            ),
        };
        SpecError::file(path, format!("`{field}`: {e}")).help(help)
    })?;
    let joint = shardplan_ir::differentiate_with(&graph, source.parallel.diff_options()).map_err(|e| {
        SpecError::file(path, format!("`source.model`: the model cannot be differentiated: {e}"))
            .help("use realistic sizes in the recorded specs")
    })?;
    rederive(&value, &plan, &joint).map_err(refuse)?;
    if let Err(e) = verify(&plan, None) {
        return Err(SpecError::file(path, format!("the plan fails verification: {e}"))
            .help("the file was edited or damaged; write it again with `shardplan plan`"));
    }
    Ok(CheckedPlan {
        plan,
        model: source.model,
        parallel: source.parallel,
        joint,
    })
}

/// A plan file of format `version`, which this shardplan does not read.
fn version_refusal(path: &Path, version: u64) -> SpecError {
    let current = crate::PLAN_VERSION;
    let (whose, help) = if version < u64::from(current) {
        (
            "an older shardplan",
            "plan its specs again with this shardplan: `shardplan plan --model ... --parallel ... --format json --out plan.json` (the file's `source` records them)",
        )
    } else {
        (
            "a newer shardplan",
            "read it with the shardplan that wrote it, or plan its specs again with this one",
        )
    };
    SpecError::file(
        path,
        format!("plan format version {version}, written by {whose} (this one reads version {current})"),
    )
    .field("version")
    .help(help)
}

/// What `shardplan plan` states beside a plan sized at a routing bound (dropless routing
/// with `moe.capacity` over 1): the peaks of the same spec routed evenly (`moe.capacity` 1),
/// `[allocated, reserved, device total]`. `None` for any other plan.
pub fn even_split(model: &ModelConfig, config: &ParallelConfig) -> Result<Option<[u64; 3]>, Refusal> {
    if config.mesh.expert <= 1 || config.moe.capacity <= 1.0 || config.moe.capacity_factor.is_some() {
        return Ok(None);
    }
    let mut even = config.clone();
    even.moe.capacity = 1.0;
    let source = |e: String| Refusal::Source {
        path: "source".into(),
        message: format!("the specs routed evenly (moe.capacity 1) cannot be traced: {e}"),
        help: "write the plan again with `shardplan plan --format json`".into(),
    };
    let graph = shardplan_models::trace(model, even.trace_options()).map_err(|e| source(e.to_string()))?;
    let joint = shardplan_ir::differentiate_with(&graph, even.diff_options()).map_err(|e| source(e.to_string()))?;
    let q = crate::plan_memory(&joint, &even).map_err(Refusal::Plan)?;
    Ok(Some([q.peak, q.reserved_peak, q.device_total]))
}

fn to_value<T: serde::Serialize>(x: &T) -> Value {
    // Plans and configs are plain data: serialising them cannot fail.
    serde_json::to_value(x).unwrap_or(Value::Null)
}

/// Re-plans `plan.source` for `joint` (the source's model traced at its batch shape) and
/// compares every field of `file` (the plan file as JSON) with it; see the module doc.
/// `plan` is `file` read as a [`Plan`]. The source's parallel spec must have passed
/// [`check_parallel`].
pub fn rederive(file: &Value, plan: &Plan, joint: &JointGraph) -> Result<(), Refusal> {
    let Some(source) = &plan.source else {
        return Err(Refusal::Derived {
            path: "source".into(),
            found: "null".into(),
            expected: "the model and parallel specs".into(),
        });
    };
    let config = &source.parallel;
    let mut cache = PlanCache::default();
    let (mut expected, compute) = plan_in(joint, config, &mut cache).map_err(Refusal::Plan)?;
    expected.shardplan_executor = shardplan_executor_prediction(joint, config, &mut cache).map_err(Refusal::Plan)?;
    expected.source = plan.source.clone();
    if let Some(e) = expected.experts.as_mut() {
        e.even = even_split(&source.model, config)?;
    }
    let choices = ["programs", "events", "timing", "memory", "estimate", "fsdp2_hooks"];
    let mut path = String::new();
    if let Some((path, found, expected)) = diff(&mut path, file, &to_value(&expected), &choices) {
        return Err(Refusal::Derived { path, found, expected });
    }
    let edited = plan.programs != expected.programs || plan.events != expected.events;
    if edited {
        if plan.programs.len() != expected.programs.len() {
            return Err(Refusal::Derived {
                path: "programs".into(),
                found: format!("{} programs", plan.programs.len()),
                expected: format!("{}", expected.programs.len()),
            });
        }
        for (p, (found, want)) in plan.programs.iter().zip(&expected.programs).enumerate() {
            same_work(plan, p, found, want)?;
        }
        verify(plan, None).map_err(Refusal::Verify)?;
        let (sim, estimate) = {
            let s = Setting::of(&expected, &expected.steps, &compute);
            let sim = simulate(&plan.programs[0], &expected.buffers, plan.events, &s, None);
            let sim = Simulated {
                memory: device_memory(
                    sim.memory,
                    &plan.programs[0],
                    &expected.buffers,
                    &compute.acts,
                    s.mesh,
                    s.hw,
                    s.policy.allocator,
                ),
                ..sim
            };
            let estimate = estimate_step(&plan.programs[0], &expected.buffers, &sim, &s, cache.model_flops(joint));
            (sim, estimate)
        };
        let (timing, memory) = (sim.timing, sim.memory);
        let planned = std::mem::replace(&mut expected.programs, plan.programs.clone());
        let planned_events = std::mem::replace(&mut expected.events, plan.events);
        expected.fsdp2_hooks = Some(crate::hooks::fsdp2_hooks(&expected, Some((&planned, planned_events))));
        expected.timing = timing;
        expected.memory = memory;
        expected.estimate = estimate;
        if config.runtime.is_shardplan() {
            expected.memory.arena = Some(crate::arena::report(&expected).map_err(Refusal::Verify)?);
        }
    }
    let mut path = String::new();
    if let Some((path, found, expected)) = diff(&mut path, file, &to_value(&expected), &[]) {
        let simulated = ["timing", "memory", "estimate"]
            .iter()
            .any(|k| path.starts_with(&format!("{k}.")) || path == *k);
        return Err(if edited && simulated {
            Refusal::Simulated { path, found, expected }
        } else if path == "fsdp2_hooks" || path.starts_with("fsdp2_hooks.") {
            Refusal::Hooks { path, found, expected }
        } else {
            Refusal::Derived { path, found, expected }
        });
    }
    Ok(())
}

/// Work: what an instruction computes or moves (everything but allocs, frees and events).
fn is_work(i: &Instr) -> bool {
    !matches!(
        i,
        Instr::Alloc { .. } | Instr::Free { .. } | Instr::Record { .. } | Instr::Wait { .. }
    )
}

/// `found` does `want`'s work: per stream the same work in the same order, the same allocs
/// and frees on the same streams, events within the plan's count.
fn same_work(plan: &Plan, p: usize, found: &Program, want: &Program) -> Result<(), Refusal> {
    let refuse = |message: String| Refusal::Schedule { program: p, message };
    // Every event is recorded once, so there are at most as many as instructions.
    if plan.events as usize > found.instrs.len() {
        return Err(refuse(format!(
            "`events` is {}, more than the program's {} instructions could record",
            plan.events,
            found.instrs.len()
        )));
    }
    for (i, x) in found.instrs.iter().enumerate() {
        if let Instr::Record { event } | Instr::Wait { event } = x.instr {
            if event.0 >= plan.events {
                return Err(refuse(format!(
                    "instruction #{i} names event {event}, but `events` is {}",
                    plan.events
                )));
            }
        }
    }
    for s in Stream::ALL {
        let work = |prog: &Program| -> Vec<(usize, Issued)> {
            prog.instrs
                .iter()
                .enumerate()
                .filter(|(_, x)| x.stream == s && is_work(&x.instr))
                .map(|(i, x)| (i, x.clone()))
                .collect()
        };
        let (a, b) = (work(found), work(want));
        for k in 0..a.len().max(b.len()) {
            match (a.get(k), b.get(k)) {
                (Some((_, x)), Some((_, y))) if x == y => {}
                (Some((i, x)), Some((_, y))) => {
                    return Err(refuse(format!(
                        "the {} stream's work item {k} (instruction #{i}) is `{}`, the planned one is `{}`: a program may change where instructions are issued, not what each stream does or in which order",
                        s.name(),
                        short(plan, x),
                        short(plan, y)
                    )))
                }
                (Some((i, x)), None) => {
                    return Err(refuse(format!(
                        "the {} stream does more work than planned: instruction #{i} `{}`",
                        s.name(),
                        short(plan, x)
                    )))
                }
                (None, Some((_, y))) => {
                    return Err(refuse(format!(
                        "the {} stream lacks planned work: `{}`",
                        s.name(),
                        short(plan, y)
                    )))
                }
                (None, None) => {}
            }
        }
    }
    let lifetimes = |prog: &Program| -> Vec<String> {
        let mut v: Vec<String> = prog
            .instrs
            .iter()
            .filter(|x| matches!(x.instr, Instr::Alloc { .. } | Instr::Free { .. }))
            .map(|x| format!("{} on the {} stream", short(plan, x), x.stream.name()))
            .collect();
        v.sort();
        v
    };
    let (a, b) = (lifetimes(found), lifetimes(want));
    if a != b {
        let extra = a.iter().find(|x| !b.contains(x));
        let missing = b.iter().find(|x| !a.contains(x));
        return Err(refuse(match (extra, missing) {
            (Some(x), _) => format!("`{x}` is not in the planned program"),
            (_, Some(x)) => format!("the planned `{x}` is missing"),
            _ => "buffers are allocated or freed a different number of times than planned".into(),
        }));
    }
    Ok(())
}

/// An instruction in the words of the printed plan, without the buffer table when the
/// buffers named are not in it.
fn short(plan: &Plan, x: &Issued) -> String {
    let fits = x.instr.accesses().iter().all(|(b, _)| b.index() < plan.buffers.len())
        && match x.instr {
            Instr::Alloc { buf } | Instr::Free { buf } => buf.index() < plan.buffers.len(),
            _ => true,
        };
    if fits {
        crate::print::describe(plan, x)
    } else {
        format!("{:?}", x.instr)
    }
}

/// The first difference between `found` and `expected` below `path`, with both values
/// printed; top-level keys in `skip` are left out.
fn diff(path: &mut String, found: &Value, expected: &Value, skip: &[&str]) -> Option<(String, String, String)> {
    match (found, expected) {
        (Value::Object(a), Value::Object(b)) => {
            let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                if path.is_empty() && skip.contains(&k.as_str()) {
                    continue;
                }
                let len = path.len();
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(k);
                let r = match (a.get(k), b.get(k)) {
                    (Some(x), Some(y)) => diff(path, x, y, &[]),
                    (Some(x), None) => Some((path.clone(), show(x), "no such field".into())),
                    (None, Some(y)) => Some((path.clone(), "missing".into(), show(y))),
                    (None, None) => None,
                };
                if r.is_some() {
                    return r;
                }
                path.truncate(len);
            }
            None
        }
        (Value::Array(a), Value::Array(b)) => {
            if a.len() != b.len() {
                return Some((
                    path.clone(),
                    format!("a list of {} entries", a.len()),
                    format!("{} entries", b.len()),
                ));
            }
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                let len = path.len();
                let _ = write!(path, "[{i}]");
                if let Some(r) = diff(path, x, y, &[]) {
                    return Some(r);
                }
                path.truncate(len);
            }
            None
        }
        (Value::Number(a), Value::Number(b)) => {
            let same = match (a.as_u64(), b.as_u64(), a.as_i64(), b.as_i64()) {
                (Some(x), Some(y), _, _) => x == y,
                (_, _, Some(x), Some(y)) => x == y,
                _ => a.as_f64() == b.as_f64() && (a.is_f64() || b.is_f64()),
            };
            (!same).then(|| (path.clone(), show(found), show(expected)))
        }
        (a, b) if a == b => None,
        _ => Some((path.clone(), show(found), show(expected))),
    }
}

/// A value as JSON, cut to a readable length.
fn show(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        let cut: String = s.chars().take(77).collect();
        format!("{cut}...")
    } else {
        s
    }
}
