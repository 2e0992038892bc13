//! The validated parallel config: what the planner, the trainers and the writer read.

use crate::hardware::HardwareProfile;
use serde::{Deserialize, Serialize};
use shardplan_ir::{DType, ModuleKind};
use std::collections::BTreeMap;

/// Pipeline x replicate x shard x tensor: `world = pipeline * replicate * shard * tensor`;
/// pipeline > 1 is pipeline parallelism, replicate > 1 HSDP, tensor > 1 tensor
/// parallelism. Ranks are numbered row-major over the axes, pipeline outermost and tensor
/// innermost (torchtitan's `pp, dp_replicate, dp_shard, tp` mesh): rank
/// `((p * replicate + r) * shard + s) * tensor + t`, so a tensor group is `tensor`
/// consecutive ranks and a pipeline stage's ranks are one contiguous block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshShape {
    /// Pipeline ranks (stages of the model in turn); absent from serialised configs when 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub pipeline: u64,
    pub replicate: u64,
    pub shard: u64,
    /// Ranks of one context-parallel group (torchtitan's `cp`, between shard and tensor):
    /// each holds `1 / context` of every sequence. FSDP shards parameters over `shard x
    /// context` (torchtitan's `dp_shard_cp`). Absent from serialised configs when 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub context: u64,
    /// Ranks of one tensor-parallel group; absent from serialised configs when 1, so
    /// plans made before the axis existed read as they did.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub tensor: u64,
    /// Ranks of one expert-parallel group, carved out of the shard axis (torchtitan's
    /// `dp_shard_in_ep`): each holds `experts / expert` of every MoE layer's routed experts,
    /// and FSDP shards them over the `shard / expert` ranks that hold the same ones. Not a
    /// factor of the world; absent from serialised configs when 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub expert: u64,
}

fn one() -> u64 {
    1
}

fn is_one(v: &u64) -> bool {
    *v == 1
}

impl MeshShape {
    /// Every rank of the mesh.
    pub fn world(&self) -> u64 {
        self.pipeline * self.stage_world()
    }

    /// The ranks of one pipeline rank's stages: `replicate x shard x context x tensor`
    /// (the whole world without a pipeline).
    pub fn stage_world(&self) -> u64 {
        self.replicate * self.shard * self.context * self.tensor
    }

    /// Ranks a parameter is sharded over: `shard x context` (torchtitan's `dp_shard_cp`).
    pub fn fsdp_shard(&self) -> u64 {
        self.shard * self.context
    }

    /// Ranks that see different data: `replicate x shard`.
    pub fn data_parallel(&self) -> u64 {
        self.replicate * self.shard
    }
}

/// `torch.compile` as torchtitan applies it (its `compile` job option, under `runtime: fsdp2`):
/// every transformer block compiled on its own (`fullgraph=True`, before `fully_shard`) and
/// the loss function compiled apart. The spec writes `compile: true` for both, or
/// `compile: {model: true, loss: false}` to choose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Compile {
    /// Each block compiled: its pointwise ops and norms fused by inductor, its backward
    /// partitioned by AOTAutograd (what it saves, what it recomputes).
    pub model: bool,
    /// The cross-entropy compiled: the f32 cast, the log-softmax and the loss in one pass.
    pub loss: bool,
}

impl Compile {
    pub fn is_default(&self) -> bool {
        *self == Compile::default()
    }

    /// Whether anything is compiled.
    pub fn any(&self) -> bool {
        self.model || self.loss
    }
}

/// Context parallelism's options (torchtitan's defaults: all-gather, head-tail).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextParallel {
    /// How keys and values reach every rank of a context group (torch's
    /// `set_rotate_method`).
    pub rotate: shardplan_ir::ContextRotate,
    /// Which rows of a sequence each context rank holds (torch's head-tail load balancer,
    /// or contiguous chunks).
    pub load_balance: shardplan_ir::ContextBalance,
}

impl Default for ContextParallel {
    fn default() -> Self {
        ContextParallel {
            rotate: shardplan_ir::ContextRotate::AllGather,
            load_balance: shardplan_ir::ContextBalance::HeadTail,
        }
    }
}

impl ContextParallel {
    pub fn is_default(&self) -> bool {
        *self == ContextParallel::default()
    }
}

/// Tensor parallelism's options (torchtitan's defaults: both on).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorParallel {
    /// Activations between blocks split along the sequence over the tensor group, norms
    /// run on the chunk, all-gathered into attention and the feed-forward and
    /// reduce-scattered out (`enable_async_tp` aside, torchtitan's default); off, the
    /// blocks' outputs are all-reduced and every rank holds them whole.
    pub sequence_parallel: bool,
    /// The cross-entropy runs on the vocabulary-split logits (torchtitan's
    /// `loss_parallel`); off, the logits are all-gathered first.
    pub loss_parallel: bool,
    /// Asynchronous tensor parallelism (`async` in the spec; torchtitan's
    /// `enable_async_tensor_parallel`): under torch.compile, inductor's micro-pipelined TP
    /// pass splits each sequence-parallel all-gather and reduce-scatter and overlaps the
    /// pieces with their matmuls, over symmetric memory on CUDA. Needs `compile` and
    /// sequence parallelism.
    #[serde(rename = "async", default, skip_serializing_if = "is_false")]
    pub async_tp: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl Default for TensorParallel {
    fn default() -> Self {
        TensorParallel {
            sequence_parallel: true,
            loss_parallel: true,
            async_tp: false,
        }
    }
}

impl TensorParallel {
    pub fn is_default(&self) -> bool {
        *self == TensorParallel::default()
    }
}

/// Mixture-of-experts options of a run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeParallel {
    /// Under expert parallelism: the most rows one rank's experts receive per layer, as a
    /// factor over the even split (`tokens * top_k` per rank). Routing stays dropless; a
    /// batch that routes more is a run-time error naming the layer and the count.
    pub capacity: f64,
    /// Token dropping (GShard's capacity factor): each expert keeps at most this factor
    /// times its even share of a rank's assignments per layer (`ceil(f * tokens * top_k /
    /// experts)`; each token's first choice before any second, then token order), the rest
    /// add nothing to their token. Every shape is then static and no batch can overflow.
    /// `None`: dropless.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_factor: Option<f64>,
}

/// `moe.capacity`'s default: GShard's training capacity factor. The bound is on the rows
/// one expert rank receives, the sum of `experts / expert` experts' loads, which varies
/// less than one expert's, so 2.0 leaves room for routing well away from even; a run that
/// exceeds it stops naming the capacity that would have fit. Not yet read from routing
/// measured over a real model's training.
pub const DEFAULT_MOE_CAPACITY: f64 = 2.0;

impl Default for MoeParallel {
    fn default() -> Self {
        MoeParallel {
            capacity: DEFAULT_MOE_CAPACITY,
            capacity_factor: None,
        }
    }
}

impl MoeParallel {
    pub fn is_default(&self) -> bool {
        *self == MoeParallel::default()
    }
}

/// FSDP2's `reshard_after_forward`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reshard {
    /// `true`: free unsharded parameters after forward, all-gather again in backward.
    AfterForward,
    /// `false`: keep them unsharded until backward.
    Keep,
    /// `N`: after forward, keep a copy sharded over groups of N ranks (intra-node).
    ToGroupOf(u64),
}

/// All-gathers issued ahead of need, as FSDP2's prefetch depth.
///
/// The spec names the units of its explicit lists by module (`K = String`); the planner's
/// lowered policy holds the same value with the modules resolved to their groups.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(bound(deserialize = "K: Ord + Deserialize<'de>"))]
pub struct Prefetch<K = String> {
    pub forward: u32,
    pub backward: u32,
    /// FSDP2's `set_modules_to_forward_prefetch`: when the key module's forward starts,
    /// all-gather the listed modules' groups (overrides the depth for them).
    pub explicit_forward: BTreeMap<K, Vec<K>>,
    /// FSDP2's `set_modules_to_backward_prefetch`, for the backward pass.
    pub explicit_backward: BTreeMap<K, Vec<K>>,
    /// The planner moves an all-gather later than the depths put it wherever that lowers
    /// the step's peak without lengthening the simulated step (`prefetch: auto`, the
    /// default: depths 1 / 1 and peak-aware; a mapping turns it off unless it says
    /// `peak_aware: true`).
    #[serde(default)]
    pub peak_aware: bool,
}

impl Prefetch {
    /// `prefetch: auto`: depth 1 each way (FSDP2's order), then peak-aware.
    pub fn auto() -> Self {
        Prefetch {
            forward: 1,
            backward: 1,
            explicit_forward: BTreeMap::new(),
            explicit_backward: BTreeMap::new(),
            peak_aware: true,
        }
    }
}

/// Dtypes of the unsharded parameters (and compute) and of gradient reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MixedPrecision {
    pub param: DType,
    pub reduce: DType,
}

impl MixedPrecision {
    /// The dtype of the sharded parameters the optimizer steps (the master copy): f32
    /// whatever the compute dtype, as FSDP2 keeps the sharded parameters in the dtype they
    /// were created in.
    pub const fn master(self) -> DType {
        DType::F32
    }
}

/// Where sharded parameters, gradients and optimizer state live between uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    None,
    Cpu,
}

/// Which blocks recompute their activations in backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActivationCheckpointing {
    None,
    Full,
    /// Every n-th block.
    Every(u64),
    /// Every block keeps the outputs of the ops `SavePolicy` names and recomputes the
    /// rest of its forward in backward (selective checkpointing by op).
    Selective(SavePolicy),
}

/// What a selectively checkpointed block saves from its forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SavePolicy {
    /// Attention outputs.
    pub attention: bool,
    /// Which matmul (linear layer) outputs.
    pub matmuls: SavedMatmuls,
}

/// Which of a block's matmuls keep their outputs, counted in forward order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SavedMatmuls {
    None,
    /// The 1st, 3rd, 5th ... of each block: every second matmul is recomputed.
    Odd,
    All,
}

impl SavePolicy {
    /// torchtitan's op policy: attention and matmul outputs are saved, and every second
    /// matmul is recomputed (`activation_checkpointing: selective`).
    pub const TORCHTITAN: SavePolicy = SavePolicy {
        attention: true,
        matmuls: SavedMatmuls::Odd,
    };

    /// The names of the `save` list this policy corresponds to.
    pub fn names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.attention {
            v.push("attention");
        }
        match self.matmuls {
            SavedMatmuls::None => {}
            SavedMatmuls::Odd => v.push("odd_matmuls"),
            SavedMatmuls::All => v.push("matmuls"),
        }
        v
    }
}

/// What `activation_checkpointing: {selective: {save: [...]}}` may list.
pub const SAVE_NAMES: [&str; 3] = ["attention", "matmuls", "odd_matmuls"];

/// When gradients are reduced under gradient accumulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GradSync {
    /// Reduce-scatter after every micro-batch and accumulate sharded gradients (FSDP2's
    /// default); the HSDP all-reduce still runs once per step.
    EveryMicroBatch,
    /// Accumulate unsharded gradients and reduce-scatter only after the last micro-batch
    /// (FSDP2's `set_requires_gradient_sync(False)` on the others): less communication,
    /// unsharded gradients held across micro-batches.
    FinalMicroBatch,
}

/// Batch shape per rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// Sequences per micro-batch on each rank.
    pub per_rank: u64,
    /// Tokens per sequence; `None`: the model's default.
    pub seq_len: Option<u64>,
    /// Micro-batches per optimizer step.
    pub grad_accum: u64,
    /// When gradients are reduced across micro-batches.
    pub grad_sync: GradSync,
}

/// The optimizer and its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    /// AdamW with decoupled weight decay.
    AdamW {
        lr: f64,
        betas: [f64; 2],
        eps: f64,
        weight_decay: f64,
    },
    Sgd {
        lr: f64,
        momentum: f64,
        weight_decay: f64,
    },
}

impl Optimizer {
    /// f32 state elements kept per parameter element (Adam: 2 moments; SGD: momentum or none).
    pub fn state_per_param(&self) -> u64 {
        match self {
            Optimizer::AdamW { .. } => 2,
            Optimizer::Sgd { momentum, .. } => u64::from(*momentum != 0.0),
        }
    }
}

/// How PyTorch's `torch.optim.AdamW` runs its step (`optimizer.adamw.implementation`): the
/// same update either way, with different memory and speed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AdamwImplementation {
    /// `fused=True`: one kernel over every parameter, holding nothing beyond the parameters,
    /// gradients and state (torchtitan's default).
    #[default]
    Fused,
    /// `foreach=True` (torch's default on CUDA when neither is given): list ops over all
    /// parameters at once, which hold a temporary the size of the parameters (`sqrt` of the
    /// second moments, f32) until the update.
    Foreach,
}

impl AdamwImplementation {
    pub fn is_fused(&self) -> bool {
        *self == AdamwImplementation::Fused
    }

    pub fn name(self) -> &'static str {
        match self {
            AdamwImplementation::Fused => "fused",
            AdamwImplementation::Foreach => "foreach",
        }
    }
}

/// Learning rate over a run: linear warmup from 0, then cosine decay to `min_lr_ratio * lr`
/// at the last step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub warmup_steps: u64,
    pub min_lr_ratio: f64,
}

/// Width of the token ids in a flat binary token file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDType {
    /// 2 bytes per token, little-endian (nanoGPT's `train.bin`).
    U16,
    /// 4 bytes per token, little-endian.
    U32,
}

/// Where training batches come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataSource {
    /// A seeded synthetic task the model can learn (see the executor's `data` module).
    Synthetic,
    /// A flat file of token ids; the path is resolved against the spec's folder.
    Tokens {
        path: std::path::PathBuf,
        dtype: TokenDType,
        /// The validation loss, measured every few steps on a second token file.
        #[serde(default)]
        eval: Option<Eval>,
    },
}

/// Most validation batches one evaluation may take (each is a micro-batch of the forward
/// program the planner makes for it).
pub const MAX_EVAL_BATCHES: u64 = 1024;

/// Validation: every `every` steps (and after the last), the loss of the model on the same
/// `batches` global batches of the token file `path` (same `dtype` as the training file),
/// forward only.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Eval {
    pub path: std::path::PathBuf,
    pub every: u64,
    pub batches: u64,
}

/// Which framework runs the plan, and so whose buffers and hooks the planner models.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Runtime {
    /// shardplan's own executor (`shardplan train`).
    #[default]
    Shardplan,
    /// PyTorch FSDP2 running the plan as a torch program (`fully_shard` per planned group):
    /// its flat all-gather output copied out into per-parameter tensors, its reduce-scatter
    /// buffers and the collective state it keeps between groups, PyTorch eager kernels and
    /// autograd's saved tensors. Implies `hardware.kernels: eager`.
    Fsdp2,
}

impl Runtime {
    pub fn is_shardplan(&self) -> bool {
        *self == Runtime::Shardplan
    }

    pub fn name(self) -> &'static str {
        match self {
            Runtime::Shardplan => "shardplan",
            Runtime::Fsdp2 => "fsdp2",
        }
    }
}

/// PyTorch's CUDA caching allocator as the run configures it (`PYTORCH_ALLOC_CONF`): the
/// planner replays the step's allocations through a model of it for the reserved peak.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorConfig {
    /// `expandable_segments:True`: one growing mapping per stream and pool, extended in
    /// pages (2 MiB small pool, 20 MiB large pool) instead of one `cudaMalloc` segment per
    /// miss. On by default, as torchtitan launches (`run_train.sh`).
    pub expandable_segments: bool,
}

impl AllocatorConfig {
    /// What torchtitan launches with: `PYTORCH_ALLOC_CONF=expandable_segments:True`.
    pub const TORCHTITAN: AllocatorConfig = AllocatorConfig {
        expandable_segments: true,
    };
    /// PyTorch's own default: one `cudaMalloc` segment per cache miss.
    pub const CUDA_MALLOC: AllocatorConfig = AllocatorConfig {
        expandable_segments: false,
    };

    pub fn is_default(&self) -> bool {
        *self == AllocatorConfig::default()
    }
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig::TORCHTITAN
    }
}

/// A validated parallel spec.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParallelConfig {
    pub mesh: MeshShape,
    pub gpus_per_node: u64,
    pub hardware: HardwareProfile,
    /// Module kinds that become FSDP units; the root group (everything else) is always last.
    pub wrap: Vec<ModuleKind>,
    /// Module paths (`layers.0.feed_forward`, `output`) that become FSDP units as well.
    pub wrap_modules: Vec<String>,
    /// Merge consecutive units into one while their parameters fit in this many MiB.
    pub bucket_mib: Option<u64>,
    pub reshard_after_forward: Reshard,
    pub prefetch: Prefetch,
    pub mixed_precision: MixedPrecision,
    pub offload: Offload,
    pub activation_checkpointing: ActivationCheckpointing,
    pub batch: Batch,
    pub optimizer: Optimizer,
    /// AdamW's implementation in a PyTorch run (`optimizer.adamw.implementation`): what an
    /// exported FSDP2 program passes to `torch.optim.AdamW`, and under `runtime: fsdp2` what
    /// its optimizer step holds. Beside `optimizer`, not in it: the update's arithmetic is
    /// the same, and shardplan's own executor has one AdamW whatever it says. `fused` for
    /// SGD; absent from a serialised config when `fused`, so older plans read as before.
    #[serde(default, skip_serializing_if = "AdamwImplementation::is_fused")]
    pub adamw_implementation: AdamwImplementation,
    /// Global gradient-norm clip; `None`: no clipping.
    pub grad_clip: Option<f64>,
    /// Seed of initialisation and data order.
    pub seed: u64,
    pub lr_schedule: LrSchedule,
    pub data: DataSource,
    /// Whose run the plan predicts; absent from a serialised config when `shardplan`, so
    /// plans made before the field existed read (and print) as they did.
    #[serde(default, skip_serializing_if = "Runtime::is_shardplan")]
    pub runtime: Runtime,
    /// The caching allocator's settings; absent from a serialised config when default
    /// (expandable segments on).
    #[serde(default, skip_serializing_if = "AllocatorConfig::is_default")]
    pub allocator: AllocatorConfig,
    /// `torch.compile` of the blocks and the loss (`runtime: fsdp2` only); absent from a
    /// serialised config when nothing is compiled.
    #[serde(default, skip_serializing_if = "Compile::is_default")]
    pub compile: Compile,
    /// Tensor parallelism's options (used when `mesh.tensor > 1`); absent from a
    /// serialised config when default.
    #[serde(default, skip_serializing_if = "TensorParallel::is_default")]
    pub tensor_parallel: TensorParallel,
    /// Context parallelism's options (used when `mesh.context > 1`); absent from a
    /// serialised config when default.
    #[serde(default, skip_serializing_if = "ContextParallel::is_default")]
    pub context_parallel: ContextParallel,
    /// Mixture-of-experts options; absent from a serialised config when default.
    #[serde(default, skip_serializing_if = "MoeParallel::is_default")]
    pub moe: MoeParallel,
    /// Pipeline parallelism's schedule and stages, when `mesh.pipeline > 1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<Pipeline>,
    /// Float8 linears (torchao); absent from a serialised config when off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub float8: Option<super::Float8>,
    /// MXFP8 linears (torchao's MX); absent from a serialised config when off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mxfp8: Option<super::Mxfp8>,
}

impl ParallelConfig {
    /// The shape a model is traced at for this run: one rank's micro-batch (sequences and
    /// tokens per sequence) in the parameter dtype; under a pipeline, one of its
    /// micro-batches. The one conversion from a run spec to `TraceOptions`.
    pub fn trace_options(&self) -> shardplan_models::TraceOptions {
        shardplan_models::TraceOptions {
            batch: self.micro_batch(),
            seq_len: self.batch.seq_len,
            dtype: self.mixed_precision.param,
            tensor: shardplan_models::TensorOptions {
                degree: self.mesh.tensor,
                sequence_parallel: self.tensor_parallel.sequence_parallel,
                loss_parallel: self.tensor_parallel.loss_parallel,
            },
            expert: shardplan_models::ExpertOptions {
                degree: self.mesh.expert,
                capacity: self.moe.capacity,
                capacity_factor: self.moe.capacity_factor,
                overlap: self.runtime == Runtime::Shardplan,
            },
            context: shardplan_models::ContextOptions {
                degree: self.mesh.context,
                balance: self.context_parallel.load_balance,
                rotate: self.context_parallel.rotate,
            },
            float8: self.float8.as_ref().map(|f| f.options()),
        }
    }

    /// Sequences of one rank's forward: `batch.per_rank`, or one pipeline micro-batch of it.
    pub fn micro_batch(&self) -> u64 {
        match &self.pipeline {
            Some(p) => self.batch.per_rank / p.microbatches,
            None => self.batch.per_rank,
        }
    }

    /// How the run's backward pass is built: shardplan's executor (`kernels: fused`,
    /// `runtime: shardplan`) recomputes pointwise ops and norms in backward rather than
    /// keeping their outputs; PyTorch eager (and FSDP2's run) keeps them. A compiled block
    /// (`compile.model`) recomputes its activation function's output, and a compiled loss
    /// (`compile.loss`) keeps the logits and recomputes their f32 copy in its backward.
    pub fn diff_options(&self) -> shardplan_ir::DiffOptions {
        shardplan_ir::DiffOptions {
            recompute_pointwise: self.runtime == Runtime::Shardplan
                && self.hardware.kernels == crate::hardware::KernelMode::Fused,
            recompute_widening_casts: self.compile.loss,
            recompute_block_activations: self.compile.model,
        }
    }
}

/// `reshard_after_forward` as the spec writes it, and as every printout shows it: `true`,
/// `false` or the group size.
impl std::fmt::Display for Reshard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reshard::AfterForward => f.write_str("true"),
            Reshard::Keep => f.write_str("false"),
            Reshard::ToGroupOf(n) => write!(f, "{n}"),
        }
    }
}

impl std::fmt::Display for Offload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Offload::None => "none",
            Offload::Cpu => "cpu",
        })
    }
}

impl std::fmt::Display for ActivationCheckpointing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ActivationCheckpointing::None => f.write_str("none"),
            ActivationCheckpointing::Full => f.write_str("full"),
            ActivationCheckpointing::Every(n) => write!(f, "every {n}"),
            ActivationCheckpointing::Selective(p) if *p == SavePolicy::TORCHTITAN => f.write_str("selective"),
            ActivationCheckpointing::Selective(p) => {
                let names = p.names();
                if names.is_empty() {
                    f.write_str("selective (saves nothing)")
                } else {
                    write!(f, "selective (saves {})", names.join(", "))
                }
            }
        }
    }
}

/// A pipeline schedule of torch.distributed.pipelining, by the name torchtitan's
/// `pipeline_parallel_schedule` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PipelineSchedule {
    /// All forwards, then all backwards; one stage a rank.
    #[serde(rename = "GPipe")]
    GPipe,
    /// One forward, one backward in steady state; one stage a rank.
    #[serde(rename = "1F1B")]
    OneFOneB,
    /// 1F1B over several stages a rank, looped (Megatron's interleaved schedule).
    Interleaved1F1B,
    /// Every forward of a rank's first stage, then its next stage's, breadth first.
    LoopedBFS,
    /// Interleaved with split backwards filling the bubble (ZB1P).
    InterleavedZeroBubble,
    /// Zero-bubble on two stages a rank placed in a V.
    ZBVZeroBubble,
    /// DeepSeek's DualPipe on one V: a forward and a backward overlapped.
    DualPipeV,
}

impl PipelineSchedule {
    pub const ALL: [PipelineSchedule; 7] = [
        PipelineSchedule::GPipe,
        PipelineSchedule::OneFOneB,
        PipelineSchedule::Interleaved1F1B,
        PipelineSchedule::LoopedBFS,
        PipelineSchedule::InterleavedZeroBubble,
        PipelineSchedule::ZBVZeroBubble,
        PipelineSchedule::DualPipeV,
    ];

    /// The name as the spec and torchtitan write it.
    pub fn name(self) -> &'static str {
        match self {
            PipelineSchedule::GPipe => "GPipe",
            PipelineSchedule::OneFOneB => "1F1B",
            PipelineSchedule::Interleaved1F1B => "Interleaved1F1B",
            PipelineSchedule::LoopedBFS => "LoopedBFS",
            PipelineSchedule::InterleavedZeroBubble => "InterleavedZeroBubble",
            PipelineSchedule::ZBVZeroBubble => "ZBVZeroBubble",
            PipelineSchedule::DualPipeV => "DualPipeV",
        }
    }

    /// GPipe and 1F1B run one stage a rank (torch's `PipelineScheduleSingle`).
    pub fn is_single_stage(self) -> bool {
        matches!(self, PipelineSchedule::GPipe | PipelineSchedule::OneFOneB)
    }

    /// Stages a rank unless the spec says: 1 for single-stage schedules, 2 for the others
    /// (torchtitan's default).
    pub fn default_stages_per_rank(self) -> u64 {
        if self.is_single_stage() {
            1
        } else {
            2
        }
    }
}

impl std::fmt::Display for PipelineSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Pipeline parallelism's schedule and stages (`pipeline:`), torchtitan's knobs under the
/// spec's names; read when `mesh.pipeline > 1`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pipeline {
    pub schedule: PipelineSchedule,
    /// Micro-batches a step: `batch.per_rank` splits into this many.
    pub microbatches: u64,
    /// Stages each pipeline rank runs; `None`: from `layers_per_stage`, the module lists,
    /// or the schedule's default (1 single-stage, 2 otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages_per_rank: Option<u64>,
    pub split: StageSplit,
    /// A custom compute-only schedule in torch's CSV format (one row a rank), run instead
    /// of the named schedule's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csv: Option<std::path::PathBuf>,
}

/// How the model's modules are cut into stages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageSplit {
    /// torchtitan's split: the embedding and the head count as `first_stage_less_layers`
    /// and `last_stage_less_layers` blocks, every stage `layers_per_stage` blocks (when
    /// set, it fixes the stage count), the first stages one more where they do not divide.
    Layers {
        layers_per_stage: Option<u64>,
        first_stage_less_layers: u64,
        last_stage_less_layers: u64,
    },
    /// Each stage's top-level modules by name (torchtitan's `module_fqns_per_model_part`).
    Modules(Vec<Vec<String>>),
}

impl StageSplit {
    /// torchtitan's defaults: stage count from the schedule, embedding and head one block each.
    pub const DEFAULT: StageSplit = StageSplit::Layers {
        layers_per_stage: None,
        first_stage_less_layers: 1,
        last_stage_less_layers: 1,
    };
}
