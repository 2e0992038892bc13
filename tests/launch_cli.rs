//! `shardplan launch` starts ranks as torchrun does; a CPU build refuses multi-process
//! training by rank, and no launch hangs.

mod common;

use common::{shardplan, shardplan_ok};

use std::process::Command;

#[test]
fn launch_runs_the_command_once_per_rank() {
    let o = shardplan_ok(&[
        "launch",
        "--nproc-per-node",
        "3",
        "--master-port",
        "29631",
        "--",
        "inspect",
        "--model",
        "tiny-llama",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.matches("model    tiny-llama (llama)").count(), 3, "{out}");
}

#[test]
fn cpu_processes_under_torchrun_are_refused_by_rank() {
    let start = std::time::Instant::now();
    let o = shardplan(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        "29632",
        "--",
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/cpu-1.yaml",
        "--steps",
        "1",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("of 2: CPU processes started by torchrun / shardplan launch have no collective engine"),
        "{err}"
    );
    assert!(err.contains("exited with code 2; stopped the other ranks"), "{err}");
    assert!(start.elapsed().as_secs() < 60);
    // The same under torchrun's variables set by hand.
    let o = Command::new(env!("CARGO_BIN_EXE_shardplan"))
        .args([
            "train",
            "--model",
            "tiny-llama",
            "--parallel",
            "examples/parallel/cpu-1.yaml",
        ])
        .env("RANK", "0")
        .env("WORLD_SIZE", "8")
        .env("LOCAL_RANK", "0")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", "29633")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("rank 0 of 8"));
    // A partial environment names what is missing.
    let o = Command::new(env!("CARGO_BIN_EXE_shardplan"))
        .args([
            "train",
            "--model",
            "tiny-llama",
            "--parallel",
            "examples/parallel/cpu-1.yaml",
        ])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("LOCAL_RANK is not set"));
}

#[test]
fn bad_launch_arguments_exit_2() {
    for (args, want) in [
        (
            vec![
                "launch",
                "--nproc-per-node",
                "0",
                "--",
                "inspect",
                "--model",
                "tiny-llama",
            ],
            "must be at least 1",
        ),
        (
            vec![
                "launch",
                "--nproc-per-node",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--",
                "inspect",
            ],
            "--node-rank 2 is not below --nnodes 2",
        ),
    ] {
        let o = shardplan(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&o.stderr).contains(want),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// Backends this build lacks are refused with exit 2, naming what is missing; a local
/// backend under a multi-process launcher is refused too.
#[test]
fn missing_backends_are_named() {
    let train = |extra: &[&str], vars: &[(&str, &str)]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_shardplan"));
        c.args([
            "train",
            "--model",
            "tiny-llama",
            "--parallel",
            "examples/parallel/cpu-1.yaml",
            "--steps",
            "1",
        ])
        .args(extra);
        for (k, v) in vars {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    // Without a CUDA build, the NCCL backend says what is missing and how to get it, as
    // one process and under a launcher (`shardplan launch`, torchrun) alike.
    let o = train(&["--backend", "nccl"], &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--backend nccl needs NVIDIA GPUs and a CUDA build")
            && err.contains("built without CUDA support")
            && err.contains("scripts/build-cuda.sh"),
        "{err}"
    );
    let o = train(
        &["--backend", "nccl"],
        &[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("rank 1 of 2: --backend nccl needs NVIDIA GPUs"), "{err}");
    #[cfg(not(feature = "mpi"))]
    {
        let o = train(&["--backend", "mpi"], &[]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains("built without MPI support") && err.contains("--features mpi"),
            "{err}"
        );
        // Under mpirun's variables the default is MPI, refused the same way.
        let o = train(&[], &[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("rank 1 of 2: --backend mpi"), "{err}");
    }
    let o = train(&["--backend", "local"], &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("srun started 4 processes"), "{err}");
    let o = train(&["--collective-timeout", "0"], &[]);
    assert_eq!(o.status.code(), Some(2));
    let o = train(&["--inject-fault", "x"], &[]);
    assert_eq!(o.status.code(), Some(2));
}

/// Thread mode writes the measured trace: a process per rank, a thread per stream.
#[test]
fn train_writes_a_measured_trace_in_thread_mode() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.json");
    let o = shardplan_ok(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        "examples/parallel/fsdp-1x4-cpu.yaml",
        "--steps",
        "2",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("predicted vs measured") && out.contains("unsharded params"),
        "{out}"
    );
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let ev = t["traceEvents"].as_array().unwrap();
    let names: Vec<&str> = ev
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["rank 0", "rank 1", "rank 2", "rank 3"]);
    for rank in 0..4 {
        let slices = ev.iter().filter(|e| e["ph"] == "X" && e["pid"] == rank).count();
        let per_step = ev
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == rank && e["args"]["step"] == 1)
            .count();
        assert!(
            per_step > 0 && slices == 2 * per_step,
            "rank {rank}: {slices} slices, {per_step} per step"
        );
        assert!(ev
            .iter()
            .any(|e| e["ph"] == "X" && e["pid"] == rank && e["name"].as_str().unwrap().starts_with("all-gather")));
    }
}
