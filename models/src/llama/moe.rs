//! The mixture-of-experts feed-forward of a Llama-family layer (Mixtral, Qwen2-MoE,
//! Qwen3-MoE), traced as Hugging Face's sparse blocks compute it.

use crate::tracer::{ExpertOptions, Tracer};
use crate::{LlamaConfig, MoeConfig, MoeNames, Router};
use shardplan_ir::{DType, IrError, NodeId, Op, RouterScore, ScopeId, TpGrad, WeightLayout};

/// The mixture-of-experts feed-forward of one layer, as Hugging Face's Mixtral / Qwen2-MoE /
/// Qwen3-MoE sparse blocks compute it: router logits (a linear layer, then f32), each token's
/// `top_k` experts and their weights, the tokens permuted to expert order, every expert's
/// SwiGLU as grouped matmuls over its rows, the rows scaled by their weights and summed back
/// per token; plus the shared expert (behind its sigmoid gate) on every token. Returns the
/// output `[batch, seq, dim]` (under sequence parallelism this rank's sequence chunk, as
/// `h`) and the f32 router logits `[tokens, experts]` of every token.
///
/// Under tensor parallelism the experts split as the dense feed-forward does (torchtitan's
/// expert tensor parallelism at the tensor degree): each tensor rank holds a column slice of
/// every gate and up projection and a row slice of every down projection, routes every
/// token of its group the same way and sums its partial outputs with the group at
/// [`Tracer::tp_exit`]. The router runs where its input is (on the sequence chunk, its
/// logits then gathered, its weight read through `tp_copy`; or on the whole input), so its
/// logits and the routing are the same on every tensor rank; the routing weights are read
/// through `tp_copy`, whose gradient sums the partial products they meet, so the router's
/// gradient is whole on every rank, the load-balancing loss's included.
pub(super) fn moe_ffn(
    t: &mut Tracer,
    ff: ScopeId,
    c: &LlamaConfig,
    m: &MoeConfig,
    h: NodeId,
    layer: &str,
    [batch, seq]: [u64; 2],
) -> Result<(NodeId, NodeId), IrError> {
    let moe = Moe::new(t, ff, c, m, layer, batch * seq);
    let (d, tokens) = (c.dim, moe.tokens);
    // Every token, `[tokens, dim]`, where `h` holds them all.
    let flat = if t.sequence_parallel() {
        None
    } else {
        Some(t.reshape(ff, h, &[tokens, d])?)
    };
    // Under sequence parallelism on this rank's chunk `[batch, seq / n, dim]`, else on every token.
    let logits = moe.router_logits(t, flat.unwrap_or(h))?;
    let mut routing = moe.route(t, logits)?;
    let x = moe.expert_input(t, h, flat)?;
    let (rows, local_ids) = moe.dispatch(t, x, &mut routing)?;
    let weights = moe.expert_weights(t)?;
    let shared_out = if moe.early { moe.shared_expert(t, x)? } else { None };
    let down = moe.routed_experts(t, rows, local_ids, &weights, routing.table)?;
    let mut y = moe.weigh_and_sum(t, down, &routing)?;
    let shared_out = match shared_out {
        Some(out) => Some(out),
        None if !moe.early => moe.shared_expert(t, x)?,
        None => None,
    };
    if let Some(out) = shared_out {
        y = t.op(ff, Op::Add, &[y, out])?;
    }
    let y = t.reshape(ff, y, &[batch, seq, d])?;
    let y = t.tp_exit(ff, y)?;
    Ok((y, logits))
}

/// What the parts of one layer's MoE feed-forward share.
struct Moe<'a> {
    c: &'a LlamaConfig,
    m: &'a MoeConfig,
    /// The feed-forward's scope: the router, the routed experts and the shared expert all
    /// trace into it.
    ff: ScopeId,
    /// The layer's MoE parameters' HF prefix (`model.layers.3.block_sparse_moe`).
    prefix: String,
    /// The routed experts' gate, up and down projections' HF names.
    names: [&'static str; 3],
    /// Tokens of the batch (`batch x seq`).
    tokens: u64,
    /// The graph's dtype (the router computes in f32).
    dtype: DType,
    ep: ExpertOptions,
    /// Under expert parallelism, trace for overlap: the routing table's all-gather right
    /// after the top-k, the shared expert while the rows travel.
    early: bool,
    /// Routed experts this rank computes (all of them without expert parallelism).
    per_rank: u64,
}

/// A layer's routing: which experts each token goes to, with what weight.
struct Routing {
    /// Each token's `top_k` experts, less those dropped past an expert's capacity.
    routed: NodeId,
    /// The routing weights, in the graph's dtype.
    weights: NodeId,
    /// Under expert parallelism every rank's routing (gathered).
    table: Option<NodeId>,
}

/// The routed experts' weights this rank holds, one per expert of `per_rank`.
struct ExpertWeights {
    gate: Vec<NodeId>,
    up: Vec<NodeId>,
    down: Vec<NodeId>,
}

/// A bias-free linear layer of `[out, in]` weights.
const LINEAR: Op = Op::Linear {
    bias: false,
    layout: WeightLayout::OutIn,
    float8: None,
};

impl<'a> Moe<'a> {
    fn new(t: &Tracer, ff: ScopeId, c: &'a LlamaConfig, m: &'a MoeConfig, layer: &str, tokens: u64) -> Self {
        let (prefix, names) = match m.hf_names {
            MoeNames::Mixtral => (format!("{layer}.block_sparse_moe"), ["w1", "w3", "w2"]),
            MoeNames::Qwen => (format!("{layer}.mlp"), ["gate_proj", "up_proj", "down_proj"]),
        };
        let ep = t.ep;
        Moe {
            c,
            m,
            ff,
            prefix,
            names,
            tokens,
            dtype: t.dtype,
            ep,
            early: ep.is_parallel() && ep.overlap,
            per_rank: if ep.is_parallel() {
                m.experts / ep.degree
            } else {
                m.experts
            },
        }
    }

    /// The router's logits of every token, `[tokens, experts]` in f32, from `input` (every
    /// token, or under sequence parallelism this rank's chunk, whose logits are gathered).
    fn router_logits(&self, t: &mut Tracer, input: NodeId) -> Result<NodeId, IrError> {
        let (router, m) = (self.ff, self.m);
        let gate_w = t.param(
            router,
            &format!("{}.gate.weight", self.prefix),
            &[m.experts, self.c.dim],
        )?;
        let gate_w = t.tp_replicated(router, gate_w)?;
        let mut logits = t.op(router, LINEAR, &[input, gate_w])?;
        if self.dtype != DType::F32 {
            logits = t.op(router, Op::Cast { dtype: DType::F32 }, &[logits])?;
        }
        if t.sequence_parallel() {
            // Every rank's logits: the same on each, so the gradient is each rank's chunk of it.
            let all = t.tp_op(
                router,
                |degree| Op::TpAllGather {
                    dim: 1,
                    degree,
                    grad: TpGrad::Replicated,
                },
                logits,
            )?;
            logits = t.reshape(router, all, &[self.tokens, m.experts])?;
        }
        Ok(logits)
    }

    /// Each token's experts and weights from the router's `logits`; under expert
    /// parallelism traced for overlap, the routing table's all-gather too.
    fn route(&self, t: &mut Tracer, logits: NodeId) -> Result<Routing, IrError> {
        let (router, m) = (self.ff, self.m);
        let score = match m.router {
            Router::SoftmaxTopk => RouterScore::Softmax,
            Router::SigmoidTopk => RouterScore::Sigmoid,
        };
        let ids = t.op(router, Op::MoeTopK { k: m.top_k, score }, &[logits])?;
        // Token dropping: each expert's assignments past its capacity leave the expert path
        // (their rows are zero); the routing weights are still the top-k's.
        let routed = match self.ep.per_expert(self.tokens * m.top_k, m.experts) {
            Some(capacity) => t.op(
                router,
                Op::MoeDrop {
                    experts: m.experts,
                    capacity,
                },
                &[ids],
            )?,
            None => ids,
        };
        // Under expert parallelism every rank's routing: traced for overlap, the table's
        // all-gather runs on the all-to-all stream while this rank computes its weights and
        // permutes its rows; else after them, as torchtitan orders it.
        let table = if self.early {
            Some(self.gather_ids(t, routed)?)
        } else {
            None
        };
        let mut weights = t.op(
            router,
            Op::MoeRouterWeights {
                score,
                norm: m.norm_topk_prob,
            },
            &[logits, ids],
        )?;
        if self.dtype != DType::F32 {
            weights = t.op(router, Op::Cast { dtype: self.dtype }, &[weights])?;
        }
        let weights = t.tp_summed(router, weights)?;
        Ok(Routing { routed, weights, table })
    }

    /// Every rank's routing of the expert group, gathered.
    fn gather_ids(&self, t: &mut Tracer, routed: NodeId) -> Result<NodeId, IrError> {
        t.op(self.ff, Op::MoeGatherIds { degree: self.ep.degree }, &[routed])
    }

    /// The experts' input `[tokens, dim]`: every token, on every tensor rank (`flat`, when
    /// it already is).
    fn expert_input(&self, t: &mut Tracer, h: NodeId, flat: Option<NodeId>) -> Result<NodeId, IrError> {
        match flat {
            Some(x) if !t.tp.is_parallel() => Ok(x),
            _ => {
                let x = t.tp_enter(self.ff, h)?;
                t.reshape(self.ff, x, &[self.tokens, self.c.dim])
            }
        }
    }

    /// The rows of `x` in expert order, and which of this rank's experts each is for. Under
    /// expert parallelism the rows travel to the ranks holding their experts (the routing
    /// table gathered first unless it was early) and this rank computes its own experts
    /// over what it received.
    fn dispatch(&self, t: &mut Tracer, x: NodeId, routing: &mut Routing) -> Result<(NodeId, NodeId), IrError> {
        let experts = self.ff;
        let ids = routing.routed;
        let rows = t.op(experts, Op::MoePermute, &[x, ids])?;
        if self.ep.is_parallel() && !self.early {
            routing.table = Some(self.gather_ids(t, ids)?);
        }
        let Some(table) = routing.table else {
            return Ok((rows, ids));
        };
        let cap = self.ep.rows(self.tokens * self.m.top_k, self.m.experts);
        let (degree, e) = (self.ep.degree, self.m.experts);
        let recv = t.op(
            experts,
            Op::MoeDispatch {
                degree,
                experts: e,
                rows: cap,
            },
            &[rows, table],
        )?;
        let lids = t.op(
            experts,
            Op::MoeLocalIds {
                degree,
                experts: e,
                rows: cap,
            },
            &[table],
        )?;
        Ok((recv, lids))
    }

    /// This rank's routed experts' weights: this tensor rank's slices (the gate and up
    /// projections' hidden units, the down projection's inputs). Every routed weight is
    /// made before the shared expert, whatever the order of the ops (parameters keep their
    /// numbers).
    fn expert_weights(&self, t: &mut Tracer) -> Result<ExpertWeights, IrError> {
        let (d, f) = (self.c.dim, self.m.expert_ffn_dim / t.tp.degree);
        let [gate, up, down] = self.names;
        Ok(ExpertWeights {
            gate: self.expert_params(t, gate, [f, d], 0)?,
            up: self.expert_params(t, up, [f, d], 0)?,
            down: self.expert_params(t, down, [d, f], 1)?,
        })
    }

    /// One projection `name` of each of this rank's experts; `shape` is this tensor rank's
    /// slice, cut along `dim`.
    fn expert_params(&self, t: &mut Tracer, name: &str, shape: [u64; 2], dim: usize) -> Result<Vec<NodeId>, IrError> {
        let prefix = &self.prefix;
        let at = prefix.len() + ".experts.".len();
        (0..self.per_rank)
            .map(|e| {
                let pname = format!("{prefix}.experts.{e}.{name}.weight");
                t.routed_param(self.ff, &pname, &shape, dim, e, self.per_rank, at)
            })
            .collect()
    }

    /// The routed experts' SwiGLU over their `rows` as grouped matmuls (`local_ids` says
    /// whose each row is); under expert parallelism the outputs travel back by `table`.
    fn routed_experts(
        &self,
        t: &mut Tracer,
        rows: NodeId,
        local_ids: NodeId,
        w: &ExpertWeights,
        table: Option<NodeId>,
    ) -> Result<NodeId, IrError> {
        let experts = self.ff;
        let grouped = |t: &mut Tracer, x: NodeId, weights: &[NodeId]| -> Result<NodeId, IrError> {
            let mut ins = vec![x, local_ids];
            ins.extend_from_slice(weights);
            t.op(
                experts,
                Op::GroupedLinear {
                    layout: WeightLayout::OutIn,
                },
                &ins,
            )
        };
        let gate = grouped(t, rows, &w.gate)?;
        let up = grouped(t, rows, &w.up)?;
        let gate = t.op(experts, self.c.activation.map_or(Op::Silu, |a| a.op()), &[gate])?;
        let hidden = t.op(experts, Op::Mul, &[gate, up])?;
        let mut down = grouped(t, hidden, &w.down)?;
        if let Some(table) = table {
            down = t.op(
                experts,
                Op::MoeCombine {
                    degree: self.ep.degree,
                    experts: self.m.experts,
                },
                &[down, table],
            )?;
        }
        Ok(down)
    }

    /// The experts' output rows scaled by their routing weights and summed back per token,
    /// `[tokens, dim]`.
    fn weigh_and_sum(&self, t: &mut Tracer, down: NodeId, routing: &Routing) -> Result<NodeId, IrError> {
        let (experts, ids) = (self.ff, routing.routed);
        let weights = t.reshape(experts, routing.weights, &[self.tokens, self.m.top_k, 1])?;
        let weights = t.op(experts, Op::MoePermute, &[weights, ids])?;
        let down = t.op(experts, Op::Mul, &[down, weights])?;
        t.op(experts, Op::MoeUnpermute { sum: true }, &[down, ids])
    }

    /// The shared expert's partial output on the experts' input `x` (split as a dense
    /// feed-forward, behind its sigmoid gate when it has one), which joins the routed one's;
    /// `None` without one. Under expert parallelism it runs while the rows travel (the
    /// compute stream does not wait for the dispatch until the routed experts read what it
    /// received).
    fn shared_expert(&self, t: &mut Tracer, x: NodeId) -> Result<Option<NodeId>, IrError> {
        let (c, m) = (self.c, self.m);
        if m.shared_experts == 0 {
            return Ok(None);
        }
        let (shared, d, n) = (self.ff, c.dim, t.tp.degree);
        let sp_name = format!("{}.shared_expert", self.prefix);
        let fs = m.shared_expert_ffn_dim;
        let col = |t: &mut Tracer, name: &str| {
            t.col_linear(
                shared,
                x,
                &format!("{sp_name}.{name}"),
                [fs, d],
                WeightLayout::OutIn,
                false,
                1,
            )
        };
        let gate = col(t, "gate_proj")?;
        let up = col(t, "up_proj")?;
        let gate = t.op(shared, c.activation.map_or(Op::Silu, |a| a.op()), &[gate])?;
        let hidden = t.op(shared, Op::Mul, &[gate, up])?;
        let down_w = t.split_param(shared, &format!("{sp_name}.down_proj.weight"), &[d, fs / n], 1, 1)?;
        let mut out = t.op(shared, LINEAR, &[hidden, down_w])?;
        if m.shared_expert_gate {
            // Its gradient meets the partial output: summed over the group.
            let g_w = t.param(shared, &format!("{}.shared_expert_gate.weight", self.prefix), &[1, d])?;
            let g_w = t.tp_summed(shared, g_w)?;
            let g = t.op(shared, LINEAR, &[x, g_w])?;
            let g = t.op(shared, Op::Sigmoid, &[g])?;
            out = t.op(shared, Op::Mul, &[g, out])?;
        }
        Ok(Some(out))
    }
}
