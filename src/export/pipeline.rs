//! `export fsdp2` of a pipeline spec: the same program, with the pipeline's stages (each
//! stage's modules and the rank that runs it), the schedule and its micro-batches written
//! in `PIPELINE`; the program builds each of its rank's stages from the model's modules,
//! applies FSDP2 inside each as torchtitan does under a pipeline, and runs them with
//! torch.distributed.pipelining: the named schedule's class, or for a custom schedule the
//! plan's own compute-only CSV through `_PipelineScheduleRuntime`.

use super::{
    checkpointing_literal, command_line, data_literal, model_literal, optimizer_literal, params_literal, program,
    Origin,
};
use crate::CliError;
use anyhow::Context;
use serde_json::{json, Value};
use shardplan_frontends::{trace_error, trace_options, LoadedModel, LoadedParallel, Offload};
use shardplan_planner::pipeline::{plan_pipeline, write_csv, PipelinePlan};
use std::path::Path;

/// Writes `out/train.py` for the pipeline spec `lp` of `lm`.
pub(super) fn export(out: &Path, lm: LoadedModel, lp: LoadedParallel) -> Result<(), CliError> {
    let config = lp.config.clone();
    refuse(&config, &lp)?;
    let custom = crate::plan::custom_schedule(&lp)?;
    let forward = shardplan_models::trace(&lm.config, trace_options(Some(&lp)))
        .map_err(|e| CliError::Input(trace_error(e, &lm, Some(&lp))))?;
    let plan = plan_pipeline(&forward, &config, custom)
        .map_err(|e| CliError::Input(lp.origin.error(e.field(), e.to_string(), e.help())))?;
    let model = lm.config.clone();
    let origin = Origin::Spec(Box::new((lp, lm)));
    super::check_tensor_parallel(config.mesh.tensor, &model, &origin)?;
    super::check_low_precision(&config, &origin)?;
    // Under tensor parallelism the traced stages hold one tensor rank's slices; the program
    // lists the whole model's parameters and each rank cuts its own.
    let whole = if config.mesh.tensor > 1 {
        super::whole_model(&model, &config)?
    } else {
        forward.clone()
    };
    let p = &plan.program;
    let mesh = config.mesh;
    let lits: Vec<(&str, &str, Value)> = vec![
        ("MODEL", "the model, as shardplan traces it", model_literal(&model, &origin)?),
        (
            "MODEL_SPEC",
            "the model spec as shardplan's checkpoints record it (`shardplan.model`)",
            super::model_spec_literal(&model)?,
        ),
        (
            "PARAMS",
            "every parameter: Hugging Face name, shape, initialisation (constant, or normal with std and stream)",
            params_literal(&whole),
        ),
        (
            "MESH",
            "pipeline x replicate x shard x tensor, pipeline outermost (HSDP inside the stages when replicate > 1), tensor groups innermost",
            json!({"pipeline": mesh.pipeline, "replicate": mesh.replicate, "shard": mesh.shard, "expert": 1, "tensor": mesh.tensor}),
        ),
        (
            "FLOAT8",
            "Float8 linears (torchao's convert_to_float8_training; None: none), as without a pipeline",
            super::float8_literal(&forward, &config),
        ),
        (
            "TENSOR",
            "tensor parallelism inside each stage (None: none), torchtitan's plan as without a pipeline",
            super::tensor_literal(mesh.tensor, &forward, &config),
        ),
        ("GROUPS", "not used under a pipeline: each stage wraps its blocks, then itself", json!([])),
        ("FORWARD_PREFETCH", "not used under a pipeline", json!([])),
        ("BACKWARD_PREFETCH", "not used under a pipeline", json!([])),
        (
            "MIXED_PRECISION",
            "unsharded parameter (compute) dtype and gradient reduction dtype; master weights f32",
            json!({"param": config.mixed_precision.param.name(), "reduce": config.mixed_precision.reduce.name()}),
        ),
        (
            "OFFLOAD",
            "sharded parameters, gradients and optimizer state on the host",
            json!(config.offload == Offload::Cpu),
        ),
        (
            "CHECKPOINTING",
            "activation checkpointing: kind, the blocks it wraps, what a selective block saves",
            checkpointing_literal(&forward, &config),
        ),
        super::allocator_literal(&config),
        (
            "COMPILE",
            "torch.compile as torchtitan applies it: each block on its own (`model`, before fully_shard), the loss function (`loss`)",
            json!({"model": config.compile.model, "loss": config.compile.loss}),
        ),
        (
            "BATCH",
            "per data-parallel rank (its pipeline's micro-batches split it)",
            json!({"per_rank": config.batch.per_rank, "seq_len": config.batch.seq_len, "grad_accum": 1, "grad_sync": "every_micro_batch"}),
        ),
        ("DATA", "where batches come from (as `shardplan train` reads them)", data_literal(&config)),
        ("SEED", "initialisation and data order", json!(config.seed)),
        (
            "OPTIMIZER",
            "the optimizer (AdamW: torch's fused or foreach implementation)",
            optimizer_literal(&config),
        ),
        (
            "LR_SCHEDULE",
            "linear warmup, then cosine decay to min_lr_ratio * lr at the last step",
            json!({"warmup_steps": config.lr_schedule.warmup_steps, "min_lr_ratio": config.lr_schedule.min_lr_ratio}),
        ),
        ("GRAD_CLIP", "global gradient-norm clip (None: no clipping)", json!(config.grad_clip)),
        ("PREDICTED", "the dry run's pipeline: step seconds and each rank's peak bytes", predicted(&plan)),
        (
            "PIPELINE",
            "the stages (their modules, in order), the rank of each, the schedule, its micro-batches, and a custom schedule's compute-only CSV",
            json!({
                "schedule": p.schedule.map(|s| s.to_string()),
                "microbatches": p.shape.microbatches,
                "stages": plan.stages.iter().map(|s| s.modules.clone()).collect::<Vec<_>>(),
                "rank_of_stage": p.rank_of_stage,
                "csv": if p.schedule.is_none() { Some(write_csv(&p.compute)) } else { None },
            }),
        ),
    ];
    let schedule = p.schedule.map_or("custom schedule".to_string(), |s| s.to_string());
    let header = format!(
        "Generated by shardplan {} from a pipeline plan:\n#   {}\n# {} on {} ranks: {schedule} over {} pipeline ranks ({} stages), FSDP {} x {} inside each.",
        env!("CARGO_PKG_VERSION"),
        command_line(),
        model.name(),
        mesh.pipeline * mesh.stage_world(),
        mesh.pipeline,
        plan.stages.len(),
        mesh.replicate,
        mesh.shard
    );
    let text = program(&header, &lits);
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let file = out.join("train.py");
    std::fs::write(&file, text).with_context(|| format!("cannot write {}", file.display()))?;
    let world = mesh.pipeline * mesh.stage_world();
    crate::emit(&format!(
        "wrote {} (pipeline {schedule}: {} stages on {} ranks, FSDP {} x {} inside)\nrun it: torchrun --nproc-per-node {world} {} --steps 10 --log-file fsdp2.jsonl [--device cuda]\n",
        file.display(),
        plan.stages.len(),
        mesh.pipeline,
        mesh.replicate,
        mesh.shard,
        file.display()
    ))
}

/// What the program does not run under a pipeline, refused naming the field.
fn refuse(config: &shardplan_frontends::ParallelConfig, spec: &LoadedParallel) -> Result<(), CliError> {
    let refuse = |field: &str, message: String, help: &str| CliError::Input(spec.origin.error(field, message, help));
    if config.mesh.expert > 1 {
        return Err(refuse(
            "mesh.expert",
            "the exported pipeline program runs no expert parallelism inside its stages".into(),
            "export without `mesh.expert`, or run this spec with `shardplan train`",
        ));
    }
    if config.batch.grad_accum != 1 {
        return Err(refuse(
            "batch.grad_accum",
            "a pipeline accumulates over its micro-batches already".into(),
            "set grad_accum to 1 and raise pipeline.microbatches",
        ));
    }
    Ok(())
}

fn predicted(plan: &PipelinePlan) -> Value {
    json!({
        "step_seconds": plan.step_s,
        "bubble": plan.timeline.bubble(),
        "peak_allocated_by_rank": plan.memory.iter().map(|r| r.peak).collect::<Vec<_>>(),
    })
}
