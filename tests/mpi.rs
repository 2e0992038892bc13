//! One process per rank under `mpirun` (the MPI backend) against every rank as a thread of
//! one process (Local): the same losses and weights on several meshes and knobs,
//! checkpoints that cross between the two modes, a measured trace, and ranks that die,
//! fail or hang. Needs a build with `--features mpi` and Open MPI's `mpirun` on PATH.
#![cfg(feature = "mpi")]

mod common;

use common::{json_lines, shardplan_ok, stderr};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_shardplan")
}

/// `mpirun -np n shardplan args...` (root allowed, more ranks than cores allowed).
fn mpirun(n: u64) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["-np", &n.to_string(), "--oversubscribe", "--allow-run-as-root", bin()]);
    c
}

fn run(mut c: Command) -> Output {
    c.output().expect("run the command (is Open MPI's mpirun on PATH?)")
}

/// `shardplan` as one process (threads), or as `ranks` MPI processes.
fn launcher(ranks: Option<u64>) -> Command {
    ranks.map_or_else(|| Command::new(bin()), mpirun)
}

/// Trains `spec` for `steps` (threads, or `ranks` MPI processes) with `extra` arguments;
/// fails the test, saying `what`, unless the run succeeds. Returns its stderr.
fn train_ok(
    ranks: Option<u64>,
    spec: &Path,
    steps: u64,
    log: &Path,
    ckpt: &Path,
    extra: &[&str],
    what: &str,
) -> String {
    let mut c = launcher(ranks);
    c.args(train_args(spec, steps, log, ckpt)).args(extra);
    let o = run(c);
    let err = stderr(&o);
    assert!(o.status.success(), "{what}: {err}");
    err
}

/// A tiny-llama parallel spec: f32 (unless `extra` sets mixed_precision), AdamW with
/// clipping, global batch 8 x 16 on any mesh (unless `extra` sets the batch).
fn spec(dir: &Path, name: &str, replicate: u64, shard: u64, extra: &str) -> PathBuf {
    let world = replicate * shard;
    let per_rank = 8 / world.min(8);
    let p = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &p,
        format!(
            "mesh: {{replicate: {replicate}, shard: {shard}}}\n\
             gpus_per_node: {world}\n\
             {}\
             optimizer: {{adamw: {{lr: 3.0e-3, betas: [0.9, 0.95], weight_decay: 0.1}}}}\n\
             grad_clip: 1.0\n\
             seed: 0\n\
             {extra}\n\
             {}",
            if extra.contains("mixed_precision:") {
                ""
            } else {
                "mixed_precision: {param: f32, reduce: f32}\n"
            },
            if extra.contains("batch:") {
                String::new()
            } else {
                format!("batch: {{per_rank: {per_rank}, seq_len: 16}}\n")
            }
        ),
    )
    .unwrap();
    p
}

fn train_args(spec: &Path, steps: u64, log: &Path, ckpt: &Path) -> Vec<String> {
    [
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        spec.to_str().unwrap(),
        "--steps",
        &steps.to_string(),
        "--log",
        log.to_str().unwrap(),
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--collective-timeout",
        "60",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn losses(log: &Path) -> Vec<f64> {
    json_lines(log).iter().map(|v| v["loss"].as_f64().unwrap()).collect()
}

fn close(a: &[f64], b: &[f64], rel: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= rel * x.abs().max(y.abs()),
            "{what}: step {} differs: {x} vs {y}",
            i + 1
        );
    }
}

/// The f32 tensors of a checkpoint, exported to one safetensors file.
fn weights(ckpt: &Path, out: &Path) -> Vec<(String, Vec<f32>)> {
    shardplan_ok(&[
        "checkpoint",
        "export",
        ckpt.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let bytes = std::fs::read(out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, bytemuck_f32(t.data())))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn bytemuck_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Runs `s` for 20 steps as threads and as `ranks` MPI processes; returns (threads log,
/// threads checkpoints, MPI log, MPI checkpoints).
fn run_both(name: &str, s: &Path, d: &Path, ranks: u64) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
    let (tl, tc) = (d.join("threads.jsonl"), d.join("threads-ckpt"));
    train_ok(None, s, 20, &tl, &tc, &[], &format!("{name} threads"));
    let (ml, mc) = (d.join("mpi.jsonl"), d.join("mpi-ckpt"));
    let err = train_ok(Some(ranks), s, 20, &ml, &mc, &[], &format!("{name} mpi"));
    assert!(err.contains("backend mpi"), "{name}: rank 0 names the backend: {err}");
    (tl, tc, ml, mc)
}

/// Runs `spec` as threads and as MPI processes; losses within 1e-5, weights within 1e-4.
fn parity(name: &str, replicate: u64, shard: u64, extra: &str) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let s = spec(d, name, replicate, shard, extra);
    spec_parity(name, &s, d, replicate * shard);
}

/// Runs spec `s` (in `d`) as threads and as `ranks` MPI processes; losses within 1e-5,
/// weights within 1e-4.
fn spec_parity(name: &str, s: &Path, d: &Path, ranks: u64) {
    let (tl, tc, ml, mc) = run_both(name, s, d, ranks);
    close(&losses(&tl), &losses(&ml), 1e-5, name);
    let (a, b) = (
        weights(&tc, &d.join("t.safetensors")),
        weights(&mc, &d.join("m.safetensors")),
    );
    assert_eq!(a.len(), b.len());
    for ((na, wa), (nb, wb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        for (x, y) in wa.iter().zip(wb) {
            assert!(
                (x - y).abs() <= 1e-4 * x.abs().max(y.abs()).max(1e-3),
                "{name}: {na}: {x} vs {y}"
            );
        }
    }
}

#[test]
fn mpi_matches_threads_1x4() {
    parity("1x4", 1, 4, "");
}

#[test]
fn mpi_matches_threads_2x2_hsdp() {
    parity("2x2", 2, 2, "");
}

#[test]
fn mpi_matches_threads_1x3_uneven() {
    parity("1x3", 1, 3, "batch: {per_rank: 2, seq_len: 16}");
}

#[test]
fn mpi_matches_threads_reshard_to_2() {
    parity("reshard2", 1, 4, "reshard_after_forward: 2");
}

#[test]
fn mpi_matches_threads_prefetch_2() {
    parity("prefetch2", 1, 4, "prefetch: {forward: 2, backward: 2}");
}

#[test]
fn mpi_matches_threads_accumulation_synced_last() {
    parity(
        "accum",
        1,
        4,
        "batch: {per_rank: 2, seq_len: 16, grad_accum: 2, grad_sync: final_micro_batch}",
    );
}

#[test]
fn mpi_matches_threads_full_checkpointing() {
    parity("ac", 1, 4, "activation_checkpointing: full");
}

#[test]
fn mpi_matches_threads_cpu_offload() {
    parity("offload", 1, 4, "offload: cpu");
}

/// A checkpoint written by one mode on one mesh resumes in the other mode on another mesh
/// and continues the loss curve of an uninterrupted run.
#[test]
fn checkpoints_cross_between_processes_and_threads() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let s4 = spec(d, "m4", 1, 4, "batch: {per_rank: 2, seq_len: 16}");
    let s2 = spec(d, "m2", 1, 2, "batch: {per_rank: 4, seq_len: 16}");
    let full = d.join("full.jsonl");
    train_ok(None, &s4, 16, &full, &d.join("full-ckpt"), &[], "uninterrupted");
    let full = losses(&full);
    // (writer mesh spec, writer is MPI, reader spec, reader is MPI)
    for (ws, wmpi, rs, rmpi, what) in [
        (&s4, true, &s2, false, "MPI 1x4 -> threads 1x2"),
        (&s2, false, &s4, true, "threads 1x2 -> MPI 1x4"),
    ] {
        let ck = d.join(format!("{wmpi}-ckpt"));
        let writer_log = d.join(format!("{wmpi}-w.jsonl"));
        train_ok(
            wmpi.then_some(4),
            ws,
            16,
            &writer_log,
            &ck,
            &["--checkpoint-every", "8"],
            what,
        );
        let resumed = d.join(format!("{wmpi}-r.jsonl"));
        let step8 = ck.join("step-00000008");
        let args = ["--resume", step8.to_str().unwrap()];
        train_ok(
            rmpi.then_some(4),
            rs,
            16,
            &resumed,
            &d.join(format!("{wmpi}-r-ckpt")),
            &args,
            what,
        );
        close(&full[8..], &losses(&resumed), 1e-4, what);
    }
}

/// The measured trace holds every planned instruction once per rank and step, in plan
/// order on each stream, in thread and MPI mode alike.
#[test]
fn measured_trace_follows_the_plan_in_both_modes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let s = spec(d, "t", 2, 2, "");
    let plan_file = d.join("plan.json");
    shardplan_ok(&[
        "plan",
        "--model",
        "tiny-llama",
        "--parallel",
        s.to_str().unwrap(),
        "--format",
        "json",
        "--out",
        plan_file.to_str().unwrap(),
    ]);
    let plan: serde_json::Value = serde_json::from_slice(&std::fs::read(&plan_file).unwrap()).unwrap();
    let instrs = plan["programs"][0]["instrs"].as_array().unwrap().clone();
    let untraced = ["alloc", "free", "record", "wait"];
    for mpi in [false, true] {
        let trace = d.join(format!("trace-{mpi}.json"));
        let mut c = if mpi { mpirun(4) } else { Command::new(bin()) };
        c.args(train_args(
            &s,
            2,
            &d.join(format!("l{mpi}.jsonl")),
            &d.join(format!("c{mpi}")),
        ))
        .args(["--trace", trace.to_str().unwrap()]);
        let o = run(c);
        assert!(o.status.success(), "{}", stderr(&o));
        let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
        let events: Vec<&serde_json::Value> = t["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X")
            .collect();
        for rank in 0..4u64 {
            for step in 1..=2u64 {
                let mut streams: std::collections::BTreeMap<u64, Vec<(f64, u64)>> = Default::default();
                for e in events.iter().filter(|e| e["pid"] == rank && e["args"]["step"] == step) {
                    streams
                        .entry(e["tid"].as_u64().unwrap())
                        .or_default()
                        .push((e["ts"].as_f64().unwrap(), e["args"]["instr"].as_u64().unwrap()));
                }
                let mut seen = 0;
                for (tid, mut list) in streams {
                    list.sort_by(|a, b| a.0.total_cmp(&b.0));
                    let got: Vec<u64> = list.iter().map(|x| x.1).collect();
                    let stream_name = instrs[got[0] as usize]["stream"].clone();
                    let want: Vec<u64> = instrs
                        .iter()
                        .enumerate()
                        .filter(|(_, i)| i["stream"] == stream_name)
                        .filter(|(_, i)| !untraced.contains(&i["kind"].as_str().unwrap_or("")))
                        .map(|(k, _)| k as u64)
                        .collect();
                    assert_eq!(got, want, "mpi={mpi} rank {rank} step {step} stream {tid}");
                    seen += got.len();
                }
                let want_all = instrs
                    .iter()
                    .filter(|i| !untraced.contains(&i["kind"].as_str().unwrap_or("")))
                    .count();
                assert_eq!(seen, want_all, "mpi={mpi} rank {rank} step {step}");
            }
        }
    }
}

/// Waits for `child` up to `limit`; kills it and fails the test if it runs longer.
fn wait_within(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("the job still ran after {limit:?}: a rank hangs");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn long_run(d: &Path, extra: &[&str]) -> std::process::Child {
    let s = spec(d, "long", 1, 4, "");
    let mut c = mpirun(4);
    c.args([
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        s.to_str().unwrap(),
        "--steps",
        "100000",
        "--log",
        d.join("long.jsonl").to_str().unwrap(),
        "--collective-timeout",
        "5",
    ])
    .args(extra)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    c.spawn().unwrap()
}

fn output_of(child: std::process::Child) -> String {
    let o = child.wait_with_output().unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// SIGKILL one rank mid-run: every other rank stops, mpirun exits non-zero naming it.
#[test]
fn a_killed_rank_stops_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut child = long_run(d, &[]);
    let log = d.join("long.jsonl");
    let start = Instant::now();
    while std::fs::read_to_string(&log).map_or(0, |s| s.lines().count()) < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the job never started training"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // mpirun starts the ranks as its children; kill the one that is rank 2.
    let kids = std::fs::read_to_string(format!("/proc/{}/task/{}/children", child.id(), child.id())).unwrap();
    let victim = kids
        .split_whitespace()
        .map(|p| p.parse::<u32>().unwrap())
        .find(|p| {
            std::fs::read(format!("/proc/{p}/environ"))
                .is_ok_and(|e| e.split(|&b| b == 0).any(|v| v == b"OMPI_COMM_WORLD_RANK=2"))
        })
        .expect("rank 2's process");
    assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
    let status = wait_within(&mut child, Duration::from_secs(30));
    assert!(!status.success());
    let out = output_of(child);
    assert!(out.contains("rank 2") && out.contains("signal 9"), "{out}");
}

/// A rank that fails an instruction stops the job at once, named with the instruction.
#[test]
fn a_failing_rank_stops_the_job_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = long_run(dir.path(), &["--inject-fault", "1:40:fail"]);
    let status = wait_within(&mut child, Duration::from_secs(60));
    assert!(!status.success());
    let out = output_of(child);
    assert!(
        out.contains("rank 1: instruction #40") && out.contains("injected failure"),
        "{out}"
    );
}

/// A rank that hangs: the others' collectives time out and stop the job.
#[test]
fn a_hung_rank_stops_the_job_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let mut child = long_run(dir.path(), &["--inject-fault", "3:40:stall"]);
    let status = wait_within(&mut child, Duration::from_secs(60));
    assert!(!status.success());
    let out = output_of(child);
    assert!(out.contains("timed out after 5.0 s"), "{out}");
    assert!(start.elapsed() < Duration::from_secs(45));
}

/// The world must match the plan's mesh.
#[test]
fn a_world_that_is_not_the_mesh_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(dir.path(), "w", 1, 4, "");
    let mut c = mpirun(2);
    c.args([
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        s.to_str().unwrap(),
        "--steps",
        "1",
    ]);
    let o = run(c);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("the plan's mesh is 1x4 (4 ranks), but MPI started 2 processes"),
        "{err}"
    );
}

/// SIGTERM (what Slurm's scancel and `kill` send) or SIGINT to the ranks: every rank stops
/// after the same step, the checkpoint of that step is complete and the log ends with it.
#[test]
fn terminated_ranks_stop_together_after_a_step_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ck = d.join("ck");
    let mut child = long_run(d, &["--checkpoint-dir", ck.to_str().unwrap()]);
    let log = d.join("long.jsonl");
    let start = Instant::now();
    while std::fs::read_to_string(&log).map_or(0, |s| s.lines().count()) < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the job never started training"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let kids = std::fs::read_to_string(format!("/proc/{}/task/{}/children", child.id(), child.id())).unwrap();
    for p in kids.split_whitespace() {
        unsafe { libc::kill(p.parse::<i32>().unwrap(), libc::SIGTERM) };
    }
    let status = wait_within(&mut child, Duration::from_secs(60));
    let out = output_of(child);
    assert!(!status.success(), "{out}");
    assert!(out.contains("interrupted: stopped cleanly after step"), "{out}");
    let lines = json_lines(&log);
    let last = lines.last().unwrap();
    assert_eq!(last["stop"], true, "{out}");
    let step = last["step"].as_u64().unwrap();
    assert!(
        ck.join(format!("step-{step:08}")).join("metadata.json").exists(),
        "{out}"
    );
}

#[test]
fn mpi_matches_threads_bf16_params_f32_reduce() {
    parity_mp("bf16-f32", "mixed_precision: {param: bf16, reduce: f32}");
}

#[test]
fn mpi_matches_threads_bf16_params_bf16_reduce() {
    parity_mp("bf16-bf16", "mixed_precision: {param: bf16, reduce: bf16}");
}

/// Threads against MPI on 1x4 with another mixed-precision setting in place of f32.
fn parity_mp(name: &str, mp: &str) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let s = spec(d, name, 1, 4, mp);
    let (tl, _, ml, _) = run_both(name, &s, d, 4);
    // The MPI backend reduces 16-bit data in rank order like Local: the same bits.
    assert_eq!(losses(&tl), losses(&ml), "{name}");
}

/// A tensor-parallel run (replicate x shard x tensor, global batch 8 x 16) as threads and
/// as one MPI process per rank: the same losses, step for step.
fn tensor_parity(model: &str, name: &str, (replicate, shard, tensor): (u64, u64, u64), extra: &str) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let world = replicate * shard * tensor;
    let s = d.join(format!("{name}.yaml"));
    std::fs::write(
        &s,
        format!(
            "mesh: {{replicate: {replicate}, shard: {shard}, tensor: {tensor}}}\ngpus_per_node: {world}\n{}\
             optimizer: {{adamw: {{lr: 3.0e-3, betas: [0.9, 0.95], weight_decay: 0.1}}}}\ngrad_clip: 1.0\nseed: 0\n\
             batch: {{per_rank: {}, seq_len: 16}}\n{extra}\n",
            if extra.contains("mixed_precision:") {
                ""
            } else {
                "mixed_precision: {param: f32, reduce: f32}\n"
            },
            8 / (replicate * shard)
        ),
    )
    .unwrap();
    threads_then_mpi(name, model, &s, world, "--checkpoint-dir: a tensor-parallel run");
}

/// tiny-llama with each sequence split over a context group (shard x context x tensor,
/// global batch 8 x 16), as threads and as one MPI process per rank: the ring's all-gather
/// and all-to-all over MPI give the threads' losses and weights (checkpoints cross, as
/// FSDP's); with a tensor axis, the losses.
#[test]
fn mpi_matches_threads_context_parallel() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (name, (shard, context, tensor), cp) in [
        ("cp4-ring", (1, 4, 1), "{rotate: alltoall, load_balance: head_tail}"),
        ("fsdp2-cp2", (2, 2, 1), "{rotate: allgather, load_balance: none}"),
        ("cp2-tp2", (1, 2, 2), "{rotate: alltoall, load_balance: head_tail}"),
    ] {
        let world = shard * context * tensor;
        let s = d.join(format!("{name}.yaml"));
        std::fs::write(
            &s,
            format!(
                "mesh: {{shard: {shard}, context: {context}, tensor: {tensor}}}\ngpus_per_node: {world}\n\
                 context_parallel: {cp}\nmixed_precision: {{param: f32, reduce: f32}}\n\
                 optimizer: {{adamw: {{lr: 3.0e-3, betas: [0.9, 0.95], weight_decay: 0.1}}}}\ngrad_clip: 1.0\nseed: 0\n\
                 batch: {{per_rank: {}, seq_len: 16}}\n",
                8 / shard
            ),
        )
        .unwrap();
        if tensor > 1 {
            let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/models/tiny-llama.yaml");
            threads_then_mpi(
                name,
                model.to_str().unwrap(),
                &s,
                world,
                "--checkpoint-dir: a tensor-parallel run",
            );
        } else {
            let run = d.join(name);
            std::fs::create_dir_all(&run).unwrap();
            spec_parity(name, &s, &run, world);
        }
    }
}

/// Trains `spec` of `model` for 10 steps as threads and as `world` MPI processes: the same
/// losses within 1e-5; with `--checkpoint-dir` the MPI run is refused before any step
/// (every rank must be in one process), saying `refusal`.
fn threads_then_mpi(name: &str, model: &str, spec: &Path, world: u64, refusal: &str) {
    let d = spec.parent().unwrap();
    let args = |log: &Path| -> Vec<String> {
        let mut a: Vec<String> = ["train", "--model", model, "--parallel", spec.to_str().unwrap()]
            .iter()
            .map(|x| x.to_string())
            .collect();
        a.extend(["--steps", "10", "--log"].map(String::from));
        a.push(log.to_str().unwrap().to_string());
        a.extend(["--collective-timeout", "60"].map(String::from));
        a
    };
    let (tl, ml) = (
        d.join(format!("{name}-threads.jsonl")),
        d.join(format!("{name}-mpi.jsonl")),
    );
    let o = run({
        let mut c = Command::new(bin());
        c.args(args(&tl));
        c
    });
    assert!(o.status.success(), "{name} threads: {}", stderr(&o));
    let o = run({
        let mut c = mpirun(world);
        c.args(args(&ml));
        c
    });
    assert!(o.status.success(), "{name} mpi: {}", stderr(&o));
    close(&losses(&tl), &losses(&ml), 1e-5, name);
    // A checkpoint needs every rank in one process: refused before any step.
    let o = run({
        let mut c = mpirun(world);
        c.args(args(&d.join(format!("{name}-refused.jsonl"))))
            .args(["--checkpoint-dir", d.join("ckpt").to_str().unwrap()]);
        c
    });
    assert_eq!(o.status.code(), Some(2), "{name}: {}", stderr(&o));
    assert!(stderr(&o).contains(refusal), "{}", stderr(&o));
}

/// examples/models/tiny-moe.yaml with an expert axis (and with a tensor axis too) as
/// threads and as one MPI process per rank: the tokens' all-to-all over the MPI backend
/// gives the threads' losses.
#[test]
fn mpi_matches_threads_expert_parallel() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/models/tiny-moe.yaml");
    for (name, replicate, shard, tensor, expert) in [
        ("1x4-ep2", 1, 4, 1, 2),
        ("2x2-ep2", 2, 2, 1, 2),
        ("1x2x2-ep2", 1, 2, 2, 2),
    ] {
        let world = replicate * shard * tensor;
        let s = d.join(format!("{name}.yaml"));
        std::fs::write(
            &s,
            format!(
                "mesh: {{replicate: {replicate}, shard: {shard}, tensor: {tensor}, expert: {expert}}}\ngpus_per_node: {world}\n\
                 mixed_precision: {{param: f32, reduce: f32}}\noptimizer: {{adamw: {{lr: 3.0e-3}}}}\ngrad_clip: 1.0\nseed: 0\n\
                 batch: {{per_rank: 2, seq_len: 16}}\n"
            ),
        )
        .unwrap();
        let refusal = if tensor > 1 {
            "--checkpoint-dir: a tensor-parallel run"
        } else {
            "--checkpoint-dir: an expert-parallel run"
        };
        threads_then_mpi(name, model.to_str().unwrap(), &s, world, refusal);
        // Each step's heaviest routing (every expert group's, across processes under MPI).
        let routing = |log: &Path| -> Vec<serde_json::Value> {
            std::fs::read_to_string(log)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["routing"].clone())
                .collect()
        };
        let threads = routing(&d.join(format!("{name}-threads.jsonl")));
        assert!(
            threads
                .iter()
                .all(|r| r["rows"].as_u64() >= r["even"].as_u64() && r["even"].as_u64() == Some(64)),
            "{name}: {threads:?}"
        );
        assert_eq!(threads, routing(&d.join(format!("{name}-mpi.jsonl"))), "{name}");
    }
}

#[test]
fn mpi_matches_threads_tensor_parallel() {
    tensor_parity("tiny-llama", "1x2x2", (1, 2, 2), "");
    tensor_parity(
        "tiny-llama",
        "2x1x2-no-sp",
        (2, 1, 2),
        "tensor_parallel: {sequence_parallel: false}",
    );
    tensor_parity(
        "tiny-llama",
        "1x2x2-selective-bf16",
        (1, 2, 2),
        "activation_checkpointing: selective\nmixed_precision: {param: bf16, reduce: f32}",
    );
    tensor_parity(
        "tiny-gpt2",
        "1x1x4-no-lp",
        (1, 1, 4),
        "tensor_parallel: {loss_parallel: false}",
    );
    tensor_parity("tiny-gpt2", "2x2x2", (2, 2, 2), "");
}

/// Trains the pipeline spec `mesh` + `pipeline` (tiny-llama with `layers` blocks, f32, 4
/// sequences of 16 a data-parallel rank) for 20 steps as threads and as one MPI process
/// per rank; the losses and gradient norms agree to 1e-6.
fn pipeline_parity(name: &str, mesh: &str, world: u64, pipeline: &str, layers: u64) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = d.join("model.yaml");
    let text = std::fs::read_to_string("examples/models/tiny-llama.yaml").unwrap();
    let text = text
        .lines()
        .map(|l| {
            if l.starts_with("n_layers:") {
                format!("n_layers: {layers}")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&model, text).unwrap();
    let s = d.join("pp.yaml");
    std::fs::write(
        &s,
        format!(
            "mesh: {mesh}\ngpus_per_node: {world}\nmixed_precision: {{param: f32, reduce: f32}}\nbatch: {{per_rank: 4, seq_len: 16}}\noptimizer: {{adamw: {{lr: 3.0e-3, betas: [0.9, 0.95], weight_decay: 0.1}}}}\ngrad_clip: 1.0\npipeline: {pipeline}\n"
        ),
    )
    .unwrap();
    let run_one = |ranks: Option<u64>, log: &Path| {
        let mut c = launcher(ranks);
        c.args([
            "train",
            "--model",
            model.to_str().unwrap(),
            "--parallel",
            s.to_str().unwrap(),
        ])
        .args([
            "--steps",
            "20",
            "--log",
            log.to_str().unwrap(),
            "--collective-timeout",
            "60",
        ]);
        if ranks.is_some() {
            c.args(["--backend", "mpi"]);
        }
        let o = run(c);
        assert!(o.status.success(), "{name} ({ranks:?} processes): {}", stderr(&o));
    };
    let (tl, ml) = (d.join("threads.jsonl"), d.join("mpi.jsonl"));
    run_one(None, &tl);
    run_one(Some(world), &ml);
    close(&losses(&tl), &losses(&ml), 1e-6, name);
    let norms = |p: &Path| -> Vec<f64> { json_lines(p).iter().map(|v| v["grad_norm"].as_f64().unwrap()).collect() };
    close(&norms(&tl), &norms(&ml), 1e-6, name);
}

#[test]
fn mpi_pipeline_matches_threads_1f1b_fsdp() {
    pipeline_parity(
        "PP2 x FSDP2 1F1B",
        "{pipeline: 2, shard: 2}",
        4,
        "{schedule: 1F1B, microbatches: 2}",
        2,
    );
}

#[test]
fn mpi_pipeline_matches_threads_interleaved_four_ranks() {
    pipeline_parity(
        "PP4 Interleaved1F1B V2",
        "{pipeline: 4, shard: 1}",
        4,
        "{schedule: Interleaved1F1B, microbatches: 2}",
        6,
    );
}

#[test]
fn mpi_pipeline_matches_threads_zero_bubble_v_and_dualpipe_v() {
    for schedule in ["ZBVZeroBubble", "DualPipeV"] {
        pipeline_parity(
            &format!("PP2 {schedule}"),
            "{pipeline: 2, shard: 1}",
            2,
            &format!("{{schedule: {schedule}, microbatches: 4}}"),
            2,
        );
    }
}

#[test]
fn mpi_pipeline_matches_threads_tensor_parallel() {
    pipeline_parity(
        "PP2 x TP2 GPipe",
        "{pipeline: 2, shard: 1, tensor: 2}",
        4,
        "{schedule: GPipe, microbatches: 2}",
        2,
    );
}
