//! What a training run measured, held against its plan in the table at the run's end.

use crate::fmt::bytes;
use shardplan_executor::runtime::device::DeviceMemory;

/// What the run measured, for the predicted-against-measured table at its end.
#[derive(Default)]
pub(super) struct Measured {
    step_seconds: Vec<f64>,
    exposed: Vec<f64>,
    max: shardplan_planner::ByCategory,
    peak: u64,
    /// The device's own figures, most on any rank over the steps (GPU runs).
    device: Option<DeviceMemory>,
    /// Each step's heaviest routing, as a factor over the even split (expert parallelism).
    routing: Vec<f64>,
}

impl Measured {
    /// The most of each device figure over the ranks of one step; `None` on the CPU.
    pub(super) fn device_max(m: &shardplan_executor::ShardedMetrics) -> Option<DeviceMemory> {
        m.measured_device.iter().flatten().copied().reduce(|a, b| DeviceMemory {
            allocated_peak: a.allocated_peak.max(b.allocated_peak),
            reserved_peak: a.reserved_peak.max(b.reserved_peak),
            in_use: a.in_use.max(b.in_use),
            total: a.total.max(b.total),
        })
    }

    pub(super) fn add(&mut self, m: &shardplan_executor::ShardedMetrics) {
        if let Some(d) = Self::device_max(m) {
            let seen = self.device.get_or_insert(d);
            seen.allocated_peak = seen.allocated_peak.max(d.allocated_peak);
            seen.reserved_peak = seen.reserved_peak.max(d.reserved_peak);
            seen.in_use = seen.in_use.max(d.in_use);
        }
        self.step_seconds.push(m.step_seconds);
        self.exposed.push(m.exposed_seconds);
        self.routing.extend(m.routing.map(|l| l.factor()));
        for by in &m.measured {
            for c in shardplan_planner::Category::ALL {
                *self.max.slot(c) = self.max.get(c).max(by.get(c));
            }
        }
        self.peak = self.peak.max(m.measured_peak.iter().copied().max().unwrap_or(0));
    }

    /// The median of the steps after the first (which pays for warm-up), or the first.
    fn steady(v: &[f64]) -> f64 {
        let mut x: Vec<f64> = if v.len() > 1 { v[1..].to_vec() } else { v.to_vec() };
        x.sort_by(f64::total_cmp);
        x.get(x.len() / 2).copied().unwrap_or(0.0)
    }

    /// The predicted-against-measured table.
    pub(super) fn versus(&self, plan: &shardplan_planner::Plan) -> String {
        use std::fmt::Write as _;
        let ratio = |m: f64, p: f64| if p > 0.0 { format!("{:.2}x", m / p) } else { "-".into() };
        let mut o = String::from("predicted vs measured (median step after the first; memory: most on any rank):\n");
        let e = &plan.estimate;
        let (st, ex) = (Self::steady(&self.step_seconds), Self::steady(&self.exposed));
        let _ = writeln!(o, "  {:<34} {:>12} {:>12} {:>7}", "", "predicted", "measured", "ratio");
        let _ = writeln!(
            o,
            "  {:<34} {:>9.1} ms {:>9.1} ms {:>7}",
            "step time",
            e.step_s * 1e3,
            st * 1e3,
            ratio(st, e.step_s)
        );
        let _ = writeln!(
            o,
            "  {:<34} {:>9.1} ms {:>9.1} ms {:>7}",
            "exposed communication",
            e.exposed_comm_s * 1e3,
            ex * 1e3,
            ratio(ex, e.exposed_comm_s)
        );
        for c in shardplan_planner::Category::ALL {
            let (p, m) = (plan.memory.max_by_category.get(c), self.max.get(c));
            if p == 0 && m == 0 {
                continue;
            }
            let _ = writeln!(
                o,
                "  {:<34} {:>12} {:>12} {:>7}",
                c.name(),
                bytes(p),
                bytes(m),
                ratio(m as f64, p as f64)
            );
        }
        let _ = writeln!(
            o,
            "  {:<34} {:>12} {:>12} {:>7}",
            "peak (all categories)",
            bytes(plan.memory.peak),
            bytes(self.peak),
            ratio(self.peak as f64, plan.memory.peak as f64)
        );
        if let Some(d) = self.device {
            let p = plan.memory.peak;
            for (name, m) in [
                ("GPU: allocator's peak allocated", d.allocated_peak),
                ("GPU: allocator's peak reserved", d.reserved_peak),
                ("GPU: in use on the device", d.in_use),
            ] {
                let _ = writeln!(
                    o,
                    "  {:<34} {:>12} {:>12} {:>7}",
                    name,
                    bytes(p),
                    bytes(m),
                    ratio(m as f64, p as f64)
                );
            }
        }
        if let (Some(e), Some(most)) = (&plan.experts, self.routing.iter().copied().reduce(f64::max)) {
            let mut sorted = self.routing.clone();
            sorted.sort_by(f64::total_cmp);
            let median = sorted[sorted.len() / 2];
            let bound = e.rows as f64 / e.even_rows.max(1) as f64;
            let _ = writeln!(
                o,
                "  expert routing: the busiest expert rank of any MoE layer received {most:.2}x the even split of {} rows at most (median step {median:.2}x); the plan's bound is {bound:.2}x ({} rows{})",
                e.even_rows,
                e.rows,
                if e.capacity_factor.is_some() {
                    ", exact: tokens past each expert's capacity were dropped"
                } else {
                    ", moe.capacity: a batch over it stops the run"
                }
            );
        }
        o
    }
}
