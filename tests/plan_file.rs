//! `shardplan train --plan`: a plan file is checked against the specs it records. An edited
//! schedule the verifier accepts trains exactly as the unedited plan; a changed derived
//! field is refused (exit 2) naming its JSON path, the value found and the one expected.

mod common;

#[path = "../planner/tests/common/edit.rs"]
mod edit;

use common::{json_lines, shardplan, shardplan_ok, stderr};
use shardplan_planner::Plan;
use std::path::Path;

fn plan_json(dir: &Path, name: &str, parallel: &Path) -> (std::path::PathBuf, Plan) {
    let out = dir.join(name);
    shardplan_ok(&[
        "plan",
        "--model",
        "tiny-llama",
        "--parallel",
        parallel.to_str().unwrap(),
        "--format",
        "json",
        "--out",
        out.to_str().unwrap(),
    ]);
    let plan = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    (out, plan)
}

fn losses(plan: &Path, log: &Path) -> Vec<serde_json::Value> {
    shardplan_ok(&[
        "train",
        "--plan",
        plan.to_str().unwrap(),
        "--steps",
        "3",
        "--log",
        log.to_str().unwrap(),
    ]);
    json_lines(log)
        .iter()
        .map(|l| serde_json::json!([l["loss"], l["grad_norm"], l["rank0_loss"]]))
        .collect()
}

#[test]
fn a_deeper_prefetch_written_into_the_plan_trains_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let base = "examples/parallel/fsdp-1x4-cpu.yaml";
    let deep = dir.path().join("deep.yaml");
    std::fs::write(
        &deep,
        format!(
            "{}prefetch: {{forward: 2, backward: 2}}\n",
            std::fs::read_to_string(base).unwrap()
        ),
    )
    .unwrap();
    let (p1_path, p1) = plan_json(dir.path(), "p1.json", Path::new(base));
    let (_, p2) = plan_json(dir.path(), "p2.json", &deep);
    assert_ne!(p1.programs, p2.programs);
    let edited = dir.path().join("edited.json");
    std::fs::write(&edited, edit::with_schedule_of(&p1, &p2).to_string()).unwrap();
    let a = losses(&p1_path, &dir.path().join("a.jsonl"));
    let b = losses(&edited, &dir.path().join("b.jsonl"));
    assert_eq!(a.len(), 3);
    assert_eq!(a, b, "the edited schedule computes the same losses, bit for bit");
}

/// `train --plan` on `v` fails with exit 2 and a message holding each of `want`.
fn refused(dir: &Path, v: &serde_json::Value, want: &[&str]) {
    let f = dir.join("mutated.json");
    std::fs::write(&f, v.to_string()).unwrap();
    let o = shardplan(&["train", "--plan", f.to_str().unwrap(), "--steps", "1"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked") && !err.contains("internal error"), "{err}");
    assert!(err.contains("mutated.json"), "{err}");
    for w in want {
        assert!(err.contains(w), "`{w}` not in: {err}");
    }
}

#[test]
fn changed_derived_fields_are_refused_by_path() {
    let dir = tempfile::tempdir().unwrap();
    let (_, p) = plan_json(dir.path(), "p.json", Path::new("examples/parallel/fsdp-1x4-cpu.yaml"));
    let v = serde_json::to_value(&p).unwrap();

    let mut m = v.clone();
    let off = m["groups"][1]["layout"]["params"][1]["shard_offset"].as_u64().unwrap();
    m["groups"][1]["layout"]["params"][1]["shard_offset"] = (off + 8).into();
    refused(
        dir.path(),
        &m,
        &[
            "`groups[1].layout.params[1].shard_offset` is",
            &format!("is {}", off + 8),
            &format!("give {off}"),
        ],
    );

    let mut m = v.clone();
    m["groups"][1]["params"].as_array_mut().unwrap().swap(0, 1);
    refused(dir.path(), &m, &["`groups[1].params[0]`"]);

    let mut m = v.clone();
    m["buffers"][3]["dtype"] = "bf16".into();
    refused(dir.path(), &m, &["`buffers[3].dtype` is \"bf16\""]);

    let mut m = v.clone();
    m["source"]["parallel"]["batch"]["grad_accum"] = 0.into();
    refused(dir.path(), &m, &["`source.parallel.batch.grad_accum`"]);

    let mut m = v.clone();
    m["source"]["model"]["dim"] = (1u64 << 62).into();
    refused(dir.path(), &m, &["`source.model."]);

    // FSDP2's hooks follow from the program: layers.0's pre-forward prefetching the root.
    let mut m = v.clone();
    m["fsdp2_hooks"]["hooks"]["forward"][0][1][0] = 2.into();
    refused(
        dir.path(),
        &m,
        &[
            "`fsdp2_hooks.hooks.forward[0][1][0]` is 2, but the plan's program (`programs`) gives 1",
            "write the derived value",
        ],
    );

    let mut m = v.clone();
    m["groups"][0]["layout"]["params"][0]["shard_offset"] = "twelve".into();
    refused(
        dir.path(),
        &m,
        &["groups[0].layout.params[0].shard_offset", "invalid type"],
    );
}

#[test]
fn an_expert_parallel_plan_file_trains_as_its_specs_do() {
    // A plan sized at a routing bound records the even split's peaks beside it, derived
    // from the specs like every other field: `train --plan` plans them again and compares.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ep.json");
    shardplan_ok(&[
        "plan",
        "--model",
        "examples/models/tiny-moe.yaml",
        "--parallel",
        "examples/parallel/ep-1x4-cpu.yaml",
        "--format",
        "json",
        "--out",
        out.to_str().unwrap(),
    ]);
    let a = losses(&out, &dir.path().join("a.jsonl"));
    shardplan_ok(&[
        "train",
        "--model",
        "examples/models/tiny-moe.yaml",
        "--parallel",
        "examples/parallel/ep-1x4-cpu.yaml",
        "--steps",
        "3",
        "--log",
        dir.path().join("b.jsonl").to_str().unwrap(),
    ]);
    let b: Vec<_> = json_lines(&dir.path().join("b.jsonl"))
        .iter()
        .map(|l| serde_json::json!([l["loss"], l["grad_norm"], l["rank0_loss"]]))
        .collect();
    assert_eq!(a.len(), 3);
    assert_eq!(a, b, "the plan file trains as the specs do, bit for bit");

    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let even = v["experts"]["even"][0].as_u64().unwrap();
    v["experts"]["even"][0] = (even / 2).into();
    refused(dir.path(), &v, &["`experts.even[0]` is", &format!("give {even}")]);
}
