//! Pipeline schedules as torch's CSV files, and custom schedules read from them:
//!
//! - every built-in schedule at a few sizes writes and reads back to the same compute-only
//!   and lowered programs, and passes validation with its own placement and lowering;
//! - custom schedules that cannot run are refused naming the rank and slot at fault;
//! - against torch, where a Python with torch is found (SHARDPLAN_TORCH_PYTHON, else
//!   `python3`; without one these checks are skipped): torch's `_PipelineScheduleRuntime`
//!   loads our compute-only CSV and lowers it to our lowered program (and loads our lowered
//!   CSV as "compute_comms" unchanged); the CSVs torch's own schedule classes dump are byte
//!   for byte ours and read back to our programs; Python's `csv.reader` cuts tricky files
//!   into the same rows and cells as we do; and torch's verdict on each refused custom
//!   schedule is the one recorded (torch 2.15 lets three of them through: a repeated
//!   action that sends nothing, a micro-batch with two backwards and another with none,
//!   micro-batch indices past M).

mod common;

use common::torch_python;
use serde_json::{json, Value};
use shardplan_planner::pipeline::{
    read_csv, read_lowered_csv, validate_custom, validate_custom_stages, write_csv, write_lowered_csv, Action,
    PipelineProgram, PipelineSchedule, RankOrder, ScheduleFileError, Shape, Slot,
};
use std::path::PathBuf;
use std::process::Command;

/// Every built-in schedule at every size of P in {2, 4}, V in {1, 2, 3} and M in {P, 2P,
/// 3P + 1} that it accepts.
fn programs() -> Vec<PipelineProgram> {
    let mut programs = Vec::new();
    for schedule in PipelineSchedule::ALL {
        for ranks in [2, 4] {
            for stages_per_rank in [1, 2, 3] {
                for microbatches in [ranks, 2 * ranks, 3 * ranks + 1] {
                    let shape = Shape {
                        ranks,
                        stages_per_rank,
                        microbatches,
                    };
                    programs.extend(PipelineProgram::build(schedule, shape).ok());
                }
            }
        }
    }
    programs
}

/// The program's schedule and size, for messages.
fn describe(p: &PipelineProgram) -> String {
    let Shape {
        ranks,
        stages_per_rank,
        microbatches,
    } = p.shape;
    format!("{} P={ranks} V={stages_per_rank} M={microbatches}", named(p))
}

#[test]
fn every_built_in_schedule_round_trips_and_validates() {
    let programs = programs();
    assert!(programs.len() >= 40, "only {} programs", programs.len());
    for p in &programs {
        let name = describe(p);
        assert_eq!(read_csv(&write_csv(&p.compute)).unwrap(), p.compute, "{name}");
        assert_eq!(
            read_lowered_csv(&write_lowered_csv(&p.lowered)).unwrap(),
            p.lowered,
            "{name}"
        );
        let custom = validate_custom(
            &read_csv(&write_csv(&p.compute)).unwrap(),
            p.shape.ranks,
            p.shape.microbatches,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let placed: Vec<u32> = (0..p.shape.stages()).map(|s| p.rank_of_stage[s as usize]).collect();
        assert_eq!(custom.rank_of_stage, placed, "{name}");
        assert_eq!(custom.lowered, p.lowered, "{name}");
        let stages = validate_custom_stages(&p.compute, p.shape.ranks, p.shape.stages(), p.shape.microbatches);
        assert_eq!(stages.unwrap(), custom, "{name}");
    }
}

/// The size of every refused custom schedule: 2 ranks, 2 stages, 2 micro-batches.
const SIZE: u32 = 2;

/// A custom schedule that cannot run: its CSV, what we say, and what torch 2.15 does with
/// it.
struct Refusal {
    what: &'static str,
    csv: &'static str,
    /// The rank we name first, and the slot where the error has one.
    at: (u32, Option<usize>),
    /// Part of our message.
    says: &'static str,
    /// Part of torch's message, or `None` where torch accepts the schedule.
    torch: Option<&'static str>,
}

const REFUSALS: &[Refusal] = &[
    Refusal {
        what: "a B before its F",
        csv: "0F0,0B1,0F1,0B0\r\n1F0,1F1,1B0,1B1\r\n",
        at: (0, Some(1)),
        says: "runs before `0F1`, which comes later at slot 2",
        torch: Some("Running Full Backward for stage 0, microbatch 1 without first running Forward"),
    },
    Refusal {
        what: "a missing F (its B there)",
        csv: "0F0,0B0,,0B1\r\n1F0,1F1,1B0,1B1\r\n",
        at: (0, Some(3)),
        says: "runs before `0F1`, which the rank never runs",
        torch: Some("without first running Forward"),
    },
    Refusal {
        what: "a missing F and B",
        csv: "0F0,0B0\r\n1F0,1F1,1B0,1B1\r\n",
        at: (0, None),
        says: "rank 0 never runs `0F1`",
        torch: Some("microbatches for stage 0, expected 2"),
    },
    Refusal {
        what: "a stage on two ranks",
        csv: "0F0,0F1,0B0,0B1,1F1\r\n1F0,,1B0,1B1\r\n",
        at: (1, Some(0)),
        says: "stage 1 runs on rank 1, but it already runs on rank 0 (slot 4)",
        torch: Some("Stage 1 is assigned to both rank 1 and rank 0"),
    },
    Refusal {
        what: "a deadlock",
        csv: "0F0,,0B0,0F1,0B1\r\n1F0,1F1,1B0,1B1\r\n",
        at: (0, Some(2)),
        says: "rank 0, slot 2 (cell C1): `0B0` waits for `1B0` (rank 1, slot 2, not run yet); rank 1, slot 1 (cell B2): `1F1` waits for `0F1` (rank 0, slot 3, not run yet)",
        torch: Some("Malformed compute schedule"),
    },
    Refusal {
        what: "a communication action",
        csv: "0F0,0F1,0B0,0B1\r\n1F0,1SEND_F0,1F1,1B0,1B1\r\n",
        at: (1, Some(1)),
        says: "`1SEND_F0` is not compute",
        torch: Some("Expected compute-only schedule but found communication action '1SEND_F0' at rank 1, position 1"),
    },
    Refusal {
        what: "a stage past the stage count",
        csv: "0F0,0F1,0B0,0B1\r\n1F0,1F1,1B0,1B1,2F0\r\n",
        at: (1, Some(4)),
        says: "names stage 2, but the pipeline has 2 stages",
        torch: Some("KeyError: 2"),
    },
    Refusal {
        what: "a repeated F that sends",
        csv: "0F0,0F1,0B0,0B1,0F1\r\n1F0,1F1,1B0,1B1\r\n",
        at: (0, Some(4)),
        says: "`0F1` already ran at slot 1",
        torch: Some("Duplicate pipeline send 0SEND_F1 at rank 0"),
    },
    Refusal {
        what: "a repeated F of the last stage",
        csv: "0F0,0F1,0B0,0B1\r\n1F0,1F1,1F1,1B0,1B1\r\n",
        at: (1, Some(2)),
        says: "`1F1` already ran at slot 1",
        torch: None,
    },
    Refusal {
        what: "a micro-batch with a B and an I, another with none",
        csv: "0F0,0F1,0B0,0I0,0W0\r\n1F0,1F1,1B0,1B1\r\n",
        at: (0, Some(3)),
        says: "`0I0` and `0B0` (slot 2) are both backwards of micro-batch 0",
        torch: None,
    },
    Refusal {
        what: "a micro-batch out of range",
        csv: "0F0,0F5,0B0,0B5\r\n1F0,1F5,1B0,1B5\r\n",
        at: (0, Some(1)),
        says: "names micro-batch 5, but the step has 2 micro-batches",
        torch: None,
    },
];

/// Our verdict on `r`, with the stage count given (2), then with the one the file implies.
fn our_verdict(r: &Refusal) -> Result<(), ScheduleFileError> {
    let rows = read_csv(r.csv).unwrap();
    validate_custom_stages(&rows, SIZE, SIZE, SIZE)?;
    validate_custom(&rows, SIZE, SIZE).map(|_| ())
}

#[test]
fn custom_schedules_are_refused_at_the_rank_and_slot_at_fault() {
    for r in REFUSALS {
        let err = our_verdict(r).expect_err(r.what);
        let text = err.to_string();
        assert!(text.contains(r.says), "{}: {text}", r.what);
        let (rank, slot) = r.at;
        assert_eq!(err.rank(), Some(rank), "{}: {text}", r.what);
        assert_eq!(err.slot().map(|s| s.slot), slot, "{}: {text}", r.what);
    }
    // The deadlock names both stuck ranks.
    let deadlock = REFUSALS.iter().find(|r| r.what == "a deadlock").unwrap();
    let Err(ScheduleFileError::Deadlock(stuck)) = our_verdict(deadlock) else {
        panic!("no deadlock");
    };
    let at: Vec<Slot> = stuck.iter().map(|s| s.at).collect();
    assert_eq!(at, [Slot { rank: 0, slot: 2 }, Slot { rank: 1, slot: 1 }]);
}

/// Runs each job in torch; one result a job, `{"error": ...}` where torch raised. A job
/// `load`s a CSV into a `_PipelineScheduleRuntime` over mock stages (rank 0's), `dump`s a
/// torch schedule class's two CSVs, or reads a file's `rows` with `csv.reader`.
const TORCH_JOBS: &str = r#"
import contextlib, csv, io, json, logging, sys, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.CRITICAL)
from torch.distributed.pipelining import schedules as S

class Stage:
    def __init__(self, index, stages, ranks):
        self.stage_index, self.num_stages = index, stages
        self.group_size, self.group_rank = ranks, 0
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = None

def stages(job):
    return [Stage(s, job["stages"], job["ranks"]) for s in job["rank0_stages"]]

def load(job):
    runtime = S._PipelineScheduleRuntime(stages(job), job["microbatches"])
    runtime._load_csv(job["path"], format=job["format"])
    order = runtime.pipeline_order_with_comms
    mapping = runtime.stage_index_to_group_rank
    return {"lowered": [[str(a) for a in order[r]] for r in range(job["ranks"])],
            "stage_to_rank": [mapping[s] for s in range(job["stages"])]}

def dump(job):
    schedule = getattr(S, job["class"])(stages(job), job["microbatches"])
    schedule._dump_csv(job["compute_path"], format="compute_only")
    schedule._dump_csv(job["comms_path"], format="compute_comms")
    return {}

def rows(job):
    with open(job["path"], newline="", encoding="utf-8") as f:
        return {"rows": [[cell.strip() for cell in row] for row in csv.reader(f)]}

def run(job):
    try:
        return {"load": load, "dump": dump, "rows": rows}[job["kind"]](job)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0]}

jobs = json.load(open(sys.argv[1]))
with contextlib.redirect_stdout(io.StringIO()):
    results = [run(job) for job in jobs]
print(json.dumps(results))
"#;

/// A folder of its own under the system's temporary one, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    /// A new folder named after `name` and this process.
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("shardplan-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// Writes `text` to the file `name` in the folder; its path, as text.
    fn write(&self, name: &str, text: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The results of running `jobs` in [`TORCH_JOBS`] under `py`.
fn run_torch(py: &str, dir: &TempDir, jobs: &[Value]) -> Vec<Value> {
    let path = dir.write("jobs.json", &Value::from(jobs.to_vec()).to_string());
    let out = Command::new(py)
        .args(["-c", TORCH_JOBS, &path])
        .output()
        .expect("runs Python");
    assert!(out.status.success(), "{py}: {}", String::from_utf8_lossy(&out.stderr));
    let results: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(results.len(), jobs.len());
    results
}

/// A JSON list of lists of strings.
fn strings(v: &Value) -> Vec<Vec<String>> {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{e}: {v}"))
}

/// Each action of a lowered program as torch writes it.
fn lowered_strings(rows: &[Vec<Action>]) -> Vec<Vec<String>> {
    rows.iter()
        .map(|r| r.iter().map(ToString::to_string).collect())
        .collect()
}

/// The fields of a job over `p`'s size, rank 0's mock stages placed as `p` places them.
fn shape_job(p: &PipelineProgram, kind: &str) -> Value {
    let stages = p.stages_of(0);
    json!({"kind": kind, "ranks": p.shape.ranks, "stages": p.shape.stages(),
           "microbatches": p.shape.microbatches, "rank0_stages": stages})
}

/// Three jobs a program: torch loads our compute-only CSV and our lowered CSV, and (for
/// multi-stage schedules) torch's own class dumps its two CSVs.
fn program_jobs(programs: &[PipelineProgram], dir: &TempDir) -> Vec<Value> {
    let mut jobs = Vec::new();
    for (i, p) in programs.iter().enumerate() {
        let mut load = shape_job(p, "load");
        load["format"] = json!("compute_only");
        load["path"] = json!(dir.write(&format!("{i}-ours-compute.csv"), &write_csv(&p.compute)));
        jobs.push(load.clone());
        load["format"] = json!("compute_comms");
        load["path"] = json!(dir.write(&format!("{i}-ours-comms.csv"), &write_lowered_csv(&p.lowered)));
        jobs.push(load);
        let mut dump = shape_job(p, "dump");
        dump["class"] = json!(format!("Schedule{}", named(p).name()));
        dump["compute_path"] = json!(dir.0.join(format!("{i}-torch-compute.csv")));
        dump["comms_path"] = json!(dir.0.join(format!("{i}-torch-comms.csv")));
        jobs.push(dump);
    }
    jobs
}

/// Compares torch's results for one program's jobs with the program; the differences.
fn compare_program(p: &PipelineProgram, results: &[Value], dir: &TempDir, i: usize) -> Vec<String> {
    let name = describe(p);
    let mut failures = Vec::new();
    let ours = lowered_strings(&p.lowered);
    for (format, result) in ["compute_only", "compute_comms"].iter().zip(results) {
        if result["lowered"].is_null() {
            failures.push(format!("{name}: torch refuses our {format} CSV: {}", result["error"]));
        } else if strings(&result["lowered"]) != ours {
            failures.push(format!("{name}: torch lowers our {format} CSV otherwise"));
        }
    }
    let placed: Vec<u32> = (0..p.shape.stages()).map(|s| p.rank_of_stage[s as usize]).collect();
    if results[0]["stage_to_rank"] != json!(placed) {
        failures.push(format!("{name}: torch maps stages to {}", results[0]["stage_to_rank"]));
    }
    if named(p).is_single_stage() {
        // GPipe's and 1F1B's classes are not runtimes: they have no CSV dump.
        return failures;
    }
    if !results[2]["error"].is_null() {
        failures.push(format!("{name}: torch's dump failed: {}", results[2]["error"]));
        return failures;
    }
    let read = |suffix: &str| std::fs::read_to_string(dir.0.join(format!("{i}-torch-{suffix}.csv"))).unwrap();
    let (compute, comms) = (read("compute"), read("comms"));
    if compute != write_csv(&p.compute) || read_csv(&compute).ok().as_ref() != Some(&p.compute) {
        failures.push(format!("{name}: torch's compute_only dump is not ours"));
    }
    if comms != write_lowered_csv(&p.lowered) || read_lowered_csv(&comms).ok().as_ref() != Some(&p.lowered) {
        failures.push(format!("{name}: torch's compute_comms dump is not ours"));
    }
    failures
}

/// Files mixing actions, spaces, quotes (some around line breaks), empty cells and every
/// kind of line break, from a fixed pseudo-random sequence.
fn tricky_texts() -> Vec<String> {
    const CELLS: [&str; 9] = [
        "0F0",
        " 1B2 ",
        "",
        "  ",
        "\"2W1\"",
        "\"3I0\n\"",
        "\"\"",
        "\"(0F3;1B2)OVERLAP_F_B\"",
        "\"4F1\r\n\"",
    ];
    const BREAKS: [&str; 5] = [",", ",", "\n", "\r\n", "\r"];
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |n: usize| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize % n
    };
    let mut texts = vec![
        "0F0\r\n\r\n".to_string(),
        "\n\n0F0".to_string(),
        "\"\"".to_string(),
        String::new(),
    ];
    for _ in 0..200 {
        let mut text = String::new();
        for _ in 0..1 + next(12) {
            text.push_str(CELLS[next(CELLS.len())]);
            text.push_str(BREAKS[next(BREAKS.len())]);
        }
        texts.push(text);
    }
    texts
}

/// Each cell as torch writes it, an idle slot as an empty string.
fn cells_as_text(rows: &[RankOrder]) -> Vec<Vec<String>> {
    rows.iter()
        .map(|r| {
            r.iter()
                .map(|a| a.as_ref().map(ToString::to_string).unwrap_or_default())
                .collect()
        })
        .collect()
}

/// One `load` job a refusal; the mock stages of rank 0 are the stages its first row names.
fn refusal_jobs(dir: &TempDir) -> Vec<Value> {
    let mut jobs = Vec::new();
    for (i, r) in REFUSALS.iter().enumerate() {
        let first_row = read_csv(r.csv).unwrap().into_iter().next().unwrap_or_default();
        let ops = first_row.iter().flatten().flat_map(|a| a.ops().to_vec());
        let mut rank0: Vec<u32> = ops.map(|op| op.stage).collect();
        rank0.sort_unstable();
        rank0.dedup();
        let path = dir.write(&format!("refused-{i}.csv"), r.csv);
        jobs.push(
            json!({"kind": "load", "format": "compute_only", "ranks": SIZE, "stages": SIZE,
                         "microbatches": SIZE, "rank0_stages": rank0, "path": path}),
        );
    }
    jobs
}

/// Where Python's `csv.reader` cuts `texts` otherwise than we do.
fn compare_rows(texts: &[String], results: &[Value]) -> Vec<String> {
    let mut failures = Vec::new();
    for (text, result) in texts.iter().zip(results) {
        let ours = read_csv(text)
            .map(|rows| cells_as_text(&rows))
            .map_err(|e| e.to_string());
        if ours.as_ref().ok() != Some(&strings(&result["rows"])) {
            failures.push(format!(
                "{text:?}: csv.reader reads {}, we read {ours:?}",
                result["rows"]
            ));
        }
    }
    failures
}

/// Where torch's verdict on a refused schedule is not the one recorded.
fn compare_refusals(results: &[Value]) -> Vec<String> {
    let mut failures = Vec::new();
    for (r, result) in REFUSALS.iter().zip(results) {
        match (r.torch, result["error"].as_str()) {
            (Some(says), Some(e)) if e.contains(says) => {}
            (None, None) => {}
            (expected, got) => failures.push(format!("{}: torch was to say {expected:?}, says {got:?}", r.what)),
        }
    }
    failures
}

#[test]
fn torch_reads_our_csv_and_we_read_torchs() {
    let Some(py) = torch_python() else {
        eprintln!("no Python with torch (set SHARDPLAN_TORCH_PYTHON): the torch CSV checks are skipped");
        return;
    };
    let dir = TempDir::new("pipeline-csv");
    let programs = programs();
    let texts = tricky_texts();
    let mut jobs = program_jobs(&programs, &dir);
    for (i, text) in texts.iter().enumerate() {
        jobs.push(json!({"kind": "rows", "path": dir.write(&format!("text-{i}.csv"), text)}));
    }
    jobs.extend(refusal_jobs(&dir));
    let results = run_torch(&py, &dir, &jobs);
    let (program_results, rest) = results.split_at(3 * programs.len());
    let (text_results, refusal_results) = rest.split_at(texts.len());
    let mut failures = Vec::new();
    for (i, (p, r)) in programs.iter().zip(program_results.chunks(3)).enumerate() {
        failures.extend(compare_program(p, r, &dir, i));
    }
    failures.extend(compare_rows(&texts, text_results));
    failures.extend(compare_refusals(refusal_results));
    eprintln!(
        "torch: {} programs loaded and dumped, {} files read by csv.reader, {} refusals",
        programs.len(),
        texts.len(),
        REFUSALS.len()
    );
    assert!(
        failures.is_empty(),
        "{} differences:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The named schedule of a built-in program.
fn named(p: &PipelineProgram) -> PipelineSchedule {
    p.schedule.expect("built-in programs have a named schedule")
}
