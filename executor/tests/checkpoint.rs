//! Distributed checkpoints: resume on another mesh, crash safety, HF interop, bad input.

use candle_core::Tensor;
use shardplan_executor::checkpoint::{export, resolve, ExportDType, SaveStage};
use shardplan_executor::ShardedTrainer;
use shardplan_frontends::{parse_parallel_spec, ParallelConfig, Source};
use shardplan_models::preset;
use std::path::PathBuf;

fn config(replicate: u64, shard: u64, global: u64) -> ParallelConfig {
    with_optimizer(replicate, shard, global, "{adamw: {lr: 3.0e-3}}")
}

/// A spec with `optimizer: {optimizer}`.
fn with_optimizer(replicate: u64, shard: u64, global: u64, optimizer: &str) -> ParallelConfig {
    let world = replicate * shard;
    let yaml = format!(
        "mesh: {{replicate: {replicate}, shard: {shard}}}\ngpus_per_node: {world}\nbatch: {{per_rank: {}, seq_len: 16}}\n\
         optimizer: {optimizer}\nlr_schedule: {{warmup_steps: 2}}\n",
        global / world
    );
    parse_parallel_spec(&Source::from_text("test.yaml", yaml))
        .unwrap_or_else(|e| panic!("{e}"))
        .0
}

fn temp(dir: &std::path::Path, name: &str) -> PathBuf {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let norm = |t: &Tensor| t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt() as f64;
    norm(&(a - b).unwrap()) / norm(b).max(1e-12)
}

fn bits(ts: &[Tensor]) -> Vec<Vec<u32>> {
    ts.iter()
        .map(|t| {
            t.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect()
}

/// 10 steps on `from`, save, resume on `to`, 10 more; against 20 steps on `from`.
fn resume(model: &str, from: (u64, u64), to: (u64, u64)) {
    resume_on(&preset(model).unwrap(), (from.0, from.1, 1), &[(to.0, to.1, 1)], 24);
}

#[test]
fn resume_on_another_mesh_continues_the_same_run() {
    resume("tiny-llama", (1, 4), (1, 2));
    resume("tiny-llama", (2, 4), (1, 8));
    resume("tiny-llama", (1, 8), (1, 3));
    resume("tiny-gpt2", (2, 2), (1, 4));
}

/// Every setting `runtime::optim` supports, as a spec's `optimizer:` value: SGD without
/// momentum keeps no state, with momentum one buffer; AdamW two moments (beta1 0 still keeps
/// both); weight decay changes the update, not the state.
const OPTIMIZERS: [&str; 7] = [
    "{sgd: {lr: 0.05}}",
    "{sgd: {lr: 0.05, weight_decay: 0.01}}",
    "{sgd: {lr: 0.05, momentum: 0.9}}",
    "{sgd: {lr: 0.05, momentum: 0.9, weight_decay: 0.01}}",
    "{adamw: {lr: 3.0e-3, weight_decay: 0.0}}",
    "{adamw: {lr: 3.0e-3, weight_decay: 0.1}}",
    "{adamw: {lr: 3.0e-3, betas: [0.0, 0.99], eps: 1.0e-6}}",
];

/// Losses of every step and the final weights, as bits.
type Run = (Vec<u32>, Vec<Vec<u32>>);

fn run(t: &mut ShardedTrainer, steps: u64) -> Vec<u32> {
    (0..steps).map(|_| t.step().unwrap().loss.to_bits()).collect()
}

#[test]
fn every_optimizer_setting_resumes_bit_for_bit() {
    const N: u64 = 5;
    let scratch = tempfile::tempdir().unwrap();
    let m = preset("tiny-llama").unwrap();
    for (i, opt) in OPTIMIZERS.iter().enumerate() {
        let cfg = with_optimizer(1, 2, 8, opt);
        let mut straight = ShardedTrainer::new(&m, &cfg, N).unwrap();
        let want: Run = (run(&mut straight, N), bits(&straight.full_params().unwrap()));
        // Saved before the first step (state freshly created) and mid-run.
        for k in [0, 2] {
            let dir = temp(scratch.path(), &format!("optim-{i}-at-{k}"));
            let mut first = ShardedTrainer::new(&m, &cfg, N).unwrap();
            let mut losses = run(&mut first, k);
            first.save(&dir).unwrap();
            let mut second = ShardedTrainer::new(&m, &cfg, N).unwrap();
            let warnings = second.load(&dir).unwrap();
            assert!(warnings.is_empty(), "{opt}: {warnings:?}");
            assert_eq!(second.steps_done(), k);
            losses.extend(run(&mut second, N - k));
            let got: Run = (losses, bits(&second.full_params().unwrap()));
            assert!(got.0 == want.0, "{opt}, saved at step {k}: losses differ");
            assert!(got.1 == want.1, "{opt}, saved at step {k}: final weights differ");
        }
    }
}

#[test]
fn every_optimizer_setting_resumes_on_another_mesh() {
    const N: u64 = 4;
    let scratch = tempfile::tempdir().unwrap();
    let m = preset("tiny-llama").unwrap();
    for (i, opt) in OPTIMIZERS.iter().enumerate() {
        let mut straight = ShardedTrainer::new(&m, &with_optimizer(1, 2, 12, opt), N).unwrap();
        let want: Vec<f32> = (0..N).map(|_| straight.step().unwrap().loss).collect();
        let dir = temp(scratch.path(), &format!("optim-mesh-{i}"));
        let mut first = ShardedTrainer::new(&m, &with_optimizer(1, 2, 12, opt), N).unwrap();
        first.step().unwrap();
        first.save(&dir).unwrap();
        let mut second = ShardedTrainer::new(&m, &with_optimizer(2, 3, 12, opt), N).unwrap();
        second.load(&dir).unwrap();
        for (k, w) in want.iter().enumerate().skip(1) {
            let got = second.step().unwrap().loss;
            assert!(((got - w) / w).abs() < 1e-5, "{opt}: step {} loss {got} vs {w}", k + 1);
        }
        for (a, b) in second
            .full_params()
            .unwrap()
            .iter()
            .zip(&straight.full_params().unwrap())
        {
            assert!(rel(a, b) < 1e-5, "{opt}: weights differ by {:e}", rel(a, b));
        }
    }
}

#[test]
fn sgd_momentum_may_change_on_resume() {
    let scratch = tempfile::tempdir().unwrap();
    let m = preset("tiny-llama").unwrap();
    let plain = with_optimizer(1, 2, 8, "{sgd: {lr: 0.05}}");
    let heavy = with_optimizer(1, 2, 8, "{sgd: {lr: 0.05, momentum: 0.9}}");
    let mut straight = ShardedTrainer::new(&m, &plain, 5).unwrap();
    let want = run(&mut straight, 5);

    // Saved without buffers, resumed with momentum: a buffer starting at zero makes the first
    // update plain SGD's (0.9 * 0 + g = g), so two more losses match the plain run exactly,
    // and the third does not (momentum acts).
    let dir = temp(scratch.path(), "momentum-0-to-0.9");
    let mut first = ShardedTrainer::new(&m, &plain, 5).unwrap();
    run(&mut first, 2);
    first.save(&dir).unwrap();
    let mut second = ShardedTrainer::new(&m, &heavy, 5).unwrap();
    let warnings = second.load(&dir).unwrap();
    assert!(
        warnings.len() == 1 && warnings[0].contains("holds no momentum buffers"),
        "{warnings:?}"
    );
    let got = run(&mut second, 3);
    assert_eq!(got[..2], want[2..4]);
    assert_ne!(got[2], want[4], "momentum 0.9 acts on the third step");

    // Saved with buffers, resumed without: they are not read.
    let dir = temp(scratch.path(), "momentum-0.9-to-0");
    let mut first = ShardedTrainer::new(&m, &heavy, 5).unwrap();
    run(&mut first, 2);
    first.save(&dir).unwrap();
    let mut second = ShardedTrainer::new(&m, &plain, 5).unwrap();
    let warnings = second.load(&dir).unwrap();
    assert!(
        warnings.len() == 1 && warnings[0].contains("momentum buffers are not used"),
        "{warnings:?}"
    );
    assert_eq!(
        bits(&second.full_params().unwrap()),
        bits(&first.full_params().unwrap())
    );
    second.step().unwrap();
}

#[test]
fn export_then_import_is_bit_exact_with_hf_names() {
    let scratch = tempfile::tempdir().unwrap();
    for model in ["tiny-llama", "tiny-gpt2"] {
        let m = preset(model).unwrap();
        let dir = temp(scratch.path(), &format!("export-{model}"));
        let mut t = ShardedTrainer::new(&m, &config(1, 3, 24), 5).unwrap();
        for _ in 0..3 {
            t.step().unwrap();
        }
        t.save(&dir).unwrap();
        let out = dir.join("model.safetensors");
        let n = export(&dir, &out, ExportDType::F32).unwrap();
        // Names, shapes and dtypes are the model's, as HF writes them.
        let bytes = std::fs::read(&out).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let g = shardplan_models::trace(&m, shardplan_models::TraceOptions::default()).unwrap();
        assert_eq!(n, g.params().len());
        for (_, p) in g.params() {
            let view = st
                .tensor(&p.name)
                .unwrap_or_else(|e| panic!("{model}: {}: {e}", p.name));
            let dims: Vec<usize> = p.ty.shape.dims().iter().map(|&d| d as usize).collect();
            assert_eq!(view.shape(), dims.as_slice(), "{}", p.name);
            assert_eq!(view.dtype(), safetensors::Dtype::F32);
        }
        if model == "tiny-gpt2" {
            assert!(
                st.tensor("lm_head.weight").is_err(),
                "GPT-2's head is tied to wte, as in HF"
            );
        }
        // Import on another mesh, each rank reading its rows.
        let mut fresh = ShardedTrainer::new(&m, &config(2, 2, 24), 5).unwrap();
        fresh.init_from(&out).unwrap();
        assert_eq!(
            bits(&fresh.full_params().unwrap()),
            bits(&t.full_params().unwrap()),
            "{model}"
        );
    }
}

#[test]
fn hf_sharded_folders_with_an_index_load() {
    let scratch = tempfile::tempdir().unwrap();
    let m = preset("tiny-llama").unwrap();
    let dir = temp(scratch.path(), "hf-index");
    let mut t = ShardedTrainer::new(&m, &config(1, 2, 24), 5).unwrap();
    t.save(&dir).unwrap();
    let whole = dir.join("whole.safetensors");
    export(&dir, &whole, ExportDType::F32).unwrap();
    // Split into two files plus model.safetensors.index.json, as HF writes big models.
    let bytes = std::fs::read(&whole).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let hf = temp(scratch.path(), "hf-index-model");
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let half = names.len() / 2;
    let mut map = serde_json::Map::new();
    for (i, part) in [&names[..half], &names[half..]].iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let views: Vec<(String, safetensors::tensor::TensorView)> =
            part.iter().map(|n| (n.clone(), st.tensor(n).unwrap())).collect();
        safetensors::serialize_to_file(views, None, &hf.join(&file)).unwrap();
        for n in *part {
            map.insert(n.clone(), serde_json::Value::String(file.clone()));
        }
    }
    std::fs::write(
        hf.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let mut fresh = ShardedTrainer::new(&m, &config(1, 4, 24), 5).unwrap();
    fresh.init_from(&hf).unwrap();
    assert_eq!(bits(&fresh.full_params().unwrap()), bits(&t.full_params().unwrap()));
}

#[test]
fn an_interrupted_save_leaves_the_previous_checkpoint_loadable() {
    let scratch = tempfile::tempdir().unwrap();
    let m = preset("tiny-llama").unwrap();
    for stop in [
        SaveStage::AfterRankFile(0),
        SaveStage::AfterRankFile(2),
        SaveStage::BeforeMetadata,
    ] {
        let dir = temp(scratch.path(), &format!("kill-{stop:?}").replace(['(', ')'], ""));
        let mut t = ShardedTrainer::new(&m, &config(1, 4, 24), 10).unwrap();
        t.step().unwrap();
        let good = t.save(&dir).unwrap();
        let saved = bits(&t.full_params().unwrap());
        t.step().unwrap();
        assert!(
            t.save_with_hook(&dir, &|s| s != stop).is_err(),
            "the hook stops the save"
        );
        let (found, warnings) = resolve(&dir).unwrap();
        assert_eq!(found, good, "{stop:?}: the complete checkpoint is the one found");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("step-00000002") && warnings[0].contains("interrupted"),
            "{warnings:?}"
        );
        let mut other = ShardedTrainer::new(&m, &config(1, 2, 24), 10).unwrap();
        other.load(&dir).unwrap();
        assert_eq!(other.steps_done(), 1);
        assert_eq!(bits(&other.full_params().unwrap()), saved);
        // Saving again completes, and keeping 1 removes the older one and the partial.
        t.save(&dir).unwrap();
        ShardedTrainer::prune(&dir, 1).unwrap();
        let (done, partial) = shardplan_executor::checkpoint::list(&dir).unwrap();
        assert_eq!(done.iter().map(|d| d.0).collect::<Vec<_>>(), [2]);
        assert!(partial.is_empty());
    }
}

#[test]
fn bad_checkpoints_are_named_and_change_nothing() {
    let scratch = tempfile::tempdir().unwrap();
    let m = preset("tiny-llama").unwrap();
    let fresh = || ShardedTrainer::new(&m, &config(1, 2, 24), 10).unwrap();
    let check = |dir: &std::path::Path, want: &str| {
        let mut t = fresh();
        let before = bits(&t.full_params().unwrap());
        let e = t.load(dir).unwrap_err().to_string();
        assert!(e.contains(want), "`{want}` not in: {e}");
        assert_eq!(bits(&t.full_params().unwrap()), before, "a failed load changes nothing");
    };
    let make = |name: &str| {
        let dir = temp(scratch.path(), name);
        let mut t = ShardedTrainer::new(&m, &config(1, 2, 24), 10).unwrap();
        t.step().unwrap();
        (t.save(&dir).unwrap(), dir)
    };

    // Another model.
    let dir = temp(scratch.path(), "other-model");
    let mut g = ShardedTrainer::new(&preset("tiny-gpt2").unwrap(), &config(1, 2, 24), 10).unwrap();
    g.step().unwrap();
    g.save(&dir).unwrap();
    check(&dir, "written for model `tiny-gpt2`");

    // A missing shard file.
    let (step, dir) = make("missing");
    std::fs::remove_file(step.join("rank-00001.safetensors")).unwrap();
    check(&dir, "rank-00001.safetensors: missing shard file");

    // A truncated file.
    let (step, dir) = make("truncated");
    let f = step.join("rank-00000.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    check(&dir, "rank-00000.safetensors: ");
    check(&dir, "truncated");

    // A flipped byte inside a tensor.
    let (step, dir) = make("corrupt");
    let f = step.join("rank-00001.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let at = bytes.len() - 10;
    bytes[at] ^= 0x40;
    std::fs::write(&f, bytes).unwrap();
    check(&dir, "fail their checksum");

    // The metadata says another dtype than the file holds.
    let (step, dir) = make("dtype");
    let meta = step.join("metadata.json");
    let text = std::fs::read_to_string(&meta)
        .unwrap()
        .replacen("\"F32\"", "\"BF16\"", 1);
    std::fs::write(&meta, text).unwrap();
    check(&dir, "is F32, the checkpoint says BF16");

    // No checkpoint at all.
    check(&temp(scratch.path(), "empty"), "no complete checkpoint");
}

/// A copy of checkpoint folder `from` (its rank files and metadata) at `to`.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Refusals of a damaged checkpoint by both readers: `load` (which must leave the trainer
/// as it was) and `export`. Each message must contain every string of `want`.
fn refused(m: &shardplan_models::ModelConfig, cfg: &ParallelConfig, dir: &std::path::Path, want: &[&str]) {
    let mut t = ShardedTrainer::new(m, cfg, 10).unwrap();
    let before = bits(&t.full_params().unwrap());
    let load = t.load(dir).unwrap_err().to_string();
    assert_eq!(bits(&t.full_params().unwrap()), before, "a failed load changes nothing");
    let exported = export(dir, &dir.join("out.safetensors"), ExportDType::F32)
        .unwrap_err()
        .to_string();
    for e in [load, exported] {
        for w in want {
            assert!(e.contains(w), "`{w}` not in: {e}");
        }
    }
}

#[test]
fn damaged_metadata_is_refused_naming_the_file_and_field() {
    use serde_json::{json, Value};
    let scratch = tempfile::tempdir().unwrap();
    let m = preset("tiny-llama").unwrap();
    let cfg = config(1, 2, 8);
    let saved = temp(scratch.path(), "good");
    let mut t = ShardedTrainer::new(&m, &cfg, 10).unwrap();
    t.step().unwrap();
    let step = t.save(&saved).unwrap();
    let huge = json!(1u64 << 62);
    type Edit = fn(&mut Value, &Value);
    let cases: [(&str, Edit, &[&str]); 25] = [
        (
            "huge rows",
            |v, h| v["tensors"][0]["shape"][0] = h.clone(),
            &["`tensors[0].pieces` cover rows 0..", "4611686018427387904"],
        ),
        (
            "huge row",
            |v, h| v["tensors"][0]["shape"][1] = h.clone(),
            &["`tensors[0].shape`", "overflow"],
        ),
        (
            "big row",
            |v, _| v["tensors"][0]["shape"][1] = json!(1u64 << 40),
            &["`tensors[0].pieces[0].end`", "do not fit"],
        ),
        (
            "huge end",
            |v, h| v["tensors"][1]["pieces"][0]["end"] = h.clone(),
            &["`tensors[1].pieces[0].end` is 4611686018427387904"],
        ),
        (
            "huge start",
            |v, h| v["tensors"][1]["pieces"][1]["start"] = h.clone(),
            &["`tensors[1].pieces[1].start` is 4611686018427387904"],
        ),
        (
            "end before start",
            |v, _| v["tensors"][1]["pieces"][0]["end"] = json!(0),
            &["`tensors[1].pieces[0].end` is 0"],
        ),
        (
            "overlap",
            |v, _| v["tensors"][1]["pieces"][1]["start"] = json!(0),
            &["`tensors[1].pieces[1].start` is 0", "without gaps or overlaps"],
        ),
        (
            "huge block",
            |v, h| v["tensors"][2]["pieces"][0]["blocks"][0]["rows"] = h.clone(),
            &["`tensors[2].pieces[0].blocks[0].rows` is 4611686018427387904"],
        ),
        (
            "zero block",
            |v, _| v["tensors"][2]["pieces"][0]["blocks"][0]["rows"] = json!(0),
            &["`tensors[2].pieces[0].blocks[0].rows` is 0"],
        ),
        (
            "no blocks",
            |v, _| v["tensors"][2]["pieces"][0]["blocks"] = json!([]),
            &["`tensors[2].pieces[0].blocks` hold 0 rows"],
        ),
        (
            "zero rows",
            |v, _| v["tensors"][0]["shape"][0] = json!(0),
            &["`tensors[0].pieces[0].end`", "at most the 0 rows"],
        ),
        (
            "zero bytes",
            |v, _| v["files"][0]["bytes"] = json!(0),
            &["`tensors[0].pieces[0].end`", "do not fit in the 0 bytes"],
        ),
        (
            "huge bytes",
            |v, h| v["files"][0]["bytes"] = h.clone(),
            &[
                "rank-00000.safetensors: ",
                "bytes, the checkpoint wrote 4611686018427387904",
            ],
        ),
        (
            "huge step",
            |v, h| v["step"] = h.clone(),
            &["`step` is 4611686018427387904, more than any run reaches"],
        ),
        (
            "huge position",
            |v, _| v["data_position"] = json!(u64::MAX),
            &["`data_position` is 18446744073709551615"],
        ),
        (
            "huge optimizer steps",
            |v, h| v["optimizer_steps"] = h.clone(),
            &["`optimizer_steps` is 4611686018427387904"],
        ),
        (
            "negative",
            |v, _| v["tensors"][1]["pieces"][1]["start"] = json!(-8),
            &["`tensors[1].pieces[1].start`: invalid value: integer `-8`, expected u64"],
        ),
        (
            "past u64",
            |v, _| v["tensors"][1]["pieces"][0]["end"] = json!(1.8446744073709552e19),
            &["`tensors[1].pieces[0].end`: invalid type: floating point"],
        ),
        (
            "missing field",
            |v, _| drop(v["tensors"][3].as_object_mut().unwrap().remove("shape")),
            &["`tensors[3]`: missing field `shape`"],
        ),
        (
            "missing step",
            |v, _| drop(v.as_object_mut().unwrap().remove("step")),
            &["missing field `step`"],
        ),
        (
            "wrong type",
            |v, _| v["tensors"][0]["shape"] = json!("big"),
            &["`tensors[0].shape`: invalid type: string \"big\", expected a sequence"],
        ),
        (
            "wrong dtype",
            |v, _| v["tensors"][0]["dtype"] = json!("F64"),
            &["`tensors[0].dtype` is \"F64\"", "F32, BF16 or F16"],
        ),
        (
            "escaping file",
            |v, _| v["files"][0]["name"] = json!("../rank-00000.safetensors"),
            &["`files[0].name` is \"../rank-00000.safetensors\", not the name of a file"],
        ),
        (
            "unlisted file",
            |v, _| v["tensors"][0]["pieces"][0]["file"] = json!("/etc/passwd"),
            &[
                "`tensors[0].pieces[0].file` is \"/etc/passwd\"",
                "`files` does not list",
            ],
        ),
        (
            "twice",
            |v, _| v["tensors"][1]["name"] = v["tensors"][0]["name"].clone(),
            &["`tensors[1].name` lists", "twice"],
        ),
    ];
    for (i, (what, edit, want)) in cases.iter().enumerate() {
        let dir = scratch.path().join(format!("case-{i}"));
        copy_dir(&step, &dir);
        let meta = dir.join("metadata.json");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&meta).unwrap()).unwrap();
        edit(&mut v, &huge);
        std::fs::write(&meta, serde_json::to_string_pretty(&v).unwrap()).unwrap();
        let named = format!(
            "{}",
            dir.join(if *what == "huge bytes" {
                "rank-00000.safetensors"
            } else {
                "metadata.json"
            })
            .display()
        );
        let mut all = vec![named.as_str()];
        all.extend(want.iter());
        refused(&m, &cfg, &dir, &all);
    }
}

/// Rewrites the safetensors header of `file` through `edit`, keeping its data, and the size
/// `metadata.json` beside it lists for the file.
fn edit_header(file: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut h);
    let mut text = serde_json::to_vec(&h).unwrap();
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(&text);
    out.extend(&bytes[8 + n..]);
    std::fs::write(file, &out).unwrap();
    let meta = file.with_file_name("metadata.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&meta).unwrap()).unwrap();
    let name = file.file_name().unwrap().to_str().unwrap();
    for f in v["files"].as_array_mut().unwrap() {
        if f["name"] == name {
            f["bytes"] = out.len().into();
        }
    }
    std::fs::write(&meta, serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn damaged_rank_files_are_refused_naming_the_file() {
    use serde_json::json;
    let scratch = tempfile::tempdir().unwrap();
    let m = preset("tiny-llama").unwrap();
    // SGD without momentum: the rank files hold parameters only, all of which export reads.
    let cfg = with_optimizer(1, 2, 8, "{sgd: {lr: 0.05}}");
    let saved = temp(scratch.path(), "good");
    let mut t = ShardedTrainer::new(&m, &cfg, 10).unwrap();
    t.step().unwrap();
    let step = t.save(&saved).unwrap();
    let file = "rank-00001.safetensors";
    const KEY: &str = "model.layers.0.self_attn.q_proj.weight";
    type Edit = fn(&mut serde_json::Value);
    let headers: [(Edit, &str); 6] = [
        (
            |h| h[KEY]["data_offsets"][1] = json!(1u64 << 62),
            "is not a range inside the file",
        ),
        (
            |h| h[KEY]["data_offsets"][0] = json!(u64::MAX),
            "is not a range inside the file",
        ),
        (
            |h| h[KEY]["data_offsets"] = json!([8, 4]),
            "is not a range inside the file",
        ),
        (
            |h| h[KEY]["shape"][0] = json!(1u64 << 62),
            "has shape [4611686018427387904",
        ),
        (|h| h[KEY]["dtype"] = json!(7), "`dtype` is 7, not a string"),
        (|h| *h = json!([]), "not a JSON object"),
    ];
    for (i, (edit, want)) in headers.iter().enumerate() {
        let dir = scratch.path().join(format!("header-{i}"));
        copy_dir(&step, &dir);
        edit_header(&dir.join(file), edit);
        let named = format!("{}", dir.join(file).display());
        refused(&m, &cfg, &dir, &[&named, want]);
    }

    // Truncated to nothing, to part of the length prefix, and to part of the header: the
    // size the metadata lists no longer matches.
    for len in [0, 5, 100] {
        let dir = scratch.path().join(format!("truncated-{len}"));
        copy_dir(&step, &dir);
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(file))
            .unwrap()
            .set_len(len)
            .unwrap();
        let named = format!("{}: {len} bytes, the checkpoint wrote", dir.join(file).display());
        refused(&m, &cfg, &dir, &[&named, "truncated"]);
    }

    // A flipped bit is refused, never read as something else: checksums cover the data,
    // checks the header. Every byte of the length prefix, every 11th of the header, and 32
    // spread over the data.
    let dir = scratch.path().join("flipped");
    copy_dir(&step, &dir);
    let path = dir.join(file);
    let good = std::fs::read(&path).unwrap();
    let data = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let spots = (0..8)
        .chain((8..data).step_by(11))
        .chain((0..32).map(|k| data + k * (good.len() - data) / 32));
    let out = dir.join("out.safetensors");
    let named = format!("{}", path.display());
    for at in spots {
        let mut bytes = good.clone();
        bytes[at] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        match export(&dir, &out, ExportDType::F32) {
            Ok(_) => panic!("byte {at} ({:?}) flipped: exported", good[at] as char),
            Err(e) => assert!(e.to_string().contains(&named), "byte {at}: {e}"),
        }
    }
}

#[test]
fn bf16_and_f16_exports_import_as_their_rounded_weights() {
    let scratch = tempfile::tempdir().unwrap();
    let m = preset("tiny-llama").unwrap();
    let dir = temp(scratch.path(), "export-half");
    let mut t = ShardedTrainer::new(&m, &config(1, 2, 24), 5).unwrap();
    t.save(&dir).unwrap();
    for (dtype, st, round) in [
        (
            ExportDType::Bf16,
            safetensors::Dtype::BF16,
            (|x: f32| half::bf16::from_f32(x).to_f32()) as fn(f32) -> f32,
        ),
        (ExportDType::F16, safetensors::Dtype::F16, |x: f32| {
            half::f16::from_f32(x).to_f32()
        }),
    ] {
        let out = dir.join(format!("model-{dtype:?}.safetensors"));
        export(&dir, &out, dtype).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert!(file.tensors().iter().all(|(_, v)| v.dtype() == st), "{dtype:?}");
        let mut fresh = ShardedTrainer::new(&m, &config(1, 4, 24), 5).unwrap();
        fresh.init_from(&out).unwrap();
        let want: Vec<Vec<u32>> = t
            .full_params()
            .unwrap()
            .iter()
            .map(|p| {
                p.flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|&x| round(x).to_bits())
                    .collect()
            })
            .collect();
        assert_eq!(bits(&fresh.full_params().unwrap()), want, "{dtype:?}");
    }
}

/// A replicate x shard x tensor spec for `global` sequences a step (a tensor group shares
/// its data-parallel rank's).
fn config3((replicate, shard, tensor): (u64, u64, u64), global: u64) -> ParallelConfig {
    let world = replicate * shard * tensor;
    let yaml = format!(
        "mesh: {{replicate: {replicate}, shard: {shard}, tensor: {tensor}}}\ngpus_per_node: {world}\n\
         batch: {{per_rank: {}, seq_len: 16}}\noptimizer: {{adamw: {{lr: 3.0e-3}}}}\nlr_schedule: {{warmup_steps: 2}}\n",
        global / (replicate * shard)
    );
    parse_parallel_spec(&Source::from_text("test.yaml", yaml))
        .unwrap_or_else(|e| panic!("{e}"))
        .0
}

/// 10 steps on `from`, save, resume on each of `to`, 10 more; against 20 steps on `from`
/// (`global` sequences a step).
fn resume_on(m: &shardplan_models::ModelConfig, from: (u64, u64, u64), to: &[(u64, u64, u64)], global: u64) {
    resume_with(m, from, to, |mesh| config3(mesh, global))
}

/// [`resume_on`] over meshes that `config` turns into specs.
fn resume_with<M: Copy + std::fmt::Debug>(
    m: &shardplan_models::ModelConfig,
    from: M,
    to: &[M],
    config: impl Fn(M) -> ParallelConfig,
) {
    resume_saved(m, from, to, config, |t, dir| {
        t.save(dir).unwrap();
    })
}

/// [`resume_with`], the checkpoint written by `save`.
fn resume_saved<M: Copy + std::fmt::Debug>(
    m: &shardplan_models::ModelConfig,
    from: M,
    to: &[M],
    config: impl Fn(M) -> ParallelConfig,
    save: impl Fn(&mut ShardedTrainer, &std::path::Path),
) {
    let scratch = tempfile::tempdir().unwrap();
    let mut straight = ShardedTrainer::new(m, &config(from), 20).unwrap();
    let want: Vec<f32> = (0..20).map(|_| straight.step().unwrap().loss).collect();
    let dir = temp(scratch.path(), "tp");
    let mut first = ShardedTrainer::new(m, &config(from), 20).unwrap();
    for _ in 0..10 {
        first.step().unwrap();
    }
    save(&mut first, &dir);
    for &mesh in to {
        let mut second = ShardedTrainer::new(m, &config(mesh), 20).unwrap();
        let warnings = second.load(&dir).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        for (k, w) in want.iter().enumerate().skip(10) {
            let got = second.step().unwrap().loss;
            let r = ((got - w).abs() / w.abs()) as f64;
            assert!(
                r < 1e-5,
                "{} {from:?} -> {mesh:?}: step {} loss {got} vs {w}",
                m.name(),
                k + 1
            );
        }
        for (a, b) in second
            .full_params()
            .unwrap()
            .iter()
            .zip(&straight.full_params().unwrap())
        {
            assert!(
                rel(a, b) < 1e-4,
                "{} {from:?} -> {mesh:?}: weights differ by {:e}",
                m.name(),
                rel(a, b)
            );
        }
    }
}

#[test]
fn tensor_parallel_checkpoints_resume_on_any_mesh() {
    let llama = preset("tiny-llama").unwrap();
    resume_on(&llama, (1, 2, 2), &[(1, 4, 1), (1, 1, 1), (2, 1, 2)], 8);
    resume_on(&llama, (1, 4, 1), &[(1, 2, 2)], 8);
    let gpt2 = preset("tiny-gpt2").unwrap();
    resume_on(&gpt2, (2, 1, 2), &[(1, 1, 4), (1, 2, 1)], 8);
}

/// A replicate x shard spec with an expert axis of `expert` ranks, `global` sequences a step.
fn config_ep((replicate, shard, expert): (u64, u64, u64), global: u64) -> ParallelConfig {
    config_etp((replicate, shard, 1, expert), global)
}

/// A replicate x shard x tensor spec with an expert axis of `expert` ranks, `global`
/// sequences a step (a tensor group shares its data-parallel rank's).
fn config_etp((replicate, shard, tensor, expert): (u64, u64, u64, u64), global: u64) -> ParallelConfig {
    let world = replicate * shard * tensor;
    let yaml = format!(
        "mesh: {{replicate: {replicate}, shard: {shard}, tensor: {tensor}, expert: {expert}}}\ngpus_per_node: {world}\n\
         batch: {{per_rank: {}, seq_len: 16}}\noptimizer: {{adamw: {{lr: 3.0e-3}}}}\nlr_schedule: {{warmup_steps: 2}}\n",
        global / (replicate * shard)
    );
    parse_parallel_spec(&Source::from_text("test.yaml", yaml))
        .unwrap_or_else(|e| panic!("{e}"))
        .0
}

#[test]
fn expert_parallel_checkpoints_resume_on_any_expert_degree() {
    // Saved as the whole model's tensors (every expert by its Hugging Face name), so a run
    // resumes with its experts split over any expert degree, or none.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-moe.yaml");
    let shardplan_models::ModelConfig::Llama(mut c) = shardplan_frontends::load_model(&path).unwrap().config else {
        unreachable!()
    };
    // The load-balancing loss is each rank's own batch's: off, so that meshes of another
    // data-parallel width continue the same run.
    c.moe.as_mut().unwrap().aux_loss_coef = 0.0;
    let moe = shardplan_models::ModelConfig::Llama(c);
    resume_with(&moe, (1, 4, 2), &[(1, 4, 4), (1, 4, 1), (2, 2, 2), (1, 1, 1)], |m| {
        config_ep(m, 8)
    });
    resume_with(&moe, (1, 2, 1), &[(1, 4, 2)], |m| config_ep(m, 8));
    // Every expert's slices put back together across the tensor group: a run whose experts
    // split over tensor and expert ranks resumes on meshes with either, both or neither.
    resume_with(
        &moe,
        (1, 2, 2, 2),
        &[(1, 4, 1, 1), (1, 2, 2, 1), (1, 1, 2, 1), (2, 2, 1, 2)],
        |m| config_etp(m, 8),
    );

    // Hugging Face weights out of an expert-parallel run and into one of another degree.
    let scratch = tempfile::tempdir().unwrap();
    let dir = temp(scratch.path(), "ep-export");
    let mut t = ShardedTrainer::new(&moe, &config_ep((1, 4, 2), 8), 5).unwrap();
    for _ in 0..3 {
        t.step().unwrap();
    }
    t.save(&dir).unwrap();
    let out = dir.join("model.safetensors");
    export(&dir, &out, ExportDType::F32).unwrap();
    let want = t.full_params().unwrap();
    for mesh in [(1, 4, 4), (1, 2, 1)] {
        let mut fresh = ShardedTrainer::new(&moe, &config_ep(mesh, 8), 5).unwrap();
        fresh.init_from(&out).unwrap();
        for (a, b) in fresh.full_params().unwrap().iter().zip(&want) {
            assert_eq!(rel(a, b), 0.0, "{mesh:?}");
        }
    }
}

#[test]
fn tensor_parallel_exports_and_imports_hf_weights() {
    let scratch = tempfile::tempdir().unwrap();
    for model in ["tiny-llama", "tiny-gpt2"] {
        let m = preset(model).unwrap();
        let dir = temp(scratch.path(), &format!("tp-export-{model}"));
        let mut t = ShardedTrainer::new(&m, &config3((1, 2, 2), 8), 5).unwrap();
        for _ in 0..3 {
            t.step().unwrap();
        }
        t.save(&dir).unwrap();
        let out = dir.join("model.safetensors");
        export(&dir, &out, ExportDType::F32).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let g = shardplan_models::trace(&m, shardplan_models::TraceOptions::default()).unwrap();
        for (_, p) in g.params() {
            let dims: Vec<usize> = p.ty.shape.dims().iter().map(|&d| d as usize).collect();
            assert_eq!(
                st.tensor(&p.name).unwrap().shape(),
                dims.as_slice(),
                "{model}: {}",
                p.name
            );
        }
        for mesh in [(1, 1, 2), (1, 2, 1), (2, 1, 2)] {
            let mut fresh = ShardedTrainer::new(&m, &config3(mesh, 8), 5).unwrap();
            fresh.init_from(&out).unwrap();
            assert_eq!(
                bits(&fresh.full_params().unwrap()),
                bits(&t.full_params().unwrap()),
                "{model} on {mesh:?}"
            );
        }
    }
}

/// A MoE whose load-balancing loss is off, so that meshes of another data-parallel width
/// continue the same run.
fn tiny_moe() -> shardplan_models::ModelConfig {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-moe.yaml");
    let shardplan_models::ModelConfig::Llama(mut c) = shardplan_frontends::load_model(&path).unwrap().config else {
        unreachable!()
    };
    c.moe.as_mut().unwrap().aux_loss_coef = 0.0;
    shardplan_models::ModelConfig::Llama(c)
}

#[test]
fn dcp_checkpoints_resume_on_another_mesh() {
    let dcp = |t: &mut ShardedTrainer, dir: &std::path::Path| {
        let step = t.save_dcp(dir).unwrap();
        assert!(
            step.join(".metadata").is_file() && step.ends_with("step-10"),
            "{}",
            step.display()
        );
    };
    for model in ["tiny-llama", "tiny-qwen3"] {
        let m = preset(model).unwrap();
        resume_saved(&m, (1, 4, 1), &[(2, 2, 1), (1, 2, 1)], |mesh| config3(mesh, 8), dcp);
    }
    // Tensor parallelism: written as whole tensors' rows, read on meshes with or without it.
    resume_saved(
        &preset("tiny-llama").unwrap(),
        (1, 2, 2),
        &[(1, 4, 1), (2, 1, 2)],
        |mesh| config3(mesh, 8),
        dcp,
    );
    // Experts by their Hugging Face names, resumed on another expert degree or none.
    resume_saved(
        &tiny_moe(),
        (1, 4, 2),
        &[(2, 2, 2), (1, 2, 1)],
        |m| config_ep(m, 8),
        dcp,
    );
}

#[test]
fn dcp_and_shardplan_checkpoints_hold_the_same_state() {
    // Saved both ways at the same step, loaded into fresh trainers: the same bits.
    let scratch = tempfile::tempdir().unwrap();
    let m = preset("tiny-llama").unwrap();
    let mut t = ShardedTrainer::new(&m, &config(1, 4, 8), 6).unwrap();
    for _ in 0..3 {
        t.step().unwrap();
    }
    let (a, b) = (temp(scratch.path(), "own"), temp(scratch.path(), "dcp"));
    t.save(&a).unwrap();
    t.save_dcp(&b).unwrap();
    let mut from_own = ShardedTrainer::new(&m, &config(2, 2, 8), 6).unwrap();
    from_own.load(&a).unwrap();
    let mut from_dcp = ShardedTrainer::new(&m, &config(2, 2, 8), 6).unwrap();
    from_dcp.load(&b).unwrap();
    assert_eq!(from_own.steps_done(), 3);
    assert_eq!(from_dcp.steps_done(), 3);
    assert_eq!(
        bits(&from_own.full_params().unwrap()),
        bits(&from_dcp.full_params().unwrap())
    );
    let (x, y) = (from_own.step().unwrap(), from_dcp.step().unwrap());
    assert_eq!(x.loss.to_bits(), y.loss.to_bits());
    // A DCP checkpoint of another model is refused by its `shardplan.model`.
    let mut other = ShardedTrainer::new(&preset("tiny-qwen3").unwrap(), &config(1, 4, 8), 6).unwrap();
    let e = other.load(&b).unwrap_err().to_string();
    assert!(e.contains("written for model `tiny-llama`"), "{e}");
}
