//! `shardplan export fsdp2`: every bundled example exports to a Python program that
//! compiles; plans FSDP2 cannot run as planned are refused naming the field; and, where
//! PyTorch is installed, the exported programs train exactly as `shardplan train` does and
//! peak where the dry run's FSDP2 model says (benches/fsdp2_export.py: a small Llama and a
//! small GPT-2 in every configuration it lists, on 4 CPU ranks).

mod common;

#[path = "../planner/tests/common/edit.rs"]
mod edit;

use common::{shardplan, shardplan_ok, stderr, stdout, torch_python};
use std::path::Path;
use std::process::Command;

fn export(model: &str, parallel: &str, out: &Path) -> std::process::Output {
    shardplan(&[
        "export",
        "fsdp2",
        "--model",
        model,
        "--parallel",
        parallel,
        "--out",
        out.to_str().unwrap(),
    ])
}

fn have_python() -> bool {
    Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn py_compile(file: &Path) {
    if !have_python() {
        return;
    }
    let o = Command::new("python3")
        .args(["-m", "py_compile"])
        .arg(file)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{}: {}",
        file.display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn files(dir: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path().display().to_string())
        .collect();
    v.sort();
    v
}

/// The `NAME = ...` literal block of an exported program, up to the blank line after it.
fn literal<'a>(text: &'a str, name: &str) -> &'a str {
    let at = text
        .find(&format!("\n{name} = "))
        .unwrap_or_else(|| panic!("no {name} in the program"));
    let rest = &text[at + 1..];
    &rest[..rest.find("\n\n").unwrap_or(rest.len())]
}

/// The program's `MESH` literal holds each axis at its size.
fn check_mesh(text: &str, axes: &[(&str, u64)]) {
    let mesh = literal(text, "MESH");
    for (axis, size) in axes {
        assert!(
            mesh.contains(&format!("\"{axis}\": {size}")),
            "{axis} {size} not in {mesh}"
        );
    }
}

/// Qwen3's per-head q/k norms and the mixture-of-experts feed-forward are in the program
/// (`exported_programs_train_as_shardplan_does` trains them), expert parallelism too; what
/// it cannot express is refused at its field, never dropped: token dropping, and selective
/// checkpointing of blocks whose experts are a unit of their own.
#[test]
fn qwen3_moe_and_expert_parallel_export_and_what_is_refused() {
    let d = tempfile::tempdir().unwrap();
    for m in ["examples/models/tiny-qwen3.yaml", "examples/models/tiny-moe.yaml"] {
        let out = d.path().join(m.replace('/', "_"));
        let o = export(m, "examples/parallel/fsdp-1x4-cpu.yaml", &out);
        assert!(o.status.success(), "{m}: {}", stderr(&o));
        let text = std::fs::read_to_string(out.join("train.py")).unwrap();
        assert!(text.contains("\"qk_norm\": True,"), "{m}");
        py_compile(&out.join("train.py"));
    }
    let ep = d.path().join("ep");
    let o = export(
        "examples/models/tiny-moe.yaml",
        "examples/parallel/ep-1x4-cpu.yaml",
        &ep,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    py_compile(&ep.join("train.py"));
    let text = std::fs::read_to_string(ep.join("train.py")).unwrap();
    let whole = std::fs::read_to_string(d.path().join("examples_models_tiny-moe.yaml/train.py")).unwrap();
    // Every rank lists the whole model's parameters, numbered (initialisation streams) as
    // without the expert axis: each builds its own experts from them.
    assert_eq!(literal(&text, "PARAMS"), literal(&whole, "PARAMS"));
    assert!(literal(&text, "PARAMS").contains("model.layers.2.mlp.experts.7.down_proj.weight"));
    check_mesh(&text, &[("expert", 2), ("replicate", 1), ("shard", 4), ("tensor", 1)]);
    for want in [
        // The routed experts of each MoE block are a unit of their own, sharded over the
        // ranks holding the same experts.
        "{\"experts\": True, \"modules\": [\"layers.1.feed_forward.experts\"], \"reshard_after_forward\": True}",
        "{\"experts\": False, \"modules\": [\"layers.1\"], \"reshard_after_forward\": True}",
        // The block's pre-forward gathers its experts where the plan issues it (the
        // block's step starts), and the experts' pre-backward the block before.
        "[\"layers.1\", [\"layers.1.feed_forward.experts\"",
        "[\"layers.2.feed_forward.experts\", [\"layers.1\"]]",
    ] {
        assert!(text.contains(want), "`{want}` not in the program:\n{text}");
    }
    // Without the expert axis no unit is the experts' alone.
    assert!(!literal(&whole, "GROUPS").contains("\"experts\": True"));

    let refused = |name: &str, spec: &str| -> String {
        let path = d.path().join(format!("{name}.yaml"));
        std::fs::write(&path, spec).unwrap();
        let out = d.path().join(name);
        let o = export("examples/models/tiny-moe.yaml", path.to_str().unwrap(), &out);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(!out.exists(), "nothing is written for a refused plan");
        assert!(err.contains(&format!("{name}.yaml:")), "{err}");
        err
    };
    let err = refused(
        "drop",
        "mesh: {shard: 4}\ngpus_per_node: 4\nbatch: {per_rank: 2, seq_len: 16}\nmoe: {capacity_factor: 1.25}\n",
    );
    assert!(
        err.contains("`moe.capacity_factor`") && err.contains("without dropping"),
        "{err}"
    );
    let err = refused(
        "sac",
        "mesh: {shard: 4, expert: 2}\ngpus_per_node: 4\nbatch: {per_rank: 2, seq_len: 16}\n\
         activation_checkpointing: selective\n",
    );
    assert!(
        err.contains("`activation_checkpointing`") && err.contains("recomputation") && err.contains("full"),
        "{err}"
    );
}

/// A Mixtral-style block (every layer routed, no shared expert) opens its backward with its
/// experts' steps, before any step reads the block's own parameters. Under `runtime: fsdp2`
/// the plan issues what the block prefetches where the block's pre-backward hook fires (the
/// first of those steps), so FSDP2 can run it: the export was refused before, the block's
/// prefetch found inside its experts' backward.
#[test]
fn a_mixtral_block_under_fsdp2_prefetches_where_its_hooks_fire() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("mixtral.yaml");
    std::fs::write(
        &model,
        "family: llama\nname: mixtral-check\nvocab_size: 256\ndim: 64\nn_layers: 2\nn_heads: 4\n\
         n_kv_heads: 2\nffn_dim: 128\nnorm_eps: 1.0e-5\nrope_theta: 1000000\nmax_seq_len: 128\n\
         moe: {experts: 4, top_k: 2, expert_ffn_dim: 64, router: sigmoid_topk, norm_topk_prob: true, \
         aux_loss_coef: 0, hf_names: mixtral}\n",
    )
    .unwrap();
    let spec = d.path().join("ep.yaml");
    std::fs::write(
        &spec,
        "mesh: {shard: 4, expert: 2}\ngpus_per_node: 4\nmixed_precision: {param: f32, reduce: f32}\n\
         batch: {per_rank: 2, seq_len: 16}\nmoe: {capacity: 2.0}\nruntime: fsdp2\n",
    )
    .unwrap();
    let out = d.path().join("out");
    let o = export(model.to_str().unwrap(), spec.to_str().unwrap(), &out);
    assert!(o.status.success(), "{}", stderr(&o));
    py_compile(&out.join("train.py"));
    let text = std::fs::read_to_string(out.join("train.py")).unwrap();
    let want = "[\"layers.1\", [\"layers.0.feed_forward.experts\"]]";
    assert!(
        literal(&text, "BACKWARD_PREFETCH").contains(want),
        "`{want}` not in the program:\n{text}"
    );
}

#[test]
fn every_bundled_example_exports_a_program_that_compiles() {
    let d = tempfile::tempdir().unwrap();
    let mut written = 0;
    // Every model with a parallel spec its sequence fits; every parallel spec with a model.
    let fallbacks = [
        "examples/parallel/fsdp-8-seq1024.yaml",
        "examples/parallel/fsdp-1x4-cpu.yaml",
    ];
    // Llama 3.1's 128k positions for the long-context (context-parallel) specs.
    let models = [
        "examples/models/tiny-llama.yaml",
        "examples/models/llama3-8b.yaml",
        "examples/models/llama3.1-8b.config.json",
    ];
    let mut pairs: Vec<(String, String)> = Vec::new();
    for m in files("examples/models") {
        for p in fallbacks {
            pairs.push((m.clone(), p.to_string()));
        }
    }
    for p in files("examples/parallel") {
        for m in models {
            pairs.push((m.to_string(), p.clone()));
        }
    }
    let mut done = std::collections::BTreeSet::new();
    for (m, p) in pairs {
        let key_m = format!("m:{m}");
        let key_p = format!("p:{p}");
        if done.contains(&key_m) && done.contains(&key_p) {
            continue;
        }
        let out = d.path().join(format!("ex{written}"));
        let o = export(&m, &p, &out);
        let err = stderr(&o);
        assert!(!err.contains("panicked"), "{m} {p}: {err}");
        if m.ends_with("mlp.yaml") {
            assert_eq!(o.status.code(), Some(2), "{err}");
            assert!(err.contains("`family`") && err.contains("mlp.yaml:"), "{err}");
            done.insert(key_m);
            continue;
        }
        if !o.status.success() && err.contains("`mesh.expert`") {
            // Experts split over an expert axis are not FSDP2 alone (or the model has no
            // experts to split): refused at the field either way.
            assert_eq!(o.status.code(), Some(2), "{err}");
            assert!(err.contains(&format!("{p}:")), "{m} {p}: {err}");
            done.insert(key_p);
            continue;
        }
        if !o.status.success() && err.contains("`pipeline") {
            // A pipeline the model cannot be cut into (more stages than modules): refused
            // at the field, in the parallel spec.
            assert_eq!(o.status.code(), Some(2), "{err}");
            assert!(err.contains(&format!("{p}:")), "{m} {p}: {err}");
            continue;
        }
        if !o.status.success() && err.contains("`float8`") {
            // Float8 under tensor parallelism: planned, refused by the export at the field.
            assert_eq!(o.status.code(), Some(2), "{err}");
            assert!(
                err.contains(&format!("{p}:")) && err.contains("tensor parallelism"),
                "{m} {p}: {err}"
            );
            done.insert(key_p);
            continue;
        }
        if !o.status.success() && err.contains("`mesh.tensor`") {
            // A model the tensor axis does not split, or whose tensor-parallel layout no
            // DTensor style writes: refused at the field, naming why.
            assert_eq!(o.status.code(), Some(2), "{err}");
            assert!(
                err.contains("do not split") || err.contains("ColwiseParallel") || err.contains("mixture of experts"),
                "{m} {p}: {err}"
            );
            continue;
        }
        if !o.status.success() {
            // The sequence does not fit this model: the pairing, not the export, failed.
            assert!(err.contains("batch.seq_len"), "{m} {p}: {err}");
            continue;
        }
        let file = out.join("train.py");
        let text = std::fs::read_to_string(&file).unwrap();
        // A pipeline program names its stages; any other names its plan by hash.
        assert!(
            text.contains("\nPIPELINE = {") || text.contains("from plan "),
            "header names the plan"
        );
        assert!(text.contains("\nGROUPS = ["), "groups written as literals");
        assert!(!text.contains("@@"), "every marker replaced");
        py_compile(&file);
        written += 1;
        done.insert(key_m);
        done.insert(key_p);
    }
    for f in files("examples/models").into_iter().map(|f| format!("m:{f}")) {
        assert!(done.contains(&f), "{f} never exported");
    }
    for f in files("examples/parallel").into_iter().map(|f| format!("p:{f}")) {
        assert!(done.contains(&f), "{f} never exported");
    }
    assert!(written > 10, "{written}");
}

#[test]
fn the_literals_are_the_plans_decisions() {
    let d = tempfile::tempdir().unwrap();
    let spec = d.path().join("p.yaml");
    std::fs::write(
        &spec,
        "mesh: {replicate: 2, shard: 2}\ngpus_per_node: 4\nreshard_after_forward: false\n\
         prefetch: {forward: 2, backward: 1}\nactivation_checkpointing: {every: 2}\n\
         mixed_precision: {param: bf16, reduce: f32}\noffload: cpu\n\
         batch: {per_rank: 2, seq_len: 16, grad_accum: 2, grad_sync: final_micro_batch}\n",
    )
    .unwrap();
    let o = export("examples/models/tiny-llama.yaml", spec.to_str().unwrap(), d.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(d.path().join("train.py")).unwrap();
    check_mesh(&text, &[("expert", 1), ("replicate", 2), ("shard", 2), ("tensor", 1)]);
    for want in [
        "{\"experts\": False, \"modules\": [\"layers.0\"], \"reshard_after_forward\": False}",
        // The root keeps its parameters, as FSDP2's root does.
        "{\"experts\": False, \"modules\": [], \"reshard_after_forward\": False}",
        // Prefetch depth 2 in forward: the root's pre-forward gathers both blocks.
        "[\"<root>\", [\"layers.0\", \"layers.1\"]]",
        "\"kind\": \"full\", \"save\": []",
        "\"blocks\": [\"layers.0\"]",
        "MIXED_PRECISION = {\"param\": \"bf16\", \"reduce\": \"f32\"}",
        "OFFLOAD = True",
        "\"grad_sync\": \"final_micro_batch\"",
        "[\"model.layers.0.self_attn.k_proj.weight\", [32, 64], [\"normal\", 0.02, 3]]",
        // The allocator the plan models (expandable segments by default), and nothing compiled.
        "ALLOCATOR = {\"expandable_segments\": True}",
        "COMPILE = {\"loss\": False, \"model\": False}",
    ] {
        assert!(text.contains(want), "`{want}` not in the program:\n{text}");
    }
}

/// A tensor-parallel plan's literals: the mesh's tensor axis, torchtitan's options, and
/// every parameter whole (each rank cuts its own slice), numbered as without the axis.
#[test]
fn a_tensor_parallel_plan_writes_its_mesh_options_and_whole_parameters() {
    let d = tempfile::tempdir().unwrap();
    let (tp, flat) = (d.path().join("tp"), d.path().join("flat"));
    let model = "examples/models/tiny-llama.yaml";
    let o = export(model, "examples/parallel/fsdp-tp-2x2-cpu.yaml", &tp);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("x tensor 2"), "{}", stdout(&o));
    let o = export(model, "examples/parallel/fsdp-1x4-cpu.yaml", &flat);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(tp.join("train.py")).unwrap();
    let whole = std::fs::read_to_string(flat.join("train.py")).unwrap();
    assert_eq!(literal(&text, "PARAMS"), literal(&whole, "PARAMS"));
    check_mesh(&text, &[("expert", 1), ("replicate", 1), ("shard", 2), ("tensor", 2)]);
    let tensor = literal(&text, "TENSOR");
    for want in [
        "\"async\": False",
        "\"degree\": 2",
        "\"loss_parallel\": True",
        "\"sequence_parallel\": True",
        "\"split_vocab\": True",
    ] {
        assert!(tensor.contains(want), "`{want}` not in {tensor}");
    }
    assert!(text.contains("tensor groups of 2"), "{text}");
    assert!(whole.contains("\nTENSOR = None\n"));
    py_compile(&tp.join("train.py"));
    // Async TP rides on the compiled blocks: with `compile: true` it is written as planned
    // (and the compiled program's losses are checked against eager by the tests below).
    let spec = d.path().join("tp-async.yaml");
    std::fs::write(
        &spec,
        "mesh: {shard: 2, tensor: 2}\ngpus_per_node: 4\nruntime: fsdp2\ncompile: true\n\
         tensor_parallel: {async: true}\nbatch: {per_rank: 2, seq_len: 16}\n",
    )
    .unwrap();
    let out = d.path().join("async");
    let o = export(model, spec.to_str().unwrap(), &out);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(out.join("train.py")).unwrap();
    assert!(literal(&text, "TENSOR").contains("\"async\": True"), "{text}");
    assert_eq!(literal(&text, "COMPILE"), "COMPILE = {\"loss\": True, \"model\": True}");
    py_compile(&out.join("train.py"));
}

#[test]
fn a_plan_file_exports_as_its_specs_do() {
    let d = tempfile::tempdir().unwrap();
    let plan = d.path().join("plan.json");
    shardplan_ok(&[
        "plan",
        "--model",
        "examples/models/tiny-gpt2.yaml",
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--format",
        "json",
        "--out",
        plan.to_str().unwrap(),
    ]);
    let (a, b) = (d.path().join("a"), d.path().join("b"));
    let o = export(
        "examples/models/tiny-gpt2.yaml",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        &a,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    shardplan_ok(&[
        "export",
        "fsdp2",
        "--plan",
        plan.to_str().unwrap(),
        "--out",
        b.to_str().unwrap(),
    ]);
    // Everything but the command line in the header is the same.
    let body = |p: &Path| {
        let t = std::fs::read_to_string(p.join("train.py")).unwrap();
        t.lines().skip(3).collect::<Vec<_>>().join("\n")
    };
    assert_eq!(body(&a), body(&b));
}

#[test]
fn a_hand_edited_issue_order_is_exported_as_edited() {
    let d = tempfile::tempdir().unwrap();
    let base = "examples/parallel/fsdp-1x4-cpu.yaml";
    let deep = d.path().join("deep.yaml");
    std::fs::write(
        &deep,
        format!(
            "{}prefetch: {{forward: 2, backward: 2}}\n",
            std::fs::read_to_string(base).unwrap()
        ),
    )
    .unwrap();
    let plan_of = |parallel: &str, name: &str| {
        let out = d.path().join(name);
        shardplan_ok(&[
            "plan",
            "--model",
            "tiny-llama",
            "--parallel",
            parallel,
            "--format",
            "json",
            "--out",
            out.to_str().unwrap(),
        ]);
        let p: shardplan_planner::Plan = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        (out, p)
    };
    let (p1_path, p1) = plan_of(base, "p1.json");
    let (_, p2) = plan_of(deep.to_str().unwrap(), "p2.json");
    // The depth-1 spec with the depth-2 issue order written into its program.
    let edited = d.path().join("edited.json");
    std::fs::write(&edited, edit::with_schedule_of(&p1, &p2).to_string()).unwrap();
    let program = |plan: &Path, out: &str| {
        let dir = d.path().join(out);
        shardplan_ok(&[
            "export",
            "fsdp2",
            "--plan",
            plan.to_str().unwrap(),
            "--out",
            dir.to_str().unwrap(),
        ]);
        std::fs::read_to_string(dir.join("train.py")).unwrap()
    };
    let (plain, deeper) = (program(&p1_path, "plain"), program(&edited, "edited"));
    assert!(plain.contains("[\"<root>\", [\"layers.0\"]]"), "{plain}");
    assert!(
        deeper.contains("[\"<root>\", [\"layers.0\", \"layers.1\"]]"),
        "{deeper}"
    );
}

#[test]
fn plans_fsdp2_cannot_run_as_planned_are_refused() {
    let d = tempfile::tempdir().unwrap();
    // GPT-2's head reads the token embedding: wrapped on its own, FSDP2 would reshard it
    // after the embedding's forward and hand the head a sharded weight.
    let spec = d.path().join("tied.yaml");
    std::fs::write(
        &spec,
        "mesh: {shard: 4}\ngpus_per_node: 4\nwrap_modules: [wte]\nbatch: {per_rank: 2, seq_len: 16}\n",
    )
    .unwrap();
    let o = export("examples/models/tiny-gpt2.yaml", spec.to_str().unwrap(), d.path());
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("tied.yaml") && err.contains("wrap_modules") && err.contains("help:"),
        "{err}"
    );
    assert!(
        !d.path().join("train.py").exists(),
        "nothing written for a refused plan"
    );
    // Tensor parallelism that no DTensor style expresses is refused naming the API: GPT-2's
    // Conv1D layers (at the model's family), a head tied to the embedding (at the mesh's
    // field).
    let tied = d.path().join("tied-llama.yaml");
    let llama = std::fs::read_to_string("examples/models/tiny-llama.yaml").unwrap();
    std::fs::write(&tied, format!("{llama}tie_embeddings: true\n")).unwrap();
    for (model, file, field, api) in [
        (
            "examples/models/tiny-gpt2.yaml",
            "tiny-gpt2.yaml",
            "`family`",
            "ColwiseParallel",
        ),
        (
            tied.to_str().unwrap(),
            "fsdp-tp-2x2-cpu.yaml:4:",
            "`mesh.tensor`",
            "ColwiseParallel",
        ),
    ] {
        let o = export(model, "examples/parallel/fsdp-tp-2x2-cpu.yaml", d.path());
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{model}: {err}");
        assert!(
            err.contains(file) && err.contains(field) && err.contains(api) && err.contains("help:"),
            "{model}: {err}"
        );
        assert!(!d.path().join("train.py").exists());
    }
    // A missing --out or specs is a usage error, not a panic.
    let o = shardplan(&["export", "fsdp2", "--model", "examples/models/tiny-gpt2.yaml"]);
    assert_eq!(o.status.code(), Some(2));
}

/// The context-parallel specs the tests below export (name, spec): head-tail balance and
/// the all-gather rotation on one context group of 2 (torchtitan's defaults); no balance
/// and the ring on shard 2 x context 2; HSDP over two context groups, bf16; context 2 x
/// tensor 2 with sequence parallelism (torchtitan's CP x TP: the tensor groups innermost).
const CONTEXT_SPECS: [(&str, &str); 4] = [
    (
        "cp-2",
        "mesh: {shard: 1, context: 2}\ngpus_per_node: 2\nmixed_precision: {param: f32, reduce: f32}\n\
         batch: {per_rank: 4, seq_len: 16}\n",
    ),
    (
        "cp-2x2-ring",
        "mesh: {shard: 2, context: 2}\ngpus_per_node: 4\nmixed_precision: {param: f32, reduce: f32}\n\
         batch: {per_rank: 2, seq_len: 16}\ncontext_parallel: {rotate: alltoall, load_balance: none}\n",
    ),
    (
        "hsdp-cp-2",
        "mesh: {replicate: 2, shard: 1, context: 2}\ngpus_per_node: 4\n\
         mixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 2, seq_len: 32}\n",
    ),
    (
        "cp-2-tp-2",
        "mesh: {shard: 1, context: 2, tensor: 2}\ngpus_per_node: 4\n\
         mixed_precision: {param: f32, reduce: f32}\nbatch: {per_rank: 4, seq_len: 16}\n\
         tensor_parallel: {sequence_parallel: true}\n",
    ),
];

/// Writes the spec `name` of [`CONTEXT_SPECS`] into `dir`; its path and its plan (JSON,
/// read back) with the plan file's path.
fn context_spec(dir: &Path, name: &str) -> (std::path::PathBuf, shardplan_planner::Plan, std::path::PathBuf) {
    let text = CONTEXT_SPECS.iter().find(|s| s.0 == name).unwrap().1;
    let spec = dir.join(format!("{name}.yaml"));
    std::fs::write(&spec, text).unwrap();
    let plan_file = dir.join(format!("{name}.json"));
    tiny_llama_plan_file(&spec, &plan_file);
    let plan = serde_json::from_str(&std::fs::read_to_string(&plan_file).unwrap()).unwrap();
    (spec, plan, plan_file)
}

/// Plans tiny-llama under `spec` into the plan file `out` (`--format json`).
fn tiny_llama_plan_file(spec: &Path, out: &Path) {
    shardplan_ok(&[
        "plan",
        "--model",
        "examples/models/tiny-llama.yaml",
        "--parallel",
        spec.to_str().unwrap(),
        "--format",
        "json",
        "--out",
        out.to_str().unwrap(),
    ]);
}

/// A context-parallel plan's program: its mesh is torchtitan's (FSDP over shard x context,
/// the context groups innermost), CONTEXT holds the plan's degree, rotation and balance, a
/// plan file exports as its specs do, and the export says the program needs CUDA. Plans
/// without the axis (a pipeline's too) read `CONTEXT = None`, their mesh unchanged.
#[test]
fn a_context_parallel_plan_exports_its_mesh_and_layout() {
    let d = tempfile::tempdir().unwrap();
    let want = [
        (
            "cp-2",
            1,
            2,
            "{\"degree\": 2, \"load_balance\": \"head_tail\", \"rotate\": \"allgather\"}",
        ),
        (
            "cp-2x2-ring",
            1,
            4,
            "{\"degree\": 2, \"load_balance\": \"none\", \"rotate\": \"alltoall\"}",
        ),
        (
            "hsdp-cp-2",
            2,
            2,
            "{\"degree\": 2, \"load_balance\": \"head_tail\", \"rotate\": \"allgather\"}",
        ),
        (
            "cp-2-tp-2",
            1,
            2,
            "{\"degree\": 2, \"load_balance\": \"head_tail\", \"rotate\": \"allgather\"}",
        ),
    ];
    for (name, replicate, shard, context) in want {
        let (spec, plan, plan_file) = context_spec(d.path(), name);
        assert_eq!(plan.mesh.context(), 2, "{name}");
        let out = d.path().join(name);
        let o = export("examples/models/tiny-llama.yaml", spec.to_str().unwrap(), &out);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let said = String::from_utf8_lossy(&o.stdout);
        assert!(
            said.contains("context groups of 2") && said.contains(" --device cuda\n"),
            "{name}: {said}"
        );
        let file = out.join("train.py");
        py_compile(&file);
        let text = std::fs::read_to_string(&file).unwrap();
        // FSDP's shard axis is the plan's: the spec's shard x context.
        let mesh = literal(&text, "MESH");
        for field in [
            "\"context\": 2,".to_string(),
            format!("\"replicate\": {replicate},"),
            format!("\"shard\": {shard},"),
        ] {
            assert!(mesh.contains(&field), "{name}: `{field}` not in {mesh}");
        }
        assert_eq!(literal(&text, "CONTEXT"), format!("CONTEXT = {context}"), "{name}");
        assert!(text.contains(", context groups of 2"), "{name}: header");
        // A plan file for shardplan's runtime runs the ring on the all-to-all stream,
        // between pieces of a block's step, and `prefetch: auto` may gather there (cp-2
        // does): refused, naming the way out. Planned for `runtime: fsdp2`, the plan file's
        // program is the specs' (but for the command line).
        let from_plan = d.path().join(format!("{name}-plan"));
        let export_plan = |file: &Path| {
            shardplan(&[
                "export",
                "fsdp2",
                "--plan",
                file.to_str().unwrap(),
                "--out",
                from_plan.to_str().unwrap(),
            ])
        };
        let o = export_plan(&plan_file);
        assert!(
            name != "cp-2" || !o.status.success(),
            "cp-2's gather between pieces was exported"
        );
        if !o.status.success() {
            assert_eq!(o.status.code(), Some(2), "{name}");
            let err = stderr(&o);
            assert!(
                err.contains("not at its start") && err.contains("`runtime: fsdp2`"),
                "{name}: {err}"
            );
        }
        let fsdp2_spec = d.path().join(format!("{name}-fsdp2.yaml"));
        let spec_text = std::fs::read_to_string(&spec).unwrap();
        std::fs::write(&fsdp2_spec, format!("{spec_text}runtime: fsdp2\n")).unwrap();
        let fsdp2_plan = d.path().join(format!("{name}-fsdp2.json"));
        tiny_llama_plan_file(&fsdp2_spec, &fsdp2_plan);
        let o = export_plan(&fsdp2_plan);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let from_spec = d.path().join(format!("{name}-fsdp2"));
        let o = export(
            "examples/models/tiny-llama.yaml",
            fsdp2_spec.to_str().unwrap(),
            &from_spec,
        );
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let body = |t: &str| t.lines().skip(3).collect::<Vec<_>>().join("\n");
        let want = std::fs::read_to_string(from_spec.join("train.py")).unwrap();
        let again = std::fs::read_to_string(from_plan.join("train.py")).unwrap();
        assert_eq!(body(&want), body(&again), "{name}");
    }
    for (name, parallel) in [
        ("plain", "examples/parallel/fsdp-1x4-cpu.yaml"),
        ("pipeline", "examples/parallel/pp-2-fsdp-2-cpu.yaml"),
    ] {
        let out = d.path().join(name);
        let o = export("examples/models/tiny-llama.yaml", parallel, &out);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let text = std::fs::read_to_string(out.join("train.py")).unwrap();
        assert_eq!(literal(&text, "CONTEXT"), "CONTEXT = None", "{name}");
        assert!(!literal(&text, "MESH").contains("context"), "{name}");
        py_compile(&out.join("train.py"));
    }
}

/// torch's context_parallel attends only in CUDA's SDPA kernels (its dispatcher has no
/// rule for the CPU's `_scaled_dot_product_flash_attention_for_cpu`), so on the CPU the
/// exported program refuses to train, saying why. What runs there is checked with
/// `--check-context-layout` under torchrun (gloo): torch's mesh, its data-parallel and
/// context indices, and its head-tail (or plain) sharding of tokens, targets and rotary
/// tables are the plan's (`Mesh::context_index`, `Mesh::data_index`,
/// `ContextLayout::positions`), and the forward runs up to the first attention, where
/// torch's CP dispatcher stops.
#[test]
fn a_context_parallel_program_shards_as_the_plan_lays_out() {
    let Some(py) = torch_python() else {
        assert!(std::env::var("CI").is_err(), "CI runs this test: its venv has torch");
        eprintln!("skipped: no Python with torch, safetensors and numpy (set SHARDPLAN_TORCH_PYTHON)");
        return;
    };
    let d = tempfile::tempdir().unwrap();
    for (k, (name, _)) in CONTEXT_SPECS.iter().enumerate() {
        let (spec, plan, _) = context_spec(d.path(), name);
        let out = d.path().join(name);
        let o = export("examples/models/tiny-llama.yaml", spec.to_str().unwrap(), &out);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let program = out.join("train.py");
        if k == 0 {
            // Training on the CPU is refused before any process group is made.
            let o = Command::new(&py).arg(&program).args(["--steps", "1"]).output().unwrap();
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(1), "{err}");
            assert!(
                err.contains("context_parallel")
                    && err.contains("_scaled_dot_product_flash_attention_for_cpu")
                    && err.contains("--device cuda"),
                "{err}"
            );
        }
        let world = plan.mesh.world();
        let o = Command::new(&py)
            .args(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"])
            .arg(world.to_string())
            .arg(&program)
            .args(["--check-context-layout", "--threads", "1"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(o.status.success(), "{name}: {text}\n{}", stderr(&o));
        let lines: Vec<serde_json::Value> = text
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len() as u64, world, "{name}: {text}");
        let c = plan.mesh.context();
        let layout = shardplan_ir::ContextLayout {
            degree: c,
            balance: plan.policy.context_parallel.load_balance,
        };
        let local = plan.policy.seq_len / c;
        for line in &lines {
            let rank = line["rank"].as_u64().unwrap();
            let cr = plan.mesh.context_index(rank);
            assert_eq!(line["context_rank"].as_u64(), Some(cr), "{name}: {line}");
            assert_eq!(
                line["tensor_rank"].as_u64(),
                Some(plan.mesh.coords(rank).tensor),
                "{name}: {line}"
            );
            assert_eq!(
                line["data_rank"].as_u64(),
                Some(plan.mesh.data_index(rank)),
                "{name}: {line}"
            );
            let positions: Vec<u64> = line["positions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p.as_u64().unwrap())
                .collect();
            assert_eq!(positions, layout.positions(cr, local), "{name}: rank {rank}");
            assert_eq!(line["rows_alike"], true, "{name}: {line}");
            assert_eq!(line["buffers_match"], true, "{name}: {line}");
            // FSDP shards over replicate x (shard x context), the plan's axes.
            let (names, shape) = if plan.mesh.replicate() > 1 {
                (
                    serde_json::json!(["replicate", "dp_shard_cp"]),
                    serde_json::json!([plan.mesh.replicate(), plan.mesh.shard()]),
                )
            } else {
                (
                    serde_json::json!(["dp_shard_cp"]),
                    serde_json::json!([plan.mesh.shard()]),
                )
            };
            assert_eq!(line["fsdp_mesh"]["names"], names, "{name}: {line}");
            assert_eq!(line["fsdp_mesh"]["shape"], shape, "{name}: {line}");
            let forward = line["forward"].as_str().unwrap();
            assert!(
                forward.starts_with("stopped in attention: ")
                    && forward.contains("_scaled_dot_product_flash_attention_for_cpu"),
                "{name}: {forward}"
            );
        }
    }
}

/// `benches/fsdp2_export.py` on the small models, 2 steps, memory checked, the ranks forked
/// from one Python (`--launcher fork`: torch imported once a run, not five times), with
/// `extra` arguments; its output, once it has exited 0.
fn run_export_check(py: &str, extra: &[&str]) -> String {
    let out = tempfile::tempdir().unwrap();
    let o = Command::new("python3")
        .args([
            "benches/fsdp2_export.py",
            "--steps",
            "2",
            "--size",
            "small",
            "--memory-check",
            "--launcher",
            "fork",
        ])
        .args(extra)
        .args(["--python", py, "--shardplan"])
        .arg(env!("CARGO_BIN_EXE_shardplan"))
        .arg("--out")
        .arg(out.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{text}\n{}", String::from_utf8_lossy(&o.stderr));
    text
}

/// Every option the exporter writes code for, once, on the Llama; GPT-2 (learned
/// positions, biases, GELU, its own HF names) as a family, and loading its HF weights.
/// `SHARDPLAN_EXPORT_FULL=1` runs every configuration on both (24 runs, as
/// `benches/fsdp2_export.py` does by default): accumulation reducing every micro-batch
/// takes the exporter's code path of one micro-batch, and GPT-2's memory under each option
/// differs from the Llama's only by its sizes.
#[test]
fn exported_programs_train_as_shardplan_does() {
    let configs = [
        "1x4",
        "hsdp-2x2",
        "no-reshard",
        "prefetch-2",
        "full-ac",
        "selective-ac",
        "accum-2-every",
        "accum-2-final",
        "bf16",
        "offload",
        "init-from",
        "tokens",
    ];
    // Full checkpointing runs in the tensor-parallel, expert-parallel and pipeline tests;
    // no-reshard and prefetch-2 change the literals only (the_literals_are_the_plans_decisions).
    let in_ci = |model: &str, c: &str| match model {
        "llama" => !matches!(c, "accum-2-every" | "no-reshard" | "prefetch-2" | "full-ac"),
        _ => c == "1x4",
    };
    let all = ["llama", "gpt2"]
        .iter()
        .flat_map(|m| configs.iter().map(move |c| (*m, *c)));
    let (runs, more): (Vec<_>, Vec<_>) = all.partition(|(m, c)| in_ci(m, c));
    let named = |v: Vec<(&str, &str)>| v.iter().map(|(m, c)| format!("{m}/{c}")).collect::<Vec<_>>();
    check_runs(&named(runs), &named(more));
}

/// torch.distributed's functions that take no tensor (setup, queries, the barrier, which
/// NCCL runs on the device the group was made with).
const NO_TENSOR: [&str; 7] = [
    "init_process_group",
    "destroy_process_group",
    "barrier",
    "get_world_size",
    "get_rank",
    "ReduceOp",
    "is_initialized",
];

/// Every torch.distributed call of `program` that hands it a tensor, with the name of that
/// tensor and the lines of the function it is made in, checked to be made on the process
/// group's device: each assignment to the name in that function says `device=device` (the
/// device `start` made the group for: CUDA under NCCL). A call whose tensor is not a plain
/// name, or a name with no assignment in its function, is reported too: the check cannot
/// see where it lives. Returns one line per problem.
fn collectives_off_device(program: &str) -> Vec<String> {
    let lines: Vec<&str> = program.lines().collect();
    let mut problems = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let code = line.split('#').next().unwrap_or("");
        for prefix in ["dist.", "torch.distributed."] {
            let mut rest = code;
            while let Some(at) = rest.find(prefix) {
                let before = rest[..at].chars().last();
                let after = &rest[at + prefix.len()..];
                rest = after;
                if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.') {
                    continue; // `torch.distributed.` seen as `dist.`, or another module's
                }
                let name: String = after
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if NO_TENSOR.contains(&name.as_str()) || !after[name.len()..].starts_with('(') {
                    continue;
                }
                let arg: String = after[name.len() + 1..]
                    .chars()
                    .take_while(|c| !matches!(c, ',' | ')'))
                    .collect::<String>()
                    .trim()
                    .to_string();
                let at_line = format!("line {}: `{}`", i + 1, line.trim());
                if arg.is_empty() || !arg.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    problems.push(format!(
                        "{at_line}: the tensor `{arg}` is not a name made in this function"
                    ));
                    continue;
                }
                // The enclosing function: the nearest `def` above with less indentation.
                let indent = line.len() - line.trim_start().len();
                let start = (0..i)
                    .rev()
                    .find(|&k| {
                        let l = lines[k];
                        l.trim_start().starts_with("def ") && l.len() - l.trim_start().len() < indent
                    })
                    .unwrap_or(0);
                let def_indent = lines[start].len() - lines[start].trim_start().len();
                let end = (start + 1..lines.len())
                    .find(|&k| {
                        let l = lines[k];
                        !l.trim().is_empty() && l.len() - l.trim_start().len() <= def_indent
                    })
                    .unwrap_or(lines.len());
                let made: Vec<&str> = lines[start..end]
                    .iter()
                    .map(|l| l.trim())
                    .filter(|l| l.starts_with(&format!("{arg} = ")))
                    .collect();
                if made.is_empty() {
                    problems.push(format!("{at_line}: `{arg}` is not made in its function"));
                }
                for m in made {
                    if !m.contains("device=device") {
                        problems.push(format!(
                            "{at_line}: `{m}` does not put `{arg}` on the process group's device"
                        ));
                    }
                }
            }
        }
    }
    problems
}

#[test]
fn every_collective_of_the_program_gets_a_tensor_on_the_process_groups_device() {
    // Under NCCL a CPU tensor handed to a collective fails ("No backend type associated
    // with device type cpu"); gloo takes it, so CPU runs cannot show it. Checked on the
    // program text: the body is the same for every plan, so two plans cover it (one with
    // a validation file, whose loss is reduced too).
    let d = tempfile::tempdir().unwrap();
    let val = d.path().join("val.bin");
    std::fs::write(&val, vec![1u8; 2 * 4096]).unwrap();
    let spec = d.path().join("p.yaml");
    std::fs::write(
        &spec,
        format!(
            "mesh: {{shard: 4}}\ngpus_per_node: 4\nbatch: {{per_rank: 2, seq_len: 16}}\n\
             data: {{tokens: {0}, val: {0}, eval_every: 2, eval_batches: 1}}\n",
            val.display()
        ),
    )
    .unwrap();
    for (k, (m, p)) in [
        ("examples/models/tiny-llama.yaml", "examples/parallel/fsdp-1x4-cpu.yaml"),
        ("examples/models/tiny-gpt2.yaml", spec.to_str().unwrap()),
    ]
    .into_iter()
    .enumerate()
    {
        let out = d.path().join(format!("e{k}"));
        let o = export(m, p, &out);
        assert!(o.status.success(), "{m} {p}: {}", stderr(&o));
        let text = std::fs::read_to_string(out.join("train.py")).unwrap();
        let problems = collectives_off_device(&text);
        assert!(problems.is_empty(), "{m} {p}:\n{}", problems.join("\n"));
        // The check sees the program's collectives: the loss, validation and peak reductions.
        let calls = text.matches("dist.all_reduce(").count();
        assert!(calls >= 3, "{calls} all_reduce calls in the program");
    }
    // And it catches a tensor made on the host, as the peaks once were.
    let bad = "def f(device):\n    x = torch.tensor([1.0], dtype=torch.float64)\n    dist.all_reduce(x)\n";
    assert_eq!(collectives_off_device(bad).len(), 1);
    let unknown = "def f(device):\n    dist.broadcast(g(), 0)\n";
    assert_eq!(collectives_off_device(unknown).len(), 1);
    let good = "def f(device):\n    x = torch.zeros((), device=device)\n    x += 1\n    dist.all_reduce(x)\n";
    assert!(collectives_off_device(good).is_empty());
}

/// Qwen3's head norms and two mixtures of experts (Qwen's: a gated shared expert, a dense
/// first layer, the load-balancing loss; Mixtral's names with sigmoid scores) trained by the
/// exported program and by `shardplan train`: the same losses, and FSDPMemTracker's peak
/// within the bound of the `runtime: fsdp2` prediction, selective checkpointing included.
/// `SHARDPLAN_EXPORT_FULL=1` adds the rest of the 3 x 4 matrix.
#[test]
fn exported_qwen3_and_moe_programs_train_as_shardplan_does() {
    check_runs(
        &["qwen3/1x4", "moe/1x4", "moe/selective-ac", "mixtral/1x4"],
        &[
            "qwen3/selective-ac",
            "qwen3/accum-2-final",
            "qwen3/bf16",
            "moe/accum-2-final",
            "moe/bf16",
            "mixtral/selective-ac",
            "mixtral/accum-2-final",
            "mixtral/bf16",
        ],
    );
}

/// `benches/fsdp2_export.py` (as `run_export_check`) on `runs` (`model/config`), and on
/// `more` as well when SHARDPLAN_EXPORT_FULL is set: every run within tolerance. Skipped
/// without a Python that has torch. CI runs `runs` only: one run per code path of the
/// exporter (an option it writes code for, a model family, expert parallelism and what
/// moves its collectives); about 25 s a run on a 2-core box.
fn check_runs<S: AsRef<str>>(runs: &[S], more: &[S]) {
    let Some(py) = torch_python() else {
        eprintln!("skipped: no Python with torch, safetensors and numpy (set SHARDPLAN_TORCH_PYTHON)");
        return;
    };
    let full = std::env::var_os("SHARDPLAN_EXPORT_FULL").is_some_and(|v| v != "0");
    let mut all: Vec<&str> = runs.iter().map(|r| r.as_ref()).collect();
    if full {
        all.extend(more.iter().map(|r| r.as_ref()));
    }
    let list = all.join(",");
    let text = run_export_check(&py, &["--runs", &list]);
    assert!(
        text.contains(&format!("all {} runs within tolerance", all.len())),
        "{text}"
    );
}

/// torch.compile as torchtitan applies it (`compile: true`: each block and the loss), on 4
/// CPU ranks with inductor, 5 steps: the compiled program's losses equal its eager twin's
/// and `shardplan train`'s within 1e-4, and its peak (the CPU allocator's count under
/// torch.profiler: FSDPMemTracker cannot watch a compiled program) is within 5% of the
/// compiled prediction, as the eager twin's, read by the same meter, is of the eager one.
/// Under tensor parallelism (FSDP 2 x TP 2, sequence and loss parallel, async TP, which
/// the CPU runs without, and selective checkpointing: torchtitan's large-run setting) the
/// compiled blocks and loss take DTensor's modules. `SHARDPLAN_EXPORT_FULL=1` adds
/// selective checkpointing compiled without tensor parallelism.
#[test]
fn exported_compiled_programs_train_as_the_eager_ones() {
    let Some(py) = torch_python() else {
        eprintln!("skipped: no Python with torch, safetensors and numpy (set SHARDPLAN_TORCH_PYTHON)");
        return;
    };
    let text = run_export_check(
        &py,
        &["--steps", "5", "--runs", "llama/compile,llama/fsdp-tp-2x2-compile"],
    );
    assert!(text.contains("all 2 runs within tolerance"), "{text}");
    if std::env::var_os("SHARDPLAN_EXPORT_FULL").is_some_and(|v| v != "0") {
        let text = run_export_check(&py, &["--steps", "5", "--runs", "llama/compile-selective-ac"]);
        assert!(text.contains("all 1 runs within tolerance"), "{text}");
    }
}

/// torchao's Float8 linears (`float8:`; `emulate=True` on the CPU) trained by the exported
/// program and by `shardplan train`'s emulation, 20 steps on 4 ranks of the tiny Llama:
/// tensorwise with the float8 all-gather and precomputed scales, rowwise_with_gw_hp, and
/// rowwise under HSDP 2 x 2 with selective checkpointing. The first step's losses agree
/// within 5e-6 and every step's within 0.5%, and the spec without `float8` is more than
/// 5e-6 from the program at step 1 (`float8_check` in the bench). The tiny model, because
/// float8 rounding turns the last bits of any upstream f32 difference (the two matmul
/// libraries sum in different orders) into whole float8 steps: at dim 256 the first step
/// differs by 1e-5 to 3e-5. Skipped without torchao. `SHARDPLAN_EXPORT_FULL=1` adds
/// tensorwise without the all-gather and plain rowwise.
#[test]
fn exported_float8_programs_train_as_shardplan_emulates() {
    let Some(py) = torch_python() else {
        eprintln!("skipped: no Python with torch, safetensors and numpy (set SHARDPLAN_TORCH_PYTHON)");
        return;
    };
    if !Command::new(&py)
        .args(["-c", "import torchao"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        eprintln!("skipped: no torchao beside torch");
        return;
    }
    let mut runs = vec![
        "llama/float8-tensorwise-ag",
        "llama/float8-rowwise-gw-hp",
        "llama/float8-hsdp-selective-ac",
    ];
    if std::env::var_os("SHARDPLAN_EXPORT_FULL").is_some_and(|v| v != "0") {
        runs.extend(["llama/float8-tensorwise", "llama/float8-rowwise"]);
    }
    let list = runs.join(",");
    let text = run_export_check(&py, &["--size", "tiny", "--steps", "20", "--runs", &list]);
    assert!(
        text.contains(&format!("all {} runs within tolerance", runs.len())),
        "{text}"
    );
}

/// Expert parallelism as torchtitan runs it under FSDP2 (the rows sent to their experts'
/// ranks and back by all-to-all, each rank's experts an FSDP unit over the ranks holding
/// them): the exported program's losses equal `shardplan train`'s on groups of 2, under
/// HSDP and accumulation (what moves the experts' collectives), and
/// FSDPMemTracker's peak lies between the `runtime: fsdp2` predictions at the even routing
/// split and at the bound; Mixtral (no shared expert, every layer routed, its own names,
/// its block's hooks firing under its experts' group) on a group of 2.
/// `SHARDPLAN_EXPORT_FULL=1` adds full checkpointing, groups of 4, bf16 parameters and
/// Mixtral under each.
#[test]
fn exported_expert_parallel_programs_train_as_shardplan_does() {
    check_runs(
        &["moe/ep-2", "moe/hsdp-ep-2", "moe/ep-2-accum-2-final", "mixtral/ep-2"],
        &[
            "moe/ep-2-full-ac",
            "moe/ep-4",
            "moe/ep-2-bf16",
            "mixtral/ep-4",
            "mixtral/hsdp-ep-2",
            "mixtral/ep-2-full-ac",
            "mixtral/ep-2-accum-2-final",
            "mixtral/ep-2-bf16",
        ],
    );
}

/// Tensor parallelism as torchtitan applies it (DTensor's styles per block, the embedding
/// and head split by vocabulary, loss_parallel, then fully_shard over the data-parallel
/// slice of one mesh): 8 steps on 4 CPU ranks within 1e-5 of `shardplan train`, and
/// FSDPMemTracker's peak within 5% of the `runtime: fsdp2` prediction. FSDP 2 x TP 2 with
/// sequence and loss parallel and selective checkpointing; HSDP 2 x TP 2 (`mesh:
/// {replicate: 2, tensor: 2}`, the shard axis defaulted) with accumulation; no sequence
/// parallelism; Qwen3's head norms; a mixture of experts on an expert and a tensor axis
/// (FSDP 2 x EP 2 x TP 2: each expert's hidden units split over the tensor group, the rows
/// sent by all-to-all between ranks of one tensor rank), its peak between the predictions
/// at the even routing split and at the bound. `SHARDPLAN_EXPORT_FULL=1` adds the rest of
/// the tensor-parallel configurations (the mixtures of experts without an expert axis,
/// without sequence parallelism, and Mixtral).
#[test]
fn exported_tensor_parallel_programs_train_as_shardplan_does() {
    let Some(py) = torch_python() else {
        eprintln!("skipped: no Python with torch, safetensors and numpy (set SHARDPLAN_TORCH_PYTHON)");
        return;
    };
    let mut runs = vec![
        "llama/fsdp-tp-2x2-selective-ac",
        "llama/hsdp-tp-2x2-accum-2",
        "llama/fsdp-tp-2x2-no-sp",
        "qwen3/fsdp-tp-2x2-selective-ac",
        "moe/ep-2-tp-2",
    ];
    if std::env::var_os("SHARDPLAN_EXPORT_FULL").is_some_and(|v| v != "0") {
        runs.extend([
            "moe/moe-tp-2x2",
            "moe/moe-tp-2x2-no-sp",
            "mixtral/moe-tp-2x2",
            "llama/fsdp-tp-2x2-sp-no-lp",
            "llama/fsdp-tp-2x2-full-ac",
            "llama/fsdp-tp-2x2-offload",
            "llama/fsdp-tp-2x2-bf16",
        ]);
    }
    let list = runs.join(",");
    let text = run_export_check(&py, &["--steps", "8", "--tolerance", "1e-5", "--runs", &list]);
    assert!(
        text.contains(&format!("all {} runs within tolerance", runs.len())),
        "{text}"
    );
}

/// The exported program of a pipeline spec trains as `shardplan train` does on 4 CPU
/// ranks (gloo, torch.distributed.pipelining): 1F1B on PP 2 x FSDP 2, Interleaved1F1B
/// (two stages a rank) on PP 2 x FSDP 2, and a custom schedule through torch's
/// `_PipelineScheduleRuntime`, and PP 2 x TP 2 with full checkpointing: every step's loss
/// within 1e-5.
#[test]
fn exported_pipeline_programs_train_as_shardplan_does() {
    let Some(py) = torch_python() else {
        eprintln!("skipped: no Python with torch, safetensors and numpy (set SHARDPLAN_TORCH_PYTHON)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("s.csv"), "0F0,0F1,0B0,0B1\r\n1F0,1F1,1B0,1B1\r\n").unwrap();
    let pp_fsdp = "mesh: {pipeline: 2, shard: 2}";
    let cases = [
        // FSDP2's CPU offload inside the stages.
        (
            "1f1b-offload",
            "mesh: {pipeline: 2, shard: 2}\noffload: cpu",
            "{schedule: 1F1B, microbatches: 2}",
            2,
        ),
        (
            "interleaved",
            pp_fsdp,
            "{schedule: Interleaved1F1B, microbatches: 4}",
            4,
        ),
        ("csv", pp_fsdp, "{microbatches: 2, csv: s.csv}", 2),
        // Tensor parallelism inside the stages (torchtitan's plan), full checkpointing.
        (
            "pp-tp",
            "mesh: {pipeline: 2, tensor: 2}\nactivation_checkpointing: full",
            "{schedule: 1F1B, microbatches: 2}",
            4,
        ),
    ];
    for (name, mesh, pipeline, per_rank) in cases {
        let spec = d.join(format!("{name}.yaml"));
        std::fs::write(
            &spec,
            format!(
                "{mesh}\ngpus_per_node: 4\nmixed_precision: {{param: f32, reduce: f32}}\nbatch: {{per_rank: {per_rank}, seq_len: 16}}\noptimizer: {{adamw: {{lr: 3.0e-3, betas: [0.9, 0.95], weight_decay: 0.1}}}}\ngrad_clip: 1.0\npipeline: {pipeline}\n"
            ),
        )
        .unwrap();
        let out = d.join(name);
        let o = export("examples/models/tiny-llama.yaml", spec.to_str().unwrap(), &out);
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
        let program = out.join("train.py");
        py_compile(&program);
        let (ours, theirs) = (
            d.join(format!("{name}-shardplan.jsonl")),
            d.join(format!("{name}-torch.jsonl")),
        );
        let o = Command::new(env!("CARGO_BIN_EXE_shardplan"))
            .args(["train", "--model", "examples/models/tiny-llama.yaml", "--parallel"])
            .arg(&spec)
            .args(["--steps", "4", "--log"])
            .arg(&ours)
            .output()
            .unwrap();
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
        let o = Command::new(&py)
            .args(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"])
            .arg(&program)
            .args(["--steps", "4", "--threads", "1", "--log-file"])
            .arg(&theirs)
            .output()
            .unwrap();
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
        let losses = |p: &Path| -> Vec<f64> {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(|l| {
                    serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                        .as_f64()
                        .unwrap()
                })
                .collect()
        };
        let (a, b) = (losses(&ours), losses(&theirs));
        assert_eq!(a.len(), 4, "{name}");
        assert_eq!(b.len(), 4, "{name}");
        for (step, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!((x - y).abs() <= 1e-5 * x.abs(), "{name}: step {}: {x} vs {y}", step + 1);
        }
    }
}

/// An exported pipeline program checkpoints in DCP as the program without a pipeline
/// does: PP 2 x FSDP 2 under Interleaved1F1B (two stages a rank) saves at step 4 of 8, and
/// the program itself, `shardplan train` of the same spec and the exported program of FSDP
/// over 4 ranks (no pipeline, the same 8 sequences a step) resume it to the straight run's
/// losses.
#[test]
fn exported_pipeline_checkpoints_resume_in_the_program_in_train_and_without_a_pipeline() {
    let Some(py) = torch_python() else {
        eprintln!("skipped: no Python with torch, safetensors and numpy (set SHARDPLAN_TORCH_PYTHON)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = "gpus_per_node: 4\nmixed_precision: {param: f32, reduce: f32}\noptimizer: {adamw: {lr: 3.0e-3, betas: [0.9, 0.95], weight_decay: 0.1}}\nlr_schedule: {warmup_steps: 2}\ngrad_clip: 1.0\n";
    let pp = d.join("pp.yaml");
    std::fs::write(
        &pp,
        format!("mesh: {{pipeline: 2, shard: 2}}\nbatch: {{per_rank: 4, seq_len: 16}}\npipeline: {{schedule: Interleaved1F1B, microbatches: 4}}\n{base}"),
    )
    .unwrap();
    let flat = d.join("flat.yaml");
    std::fs::write(
        &flat,
        format!("mesh: {{shard: 4}}\nbatch: {{per_rank: 2, seq_len: 16}}\n{base}"),
    )
    .unwrap();
    let model = "examples/models/tiny-llama.yaml";
    for (spec, out) in [(&pp, "pp"), (&flat, "flat")] {
        let o = export(model, spec.to_str().unwrap(), &d.join(out));
        assert!(o.status.success(), "{out}: {}", stderr(&o));
    }
    let ck = d.join("ck");
    let ck_arg = ck.to_str().unwrap();
    let straight = run_program(
        &py,
        &d.join("pp/train.py"),
        &d.join("straight.jsonl"),
        &["--steps", "8", "--checkpoint-dir", ck_arg, "--checkpoint-every", "4"],
    );
    assert!(ck.join("step-4/.metadata").is_file() && ck.join("step-8/.metadata").is_file());
    let step4 = ck.join("step-4");
    let step4 = step4.to_str().unwrap();
    let resumed = run_program(
        &py,
        &d.join("pp/train.py"),
        &d.join("again.jsonl"),
        &["--steps", "8", "--resume", step4],
    );
    continues("the pipeline program", &straight, &resumed, 4);
    let log = d.join("train.jsonl");
    let o = shardplan(&[
        "train",
        "--model",
        model,
        "--parallel",
        pp.to_str().unwrap(),
        "--steps",
        "8",
        "--resume",
        step4,
        "--log",
        log.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let close = |what: &str, resumed: &[f64]| {
        assert_eq!(resumed.len(), 4, "{what}: {resumed:?}");
        for (a, b) in straight[4..].iter().zip(resumed) {
            assert!(
                ((a - b) / a).abs() < 1e-5,
                "{what}: resumed {resumed:?} vs {:?}",
                &straight[4..]
            );
        }
    };
    close("shardplan train of the pipeline spec", &log_losses(&log));
    let flat_run = run_program(
        &py,
        &d.join("flat/train.py"),
        &d.join("flat.jsonl"),
        &["--steps", "8", "--resume", step4],
    );
    close("the program without a pipeline", &flat_run);
}

/// `torchrun --nproc-per-node 4` of an exported `program` with `args`; its log's losses.
fn run_program(py: &str, program: &Path, log: &Path, args: &[&str]) -> Vec<f64> {
    let o = Command::new(py)
        .args(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"])
        .arg(program)
        .args(["--threads", "1", "--log-file"])
        .arg(log)
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{}: {}",
        program.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    log_losses(log)
}

fn log_losses(log: &Path) -> Vec<f64> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

/// `resumed` (the steps after `k`) against the straight run `straight`, to 1e-6.
fn continues(what: &str, straight: &[f64], resumed: &[f64], k: usize) {
    assert_eq!(resumed.len(), straight.len() - k, "{what}: {resumed:?}");
    for (a, b) in straight[k..].iter().zip(resumed) {
        assert!(
            ((a - b) / a).abs() < 1e-6,
            "{what}: resumed {resumed:?} vs {:?}",
            &straight[k..]
        );
    }
}

#[test]
fn dcp_checkpoints_move_between_exported_programs_and_shardplan_train() {
    let Some(py) = torch_python() else {
        assert!(std::env::var("CI").is_err(), "CI runs this test: its venv has torch");
        eprintln!("skipped: no Python with torch, safetensors and numpy (set SHARDPLAN_TORCH_PYTHON)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = "gpus_per_node: 4\nmixed_precision: {param: f32, reduce: f32}\noptimizer: {adamw: {lr: 3.0e-3, betas: [0.9, 0.95], weight_decay: 0.1}}\nlr_schedule: {warmup_steps: 2}\ngrad_clip: 1.0\n";
    let spec = |name: &str, mesh: &str, per_rank: u64| {
        let p = d.join(name);
        std::fs::write(
            &p,
            format!("mesh: {mesh}\nbatch: {{per_rank: {per_rank}, seq_len: 16}}\n{base}"),
        )
        .unwrap();
        p
    };
    // 1x4 saves; 2x2 (replicated shards) and 1x2 (half the ranks, twice the rows) resume;
    // the MoE (load-balancing loss off, so another data-parallel width continues the same
    // run) saves with its experts over 2 expert ranks and resumes on 2x2 with the same.
    let (a, b, c) = (
        spec("1x4.yaml", "{replicate: 1, shard: 4}", 1),
        spec("2x2.yaml", "{replicate: 2, shard: 2}", 1),
        spec("1x2.yaml", "{replicate: 1, shard: 2}", 2),
    );
    let (ep_a, ep_b) = (
        spec("ep-1x4.yaml", "{shard: 4, expert: 2}", 1),
        spec("ep-2x2.yaml", "{replicate: 2, shard: 2, expert: 2}", 1),
    );
    let moe = d.join("moe.yaml");
    let text = std::fs::read_to_string("examples/models/tiny-moe.yaml").unwrap();
    std::fs::write(&moe, text.replace("aux_loss_coef: 0.01", "aux_loss_coef: 0.0")).unwrap();
    let cases = [
        ("tiny-llama", "tiny-llama", &a, &b, 4),
        ("tiny-qwen3", "tiny-qwen3", &a, &c, 2),
        ("moe", moe.to_str().unwrap(), &ep_a, &ep_b, 4),
    ];
    for (tag, model, a, to, to_ranks) in cases {
        let (out_a, out_to) = (d.join(format!("{tag}-a")), d.join(format!("{tag}-to")));
        for (s, out) in [(a, &out_a), (to, &out_to)] {
            let o = export(model, s.to_str().unwrap(), out);
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        }
        // Both straight runs save at step 3 (saving changes nothing of the run).
        let (ck_torch, ck_ours) = (d.join(format!("{tag}-ck-torch")), d.join(format!("{tag}-ck-ours")));
        let torch = run_program(
            &py,
            &out_a.join("train.py"),
            &d.join(format!("{tag}-torch.jsonl")),
            &[
                "--steps",
                "8",
                "--checkpoint-every",
                "3",
                "--checkpoint-dir",
                ck_torch.to_str().unwrap(),
            ],
        );
        let ours_log = d.join(format!("{tag}-ours.jsonl"));
        let o = Command::new(env!("CARGO_BIN_EXE_shardplan"))
            .args([
                "train",
                "--model",
                model,
                "--parallel",
                a.to_str().unwrap(),
                "--steps",
                "8",
                "--log",
            ])
            .arg(&ours_log)
            .args([
                "--checkpoint-dir",
                ck_ours.to_str().unwrap(),
                "--checkpoint-every",
                "3",
                "--checkpoint-format",
                "dcp",
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let ours = log_losses(&ours_log);
        let program = out_to.join("train.py");
        let nproc = to_ranks.to_string();
        let resume_program = |from: &Path, log: &str| {
            let log = d.join(log);
            let o = Command::new(&py)
                .args([
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc-per-node",
                    &nproc,
                ])
                .arg(&program)
                .args(["--threads", "1", "--steps", "8", "--resume"])
                .arg(from)
                .arg("--log-file")
                .arg(&log)
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            log_losses(&log)
        };
        let e2e = resume_program(&ck_torch.join("step-3"), &format!("{tag}-e2e.jsonl"));
        continues(&format!("{tag}: exported -> exported"), &torch, &e2e, 3);
        let s2e = resume_program(&ck_ours.join("step-3"), &format!("{tag}-s2e.jsonl"));
        continues(&format!("{tag}: shardplan train -> exported"), &torch, &s2e, 3);
        let e2s_log = d.join(format!("{tag}-e2s.jsonl"));
        let o = Command::new(env!("CARGO_BIN_EXE_shardplan"))
            .args([
                "train",
                "--model",
                model,
                "--parallel",
                to.to_str().unwrap(),
                "--steps",
                "8",
                "--resume",
            ])
            .arg(ck_torch.join("step-3"))
            .arg("--log")
            .arg(&e2s_log)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        continues(
            &format!("{tag}: exported -> shardplan train"),
            &ours,
            &log_losses(&e2s_log),
            3,
        );
    }
}

#[test]
fn exported_programs_write_and_read_torchtitans_names() {
    let Some(py) = torch_python() else {
        assert!(std::env::var("CI").is_err(), "CI runs this test: its venv has torch");
        eprintln!("skipped: no Python with torch, safetensors and numpy (set SHARDPLAN_TORCH_PYTHON)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = "examples/parallel/fsdp-1x4-cpu.yaml";
    let out = d.join("export");
    let o = export("tiny-llama", spec, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let program = out.join("train.py");
    let ck = d.join("ck");
    let straight = run_program(
        &py,
        &program,
        &d.join("straight.jsonl"),
        &[
            "--steps",
            "6",
            "--checkpoint-dir",
            ck.to_str().unwrap(),
            "--checkpoint-every",
            "3",
            "--names",
            "torchtitan",
        ],
    );
    let step3 = ck.join("step-3");
    let md = shardplan_dcp::Checkpoint::open(&step3).unwrap().metadata;
    for key in [
        "tok_embeddings.weight",
        "layers.0.attention.wq.weight",
        "optimizer.state.layers.1.feed_forward.w2.weight.exp_avg",
    ] {
        assert!(md.entry(key).is_some(), "{key} not written");
    }
    assert!(md.entry("model.embed_tokens.weight").is_none());
    // Read back by the program itself and by shardplan, each with its own rotary permutation.
    let again = run_program(
        &py,
        &program,
        &d.join("again.jsonl"),
        &[
            "--steps",
            "6",
            "--resume",
            step3.to_str().unwrap(),
            "--names",
            "torchtitan",
        ],
    );
    continues("exported -> exported under torchtitan's names", &straight, &again, 3);
    let log = d.join("ours.jsonl");
    let o = Command::new(env!("CARGO_BIN_EXE_shardplan"))
        .args([
            "train",
            "--model",
            "tiny-llama",
            "--parallel",
            spec,
            "--steps",
            "6",
            "--names",
            "torchtitan",
            "--resume",
        ])
        .arg(&step3)
        .arg("--log")
        .arg(&log)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    continues(
        "exported -> shardplan train under torchtitan's names",
        &straight,
        &log_losses(&log),
        3,
    );
}
