//! The hyper-parameters of one AdamW update, a leaf every implementation of the update
//! takes: the CPU's vector loop (`cpu::vmath`), the CUDA kernel (`gpu`) and the optimizer
//! that makes them (`runtime::optim`).

/// AdamW hyper-parameters of one update, bias corrections included.
#[derive(Clone, Copy, Debug)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// `1 - beta1^t` and `1 - beta2^t`.
    pub bias1: f32,
    pub bias2: f32,
    /// Factor applied to the gradient first (global-norm clipping).
    pub grad_scale: f32,
}
