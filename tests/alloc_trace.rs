//! The plan's requests of the caching allocator against PyTorch's own: where torch is
//! installed, the exported FSDP2 program runs on the CPU with `--alloc-trace`, and its
//! requests (the CPU allocator's, each put on the stream FSDP2 makes it on on a GPU),
//! replayed through the planner's allocator model, reach on every stream the peak the
//! plan's own requests reach, and allocate the same peak. This holds the plan's sequence
//! of requests (what is allocated when, how large, on which stream) to torch's, apart from
//! the model's rules, which a GPU run's trace holds against what the device reserved. The
//! reserved peaks of both replays are printed beside.

mod common;

use common::{shardplan_ok, stdout, torch_python};
use std::path::Path;
use std::process::Command;

/// Four blocks of width 512 and a 1,024-token sequence: large enough that one 20 MiB
/// page of an expandable segment is a few percent of what each pool holds.
const MODEL: &str = "family: llama\nname: trace-check\nvocab_size: 8192\ndim: 512\nn_layers: 4\nn_heads: 8\n\
n_kv_heads: 4\nffn_dim: 1408\nnorm_eps: 1.0e-5\nrope_theta: 10000\nmax_seq_len: 1024\n";

/// The run's allocated peak may differ from the plan's by this much (within 0.6% on
/// every row: the blocks a CPU run makes beside the plan's, its batch and RNG state).
const TOLERANCE: f64 = 0.01;
/// Each stream's own peak of requested bytes: the same requests, allocated in the same
/// order, within the bytes a CPU run makes that the plan does not count (0.1% here).
const STREAM_TOLERANCE: f64 = 0.01;

/// The spec of a case: `shard` ranks, `checkpointing`, parameters in `param` (bf16 as the
/// H200 rows ran; f32 is some twenty times faster on a CPU without bf16 matmuls).
fn spec(shard: u64, checkpointing: &str, param: &str, expandable: bool) -> String {
    format!(
        "mesh: {{replicate: 1, shard: {shard}}}\ngpus_per_node: {shard}\nhardware: {{base: h200}}\nruntime: fsdp2\n\
allocator: {{expandable_segments: {expandable}}}\nwrap: [block]\nreshard_after_forward: true\n\
mixed_precision: {{param: {param}, reduce: f32}}\nactivation_checkpointing: {checkpointing}\n\
batch: {{per_rank: 2, seq_len: 1024, grad_accum: 1}}\n\
optimizer: {{adamw: {{lr: 3.0e-4, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.1, implementation: foreach}}}}\n\
lr_schedule: {{warmup_steps: 0, min_lr_ratio: 1.0}}\ngrad_clip: 1.0\nseed: 0\ndata: synthetic\n"
    )
}

/// Exports the spec, runs it for two steps on `ranks` CPU processes with `--alloc-trace`,
/// and returns the trace's path.
fn record(py: &str, dir: &Path, name: &str, model: &Path, parallel: &Path, ranks: u64) -> std::path::PathBuf {
    let out = dir.join(name);
    shardplan_ok(&[
        "export",
        "fsdp2",
        "--model",
        model.to_str().unwrap(),
        "--parallel",
        parallel.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let trace = dir.join(format!("{name}.jsonl"));
    let (nproc, threads) = (ranks.to_string(), (2 / ranks).max(1).to_string());
    let o = Command::new(py)
        .args([
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            &nproc,
        ])
        .arg(out.join("train.py"))
        .args(["--steps", "2", "--threads", &threads, "--alloc-trace"])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
    trace
}

/// `plan --alloc-trace --format json` of the trace at `trace` under the spec `parallel`.
fn comparison(model: &Path, parallel: &Path, trace: &Path) -> serde_json::Value {
    let o = shardplan_ok(&[
        "plan",
        "--model",
        model.to_str().unwrap(),
        "--parallel",
        parallel.to_str().unwrap(),
        "--alloc-trace",
        trace.to_str().unwrap(),
        "--format",
        "json",
    ]);
    serde_json::from_str(&stdout(&o)).unwrap()
}

fn peaks(v: &serde_json::Value) -> Vec<u64> {
    v["stream_requested_peaks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn the_plans_allocator_requests_are_torchs() {
    let Some(py) = torch_python() else {
        eprintln!("skipped: no Python with torch, safetensors and numpy (set SHARDPLAN_TORCH_PYTHON)");
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("model.yaml");
    std::fs::write(&model, MODEL).unwrap();
    // One rank (FSDP2's world-size-1 path) with full checkpointing in bf16, as the H200 rows
    // ran, and two in f32 (the all-gather on its own stream, f32 for speed: a bf16 case is
    // about 200 s on 2 cores); `SHARDPLAN_EXPORT_FULL=1` adds two ranks in bf16 and one rank
    // without checkpointing and with selective checkpointing.
    let mut cases = vec![(1, "full", "bf16"), (2, "none", "f32")];
    if std::env::var_os("SHARDPLAN_EXPORT_FULL").is_some_and(|v| v != "0") {
        cases.extend([(2, "none", "bf16"), (1, "none", "bf16"), (1, "selective", "bf16")]);
    }
    let mut failures = Vec::new();
    for (shard, checkpointing, param) in cases {
        let name = format!("{shard}-{checkpointing}-{param}");
        let parallel = d.path().join(format!("{name}.yaml"));
        std::fs::write(&parallel, spec(shard, checkpointing, param, true)).unwrap();
        let trace = record(&py, d.path(), &name, &model, &parallel, shard);
        let c = comparison(&model, &parallel, &trace);
        for s in c["settings"].as_array().unwrap() {
            let (run, plan) = (&s["run"], &s["plan"]);
            let ratio = |k: &str| run[k].as_f64().unwrap() / plan[k].as_f64().unwrap();
            let (rp, pp) = (peaks(run), peaks(plan));
            let expandable = s["expandable_segments"].as_bool().unwrap();
            println!(
                "{name}, expandable segments {expandable}: run / plan allocated {:.3}, reserved {:.3}; \
                 peak requested by stream: run {rp:?}, plan {pp:?}",
                ratio("allocated_peak"),
                ratio("reserved")
            );
            // The same requests on the same streams at the same moments: each stream's own
            // peak, and the allocated peak (blocks as the allocator rounds and splits them).
            for st in 0..rp.len().max(pp.len()) {
                let (r, p) = (rp.get(st).copied().unwrap_or(0), pp.get(st).copied().unwrap_or(0));
                if (r as f64 - p as f64).abs() > STREAM_TOLERANCE * p.max(1) as f64 {
                    failures.push(format!(
                        "{name}: stream {st} peaks at {r} bytes in the run, {p} in the plan"
                    ));
                }
            }
            if (ratio("allocated_peak") - 1.0).abs() > TOLERANCE {
                failures.push(format!(
                    "{name}: allocated {:.3} of the plan's",
                    ratio("allocated_peak")
                ));
            }
            // The reserved peaks are printed: how the same requests lie in the segments is
            // the open question (docs/src/memory.md), not held here.
            let _ = expandable;
        }
    }
    // The text a user reads says the same.
    let text = stdout(&shardplan_ok(&[
        "plan",
        "--model",
        model.to_str().unwrap(),
        "--parallel",
        d.path().join("1-full-bf16.yaml").to_str().unwrap(),
        "--alloc-trace",
        d.path().join("1-full-bf16.jsonl").to_str().unwrap(),
    ]));
    assert!(
        text.contains("the run's requests") && text.contains("cudaMalloc segments"),
        "{text}"
    );
    assert!(failures.is_empty(), "{failures:#?}");
}
