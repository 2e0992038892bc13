//! shardplan's pipeline schedules against torch.distributed.pipelining's: every schedule,
//! P in {2, 4, 8}, V and M over the grid of `scripts/torch-pipeline-schedules.py`, the
//! compute-only order, the lowered order with communication, and which sizes torch refuses.
//!
//! The live comparison runs the script under the Python with torch (SHARDPLAN_TORCH_PYTHON,
//! else `python3`); a machine without torch compares against the committed P = 2 dump,
//! `fixtures/torch-pipeline-pp2.json` (`--pp 2`, torch 2.15).
//!
//! GPipe's and 1F1B's orders are compared with what torch *runs* (`_step_microbatches`),
//! which the script records: torch's `pipeline_order` of these two drops idle slots when it
//! adds the gradient reduction, and 1F1B's is wrong on its last rank in torch 2.15 (it
//! starts at micro-batch 1 and ends at micro-batch M). The other ranks' `pipeline_order`
//! is compared too, the gradient reduction left out.

mod common;

use common::torch_python;
use serde_json::Value;
use shardplan_planner::pipeline::{check, PipelineProgram, PipelineSchedule, Shape};
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn torch_dump() -> Value {
    let text = match torch_python() {
        Some(py) => {
            let out = Command::new(&py)
                .arg(repo().join("scripts/torch-pipeline-schedules.py"))
                .output()
                .expect("runs the torch dump");
            assert!(
                out.status.success(),
                "scripts/torch-pipeline-schedules.py failed under {py}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap()
        }
        None => {
            eprintln!("no Python with torch: comparing with the committed P = 2 dump of torch 2.15");
            std::fs::read_to_string(repo().join("planner/tests/fixtures/torch-pipeline-pp2.json")).unwrap()
        }
    };
    serde_json::from_str(&text).unwrap()
}

fn schedule_named(name: &str) -> PipelineSchedule {
    PipelineSchedule::ALL.into_iter().find(|s| s.name() == name).unwrap()
}

fn strings(v: &Value) -> Vec<Vec<String>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|rank| {
            rank.as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap().to_string())
                .collect()
        })
        .collect()
}

fn is_reduction(action: &str) -> bool {
    action.ends_with("REDUCE_GRAD")
}

/// One case: refused alike, or equal compute-only and lowered orders.
fn compare(case: &Value) -> Result<(), String> {
    let schedule = schedule_named(case["schedule"].as_str().unwrap());
    let n = |k: &str| case[k].as_u64().unwrap() as u32;
    let shape = Shape {
        ranks: n("pp"),
        stages_per_rank: n("stages_per_rank"),
        microbatches: n("microbatches"),
    };
    let ours = check(schedule, shape).map(|()| PipelineProgram::build(schedule, shape).unwrap());
    let program = match (ours, case["error"].as_str()) {
        (Err(_), Some(_)) => return Ok(()),
        (Err(e), None) => return Err(format!("refused by shardplan ({e}), accepted by torch")),
        (Ok(_), Some(e)) => return Err(format!("accepted by shardplan, refused by torch: {e}")),
        (Ok(p), None) => p,
    };
    let compute: Vec<Vec<String>> = program
        .compute
        .iter()
        .map(|rank| {
            rank.iter()
                .map(|a| a.as_ref().map(|a| a.to_string()).unwrap_or_default())
                .collect()
        })
        .collect();
    if schedule.is_single_stage() {
        if compute != strings(&case["executed"]) {
            return Err(format!(
                "compute {compute:?} but torch runs {:?}",
                strings(&case["executed"])
            ));
        }
        let listed = strings(&case["compute"]);
        let last = shape.ranks as usize - 1;
        for (rank, torch_rank) in listed.iter().enumerate() {
            let torch_rank: Vec<&String> = torch_rank.iter().filter(|a| !is_reduction(a)).collect();
            let buggy = schedule == PipelineSchedule::OneFOneB && rank == last;
            if !buggy && torch_rank != compute[rank].iter().collect::<Vec<_>>() {
                return Err(format!(
                    "rank {rank}: compute {:?}, torch's pipeline_order {torch_rank:?}",
                    compute[rank]
                ));
            }
        }
    } else if compute != strings(&case["compute"]) {
        return Err(format!("compute {compute:?}\n torch {:?}", strings(&case["compute"])));
    }
    let lowered: Vec<Vec<String>> = program
        .lowered
        .iter()
        .map(|rank| rank.iter().map(ToString::to_string).collect())
        .collect();
    let torch_lowered = strings(&case["lowered"]);
    for (rank, (ours, theirs)) in lowered.iter().zip(&torch_lowered).enumerate() {
        if ours != theirs {
            let at = ours
                .iter()
                .zip(theirs)
                .position(|(a, b)| a != b)
                .unwrap_or(ours.len().min(theirs.len()));
            return Err(format!(
                "lowered rank {rank} differs at {at}: ours {:?}, torch {:?}",
                &ours[at.saturating_sub(2)..(at + 3).min(ours.len())],
                &theirs[at.saturating_sub(2)..(at + 3).min(theirs.len())]
            ));
        }
    }
    Ok(())
}

#[test]
fn schedules_equal_torch() {
    let dump = torch_dump();
    let cases = dump["cases"].as_array().unwrap();
    assert!(cases.len() >= 100, "the dump has {} cases", cases.len());
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|case| {
            compare(case).err().map(|e| {
                format!(
                    "{} P={} V={} M={}: {e}",
                    case["schedule"], case["pp"], case["stages_per_rank"], case["microbatches"]
                )
            })
        })
        .collect();
    let accepted = cases.iter().filter(|c| c["error"].is_null()).count();
    eprintln!(
        "torch {}: {} cases, {accepted} accepted, {} differ",
        dump["torch"],
        cases.len(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
