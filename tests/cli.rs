//! The `shardplan` binary as a user runs it: outputs, exit codes, help.

mod common;

use common::{json_lines, shardplan, shardplan_ok, stderr, stdout};

use std::process::Command;

/// Runs a command that must fail with exit code 2 and an error (no panic) saying `want`.
fn bad(args: &[&str], want: &str) {
    let o = shardplan(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "args {args:?}, stderr: {err}");
    assert!(err.contains(want), "`{want}` not in stderr for {args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn inspect_json_has_exact_counts() {
    let o = shardplan_ok(&[
        "inspect",
        "--model",
        "examples/models/llama3-8b.yaml",
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["params"]["total"], 8_030_261_248u64);
    assert_eq!(v["params"]["embedding"], 525_336_576u64);
    assert_eq!(v["params"]["non_embedding"], 8_030_261_248u64 - 525_336_576);
    // torchtitan's count: 6 x non-embedding params + 12 x layers x heads x head_dim x seq.
    let expected = 6 * 7_504_924_672u64 + 12 * 32 * 32 * 128 * 8192;
    let got = v["flops_per_token"].as_u64().unwrap();
    let rel = (got as f64 - expected as f64).abs() / expected as f64;
    assert!(rel < 1e-3, "flops per token {got} vs {expected}");
    assert_eq!(
        v["layers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["kind"] == "block")
            .count(),
        32
    );

    let o = shardplan(&[
        "inspect",
        "--model",
        "examples/models/gpt2.config.json",
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["params"]["total"], 124_439_808u64);
}

#[test]
fn inspect_plan_and_train_a_mixture_of_experts() {
    let o = shardplan_ok(&["inspect", "--model", "examples/models/qwen3-30b-a3b.config.json"]);
    let out = stdout(&o);
    assert!(
        out.contains("30,532,122,624 total, 3,353,032,704 active per token"),
        "{out}"
    );
    assert!(
        out.contains("48 of 48 layers: 128 experts of width 768, top 8"),
        "{out}"
    );
    let o = shardplan_ok(&["inspect", "--model", "mixtral-8x7b", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["params"]["total"], 46_702_792_704u64);
    assert_eq!(v["moe"]["active_params_per_token"], 12_879_925_248u64);
    assert_eq!(v["moe"]["moe_layers"], 32);
    // Routed FLOPs: 6 per active non-embedding parameter and token, plus attention, within
    // the elementwise ops' small share (Mixtral's published 12.9B active of 46.7B).
    let flops = v["flops_per_token"].as_u64().unwrap() as f64;
    let (active, embedding) = (12_879_925_248f64, 2.0 * 32000.0 * 4096.0);
    let seq = v["shape"]["seq_len"].as_u64().unwrap() as f64;
    let attention = 12.0 * 32.0 * 4096.0 * seq;
    let want = 6.0 * (active - embedding) + attention;
    assert!((flops / want - 1.0).abs() < 0.02, "{flops} vs {want}");

    let o = shardplan_ok(&[
        "plan",
        "--model",
        "examples/models/tiny-moe.yaml",
        "--parallel",
        "examples/parallel/cpu-1.yaml",
    ]);
    assert!(stdout(&o).contains("adamw step"), "{}", stdout(&o));
    let o = shardplan_ok(&[
        "train",
        "--model",
        "examples/models/tiny-moe.yaml",
        "--parallel",
        "examples/parallel/cpu-1.yaml",
        "--steps",
        "6",
    ]);
    let out = stdout(&o);
    let line = out
        .lines()
        .find(|l| l.starts_with("trained 6 steps"))
        .unwrap_or_else(|| panic!("{out}"));
    let losses: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse().ok())
        .collect();
    // "trained 6 steps of tiny-moe: loss A -> B, ..."
    assert!(losses[1] > losses[2], "{line}");
}

#[test]
fn inspect_text_with_parallel_spec_and_dot() {
    let scratch = tempfile::tempdir().unwrap();
    let dot = scratch.path().join("graph.dot");
    let o = shardplan_ok(&[
        "inspect",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/cpu-1.yaml",
        "--dot",
        dot.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    for want in [
        "model    tiny-llama (llama)",
        "batch 4 x seq 16",
        "parallel world 1",
        "layers.1  ",
        "params   106,816 total",
    ] {
        assert!(out.contains(want), "`{want}` not in:\n{out}");
    }
    let dot_text = std::fs::read_to_string(&dot).unwrap();
    assert!(dot_text.starts_with("digraph {"), "{dot_text}");
    assert!(dot_text.contains("model.layers.1.mlp.down_proj.weight"));
}

#[test]
fn help_explains_every_flag() {
    let o = shardplan(&["--help"]);
    assert!(stdout(&o).contains("inspect") && stdout(&o).contains("train"));
    let help = stdout(&shardplan(&["train", "--help"]));
    for flag in ["--model", "--parallel", "--steps", "--log"] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
    let o = shardplan(&["inspect", "--help"]);
    let help = stdout(&o);
    for flag in ["--model", "--parallel", "--format", "--dot"] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
}

#[test]
fn bad_input_exits_2_with_a_located_message() {
    bad(
        &["inspect", "--model", "no/such/model.yaml"],
        "no/such/model.yaml: no such file",
    );
    bad(
        &["inspect", "--model", "llama-3-8b"],
        "did you mean the preset `llama3-8b`?",
    );
    bad(
        &["inspect", "--model", "Cargo.toml"],
        "Cargo.toml:1:1: expected a mapping",
    );
    bad(
        &[
            "inspect",
            "--model",
            "tiny-gpt2",
            "--parallel",
            "examples/parallel/fsdp-8.yaml",
        ],
        "examples/parallel/fsdp-8.yaml:12:31: `batch.seq_len`: sequence length 8192 exceeds the model's 128 positions",
    );
    bad(
        &[
            "inspect",
            "--model",
            "tiny-llama",
            "--parallel",
            "examples/models/tiny-llama.yaml",
        ],
        "unknown field `name`",
    );
    bad(
        &["inspect", "--model", "tiny-llama", "--format", "xml"],
        "invalid value 'xml'",
    );
    bad(&["inspect"], "--model <FILE>");
    bad(&["inspec"], "unrecognized subcommand");
}

#[test]
fn unwritable_dot_path_is_an_error_not_a_panic() {
    let o = shardplan(&["inspect", "--model", "tiny-mlp", "--dot", "/nonexistent-dir/x.dot"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("cannot write DOT to /nonexistent-dir/x.dot"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_closed_pipe_is_not_a_panic() {
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_shardplan"))
        .args(["inspect", "--model", "llama3-405b"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Close our end before reading anything, as `| head -n 0` would.
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
}

/// Each kind of bad model file, as a user would pass it: exit 2 and `file:line:col`.
#[test]
fn every_bad_model_file_exits_2_with_its_position() {
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let llama = std::fs::read_to_string("examples/models/tiny-llama.yaml").unwrap();
    let cases: Vec<(&str, String, &str)> = vec![
        ("empty.yaml", String::new(), "empty.yaml: is empty"),
        ("not-yaml.yaml", "<<<<\n\t- :\n".to_string(), "not-yaml.yaml:"),
        (
            "not-json.json",
            "{ nope".to_string(),
            "not-json.json:1:3: is not valid JSON",
        ),
        (
            "unknown.yaml",
            llama.replace("n_kv_heads", "kv_heads"),
            "unknown.yaml:8:1: `kv_heads`: unknown field `kv_heads`",
        ),
        (
            "type.yaml",
            llama.replace("dim: 64", "dim: big"),
            "type.yaml:5:6: `dim`: expected a whole number",
        ),
        (
            "zero.yaml",
            llama.replace("n_layers: 2", "n_layers: 0"),
            "zero.yaml:6:11: `n_layers`: must be at least 1",
        ),
        (
            "negative.yaml",
            llama.replace("ffn_dim: 128", "ffn_dim: -1"),
            "negative.yaml:9:10: `ffn_dim`",
        ),
        (
            "heads.yaml",
            llama.replace("n_heads: 4", "n_heads: 6"),
            "heads.yaml:7:10: `n_heads`: n_heads = 6 does not divide dim = 64",
        ),
        (
            "kv.yaml",
            llama.replace("n_kv_heads: 2", "n_kv_heads: 3"),
            "kv.yaml:8:13: `n_kv_heads`",
        ),
        (
            "arch.json",
            "{\"architectures\": [\"BertModel\"]}".to_string(),
            "arch.json:1:2: `architectures`: unsupported architecture `BertModel`",
        ),
        (
            "huge.yaml",
            llama.replace("vocab_size: 256", "vocab_size: 4611686018427387904"),
            "huge.yaml:4:13: `vocab_size`: the model is too large",
        ),
        (
            "bomb.yaml",
            format!("{llama}wrap: [&b x{}]\n", ", *b".repeat(300)),
            "bomb.yaml:",
        ),
    ];
    for (name, text, want) in cases {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let shown = path.to_str().unwrap().to_string();
        let want = want.replacen(name, &shown, 1);
        bad(&["inspect", "--model", &shown], &want);
    }
}

fn temp(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    dir.join(name)
}

#[test]
fn train_logs_json_lines_and_the_loss_falls() {
    let scratch = tempfile::tempdir().unwrap();
    let log = temp(scratch.path(), "metrics.jsonl");
    let o = shardplan_ok(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/cpu-1.yaml",
        "--steps",
        "60",
        "--log",
        log.to_str().unwrap(),
    ]);
    assert!(
        stdout(&o).starts_with("trained 60 steps of tiny-llama: loss "),
        "{}",
        stdout(&o)
    );
    let lines = json_lines(&log);
    assert_eq!(lines.len(), 60);
    assert_eq!(lines[59]["step"], 60);
    for key in [
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_second",
        "step_seconds",
        "measured",
        "planned",
        "planned_peak",
    ] {
        assert!(lines[0].get(key).is_some(), "{key} missing from {}", lines[0]);
    }
    let (first, last) = (lines[0]["loss"].as_f64().unwrap(), lines[59]["loss"].as_f64().unwrap());
    assert!(last < 0.6 * first, "{first} -> {last}");
}

#[test]
fn train_runs_a_sharded_mesh_and_a_saved_plan() {
    let scratch = tempfile::tempdir().unwrap();
    let log = temp(scratch.path(), "sharded.jsonl");
    shardplan_ok(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--steps",
        "3",
        "--log",
        log.to_str().unwrap(),
    ]);
    let direct = json_lines(&log);
    assert_eq!(
        direct[0]["measured"].as_array().unwrap().len(),
        4,
        "one memory report per rank"
    );

    let plan = temp(scratch.path(), "plan.json");
    shardplan_ok(&[
        "plan",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--format",
        "json",
        "--out",
        plan.to_str().unwrap(),
    ]);
    let log2 = temp(scratch.path(), "from-plan.jsonl");
    shardplan_ok(&[
        "train",
        "--plan",
        plan.to_str().unwrap(),
        "--steps",
        "3",
        "--log",
        log2.to_str().unwrap(),
    ]);
    let from_plan = json_lines(&log2);
    for (a, b) in direct.iter().zip(&from_plan) {
        assert_eq!(a["loss"], b["loss"], "the saved plan runs the same training");
    }
}

#[test]
fn train_refuses_bad_plans_and_specs_at_their_line() {
    let scratch = tempfile::tempdir().unwrap();
    bad(
        &[
            "train",
            "--model",
            "tiny-gpt2",
            "--parallel",
            "examples/parallel/fsdp-8.yaml",
        ],
        "fsdp-8.yaml:",
    );
    let broken = temp(scratch.path(), "broken-plan.json");
    std::fs::write(&broken, "{\"version\": 1,\n \"model\": oops}\n").unwrap();
    bad(&["train", "--plan", broken.to_str().unwrap()], "broken-plan.json:2:");
    let o = shardplan(&[
        "plan",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--format",
        "json",
    ]);
    let mut v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["version"] = serde_json::json!(99);
    let old = temp(scratch.path(), "old-plan.json");
    std::fs::write(&old, v.to_string()).unwrap();
    bad(&["train", "--plan", old.to_str().unwrap()], "plan format version 99");
    // A version-3 file, in that version's shape (explicit prefetch lists as pairs), is
    // refused by its version, with how to plan again, before its fields are read.
    let mut v3 = v.clone();
    v3["version"] = serde_json::json!(3);
    v3["policy"]["prefetch"]["explicit_forward"] = serde_json::json!([]);
    std::fs::write(&old, v3.to_string()).unwrap();
    bad(
        &["train", "--plan", old.to_str().unwrap()],
        "plan format version 3, written by an older shardplan",
    );
    bad(
        &["train", "--plan", old.to_str().unwrap()],
        "--format json --out plan.json",
    );
    v["version"] = serde_json::json!(shardplan_planner::PLAN_VERSION);
    v["programs"][0]["instrs"].as_array_mut().unwrap().remove(3);
    let edited = temp(scratch.path(), "edited-plan.json");
    std::fs::write(&edited, v.to_string()).unwrap();
    bad(
        &["train", "--plan", edited.to_str().unwrap()],
        "a program may change where instructions are issued, not what each stream does",
    );
}

#[test]
fn train_names_a_bad_token_file_and_offset() {
    let scratch = tempfile::tempdir().unwrap();
    let tokens = temp(scratch.path(), "tokens.bin");
    let mut bytes: Vec<u8> = (0..2000u16).flat_map(|i| (i % 256).to_le_bytes()).collect();
    bytes[2 * 7..2 * 8].copy_from_slice(&999u16.to_le_bytes());
    // Corrupt every window's reach: put the bad id early and make the file short.
    bytes.truncate(2 * 40);
    std::fs::write(&tokens, &bytes).unwrap();
    let spec = temp(scratch.path(), "p.yaml");
    std::fs::write(
        &spec,
        format!(
            "mesh: {{shard: 1}}\ngpus_per_node: 1\nbatch: {{per_rank: 4, seq_len: 30}}\ndata: {{tokens: {}}}\n",
            tokens.display()
        ),
    )
    .unwrap();
    bad(
        &[
            "train",
            "--model",
            "tiny-llama",
            "--parallel",
            spec.to_str().unwrap(),
            "--steps",
            "5",
        ],
        "token id 999 at byte offset 14 (token 7)",
    );
}

#[test]
fn ctrl_c_stops_after_the_current_step_with_a_complete_log() {
    let scratch = tempfile::tempdir().unwrap();
    let log = temp(scratch.path(), "interrupted.jsonl");
    let child = Command::new(env!("CARGO_BIN_EXE_shardplan"))
        .args([
            "train",
            "--model",
            "tiny-llama",
            "--parallel",
            "examples/parallel/cpu-1.yaml",
            "--steps",
            "1000000",
            "--log",
            log.to_str().unwrap(),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until a few steps are logged, then send SIGINT as a terminal would.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::fs::read_to_string(&log).map_or(0, |s| s.lines().count()) < 3 {
        assert!(std::time::Instant::now() < deadline, "no steps logged");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("interrupted: stopped cleanly after step"),
        "{}",
        stderr(&o)
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.ends_with('\n'));
    for line in text.lines() {
        serde_json::from_str::<serde_json::Value>(line).expect("every logged line is complete JSON");
    }
}

/// `--device`: unknown names and (in a build without the `cuda` feature) CUDA are refused
/// with exit 2 and what to do; `--device cpu` is the default.
#[test]
fn train_device_choices() {
    let base = [
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/cpu-1.yaml",
        "--steps",
        "1",
    ];
    let with = |d: &'static str| [&base[..], &["--device", d]].concat();
    bad(
        &with("gpu"),
        "--device: unknown device `gpu`: use `cpu`, `cuda` or `cuda:N`",
    );
    #[cfg(not(feature = "cuda"))]
    bad(
        &with("cuda:1"),
        "this shardplan was built without CUDA support; build one with `scripts/build-cuda.sh`",
    );
    shardplan_ok(&with("cpu"));
}

/// `--kernels`: shardplan's CUDA kernels need a CUDA device; unknown names are refused.
#[test]
fn train_kernels_choices() {
    let base = [
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/cpu-1.yaml",
        "--steps",
        "1",
    ];
    let with = |k: &'static str| [&base[..], &["--kernels", k]].concat();
    bad(
        &with("fast"),
        "--kernels: unknown kernels `fast`: use `candle` or `native`",
    );
    bad(
        &with("native"),
        "--kernels native runs shardplan's CUDA kernels, but --device is `cpu`: give --device cuda",
    );
    shardplan_ok(&with("candle"));
}

/// Without a GPU (here: a build without CUDA) the self-test says so and exits 2; a CPU
/// device is refused as a usage error.
#[test]
fn gpu_selftest_without_a_gpu_exits_2() {
    let o = shardplan(&["gpu-selftest"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("gpu-selftest: no GPU to test"), "{}", stderr(&o));
    let o = shardplan(&["gpu-selftest", "--device", "cpu"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the GPU self-test runs on a CUDA device"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn calibrate_writes_a_hardware_line_that_plans() {
    let scratch = tempfile::tempdir().unwrap();
    let out = scratch.path().join("hw.txt");
    let o = shardplan_ok(&[
        "calibrate",
        "--ranks",
        "2",
        "--seconds",
        "0.02",
        "--out",
        out.to_str().unwrap(),
    ]);
    let line = stdout(&o);
    assert_eq!(std::fs::read_to_string(&out).unwrap(), line);
    assert!(
        line.starts_with("hardware: {name: cpu-2-ranks, kernels: fused, "),
        "{line}"
    );
    // Every measured figure is a positive, finite number.
    for key in [
        "f32_tflops",
        "hbm_gbps",
        "intra_node_gbps",
        "attention_fwd_efficiency",
        "matmul_tile_m",
        "copy_gbps",
        "step_overhead_us",
    ] {
        let v: f64 = line
            .split(&format!("{key}: "))
            .nth(1)
            .and_then(|r| r.split([',', '}']).next())
            .and_then(|x| x.trim().parse().ok())
            .unwrap_or_else(|| panic!("{key} in {line}"));
        assert!(v.is_finite() && v > 0.0, "{key}: {v}");
    }
    // The line is a parallel spec's hardware: the plan uses it.
    let spec = scratch.path().join("p.yaml");
    std::fs::write(&spec, format!("mesh: {{shard: 2}}\ngpus_per_node: 2\nmixed_precision: {{param: f32, reduce: f32}}\nbatch: {{per_rank: 2, seq_len: 16}}\n{line}")).unwrap();
    let o = shardplan_ok(&["plan", "--model", "tiny-llama", "--parallel", spec.to_str().unwrap()]);
    assert!(stdout(&o).contains("cpu-2-ranks"), "{}", stdout(&o));
}

#[test]
fn calibrate_refuses_impossible_arguments() {
    bad(&["calibrate", "--ranks", "0"], "--ranks 0");
    bad(&["calibrate", "--seconds=-1"], "--seconds -1");
    bad(&["calibrate", "--seconds", "NaN"], "--seconds NaN");
}

#[test]
fn a_panic_is_reported_as_a_bug_in_one_line() {
    let run = |backtrace: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_shardplan"));
        c.args(["plan", "--help"]).env("SHARDPLAN_TEST_PANIC", "1");
        match backtrace {
            Some(v) => c.env("RUST_BACKTRACE", v),
            None => c.env_remove("RUST_BACKTRACE"),
        };
        c.output().unwrap()
    };
    let o = run(None);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(101), "{err}");
    assert!(
        err.starts_with(&format!(
            "error: shardplan {} hit an internal error (a bug): SHARDPLAN_TEST_PANIC is set at src/main.rs:",
            env!("CARGO_PKG_VERSION")
        )),
        "{err}"
    );
    assert!(err.contains("please report it on the project's issue tracker"), "{err}");
    assert_eq!(err.lines().count(), 1, "one line, no backtrace: {err}");
    assert!(!err.contains("panicked at"), "{err}");
    let o = run(Some("1"));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(101), "{err}");
    assert!(
        err.contains("internal error (a bug)") && err.contains("stack backtrace"),
        "{err}"
    );
}
