//! The cost model: how long each instruction takes on a hardware profile.
//!
//! Every constant is a field of [`HardwareProfile`] (documented there with its source) and
//! can be overridden in the parallel spec; nothing is hidden here.
//!
//! - **Matmuls** (linear layers, their input and weight gradients, batched matmuls): FLOPs
//!   at `peak x matmul_efficiency`, times the fraction of the GPU's tile slots the shape
//!   fills: the `M x N` output is cut into `matmul_tile_m x matmul_tile_n` tiles that run in
//!   waves of `sm_count`, and a last, partly filled wave or a partly filled edge tile costs
//!   a full one (tile and wave quantisation).
//! - **Attention** runs as flash attention: FLOPs at `peak x attention_fwd_efficiency`
//!   (the forward, and its recomputation) or `attention_bwd_efficiency` (the five parts of
//!   the backward), counting only the `attention_block`-square blocks a causal mask leaves.
//!   The `[b, h, s, t]` probabilities the graph names in backward are never in memory.
//! - **Everything else is memory-bound**: the bytes it reads and writes at
//!   `hbm_gbps x memory_efficiency`. Under `kernels: eager` (PyTorch eager, how FSDP2 runs
//!   torchtitan's Llama) RMSNorm, rotary embeddings and the cross-entropy run as several
//!   kernels through f32 temporaries, and move [`eager_traffic`]'s multiple of the fused
//!   op's bytes.
//! - **Launches**: under `kernels: eager` every kernel takes at least `kernel_launch_us`
//!   (launches are asynchronous and hide behind longer work); under `kernels: fused` each
//!   op's `kernel_launch_us` adds to its work (shardplan's executor runs one op at a time).
//! - **Collectives**: a ring, alpha-beta, at `collective_efficiency` of the link rate. With
//!   `n` ranks and `B` bytes in the full buffer, an all-gather or reduce-scatter takes
//!   `(n-1) (alpha + B/n / bw)`, an all-reduce twice that or, when faster, a double
//!   binary tree's `2 (log2(n) alpha + B / bw)`. A group within one node uses
//!   NVLink. A group across nodes runs one ring per GPU of a node, each leaving the node
//!   through its own GPU's NIC (NCCL's rail-aligned rings), so its bandwidth is the lesser
//!   of NVLink's and `inter_node_gbps` times the group's ranks per node, at the network's
//!   latency.
//! - **Overlap**: compute that runs while a collective does is `overlap_slowdown` slower
//!   for the overlapped part (NCCL's kernels hold SMs); see [`crate::simulate::timeline`].
//! - Host copies move bytes at `host_link_gbps`; device-to-device copies read and write at
//!   HBM speed; the gradient norm and the optimizer step stream their operands at HBM
//!   speed, or at `host_mem_gbps` when they run on the host (CPU offload).
//! - **shardplan's CPU executor** (`kernels: fused`, a profile from `shardplan calibrate`):
//!   ops it splits over its thread pool ([`forks`]) pay `parallel_launch_us`; a compute step
//!   copies its gradients (and, with shards, its parameters) on its own thread at
//!   `copy_gbps` ([`compute_copies`]).

use crate::compiled::Compiled;
use crate::mesh::Mesh;
use crate::plan::{Breakdown, Buffer, Comm, Instr, Pool, Stream, WorkKind};
use crate::steps::Step;
use shardplan_frontends::{Compile, HardwareProfile, KernelMode, ParallelConfig};
use shardplan_ir::{DType, Graph, NodeId, NormWrt, Op};

/// Every node's [`OpModel::seconds`] with its parts ([`OpModel::parts`]), costed once per
/// graph, hardware and compute dtype: the steps of every grouping and checkpointing policy
/// of a search read them instead of costing each op again.
pub(crate) struct NodeTimes(Vec<(f64, WorkKind, f64, f64)>);

impl NodeTimes {
    pub(crate) fn new(g: &Graph, hw: &HardwareProfile, compute_dtype: DType, compile: Compile) -> Self {
        let model = OpModel::new(g, hw, compute_dtype).compiled(compile);
        NodeTimes((0..g.node_count()).map(|i| model.timed(NodeId(i as u32))).collect())
    }

    fn get(&self, id: NodeId) -> (f64, WorkKind, f64, f64) {
        self.0
            .get(id.index())
            .copied()
            .unwrap_or((0.0, WorkKind::Elementwise, 0.0, 0.0))
    }
}

/// Seconds to run each step (segment) once (the sum of its ops' [`OpModel::seconds`]), and
/// the same seconds by kind of work, each op's time split into its work and the launches it
/// does not hide ([`OpModel::parts`]). `unit_host_s[g]` is a framework's host time per step
/// for FSDP unit `g` that the device waits for ([`unit_host_seconds`]): half of it before
/// each unit's first forward step, half before its first backward step, where FSDP2's
/// pre-forward and pre-backward hooks run (the post hooks' time lands in the same gaps).
pub(crate) fn step_costs(times: &NodeTimes, steps: &[Step], unit_host_s: &[f64]) -> (Vec<f64>, Vec<Breakdown>) {
    let mut hooked = std::collections::HashSet::new();
    steps
        .iter()
        .map(|s| {
            let mut total = 0.0;
            let mut b = Breakdown::default();
            let unit_host_s = unit_host_s.get(s.group.index()).copied().unwrap_or(0.0);
            if unit_host_s > 0.0 && s.phase != crate::steps::Phase::Recompute && hooked.insert((s.group, s.phase)) {
                total += unit_host_s / 2.0;
                b.add(WorkKind::Hooks, unit_host_s / 2.0);
            }
            for i in s.nodes.iter().flat_map(|r| r.clone()) {
                let (seconds, kind, work, launch) = times.get(NodeId(i));
                total += seconds;
                b.add(kind, work);
                b.add(WorkKind::Launch, launch);
            }
            (total, b)
        })
        .unzip()
}

/// Host time per step of each FSDP unit of `groups` that the device waits for: PyTorch
/// FSDP2's (`runtime: fsdp2`), `fsdp2_unit_host_us` per unit, or
/// `fsdp2_compiled_unit_host_us` for a unit inside a compiled block (`compile.model`);
/// none under shardplan's runtime.
pub(crate) fn unit_host_seconds(g: &Graph, groups: &[crate::group::FsdpGroup], config: &ParallelConfig) -> Vec<f64> {
    if config.runtime.is_shardplan() {
        return vec![0.0; groups.len()];
    }
    let hw = &config.hardware;
    groups
        .iter()
        .map(|grp| {
            let compiled = !grp.is_root()
                && grp
                    .scopes
                    .iter()
                    .all(|&s| crate::compiled::compiled_block(g, s, config.compile).is_some());
            let us = if compiled {
                hw.fsdp2_compiled_unit_host_us
            } else {
                hw.fsdp2_unit_host_us
            };
            us * 1e-6
        })
        .collect()
}

/// Records each step's tensor-, expert- and context-parallel collectives
/// ([`crate::steps::TensorOp`]) with where they fall in the step by [`OpModel::seconds`];
/// nothing without them.
pub(crate) fn annotate_tensor_ops(g: &Graph, times: &NodeTimes, steps: &mut [Step]) {
    if g.tensor_degree() <= 1 && g.expert_degree() <= 1 && g.context_degree() <= 1 {
        return;
    }
    for s in steps {
        let mut at = 0.0;
        for i in s.nodes.iter().flat_map(|r| r.clone()) {
            let id = NodeId(i);
            let dur = times.get(id).0;
            let node = g.node(id);
            if let Some(op) = crate::steps::StepCollective::of(&node.op) {
                let bytes = match node.op {
                    Op::TpAllGather { .. }
                    | Op::MoeGatherIds { .. }
                    | Op::MoeDispatch { .. }
                    | Op::CpAllGather { .. } => node.ty.bytes(),
                    // The gradients travel in f32.
                    Op::CpReduceScatter { .. } => g.node(node.inputs[0]).ty.numel().map(|n| n * 4),
                    Op::VocabCrossEntropy { degree } | Op::VocabCrossEntropyGrad { degree } => {
                        // Row maxima gathered, exponential sums and target logits reduced.
                        let rows = g.node(node.inputs[0]).ty.shape.dims().first().copied().unwrap_or(0);
                        Some(rows * 4 * degree + rows * 8)
                    }
                    _ => g.node(node.inputs[0]).ty.bytes(),
                }
                .unwrap_or(u64::MAX);
                s.tensor_ops.push(crate::steps::TensorOp {
                    node: id,
                    op,
                    bytes,
                    at_s: at,
                    dur_s: dur,
                });
            }
            at += dur;
        }
    }
}

/// The kind of work `op` is, for the estimate's breakdown.
pub(crate) fn work_kind(op: &Op) -> WorkKind {
    match op {
        Op::Linear { .. }
        | Op::MatMul
        | Op::WeightGrad { .. }
        | Op::GroupedLinear { .. }
        | Op::GroupedWeightGrad { .. } => WorkKind::Matmul,
        Op::Attention { .. }
        | Op::AttnProbs { .. }
        | Op::AttnGradV { .. }
        | Op::AttnGradScores
        | Op::AttnGradQ
        | Op::AttnGradK { .. } => WorkKind::Attention,
        Op::RmsNorm { .. } | Op::LayerNorm { .. } | Op::RmsNormGrad { .. } | Op::LayerNormGrad { .. } => WorkKind::Norm,
        Op::Rope { .. } | Op::RopeGrad { .. } => WorkKind::Rotary,
        Op::Embedding | Op::EmbeddingGrad { .. } | Op::VocabEmbedding { .. } | Op::VocabEmbeddingGrad { .. } => {
            WorkKind::Embedding
        }
        Op::CrossEntropy | Op::CrossEntropyGrad | Op::VocabCrossEntropy { .. } | Op::VocabCrossEntropyGrad { .. } => {
            WorkKind::CrossEntropy
        }
        Op::TpAllGather { .. } | Op::TpReduceScatter { .. } | Op::TpAllReduce { .. } => WorkKind::TensorComm,
        Op::MoeGatherIds { .. } | Op::MoeDispatch { .. } | Op::MoeCombine { .. } => WorkKind::ExpertComm,
        Op::CpAllGather { .. } | Op::CpReduceScatter { .. } => WorkKind::ContextComm,
        Op::MoeLocalIds { .. } | Op::MoeDrop { .. } => WorkKind::Layout,
        Op::Float8Cast { .. } => WorkKind::Float8Casts,
        Op::Add
        | Op::Mul
        | Op::Silu
        | Op::SiluGrad
        | Op::Gelu
        | Op::GeluGrad
        | Op::GeluErf
        | Op::GeluErfGrad
        | Op::Relu
        | Op::ReluGrad
        | Op::Sigmoid
        | Op::SigmoidGrad
        | Op::Softmax { .. }
        | Op::SoftmaxGrad { .. }
        | Op::MoeTopK { .. }
        | Op::MoeRouterWeights { .. }
        | Op::MoeRouterWeightsGrad { .. }
        | Op::MoeAuxLoss { .. }
        | Op::MoeAuxLossGrad { .. } => WorkKind::Elementwise,
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Narrow { .. }
        | Op::Concat { .. }
        | Op::Cast { .. }
        | Op::Sum
        | Op::Fill { .. }
        | Op::SumTo { .. }
        | Op::BroadcastTo { .. }
        | Op::Pad { .. }
        | Op::TpCopy { .. }
        | Op::TpSlice { .. }
        | Op::MoePermute
        | Op::MoeUnpermute { .. } => WorkKind::Layout,
    }
}

/// Kernels and the multiple of its fused bytes that an op moves in PyTorch eager mode, as
/// torchtitan's Llama modules decompose it (bf16 activations; bytes per element):
/// - RMSNorm `(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * w`: 7
///   kernels, 38 bytes against the fused op's 4;
/// - its autograd backward: to the input about 8 kernels, 58 bytes against 6; to the
///   weight a product and a sum over tokens, 2 kernels, 8 bytes against 4;
/// - rotary embedding through `view_as_complex(x.float())`: 3 kernels (cast, complex
///   multiply, cast back), 20 bytes against 4, forward and backward alike;
/// - cross-entropy (the graph casts the logits to f32 in a node of its own): log-softmax and
///   NLL, 2 kernels, 8 bytes against 4; its backward 2 kernels, 16 against 8.
///
/// Every other op is one kernel moving what the graph counts.
pub(crate) fn eager_traffic(op: &Op) -> (f64, f64) {
    match op {
        Op::RmsNorm { .. } => (7.0, 38.0 / 4.0),
        Op::RmsNormGrad {
            wrt: NormWrt::Input, ..
        } => (8.0, 58.0 / 6.0),
        Op::RmsNormGrad {
            wrt: NormWrt::Weight, ..
        } => (2.0, 2.0),
        Op::Rope { .. } | Op::RopeGrad { .. } => (3.0, 5.0),
        Op::CrossEntropy | Op::CrossEntropyGrad | Op::VocabCrossEntropy { .. } | Op::VocabCrossEntropyGrad { .. } => {
            (2.0, 2.0)
        }
        _ => (1.0, 1.0),
    }
}

/// Output elements from which shardplan's CPU executor splits an elementwise or row-wise
/// kernel across its thread pool (below it, one thread runs it).
pub const PARALLEL_MIN_ELEMS: u64 = 1 << 14;

/// Whether shardplan's executor (`kernels: fused`) runs `op`, with `numel` output elements,
/// on its thread pool, paying `parallel_launch_us` to start it: attention and its backward
/// parts, RMSNorm and LayerNorm, rotary embeddings and RMSNorm's weight gradient always;
/// elementwise ops, activations, RMSNorm's input gradient and the cross-entropy from
/// [`PARALLEL_MIN_ELEMS`] output elements (the cross-entropy's from its logits'). Matmuls
/// are gemm's own business: their rate, tiles included, is measured whole.
pub fn forks(op: &Op, numel: Option<u64>) -> bool {
    let big = numel.is_some_and(|n| n >= PARALLEL_MIN_ELEMS);
    match op {
        Op::Attention { .. }
        | Op::AttnProbs { .. }
        | Op::AttnGradV { .. }
        | Op::AttnGradScores
        | Op::AttnGradQ
        | Op::AttnGradK { .. }
        | Op::RmsNorm { .. }
        | Op::LayerNorm { .. }
        | Op::Rope { .. }
        | Op::RopeGrad { .. }
        | Op::RmsNormGrad {
            wrt: NormWrt::Weight, ..
        } => true,
        // The loss is a scalar; its kernel splits by the logits' rows.
        Op::CrossEntropy | Op::VocabCrossEntropy { .. } => true,
        Op::Add
        | Op::Mul
        | Op::Silu
        | Op::SiluGrad
        | Op::Gelu
        | Op::GeluGrad
        | Op::GeluErfGrad
        | Op::CrossEntropyGrad
        | Op::VocabCrossEntropyGrad { .. }
        | Op::RmsNormGrad { .. } => big,
        _ => false,
    }
}

/// The per-op cost model of one graph on one profile.
pub struct OpModel<'a> {
    g: &'a Graph,
    hw: &'a HardwareProfile,
    peak: f64,
    bw: f64,
    launch: f64,
    /// Whether the model's attention is causal (the backward parts do not say).
    causal: bool,
    /// The layout of a context-parallel graph's rows (the backward parts do not say).
    context: Option<shardplan_ir::ContextLayout>,
    /// What torch.compile runs, and fuses, of the graph (nothing by default).
    compiled: Compiled,
}

impl<'a> OpModel<'a> {
    pub fn new(g: &'a Graph, hw: &'a HardwareProfile, compute_dtype: DType) -> Self {
        let peak = if compute_dtype == DType::F32 || compute_dtype == DType::F64 {
            hw.f32_tflops
        } else {
            hw.bf16_tflops
        } * 1e12;
        let causal = g
            .nodes()
            .any(|(_, n)| matches!(n.op, Op::Attention { causal: true, .. }));
        OpModel {
            g,
            hw,
            peak,
            bw: hw.hbm_gbps * 1e9 * hw.memory_efficiency,
            launch: hw.kernel_launch_us * 1e-6,
            causal,
            context: g.context_layout(),
            compiled: Compiled::default(),
        }
    }

    /// This model with the blocks and loss `compile` names compiled.
    pub fn compiled(mut self, compile: Compile) -> Self {
        self.compiled = Compiled::new(self.g, compile);
        self
    }

    /// Seconds of one node.
    pub fn seconds(&self, id: NodeId) -> f64 {
        let t = self.launched_seconds(id).0;
        t + self.pool_start(id, t)
    }

    /// One node's seconds in parts: its kind, the time its work takes, and the time its
    /// launches add beyond the work (which [`OpModel::seconds`] sums with it).
    pub fn parts(&self, id: NodeId) -> (WorkKind, f64, f64) {
        let (_, kind, work, launch) = self.timed(id);
        (kind, work, launch)
    }

    /// [`OpModel::seconds`] and [`OpModel::parts`] of one node at once.
    fn timed(&self, id: NodeId) -> (f64, WorkKind, f64, f64) {
        let (t, work) = self.launched_seconds(id);
        let start = self.pool_start(id, t);
        let work = work.min(t);
        (t + start, work_kind(&self.g.node(id).op), work, t - work + start)
    }

    /// The thread pool's start for a node that takes `t` seconds (`kernels: fused`).
    fn pool_start(&self, id: NodeId, t: f64) -> f64 {
        if t > 0.0 && self.hw.kernels == KernelMode::Fused && forks(&self.g.node(id).op, self.g.node(id).ty.numel()) {
            self.hw.parallel_launch_us * 1e-6
        } else {
            0.0
        }
    }

    /// Seconds of one node without the thread pool's start, with its launches and without.
    fn launched_seconds(&self, id: NodeId) -> (f64, f64) {
        let node = self.g.node(id);
        let cost = self.g.node_cost(id);
        let (flops, bytes) = (cost.fwd_flops as f64, cost.fwd_bytes as f64);
        let dims = |i: usize| self.g.node(node.inputs[i]).ty.shape.dims();
        let out = node.ty.shape.dims();
        let numel = |d: &[u64]| d.iter().map(|&x| x as f64).product::<f64>();
        match &node.op {
            Op::Input { .. } | Op::Param { .. } | Op::Reshape { .. } | Op::TpCopy { .. } => (0.0, 0.0),
            Op::TpAllGather { degree, .. } | Op::TpReduceScatter { degree, .. } | Op::TpAllReduce { degree } => {
                // A ring over the tensor group, inside one node (the spec keeps it there);
                // the full buffer is the gathered output or the reduced input.
                let full = match node.op {
                    Op::TpAllGather { .. } if self.gathers_float8(id) => node.ty.numel(),
                    Op::TpAllGather { .. } => node.ty.bytes(),
                    _ => self.g.node(node.inputs[0]).ty.bytes(),
                }
                .unwrap_or(u64::MAX);
                let all_reduce = matches!(node.op, Op::TpAllReduce { .. });
                self.launched(ring_seconds(*degree, full, self.tensor_link(), all_reduce), 1.0)
            }
            // Expert parallelism's exchanges, inside a node (consecutive shards): the
            // routing table all-gathered, the rows sent out and back (each rank keeps
            // `1 / degree` of what it sends at the even split; the buffer is sized at the
            // capacity bound, which the time follows).
            Op::MoeGatherIds { degree } => self.launched(
                ring_seconds(*degree, node.ty.bytes().unwrap_or(u64::MAX), self.tensor_link(), false),
                1.0,
            ),
            Op::MoeDispatch { degree, .. } | Op::MoeCombine { degree, .. } => {
                let moved = match node.op {
                    Op::MoeDispatch { .. } => node.ty.bytes(),
                    _ => self.g.node(node.inputs[0]).ty.bytes(),
                }
                .unwrap_or(u64::MAX) as f64;
                let (bw, alpha) = self.tensor_link();
                let d = *degree as f64;
                let t = (d - 1.0) * alpha + moved * (d - 1.0) / d / bw;
                self.launched(t + 2.0 * moved / self.bw, 2.0)
            }
            Op::VocabCrossEntropy { degree } | Op::VocabCrossEntropyGrad { degree } => {
                // The local log-softmax's traffic, plus the row maxima all-gathered and the
                // exponential sums with the target logits all-reduced over the group
                // (f32, one of each per row).
                let rows = dims(0)[0];
                let (kernels, factor) = match self.hw.kernels {
                    KernelMode::Eager => eager_traffic(&node.op),
                    KernelMode::Fused => (1.0, 1.0),
                };
                let local = (bytes * factor / self.bw).max(flops / self.peak);
                let link = self.tensor_link();
                let comm =
                    ring_seconds(*degree, rows * 4 * degree, link, false) + ring_seconds(*degree, rows * 8, link, true);
                self.launched(local + comm, kernels + 2.0)
            }
            Op::Linear { .. } | Op::MatMul | Op::WeightGrad { .. } => {
                // The output's last two dims are the tiled M x N; leading dims batch.
                let (m, n) = match out.len() {
                    0 => (1.0, 1.0),
                    1 => (1.0, out[0] as f64),
                    r => match node.op {
                        Op::Linear { .. } => (numel(&out[..r - 1]), out[r - 1] as f64),
                        _ => (out[r - 2] as f64, out[r - 1] as f64),
                    },
                };
                let batch = (numel(out) / (m * n)).max(1.0);
                let fill = self.tile_fill(m, n, batch);
                let t = flops / (self.gemm_peak(id) * self.hw.matmul_efficiency * fill);
                let (mut t, mut kernels) = (t.max(bytes / self.bw), 1.0);
                if let Op::Linear { float8: Some(_), .. } = node.op {
                    // The forward's casts of the input and the weight, before the GEMM.
                    for &i in &node.inputs[..2] {
                        let (s, k) = self.float8_cast_seconds(id, i);
                        t += s;
                        kernels += k;
                    }
                }
                self.launched(t, kernels)
            }
            Op::Float8Cast { .. } => {
                let (s, k) = self.float8_cast_seconds(id, node.inputs[0]);
                self.launched(s, k)
            }
            // One grouped GEMM over the experts: each expert's `T * k / E` rows (the even
            // split) by its weight, the experts' tiles sharing the waves.
            Op::GroupedLinear { .. } => {
                let experts = (node.inputs.len() - 2).max(1) as f64;
                let rows = dims(0)[0] as f64 / experts;
                let n = out.last().copied().unwrap_or(1) as f64;
                let fill = self.tile_fill(rows.max(1.0), n, experts);
                let t = flops / (self.peak * self.hw.matmul_efficiency * fill);
                self.launched(t.max(bytes / self.bw), 1.0)
            }
            Op::GroupedWeightGrad { .. } => {
                let fill = self.tile_fill(out[0] as f64, out[1] as f64, 1.0);
                let t = flops / (self.peak * self.hw.matmul_efficiency * fill);
                self.launched(t.max(bytes / self.bw), 1.0)
            }
            Op::Attention { causal, .. } => {
                let q = dims(0);
                let t = dims(1)[1];
                let f = flops * self.kept(q[1], t, *causal);
                self.launched(f / (self.peak * self.hw.attention_fwd_efficiency), 1.0)
            }
            Op::AttnProbs { causal, .. } => {
                let q = dims(0);
                let t = dims(1)[1];
                let f = flops * self.kept(q[1], t, *causal);
                self.launched(f / (self.peak * self.hw.attention_bwd_efficiency), 1.0)
            }
            Op::CpAllGather { layout, rotate } | Op::CpReduceScatter { layout, rotate } => {
                let full = match node.op {
                    Op::CpAllGather { .. } => node.ty.bytes(),
                    // The gradients travel in f32.
                    _ => self.g.node(node.inputs[0]).ty.numel().map(|n| n * 4),
                }
                .unwrap_or(u64::MAX);
                // Inside a node, as the expert group's consecutive shards.
                let t = context_ring_seconds(self.tensor_link(), layout.degree, full, *rotate);
                // The gather's rows put in position order, the reduction's arriving sums.
                self.launched(t + 2.0 * full as f64 / self.bw, 2.0)
            }
            Op::AttnGradV { .. } | Op::AttnGradScores | Op::AttnGradQ | Op::AttnGradK { .. } => {
                // Operand 0 is the [b, h, s, t] probabilities or their gradient.
                let p = dims(0);
                let f = flops * self.kept(p[2], p[3], self.causal);
                // Fused into flash attention's backward kernel under eager PyTorch; in
                // shardplan's executor one of the five kernels its blockwise backward runs
                // (`ExecOrder::blockwise_attention`), each with its launch.
                let t = f / (self.peak * self.hw.attention_bwd_efficiency);
                match self.hw.kernels {
                    KernelMode::Eager => (t, t),
                    KernelMode::Fused => self.launched(t, 1.0),
                }
            }
            _ if self.compiled.compiled(id) => self.inductor_seconds(id, bytes, flops),
            op => {
                let (kernels, factor) = match self.hw.kernels {
                    KernelMode::Eager => eager_traffic(op),
                    KernelMode::Fused => (1.0, 1.0),
                };
                self.launched((bytes * factor / self.bw).max(flops / self.peak), kernels)
            }
        }
    }

    /// A memory-bound node of a compiled region ([`crate::compiled`]): its bytes without
    /// the values fused away (its own, when it is computed inside its readers' kernel, and
    /// those of its fused operands), in one kernel of its own unless it is fused.
    fn inductor_seconds(&self, id: NodeId, bytes: f64, flops: f64) -> (f64, f64) {
        let node = self.g.node(id);
        let value = |v: NodeId| self.g.node(v).ty.bytes().unwrap_or(0) as f64;
        let fused_in: f64 = node
            .inputs
            .iter()
            .filter(|&&i| self.compiled.fused(i))
            .map(|&i| value(i))
            .sum();
        let own = if self.compiled.fused(id) { value(id) } else { 0.0 };
        let moved = (bytes - fused_in - own).max(0.0);
        let kernels = if self.compiled.fused(id) { 0.0 } else { 1.0 };
        self.launched((moved / self.bw).max(flops / self.peak), kernels)
    }

    /// Bandwidth and latency of a tensor group's ring: NVLink, inside one node.
    fn tensor_link(&self) -> (f64, f64) {
        (
            self.hw.intra_node_gbps * 1e9 * self.hw.collective_efficiency,
            self.hw.intra_node_latency_us * 1e-6,
        )
    }

    /// `work` seconds of `kernels` kernels with their launch cost: eager PyTorch launches
    /// asynchronously, so a kernel takes at least the launch time and longer work hides it;
    /// shardplan's executor runs each op to completion before the next, so the cost adds.
    /// Returns the op's seconds and, of them, its work's.
    fn launched(&self, work: f64, kernels: f64) -> (f64, f64) {
        let t = match self.hw.kernels {
            KernelMode::Eager => work.max(kernels * self.launch),
            KernelMode::Fused => work + kernels * self.launch,
        };
        (t, work)
    }

    /// Whether the tensor all-gather `id` moves float8: torchao's Float8 TP styles cast a
    /// sequence-parallel activation before gathering it when every reader is a tensorwise
    /// Float8 linear in the forward (one byte an element; rowwise recipes gather in high
    /// precision).
    fn gathers_float8(&self, id: NodeId) -> bool {
        let users: Vec<NodeId> = self
            .g
            .users(id)
            .into_iter()
            .filter(|&u| !self.g.node(u).is_backward())
            .collect();
        !users.is_empty()
            && users.iter().all(|&u| {
                matches!(
                    self.g.node(u).op,
                    Op::Linear {
                        float8: Some(shardplan_ir::Float8Recipe::Tensorwise),
                        ..
                    }
                )
            })
    }

    /// The peak FLOP/s of matmul `id`: the float8 tensor cores' for a Float8 linear's
    /// forward and for a backward product of two float8-cast operands (rowwise with a high
    /// precision weight gradient keeps that one in bf16), else the compute dtype's.
    fn gemm_peak(&self, id: NodeId) -> f64 {
        let node = self.g.node(id);
        let cast = |i: &NodeId| matches!(self.g.node(*i).op, Op::Float8Cast { .. });
        let float8 = match node.op {
            Op::Linear { float8: Some(_), .. } => true,
            Op::Linear { .. } | Op::WeightGrad { .. } => node.inputs.len() >= 2 && node.inputs[..2].iter().all(cast),
            _ => false,
        };
        if float8 && self.hw.fp8_tflops > 0.0 {
            self.hw.fp8_tflops * 1e12
        } else {
            self.peak
        }
    }

    /// Seconds and kernels of torchao's cast of the value `x` for node `id`'s Float8 matmul:
    /// the amax (a reduction over `x`), the scale, and the scaled, clamped cast writing one
    /// byte an element. Eager PyTorch runs it as about 9 kernels (abs, max, the scale's
    /// arithmetic, multiply, clamp, convert) moving `x` 6 times; inductor as 2 (the
    /// reduction, then one fused cast), moving it twice.
    fn float8_cast_seconds(&self, id: NodeId, x: NodeId) -> (f64, f64) {
        let v = &self.g.node(x).ty;
        let (read, numel) = (
            v.bytes().unwrap_or(u64::MAX) as f64,
            v.numel().unwrap_or(u64::MAX) as f64,
        );
        let (kernels, passes) = if self.compiled.compiled(id) {
            (2.0, 2.0)
        } else {
            match self.hw.kernels {
                KernelMode::Eager => (9.0, 6.0),
                KernelMode::Fused => (1.0, 6.0),
            }
        };
        ((passes * read + numel) / self.bw, kernels)
    }

    /// The fraction of tile slots an `m x n` output (`batch` of them) fills.
    fn tile_fill(&self, m: f64, n: f64, batch: f64) -> f64 {
        let (tm, tn) = (self.hw.matmul_tile_m.max(1.0), self.hw.matmul_tile_n.max(1.0));
        let sms = self.hw.sm_count.max(1.0);
        let tiles = batch * (m / tm).ceil() * (n / tn).ceil();
        let waves = (tiles / sms).ceil().max(1.0);
        (batch * m * n / (waves * sms * tm * tn)).clamp(1e-6, 1.0)
    }

    /// The fraction of an `s x t` score matrix's blocks that flash attention computes; in
    /// a context-parallel graph, the share of its rank's pairs that the busiest rank of
    /// the group computes (the others wait for it at the next collective).
    fn kept(&self, s: u64, t: u64, causal: bool) -> f64 {
        if !causal || s == 0 || t == 0 {
            return 1.0;
        }
        if let Some(layout) = self.context {
            let whole = t as f64;
            let share = layout.worst_causal_share(s);
            return (share * whole * (whole + 1.0) / 2.0 / (s as f64 * whole)).min(1.0);
        }
        let b = self.hw.attention_block.max(1.0);
        let (nq, nk) = ((s as f64 / b).ceil(), (t as f64 / b).ceil());
        // Query block i (aligned to the end of the keys) sees key blocks up to its diagonal.
        let offset = nk - nq;
        let mut kept = 0.0;
        let mut i = 0.0;
        while i < nq {
            kept += (i + 1.0 + offset).clamp(0.0, nk);
            i += 1.0;
        }
        kept / (nq * nk)
    }
}

/// True when every instance of `comm` (one per rank) lies within one node. Members of a
/// shard group are `tensor` ranks apart, of a replicate group `shard x tensor`.
pub fn intra_node(mesh: &Mesh, comm: Comm) -> bool {
    let g = mesh.gpus_per_node();
    let t = mesh.tensor().max(1);
    let node = |r: u64| r / g;
    match comm {
        Comm::Shard | Comm::Reshard(_) => {
            let size = match comm {
                Comm::Reshard(n) => n,
                _ => mesh.shard(),
            }
            .max(1);
            // Groups start at `k * size * t + i` (i < t); their placement repeats every `g`
            // groups.
            let groups = mesh.world() / (size * t);
            (0..groups.min(g)).all(|k| {
                (0..t).all(|i| {
                    let first = k * size * t + i;
                    node(first) == node(first + (size - 1) * t)
                })
            })
        }
        // The spec keeps a tensor group inside a node.
        Comm::Tensor => true,
        // Consecutive shards, as a reshard group of `expert` (or `context`).
        Comm::Expert => intra_node(mesh, Comm::Reshard(mesh.expert())),
        Comm::Context => intra_node(mesh, Comm::Reshard(mesh.context())),
        // Every `expert`-th shard: inside a node only if the whole shard group is.
        Comm::ExpertShard => mesh.expert_shard() <= 1 || intra_node(mesh, Comm::Shard),
        Comm::Replicate => {
            let stride = mesh.shard() * t;
            let last = (mesh.replicate() - 1) * stride;
            (0..stride.min(g)).all(|s| node(s) == node(s + last))
        }
    }
}

/// Seconds of a context group of `degree` ranks exchanging a whole sequence's keys or
/// values (`bytes`, every rank's rows): one ring all-gather or reduce-scatter
/// (`allgather`), or `degree - 1` steps each passing one rank's rows to the next rank
/// (`alltoall`, torch's ring rotation).
pub(crate) fn context_ring_seconds(
    link: (f64, f64),
    degree: u64,
    bytes: u64,
    rotate: shardplan_ir::ContextRotate,
) -> f64 {
    match rotate {
        shardplan_ir::ContextRotate::AllGather => ring_seconds(degree, bytes, link, false),
        shardplan_ir::ContextRotate::AllToAll => {
            let (bw, alpha) = link;
            let steps = degree.saturating_sub(1) as f64;
            steps * (alpha + bytes as f64 / degree.max(1) as f64 / bw)
        }
    }
}

/// Bandwidth (bytes/s) and per-hop latency (s) of `comm`'s ring: NVLink within a node;
/// across nodes, one ring per GPU of the group on a node, each through its own NIC.
pub(crate) fn link(mesh: &Mesh, comm: Comm, hw: &HardwareProfile) -> (f64, f64) {
    let eff = hw.collective_efficiency;
    if intra_node(mesh, comm) {
        (hw.intra_node_gbps * 1e9 * eff, hw.intra_node_latency_us * 1e-6)
    } else {
        let rails = ranks_per_node(mesh, comm) as f64;
        let bw = hw.intra_node_gbps.min(hw.inter_node_gbps * rails);
        (bw * 1e9 * eff, hw.inter_node_latency_us * 1e-6)
    }
}

/// How many ranks of one group of `comm` share a node.
pub(crate) fn ranks_per_node(mesh: &Mesh, comm: Comm) -> u64 {
    let g = mesh.gpus_per_node().max(1);
    match comm {
        Comm::Shard | Comm::Reshard(_) => {
            let size = match comm {
                Comm::Reshard(n) => n,
                _ => mesh.shard(),
            };
            // Members are `tensor` ranks apart.
            (g / mesh.tensor().max(1)).clamp(1, size.max(1))
        }
        Comm::Tensor => mesh.tensor().clamp(1, g),
        Comm::Expert => (g / mesh.tensor().max(1)).clamp(1, mesh.expert().max(1)),
        Comm::Context => (g / mesh.tensor().max(1)).clamp(1, mesh.context().max(1)),
        // Members are `expert x tensor` ranks apart.
        Comm::ExpertShard => (g / (mesh.expert() * mesh.tensor()).max(1)).clamp(1, mesh.expert_shard().max(1)),
        // Replicas are `shard x tensor` ranks apart.
        Comm::Replicate => (g / (mesh.shard() * mesh.tensor()).max(1)).clamp(1, mesh.replicate().max(1)),
    }
}

/// Seconds of a collective moving `bytes` (the full buffer) over `n` ranks: a ring for
/// all-gather and reduce-scatter; for all-reduce the faster of a ring (a reduce-scatter
/// then an all-gather) and NCCL's double binary tree (a reduce up and a broadcast down,
/// `log2 n` hops of latency each way, the buffer pipelined through at the link rate),
/// which NCCL picks for small buffers on many ranks.
pub(crate) fn ring_seconds(n: u64, bytes: u64, (bw, alpha): (f64, f64), all_reduce: bool) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let t = (n - 1) as f64 * (alpha + bytes as f64 / n as f64 / bw);
    if all_reduce {
        let depth = (n as f64).log2().ceil();
        let tree = 2.0 * (depth * alpha + bytes as f64 / bw);
        (2.0 * t).min(tree)
    } else {
        t
    }
}

/// What decides the optimizer step's memory traffic.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OptimizerTraffic {
    /// Optimizer state elements per parameter element.
    pub state_per_param: u64,
    /// torch's foreach AdamW (`runtime: fsdp2`, `implementation: foreach`): a pass per op.
    pub foreach_adamw: bool,
    /// torch's `clip_grad_norm_` (`runtime: fsdp2`): after the norm, every gradient is
    /// multiplied by the clamped coefficient in place (`_foreach_mul_`, done even when the
    /// coefficient is 1 to spare a host sync; torch/nn/utils/clip_grad.py,
    /// `_clip_grads_with_norm_`), a second pass reading and writing them.
    pub clip_scales_grads: bool,
}

impl OptimizerTraffic {
    pub(crate) fn of(policy: &crate::plan::Policy) -> Self {
        OptimizerTraffic {
            state_per_param: policy.optimizer_state_per_param,
            foreach_adamw: !policy.runtime.is_shardplan()
                && policy.optimizer == crate::OptimizerKind::Adamw
                && policy.adamw_implementation == shardplan_frontends::AdamwImplementation::Foreach,
            clip_scales_grads: !policy.runtime.is_shardplan() && policy.grad_clip.is_some(),
        }
    }
}

/// Seconds of one instruction. `step_s` comes from [`step_costs`].
pub(crate) fn instr_seconds(
    instr: &Instr,
    stream: Stream,
    buffers: &[Buffer],
    step_s: &[f64],
    mesh: &Mesh,
    hw: &HardwareProfile,
    optimizer: OptimizerTraffic,
) -> f64 {
    let bytes = |b: crate::plan::BufId| buffers[b.index()].bytes();
    let mem_bw = if stream == Stream::Host {
        hw.host_mem_gbps * 1e9
    } else {
        hw.hbm_gbps * 1e9 * hw.memory_efficiency
    };
    match instr {
        Instr::Compute {
            step, reads, writes, ..
        } => step_s[step.index()] + compute_copies(reads, writes, buffers, mesh, hw),
        Instr::Alloc { .. } | Instr::Free { .. } | Instr::Record { .. } | Instr::Wait { .. } => 0.0,
        Instr::AllGather { comm, dst, .. } => ring_seconds(comm.size(mesh), bytes(*dst), link(mesh, *comm, hw), false),
        Instr::ReduceScatter { comm, src, .. } => {
            ring_seconds(comm.size(mesh), bytes(*src), link(mesh, *comm, hw), false)
        }
        Instr::PackGrads { srcs, dst, .. } => {
            // Read every piece, write the packed buffer (padding included).
            let read: u64 = srcs.iter().map(|&b| bytes(b)).sum();
            (read + bytes(*dst)) as f64 / mem_bw
        }
        Instr::AllReduce { comm, buf, .. } => ring_seconds(comm.size(mesh), bytes(*buf), link(mesh, *comm, hw), true),
        Instr::Copy { src, dst, .. } | Instr::PostForwardSlice { src, dst, .. } => {
            let (s, d) = (&buffers[src.index()], &buffers[dst.index()]);
            if s.pool != d.pool {
                s.bytes().min(d.bytes()) as f64 / (hw.host_link_gbps * 1e9)
            } else {
                // The elements copied are read in the source's dtype and written in the
                // destination's: a cast (FSDP2's copy-in of f32 shards into a bf16
                // all-gather input) reads more than it writes.
                let n = s.numel.min(d.numel);
                (n * (s.dtype.size_bytes() + d.dtype.size_bytes())) as f64 / (hw.hbm_gbps * 1e9 * hw.memory_efficiency)
            }
        }
        Instr::GradNorm { grads, .. } => {
            let read = grads.iter().map(|&b| bytes(b)).sum::<u64>();
            let passes = if optimizer.clip_scales_grads { 3 } else { 1 };
            (passes * read) as f64 / mem_bw
        }
        Instr::OptimizerStep { grads, params, .. } => {
            let p = buffers[params.index()].bytes();
            let moved = if optimizer.foreach_adamw {
                // torch's foreach AdamW, one pass per `_foreach_` op over the shard (p the
                // parameters' bytes, each moment as large): the decoupled weight decay's
                // `mul_` (2p), `lerp_` of the first moment (2p + g), `mul_` and `addcmul_(g, g)`
                // of the second (4p + 2g), `sqrt` into a temporary, its `div_` by the bias
                // correction and `add_` of eps (6p), and the `addcdiv_` update (4p).
                3 * bytes(*grads) + 16 * p
            } else {
                // One fused pass: read and write the params and every state element, read
                // the gradients.
                bytes(*grads) + 2 * p + 2 * p * optimizer.state_per_param
            };
            moved as f64 / mem_bw
        }
    }
}

/// Seconds a compute step of shardplan's executor (`kernels: fused`, `copy_gbps` measured)
/// spends copying on its own thread: every gradient it makes into its group's flat
/// gradient buffer (`writes`), and, when shards come from other ranks, the parameters it
/// reads out of each all-gather output (`reads`; with one shard they are views).
pub(crate) fn compute_copies(
    reads: &[crate::plan::BufId],
    writes: &[crate::plan::BufId],
    buffers: &[Buffer],
    mesh: &Mesh,
    hw: &HardwareProfile,
) -> f64 {
    if hw.kernels != KernelMode::Fused || hw.copy_gbps <= 0.0 {
        return 0.0;
    }
    let bytes = |bs: &[crate::plan::BufId]| bs.iter().map(|b| buffers[b.index()].bytes()).sum::<u64>() as f64;
    let read = if mesh.shard() > 1 { bytes(reads) } else { 0.0 };
    (read + bytes(writes)) / (hw.copy_gbps * 1e9)
}

/// Where a buffer lives, for printing.
pub(crate) fn pool_name(p: Pool) -> &'static str {
    match p {
        Pool::Device => "device",
        Pool::Host => "host",
    }
}
