//! Checkpoints as a user drives them: save while training, resume on another mesh, export
//! and start from the export.

mod common;

use common::{json_lines, shardplan, torch_python};

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

/// torch's `dcp.load` of every tensor and value of a checkpoint folder (`argv[1]`), the
/// tensors written to `argv[2]` as safetensors, the values printed as `key=repr`.
const TORCH_LOAD: &str = r#"
import sys, warnings
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
warnings.simplefilter("ignore")
md = dcp.FileSystemReader(sys.argv[1]).read_metadata()
sd = {}
for k, v in md.state_dict_metadata.items():
    sd[k] = torch.full(tuple(v.size), float("nan"), dtype=v.properties.dtype) if hasattr(v, "size") else None
dcp.load(sd, checkpoint_id=sys.argv[1])
save_file({k: v.contiguous() for k, v in sd.items() if torch.is_tensor(v)}, sys.argv[2])
for k, v in sd.items():
    if not torch.is_tensor(v):
        print(f"{k}={v!r}")
"#;

#[test]
fn dcp_checkpoints_resume_on_another_mesh_and_load_in_torch() {
    let scratch = tempfile::tempdir().unwrap();
    let ck = temp(scratch.path(), "run");
    let spec2 = temp(scratch.path(), "two.yaml");
    std::fs::write(&spec2, "mesh: {replicate: 2, shard: 2}\ngpus_per_node: 4\nmixed_precision: {param: f32, reduce: f32}\nbatch: {per_rank: 2, seq_len: 16}\n").unwrap();
    let (full, resumed) = (
        temp(scratch.path(), "full.jsonl"),
        temp(scratch.path(), "resumed.jsonl"),
    );
    let train = |extra: &[&str]| {
        let mut args = vec!["train", "--model", "tiny-llama", "--steps", "8"];
        args.extend_from_slice(extra);
        ok(&shardplan(&args))
    };
    train(&[
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--log",
        full.to_str().unwrap(),
    ]);
    let c = ck.to_str().unwrap();
    train(&[
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--checkpoint-dir",
        c,
        "--checkpoint-every",
        "4",
        "--checkpoint-format",
        "dcp",
    ]);
    let step4 = ck.join("step-4");
    assert!(step4.join(".metadata").is_file() && step4.join("__3_0.distcp").is_file());
    train(&[
        "--parallel",
        spec2.to_str().unwrap(),
        "--resume",
        step4.to_str().unwrap(),
        "--log",
        resumed.to_str().unwrap(),
    ]);
    let (a, b) = (losses(&full), losses(&resumed));
    assert_eq!(b.len(), 4);
    for (x, y) in a[4..].iter().zip(&b) {
        assert!(((x - y) / x).abs() < 1e-6, "resumed {b:?} vs {a:?}");
    }

    let Some(py) = torch_python() else {
        assert!(std::env::var("CI").is_err(), "CI runs this part: its venv has torch");
        eprintln!("skipped the torch half: no Python with torch and safetensors (set SHARDPLAN_TORCH_PYTHON)");
        return;
    };
    let out = temp(scratch.path(), "torch.safetensors");
    let o = std::process::Command::new(&py)
        .args(["-c", TORCH_LOAD, step4.to_str().unwrap(), out.to_str().unwrap()])
        .output()
        .unwrap();
    let values = ok(&o);
    for want in [
        "train_state.step=4",
        "dataloader.position=",
        "optimizer.param_groups.model.norm.weight.lr=0.0003",
    ] {
        assert!(values.contains(want), "{want}: {values}");
    }
    // Every tensor torch read equals, bit for bit, what shardplan reads from the folder.
    let ours = shardplan_dcp::Checkpoint::open(&step4).unwrap();
    let bytes = std::fs::read(&out).unwrap();
    let theirs = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut compared = 0;
    for (key, entry) in &ours.metadata.entries {
        if let shardplan_dcp::Entry::Tensor(_) = entry {
            let t = ours.tensor(key).unwrap();
            assert_eq!(theirs.tensor(key).unwrap().data(), t.bytes.as_slice(), "{key}");
            compared += 1;
        }
    }
    assert!(compared > 50, "{compared} tensors");
}

#[test]
fn checkpoints_convert_between_formats_and_resume_alike() {
    let scratch = tempfile::tempdir().unwrap();
    let d = scratch.path();
    let (ck, full) = (d.join("ck"), d.join("full.jsonl"));
    ok(&shardplan(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--steps",
        "6",
        "--log",
        full.to_str().unwrap(),
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--checkpoint-every",
        "3",
    ]));
    let step3 = ck.join("step-00000003");
    let (dcp, own, hf) = (d.join("dcp"), d.join("own"), d.join("hf"));
    let convert = |src: &std::path::Path, to: &str, out: &std::path::Path, extra: &[&str]| {
        let mut args = vec![
            "checkpoint",
            "convert",
            src.to_str().unwrap(),
            "--to",
            to,
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        shardplan(&args)
    };
    assert!(ok(&convert(&step3, "dcp", &dcp, &[])).contains("wrote 63 tensors"));
    assert!(dcp.join(".metadata").is_file());
    ok(&convert(&dcp, "shardplan", &own, &[]));
    assert!(own.join("metadata.json").is_file());
    ok(&convert(&own, "hf", &hf, &["--dtype", "bf16"]));
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("model.safetensors.index.json")).unwrap()).unwrap();
    assert_eq!(index["weight_map"].as_object().unwrap().len(), 21);
    // Both converted checkpoints resume as the original does.
    let want = losses(&full)[3..].to_vec();
    for (name, from) in [("dcp", &dcp), ("own", &own)] {
        let log = d.join(format!("{name}.jsonl"));
        ok(&shardplan(&[
            "train",
            "--model",
            "tiny-llama",
            "--parallel",
            "examples/parallel/fsdp-1x4-cpu.yaml",
            "--steps",
            "6",
            "--resume",
            from.to_str().unwrap(),
            "--log",
            log.to_str().unwrap(),
        ]));
        assert_eq!(losses(&log), want, "{name}");
    }
    // The Hugging Face shards and the DCP folder start new runs from the same weights
    // (the bf16 shards rounded).
    let mut first = Vec::new();
    for from in [&hf, &dcp] {
        let log = d.join("init.jsonl");
        let _ = std::fs::remove_file(&log);
        ok(&shardplan(&[
            "train",
            "--model",
            "tiny-llama",
            "--parallel",
            "examples/parallel/fsdp-1x4-cpu.yaml",
            "--steps",
            "1",
            "--init-from",
            from.to_str().unwrap(),
            "--log",
            log.to_str().unwrap(),
        ]));
        first.push(losses(&log)[0]);
    }
    assert!(((first[0] - first[1]) / first[1]).abs() < 1e-3, "{first:?}");
    // Hugging Face weights convert to DCP (parameters only, step 0), which starts a run.
    let from_hf = d.join("from-hf");
    assert!(ok(&convert(&hf, "dcp", &from_hf, &[])).contains("wrote 21 tensors"));
    let log = d.join("init-dcp.jsonl");
    ok(&shardplan(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--steps",
        "1",
        "--init-from",
        from_hf.to_str().unwrap(),
        "--log",
        log.to_str().unwrap(),
    ]));
    assert_eq!(losses(&log)[0], first[0], "the bf16 weights, through DCP");
    // Nothing is overwritten; a torch-made checkpoint records no model for shardplan's format.
    let o = convert(&step3, "dcp", &dcp, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not empty"));
    let o = convert(
        std::path::Path::new("dcp/tests/fixtures/two-ranks/step-1"),
        "shardplan",
        &d.join("x"),
        &[],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("records no model spec"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Rewrites the DCP checkpoint `argv[1]` (shardplan's keys, tiny-llama) into `argv[2]` as
/// torchtitan v0.2 writes its Llama 3: its own parameter names, wq and wk in Meta's rotary
/// layout (what its state-dict adapter turns Hugging Face's into), its optimizer and train
/// state keys, nothing of shardplan's.
const TO_TORCHTITAN: &str = r#"
import re, sys, warnings
import torch
import torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")
md = dcp.FileSystemReader(sys.argv[1]).read_metadata()
sd = {k: (torch.zeros(v.size, dtype=v.properties.dtype) if hasattr(v, "size") else None) for k, v in md.state_dict_metadata.items()}
dcp.load(sd, checkpoint_id=sys.argv[1])
heads = {"q_proj": 4, "k_proj": 2}
rules = [
    (r"^model\.embed_tokens\.weight$", "tok_embeddings.weight"), (r"^model\.norm\.weight$", "norm.weight"),
    (r"^lm_head\.weight$", "output.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.weight$", r"layers.\1.attention.w\2.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.weight$", r"layers.\1.feed_forward.w1.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.weight$", r"layers.\1.feed_forward.w2.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.weight$", r"layers.\1.feed_forward.w3.weight"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", r"layers.\1.attention_norm.weight"),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$", r"layers.\1.ffn_norm.weight"),
]
def tt(name):
    for pat, rep in rules:
        if re.match(pat, name):
            return re.sub(pat, rep, name)
    raise SystemExit(f"no torchtitan name for {name}")
def meta(name, t):
    for proj, n in heads.items():
        if name.endswith(f"self_attn.{proj}.weight") and t.dim() == 2:
            hd = t.shape[0] // n
            return t.view(n, 2, hd // 2, t.shape[1]).transpose(1, 2).reshape(t.shape)
    return t
out = {}
for k, v in sd.items():
    m = re.match(r"^optimizer\.(state|param_groups)\.(.+)\.([a-z_]+)$", k)
    if m and m.group(1) == "state":
        out[f"optimizer.state.{tt(m.group(2))}.{m.group(3)}"] = meta(m.group(2), v)
    elif m:
        out[f"optimizer.param_groups.{tt(m.group(2))}.{m.group(3)}"] = v
    elif k in ("train_state.step", "lr_scheduler.last_epoch"):
        out[k] = v
    elif not (k.startswith("shardplan.") or k.startswith("dataloader.")):
        out[tt(k)] = meta(k, v)
dcp.save(out, checkpoint_id=sys.argv[2])
print(len(out))
"#;

#[test]
fn a_torchtitan_checkpoint_resumes_with_its_names() {
    let Some(py) = torch_python() else {
        assert!(std::env::var("CI").is_err(), "CI runs this test: its venv has torch");
        eprintln!("skipped: no Python with torch and safetensors (set SHARDPLAN_TORCH_PYTHON)");
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let d = scratch.path();
    let (ck, full, resumed) = (d.join("ck"), d.join("full.jsonl"), d.join("resumed.jsonl"));
    let spec = "examples/parallel/fsdp-1x4-cpu.yaml";
    let train = |extra: &[&str]| {
        let mut args = vec!["train", "--model", "tiny-llama", "--parallel", spec, "--steps", "8"];
        args.extend_from_slice(extra);
        shardplan(&args)
    };
    ok(&train(&[
        "--log",
        full.to_str().unwrap(),
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--checkpoint-every",
        "4",
        "--checkpoint-format",
        "dcp",
    ]));
    let tt = d.join("torchtitan").join("step-4");
    let o = std::process::Command::new(&py)
        .args(["-c", TO_TORCHTITAN])
        .arg(ck.join("step-4"))
        .arg(&tt)
        .output()
        .unwrap();
    ok(&o);
    // Under Hugging Face's names the keys are not there.
    let o = train(&["--resume", tt.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        err.contains("key `model.") && err.contains("is not in the checkpoint"),
        "{err}"
    );
    let o = train(&[
        "--resume",
        tt.to_str().unwrap(),
        "--names",
        "torchtitan",
        "--log",
        resumed.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    ok(&o);
    assert!(err.contains("not written by shardplan"), "{err}");
    let (a, b) = (losses(&full), losses(&resumed));
    assert_eq!(b, a[4..].to_vec(), "resumed from torchtitan's layout: {b:?} vs {a:?}");
}
