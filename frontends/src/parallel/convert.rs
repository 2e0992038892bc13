//! The conversion from the file as written to the validated config: defaults, every
//! range and cross-field check, and `file:line:col` errors naming the fix.
//!
//! This file holds the order of the sections and the mesh, the runtime and the checks
//! across them; `fsdp` converts the sharding policy (wrap, resharding, prefetch,
//! precision, checkpointing), `training` the training run (batch, optimizer, schedule,
//! data), `hardware` the hardware profile.

mod float8;
mod fsdp;
mod hardware;
mod pipeline;
mod training;

use super::file::*;
use super::*;
use crate::hardware::{HardwareProfile, KernelMode};
use crate::yaml::{self, pos};
use crate::{Origin, Source, SpecError};
use float8::{float8, mxfp8};
use fsdp::{activation_checkpointing, mixed_precision, prefetch, reshard_after_forward, wrap, wrap_modules};
use hardware::hardware;
use pipeline::{pipeline, pipeline_axis};
use serde_saphyr::Spanned;
use training::{batch, data, grad_clip, lr_schedule, optimizer};

/// `v`, refused when 0.
fn at_least_1(origin: &Origin, field: &str, v: u64) -> Result<u64, SpecError> {
    if v == 0 {
        return Err(origin.error(
            field,
            "must be at least 1, got 0",
            format!("set `{field}` to a positive integer"),
        ));
    }
    Ok(v)
}

/// `v`, refused unless finite and `ok`; `rule` says what `ok` asks for.
fn number(origin: &Origin, field: &str, v: f64, ok: impl Fn(f64) -> bool, rule: &str) -> Result<f64, SpecError> {
    if v.is_finite() && ok(v) {
        Ok(v)
    } else {
        Err(origin.error(
            field,
            format!("must be {rule}, got {v}"),
            format!("set `{field}` to a value {rule}"),
        ))
    }
}

/// Records where `field` was written, when it was.
fn record<T>(origin: &mut Origin, field: &str, s: &Option<Spanned<T>>) {
    if let Some(s) = s {
        origin.insert(field, pos(s));
    }
}

impl ParallelSpecFile {
    /// Converts the spec section by section, in the order in which their errors are found.
    fn into_config(self, src: &Source) -> Result<(ParallelConfig, Origin), SpecError> {
        let mut o = Origin::new(&src.path);
        let mesh = mesh(&mut o, self.mesh, self.world.as_ref())?;
        let world = world(&mut o, &mesh, self.world)?;
        let gpus_per_node = gpus_per_node(&mut o, self.gpus_per_node, &mesh, world)?;
        let tensor_parallel = tensor_parallel(&mut o, self.tensor_parallel);
        let context_parallel = context_parallel(&mut o, self.context_parallel);
        let moe = moe(&mut o, self.moe)?;
        let mut hardware = hardware(&mut o, self.hardware)?;
        let runtime = runtime(&mut o, self.runtime, &mut hardware)?;

        let wrap = wrap(&mut o, self.wrap)?;
        let wrap_modules = wrap_modules(&mut o, self.wrap_modules);
        record(&mut o, "bucket_mib", &self.bucket_mib);
        let bucket_mib = self
            .bucket_mib
            .map(|s| at_least_1(&o, "bucket_mib", s.value))
            .transpose()?;
        let reshard_after_forward = reshard_after_forward(&mut o, self.reshard_after_forward, mesh.fsdp_shard())?;
        let prefetch = prefetch(&mut o, self.prefetch)?;
        let mixed_precision = mixed_precision(&mut o, self.mixed_precision)?;
        record(&mut o, "offload", &self.offload);
        let offload = self.offload.map_or(Offload::None, |s| s.value);
        let activation_checkpointing = activation_checkpointing(&mut o, self.activation_checkpointing)?;
        check_fsdp2_checkpointing(&o, runtime, &mesh, &activation_checkpointing)?;

        let batch = batch(&mut o, self.batch)?;
        let (optimizer, adamw_implementation) = optimizer(&mut o, self.optimizer)?;
        let grad_clip = grad_clip(&mut o, self.grad_clip)?;
        record(&mut o, "seed", &self.seed);
        let seed = self.seed.map_or(0, |s| s.value);
        let lr_schedule = lr_schedule(&mut o, self.lr_schedule)?;
        let data = data(&mut o, self.data, &src.path)?;
        let allocator = allocator(&mut o, self.allocator);
        let compile = compile(&mut o, self.compile, runtime)?;
        check_async_tp(&o, &tensor_parallel, &mesh, &compile)?;
        let pipeline = pipeline(&mut o, self.pipeline, mesh.pipeline, batch.per_rank, &src.path)?;
        let float8 = float8(&mut o, self.float8, &hardware)?;
        let mxfp8 = mxfp8(&mut o, self.mxfp8, &hardware, float8.as_ref())?;

        let config = ParallelConfig {
            mesh,
            gpus_per_node,
            hardware,
            wrap,
            wrap_modules,
            bucket_mib,
            reshard_after_forward,
            prefetch,
            mixed_precision,
            offload,
            activation_checkpointing,
            batch,
            optimizer,
            adamw_implementation,
            grad_clip,
            seed,
            lr_schedule,
            data,
            runtime,
            allocator,
            compile,
            tensor_parallel,
            context_parallel,
            moe,
            pipeline,
            float8,
            mxfp8,
        };
        Ok((config, o))
    }
}

/// The mesh's axes, each at least 1, the expert axis dividing the shard axis; an absent
/// shard axis is what `world` leaves (1 without `world`), as torchtitan's `dp_shard: -1`.
fn mesh(o: &mut Origin, spec: Spanned<MeshFile>, world: Option<&Spanned<u64>>) -> Result<MeshShape, SpecError> {
    o.insert("mesh", pos(&spec));
    let mesh_file = spec.value;
    record(o, "mesh.replicate", &mesh_file.replicate);
    record(o, "mesh.shard", &mesh_file.shard);
    let pipeline = pipeline_axis(o, &mesh_file)?;
    record(o, "mesh.tensor", &mesh_file.tensor);
    let replicate = at_least_1(o, "mesh.replicate", mesh_file.replicate.map_or(1, |s| s.value))?;
    let tensor = at_least_1(o, "mesh.tensor", mesh_file.tensor.map_or(1, |s| s.value))?;
    record(o, "mesh.expert", &mesh_file.expert);
    let expert = at_least_1(o, "mesh.expert", mesh_file.expert.map_or(1, |s| s.value))?;
    record(o, "mesh.context", &mesh_file.context);
    let context = at_least_1(o, "mesh.context", mesh_file.context.map_or(1, |s| s.value))?;
    let shard = match &mesh_file.shard {
        Some(s) => at_least_1(o, "mesh.shard", s.value)?,
        None => default_shard(o, [pipeline, replicate, context, tensor], world)?,
    };
    check_context_axis(o, context, pipeline, expert)?;
    if !shard.is_multiple_of(expert) {
        return Err(o.error(
            "mesh.expert",
            format!("an expert group of {expert} ranks does not divide the shard axis of {shard} ranks"),
            format!("set mesh.expert to a divisor of mesh.shard ({shard}): expert parallelism is carved out of the shard axis"),
        ));
    }
    Ok(MeshShape {
        pipeline,
        replicate,
        shard,
        context,
        tensor,
        expert,
    })
}

/// The shard degree a mesh without `shard` gets: the ranks of `world` the other axes
/// (`pipeline x replicate x context x tensor`) leave, or 1 without `world`.
fn default_shard(o: &Origin, others: [u64; 4], world: Option<&Spanned<u64>>) -> Result<u64, SpecError> {
    let Some(w) = world else {
        return Ok(1);
    };
    let taken = others
        .iter()
        .try_fold(1u64, |acc, &a| acc.checked_mul(a))
        .unwrap_or(u64::MAX);
    if w.value == 0 || !w.value.is_multiple_of(taken) {
        return Err(SpecError::file(
            &o.file,
            format!(
                "the mesh's other axes take {taken} ranks, which do not divide world ({}), so the shard axis has no size",
                w.value
            ),
        )
        .at(Some(pos(w)))
        .field("mesh.shard")
        .help(format!("set mesh.shard, or make world a multiple of {taken}")));
    }
    Ok(w.value / taken)
}

/// Refuses a context axis beside the axes it does not combine with yet.
fn check_context_axis(o: &Origin, context: u64, pipeline: u64, expert: u64) -> Result<(), SpecError> {
    if context <= 1 {
        return Ok(());
    }
    for (axis, size) in [("pipeline", pipeline), ("expert", expert)] {
        if size > 1 {
            return Err(o.error(
                "mesh.context",
                format!("context parallelism does not combine with mesh.{axis} {size} yet"),
                format!("set mesh.context to 1, or mesh.{axis} to 1"),
            ));
        }
    }
    Ok(())
}

/// The mesh's axes as errors name them (`replicate x shard = 2 x 8`, with `pipeline` and
/// `tensor` where they are more than 1).
fn axes(mesh: &MeshShape) -> String {
    let axes = [
        ("pipeline", mesh.pipeline, mesh.pipeline > 1),
        ("replicate", mesh.replicate, true),
        ("shard", mesh.shard, true),
        ("context", mesh.context, mesh.context > 1),
        ("tensor", mesh.tensor, mesh.tensor > 1),
    ];
    let shown: Vec<_> = axes.iter().filter(|a| a.2).collect();
    let names: Vec<&str> = shown.iter().map(|a| a.0).collect();
    let sizes: Vec<String> = shown.iter().map(|a| a.1.to_string()).collect();
    format!("{} = {}", names.join(" x "), sizes.join(" x "))
}

/// The mesh's rank count: at most [`MAX_WORLD`], and the `world` of the spec where written.
fn world(o: &mut Origin, mesh: &MeshShape, spec: Option<Spanned<u64>>) -> Result<u64, SpecError> {
    let axes = axes(mesh);
    let tensor = mesh.tensor;
    match mesh
        .pipeline
        .checked_mul(mesh.replicate)
        .and_then(|p| p.checked_mul(mesh.shard))
        .and_then(|p| p.checked_mul(mesh.context))
        .and_then(|p| p.checked_mul(tensor))
    {
        Some(w) if w <= MAX_WORLD => {}
        _ => {
            return Err(o.error(
                "mesh",
                format!("{axes} is more than the {MAX_WORLD} ranks shardplan plans for"),
                "use a realistic mesh",
            ))
        }
    }
    let world = mesh.world();
    if let Some(w) = &spec {
        o.insert("world", pos(w));
        if tensor > w.value {
            return Err(o.error(
                "mesh.tensor",
                format!(
                    "a tensor group of {tensor} ranks is larger than the world of {} ranks",
                    w.value
                ),
                format!("set mesh.tensor to a divisor of {} at most gpus_per_node", w.value),
            ));
        }
        if w.value != world {
            return Err(o.error(
                "world",
                format!("the mesh has {axes} = {world} ranks, but world is {}", w.value),
                format!("make the mesh's axes multiply to {}, or set world to {world}", w.value),
            ));
        }
    }
    Ok(world)
}

/// GPUs per node (8 unless written): the world fills whole nodes, a tensor group one node.
fn gpus_per_node(o: &mut Origin, spec: Option<Spanned<u64>>, mesh: &MeshShape, world: u64) -> Result<u64, SpecError> {
    record(o, "gpus_per_node", &spec);
    let gpus_per_node = at_least_1(o, "gpus_per_node", spec.map_or(8, |s| s.value))?;
    if world > gpus_per_node && !world.is_multiple_of(gpus_per_node) {
        return Err(o.error(
            "gpus_per_node",
            format!("world size {world} does not fill whole nodes of {gpus_per_node} GPUs"),
            format!("make the mesh's axes multiply to a multiple of {gpus_per_node}, or change gpus_per_node"),
        ));
    }
    let tensor = mesh.tensor;
    if tensor > 1 && !gpus_per_node.is_multiple_of(tensor) {
        return Err(o.error(
            "mesh.tensor",
            format!("a tensor group of {tensor} ranks would span nodes of {gpus_per_node} GPUs"),
            format!(
                "set mesh.tensor to a divisor of gpus_per_node ({gpus_per_node}): tensor parallelism's activation collectives need NVLink"
            ),
        ));
    }
    Ok(gpus_per_node)
}

/// Tensor parallelism's options: sequence and loss parallelism (both off unless written).
fn tensor_parallel(o: &mut Origin, spec: Option<Spanned<TensorParallelFile>>) -> TensorParallel {
    let mut tensor_parallel = TensorParallel::default();
    if let Some(tp) = spec {
        o.insert("tensor_parallel", pos(&tp));
        if let Some(v) = &tp.value.sequence_parallel {
            o.insert("tensor_parallel.sequence_parallel", pos(v));
            tensor_parallel.sequence_parallel = v.value;
        }
        if let Some(v) = &tp.value.loss_parallel {
            o.insert("tensor_parallel.loss_parallel", pos(v));
            tensor_parallel.loss_parallel = v.value;
        }
        if let Some(v) = &tp.value.async_tp {
            o.insert("tensor_parallel.async", pos(v));
            tensor_parallel.async_tp = v.value;
        }
    }
    tensor_parallel
}

/// Async tensor parallelism as torchtitan allows it: a pass of torch.compile over the
/// sequence-parallel collectives of a tensor axis.
fn check_async_tp(o: &Origin, tp: &TensorParallel, mesh: &MeshShape, compile: &Compile) -> Result<(), SpecError> {
    if !tp.async_tp {
        return Ok(());
    }
    let field = "tensor_parallel.async";
    if mesh.tensor <= 1 {
        return Err(o.error(
            field,
            "async tensor parallelism overlaps the tensor group's collectives, and the mesh has no tensor axis",
            "set mesh.tensor (2 or more), or remove `async`",
        ));
    }
    if !tp.sequence_parallel {
        return Err(o.error(
            field,
            "async tensor parallelism splits the sequence-parallel all-gathers and reduce-scatters, and sequence_parallel is off",
            "set `sequence_parallel: true`, or remove `async`",
        ));
    }
    if !compile.model {
        return Err(o.error(
            field,
            "async tensor parallelism is a pass of torch.compile (inductor's micro-pipelined TP), and the model is not compiled (torchtitan refuses it so too)",
            "add `compile: true` (with `runtime: fsdp2`), or remove `async`",
        ));
    }
    Ok(())
}

/// Context parallelism's options: torchtitan's defaults unless written.
fn context_parallel(o: &mut Origin, spec: Option<Spanned<ContextParallelFile>>) -> ContextParallel {
    let mut cp = ContextParallel::default();
    if let Some(c) = spec {
        o.insert("context_parallel", pos(&c));
        if let Some(v) = &c.value.rotate {
            o.insert("context_parallel.rotate", pos(v));
            cp.rotate = v.value;
        }
        if let Some(v) = &c.value.load_balance {
            o.insert("context_parallel.load_balance", pos(v));
            cp.load_balance = v.value;
        }
    }
    cp
}

/// The routing of a mixture of experts: dropless within `capacity`, or dropping past
/// `capacity_factor`, never both.
fn moe(o: &mut Origin, spec: Option<Spanned<MoeFile>>) -> Result<MoeParallel, SpecError> {
    let mut moe = MoeParallel::default();
    if let Some(m) = spec {
        o.insert("moe", pos(&m));
        if let Some(v) = &m.value.capacity {
            o.insert("moe.capacity", pos(v));
            moe.capacity = number(
                o,
                "moe.capacity",
                v.value,
                |c| c >= 1.0,
                "at least 1.0 (the even split)",
            )?;
        }
        if let Some(v) = &m.value.capacity_factor {
            o.insert("moe.capacity_factor", pos(v));
            if m.value.capacity.is_some() {
                return Err(o.error(
                    "moe.capacity_factor",
                    "`moe.capacity` bounds dropless routing, `moe.capacity_factor` drops the tokens past each expert's capacity: a run routes one way",
                    "keep moe.capacity for dropless routing (torchtitan's and Hugging Face's), or moe.capacity_factor for token dropping (GShard's static shapes)",
                ));
            }
            moe.capacity_factor = Some(number(
                o,
                "moe.capacity_factor",
                v.value,
                |c| c > 0.0,
                "above 0 (1.0: each expert's even share)",
            )?);
        }
    }
    Ok(moe)
}

/// The runtime that executes the plan; under FSDP2 the kernels are eager and the mesh has
/// no tensor axis.
fn runtime(
    o: &mut Origin,
    spec: Option<Spanned<Runtime>>,
    hardware: &mut HardwareProfile,
) -> Result<Runtime, SpecError> {
    record(o, "runtime", &spec);
    let runtime = spec.map_or(Runtime::Shardplan, |s| s.value);
    if runtime == Runtime::Fsdp2 {
        // FSDP2 runs PyTorch eager kernels whatever the profile says; a spec that asks
        // for fused kernels as well contradicts itself, so it is refused, not overridden.
        if o.has("hardware.kernels") && hardware.kernels == KernelMode::Fused {
            return Err(o.error(
                "hardware.kernels",
                "`runtime: fsdp2` runs PyTorch eager kernels, but the hardware asks for `kernels: fused`",
                "remove `kernels: fused` (or write `kernels: eager`); `kernels: fused` is shardplan's own executor, `runtime: shardplan`",
            ));
        }
        hardware.kernels = KernelMode::Eager;
    }
    Ok(runtime)
}

/// Refuses selective checkpointing under FSDP2 with an expert axis, which PyTorch cannot run.
fn check_fsdp2_checkpointing(
    o: &Origin,
    runtime: Runtime,
    mesh: &MeshShape,
    activation_checkpointing: &ActivationCheckpointing,
) -> Result<(), SpecError> {
    if runtime == Runtime::Fsdp2
        && mesh.expert > 1
        && matches!(activation_checkpointing, ActivationCheckpointing::Selective(_))
    {
        // `export fsdp2` refuses it too: PyTorch's selective checkpointing replay fails
        // on the experts' FSDP2 hooks inside the checkpointed block.
        return Err(o.error(
            "activation_checkpointing",
            "FSDP2 cannot run selective checkpointing with an expert axis: the experts' FSDP unit runs its own hooks inside the recomputed block, which PyTorch's selective checkpointing replay refuses (seen with torch 2.15; torchtitan issue 3427)",
            "predict `activation_checkpointing: full` (FSDP2 runs it), or plan this with `runtime: shardplan` (the default), which runs it",
        ));
    }
    Ok(())
}

/// The caching allocator's options (expandable segments on unless written otherwise).
fn allocator(o: &mut Origin, spec: Option<Spanned<AllocatorFile>>) -> AllocatorConfig {
    let mut allocator = AllocatorConfig::default();
    if let Some(a) = spec {
        o.insert("allocator", pos(&a));
        if let Some(e) = &a.value.expandable_segments {
            o.insert("allocator.expandable_segments", pos(e));
            allocator.expandable_segments = e.value;
        }
    }
    allocator
}

/// What is compiled: `true` for the blocks and the loss, a map to choose, nothing when
/// absent. Only a PyTorch run compiles (`runtime: fsdp2`).
fn compile(
    o: &mut Origin,
    spec: Option<Spanned<crate::either::BoolOr<CompileFile>>>,
    runtime: Runtime,
) -> Result<Compile, SpecError> {
    let Some(c) = spec else {
        return Ok(Compile::default());
    };
    o.insert("compile", pos(&c));
    let compile = match c.value {
        crate::either::BoolOr::Bool(b) => Compile { model: b, loss: b },
        crate::either::BoolOr::Map(m) => {
            record(o, "compile.model", &m.model);
            record(o, "compile.loss", &m.loss);
            Compile {
                model: m.model.is_some_and(|v| v.value),
                loss: m.loss.is_some_and(|v| v.value),
            }
        }
    };
    if compile.any() && runtime != Runtime::Fsdp2 {
        return Err(o.error(
            "compile",
            "`compile` is torch.compile of a PyTorch FSDP2 run, and this spec plans shardplan's own executor, which does not compile",
            "add `runtime: fsdp2` to plan (and `export fsdp2`) the compiled PyTorch run, or remove `compile`",
        ));
    }
    Ok(compile)
}

/// Parses and validates a parallel spec.
pub fn parse_parallel_spec(src: &Source) -> Result<(ParallelConfig, Origin), SpecError> {
    let file: ParallelSpecFile = yaml::parse(src)?;
    file.into_config(src)
}
