//! Golden snapshots of the printed IR of the tiny models: a refactor must leave them
//! unchanged; a deliberate change updates them in the same commit, with the reason.

use shardplan_ir::to_text;
use shardplan_models::{preset, trace, TraceOptions};

fn printed(name: &str) -> String {
    let opts = TraceOptions {
        batch: 2,
        seq_len: Some(8),
        ..TraceOptions::default()
    };
    to_text(&trace(&preset(name).unwrap(), opts).unwrap())
}

#[test]
fn tiny_llama_ir() {
    insta::assert_snapshot!(printed("tiny-llama"));
}

#[test]
fn tiny_gpt2_ir() {
    insta::assert_snapshot!(printed("tiny-gpt2"));
}

#[test]
fn tiny_mlp_ir() {
    insta::assert_snapshot!(printed("tiny-mlp"));
}
