//! Expert parallelism's ops: the routing table gathered over a rank's expert group, the
//! rows sent to the ranks holding their experts and back (all-to-all), and the local
//! expert of each received row.
//!
//! Every rank of an expert group runs the same graph in the same order, so, as for the
//! tensor group, the group's collectives are tagged by a per-rank counter. Each rank of
//! the group reads the whole routing table, so every rank computes every send and receive
//! count itself and hands the receive counts to the all-to-all: it needs no count exchange.

use crate::comm::Collectives;
use crate::ExecError;
use candle_core::{DType as CDType, Tensor, TensorId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

type Result<T> = std::result::Result<T, ExecError>;

/// One rank's handle on its expert group, with the tag of its next collective.
pub struct ExpertGroup {
    comm: Arc<dyn Collectives>,
    next: AtomicU64,
    load: Mutex<Option<RoutingLoad>>,
    /// Each routing table's counts, by the table tensor's id: a layer's dispatch, local
    /// ids and combine, and the backward of the dispatch and the combine, all read one
    /// table, whose host copy (a device synchronisation on a GPU) is then made once per
    /// table rather than once per op. Emptied with the step's load ([`Self::take_load`]).
    /// (Shared by the compute stream's local ids and the all-to-all stream's dispatch and
    /// combine: one reads a table while the other waits, then finds its counts.)
    routes: Mutex<HashMap<TensorId, Arc<Routes>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How unevenly a step routed: of every MoE layer's dispatch, the one whose busiest rank
/// received the most rows (`rows`) beside the rows an even routing sends each rank
/// (`even`: a rank's `tokens x top_k`). Every rank of an expert group reads the whole
/// routing table, so each reports its group's figure.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct RoutingLoad {
    pub rows: u64,
    pub even: u64,
}

impl RoutingLoad {
    /// `rows / even`: the factor over the even split, what `moe.capacity` bounds.
    pub fn factor(&self) -> f64 {
        self.rows as f64 / self.even.max(1) as f64
    }

    /// The heavier of two (by factor).
    pub fn max(self, other: RoutingLoad) -> RoutingLoad {
        if other.factor() > self.factor() {
            other
        } else {
            self
        }
    }
}

/// Who sends which rows where, from the routing table of every rank of the group.
struct Routes {
    /// `counts[q][e]`: rows rank `q` routes to expert `e`.
    counts: Vec<Vec<usize>>,
    /// Experts per rank.
    n: usize,
    me: usize,
}

impl Routes {
    fn new(table: &Tensor, degree: usize, experts: usize, me: usize) -> Result<Self> {
        let (all, k) = table.dims2()?;
        let ids = table.to_dtype(CDType::U32)?.flatten_all()?.to_vec1::<u32>()?;
        let per = all / degree.max(1) * k;
        let mut counts = vec![vec![0usize; experts]; degree];
        for (q, c) in counts.iter_mut().enumerate() {
            for &e in &ids[q * per..(q + 1) * per] {
                let e = e as usize;
                // Dropped (`moe_drop`): last in the rank's expert order, sent nowhere.
                if e == experts {
                    continue;
                }
                if e > experts {
                    return Err(ExecError::Internal(format!(
                        "expert id {e} out of range ({experts} experts)"
                    )));
                }
                c[e] += 1;
            }
        }
        Ok(Routes {
            counts,
            n: experts / degree.max(1),
            me,
        })
    }

    fn degree(&self) -> usize {
        self.counts.len()
    }

    /// This rank's assignments (`tokens * k`), dropped ones included.
    fn assignments(&self, table: &Tensor) -> Result<usize> {
        let (all, k) = table.dims2()?;
        Ok(all / self.degree().max(1) * k)
    }

    /// Rows rank `q` sends to rank `r` (its rows of `r`'s experts).
    fn sends(&self, q: usize, r: usize) -> usize {
        self.counts[q][r * self.n..(r + 1) * self.n].iter().sum()
    }

    /// Rows rank `r`'s local expert `j` receives from every rank.
    fn expert_rows_of(&self, r: usize, j: usize) -> usize {
        self.counts.iter().map(|c| c[r * self.n + j]).sum()
    }

    /// Rows this rank's local expert `j` receives from every rank.
    fn expert_rows(&self, j: usize) -> usize {
        self.expert_rows_of(self.me, j)
    }

    /// Rows rank `r` receives.
    fn received_by(&self, r: usize) -> usize {
        (0..self.degree()).map(|q| self.sends(q, r)).sum()
    }

    fn received(&self) -> usize {
        self.received_by(self.me)
    }

    /// The rank that receives the most rows, and their count (the last such rank on ties).
    fn busiest(&self) -> (usize, usize) {
        (0..self.degree())
            .map(|r| (r, self.received_by(r)))
            .max_by_key(|&(_, n)| n)
            .unwrap_or((0, 0))
    }

    /// For each row of the dispatch's output order (local expert, source rank, source
    /// order), its row in the received chunks laid one after another in rank order.
    fn output_order(&self) -> Vec<u32> {
        let degree = self.degree();
        let mut chunk_start = vec![0usize; degree];
        for q in 1..degree {
            chunk_start[q] = chunk_start[q - 1] + self.sends(q - 1, self.me);
        }
        let mut order = Vec::with_capacity(self.received());
        for j in 0..self.n {
            for (q, c) in self.counts.iter().enumerate() {
                let base = self.me * self.n;
                let before: usize = c[base..base + j].iter().sum();
                let start = chunk_start[q] + before;
                order.extend((start..start + c[base + j]).map(|r| r as u32));
            }
        }
        order
    }

    /// The run-time check of the plan's bound on received rows. Every rank of the group
    /// reads the same table, so every rank finds the same overflow and fails with the
    /// same message before any row moves: none waits on a rank that stopped.
    fn check(&self, rows: usize) -> Result<()> {
        let (r, got) = self.busiest();
        if got <= rows {
            return Ok(());
        }
        let first = r * self.n;
        let busiest = (0..self.n).max_by_key(|&j| self.expert_rows_of(r, j)).unwrap_or(0);
        let even = self.counts[r].iter().sum::<usize>();
        let ratio = got as f64 / even.max(1) as f64;
        Err(ExecError::Data(format!(
            "expert rank {r} (experts {first}..{}) was routed {got} rows, more than the plan's bound of {rows} ({ratio:.2}x the even split of {even}); its busiest expert, {}, took {}: raise moe.capacity to at least {:.2}, or train with a larger load-balancing loss (moe.aux_loss_coef)",
            first + self.n,
            first + busiest,
            self.expert_rows_of(r, busiest),
            (ratio * 100.0).ceil() / 100.0,
        )))
    }
}

/// Rows `idx` of `t` (`[n, d]`), in that order; none gives `[0, d]`.
fn rows_at(t: &Tensor, idx: Vec<u32>) -> Result<Tensor> {
    let n = idx.len();
    if n == 0 {
        return Ok(Tensor::zeros((0, t.dim(1)?), t.dtype(), t.device())?);
    }
    Ok(t.index_select(&Tensor::from_vec(idx, n, t.device())?, 0)?)
}

impl ExpertGroup {
    pub fn new(comm: Arc<dyn Collectives>) -> Self {
        ExpertGroup {
            comm,
            next: AtomicU64::new(0),
            load: Mutex::new(None),
            routes: Mutex::new(HashMap::new()),
        }
    }

    /// The heaviest routing of the dispatches since the last call (`None`: none ran). The
    /// step is over: its routing tables' counts are let go.
    pub fn take_load(&self) -> Option<RoutingLoad> {
        lock(&self.routes).clear();
        lock(&self.load).take()
    }

    /// Waits for this group's collectives that were only enqueued (NCCL), under the
    /// collective timeout: the step's end.
    pub fn flush(&self) -> Result<()> {
        if self.comm.enqueues() {
            self.comm.flush()?;
        }
        Ok(())
    }

    /// The counts of routing table `table`, read from it once per table.
    fn routes(&self, table: &Tensor, degree: u64, experts: u64) -> Result<Arc<Routes>> {
        let (degree, experts) = (degree as usize, experts as usize);
        let mut held = lock(&self.routes);
        if let Some(r) = held.get(&table.id()) {
            if r.degree() == degree && r.counts.first().map_or(0, Vec::len) == experts {
                return Ok(r.clone());
            }
        }
        let r = Arc::new(Routes::new(table, degree, experts, self.comm.index())?);
        held.insert(table.id(), r.clone());
        Ok(r)
    }

    /// Routing tables whose counts are held (one per table read since the step began).
    #[cfg(test)]
    fn tables_held(&self) -> usize {
        lock(&self.routes).len()
    }

    /// Tags for a collective that takes `n` of them.
    fn tags(&self, n: u64) -> u64 {
        self.next.fetch_add(n, Ordering::Relaxed)
    }

    fn check(&self, degree: u64) -> Result<()> {
        if self.comm.size() as u64 == degree {
            Ok(())
        } else {
            Err(ExecError::Internal(format!(
                "an expert-parallel op of degree {degree} ran on an expert group of {} ranks",
                self.comm.size()
            )))
        }
    }

    /// Sends `parts[r]` (flat rows of width `d`) to member `r`; returns what every member
    /// sent this one (`rows[q]` rows from member `q`, as the routing table says), as rows,
    /// in member order.
    fn exchange(&self, parts: &[Tensor], rows: impl Iterator<Item = usize>, d: usize) -> Result<Tensor> {
        let lens: Vec<usize> = rows.map(|r| r * d).collect();
        let got = self.comm.all_to_all(self.tags(2), parts, &lens)?;
        let chunks: Vec<Tensor> = got
            .iter()
            .map(|t| t.reshape(((), d)))
            .collect::<std::result::Result<_, _>>()?;
        Ok(Tensor::cat(&chunks, 0)?)
    }

    /// `moe_gather_ids`: every rank's `[T, k]` expert ids, one after another.
    pub fn gather_ids(&self, ids: &Tensor, degree: u64) -> Result<Tensor> {
        self.check(degree)?;
        let (t, k) = ids.dims2()?;
        // Through f32 (exact below 2^24 experts): every backend moves floats.
        let all = self
            .comm
            .all_gather(self.tags(1), &ids.to_dtype(CDType::F32)?.flatten_all()?)?;
        // Every op of the layer reads the table on the host next; on a backend that only
        // enqueues the gather (NCCL), wait for it here, under the collective timeout,
        // rather than in a device read that cannot time out.
        self.flush()?;
        Ok(all.reshape((t * degree as usize, k))?.to_dtype(CDType::U32)?)
    }

    /// `moe_dispatch`: this rank's rows `x` (in expert order) to the ranks holding their
    /// experts; returns the rows of its own experts, ordered by (local expert, source rank,
    /// source order), zero rows after them up to `rows`.
    pub fn dispatch(&self, x: &Tensor, table: &Tensor, degree: u64, experts: u64, rows: u64) -> Result<Tensor> {
        self.check(degree)?;
        let routes = self.routes(table, degree, experts)?;
        let load = RoutingLoad {
            rows: routes.busiest().1 as u64,
            even: routes.assignments(table)? as u64,
        };
        let mut held = lock(&self.load);
        *held = Some(held.map_or(load, |l| l.max(load)));
        routes.check(rows as usize)?;
        let d = x.dim(1)?;
        let x = x.contiguous()?;
        let mut parts = Vec::with_capacity(routes.degree());
        let mut start = 0;
        for r in 0..routes.degree() {
            let n = routes.sends(routes.me, r);
            parts.push(x.narrow(0, start, n)?.flatten_all()?);
            start += n;
        }
        let me = routes.me;
        let recv = self.exchange(&parts, (0..routes.degree()).map(|q| routes.sends(q, me)), d)?;
        let order = routes.output_order();
        let n = order.len();
        let mut out = rows_at(&recv, order)?;
        if (rows as usize) > n {
            let pad = Tensor::zeros((rows as usize - n, d), x.dtype(), x.device())?;
            out = Tensor::cat(&[out, pad], 0)?;
        }
        Ok(out)
    }

    /// `moe_combine`: the dispatch undone, each row back to the rank it came from, in that
    /// rank's expert order.
    pub fn combine(&self, y: &Tensor, table: &Tensor, degree: u64, experts: u64) -> Result<Tensor> {
        self.check(degree)?;
        let routes = self.routes(table, degree, experts)?;
        let d = y.dim(1)?;
        if routes.received() > y.dim(0)? {
            return Err(ExecError::Internal(format!(
                "moe_combine of {} rows, {} received",
                y.dim(0)?,
                routes.received()
            )));
        }
        let y = y.contiguous()?;
        // Output row i came from received-chunk row order[i]; invert it per source rank.
        let order = routes.output_order();
        let mut at = vec![0u32; order.len()];
        for (i, &r) in order.iter().enumerate() {
            at[r as usize] = i as u32;
        }
        let mut parts = Vec::with_capacity(routes.degree());
        let mut start = 0;
        for q in 0..routes.degree() {
            let n = routes.sends(q, routes.me);
            parts.push(rows_at(&y, at[start..start + n].to_vec())?.flatten_all()?);
            start += n;
        }
        let me = routes.me;
        let back = self.exchange(&parts, (0..routes.degree()).map(|q| routes.sends(me, q)), d)?;
        // The rows `moe_drop` dropped went nowhere: zero rows in their places, the last of
        // this rank's expert order.
        let all = routes.assignments(table)?;
        let n = back.dim(0)?;
        if n < all {
            let pad = Tensor::zeros((all - n, d), back.dtype(), back.device())?;
            return Ok(Tensor::cat(&[back, pad], 0)?);
        }
        Ok(back)
    }

    /// `moe_local_ids`: the local expert of each of the `rows` received rows, the expert
    /// count per rank for the padding.
    pub fn local_ids(&self, table: &Tensor, degree: u64, experts: u64, rows: u64) -> Result<Tensor> {
        self.check(degree)?;
        let routes = self.routes(table, degree, experts)?;
        routes.check(rows as usize)?;
        let mut ids = Vec::with_capacity(rows as usize);
        for j in 0..routes.n {
            ids.extend(std::iter::repeat_n(j as u32, routes.expert_rows(j)));
        }
        ids.resize(rows as usize, routes.n as u32);
        Ok(Tensor::from_vec(ids, (rows as usize, 1), table.device())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Runs `f(group, rank)` on every rank of a Local expert group of `n` threads.
    fn on_group<T: Send>(n: usize, f: impl Fn(&ExpertGroup, usize) -> T + Sync) -> Vec<T> {
        crate::comm::local::on_group(n, |g, r| f(&ExpertGroup::new(Arc::new(g)), r))
    }

    /// Each rank's received rows, local ids and combined rows of a dispatch of `rows` over
    /// 4 experts on 2 ranks routed by `ids(rank)`, with room for 8 rows.
    #[allow(clippy::type_complexity)]
    fn round_trip(ids: fn(usize) -> Tensor) -> Vec<(Vec<Vec<f32>>, Vec<u32>, Vec<Vec<f32>>)> {
        on_group(2, |g, r| {
            let table = g.gather_ids(&ids(r), 2).unwrap();
            let recv = g.dispatch(&rows(r), &table, 2, 4, 8).unwrap();
            let lids = g.local_ids(&table, 2, 4, 8).unwrap();
            let back = g.combine(&recv, &table, 2, 4).unwrap();
            (
                recv.to_vec2::<f32>().unwrap(),
                lids.flatten_all().unwrap().to_vec1::<u32>().unwrap(),
                back.to_vec2::<f32>().unwrap(),
            )
        })
    }

    /// Rank `r`'s routing of 3 tokens, top 2, over 4 experts (2 per rank), deliberately
    /// uneven: rank 0 sends 5 of its 6 rows to rank 1's experts.
    fn ids(r: usize) -> Tensor {
        let v: Vec<u32> = if r == 0 {
            vec![2, 3, 0, 3, 2, 3]
        } else {
            vec![0, 1, 1, 2, 0, 3]
        };
        Tensor::from_vec(v, (3, 2), &Device::Cpu).unwrap()
    }

    /// A rank's rows in expert order, each row its (rank, position) so moves are visible.
    fn rows(r: usize) -> Tensor {
        let v: Vec<f32> = (0..6).flat_map(|i| [r as f32, i as f32]).collect();
        Tensor::from_vec(v, (6, 2), &Device::Cpu).unwrap()
    }

    #[test]
    fn dispatch_orders_by_local_expert_then_source_and_combine_undoes_it() {
        let out = round_trip(ids);
        // Rank 0 holds experts 0, 1: rank 0's row of expert 0 (its first in expert order),
        // then rank 1's two rows of expert 0, then rank 1's two of expert 1; zero padding.
        let (recv0, lids0, back0) = &out[0];
        assert_eq!(&recv0[..5], &[[0., 0.], [1., 0.], [1., 1.], [1., 2.], [1., 3.]]);
        assert_eq!(&recv0[5..], &[[0., 0.]; 3]);
        assert_eq!(lids0, &[0, 0, 0, 1, 1, 2, 2, 2]);
        // Rank 1 holds experts 2, 3: rank 0's two rows of expert 2, rank 1's one, then
        // rank 0's three of expert 3, rank 1's one.
        let (recv1, lids1, _) = &out[1];
        assert_eq!(
            &recv1[..7],
            &[[0., 1.], [0., 2.], [1., 4.], [0., 3.], [0., 4.], [0., 5.], [1., 5.]]
        );
        assert_eq!(lids1, &[0, 0, 0, 1, 1, 1, 1, 2]);
        // The combine brings every row home in its place.
        for (r, (_, _, back)) in out.iter().enumerate() {
            assert_eq!(back, &rows(r).to_vec2::<f32>().unwrap(), "rank {r}");
        }
        assert_eq!(back0.len(), 6);
    }

    /// A layer's dispatch, local ids and combine read their table's counts once; a second
    /// table (the next layer, a recomputation) adds its own; the step's end lets them go,
    /// and a table read again after it gives the same rows.
    #[test]
    fn a_routing_table_is_read_once_per_step() {
        let out = on_group(2, |g, r| {
            let table = g.gather_ids(&ids(r), 2).unwrap();
            let recv = g.dispatch(&rows(r), &table, 2, 4, 8).unwrap();
            g.local_ids(&table, 2, 4, 8).unwrap();
            g.combine(&recv, &table, 2, 4).unwrap();
            let one = g.tables_held();
            let again = g.gather_ids(&ids(r), 2).unwrap();
            g.dispatch(&rows(r), &again, 2, 4, 8).unwrap();
            let two = g.tables_held();
            g.take_load();
            let after = g.tables_held();
            let recv_after = g.dispatch(&rows(r), &table, 2, 4, 8).unwrap();
            (
                one,
                two,
                after,
                recv.to_vec2::<f32>().unwrap() == recv_after.to_vec2::<f32>().unwrap(),
            )
        });
        assert!(out.iter().all(|&o| o == (1, 2, 0, true)), "{out:?}");
    }

    #[test]
    fn every_rank_reports_the_heaviest_layer_of_its_group() {
        let even = |_: usize| Tensor::from_vec(vec![0u32, 1, 2, 3, 0, 2], (3, 2), &Device::Cpu).unwrap();
        let loads = on_group(2, |g, r| {
            assert_eq!(g.take_load(), None);
            // `ids`: rank 1 receives 7 rows, rank 0 five; then an even layer (6 each).
            for layer in [ids, even] {
                let table = g.gather_ids(&layer(r), 2).unwrap();
                g.dispatch(&rows(r), &table, 2, 4, 8).unwrap();
            }
            (g.take_load(), g.take_load())
        });
        for (r, (first, then)) in loads.into_iter().enumerate() {
            let want = RoutingLoad { rows: 7, even: 6 };
            assert_eq!(first, Some(want), "rank {r}");
            assert_eq!(then, None, "rank {r}: taken");
            assert!((want.factor() - 7.0 / 6.0).abs() < 1e-12);
        }
    }

    #[test]
    fn dropped_rows_are_sent_nowhere_and_come_back_zero() {
        // Rank 0's last two assignments dropped (id 4 of 4 experts): in expert order they are
        // its last two rows.
        let dropped = |r: usize| -> Tensor {
            let v: Vec<u32> = if r == 0 {
                vec![2, 3, 0, 4, 2, 4]
            } else {
                vec![0, 1, 1, 2, 0, 3]
            };
            Tensor::from_vec(v, (3, 2), &Device::Cpu).unwrap()
        };
        let out = round_trip(dropped);
        // Rank 1 holds experts 2, 3: rank 0's two rows of expert 2 and its one of expert 3
        // (rank 0's rows 1, 2, 3); its rows 4 and 5 were dropped and never arrive.
        let (recv1, lids1, _) = &out[1];
        assert_eq!(&recv1[..5], &[[0., 1.], [0., 2.], [1., 4.], [0., 3.], [1., 5.]]);
        assert_eq!(lids1, &[0, 0, 0, 1, 1, 2, 2, 2]);
        // Rank 0 gets its four routed rows back in place and zeros for the dropped two.
        let (_, _, back0) = &out[0];
        let mut want = rows(0).to_vec2::<f32>().unwrap();
        want[4] = vec![0., 0.];
        want[5] = vec![0., 0.];
        assert_eq!(back0, &want);
        assert_eq!(out[1].2, rows(1).to_vec2::<f32>().unwrap());
    }

    #[test]
    fn more_rows_than_the_bound_name_the_rank_the_count_and_the_fix() {
        let out = on_group(2, |g, r| {
            let table = g.gather_ids(&ids(r), 2).unwrap();
            g.dispatch(&rows(r), &table, 2, 4, 6)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        // Rank 0 receives 5 rows, rank 1 7: both see it in the table and stop before the
        // all-to-all, with the same message.
        for e in &out {
            let e = e.as_ref().unwrap_err();
            assert!(
                e.contains("expert rank 1 (experts 2..4) was routed 7 rows, more than the plan's bound of 6")
                    && e.contains("raise moe.capacity to at least 1.17"),
                "{e}"
            );
        }
    }
}
