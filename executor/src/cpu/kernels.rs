//! One function per IR op, on candle tensors. Shapes were checked when the graph was
//! built, so kernels trust them; numerics that need range (norms, softmax, cross-entropy,
//! scatter-adds) run in f32 (or f64) and cast back to the op's dtype.

use crate::cpu::context::ContextGroup;
use crate::cpu::expert::ExpertGroup;
use crate::cpu::linear::{linear, rows, weight_grad};
pub use crate::cpu::mask::Mask;
use crate::cpu::tensor::TensorGroup;
use crate::cpu::{attention, float8, fused, moe};
use crate::ExecError;
use candle_core::{DType as CDType, Device, Tensor, D};
use shardplan_ir::{ContextLayout, DType, NormWrt, Op, TensorType};
use std::cell::RefCell;
use std::collections::HashMap;

type Result<T> = std::result::Result<T, ExecError>;

/// candle's dtype for an IR dtype.
pub fn cdtype(d: DType) -> CDType {
    match d {
        DType::F64 => CDType::F64,
        DType::F32 => CDType::F32,
        DType::BF16 => CDType::BF16,
        DType::F16 => CDType::F16,
        DType::I64 => CDType::I64,
        DType::U32 => CDType::U32,
    }
}

/// The IR dtype of a candle dtype (the ones the IR has; others read as f32).
pub fn ir_dtype(d: CDType) -> DType {
    match d {
        CDType::F64 => DType::F64,
        CDType::BF16 => DType::BF16,
        CDType::F16 => DType::F16,
        CDType::I64 => DType::I64,
        CDType::U32 => DType::U32,
        _ => DType::F32,
    }
}

/// `(theta bits, scaling, seq, context rows, head_dim, dtype)` of a rotary table.
type RopeKey = (u64, String, usize, Option<(ContextLayout, u64)>, usize, CDType);

/// What kernels share: the device, cached rotary tables and, for a tensor-parallel
/// graph, the rank's tensor group.
pub struct Ctx {
    pub device: Device,
    rope: RefCell<HashMap<RopeKey, (Tensor, Tensor)>>,
    tensor: Option<TensorGroup>,
    expert: Option<std::sync::Arc<ExpertGroup>>,
    context: Option<std::sync::Arc<ContextGroup>>,
    /// Run the ops shardplan has its own CUDA kernels for on them (`--kernels native`):
    /// see [`crate::gpu`]. Only on a CUDA device.
    pub native: bool,
}

impl Ctx {
    pub fn new(device: Device) -> Self {
        Ctx {
            device,
            rope: RefCell::new(HashMap::new()),
            tensor: None,
            expert: None,
            context: None,
            native: false,
        }
    }

    /// This context with its context-parallel ops running over `group`.
    pub fn with_context_group(self, group: ContextGroup) -> Self {
        Ctx {
            context: Some(std::sync::Arc::new(group)),
            ..self
        }
    }

    /// The context group, for the all-to-all stream's steps (`apply_context`).
    pub fn context_group(&self) -> Option<std::sync::Arc<ContextGroup>> {
        self.context.clone()
    }

    /// This context with its expert-parallel ops running over `group`.
    pub fn with_expert_group(self, group: ExpertGroup) -> Self {
        Ctx {
            expert: Some(std::sync::Arc::new(group)),
            ..self
        }
    }

    /// The expert group, for the all-to-all stream's steps (`apply_expert`).
    pub fn expert_group(&self) -> Option<std::sync::Arc<ExpertGroup>> {
        self.expert.clone()
    }

    /// A context whose tensor-parallel ops run over `group`.
    pub fn with_tensor_group(device: Device, group: TensorGroup) -> Self {
        Ctx {
            tensor: Some(group),
            ..Ctx::new(device)
        }
    }

    /// This context on `device`, its tensor group kept.
    pub fn to_device(self, device: Device) -> Self {
        Ctx {
            device,
            rope: RefCell::new(HashMap::new()),
            tensor: self.tensor,
            expert: self.expert,
            context: self.context,
            native: self.native,
        }
    }

    /// The tensor group a tensor-parallel op runs over.
    fn tensor(&self, op: &Op) -> Result<&TensorGroup> {
        self.tensor.as_ref().ok_or_else(|| {
            ExecError::Internal(format!(
                "{} is a tensor-parallel op, but this rank has no tensor group",
                op.name()
            ))
        })
    }

    /// The context group a context-parallel op runs over.
    fn context(&self, op: &Op) -> Result<&ContextGroup> {
        self.context.as_deref().ok_or_else(|| {
            ExecError::Internal(format!(
                "{} is a context-parallel op, but this rank has no context group",
                op.name()
            ))
        })
    }

    /// Under a context layout, the layout with this rank's index in its context group:
    /// where its rows sit in their sequences. `None` without one.
    pub fn context_rows(&self, context: Option<ContextLayout>) -> Result<Option<(ContextLayout, u64)>> {
        let Some(layout) = context else { return Ok(None) };
        let group = self
            .context
            .as_ref()
            .ok_or_else(|| ExecError::Internal("a context-parallel op ran on a rank without a context group".into()))?;
        Ok(Some((layout, group.index() as u64)))
    }

    /// The rotary tables `rope` (`theta`, `scaling`, `context`) rotates `x [b, s, h, d]` by.
    fn rope_tables_of(
        &self,
        theta: f64,
        scaling: &shardplan_ir::RopeScaling,
        context: Option<ContextLayout>,
        x: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (_, s, _, d) = x.dims4()?;
        self.rope_tables(theta, scaling, s, self.context_rows(context)?, d, x.dtype())
    }

    /// The mask of an attention op with `rows` query rows on this rank.
    pub fn mask(&self, causal: bool, context: Option<ContextLayout>, rows: usize) -> Result<Mask> {
        let rank = self.context_rows(context)?.map_or(0, |(_, r)| r);
        Ok(Mask::of(causal, context, rank, rows))
    }

    /// Waits, under the collective timeout, for this rank's expert- and context-group
    /// collectives that were only enqueued (NCCL); nothing to do on a blocking backend or
    /// without those groups.
    pub fn flush_groups(&self) -> Result<()> {
        self.expert.as_ref().map_or(Ok(()), |g| g.flush())?;
        self.context.as_ref().map_or(Ok(()), |g| g.flush())
    }

    /// The heaviest routing of this rank's expert group since the last call (`None`: no
    /// expert group, or no dispatch ran).
    pub fn take_routing_load(&self) -> Option<crate::cpu::expert::RoutingLoad> {
        self.expert.as_ref().and_then(|g| g.take_load())
    }

    /// The expert group an expert-parallel op runs over.
    fn expert(&self, op: &Op) -> Result<&ExpertGroup> {
        self.expert.as_deref().ok_or_else(|| {
            ExecError::Internal(format!(
                "{} is an expert-parallel op, but this rank has no expert group",
                op.name()
            ))
        })
    }

    /// `cos`, `sin` of shape `[seq, head_dim / 2]` for positions `0..seq` (HF's
    /// rotate-half convention: frequency `theta^(-2i / head_dim)`).
    fn rope_tables(
        &self,
        theta: f64,
        scaling: &shardplan_ir::RopeScaling,
        seq: usize,
        context: Option<(ContextLayout, u64)>,
        head_dim: usize,
        dtype: CDType,
    ) -> Result<(Tensor, Tensor)> {
        let key = (theta.to_bits(), format!("{scaling:?}"), seq, context, head_dim, dtype);
        if let Some(t) = self.rope.borrow().get(&key) {
            return Ok(t.clone());
        }
        let half = head_dim / 2;
        let mut angles = Vec::with_capacity(seq * half);
        let positions: Vec<u64> = match context {
            Some((layout, rank)) => layout.positions(rank, seq as u64),
            None => (0..seq as u64).collect(),
        };
        for pos in positions {
            for i in 0..half {
                let inv_freq = scaling.inv_freq(theta, head_dim, i);
                angles.push(pos as f64 * inv_freq);
            }
        }
        let a = Tensor::from_vec(angles, (seq, half), &self.device)?;
        let m = scaling.attention_factor();
        let t = ((a.cos()? * m)?.to_dtype(dtype)?, (a.sin()? * m)?.to_dtype(dtype)?);
        self.rope.borrow_mut().insert(key, t.clone());
        Ok(t)
    }
}

/// One of attention's backward ops (`attn_probs`, `attn_grad_{v,scores,q,k}`) on `ins`;
/// `mask` is the probabilities' mask.
fn attention_backward_op(op: &Op, ins: &[&Tensor], mask: &Mask) -> Result<Tensor> {
    let t = match op {
        Op::AttnProbs { .. } if fused::applies(&ins[..2]) => attention::probs(ins[0], ins[1], mask)?,
        Op::AttnProbs { .. } => attn_probs(ins[0], ins[1], mask)?,
        Op::AttnGradV { kv_heads } if fused::applies(&ins[..2]) => {
            attention::grad_v(ins[0], ins[1], *kv_heads as usize)?
        }
        Op::AttnGradScores if fused::applies(&ins[..3]) => attention::grad_scores(ins[0], ins[1], ins[2])?,
        Op::AttnGradQ if fused::applies(&ins[..2]) => attention::grad_q(ins[0], ins[1])?,
        Op::AttnGradK { kv_heads } if fused::applies(&ins[..2]) => {
            attention::grad_k(ins[0], ins[1], *kv_heads as usize)?
        }
        Op::AttnGradV { kv_heads } => {
            // dv[b, t, kv, :] = sum over the kv head's query heads and s of p * g
            let p = grouped(ins[0], *kv_heads as usize)?;
            let g = grouped(&heads_first(ins[1])?, *kv_heads as usize)?;
            heads_first(&p.transpose(2, 3)?.matmul(&g)?)?
        }
        Op::AttnGradScores => {
            let (p, g, v) = (ins[0], ins[1], ins[2]);
            let kv = v.dim(2)?;
            let h = p.dim(1)?;
            let dp = grouped(&heads_first(g)?, kv)?.matmul(&heads_first(v)?.transpose(2, 3)?)?;
            let dp = ungroup(&dp, h)?;
            if fused::applies(&[p, &dp]) {
                return fused::softmax_backward(p, &dp);
            }
            let (pw, dpw) = (wide(p)?, wide(&dp)?);
            let row = (&dpw * &pw)?.sum_keepdim(D::Minus1)?;
            (pw * dpw.broadcast_sub(&row)?)?.to_dtype(p.dtype())?
        }
        Op::AttnGradQ => {
            let (ds, k) = (ins[0], ins[1]);
            let scale = 1.0 / (k.dim(3)? as f64).sqrt();
            let dq = grouped(ds, k.dim(2)?)?.matmul(&heads_first(k)?)?;
            ungroup_heads(&dq, ds.dim(1)?)?.affine(scale, 0.0)?
        }
        Op::AttnGradK { kv_heads } => {
            let (ds, q) = (ins[0], ins[1]);
            let scale = 1.0 / (q.dim(3)? as f64).sqrt();
            let ds = grouped(ds, *kv_heads as usize)?;
            let q = grouped(&heads_first(q)?, *kv_heads as usize)?;
            heads_first(&ds.transpose(2, 3)?.matmul(&q)?)?.affine(scale, 0.0)?
        }
        _ => {
            return Err(ExecError::Internal(format!(
                "{} is not an attention backward op",
                op.name()
            )))
        }
    };
    Ok(t)
}

/// Rows of f32 scores (`[b, h, rows, t]`) one block of [`attention_backward_blockwise`]
/// holds at most: 1 MiB per `[b, h, rows, t]` tensor, in whole 64-row blocks.
const BLOCKWISE_SCORES: usize = 1 << 18;

/// Attention's gradients `[dq, dk, dv]` (each only where `want` asks) from its operands
/// `q [b, s, h, d]`, `k`, `v [b, t, kv, d]` and the output gradient `dy [b, s, h, d]`,
/// without the `[b, h, s, t]` probabilities or their gradient: blocks of query rows, each
/// recomputing its probabilities from q and k (as flash attention's backward does) and
/// holding at most [`BLOCKWISE_SCORES`] scores. A causal block reads only the keys its last
/// row sees. dk and dv sum the blocks' parts in f32. f32 CPU tensors take the fused
/// [`attention::backward`] instead (the same blocks in one pass, a `64 x t` scratch per
/// thread).
pub fn attention_backward_blockwise(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dy: &Tensor,
    mask: &Mask,
    want: [bool; 3],
) -> Result<[Option<Tensor>; 3]> {
    if fused::applies(&[q, k, v, dy]) {
        // f32 on the CPU: one fused pass, `BLOCK x t` scratch per thread.
        let [dq, dk, dv] = attention::backward(q, k, v, dy, mask)?;
        return Ok([want[0].then_some(dq), want[1].then_some(dk), want[2].then_some(dv)]);
    }
    let (b, s, h, _) = q.dims4()?;
    let t = k.dim(1)?;
    let per_row = (b * h * t).max(1);
    let rows = ((BLOCKWISE_SCORES / per_row) / 64 * 64).clamp(64, s.max(64));
    blockwise_in_rows(q, k, v, dy, mask, want, rows)
}

/// [`attention_backward_blockwise`] in blocks of `rows` query rows.
fn blockwise_in_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dy: &Tensor,
    mask: &Mask,
    want: [bool; 3],
    rows: usize,
) -> Result<[Option<Tensor>; 3]> {
    let s = q.dim(1)?;
    let (_, t, kv, _) = k.dims4()?;
    let rows = rows.max(1);
    let wide_dtype = if q.dtype() == CDType::F64 {
        CDType::F64
    } else {
        CDType::F32
    };
    let mut dq_parts = Vec::new();
    let (mut dk, mut dv): (Option<Tensor>, Option<Tensor>) = (None, None);
    let kv_heads = kv as u64;
    for r0 in (0..s).step_by(rows) {
        let r1 = (r0 + rows).min(s);
        let c = r1 - r0;
        // Keys the block's rows see.
        let tk = mask.block_keys(r0, r1, s, t);
        if tk == 0 {
            if want[0] {
                dq_parts.push(q.narrow(1, r0, c)?.zeros_like()?);
            }
            continue;
        }
        let qc = q.narrow(1, r0, c)?.contiguous()?;
        let dyc = dy.narrow(1, r0, c)?.contiguous()?;
        let kc = k.narrow(1, 0, tk)?.contiguous()?;
        let vc = v.narrow(1, 0, tk)?.contiguous()?;
        let probs = Op::AttnProbs {
            causal: !mask.is_full(),
            context: None,
        };
        let p = attention_backward_op(&probs, &[&qc, &kc], &mask.rows(r0, r1))?;
        let add = |acc: &mut Option<Tensor>, part: Tensor| -> Result<()> {
            let part = part.to_dtype(wide_dtype)?.pad_with_zeros(1, 0, t - tk)?;
            *acc = Some(match acc.take() {
                Some(a) => (a + part)?,
                None => part,
            });
            Ok(())
        };
        if want[2] {
            add(
                &mut dv,
                attention_backward_op(&Op::AttnGradV { kv_heads }, &[&p, &dyc], mask)?,
            )?;
        }
        if want[0] || want[1] {
            let ds = attention_backward_op(&Op::AttnGradScores, &[&p, &dyc, &vc], mask)?;
            drop(p);
            if want[0] {
                dq_parts.push(attention_backward_op(&Op::AttnGradQ, &[&ds, &kc], mask)?);
            }
            if want[1] {
                add(
                    &mut dk,
                    attention_backward_op(&Op::AttnGradK { kv_heads }, &[&ds, &qc], mask)?,
                )?;
            }
        }
    }
    let dq = if want[0] {
        Some(Tensor::cat(&dq_parts, 1)?)
    } else {
        None
    };
    let dk = dk.map(|x| x.to_dtype(k.dtype())).transpose()?;
    let dv = dv.map(|x| x.to_dtype(v.dtype())).transpose()?;
    Ok([dq, dk, dv])
}

/// The wide float type reductions run in: f64 stays f64, everything else uses f32.
fn wide(t: &Tensor) -> Result<Tensor> {
    Ok(if t.dtype() == CDType::F64 {
        t.clone()
    } else {
        t.to_dtype(CDType::F32)?
    })
}

fn dims(t: &TensorType) -> Vec<usize> {
    t.shape.dims().iter().map(|&d| d as usize).collect()
}

/// Applies `op` to `ins`, producing a tensor of type `out`.
/// An expert-group collective (`Op::is_expert_collective`) over `group`: the all-to-all
/// stream's steps run it without the compute stream's context.
/// A context-group collective (`Op::is_context_collective`) over `group`: ring
/// attention's keys and values gathered, or their gradients reduced.
pub fn apply_context(group: &ContextGroup, op: &Op, ins: &[&Tensor]) -> Result<Tensor> {
    let x = ins
        .first()
        .ok_or_else(|| ExecError::Internal(format!("{} takes one operand", op.name())))?;
    match op {
        Op::CpAllGather { layout, rotate } => group.all_gather(x, layout, *rotate),
        Op::CpReduceScatter { layout, rotate } => group.reduce_scatter(x, layout, *rotate),
        _ => Err(ExecError::Internal(format!(
            "{} is not a context-group collective",
            op.name()
        ))),
    }
}

pub fn apply_expert(group: &ExpertGroup, op: &Op, ins: &[&Tensor]) -> Result<Tensor> {
    let arg = |k: usize| {
        ins.get(k)
            .copied()
            .ok_or_else(|| ExecError::Internal(format!("{} takes {} operands, got {}", op.name(), k + 1, ins.len())))
    };
    match op {
        Op::MoeGatherIds { degree } => group.gather_ids(arg(0)?, *degree),
        Op::MoeDispatch { degree, experts, rows } => group.dispatch(arg(0)?, arg(1)?, *degree, *experts, *rows),
        Op::MoeCombine { degree, experts } => group.combine(arg(0)?, arg(1)?, *degree, *experts),
        _ => Err(ExecError::Internal(format!(
            "{} is not an expert-group collective",
            op.name()
        ))),
    }
}

pub fn apply(ctx: &Ctx, op: &Op, ins: &[&Tensor], out: &TensorType) -> Result<Tensor> {
    if ctx.native {
        if let Some(t) = native_op(ctx, op, ins, out)? {
            return Ok(t);
        }
    }
    let odims = dims(out);
    let t = match op {
        Op::Input { .. } | Op::Param { .. } => {
            return Err(ExecError::Internal(format!(
                "{} values are fed, not computed",
                op.name()
            )))
        }
        Op::Fill { value } => Tensor::ones(odims.as_slice(), cdtype(out.dtype), &ctx.device)?.affine(*value, 0.0)?,
        Op::Embedding => embedding(ins[0], ins[1], &odims)?,
        Op::Linear {
            layout,
            float8: Some(recipe),
            ..
        } => {
            // torchao's emulated Float8 linear: both operands cast and read back in f32, the
            // product in f32, then the output's dtype; the bias after, in high precision.
            let c = recipe.casts();
            let x = float8::cast_tensor(ins[0], c.output_input)?;
            let w = float8::cast_tensor(ins[1], c.output_weight_t.transposed())?;
            let y = linear(&x, &w, *layout, &odims)?.to_dtype(cdtype(out.dtype))?;
            match ins.get(2) {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            }
        }
        Op::Float8Cast { cast } => float8::cast_tensor(ins[0], *cast)?.to_dtype(cdtype(out.dtype))?,
        Op::Linear { layout, .. } => {
            let y = linear(ins[0], ins[1], *layout, &odims)?;
            match ins.get(2) {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            }
        }
        Op::MatMul => ins[0].contiguous()?.broadcast_matmul(&ins[1].contiguous()?)?,
        Op::Add | Op::Mul if ins[0].dims() == ins[1].dims() && fused::applies(&ins[..2]) => {
            fused::elementwise(ins[0], ins[1], matches!(op, Op::Mul))?
        }
        Op::Add => ins[0].broadcast_add(ins[1])?,
        Op::Mul => ins[0].broadcast_mul(ins[1])?,
        // The fused kernels have no f64 version; the composed ones (used for gradient checks) do.
        Op::RmsNorm { eps } if ins[0].dtype() == CDType::F64 => {
            candle_nn::ops::rms_norm_slow(ins[0], ins[1], *eps as f32)?
        }
        Op::RmsNorm { eps } => candle_nn::ops::rms_norm(&ins[0].contiguous()?, ins[1], *eps as f32)?,
        Op::LayerNorm { eps } if ins[0].dtype() == CDType::F64 => {
            candle_nn::ops::layer_norm_slow(ins[0], ins[1], ins[2], *eps as f32)?
        }
        Op::LayerNorm { eps } => candle_nn::ops::layer_norm(&ins[0].contiguous()?, ins[1], ins[2], *eps as f32)?,
        Op::Rope {
            theta,
            scaling,
            context,
        }
        | Op::RopeGrad {
            theta,
            scaling,
            context,
        } => {
            let (cos, sin) = ctx.rope_tables_of(*theta, scaling, *context, ins[0])?;
            // The inverse rotation (the gradient) is the rotation by minus the angle.
            let sin = if matches!(op, Op::RopeGrad { .. }) {
                sin.neg()?
            } else {
                sin
            };
            candle_nn::rotary_emb::rope_thd(&ins[0].contiguous()?, &cos, &sin)?
        }
        Op::Attention { causal, context } if fused::applies(&ins[..3]) => {
            attention::forward(ins[0], ins[1], ins[2], &ctx.mask(*causal, *context, ins[0].dim(1)?)?)?
        }
        Op::Attention { causal, context } => {
            let p = attn_probs(ins[0], ins[1], &ctx.mask(*causal, *context, ins[0].dim(1)?)?)?;
            let kv = ins[1].dim(2)?;
            // out[b, s, h, :] = sum_t p[b, h, s, t] v[b, t, kv(h), :]
            let o = grouped(&p, kv)?.matmul(&heads_first(ins[2])?)?;
            ungroup_heads(&o, ins[0].dim(2)?)?
        }
        Op::Silu if fused::applies(&[ins[0]]) => fused::silu(ins[0])?,
        Op::Silu => ins[0].silu()?,
        Op::Gelu => ins[0].gelu()?,
        Op::GeluErf => ins[0].gelu_erf()?,
        Op::Relu => ins[0].relu()?,
        Op::Sigmoid => sigmoid(ins[0])?,
        Op::Softmax { dim } => softmax(ins[0], *dim)?,
        Op::CrossEntropy if fused::applies(&[ins[0]]) => fused::cross_entropy(ins[0], ins[1])?,
        Op::CrossEntropy => cross_entropy(ins[0], ins[1])?,
        Op::Reshape { .. } => ins[0].reshape(odims.as_slice())?,
        Op::Transpose { dim0, dim1 } => ins[0].transpose(*dim0, *dim1)?,
        Op::Narrow { dim, start, len } => ins[0].narrow(*dim, *start as usize, *len as usize)?,
        Op::Concat { dim } => Tensor::cat(ins, *dim)?,
        Op::Cast { dtype } => ins[0].to_dtype(cdtype(*dtype))?,
        Op::Sum => ins[0].sum_all()?,
        Op::SumTo { .. } => sum_to(ins[0], &odims)?,
        Op::BroadcastTo { .. } => ins[0].broadcast_as(odims.as_slice())?,
        Op::WeightGrad { layout } => weight_grad(ins[0], ins[1], *layout)?,
        Op::EmbeddingGrad { .. } => embedding_grad(ins[0], ins[1], &odims)?,
        Op::RmsNormGrad { eps, wrt } if fused::applies(&[ins[0], ins[1], ins[2]]) => match wrt {
            NormWrt::Input => fused::rms_norm_grad_input(ins[0], ins[1], ins[2], *eps)?,
            NormWrt::Weight => fused::rms_norm_grad_weight(ins[0], ins[2], *eps)?,
        },
        Op::RmsNormGrad { eps, wrt } => rms_norm_grad(ins[0], ins[1], ins[2], *eps, *wrt)?,
        Op::LayerNormGrad { eps, wrt } => layer_norm_grad(ins[0], ins[1], ins[2], *eps, *wrt)?,
        Op::AttnProbs { causal, context } => {
            attention_backward_op(op, ins, &ctx.mask(*causal, *context, ins[0].dim(1)?)?)?
        }
        Op::AttnGradV { .. } | Op::AttnGradScores | Op::AttnGradQ | Op::AttnGradK { .. } => {
            attention_backward_op(op, ins, &Mask::Full)?
        }
        Op::SiluGrad | Op::GeluGrad if fused::applies(&[ins[0], ins[1]]) => {
            fused::activation_grad(ins[0], ins[1], matches!(op, Op::GeluGrad))?
        }
        Op::SiluGrad => {
            let (x, g) = (wide(ins[0])?, wide(ins[1])?);
            let s = candle_nn::ops::sigmoid(&x)?;
            let d = (&s * ((x * (1.0 - &s)?)? + 1.0)?)?;
            (g * d)?.to_dtype(ins[1].dtype())?
        }
        Op::GeluGrad => gelu_grad(ins[0], ins[1])?,
        Op::GeluErfGrad => {
            // d/dx x Phi(x) = Phi(x) + x phi(x).
            let (x, g) = (wide(ins[0])?, wide(ins[1])?);
            let cdf = ((&x * std::f64::consts::FRAC_1_SQRT_2)?.erf()? + 1.0)?.affine(0.5, 0.0)?;
            let pdf = (x.sqr()?.affine(-0.5, 0.0)?.exp()?
                * (0.5 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2))?;
            (g * (cdf + (x * pdf)?)?)?.to_dtype(ins[1].dtype())?
        }
        Op::ReluGrad => {
            let x = ins[0];
            (ins[1] * x.gt(&x.zeros_like()?)?.to_dtype(ins[1].dtype())?)?
        }
        Op::SigmoidGrad => {
            let s = wide(&sigmoid(ins[0])?)?;
            let slope = (&s * s.affine(-1.0, 1.0)?)?;
            (wide(ins[1])? * slope)?.to_dtype(ins[1].dtype())?
        }
        Op::SoftmaxGrad { dim } if *dim + 1 == ins[0].rank() && fused::applies(&[ins[0], ins[1]]) => {
            fused::softmax_backward(ins[0], ins[1])?
        }
        Op::SoftmaxGrad { dim } => {
            let (y, g) = (wide(ins[0])?, wide(ins[1])?);
            let dot = (&g * &y)?.sum_keepdim(*dim)?;
            (y * g.broadcast_sub(&dot)?)?.to_dtype(ins[1].dtype())?
        }
        Op::CrossEntropyGrad if fused::applies(&[ins[0]]) => fused::cross_entropy_grad(ins[0], ins[1], ins[2])?,
        Op::CrossEntropyGrad => cross_entropy_grad(ins[0], ins[1], ins[2])?,
        Op::Pad { dim, before, after } => ins[0].pad_with_zeros(*dim, *before as usize, *after as usize)?,
        Op::TpCopy { .. } => ins[0].clone(),
        Op::TpAllGather { dim, degree, .. } => ctx.tensor(op)?.all_gather(ins[0], *dim, *degree)?,
        Op::TpReduceScatter { dim, degree } => ctx.tensor(op)?.reduce_scatter(ins[0], *dim, *degree)?,
        Op::TpAllReduce { degree } => ctx.tensor(op)?.all_reduce(ins[0], *degree)?,
        Op::TpSlice { dim, degree } => ctx.tensor(op)?.slice(ins[0], *dim, *degree)?,
        Op::VocabEmbedding { degree } => ctx.tensor(op)?.embedding(ins[0], ins[1], &odims, *degree)?,
        Op::VocabEmbeddingGrad { vocab, degree } => {
            ctx.tensor(op)?
                .embedding_grad(ins[0], ins[1], *vocab as usize, *degree)?
        }
        Op::VocabCrossEntropy { degree } => ctx.tensor(op)?.cross_entropy(ins[0], ins[1], *degree)?,
        Op::VocabCrossEntropyGrad { degree } => ctx.tensor(op)?.cross_entropy_grad(ins[0], ins[1], ins[2], *degree)?,
        Op::CpAllGather { .. } | Op::CpReduceScatter { .. } => apply_context(ctx.context(op)?, op, ins)?,
        Op::MoeTopK { k, score } => moe::top_k(ins[0], *k as usize, *score)?,
        Op::MoeDrop { experts, capacity } => moe::drop_over_capacity(ins[0], *experts as usize, *capacity as usize)?,
        Op::MoeRouterWeights { score, norm } => moe::router_weights(ins[0], ins[1], *score, *norm)?,
        Op::MoeRouterWeightsGrad { score, norm } => moe::router_weights_grad(ins[0], ins[1], ins[2], *score, *norm)?,
        Op::MoePermute => moe::permute(ins[0], ins[1])?,
        Op::MoeUnpermute { sum } => moe::unpermute(ins[0], ins[1], *sum)?,
        Op::GroupedLinear { layout } => moe::grouped_linear(ins[0], ins[1], &ins[2..], *layout)?,
        Op::MoeGatherIds { .. } | Op::MoeDispatch { .. } | Op::MoeCombine { .. } => {
            apply_expert(ctx.expert(op)?, op, ins)?
        }
        Op::MoeLocalIds { degree, experts, rows } => ctx.expert(op)?.local_ids(ins[0], *degree, *experts, *rows)?,
        Op::GroupedWeightGrad {
            expert,
            experts,
            layout,
        } => moe::grouped_weight_grad(
            ins[0],
            ins[1],
            ins[2],
            *expert as usize,
            *experts as usize,
            *layout,
            &odims,
        )?,
        Op::MoeAuxLoss { top_k, coef } => moe::aux_loss(ins, *top_k as usize, *coef)?,
        Op::MoeAuxLossGrad { layer, top_k, coef } => {
            moe::aux_loss_grad(ins[0], &ins[1..], *layer, *top_k as usize, *coef)?
        }
    };
    Ok(t)
}

/// `op` on shardplan's own CUDA kernels ([`crate::gpu`]) where one takes its operands
/// (CUDA tensors of one dtype the kernel has); `None` leaves it to candle's ops.
pub(crate) fn native_op(ctx: &Ctx, op: &Op, ins: &[&Tensor], out: &TensorType) -> Result<Option<Tensor>> {
    use crate::gpu;
    let takes = |ts: &[&Tensor]| {
        ts.iter().all(|t| t.device().is_cuda() && gpu::takes(t.dtype()))
            && ts.windows(2).all(|w| w[0].dtype() == w[1].dtype())
    };
    let t = match op {
        Op::RmsNorm { eps } if takes(&ins[..2]) => gpu::rms_norm(ins[0], ins[1], *eps)?,
        Op::RmsNormGrad { eps, wrt } if takes(&ins[..3]) => {
            gpu::rms_norm_grad(ins[0], ins[1], ins[2], *eps, *wrt == NormWrt::Weight)?
        }
        Op::Silu if takes(&ins[..1]) => gpu::silu(ins[0])?,
        Op::SiluGrad if takes(&ins[..2]) => gpu::silu_grad(ins[0], ins[1])?,
        Op::Rope {
            theta,
            scaling,
            context,
        }
        | Op::RopeGrad {
            theta,
            scaling,
            context,
        } if takes(&ins[..1]) => {
            let (cos, sin) = ctx.rope_tables_of(*theta, scaling, *context, ins[0])?;
            gpu::rope(ins[0], &cos, &sin, matches!(op, Op::RopeGrad { .. }))?
        }
        Op::Attention { causal, context: None } if gpu::attention_applies(ins[0], ins[1], ins[2]) => {
            gpu::attention(ins[0], ins[1], ins[2], *causal)?.0
        }
        Op::CrossEntropy if takes(&ins[..1]) && ins[0].rank() == 2 => gpu::cross_entropy(ins[0], ins[1])?,
        Op::CrossEntropyGrad if takes(&ins[..1]) && ins[0].rank() == 2 => {
            gpu::cross_entropy_grad(ins[0], ins[1], ins[2])?
        }
        Op::EmbeddingGrad { .. } if takes(&ins[1..2]) && out.shape.rank() == 2 => {
            let d = dims(out);
            gpu::embedding_grad(ins[0], ins[1], d[0], d[1])?
        }
        _ => return Ok(None),
    };
    Ok(Some(t.to_dtype(cdtype(out.dtype))?))
}

fn embedding(table: &Tensor, ids: &Tensor, out: &[usize]) -> Result<Tensor> {
    let flat = ids.flatten_all()?;
    Ok(table.index_select(&flat, 0)?.reshape(out)?)
}

/// `1 / (1 + exp(-x))`, in f32 (or f64) and cast back.
fn sigmoid(x: &Tensor) -> Result<Tensor> {
    let w = wide(x)?;
    Ok(w.neg()?.exp()?.affine(1.0, 1.0)?.recip()?.to_dtype(x.dtype())?)
}

fn embedding_grad(ids: &Tensor, g: &Tensor, out: &[usize]) -> Result<Tensor> {
    let flat = ids.flatten_all()?;
    if fused::applies(&[g]) && flat.dtype() == CDType::U32 && out.len() == 2 {
        return fused::embedding_grad(&flat.to_vec1::<u32>()?, g, out[0], out[1]);
    }
    let g2 = wide(&rows(&g.contiguous()?)?)?;
    let zeros = Tensor::zeros(out, g2.dtype(), g.device())?;
    Ok(zeros.index_add(&flat, &g2, 0)?.to_dtype(g.dtype())?)
}

/// Sums `g` over the dims that broadcasting expanded, down to `out`.
fn sum_to(g: &Tensor, out: &[usize]) -> Result<Tensor> {
    let gd = g.dims().to_vec();
    let lead = gd.len() - out.len();
    let mut reduce: Vec<usize> = (0..lead).collect();
    for (i, &o) in out.iter().enumerate() {
        if o == 1 && gd[lead + i] != 1 {
            reduce.push(lead + i);
        }
    }
    let w = wide(g)?;
    let s = if reduce.is_empty() { w } else { w.sum_keepdim(reduce)? };
    Ok(s.reshape(out)?.to_dtype(g.dtype())?)
}

fn softmax(x: &Tensor, dim: usize) -> Result<Tensor> {
    let w = wide(x)?;
    let y = if dim + 1 == x.rank() {
        candle_nn::ops::softmax_last_dim(&w.contiguous()?)?
    } else {
        candle_nn::ops::softmax(&w, dim)?
    };
    Ok(y.to_dtype(x.dtype())?)
}

fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let n = logits.dim(0)?;
    let logp = candle_nn::ops::log_softmax(&wide(logits)?, D::Minus1)?;
    let picked = logp.gather(&targets.to_dtype(CDType::U32)?.reshape((n, 1))?, 1)?;
    Ok((picked.sum_all()? * (-1.0 / n as f64))?)
}

fn cross_entropy_grad(logits: &Tensor, targets: &Tensor, g: &Tensor) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    let w = wide(logits)?;
    let p = candle_nn::ops::softmax_last_dim(&w.contiguous()?)?;
    let idx = targets.to_dtype(CDType::U32)?.reshape((n, 1))?;
    let ones = Tensor::ones((n, 1), w.dtype(), w.device())?;
    let onehot = Tensor::zeros((n, v), w.dtype(), w.device())?.scatter_add(&idx, &ones, 1)?;
    let scale = g.to_dtype(w.dtype())?.affine(1.0 / n as f64, 0.0)?;
    Ok((p - onehot)?.broadcast_mul(&scale)?.to_dtype(logits.dtype())?)
}

fn gelu_grad(x: &Tensor, g: &Tensor) -> Result<Tensor> {
    const C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
    const A: f64 = 0.044_715;
    let xw = wide(x)?;
    let x2 = xw.sqr()?;
    let u = ((&xw * (x2.affine(A, 1.0))?)? * C)?;
    let t = u.tanh()?;
    let left = (t.affine(0.5, 0.5))?;
    let sech2 = (1.0 - t.sqr()?)?;
    let right = ((&xw * sech2)? * x2.affine(3.0 * A * C * 0.5, 0.5 * C)?)?;
    Ok((wide(g)? * (left + right)?)?.to_dtype(g.dtype())?)
}

fn rms_norm_grad(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64, wrt: NormWrt) -> Result<Tensor> {
    let (xw, ww, gw) = (wide(x)?, wide(w)?, wide(g)?);
    let r = (xw.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    let xhat = xw.broadcast_mul(&r)?;
    let out = match wrt {
        NormWrt::Weight => sum_to(&(&gw * &xhat)?, w.dims())?,
        NormWrt::Input => {
            let gwt = gw.broadcast_mul(&ww)?;
            let m = (&gwt * &xhat)?.mean_keepdim(D::Minus1)?;
            (gwt - xhat.broadcast_mul(&m)?)?.broadcast_mul(&r)?
        }
    };
    Ok(out.to_dtype(g.dtype())?)
}

fn layer_norm_grad(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64, wrt: NormWrt) -> Result<Tensor> {
    let (xw, ww, gw) = (wide(x)?, wide(w)?, wide(g)?);
    let centered = xw.broadcast_sub(&xw.mean_keepdim(D::Minus1)?)?;
    let r = (centered.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    let xhat = centered.broadcast_mul(&r)?;
    let out = match wrt {
        NormWrt::Weight => sum_to(&(&gw * &xhat)?, w.dims())?,
        NormWrt::Input => {
            let gwt = gw.broadcast_mul(&ww)?;
            let m1 = gwt.mean_keepdim(D::Minus1)?;
            let m2 = (&gwt * &xhat)?.mean_keepdim(D::Minus1)?;
            gwt.broadcast_sub(&m1)?
                .sub(&xhat.broadcast_mul(&m2)?)?
                .broadcast_mul(&r)?
        }
    };
    Ok(out.to_dtype(g.dtype())?)
}

/// `[b, s, h, d] -> [b, h, s, d]`, contiguous (and back: the same swap).
fn heads_first(x: &Tensor) -> Result<Tensor> {
    if fused::applies(&[x]) {
        return fused::swap_dims_1_2(x);
    }
    Ok(x.transpose(1, 2)?.contiguous()?)
}

/// `[b, h, s, x] -> [b, kv, (h / kv) * s, x]`: the query heads sharing one k/v head,
/// stacked, so grouped-query attention is one batched matmul per k/v head.
fn grouped(t: &Tensor, kv: usize) -> Result<Tensor> {
    let (b, h, s, x) = t.dims4()?;
    Ok(t.contiguous()?.reshape((b, kv, (h / kv) * s, x))?)
}

/// Inverse of [`grouped`]: `[b, kv, g * s, x] -> [b, h, s, x]`.
fn ungroup(t: &Tensor, h: usize) -> Result<Tensor> {
    let (b, kv, gs, x) = t.dims4()?;
    Ok(t.reshape((b, h, gs * kv / h, x))?)
}

/// `[b, kv, g * s, d] -> [b, s, h, d]`.
fn ungroup_heads(t: &Tensor, h: usize) -> Result<Tensor> {
    heads_first(&ungroup(t, h)?)
}

/// Softmax of the scaled scores: `(q [b, s, h, d], k [b, t, kv, d]) -> [b, h, s, t]`.
/// The additive mask of `s` queries against `t` keys: query i sees keys
/// `0..mask.keys(i, s, t)`.
fn additive_mask(mask: &Mask, s: usize, t: usize, dtype: CDType, device: &Device) -> Result<Tensor> {
    if *mask == Mask::Causal {
        return causal_mask(s, t, dtype, device);
    }
    let m: Vec<f32> = (0..s)
        .flat_map(|i| {
            let n = mask.keys(i, s, t);
            (0..t).map(move |j| if j >= n { f32::NEG_INFINITY } else { 0.0 })
        })
        .collect();
    Ok(Tensor::from_vec(m, (s, t), device)?.to_dtype(dtype)?)
}

/// The additive causal mask of `s` queries (aligned to the end of `t` keys): query i sees
/// keys 0..=i + t - s. Made once per shape, dtype and device, then reused: on a GPU,
/// building it on the host and copying it every call cost as much as the attention.
fn causal_mask(s: usize, t: usize, dtype: CDType, device: &Device) -> Result<Tensor> {
    type Key = (usize, usize, CDType, candle_core::DeviceLocation);
    static MASKS: std::sync::Mutex<Vec<(Key, Tensor)>> = std::sync::Mutex::new(Vec::new());
    let key = (s, t, dtype, device.location());
    let mut masks = MASKS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, m)) = masks.iter().find(|(k, _)| *k == key) {
        return Ok(m.clone());
    }
    let offset = t as i64 - s as i64;
    let mask: Vec<f32> = (0..s as i64)
        .flat_map(|i| (0..t as i64).map(move |j| if j > i + offset { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (s, t), device)?.to_dtype(dtype)?;
    // A handful of shapes per run; a bound keeps a long-lived process from hoarding them.
    if masks.len() >= 8 {
        masks.remove(0);
    }
    masks.push((key, mask.clone()));
    Ok(mask)
}

fn attn_probs(q: &Tensor, k: &Tensor, mask: &Mask) -> Result<Tensor> {
    let (_, s, h, d) = q.dims4()?;
    let (_, t, kv, _) = k.dims4()?;
    let scale = 1.0 / (d as f64).sqrt();
    let qg = grouped(&heads_first(q)?, kv)?;
    // A transposed operand is passed to the matmul as strides, not copied.
    let kt = heads_first(k)?.transpose(2, 3)?;
    let scores = ungroup(&qg.matmul(&kt)?, h)?;
    if fused::applies(&[&scores]) {
        return fused::masked_softmax(&scores, scale, mask);
    }
    let mut w = wide(&scores)?.affine(scale, 0.0)?;
    if !mask.is_full() {
        w = w.broadcast_add(&additive_mask(mask, s, t, w.dtype(), q.device())?)?;
    }
    Ok(candle_nn::ops::softmax_last_dim(&w.contiguous()?)?.to_dtype(q.dtype())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(op: Op, ins: &[&Tensor]) -> Vec<f64> {
        let ty = TensorType::new(DType::F64, [ins[0].elem_count() as u64]);
        apply(&Ctx::new(Device::Cpu), &op, ins, &ty)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
    }

    #[test]
    fn exact_gelu_relu_and_their_gradients_take_their_textbook_values() {
        // x Phi(x), its tanh approximation, and d/dx x Phi(x), from Python's math.erf.
        let xs = [1.0, -0.5, 2.0, -3.0];
        let exact = [
            0.8413447460685429,
            -0.15426876936299344,
            1.9544997361036416,
            -0.00404969409489031,
        ];
        let tanh = [
            0.8411919906082768,
            -0.15428599017485606,
            1.954597694087775,
            -0.0036373920817729943,
        ];
        let slope = [
            1.0833154705876864,
            0.13250487534383712,
            1.085231801078197,
            -0.011945647204183918,
        ];
        let x = Tensor::new(&xs, &Device::Cpu).unwrap();
        let ones = Tensor::ones(4, CDType::F64, &Device::Cpu).unwrap();
        let close = |a: &[f64], b: &[f64], tol: f64| a.iter().zip(b).all(|(a, b)| (a - b).abs() < tol);
        assert!(
            close(&run(Op::GeluErf, &[&x]), &exact, 1e-12),
            "{:?}",
            run(Op::GeluErf, &[&x])
        );
        assert!(close(&run(Op::Gelu, &[&x]), &tanh, 1e-12), "{:?}", run(Op::Gelu, &[&x]));
        assert!(close(&run(Op::GeluErfGrad, &[&x, &ones]), &slope, 1e-12));
        assert_eq!(run(Op::Relu, &[&x]), vec![1.0, 0.0, 2.0, 0.0]);
        let g = Tensor::new(&[3.0f64, 3.0, 3.0, 3.0], &Device::Cpu).unwrap();
        assert_eq!(run(Op::ReluGrad, &[&x, &g]), vec![3.0, 0.0, 3.0, 0.0]);
        // At 0 the gradient is 0, as torch's.
        let z = Tensor::new(&[0.0f64], &Device::Cpu).unwrap();
        let one = Tensor::new(&[1.0f64], &Device::Cpu).unwrap();
        assert_eq!(run(Op::ReluGrad, &[&z, &one]), vec![0.0]);
        let s: Vec<f64> = [1.0f64, -0.5, 2.0, -3.0]
            .iter()
            .map(|v| 1.0 / (1.0 + (-v).exp()))
            .collect();
        assert!(
            close(&run(Op::Sigmoid, &[&x]), &s, 1e-12),
            "{:?}",
            run(Op::Sigmoid, &[&x])
        );
        let ds: Vec<f64> = s.iter().map(|s| 3.0 * s * (1.0 - s)).collect();
        assert!(close(&run(Op::SigmoidGrad, &[&x, &g]), &ds, 1e-12));
    }

    #[test]
    fn the_causal_mask_hides_later_keys_and_is_made_once_per_shape() {
        let m = causal_mask(2, 3, CDType::F32, &Device::Cpu).unwrap();
        let inf = f32::NEG_INFINITY;
        // Two queries aligned to the end of three keys: query 0 sees keys 0-1, query 1 all.
        assert_eq!(
            m.to_vec2::<f32>().unwrap(),
            vec![vec![0.0, 0.0, inf], vec![0.0, 0.0, 0.0]]
        );
        let again = causal_mask(2, 3, CDType::F32, &Device::Cpu).unwrap();
        assert_eq!(again.id(), m.id(), "a second call reuses the first mask");
        let b = causal_mask(2, 3, CDType::BF16, &Device::Cpu).unwrap();
        assert_eq!(b.dtype(), CDType::BF16);
        assert_ne!(b.id(), m.id());
    }

    #[test]
    fn blockwise_attention_backward_equals_the_materialised_one() {
        use candle_core::DType as CD;
        // s = t = 100 in blocks of 32 (a partial last block); GQA (4 query heads on 2 k/v
        // heads) and MHA; causal, full, and a context rank's head and tail rows (rank 1 of
        // 2: positions 50..100 and 200..250 of 400 keys); f32 (the fused kernels) and f64
        // (the composed ones).
        let layout = shardplan_ir::ContextLayout {
            degree: 2,
            balance: shardplan_ir::ContextBalance::HeadTail,
        };
        for (dtype, tol) in [(CD::F32, 1e-5), (CD::F64, 1e-12)] {
            for (h, kv) in [(4usize, 2usize), (2, 2)] {
                for (mask, t) in [
                    (Mask::Causal, 100),
                    (Mask::Full, 100),
                    (Mask::of(true, Some(layout), 1, 100), 200),
                ] {
                    let (b, s, d) = (2usize, 100usize, 8usize);
                    let dev = Device::Cpu;
                    let r = |n: &[usize]| Tensor::randn(0f32, 1.0, n, &dev).unwrap().to_dtype(dtype).unwrap();
                    let (q, k, v, dy) = (r(&[b, s, h, d]), r(&[b, t, kv, d]), r(&[b, t, kv, d]), r(&[b, s, h, d]));
                    let kv_heads = kv as u64;
                    let probs = Op::AttnProbs {
                        causal: !mask.is_full(),
                        context: None,
                    };
                    let p = attention_backward_op(&probs, &[&q, &k], &mask).unwrap();
                    let dv = attention_backward_op(&Op::AttnGradV { kv_heads }, &[&p, &dy], &mask).unwrap();
                    let ds = attention_backward_op(&Op::AttnGradScores, &[&p, &dy, &v], &mask).unwrap();
                    let dq = attention_backward_op(&Op::AttnGradQ, &[&ds, &k], &mask).unwrap();
                    let dk = attention_backward_op(&Op::AttnGradK { kv_heads }, &[&ds, &q], &mask).unwrap();
                    let causal = !mask.is_full();
                    // Blocks of 32 to 1000 rows, and the public entry (f32: the fused pass).
                    for rows in [32, 64, 100, 1000, 0] {
                        let got = if rows == 0 {
                            attention_backward_blockwise(&q, &k, &v, &dy, &mask, [true, true, true]).unwrap()
                        } else {
                            blockwise_in_rows(&q, &k, &v, &dy, &mask, [true, true, true], rows).unwrap()
                        };
                        for (name, want, got) in [("dq", &dq, &got[0]), ("dk", &dk, &got[1]), ("dv", &dv, &got[2])] {
                            let got = got.as_ref().unwrap();
                            assert_eq!(got.dims(), want.dims(), "{name}");
                            assert_eq!(got.dtype(), want.dtype(), "{name}");
                            let err = (got - want)
                                .unwrap()
                                .abs()
                                .unwrap()
                                .flatten_all()
                                .unwrap()
                                .max(0)
                                .unwrap()
                                .to_dtype(CD::F64)
                                .unwrap()
                                .to_scalar::<f64>()
                                .unwrap();
                            assert!(
                                err <= tol,
                                "{name} differs by {err} (h {h}, kv {kv}, causal {causal}, rows {rows}, {dtype:?})"
                            );
                        }
                    }
                    // Only what is asked for is made.
                    let only_v = blockwise_in_rows(&q, &k, &v, &dy, &mask, [false, false, true], 32).unwrap();
                    assert!(only_v[0].is_none() && only_v[1].is_none() && only_v[2].is_some());
                }
            }
        }
    }

    #[test]
    fn the_in_place_cross_entropy_gradient_equals_the_out_of_place_one() {
        let dev = Device::Cpu;
        // 300 x 50 crosses the fused kernels' parallel threshold; 3 x 7 stays below it.
        for (n, v) in [(3usize, 7usize), (300, 50)] {
            let logits = Tensor::randn(0f32, 3.0, (n, v), &dev).unwrap();
            let targets =
                Tensor::from_vec((0..n as u32).map(|i| (i * 7) % v as u32).collect::<Vec<_>>(), n, &dev).unwrap();
            let g = Tensor::new(0.5f32, &dev).unwrap();
            let want = fused::cross_entropy_grad(&logits, &targets, &g).unwrap();
            let owned = logits.copy().unwrap();
            fused::cross_entropy_grad_in_place(&owned, &targets, &g).unwrap();
            assert_eq!(
                owned.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                "{n} x {v}"
            );
        }
    }
}
