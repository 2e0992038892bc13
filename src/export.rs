//! `shardplan export fsdp2`: a plan as a self-contained PyTorch FSDP2 program.
//!
//! The program (`src/export/fsdp2_train.py`, the same for every plan) reads the plan's
//! decisions from literals written at its top: the model as shardplan traces it, every
//! parameter's Hugging Face name, shape and initialisation, the FSDP groups with their
//! `reshard_after_forward`, the prefetch lists, mixed precision, offload, checkpointing,
//! gradient accumulation, optimizer, schedule, clipping, seed and data. This module derives
//! those literals from the plan and refuses, naming the field, any plan FSDP2's hooks cannot
//! run exactly as planned.
//!
//! The prefetch lists are the plan's own `fsdp2_hooks`, which the planner derives from
//! where its program issues each all-gather (`planner/src/hooks.rs`), so a hand-edited
//! issue order is honoured; a plan whose program no hook can issue records why, and is
//! refused here naming the instruction. A pipeline spec's program is written by
//! `pipeline.rs`.
//!
//! A context-parallel plan's program (`CONTEXT`, and `context` in `MESH`) builds torchtitan's
//! mesh (FSDP over shard x context, the context groups innermost), gives each context
//! group its data-parallel rank's rows, and runs every forward and backward inside torch's
//! `context_parallel` with the plan's rotation and load balance, the rotary tables sharded
//! with the tokens. torch's ring attention runs only in CUDA's SDPA kernels, so on the CPU
//! the program refuses to train and `--check-context-layout` shows its split instead.

use crate::CliError;
use anyhow::Context;
use clap::{Args, Subcommand};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use shardplan_executor::init::{rule, InitRule};
use shardplan_frontends::{
    load_model, load_parallel, ActivationCheckpointing, DataSource, GradSync, Offload, Optimizer, ParallelConfig,
    Reshard, Runtime, SpecError,
};
use shardplan_ir::{Graph, JointGraph, ModuleKind};
use shardplan_models::{Activation, ModelConfig};
use shardplan_planner::StepId;
use shardplan_planner::{GroupId, HookModel, HookRefusal, Phase, Plan};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The program every export writes, with its two markers.
const TEMPLATE: &str = include_str!("export/fsdp2_train.py");

mod pipeline;

#[derive(Subcommand, Debug)]
pub enum ExportCommand {
    /// Write the plan as a PyTorch FSDP2 training program (DIR/train.py): fully_shard per
    /// planned group, the planned resharding, prefetch, precision, offload, checkpointing,
    /// accumulation, optimizer and the same batches as `shardplan train`.
    Fsdp2(Fsdp2Args),
}

#[derive(Args, Debug)]
pub struct Fsdp2Args {
    /// Model: a YAML model spec, a Hugging Face config.json, or a preset name.
    #[arg(long, value_name = "FILE", required_unless_present = "plan")]
    pub model: Option<PathBuf>,
    /// Parallel spec (YAML).
    #[arg(long, value_name = "FILE", required_unless_present = "plan")]
    pub parallel: Option<PathBuf>,
    /// A plan written by `shardplan plan --format json` (its issue order is exported as is).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["model", "parallel"])]
    pub plan: Option<PathBuf>,
    /// Directory to write train.py into (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

pub fn run(cmd: &ExportCommand) -> Result<(), CliError> {
    match cmd {
        ExportCommand::Fsdp2(args) => fsdp2(args),
    }
}

/// Where a refusal points: the parallel spec (field and line) or the plan file (JSON path).
enum Origin {
    Spec(Box<(shardplan_frontends::LoadedParallel, shardplan_frontends::LoadedModel)>),
    PlanFile(PathBuf),
}

/// The fields a refusal names in the model's file rather than the parallel spec's.
const MODEL_FIELDS: &[&str] = &["family", "qk_norm", "moe"];

impl Origin {
    fn refuse(&self, field: &str, message: String, help: &str) -> CliError {
        CliError::Input(match self {
            Origin::Spec(b) if MODEL_FIELDS.contains(&field) => b.1.origin.error(field, message, help),
            Origin::Spec(b) => b.0.origin.error(field, message, help),
            Origin::PlanFile(path) => {
                let f = if field.starts_with("programs") {
                    field.to_string()
                } else if MODEL_FIELDS.contains(&field) {
                    format!("source.model.{field}")
                } else {
                    format!("source.parallel.{field}")
                };
                SpecError::file(path, message).field(f).help(help)
            }
        })
    }
}

fn fsdp2(args: &Fsdp2Args) -> Result<(), CliError> {
    let (plan, model, parallel, joint, origin) = match (&args.plan, &args.model, &args.parallel) {
        (Some(path), _, _) => {
            let src = shardplan_frontends::Source::read(path)?;
            let c = shardplan_planner::rederive::read_plan(path, &src.text)?;
            let origin = Origin::PlanFile(path.clone());
            if c.plan.mesh.expert() > 1 && c.parallel.runtime == Runtime::Shardplan {
                return Err(origin.refuse(
                    "runtime",
                    "the plan runs expert parallelism on shardplan's runtime, which orders each MoE block for its all-to-all stream (the routing table's all-gather right after the top-k, the all-to-alls as steps of their own); FSDP2 calls the routed experts' module once, between the router and the shared expert, so its hooks cannot issue this plan's all-gathers".into(),
                    "export from the specs (`--model` and `--parallel`), which plans the blocks in FSDP2's order",
                ));
            }
            (c.plan, c.model, c.parallel, c.joint, origin)
        }
        (None, Some(m), Some(p)) => {
            let lm = load_model(m)?;
            let lp = load_parallel(p)?;
            if lp.config.pipeline.is_some() {
                return pipeline::export(&args.out, lm, lp);
            }
            // FSDP2 issues an all-gather only from a module's pre-forward or pre-backward
            // hook; `prefetch: auto` may move one into the middle of a module's steps, which
            // no prefetch list can say. The export plans the depths' order (FSDP2's own).
            let mut config = lp.config.clone();
            config.prefetch.peak_aware = false;
            // Each MoE block in torchtitan's order, its all-to-alls inside the experts'
            // module (FSDP2 calls that module once, between the router and the shared
            // expert), not as shardplan's runtime overlaps them.
            let (plan, joint) = crate::plan::make_plan_and_graph_traced(&lm, &lp, &config, false)?;
            let (model, parallel) = (lm.config.clone(), config);
            (plan, model, parallel, joint, Origin::Spec(Box::new((lp, lm))))
        }
        _ => {
            return Err(CliError::Usage(
                "give --model and --parallel, or --plan (a `shardplan plan --format json` file)".into(),
            ))
        }
    };
    check_tensor_parallel(plan.mesh.tensor(), &model, &origin)?;
    check_low_precision(&parallel, &origin)?;
    if parallel.moe.capacity_factor.is_some() {
        return Err(origin.refuse(
            "moe.capacity_factor",
            "the plan drops each expert's assignments past its capacity; the exported program routes without dropping (as Hugging Face and torchtitan do), so it would train a different model".into(),
            "export the plan without `moe.capacity_factor`, or run this one with `shardplan train`",
        ));
    }
    if plan.mesh.expert() > 1 && matches!(parallel.activation_checkpointing, ActivationCheckpointing::Selective(_)) {
        return Err(origin.refuse(
            "activation_checkpointing",
            "selective checkpointing of a block whose routed experts are an FSDP unit of their own (expert parallelism) fails in PyTorch: FSDP2's hooks inside the checkpointed block run a different number of ops in recomputation than in forward, which selective checkpointing's replay refuses (seen with torch 2.15; torchtitan issue 3427)".into(),
            "export with `activation_checkpointing: full` (it runs), or without `mesh.expert`; `shardplan train` runs this plan as it is",
        ));
    }
    let text = render(&plan, &model, &parallel, &joint, &origin, &command_line())?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("cannot create {}", args.out.display()))?;
    let file = args.out.join("train.py");
    std::fs::write(&file, text).with_context(|| format!("cannot write {}", file.display()))?;
    let world = plan.mesh.world();
    // torch's context_parallel attends in CUDA's SDPA kernels only.
    let tensor = match plan.mesh.tensor() {
        1 => String::new(),
        t => format!(" x tensor {t}"),
    };
    let (context, device) = match plan.mesh.context() {
        1 => (tensor, "[--device cuda]"),
        c => (
            format!("{tensor}, context groups of {c}; on the CPU `--check-context-layout` shows its split"),
            "--device cuda",
        ),
    };
    crate::emit(&format!(
        "wrote {} (plan {}: {} groups, mesh {} x {}{context})\nrun it: torchrun --nproc-per-node {world} {} --steps 10 --log-file fsdp2.jsonl {device}\ncompare: shardplan plan ... --compare fsdp2.jsonl\n",
        file.display(),
        plan_hash(&plan),
        plan.groups.len(),
        plan.mesh.replicate(),
        plan.mesh.shard(),
        file.display()
    ))
}

/// Refuses the low-precision linears the program cannot yet write: MXFP8 (torchao's MX
/// linears run on Blackwell only, and `shardplan train` has no emulation to hold them to),
/// and Float8 under tensor parallelism (torchao's Float8 TP styles).
fn check_low_precision(parallel: &ParallelConfig, origin: &Origin) -> Result<(), CliError> {
    if parallel.mxfp8.is_some() {
        return Err(origin.refuse(
            "mxfp8",
            "MXFP8 linears are planned but not exported yet: `shardplan train` does not emulate them, so no run could check the program".into(),
            "plan it with `shardplan plan`, or export with `float8`",
        ));
    }
    if parallel.float8.is_some() && parallel.mesh.tensor > 1 {
        return Err(origin.refuse(
            "float8",
            "Float8 under tensor parallelism is planned but not exported yet: its scales reduce over the tensor group (torchao's Float8 TP styles), which `shardplan train` does not run".into(),
            "export Float8 on FSDP or HSDP meshes, or this mesh without `float8`",
        ));
    }
    Ok(())
}

/// The `FLOAT8` literal: None, or the recipe, the Float8 linears by Hugging Face module
/// path (as the traced graph `g` chose them) and torchao's FSDP options.
pub(crate) fn float8_literal(g: &Graph, parallel: &ParallelConfig) -> Value {
    let Some(f) = &parallel.float8 else { return Value::Null };
    json!({
        "recipe": f.recipe.name(),
        "linears": shardplan_models::float8::float8_linears(g),
        "fsdp_float8_all_gather": f.fsdp_float8_all_gather,
        "precompute_scale": f.precompute_scale,
    })
}

/// Refuses the tensor-parallel plans torch's DTensor styles cannot express as shardplan
/// splits them, naming the API.
fn check_tensor_parallel(tensor: u64, model: &ModelConfig, origin: &Origin) -> Result<(), CliError> {
    if tensor <= 1 {
        return Ok(());
    }
    let refuse = |field: &str, why: &str, help: &str| Err(origin.refuse(field, why.to_string(), help));
    match model {
        ModelConfig::Gpt2(_) => refuse(
            "family",
            "torch's ColwiseParallel and RowwiseParallel shard nn.Linear and nn.Embedding; GPT-2's Conv1D layers hold their weights transposed, and shardplan splits its fused q/k/v projection per block of three, which no DTensor placement of one dim (Shard) expresses",
            "export a Llama-family model under `mesh.tensor`, or run this plan with `shardplan train`",
        ),
        ModelConfig::Llama(c) if c.tie_embeddings => refuse(
            "mesh.tensor",
            "torchtitan's plan shards the output projection as an nn.Linear with ColwiseParallel; this model's head is tied to the token embedding and has no weight of its own for parallelize_module to shard (torchtitan trains no tied model under tensor parallelism)",
            "export without `mesh.tensor`, or run this plan with `shardplan train`",
        ),
        _ => Ok(()),
    }
}

fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if a.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:@".contains(c)) && !a.is_empty() {
                a
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The first 16 hex digits of the SHA-256 of the plan's JSON.
fn plan_hash(plan: &Plan) -> String {
    let json = serde_json::to_string(plan).unwrap_or_default();
    let digest = Sha256::digest(json.as_bytes());
    digest.iter().take(8).fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// The whole program for `plan`.
fn render(
    plan: &Plan,
    model: &ModelConfig,
    parallel: &ParallelConfig,
    joint: &JointGraph,
    origin: &Origin,
    command: &str,
) -> Result<String, CliError> {
    let g = &joint.graph;
    // Under expert parallelism a rank's graph holds one expert rank's experts, under tensor
    // parallelism its slices; the program lists the whole model's parameters (names, whole
    // shapes and initialisation streams), as `shardplan train` numbers them, and each rank
    // builds its own experts and slices.
    let whole;
    let every = if g.expert_degree() > 1 || plan.mesh.tensor() > 1 {
        whole = whole_model(model, parallel)?;
        &whole
    } else {
        g
    };
    let mut lits: Vec<(&str, &str, Value)> = vec![
        (
            "MODEL",
            "the model, as shardplan traces it",
            model_literal(model, origin)?,
        ),
        (
            "MODEL_SPEC",
            "the model spec as shardplan's checkpoints record it (`shardplan.model`)",
            model_spec_literal(model)?,
        ),
        (
            "PARAMS",
            "every parameter: Hugging Face name, shape, initialisation (constant, or normal with std and stream)",
            params_literal(every),
        ),
        mesh_literal(plan),
        (
            "CONTEXT",
            "context parallelism (None: none): context groups of `degree` ranks, how keys and values reach every rank of one (torch's set_rotate_method), which rows of a sequence each holds (head_tail: torch's head-tail load balancer)",
            context_literal(plan),
        ),
        (
            "TENSOR",
            "tensor parallelism (None: none), torchtitan's plan over groups of `degree` consecutive ranks: sequence parallelism between blocks, the cross-entropy on vocabulary-split logits (loss_parallel), the embedding and head split by vocabulary (`split_vocab`: the vocabulary divides by the degree), async TP (compiled, CUDA)",
            tensor_literal(plan.mesh.tensor(), g, parallel),
        ),
        (
            "GROUPS",
            "fully_shard units in the plan's order (the root last), with reshard_after_forward; `experts`: routed experts sharded over the ranks holding the same ones",
            groups_literal(plan, g, origin)?,
        ),
    ];
    let (fwd, bwd) = prefetch_lists(plan, g, origin)?;
    lits.push((
        "FORWARD_PREFETCH",
        "module -> modules whose all-gathers its pre-forward issues, in the plan's order",
        fwd,
    ));
    lits.push((
        "BACKWARD_PREFETCH",
        "module -> modules whose all-gathers its pre-backward issues (a module listing itself: no prefetch)",
        bwd,
    ));
    lits.push((
        "MIXED_PRECISION",
        "unsharded parameter (compute) dtype and gradient reduction dtype; master weights f32",
        json!({"param": parallel.mixed_precision.param.name(), "reduce": parallel.mixed_precision.reduce.name()}),
    ));
    lits.push((
        "OFFLOAD",
        "sharded parameters, gradients and optimizer state on the host",
        Value::Bool(parallel.offload == Offload::Cpu),
    ));
    lits.push((
        "CHECKPOINTING",
        "activation checkpointing: kind, the blocks it wraps, what a selective block saves",
        checkpointing_literal(g, parallel),
    ));
    lits.push(allocator_literal(parallel));
    lits.push((
        "COMPILE",
        "torch.compile as torchtitan applies it: each block on its own (`model`, before fully_shard), the loss function (`loss`)",
        json!({"model": parallel.compile.model, "loss": parallel.compile.loss}),
    ));
    lits.push((
        "FLOAT8",
        "Float8 linears (torchao's convert_to_float8_training; None: none): recipe, the linears by Hugging Face module path, FSDP's float8 all-gather and precomputed scales",
        float8_literal(g, parallel),
    ));
    lits.push((
        "BATCH",
        "per rank and micro-batch; gradient accumulation and when gradients are reduced",
        json!({
            "per_rank": plan.policy.batch_per_rank,
            "seq_len": plan.policy.seq_len,
            "grad_accum": plan.policy.grad_accum,
            "grad_sync": match parallel.batch.grad_sync {
                GradSync::EveryMicroBatch => "every_micro_batch",
                GradSync::FinalMicroBatch => "final_micro_batch",
            },
        }),
    ));
    lits.push((
        "DATA",
        "where batches come from (as `shardplan train` reads them)",
        data_literal(parallel),
    ));
    lits.push(("SEED", "initialisation and data order", json!(parallel.seed)));
    lits.push((
        "OPTIMIZER",
        "the optimizer (AdamW: torch's fused or foreach implementation)",
        optimizer_literal(parallel),
    ));
    lits.push((
        "LR_SCHEDULE",
        "linear warmup, then cosine decay to min_lr_ratio * lr at the last step",
        json!({"warmup_steps": parallel.lr_schedule.warmup_steps, "min_lr_ratio": parallel.lr_schedule.min_lr_ratio}),
    ));
    lits.push((
        "GRAD_CLIP",
        "global gradient-norm clip (None: no clipping)",
        json!(parallel.grad_clip),
    ));
    lits.push((
        "PREDICTED",
        "the dry run's prediction of this program's run (`runtime: fsdp2`), per rank (bytes, seconds)",
        fsdp2_prediction(plan, parallel, joint),
    ));

    lits.push((
        "PIPELINE",
        "the pipeline's stages, their ranks and schedule (None: no pipeline)",
        Value::Null,
    ));
    let mut context = match plan.mesh.context() {
        1 => String::new(),
        c => format!(", context groups of {c}"),
    };
    if plan.mesh.tensor() > 1 {
        let _ = write!(context, ", tensor groups of {}", plan.mesh.tensor());
    }
    let header = format!(
        "Generated by shardplan {} from plan {} (the SHA-256 of its JSON, first 16 digits):\n#   {}\n# {} on {} ranks ({} x {}{context}), {} FSDP groups.",
        env!("CARGO_PKG_VERSION"),
        plan_hash(plan),
        command,
        plan.model,
        plan.mesh.world(),
        plan.mesh.replicate(),
        plan.mesh.shard(),
        plan.groups.len()
    );
    Ok(program(&header, &lits))
}

/// The `MESH` literal: replicate x shard, the shard axis FSDP's (with a context axis, the
/// plan's `shard`, torchtitan's `dp_shard_cp`, and `context` its innermost ranks).
fn mesh_literal(plan: &Plan) -> (&'static str, &'static str, Value) {
    let (r, s, e, c, t) = (
        plan.mesh.replicate(),
        plan.mesh.shard(),
        plan.mesh.expert(),
        plan.mesh.context(),
        plan.mesh.tensor(),
    );
    if c > 1 {
        return (
            "MESH",
            "replicate x shard x tensor (HSDP when replicate > 1), FSDP sharding over the shard axis (torchtitan's dp_shard_cp), whose innermost `context` ranks are a context group; tensor groups of `tensor` consecutive ranks innermost",
            json!({"replicate": r, "shard": s, "expert": e, "context": c, "tensor": t}),
        );
    }
    (
        "MESH",
        "replicate x shard x tensor (HSDP when replicate > 1); the routed experts split over groups of `expert` consecutive shards; tensor groups of `tensor` consecutive ranks innermost",
        json!({"replicate": r, "shard": s, "expert": e, "tensor": t}),
    )
}

/// The model traced without its expert and tensor axes: every parameter whole, numbered as
/// `shardplan train` numbers them for initialisation.
fn whole_model(model: &ModelConfig, parallel: &ParallelConfig) -> Result<Graph, CliError> {
    let mut opts = parallel.trace_options();
    opts.expert = Default::default();
    opts.tensor = Default::default();
    shardplan_models::trace(model, opts)
        .map_err(|e| CliError::Usage(format!("tracing the whole model for its parameters: {e}")))
}

/// The `TENSOR` literal: None, or the tensor groups' degree `t` and options; whether the
/// embedding is split by vocabulary is read off the tensor rank's graph `g`, as traced.
fn tensor_literal(t: u64, g: &Graph, parallel: &ParallelConfig) -> Value {
    if t <= 1 {
        return Value::Null;
    }
    let tp = &parallel.tensor_parallel;
    let split_vocab = g
        .params()
        .any(|(_, p)| g.scope(p.scope).kind == ModuleKind::Embedding && p.tensor.is_some());
    json!({
        "degree": t,
        "sequence_parallel": tp.sequence_parallel,
        "loss_parallel": tp.loss_parallel,
        "split_vocab": split_vocab,
        "async": tp.async_tp,
    })
}

/// The `CONTEXT` literal: None, or the context groups' degree, rotation and load balance.
fn context_literal(plan: &Plan) -> Value {
    let c = plan.mesh.context();
    if c <= 1 {
        return Value::Null;
    }
    let cp = &plan.policy.context_parallel;
    json!({"degree": c, "rotate": cp.rotate.name(), "load_balance": cp.load_balance.name()})
}

/// The template with `header` and the literals `lits` (name, what it is, value) written in;
/// a program without a `CONTEXT` or `TENSOR` literal (a pipeline's) gets it as None, which
/// the body reads.
fn program(header: &str, lits: &[(&str, &str, Value)]) -> String {
    let mut block = String::new();
    let defaults = [
        ("CONTEXT", "context parallelism (None: none)", Value::Null),
        ("TENSOR", "tensor parallelism (None: none)", Value::Null),
        ("FLOAT8", "Float8 linears (None: none)", Value::Null),
    ];
    let missing = |name: &str| !lits.iter().any(|l| l.0 == name);
    for (name, what, v) in lits.iter().chain(defaults.iter().filter(|d| missing(d.0))) {
        let _ = writeln!(block, "# {what}");
        let _ = writeln!(block, "{name} = {}\n", python(v, 0));
    }
    let header = header.replace("\n#   \n", "\n");
    TEMPLATE
        .replacen("# @@HEADER@@", &format!("# {header}"), 1)
        .replacen("# @@PLAN@@\n", &block, 1)
}

/// The caching allocator the plan models (`allocator` in the spec), which the program sets
/// through `PYTORCH_ALLOC_CONF` before torch starts.
pub(crate) fn allocator_literal(parallel: &ParallelConfig) -> (&'static str, &'static str, Value) {
    (
        "ALLOCATOR",
        "PyTorch's caching allocator as planned: expandable segments (PYTORCH_ALLOC_CONF=expandable_segments:True, torchtitan's launch setting) or one cudaMalloc segment per miss",
        json!({"expandable_segments": parallel.allocator.expandable_segments}),
    )
}

/// What the planner predicts for FSDP2 running this plan: the plan's own figures when it was
/// made for `runtime: fsdp2`, else those of the same spec planned for it.
fn fsdp2_prediction(plan: &Plan, parallel: &ParallelConfig, joint: &JointGraph) -> Value {
    let of = |p: &Plan| {
        json!({
            "peak_allocated": p.memory.peak,
            "peak_reserved": p.memory.reserved_peak,
            "step_seconds": p.estimate.step_s,
            "tokens_per_second": p.estimate.tokens_per_s,
        })
    };
    if parallel.runtime == Runtime::Fsdp2 {
        return of(plan);
    }
    let mut c = parallel.clone();
    c.runtime = Runtime::Fsdp2;
    c.hardware.kernels = shardplan_frontends::KernelMode::Eager;
    match shardplan_planner::plan(joint, &c) {
        Ok(p) => of(&p),
        // Planning the same spec again cannot fail where it planned once; if it does, say so.
        Err(_) => Value::Null,
    }
}

/// The model spec as JSON text: what `shardplan train` writes under `shardplan.model` in
/// a DCP checkpoint, so a resume on either side checks it continues the same model.
pub(crate) fn model_spec_literal(model: &ModelConfig) -> Result<Value, CliError> {
    serde_json::to_string(model)
        .map(Value::String)
        .map_err(|e| CliError::Other(anyhow::anyhow!("the model spec as JSON: {e}")))
}

fn model_literal(model: &ModelConfig, origin: &Origin) -> Result<Value, CliError> {
    let act = |a: Option<Activation>, default: &str| {
        a.map_or(default.to_string(), |a| {
            match a {
                Activation::Silu => "silu",
                Activation::Gelu => "gelu",
                Activation::GeluTanh => "gelu_tanh",
                Activation::Relu => "relu",
            }
            .to_string()
        })
    };
    Ok(match model {
        ModelConfig::Llama(c) => {
            let hd = c.head_dim();
            let inv: Vec<f64> = (0..hd / 2)
                .map(|i| c.rope_scaling.inv_freq(c.rope_theta, hd as usize, i as usize))
                .collect();
            json!({
                "family": "llama",
                "vocab_size": c.vocab_size,
                "dim": c.dim,
                "n_layers": c.n_layers,
                "n_heads": c.n_heads,
                "n_kv_heads": c.n_kv_heads,
                "head_dim": hd,
                "ffn_dim": c.ffn_dim,
                "norm_eps": c.norm_eps,
                "activation": act(c.activation, "silu"),
                "qkv_bias": c.qkv_bias,
                "tie_embeddings": c.tie_embeddings,
                "rope_inv_freq": inv,
                "rope_attention_factor": c.rope_scaling.attention_factor(),
                "max_seq_len": c.max_seq_len,
                "qk_norm": c.qk_norm,
                "moe": c.moe.as_ref().map(|m| json!({
                    "experts": m.experts,
                    "top_k": m.top_k,
                    "expert_ffn_dim": m.expert_ffn_dim,
                    "shared_expert_ffn_dim": if m.shared_experts > 0 { m.shared_expert_ffn_dim } else { 0 },
                    "shared_expert_gate": m.shared_experts > 0 && m.shared_expert_gate,
                    "router": m.router.name(),
                    "norm_topk_prob": m.norm_topk_prob,
                    "aux_loss_coef": m.aux_loss_coef,
                    "every": m.every,
                    "first_dense": m.first_dense,
                    "dense_layers": m.dense_layers.layers(),
                    "names": m.hf_names.name(),
                })),
            })
        }
        ModelConfig::Gpt2(c) => json!({
            "family": "gpt2",
            "vocab_size": c.vocab_size,
            "dim": c.dim,
            "n_layers": c.n_layers,
            "n_heads": c.n_heads,
            "ffn_dim": c.ffn_dim,
            "norm_eps": c.norm_eps,
            "activation": act(c.activation, "gelu_tanh"),
            "max_seq_len": c.max_seq_len,
        }),
        ModelConfig::Mlp(_) => return Err(origin.refuse(
            "family",
            "`export fsdp2` writes language models (the llama and gpt2 families); the mlp family has no FSDP2 program"
                .into(),
            "export a llama or gpt2 model, or train the mlp with `shardplan train`",
        )),
    })
}

fn params_literal(g: &Graph) -> Value {
    Value::Array(
        g.params()
            .map(|(id, p)| {
                let init = match rule(g, id) {
                    InitRule::Constant(c) => json!(["constant", f64::from(c)]),
                    InitRule::Normal { std } => json!(["normal", std, id.0]),
                };
                json!([p.name, p.ty.shape.dims(), init])
            })
            .collect(),
    )
}

fn groups_literal(plan: &Plan, g: &Graph, origin: &Origin) -> Result<Value, CliError> {
    // A tied weight read by the head outside its own group: FSDP2 would hand the head the
    // sharded parameter once its group reshards, where shardplan gathers it again.
    let hook = |k: GroupId| shardplan_planner::schedule::hook_group(&plan.groups, k);
    for (k, grp) in plan.groups.iter().enumerate() {
        if grp.group.is_root() || grp.reshard == Reshard::Keep {
            continue;
        }
        let foreign = plan
            .steps
            .iter()
            .filter(|s| hook(s.group) != hook(GroupId::new(k)) && s.phase == Phase::Forward)
            .any(|s| s.reads.iter().any(|r| r.index() == k));
        if foreign {
            return Err(origin.refuse(
                "wrap_modules",
                format!(
                    "group `{}` is read by another group's forward (a tied weight): FSDP2 reshards it after its own forward and cannot gather it again for another module",
                    grp.group.module
                ),
                "keep the tied embedding in the root group (do not wrap it on its own), or set reshard_after_forward: false",
            ));
        }
    }
    Ok(Value::Array(
        plan.groups
            .iter()
            .map(|grp| {
                let modules = group_modules(plan, g, grp.group.id.index());
                let reshard = match grp.reshard {
                    Reshard::AfterForward => json!(true),
                    Reshard::Keep => json!(false),
                    Reshard::ToGroupOf(n) => json!(n),
                };
                json!({"modules": modules, "reshard_after_forward": reshard, "experts": grp.group.experts})
            })
            .collect(),
    ))
}

/// The modules group `k` wraps, by the program's module paths: its scopes, or for a unit
/// of routed experts the `experts` module of each feed-forward its parameters live in.
fn group_modules(plan: &Plan, g: &Graph, k: usize) -> Vec<String> {
    let grp = &plan.groups[k].group;
    if !grp.experts {
        return grp
            .scopes
            .iter()
            .map(|&s| g.scope(s).display_path().to_string())
            .collect();
    }
    let mut out: Vec<String> = Vec::new();
    for &p in &grp.params {
        let path = format!("{}.experts", g.scope(g.param(p).scope).display_path());
        if !out.contains(&path) {
            out.push(path);
        }
    }
    out
}

fn checkpointing_literal(g: &Graph, parallel: &ParallelConfig) -> Value {
    let blocks: Vec<&str> = g
        .scopes()
        .filter(|(_, s)| s.kind == ModuleKind::Block)
        .map(|(_, s)| s.display_path())
        .collect();
    let every = |k: u64| -> Vec<&str> {
        blocks
            .iter()
            .enumerate()
            .filter(|(i, _)| (*i as u64).is_multiple_of(k))
            .map(|(_, b)| *b)
            .collect()
    };
    match parallel.activation_checkpointing {
        ActivationCheckpointing::None => json!({"kind": "none", "blocks": [], "save": []}),
        ActivationCheckpointing::Full => json!({"kind": "full", "blocks": blocks, "save": []}),
        ActivationCheckpointing::Every(k) => json!({"kind": "full", "blocks": every(k), "save": []}),
        ActivationCheckpointing::Selective(p) => json!({"kind": "selective", "blocks": blocks, "save": p.names()}),
    }
}

fn data_literal(parallel: &ParallelConfig) -> Value {
    let abs = |p: &Path| {
        std::fs::canonicalize(p)
            .unwrap_or_else(|_| p.to_path_buf())
            .display()
            .to_string()
    };
    match &parallel.data {
        DataSource::Synthetic => json!({"kind": "synthetic"}),
        DataSource::Tokens { path, dtype, eval } => json!({
            "kind": "tokens",
            "path": abs(path),
            "dtype": match dtype {
                shardplan_frontends::TokenDType::U16 => "u16",
                shardplan_frontends::TokenDType::U32 => "u32",
            },
            "eval": eval.as_ref().map(|e| json!({"path": abs(&e.path), "every": e.every, "batches": e.batches})),
        }),
    }
}

fn optimizer_literal(parallel: &ParallelConfig) -> Value {
    match parallel.optimizer {
        Optimizer::AdamW {
            lr,
            betas,
            eps,
            weight_decay,
        } => json!({
            "name": "adamw",
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "implementation": parallel.adamw_implementation.name(),
        }),
        Optimizer::Sgd {
            lr,
            momentum,
            weight_decay,
        } => json!({"name": "sgd", "lr": lr, "momentum": momentum, "weight_decay": weight_decay}),
    }
}

/// FSDP2's explicit prefetch lists the plan records (`fsdp2_hooks`), as Python literals
/// `[(module, [modules]), ...]`; a plan whose program no hooks can issue is refused,
/// naming the instruction or program.
fn prefetch_lists(plan: &Plan, g: &Graph, origin: &Origin) -> Result<(Value, Value), CliError> {
    let hooks = match &plan.fsdp2_hooks {
        Some(HookModel::Hooks(h)) => h,
        Some(HookModel::Refused(r)) => return Err(hooks_refused(plan, r, origin)),
        None => {
            return Err(CliError::Other(anyhow::anyhow!(
                "internal error: the plan records no FSDP2 hooks; please report this"
            )))
        }
    };
    let key_of = |k: GroupId| -> String {
        group_modules(plan, g, k.index())
            .into_iter()
            .next()
            .unwrap_or_else(|| "<root>".to_string())
    };
    let lists = |l: &[(GroupId, Vec<GroupId>)]| {
        Value::Array(
            l.iter()
                .map(|(t, v)| json!([key_of(*t), v.iter().map(|&k| key_of(k)).collect::<Vec<_>>()]))
                .collect(),
        )
    };
    Ok((lists(&hooks.forward), lists(&hooks.backward)))
}

/// Why FSDP2's hooks cannot issue the plan's program, in the user's words.
fn hooks_refused(plan: &Plan, r: &HookRefusal, origin: &Origin) -> CliError {
    let label = |s: StepId| plan.steps.get(s.index()).map_or("?", |s| s.label.as_str());
    let help = "FSDP2 issues an all-gather only in a module's pre-forward or pre-backward hook; re-plan with `shardplan plan`, or move the all-gather to the start of a group's step";
    let at_with = |program: usize, instr: usize, why: String, help: &str| {
        origin.refuse(&format!("programs[{program}].instrs[{instr}]"), why, help)
    };
    let at = |program: usize, instr: usize, why: String| at_with(program, instr, why, help);
    match *r {
        HookRefusal::NeverRead { program, instr, group } => at(
            program,
            instr,
            format!("the all-gather of group {} is never read", group.index()),
        ),
        HookRefusal::Ungated { program, instr, group } => at(
            program,
            instr,
            format!("the all-gather of group {} waits for no compute step", group.index()),
        ),
        HookRefusal::OtherPass {
            program,
            instr,
            group,
            read,
            at: step,
        } => at(
            program,
            instr,
            format!(
                "group {}'s all-gather for `{}` is issued during another pass or micro-batch (at `{}`)",
                group.index(),
                label(read),
                label(step)
            ),
        ),
        HookRefusal::MidModule {
            program,
            instr,
            group,
            at: step,
            inside,
        } => {
            let forward = plan.steps.get(step.index()).is_some_and(|s| s.phase == Phase::Forward);
            // shardplan's runtime splits a module's step around the collectives it runs on
            // the all-to-all stream, and `prefetch: auto` may gather between the pieces.
            at_with(
                program,
                instr,
                format!(
                    "group {}'s all-gather is issued at `{}`, inside group {}'s {} but not at its start",
                    group.index(),
                    label(step),
                    inside.index(),
                    if forward { "forward" } else { "backward" }
                ),
                "FSDP2 issues an all-gather only in a module's pre-forward or pre-backward hook; plan the spec with `runtime: fsdp2` (FSDP2's issue order) or export from the specs (`--model` and `--parallel`), or move the all-gather to the start of a group's step",
            )
        }
        HookRefusal::MicroBatches { program } => origin.refuse(
            &format!("programs[{program}]"),
            "the micro-batches of the step prefetch differently; FSDP2's prefetch lists are the same for every micro-batch".into(),
            "prefetch alike in every micro-batch, or re-plan with `shardplan plan`",
        ),
        HookRefusal::Ranks { program } => origin.refuse(
            &format!("programs[{program}]"),
            "ranks prefetch differently; FSDP2 runs one program on every rank".into(),
            "give every rank the same issue order",
        ),
        HookRefusal::Moved { program } => origin.refuse(
            &format!("programs[{program}]"),
            "the edited program moves a reduce-scatter, all-reduce or copy away from the point FSDP2's hooks issue it".into(),
            "edit only where all-gathers are issued (prefetch), or re-plan with `shardplan plan`",
        ),
    }
}

/// A JSON value as a Python literal: one top-level item per line for lists of rows and
/// dicts, the rest inline.
fn python(v: &Value, depth: usize) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Number(n) => n.to_string(),
        Value::String(_) => v.to_string(),
        Value::Array(a) => {
            let items: Vec<String> = a.iter().map(|x| python(x, depth + 1)).collect();
            if depth == 0 && a.iter().any(|x| x.is_array() || x.is_object()) {
                format!(
                    "[\n{}]",
                    items.iter().map(|i| format!("    {i},\n")).collect::<String>()
                )
            } else {
                format!("[{}]", items.join(", "))
            }
        }
        Value::Object(o) => dict(o, depth),
    }
}

fn dict(o: &Map<String, Value>, depth: usize) -> String {
    let items: Vec<String> = o
        .iter()
        .map(|(k, x)| format!("{}: {}", Value::String(k.clone()), python(x, depth + 1)))
        .collect();
    if depth == 0 && items.len() > 3 {
        format!(
            "{{\n{}}}",
            items.iter().map(|i| format!("    {i},\n")).collect::<String>()
        )
    } else {
        format!("{{{}}}", items.join(", "))
    }
}
