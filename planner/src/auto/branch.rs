//! The branch and bound behind [`super::search_spaces`]: the candidates as far as each
//! has been evaluated, the allocator replay only where a candidate's fit is open, plans
//! made ahead of their turn on other threads, the pruning rules, and the search's state
//! through its passes to the winner or, nothing fitting, to the least device total.

use super::{grid, AutoResult, Candidate, Fixed, Knobs, NoFit};
use crate::bounds::{BoundCache, Bounds};
use crate::{plan_candidate, simulate, Plan, PlanCache, PlanError};
use shardplan_frontends::ParallelConfig;
use shardplan_ir::JointGraph;
use std::collections::HashMap;

/// A candidate as far as it has been evaluated.
struct Entry {
    /// Its space: the traced graph it plans against (one per tensor-parallel degree).
    space: usize,
    knobs: Knobs,
    config: ParallelConfig,
    bounds: Bounds,
    /// Planned (without the replay unless `device_exact`).
    planned: Option<Candidate>,
    /// What the replay needs of its plan, while planned without it and nothing fits yet:
    /// the search then may still need its exact device total.
    unreplayed: Option<Box<Unreplayed>>,
}

/// A plan as far as the allocator replay needs it (with its config's hardware and
/// allocator): its [`Unreplayed::device_total`] is that of [`replayed`] of the whole plan.
struct Unreplayed {
    memory: crate::MemoryReport,
    program: crate::Program,
    buffers: Vec<crate::Buffer>,
    mesh: crate::Mesh,
    steps: std::sync::Arc<crate::CachedSteps>,
}

impl Unreplayed {
    /// The device total of the plan, the allocator replayed.
    fn device_total(self, config: &ParallelConfig) -> u64 {
        simulate::device_memory(
            self.memory,
            &self.program,
            &self.buffers,
            &self.steps.acts,
            &self.mesh,
            &config.hardware,
            config.allocator,
        )
        .device_total
    }
}

impl Entry {
    /// The best known lower bound on its device total (exact once replayed).
    fn device(&self) -> u64 {
        self.planned.as_ref().map_or(self.bounds.device, |c| c.device)
    }
}

/// A candidate's plan (without the replay) and its steps, as [`plan_candidate`] gives them.
type Planned = (Plan, std::sync::Arc<crate::CachedSteps>);

/// A planned candidate, replayed through the allocator only when `replay_if` says the fit
/// is open; otherwise what a later replay needs, when `keep` says so.
fn decide(
    (mut p, steps): Planned,
    knobs: &Knobs,
    budget: u64,
    keep: bool,
    replay_if: impl Fn(f64, u64) -> bool,
) -> (Candidate, Option<Box<Unreplayed>>) {
    // The allocator replay costs more than the rest of a candidate; it runs only where the
    // allocated peak plus the fixed overheads (a lower bound of the device total) leaves
    // the fit open, and where the caller still cares.
    // So does the sum of the streams' own peaks (`allocator::stream_peaks`), which is far
    // cheaper than the replay and often far above the allocated peak.
    let streams = crate::allocator::stream_peaks(&p.programs[0], &p.buffers, &steps.steps);
    let lower = p.memory.peak.max(streams).saturating_add(p.memory.overhead.total());
    let device_exact = lower <= budget && replay_if(p.estimate.step_s, lower);
    if device_exact {
        p.memory = replayed(&p, &steps.acts);
    }
    let device = if device_exact { p.memory.device_total } else { lower };
    let c = Candidate {
        knobs: knobs.clone(),
        step_s: p.estimate.step_s,
        mfu: p.estimate.mfu,
        exposed_comm_s: p.estimate.exposed_comm_s,
        peak: p.memory.peak,
        device,
        device_exact,
        fits: device_exact && device <= budget,
    };
    let rest = (keep && !device_exact).then(|| {
        Box::new(Unreplayed {
            memory: p.memory,
            program: p.programs.swap_remove(0),
            buffers: p.buffers,
            mesh: p.mesh,
            steps,
        })
    });
    (c, rest)
}

/// Plans `want` (indices of `entries`) at once, one thread each beyond the first, each with
/// its own copy of its space's cache: a plan does not depend on what the cache holds, only
/// on how long it takes.
fn plan_ahead(
    spaces: &[(&JointGraph, ParallelConfig)],
    entries: &[Entry],
    caches: &mut [PlanCache],
    workers: &mut [Vec<PlanCache>],
    want: &[usize],
) -> Vec<(usize, Result<Planned, PlanError>)> {
    let Some((&first, rest)) = want.split_first() else {
        return Vec::new();
    };
    std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(rest.len());
        for (&i, worker) in rest.iter().zip(workers.iter_mut()) {
            let e = &entries[i];
            let cache = &mut worker[e.space];
            let joint = spaces[e.space].0;
            handles.push((i, scope.spawn(move || plan_candidate(joint, &e.config, cache))));
        }
        let e = &entries[first];
        let mut out = vec![(
            first,
            plan_candidate(spaces[e.space].0, &e.config, &mut caches[e.space]),
        )];
        for (i, h) in handles {
            out.push((
                i,
                h.join()
                    .unwrap_or_else(|_| Err(PlanError::Bug("a planning thread panicked".into()))),
            ));
        }
        out
    })
}

/// What the search does with the next candidate of its order.
enum Turn {
    /// Bounded slower than the winner so far, as is every later one: the search stops.
    Stop,
    /// Skipped ([`shallower_prefetch_too_large`]).
    Skip,
    Plan,
}

/// Whether a planned candidate that differs from `entries[i]` only in a prefetch no deeper
/// in either direction already needs more than `budget` with its allocated peak plus the
/// CUDA context. Deeper prefetch only issues all-gathers earlier (allocating their outputs
/// sooner) with every free where it was, so at every point of the program at least the
/// same buffers are live: the allocated peak does not fall, and neither candidate fits.
/// (The search plans the shallower one first: prefetch is the innermost knob of [`grid`],
/// and equal time bounds are taken in grid order.)
fn shallower_prefetch_too_large(entries: &[Entry], i: usize, budget: u64) -> bool {
    (i.saturating_sub(3)..i).any(|o| {
        let e = &entries[o];
        shallower_prefetch(entries, o, i)
            && e.planned
                .as_ref()
                .is_some_and(|c| c.peak.saturating_add(e.config.hardware.cuda_context_bytes()) > budget)
    })
}

/// Whether `entries[o]` differs from `entries[i]` only in a prefetch no deeper in either
/// direction, and comes before it in [`grid`] order.
fn shallower_prefetch(entries: &[Entry], o: usize, i: usize) -> bool {
    let (o, k) = (&entries[o].knobs, &entries[i].knobs);
    o.prefetch_forward <= k.prefetch_forward
        && o.prefetch_backward <= k.prefetch_backward
        && Knobs {
            prefetch_forward: k.prefetch_forward,
            prefetch_backward: k.prefetch_backward,
            ..o.clone()
        } == *k
}

/// `p`'s memory with the caching allocator replayed over its program.
fn replayed(p: &Plan, acts: &crate::ActEvents) -> crate::MemoryReport {
    let mut m = simulate::device_memory(
        p.memory.clone(),
        &p.programs[0],
        &p.buffers,
        acts,
        &p.mesh,
        &p.hardware,
        p.policy.allocator,
    );
    if p.policy.runtime.is_shardplan() {
        m.arena = crate::arena::report(p).ok();
    }
    m
}

/// Every candidate of every space with its bounds (or none, without pruning), and each
/// space's plan cache: each space's grid and bounds are its own (its graph, its caches),
/// so one thread each.
fn bounded_entries(
    spaces: &[(&JointGraph, ParallelConfig)],
    fixed: Fixed,
    budget: u64,
    prune: bool,
) -> Result<(Vec<Entry>, Vec<PlanCache>), PlanError> {
    let per_space: Vec<Result<(Vec<Entry>, PlanCache), PlanError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = spaces
            .iter()
            .enumerate()
            .map(|(space, (joint, base))| {
                scope.spawn(move || {
                    let mut cache = PlanCache::default();
                    let mut bound_cache = BoundCache::with_budget(budget);
                    let mut entries = Vec::new();
                    for (knobs, config) in grid(joint, base, fixed) {
                        let bounds = if prune {
                            bound_cache.bounds(joint, &config, &mut cache)?
                        } else {
                            Bounds { step_s: 0.0, device: 0 }
                        };
                        entries.push(Entry {
                            space,
                            knobs,
                            config,
                            bounds,
                            planned: None,
                            unreplayed: None,
                        });
                    }
                    Ok((entries, cache))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(PlanError::Bug("a search thread panicked".into())))
            })
            .collect()
    });
    let mut caches: Vec<PlanCache> = Vec::with_capacity(spaces.len());
    let mut entries: Vec<Entry> = Vec::new();
    for r in per_space {
        let (e, c) = r?;
        entries.extend(e);
        caches.push(c);
    }
    Ok((entries, caches))
}

/// The winner so far: (step time, device total, index).
type Best = Option<(f64, u64, usize)>;

/// Plans made ahead of their turn, on other threads, by candidate index.
type Ahead = HashMap<usize, Result<Planned, PlanError>>;

/// One branch and bound over the candidates of several spaces: the candidates, the caches
/// they plan from (this thread's and each worker's copies), and the winner so far.
pub(super) struct Search<'a> {
    spaces: &'a [(&'a JointGraph, ParallelConfig)],
    budget: u64,
    prune: bool,
    entries: Vec<Entry>,
    caches: Vec<PlanCache>,
    /// Threads that plan candidates ahead (beside this one), each with copies of the caches.
    workers: Vec<Vec<PlanCache>>,
    threads: usize,
    /// Candidates planned by the passes (not those planned for the least device total).
    evaluated: usize,
    best: Best,
}

impl<'a> Search<'a> {
    /// A search over every candidate of `spaces` ([`bounded_entries`]) with nothing
    /// planned yet; an error if there are none.
    pub(super) fn new(
        spaces: &'a [(&'a JointGraph, ParallelConfig)],
        fixed: Fixed,
        budget: u64,
        prune: bool,
    ) -> Result<Search<'a>, PlanError> {
        let (entries, caches) = bounded_entries(spaces, fixed, budget, prune)?;
        if entries.is_empty() {
            return Err(PlanError::Graph("the search space is empty".into()));
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 4);
        let workers: Vec<Vec<PlanCache>> = (1..threads).map(|_| caches.clone()).collect();
        Ok(Search {
            spaces,
            budget,
            prune,
            entries,
            caches,
            workers,
            threads,
            evaluated: 0,
            best: None,
        })
    }

    /// Whether some candidate fits.
    pub(super) fn found(&self) -> bool {
        self.best.is_some()
    }

    /// The candidates with (or without) offload in the order the pass takes them: all in
    /// grid order without pruning; else those whose memory bound fits, by time bound.
    fn order(&self, offload: bool) -> Vec<usize> {
        let entries = &self.entries;
        let mut order: Vec<usize> = (0..entries.len())
            .filter(|&i| entries[i].knobs.offload == offload)
            .collect();
        if self.prune {
            // A memory bound over the budget cannot fit; the rest by time bound.
            order.retain(|&i| entries[i].bounds.device <= self.budget);
            order.sort_by(|&a, &b| {
                entries[a]
                    .bounds
                    .step_s
                    .total_cmp(&entries[b].bounds.step_s)
                    .then(a.cmp(&b))
            });
        }
        order
    }

    /// What the pruning rules say of candidate `i` as things stand.
    fn turn(&self, i: usize) -> Turn {
        if self.prune && self.best.is_some_and(|(t, _, _)| self.entries[i].bounds.step_s > t) {
            Turn::Stop
        } else if self.prune && shallower_prefetch_too_large(&self.entries, i, self.budget) {
            Turn::Skip
        } else {
            Turn::Plan
        }
    }

    /// One pass of the branch and bound over the candidates with (or without) offload:
    /// each planned in its turn unless the pruning rules skip it or stop the pass.
    pub(super) fn pass(&mut self, offload: bool) -> Result<(), PlanError> {
        let order = self.order(offload);
        // Plans made ahead of their turn, on other threads: each is taken in order, with the
        // decisions of a search that plans one at a time (one planned ahead but skipped
        // by then is dropped), so the winner and every score are the same.
        let mut ahead: Ahead = HashMap::new();
        for (k, &i) in order.iter().enumerate() {
            match self.turn(i) {
                Turn::Stop => break,
                Turn::Skip => continue,
                Turn::Plan => {}
            }
            if !ahead.contains_key(&i) {
                let want = self.wanted(i, &order[k + 1..], &ahead);
                ahead.extend(plan_ahead(
                    self.spaces,
                    &self.entries,
                    &mut self.caches,
                    &mut self.workers,
                    &want,
                ));
            }
            let planned = ahead
                .remove(&i)
                .ok_or_else(|| PlanError::Bug("a candidate was not planned".into()))??;
            self.take(i, planned);
        }
        Ok(())
    }

    /// Candidate `i` and the next few of `later` that would be planned as things stand now
    /// and are not planned yet (one for each worker). One whose shallower-prefetch sibling
    /// is planned beside it or ahead of its turn waits: that sibling's plan may skip it.
    fn wanted(&self, i: usize, later: &[usize], ahead: &Ahead) -> Vec<usize> {
        let mut want = vec![i];
        for &j in later {
            if want.len() > self.workers.len() {
                break;
            }
            match self.turn(j) {
                Turn::Stop => break,
                Turn::Skip => {}
                Turn::Plan if ahead.contains_key(&j) => {}
                Turn::Plan
                    if (j.saturating_sub(3)..j).any(|w| {
                        (want.contains(&w) || ahead.contains_key(&w)) && shallower_prefetch(&self.entries, w, j)
                    }) => {}
                Turn::Plan => want.push(j),
            }
        }
        want
    }

    /// Takes candidate `i`'s plan in its turn: replayed if it could still win, and the
    /// winner so far if it fits and beats it.
    fn take(&mut self, i: usize, planned: Planned) {
        // While nothing fits, the search may end up wanting the least device total, so
        // a plan not replayed is kept for its replay.
        let keep = self.best.is_none();
        let (prune, best) = (self.prune, self.best);
        let (c, rest) = decide(planned, &self.entries[i].knobs, self.budget, keep, |step_s, lower| {
            !prune
                || match best {
                    None => true,
                    Some((t, d, _)) => step_s < t || (step_s == t && lower <= d),
                }
        });
        self.entries[i].unreplayed = rest;
        self.evaluated += 1;
        if c.fits {
            let key = (c.step_s, c.device, i);
            let better = best.is_none_or(|(t, d, j)| {
                key.0.total_cmp(&t).then(key.1.cmp(&d)).then(key.2.cmp(&j)) == std::cmp::Ordering::Less
            });
            if better {
                if best.is_none() {
                    for e in &mut self.entries {
                        e.unreplayed = None; // something fits: no least device total is wanted
                    }
                }
                self.best = Some(key);
            }
        }
        self.entries[i].planned = Some(c);
    }

    /// The winner planned again in full (named, replayed, verified), from the search's
    /// caches, and every planned candidate, best first.
    pub(super) fn winner(mut self) -> Result<AutoResult, PlanError> {
        let Some((_, _, i)) = self.best else {
            return Err(PlanError::Bug("the search has no winner".into()));
        };
        let pruned = self.entries.len() - self.evaluated;
        let config = self.entries[i].config.clone();
        let space = self.entries[i].space;
        let joint = self.spaces[space].0;
        let (mut winner, _) = crate::plan_in(joint, &config, &mut self.caches[space])?;
        winner.shardplan_executor = crate::shardplan_executor_prediction(joint, &config, &mut self.caches[space])?;
        // Best first: fitting before not, then faster, then smaller, then earlier.
        let mut planned: Vec<(usize, Candidate)> = self
            .entries
            .into_iter()
            .enumerate()
            .filter_map(|(i, e)| e.planned.map(|c| (i, c)))
            .collect();
        planned.sort_by(|(i, a), (j, b)| {
            (!a.fits)
                .cmp(&!b.fits)
                .then(a.step_s.total_cmp(&b.step_s))
                .then(a.device.cmp(&b.device))
                .then(i.cmp(j))
        });
        Ok(AutoResult {
            winner,
            config,
            candidates: planned.into_iter().map(|(_, c)| c).collect(),
            evaluated: self.evaluated,
            pruned,
            context_effects: Vec::new(),
        })
    }

    /// Nothing fits: the candidate with the least device memory. Takes the candidates with
    /// the least bound and plans them (the bound becomes the allocated peak plus overheads)
    /// or, once planned, replays them (exact), until the least is exact (a bound never
    /// exceeds its candidate's total); among equal totals, the fastest, then the earliest.
    /// A plan not replayed is kept for its replay, so none is planned twice and only those
    /// that reach the least are replayed.
    pub(super) fn least_device(mut self) -> Result<NoFit, PlanError> {
        loop {
            let least = self.entries.iter().map(Entry::device).min().unwrap_or(0);
            let open: Vec<usize> = (0..self.entries.len())
                .filter(|&i| {
                    let e = &self.entries[i];
                    e.device() == least && !e.planned.as_ref().is_some_and(|c| c.device_exact)
                })
                .collect();
            if open.is_empty() {
                let (_, c) = self
                    .entries
                    .iter()
                    .enumerate()
                    .filter_map(|(i, e)| e.planned.as_ref().filter(|c| c.device == least).map(|c| (i, c)))
                    .min_by(|(i, a), (j, b)| a.step_s.total_cmp(&b.step_s).then(i.cmp(j)))
                    .ok_or_else(|| PlanError::Bug("no candidate holds the least device total".into()))?;
                return Ok(NoFit {
                    best: c.clone(),
                    budget: self.budget,
                });
            }
            // Those planned before, over the budget by their bound: replayed anyway, for
            // their totals; those not planned yet: planned. Each independent of the
            // others, so on the threads at once.
            let mut replays: Vec<(usize, Box<Unreplayed>)> = Vec::new();
            let mut unplanned: Vec<usize> = Vec::new();
            for i in open {
                let e = &mut self.entries[i];
                match (e.planned.is_some(), e.unreplayed.take()) {
                    (true, Some(u)) => replays.push((i, u)),
                    (false, _) => unplanned.push(i),
                    (true, None) => return Err(PlanError::Bug("a plan to replay was not kept".into())),
                }
            }
            self.replay(replays)?;
            self.plan_unplanned(&unplanned)?;
        }
    }

    /// Replays the kept plans of `replays` through the allocator, on the threads at once,
    /// and makes their candidates' device totals exact.
    fn replay(&mut self, replays: Vec<(usize, Box<Unreplayed>)>) -> Result<(), PlanError> {
        let per = replays.len().div_ceil(self.threads).max(1);
        let entries_ref = &self.entries;
        let totals: Result<Vec<Vec<(usize, u64)>>, PlanError> = std::thread::scope(|scope| {
            let mut handles = Vec::new();
            let mut rest = replays;
            while !rest.is_empty() {
                let tail = rest.split_off(per.min(rest.len()));
                let chunk = std::mem::replace(&mut rest, tail);
                handles.push(scope.spawn(move || {
                    chunk
                        .into_iter()
                        .map(|(i, u)| (i, u.device_total(&entries_ref[i].config)))
                        .collect::<Vec<_>>()
                }));
            }
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| PlanError::Bug("a replay thread panicked".into())))
                .collect()
        });
        for (i, total) in totals?.into_iter().flatten() {
            if let Some(c) = self.entries[i].planned.as_mut() {
                c.device = total;
                c.device_exact = true;
            }
        }
        Ok(())
    }

    /// Plans the candidates `unplanned` (as many at once as there are threads), each kept
    /// unreplayed unless its fit is open.
    fn plan_unplanned(&mut self, unplanned: &[usize]) -> Result<(), PlanError> {
        for chunk in unplanned.chunks(self.workers.len() + 1) {
            for (i, planned) in plan_ahead(self.spaces, &self.entries, &mut self.caches, &mut self.workers, chunk) {
                let (c, rest) = decide(planned?, &self.entries[i].knobs, self.budget, true, |_, _| true);
                self.entries[i].planned = Some(c);
                self.entries[i].unreplayed = rest;
            }
        }
        Ok(())
    }
}
