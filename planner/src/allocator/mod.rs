//! A model of PyTorch's CUDA caching allocator: what a program's allocations reserve from
//! the device, fragmentation included.
//!
//! The rules, as `c10/cuda/CUDACachingAllocator.cpp` applies them (no `max_split_size`, no
//! power-of-two rounding, no `empty_cache`), in both of its ways to get device memory:
//! - a request is rounded up to a multiple of [`MIN_BLOCK`] (512 bytes; a 0-byte request
//!   allocates nothing);
//! - requests up to [`SMALL_SIZE`] (1 MiB) come from the small pool, larger ones from the
//!   large pool; each pool keeps the free blocks of every stream apart, and a block freed
//!   goes back to the stream it was allocated on;
//! - a request takes the smallest free block of its pool and stream that is large enough
//!   (ties to the lowest address);
//! - a freed block merges with free neighbours of its segment;
//! - nothing is given back (no `empty_cache`, and the replay never runs out of memory, so
//!   the allocator's release-and-retry path never runs): the reserved peak is the reserved
//!   total at the end.
//!
//! Without expandable segments (PyTorch's default, `expandable_segments: false`), a miss
//! reserves a new segment with `cudaMalloc`: [`SMALL_SEGMENT`] (2 MiB) for small requests,
//! [`LARGE_SEGMENT`] (20 MiB) for requests below [`MIN_LARGE_ALLOC`] (10 MiB), otherwise
//! the request rounded up to [`ROUND_LARGE`] (2 MiB). The block taken is split when what is
//! left stays useful: in the small pool when at least 512 bytes remain, in the large pool
//! when more than 1 MiB remains (so a large block may hold up to 1 MiB it was not asked
//! for); the remainder stays a free block of the same segment, after the allocated part.
//!
//! With expandable segments (`expandable_segments: true`, what torchtitan launches with),
//! each pool of each stream has one segment: a virtual range far larger than the device,
//! of which a prefix is mapped to physical memory in pages of [`SMALL_PAGE`] (2 MiB, small
//! pool) or [`LARGE_PAGE`] (20 MiB, large pool). Blocks tile the mapped prefix. A miss
//! maps just enough pages after the prefix's end to serve the request, from the start of
//! the free block that ends the prefix when there is one (that block grows by the pages
//! mapped) or else from the old end; the rest of the last page is a free block of the
//! prefix. Every block is split when at least 512 bytes would remain, in either pool. In
//! best fit, the free block that ends the prefix counts as the size it could grow to: it
//! is taken only when no other free block of its pool and stream is large enough. So
//! reserved is what was allocated at the worst moment plus the holes between live blocks
//! and less than a page per pool and stream.
//!
//! Addresses are a counter (segments in the order they are reserved), so ties between equal
//! free blocks go to the older segment, as they do on a device that hands out rising
//! addresses. The free blocks of each pool and stream are a vector sorted by size and
//! address: best fit is a binary search, and inserting or removing one moves the larger
//! entries of its pool and stream (a replay holds a handful of free blocks per pool and
//! stream, where a vector beats a search tree several times over). Blocks live in an arena
//! whose slots are reused, so a long replay allocates only while the free lists grow.

mod trace;
pub use trace::{read_alloc_trace, RecordedTrace, MAX_REQUEST_BYTES, MAX_STREAMS, MAX_TRACE_REQUESTED, TRACE_VERSION};

/// Every request is rounded up to a multiple of this many bytes.
pub(crate) const MIN_BLOCK: u64 = 512;
/// The largest request the small pool serves (1 MiB).
pub(crate) const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool (2 MiB).
pub(crate) const SMALL_SEGMENT: u64 = 2 << 20;
/// Segment size for large requests below [`MIN_LARGE_ALLOC`] (20 MiB).
pub(crate) const LARGE_SEGMENT: u64 = 20 << 20;
/// From this request size on, a segment is the request itself, rounded (10 MiB).
pub(crate) const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Rounding of segments made for large requests (2 MiB).
pub(crate) const ROUND_LARGE: u64 = 2 << 20;
/// Mapping granularity of an expandable segment of the small pool (2 MiB).
pub(crate) const SMALL_PAGE: u64 = 2 << 20;
/// Mapping granularity of an expandable segment of the large pool (20 MiB).
pub(crate) const LARGE_PAGE: u64 = 20 << 20;

/// Streams whose pools are kept apart (3 bits of stream).
pub(crate) const STREAMS: usize = 8;
/// Pool-and-stream classes: the small flag and 3 bits of stream.
const CLASSES: usize = 2 * STREAMS;

const NONE: u32 = u32::MAX;

/// The size a request of `bytes` occupies: rounded up to [`MIN_BLOCK`], at least one block.
pub(crate) fn round(bytes: u64) -> u64 {
    bytes.div_ceil(MIN_BLOCK).max(1).saturating_mul(MIN_BLOCK)
}

/// The segment reserved for a (rounded) request that no free block can serve.
pub(crate) fn segment_size(rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_SEGMENT
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_SEGMENT
    } else {
        rounded.div_ceil(ROUND_LARGE).saturating_mul(ROUND_LARGE)
    }
}

/// A block of a segment: allocated or free.
#[derive(Clone, Copy, Debug)]
struct Block {
    addr: u64,
    size: u64,
    /// Neighbours in the same segment (`NONE` at its ends).
    prev: u32,
    next: u32,
    stream: u8,
    small: bool,
    live: bool,
}

/// The class of a block's pool and stream: the small flag, then 3 bits of stream.
fn class_of(small: bool, stream: u8) -> usize {
    (usize::from(small) << 3) | usize::from(stream & 7)
}

/// A free block in its pool and stream's list.
#[derive(Clone, Copy, Debug)]
struct FreeEntry {
    size: u64,
    addr: u64,
    block: u32,
}

/// The free blocks of one pool and stream, sorted by (size, address): best fit is the first
/// entry at least as large as the request (ties to the lowest address).
#[derive(Clone, Debug, Default)]
struct FreeList(Vec<FreeEntry>);

impl FreeList {
    /// Where the first entry of at least `size` bytes is (or would be).
    fn fit(&self, size: u64) -> usize {
        self.0.partition_point(|e| e.size < size)
    }

    fn position(&self, size: u64, addr: u64) -> Result<usize, usize> {
        self.0.binary_search_by(|e| (e.size, e.addr).cmp(&(size, addr)))
    }

    fn insert(&mut self, size: u64, addr: u64, block: u32) {
        let (Ok(i) | Err(i)) = self.position(size, addr);
        self.0.insert(i, FreeEntry { size, addr, block });
    }

    fn remove(&mut self, size: u64, addr: u64) {
        if let Ok(i) = self.position(size, addr) {
            self.0.remove(i);
        }
    }
}

/// The allocator's state and its counters, in bytes.
#[derive(Clone, Debug)]
pub(crate) struct CachingAllocator {
    blocks: Vec<Block>,
    spare: Vec<u32>,
    /// Free blocks by class ([`class_of`]).
    free: [FreeList; CLASSES],
    next_addr: u64,
    /// Expandable segments: one segment per pool and stream.
    expandable: bool,
    /// Expandable segments: each class's last block (the end of its mapped prefix), or
    /// `NONE` before its first mapping.
    last: [u32; CLASSES],
    /// Expandable segments: each class's mapped bytes (the end of its prefix).
    mapped: [u64; CLASSES],
    /// Bytes in segments (PyTorch's "reserved").
    pub reserved: u64,
    /// Bytes in allocated blocks, as rounded and split (PyTorch's "allocated"/"active").
    pub allocated: u64,
    /// Bytes requested by the live allocations, unrounded.
    pub requested: u64,
    pub allocated_peak: u64,
    pub requested_peak: u64,
    /// Each stream's own requested bytes, and their peaks (by the stream's low 3 bits, as
    /// its pools are kept).
    stream_requested: [u64; STREAMS],
    pub stream_requested_peaks: [u64; STREAMS],
    /// Segments reserved so far (with expandable segments: mappings grown).
    pub segments: u64,
}

impl Default for CachingAllocator {
    /// PyTorch's default allocator: one `cudaMalloc` segment per miss.
    fn default() -> Self {
        CachingAllocator::new(false)
    }
}

/// A live allocation (the block it holds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Allocation {
    block: u32,
    requested: u64,
}

impl CachingAllocator {
    /// An empty allocator; `expandable_segments` as PyTorch's setting of that name.
    pub(crate) fn new(expandable_segments: bool) -> Self {
        CachingAllocator {
            blocks: Vec::new(),
            spare: Vec::new(),
            free: Default::default(),
            next_addr: 0,
            expandable: expandable_segments,
            last: [NONE; CLASSES],
            mapped: [0; CLASSES],
            reserved: 0,
            allocated: 0,
            requested: 0,
            allocated_peak: 0,
            requested_peak: 0,
            stream_requested: [0; STREAMS],
            stream_requested_peaks: [0; STREAMS],
            segments: 0,
        }
    }

    /// Allocates `bytes` for `stream`; `None` for a 0-byte request, which takes nothing.
    pub(crate) fn alloc(&mut self, stream: u8, bytes: u64) -> Option<Allocation> {
        if bytes == 0 {
            return None;
        }
        let size = round(bytes);
        let small = size <= SMALL_SIZE;
        let c = class_of(small, stream);
        let list = &mut self.free[c];
        let mut found = list.fit(size);
        // With expandable segments, the block that ends the mapped prefix counts as the
        // size it could grow to: any other block large enough is a better fit.
        if self.expandable && list.0.get(found).is_some_and(|e| e.block == self.last[c]) && found + 1 < list.0.len() {
            found += 1;
        }
        let b = match (found < list.0.len()).then(|| list.0.remove(found).block) {
            Some(b) => b,
            None if self.expandable => self.grow(small, stream, size),
            None => {
                let seg = segment_size(size);
                let addr = self.next_addr;
                self.next_addr = self.next_addr.saturating_add(seg);
                self.reserved = self.reserved.saturating_add(seg);
                self.segments += 1;
                self.new_block(Block {
                    addr,
                    size: seg,
                    prev: NONE,
                    next: NONE,
                    stream,
                    small,
                    live: false,
                })
            }
        };
        let block = self.blocks[b as usize];
        let remaining = block.size - size;
        let split = if small || self.expandable {
            remaining >= MIN_BLOCK
        } else {
            remaining > SMALL_SIZE
        };
        if split {
            let rest = self.new_block(Block {
                addr: block.addr + size,
                size: remaining,
                prev: b,
                next: block.next,
                stream,
                small,
                live: false,
            });
            if block.next != NONE {
                self.blocks[block.next as usize].prev = rest;
            }
            let blk = &mut self.blocks[b as usize];
            blk.next = rest;
            blk.size = size;
            self.free[c].insert(remaining, block.addr + size, rest);
            if self.expandable && self.last[c] == b {
                self.last[c] = rest;
            }
        }
        let blk = &mut self.blocks[b as usize];
        blk.live = true;
        self.allocated = self.allocated.saturating_add(blk.size);
        self.requested = self.requested.saturating_add(bytes);
        self.allocated_peak = self.allocated_peak.max(self.allocated);
        self.requested_peak = self.requested_peak.max(self.requested);
        let st = usize::from(stream) % STREAMS;
        self.stream_requested[st] = self.stream_requested[st].saturating_add(bytes);
        self.stream_requested_peaks[st] = self.stream_requested_peaks[st].max(self.stream_requested[st]);
        Some(Allocation {
            block: b,
            requested: bytes,
        })
    }

    /// Returns `a`'s block to its pool and stream, merged with free neighbours.
    pub(crate) fn free(&mut self, a: Allocation) {
        let b = a.block;
        let Some(&block) = self.blocks.get(b as usize) else {
            return;
        };
        if !block.live {
            return;
        }
        self.allocated = self.allocated.saturating_sub(block.size);
        self.requested = self.requested.saturating_sub(a.requested);
        let st = usize::from(block.stream) % STREAMS;
        self.stream_requested[st] = self.stream_requested[st].saturating_sub(a.requested);
        let mut merged = Block { live: false, ..block };
        if block.prev != NONE && !self.blocks[block.prev as usize].live {
            let p = self.blocks[block.prev as usize];
            self.free[class_of(p.small, p.stream)].remove(p.size, p.addr);
            self.spare.push(block.prev);
            merged.addr = p.addr;
            merged.size += p.size;
            merged.prev = p.prev;
            if p.prev != NONE {
                self.blocks[p.prev as usize].next = b;
            }
        }
        if block.next != NONE && !self.blocks[block.next as usize].live {
            let n = self.blocks[block.next as usize];
            self.free[class_of(n.small, n.stream)].remove(n.size, n.addr);
            self.spare.push(block.next);
            merged.size += n.size;
            merged.next = n.next;
            if n.next != NONE {
                self.blocks[n.next as usize].prev = b;
            }
        }
        self.blocks[b as usize] = merged;
        self.free[class_of(merged.small, merged.stream)].insert(merged.size, merged.addr, b);
        if self.expandable && merged.next == NONE {
            // It absorbed the block that ended the mapped prefix (or was it).
            self.last[class_of(merged.small, merged.stream)] = b;
        }
    }

    /// Expandable segments: maps the pages a request of `size` needs at the end of its
    /// class's prefix; returns the (unindexed) free block that now holds them.
    fn grow(&mut self, small: bool, stream: u8, size: u64) -> u32 {
        let c = class_of(small, stream);
        let page = if small { SMALL_PAGE } else { LARGE_PAGE };
        let last = self.last[c];
        let tail = (last != NONE && !self.blocks[last as usize].live).then_some(last);
        // The free block at the end of the prefix is extended; otherwise a block starts at
        // the end.
        let have = tail.map_or(0, |t| self.blocks[t as usize].size);
        let grown = (size - have).div_ceil(page).saturating_mul(page);
        self.reserved = self.reserved.saturating_add(grown);
        self.segments += 1;
        let end = self.mapped[c];
        self.mapped[c] = end.saturating_add(grown);
        match tail {
            Some(t) => {
                let blk = self.blocks[t as usize];
                self.free[c].remove(blk.size, blk.addr);
                self.blocks[t as usize].size += grown;
                t
            }
            None => {
                let b = self.new_block(Block {
                    addr: end,
                    size: grown,
                    prev: last,
                    next: NONE,
                    stream,
                    small,
                    live: false,
                });
                if last != NONE {
                    self.blocks[last as usize].next = b;
                }
                self.last[c] = b;
                b
            }
        }
    }

    /// Free bytes held in segments (reserved but not allocated).
    #[cfg(test)]
    pub(crate) fn cached(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }

    /// Free blocks, each as (small pool?, stream, size), smallest first per pool and stream.
    #[cfg(test)]
    pub(crate) fn free_blocks(&self) -> Vec<(bool, u8, u64)> {
        self.free
            .iter()
            .flat_map(|l| &l.0)
            .map(|e| {
                let b = &self.blocks[e.block as usize];
                (b.small, b.stream, b.size)
            })
            .collect()
    }

    fn new_block(&mut self, b: Block) -> u32 {
        match self.spare.pop() {
            Some(i) => {
                self.blocks[i as usize] = b;
                i
            }
            None => {
                self.blocks.push(b);
                (self.blocks.len() - 1) as u32
            }
        }
    }
}

/// Replays of a step at most: the allocator's cache carries over from one step to the next,
/// so the first step (from an empty cache) need not be the one that reserves the most.
pub(crate) const MAX_REPLAYS: u32 = 3;

/// What the caching allocator holds over a program, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Replay {
    /// Bytes in segments at the end (segments are never released: the peak).
    pub reserved: u64,
    /// Peak of allocated blocks (rounded, with unsplit remainders).
    pub allocated_peak: u64,
    /// Peak of the requested bytes themselves (the plan's own accounting).
    pub requested_peak: u64,
    /// Each stream's own peak of requested bytes (by stream number, 8 of them).
    pub stream_requested_peaks: [u64; STREAMS],
    pub segments: u64,
    /// Steps replayed: until one reserves nothing more, at most [`MAX_REPLAYS`].
    pub steps: u32,
}

/// Replays `program` through the allocator model: persistent device buffers first (on the
/// compute stream, as they are made at start-up), then the program's allocs and frees in
/// issue order (the host issues them, and the allocator sees them, in that order), each
/// compute step's activations made and freed where it runs, on the compute stream. Host
/// buffers are not device memory and are left out. `settings` are the allocator's.
pub fn replay(
    program: &crate::plan::Program,
    buffers: &[crate::plan::Buffer],
    acts: &crate::steps::ActEvents,
    settings: shardplan_frontends::AllocatorConfig,
) -> Replay {
    use crate::plan::{Pool, Stream};
    let mut r = Replayer::new(settings);
    let compute = Stream::Compute.index() as u8;
    for b in buffers.iter().filter(|b| b.persistent && b.pool == Pool::Device) {
        r.apply(Request::Alloc {
            id: b.id.index() as u32,
            stream: compute,
            bytes: b.bytes(),
        });
    }
    let step = step_requests(program, buffers, acts);
    let mut steps = 0;
    while steps < MAX_REPLAYS {
        let before = r.a.reserved;
        for &q in &step {
            r.apply(q);
        }
        steps += 1;
        if steps > 1 && r.a.reserved == before {
            break;
        }
    }
    r.done(steps)
}

/// One request a program makes of the allocator: `bytes` for `stream` under the id
/// `id`, or the free of the live allocation `id`. Ids are dense (small integers: the
/// replay keeps a slot per id).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    Alloc { id: u32, stream: u8, bytes: u64 },
    Free { id: u32 },
}

/// An allocator and the live allocation of each request id.
struct Replayer {
    a: CachingAllocator,
    live: Vec<Option<Allocation>>,
}

impl Replayer {
    fn new(settings: shardplan_frontends::AllocatorConfig) -> Self {
        Replayer {
            a: CachingAllocator::new(settings.expandable_segments),
            live: Vec::new(),
        }
    }

    /// An alloc of a live id frees it first; a free of an id not live is nothing.
    fn apply(&mut self, r: Request) {
        let id = match r {
            Request::Alloc { id, .. } | Request::Free { id } => id as usize,
        };
        if self.live.len() <= id {
            self.live.resize(id + 1, None);
        }
        if let Some(old) = self.live[id].take() {
            self.a.free(old);
        }
        if let Request::Alloc { stream, bytes, .. } = r {
            self.live[id] = self.a.alloc(stream, bytes);
        }
    }

    fn done(self, steps: u32) -> Replay {
        Replay {
            reserved: self.a.reserved,
            allocated_peak: self.a.allocated_peak,
            requested_peak: self.a.requested_peak,
            stream_requested_peaks: self.a.stream_requested_peaks,
            segments: self.a.segments,
            steps,
        }
    }
}

/// Replays a recorded trace of requests once, in order, from an empty allocator: what the
/// program that made them reserves under `settings`.
pub fn replay_requests(requests: &[Request], settings: shardplan_frontends::AllocatorConfig) -> Replay {
    let mut r = Replayer::new(settings);
    for &q in requests {
        r.apply(q);
    }
    r.done(1)
}

/// The requests of one step of `program`, as [`replay`] makes them: the program's allocs
/// and frees of device buffers on their streams (id: the buffer's index), and each compute
/// step's activations on the compute stream (id: the buffer count plus the value).
pub fn step_requests(
    program: &crate::plan::Program,
    buffers: &[crate::plan::Buffer],
    acts: &crate::steps::ActEvents,
) -> Vec<Request> {
    use crate::plan::{Instr, Pool, Stream};
    let compute = Stream::Compute.index() as u8;
    let on_device = |buf: usize| buffers.get(buf).is_some_and(|b| b.pool == Pool::Device);
    let value_id = |v: u32| (buffers.len() as u32).saturating_add(v);
    let mut out = Vec::new();
    for issued in &program.instrs {
        match &issued.instr {
            Instr::Alloc { buf } if on_device(buf.index()) => out.push(Request::Alloc {
                id: buf.index() as u32,
                stream: issued.stream.index() as u8,
                bytes: buffers[buf.index()].bytes(),
            }),
            Instr::Free { buf } if on_device(buf.index()) => out.push(Request::Free { id: buf.index() as u32 }),
            Instr::Compute { step, .. } => {
                for e in acts.of(*step) {
                    let id = value_id(e.value);
                    out.push(if e.bytes > 0 {
                        Request::Alloc {
                            id,
                            stream: compute,
                            bytes: e.bytes,
                        }
                    } else {
                        Request::Free { id }
                    });
                }
            }
            _ => {}
        }
    }
    out
}

/// A lower bound on what [`replay`] reserves, without replaying: the sum over streams of
/// each stream's own peak of requested bytes. Every allocation comes from the pool of the
/// stream it is made on and goes back to it when freed (whichever stream frees it); a
/// stream's blocks lie in segments (or its expandable segment's mapping) of its own that are
/// never given back; so each stream holds at least its own peak at the end, and the streams'
/// holdings are disjoint. Activations are the compute stream's, at a step's activation peak
/// while it runs and its end level after (as the memory model counts them, and as the
/// replay's requested bytes reach them).
pub fn stream_peaks(
    program: &crate::plan::Program,
    buffers: &[crate::plan::Buffer],
    steps: &[crate::steps::Step],
) -> u64 {
    use crate::plan::{Instr, Pool, Stream};
    let n = Stream::ALL.len();
    let compute = Stream::Compute.index();
    let mut level = vec![0u64; n];
    let mut peak = vec![0u64; n];
    let mut owner: Vec<Option<usize>> = vec![None; buffers.len()];
    for b in buffers.iter().filter(|b| b.persistent && b.pool == Pool::Device) {
        level[compute] = level[compute].saturating_add(b.bytes());
    }
    peak[compute] = level[compute];
    let mut acts = 0u64;
    for issued in &program.instrs {
        let s = issued.stream.index();
        match &issued.instr {
            Instr::Alloc { buf } => {
                let Some(b) = buffers.get(buf.index()) else { continue };
                if b.pool != Pool::Device {
                    continue;
                }
                if let Some(o) = owner[buf.index()].take() {
                    level[o] = level[o].saturating_sub(b.bytes());
                }
                owner[buf.index()] = Some(s);
                level[s] = level[s].saturating_add(b.bytes());
                peak[s] = peak[s].max(level[s]);
            }
            Instr::Free { buf } => {
                if let (Some(b), Some(o)) = (
                    buffers.get(buf.index()),
                    owner.get_mut(buf.index()).and_then(Option::take),
                ) {
                    level[o] = level[o].saturating_sub(b.bytes());
                }
            }
            Instr::Compute { step, .. } => {
                let Some(st) = steps.get(step.index()) else { continue };
                let base = level[compute].saturating_sub(acts);
                peak[compute] = peak[compute].max(base.saturating_add(st.act_peak));
                acts = st.act_end;
                level[compute] = base.saturating_add(acts);
                peak[compute] = peak[compute].max(level[compute]);
            }
            _ => {}
        }
    }
    peak.iter().fold(0u64, |a, &p| a.saturating_add(p))
}

#[cfg(test)]
mod tests;
