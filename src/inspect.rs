//! `shardplan inspect`: what was traced, in numbers.

use crate::fmt::{bytes, si, thousands};
use crate::CliError;
use anyhow::Context;
use clap::{Args, ValueEnum};
use serde::Serialize;
use shardplan_frontends::{load_model, load_parallel, trace_error, trace_options, LoadedParallel, ParallelConfig};
use shardplan_ir::stats::{module_stats, param_counts, ModuleStats, ParamCounts};
use shardplan_ir::{to_dot, DType, Graph};
use shardplan_models::{trace, ModelConfig};
use std::fmt::Write as _;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Model: a YAML model spec, a Hugging Face config.json, or a preset name (llama3-8b, gpt2, tiny-llama, ...).
    #[arg(long, value_name = "FILE")]
    pub model: PathBuf,
    /// Parallel spec (YAML): its batch size, sequence length and param dtype set the traced shape.
    #[arg(long, value_name = "FILE")]
    pub parallel: Option<PathBuf>,
    /// Output format on stdout.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Also write the traced graph as Graphviz DOT to this file.
    #[arg(long, value_name = "FILE")]
    pub dot: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    /// Aligned tables for people.
    Text,
    /// One JSON object for scripts.
    Json,
}

#[derive(Serialize)]
struct Report<'a> {
    model: &'a ModelConfig,
    shape: Shape,
    params: ParamCounts,
    /// Training FLOPs (forward + backward) per token.
    flops_per_token: u64,
    flops: Flops,
    graph: GraphSize,
    layers: Vec<ModuleStats>,
    parallel: Option<&'a ParallelConfig>,
    /// Mixtures of experts only.
    #[serde(skip_serializing_if = "Option::is_none")]
    moe: Option<MoeReport>,
}

#[derive(Serialize)]
struct Shape {
    batch: u64,
    seq_len: u64,
    tokens: u64,
    dtype: DType,
}

#[derive(Serialize)]
struct Flops {
    forward_per_token: u64,
    backward_per_token: u64,
    forward_total: u64,
    backward_total: u64,
}

#[derive(Serialize)]
struct GraphSize {
    nodes: usize,
    edges: usize,
    params: usize,
    scopes: usize,
}

pub fn run(args: &InspectArgs) -> Result<(), CliError> {
    let model = load_model(&args.model)?;
    let parallel: Option<LoadedParallel> = args.parallel.as_deref().map(load_parallel).transpose()?;
    let opts = trace_options(parallel.as_ref());
    let graph = trace(&model.config, opts).map_err(|e| trace_error(e, &model, parallel.as_ref()))?;
    if let Some(path) = &args.dot {
        std::fs::write(path, to_dot(&graph)).with_context(|| format!("cannot write DOT to {}", path.display()))?;
    }
    let report = build_report(&model.config, parallel.as_ref().map(|p| &p.config), &graph);
    let out = match args.format {
        Format::Json => serde_json::to_string_pretty(&report).context("serialising the report")? + "\n",
        Format::Text => text(&report),
    };
    crate::emit(&out)
}

/// A mixture of experts' numbers beyond the graph's: parameters active per token (the
/// chosen experts' only) and the expert layout, from the validated config.
#[derive(Serialize)]
struct MoeReport {
    active_params_per_token: u64,
    moe_layers: u64,
    line: String,
}

fn moe_report(model: &ModelConfig) -> Option<MoeReport> {
    let ModelConfig::Llama(c) = model else { return None };
    let m = c.moe.as_ref().filter(|_| model.is_moe())?;
    let shared = if m.shared_experts > 0 {
        format!(
            ", {} shared of width {}{}",
            m.shared_experts,
            m.shared_expert_ffn_dim,
            if m.shared_expert_gate { " (sigmoid-gated)" } else { "" }
        )
    } else {
        String::new()
    };
    let aux = if m.aux_loss_coef > 0.0 {
        format!(", load-balancing loss x {}", m.aux_loss_coef)
    } else {
        String::new()
    };
    Some(MoeReport {
        // Validation bounded the count to u64.
        active_params_per_token: model.active_param_count().unwrap_or(0),
        moe_layers: c.moe_layers(),
        line: format!(
            "{} of {} layers: {} experts of width {}, top {} ({}{}){shared}{aux}",
            c.moe_layers(),
            c.n_layers,
            m.experts,
            m.expert_ffn_dim,
            m.top_k,
            m.router.name(),
            if m.norm_topk_prob { ", renormalised" } else { "" },
        ),
    })
}

fn build_report<'a>(model: &'a ModelConfig, parallel: Option<&'a ParallelConfig>, g: &Graph) -> Report<'a> {
    let tokens_ty = &g.node(g.inputs()[0]).ty;
    let dims = tokens_ty.shape.dims();
    let (batch, seq_len) = (dims[0], dims[1]);
    let tokens = batch * seq_len;
    let cost = g.total_cost();
    let dtype = g.params().next().map_or(DType::F32, |(_, p)| p.ty.dtype);
    Report {
        model,
        shape: Shape {
            batch,
            seq_len,
            tokens,
            dtype,
        },
        params: param_counts(g),
        flops_per_token: cost.fwd_flops.saturating_add(cost.bwd_flops) / tokens,
        flops: Flops {
            forward_per_token: cost.fwd_flops / tokens,
            backward_per_token: cost.bwd_flops / tokens,
            forward_total: cost.fwd_flops,
            backward_total: cost.bwd_flops,
        },
        graph: GraphSize {
            nodes: g.node_count(),
            edges: g.edge_count(),
            params: g.params().len(),
            scopes: g.scopes().len(),
        },
        // Rows that hold and compute nothing (the root, holding only the inputs) are noise.
        layers: module_stats(g)
            .into_iter()
            .filter(|l| l.params > 0 || l.cost.fwd_flops > 0 || l.activation_bytes > 0)
            .collect(),
        parallel,
        moe: moe_report(model),
    }
}

fn text(r: &Report) -> String {
    let mut s = String::new();
    let p = &r.params;
    let _ = writeln!(s, "model    {} ({})", r.model.name(), r.model.family());
    let _ = writeln!(
        s,
        "shape    batch {} x seq {} = {} tokens per micro-batch, {}",
        r.shape.batch, r.shape.seq_len, r.shape.tokens, r.shape.dtype
    );
    let _ = writeln!(
        s,
        "params   {} total, {} embedding, {} non-embedding",
        thousands(p.total),
        thousands(p.embedding),
        thousands(p.non_embedding)
    );
    if let Some(m) = &r.moe {
        let _ = writeln!(
            s,
            "         {} total, {} active per token (FLOPs below are the routed ones: top-k experts per token)",
            thousands(p.total),
            thousands(m.active_params_per_token)
        );
        let _ = writeln!(s, "moe      {}", m.line);
    }
    let kinds: Vec<String> = p
        .by_kind
        .iter()
        .map(|(k, n)| format!("{k} {}", thousands(*n)))
        .collect();
    let _ = writeln!(s, "  by kind  {}", kinds.join(", "));
    let _ = writeln!(
        s,
        "flops    {} per token (fwd+bwd): forward {}, backward {}",
        si(r.flops_per_token),
        si(r.flops.forward_per_token),
        si(r.flops.backward_per_token)
    );
    let _ = writeln!(
        s,
        "graph    {} nodes, {} edges, {} parameters, {} scopes",
        r.graph.nodes, r.graph.edges, r.graph.params, r.graph.scopes
    );
    if let Some(par) = r.parallel {
        let m = par.mesh;
        let _ = writeln!(
            s,
            "parallel world {} = replicate {} x shard {}{}, {} GPUs/node, {}",
            m.world(),
            m.replicate,
            m.shard,
            if m.tensor > 1 {
                format!(" x tensor {}", m.tensor)
            } else {
                String::new()
            },
            par.gpus_per_node,
            par.hardware.name
        );
        if m.tensor > 1 {
            let _ = writeln!(
                s,
                "         the graph is one of the {} tensor ranks' programs: its parameters, FLOPs and activations are one rank's slices",
                m.tensor
            );
        }
        let _ = writeln!(
            s,
            "         wrap [{}], reshard_after_forward {}, prefetch fwd {} bwd {}, params {} / reduce {}, offload {}, checkpointing {}, grad_accum {}",
            par.wrap.iter().map(|k| k.name()).collect::<Vec<_>>().join(", "),
            par.reshard_after_forward,
            par.prefetch.forward,
            par.prefetch.backward,
            par.mixed_precision.param,
            par.mixed_precision.reduce,
            par.offload,
            par.activation_checkpointing,
            par.batch.grad_accum
        );
    }
    let _ = writeln!(s);
    let w = r.layers.iter().map(|l| l.path.len()).max().unwrap_or(6).max(6);
    let _ = writeln!(
        s,
        "{:<w$}  {:<9}  {:>9}  {:>10}  {:>10}  {:>11}",
        "module", "kind", "params", "fwd FLOPs", "bwd FLOPs", "activations"
    );
    for l in &r.layers {
        let _ = writeln!(
            s,
            "{:<w$}  {:<9}  {:>9}  {:>10}  {:>10}  {:>11}",
            l.path,
            l.kind.name(),
            si(l.params),
            si(l.cost.fwd_flops),
            si(l.cost.bwd_flops),
            bytes(l.activation_bytes)
        );
    }
    s
}
