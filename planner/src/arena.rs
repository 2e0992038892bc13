//! The plan's own device buffers at fixed offsets of one allocation per rank: the arena a
//! step can be captured and replayed in (issue 37's CUDA graph needs every address fixed)
//! and the device memory those buffers take, known before the run.
//!
//! The executor allocates and frees in issue order (every stream's allocations and frees
//! are sequenced by their issue index, as the simulated timeline orders them), so two
//! buffers whose lives do not overlap in issue order may share addresses. Persistent
//! buffers (sharded parameters, optimizer state) live across steps and share with nothing;
//! they sit at the bottom, one after another. Every other device buffer of the program is
//! placed greedily, one at a time, in the smallest gap between the buffers already placed
//! whose lives overlap its own (best fit; the lowest offset on ties): TensorFlow Lite's and
//! XLA's static memory planning for a straight-line program. Three orders (largest first,
//! longest life first, largest size x life first) are tried in turn until one comes within
//! 1% of the live peak, and the smallest arena kept. The
//! least any arena needs is the buffers' live peak ([`Arena::peak`]: buffers live at one
//! point of the issue order cannot share); the plans of `examples/` come within 1% of it.
//!
//! On a device, a free issued on the host does not mean the work before it on its stream
//! has finished. A buffer that takes addresses another held is safe when that one's free
//! happens before its allocation on the verifier's order ([`crate::verify`]'s vector clocks
//! over the streams): every access of the first happens before its free (the verifier
//! proves it), so before any access of the second. Where the plan's own events do not give
//! that order (a reduce-scatter input freed on the reduce-scatter stream and its addresses
//! taken by the next one on the compute stream), the arena lists the ordering it needs
//! ([`Arena::waits`]: an event after the free, waited on before the allocation), and
//! [`check`] proves the layout on the program's order with those added. They cost no time
//! in the simulated timeline, which already starts an allocation after every free issued
//! before it.
//!
//! Host buffers (CPU offload) are not in the arena. Activations are not either: they are
//! the compute steps' values, made and freed by the kernels' allocator.

use crate::plan::{ArenaReport, BufId, Instr, Plan, Pool, Program};
use crate::verify::{happens_before, HappensBefore, VerifyError};
use serde::{Deserialize, Serialize};

/// Every buffer starts at a multiple of this many bytes (the CUDA caching allocator's
/// block; cudaMalloc aligns to 256).
pub const ALIGN: u64 = 512;

/// A buffer's size in the arena: its bytes rounded up to [`ALIGN`] (a 0-byte buffer takes
/// nothing).
pub fn aligned(bytes: u64) -> u64 {
    bytes.div_ceil(ALIGN).saturating_mul(ALIGN)
}

/// One program's arena.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arena {
    /// Bytes of the one allocation.
    pub bytes: u64,
    /// The buffers' live peak in issue order, aligned: the least any arena of this program
    /// needs.
    pub peak: u64,
    /// Each buffer's offset, by buffer id; `None` for a buffer the program never allocates
    /// or that lives on the host.
    pub offsets: Vec<Option<u64>>,
    /// Orderings the addresses' reuse needs beyond the program's events: `(free, alloc)`
    /// issue indices, the allocation's stream waiting for the free's stream to reach the
    /// free. At most one per allocation and stream (the latest free).
    pub waits: Vec<(usize, usize)>,
}

impl Arena {
    /// How many buffers it holds.
    pub(crate) fn buffers(&self) -> usize {
        self.offsets.iter().flatten().count()
    }

    /// The buffer's offset, if it is in the arena.
    pub fn offset(&self, b: BufId) -> Option<u64> {
        self.offsets.get(b.index()).copied().flatten()
    }
}

impl From<&Arena> for ArenaReport {
    fn from(a: &Arena) -> Self {
        ArenaReport {
            bytes: a.bytes,
            peak: a.peak,
            buffers: a.buffers() as u64,
            waits: a.waits.len() as u64,
        }
    }
}

/// A buffer's issue indices of allocation and free; `None` for a persistent one.
type Life = Option<(usize, usize)>;
/// A device buffer, its aligned bytes and its life.
type Item = (BufId, u64, Life);
/// A placed buffer: offset, end, allocation and free.
type Span = (u64, u64, usize, usize);

/// Where each device buffer of program `p` lives, and when (issue indices of its
/// allocation and free; persistent buffers have neither).
struct Lifetimes {
    /// (buffer, aligned bytes, Some((alloc, free)) or None for persistent).
    items: Vec<Item>,
}

fn lifetimes(plan: &Plan, p: usize, program: &Program) -> Result<Lifetimes, VerifyError> {
    let n = plan.buffers.len();
    let mut alloc = vec![None; n];
    let mut free = vec![None; n];
    for (i, x) in program.instrs.iter().enumerate() {
        match x.instr {
            Instr::Alloc { buf } if buf.index() < n => alloc[buf.index()] = Some(i),
            Instr::Free { buf } if buf.index() < n => free[buf.index()] = Some(i),
            _ => {}
        }
    }
    let mut items = Vec::new();
    for b in &plan.buffers {
        if b.pool != Pool::Device {
            continue;
        }
        let bytes = aligned(b.bytes());
        if b.persistent {
            items.push((b.id, bytes, None));
            continue;
        }
        match (alloc[b.id.index()], free[b.id.index()]) {
            (None, None) => {}
            (Some(a), Some(f)) if a < f => items.push((b.id, bytes, Some((a, f)))),
            _ => {
                return Err(VerifyError {
                    rule: "arena",
                    program: p,
                    instr: alloc[b.id.index()].or(free[b.id.index()]),
                    message: format!(
                        "{} ({}) is not allocated once and freed once after it: it has no place in the arena",
                        b.id, b.name
                    ),
                })
            }
        }
    }
    Ok(Lifetimes { items })
}

/// Program `p`, its happens-before order with the orderings `waits` added, and its device
/// buffers' lives.
fn ordered<'a>(
    plan: &'a Plan,
    p: usize,
    waits: &[(usize, usize)],
) -> Result<(&'a Program, HappensBefore, Lifetimes), VerifyError> {
    let program = plan.programs.get(p).ok_or_else(|| VerifyError {
        rule: "arena",
        program: p,
        instr: None,
        message: format!("the plan has {} programs", plan.programs.len()),
    })?;
    let hb = happens_before(plan, p, program, waits)?;
    let lt = lifetimes(plan, p, program)?;
    Ok((program, hb, lt))
}

/// The live peak of `items` over the issue order (persistent ones live throughout).
fn live_peak(items: &[Item], n: usize) -> u64 {
    let mut delta = vec![0i128; n + 1];
    let mut base = 0u64;
    for &(_, bytes, life) in items {
        match life {
            None => base = base.saturating_add(bytes),
            Some((a, f)) => {
                delta[a] += i128::from(bytes);
                delta[f] -= i128::from(bytes);
            }
        }
    }
    let (mut live, mut peak) = (0i128, 0i128);
    for d in delta {
        live += d;
        peak = peak.max(live);
    }
    base.saturating_add(u64::try_from(peak).unwrap_or(u64::MAX))
}

/// Places `order`'s buffers (buffer, aligned bytes, (alloc, free)) one by one above `base`,
/// each in the smallest gap between the placed buffers whose lives overlap its own; returns
/// the top and the placed spans (offset, end, alloc, free), by offset. The spans are kept
/// sorted by (offset, end) as they are placed, so each buffer's clashes are read in order
/// where they were gathered and sorted for every buffer.
fn place(order: &[(BufId, u64, (usize, usize))], base: u64, offsets: &mut [Option<u64>]) -> (u64, Vec<Span>) {
    let mut top = base;
    let mut placed: Vec<Span> = Vec::with_capacity(order.len());
    for &(b, bytes, (a, f)) in order {
        let clash = placed.iter().filter(|&&(_, _, pa, pf)| pa < f && a < pf);
        // The smallest gap above `base` that holds `bytes`, else the end of the clashes.
        let mut best: Option<(u64, u64)> = None; // (gap size, offset)
        let mut at = base;
        for &(o, e, _, _) in clash {
            if o >= at {
                let gap = o - at;
                if gap >= bytes && best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, at));
                }
            }
            at = at.max(e);
        }
        let offset = best.map_or(at, |(_, o)| o);
        let end = offset.saturating_add(bytes);
        top = top.max(end);
        offsets[b.index()] = Some(offset);
        if bytes > 0 {
            let at = placed.partition_point(|&(o, e, _, _)| (o, e) <= (offset, end));
            placed.insert(at, (offset, end, a, f));
        }
    }
    (top, placed)
}

/// Lays out program `p`'s device buffers (see the module's comment). The program must have
/// passed the verifier's event checks; a program it would refuse gets the verifier's error.
pub fn layout(plan: &Plan, p: usize) -> Result<Arena, VerifyError> {
    let (program, hb, lt) = ordered(plan, p, &[])?;
    let mut offsets = vec![None; plan.buffers.len()];
    // Persistent buffers first, in id order.
    let mut base = 0u64;
    for &(b, bytes, life) in &lt.items {
        if life.is_none() {
            offsets[b.index()] = Some(base);
            base = base.saturating_add(bytes);
        }
    }
    let mut order: Vec<(BufId, u64, (usize, usize))> = lt
        .items
        .iter()
        .filter_map(|&(b, bytes, life)| life.map(|l| (b, bytes, l)))
        .collect();
    // Three orders, the smallest arena kept (see the module's comment).
    let mut best: Option<(u64, Vec<Span>, Vec<Option<u64>>)> = None;
    let peak = live_peak(&lt.items, program.instrs.len());
    for key in 0..3 {
        if best.as_ref().is_some_and(|b| b.0 <= peak.saturating_add(peak / 100)) {
            break; // within 1% of the lower bound: no order does much better
        }
        match key {
            0 => order.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0))),
            1 => order.sort_by(|a, b| (b.2 .1 - b.2 .0).cmp(&(a.2 .1 - a.2 .0)).then(b.1.cmp(&a.1))),
            _ => order.sort_by(|a, b| {
                let area = |x: &(BufId, u64, (usize, usize))| u128::from(x.1) * (x.2 .1 - x.2 .0) as u128;
                area(b).cmp(&area(a)).then(a.0.cmp(&b.0))
            }),
        }
        let mut offsets = offsets.clone();
        let (top, placed) = place(&order, base, &mut offsets);
        if best.as_ref().is_none_or(|b| top < b.0) {
            best = Some((top, placed, offsets));
        }
    }
    let (top, mut placed, offsets) = best.unwrap_or((base, Vec::new(), offsets));
    // The orderings reuse needs beyond the events: per allocation and stream of the frees,
    // the latest free it must follow (earlier ones on that stream come with it).
    placed.sort_unstable_by_key(|x| x.2);
    let mut latest: std::collections::BTreeMap<(usize, usize), usize> = Default::default();
    for (j, &(o, e, a, _)) in placed.iter().enumerate() {
        for &(po, pe, _, pf) in &placed[..j] {
            if po < e && o < pe && !hb.before(pf, a) {
                let s = program.instrs[pf].stream.index();
                let slot = latest.entry((a, s)).or_insert(pf);
                *slot = (*slot).max(pf);
            }
        }
    }
    let waits = latest.into_iter().map(|((a, _), f)| (f, a)).collect();
    Ok(Arena {
        bytes: top,
        peak,
        offsets,
        waits,
    })
}

/// Proves `arena` safe for program `p`: every device buffer the program uses has a place,
/// aligned and inside the arena, and two buffers whose places overlap are persistent
/// neither and one is freed before the other is allocated on the happens-before order of
/// the program's events and the arena's [`Arena::waits`].
/// Independent of [`layout`]'s search: a plan edited by hand or an arena from elsewhere is
/// checked the same way.
pub fn check(plan: &Plan, p: usize, arena: &Arena) -> Result<(), VerifyError> {
    let (_, hb, lt) = ordered(plan, p, &arena.waits)?;
    let fail = |message: String| VerifyError {
        rule: "arena",
        program: p,
        instr: None,
        message,
    };
    let mut spans = Vec::with_capacity(lt.items.len());
    for &(b, bytes, life) in &lt.items {
        let name = &plan.buffer(b).name;
        let Some(o) = arena.offset(b) else {
            return Err(fail(format!("{b} ({name}) has no place in the arena")));
        };
        if o % ALIGN != 0 {
            return Err(fail(format!("{b} ({name}) starts at {o}, not a multiple of {ALIGN}")));
        }
        let end = o.checked_add(bytes).filter(|&e| e <= arena.bytes).ok_or_else(|| {
            fail(format!(
                "{b} ({name}) at {o} takes {bytes} bytes, past the arena's {}",
                arena.bytes
            ))
        })?;
        if bytes > 0 {
            spans.push((o, end, b, life));
        }
    }
    // Sweep by offset: each span against those still open at its start.
    spans.sort_unstable_by_key(|s| (s.0, s.1));
    let mut open: Vec<(u64, u64, BufId, Life)> = Vec::new();
    for &s in &spans {
        open.retain(|o| o.1 > s.0);
        for o in &open {
            let ordered = match (o.3, s.3) {
                (Some((oa, of)), Some((sa, sf))) => hb.before(of, sa) || hb.before(sf, oa),
                _ => false,
            };
            if !ordered {
                return Err(fail(format!(
                    "{} ({}) and {} ({}) overlap in the arena ({}..{} and {}..{}) but may be live at once",
                    o.2,
                    plan.buffer(o.2).name,
                    s.2,
                    plan.buffer(s.2).name,
                    o.0,
                    o.1,
                    s.0,
                    s.1
                )));
            }
        }
        open.push(s);
    }
    Ok(())
}

/// Program 0's arena summary, for the memory report, every program's arena laid out and
/// proven by [`check`]; the verifier's error when a program would not verify or an arena
/// fails its proof (a planner bug).
pub fn report(plan: &Plan) -> Result<ArenaReport, VerifyError> {
    let mut first = None;
    for p in 0..plan.programs.len() {
        let a = layout(plan, p)?;
        check(plan, p, &a)?;
        first.get_or_insert(ArenaReport::from(&a));
    }
    first.ok_or_else(|| VerifyError {
        rule: "arena",
        program: 0,
        instr: None,
        message: "the plan has no program".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_aligned() {
        assert_eq!(aligned(0), 0);
        assert_eq!(aligned(1), 512);
        assert_eq!(aligned(512), 512);
        assert_eq!(aligned(513), 1024);
        assert_eq!(aligned(u64::MAX), u64::MAX);
    }
}
