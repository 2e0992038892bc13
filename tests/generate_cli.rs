//! From text to a model that writes text, through the binary: `data prepare`, `train` on
//! 1x2 ranks with validation, `generate` from the checkpoint and from its exported
//! safetensors, and bad inputs to `generate` refused with exit 2 naming what is wrong.

mod common;

use common::{json_lines, shardplan, shardplan_ok, stderr, stdout};

const TOKENIZER: &str = "tests/fixtures/tokenizer/tokenizer.json";

#[test]
fn prepare_train_with_validation_and_generate() {
    let d = tempfile::tempdir().unwrap();
    let p = |name: &str| d.path().join(name).to_str().unwrap().to_string();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string("tests/fixtures/tokenizer/expected.json").unwrap()).unwrap();
    let text: Vec<String> = expected["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    std::fs::write(p("corpus.txt"), text.join("\n\n").repeat(4)).unwrap();
    shardplan_ok(&[
        "data",
        "prepare",
        "--tokenizer",
        TOKENIZER,
        "--out",
        &p("tok"),
        "--val-fraction",
        "0.2",
        &p("corpus.txt"),
    ]);
    std::fs::write(
        p("m.yaml"),
        "name: t\nfamily: llama\nvocab_size: 512\ndim: 32\nn_layers: 2\nn_heads: 2\nffn_dim: 64\nmax_seq_len: 64\n",
    )
    .unwrap();
    std::fs::write(
        p("p.yaml"),
        "mesh: {shard: 2}\ngpus_per_node: 2\nmixed_precision: {param: f32, reduce: f32}\nbatch: {per_rank: 2, seq_len: 16}\n\
         optimizer: {adamw: {lr: 1.0e-2}}\ndata: {tokens: tok/train.bin, val: tok/val.bin, eval_every: 2, eval_batches: 2}\n",
    )
    .unwrap();
    let o = shardplan_ok(&[
        "train",
        "--model",
        &p("m.yaml"),
        "--parallel",
        &p("p.yaml"),
        "--steps",
        "5",
        "--log",
        &p("log.jsonl"),
        "--checkpoint-dir",
        &p("ckpt"),
    ]);
    let log = json_lines(&d.path().join("log.jsonl"));
    let val: Vec<Option<f64>> = log.iter().map(|l| l["val_loss"].as_f64()).collect();
    assert!(val[0].is_none() && val[2].is_none(), "{val:?}");
    assert!(val[1].is_some() && val[3].is_some() && val[4].is_some(), "{val:?}");
    assert!(
        stdout(&o).contains(&format!(
            "validation loss {:.4} -> {:.4}",
            val[1].unwrap(),
            val[4].unwrap()
        )),
        "{}",
        stdout(&o)
    );

    let generate = |from: &str, extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--from",
            from,
            "--tokenizer",
            TOKENIZER,
            "--prompt",
            "The ",
            "--max-new-tokens",
            "12",
        ];
        args.extend_from_slice(extra);
        shardplan(&args)
    };
    let greedy = generate(&p("ckpt"), &["--temperature", "0"]);
    assert!(greedy.status.success(), "{}", stderr(&greedy));
    let text = stdout(&greedy);
    assert!(text.starts_with("The ") && text.len() > 5, "{text:?}");
    assert!(stderr(&greedy).contains("new tokens in"), "{}", stderr(&greedy));
    // The exported safetensors (with the model named) generate the same text.
    shardplan_ok(&["checkpoint", "export", &p("ckpt"), "--out", &p("model.safetensors")]);
    let again = generate(
        &p("model.safetensors"),
        &["--temperature", "0", "--model", &p("m.yaml")],
    );
    assert!(again.status.success(), "{}", stderr(&again));
    assert_eq!(stdout(&again), text);
    // --logits writes the prompt's ids and one row of vocab logits per prompt position,
    // the same from the checkpoint and from its export.
    let logits = |from: &str, file: &str, extra: &[&str]| {
        let mut args = vec!["--temperature", "0", "--logits", file];
        args.extend_from_slice(extra);
        let o = generate(from, &args);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
        v
    };
    let (l1, l2) = (p("l1.json"), p("l2.json"));
    let a = logits(&p("ckpt"), &l1, &[]);
    let b = logits(&p("model.safetensors"), &l2, &["--model", &p("m.yaml")]);
    let tokens = a["tokens"].as_array().unwrap().len();
    let rows = a["logits"].as_array().unwrap();
    assert!(
        tokens >= 1 && rows.len() == tokens,
        "{tokens} tokens, {} rows",
        rows.len()
    );
    assert!(
        rows.iter().all(|r| r.as_array().unwrap().len() == 512),
        "vocab-wide rows"
    );
    assert_eq!(a, b, "the export's logits equal the checkpoint's");
    // Sampling repeats with its seed.
    let a = generate(&p("ckpt"), &["--seed", "3"]);
    let b = generate(&p("ckpt"), &["--seed", "3"]);
    assert!(a.status.success(), "{}", stderr(&a));
    assert_eq!(stdout(&a), stdout(&b));

    // Bad inputs: exit 2, naming the file or flag and the fix.
    std::fs::write(
        p("small.yaml"),
        "name: s\nfamily: llama\nvocab_size: 256\ndim: 32\nn_layers: 2\nn_heads: 2\nffn_dim: 64\nmax_seq_len: 64\n",
    )
    .unwrap();
    let long = "word ".repeat(200);
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (
            vec!["--from".into(), p("nowhere"), "--prompt".into(), "x".into()],
            vec!["nowhere", "no such file"],
        ),
        (
            vec!["--from".into(), p("model.safetensors"), "--prompt".into(), "x".into()],
            vec!["config.json", "--model"],
        ),
        (
            vec![
                "--from".into(),
                p("model.safetensors"),
                "--model".into(),
                p("small.yaml"),
                "--prompt".into(),
                "x".into(),
            ],
            vec!["tokenizer.json", "512 tokens", "vocab_size of 256"],
        ),
        (
            vec!["--from".into(), p("ckpt"), "--prompt".into(), long],
            vec!["--prompt", "positions"],
        ),
        (
            vec![
                "--from".into(),
                p("ckpt"),
                "--prompt".into(),
                "x".into(),
                "--top-p".into(),
                "0".into(),
            ],
            vec!["--top-p 0"],
        ),
        (
            vec![
                "--from".into(),
                p("ckpt"),
                "--prompt".into(),
                "x".into(),
                "--temperature=-1".into(),
            ],
            vec!["--temperature -1"],
        ),
    ];
    for (args, want) in cases {
        let mut all = vec!["generate".to_string(), "--tokenizer".into(), TOKENIZER.into()];
        all.extend(args.iter().cloned());
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        let o = shardplan(&refs);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        for w in want {
            assert!(stderr(&o).contains(w), "{args:?}: {}", stderr(&o));
        }
    }
    let o = shardplan(&[
        "generate",
        "--from",
        &p("ckpt"),
        "--tokenizer",
        &p("m.yaml"),
        "--prompt",
        "x",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("is not a tokenizer.json"), "{}", stderr(&o));
}
