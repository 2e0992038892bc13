//! What the builders trace with: `Tracer`, the graph being built and the helpers every
//! builder shares, and `TensorOptions`, how the graph is split over a tensor-parallel
//! group. The builders (`llama`, `gpt2`, `mlp`) import this; the entry point (`trace`)
//! imports them and this, so nothing imports back.

use shardplan_ir::{
    ContextBalance, ContextLayout, ContextRotate, DType, ExpertSplit, Graph, IrError, ModuleKind, NodeId, Op, ScopeId,
    Shape, TensorSplit, TensorType, TpGrad, WeightLayout,
};

/// How a model is split over a tensor-parallel group (torchtitan's Llama plan): attention
/// heads and the feed-forward's hidden units column-wise then row-wise, the vocabulary
/// across the group for the embedding and the output projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorOptions {
    /// Ranks of the tensor group; 1: no tensor parallelism.
    pub degree: u64,
    /// Between blocks, activations are split along the sequence (norms run on a
    /// sequence chunk), all-gathered into attention and the feed-forward and
    /// reduce-scattered out of them; off, they are whole on every rank and the blocks'
    /// outputs all-reduced.
    pub sequence_parallel: bool,
    /// The cross-entropy runs on vocabulary-split logits; off, the logits are all-gathered
    /// first.
    pub loss_parallel: bool,
}

impl Default for TensorOptions {
    fn default() -> Self {
        TensorOptions {
            degree: 1,
            sequence_parallel: true,
            loss_parallel: true,
        }
    }
}

impl TensorOptions {
    pub fn is_parallel(&self) -> bool {
        self.degree > 1
    }
}

/// How a mixture of experts' routed experts split over an expert-parallel group
/// (torchtitan's expert parallelism): each rank holds `experts / degree` of every MoE
/// layer's experts and receives, per layer, at most `capacity` times the rows an even
/// routing would send it (`tokens * top_k`): dropless routing within that bound.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertOptions {
    /// Ranks of the expert group; 1: every rank holds every expert.
    pub degree: u64,
    /// The bound on received rows, as a factor over the even split (at least 1).
    pub capacity: f64,
    /// Token dropping (GShard): each expert takes at most this factor times its even share
    /// of a rank's assignments per layer (`ceil(f * tokens * top_k / experts)`), the rest
    /// are dropped; every shape is then exact. `None`: dropless routing.
    pub capacity_factor: Option<f64>,
    /// Trace the expert group's collectives for overlap (shardplan's runtime, which runs them
    /// on a stream of their own): the routing table's all-gather right after the top-k and
    /// the shared expert right after the dispatch, so the compute stream has work while they
    /// are in flight. `false`: in torchtitan's order (router, permutation, the table, the
    /// routed experts, the shared expert last), which `runtime: fsdp2` runs and exports.
    /// Parameters are numbered alike either way.
    pub overlap: bool,
}

impl Default for ExpertOptions {
    fn default() -> Self {
        ExpertOptions {
            degree: 1,
            capacity: 2.0,
            capacity_factor: None,
            overlap: true,
        }
    }
}

impl ExpertOptions {
    pub fn is_parallel(&self) -> bool {
        self.degree > 1
    }

    /// Under token dropping, the assignments each expert keeps of a rank's `assignments`
    /// (`tokens * top_k`) over `experts`.
    pub fn per_expert(&self, assignments: u64, experts: u64) -> Option<u64> {
        let f = self.capacity_factor?;
        let c = (f * assignments as f64 / experts.max(1) as f64).ceil();
        Some((c as u64).clamp(1, assignments.max(1)))
    }

    /// The rows one rank receives at most, of `assignments` (`tokens * top_k`) sent by
    /// each rank over `experts`: the dropless bound, or under token dropping every expert
    /// of the rank full from every rank (exact).
    pub fn rows(&self, assignments: u64, experts: u64) -> u64 {
        let bound = match self.per_expert(assignments, experts) {
            Some(c) => c.saturating_mul(experts),
            None => (assignments as f64 * self.capacity.max(1.0)).ceil() as u64,
        };
        // Never more than every rank's every row.
        bound.min(assignments.saturating_mul(self.degree)).max(1)
    }
}

/// How each sequence is split over a context-parallel group (torchtitan's `cp` axis):
/// each rank holds its rows of every sequence ([`ContextLayout`]), and attention meets
/// every rank's keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextOptions {
    /// Ranks of the context group; 1: every rank holds whole sequences.
    pub degree: u64,
    pub balance: ContextBalance,
    pub rotate: ContextRotate,
}

impl Default for ContextOptions {
    fn default() -> Self {
        ContextOptions {
            degree: 1,
            balance: ContextBalance::HeadTail,
            rotate: ContextRotate::AllGather,
        }
    }
}

impl ContextOptions {
    pub fn is_parallel(&self) -> bool {
        self.degree > 1
    }

    /// The layout of a context-parallel trace; `None` without context parallelism.
    pub fn layout(&self) -> Option<ContextLayout> {
        self.is_parallel().then_some(ContextLayout {
            degree: self.degree,
            balance: self.balance,
        })
    }

    /// Rows of a sequence of `seq` tokens each context rank holds.
    pub fn local_seq(&self, seq: u64) -> u64 {
        seq / self.degree.max(1)
    }
}

/// Small helpers shared by the builders.
pub(crate) struct Tracer {
    pub g: Graph,
    pub dtype: DType,
    /// Tensor parallelism of the graph being traced.
    pub tp: TensorOptions,
    /// Expert parallelism of the graph being traced.
    pub ep: ExpertOptions,
    /// Context parallelism of the graph being traced.
    pub cp: ContextOptions,
    /// A term added to the loss (the MoE load-balancing loss), made in the loss's scope.
    pub aux_loss: Option<(Op, Vec<NodeId>)>,
}

impl Tracer {
    pub fn scope(&mut self, parent: ScopeId, segment: &str, kind: ModuleKind) -> ScopeId {
        self.g.add_scope(parent, segment, kind)
    }

    pub fn param(&mut self, scope: ScopeId, name: &str, dims: &[u64]) -> Result<NodeId, IrError> {
        self.g.add_param(name, TensorType::new(self.dtype, dims), scope)
    }

    /// A routed expert's parameter under expert parallelism: this rank's expert `local`,
    /// named as on expert rank 0 with its number at byte `name_at` of `name`.
    pub fn expert_param(
        &mut self,
        scope: ScopeId,
        name: &str,
        dims: &[u64],
        local: u64,
        per_rank: u64,
        name_at: usize,
    ) -> Result<NodeId, IrError> {
        let split = ExpertSplit {
            local,
            per_rank,
            degree: self.ep.degree,
            name_at: name_at as u32,
        };
        self.g
            .add_expert_param(name, TensorType::new(self.dtype, dims), scope, split)
    }

    /// A routed expert's weight: under expert parallelism this rank's expert `local` of
    /// `per_rank` (named as on expert rank 0, its number at byte `name_at`), under tensor
    /// parallelism this tensor rank's slice along `dim` (`dims` are the slice's); a plain
    /// parameter with neither.
    #[allow(clippy::too_many_arguments)]
    pub fn routed_param(
        &mut self,
        scope: ScopeId,
        name: &str,
        dims: &[u64],
        dim: usize,
        local: u64,
        per_rank: u64,
        name_at: usize,
    ) -> Result<NodeId, IrError> {
        match (self.ep.is_parallel(), self.tp.is_parallel()) {
            (false, false) => self.param(scope, name, dims),
            (false, true) => self.split_param(scope, name, dims, dim, 1),
            (true, false) => self.expert_param(scope, name, dims, local, per_rank, name_at),
            (true, true) => {
                let expert = ExpertSplit {
                    local,
                    per_rank,
                    degree: self.ep.degree,
                    name_at: name_at as u32,
                };
                let tensor = TensorSplit {
                    dim,
                    parts: 1,
                    degree: self.tp.degree,
                };
                self.g
                    .add_expert_split_param(name, TensorType::new(self.dtype, dims), scope, expert, tensor)
            }
        }
    }

    /// A parameter split over the tensor group: this rank's slice (`local` dims) of the
    /// whole one, cut along `dim` in `parts` blocks; a plain parameter without tensor
    /// parallelism.
    pub fn split_param(
        &mut self,
        scope: ScopeId,
        name: &str,
        local: &[u64],
        dim: usize,
        parts: u64,
    ) -> Result<NodeId, IrError> {
        if !self.tp.is_parallel() {
            return self.param(scope, name, local);
        }
        let split = TensorSplit {
            dim,
            parts,
            degree: self.tp.degree,
        };
        self.g
            .add_split_param(name, TensorType::new(self.dtype, local), scope, split)
    }

    /// True when the trace is tensor-parallel with sequence parallelism.
    pub fn sequence_parallel(&self) -> bool {
        self.tp.is_parallel() && self.tp.sequence_parallel
    }

    /// A tensor-group op of this trace's degree.
    pub fn tp_op(&mut self, scope: ScopeId, op: impl FnOnce(u64) -> Op, x: NodeId) -> Result<NodeId, IrError> {
        let degree = self.tp.degree;
        self.g.add_node(op(degree), &[x], scope)
    }

    /// Where a block's input enters column-parallel work: gathered along the sequence
    /// (sequence parallelism) or read through `tp_copy`; `x` itself without tensor
    /// parallelism.
    pub fn tp_enter(&mut self, scope: ScopeId, x: NodeId) -> Result<NodeId, IrError> {
        if !self.tp.is_parallel() {
            Ok(x)
        } else if self.tp.sequence_parallel {
            self.tp_op(
                scope,
                |degree| Op::TpAllGather {
                    dim: 1,
                    degree,
                    grad: TpGrad::Partial,
                },
                x,
            )
        } else {
            self.tp_op(scope, |degree| Op::TpCopy { degree }, x)
        }
    }

    /// Where a row-parallel layer's partial sums leave: reduce-scattered along the sequence
    /// (sequence parallelism) or all-reduced; `x` itself without tensor parallelism.
    pub fn tp_exit(&mut self, scope: ScopeId, x: NodeId) -> Result<NodeId, IrError> {
        if !self.tp.is_parallel() {
            Ok(x)
        } else if self.tp.sequence_parallel {
            self.tp_op(scope, |degree| Op::TpReduceScatter { dim: 1, degree }, x)
        } else {
            self.tp_op(scope, |degree| Op::TpAllReduce { degree }, x)
        }
    }

    /// `x` read through `tp_copy` under any tensor parallelism (its gradient, partial on each
    /// tensor rank, summed over the group); `x` itself without.
    pub fn tp_summed(&mut self, scope: ScopeId, x: NodeId) -> Result<NodeId, IrError> {
        if self.tp.is_parallel() {
            self.tp_op(scope, |degree| Op::TpCopy { degree }, x)
        } else {
            Ok(x)
        }
    }

    /// A whole parameter read by sequence-parallel work, whose gradient each rank holds
    /// only part of: read through `tp_copy`. Otherwise the parameter itself.
    pub fn tp_replicated(&mut self, scope: ScopeId, p: NodeId) -> Result<NodeId, IrError> {
        if self.sequence_parallel() {
            self.tp_op(scope, |degree| Op::TpCopy { degree }, p)
        } else {
            Ok(p)
        }
    }

    /// A column-parallel linear layer: `shape` is the whole weight's, each tensor rank
    /// holds the output features `out / degree` (in `parts` blocks: GPT-2's fused q/k/v),
    /// and its bias likewise. Its input is whole, its output this rank's features.
    // The plain layer's arguments plus its block count: splitting them into a struct
    // would make every builder's call site longer for one extra number.
    #[allow(clippy::too_many_arguments)]
    pub fn col_linear(
        &mut self,
        scope: ScopeId,
        x: NodeId,
        prefix: &str,
        shape: [u64; 2],
        layout: WeightLayout,
        bias: bool,
        parts: u64,
    ) -> Result<NodeId, IrError> {
        if !self.tp.is_parallel() {
            return self.linear(scope, x, prefix, shape, layout, bias);
        }
        let n = self.tp.degree;
        let out_dim = match layout {
            WeightLayout::OutIn => 0,
            WeightLayout::InOut => 1,
        };
        let mut local = shape;
        local[out_dim] /= n;
        let w = self.split_param(scope, &format!("{prefix}.weight"), &local, out_dim, parts)?;
        let mut ins = vec![x, w];
        if bias {
            ins.push(self.split_param(scope, &format!("{prefix}.bias"), &[local[out_dim]], 0, parts)?);
        }
        self.op(
            scope,
            Op::Linear {
                bias,
                layout,
                float8: None,
            },
            &ins,
        )
    }

    /// A row-parallel linear layer: `shape` is the whole weight's, each tensor rank holds
    /// the input features `in / degree`; its partial sums leave through [`Tracer::tp_exit`]
    /// and the (whole) bias is added after them.
    pub fn row_linear(
        &mut self,
        scope: ScopeId,
        x: NodeId,
        prefix: &str,
        shape: [u64; 2],
        layout: WeightLayout,
        bias: bool,
    ) -> Result<NodeId, IrError> {
        if !self.tp.is_parallel() {
            return self.linear(scope, x, prefix, shape, layout, bias);
        }
        let n = self.tp.degree;
        let (in_dim, out_dim) = match layout {
            WeightLayout::OutIn => (1, 0),
            WeightLayout::InOut => (0, 1),
        };
        let mut local = shape;
        local[in_dim] /= n;
        let w = self.split_param(scope, &format!("{prefix}.weight"), &local, in_dim, 1)?;
        let b = if bias {
            Some(self.param(scope, &format!("{prefix}.bias"), &[shape[out_dim]])?)
        } else {
            None
        };
        let y = self.op(
            scope,
            Op::Linear {
                bias: false,
                layout,
                float8: None,
            },
            &[x, w],
        )?;
        let y = self.tp_exit(scope, y)?;
        match b {
            Some(b) => {
                let b = self.tp_replicated(scope, b)?;
                self.op(scope, Op::Add, &[y, b])
            }
            None => Ok(y),
        }
    }

    pub fn input(&mut self, name: &str, dtype: DType, dims: &[u64]) -> Result<NodeId, IrError> {
        let root = self.g.root();
        self.g.add_input(name, TensorType::new(dtype, dims), root)
    }

    pub fn op(&mut self, scope: ScopeId, op: Op, ins: &[NodeId]) -> Result<NodeId, IrError> {
        self.g.add_node(op, ins, scope)
    }

    /// `x @ w (+ b)`, with the weight named `{prefix}.weight` (and `{prefix}.bias`).
    pub fn linear(
        &mut self,
        scope: ScopeId,
        x: NodeId,
        prefix: &str,
        shape: [u64; 2],
        layout: WeightLayout,
        bias: bool,
    ) -> Result<NodeId, IrError> {
        let w = self.param(scope, &format!("{prefix}.weight"), &shape)?;
        let mut ins = vec![x, w];
        if bias {
            let out = match layout {
                WeightLayout::OutIn => shape[0],
                WeightLayout::InOut => shape[1],
            };
            ins.push(self.param(scope, &format!("{prefix}.bias"), &[out])?);
        }
        self.op(
            scope,
            Op::Linear {
                bias,
                layout,
                float8: None,
            },
            &ins,
        )
    }

    pub fn reshape(&mut self, scope: ScopeId, x: NodeId, dims: &[u64]) -> Result<NodeId, IrError> {
        self.op(
            scope,
            Op::Reshape {
                shape: Shape::new(dims),
            },
            &[x],
        )
    }

    /// Flattens logits to `[n, classes]`, casts them to f32 and takes the mean
    /// cross-entropy against the `targets` input; marks the loss as the graph output.
    pub fn loss(&mut self, logits: NodeId, targets: NodeId) -> Result<NodeId, IrError> {
        self.loss_split(logits, targets, None)
    }

    /// As [`Tracer::loss`]; with `vocab_parallel: Some(degree)` the logits are this tensor
    /// rank's vocabulary chunk and the loss is `vocab_cross_entropy`.
    pub fn loss_split(
        &mut self,
        logits: NodeId,
        targets: NodeId,
        vocab_parallel: Option<u64>,
    ) -> Result<NodeId, IrError> {
        let root = self.g.root();
        let scope = self.scope(root, "loss", ModuleKind::Loss);
        let ty = self.g.node(logits).ty.clone();
        let classes = ty.shape.last().unwrap_or(1);
        let rows = ty.numel().unwrap_or(0) / classes.max(1);
        let mut flat = self.reshape(scope, logits, &[rows, classes])?;
        if ty.dtype != DType::F32 {
            flat = self.op(scope, Op::Cast { dtype: DType::F32 }, &[flat])?;
        }
        let op = match vocab_parallel {
            Some(degree) => Op::VocabCrossEntropy { degree },
            None => Op::CrossEntropy,
        };
        let mut loss = self.op(scope, op, &[flat, targets])?;
        if let Some((op, ins)) = self.aux_loss.take() {
            let aux = self.op(scope, op, &ins)?;
            loss = self.op(scope, Op::Add, &[loss, aux])?;
        }
        self.g.add_output(loss);
        Ok(loss)
    }
}
