//! The ten-minute demo (`examples/demo.sh`) end to end at a reduced size: prepare the
//! repository's docs, train 3 steps on 1x2 ranks with validation, generate from the
//! checkpoint, export a Hugging Face folder and generate from it.

mod common;

#[test]
fn the_demo_runs_end_to_end() {
    let d = tempfile::tempdir().unwrap();
    let o = std::process::Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/demo.sh"))
        .env("SHARDPLAN", env!("CARGO_BIN_EXE_shardplan"))
        .env("STEPS", "3")
        .env("OUT", d.path())
        .env_remove("PYTHON")
        .output()
        .expect("run bash");
    let (out, err) = (common::stdout(&o), common::stderr(&o));
    assert!(o.status.success(), "{out}\n{err}");
    for want in [
        "== 1. data prepare",
        "trained 3 steps of demo-llama",
        "validation loss",
        "wrote ",
        "The planner",
        "== done in",
    ] {
        assert!(out.contains(want), "`{want}` not in:\n{out}\n{err}");
    }
    assert_eq!(common::json_lines(&d.path().join("log.jsonl")).len(), 3);
    assert!(d.path().join("hf/model.safetensors").is_file());
}
