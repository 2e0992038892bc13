//! Optimizers on f32 master weights, and the learning-rate schedule.

use crate::cpu::fused;
use crate::ExecError;
use candle_core::Tensor;
use shardplan_frontends::{LrSchedule, Optimizer};

/// Learning rate at `step` (0-based) of `total` steps: linear warmup to `base`, then cosine
/// decay to `min_lr_ratio * base` at the last step.
pub fn lr_at(step: u64, total: u64, base: f64, s: &LrSchedule) -> f64 {
    if step < s.warmup_steps {
        return base * (step + 1) as f64 / s.warmup_steps as f64;
    }
    let span = total.saturating_sub(s.warmup_steps).saturating_sub(1).max(1);
    let progress = ((step - s.warmup_steps) as f64 / span as f64).min(1.0);
    let min = base * s.min_lr_ratio;
    min + (base - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// The base learning rate of an optimizer.
pub fn base_lr(o: &Optimizer) -> f64 {
    match o {
        Optimizer::AdamW { lr, .. } | Optimizer::Sgd { lr, .. } => *lr,
    }
}

/// The state tensors an optimizer keeps per parameter, by checkpoint name: AdamW's two
/// moments; SGD's momentum buffer, or nothing when momentum is 0 (PyTorch keeps none then).
/// State `k` of [`OptState`] is the `k`-th name.
pub fn state_names(o: &Optimizer) -> &'static [&'static str] {
    match o {
        Optimizer::AdamW { .. } => &["optim.exp_avg", "optim.exp_avg_sq"],
        Optimizer::Sgd { momentum, .. } if *momentum != 0.0 => &["optim.momentum"],
        Optimizer::Sgd { .. } => &[],
    }
}

/// AdamW's settings for update `step` (1-based) at learning rate `lr`, the gradient first
/// multiplied by `grad_scale`; `None` for other optimizers.
fn adamw_settings(kind: Optimizer, lr: f64, grad_scale: f64, step: u64) -> Option<fused::AdamW> {
    let Optimizer::AdamW {
        betas: [b1, b2],
        eps,
        weight_decay,
        ..
    } = kind
    else {
        return None;
    };
    // Past i32::MAX steps the bias corrections are 1 to f64 precision; saturate, never wrap.
    let t = i32::try_from(step).unwrap_or(i32::MAX);
    Some(fused::AdamW {
        lr: lr as f32,
        beta1: b1 as f32,
        beta2: b2 as f32,
        eps: eps as f32,
        weight_decay: weight_decay as f32,
        bias1: (1.0 - b1.powi(t)) as f32,
        bias2: (1.0 - b2.powi(t)) as f32,
        grad_scale: grad_scale as f32,
    })
}

/// Optimizer state, one slot per parameter.
pub struct OptState {
    kind: Optimizer,
    /// Adam's first moment, or SGD's momentum buffer.
    pub(crate) m: Vec<Option<Tensor>>,
    /// Adam's second moment.
    pub(crate) v: Vec<Option<Tensor>>,
    /// Updates made so far (Adam's bias correction).
    pub(crate) steps: u64,
}

impl OptState {
    pub fn new(kind: Optimizer, params: usize) -> Self {
        OptState {
            kind,
            m: vec![None; params],
            v: vec![None; params],
            steps: 0,
        }
    }

    /// Creates the state of `params` now (zero moments), as PyTorch does at the first step;
    /// updates are the same as when the state is created lazily.
    pub fn materialize(&mut self, params: &[Tensor]) -> Result<(), ExecError> {
        for k in 0..state_names(&self.kind).len() {
            for (i, p) in params.iter().enumerate() {
                if self.slots(k)[i].is_none() {
                    self.slots_mut(k)[i] = Some(p.zeros_like()?);
                }
            }
        }
        Ok(())
    }

    /// State `k` (named `state_names(kind)[k]`) of parameter `i`, if created.
    pub fn state(&self, k: usize, i: usize) -> Option<&Tensor> {
        self.slots(k)[i].as_ref()
    }

    /// Sets state `k` of parameter `i` (a checkpoint's).
    pub fn set_state(&mut self, k: usize, i: usize, t: Tensor) {
        self.slots_mut(k)[i] = Some(t);
    }

    fn slots(&self, k: usize) -> &[Option<Tensor>] {
        if k == 0 {
            &self.m
        } else {
            &self.v
        }
    }

    fn slots_mut(&mut self, k: usize) -> &mut [Option<Tensor>] {
        if k == 0 {
            &mut self.m
        } else {
            &mut self.v
        }
    }

    /// Bytes of optimizer state held (f32 moments).
    pub fn bytes(&self) -> u64 {
        self.m
            .iter()
            .chain(&self.v)
            .flatten()
            .map(|t| (t.elem_count() * 4) as u64)
            .sum()
    }

    /// One AdamW update of the single parameter in `params` on shardplan's CUDA kernel
    /// ([`crate::gpu::adamw`]), its gradient multiplied by `host_scale` and by `factor` (a
    /// one-element f64 device tensor, read on the device). Returns false, having done
    /// nothing, where the kernel does not apply (SGD, not f32, not on a CUDA device): the
    /// caller then takes [`OptState::step_scaled`].
    pub fn step_native(
        &mut self,
        params: &mut [Tensor],
        grad: &Tensor,
        lr: f64,
        host_scale: f64,
        factor: Option<&Tensor>,
    ) -> Result<bool, ExecError> {
        let [p] = params else { return Ok(false) };
        let f32_cuda = |t: &Tensor| t.device().is_cuda() && t.dtype() == candle_core::DType::F32;
        let Some(h) = adamw_settings(self.kind, lr, host_scale, self.steps + 1) else {
            return Ok(false);
        };
        if !f32_cuda(p) || !f32_cuda(grad) || self.m.len() != 1 {
            return Ok(false);
        }
        self.steps += 1;
        let (np, m, v) = crate::gpu::adamw(p, grad, self.m[0].as_ref(), self.v[0].as_ref(), factor, h)?;
        (*p, self.m[0], self.v[0]) = (np, Some(m), Some(v));
        Ok(true)
    }

    /// One update of every parameter from its gradient, at learning rate `lr`.
    pub fn step(&mut self, params: &mut [Tensor], grads: &[Tensor], lr: f64) -> Result<(), ExecError> {
        self.step_scaled(params, grads, lr, 1.0)
    }

    /// As [`OptState::step`], with every gradient first multiplied by `grad_scale` (the
    /// global-norm clipping factor), folded into the update.
    pub fn step_scaled(
        &mut self,
        params: &mut [Tensor],
        grads: &[Tensor],
        lr: f64,
        grad_scale: f64,
    ) -> Result<(), ExecError> {
        self.steps += 1;
        let t = i32::try_from(self.steps).unwrap_or(i32::MAX);
        for (i, (p, g)) in params.iter_mut().zip(grads).enumerate() {
            if let Some(h) = adamw_settings(self.kind, lr, grad_scale, self.steps) {
                if fused::applies(&[p, g]) {
                    let (np, m, v) = fused::adamw(p, g, self.m[i].as_ref(), self.v[i].as_ref(), h)?;
                    (*p, self.m[i], self.v[i]) = (np, Some(m), Some(v));
                    continue;
                }
            }
            let scaled;
            let g = if grad_scale == 1.0 {
                g
            } else {
                scaled = (g * grad_scale)?;
                &scaled
            };
            match self.kind {
                Optimizer::AdamW {
                    betas: [b1, b2],
                    eps,
                    weight_decay,
                    ..
                } => {
                    let m = match &self.m[i] {
                        Some(m) => ((m * b1)? + (g * (1.0 - b1))?)?,
                        None => (g * (1.0 - b1))?,
                    };
                    let v = match &self.v[i] {
                        Some(v) => ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?,
                        None => (g.sqr()? * (1.0 - b2))?,
                    };
                    let m_hat = (&m * (1.0 / (1.0 - b1.powi(t))))?;
                    let v_hat = (&v * (1.0 / (1.0 - b2.powi(t))))?;
                    let update = (m_hat / (v_hat.sqrt()? + eps)?)?;
                    // Decoupled weight decay (AdamW): shrink the weights, then step.
                    *p = ((&*p * (1.0 - lr * weight_decay))? - (update * lr)?)?;
                    self.m[i] = Some(m);
                    self.v[i] = Some(v);
                }
                Optimizer::Sgd {
                    momentum, weight_decay, ..
                } => {
                    let g = if weight_decay != 0.0 {
                        (g + (&*p * weight_decay)?)?
                    } else {
                        g.clone()
                    };
                    let dir = if momentum != 0.0 {
                        let b = match &self.m[i] {
                            Some(b) => ((b * momentum)? + &g)?,
                            None => g,
                        };
                        self.m[i] = Some(b.clone());
                        b
                    } else {
                        g
                    };
                    *p = (&*p - (dir * lr)?)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let s = LrSchedule {
            warmup_steps: 10,
            min_lr_ratio: 0.1,
        };
        assert!((lr_at(0, 100, 1.0, &s) - 0.1).abs() < 1e-12);
        assert!((lr_at(9, 100, 1.0, &s) - 1.0).abs() < 1e-12);
        assert!((lr_at(10, 100, 1.0, &s) - 1.0).abs() < 1e-12);
        assert!((lr_at(99, 100, 1.0, &s) - 0.1).abs() < 1e-12);
        let none = LrSchedule {
            warmup_steps: 0,
            min_lr_ratio: 1.0,
        };
        assert_eq!(lr_at(50, 100, 0.5, &none), 0.5);
    }

    #[test]
    fn adamw_matches_the_reference_formula() {
        // One parameter, two steps, against AdamW written out by hand.
        let kind = Optimizer::AdamW {
            lr: 0.1,
            betas: [0.9, 0.99],
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let mut st = OptState::new(kind, 1);
        let mut p = vec![Tensor::new(&[1.0f32], &Device::Cpu).unwrap()];
        let (mut w, mut m, mut v) = (1.0f64, 0.0, 0.0);
        for (t, g) in [(1, 0.5f64), (2, -0.25)] {
            st.step(&mut p, &[Tensor::new(&[g as f32], &Device::Cpu).unwrap()], 0.1)
                .unwrap();
            m = 0.9 * m + 0.1 * g;
            v = 0.99 * v + 0.01 * g * g;
            let (mh, vh) = (m / (1.0 - 0.9f64.powi(t)), v / (1.0 - 0.99f64.powi(t)));
            w = w * (1.0 - 0.1 * 0.01) - 0.1 * mh / (vh.sqrt() + 1e-8);
        }
        let got = p[0].to_vec1::<f32>().unwrap()[0] as f64;
        assert!((got - w).abs() < 1e-6, "{got} vs {w}");
    }

    #[test]
    fn fused_and_composed_adamw_agree() {
        // f32 tensors take the fused single-pass kernel, f64 ones the composed candle ops.
        let kind = Optimizer::AdamW {
            lr: 0.01,
            betas: [0.9, 0.95],
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let p0 = Tensor::randn(0f32, 1.0, (50, 70), &Device::Cpu).unwrap();
        let (mut fused_p, mut comp_p) = (vec![p0.clone()], vec![p0.to_dtype(candle_core::DType::F64).unwrap()]);
        let (mut fs, mut cs) = (OptState::new(kind, 1), OptState::new(kind, 1));
        for step in 0..5 {
            let g = Tensor::randn(0f32, 1.0, (50, 70), &Device::Cpu).unwrap();
            let scale = if step % 2 == 0 { 1.0 } else { 0.3 };
            fs.step_scaled(&mut fused_p, std::slice::from_ref(&g), 0.01, scale)
                .unwrap();
            cs.step_scaled(
                &mut comp_p,
                &[g.to_dtype(candle_core::DType::F64).unwrap()],
                0.01,
                scale,
            )
            .unwrap();
        }
        let diff = (fused_p[0].to_dtype(candle_core::DType::F64).unwrap() - &comp_p[0])
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert!(diff < 1e-5, "fused and composed AdamW differ by {diff}");
    }

    #[test]
    fn state_names_are_the_state_a_step_keeps() {
        let settings = [
            Optimizer::AdamW {
                lr: 0.1,
                betas: [0.9, 0.99],
                eps: 1e-8,
                weight_decay: 0.0,
            },
            Optimizer::Sgd {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.1,
            },
            Optimizer::Sgd {
                lr: 0.1,
                momentum: 0.0,
                weight_decay: 0.1,
            },
        ];
        for kind in settings {
            let n = state_names(&kind).len();
            assert_eq!(n as u64, kind.state_per_param(), "{kind:?}");
            let mut st = OptState::new(kind, 1);
            let mut p = vec![Tensor::new(&[1.0f32], &Device::Cpu).unwrap()];
            st.step(&mut p, &[Tensor::new(&[0.5f32], &Device::Cpu).unwrap()], 0.1)
                .unwrap();
            let kept: Vec<bool> = (0..2).map(|k| st.state(k, 0).is_some()).collect();
            assert_eq!(kept, [n > 0, n > 1], "{kind:?}");
        }
    }

    #[test]
    fn sgd_momentum_matches_pytorch_semantics() {
        let kind = Optimizer::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        };
        let mut st = OptState::new(kind, 1);
        let mut p = vec![Tensor::new(&[1.0f32], &Device::Cpu).unwrap()];
        for _ in 0..2 {
            st.step(&mut p, &[Tensor::new(&[1.0f32], &Device::Cpu).unwrap()], 0.1)
                .unwrap();
        }
        // buf1 = 1, p = 0.9; buf2 = 0.9 + 1 = 1.9, p = 0.9 - 0.19 = 0.71
        assert!((p[0].to_vec1::<f32>().unwrap()[0] - 0.71).abs() < 1e-6);
    }
}
