//! What the step-profiling examples share: a training step of the reference interpreter on
//! random parameters and zero tokens, timed node by node.

use shardplan_executor::{Ctx, Interpreter};
use shardplan_ir::{JointGraph, NodeId, Op};
use std::collections::HashMap;
use std::time::Duration;

pub struct TimedStep {
    interp: Interpreter,
    keep: Vec<NodeId>,
    feeds: HashMap<NodeId, candle_core::Tensor>,
    ctx: Ctx,
}

impl TimedStep {
    /// The step of `joint`, keeping the loss and every parameter gradient.
    pub fn new(joint: &JointGraph) -> Self {
        let mut keep = vec![joint.loss];
        keep.extend(joint.graph.params().map(|(p, _)| joint.grad(p).unwrap()));
        let dev = candle_core::Device::Cpu;
        let mut feeds = HashMap::new();
        for (id, n) in joint.graph.nodes() {
            let dims: Vec<usize> = n.ty.shape.dims().iter().map(|&d| d as usize).collect();
            let t = match &n.op {
                Op::Param { .. } => candle_core::Tensor::randn(0f32, 0.02, dims.as_slice(), &dev).unwrap(),
                Op::Input { .. } => candle_core::Tensor::zeros(dims.as_slice(), candle_core::DType::U32, &dev).unwrap(),
                _ => continue,
            };
            feeds.insert(id, t);
        }
        TimedStep {
            interp: Interpreter::new(joint.graph.clone(), &keep),
            keep,
            feeds,
            ctx: Ctx::new(dev),
        }
    }

    /// Runs the step once, adding each node's time to `times` (indexed by node).
    pub fn run(&self, times: &mut Vec<Duration>) {
        self.interp
            .run_timed(
                &self.ctx,
                &self.keep,
                &mut |id| Ok(self.feeds[&id].clone()),
                Some(times),
            )
            .unwrap();
    }
}
