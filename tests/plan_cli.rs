//! `shardplan plan` as a user runs it: the three formats, a rank's view, budgets and bad input.

mod common;

use common::{shardplan, shardplan_ok, stderr, stdout};

fn bad(args: &[&str], want: &[&str]) {
    let o = shardplan(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "args {args:?}, stderr: {err}");
    for w in want {
        assert!(err.contains(w), "`{w}` not in stderr for {args:?}: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

fn temp(dir: &std::path::Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

const LLAMA8B: &str = "examples/models/llama3-8b.yaml";

#[test]
fn text_plan_of_the_bundled_example() {
    let o = shardplan_ok(&[
        "plan",
        "--model",
        LLAMA8B,
        "--parallel",
        "examples/parallel/fsdp-8.yaml",
    ]);
    let out = stdout(&o);
    for want in [
        "plan: llama3-8b (8,030,261,248 params) on 8 ranks: mesh 1 replicate x 8 shard",
        "memory per rank (device): peak",
        "allocated peak 40.70 GiB",
        "prefetch auto moved 1 all-gather later, peak 41.10 GiB -> 40.70 GiB (-416.02 MiB), step time not longer:",
        "g31 layers.31 (read by recompute layers.31 [s36]): issued with backward output, norm [s35] instead of backward loss, output [s34], -416.02 MiB",
        "reserved peak 45.27 GiB (PyTorch's caching allocator)",
        "device total 46.32 GiB = reserved 45.27 GiB + CUDA context 635.75 MiB + NCCL 441.00 MiB (3 communicators)",
        "fits h100-sxm's 79.60 GiB (33.28 GiB spare)",
        "optimizer state",
        "predicted step:",
        "MFU",
        "g31   layers.31",
        "g32   <root>",
        "schedule of rank 0",
        "all-gather g1 layers.1 over shard 0-7",
        "reduce-scatter g31 layers.31 avg over shard 0-7",
        "adamw step g32 <root>",
    ] {
        assert!(out.contains(want), "`{want}` not in:\n{out}");
    }
}

#[test]
fn json_plan_reads_back_and_trace_is_chrome_json() {
    let scratch = tempfile::tempdir().unwrap();
    let o = shardplan_ok(&[
        "plan",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--format",
        "json",
    ]);
    let plan: shardplan_planner::Plan = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(plan.version, shardplan_planner::PLAN_VERSION);
    assert_eq!(plan.mesh.world(), 4);
    let m = &plan.memory;
    assert!(m.reserved_peak >= m.active_peak && m.active_peak >= m.peak, "{m:?}");
    assert_eq!(m.device_total, m.reserved_peak + m.overhead.total());
    shardplan_planner::verify(&plan, None).unwrap();
    assert_eq!(
        serde_json::to_string(&plan).unwrap() + "\n",
        stdout(&o),
        "JSON -> Plan -> JSON is the identity"
    );

    let out = temp(scratch.path(), "trace.json", "");
    let o = shardplan_ok(&[
        "plan",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--format",
        "trace",
        "--rank",
        "3",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(stdout(&o).is_empty());
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let names: Vec<&str> = events
        .iter()
        .filter(|e| e["ph"] == "M")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(
        names.contains(&"rank 3") && names.contains(&"compute") && names.contains(&"all-gather"),
        "{names:?}"
    );
    assert!(
        events.iter().any(|e| e["ph"] == "X" && e["tid"] == 2),
        "reduce-scatter slices"
    );
    assert!(events.iter().any(|e| e["ph"] == "C" && e["name"] == "device memory"));
}

#[test]
fn rank_view_names_that_ranks_groups() {
    let o = shardplan_ok(&[
        "plan",
        "--model",
        LLAMA8B,
        "--parallel",
        "examples/parallel/hsdp-2x8.yaml",
        "--rank",
        "11",
    ]);
    let out = stdout(&o);
    assert!(out.contains("schedule of rank 11 (replicate 1, shard 3)"), "{out}");
    assert!(out.contains("over shard 8-15"), "{out}");
    assert!(out.contains("over replicate 3,11"), "{out}");
}

#[test]
fn a_budget_the_plan_misses_says_by_how_much_and_what_helps() {
    bad(
        &[
            "plan",
            "--model",
            LLAMA8B,
            "--parallel",
            "examples/parallel/fsdp-8.yaml",
            "--memory-budget",
            "45GiB",
        ],
        &[
            "of device memory per rank (reserved ",
            "over the memory budget of 45.00 GiB",
            "help: each of these single changes fits: `offload: cpu` (",
            "`activation_checkpointing: full` (",
        ],
    );
    // The budget is for the device total (reserved + CUDA context + NCCL), above the
    // allocated peak: 41.0 GiB allocated needs 46.2 GiB (expandable segments, the default).
    shardplan_ok(&[
        "plan",
        "--model",
        LLAMA8B,
        "--parallel",
        "examples/parallel/fsdp-8.yaml",
        "--memory-budget",
        "47GiB",
    ]);
    bad(
        &[
            "plan",
            "--model",
            LLAMA8B,
            "--parallel",
            "examples/parallel/fsdp-8.yaml",
            "--memory-budget",
            "lots",
        ],
        &["`lots` is not a size"],
    );
    bad(
        &[
            "plan",
            "--model",
            LLAMA8B,
            "--parallel",
            "examples/parallel/fsdp-8.yaml",
            "--memory-budget",
            "3parsecs",
        ],
        &["unknown unit `parsecs`"],
    );
}

#[test]
fn bad_plan_input_is_located() {
    let scratch = tempfile::tempdir().unwrap();
    let wrap = temp(
        scratch.path(),
        "wrap.yaml",
        "mesh: {shard: 4}\ngpus_per_node: 4\nwrap: [attention]\n",
    );
    bad(
        &["plan", "--model", "tiny-mlp", "--parallel", wrap.to_str().unwrap()],
        &[
            "wrap.yaml:3:7",
            "wrap policy `attention` matches no module",
            "help: wrap one of: block",
        ],
    );
    let module = temp(
        scratch.path(),
        "module.yaml",
        "mesh: {shard: 4}\ngpus_per_node: 4\nwrap_modules: [layers.0.feed_fwd]\n",
    );
    bad(
        &["plan", "--model", "tiny-llama", "--parallel", module.to_str().unwrap()],
        &[
            "module.yaml:3:15",
            "`layers.0.feed_fwd`",
            "did you mean `layers.0.feed_forward`",
        ],
    );
    let reshard = temp(
        scratch.path(),
        "reshard.yaml",
        "mesh: {shard: 8}\nreshard_after_forward: 3\n",
    );
    bad(
        &["plan", "--model", "tiny-llama", "--parallel", reshard.to_str().unwrap()],
        &["reshard.yaml:2:24", "3 does not divide the shard axis (8)"],
    );
    bad(
        &[
            "plan",
            "--model",
            "tiny-llama",
            "--parallel",
            "examples/parallel/fsdp-1x4-cpu.yaml",
            "--rank",
            "4",
        ],
        &[
            "--rank 4 is not a rank of this 4-rank mesh",
            "use --rank between 0 and 3",
        ],
    );
}

#[test]
fn wrap_modules_and_buckets_shape_the_groups() {
    let scratch = tempfile::tempdir().unwrap();
    let spec = temp(
        scratch.path(),
        "buckets.yaml",
        "mesh: {shard: 4}\ngpus_per_node: 4\nwrap_modules: [output]\nbucket_mib: 1\nbatch: {per_rank: 1, seq_len: 8}\n",
    );
    let o = shardplan_ok(&[
        "plan",
        "--model",
        "tiny-llama",
        "--parallel",
        spec.to_str().unwrap(),
        "--format",
        "json",
    ]);
    let plan: shardplan_planner::Plan = serde_json::from_str(&stdout(&o)).unwrap();
    let modules: Vec<&str> = plan.groups.iter().map(|g| g.group.module.as_str()).collect();
    assert_eq!(modules, ["layers.0+layers.1+output", "<root>"]);
}

#[test]
fn auto_finds_a_plan_shows_the_table_and_emits_a_reproducible_spec() {
    let scratch = tempfile::tempdir().unwrap();
    let spec = temp(scratch.path(), "auto.yaml", "mesh: {shard: 16}\ngpus_per_node: 8\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 1, seq_len: 8192}\n");
    let emitted = temp(scratch.path(), "emitted.yaml", "");
    let o = shardplan_ok(&[
        "plan",
        "--model",
        LLAMA8B,
        "--parallel",
        spec.to_str().unwrap(),
        "--auto",
        "--top",
        "3",
        "--emit-spec",
        emitted.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    for want in [
        "auto: ",
        "candidates planned (",
        "  #  mesh",
        "the winner, knob by knob:",
        // Knobs compare only against candidates the search planned (bounds skip the rest),
        // so which knobs get a line depends on the bounds; that some knob does is checked.
        " (vs ",
        "plan: llama3-8b",
    ] {
        assert!(out.contains(want), "`{want}` not in:\n{out}");
    }
    // The emitted spec plans to the same plan without --auto.
    let auto_json = shardplan(&[
        "plan",
        "--model",
        LLAMA8B,
        "--parallel",
        spec.to_str().unwrap(),
        "--auto",
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&auto_json.stdout).unwrap();
    assert!(v["candidates"].as_array().unwrap().len() > 10);
    let direct = shardplan_ok(&[
        "plan",
        "--model",
        LLAMA8B,
        "--parallel",
        emitted.to_str().unwrap(),
        "--format",
        "json",
    ]);
    let w: serde_json::Value = serde_json::from_slice(&direct.stdout).unwrap();
    assert_eq!(v["plan"]["programs"], w["programs"]);
    assert_eq!(v["plan"]["memory"], w["memory"]);
}

#[test]
fn auto_says_by_how_much_nothing_fits_and_what_would() {
    let scratch = tempfile::tempdir().unwrap();
    let spec = temp(scratch.path(),
        "nofit.yaml",
        "mesh: {shard: 8}\ngpus_per_node: 8\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 1, seq_len: 8192}\noffload: none\n",
    );
    bad(
        &[
            "plan",
            "--model",
            "examples/models/llama3-70b.yaml",
            "--parallel",
            spec.to_str().unwrap(),
            "--auto",
            "--memory-budget",
            "80GiB",
        ],
        &[
            "no plan fits the budget of 80.00 GiB per rank: the smallest candidate needs 156.49 GiB of device memory (76.49 GiB over: mesh 1x1x8",
            "help: offload: cpu fits",
        ],
    );
}

#[test]
fn runtime_fsdp2_prints_both_predictions_and_train_refuses_its_plan() {
    let dir = tempfile::tempdir().unwrap();
    let par = temp(
        dir.path(),
        "p.yaml",
        "mesh: {shard: 2}\ngpus_per_node: 2\nruntime: fsdp2\nbatch: {per_rank: 2, seq_len: 16}\n",
    );
    let args = ["plan", "--model", "tiny-llama", "--parallel", par.to_str().unwrap()];
    let o = shardplan_ok(&args);
    let out = stdout(&o);
    for want in [
        "runtime: fsdp2 — the figures above predict PyTorch FSDP2",
        "shardplan's executor on the same spec (kernels fused): peak ",
        " tokens/s",
        "copy g0.ag.fwd -> g0.unsharded.fwd",
    ] {
        assert!(out.contains(want), "`{want}` not in:\n{out}");
    }
    let json = dir.path().join("plan.json");
    shardplan_ok(&[&args[..], &["--format", "json", "--out", json.to_str().unwrap()]].concat());
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["policy"]["runtime"], "fsdp2");
    assert!(v["shardplan_executor"]["peak"].as_u64().unwrap() > 0);
    assert_eq!(v["shardplan_executor"]["kernels"], "fused");
    // shardplan's executor does not run FSDP2's buffers: a clear refusal, exit 2.
    bad(
        &["train", "--plan", json.to_str().unwrap(), "--steps", "1"],
        &[
            "predicts PyTorch FSDP2's run (runtime: fsdp2)",
            "--model M --parallel P",
        ],
    );
    // From the specs it trains, planned for its own runtime.
    shardplan_ok(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        par.to_str().unwrap(),
        "--steps",
        "1",
    ]);
    // --compare reads against the FSDP2 prediction and names it.
    let m = temp(
        dir.path(),
        "m.json",
        "{\"tokens_per_second\": 1000, \"step_seconds\": 0.1, \"peak_allocated\": 1000000}",
    );
    let o = shardplan_ok(&[&args[..], &["--compare", m.to_str().unwrap()]].concat());
    let out = stdout(&o);
    assert!(
        out.contains("predicted for PyTorch FSDP2 (runtime: fsdp2) vs measured"),
        "{out}"
    );
    assert!(out.contains("shardplan's executor on the same spec predicts"), "{out}");
    // A spec that asks for fused kernels as well is refused at the field.
    let fused = temp(
        dir.path(),
        "fused.yaml",
        "mesh: {shard: 2}\nruntime: fsdp2\nhardware: {base: h100-sxm, kernels: fused}\n",
    );
    bad(
        &["plan", "--model", "tiny-llama", "--parallel", fused.to_str().unwrap()],
        &["fused.yaml:3:", "hardware.kernels", "runtime: fsdp2"],
    );
}

#[test]
fn a_tensor_parallel_plan_says_its_mesh_and_collectives() {
    let o = shardplan_ok(&[
        "plan",
        "--model",
        "llama3-70b",
        "--parallel",
        "examples/parallel/fsdp-32-tp-8.yaml",
    ]);
    let out = stdout(&o);
    for want in [
        "plan: llama3-70b (70,553,706,496 params) on 256 ranks: mesh 1 replicate x 32 shard x 8 tensor",
        "tensor parallel: groups of 8 consecutive ranks (rank = (replicate x 32 + shard) x 8 + tensor), sequence parallel on, loss parallel on",
        "batch: 16 x 8192 tokens per data-parallel rank (its 8 tensor ranks share them), grad_accum 1",
        "4,194,304 tokens per step",
        "  tensor collectives ",
        "forward layers.0 [s1] +4 tensor collectives 8.00 GiB",
        "all-reduce grad_norm sum over tensor 0-7",
    ] {
        assert!(out.contains(want), "`{want}` not in:\n{out}");
    }
    // The trace nests each collective in its compute slice.
    let o = shardplan_ok(&[
        "plan",
        "--model",
        "llama3-70b",
        "--parallel",
        "examples/parallel/fsdp-32-tp-8.yaml",
        "--format",
        "trace",
    ]);
    let out = stdout(&o);
    assert!(
        out.contains("\"name\":\"tp_reduce_scatter n"),
        "no tensor collective slice in the trace"
    );
}

#[test]
fn bad_tensor_specs_exit_2_naming_the_field() {
    let scratch = tempfile::tempdir().unwrap();
    for (text, want) in [
        ("mesh: {shard: 2, tensor: 0}\n", "`mesh.tensor`: must be at least 1"),
        (
            "mesh: {shard: 1, tensor: 16}\ngpus_per_node: 8\n",
            "`mesh.tensor`: a tensor group of 16 ranks would span nodes of 8 GPUs",
        ),
        (
            "mesh: {shard: 1, tensor: 8}\nworld: 4\n",
            "`mesh.tensor`: a tensor group of 8 ranks is larger than the world of 4 ranks",
        ),
        (
            "mesh: {shard: 1, tensor: 8}\ngpus_per_node: 8\n",
            "`mesh.tensor`: the model's 4 attention heads do not split over 8 tensor ranks",
        ),
        (
            "mesh: {shard: 2, tensor: 4}\n",
            "`mesh.tensor`: the model's 2 key/value heads do not split over 4 tensor ranks",
        ),
    ] {
        let spec = temp(scratch.path(), "tp.yaml", text);
        bad(
            &["plan", "--model", "tiny-llama", "--parallel", spec.to_str().unwrap()],
            &[want],
        );
    }
}

#[test]
fn an_expert_parallel_plan_says_its_groups_bound_and_memory_at_both() {
    let o = shardplan_ok(&[
        "plan",
        "--model",
        "examples/models/qwen3-30b-a3b.config.json",
        "--parallel",
        "examples/parallel/ep-8-fsdp-64.yaml",
    ]);
    let out = stdout(&o);
    for want in [
        "plan: qwen3-30b-a3b (30,532,122,624 params) on 64 ranks: mesh 1 replicate x 64 shard (expert 8 inside shard)",
        "expert parallel: groups of 8 consecutive shard ranks, each holding 16 of every MoE layer's 128 routed experts, sharded over the 8 ranks holding the same ones",
        "routing bound: each rank receives at most 131,072 rows per MoE layer (moe.capacity 2 x the even split), memory below is at the bound; at the even split (65,536 rows) allocated peak ",
        "layers.0.experts ",
        "expert all-to-all ",
    ] {
        assert!(out.contains(want), "`{want}` not in:\n{out}");
    }
}

/// FSDP2 running expert parallelism (what `export fsdp2` writes): planned with FSDP2's
/// buffers, the experts' unit gathered over the ranks holding them, memory at the routing
/// bound and at the even split, which is below it.
#[test]
fn runtime_fsdp2_plans_expert_parallelism_at_both_splits() {
    let scratch = tempfile::tempdir().unwrap();
    let spec = temp(
        scratch.path(),
        "ep.yaml",
        "mesh: {shard: 4, expert: 2}\ngpus_per_node: 4\nbatch: {per_rank: 2, seq_len: 64}\nruntime: fsdp2\n",
    );
    let args = [
        "plan",
        "--model",
        "examples/models/tiny-moe.yaml",
        "--parallel",
        spec.to_str().unwrap(),
    ];
    let out = stdout(&shardplan_ok(&args));
    for want in [
        "routing bound: each rank receives at most ",
        "all-gather g2 layers.1.experts over expert-shard 0,2",
        "FSDP2",
    ] {
        assert!(out.contains(want), "`{want}` not in:\n{out}");
    }
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&shardplan_ok(&[&args[..], &["--format", "json"]].concat()))).unwrap();
    let bound = json["memory"]["peak"].as_u64().unwrap();
    let even = json["experts"]["even"][0].as_u64().unwrap();
    assert!(even < bound, "even {even} bound {bound}");
    assert_eq!(json["policy"]["runtime"], "fsdp2");
    // --compare sets a run's peak beside both.
    let m = temp(
        scratch.path(),
        "m.json",
        &format!("{{\"peak_allocated\": {}}}", (even + bound) / 2),
    );
    let out = stdout(&shardplan_ok(
        &[&args[..], &["--compare", m.to_str().unwrap()]].concat(),
    ));
    for want in [
        "peak allocated per rank",
        "  at the even routing split",
        "  reserved at the even split",
        "at the routing bound, moe.capacity 2x the even split",
    ] {
        assert!(out.contains(want), "`{want}` not in:\n{out}");
    }
    let ratio = |row: &str| -> f64 {
        let line = out.lines().find(|l| l.contains(row)).unwrap();
        line.split_whitespace()
            .last()
            .unwrap()
            .trim_end_matches('x')
            .parse()
            .unwrap()
    };
    assert!(
        ratio("peak allocated per rank") < 1.0 && ratio("at the even routing split") > 1.0,
        "{out}"
    );
}

#[test]
fn a_token_dropping_plan_says_each_experts_capacity() {
    let scratch = tempfile::tempdir().unwrap();
    // 2 x 16 tokens, top 2, 8 experts: 64 assignments a rank, 10 each at factor 1.25.
    for (mesh, received) in [
        ("{shard: 4}", ""),
        (
            "{shard: 4, expert: 2}",
            "; each rank receives at most 80 rows per MoE layer",
        ),
    ] {
        let spec = temp(
            scratch.path(),
            "drop.yaml",
            &format!(
                "mesh: {mesh}\ngpus_per_node: 4\nbatch: {{per_rank: 2, seq_len: 16}}\nmoe: {{capacity_factor: 1.25}}\n"
            ),
        );
        let o = shardplan_ok(&[
            "plan",
            "--model",
            "examples/models/tiny-moe.yaml",
            "--parallel",
            spec.to_str().unwrap(),
        ]);
        let out = stdout(&o);
        let want = format!("token dropping: each expert keeps at most 10 of a rank's 64 assignments per MoE layer (moe.capacity_factor 1.25; first choices first, then token order), the rest add nothing; every shape is exact{received}\n");
        assert!(out.contains(&want), "`{want}` not in:\n{out}");
        assert!(!out.contains("routing bound"), "{out}");
    }
}

#[test]
fn bad_expert_specs_exit_2_naming_the_field() {
    let scratch = tempfile::tempdir().unwrap();
    let moe = "examples/models/tiny-moe.yaml";
    for (model, text, want) in [
        (
            moe,
            "mesh: {shard: 4, expert: 3}\ngpus_per_node: 4\n",
            "`mesh.expert`: an expert group of 3 ranks does not divide the shard axis of 4 ranks",
        ),
        (
            "tiny-llama",
            "mesh: {shard: 4, expert: 2}\ngpus_per_node: 4\n",
            "`mesh.expert`: an expert group of 2 ranks needs a model with routed experts; tiny-llama has none",
        ),
        (
            moe,
            "mesh: {shard: 4, expert: 2}\ngpus_per_node: 4\nmoe: {capacity: 0.5}\n",
            "`moe.capacity`: must be at least 1.0 (the even split), got 0.5",
        ),
        (
            moe,
            "mesh: {shard: 8, expert: 8}\ngpus_per_node: 8\nruntime: fsdp2\nactivation_checkpointing: selective\n",
            "`activation_checkpointing`: FSDP2 cannot run selective checkpointing with an expert axis",
        ),
        (
            moe,
            "mesh: {shard: 16, expert: 16}\ngpus_per_node: 8\n",
            "`mesh.expert`: the model's 8 routed experts do not split evenly over 16 expert ranks",
        ),
        (
            moe,
            "mesh: {shard: 4, expert: 2}\ngpus_per_node: 4\nmoe: {capacity: 2.0, capacity_factor: 1.25}\n",
            "`moe.capacity_factor`: `moe.capacity` bounds dropless routing, `moe.capacity_factor` drops the tokens past each expert's capacity",
        ),
        (
            moe,
            "mesh: {shard: 4}\ngpus_per_node: 4\nmoe: {capacity_factor: 0}\n",
            "`moe.capacity_factor`: must be above 0 (1.0: each expert's even share), got 0",
        ),
        (
            "tiny-llama",
            "mesh: {shard: 4}\ngpus_per_node: 4\nmoe: {capacity_factor: 1.25}\n",
            "`moe.capacity_factor`: token dropping needs a model with routed experts; tiny-llama has none",
        ),
    ] {
        let spec = temp(scratch.path(), "ep.yaml", &format!("{text}batch: {{per_rank: 1, seq_len: 16}}\n"));
        bad(
            &["plan", "--model", model, "--parallel", spec.to_str().unwrap()],
            &[want],
        );
    }
}

/// Llama 3.1 8B at its 131,072 tokens on 8 H100s: as FSDP 8 the plan does not fit; as FSDP
/// 2 x context parallelism 4 it fits 80 GiB and prints the ring's traffic per layer.
#[test]
fn a_long_context_plan_fits_once_each_sequence_is_split() {
    let model = "examples/models/llama3.1-8b.config.json";
    let whole = stdout(&shardplan_ok(&[
        "plan",
        "--model",
        model,
        "--parallel",
        "examples/parallel/long-context-fsdp-8.yaml",
    ]));
    assert!(whole.contains("peak 237.05 GiB"), "{whole}");
    assert!(whole.contains("DOES NOT FIT h100-sxm's 79.60 GiB"), "{whole}");
    let split = stdout(&shardplan_ok(&[
        "plan",
        "--model",
        model,
        "--parallel",
        "examples/parallel/long-context-fsdp-2-cp-4.yaml",
    ]));
    for want in [
        "mesh 1 replicate x 2 shard x 4 context",
        "head_tail balance (rank r holds chunks r and 7 - r of 8, 16,384 tokens each), rotate allgather",
        "ring per layer (layers.0): forward 2 x all-gather 256.00 MiB",
        "backward 2 x reduce-scatter (f32) 512.00 MiB",
        "peak 69.14 GiB",
        "fits h100-sxm's 79.60 GiB",
        "on the all-to-all stream",
        "cp_all_gather forward layers.0 [s2] 256.00 MiB over context 0-3",
        "cp_reduce_scatter backward layers.0",
    ] {
        assert!(split.contains(want), "`{want}` not in:\n{split}");
    }
    // The queries' projection outlasts each gather and the queries' gradient path each
    // reduction: the compute stream never waits on the ring (no `context ring` row).
    let breakdown = split.split("step by kind of work").nth(1).unwrap();
    assert!(
        !breakdown
            .lines()
            .take(20)
            .any(|l| l.trim_start().starts_with("context ring")),
        "{split}"
    );
}

#[test]
fn bad_context_specs_exit_2_naming_the_field() {
    let scratch = tempfile::tempdir().unwrap();
    for (model, text, want) in [
        (
            "tiny-llama",
            "mesh: {shard: 1, context: 4}\ngpus_per_node: 4\nbatch: {per_rank: 1, seq_len: 20}\n",
            "`batch.seq_len`: sequence length 20 does not divide by 2 x context 4 = 8",
        ),
        (
            "tiny-llama",
            "mesh: {shard: 1, context: 2, tensor: 2}\ngpus_per_node: 4\nbatch: {per_rank: 1, seq_len: 12}\n",
            "sequence length 12 does not divide by 2 x context 2 x tensor 2 = 8",
        ),
        (
            "tiny-gpt2",
            "mesh: {shard: 1, context: 2}\ngpus_per_node: 2\nbatch: {per_rank: 1, seq_len: 16}\n",
            "`mesh.context`: context parallelism needs rotary positions; tiny-gpt2 is not a Llama-family model",
        ),
        (
            "examples/models/tiny-moe.yaml",
            "mesh: {shard: 1, context: 2}\ngpus_per_node: 2\nbatch: {per_rank: 1, seq_len: 16}\n",
            "not supported for mixture-of-experts models yet",
        ),
    ] {
        let spec = temp(scratch.path(), "cp.yaml", text);
        bad(
            &["plan", "--model", model, "--parallel", spec.to_str().unwrap()],
            &[want],
        );
    }
}
