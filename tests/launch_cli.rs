//! `shardplan launch` starts ranks as torchrun does; a CPU build refuses multi-process
//! training by rank, and no launch hangs.

mod common;

use common::shardplan;

use std::process::Command;

#[test]
fn launch_runs_the_command_once_per_rank() {
    let o = shardplan(&[
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
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
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
