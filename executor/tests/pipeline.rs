//! Pipeline training on threads equals one rank's training over the same batch, step for
//! step, for every schedule torch.distributed.pipelining runs.

use candle_core::{Device, Tensor};
use shardplan_executor::train::pipeline::PipelineTrainer;
use shardplan_executor::{ShardedTrainer, Trainer};
use shardplan_frontends::{parse_parallel_spec, ParallelConfig, Source};
use shardplan_models::{preset, ModelConfig};
use shardplan_planner::pipeline::plan_pipeline;

fn config(yaml: &str) -> ParallelConfig {
    parse_parallel_spec(&Source::from_text("test.yaml", yaml))
        .unwrap_or_else(|e| panic!("{e}"))
        .0
}

const COMMON: &str = "optimizer: {adamw: {lr: 3.0e-3, betas: [0.9, 0.95], weight_decay: 0.1}}\ngrad_clip: 1.0\nlr_schedule: {warmup_steps: 2}\n";

/// `|a - b| / |b|` (Frobenius norms).
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let norm = |t: &Tensor| t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt() as f64;
    norm(&(a - b).unwrap()) / norm(b).max(1e-12)
}

/// tiny-llama with `layers` blocks.
fn llama(layers: u64) -> ModelConfig {
    match preset("tiny-llama").unwrap() {
        ModelConfig::Llama(mut c) => {
            c.n_layers = layers;
            ModelConfig::Llama(c)
        }
        _ => unreachable!(),
    }
}

/// Trains `model` for `steps` steps with `pipeline` (a `pipeline:` flow mapping) on
/// `ranks` pipeline ranks and on one rank over the same batch of `batch` sequences;
/// returns the largest relative differences of loss and of the weights.
fn compare(model: &ModelConfig, ranks: u64, pipeline: &str, batch: u64, steps: u64) -> (f64, f64) {
    compare_mesh(model, (ranks, 1, 1, 1), pipeline, batch, steps)
}

/// As [`compare`] on a pipeline x replicate x shard x tensor mesh, each data-parallel rank
/// taking `batch` sequences (its tensor group shares them); one rank takes all of them.
fn compare_mesh(
    model: &ModelConfig,
    (ranks, replicate, shard, tensor): (u64, u64, u64, u64),
    pipeline: &str,
    batch: u64,
    steps: u64,
) -> (f64, f64) {
    let world = ranks * replicate * shard * tensor;
    let piped = config(&format!(
        "mesh: {{pipeline: {ranks}, replicate: {replicate}, shard: {shard}, tensor: {tensor}}}\ngpus_per_node: {world}\n{COMMON}batch: {{per_rank: {batch}, seq_len: 16}}\npipeline: {pipeline}\n"
    ));
    let single = config(&format!(
        "mesh: {{shard: 1}}\ngpus_per_node: 1\n{COMMON}batch: {{per_rank: {}, seq_len: 16}}\n",
        batch * replicate * shard
    ));
    let graph = shardplan_models::trace(model, piped.trace_options()).unwrap();
    let plan = plan_pipeline(&graph, &piped, None).unwrap_or_else(|e| panic!("{e}"));
    let mut a = PipelineTrainer::new(model, &piped, &plan, steps, Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    let mut b = Trainer::new(model, &single, steps, Device::Cpu).unwrap();
    let mut worst_loss = 0f64;
    for step in 0..steps {
        let x = a.step().unwrap_or_else(|e| panic!("step {step}: {e}"));
        let y = b.step().unwrap();
        assert!(x.loss.is_finite());
        worst_loss = worst_loss.max(((x.loss - y.loss).abs() / y.loss.abs().max(1e-6)) as f64);
    }
    let mut worst_w = 0f64;
    let mine = a.master().unwrap();
    assert_eq!(mine.len(), b.master().len());
    for (p, q) in mine.iter().zip(b.master()) {
        worst_w = worst_w.max(rel(p, q));
    }
    (worst_loss, worst_w)
}

/// f32 tolerances, as the sharded parity tests': the pipeline sums each micro-batch's
/// gradients where one rank takes the whole batch at once, which moves gradients by ~1e-7
/// relative. The loss stays within 1e-5; AdamW turns that rounding into full `lr` steps
/// on elements whose gradient is near zero, so after 20 steps weights drift up to 2.5e-5
/// (measured), hence 1e-4.
const F32: (f64, f64) = (1e-5, 1e-4);

fn assert_parity(name: &str, (loss, weights): (f64, f64)) {
    eprintln!("{name}: loss {loss:.2e}, weights {weights:.2e}");
    assert!(
        loss < F32.0 && weights < F32.1,
        "{name}: loss {loss:.2e}, weights {weights:.2e}"
    );
}

#[test]
fn gpipe_on_two_ranks_trains_as_one_rank() {
    assert_parity(
        "GPipe PP2",
        compare(&llama(2), 2, "{schedule: GPipe, microbatches: 4}", 4, 20),
    );
}

#[test]
fn one_f_one_b_on_two_ranks_trains_as_one_rank() {
    assert_parity(
        "1F1B PP2",
        compare(&llama(2), 2, "{schedule: 1F1B, microbatches: 4}", 8, 20),
    );
}

#[test]
fn interleaved_one_f_one_b_on_four_ranks_trains_as_one_rank() {
    assert_parity(
        "Interleaved1F1B PP4 V2",
        compare(&llama(6), 4, "{schedule: Interleaved1F1B, microbatches: 8}", 8, 20),
    );
}

#[test]
fn zero_bubble_v_on_two_ranks_trains_as_one_rank() {
    assert_parity(
        "ZBVZeroBubble PP2",
        compare(&llama(2), 2, "{schedule: ZBVZeroBubble, microbatches: 4}", 4, 20),
    );
}

#[test]
fn dualpipe_v_on_two_ranks_trains_as_one_rank() {
    assert_parity(
        "DualPipeV PP2",
        compare(&llama(2), 2, "{schedule: DualPipeV, microbatches: 4}", 4, 20),
    );
}

#[test]
fn uneven_stages_train_as_one_rank() {
    // Three blocks with the embedding and head counted as layers: 5 over 2 stages.
    assert_parity(
        "1F1B PP2, 3 blocks",
        compare(&llama(3), 2, "{schedule: 1F1B, microbatches: 2}", 4, 20),
    );
}

#[test]
fn fsdp_inside_two_stages_trains_as_one_rank() {
    assert_parity(
        "1F1B PP2 x FSDP2",
        compare_mesh(&llama(2), (2, 1, 2, 1), "{schedule: 1F1B, microbatches: 2}", 2, 20),
    );
}

#[test]
fn hsdp_inside_two_stages_trains_as_one_rank() {
    // Eight ranks: 2 pipeline x 2 replicate x 2 shard.
    assert_parity(
        "Interleaved1F1B PP2 x HSDP 2x2",
        compare_mesh(
            &llama(4),
            (2, 2, 2, 1),
            "{schedule: Interleaved1F1B, microbatches: 2}",
            2,
            20,
        ),
    );
}

#[test]
fn fsdp_with_uneven_chunks_inside_stages_trains_as_one_rank() {
    // Three shard ranks: 64-row weights split 22 + 22 + 20, padded.
    assert_parity(
        "GPipe PP2 x FSDP3",
        compare_mesh(&llama(2), (2, 1, 3, 1), "{schedule: GPipe, microbatches: 2}", 2, 20),
    );
}

#[test]
fn tensor_parallel_stages_train_as_one_rank() {
    assert_parity(
        "1F1B PP2 x TP2",
        compare_mesh(&llama(2), (2, 1, 1, 2), "{schedule: 1F1B, microbatches: 2}", 2, 20),
    );
}

#[test]
fn fsdp_and_tensor_parallel_stages_train_as_one_rank() {
    assert_parity(
        "ZBVZeroBubble PP2 x FSDP2 x TP2",
        compare_mesh(
            &llama(2),
            (2, 1, 2, 2),
            "{schedule: ZBVZeroBubble, microbatches: 4}",
            4,
            20,
        ),
    );
}

#[test]
fn moe_stages_train_as_one_rank() {
    // tiny-moe (a dense first layer, then routed and shared experts) without its
    // load-balancing loss, whose router logits a pipeline cannot carry between stages.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-moe.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let model = shardplan_frontends::parse_model_spec(&Source::from_text(
        "tiny-moe.yaml",
        text.replace("aux_loss_coef: 0.01", "aux_loss_coef: 0"),
    ))
    .unwrap_or_else(|e| panic!("{e}"))
    .0;
    assert_parity(
        "1F1B PP2 x FSDP2, MoE",
        compare_mesh(&model, (2, 1, 2, 1), "{schedule: 1F1B, microbatches: 2}", 2, 20),
    );
}

/// A parallel spec of tiny-llama (f32, AdamW with clipping) with `mesh`, `per_rank`
/// sequences of 16 a data-parallel rank, and `pipeline` (a flow mapping) where given.
fn spec_of(mesh: &str, per_rank: u64, pipeline: Option<&str>) -> ParallelConfig {
    let pipeline = pipeline.map_or(String::new(), |p| format!("pipeline: {p}\n"));
    config(&format!(
        "mesh: {mesh}\ngpus_per_node: 8\n{COMMON}batch: {{per_rank: {per_rank}, seq_len: 16}}\n{pipeline}"
    ))
}

fn pipeline_trainer(model: &ModelConfig, c: &ParallelConfig, steps: u64) -> PipelineTrainer {
    let graph = shardplan_models::trace(model, c.trace_options()).unwrap();
    let plan = plan_pipeline(&graph, c, None).unwrap_or_else(|e| panic!("{e}"));
    PipelineTrainer::new(model, c, &plan, steps, Device::Cpu).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn a_pipeline_checkpoint_resumes_on_another_pipeline_and_without_one() {
    let model = llama(2);
    // Global batch 4 throughout; 6 steps straight through as the reference.
    let pp2 = spec_of("{pipeline: 2, shard: 2}", 2, Some("{schedule: 1F1B, microbatches: 2}"));
    let mut straight = pipeline_trainer(&model, &pp2, 6);
    let reference: Vec<f32> = (0..6).map(|_| straight.step().unwrap().loss).collect();
    // 3 steps, saved, then resumed on four pipeline ranks (Interleaved: 2 stages a rank
    // would need more blocks; 1F1B over 4 stages of one module each).
    let dir = tempfile::tempdir().unwrap();
    let mut first = pipeline_trainer(&model, &pp2, 6);
    for _ in 0..3 {
        first.step().unwrap();
    }
    let saved = first.save(dir.path()).unwrap();
    assert!(saved.join("metadata.json").is_file());
    let pp4 = spec_of("{pipeline: 4, shard: 1}", 4, Some("{schedule: 1F1B, microbatches: 4}"));
    let mut resumed = pipeline_trainer(&model, &pp4, 6);
    resumed.load(dir.path()).unwrap();
    assert_eq!(resumed.steps_done(), 3);
    for (step, want) in reference.iter().enumerate().skip(3) {
        let got = resumed.step().unwrap().loss;
        assert!(
            (got - want).abs() <= 1e-5 * want.abs(),
            "step {}: {got} vs {want}",
            step + 1
        );
    }
    // The same checkpoint on a mesh without a pipeline (FSDP over 2 ranks).
    let fsdp = spec_of("{shard: 2}", 2, None);
    let mut plain = ShardedTrainer::new(&model, &fsdp, 6).unwrap();
    plain.load(&saved).unwrap();
    for (step, want) in reference.iter().enumerate().skip(3) {
        let got = plain.step().unwrap().loss;
        assert!(
            (got - want).abs() <= 1e-5 * want.abs(),
            "FSDP step {}: {got} vs {want}",
            step + 1
        );
    }
    // And the other way: a checkpoint of the FSDP run resumes on a pipeline with TP.
    let back = tempfile::tempdir().unwrap();
    let mut plain = ShardedTrainer::new(&model, &fsdp, 6).unwrap();
    for _ in 0..3 {
        plain.step().unwrap();
    }
    plain.save(back.path()).unwrap();
    let pp_tp = spec_of(
        "{pipeline: 2, shard: 2, tensor: 2}",
        2,
        Some("{schedule: GPipe, microbatches: 2}"),
    );
    let mut piped = pipeline_trainer(&model, &pp_tp, 6);
    piped.load(back.path()).unwrap();
    for (step, want) in reference.iter().enumerate().skip(3) {
        let got = piped.step().unwrap().loss;
        assert!(
            (got - want).abs() <= 1e-5 * want.abs(),
            "PP x TP step {}: {got} vs {want}",
            step + 1
        );
    }
    // A pipeline with TP saves too, and the weights come back.
    let tp_dir = tempfile::tempdir().unwrap();
    piped.save(tp_dir.path()).unwrap();
    let mut again = pipeline_trainer(&model, &pp2, 6);
    again.load(tp_dir.path()).unwrap();
    for (a, b) in again.master().unwrap().iter().zip(piped.master().unwrap()) {
        assert!(rel(a, &b) < 1e-7, "{}", rel(a, &b));
    }
}

#[test]
fn a_pipeline_dcp_checkpoint_resumes_on_another_pipeline_and_without_one() {
    let model = llama(2);
    let pp2 = spec_of("{pipeline: 2, shard: 2}", 2, Some("{schedule: 1F1B, microbatches: 2}"));
    let mut straight = pipeline_trainer(&model, &pp2, 6);
    let reference: Vec<f32> = (0..6).map(|_| straight.step().unwrap().loss).collect();
    let dir = tempfile::tempdir().unwrap();
    let mut first = pipeline_trainer(&model, &pp2, 6);
    for _ in 0..3 {
        first.step().unwrap();
    }
    let saved = first.save_dcp(dir.path()).unwrap();
    assert!(saved.join(".metadata").is_file() && saved.ends_with("step-3"));
    let close = |what: &str, got: f32, want: f32| {
        assert!((got - want).abs() <= 1e-5 * want.abs(), "{what}: {got} vs {want}");
    };
    let pp4 = spec_of("{pipeline: 4, shard: 1}", 4, Some("{schedule: 1F1B, microbatches: 4}"));
    let mut resumed = pipeline_trainer(&model, &pp4, 6);
    resumed.load(&saved).unwrap();
    assert_eq!(resumed.steps_done(), 3);
    for want in &reference[3..] {
        close("PP 4", resumed.step().unwrap().loss, *want);
    }
    let mut plain = ShardedTrainer::new(&model, &spec_of("{shard: 2}", 2, None), 6).unwrap();
    plain.load(&saved).unwrap();
    for want in &reference[3..] {
        close("FSDP 2", plain.step().unwrap().loss, *want);
    }
}
