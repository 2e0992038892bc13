//! The conversion from the file as written to the validated config: defaults, every
//! range and cross-field check, and `file:line:col` errors naming the fix.

use super::file::*;
use super::*;
use crate::either::{BoolOrInt, NameOr};
use crate::hardware::{builtin, HardwareProfile, HARDWARE_NAMES};
use crate::yaml::{self, pos};
use crate::{did_you_mean, Origin, Source, SpecError};
use serde_saphyr::Spanned;
use shardplan_ir::{DType, ModuleKind};

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

fn record<T>(origin: &mut Origin, field: &str, s: &Option<Spanned<T>>) {
    if let Some(s) = s {
        origin.insert(field, pos(s));
    }
}

impl ParallelSpecFile {
    fn into_config(self, src: &Source) -> Result<(ParallelConfig, Origin), SpecError> {
        let mut o = Origin::new(&src.path);

        o.insert("mesh", pos(&self.mesh));
        let mesh_file = self.mesh.value;
        record(&mut o, "mesh.replicate", &mesh_file.replicate);
        o.insert("mesh.shard", pos(&mesh_file.shard));
        record(&mut o, "mesh.tensor", &mesh_file.tensor);
        let replicate = at_least_1(&o, "mesh.replicate", mesh_file.replicate.map_or(1, |s| s.value))?;
        let shard = at_least_1(&o, "mesh.shard", mesh_file.shard.value)?;
        let tensor = at_least_1(&o, "mesh.tensor", mesh_file.tensor.map_or(1, |s| s.value))?;
        record(&mut o, "mesh.expert", &mesh_file.expert);
        let expert = at_least_1(&o, "mesh.expert", mesh_file.expert.map_or(1, |s| s.value))?;
        if !shard.is_multiple_of(expert) {
            return Err(o.error(
                "mesh.expert",
                format!("an expert group of {expert} ranks does not divide the shard axis of {shard} ranks"),
                format!("set mesh.expert to a divisor of mesh.shard ({shard}): expert parallelism is carved out of the shard axis"),
            ));
        }
        let mesh = MeshShape {
            replicate,
            shard,
            tensor,
            expert,
        };
        let axes = if tensor > 1 {
            format!("replicate x shard x tensor = {replicate} x {shard} x {tensor}")
        } else {
            format!("replicate x shard = {replicate} x {shard}")
        };
        match replicate.checked_mul(shard).and_then(|p| p.checked_mul(tensor)) {
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
        if let Some(w) = &self.world {
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

        record(&mut o, "gpus_per_node", &self.gpus_per_node);
        let gpus_per_node = at_least_1(&o, "gpus_per_node", self.gpus_per_node.map_or(8, |s| s.value))?;
        if world > gpus_per_node && !world.is_multiple_of(gpus_per_node) {
            return Err(o.error(
                "gpus_per_node",
                format!("world size {world} does not fill whole nodes of {gpus_per_node} GPUs"),
                format!("make the mesh's axes multiply to a multiple of {gpus_per_node}, or change gpus_per_node"),
            ));
        }
        if tensor > 1 && !gpus_per_node.is_multiple_of(tensor) {
            return Err(o.error(
                "mesh.tensor",
                format!("a tensor group of {tensor} ranks would span nodes of {gpus_per_node} GPUs"),
                format!(
                    "set mesh.tensor to a divisor of gpus_per_node ({gpus_per_node}): tensor parallelism's activation collectives need NVLink"
                ),
            ));
        }

        let mut tensor_parallel = TensorParallel::default();
        if let Some(tp) = self.tensor_parallel {
            o.insert("tensor_parallel", pos(&tp));
            if let Some(v) = &tp.value.sequence_parallel {
                o.insert("tensor_parallel.sequence_parallel", pos(v));
                tensor_parallel.sequence_parallel = v.value;
            }
            if let Some(v) = &tp.value.loss_parallel {
                o.insert("tensor_parallel.loss_parallel", pos(v));
                tensor_parallel.loss_parallel = v.value;
            }
        }

        let mut moe = MoeParallel::default();
        if let Some(m) = self.moe {
            o.insert("moe", pos(&m));
            if let Some(v) = &m.value.capacity {
                o.insert("moe.capacity", pos(v));
                moe.capacity = number(
                    &o,
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
                    &o,
                    "moe.capacity_factor",
                    v.value,
                    |c| c > 0.0,
                    "above 0 (1.0: each expert's even share)",
                )?);
            }
        }

        let mut hardware = hardware(&mut o, self.hardware)?;
        record(&mut o, "runtime", &self.runtime);
        let runtime = self.runtime.map_or(Runtime::Shardplan, |s| s.value);
        if runtime == Runtime::Fsdp2 {
            // FSDP2 runs PyTorch eager kernels whatever the profile says; a spec that asks
            // for fused kernels as well contradicts itself, so it is refused, not overridden.
            if o.has("hardware.kernels") && hardware.kernels == crate::hardware::KernelMode::Fused {
                return Err(o.error(
                    "hardware.kernels",
                    "`runtime: fsdp2` runs PyTorch eager kernels, but the hardware asks for `kernels: fused`",
                    "remove `kernels: fused` (or write `kernels: eager`); `kernels: fused` is shardplan's own executor, `runtime: shardplan`",
                ));
            }
            hardware.kernels = crate::hardware::KernelMode::Eager;
            if tensor > 1 {
                return Err(o.error(
                    "runtime",
                    "`runtime: fsdp2` models FSDP2's hooks on a data-parallel mesh; shardplan has no model of DTensor tensor parallelism under FSDP2",
                    "plan tensor parallelism with `runtime: shardplan` (the default), or set mesh.tensor to 1",
                ));
            }
        }

        let wrap = match self.wrap {
            None => vec![ModuleKind::Block],
            Some(list) => {
                o.insert("wrap", pos(&list));
                let mut kinds = Vec::new();
                for k in list.value {
                    if matches!(k.value, ModuleKind::Root | ModuleKind::Loss) {
                        let e = o.error("wrap", format!("`{}` cannot be wrapped", k.value), "the root group is always the last group and holds what no unit took; remove it from `wrap`");
                        return Err(e.at(Some(pos(&k))));
                    }
                    if !kinds.contains(&k.value) {
                        kinds.push(k.value);
                    }
                }
                kinds
            }
        };

        let mut wrap_modules = Vec::new();
        if let Some(list) = self.wrap_modules {
            o.insert("wrap_modules", pos(&list));
            for m in list.value {
                if !wrap_modules.contains(&m.value) {
                    wrap_modules.push(m.value);
                }
            }
        }
        record(&mut o, "bucket_mib", &self.bucket_mib);
        let bucket_mib = self
            .bucket_mib
            .map(|s| at_least_1(&o, "bucket_mib", s.value))
            .transpose()?;

        record(&mut o, "reshard_after_forward", &self.reshard_after_forward);
        let reshard_after_forward = match self.reshard_after_forward.map(|s| s.value) {
            None | Some(BoolOrInt::Bool(true)) => Reshard::AfterForward,
            Some(BoolOrInt::Bool(false)) => Reshard::Keep,
            Some(BoolOrInt::Int(n)) => {
                if n == 0 || !shard.is_multiple_of(n) {
                    return Err(o.error(
                        "reshard_after_forward",
                        format!("{n} does not divide the shard axis ({shard})"),
                        format!("use true, false, or a divisor of {shard} (usually gpus_per_node)"),
                    ));
                }
                Reshard::ToGroupOf(n)
            }
        };

        let mut prefetch = Prefetch::auto();
        if let Some(p) = self.prefetch {
            o.insert("prefetch", pos(&p));
            match p.value {
                NameOr::Name(n) if n == "auto" => {}
                NameOr::Name(n) => {
                    return Err(o.error(
                        "prefetch",
                        format!("unknown prefetch `{n}`"),
                        "use auto (the default) or {forward: N, backward: N}",
                    ));
                }
                NameOr::Map(m) => {
                    record(&mut o, "prefetch.forward", &m.forward);
                    record(&mut o, "prefetch.backward", &m.backward);
                    record(&mut o, "prefetch.peak_aware", &m.peak_aware);
                    prefetch.forward = m.forward.map_or(1, |s| s.value);
                    prefetch.backward = m.backward.map_or(1, |s| s.value);
                    prefetch.peak_aware = m.peak_aware.is_some_and(|s| s.value);
                    if let Some(e) = m.explicit {
                        o.insert("prefetch.explicit", pos(&e));
                        prefetch.explicit_forward = e.value.forward;
                        prefetch.explicit_backward = e.value.backward;
                    }
                }
            }
            for (field, v) in [
                ("prefetch.forward", prefetch.forward),
                ("prefetch.backward", prefetch.backward),
            ] {
                if v > 64 {
                    return Err(o.error(
                        field,
                        format!("prefetch depth {v} is more than 64"),
                        "FSDP2 uses 1; depths beyond 2-3 only add memory",
                    ));
                }
            }
        }

        let mut mixed_precision = MixedPrecision {
            param: DType::F32,
            reduce: DType::F32,
        };
        if let Some(mp) = self.mixed_precision {
            o.insert("mixed_precision", pos(&mp));
            for (field, v, slot) in [
                ("mixed_precision.param", &mp.value.param, &mut mixed_precision.param),
                ("mixed_precision.reduce", &mp.value.reduce, &mut mixed_precision.reduce),
            ] {
                if let Some(s) = v {
                    o.insert(field, pos(s));
                    if !s.value.is_float() {
                        return Err(o.error(
                            field,
                            format!("{} is not a floating-point dtype", s.value),
                            "use f32, bf16 or f16",
                        ));
                    }
                    *slot = s.value;
                }
            }
        }

        record(&mut o, "offload", &self.offload);
        let offload = self.offload.map_or(Offload::None, |s| s.value);

        record(&mut o, "activation_checkpointing", &self.activation_checkpointing);
        let activation_checkpointing = match self.activation_checkpointing.map(|s| s.value) {
            None => ActivationCheckpointing::None,
            Some(NameOr::Name(n)) => match n.as_str() {
                "none" => ActivationCheckpointing::None,
                "full" => ActivationCheckpointing::Full,
                "selective" => ActivationCheckpointing::Selective(SavePolicy::TORCHTITAN),
                other => {
                    let help = did_you_mean(other, ["none", "full", "selective"]).map_or_else(
                        || "use none, full, selective, {every: N} or {selective: {save: [...]}}".to_string(),
                        |m| format!("did you mean `{m}`? (none, full, selective, {{every: N}} or {{selective: {{save: [...]}}}})"),
                    );
                    return Err(o.error("activation_checkpointing", format!("unknown mode `{other}`"), help));
                }
            },
            Some(NameOr::Map(m)) => match (m.every, m.selective) {
                (Some(every), None) => {
                    o.insert("activation_checkpointing.every", pos(&every));
                    ActivationCheckpointing::Every(at_least_1(&o, "activation_checkpointing.every", every.value)?)
                }
                (None, Some(sel)) => {
                    o.insert("activation_checkpointing.selective", pos(&sel));
                    o.insert("activation_checkpointing.selective.save", pos(&sel.value.save));
                    let mut policy = SavePolicy {
                        attention: false,
                        matmuls: SavedMatmuls::None,
                    };
                    for (i, name) in sel.value.save.value.iter().enumerate() {
                        let field = format!("activation_checkpointing.selective.save[{i}]");
                        o.insert(&field, pos(name));
                        let matmuls = |p: &SavePolicy| p.matmuls != SavedMatmuls::None;
                        match name.value.as_str() {
                            "attention" if !policy.attention => policy.attention = true,
                            "matmuls" if !matmuls(&policy) => policy.matmuls = SavedMatmuls::All,
                            "odd_matmuls" if !matmuls(&policy) => policy.matmuls = SavedMatmuls::Odd,
                            "attention" | "matmuls" | "odd_matmuls" => {
                                return Err(o.error(
                                    &field,
                                    format!("`{}` repeats what the list already saves", name.value),
                                    "list each of attention, and matmuls or odd_matmuls, at most once",
                                ))
                            }
                            other => {
                                let help = did_you_mean(other, SAVE_NAMES).map_or_else(
                                    || format!("save lists some of {}", SAVE_NAMES.join(", ")),
                                    |m| format!("did you mean `{m}`? (save lists some of {})", SAVE_NAMES.join(", ")),
                                );
                                return Err(o.error(&field, format!("unknown op class `{other}`"), help));
                            }
                        }
                    }
                    ActivationCheckpointing::Selective(policy)
                }
                _ => {
                    return Err(o.error(
                        "activation_checkpointing",
                        "give either `every` or `selective`".to_string(),
                        "{every: N} checkpoints every N-th block whole; {selective: {save: [...]}} checkpoints every block by op",
                    ))
                }
            },
        };

        if runtime == Runtime::Fsdp2
            && expert > 1
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

        let mut batch = Batch {
            per_rank: 1,
            seq_len: None,
            grad_accum: 1,
            grad_sync: GradSync::EveryMicroBatch,
        };
        if let Some(b) = self.batch {
            o.insert("batch", pos(&b));
            let b = b.value;
            record(&mut o, "batch.per_rank", &b.per_rank);
            record(&mut o, "batch.seq_len", &b.seq_len);
            record(&mut o, "batch.grad_accum", &b.grad_accum);
            batch.per_rank = at_least_1(&o, "batch.per_rank", b.per_rank.map_or(1, |s| s.value))?;
            batch.seq_len = b
                .seq_len
                .map(|s| at_least_1(&o, "batch.seq_len", s.value))
                .transpose()?;
            batch.grad_accum = at_least_1(&o, "batch.grad_accum", b.grad_accum.map_or(1, |s| s.value))?;
            record(&mut o, "batch.grad_sync", &b.grad_sync);
            batch.grad_sync = b.grad_sync.map_or(GradSync::EveryMicroBatch, |s| s.value);
        }

        let (optimizer, adamw_implementation) = optimizer(&mut o, self.optimizer)?;

        record(&mut o, "grad_clip", &self.grad_clip);
        let grad_clip = match self.grad_clip.map(|s| s.value) {
            None => Some(1.0),
            Some(None) => None,
            Some(Some(c)) => Some(number(
                &o,
                "grad_clip",
                c,
                |v| v > 0.0,
                "> 0 (or null for no clipping)",
            )?),
        };

        record(&mut o, "seed", &self.seed);
        let seed = self.seed.map_or(0, |s| s.value);

        let mut lr_schedule = LrSchedule {
            warmup_steps: 0,
            min_lr_ratio: 0.1,
        };
        if let Some(ls) = self.lr_schedule {
            o.insert("lr_schedule", pos(&ls));
            if let Some(w) = &ls.value.warmup_steps {
                o.insert("lr_schedule.warmup_steps", pos(w));
                lr_schedule.warmup_steps = w.value;
            }
            if let Some(m) = &ls.value.min_lr_ratio {
                o.insert("lr_schedule.min_lr_ratio", pos(m));
                lr_schedule.min_lr_ratio = number(
                    &o,
                    "lr_schedule.min_lr_ratio",
                    m.value,
                    |v| (0.0..=1.0).contains(&v),
                    "in [0, 1]",
                )?;
            }
        }

        let data = match self.data {
            None => DataSource::Synthetic,
            Some(d) => {
                o.insert("data", pos(&d));
                match d.value {
                    NameOr::Name(n) if n == "synthetic" => DataSource::Synthetic,
                    NameOr::Name(n) => {
                        return Err(o.error(
                            "data",
                            format!("unknown data source `{n}`"),
                            "use `synthetic` or `{tokens: path/to/train.bin, dtype: u16}`",
                        ));
                    }
                    NameOr::Map(f) => {
                        o.insert("data.tokens", pos(&f.tokens));
                        let base = src.path.parent().unwrap_or_else(|| std::path::Path::new(""));
                        let resolve = |written: &str| {
                            let rel = std::path::PathBuf::from(written);
                            if rel.is_absolute() {
                                rel
                            } else {
                                base.join(rel)
                            }
                        };
                        let path = resolve(&f.tokens.value);
                        record(&mut o, "data.val", &f.val);
                        record(&mut o, "data.eval_every", &f.eval_every);
                        record(&mut o, "data.eval_batches", &f.eval_batches);
                        let eval = match (&f.val, &f.eval_every, &f.eval_batches) {
                            (None, None, None) => None,
                            (None, every, _) => {
                                let field = if every.is_some() {
                                    "data.eval_every"
                                } else {
                                    "data.eval_batches"
                                };
                                return Err(o.error(
                                    field,
                                    "validation needs a validation token file",
                                    "add `val: path/to/val.bin` to `data` (what `shardplan data prepare` writes beside train.bin)",
                                ));
                            }
                            (Some(val), every, batches) => {
                                let every = at_least_1(&o, "data.eval_every", every.as_ref().map_or(100, |s| s.value))?;
                                let batches =
                                    at_least_1(&o, "data.eval_batches", batches.as_ref().map_or(10, |s| s.value))?;
                                if batches > MAX_EVAL_BATCHES {
                                    return Err(o.error(
                                        "data.eval_batches",
                                        format!("{batches} batches per evaluation is more than the {MAX_EVAL_BATCHES} shardplan runs"),
                                        format!("set `data.eval_batches` to at most {MAX_EVAL_BATCHES}"),
                                    ));
                                }
                                if val.value.trim().is_empty() {
                                    return Err(o.error(
                                        "data.val",
                                        "the validation file's path is empty",
                                        "give the path of a token file, such as data/val.bin",
                                    ));
                                }
                                Some(Eval {
                                    path: resolve(&val.value),
                                    every,
                                    batches,
                                })
                            }
                        };
                        DataSource::Tokens {
                            path,
                            dtype: f.dtype.map_or(TokenDType::U16, |d| d.value),
                            eval,
                        }
                    }
                }
            }
        };

        let mut allocator = AllocatorConfig::default();
        if let Some(a) = self.allocator {
            o.insert("allocator", pos(&a));
            if let Some(e) = &a.value.expandable_segments {
                o.insert("allocator.expandable_segments", pos(e));
                allocator.expandable_segments = e.value;
            }
        }

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
            tensor_parallel,
            moe,
        };
        Ok((config, o))
    }
}

fn hardware(o: &mut Origin, spec: Option<Spanned<NameOr<HardwareFile>>>) -> Result<HardwareProfile, SpecError> {
    let unknown = |o: &Origin, field: &str, name: &str| {
        let help = match did_you_mean(name, HARDWARE_NAMES.iter().copied()) {
            Some(m) => format!("did you mean `{m}`? built-in profiles: {}", HARDWARE_NAMES.join(", ")),
            None => format!(
                "built-in profiles: {}; or give the numbers as a mapping",
                HARDWARE_NAMES.join(", ")
            ),
        };
        o.error(field, format!("unknown hardware profile `{name}`"), help)
    };
    let Some(spec) = spec else {
        return Ok(builtin("h100-sxm").expect("built-in profile"));
    };
    o.insert("hardware", pos(&spec));
    match spec.value {
        NameOr::Name(n) => builtin(&n).ok_or_else(|| unknown(o, "hardware", &n)),
        NameOr::Map(h) => {
            let mut profile = match &h.base {
                Some(b) => {
                    o.insert("hardware.base", pos(b));
                    builtin(&b.value).ok_or_else(|| unknown(o, "hardware.base", &b.value))?
                }
                None => HardwareProfile {
                    name: "custom".into(),
                    bf16_tflops: f64::NAN,
                    f32_tflops: f64::NAN,
                    hbm_gib: f64::NAN,
                    hbm_gbps: f64::NAN,
                    intra_node_gbps: f64::NAN,
                    inter_node_gbps: f64::NAN,
                    intra_node_latency_us: f64::NAN,
                    inter_node_latency_us: f64::NAN,
                    matmul_efficiency: f64::NAN,
                    host_link_gbps: f64::NAN,
                    host_mem_gbps: f64::NAN,
                    // Not hardware numbers a user must know: NCCL's, CUDA's and the
                    // kernels' typical figures (the H100's where they differ by GPU).
                    ..builtin("h100-sxm").expect("built-in profile")
                },
            };
            if let Some(n) = h.name {
                profile.name = n;
            } else if h.base.is_some() {
                profile.name.push_str("-custom");
            }
            let fields = [
                ("bf16_tflops", h.bf16_tflops, &mut profile.bf16_tflops),
                ("f32_tflops", h.f32_tflops, &mut profile.f32_tflops),
                ("hbm_gib", h.hbm_gib, &mut profile.hbm_gib),
                ("hbm_gbps", h.hbm_gbps, &mut profile.hbm_gbps),
                ("intra_node_gbps", h.intra_node_gbps, &mut profile.intra_node_gbps),
                ("inter_node_gbps", h.inter_node_gbps, &mut profile.inter_node_gbps),
                (
                    "intra_node_latency_us",
                    h.intra_node_latency_us,
                    &mut profile.intra_node_latency_us,
                ),
                (
                    "inter_node_latency_us",
                    h.inter_node_latency_us,
                    &mut profile.inter_node_latency_us,
                ),
                ("matmul_efficiency", h.matmul_efficiency, &mut profile.matmul_efficiency),
                ("host_link_gbps", h.host_link_gbps, &mut profile.host_link_gbps),
                ("host_mem_gbps", h.host_mem_gbps, &mut profile.host_mem_gbps),
                ("cuda_context_mib", h.cuda_context_mib, &mut profile.cuda_context_mib),
                ("nccl_channels", h.nccl_channels, &mut profile.nccl_channels),
                ("nccl_channel_mib", h.nccl_channel_mib, &mut profile.nccl_channel_mib),
                ("sm_count", h.sm_count, &mut profile.sm_count),
                ("matmul_tile_m", h.matmul_tile_m, &mut profile.matmul_tile_m),
                ("matmul_tile_n", h.matmul_tile_n, &mut profile.matmul_tile_n),
                (
                    "attention_fwd_efficiency",
                    h.attention_fwd_efficiency,
                    &mut profile.attention_fwd_efficiency,
                ),
                (
                    "attention_bwd_efficiency",
                    h.attention_bwd_efficiency,
                    &mut profile.attention_bwd_efficiency,
                ),
                ("attention_block", h.attention_block, &mut profile.attention_block),
                ("memory_efficiency", h.memory_efficiency, &mut profile.memory_efficiency),
                ("kernel_launch_us", h.kernel_launch_us, &mut profile.kernel_launch_us),
                (
                    "collective_efficiency",
                    h.collective_efficiency,
                    &mut profile.collective_efficiency,
                ),
                ("overlap_slowdown", h.overlap_slowdown, &mut profile.overlap_slowdown),
                (
                    "parallel_launch_us",
                    h.parallel_launch_us,
                    &mut profile.parallel_launch_us,
                ),
                ("copy_gbps", h.copy_gbps, &mut profile.copy_gbps),
                ("step_overhead_us", h.step_overhead_us, &mut profile.step_overhead_us),
                (
                    "fsdp2_unit_host_us",
                    h.fsdp2_unit_host_us,
                    &mut profile.fsdp2_unit_host_us,
                ),
            ];
            if let Some(k) = &h.kernels {
                o.insert("hardware.kernels", pos(k));
                profile.kernels = k.value;
            }
            let mut missing = Vec::new();
            for (name, value, slot) in fields {
                let field = format!("hardware.{name}");
                match value {
                    Some(v) => {
                        o.insert(&field, pos(&v));
                        // Memory outside the allocator may be none (no NCCL, no context), and
                        // so may launch costs and overlap slowdowns.
                        let may_be_zero = matches!(
                            name,
                            "cuda_context_mib"
                                | "nccl_channels"
                                | "nccl_channel_mib"
                                | "kernel_launch_us"
                                | "overlap_slowdown"
                                | "parallel_launch_us"
                                | "copy_gbps"
                                | "step_overhead_us"
                                | "fsdp2_unit_host_us"
                        );
                        let fraction = name.ends_with("_efficiency");
                        let rule = if fraction {
                            "in (0, 1]"
                        } else if may_be_zero {
                            ">= 0"
                        } else {
                            "> 0"
                        };
                        *slot = number(
                            o,
                            &field,
                            v.value,
                            |x| {
                                if may_be_zero {
                                    x >= 0.0
                                } else {
                                    x > 0.0 && (!fraction || x <= 1.0)
                                }
                            },
                            rule,
                        )?;
                    }
                    None if slot.is_nan() => missing.push(name),
                    None => {}
                }
            }
            if !missing.is_empty() {
                return Err(o.error(
                    "hardware",
                    format!("custom hardware is missing {}", missing.join(", ")),
                    format!(
                        "give every number, or start from a built-in with `base: h100-sxm` ({})",
                        HARDWARE_NAMES.join(", ")
                    ),
                ));
            }
            Ok(profile)
        }
    }
}

/// The optimizer, and AdamW's implementation in a PyTorch run (`fused` unless written).
fn optimizer(
    o: &mut Origin,
    spec: Option<Spanned<OptimizerFile>>,
) -> Result<(Optimizer, AdamwImplementation), SpecError> {
    let Some(spec) = spec else {
        let adamw = Optimizer::AdamW {
            lr: 3e-4,
            betas: [0.9, 0.95],
            eps: 1e-8,
            weight_decay: 0.1,
        };
        return Ok((adamw, AdamwImplementation::Fused));
    };
    o.insert("optimizer", pos(&spec));
    let get = |o: &mut Origin,
               field: &str,
               v: Option<Spanned<f64>>,
               default: f64,
               ok: fn(f64) -> bool,
               rule: &str|
     -> Result<f64, SpecError> {
        match v {
            None => Ok(default),
            Some(s) => {
                o.insert(field, pos(&s));
                number(o, field, s.value, ok, rule)
            }
        }
    };
    Ok(match spec.value {
        OptimizerFile::Adamw(a) => {
            let lr = get(o, "optimizer.adamw.lr", a.lr, 3e-4, |v| v > 0.0, "> 0")?;
            let eps = get(o, "optimizer.adamw.eps", a.eps, 1e-8, |v| v > 0.0, "> 0")?;
            let weight_decay = get(
                o,
                "optimizer.adamw.weight_decay",
                a.weight_decay,
                0.1,
                |v| v >= 0.0,
                ">= 0",
            )?;
            let betas = match a.betas {
                None => [0.9, 0.95],
                Some(b) => {
                    o.insert("optimizer.adamw.betas", pos(&b));
                    for v in b.value {
                        number(o, "optimizer.adamw.betas", v, |x| (0.0..1.0).contains(&x), "in [0, 1)")?;
                    }
                    b.value
                }
            };
            record(o, "optimizer.adamw.implementation", &a.implementation);
            let implementation = a.implementation.map_or(AdamwImplementation::Fused, |s| s.value);
            let adamw = Optimizer::AdamW {
                lr,
                betas,
                eps,
                weight_decay,
            };
            (adamw, implementation)
        }
        OptimizerFile::Sgd(s) => (
            Optimizer::Sgd {
                lr: get(o, "optimizer.sgd.lr", s.lr, 1e-2, |v| v > 0.0, "> 0")?,
                momentum: get(
                    o,
                    "optimizer.sgd.momentum",
                    s.momentum,
                    0.0,
                    |v| (0.0..1.0).contains(&v),
                    "in [0, 1)",
                )?,
                weight_decay: get(
                    o,
                    "optimizer.sgd.weight_decay",
                    s.weight_decay,
                    0.0,
                    |v| v >= 0.0,
                    ">= 0",
                )?,
            },
            AdamwImplementation::Fused,
        ),
    })
}

/// Parses and validates a parallel spec.
pub fn parse_parallel_spec(src: &Source) -> Result<(ParallelConfig, Origin), SpecError> {
    let file: ParallelSpecFile = yaml::parse(src)?;
    file.into_config(src)
}
