//! The sharded executor's promises beyond parity: determinism, measured memory equal to
//! the plan, and failures that stop every rank.

use shardplan_executor::{ExecError, ShardedTrainer};
use shardplan_frontends::{parse_parallel_spec, ParallelConfig, Source};
use shardplan_models::preset;

fn config(yaml: &str) -> ParallelConfig {
    parse_parallel_spec(&Source::from_text("test.yaml", yaml))
        .unwrap_or_else(|e| panic!("{e}"))
        .0
}

fn base(extra: &str) -> String {
    let batch = if extra.contains("batch:") {
        ""
    } else {
        "batch: {per_rank: 2, seq_len: 16}\n"
    };
    format!("mesh: {{shard: 4}}\ngpus_per_node: 4\n{batch}{extra}")
}

#[test]
fn the_same_run_twice_gives_bitwise_identical_losses() {
    let c = config(&base(""));
    let m = preset("tiny-llama").unwrap();
    let run = || {
        let mut t = ShardedTrainer::new(&m, &c, 5).unwrap();
        (0..5).map(|_| t.step().unwrap().loss.to_bits()).collect::<Vec<u32>>()
    };
    assert_eq!(run(), run());
}

#[test]
fn measured_memory_equals_the_plan() {
    let m = preset("tiny-llama").unwrap();
    for extra in [
        "",
        "reshard_after_forward: false\n",
        "reshard_after_forward: 2\n",
        "prefetch: {forward: 2, backward: 2}\n",
        "batch: {per_rank: 2, seq_len: 16, grad_accum: 4}\n",
        "batch: {per_rank: 2, seq_len: 16, grad_accum: 4, grad_sync: final_micro_batch}\n",
        "activation_checkpointing: full\n",
        "activation_checkpointing: selective\n",
        "activation_checkpointing: {selective: {save: [matmuls]}}\n",
        "offload: cpu\n",
        "mixed_precision: {param: bf16, reduce: f32}\n",
    ] {
        let c = config(&base(extra));
        let mut t = ShardedTrainer::new(&m, &c, 2).unwrap();
        for _ in 0..2 {
            let s = t.step().unwrap();
            let plan = t.plan();
            for (rank, got) in s.measured.iter().enumerate() {
                let want = plan.memory.max_by_category;
                for (name, g, w) in [
                    ("sharded params", got.sharded_params, want.sharded_params),
                    ("unsharded params", got.unsharded_params, want.unsharded_params),
                    ("sharded grads", got.sharded_grads, want.sharded_grads),
                    ("unsharded grads", got.unsharded_grads, want.unsharded_grads),
                    ("optimizer state", got.optimizer_state, want.optimizer_state),
                    ("collective buffers", got.comm_buffers, want.comm_buffers),
                ] {
                    assert_eq!(g, w, "{extra:?} rank {rank}: {name} measured {g}, planned {w}");
                }
                let (g, w) = (got.activations as f64, want.activations as f64);
                assert!(
                    (g - w).abs() <= 0.05 * w,
                    "{extra:?} rank {rank}: activations measured {g}, planned {w}"
                );
                assert_eq!(
                    s.measured_host[rank], plan.memory.host,
                    "{extra:?} rank {rank}: host memory"
                );
            }
        }
    }
}

#[test]
fn a_non_finite_loss_stops_every_rank_naming_the_rank_and_instruction() {
    let c = config(&base("optimizer: {adamw: {lr: 1.0e30}}\ngrad_clip: null\n"));
    let m = preset("tiny-llama").unwrap();
    let mut t = ShardedTrainer::new(&m, &c, 10).unwrap();
    let start = std::time::Instant::now();
    let err = (0..10).find_map(|_| t.step().err()).expect("the run diverges");
    let msg = err.to_string();
    assert!(matches!(err, ExecError::Aborted(_)), "{msg}");
    assert!(msg.contains("rank ") && msg.contains("instruction #"), "{msg}");
    assert!(msg.contains("non-finite") || msg.contains("norm"), "{msg}");
    assert!(start.elapsed().as_secs() < 60, "stopped in {:?}", start.elapsed());
    // The trainer stays stopped.
    assert!(t.step().is_err());
}

#[test]
fn a_rank_that_never_arrives_times_out_instead_of_hanging() {
    let c = config(&base(""));
    let m = preset("tiny-llama").unwrap();
    let mut t = ShardedTrainer::new(&m, &c, 2).unwrap();
    t.set_timeout(std::time::Duration::from_millis(500));
    // Rank 2 stalls before its first all-gather, as a crashed or stuck process would.
    let first_gather = t.plan().programs[0]
        .instrs
        .iter()
        .position(|i| matches!(i.instr, shardplan_planner::Instr::AllGather { .. }))
        .unwrap();
    t.inject_fault(2, first_gather, shardplan_executor::train::sharded::Fault::Stall);
    let start = std::time::Instant::now();
    let err = t.step().unwrap_err().to_string();
    assert!(start.elapsed().as_secs() < 30, "took {:?}", start.elapsed());
    assert!(err.contains("timed out"), "{err}");
}

#[test]
fn a_failing_rank_stops_the_others() {
    let c = config(&base(""));
    let m = preset("tiny-llama").unwrap();
    let mut t = ShardedTrainer::new(&m, &c, 2).unwrap();
    let rs = t.plan().programs[0]
        .instrs
        .iter()
        .position(|i| matches!(i.instr, shardplan_planner::Instr::ReduceScatter { .. }))
        .unwrap();
    t.inject_fault(1, rs, shardplan_executor::train::sharded::Fault::Fail);
    let err = t.step().unwrap_err().to_string();
    assert!(
        err.contains(&format!("rank 1: instruction #{rs} `reduce-scatter")),
        "{err}"
    );
    assert!(err.contains("injected failure"), "{err}");
}

#[test]
fn shard_only_initialisation_equals_the_single_rank_model_bit_for_bit() {
    for (model, shard) in [("tiny-llama", 3), ("tiny-gpt2", 8), ("tiny-mlp", 4)] {
        let m = preset(model).unwrap();
        let c = config(&format!(
            "mesh: {{shard: {shard}}}\ngpus_per_node: {shard}\nbatch: {{per_rank: 1, seq_len: 8}}\n"
        ));
        let one = config("mesh: {shard: 1}\ngpus_per_node: 1\nbatch: {per_rank: 1, seq_len: 8}\n");
        let sharded = ShardedTrainer::new(&m, &c, 1).unwrap().full_params().unwrap();
        let single = shardplan_executor::Trainer::new(&m, &one, 1, candle_core::Device::Cpu).unwrap();
        for (a, b) in sharded.iter().zip(single.master()) {
            let (a, b) = (
                a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{model} over {shard}"
            );
        }
    }
}

#[test]
fn collectives_launched_in_issue_order_give_the_same_run() {
    // An enqueueing backend (NCCL) makes every rank launch its collectives on all its
    // communicators in issue order. Forced on the blocking Local backend, that order must
    // neither deadlock (every collective waits only for work issued before it) nor change a
    // bit, on a plan whose all-gather, reduce-scatter and all-reduce streams all overlap.
    let m = preset("tiny-llama").unwrap();
    for extra in [
        "prefetch: {forward: 2, backward: 2}\n",
        "mesh: {replicate: 2, shard: 2}\nbatch: {per_rank: 2, seq_len: 16, grad_accum: 2}\n",
        "offload: cpu\nmixed_precision: {param: bf16, reduce: f32}\n",
    ] {
        let yaml = if extra.starts_with("mesh:") {
            format!("gpus_per_node: 4\n{extra}")
        } else {
            base(extra)
        };
        let c = config(&yaml);
        let run = |ordered: bool| {
            let mut t = ShardedTrainer::new(&m, &c, 4).unwrap();
            t.set_timeout(std::time::Duration::from_secs(30));
            t.set_ordered_launch(ordered);
            (0..4)
                .map(|_| {
                    let s = t.step().unwrap_or_else(|e| panic!("{extra:?}: {e}"));
                    (s.loss.to_bits(), s.grad_norm.to_bits())
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(true), run(false), "{extra:?}");
    }
}

#[test]
fn compute_steps_with_collectives_take_a_launch_turn_in_issue_order() {
    // Under tensor and expert parallelism a compute step runs collectives among its ops
    // (the tensor group's, the tokens' all-to-all); an enqueueing backend launches them in
    // the compute step's turn among the rank's launches. Forced on Local: no deadlock and
    // not a bit changed, with the prefetching streams overlapping the compute steps.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-moe.yaml");
    let m = shardplan_frontends::load_model(&path).unwrap().config;
    for mesh in [
        "mesh: {shard: 4, expert: 2}\n",
        "mesh: {shard: 2, tensor: 2, expert: 2}\n",
    ] {
        let c = config(&format!(
            "{mesh}gpus_per_node: 4\nbatch: {{per_rank: 2, seq_len: 16}}\nprefetch: {{forward: 2, backward: 2}}\n"
        ));
        let run = |ordered: bool| {
            let mut t = ShardedTrainer::new(&m, &c, 4).unwrap();
            t.set_timeout(std::time::Duration::from_secs(30));
            t.set_ordered_launch(ordered);
            (0..3)
                .map(|_| {
                    let s = t.step().unwrap_or_else(|e| panic!("{mesh:?}: {e}"));
                    (s.loss.to_bits(), s.grad_norm.to_bits())
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(true), run(false), "{mesh:?}");
    }
}

#[test]
fn attention_backward_holds_no_probabilities_and_measured_memory_equals_the_plan() {
    // 128 positions on 4 heads: each `[b, h, s, t]` value would be 512 KiB per rank, more
    // than any other activation of tiny-llama; the blockwise backward holds none of them.
    let m = preset("tiny-llama").unwrap();
    for extra in [
        "",
        "activation_checkpointing: full\n",
        "activation_checkpointing: selective\n",
    ] {
        let c = config(&base(&format!("batch: {{per_rank: 2, seq_len: 128}}\n{extra}")));
        let mut t = ShardedTrainer::new(&m, &c, 1).unwrap();
        let s = t.step().unwrap();
        let plan = t.plan();
        let want = plan.memory.max_by_category.activations;
        for (rank, got) in s.measured.iter().enumerate() {
            assert_eq!(got.activations, want, "{extra:?} rank {rank}: activations");
        }
    }
}
