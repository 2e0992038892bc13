//! Checkpoints as a user drives them: save while training, resume on another mesh, export
//! and start from the export.

mod common;

use common::{json_lines, shardplan};

use std::process::Output;

fn temp(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    dir.join(name)
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn losses(log: &std::path::Path) -> Vec<f64> {
    json_lines(log).iter().map(|v| v["loss"].as_f64().unwrap()).collect()
}

#[test]
fn save_resume_on_another_mesh_export_and_init() {
    let scratch = tempfile::tempdir().unwrap();
    let ck = temp(scratch.path(), "run");
    let spec2 = temp(scratch.path(), "two.yaml");
    std::fs::write(&spec2, "mesh: {shard: 2}\ngpus_per_node: 2\nmixed_precision: {param: f32, reduce: f32}\nbatch: {per_rank: 4, seq_len: 16}\n").unwrap();
    let (c, s2) = (ck.to_str().unwrap(), spec2.to_str().unwrap());
    let full = temp(scratch.path(), "full.jsonl");
    ok(&shardplan(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--steps",
        "8",
        "--log",
        full.to_str().unwrap(),
    ]));
    ok(&shardplan(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--steps",
        "8",
        "--checkpoint-dir",
        c,
        "--checkpoint-every",
        "2",
        "--checkpoint-keep",
        "2",
    ]));
    let mut steps: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    steps.sort();
    assert_eq!(steps, ["step-00000006", "step-00000008"], "keeps the last 2");
    // Resume step 6 on a 2-rank mesh (same global batch) and finish the same run.
    let part = temp(scratch.path(), "part.jsonl");
    ok(&shardplan(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        s2,
        "--steps",
        "8",
        "--resume",
        &format!("{c}/step-00000006"),
        "--log",
        part.to_str().unwrap(),
    ]));
    let (a, b) = (losses(&full), losses(&part));
    assert_eq!(b.len(), 2);
    for (x, y) in a[6..].iter().zip(&b) {
        assert!((x - y).abs() / x < 1e-5, "{x} vs {y}");
    }
    // Export, then start a run from it.
    let out = temp(scratch.path(), "model.safetensors");
    let msg = ok(&shardplan(&["checkpoint", "export", c, "--out", out.to_str().unwrap()]));
    assert!(msg.starts_with("wrote 21 tensors from"), "{msg}");
    ok(&shardplan(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        s2,
        "--steps",
        "1",
        "--init-from",
        out.to_str().unwrap(),
    ]));
}

#[test]
fn sgd_without_momentum_saves_and_resumes() {
    // SGD with momentum 0 keeps no optimizer state; saving it once failed with "no optimizer
    // state for optim.momentum..." and left a step folder without metadata.
    let scratch = tempfile::tempdir().unwrap();
    let ck = temp(scratch.path(), "sgd");
    let spec = temp(scratch.path(), "sgd.yaml");
    std::fs::write(
        &spec,
        "mesh: {shard: 2}\ngpus_per_node: 2\nmixed_precision: {param: f32, reduce: f32}\nbatch: {per_rank: 2, seq_len: 16}\n\
         optimizer: {sgd: {lr: 0.05, momentum: 0}}\n",
    )
    .unwrap();
    let (c, s) = (ck.to_str().unwrap(), spec.to_str().unwrap());
    let (full, part) = (temp(scratch.path(), "full.jsonl"), temp(scratch.path(), "part.jsonl"));
    let train = |steps: &str, extra: &[&str], log: &std::path::Path| {
        let mut args = vec!["train", "--model", "tiny-llama", "--parallel", s, "--steps", steps];
        args.extend(extra);
        args.extend(["--log", log.to_str().unwrap()]);
        ok(&shardplan(&args));
    };
    train("4", &["--checkpoint-dir", c, "--checkpoint-every", "2"], &full);
    assert!(ck.join("step-00000002/metadata.json").is_file());
    let step2 = format!("{c}/step-00000002");
    train("4", &["--resume", &step2], &part);
    assert_eq!(
        losses(&full)[2..],
        losses(&part),
        "resumed losses equal the uninterrupted run's"
    );
}

/// A CUDA out-of-memory error in the step right after a checkpoint (injected on rank 1 as
/// the driver words it, `--inject-fault 1:5:oom:3`) stops every rank with the plan's
/// device figures and what leaves room; the checkpoint before it is complete and resumes to
/// the uninterrupted run's losses.
#[test]
fn an_out_of_memory_step_stops_the_run_and_keeps_the_last_checkpoint() {
    let scratch = tempfile::tempdir().unwrap();
    let ck = temp(scratch.path(), "oom");
    let c = ck.to_str().unwrap();
    let (full, failed, part) = (
        temp(scratch.path(), "full.jsonl"),
        temp(scratch.path(), "failed.jsonl"),
        temp(scratch.path(), "part.jsonl"),
    );
    let train = |extra: &[&str], log: &std::path::Path| {
        let mut args = vec![
            "train",
            "--model",
            "tiny-llama",
            "--parallel",
            "examples/parallel/fsdp-1x4-cpu.yaml",
            "--steps",
            "4",
        ];
        args.extend(extra);
        args.extend(["--log", log.to_str().unwrap()]);
        shardplan(&args)
    };
    ok(&train(&[], &full));
    let o = train(
        &[
            "--checkpoint-dir",
            c,
            "--checkpoint-every",
            "2",
            "--inject-fault",
            "1:5:oom:3",
        ],
        &failed,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    for want in [
        "step 3: rank 1: instruction #5",
        "CUDA_ERROR_OUT_OF_MEMORY",
        "the GPU ran out of memory",
        "reserved peak",
        "continue with --resume",
        "lower batch.per_rank",
        "--memory-budget",
    ] {
        assert!(err.contains(want), "{want:?} in {err}");
    }
    assert_eq!(losses(&failed), losses(&full)[..2], "two steps logged before it");
    let mut kept: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    kept.sort();
    assert_eq!(kept, ["step-00000002"], "nothing written after the failure");
    ok(&train(&["--resume", &format!("{c}/step-00000002")], &part));
    assert_eq!(
        losses(&full)[2..],
        losses(&part),
        "resumed losses equal the uninterrupted run's"
    );
}

#[test]
fn bad_checkpoints_exit_2_naming_the_file() {
    let scratch = tempfile::tempdir().unwrap();
    let ck = temp(scratch.path(), "bad");
    let c = ck.to_str().unwrap();
    ok(&shardplan(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/cpu-1.yaml",
        "--steps",
        "1",
        "--checkpoint-dir",
        c,
    ]));
    for (args, want) in [
        (
            vec![
                "train",
                "--model",
                "tiny-gpt2",
                "--parallel",
                "examples/parallel/cpu-1.yaml",
                "--resume",
                c,
            ],
            "written for model `tiny-llama`",
        ),
        (
            vec![
                "train",
                "--model",
                "tiny-llama",
                "--parallel",
                "examples/parallel/cpu-1.yaml",
                "--resume",
                "/nonexistent/ck",
            ],
            "/nonexistent/ck: no such checkpoint folder",
        ),
        (
            vec![
                "train",
                "--model",
                "tiny-llama",
                "--parallel",
                "examples/parallel/cpu-1.yaml",
                "--steps",
                "1",
                "--resume",
                c,
            ],
            "leaves nothing to do",
        ),
        (
            vec![
                "train",
                "--model",
                "tiny-llama",
                "--parallel",
                "examples/parallel/cpu-1.yaml",
                "--init-from",
                "/nonexistent.safetensors",
            ],
            "not a safetensors file",
        ),
        (
            vec!["checkpoint", "export", "/nonexistent/ck", "--out", "/tmp/x.safetensors"],
            "no such checkpoint folder",
        ),
    ] {
        let o = shardplan(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "`{want}` not in {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn damaged_checkpoints_exit_2_naming_the_file_and_field() {
    let scratch = tempfile::tempdir().unwrap();
    let ck = temp(scratch.path(), "ck");
    ok(&shardplan(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/cpu-1.yaml",
        "--steps",
        "1",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
    ]));
    let step = ck.join("step-00000001");
    let meta = step.join("metadata.json");
    let rank = step.join("rank-00000.safetensors");
    let (good_meta, good_rank) = (std::fs::read_to_string(&meta).unwrap(), std::fs::read(&rank).unwrap());
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value = serde_json::from_str(&good_meta).unwrap();
        f(&mut v);
        std::fs::write(&meta, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    };
    let resume = [
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/cpu-1.yaml",
        "--steps",
        "2",
        "--resume",
    ];
    let export = ["checkpoint", "export", "--out"];
    type Damage<'a> = (&'a dyn Fn(), &'a str, &'a str);
    let cases: [Damage; 5] = [
        (
            &|| edit(&|v| v["tensors"][0]["shape"][0] = (1u64 << 62).into()),
            "metadata.json",
            "`tensors[0].pieces` cover rows 0..",
        ),
        (
            &|| edit(&|v| v["step"] = (1u64 << 62).into()),
            "metadata.json",
            "`step` is 4611686018427387904",
        ),
        (
            &|| edit(&|v| v["tensors"][1]["pieces"][0]["start"] = (-1).into()),
            "metadata.json",
            "`tensors[1].pieces[0].start`: invalid value: integer `-1`",
        ),
        (
            &|| edit(&|v| drop(v["tensors"][0].as_object_mut().unwrap().remove("pieces"))),
            "metadata.json",
            "`tensors[0]`: missing field `pieces`",
        ),
        (
            &|| {
                let mut b = good_rank.clone();
                b[20] ^= 0x01;
                std::fs::write(&rank, b).unwrap();
            },
            "rank-00000.safetensors",
            ": ",
        ),
    ];
    let out = scratch.path().join("out.safetensors");
    for (damage, file, want) in cases {
        std::fs::write(&meta, &good_meta).unwrap();
        std::fs::write(&rank, &good_rank).unwrap();
        damage();
        let named = format!("{}", step.join(file).display());
        let mut runs = vec![resume.to_vec(), export.to_vec()];
        runs[0].push(ck.to_str().unwrap());
        runs[1].extend([out.to_str().unwrap(), ck.to_str().unwrap()]);
        for args in runs {
            let o = shardplan(&args);
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
            assert!(
                err.contains(&named) && err.contains(want),
                "`{named}` and `{want}` not in {err}"
            );
            assert!(!err.contains("panicked"), "{err}");
        }
    }
}
