//! The TCP process world as the NCCL backend uses it: one rank per "process" (threads
//! here, each with its own trainer), the plan's collectives on a backend of their own, and
//! the step figures, stop requests and checkpoint completion agreed over TCP. The losses
//! equal one process running every rank, and a checkpoint written this way resumes there.

use shardplan_executor::comm::tcp::TcpWorld;
use shardplan_executor::comm::{local, Placement};
use shardplan_executor::ShardedTrainer;
use shardplan_frontends::{parse_parallel_spec, ParallelConfig, Source};
use shardplan_models::{preset, trace};
use std::time::Duration;

fn config(replicate: u64, shard: u64) -> ParallelConfig {
    let world = replicate * shard;
    let yaml = format!(
        "mesh: {{replicate: {replicate}, shard: {shard}}}\ngpus_per_node: {world}\nbatch: {{per_rank: {}, seq_len: 16}}\n\
         optimizer: {{adamw: {{lr: 3.0e-3}}}}\nlr_schedule: {{warmup_steps: 2}}\n",
        8 / world
    );
    parse_parallel_spec(&Source::from_text("test.yaml", yaml))
        .unwrap_or_else(|e| panic!("{e}"))
        .0
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `steps` steps of tiny-llama on `mesh`, one trainer per rank; saves after `save_at`
/// steps into `dir` when given. Returns every rank's losses.
fn per_process(mesh: (u64, u64), steps: u64, save_at: Option<(u64, &std::path::Path)>) -> Vec<Vec<f32>> {
    let m = preset("tiny-llama").unwrap();
    let cfg = config(mesh.0, mesh.1);
    let graph = trace(&m, cfg.trace_options()).unwrap();
    let joint = shardplan_ir::differentiate(&graph).unwrap();
    let plan = shardplan_planner::plan(&joint, &cfg).unwrap();
    let world = plan.mesh.world();
    let port = free_port();
    // The plan's collectives: Local groups shared by the threads.
    let whole = local::place(&plan);
    let abort = whole.abort.clone();
    let ranks = whole.ranks;
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .into_iter()
            .map(|(rank, comms)| {
                let (m, cfg, plan, joint, abort) = (m.clone(), cfg.clone(), plan.clone(), joint.clone(), abort.clone());
                s.spawn(move || {
                    let env = shardplan_executor::comm::env::DistEnv {
                        rank,
                        world_size: world,
                        local_rank: rank,
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                    };
                    abort.set_timeout(Duration::from_secs(60));
                    let procs = TcpWorld::connect(&env, abort.clone()).unwrap();
                    let place = Placement {
                        ranks: vec![(rank, comms)],
                        processes: Some(Box::new(procs)),
                        abort,
                        backend: "test",
                    };
                    let mut t = ShardedTrainer::from_placement(&m, &cfg, plan, joint, steps, place).unwrap();
                    let mut losses = Vec::new();
                    for _ in 0..steps {
                        let metrics = t.step().unwrap();
                        // Every process sees every rank's figures.
                        assert_eq!(metrics.measured_peak.len() as u64, world);
                        losses.push(metrics.loss);
                        if let Some((at, dir)) = save_at {
                            if t.steps_done() == at {
                                t.save(dir).unwrap();
                            }
                        }
                    }
                    losses
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn one_rank_per_process_over_the_tcp_world_trains_as_one_process_does() {
    let scratch = tempfile::tempdir().unwrap();
    let m = preset("tiny-llama").unwrap();
    for mesh in [(1, 2), (2, 2)] {
        let mut one = ShardedTrainer::new(&m, &config(mesh.0, mesh.1), 6).unwrap();
        let want: Vec<f32> = (0..6).map(|_| one.step().unwrap().loss).collect();
        let dir = scratch.path().join(format!("{}x{}", mesh.0, mesh.1));
        std::fs::create_dir_all(&dir).unwrap();
        let got = per_process(mesh, 6, Some((3, &dir)));
        for losses in &got {
            assert_eq!(
                losses, &want,
                "mesh {mesh:?}: every process reports the global loss, bit for bit"
            );
        }
        // The checkpoint the processes wrote together resumes in one process.
        let mut resumed = ShardedTrainer::new(&m, &config(mesh.0, mesh.1), 6).unwrap();
        resumed.load(&dir).unwrap();
        assert_eq!(resumed.steps_done(), 3);
        let tail: Vec<f32> = (0..3).map(|_| resumed.step().unwrap().loss).collect();
        assert_eq!(tail, want[3..].to_vec(), "mesh {mesh:?}");
    }
}
