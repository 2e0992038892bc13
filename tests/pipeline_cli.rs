//! `shardplan plan` of a spec with a pipeline axis: the report, torch's CSV, and the
//! spec's pipeline errors located in the file.

mod common;

use common::{json_lines, shardplan, shardplan_ok, stderr, stdout};
use std::io::Write;
use std::path::Path;

fn spec(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

fn plan(spec: &tempfile::NamedTempFile, extra: &[&str]) -> std::process::Output {
    let path = spec.path().to_str().unwrap();
    let mut args = vec!["plan", "--model", "examples/models/tiny-llama.yaml", "--parallel", path];
    args.extend_from_slice(extra);
    shardplan(&args)
}

#[test]
fn the_example_prints_stages_bubble_and_timeline() {
    let o = shardplan_ok(&[
        "plan",
        "--model",
        "examples/models/llama-10m.yaml",
        "--parallel",
        "examples/parallel/pp-4-1f1b-cpu.yaml",
    ]);
    let out = stdout(&o);
    assert!(
        out.starts_with("pipeline  1F1B, 4 ranks x 1 stage = 4 stages (loop placement), 8 micro-batches"),
        "{out}"
    );
    assert!(out.contains("bubble "), "{out}");
    assert!(out.contains("tok_embeddings"), "{out}");
    assert!(out.contains("rank 3"), "{out}");
    assert!(
        out.contains("3B7"),
        "the last stage's last backward is in the timeline:\n{out}"
    );
    // Memory: the largest rank named against the device, then every rank, largest first.
    let memory = out.lines().find(|l| l.starts_with("memory ")).expect("a memory line");
    assert!(
        memory.contains("on pipeline rank ") && memory.contains("fits h100-sxm"),
        "{memory}"
    );
    let table: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("rank  peak"))
        .skip(1)
        .take_while(|l| !l.is_empty())
        .collect();
    assert_eq!(table.len(), 4, "{out}");
    // 1F1B holds P - r micro-batches in flight on rank r.
    for row in &table {
        let cells: Vec<&str> = row.split_whitespace().collect();
        let rank: usize = cells[0].parse().unwrap();
        assert_eq!(cells[11], (4 - rank).to_string(), "rank {rank}: {row}");
    }
}

#[test]
fn pp_csv_is_torchs_compute_only_format() {
    let f = spec("mesh: {pipeline: 2, shard: 1}\nbatch: {per_rank: 4, seq_len: 64}\npipeline: {schedule: GPipe, microbatches: 2}\n");
    let o = plan(&f, &["--format", "pp-csv"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o), "0F0,0F1,0B0,0B1\r\n1F0,1F1,1B0,1B1\r\n");
}

#[test]
fn interleaved_schedules_loop_two_stages_a_rank() {
    let f = spec("mesh: {pipeline: 2, shard: 1}\nbatch: {per_rank: 4, seq_len: 64}\npipeline: {schedule: Interleaved1F1B, microbatches: 4}\n");
    let o = plan(&f, &["--format", "pp-csv"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let csv = stdout(&o);
    assert!(
        csv.lines().next().unwrap().contains("2F0"),
        "rank 0 runs stage 2 as well:\n{csv}"
    );
}

/// Each bad spec and the field, line and words its error must name.
#[test]
fn bad_pipelines_are_refused_where_written() {
    let cases = [
        (
            "mesh: {shard: 2}\npipeline: {schedule: 1F1B}\n",
            ":2:",
            "no pipeline axis",
        ),
        (
            "mesh: {pipeline: 2, shard: 1}\nbatch: {per_rank: 6, seq_len: 64}\npipeline: {microbatches: 4}\n",
            ":3:",
            "does not split into 4 equal micro-batches",
        ),
        (
            "mesh: {pipeline: 4, shard: 1}\nbatch: {per_rank: 2, seq_len: 64}\npipeline: {schedule: 1F1B, microbatches: 2}\n",
            ":3:",
            "at least as many micro-batches as stages",
        ),
        (
            "mesh: {pipeline: 2, shard: 1}\nbatch: {per_rank: 4, seq_len: 64}\npipeline: {schedule: DualPipeV, stages_per_rank: 3}\n",
            ":3:",
            "two stages a rank in a V",
        ),
        (
            "mesh: {pipeline: 2, shard: 1}\nbatch: {per_rank: 4, seq_len: 64}\npipeline: {schedule: 1F1B, modules_per_stage: [[tok_embedings, layers.0], [layers.1, norm, output]]}\n",
            ":3:",
            "did you mean `tok_embeddings`",
        ),
        (
            "mesh: {pipeline: 2, shard: 1}\npipeline: {schedule: 2F2B}\n",
            ":2:",
            "2F2B",
        ),
        (
            "mesh: {pipeline: 8, shard: 1}\nbatch: {per_rank: 8, seq_len: 64}\npipeline: {schedule: 1F1B}\n",
            ":3:",
            "leave some stage empty",
        ),
    ];
    for (text, at, words) in cases {
        let f = spec(text);
        let o = plan(&f, &[]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{text}: {err}");
        assert!(
            err.contains(at) && err.contains(words),
            "{text}: expected `{at}` and `{words}` in:\n{err}"
        );
    }
}

#[test]
fn json_and_trace_of_a_pipeline_plan() {
    let f = spec("mesh: {pipeline: 2, shard: 2}\nbatch: {per_rank: 4, seq_len: 64}\npipeline: {schedule: Interleaved1F1B, microbatches: 4}\n");
    let o = plan(&f, &["--format", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["kind"], "pipeline");
    assert_eq!(v["schedule"], "Interleaved1F1B");
    let stages = v["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 4);
    // Every stage names a stage FSDP plan, written once however many stages share it.
    let plans = v["fsdp_plans"].as_array().unwrap().len();
    assert!((1..=4).contains(&plans), "{plans}");
    for s in stages {
        assert!(s["fsdp_plan"].as_u64().unwrap() < plans as u64, "{s}");
    }
    // The lowered program holds each rank's compute, and every rank's memory is there.
    let lowered = v["lowered"].as_array().unwrap();
    assert_eq!(lowered.len(), 2);
    assert!(
        lowered[0].as_array().unwrap().iter().any(|a| a == "0F0"),
        "{}",
        lowered[0]
    );
    assert_eq!(v["memory"].as_array().unwrap().len(), 2);
    // The JSON is for reading: `train --plan` and `export --plan` take the specs instead.
    let file = tempfile::Builder::new().suffix(".json").tempfile().unwrap();
    std::fs::write(file.path(), stdout(&o)).unwrap();
    let o = shardplan(&["train", "--plan", file.path().to_str().unwrap(), "--steps", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("a pipeline plan"), "{}", stderr(&o));
    // The trace: a slice per compute action of the timeline, and flows between ranks.
    let o = plan(&f, &["--format", "trace"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let slices = events.iter().filter(|e| e["ph"] == "X").count();
    let spans: usize = v["timeline"]["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().len())
        .sum();
    assert_eq!(slices, spans);
    assert!(events.iter().any(|e| e["ph"] == "s") && events.iter().any(|e| e["ph"] == "f"));
}

#[test]
fn train_runs_the_pipeline_example_and_logs_every_step() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log.jsonl");
    let o = shardplan_ok(&[
        "train",
        "--model",
        "examples/models/tiny-llama.yaml",
        "--parallel",
        "examples/parallel/pp-2-1f1b-cpu.yaml",
        "--steps",
        "3",
        "--log",
        log.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    assert!(out.starts_with("trained 3 steps of tiny-llama on a pipeline"), "{out}");
    assert!(out.contains("planned"), "{out}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    for l in &lines {
        assert!(l["loss"].as_f64().unwrap().is_finite(), "{l}");
    }
}

#[test]
fn train_refuses_expert_parallel_stages_and_unsupported_options() {
    let f = spec("mesh: {pipeline: 2, shard: 2, expert: 2}\nbatch: {per_rank: 4, seq_len: 16}\npipeline: {schedule: GPipe, microbatches: 2}\n");
    let path = f.path().to_str().unwrap();
    // tiny-moe without its load-balancing loss, which a pipeline cannot cut.
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("moe.yaml");
    let text = std::fs::read_to_string("examples/models/tiny-moe.yaml").unwrap();
    std::fs::write(&model, text.replace("aux_loss_coef: 0.01", "aux_loss_coef: 0")).unwrap();
    let o = shardplan(&[
        "train",
        "--model",
        model.to_str().unwrap(),
        "--parallel",
        path,
        "--steps",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("expert parallelism inside pipeline stages"),
        "{}",
        stderr(&o)
    );
    let f = spec("mesh: {pipeline: 2, shard: 1}\nbatch: {per_rank: 4, seq_len: 16}\npipeline: {schedule: GPipe, microbatches: 2}\n");
    let path = f.path().to_str().unwrap();
    let o = shardplan(&[
        "train",
        "--model",
        "examples/models/tiny-llama.yaml",
        "--parallel",
        path,
        "--steps",
        "1",
        "--profile",
        "p.json",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    // The refusal says why: the option reads what a pipeline rank does not run.
    assert!(
        stderr(&o).contains("--profile with a pipeline") && stderr(&o).contains("several stage graphs"),
        "{}",
        stderr(&o)
    );
}

/// `--init-from` with a pipeline: Hugging Face safetensors (`checkpoint export`'s) and a
/// DCP checkpoint start the pipeline's stages from those weights, as the same weights
/// start a run without a pipeline: the first steps' losses agree, and differ from a run
/// from shardplan's own initialisation.
#[test]
fn train_starts_a_pipeline_from_pretrained_weights() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = "examples/models/tiny-llama.yaml";
    let flat = d.join("flat.yaml");
    std::fs::write(
        &flat,
        std::fs::read_to_string("examples/parallel/pp-2-1f1b-cpu.yaml")
            .unwrap()
            .replace("mesh: {pipeline: 2, shard: 1}", "mesh: {shard: 2}")
            .replace("batch: {per_rank: 4, seq_len: 64}", "batch: {per_rank: 2, seq_len: 64}")
            .replace("pipeline: {schedule: 1F1B, microbatches: 4}", ""),
    )
    .unwrap();
    let (ck, dcp) = (d.join("ck"), d.join("dcp"));
    for (root, format) in [(&ck, "shardplan"), (&dcp, "dcp")] {
        shardplan_ok(&[
            "train",
            "--model",
            model,
            "--parallel",
            flat.to_str().unwrap(),
            "--steps",
            "3",
            "--checkpoint-dir",
            root.to_str().unwrap(),
            "--checkpoint-format",
            format,
        ]);
    }
    let weights = d.join("w.safetensors");
    let step = ck.join("step-00000003");
    shardplan_ok(&[
        "checkpoint",
        "export",
        step.to_str().unwrap(),
        "--out",
        weights.to_str().unwrap(),
    ]);
    let run = |spec: &str, from: Option<&Path>, log: &str| -> Vec<f64> {
        let log = d.join(log);
        let mut args = vec![
            "train",
            "--model",
            model,
            "--parallel",
            spec,
            "--steps",
            "2",
            "--log",
            log.to_str().unwrap(),
        ];
        if let Some(p) = from {
            args.extend(["--init-from", p.to_str().unwrap()]);
        }
        shardplan_ok(&args);
        json_lines(&log).iter().map(|v| v["loss"].as_f64().unwrap()).collect()
    };
    let pp = "examples/parallel/pp-2-1f1b-cpu.yaml";
    let want = run(flat.to_str().unwrap(), Some(&weights), "flat.jsonl");
    let dcp_step = std::fs::read_dir(&dcp)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join(".metadata").is_file())
        .unwrap();
    for (what, from) in [("safetensors", weights.as_path()), ("DCP", dcp_step.as_path())] {
        let got = run(pp, Some(from), &format!("pp-{what}.jsonl"));
        for (a, b) in want.iter().zip(&got) {
            assert!(((a - b) / a).abs() < 1e-5, "{what}: {got:?} vs {want:?}");
        }
    }
    let fresh = run(pp, None, "fresh.jsonl");
    assert!((fresh[0] - want[0]).abs() > 1e-3, "{fresh:?} vs {want:?}");
}

#[test]
fn a_custom_schedule_runs_or_is_refused_at_its_cell() {
    let dir = tempfile::tempdir().unwrap();
    let run = |csv: &str| {
        std::fs::write(dir.path().join("s.csv"), csv).unwrap();
        let spec = dir.path().join("pp.yaml");
        std::fs::write(
            &spec,
            "mesh: {pipeline: 2, shard: 1}\nbatch: {per_rank: 4, seq_len: 64}\npipeline: {microbatches: 2, csv: s.csv}\n",
        )
        .unwrap();
        shardplan(&[
            "plan",
            "--model",
            "examples/models/tiny-llama.yaml",
            "--parallel",
            spec.to_str().unwrap(),
        ])
    };
    let o = run("0F0,0F1,0B0,0B1\r\n1F0,1F1,1B0,1B1\r\n");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).starts_with("pipeline  custom schedule, 2 ranks"),
        "{}",
        stdout(&o)
    );
    let o = run("0F0,0B1,0F1,0B0\r\n1F0,1F1,1B1,1B0\r\n");
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("s.csv: rank 0, slot 1 (cell B1)"), "{}", stderr(&o));
}

#[test]
fn auto_searches_the_open_pipeline_knobs_and_says_why() {
    // The schedule, stages a rank and checkpointing are open; the micro-batches written.
    let f = spec("mesh: {pipeline: 2, shard: 1}\nbatch: {per_rank: 4, seq_len: 64}\npipeline: {microbatches: 4}\n");
    let o = plan(&f, &["--auto", "--top", "50"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.starts_with("auto: "), "{out}");
    let rows: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("#  mesh"))
        .skip(1)
        .take_while(|l| !l.starts_with("why:"))
        .collect();
    assert!(rows.len() >= 4, "{out}");
    assert!(rows.iter().all(|r| r.contains(" 4  ")), "M stays 4:\n{out}");
    assert!(out.contains("the fastest that fits"), "{out}");
    // The winner's plan follows, and --emit-spec writes the chosen spec, which plans.
    assert!(out.contains("\npipeline  "), "{out}");
    let dir = tempfile::tempdir().unwrap();
    let chosen = dir.path().join("chosen.yaml");
    let o = plan(
        &f,
        &["--auto", "--emit-spec", chosen.to_str().unwrap(), "--format", "pp-csv"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let searched = stdout(&o);
    let o = shardplan(&[
        "plan",
        "--model",
        "examples/models/tiny-llama.yaml",
        "--parallel",
        chosen.to_str().unwrap(),
        "--format",
        "pp-csv",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o), searched, "the chosen spec plans the winner's schedule");
}

#[test]
fn train_checkpoints_a_pipeline_and_resumes_it_on_another() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (ck, first, second) = (d.join("ck"), d.join("first.jsonl"), d.join("second.jsonl"));
    let train = |spec: &str, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--model",
            "examples/models/tiny-llama.yaml",
            "--parallel",
            spec,
            "--steps",
            "6",
        ];
        args.extend_from_slice(extra);
        shardplan_ok(&args);
    };
    train(
        "examples/parallel/pp-2-1f1b-cpu.yaml",
        &[
            "--checkpoint-dir",
            ck.to_str().unwrap(),
            "--checkpoint-every",
            "3",
            "--log",
            first.to_str().unwrap(),
        ],
    );
    assert!(ck.join("step-00000003/metadata.json").is_file());
    assert!(ck.join("step-00000006/metadata.json").is_file());
    // Resumed at step 3 as GPipe on two pipeline ranks x FSDP 2, the same global batch.
    let other = d.join("other.yaml");
    std::fs::write(
        &other,
        std::fs::read_to_string("examples/parallel/pp-2-1f1b-cpu.yaml")
            .unwrap()
            .replace("mesh: {pipeline: 2, shard: 1}", "mesh: {pipeline: 2, shard: 2}")
            .replace("gpus_per_node: 2", "gpus_per_node: 4")
            .replace("batch: {per_rank: 4, seq_len: 64}", "batch: {per_rank: 2, seq_len: 64}")
            .replace(
                "pipeline: {schedule: 1F1B, microbatches: 4}",
                "pipeline: {schedule: GPipe, microbatches: 2}",
            ),
    )
    .unwrap();
    let resume = ck.join("step-00000003");
    train(
        other.to_str().unwrap(),
        &["--resume", resume.to_str().unwrap(), "--log", second.to_str().unwrap()],
    );
    let losses = |p: &std::path::Path| -> Vec<(u64, f64)> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
            })
            .collect()
    };
    let (a, b) = (losses(&first), losses(&second));
    assert_eq!(b.iter().map(|x| x.0).collect::<Vec<_>>(), vec![4, 5, 6]);
    for ((sa, la), (sb, lb)) in a[3..].iter().zip(&b) {
        assert_eq!(sa, sb);
        assert!((la - lb).abs() <= 1e-5 * la.abs(), "step {sa}: {la} vs {lb}");
    }
}
