//! `shardplan train --profile`: the file it writes, the table it prints, `plan --compare`
//! reading it back, and bad profile files refused at their line and field.

mod common;

use common::{shardplan, shardplan_ok, stderr, stdout};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// tiny-llama's CPU spec on two ranks (threads).
fn spec_1x2(dir: &Path) -> PathBuf {
    let p = dir.join("fsdp-1x2-cpu.yaml");
    std::fs::write(
        &p,
        "mesh: {replicate: 1, shard: 2}\ngpus_per_node: 2\nmixed_precision: {param: f32, reduce: f32}\nbatch: {per_rank: 2, seq_len: 16}\n",
    )
    .unwrap();
    p
}

fn train(spec: &Path, profile: &Path, steps: &str) -> String {
    train_model("tiny-llama", spec, profile, steps)
}

fn train_model(model: &str, spec: &Path, profile: &Path, steps: &str) -> String {
    let o = shardplan_ok(&[
        "train",
        "--model",
        model,
        "--parallel",
        spec.to_str().unwrap(),
        "--steps",
        steps,
        "--profile",
        profile.to_str().unwrap(),
    ]);
    stdout(&o)
}

fn rows(v: &Value) -> Vec<(String, f64, u64, f64)> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["name"].as_str().unwrap().to_string(),
                r["seconds"].as_f64().unwrap(),
                r["count"].as_u64().unwrap(),
                r["share"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn train_profile_writes_totals_by_kind_and_op_that_compare_reads() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec_1x2(dir.path());
    let path = dir.path().join("profile.json");
    let out = train(&spec, &path, "3");
    for want in [
        "profile (host timers; mean of 2 rank(s), steps 2-3, cpu",
        "instruction kind",
        "compute by op",
        "(compute outside ops)",
    ] {
        assert!(out.contains(want), "`{want}` not in:\n{out}");
    }
    let p: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(p["format"], "shardplan-profile");
    assert_eq!(p["version"], 1);
    assert_eq!(p["model"], "tiny-llama");
    assert_eq!(p["mesh"]["replicate"], 1);
    assert_eq!(p["mesh"]["shard"], 2);
    assert_eq!(p["device"], "cpu");
    assert_eq!(p["backend"], "local");
    assert_eq!(p["clock"], "host timers");
    // The warm-up step is left out.
    assert_eq!(
        (p["steps"]["first"].as_u64(), p["steps"]["last"].as_u64()),
        (Some(2), Some(3))
    );
    assert_eq!(p["steps"]["run"], 3);
    let ranks = p["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    let instructions = p["instructions"].as_u64().unwrap();
    for (k, f) in ranks.iter().chain([&p["mean"]]).enumerate() {
        if k < 2 {
            assert_eq!(f["rank"], k as u64);
        }
        let step = f["step_seconds"].as_f64().unwrap();
        assert!(step > 0.0);
        let kinds = rows(&f["by_instruction"]);
        let names: Vec<&str> = kinds.iter().map(|r| r.0.as_str()).collect();
        for want in [
            "compute",
            "pack",
            "all-gather",
            "reduce-scatter",
            "grad norm",
            "optimizer",
            "alloc/free",
            "wait",
            "record",
        ] {
            assert!(names.contains(&want), "{want} not in {names:?}");
        }
        // Every instruction of the program is counted once per step.
        assert_eq!(kinds.iter().map(|r| r.2).sum::<u64>(), instructions);
        for (name, secs, _, share) in &kinds {
            assert!(
                (share - secs / step).abs() < 1e-9 * (1.0 + share),
                "{name}: share {share} vs {secs} / {step}"
            );
        }
        let compute = kinds.iter().find(|r| r.0 == "compute").unwrap().1;
        let ops = rows(&f["by_op"]);
        let op_names: Vec<&str> = ops.iter().map(|r| r.0.as_str()).collect();
        for want in ["linear", "attention", "rms_norm", "cross_entropy", "weight_grad"] {
            assert!(op_names.contains(&want), "{want} not in {op_names:?}");
        }
        // Largest first.
        assert!(ops.windows(2).all(|w| w[0].1 >= w[1].1), "{ops:?}");
        // The nodes are timed inside the compute instructions: their sum cannot exceed
        // them (how much of them it covers depends on the machine's load, not checked here).
        let in_ops: f64 = ops.iter().map(|r| r.1).sum();
        assert!(in_ops > 0.0, "no time in ops");
        assert!(in_ops <= compute * 1.000_001, "ops {in_ops} > compute {compute}");
    }

    // plan --compare reads it: the plan's predicted time of each kind beside it.
    let o = shardplan_ok(&[
        "plan",
        "--model",
        "tiny-llama",
        "--parallel",
        spec.to_str().unwrap(),
        "--compare",
        path.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    for want in [
        "train profile, mean of 2 rank(s), steps 2-3",
        "step time",
        "time per step, by instruction",
        "  compute",
        "  all-gather",
        "  reduce-scatter",
        "  optimizer",
        "  wait",
    ] {
        assert!(out.contains(want), "`{want}` not in:\n{out}");
    }
    assert!(!out.contains("compare different programs"), "{out}");
    assert!(!out.contains("instructions per step differ"), "{out}");

    // A profile of another mesh is flagged.
    let o = shardplan_ok(&[
        "plan",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--compare",
        path.to_str().unwrap(),
    ]);
    assert!(
        stdout(&o).contains("measured on tiny-llama 1x2, this plan is tiny-llama 1x4"),
        "{}",
        stdout(&o)
    );
}

/// Under expert parallelism each all-to-all runs on its own stream (a thread on the CPU):
/// its time is the all-to-all row's, and "compute by op" holds the compute stream's ops
/// only, so that "(compute outside ops)" is the compute row less them.
#[test]
fn all_to_alls_are_timed_on_their_stream_not_among_the_compute_ops() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("ep.yaml");
    std::fs::write(
        &spec,
        "mesh: {shard: 2, expert: 2}\ngpus_per_node: 2\nbatch: {per_rank: 2, seq_len: 16}\n",
    )
    .unwrap();
    let path = dir.path().join("profile.json");
    train_model("examples/models/tiny-moe.yaml", &spec, &path, "2");
    let p: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for f in p["ranks"].as_array().unwrap().iter().chain([&p["mean"]]) {
        let kinds = rows(&f["by_instruction"]);
        let a2a = kinds.iter().find(|r| r.0 == "all-to-all").expect("an all-to-all row");
        assert!(a2a.1 > 0.0 && a2a.2 > 0, "{a2a:?}");
        let ops = rows(&f["by_op"]);
        let names: Vec<&str> = ops.iter().map(|r| r.0.as_str()).collect();
        for routing in ["moe_top_k", "moe_permute", "moe_unpermute"] {
            assert!(names.contains(&routing), "{routing} not in {names:?}");
        }
        for collective in ["moe_gather_ids", "moe_dispatch", "moe_combine"] {
            assert!(
                !names.contains(&collective),
                "{collective} among the compute ops: {names:?}"
            );
        }
    }
}

#[test]
fn one_step_is_its_own_profile() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec_1x2(dir.path());
    let path = dir.path().join("one.json");
    train(&spec, &path, "1");
    let p: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(
        (p["steps"]["first"].as_u64(), p["steps"]["last"].as_u64()),
        (Some(1), Some(1))
    );
}

#[test]
fn bad_profiles_are_refused_at_their_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec_1x2(dir.path());
    let good = dir.path().join("good.json");
    train(&spec, &good, "2");
    let text = std::fs::read_to_string(&good).unwrap();
    // The line of the first `"key": ` in the text, 1-based.
    let line_of = |t: &str, key: &str| t[..t.find(&format!("\"{key}\": ")).unwrap()].matches('\n').count() + 1;
    let first_seconds = text.find("\"seconds\": ").unwrap();
    let negative = format!(
        "{}\"seconds\": -{}",
        &text[..first_seconds],
        &text[first_seconds + "\"seconds\": ".len()..]
    );
    let cases: Vec<(&str, String, Vec<String>)> = vec![
        (
            "negative.json",
            negative.clone(),
            vec![
                format!("negative.json:{}:", line_of(&negative, "seconds")),
                "`mean.by_instruction[0].seconds`".into(),
                "not a number of seconds".into(),
            ],
        ),
        (
            "kind.json",
            text.replacen("\"name\": \"compute\"", "\"name\": \"teleport\"", 1),
            vec![
                "`mean.by_instruction`".into(),
                "row 0: `teleport` is not an instruction kind".into(),
            ],
        ),
        (
            "version.json",
            text.replacen("\"version\": 1", "\"version\": 7", 1),
            vec![
                format!("version.json:{}:", line_of(&text, "version")),
                "`version`".into(),
                "format version 7".into(),
            ],
        ),
        (
            "truncated.json",
            text[..text.len() / 2].to_string(),
            vec!["truncated.json:".into(), "not a shardplan profile".into()],
        ),
        (
            "steps.json",
            text.replacen("\"first\": 2", "\"first\": 9", 1),
            vec!["`steps.first`".into(), "steps 9-2".into()],
        ),
        (
            "unknown.json",
            text.replacen("\"clock\":", "\"clock_rate\": 3, \"clock\":", 1),
            vec!["unknown field `clock_rate`".into()],
        ),
    ];
    for (name, body, want) in cases {
        let p = dir.path().join(name);
        std::fs::write(&p, &body).unwrap();
        let o = shardplan(&[
            "plan",
            "--model",
            "tiny-llama",
            "--parallel",
            spec.to_str().unwrap(),
            "--compare",
            p.to_str().unwrap(),
        ]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{name}: {err}");
        assert!(!err.contains("panicked"), "{name}: {err}");
        for w in &want {
            assert!(err.contains(w.as_str()), "{name}: `{w}` not in {err}");
        }
    }
}

/// The CPU is timed by the host whichever clock is asked for; an unknown clock is refused.
#[test]
fn the_cpu_is_timed_by_the_host_under_either_profile_clock() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec_1x2(dir.path());
    for clock in ["device", "host"] {
        let path = dir.path().join(format!("profile-{clock}.json"));
        shardplan_ok(&[
            "train",
            "--model",
            "tiny-llama",
            "--parallel",
            spec.to_str().unwrap(),
            "--steps",
            "2",
            "--profile",
            path.to_str().unwrap(),
            "--profile-clock",
            clock,
        ]);
        let p: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(p["clock"], "host timers", "--profile-clock {clock}");
    }
    let o = shardplan(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        spec.to_str().unwrap(),
        "--steps",
        "1",
        "--profile-clock",
        "wall",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--profile-clock"), "{}", stderr(&o));
}
