//! Every kind of bad input gets a clear, located error, never a panic.

use shardplan_frontends::{
    load_model, load_parallel, parse_hf_config, parse_model_spec, parse_parallel_spec, Source, SpecError,
};
use shardplan_models::{ModelConfig, MoeNames};
use std::path::PathBuf;

fn model(text: &str) -> SpecError {
    parse_model_spec(&Source::from_text("m.yaml", text)).unwrap_err()
}

fn hf(text: &str) -> SpecError {
    parse_hf_config(&Source::from_text("config.json", text)).unwrap_err()
}

const PAR_OK: &str = "mesh: {replicate: 1, shard: 8}\n";

fn parallel(text: &str) -> SpecError {
    parse_parallel_spec(&Source::from_text("p.yaml", text)).unwrap_err()
}

/// Asserts the error is at `line:col`, and its message (with help) contains each of `texts`.
fn check(e: &SpecError, line: u64, col: u64, texts: &[&str]) {
    let shown = e.to_string();
    assert_eq!((e.line, e.column), (Some(line), Some(col)), "position of: {shown}");
    for t in texts {
        assert!(shown.contains(t), "`{t}` not in: {shown}");
    }
}

const LLAMA: &str = "family: llama\nvocab_size: 256\ndim: 64\nn_layers: 2\nn_heads: 4\nn_kv_heads: 2\nffn_dim: 128\n";

fn tmp(dir: &std::path::Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn good_specs_parse() {
    parse_model_spec(&Source::from_text("m.yaml", LLAMA)).unwrap();
    parse_parallel_spec(&Source::from_text("p.yaml", PAR_OK)).unwrap();
}

/// A mesh without `shard` takes what `world` leaves, or 1 (`mesh: {tensor: 4}` plans as a
/// user of torchtitan's `dp_shard: -1` expects); a world the other axes do not divide is
/// refused at `world`.
#[test]
fn the_shard_axis_defaults_to_what_world_leaves() {
    let mesh = |text: &str| parse_parallel_spec(&Source::from_text("p.yaml", text)).unwrap().0.mesh;
    let m = mesh("mesh: {tensor: 4}\ngpus_per_node: 4\n");
    assert_eq!((m.shard, m.tensor, m.world()), (1, 4, 4));
    let m = mesh("mesh: {pipeline: 2, tensor: 2}\ngpus_per_node: 4\n");
    assert_eq!((m.pipeline, m.shard, m.tensor, m.world()), (2, 1, 2, 4));
    let m = mesh("mesh: {replicate: 2, tensor: 4}\nworld: 64\n");
    assert_eq!((m.replicate, m.shard, m.tensor), (2, 8, 4));
    let m = mesh("mesh: {tensor: 2, context: 2}\nworld: 16\n");
    assert_eq!((m.shard, m.context), (4, 2));
    let e = parallel("mesh: {tensor: 8}\nworld: 12\n");
    check(
        &e,
        2,
        8,
        &["`mesh.shard`", "do not divide world (12)", "set mesh.shard"],
    );
}

#[test]
fn missing_file() {
    let e = load_model(&PathBuf::from("/nonexistent/model.yaml")).unwrap_err();
    assert!(
        e.to_string().starts_with("/nonexistent/model.yaml: no such file"),
        "{e}"
    );
    let e = load_parallel(&PathBuf::from("/nonexistent/p.yaml")).unwrap_err();
    assert!(e.to_string().contains("no such file"), "{e}");
}

#[test]
fn unknown_preset_suggests_the_closest() {
    let e = load_model(&PathBuf::from("llama3-8")).unwrap_err();
    assert!(e.to_string().contains("did you mean the preset `llama3-8b`?"), "{e}");
}

#[test]
fn empty_file() {
    let scratch = tempfile::tempdir().unwrap();
    for text in ["", "   \n\n", "# only a comment\n"] {
        let p = tmp(scratch.path(), "empty.yaml", text.as_bytes());
        let e = load_model(&p).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("is empty\n  help: write a spec in it; see examples/ for complete ones"),
            "{e}"
        );
    }
}

#[test]
fn binary_and_directory_inputs() {
    let scratch = tempfile::tempdir().unwrap();
    let p = tmp(scratch.path(), "weights.yaml", &[0xff, 0xfe, 0x00, 0x12]);
    let e = load_model(&p).unwrap_err();
    assert!(e.to_string().contains("not UTF-8 text"), "{e}");
    let e = load_model(&std::env::temp_dir()).unwrap_err();
    assert!(e.to_string().contains("is a directory"), "{e}");
}

#[test]
fn not_yaml_or_json() {
    let e = model("family: llama\ndim: [1, 2\n");
    assert!(e.line.is_some(), "{e}");
    let e = model("just some words\n");
    check(&e, 1, 1, &["expected a mapping"]);
    let e = hf("{\"hidden_size\": 4096,,}");
    check(&e, 1, 22, &["is not valid JSON"]);
    let e = hf("<html>not json</html>");
    check(&e, 1, 1, &["is not valid JSON"]);
}

#[test]
fn unknown_field_with_did_you_mean() {
    let e = model(&LLAMA.replace("n_kv_heads", "n_kv_head"));
    check(&e, 6, 1, &["unknown field `n_kv_head`", "did you mean `n_kv_heads`?"]);
    let e = parallel("mesh: {replicate: 1, shard: 8}\nprefetch: {forwards: 2}\n");
    check(&e, 2, 12, &["unknown field `forwards`", "did you mean `forward`?"]);
    assert_eq!(e.field.as_deref(), Some("prefetch.forwards"));
    let e = parallel("mesh: {replicate: 1, shard: 8}\nwrap: [blocks]\n");
    check(&e, 2, 8, &["unknown variant `blocks`", "did you mean `block`?"]);
    let e = model("family: lama\ndim: 4\n");
    check(&e, 1, 9, &["unknown variant `lama`", "did you mean `llama`?"]);
}

#[test]
fn wrong_type() {
    let e = model(&LLAMA.replace("dim: 64", "dim: wide"));
    check(&e, 3, 6, &["expected a whole number"]);
    assert_eq!(e.field.as_deref(), Some("dim"));
    let e = parallel("mesh: {replicate: 1, shard: 8}\ngrad_clip: lots\n");
    check(&e, 2, 12, &["expected a number"]);
    let e = hf("{\"architectures\": [\"LlamaForCausalLM\"],\n \"hidden_size\": \"4096\"}");
    check(&e, 2, 22, &["wrong type"]);
    assert_eq!(e.field.as_deref(), Some("hidden_size"));
}

#[test]
fn zero_and_negative_sizes() {
    let e = model(&LLAMA.replace("n_layers: 2", "n_layers: 0"));
    check(&e, 4, 11, &["`n_layers`", "at least 1"]);
    let e = model(&LLAMA.replace("ffn_dim: 128", "ffn_dim: -128"));
    check(&e, 7, 10, &["expected a whole number >= 0"]);
    let e = parallel("mesh: {replicate: 1, shard: 0}\n");
    check(&e, 1, 29, &["`mesh.shard`", "at least 1"]);
    let e = parallel("mesh: {replicate: -2, shard: 8}\n");
    check(&e, 1, 19, &["expected a whole number"]);
    let e = hf("{\"architectures\": [\"GPT2LMHeadModel\"], \"vocab_size\": 50257,\n \"n_embd\": 768, \"n_layer\": -12, \"n_head\": 12}");
    check(&e, 2, 30, &["wrong type"]);
}

#[test]
fn heads_must_divide_hidden_and_kv_heads_must_divide_heads() {
    let e = model(&LLAMA.replace("n_heads: 4", "n_heads: 5"));
    check(
        &e,
        5,
        10,
        &["n_heads = 5 does not divide dim = 64", "set head_dim explicitly"],
    );
    let e = model(&LLAMA.replace("n_kv_heads: 2", "n_kv_heads: 3"));
    check(&e, 6, 13, &["n_kv_heads = 3 does not divide n_heads = 4"]);
    let e = hf("{\"architectures\": [\"MistralForCausalLM\"], \"vocab_size\": 32000,\n \"hidden_size\": 4096, \"num_hidden_layers\": 2,\n \"num_attention_heads\": 32, \"num_key_value_heads\": 7, \"intermediate_size\": 128}");
    check(&e, 3, 29, &["`num_key_value_heads`", "does not divide"]);
}

#[test]
fn fields_of_another_family_and_missing_fields() {
    let e = model("family: gpt2\nvocab_size: 10\ndim: 8\nn_layers: 1\nn_heads: 2\nrope_theta: 10000\n");
    check(&e, 6, 13, &["does not apply to family gpt2"]);
    let e = model("family: llama\nvocab_size: 10\ndim: 8\n");
    check(&e, 1, 9, &["family llama needs `n_heads`", "add `n_heads: <integer>`"]);
    let e = hf("{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 10}");
    assert!(e.to_string().contains("missing `num_attention_heads`"), "{e}");
}

#[test]
fn qk_norm_field() {
    let ok = format!("{LLAMA}qk_norm: true\nhead_dim: 32\n");
    parse_model_spec(&Source::from_text("m.yaml", ok.as_str())).unwrap();
    let e = model(&format!("{LLAMA}qk_norm: 3\n"));
    check(&e, 8, 10, &["qk_norm"]);
    assert_eq!(e.field.as_deref(), Some("qk_norm"));
    let e = model("family: gpt2\nvocab_size: 10\ndim: 8\nn_layers: 1\nn_heads: 2\nqk_norm: true\n");
    check(&e, 6, 10, &["does not apply to family gpt2"]);
    let e = model(&format!("{LLAMA}qk_norm: true\nhead_dim: 0\n"));
    check(&e, 9, 11, &["`head_dim`", "at least 1"]);
    let e = hf("{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 256, \"hidden_size\": 64,\n \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"intermediate_size\": 128,\n \"head_dim\": 31}");
    check(&e, 3, 2, &["even head_dim"]);
    assert_eq!(e.field.as_deref(), Some("head_dim"));
}

const MOE: &str = "moe:\n  experts: 8\n  top_k: 2\n  expert_ffn_dim: 32\n";

#[test]
fn moe_fields() {
    let ok = format!("{LLAMA}{MOE}");
    parse_model_spec(&Source::from_text("m.yaml", ok.as_str())).unwrap();
    // Lines: LLAMA has 7; `moe:` is line 8, experts 9, top_k 10, expert_ffn_dim 11.
    let e = model(&format!("{LLAMA}{}", MOE.replace("top_k: 2", "top_k: 9")));
    check(&e, 10, 10, &["`moe.top_k`", "more than the 8 experts"]);
    let e = model(&format!("{LLAMA}{}", MOE.replace("experts: 8", "experts: 0")));
    check(&e, 9, 12, &["`moe.experts`", "at least 1"]);
    let e = model(&format!("{LLAMA}{}", MOE.replace("top_k", "topk")));
    check(&e, 10, 3, &["unknown field `topk`", "did you mean `top_k`?"]);
    let e = model(&format!("{LLAMA}{MOE}  router: softmax_top2\n"));
    check(
        &e,
        12,
        11,
        &["unknown variant `softmax_top2`", "did you mean `softmax_topk`?"],
    );
    let e = model(&format!("{LLAMA}{MOE}  shared_experts: 1\n"));
    check(
        &e,
        12,
        19,
        &["`moe.shared_experts`", "need a width", "shared_expert_ffn_dim"],
    );
    let e = model(&format!("{LLAMA}{MOE}  shared_expert_ffn_dim: 64\n"));
    check(&e, 12, 26, &["`moe.shared_expert_ffn_dim`", "no shared experts"]);
    let e = model(&format!("{LLAMA}{MOE}  shared_expert_gate: true\n"));
    check(&e, 12, 23, &["`moe.shared_expert_gate`", "there are none"]);
    let e = model(&format!("{LLAMA}{MOE}  aux_loss_coef: -0.1\n"));
    check(&e, 12, 18, &["`moe.aux_loss_coef`", "finite number >= 0"]);
    let e = model(&format!("{LLAMA}{MOE}  aux_loss_coef: .nan\n"));
    check(&e, 12, 18, &["`moe.aux_loss_coef`"]);
    let e = model(&format!("{LLAMA}{MOE}  first_dense: 2\n"));
    check(&e, 12, 16, &["`moe.first_dense`", "no layer of 2 has experts"]);
    let e = model(&format!("{LLAMA}{MOE}  hf_names: deepseek\n"));
    check(
        &e,
        12,
        13,
        &[
            "`moe.hf_names`",
            "unknown variant `deepseek`",
            "valid here: qwen, mixtral",
        ],
    );
    for (names, want) in [("mixtral", MoeNames::Mixtral), ("qwen", MoeNames::Qwen)] {
        let (c, _) = parse_model_spec(&Source::from_text(
            "m.yaml",
            format!("{LLAMA}{MOE}  hf_names: {names}\n").as_str(),
        ))
        .unwrap();
        let ModelConfig::Llama(c) = c else { unreachable!() };
        assert_eq!(c.moe.unwrap().hf_names, want);
    }
    let e = model(&format!("{LLAMA}{MOE}  every: 3\n"));
    check(&e, 12, 10, &["`moe.every`", "no layer of 2 has experts"]);
    let e = model(&format!("{LLAMA}{MOE}  every: 0\n"));
    check(&e, 12, 10, &["`moe.every`", "at least 1"]);
    let e = model(&format!("{LLAMA}moe:\n  experts: 8\n"));
    check(&e, 9, 3, &["missing field `top_k`"]);
    // A defaulted width (the model's ffn_dim) that is 0 is blamed on `moe`... ffn_dim is
    // checked first; the expert width written as 0 is named.
    let e = model(&format!(
        "{LLAMA}{}",
        MOE.replace("expert_ffn_dim: 32", "expert_ffn_dim: 0")
    ));
    check(&e, 11, 19, &["`moe.expert_ffn_dim`", "at least 1"]);
    let e = model(&format!(
        "family: gpt2\nvocab_size: 10\ndim: 8\nn_layers: 1\nn_heads: 2\n{MOE}"
    ));
    check(&e, 7, 3, &["`moe`", "does not apply to family gpt2"]);
}

const QWEN3_MOE: &str = "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"vocab_size\": 256, \"hidden_size\": 64,\n \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"intermediate_size\": 128,\n \"num_experts\": 8, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 32";

#[test]
fn moe_config_json_fields() {
    parse_hf_config(&Source::from_text("config.json", format!("{QWEN3_MOE}}}"))).unwrap();
    let e = hf(&format!("{QWEN3_MOE},\n \"mlp_only_layers\": [5]}}"));
    check(&e, 4, 2, &["`mlp_only_layers`", "layer 5", "past the model's 2 layers"]);
    let e = hf(&format!("{QWEN3_MOE},\n \"mlp_only_layers\": [0, 1]}}"));
    check(&e, 4, 2, &["`mlp_only_layers`", "no layer of 2 has experts"]);
    let e = hf(&format!(
        "{}}}",
        QWEN3_MOE.replace("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 9")
    ));
    check(&e, 3, 20, &["`num_experts_per_tok`", "more than the 8 experts"]);
    let e = hf(&format!(
        "{}}}",
        QWEN3_MOE.replace(", \"moe_intermediate_size\": 32", "")
    ));
    assert!(e.to_string().contains("missing `moe_intermediate_size`"), "{e}");
    let e = hf(&format!("{QWEN3_MOE},\n \"decoder_sparse_step\": 0}}"));
    check(&e, 4, 2, &["`decoder_sparse_step`", "at least 1"]);
    let e = hf(&format!("{QWEN3_MOE},\n \"shared_expert_intermediate_size\": 64}}"));
    check(
        &e,
        4,
        2,
        &["unknown Qwen3MoeForCausalLM config key `shared_expert_intermediate_size`"],
    );
    let qwen2 = QWEN3_MOE.replace("Qwen3Moe", "Qwen2Moe");
    let e = hf(&format!("{qwen2}}}"));
    assert!(
        e.to_string().contains("missing `shared_expert_intermediate_size`"),
        "{e}"
    );
    let e = hf(&format!("{qwen2},\n \"shared_expert_intermediate_size\": 0}}"));
    check(&e, 4, 2, &["`shared_expert_intermediate_size` is 0"]);
    let mixtral = "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 256, \"hidden_size\": 64,\n \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"intermediate_size\": 128,\n \"num_local_experts\": 8, \"num_experts_per_tok\": 2";
    parse_hf_config(&Source::from_text("config.json", format!("{mixtral}}}"))).unwrap();
    let e = hf(&format!("{mixtral},\n \"router_jitter_noise\": 0.01}}"));
    check(&e, 4, 2, &["`router_jitter_noise`", "not implemented"]);
    let e = hf(&format!("{mixtral},\n \"num_experts\": 4}}"));
    check(&e, 4, 2, &["`num_experts` is 4 but `num_local_experts` is 8"]);
    let e = hf(&format!("{mixtral},\n \"moe_intermediate_size\": 32}}"));
    check(
        &e,
        4,
        2,
        &["unknown MixtralForCausalLM config key `moe_intermediate_size`"],
    );
    let e = hf(&format!("{mixtral},\n \"norm_topk_prob\": \"yes\"}}"));
    check(&e, 4, 24, &["`norm_topk_prob`", "wrong type"]);
}

#[test]
fn unsupported_architecture() {
    let e = hf("{\n  \"architectures\": [\"MixtralForCausalLm\"]\n}");
    check(
        &e,
        2,
        3,
        &[
            "unsupported architecture `MixtralForCausalLm`",
            "did you mean `MixtralForCausalLM`?",
        ],
    );
    let e = hf("{\"model_type\": \"t5\"}");
    check(&e, 1, 2, &["unsupported model_type `t5`"]);
    let e = hf("{\"hidden_size\": 4}");
    assert!(
        e.to_string().contains("neither `architectures` nor `model_type`"),
        "{e}"
    );
    let e = hf("{\"architectures\": [\"LlamaForCausalLM\"], \"attention_bias\": true}");
    check(&e, 1, 41, &["`attention_bias: true`", "not supported"]);
}

/// The classic "billion laughs": nine levels of nine aliases each.
fn billion_laughs() -> String {
    let mut doc = String::from("a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for (i, c) in "bcdefghi".chars().enumerate() {
        let p = (b'a' + i as u8) as char;
        doc.push_str(&format!(
            "{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        ));
    }
    doc
}

#[test]
fn yaml_alias_bomb_is_refused() {
    // Strict keys refuse the bomb at its first key, before anything is expanded.
    let e = parallel(&billion_laughs());
    check(&e, 1, 1, &["unknown field `a`"]);
    let e = model(&billion_laughs());
    check(&e, 1, 1, &["unknown field `a`"]);
    // Inside a field the spec does take, the parser's alias budget stops it.
    let e = parallel(&format!("mesh: {{shard: 1}}\nwrap: [&b block{}]\n", ", *b".repeat(300)));
    check(&e, 3, 1, &["expands too much (YAML alias bomb?)", "AliasAnchorRatio"]);
}

#[test]
fn deep_nesting_is_refused_with_a_path() {
    let mut doc = String::from("mesh: {shard: 1}\nwrap: [");
    doc.push_str(&"[".repeat(200));
    doc.push_str(&"]".repeat(201));
    let e = parallel(&doc);
    check(&e, 2, 8, &["`wrap[0]`"]);
}

#[test]
fn absurd_sizes_do_not_overflow() {
    let e = model(&LLAMA.replace("vocab_size: 256", "vocab_size: 9223372036854775807"));
    check(&e, 2, 13, &["overflow u64", "realistic sizes"]);
    let e = model(&LLAMA.replace("dim: 64", "dim: 99999999999999999999999"));
    assert!(e.to_string().contains("expected a whole number"), "{e}");
    let e = parallel("mesh: {replicate: 4294967296, shard: 4294967296}\n");
    check(&e, 1, 7, &["more than the 1048576 ranks"]);
    let e = model(&LLAMA.replace("n_layers: 2", "n_layers: 18446744073709551615"));
    check(&e, 4, 11, &["more than the 10000"]);
}

#[test]
fn parallel_spec_rules() {
    let cases: &[(&str, u64, u64, &str)] = &[
        (
            "mesh: {replicate: 2, shard: 4}\nworld: 16\n",
            2,
            8,
            "the mesh has replicate x shard = 2 x 4 = 8 ranks, but world is 16",
        ),
        (
            "mesh: {shard: 4}\nprefetch: {explicit: {sideways: {}}}\n",
            2,
            23,
            "unknown field",
        ),
        (
            "mesh: {shard: 4}\nbatch: {grad_sync: sometimes}\n",
            2,
            20,
            "unknown variant",
        ),
        ("mesh: {shard: 4}\nbucket_mib: 0\n", 2, 13, "must be at least 1"),
        (
            "mesh: {shard: 2, tensor: 2}\ngpus_per_node: 4\ntensor_parallel: {async: true}\n",
            3,
            26,
            "the model is not compiled",
        ),
        (
            "mesh: {shard: 4}\nruntime: fsdp2\ncompile: true\ntensor_parallel: {async: true}\n",
            4,
            26,
            "the mesh has no tensor axis",
        ),
        (
            "mesh: {shard: 2, tensor: 2}\ngpus_per_node: 4\nruntime: fsdp2\ncompile: true\n\
             tensor_parallel: {sequence_parallel: false, async: true}\n",
            5,
            52,
            "sequence_parallel is off",
        ),
        (
            "mesh: {shard: 8}\nhardware: a100-80gb\nfloat8: {recipe: rowwise}\n",
            3,
            9,
            "has no float8 tensor cores",
        ),
        (
            "mesh: {shard: 8}\nfloat8: {recipe: rowwise, fsdp_float8_all_gather: true}\n",
            2,
            51,
            "only with tensorwise",
        ),
        (
            "mesh: {shard: 8}\nfloat8: {precompute_scale: true}\n",
            2,
            28,
            "the float8 all-gather, which is off",
        ),
        (
            "mesh: {shard: 8}\nfloat8: {recipe: rowwise_with_gw_hp, filter_fqns: [auto_filter_small_kn]}\n",
            2,
            51,
            "no `auto_filter_small_kn` heuristics",
        ),
        (
            "mesh: {shard: 8}\nfloat8: {filter_fqns: [lm_head, \"\"]}\n",
            2,
            33,
            "an empty entry matches every linear",
        ),
        (
            "mesh: {shard: 8}\nmxfp8: {recipe: mxfp8_cublas}\n",
            2,
            8,
            "has no MX tensor cores",
        ),
        (
            "mesh: {shard: 8}\nhardware: b200\nfloat8: {}\nmxfp8: {}\n",
            4,
            8,
            "asks for both",
        ),
        (
            "mesh: {replicate: 3, shard: 4}\ngpus_per_node: 8\n",
            2,
            16,
            "does not fill whole nodes of 8",
        ),
        (
            "mesh: {shard: 8}\nreshard_after_forward: 3\n",
            2,
            24,
            "3 does not divide the shard axis (8)",
        ),
        (
            "mesh: {shard: 2, context: 2}\ngpus_per_node: 4\nreshard_after_forward: 3\n",
            3,
            24,
            "3 does not divide the shard axis (4)",
        ),
        ("mesh: {shard: 4, context: 0}\n", 1, 27, "must be at least 1"),
        (
            "mesh: {shard: 2, context: 2, expert: 2}\ngpus_per_node: 4\n",
            1,
            27,
            "does not combine with mesh.expert 2",
        ),
        (
            "mesh: {pipeline: 2, shard: 2, context: 2}\n",
            1,
            40,
            "does not combine with mesh.pipeline 2",
        ),
        (
            "mesh: {shard: 2, context: 2}\ngpus_per_node: 4\ncontext_parallel: {rotate: ring}\n",
            3,
            28,
            "unknown variant `ring`",
        ),
        (
            "mesh: {shard: 2, context: 2}\ngpus_per_node: 4\ncontext_parallel: {load_balance: zigzag}\n",
            3,
            34,
            "unknown variant `zigzag`",
        ),
        (
            "mesh: {shard: 8}\nreshard_after_forward: maybe\n",
            2,
            1,
            "true, false or a positive integer",
        ),
        (
            "mesh: {shard: 8}\nmixed_precision: {param: u32}\n",
            2,
            26,
            "not a floating-point dtype",
        ),
        (
            "mesh: {shard: 8}\nmixed_precision: {param: fp8}\n",
            2,
            26,
            "unknown variant `fp8`",
        ),
        ("mesh: {shard: 8}\noffload: gpu\n", 2, 10, "unknown variant `gpu`"),
        (
            "mesh: {shard: 8}\nactivation_checkpointing: ful\n",
            2,
            27,
            "did you mean `full`?",
        ),
        (
            "mesh: {shard: 8}\nactivation_checkpointing: {every: 0}\n",
            2,
            35,
            "at least 1",
        ),
        (
            "mesh: {shard: 8}\nactivation_checkpointing: selectve\n",
            2,
            27,
            "did you mean `selective`?",
        ),
        (
            "mesh: {shard: 8}\nactivation_checkpointing: {selective: {save: [attention, matmul]}}\n",
            2,
            58,
            "did you mean `matmuls`?",
        ),
        (
            "mesh: {shard: 8}\nactivation_checkpointing: {selective: {save: [matmuls, odd_matmuls]}}\n",
            2,
            56,
            "repeats what the list already saves",
        ),
        (
            "mesh: {shard: 8}\nactivation_checkpointing: {every: 2, selective: {save: []}}\n",
            2,
            27,
            "either `every` or `selective`",
        ),
        (
            "mesh: {shard: 8}\nwrap: [block, root]\n",
            2,
            15,
            "the root group is always the last group",
        ),
        ("mesh: {shard: 8}\nhardware: h100\n", 2, 11, "did you mean `h100-sxm`?"),
        (
            "mesh: {shard: 8}\nhardware: {bf16_tflops: 100}\n",
            2,
            11,
            "missing f32_tflops",
        ),
        (
            "mesh: {shard: 8}\nhardware: {base: h200, compute_efficiency: 1.5}\n",
            2,
            44,
            "in (0, 1]",
        ),
        (
            "mesh: {shard: 8}\nhardware: {base: h200, hbm_gbs: 1}\n",
            2,
            24,
            "did you mean `hbm_gbps`?",
        ),
        (
            "mesh: {shard: 8}\nhardware: {base: h200, nccl_channels: -1}\n",
            2,
            39,
            "must be >= 0",
        ),
        ("mesh: {shard: 8}\nbatch: {per_rank: 0}\n", 2, 19, "at least 1"),
        ("mesh: {shard: 8}\noptimizer: {adamw: {lr: -1}}\n", 2, 25, "must be > 0"),
        (
            "mesh: {shard: 8}\noptimizer: {adamw: {betas: [0.9, 1.5]}}\n",
            2,
            28,
            "in [0, 1)",
        ),
        (
            "mesh: {shard: 8}\noptimizer: {adamw: {implementation: foreach_}}\n",
            2,
            37,
            "did you mean `foreach`?",
        ),
        (
            "mesh: {shard: 8}\noptimizer: {adamw: {implementation: 1}}\n",
            2,
            37,
            "fused",
        ),
        (
            "mesh: {shard: 8}\noptimizer: {sgd: {implementation: fused}}\n",
            2,
            19,
            "unknown field",
        ),
        (
            "mesh: {shard: 8}\noptimizer: {adam: {lr: 1}}\n",
            2,
            13,
            "did you mean `adamw`?",
        ),
        (
            "mesh: {shard: 8}\ngrad_clip: 0\n",
            2,
            12,
            "> 0 (or null for no clipping)",
        ),
        ("mesh: {shard: 8}\nprefetch: {forward: 100}\n", 2, 21, "more than 64"),
        (
            "mesh: {shard: 8}\nprefetch: sometimes\n",
            2,
            11,
            "use auto (the default)",
        ),
        (
            "mesh: {shard: 8}\nprefetch: {peak_aware: 2}\n",
            2,
            24,
            "expected true or false",
        ),
        ("mesh: {shard: 8}\nmesh: {shard: 4}\n", 2, 1, "duplicate"),
        ("wrap: [block]\n", 1, 1, "missing field `mesh`"),
    ];
    for (text, line, col, want) in cases {
        let e = parallel(text);
        let shown = e.to_string();
        assert!(shown.contains(want), "`{want}` not in: {shown}\n--- for:\n{text}");
        assert_eq!(
            (e.line, e.column),
            (Some(*line), Some(*col)),
            "position of: {shown}\n--- for:\n{text}"
        );
    }
}

#[test]
fn nulls_and_defaults() {
    let (c, _) = parse_parallel_spec(&Source::from_text("p.yaml", "mesh: {shard: 2}\ngrad_clip: null\n")).unwrap();
    assert_eq!(c.grad_clip, None);
    assert_eq!(c.mesh.world(), 2);
    let (c, _) = parse_parallel_spec(&Source::from_text("p.yaml", PAR_OK)).unwrap();
    assert_eq!(c.grad_clip, Some(1.0));
    assert_eq!(c.hardware.name, "h100-sxm");
}

#[test]
fn memory_outside_the_allocator_has_documented_defaults_and_can_be_set() {
    use shardplan_frontends::{CUDA_CONTEXT_MIB, NCCL_CHANNELS, NCCL_CHANNEL_MIB};
    // NCCL's default buffers per connection: Simple 4 MiB + LL128 4.6875 MiB + LL 512 KiB.
    assert_eq!(NCCL_CHANNEL_MIB, 9.1875);
    let (c, _) = parse_parallel_spec(&Source::from_text("p.yaml", PAR_OK)).unwrap();
    let hw = &c.hardware;
    assert_eq!(
        (hw.cuda_context_mib, hw.nccl_channels, hw.nccl_channel_mib),
        (CUDA_CONTEXT_MIB, NCCL_CHANNELS, NCCL_CHANNEL_MIB)
    );
    assert_eq!(hw.cuda_context_bytes(), 666_632_192);
    assert_eq!(hw.nccl_bytes_per_communicator(), 16 * 9_633_792);
    // A custom profile needs none of them, and may set each (0: none of that memory).
    let numbers = "bf16_tflops: 1, f32_tflops: 1, hbm_gib: 1, hbm_gbps: 1, intra_node_gbps: 1, inter_node_gbps: 1, intra_node_latency_us: 1, inter_node_latency_us: 1, compute_efficiency: 1, host_link_gbps: 1, host_mem_gbps: 1";
    let text = format!("mesh: {{shard: 2}}\nhardware: {{{numbers}}}\n");
    let (c, _) = parse_parallel_spec(&Source::from_text("p.yaml", text.as_str())).unwrap();
    assert_eq!(c.hardware.cuda_context_mib, CUDA_CONTEXT_MIB);
    let text = format!("mesh: {{shard: 2}}\nhardware: {{{numbers}, cuda_context_mib: 0, nccl_channels: 8}}\n");
    let (c, _) = parse_parallel_spec(&Source::from_text("p.yaml", text.as_str())).unwrap();
    assert_eq!((c.hardware.cuda_context_bytes(), c.hardware.nccl_channels), (0, 8.0));
}

#[test]
fn validation_data_fields() {
    let ok = parse_parallel_spec(&Source::from_text(
        "dir/p.yaml",
        "mesh: {shard: 2}\ndata: {tokens: t.bin, val: v.bin, eval_every: 50, eval_batches: 4}\n",
    ))
    .unwrap()
    .0;
    match ok.data {
        shardplan_frontends::DataSource::Tokens { eval: Some(e), .. } => {
            assert_eq!((e.path, e.every, e.batches), (PathBuf::from("dir/v.bin"), 50, 4));
        }
        other => panic!("{other:?}"),
    }
    // Defaults: every 100 steps, 10 batches.
    let d = parse_parallel_spec(&Source::from_text(
        "p.yaml",
        "mesh: {shard: 2}\ndata: {tokens: t.bin, val: v.bin}\n",
    ))
    .unwrap()
    .0;
    assert!(matches!(
        d.data,
        shardplan_frontends::DataSource::Tokens {
            eval: Some(shardplan_frontends::Eval {
                every: 100,
                batches: 10,
                ..
            }),
            ..
        }
    ));
    let e = parallel(&format!("{PAR_OK}data: {{tokens: t.bin, eval_every: 5}}\n"));
    check(
        &e,
        2,
        35,
        &["`data.eval_every`", "needs a validation token file", "add `val: "],
    );
    let e = parallel(&format!("{PAR_OK}data: {{tokens: t.bin, val: v.bin, eval_every: 0}}\n"));
    check(&e, 2, 47, &["`data.eval_every`", "at least 1"]);
    let e = parallel(&format!(
        "{PAR_OK}data: {{tokens: t.bin, val: v.bin, eval_batches: 5000}}\n"
    ));
    check(&e, 2, 49, &["`data.eval_batches`", "at most 1024"]);
    let e = parallel(&format!("{PAR_OK}data: {{tokens: t.bin, vall: v.bin}}\n"));
    check(&e, 2, 23, &["unknown field `vall`", "did you mean `val`?"]);
    let e = parallel(&format!("{PAR_OK}data: {{tokens: t.bin, val: \"\"}}\n"));
    check(&e, 2, 28, &["`data.val`", "empty"]);
}

#[test]
fn runtime_field() {
    let ok = |text: &str| parse_parallel_spec(&Source::from_text("p.yaml", text)).unwrap().0;
    // Absent: shardplan's executor, and the profile's kernels as written.
    let c = ok(PAR_OK);
    assert_eq!(c.runtime, shardplan_frontends::Runtime::Shardplan);
    let c = ok(&format!(
        "{PAR_OK}runtime: shardplan\nhardware: {{base: h100-sxm, kernels: fused}}\n"
    ));
    assert_eq!(c.hardware.kernels, shardplan_frontends::KernelMode::Fused);
    // fsdp2 implies eager kernels.
    let c = ok(&format!("{PAR_OK}runtime: fsdp2\n"));
    assert_eq!(c.runtime, shardplan_frontends::Runtime::Fsdp2);
    assert_eq!(c.hardware.kernels, shardplan_frontends::KernelMode::Eager);
    let c = ok(&format!(
        "{PAR_OK}runtime: fsdp2\nhardware: {{base: a100-80gb, kernels: eager}}\n"
    ));
    assert_eq!(c.hardware.kernels, shardplan_frontends::KernelMode::Eager);
    // Unknown runtimes, with a suggestion.
    let e = parallel(&format!("{PAR_OK}runtime: fsdp\n"));
    check(&e, 2, 10, &["unknown variant `fsdp`", "did you mean `fsdp2`?"]);
    assert_eq!(e.field.as_deref(), Some("runtime"));
    let e = parallel(&format!("{PAR_OK}runtime: shardpaln\n"));
    check(&e, 2, 10, &["did you mean `shardplan`?"]);
    let e = parallel(&format!("{PAR_OK}runtime: 2\n"));
    assert_eq!(e.field.as_deref(), Some("runtime"), "{e}");
    let e = parallel(&format!("{PAR_OK}runtimes: fsdp2\n"));
    check(&e, 2, 1, &["unknown field `runtimes`", "did you mean `runtime`?"]);
    // fsdp2 runs eager kernels: asking for fused ones as well is refused where written.
    let e = parallel(&format!(
        "{PAR_OK}runtime: fsdp2\nhardware: {{base: h100-sxm, kernels: fused}}\n"
    ));
    check(
        &e,
        3,
        37,
        &["`runtime: fsdp2` runs PyTorch eager kernels", "remove `kernels: fused`"],
    );
    assert_eq!(e.field.as_deref(), Some("hardware.kernels"));
}

#[test]
fn allocator_field() {
    let ok = |text: &str| parse_parallel_spec(&Source::from_text("p.yaml", text)).unwrap().0;
    // Absent: expandable segments, as torchtitan launches.
    let c = ok(PAR_OK);
    assert!(c.allocator.expandable_segments);
    assert_eq!(c.allocator, shardplan_frontends::AllocatorConfig::TORCHTITAN);
    let c = ok(&format!("{PAR_OK}allocator: {{expandable_segments: false}}\n"));
    assert!(!c.allocator.expandable_segments);
    let c = ok(&format!("{PAR_OK}allocator: {{}}\n"));
    assert!(c.allocator.expandable_segments);
    for (text, line, col, texts) in [
        (
            "allocator: {expandable_segment: false}\n",
            2,
            13,
            &[
                "unknown field `expandable_segment`",
                "did you mean `expandable_segments`?",
            ][..],
        ),
        (
            "allocator: {expandable_segments: maybe}\n",
            2,
            34,
            &["`allocator.expandable_segments`", "expected true or false"][..],
        ),
        (
            "allocator: {expandable_segments: 1}\n",
            2,
            34,
            &["`allocator.expandable_segments`", "expected true or false"][..],
        ),
        // PyTorch's environment-variable form is not the spec's.
        (
            "allocator: \"expandable_segments:True\"\n",
            2,
            12,
            &["`allocator`", "expected a mapping"][..],
        ),
        (
            "allocator: {max_split_size_mb: 512}\n",
            2,
            13,
            &["unknown field `max_split_size_mb`"][..],
        ),
        (
            "allocater: {expandable_segments: true}\n",
            2,
            1,
            &["did you mean `allocator`?"][..],
        ),
    ] {
        let e = parallel(&format!("{PAR_OK}{text}"));
        check(&e, line, col, texts);
    }
}

#[test]
fn tensor_parallel_fields() {
    let ok = |text: &str| parse_parallel_spec(&Source::from_text("p.yaml", text)).unwrap().0;
    let c = ok("mesh: {shard: 4, tensor: 2}\n");
    assert_eq!((c.mesh.world(), c.mesh.data_parallel(), c.mesh.tensor), (8, 4, 2));
    assert!(c.tensor_parallel.sequence_parallel && c.tensor_parallel.loss_parallel);
    let c = ok("mesh: {shard: 4, tensor: 2}\ntensor_parallel: {sequence_parallel: false}\n");
    assert!(!c.tensor_parallel.sequence_parallel && c.tensor_parallel.loss_parallel);
    assert_eq!(ok(PAR_OK).mesh.tensor, 1);
    // `runtime: fsdp2` plans DTensor's tensor parallelism (the exported program's).
    let c = ok("mesh: {shard: 4, tensor: 2}\nruntime: fsdp2\n");
    assert_eq!((c.runtime, c.mesh.tensor), (shardplan_frontends::Runtime::Fsdp2, 2));
    for (text, line, col, texts) in [
        (
            "mesh: {shard: 4, tensor: 0}\n",
            1,
            26,
            &["`mesh.tensor`", "must be at least 1"][..],
        ),
        (
            "mesh: {shard: 2, tensor: 16}\ngpus_per_node: 8\n",
            1,
            26,
            &[
                "`mesh.tensor`",
                "would span nodes of 8 GPUs",
                "divisor of gpus_per_node (8)",
            ][..],
        ),
        (
            "mesh: {shard: 1, tensor: 8}\nworld: 4\n",
            1,
            26,
            &["`mesh.tensor`", "larger than the world of 4 ranks"][..],
        ),
        (
            "mesh: {shard: 4, tensor: 2}\nworld: 4\n",
            2,
            8,
            &[
                "`world`",
                "replicate x shard x tensor = 1 x 4 x 2 = 8 ranks, but world is 4",
            ][..],
        ),
        (
            "mesh: {shard: 4, tensor: 2}\ntensor_parallel: {sequence: true}\n",
            2,
            19,
            &["unknown field `sequence`", "did you mean `sequence_parallel`?"][..],
        ),
        (
            "mesh: {shard: 4, tensor: 2}\ntensor_parallel: {loss_parallel: maybe}\n",
            2,
            34,
            &["`tensor_parallel.loss_parallel`", "expected true or false"][..],
        ),
        ("mesh: {shard: 4, tensr: 2}\n", 1, 18, &["did you mean `tensor`?"][..]),
    ] {
        let e = parallel(text);
        check(&e, line, col, texts);
    }
}

#[test]
fn tensor_parallel_needs_a_model_that_splits() {
    use shardplan_frontends::{trace_error, trace_options};
    let dir = tempfile::tempdir().unwrap();
    let m = load_model(&tmp(dir.path(), "m.yaml", LLAMA.as_bytes())).unwrap();
    let mlp = load_model(&PathBuf::from("tiny-mlp")).unwrap();
    for (model, text, field, line, col, texts) in [
        // 2 key/value heads do not split 4 ways.
        (
            &m,
            "mesh: {shard: 2, tensor: 4}\n",
            "mesh.tensor",
            1,
            26,
            &["2 key/value heads do not split over 4 tensor ranks"][..],
        ),
        (
            &m,
            "mesh: {shard: 1, tensor: 8}\n",
            "mesh.tensor",
            1,
            26,
            &["4 attention heads do not split over 8"][..],
        ),
        (
            &mlp,
            "mesh: {shard: 1, tensor: 2}\n",
            "mesh.tensor",
            1,
            26,
            &["the mlp family has no tensor-parallel plan"][..],
        ),
        (
            &m,
            "mesh: {shard: 1, tensor: 2}\nbatch: {per_rank: 1, seq_len: 15}\n",
            "batch.seq_len",
            2,
            31,
            &["splits the 15 positions over 2 tensor ranks"][..],
        ),
    ] {
        let p = load_parallel(&tmp(dir.path(), "p.yaml", text.as_bytes())).unwrap();
        let e = shardplan_models::trace(&model.config, trace_options(Some(&p))).unwrap_err();
        let e = trace_error(e, model, Some(&p));
        assert_eq!(e.field.as_deref(), Some(field), "{e}");
        check(&e, line, col, texts);
    }
    // GPT-2's vocabulary of 255 does not split 2 ways: loss parallelism is refused where
    // it was written (or defaulted: the mesh), and the embedding stays whole without it.
    let odd = tmp(
        dir.path(),
        "odd.yaml",
        b"family: gpt2\nvocab_size: 255\ndim: 64\nn_layers: 2\nn_heads: 4\nffn_dim: 256\nmax_seq_len: 128\n",
    );
    let odd = load_model(&odd).unwrap();
    let p = load_parallel(&tmp(
        dir.path(),
        "lp.yaml",
        b"mesh: {shard: 1, tensor: 2}\ntensor_parallel: {loss_parallel: true}\nbatch: {per_rank: 1, seq_len: 16}\n",
    ))
    .unwrap();
    let e = trace_error(
        shardplan_models::trace(&odd.config, trace_options(Some(&p))).unwrap_err(),
        &odd,
        Some(&p),
    );
    check(
        &e,
        2,
        34,
        &[
            "`tensor_parallel.loss_parallel`",
            "vocabulary of 255",
            "pad vocab_size to a multiple of 2",
        ],
    );
    let p = load_parallel(&tmp(
        dir.path(),
        "nolp.yaml",
        b"mesh: {shard: 1, tensor: 2}\ntensor_parallel: {loss_parallel: false}\nbatch: {per_rank: 1, seq_len: 16}\n",
    ))
    .unwrap();
    shardplan_models::trace(&odd.config, trace_options(Some(&p))).unwrap();
}

#[test]
fn compile_is_a_pytorch_runs_and_takes_a_bool_or_a_map() {
    let ok = |text: &str| parse_parallel_spec(&Source::from_text("p.yaml", text)).unwrap().0;
    // PAR_OK plans shardplan's own executor, which does not compile.
    let n = PAR_OK.lines().count() as u64;
    check(
        &parallel(&format!("{PAR_OK}compile: true\n")),
        n + 1,
        10,
        &[
            "`compile` is torch.compile of a PyTorch FSDP2 run",
            "add `runtime: fsdp2`",
        ],
    );
    let c = ok(&format!("{PAR_OK}runtime: fsdp2\ncompile: true\n"));
    assert_eq!(
        c.compile,
        shardplan_frontends::Compile {
            model: true,
            loss: true
        }
    );
    let c = ok(&format!("{PAR_OK}runtime: fsdp2\ncompile: {{model: true}}\n"));
    assert_eq!(
        c.compile,
        shardplan_frontends::Compile {
            model: true,
            loss: false
        }
    );
    // Writing `compile: false` anywhere is fine.
    assert!(!ok(&format!("{PAR_OK}compile: false\n")).compile.any());
    // The written spec reads back as it was.
    let c = ok(&format!("{PAR_OK}runtime: fsdp2\ncompile: {{loss: true}}\n"));
    assert_eq!(ok(&shardplan_frontends::spec_yaml(&c)).compile, c.compile);
    let e = parallel(&format!(
        "{PAR_OK}runtime: fsdp2\ncompile: {{model: true, graphs: 2}}\n"
    ));
    assert!(e.to_string().contains("graphs"), "{e}");
}
