//! Running the `shardplan` binary from the integration tests.

#![allow(dead_code)]

use std::process::{Command, Output};

/// Runs `shardplan` with `args` and waits for it.
pub fn shardplan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardplan"))
        .args(args)
        .output()
        .expect("run shardplan")
}

/// Runs `shardplan` with `args`; fails the test, showing the arguments and the standard
/// error, unless it exits 0.
#[track_caller]
pub fn shardplan_ok(args: &[&str]) -> Output {
    let o = shardplan(args);
    assert!(o.status.success(), "shardplan {}: {}", args.join(" "), stderr(&o));
    o
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The objects of a JSON-lines metrics log, one per step.
pub fn json_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The Python with torch, safetensors and numpy (the torch checks' needs):
/// SHARDPLAN_TORCH_PYTHON, else `python3` if it has them.
pub fn torch_python() -> Option<String> {
    let candidates = std::env::var("SHARDPLAN_TORCH_PYTHON")
        .ok()
        .into_iter()
        .chain(["python3".to_string()]);
    candidates.into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import torch, safetensors, numpy"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}
