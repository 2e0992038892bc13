//! Expert parallelism's ops: the routing table gathered over a rank's expert group, the
//! rows sent to the ranks holding their experts and back (all-to-all), and the local
//! expert of each received row.
//!
//! Every rank of an expert group runs the same graph in the same order, so, as for the
//! tensor group, the group's collectives are tagged by a per-rank counter. Each rank of
//! the group reads the whole routing table, so every rank computes every send and receive
//! count itself: the all-to-all needs no count exchange.

use crate::comm::Collectives;
use crate::ExecError;
use candle_core::{DType as CDType, Tensor};
use std::cell::Cell;
use std::sync::Arc;

type Result<T> = std::result::Result<T, ExecError>;

/// One rank's handle on its expert group, with the tag of its next collective.
pub struct ExpertGroup {
    comm: Arc<dyn Collectives>,
    next: Cell<u64>,
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
                if e >= experts {
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

    /// Rows rank `q` sends to rank `r` (its rows of `r`'s experts).
    fn sends(&self, q: usize, r: usize) -> usize {
        self.counts[q][r * self.n..(r + 1) * self.n].iter().sum()
    }

    /// Rows this rank's local expert `j` receives from every rank.
    fn expert_rows(&self, j: usize) -> usize {
        self.counts.iter().map(|c| c[self.me * self.n + j]).sum()
    }

    fn received(&self) -> usize {
        (0..self.degree()).map(|q| self.sends(q, self.me)).sum()
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

    /// The run-time check of the plan's bound on received rows.
    fn check(&self, rows: usize) -> Result<()> {
        let got = self.received();
        if got <= rows {
            return Ok(());
        }
        let first = self.me * self.n;
        let busiest = (0..self.n).max_by_key(|&j| self.expert_rows(j)).unwrap_or(0);
        let even = self.counts[self.me].iter().sum::<usize>();
        Err(ExecError::Data(format!(
            "expert rank {} (experts {first}..{}) was routed {got} rows, more than the plan's bound of {rows} ({:.2}x the even split of {even}); its busiest expert, {}, took {}: raise moe.capacity to at least {:.2}, or train with a larger load-balancing loss (moe.aux_loss_coef)",
            self.me,
            first + self.n,
            got as f64 / even.max(1) as f64,
            first + busiest,
            self.expert_rows(busiest),
            got as f64 / even.max(1) as f64,
        )))
    }
}

impl ExpertGroup {
    pub fn new(comm: Arc<dyn Collectives>) -> Self {
        ExpertGroup {
            comm,
            next: Cell::new(0),
        }
    }

    /// Tags for a collective that takes `n` of them.
    fn tags(&self, n: u64) -> u64 {
        let t = self.next.get();
        self.next.set(t + n);
        t
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

    /// `moe_gather_ids`: every rank's `[T, k]` expert ids, one after another.
    pub fn gather_ids(&self, ids: &Tensor, degree: u64) -> Result<Tensor> {
        self.check(degree)?;
        let (t, k) = ids.dims2()?;
        // Through f32 (exact below 2^24 experts): every backend moves floats.
        let all = self
            .comm
            .all_gather(self.tags(1), &ids.to_dtype(CDType::F32)?.flatten_all()?)?;
        Ok(all.reshape((t * degree as usize, k))?.to_dtype(CDType::U32)?)
    }

    /// `moe_dispatch`: this rank's rows `x` (in expert order) to the ranks holding their
    /// experts; returns the rows of its own experts, ordered by (local expert, source rank,
    /// source order), zero rows after them up to `rows`.
    pub fn dispatch(&self, x: &Tensor, table: &Tensor, degree: u64, experts: u64, rows: u64) -> Result<Tensor> {
        self.check(degree)?;
        let routes = Routes::new(table, degree as usize, experts as usize, self.comm.index())?;
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
        let got = self.comm.all_to_all(self.tags(2), &parts)?;
        let chunks: Vec<Tensor> = got
            .iter()
            .map(|t| t.reshape(((), d)))
            .collect::<std::result::Result<_, _>>()?;
        let recv = Tensor::cat(&chunks, 0)?;
        let order = routes.output_order();
        let n = order.len();
        let mut out = if n == 0 {
            Tensor::zeros((0, d), x.dtype(), x.device())?
        } else {
            recv.index_select(&Tensor::from_vec(order, n, x.device())?, 0)?
        };
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
        let routes = Routes::new(table, degree as usize, experts as usize, self.comm.index())?;
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
            let idx = at[start..start + n].to_vec();
            parts.push(if n == 0 {
                Tensor::zeros(0, y.dtype(), y.device())?
            } else {
                y.index_select(&Tensor::from_vec(idx, n, y.device())?, 0)?
                    .flatten_all()?
            });
            start += n;
        }
        let back = self.comm.all_to_all(self.tags(2), &parts)?;
        let chunks: Vec<Tensor> = back
            .iter()
            .map(|t| t.reshape(((), d)))
            .collect::<std::result::Result<_, _>>()?;
        Ok(Tensor::cat(&chunks, 0)?)
    }

    /// `moe_local_ids`: the local expert of each of the `rows` received rows, the expert
    /// count per rank for the padding.
    pub fn local_ids(&self, table: &Tensor, degree: u64, experts: u64, rows: u64) -> Result<Tensor> {
        self.check(degree)?;
        let routes = Routes::new(table, degree as usize, experts as usize, self.comm.index())?;
        routes.check(rows as usize)?;
        let mut ids = Vec::with_capacity(rows as usize);
        for j in 0..routes.n {
            ids.extend(std::iter::repeat_n(j as u32, routes.expert_rows(j)));
        }
        ids.resize(rows as usize, routes.n as u32);
        Ok(Tensor::from_vec(ids, (rows as usize, 1), table.device())?)
    }
}
