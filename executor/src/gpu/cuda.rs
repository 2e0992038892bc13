//! The CUDA side of [`super`]: loads each kernel file's CUBIN into the device's context once,
//! launches on candle's stream (the one stream every rank thread of the device shares, so
//! launch order is device order, as for candle's own ops), and calls the cuDNN shim.
//!
//! Kernels take raw device addresses of contiguous tensors: the inputs stay alive in the
//! caller until the launch is queued, and a later free is queued on the same stream.

use crate::adamw::AdamW;
use crate::ExecError;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaModule, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Shape, Storage, Tensor, D};
use std::ffi::{c_void, CStr};
use std::sync::{Arc, Mutex};

type Result<T> = std::result::Result<T, ExecError>;

fn err(what: impl std::fmt::Display) -> ExecError {
    ExecError::Internal(format!("shardplan CUDA kernels: {what}"))
}

/// One compiled kernel file.
struct Module {
    name: &'static str,
    image: &'static [u8],
}

macro_rules! module {
    ($name:literal) => {
        Module {
            name: $name,
            image: include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".cubin")),
        }
    };
}

const NORM: Module = module!("norm");
const ACT: Module = module!("act");
const ROPE: Module = module!("rope");
const XENT: Module = module!("xent");
const EMBED: Module = module!("embed");
const OPTIM: Module = module!("optim");

/// Modules loaded so far, by context address and file.
static LOADED: Mutex<Vec<(usize, &'static str, Arc<CudaModule>)>> = Mutex::new(Vec::new());

fn function(dev: &CudaDevice, m: &Module, name: &str) -> Result<CudaFunction> {
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let key = Arc::as_ptr(ctx) as usize;
    let module = {
        let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        match loaded.iter().find(|(c, n, _)| *c == key && *n == m.name) {
            Some((_, _, md)) => md.clone(),
            None => {
                let md = ctx
                    .load_module(Ptx::from_binary(m.image.to_vec()))
                    .map_err(|e| err(format!("loading {}.cubin: {e:?}", m.name)))?;
                loaded.push((key, m.name, md.clone()));
                md
            }
        }
    };
    module
        .load_function(name)
        .map_err(|e| err(format!("no kernel {name} in {}.cubin: {e:?}", m.name)))
}

/// Launches `$name` of module `$m` with the locals `$arg` (bound before the call: the
/// launch reads each argument through a pointer).
macro_rules! launch {
    ($dev:expr, $m:expr, $name:expr, $cfg:expr; $($arg:ident),* $(,)?) => {{
        let name: &str = &$name;
        let f = function($dev, &$m, name)?;
        let stream = $dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        $( b.arg(&$arg); )*
        // SAFETY: the arguments match the kernel's C signature in executor/kernels (one
        // `.cu` per module), and every address is of a live tensor with the extent given.
        unsafe { b.launch($cfg) }.map_err(|e| err(format!("launching {name}: {e:?}")))?;
    }};
}

fn device(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        d => Err(err(format!("a tensor on {:?}, not on a CUDA device", d.location()))),
    }
}

/// The device address of a contiguous CUDA tensor's first element.
fn ptr(t: &Tensor, stream: &CudaStream) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        return Err(err("a tensor not on a CUDA device"));
    };
    let Some((start, _)) = layout.contiguous_offsets() else {
        return Err(err("a non-contiguous tensor"));
    };
    let (base, size) = match t.dtype() {
        DType::F32 => (s.as_cuda_slice::<f32>()?.device_ptr(stream).0, 4),
        DType::BF16 => (s.as_cuda_slice::<half::bf16>()?.device_ptr(stream).0, 2),
        DType::F16 => (s.as_cuda_slice::<half::f16>()?.device_ptr(stream).0, 2),
        DType::F64 => (s.as_cuda_slice::<f64>()?.device_ptr(stream).0, 8),
        DType::U32 => (s.as_cuda_slice::<u32>()?.device_ptr(stream).0, 4),
        DType::I64 => (s.as_cuda_slice::<i64>()?.device_ptr(stream).0, 8),
        d => return Err(err(format!("no kernel takes {d:?}"))),
    };
    Ok(base + (start * size) as u64)
}

/// A new tensor whose elements the next kernel writes (not zeroed).
fn empty(dev: &CudaDevice, dtype: DType, shape: impl Into<Shape>) -> Result<Tensor> {
    let shape = shape.into();
    let n = shape.elem_count();
    if n == 0 {
        return Ok(Tensor::zeros(shape, dtype, &Device::Cuda(dev.clone()))?);
    }
    // SAFETY (each arm): the kernel the caller launches next writes all `n` elements.
    let storage = match dtype {
        DType::F32 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f32>(n)? }, dev.clone()),
        DType::BF16 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::bf16>(n)? }, dev.clone()),
        DType::F16 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::f16>(n)? }, dev.clone()),
        DType::F64 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f64>(n)? }, dev.clone()),
        d => return Err(err(format!("no kernel writes {d:?}"))),
    };
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        shape,
        BackpropOp::none(),
        false,
    ))
}

/// The kernel-name suffix of a storage dtype the CUDA C kernels take.
fn suffix(d: DType) -> Result<&'static str> {
    match d {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => Err(err(format!("the CUDA C kernels take f32 or bf16, not {d:?}"))),
    }
}

/// Whether the CUDA C kernels take tensors of this dtype.
pub fn takes(d: DType) -> bool {
    matches!(d, DType::F32 | DType::BF16)
}

fn cfg(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row; `block` threads (a multiple of 32, at most 1024).
fn per_row(rows: usize, block: u32) -> Result<LaunchConfig> {
    let rows = u32::try_from(rows).map_err(|_| err(format!("{rows} rows exceed one launch")))?;
    Ok(cfg((rows, 1, 1), block))
}

/// A grid-stride launch over `n` elements.
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65_536) as u32;
    cfg((blocks, 1, 1), 256)
}

/// Threads per row for a row of `cols` elements: whole warps, a few elements each.
fn row_block(cols: usize) -> u32 {
    (cols.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32
}

fn i32_of(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| err(format!("{what} {n} exceeds the kernels' 32-bit sizes")))
}

/// `x * rsqrt(mean(x^2) + eps) * w` over the last dim.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dev = device(x)?;
    let s = suffix(x.dtype())?;
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let cols = x.dim(D::Minus1)?;
    let rows = x.elem_count() / cols.max(1);
    let y = empty(&dev, x.dtype(), x.shape().clone())?;
    if rows == 0 {
        return Ok(y);
    }
    let stream = dev.cuda_stream();
    let (xp, wp, yp) = (ptr(&x, &stream)?, ptr(&w, &stream)?, ptr(&y, &stream)?);
    let (c, e) = (i32_of(cols, "a row of")?, eps as f32);
    launch!(&dev, NORM, format!("rmsnorm_fwd_{s}"), per_row(rows, row_block(cols))?; xp, wp, yp, c, e);
    Ok(y)
}

/// RMSNorm's gradient with respect to its input (`weight: false`) or its weight.
pub fn rms_norm_grad(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64, weight: bool) -> Result<Tensor> {
    let dev = device(x)?;
    let s = suffix(x.dtype())?;
    let (x, w, g) = (x.contiguous()?, w.contiguous()?, g.contiguous()?);
    let cols = x.dim(D::Minus1)?;
    let rows = x.elem_count() / cols.max(1);
    let stream = dev.cuda_stream();
    let (c, e) = (i32_of(cols, "a row of")?, eps as f32);
    let (xp, wp, gp) = (ptr(&x, &stream)?, ptr(&w, &stream)?, ptr(&g, &stream)?);
    if !weight {
        let dx = empty(&dev, g.dtype(), x.shape().clone())?;
        if rows > 0 {
            let dp = ptr(&dx, &stream)?;
            launch!(&dev, NORM, format!("rmsnorm_bwd_dx_{s}"), per_row(rows, row_block(cols))?; xp, wp, gp, dp, c, e);
        }
        return Ok(dx);
    }
    if rows == 0 {
        return Ok(Tensor::zeros(w.shape().clone(), g.dtype(), &Device::Cuda(dev))?);
    }
    // Pass 1: each row's 1/rms. Pass 2: partial column sums over chunks of rows, one
    // thread per column. Pass 3: the chunks' sums in order.
    let rinv = empty(&dev, DType::F32, rows)?;
    let rp = ptr(&rinv, &stream)?;
    launch!(&dev, NORM, format!("rmsnorm_rinv_{s}"), per_row(rows, row_block(cols))?; xp, rp, c, e);
    let per_chunk = rows.div_ceil(rows.clamp(1, 512)).max(rows.div_ceil(4096));
    let chunks = rows.div_ceil(per_chunk);
    let part = empty(&dev, DType::F32, chunks * cols)?;
    let pp = ptr(&part, &stream)?;
    let (r, pc, nc) = (
        i32_of(rows, "rows")?,
        i32_of(per_chunk, "rows")?,
        i32_of(chunks, "chunks")?,
    );
    let tiles = cols.div_ceil(256) as u32;
    launch!(&dev, NORM, format!("rmsnorm_dw_part_{s}"), cfg((tiles, chunks as u32, 1), 256); xp, gp, rp, pp, r, c, pc);
    let dw = empty(&dev, g.dtype(), w.shape().clone())?;
    let dp = ptr(&dw, &stream)?;
    launch!(&dev, NORM, format!("rmsnorm_dw_sum_{s}"), cfg((tiles, 1, 1), 256); pp, dp, c, nc);
    Ok(dw)
}

/// `x * sigmoid(x)`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    let dev = device(x)?;
    let s = suffix(x.dtype())?;
    let x = x.contiguous()?;
    let y = empty(&dev, x.dtype(), x.shape().clone())?;
    let n = x.elem_count();
    if n > 0 {
        let stream = dev.cuda_stream();
        let (xp, yp, nn) = (ptr(&x, &stream)?, ptr(&y, &stream)?, n as u64);
        launch!(&dev, ACT, format!("silu_fwd_{s}"), elementwise(n); xp, yp, nn);
    }
    Ok(y)
}

/// `g * silu'(x)`.
pub fn silu_grad(x: &Tensor, g: &Tensor) -> Result<Tensor> {
    let dev = device(x)?;
    let s = suffix(x.dtype())?;
    let (x, g) = (x.contiguous()?, g.contiguous()?);
    let dx = empty(&dev, x.dtype(), x.shape().clone())?;
    let n = x.elem_count();
    if n > 0 {
        let stream = dev.cuda_stream();
        let (xp, gp, dp, nn) = (ptr(&x, &stream)?, ptr(&g, &stream)?, ptr(&dx, &stream)?, n as u64);
        launch!(&dev, ACT, format!("silu_bwd_{s}"), elementwise(n); xp, gp, dp, nn);
    }
    Ok(dx)
}

/// Rotary embedding of `x [b, s, h, d]` from tables `cos, sin [s, d/2]` (x's dtype);
/// `inverse` rotates by minus the angle (the gradient).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Result<Tensor> {
    let dev = device(x)?;
    let s = suffix(x.dtype())?;
    let (x, cos, sin) = (x.contiguous()?, cos.contiguous()?, sin.contiguous()?);
    let (_, seq, h, d) = x.dims4()?;
    let y = empty(&dev, x.dtype(), x.shape().clone())?;
    let pairs = x.elem_count() / 2;
    if pairs > 0 {
        let stream = dev.cuda_stream();
        let (xp, cp, sp, yp) = (
            ptr(&x, &stream)?,
            ptr(&cos, &stream)?,
            ptr(&sin, &stream)?,
            ptr(&y, &stream)?,
        );
        let (np, si, hi, di) = (
            pairs as u64,
            i32_of(seq, "a sequence of")?,
            i32_of(h, "heads")?,
            i32_of(d, "head dim")?,
        );
        let sign: f32 = if inverse { -1.0 } else { 1.0 };
        launch!(&dev, ROPE, format!("rope_{s}"), elementwise(pairs); xp, cp, sp, yp, np, si, hi, di, sign);
    }
    Ok(y)
}

fn targets_u32(t: &Tensor) -> Result<Tensor> {
    Ok(t.flatten_all()?.to_dtype(DType::U32)?.contiguous()?)
}

/// The mean cross-entropy of `logits [n, V]` at `targets [n]`, an f32 scalar.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let dev = device(logits)?;
    let s = suffix(logits.dtype())?;
    let logits = logits.contiguous()?;
    let (n, v) = logits.dims2()?;
    let t = targets_u32(targets)?;
    let rows = empty(&dev, DType::F32, n)?;
    let out = empty(&dev, DType::F32, ())?;
    let stream = dev.cuda_stream();
    let (lp, tp, rp, op) = (
        ptr(&logits, &stream)?,
        ptr(&t, &stream)?,
        ptr(&rows, &stream)?,
        ptr(&out, &stream)?,
    );
    let (ni, vi) = (i32_of(n, "rows")?, i32_of(v, "a vocabulary of")?);
    if n > 0 {
        launch!(&dev, XENT, format!("xent_rows_{s}"), per_row(n, row_block(v))?; lp, tp, rp, vi);
    }
    launch!(&dev, XENT, "xent_mean", cfg((1, 1, 1), 1024); rp, op, ni);
    Ok(out)
}

/// `(softmax(logits) - onehot(targets)) * g / n`, in the logits' dtype.
pub fn cross_entropy_grad(logits: &Tensor, targets: &Tensor, g: &Tensor) -> Result<Tensor> {
    let dev = device(logits)?;
    let s = suffix(logits.dtype())?;
    let logits = logits.contiguous()?;
    let (n, v) = logits.dims2()?;
    let t = targets_u32(targets)?;
    let g = g.flatten_all()?.to_dtype(DType::F32)?.contiguous()?;
    let grad = empty(&dev, logits.dtype(), (n, v))?;
    if n > 0 {
        let stream = dev.cuda_stream();
        let (lp, tp, gp, dp) = (
            ptr(&logits, &stream)?,
            ptr(&t, &stream)?,
            ptr(&g, &stream)?,
            ptr(&grad, &stream)?,
        );
        let (ni, vi) = (i32_of(n, "rows")?, i32_of(v, "a vocabulary of")?);
        launch!(&dev, XENT, format!("xent_bwd_{s}"), per_row(n, row_block(v))?; lp, tp, gp, dp, ni, vi);
    }
    Ok(grad)
}

/// The embedding table's gradient `[vocab, dim]` from `ids` and the output gradient
/// `g [.., dim]`, in g's dtype.
pub fn embedding_grad(ids: &Tensor, g: &Tensor, vocab: usize, dim: usize) -> Result<Tensor> {
    let dev = device(g)?;
    let s = suffix(g.dtype())?;
    let ids = targets_u32(ids)?;
    let g = g.contiguous()?;
    let table = Tensor::zeros((vocab, dim), DType::F32, &Device::Cuda(dev.clone()))?;
    let tokens = ids.elem_count();
    if tokens * dim != g.elem_count() {
        return Err(err(format!(
            "an embedding gradient of {} elements for {tokens} ids of width {dim}",
            g.elem_count()
        )));
    }
    if tokens > 0 && dim > 0 {
        let stream = dev.cuda_stream();
        let (ip, gp, tp) = (ptr(&ids, &stream)?, ptr(&g, &stream)?, ptr(&table, &stream)?);
        let (nt, di) = (tokens as u64, i32_of(dim, "a row of")?);
        let vu = u32::try_from(vocab).map_err(|_| err(format!("a vocabulary of {vocab} rows")))?;
        launch!(&dev, EMBED, format!("embed_grad_{s}"), elementwise(tokens * dim); ip, gp, tp, nt, di, vu);
    }
    Ok(table.to_dtype(g.dtype())?)
}

const SUMSQ_MAX_TENSORS: usize = 48;
const SUMSQ_CHUNK: usize = 65_536;

/// `SumSqArgs` of optim.cu, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct SumSqArgs {
    ptr: [u64; SUMSQ_MAX_TENSORS],
    len: [u64; SUMSQ_MAX_TENSORS],
    weight: [f64; SUMSQ_MAX_TENSORS],
    first_block: [u32; SUMSQ_MAX_TENSORS + 1],
    count: i32,
}

// SAFETY: plain numbers and addresses, laid out as the C struct (repr(C), same field
// order and types).
unsafe impl DeviceRepr for SumSqArgs {}

/// `scale^2 * sum_i weight_i * sum(x_i^2)` over f32 tensors, a one-element f64 tensor on
/// their device: one launch per 48 tensors, and one more to add the blocks' partials.
pub fn sum_squares(parts: &[(Tensor, f64)], scale: f64) -> Result<Tensor> {
    let Some((first, _)) = parts.first() else {
        return Err(err("a gradient norm over no tensors"));
    };
    let dev = device(first)?;
    let out = Tensor::zeros(1, DType::F64, &Device::Cuda(dev.clone()))?;
    let stream = dev.cuda_stream();
    let op = ptr(&out, &stream)?;
    let parts: Vec<(Tensor, f64)> = parts
        .iter()
        .filter(|(t, _)| t.elem_count() > 0)
        .map(|(t, w)| -> Result<(Tensor, f64)> { Ok((t.contiguous()?, *w)) })
        .collect::<Result<_>>()?;
    for (i, group) in parts.chunks(SUMSQ_MAX_TENSORS).enumerate() {
        let mut a = SumSqArgs {
            ptr: [0; SUMSQ_MAX_TENSORS],
            len: [0; SUMSQ_MAX_TENSORS],
            weight: [0.0; SUMSQ_MAX_TENSORS],
            first_block: [0; SUMSQ_MAX_TENSORS + 1],
            count: group.len() as i32,
        };
        let mut blocks = 0usize;
        for (j, (t, w)) in group.iter().enumerate() {
            if t.dtype() != DType::F32 {
                return Err(err(format!(
                    "the gradient norm kernel takes f32 gradients, not {:?}",
                    t.dtype()
                )));
            }
            a.ptr[j] = ptr(t, &stream)?;
            a.len[j] = t.elem_count() as u64;
            a.weight[j] = *w;
            a.first_block[j] = u32::try_from(blocks).map_err(|_| err("a gradient norm over too many blocks"))?;
            blocks += t.elem_count().div_ceil(SUMSQ_CHUNK);
        }
        a.first_block[group.len()] = u32::try_from(blocks).map_err(|_| err("a gradient norm over too many blocks"))?;
        let partial = empty(&dev, DType::F64, blocks)?;
        let pp = ptr(&partial, &stream)?;
        launch!(&dev, OPTIM, "sumsq_multi", cfg((blocks as u32, 1, 1), 256); a, pp);
        let (nb, sc, acc) = (blocks as i32, scale, i32::from(i > 0));
        launch!(&dev, OPTIM, "sumsq_finish", cfg((1, 1, 1), 1024); pp, nb, sc, acc, op);
    }
    Ok(out)
}

/// One AdamW update of f32 `p` from `g` in one pass; `m`, `v` absent start at zero. The
/// gradient factor is `h.grad_scale` times `factor` (a one-element f64 device tensor: the
/// clipping factor the gradient norm left there), read on the device.
pub fn adamw(
    p: &Tensor,
    g: &Tensor,
    m: Option<&Tensor>,
    v: Option<&Tensor>,
    factor: Option<&Tensor>,
    h: AdamW,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = device(p)?;
    let n = p.elem_count();
    for t in [Some(p), Some(g), m, v].into_iter().flatten() {
        if t.dtype() != DType::F32 || t.elem_count() != n {
            return Err(err(format!(
                "AdamW takes f32 tensors of {n} elements, got {:?} of {}",
                t.dtype(),
                t.elem_count()
            )));
        }
    }
    let zeros;
    let (m, v) = match (m, v) {
        (Some(m), Some(v)) => (m.contiguous()?, v.contiguous()?),
        _ => {
            zeros = Tensor::zeros(p.shape().clone(), DType::F32, p.device())?;
            (zeros.clone(), zeros)
        }
    };
    let (p, g) = (p.contiguous()?, g.contiguous()?);
    let (np, nm, nv) = (
        empty(&dev, DType::F32, p.shape().clone())?,
        empty(&dev, DType::F32, p.shape().clone())?,
        empty(&dev, DType::F32, p.shape().clone())?,
    );
    if n == 0 {
        return Ok((np, nm, nv));
    }
    let stream = dev.cuda_stream();
    let (pp, gp, mp, vp) = (
        ptr(&p, &stream)?,
        ptr(&g, &stream)?,
        ptr(&m, &stream)?,
        ptr(&v, &stream)?,
    );
    let (npp, nmp, nvp) = (ptr(&np, &stream)?, ptr(&nm, &stream)?, ptr(&nv, &stream)?);
    let fp = match factor {
        Some(f) => {
            if f.dtype() != DType::F64 || f.elem_count() != 1 {
                return Err(err("the AdamW gradient factor must be one f64"));
            }
            ptr(&f.contiguous()?, &stream)?
        }
        None => 0u64,
    };
    let nn = n as u64;
    let AdamW {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        bias1,
        bias2,
        grad_scale,
    } = h;
    launch!(&dev, OPTIM, "adamw_f32", elementwise(n);
        pp, gp, mp, vp, npp, nmp, nvp, nn, fp, grad_scale, lr, beta1, beta2, eps, weight_decay, bias1, bias2);
    Ok((np, nm, nv))
}

extern "C" {
    fn sp_attn_error() -> *const std::ffi::c_char;
    fn sp_attn_load() -> i32;
    fn sp_attn_cudnn_version() -> i64;
    fn sp_attn_fwd(
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        o: *mut c_void,
        lse: *mut f32,
        b: i32,
        s: i32,
        hq: i32,
        hkv: i32,
        d: i32,
        scale: f32,
        causal: i32,
        dtype: i32,
        stream: *mut c_void,
    ) -> i32;
    fn sp_attn_bwd(
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        o: *const c_void,
        dout: *const c_void,
        lse: *const f32,
        dq: *mut c_void,
        dk: *mut c_void,
        dv: *mut c_void,
        b: i32,
        s: i32,
        hq: i32,
        hkv: i32,
        d: i32,
        scale: f32,
        causal: i32,
        dtype: i32,
        stream: *mut c_void,
    ) -> i32;
}

fn shim_error(what: &str) -> ExecError {
    // SAFETY: the shim returns its thread's last message, a NUL-terminated string it owns
    // until its next call on this thread.
    let msg = unsafe { CStr::from_ptr(sp_attn_error()) }
        .to_string_lossy()
        .into_owned();
    ExecError::Unsupported(format!("{what}: {msg}"))
}

/// Whether cuDNN can be opened here, and its version (e.g. 91900).
pub fn cudnn_version() -> Result<i64> {
    // SAFETY: no arguments; the shim opens libcudnn once.
    if unsafe { sp_attn_load() } != 0 {
        return Err(shim_error("cuDNN flash attention"));
    }
    // SAFETY: as above.
    Ok(unsafe { sp_attn_cudnn_version() })
}

/// Whether cuDNN's flash attention takes these operands: bf16 or f16 `[b, s, h, d]`
/// tensors, keys as long as queries, and a head dim it supports.
pub fn attention_applies(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let half = matches!(q.dtype(), DType::BF16 | DType::F16);
    let same = q.dtype() == k.dtype() && k.dtype() == v.dtype();
    match (q.dims4(), k.dims4()) {
        (Ok((_, s, h, d)), Ok((_, t, kv, _))) => {
            half && same && s == t && kv > 0 && h % kv == 0 && d % 8 == 0 && d <= 256 && q.device().is_cuda()
        }
        _ => false,
    }
}

struct AttnDims {
    b: i32,
    s: i32,
    h: i32,
    kv: i32,
    d: i32,
    scale: f32,
    dtype: i32,
}

fn attn_dims(q: &Tensor, k: &Tensor) -> Result<AttnDims> {
    let (b, s, h, d) = q.dims4()?;
    let (_, _, kv, _) = k.dims4()?;
    Ok(AttnDims {
        b: i32_of(b, "a batch of")?,
        s: i32_of(s, "a sequence of")?,
        h: i32_of(h, "heads")?,
        kv: i32_of(kv, "kv heads")?,
        d: i32_of(d, "head dim")?,
        scale: 1.0 / (d as f32).sqrt(),
        dtype: if q.dtype() == DType::BF16 { 0 } else { 1 },
    })
}

/// Flash attention forward through cuDNN: the output `[b, s, h, d]` and the log-sum-exp of
/// each row of scaled scores `[b, h, s]` (f32).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<(Tensor, Tensor)> {
    let dev = device(q)?;
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let a = attn_dims(&q, &k)?;
    let (b, s, h, _) = q.dims4()?;
    let o = empty(&dev, q.dtype(), q.shape().clone())?;
    let lse = empty(&dev, DType::F32, (b, h, s))?;
    let stream = dev.cuda_stream();
    let p = |t: &Tensor| ptr(t, &stream);
    // SAFETY: device addresses of live, contiguous tensors of the shapes the shim reads
    // ([b, s, h, d] and [b, h, s]) on candle's stream, which the call queues onto.
    let rc = unsafe {
        sp_attn_fwd(
            p(&q)? as *const c_void,
            p(&k)? as *const c_void,
            p(&v)? as *const c_void,
            p(&o)? as *mut c_void,
            p(&lse)? as *mut f32,
            a.b,
            a.s,
            a.h,
            a.kv,
            a.d,
            a.scale,
            i32::from(causal),
            a.dtype,
            stream.cu_stream() as *mut c_void,
        )
    };
    if rc != 0 {
        return Err(shim_error("cuDNN flash attention forward"));
    }
    Ok((o, lse))
}

/// Flash attention backward through cuDNN from the forward's output `o` and log-sum-exp
/// `lse`: `(dq, dk, dv)`, dk and dv with the kv heads.
pub fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    dy: &Tensor,
    lse: &Tensor,
    causal: bool,
) -> Result<[Tensor; 3]> {
    let dev = device(q)?;
    let (q, k, v, o) = (q.contiguous()?, k.contiguous()?, v.contiguous()?, o.contiguous()?);
    let (dy, lse) = (dy.to_dtype(q.dtype())?.contiguous()?, lse.contiguous()?);
    let a = attn_dims(&q, &k)?;
    let dq = empty(&dev, q.dtype(), q.shape().clone())?;
    let dk = empty(&dev, q.dtype(), k.shape().clone())?;
    let dv = empty(&dev, q.dtype(), v.shape().clone())?;
    let stream = dev.cuda_stream();
    let p = |t: &Tensor| ptr(t, &stream);
    // SAFETY: as in `attention`, for the backward's nine operands.
    let rc = unsafe {
        sp_attn_bwd(
            p(&q)? as *const c_void,
            p(&k)? as *const c_void,
            p(&v)? as *const c_void,
            p(&o)? as *const c_void,
            p(&dy)? as *const c_void,
            p(&lse)? as *const f32,
            p(&dq)? as *mut c_void,
            p(&dk)? as *mut c_void,
            p(&dv)? as *mut c_void,
            a.b,
            a.s,
            a.h,
            a.kv,
            a.d,
            a.scale,
            i32::from(causal),
            a.dtype,
            stream.cu_stream() as *mut c_void,
        )
    };
    if rc != 0 {
        return Err(shim_error("cuDNN flash attention backward"));
    }
    Ok([dq, dk, dv])
}

/// Waits for everything queued on `device`'s stream (the self-test's timer).
pub fn synchronize(device: &Device) -> Result<()> {
    if let Device::Cuda(d) = device {
        d.cuda_stream()
            .synchronize()
            .map_err(|e| err(format!("synchronising: {e:?}")))?;
    }
    Ok(())
}
