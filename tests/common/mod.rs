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

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
