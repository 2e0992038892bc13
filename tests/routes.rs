//! The YAML spec, the Hugging Face config.json and the preset of one model trace to the
//! same graph; every bundled example loads.

use shardplan_frontends::{load_model, load_parallel, trace_error, trace_options};
use shardplan_ir::to_text;
use shardplan_models::{preset, trace, TraceOptions};
use std::path::Path;

fn graph_of(path: &str) -> shardplan_ir::Graph {
    let m = load_model(Path::new(path)).unwrap_or_else(|e| panic!("{e}"));
    trace(
        &m.config,
        TraceOptions {
            seq_len: Some(32),
            ..TraceOptions::default()
        },
    )
    .unwrap()
}

#[test]
fn yaml_json_and_preset_give_the_same_graph() {
    for (yaml, json, preset_name) in [
        (
            "examples/models/llama3-8b.yaml",
            "examples/models/llama3-8b.config.json",
            "llama3-8b",
        ),
        ("examples/models/gpt2.yaml", "examples/models/gpt2.config.json", "gpt2"),
    ] {
        let (a, b) = (graph_of(yaml), graph_of(json));
        assert!(a.same_structure(&b), "{yaml} and {json} differ");
        assert_eq!(to_text(&a), to_text(&b));
        let c = trace(
            &preset(preset_name).unwrap(),
            TraceOptions {
                seq_len: Some(32),
                ..TraceOptions::default()
            },
        )
        .unwrap();
        assert!(a.same_structure(&c), "{yaml} differs from preset {preset_name}");
    }
}

#[test]
fn imports_match_presets() {
    for (json, preset_name) in [
        ("examples/models/mistral-7b.config.json", "mistral-7b"),
        ("examples/models/qwen2-0.5b.config.json", "qwen2-0.5b"),
        ("examples/models/qwen3-8b.config.json", "qwen3-8b"),
        ("examples/models/tiny-qwen3.yaml", "tiny-qwen3"),
    ] {
        let a = graph_of(json);
        let b = trace(
            &preset(preset_name).unwrap(),
            TraceOptions {
                seq_len: Some(32),
                ..TraceOptions::default()
            },
        )
        .unwrap();
        assert!(a.same_structure(&b), "{json} differs from preset {preset_name}");
    }
}

/// The published MoE config.json files read into their presets' configs, field for field.
#[test]
fn moe_imports_match_presets() {
    for (file, preset_name) in [
        ("examples/models/mixtral-8x7b.config.json", "mixtral-8x7b"),
        ("examples/models/qwen2-57b-a14b.config.json", "qwen2-57b-a14b"),
        ("examples/models/qwen3-30b-a3b.config.json", "qwen3-30b-a3b"),
    ] {
        let m = load_model(Path::new(file)).unwrap_or_else(|e| panic!("{e}"));
        let shardplan_models::ModelConfig::Llama(mut c) = m.config else {
            panic!("{file} is not a llama-family model")
        };
        // `"hidden_act": "silu"` is the family's default activation, which presets leave unset.
        assert_eq!(c.activation, Some(shardplan_models::Activation::Silu), "{file}");
        c.activation = None;
        assert_eq!(
            shardplan_models::ModelConfig::Llama(c),
            preset(preset_name).unwrap(),
            "{file}"
        );
    }
}

#[test]
fn every_bundled_example_loads_and_traces_with_a_fitting_layout() {
    let mut models = 0;
    for entry in std::fs::read_dir("examples/models").unwrap() {
        let path = entry.unwrap().path();
        let m = load_model(&path).unwrap_or_else(|e| panic!("{e}"));
        models += 1;
        let mut traced = 0;
        for p in std::fs::read_dir("examples/parallel").unwrap() {
            let p = load_parallel(&p.unwrap().path()).unwrap_or_else(|e| panic!("{e}"));
            match trace(&m.config, trace_options(Some(&p))) {
                Ok(_) => traced += 1,
                // The only refusals allowed: a layout's sequence longer than the model's
                // context, a tensor-parallel layout the model's heads, widths or
                // vocabulary (or experts' widths) do not split over, and an expert-parallel
                // layout for a model without routed experts or whose experts it does not split,
                // and a context-parallel layout for a model without rotary positions.
                Err(e) => {
                    let e = trace_error(e, &m, Some(&p));
                    if p.config.mesh.expert > 1 && e.field.as_deref() == Some("mesh.expert") {
                        continue;
                    }
                    if p.config.mesh.context > 1 && e.field.as_deref() == Some("mesh.context") {
                        continue;
                    }
                    assert!(
                        matches!(
                            e.field.as_deref(),
                            Some("batch.seq_len" | "mesh.tensor" | "tensor_parallel.loss_parallel")
                        ),
                        "{e}"
                    );
                }
            }
        }
        assert!(traced > 0, "no bundled layout fits {}", path.display());
    }
    assert!(models >= 8);
}
