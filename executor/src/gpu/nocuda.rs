//! [`super`] in a build without the `cuda` feature: the same functions, each an error
//! saying so. Native kernels are only chosen on a CUDA device, which such a build cannot
//! open, so these are reached only by a caller that skipped that check.

use crate::adamw::AdamW;
use crate::ExecError;
use candle_core::{DType, Device, Tensor};

type Result<T> = std::result::Result<T, ExecError>;

fn unbuilt<T>() -> Result<T> {
    Err(ExecError::Unsupported(
        "shardplan's CUDA kernels: this shardplan was built without CUDA support (scripts/build-cuda.sh builds one)"
            .into(),
    ))
}

/// Whether the CUDA C kernels take tensors of this dtype.
pub fn takes(_d: DType) -> bool {
    false
}

/// `x * rsqrt(mean(x^2) + eps) * w` over the last dim.
pub fn rms_norm(_x: &Tensor, _w: &Tensor, _eps: f64) -> Result<Tensor> {
    unbuilt()
}

/// RMSNorm's gradient with respect to its input (`weight: false`) or its weight.
pub fn rms_norm_grad(_x: &Tensor, _w: &Tensor, _g: &Tensor, _eps: f64, _weight: bool) -> Result<Tensor> {
    unbuilt()
}

/// `x * sigmoid(x)`.
pub fn silu(_x: &Tensor) -> Result<Tensor> {
    unbuilt()
}

/// `g * silu'(x)`.
pub fn silu_grad(_x: &Tensor, _g: &Tensor) -> Result<Tensor> {
    unbuilt()
}

/// Rotary embedding of `x [b, s, h, d]` from tables `cos, sin [s, d/2]` (x's dtype);
/// `inverse` rotates by minus the angle (the gradient).
pub fn rope(_x: &Tensor, _cos: &Tensor, _sin: &Tensor, _inverse: bool) -> Result<Tensor> {
    unbuilt()
}

/// The mean cross-entropy of `logits [n, V]` at `targets [n]`, an f32 scalar.
pub fn cross_entropy(_logits: &Tensor, _targets: &Tensor) -> Result<Tensor> {
    unbuilt()
}

/// `(softmax(logits) - onehot(targets)) * g / n`, in the logits' dtype.
pub fn cross_entropy_grad(_logits: &Tensor, _targets: &Tensor, _g: &Tensor) -> Result<Tensor> {
    unbuilt()
}

/// The embedding table's gradient `[vocab, dim]` from `ids` and the output gradient
/// `g [.., dim]`, in g's dtype.
pub fn embedding_grad(_ids: &Tensor, _g: &Tensor, _vocab: usize, _dim: usize) -> Result<Tensor> {
    unbuilt()
}

/// `scale^2 * sum_i weight_i * sum(x_i^2)` over f32 tensors, a one-element f64 tensor on
/// their device: one launch per 48 tensors, and one more to add the blocks' partials.
pub fn sum_squares(_parts: &[(Tensor, f64)], _scale: f64) -> Result<Tensor> {
    unbuilt()
}

/// One AdamW update of f32 `p` from `g` in one pass; `m`, `v` absent start at zero. The
/// gradient factor is `h.grad_scale` times `factor` (a one-element f64 device tensor: the
/// clipping factor the gradient norm left there), read on the device.
pub fn adamw(
    _p: &Tensor,
    _g: &Tensor,
    _m: Option<&Tensor>,
    _v: Option<&Tensor>,
    _factor: Option<&Tensor>,
    _h: AdamW,
) -> Result<(Tensor, Tensor, Tensor)> {
    unbuilt()
}

/// Whether cuDNN can be opened here, and its version (e.g. 91900).
pub fn cudnn_version() -> Result<i64> {
    unbuilt()
}

/// Whether cuDNN's flash attention takes these operands: bf16 or f16 `[b, s, h, d]`
/// tensors, keys as long as queries, and a head dim it supports.
pub fn attention_applies(_q: &Tensor, _k: &Tensor, _v: &Tensor) -> bool {
    false
}

/// Flash attention forward through cuDNN: the output `[b, s, h, d]` and the log-sum-exp of
/// each row of scaled scores `[b, h, s]` (f32).
pub fn attention(_q: &Tensor, _k: &Tensor, _v: &Tensor, _causal: bool) -> Result<(Tensor, Tensor)> {
    unbuilt()
}

/// Flash attention backward through cuDNN from the forward's output `o` and log-sum-exp
/// `lse`: `(dq, dk, dv)`, dk and dv with the kv heads.
pub fn attention_backward(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _o: &Tensor,
    _dy: &Tensor,
    _lse: &Tensor,
    _causal: bool,
) -> Result<[Tensor; 3]> {
    unbuilt()
}

/// Waits for everything queued on `device`'s stream (the self-test's timer).
pub fn synchronize(_device: &Device) -> Result<()> {
    Ok(())
}
