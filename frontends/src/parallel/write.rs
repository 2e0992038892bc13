//! The validated config written back as a parallel spec, in the spec's own words.

use super::*;

/// The `prefetch:` value that reads back as `p`.
fn prefetch_yaml(p: &Prefetch) -> String {
    if p.peak_aware
        && p.forward == 1
        && p.backward == 1
        && p.explicit_forward.is_empty()
        && p.explicit_backward.is_empty()
    {
        return "auto".into();
    }
    let list = |m: &std::collections::BTreeMap<String, Vec<String>>| -> String {
        let items: Vec<String> = m
            .iter()
            .map(|(k, v)| {
                // Module names as quoted scalars (a JSON string is one in YAML).
                let q = |x: &String| serde_json::to_string(x).unwrap_or_else(|_| "\"\"".into());
                let vs: Vec<String> = v.iter().map(q).collect();
                format!("{}: [{}]", q(k), vs.join(", "))
            })
            .collect();
        format!("{{{}}}", items.join(", "))
    };
    let mut y = format!("{{forward: {}, backward: {}", p.forward, p.backward);
    if p.peak_aware {
        y.push_str(", peak_aware: true");
    }
    if !p.explicit_forward.is_empty() || !p.explicit_backward.is_empty() {
        y.push_str(&format!(
            ", explicit: {{forward: {}, backward: {}}}",
            list(&p.explicit_forward),
            list(&p.explicit_backward)
        ));
    }
    y.push('}');
    y
}

/// The `pipeline:` value that reads back as `p`.
fn pipeline_yaml(p: &Pipeline) -> String {
    let q = |x: &str| serde_json::to_string(x).unwrap_or_else(|_| "\"\"".into());
    let mut y = format!("{{schedule: {}, microbatches: {}", q(p.schedule.name()), p.microbatches);
    if let Some(v) = p.stages_per_rank {
        y.push_str(&format!(", stages_per_rank: {v}"));
    }
    match &p.split {
        StageSplit::Layers {
            layers_per_stage,
            first_stage_less_layers,
            last_stage_less_layers,
        } => {
            if let Some(k) = layers_per_stage {
                y.push_str(&format!(", layers_per_stage: {k}"));
            }
            y.push_str(&format!(
                ", first_stage_less_layers: {first_stage_less_layers}, last_stage_less_layers: {last_stage_less_layers}"
            ));
        }
        StageSplit::Modules(stages) => {
            let stages: Vec<String> = stages
                .iter()
                .map(|s| format!("[{}]", s.iter().map(|m| q(m)).collect::<Vec<_>>().join(", ")))
                .collect();
            y.push_str(&format!(", modules_per_stage: [{}]", stages.join(", ")));
        }
    }
    if let Some(csv) = &p.csv {
        y.push_str(&format!(", csv: {}", q(&csv.display().to_string())));
    }
    y.push('}');
    y
}

/// The mesh and the sections of its axes' options (`moe`, `tensor_parallel`,
/// `context_parallel`) where they differ from the defaults, one line each.
fn mesh_yaml(c: &ParallelConfig) -> String {
    let mut y = String::new();
    let mut axes = String::new();
    if c.mesh.pipeline > 1 {
        axes.push_str(&format!("pipeline: {}, ", c.mesh.pipeline));
    }
    axes.push_str(&format!("replicate: {}, shard: {}", c.mesh.replicate, c.mesh.shard));
    if c.mesh.context > 1 {
        axes.push_str(&format!(", context: {}", c.mesh.context));
    }
    if c.mesh.tensor > 1 {
        axes.push_str(&format!(", tensor: {}", c.mesh.tensor));
    }
    if c.mesh.expert > 1 {
        axes.push_str(&format!(", expert: {}", c.mesh.expert));
    }
    y.push_str(&format!("mesh: {{{axes}}}\n"));
    if !c.moe.is_default() {
        match c.moe.capacity_factor {
            Some(f) => y.push_str(&format!("moe: {{capacity_factor: {f:?}}}\n")),
            None => y.push_str(&format!("moe: {{capacity: {:?}}}\n", c.moe.capacity)),
        }
    }
    if !c.tensor_parallel.is_default() {
        let tp = &c.tensor_parallel;
        let async_tp = if tp.async_tp { ", async: true" } else { "" };
        y.push_str(&format!(
            "tensor_parallel: {{sequence_parallel: {}, loss_parallel: {}{async_tp}}}\n",
            tp.sequence_parallel, tp.loss_parallel
        ));
    }
    if !c.context_parallel.is_default() {
        y.push_str(&format!(
            "context_parallel: {{rotate: {}, load_balance: {}}}\n",
            c.context_parallel.rotate.name(),
            c.context_parallel.load_balance.name()
        ));
    }
    y
}

/// The parallel spec of `c` as YAML (every field the planner and the trainers read), so a
/// run is reproducible from it: `plan --auto --emit-spec` writes it, and a plan file's
/// re-derivation checks that it reads back as `c`.
pub fn spec_yaml(c: &ParallelConfig) -> String {
    let hw = &c.hardware;
    let builtin = crate::hardware::HARDWARE_NAMES
        .iter()
        .find(|n| crate::hardware::builtin(n).as_ref() == Some(hw));
    let hardware = match builtin {
        Some(n) => n.to_string(),
        None => {
            let nums: Vec<String> = hw.numbers().iter().map(|(k, v)| format!("{k}: {v:?}")).collect();
            // The name as a quoted scalar (a JSON string is one in YAML): it may hold `:`
            // or `,`.
            let name = serde_json::to_string(&hw.name).unwrap_or_else(|_| "\"custom\"".into());
            format!("{{name: {name}, kernels: {}, {}}}", hw.kernels.name(), nums.join(", "))
        }
    };
    let wrap: Vec<&str> = c.wrap.iter().map(|k| k.name()).collect();
    let reshard = c.reshard_after_forward.to_string();
    let ac = match c.activation_checkpointing {
        ActivationCheckpointing::None => "none".to_string(),
        ActivationCheckpointing::Full => "full".to_string(),
        ActivationCheckpointing::Every(n) => format!("{{every: {n}}}"),
        ActivationCheckpointing::Selective(p) if p == SavePolicy::TORCHTITAN => "selective".to_string(),
        ActivationCheckpointing::Selective(p) => format!("{{selective: {{save: [{}]}}}}", p.names().join(", ")),
    };
    let optimizer = match c.optimizer {
        Optimizer::AdamW {
            lr,
            betas,
            eps,
            weight_decay,
        } => {
            // Written only when not the default, as the other defaulted fields are.
            let implementation = if c.adamw_implementation.is_fused() {
                String::new()
            } else {
                format!(", implementation: {}", c.adamw_implementation.name())
            };
            format!(
                "{{adamw: {{lr: {lr:?}, betas: [{:?}, {:?}], eps: {eps:?}, weight_decay: {weight_decay:?}{implementation}}}}}",
                betas[0], betas[1]
            )
        }
        Optimizer::Sgd {
            lr,
            momentum,
            weight_decay,
        } => format!("{{sgd: {{lr: {lr:?}, momentum: {momentum:?}, weight_decay: {weight_decay:?}}}}}"),
    };
    let mut y = String::new();
    y.push_str("# Written by `shardplan plan --auto --emit-spec`.\n");
    y.push_str(&mesh_yaml(c));
    if let Some(p) = &c.pipeline {
        y.push_str(&format!("pipeline: {}\n", pipeline_yaml(p)));
    }
    y.push_str(&format!("gpus_per_node: {}\n", c.gpus_per_node));
    y.push_str(&format!("hardware: {hardware}\n"));
    if !c.runtime.is_shardplan() {
        y.push_str(&format!("runtime: {}\n", c.runtime.name()));
    }
    y.push_str(&format!("wrap: [{}]\n", wrap.join(", ")));
    if !c.wrap_modules.is_empty() {
        y.push_str(&format!("wrap_modules: [{}]\n", c.wrap_modules.join(", ")));
    }
    if let Some(b) = c.bucket_mib {
        y.push_str(&format!("bucket_mib: {b}\n"));
    }
    y.push_str(&format!("reshard_after_forward: {reshard}\n"));
    y.push_str(&format!("prefetch: {}\n", prefetch_yaml(&c.prefetch)));
    y.push_str(&format!(
        "mixed_precision: {{param: {}, reduce: {}}}\n",
        c.mixed_precision.param, c.mixed_precision.reduce
    ));
    y.push_str(&format!(
        "offload: {}\n",
        if c.offload == Offload::Cpu { "cpu" } else { "none" }
    ));
    y.push_str(&format!("activation_checkpointing: {ac}\n"));
    let seq = c.batch.seq_len.map(|s| format!(", seq_len: {s}")).unwrap_or_default();
    let sync = match c.batch.grad_sync {
        GradSync::EveryMicroBatch => "every_micro_batch",
        GradSync::FinalMicroBatch => "final_micro_batch",
    };
    y.push_str(&format!(
        "batch: {{per_rank: {}{seq}, grad_accum: {}, grad_sync: {sync}}}\n",
        c.batch.per_rank, c.batch.grad_accum
    ));
    y.push_str(&format!("optimizer: {optimizer}\n"));
    match c.grad_clip {
        Some(g) => y.push_str(&format!("grad_clip: {g:?}\n")),
        None => y.push_str("grad_clip: null\n"),
    }
    y.push_str(&format!("seed: {}\n", c.seed));
    if !c.compile.is_default() {
        y.push_str(&format!(
            "compile: {{model: {}, loss: {}}}\n",
            c.compile.model, c.compile.loss
        ));
    }
    y.push_str(&low_precision_yaml(c));
    if !c.allocator.is_default() {
        y.push_str(&format!(
            "allocator: {{expandable_segments: {}}}\n",
            c.allocator.expandable_segments
        ));
    }
    y.push_str(&format!(
        "lr_schedule: {{warmup_steps: {}, min_lr_ratio: {:?}}}\n",
        c.lr_schedule.warmup_steps, c.lr_schedule.min_lr_ratio
    ));
    match &c.data {
        DataSource::Synthetic => y.push_str("data: synthetic\n"),
        DataSource::Tokens { path, dtype, eval } => {
            let eval = eval.as_ref().map_or(String::new(), |e| {
                format!(
                    ", val: {:?}, eval_every: {}, eval_batches: {}",
                    e.path.display().to_string(),
                    e.every,
                    e.batches
                )
            });
            y.push_str(&format!(
                "data: {{tokens: {:?}, dtype: {}{eval}}}\n",
                path.display().to_string(),
                match dtype {
                    TokenDType::U16 => "u16",
                    TokenDType::U32 => "u32",
                }
            ))
        }
    }
    y
}

/// The `float8:` or `mxfp8:` line that reads back as the config's, or nothing.
fn low_precision_yaml(c: &ParallelConfig) -> String {
    let q = |x: &String| serde_json::to_string(x).unwrap_or_else(|_| "\"\"".into());
    let list = |v: &[String]| v.iter().map(q).collect::<Vec<_>>().join(", ");
    if let Some(f) = &c.float8 {
        return format!(
            "float8: {{recipe: {}, filter_fqns: [{}], fsdp_float8_all_gather: {}, precompute_scale: {}}}\n",
            f.recipe.name(),
            list(&f.filter_fqns),
            f.fsdp_float8_all_gather,
            f.precompute_scale
        );
    }
    if let Some(m) = &c.mxfp8 {
        let recipe = match m.recipe {
            Mxfp8Recipe::Mxfp8Cublas => "mxfp8_cublas",
            Mxfp8Recipe::Mxfp8CublasRceil => "mxfp8_cublas_rceil",
        };
        return format!("mxfp8: {{recipe: {recipe}, filter_fqns: [{}]}}\n", list(&m.filter_fqns));
    }
    String::new()
}
