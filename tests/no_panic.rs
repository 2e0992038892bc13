//! Nothing a user types may panic: arbitrary text and mutated specs into every parser.

use proptest::prelude::*;
use shardplan_frontends::{parse_hf_config, parse_model_spec, parse_parallel_spec, Source};
use shardplan_models::{trace, TraceOptions};

const MODEL: &str = include_str!("../examples/models/tiny-llama.yaml");
const PARALLEL: &str = include_str!("../examples/parallel/hsdp-2x8.yaml");
const PARALLEL_FSDP2: &str = include_str!("../examples/parallel/fsdp2-8.yaml");
const HF: &str = include_str!("../examples/models/qwen2-0.5b.config.json");

/// Replaces the `n`-th number-like token of `text` with `value`.
fn mutate(text: &str, n: usize, value: &str) -> String {
    let mut seen = 0;
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find(|c: char| c.is_ascii_digit()) {
        let end = rest[i..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '.' || c == '-'))
            .map_or(rest.len(), |e| i + e);
        out.push_str(&rest[..i]);
        out.push_str(if seen == n { value } else { &rest[i..end] });
        seen += 1;
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

fn parse_all(text: &str) {
    if let Ok((m, _)) = parse_model_spec(&Source::from_text("m.yaml", text)) {
        let _ = trace(
            &m,
            TraceOptions {
                seq_len: Some(4),
                ..TraceOptions::default()
            },
        );
    }
    let _ = parse_parallel_spec(&Source::from_text("p.yaml", text));
    let _ = parse_hf_config(&Source::from_text("c.json", text));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_text(text in "\\PC{0,200}") {
        parse_all(&text);
    }

    #[test]
    fn yaml_shaped_text(text in "([a-z_]{1,12}: ([0-9-]{1,25}|[a-z]{1,8}|\\[[0-9, ]{0,10}\\]|\\{[a-z]{1,6}: [0-9]{1,3}\\}|&a x|\\*a)\n){1,8}") {
        parse_all(&text);
    }

    #[test]
    fn mutated_specs(n in 0usize..40, value in prop_oneof![
        Just("0".to_string()), Just("-1".to_string()), Just("18446744073709551615".to_string()),
        Just("1e308".to_string()), Just("nan".to_string()), Just("true".to_string()), Just("[]".to_string()),
        (1u64..u64::MAX).prop_map(|v| v.to_string()),
    ]) {
        let model = mutate(MODEL, n, &value);
        if let Ok((m, _)) = parse_model_spec(&Source::from_text("m.yaml", model)) {
            // Small shapes keep the trace quick even when the mutation made the model large.
            let _ = trace(&m, TraceOptions { seq_len: Some(2), ..TraceOptions::default() });
        }
        let _ = parse_parallel_spec(&Source::from_text("p.yaml", mutate(PARALLEL, n, &value)));
        let _ = parse_parallel_spec(&Source::from_text("p.yaml", mutate(PARALLEL_FSDP2, n, &value)));
        if let Ok((m, _)) = parse_hf_config(&Source::from_text("c.json", mutate(HF, n, &value))) {
            let _ = trace(&m, TraceOptions { seq_len: Some(2), ..TraceOptions::default() });
        }
    }
}
