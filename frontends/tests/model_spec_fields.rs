//! The YAML model spec states what a Hugging Face config.json can: the MLP activation and
//! RoPE scaling, with the same meaning as the config.json reader gives them.

use shardplan_frontends::{parse_hf_config, parse_model_spec, Source};
use shardplan_models::{Activation, ModelConfig, RopeScaling};

const LLAMA: &str =
    "family: llama\nvocab_size: 256\ndim: 64\nn_layers: 2\nn_heads: 4\nn_kv_heads: 2\nffn_dim: 128\nmax_seq_len: 512\n";

fn parse(text: &str) -> Result<ModelConfig, String> {
    parse_model_spec(&Source::from_text("m.yaml", text))
        .map(|(c, _)| c)
        .map_err(|e| e.to_string())
}

#[test]
fn rope_scaling_and_activation_equal_the_config_json_readers() {
    let yaml = parse(&format!(
        "{LLAMA}rope_scaling: {{rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 128}}\nactivation: gelu_tanh\n"
    ))
    .unwrap();
    let json = parse_hf_config(&Source::from_text(
        "config.json",
        r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
  "max_position_embeddings": 512, "hidden_act": "gelu_pytorch_tanh",
  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 128}}"#,
    ))
    .unwrap()
    .0;
    let (ModelConfig::Llama(y), ModelConfig::Llama(j)) = (&yaml, &json) else {
        panic!("llama configs");
    };
    assert_eq!(y.rope_scaling, j.rope_scaling);
    assert_eq!(y.activation, Some(Activation::GeluTanh));
    assert_eq!(y.activation, j.activation);
    assert!(matches!(y.rope_scaling, RopeScaling::Llama3 { .. }));
}

#[test]
fn every_rope_type_and_activation_reads() {
    for (scaling, want) in [
        ("{rope_type: linear, factor: 2.0}", RopeScaling::Linear { factor: 2.0 }),
        (
            "{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 128, beta_fast: 32, beta_slow: 1, attention_factor: 1.1, truncate: true}",
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 128,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: 1.1,
                truncate: true,
            },
        ),
    ] {
        let ModelConfig::Llama(c) = parse(&format!("{LLAMA}rope_scaling: {scaling}\n")).unwrap() else {
            panic!()
        };
        assert_eq!(c.rope_scaling, want);
    }
    for (name, want) in [
        ("silu", Activation::Silu),
        ("gelu", Activation::Gelu),
        ("gelu_tanh", Activation::GeluTanh),
        ("relu", Activation::Relu),
    ] {
        let ModelConfig::Gpt2(c) = parse(&format!(
            "family: gpt2\nvocab_size: 256\ndim: 64\nn_layers: 2\nn_heads: 4\nactivation: {name}\n"
        ))
        .unwrap() else {
            panic!()
        };
        assert_eq!(c.activation, Some(want));
    }
}

#[test]
fn bad_values_are_refused_naming_the_field() {
    for (extra, want) in [
        ("rope_scaling: {rope_type: linear, factor: 0}\n", "`factor` must be a finite number above 0"),
        ("rope_scaling: {rope_type: linear, factor: .nan}\n", "rope_scaling.factor"),
        (
            "rope_scaling: {rope_type: llama3, factor: 8, low_freq_factor: 4, high_freq_factor: 1, original_max_position_embeddings: 128}\n",
            "high_freq_factor (1) must be above low_freq_factor (4)",
        ),
        (
            "rope_scaling: {rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 0}\n",
            "original_max_position_embeddings",
        ),
        ("rope_scaling: {rope_type: dynamic, factor: 2}\n", "rope_scaling"),
        ("activation: tanh\n", "activation"),
    ] {
        let e = parse(&format!("{LLAMA}{extra}")).unwrap_err();
        assert!(e.contains(want), "{extra}: {e}");
        assert!(e.contains("m.yaml"), "{e}");
    }
    let e = parse("family: gpt2\nvocab_size: 256\ndim: 64\nn_layers: 2\nn_heads: 4\nrope_scaling: {rope_type: linear, factor: 2}\n")
        .unwrap_err();
    assert!(e.contains("does not apply to family gpt2"), "{e}");
}
