//! The gradient norm (`Instr::GradNorm`) and the factor the optimizer step multiplies the
//! gradients by (averaging and clipping), on the host or on the buffers' device.

use super::*;

/// The factor an optimizer step multiplies its gradients by: averaging over micro-batches
/// times the clipping factor. On the CPU it is a number; on a GPU it stays a one-element
/// device tensor, so the host never waits for the norm inside a step.
pub(super) enum GradScale {
    Host(f64),
    Device(Tensor),
}

impl StepCtx<'_> {
    /// The sum of squares of `grads`, times `scale` squared, as a one-element f64 tensor on
    /// the buffers' device. On the host it is summed in f64 as it goes (the fused kernel
    /// for f32); on a GPU every tensor is reduced there and nothing is read back.
    pub(super) fn sum_squares(&self, grads: &[BufId], scale: f64) -> Result<Tensor, ExecError> {
        if self.shared.native {
            let mut parts = Vec::new();
            for g in grads {
                let t = self.get(*g)?;
                parts.extend(self.norm_parts(*g, &t)?);
            }
            if !parts.is_empty()
                && parts
                    .iter()
                    .all(|(t, _)| t.device().is_cuda() && t.dtype() == CDType::F32)
            {
                // One launch over every shard of the rank (per 48 tensors), nothing read back.
                return crate::gpu::sum_squares(&parts, scale);
            }
        }
        let mut host = 0f64;
        let mut device: Option<Tensor> = None;
        for g in grads {
            let t = self.get(*g)?;
            for (part, weight) in self.norm_parts(*g, &t)? {
                if part.device().is_cpu() {
                    let sq = if fused::applies(&[&part]) {
                        fused::sum_squares(&part)?
                    } else {
                        part.sqr()?.sum_all()?.to_dtype(CDType::F64)?.to_scalar::<f64>()?
                    };
                    host += sq * weight;
                } else {
                    let sq = (part.sqr()?.sum_all()?.to_dtype(CDType::F64)?.reshape(1)? * weight)?;
                    device = Some(match device {
                        Some(acc) => (acc + sq)?,
                        None => sq,
                    });
                }
            }
        }
        Ok(match device {
            // `(sq * scale) * scale`, as the host computes it.
            Some(d) => ((d + host)?.affine(scale, 0.0)?).affine(scale, 0.0)?,
            None => Tensor::new(&[host * scale * scale], &candle_core::Device::Cpu)?.to_device(&self.device)?,
        })
    }

    /// The pieces of gradient shard `buf` and the weight of each one's sum of squares in
    /// this rank's share of the norm: the whole buffer at 1 without tensor parallelism;
    /// with it, each parameter's rows, a parameter every tensor rank holds whole at
    /// `1 / tensor` (the plan sums the shares over the tensor group).
    pub(super) fn norm_parts(&self, buf: BufId, t: &Tensor) -> Result<Vec<(Tensor, f64)>, ExecError> {
        let plan = &self.shared.plan;
        let degree = plan.mesh.tensor();
        let group = plan.buffer(buf).group;
        let (true, Some(group)) = (degree > 1, group) else {
            return Ok(vec![(t.clone(), 1.0)]);
        };
        let g = &self.shared.joint.graph;
        let layout = &plan.groups[group.index()].layout;
        let mut parts = Vec::with_capacity(layout.params.len());
        for pl in &layout.params {
            let len = (pl.chunk_rows * pl.row_elems) as usize;
            let weight = if g.param(pl.param).tensor.is_some() {
                1.0
            } else {
                1.0 / degree as f64
            };
            parts.push((t.narrow(0, pl.shard_offset as usize, len)?, weight));
        }
        Ok(parts)
    }

    /// The gradient factor from the reduced sum of squares `sq`: `accum` times the clipping
    /// factor `clip / (norm + 1e-6)` when the norm exceeds the clip. A host tensor is read
    /// here (and a non-finite norm refused before any update); a device tensor is kept
    /// there and read once, after the step (`run_step`).
    pub(super) fn clip_scale(&self, sq: &Tensor, accum: f64) -> Result<GradScale, ExecError> {
        if !sq.device().is_cpu() {
            *lock(&self.norm) = Some(sq.clone());
            let total = sq.to_dtype(CDType::F64)?.flatten_all()?.sqrt()?;
            let Some(clip) = self.shared.clip else {
                return Ok(GradScale::Device(Tensor::full(accum, 1, sq.device())?));
            };
            let clip_t = Tensor::full(clip, 1, sq.device())?;
            let factor = (&clip_t / (&total + 1e-6)?)?;
            let factor = total
                .gt(&clip_t)?
                .where_cond(&factor, &Tensor::ones(1, CDType::F64, sq.device())?)?;
            // `accum * factor`, in the host's order.
            return Ok(GradScale::Device(factor.affine(accum, 0.0)?));
        }
        let sq = sq.to_dtype(CDType::F64)?.flatten_all()?.to_vec1::<f64>()?[0];
        let total = sq.sqrt();
        lock(&self.out).grad_norm = Some(total);
        if !total.is_finite() {
            return Err(ExecError::Internal(format!("the global gradient norm is {total}")));
        }
        let mut scale = accum;
        if let Some(clip) = self.shared.clip {
            if total > clip {
                scale *= clip / (total + 1e-6);
            }
        }
        Ok(GradScale::Host(scale))
    }
}
