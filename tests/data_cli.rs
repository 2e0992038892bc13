//! `shardplan data prepare` as a user runs it: the token ids equal Python `tokenizers`'
//! (tests/fixtures/tokenizer/expected.json, written with it), the files train, and bad
//! inputs are refused naming the file and line.

mod common;

use common::{json_lines, shardplan, shardplan_ok, stderr};

const TOKENIZER: &str = "tests/fixtures/tokenizer/tokenizer.json";

fn read_u16(path: &std::path::Path) -> Vec<u32> {
    std::fs::read(path)
        .unwrap()
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
        .collect()
}

#[test]
fn prepared_tokens_equal_python_tokenizers_and_train() {
    let d = tempfile::tempdir().unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string("tests/fixtures/tokenizer/expected.json").unwrap()).unwrap();
    let docs: Vec<String> = expected["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let eos = expected["eos"].as_u64().unwrap() as u32;
    // The first document as a text file, the rest as JSON lines under another field.
    let txt = d.path().join("a.txt");
    std::fs::write(&txt, &docs[0]).unwrap();
    let jl = d.path().join("b.jsonl");
    let lines: Vec<String> = docs[1..]
        .iter()
        .map(|t| serde_json::json!({"body": t, "id": 1}).to_string())
        .collect();
    std::fs::write(&jl, lines.join("\n") + "\n").unwrap();
    let out = d.path().join("tok");
    shardplan_ok(&[
        "data",
        "prepare",
        "--tokenizer",
        TOKENIZER,
        "--out",
        out.to_str().unwrap(),
        "--field",
        "body",
        "--val-fraction",
        "0.25",
        txt.to_str().unwrap(),
        jl.to_str().unwrap(),
    ]);
    // A missing input is refused.
    let o = shardplan(&[
        "data",
        "prepare",
        "--tokenizer",
        TOKENIZER,
        "--out",
        out.to_str().unwrap(),
        d.path().join("none.jsonl").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let mut want: Vec<u32> = Vec::new();
    for ids in expected["ids"].as_array().unwrap() {
        want.extend(ids.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32));
        want.push(eos);
    }
    let mut got = read_u16(&out.join("train.bin"));
    let val = read_u16(&out.join("val.bin"));
    assert_eq!(val.len(), (want.len() as f64 * 0.25).round() as usize);
    got.extend(val);
    assert_eq!(
        got, want,
        "the stream equals Python tokenizers' ids, each document ended by <|endoftext|>"
    );
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(
        (m["documents"].as_u64(), m["dtype"].as_str(), m["vocab_size"].as_u64()),
        (Some(5), Some("u16"), Some(512))
    );
    assert_eq!(m["tokenizer_sha256"].as_str().unwrap().len(), 64);

    // The train file trains: a model with the tokenizer's vocabulary, 2 steps.
    let model = d.path().join("m.yaml");
    std::fs::write(
        &model,
        "name: t\nfamily: llama\nvocab_size: 512\ndim: 32\nn_layers: 1\nn_heads: 2\nffn_dim: 64\nmax_seq_len: 64\n",
    )
    .unwrap();
    let spec = d.path().join("p.yaml");
    std::fs::write(
        &spec,
        format!(
            "mesh: {{shard: 1}}\ngpus_per_node: 1\nmixed_precision: {{param: f32, reduce: f32}}\nbatch: {{per_rank: 2, seq_len: 8}}\ndata: {{tokens: {}, dtype: u16}}\n",
            out.join("train.bin").display()
        ),
    )
    .unwrap();
    let log = d.path().join("log.jsonl");
    shardplan_ok(&[
        "train",
        "--model",
        model.to_str().unwrap(),
        "--parallel",
        spec.to_str().unwrap(),
        "--steps",
        "2",
        "--log",
        log.to_str().unwrap(),
    ]);
    assert_eq!(json_lines(&log).len(), 2);
}

#[test]
fn bad_inputs_are_refused_naming_the_file_and_line() {
    let d = tempfile::tempdir().unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let p = d.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p.to_str().unwrap().to_string()
    };
    let good = write("good.txt", b"hello");
    let prepare = |extra: &[&str]| {
        let out = d.path().join("o");
        let mut args = vec![
            "data",
            "prepare",
            "--tokenizer",
            TOKENIZER,
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = shardplan(&args);
        (o.status.code(), stderr(&o))
    };
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (
            vec![write("bin.txt", &[0x66, 0xff, 0xfe])],
            vec!["bin.txt", "not UTF-8", "offset 1"],
        ),
        (
            vec![write("bad.jsonl", b"{\"text\": \"a\"}\n{\"text\": \n")],
            vec!["bad.jsonl:2:1", "line 2 is not JSON"],
        ),
        (
            vec![write("nofield.jsonl", b"{\"body\": \"a\"}\n")],
            vec!["nofield.jsonl:1:1", "has no `text` field"],
        ),
        (
            vec![write("num.jsonl", b"{\"text\": 3}\n")],
            vec!["num.jsonl:1:1", "`text` is a number, not a string"],
        ),
        (
            vec!["--eos".into(), "<nope>".into(), good.clone()],
            vec!["tokenizer.json", "--eos `<nope>` is not a token"],
        ),
        (
            vec!["--val-fraction".into(), "1.5".into(), good.clone()],
            vec!["--val-fraction 1.5"],
        ),
        (vec![d.path().to_str().unwrap().to_string()], vec!["cannot read it"]),
    ];
    for (args, want) in cases {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, err) = prepare(&refs);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        for w in want {
            assert!(err.contains(w), "{args:?}: {err}");
        }
    }
    // A tokenizer that is not one.
    let fake = write("tokenizer.json", b"{\"version\": \"1.0\", \"model\": 3}");
    let o = shardplan(&["data", "prepare", "--tokenizer", &fake, "--out", "/tmp/x-never", &good]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("is not a tokenizer.json"), "{}", stderr(&o));
}
