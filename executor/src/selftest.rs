//! `shardplan gpu-selftest`: every kernel of [`crate::gpu`] against its CPU twin on random
//! inputs and edge shapes (sequence lengths off the tile, every grouped-query ratio of the
//! presets, head dims 64 and 128, vocabularies of 256 and 128,256, one and several
//! sequences), each case's worst error against its stated tolerance, and the kernel's time.
//!
//! A case is run by two [`Backend`]s on the same inputs (drawn in f32 and rounded through
//! the case's storage dtype first, so both see identical values): the device under test and
//! the reference. On a GPU those are [`Native`] (shardplan's CUDA kernels) and [`Twin`]
//! (the CPU executor's f32 kernels). The CPU test suite runs the same cases with the twin
//! under test against [`Composed`] (candle's composed ops in f64), which checks the twins
//! and the harness on every machine.

use crate::adamw::AdamW;
use crate::cpu::kernels::{self, Ctx};
use crate::ExecError;
use candle_core::{DType as CDType, Device, Tensor, D};
use shardplan_ir::{DType, Op, TensorType};
use std::time::Instant;

mod cases;

pub use cases::cases;

type Result<T> = std::result::Result<T, ExecError>;

/// Storage dtype of a case's floating-point inputs on the device under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    Bf16,
    F32,
}

impl Precision {
    fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::F32 => "f32",
        }
    }

    /// The stated tolerance: the worst absolute error over the largest reference magnitude.
    /// bf16 keeps 8 bits of mantissa (a rounding is up to 2^-9 of the value; a kernel's
    /// output carries a few of them); f32 math in another order (atomics, fast exp) agrees
    /// to a few 1e-6.
    pub fn tolerance(self) -> f64 {
        match self {
            Precision::Bf16 => 2e-2,
            Precision::F32 => 1e-4,
        }
    }
}

/// One integer-or-float operand of an op case.
#[derive(Clone, Debug)]
enum Input {
    /// Values in [-scale, scale].
    Float(Vec<usize>, f32),
    /// Ids in [0, max).
    Ids(Vec<usize>, u32),
    /// A float scalar.
    Scalar(f32),
}

#[derive(Clone, Debug)]
enum Kind {
    Op {
        op: Op,
        inputs: Vec<Input>,
    },
    Attention {
        b: usize,
        s: usize,
        h: usize,
        kv: usize,
        d: usize,
        causal: bool,
    },
    SumSquares {
        lens: Vec<usize>,
    },
    AdamW {
        n: usize,
        factor: Option<f64>,
    },
}

/// One self-test case.
#[derive(Clone, Debug)]
pub struct Case {
    pub kernel: &'static str,
    pub label: String,
    pub precision: Precision,
    kind: Kind,
}

/// The figures of one output of one case.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CaseResult {
    pub kernel: String,
    pub case: String,
    pub output: String,
    pub dtype: &'static str,
    /// Worst absolute error over the largest reference magnitude.
    pub worst: f64,
    pub tolerance: f64,
    /// Milliseconds per call of the device under test (its stream synchronised), when timed.
    pub ms: Option<f64>,
    pub pass: bool,
    /// Why the case could not run, when it could not.
    pub error: Option<String>,
}

/// Everything a self-test found.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    pub under_test: String,
    pub reference: String,
    pub results: Vec<CaseResult>,
}

impl Report {
    pub fn passed(&self) -> bool {
        !self.results.is_empty() && self.results.iter().all(|r| r.pass)
    }

    /// One line per output of each case, then a summary line.
    pub fn text(&self) -> String {
        let mut s = format!(
            "{} against {}\n{:<16} {:<34} {:<8} {:<6} {:>10} {:>9} {:>10}  result\n",
            self.under_test, self.reference, "kernel", "case", "output", "dtype", "worst", "tol", "ms/call"
        );
        for r in &self.results {
            let ms = r.ms.map_or("-".to_string(), |m| format!("{m:.4}"));
            let verdict = match &r.error {
                Some(e) => format!("ERROR {e}"),
                None if r.pass => "ok".to_string(),
                None => "MISS".to_string(),
            };
            s += &format!(
                "{:<16} {:<34} {:<8} {:<6} {:>10.3e} {:>9.1e} {:>10}  {verdict}\n",
                r.kernel, r.case, r.output, r.dtype, r.worst, r.tolerance, ms
            );
        }
        let missed = self.results.iter().filter(|r| !r.pass).count();
        s += &format!(
            "{} outputs checked, {} within tolerance, {missed} missed\n",
            self.results.len(),
            self.results.len() - missed
        );
        s
    }
}

/// Runs the kernels a case needs. Inputs arrive as CPU f32 tensors already rounded through
/// the case's precision; [`Backend::put`] places them.
pub trait Backend {
    fn name(&self) -> String;
    /// `t` (CPU f32) where and as this backend computes: `float` says it is a float operand
    /// stored at `precision`.
    fn put(&self, t: &Tensor, float: bool, precision: Precision) -> Result<Tensor>;
    fn op(&self, op: &Op, ins: &[&Tensor], out: &TensorType) -> Result<Tensor>;
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<(Tensor, Tensor)>;
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        dy: &Tensor,
        lse: &Tensor,
        causal: bool,
    ) -> Result<[Tensor; 3]>;
    fn sum_squares(&self, parts: &[(Tensor, f64)], scale: f64) -> Result<f64>;
    #[allow(clippy::too_many_arguments)]
    fn adamw(
        &self,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        factor: Option<f64>,
        h: AdamW,
    ) -> Result<[Tensor; 3]>;
    /// Waits for queued work (timing).
    fn sync(&self) -> Result<()>;
    /// Whether this backend's calls are timed.
    fn timed(&self) -> bool;
}

/// The log-sum-exp of each row of scaled (and causally masked) scores, `[b, h, s]`, from
/// candle's ops in `q`'s dtype: the reference the forward's statistics are checked against.
pub fn attention_lse(q: &Tensor, k: &Tensor, causal: bool) -> Result<Tensor> {
    let (b, s, h, d) = q.dims4()?;
    let (_, t, kv, _) = k.dims4()?;
    let group = h / kv.max(1);
    let qh = q.transpose(1, 2)?.contiguous()?; // [b, h, s, d]
    let kh = k.transpose(1, 2)?.contiguous()?; // [b, kv, t, d]
    let kh = kh
        .unsqueeze(2)?
        .broadcast_as((b, kv, group, t, d))?
        .reshape((b, h, t, d))?
        .contiguous()?;
    let scores = (qh.matmul(&kh.transpose(2, 3)?.contiguous()?)? * (1.0 / (d as f64).sqrt()))?;
    let scores = if causal {
        let mask: Vec<f32> = (0..s)
            .flat_map(|i| (0..t).map(move |j| if j + s > i + t { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (s, t), q.device())?.to_dtype(q.dtype())?;
        scores.broadcast_add(&mask)?
    } else {
        scores
    };
    let m = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?;
    Ok((e.log()? + m)?.squeeze(D::Minus1)?)
}

/// The CPU executor's f32 kernels: the twins.
pub struct Twin {
    ctx: Ctx,
}

impl Default for Twin {
    fn default() -> Self {
        Twin {
            ctx: Ctx::new(Device::Cpu),
        }
    }
}

impl Backend for Twin {
    fn name(&self) -> String {
        "CPU twins (the executor's f32 kernels)".into()
    }
    fn put(&self, t: &Tensor, _float: bool, _p: Precision) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn op(&self, op: &Op, ins: &[&Tensor], out: &TensorType) -> Result<Tensor> {
        kernels::apply(
            &self.ctx,
            op,
            ins,
            &TensorType::new(f32_of(out.dtype), out.shape.clone()),
        )
    }
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<(Tensor, Tensor)> {
        let out = TensorType::new(
            DType::F32,
            shardplan_ir::Shape::new(q.dims().iter().map(|&d| d as u64).collect::<Vec<_>>()),
        );
        let o = kernels::apply(&self.ctx, &Op::Attention { causal, context: None }, &[q, k, v], &out)?;
        Ok((o, attention_lse(q, k, causal)?))
    }
    fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _o: &Tensor,
        dy: &Tensor,
        _lse: &Tensor,
        causal: bool,
    ) -> Result<[Tensor; 3]> {
        let [dq, dk, dv] =
            kernels::attention_backward_blockwise(q, k, v, dy, &kernels::Mask::of(causal, None, 0, 0), [true; 3])?;
        let missing = || ExecError::Internal("the blockwise attention backward made no gradient".into());
        Ok([
            dq.ok_or_else(missing)?,
            dk.ok_or_else(missing)?,
            dv.ok_or_else(missing)?,
        ])
    }
    fn sum_squares(&self, parts: &[(Tensor, f64)], scale: f64) -> Result<f64> {
        let mut total = 0.0;
        for (t, w) in parts {
            total += crate::cpu::fused::sum_squares(t)? * w;
        }
        Ok(total * scale * scale)
    }
    fn adamw(
        &self,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        factor: Option<f64>,
        h: AdamW,
    ) -> Result<[Tensor; 3]> {
        let h = AdamW {
            grad_scale: (factor.unwrap_or(1.0) * f64::from(h.grad_scale)) as f32,
            ..h
        };
        let (np, nm, nv) = crate::cpu::fused::adamw(p, g, Some(m), Some(v), h)?;
        Ok([np, nm, nv])
    }
    fn sync(&self) -> Result<()> {
        Ok(())
    }
    fn timed(&self) -> bool {
        false
    }
}

fn f32_of(d: DType) -> DType {
    if d.is_float() {
        DType::F32
    } else {
        d
    }
}

/// candle's composed ops in f64 on the CPU: the reference that checks the twins in the CPU
/// test suite (the kernels take their composed, non-fused paths for f64).
pub struct Composed {
    ctx: Ctx,
}

impl Default for Composed {
    fn default() -> Self {
        Composed {
            ctx: Ctx::new(Device::Cpu),
        }
    }
}

impl Backend for Composed {
    fn name(&self) -> String {
        "candle's composed ops in f64".into()
    }
    fn put(&self, t: &Tensor, float: bool, _p: Precision) -> Result<Tensor> {
        Ok(if float { t.to_dtype(CDType::F64)? } else { t.clone() })
    }
    fn op(&self, op: &Op, ins: &[&Tensor], out: &TensorType) -> Result<Tensor> {
        let dtype = if out.dtype.is_float() { DType::F64 } else { out.dtype };
        kernels::apply(&self.ctx, op, ins, &TensorType::new(dtype, out.shape.clone()))
    }
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<(Tensor, Tensor)> {
        let out = TensorType::new(
            DType::F64,
            shardplan_ir::Shape::new(q.dims().iter().map(|&d| d as u64).collect::<Vec<_>>()),
        );
        let o = kernels::apply(&self.ctx, &Op::Attention { causal, context: None }, &[q, k, v], &out)?;
        Ok((o, attention_lse(q, k, causal)?))
    }
    fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        dy: &Tensor,
        lse: &Tensor,
        causal: bool,
    ) -> Result<[Tensor; 3]> {
        Twin::default().attention_backward(q, k, v, o, dy, lse, causal)
    }
    fn sum_squares(&self, parts: &[(Tensor, f64)], scale: f64) -> Result<f64> {
        let mut total = 0.0;
        for (t, w) in parts {
            total += t.sqr()?.sum_all()?.to_scalar::<f64>()? * w;
        }
        Ok(total * scale * scale)
    }
    fn adamw(
        &self,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        factor: Option<f64>,
        h: AdamW,
    ) -> Result<[Tensor; 3]> {
        let (b1, b2) = (f64::from(h.beta1), f64::from(h.beta2));
        let g = (g * (factor.unwrap_or(1.0) * f64::from(h.grad_scale)))?;
        let m = ((m * b1)? + (&g * (1.0 - b1))?)?;
        let v = ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
        let update = ((&m / f64::from(h.bias1))? / ((&v / f64::from(h.bias2))?.sqrt()? + f64::from(h.eps))?)?;
        let lr = f64::from(h.lr);
        let p = ((p * (1.0 - lr * f64::from(h.weight_decay)))? - (update * lr)?)?;
        Ok([p, m, v])
    }
    fn sync(&self) -> Result<()> {
        Ok(())
    }
    fn timed(&self) -> bool {
        false
    }
}

/// shardplan's CUDA kernels on a CUDA device (bf16 or f32 storage as the case says).
pub struct Native {
    ctx: Ctx,
}

impl Native {
    /// The device under test; `device` must be a CUDA device.
    pub fn new(device: Device) -> Result<Self> {
        if !device.is_cuda() {
            return Err(ExecError::Unsupported("the GPU self-test needs a CUDA device".into()));
        }
        let mut ctx = Ctx::new(device);
        ctx.native = true;
        Ok(Native { ctx })
    }
}

impl Backend for Native {
    fn name(&self) -> String {
        "shardplan's CUDA kernels".into()
    }
    fn put(&self, t: &Tensor, float: bool, p: Precision) -> Result<Tensor> {
        let t = match (float, p) {
            (true, Precision::Bf16) => t.to_dtype(CDType::BF16)?,
            _ => t.clone(),
        };
        Ok(t.to_device(&self.ctx.device)?)
    }
    fn op(&self, op: &Op, ins: &[&Tensor], out: &TensorType) -> Result<Tensor> {
        let dtype = if out.dtype.is_float() {
            crate::cpu::kernels::ir_dtype(
                ins.iter()
                    .find(|t| t.dtype().is_float())
                    .map_or(CDType::F32, |t| t.dtype()),
            )
        } else {
            out.dtype
        };
        kernels::native_op(&self.ctx, op, ins, &TensorType::new(dtype, out.shape.clone()))?
            .ok_or_else(|| ExecError::Internal(format!("no CUDA kernel of shardplan's took {} here", op.name())))
    }
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<(Tensor, Tensor)> {
        crate::gpu::attention(q, k, v, causal)
    }
    fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        dy: &Tensor,
        lse: &Tensor,
        causal: bool,
    ) -> Result<[Tensor; 3]> {
        crate::gpu::attention_backward(q, k, v, o, dy, lse, causal)
    }
    fn sum_squares(&self, parts: &[(Tensor, f64)], scale: f64) -> Result<f64> {
        let parts: Vec<(Tensor, f64)> = parts
            .iter()
            .map(|(t, w)| Ok((t.to_dtype(CDType::F32)?, *w)))
            .collect::<Result<_>>()?;
        Ok(crate::gpu::sum_squares(&parts, scale)?.to_vec1::<f64>()?[0])
    }
    fn adamw(
        &self,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        factor: Option<f64>,
        h: AdamW,
    ) -> Result<[Tensor; 3]> {
        let f = factor.map(|f| Tensor::new(&[f], &self.ctx.device)).transpose()?;
        let f32s = |t: &Tensor| t.to_dtype(CDType::F32);
        let (np, nm, nv) = crate::gpu::adamw(&f32s(p)?, &f32s(g)?, Some(&f32s(m)?), Some(&f32s(v)?), f.as_ref(), h)?;
        Ok([np, nm, nv])
    }
    fn sync(&self) -> Result<()> {
        crate::gpu::synchronize(&self.ctx.device)
    }
    fn timed(&self) -> bool {
        true
    }
}

/// Deterministic inputs: the initialiser's counter-based uniforms (`init::uniform`),
/// element after element of one stream per case.
struct Rng {
    seed: u64,
    next: u64,
}

impl Rng {
    fn new(seed: u64) -> Self {
        Rng { seed, next: 0 }
    }
    /// A uniform in (0, 1).
    fn unit(&mut self) -> f64 {
        self.next += 1;
        crate::init::uniform(self.seed, 0, self.next)
    }
    fn uniform(&mut self, scale: f32) -> f32 {
        ((self.unit() * 2.0 - 1.0) * f64::from(scale)) as f32
    }
    /// f32 values rounded through `p`, as a CPU f32 tensor.
    fn floats(&mut self, dims: &[usize], scale: f32, p: Precision) -> Result<Tensor> {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n).map(|_| self.uniform(scale)).collect();
        let t = Tensor::from_vec(v, dims, &Device::Cpu)?;
        Ok(match p {
            Precision::Bf16 => t.to_dtype(CDType::BF16)?.to_dtype(CDType::F32)?,
            Precision::F32 => t,
        })
    }
    fn ids(&mut self, dims: &[usize], max: u32) -> Result<Tensor> {
        let n: usize = dims.iter().product();
        let max = max.max(1);
        let v: Vec<u32> = (0..n)
            .map(|_| ((self.unit() * f64::from(max)) as u32).min(max - 1))
            .collect();
        Ok(Tensor::from_vec(v, dims, &Device::Cpu)?)
    }
}

/// Worst `|a - b|` over the largest `|b|` (`b` the reference), both read as f64.
pub fn worst_error(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a
        .to_device(&Device::Cpu)?
        .to_dtype(CDType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let b = b
        .to_device(&Device::Cpu)?
        .to_dtype(CDType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    if a.len() != b.len() {
        return Err(ExecError::Internal(format!(
            "{} elements against {} in the reference",
            a.len(),
            b.len()
        )));
    }
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    let mut worst = 0f64;
    for (x, y) in a.iter().zip(&b) {
        let e = (x - y).abs();
        // A NaN anywhere is the worst error there is.
        worst = if e.is_nan() { f64::INFINITY } else { worst.max(e) };
    }
    Ok(worst / scale)
}

/// Runs `f` once to warm up, then `reps` times between synchronisations: milliseconds per call.
fn time<T>(be: &dyn Backend, reps: usize, mut f: impl FnMut() -> Result<T>) -> Result<(T, Option<f64>)> {
    let first = f()?;
    be.sync()?;
    if !be.timed() || reps == 0 {
        return Ok((first, None));
    }
    let start = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    be.sync()?;
    Ok((first, Some(start.elapsed().as_secs_f64() * 1e3 / reps as f64)))
}

/// Runs one case on both backends: one result per output.
pub fn run_case(case: &Case, dut: &dyn Backend, reference: &dyn Backend, reps: usize, seed: u64) -> Vec<CaseResult> {
    let outputs: Vec<&str> = match &case.kind {
        Kind::Op { .. } | Kind::SumSquares { .. } => vec!["out"],
        Kind::Attention { .. } => vec!["o", "lse", "dq", "dk", "dv"],
        Kind::AdamW { .. } => vec!["p", "m", "v"],
    };
    let result = |output: &str, worst: f64, ms: Option<f64>, error: Option<String>| {
        let tolerance = case.precision.tolerance();
        CaseResult {
            kernel: case.kernel.to_string(),
            case: case.label.clone(),
            output: output.to_string(),
            dtype: case.precision.name(),
            worst,
            tolerance,
            ms,
            pass: error.is_none() && worst <= tolerance,
            error,
        }
    };
    match compare(case, dut, reference, reps, seed) {
        Ok((worsts, ms)) => worsts
            .into_iter()
            .zip(&outputs)
            .map(|(w, o)| result(o, w, ms, None))
            .collect(),
        Err(e) => vec![result(outputs[0], f64::INFINITY, None, Some(e.to_string()))],
    }
}

/// Runs one case on both backends on the same inputs: each output's worst error, and the
/// device under test's milliseconds per call when timed.
fn compare(
    case: &Case,
    dut: &dyn Backend,
    reference: &dyn Backend,
    reps: usize,
    seed: u64,
) -> Result<(Vec<f64>, Option<f64>)> {
    let mut trial = Trial {
        dut,
        reference,
        reps,
        p: case.precision,
        rng: Rng::new(seed),
    };
    match &case.kind {
        Kind::Op { op, inputs } => trial.op(case, op, inputs),
        Kind::Attention { b, s, h, kv, d, causal } => trial.attention([*b, *s, *h, *kv, *d], *causal),
        Kind::SumSquares { lens } => trial.sum_squares(lens),
        Kind::AdamW { n, factor } => trial.adamw(*n, *factor),
    }
}

/// One case's run: the backend under test and the reference, the timed repetitions, and
/// the case's input precision and random stream.
struct Trial<'a> {
    dut: &'a dyn Backend,
    reference: &'a dyn Backend,
    reps: usize,
    p: Precision,
    rng: Rng,
}

impl Trial<'_> {
    /// A graph op on `inputs`: the output's worst error.
    fn op(&mut self, case: &Case, op: &Op, inputs: &[Input]) -> Result<(Vec<f64>, Option<f64>)> {
        let (dut, reference, p) = (self.dut, self.reference, self.p);
        let mut host = Vec::with_capacity(inputs.len());
        let mut types = Vec::with_capacity(inputs.len());
        for i in inputs {
            let (t, float) = match i {
                Input::Float(dims, scale) => (self.rng.floats(dims, *scale, p)?, true),
                Input::Ids(dims, max) => (self.rng.ids(dims, *max)?, false),
                Input::Scalar(x) => (Tensor::new(*x, &Device::Cpu)?, true),
            };
            let dims: Vec<u64> = t.dims().iter().map(|&d| d as u64).collect();
            let dtype = if float { DType::F32 } else { DType::U32 };
            types.push(TensorType::new(dtype, shardplan_ir::Shape::new(dims)));
            host.push((t, float));
        }
        let refs: Vec<&TensorType> = types.iter().collect();
        let out = op
            .infer(&refs)
            .map_err(|e| ExecError::Internal(format!("self-test case {} {}: {e}", case.kernel, case.label)))?;
        let run = |be: &dyn Backend| -> Result<Vec<Tensor>> { host.iter().map(|(t, f)| be.put(t, *f, p)).collect() };
        let (a_in, b_in) = (run(dut)?, run(reference)?);
        let a_refs: Vec<&Tensor> = a_in.iter().collect();
        let b_refs: Vec<&Tensor> = b_in.iter().collect();
        let (a, ms) = time(dut, self.reps, || dut.op(op, &a_refs, &out))?;
        let b = reference.op(op, &b_refs, &out)?;
        Ok((vec![worst_error(&a, &b)?], ms))
    }

    /// Attention forward and backward on `[b, s, h, d]` queries and `kv` key/value heads:
    /// the worst errors of o, lse, dq, dk and dv, and the two directions' time together.
    fn attention(&mut self, [b, s, h, kv, d]: [usize; 5], causal: bool) -> Result<(Vec<f64>, Option<f64>)> {
        let (dut, reference, p) = (self.dut, self.reference, self.p);
        let q = self.rng.floats(&[b, s, h, d], 1.0, p)?;
        let k = self.rng.floats(&[b, s, kv, d], 1.0, p)?;
        let v = self.rng.floats(&[b, s, kv, d], 1.0, p)?;
        let dy = self.rng.floats(&[b, s, h, d], 1.0, p)?;
        let put = |be: &dyn Backend| -> Result<[Tensor; 4]> {
            Ok([
                be.put(&q, true, p)?,
                be.put(&k, true, p)?,
                be.put(&v, true, p)?,
                be.put(&dy, true, p)?,
            ])
        };
        let [aq, ak, av, ady] = put(dut)?;
        let [bq, bk, bv, bdy] = put(reference)?;
        let ((ao, alse), fwd_ms) = time(dut, self.reps, || dut.attention(&aq, &ak, &av, causal))?;
        let (bo, blse) = reference.attention(&bq, &bk, &bv, causal)?;
        let (ag, bwd_ms) = time(dut, self.reps, || {
            dut.attention_backward(&aq, &ak, &av, &ao, &ady, &alse, causal)
        })?;
        let bg = reference.attention_backward(&bq, &bk, &bv, &bo, &bdy, &blse, causal)?;
        let mut w = vec![worst_error(&ao, &bo)?, worst_error(&alse, &blse)?];
        for (x, y) in ag.iter().zip(&bg) {
            w.push(worst_error(x, y)?);
        }
        Ok((w, fwd_ms.zip(bwd_ms).map(|(f, b)| f + b)))
    }

    /// The weighted sum of squares of tensors of `lens` elements: its relative error.
    fn sum_squares(&mut self, lens: &[usize]) -> Result<(Vec<f64>, Option<f64>)> {
        let (dut, reference, p) = (self.dut, self.reference, self.p);
        let host: Vec<(Tensor, f64)> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| Ok((self.rng.floats(&[n], 1.0, p)?, if i % 3 == 0 { 0.5 } else { 1.0 })))
            .collect::<Result<_>>()?;
        let put = |be: &dyn Backend| -> Result<Vec<(Tensor, f64)>> {
            host.iter().map(|(t, w)| Ok((be.put(t, true, p)?, *w))).collect()
        };
        let (a_in, b_in) = (put(dut)?, put(reference)?);
        let (a, ms) = time(dut, self.reps, || dut.sum_squares(&a_in, 0.25))?;
        let b = reference.sum_squares(&b_in, 0.25)?;
        Ok((vec![(a - b).abs() / b.abs().max(1e-30)], ms))
    }

    /// The third AdamW update of `n` parameters: the worst errors of the update (new
    /// weights less old) and of the two moments.
    fn adamw(&mut self, n: usize, factor: Option<f64>) -> Result<(Vec<f64>, Option<f64>)> {
        let (dut, reference, p) = (self.dut, self.reference, self.p);
        let pv = self.rng.floats(&[n], 1.0, p)?;
        let g = self.rng.floats(&[n], 0.1, p)?;
        let m = self.rng.floats(&[n], 0.01, p)?;
        let v = self.rng.floats(&[n], 1e-4, p)?.abs()?;
        // The third update of a run: bias corrections of t = 3.
        let (b1, b2) = (0.9f32, 0.95f32);
        let h = AdamW {
            lr: 3e-4,
            beta1: b1,
            beta2: b2,
            eps: 1e-8,
            weight_decay: 0.1,
            bias1: 1.0 - b1.powi(3),
            bias2: 1.0 - b2.powi(3),
            grad_scale: 0.5,
        };
        let put = |be: &dyn Backend| -> Result<[Tensor; 4]> {
            Ok([
                be.put(&pv, true, p)?,
                be.put(&g, true, p)?,
                be.put(&m, true, p)?,
                be.put(&v, true, p)?,
            ])
        };
        let [ap, ag, am, av] = put(dut)?;
        let [bp, bg, bm, bv] = put(reference)?;
        let (a, ms) = time(dut, self.reps, || dut.adamw(&ap, &ag, &am, &av, factor, h))?;
        let b = reference.adamw(&bp, &bg, &bm, &bv, factor, h)?;
        // The update is what the kernel computes; the weights are mostly what it read.
        let dp =
            |x: &Tensor, p0: &Tensor| -> Result<Tensor> { Ok((x.to_dtype(CDType::F64)? - p0.to_dtype(CDType::F64)?)?) };
        let pa = dp(&a[0], &ap.to_device(&Device::Cpu)?)?;
        let pb = dp(&b[0], &bp.to_device(&Device::Cpu)?)?;
        Ok((
            vec![
                worst_error(&pa, &pb)?,
                worst_error(&a[1], &b[1])?,
                worst_error(&a[2], &b[2])?,
            ],
            ms,
        ))
    }
}

/// Runs `cases` (those whose kernel name contains `only`, when given).
pub fn run(
    cases: &[Case],
    dut: &dyn Backend,
    reference: &dyn Backend,
    reps: usize,
    only: Option<&str>,
    mut progress: impl FnMut(&CaseResult),
) -> Report {
    let mut results = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        if only.is_some_and(|o| !case.kernel.contains(o)) {
            continue;
        }
        for r in run_case(case, dut, reference, reps, 0x5eed + i as u64) {
            progress(&r);
            results.push(r);
        }
    }
    Report {
        under_test: dut.name(),
        reference: reference.name(),
        results,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_twin_agrees_with_the_composed_ops_on_the_small_cases() {
        let report = run(&cases(false), &Twin::default(), &Composed::default(), 0, None, |_| {});
        assert!(report.passed(), "{}", report.text());
        // Every kind of kernel took part.
        for k in [
            "rms_norm",
            "rms_norm_dx",
            "rms_norm_dw",
            "silu",
            "silu_grad",
            "rope",
            "rope_grad",
            "cross_entropy",
            "cross_entropy_grad",
            "embedding_grad",
            "attention",
            "grad_sum_squares",
            "adamw",
        ] {
            assert!(report.results.iter().any(|r| r.kernel == k), "no {k} case");
        }
    }

    /// Composed ops with one kernel made wrong: the harness must report the miss.
    struct Faulty(Composed, &'static str);

    impl Backend for Faulty {
        fn name(&self) -> String {
            "a faulty backend".into()
        }
        fn put(&self, t: &Tensor, float: bool, p: Precision) -> Result<Tensor> {
            self.0.put(t, float, p)
        }
        fn op(&self, op: &Op, ins: &[&Tensor], out: &TensorType) -> Result<Tensor> {
            let t = self.0.op(op, ins, out)?;
            Ok(if op.name() == self.1 { t.affine(1.03, 0.0)? } else { t })
        }
        fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<(Tensor, Tensor)> {
            // The wrong mask.
            let causal = if self.1 == "attention" { !causal } else { causal };
            self.0.attention(q, k, v, causal)
        }
        fn attention_backward(
            &self,
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            o: &Tensor,
            dy: &Tensor,
            lse: &Tensor,
            causal: bool,
        ) -> Result<[Tensor; 3]> {
            self.0.attention_backward(q, k, v, o, dy, lse, causal)
        }
        fn sum_squares(&self, parts: &[(Tensor, f64)], scale: f64) -> Result<f64> {
            // One tensor left out.
            let n = if self.1 == "grad_sum_squares" {
                parts.len() - 1
            } else {
                parts.len()
            };
            self.0.sum_squares(&parts[..n], scale)
        }
        fn adamw(
            &self,
            p: &Tensor,
            g: &Tensor,
            m: &Tensor,
            v: &Tensor,
            factor: Option<f64>,
            h: AdamW,
        ) -> Result<[Tensor; 3]> {
            // The factor ignored.
            let factor = if self.1 == "adamw" { None } else { factor };
            self.0.adamw(p, g, m, v, factor, h)
        }
        fn sync(&self) -> Result<()> {
            Ok(())
        }
        fn timed(&self) -> bool {
            false
        }
    }

    #[test]
    fn a_wrong_kernel_is_reported_as_a_miss() {
        for (op, kernel) in [
            ("rms_norm", "rms_norm"),
            ("rms_norm_grad", "rms_norm_dw"),
            ("cross_entropy_grad", "cross_entropy_grad"),
            ("attention", "attention"),
            ("grad_sum_squares", "grad_sum_squares"),
            ("adamw", "adamw"),
        ] {
            let report = run(
                &cases(false),
                &Faulty(Composed::default(), op),
                &Twin::default(),
                0,
                Some(kernel),
                |_| {},
            );
            assert!(!report.passed(), "a faulty {op} passed:\n{}", report.text());
            assert!(report.text().contains("MISS"), "{}", report.text());
        }
    }

    #[test]
    fn a_case_that_cannot_run_is_an_error_and_a_miss() {
        // The native backend cannot be made on the CPU; a backend erroring on every call
        // fails its cases with the message.
        assert!(Native::new(Device::Cpu).is_err());
        struct Broken;
        impl Backend for Broken {
            fn name(&self) -> String {
                "broken".into()
            }
            fn put(&self, t: &Tensor, _: bool, _: Precision) -> Result<Tensor> {
                Ok(t.clone())
            }
            fn op(&self, _: &Op, _: &[&Tensor], _: &TensorType) -> Result<Tensor> {
                Err(ExecError::Internal("no kernel here".into()))
            }
            fn attention(&self, _: &Tensor, _: &Tensor, _: &Tensor, _: bool) -> Result<(Tensor, Tensor)> {
                Err(ExecError::Internal("no kernel here".into()))
            }
            fn attention_backward(
                &self,
                _: &Tensor,
                _: &Tensor,
                _: &Tensor,
                _: &Tensor,
                _: &Tensor,
                _: &Tensor,
                _: bool,
            ) -> Result<[Tensor; 3]> {
                Err(ExecError::Internal("no kernel here".into()))
            }
            fn sum_squares(&self, _: &[(Tensor, f64)], _: f64) -> Result<f64> {
                Err(ExecError::Internal("no kernel here".into()))
            }
            fn adamw(
                &self,
                _: &Tensor,
                _: &Tensor,
                _: &Tensor,
                _: &Tensor,
                _: Option<f64>,
                _: AdamW,
            ) -> Result<[Tensor; 3]> {
                Err(ExecError::Internal("no kernel here".into()))
            }
            fn sync(&self) -> Result<()> {
                Ok(())
            }
            fn timed(&self) -> bool {
                false
            }
        }
        let report = run(&cases(false), &Broken, &Twin::default(), 0, Some("silu"), |_| {});
        assert!(!report.passed());
        assert!(report
            .results
            .iter()
            .all(|r| r.error.as_deref().is_some_and(|e| e.contains("no kernel here"))));
    }
}
