//! Parameter counts equal the published figures of the public models (as reported by
//! `sum(p.numel() for p in model.parameters())` in Hugging Face transformers), both from
//! the closed-form count and from the traced graph.

use shardplan_ir::stats::param_counts;
use shardplan_models::{preset, trace, TraceOptions, PRESET_NAMES};

fn traced_total(name: &str) -> u64 {
    let cfg = preset(name).unwrap();
    let g = trace(
        &cfg,
        TraceOptions {
            seq_len: Some(8),
            ..TraceOptions::default()
        },
    )
    .unwrap();
    param_counts(&g).total
}

#[test]
fn published_counts() {
    let expected: &[(&str, u64)] = &[
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
        ("llama3-405b", 405_853_388_800),
        ("llama2-7b", 6_738_415_616),
        ("llama2-13b", 13_015_864_320),
        ("llama2-70b", 68_976_648_192),
        ("mistral-7b", 7_241_732_096),
        ("qwen2-0.5b", 494_032_768),
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
    ];
    for &(name, n) in expected {
        assert_eq!(preset(name).unwrap().param_count(), Some(n), "closed form of {name}");
        assert_eq!(traced_total(name), n, "traced graph of {name}");
    }
}

#[test]
fn closed_form_matches_trace_for_every_preset() {
    for name in PRESET_NAMES {
        assert_eq!(preset(name).unwrap().param_count(), Some(traced_total(name)), "{name}");
    }
}
