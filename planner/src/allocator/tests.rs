//! The caching-allocator model on hand-made sequences: rounding, pools, segment sizes,
//! splitting, best-fit reuse, merging, per-stream pools, and fragmentation reserving more
//! than is allocated; with expandable segments, pages mapped at the end of one segment per
//! pool and stream, and generated traces against properties with known answers.

use super::{round, segment_size, CachingAllocator, LARGE_PAGE, SMALL_PAGE};
use proptest::prelude::*;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

#[test]
fn requests_round_up_to_512_byte_blocks() {
    assert_eq!(round(1), 512);
    assert_eq!(round(512), 512);
    assert_eq!(round(513), 1024);
    assert_eq!(round(u64::MAX), u64::MAX, "saturates instead of overflowing");
    let mut a = CachingAllocator::default();
    a.alloc(0, 1).unwrap();
    a.alloc(0, 513).unwrap();
    assert_eq!((a.requested, a.allocated), (514, 1536));
}

#[test]
fn a_zero_byte_request_takes_nothing() {
    let mut a = CachingAllocator::default();
    assert!(a.alloc(0, 0).is_none());
    assert_eq!((a.reserved, a.allocated, a.segments), (0, 0, 0));
}

#[test]
fn segment_sizes_follow_the_pools() {
    // Small pool: 2 MiB segments for requests up to 1 MiB.
    assert_eq!(segment_size(512), 2 * MIB);
    assert_eq!(segment_size(MIB), 2 * MIB);
    // Large pool: 20 MiB below 10 MiB, then the request rounded up to 2 MiB.
    assert_eq!(segment_size(MIB + 512), 20 * MIB);
    assert_eq!(segment_size(10 * MIB - 512), 20 * MIB);
    assert_eq!(segment_size(10 * MIB), 10 * MIB);
    assert_eq!(segment_size(11 * MIB), 12 * MIB);
    assert_eq!(segment_size(12 * MIB), 12 * MIB);

    let mut a = CachingAllocator::default();
    a.alloc(0, MIB).unwrap();
    assert_eq!(a.reserved, 2 * MIB);
    a.alloc(0, 11 * MIB).unwrap();
    assert_eq!(a.reserved, 14 * MIB, "11 MiB reserves 12");
    a.alloc(0, MIB + 1).unwrap();
    assert_eq!(
        (a.reserved, a.segments),
        (34 * MIB, 3),
        "just over 1 MiB is a large request"
    );
}

#[test]
fn small_requests_share_a_segment_and_never_use_the_large_pool() {
    let mut a = CachingAllocator::default();
    a.alloc(0, MIB).unwrap();
    a.alloc(0, MIB).unwrap();
    assert_eq!(
        (a.reserved, a.segments),
        (2 * MIB, 1),
        "two 1 MiB requests split one 2 MiB segment"
    );
    // A large segment with room to spare does not serve a small request.
    let big = a.alloc(0, 4 * MIB).unwrap();
    a.free(big);
    a.alloc(0, 256 * KIB).unwrap();
    assert_eq!((a.reserved, a.segments), (24 * MIB, 3));
}

#[test]
fn large_blocks_split_only_when_more_than_1_mib_is_left() {
    let mut a = CachingAllocator::default();
    // 11 MiB gets a 12 MiB segment; the 1 MiB left is not split off and counts as allocated.
    a.alloc(0, 11 * MIB).unwrap();
    assert_eq!((a.allocated, a.reserved), (12 * MIB, 12 * MIB));
    // 5 MiB takes a 20 MiB segment; the 15 MiB left is split off and serves two more.
    a.alloc(0, 5 * MIB).unwrap();
    assert_eq!(a.allocated, 17 * MIB);
    a.alloc(0, 5 * MIB).unwrap();
    a.alloc(0, 8 * MIB).unwrap();
    assert_eq!((a.reserved, a.segments), (32 * MIB, 2));
    // 2 MiB are left of the 20: more than 1 MiB, so still a free block of its own.
    assert_eq!(a.free_blocks(), vec![(false, 0, 2 * MIB)]);
    a.alloc(0, 2 * MIB).unwrap();
    assert_eq!((a.reserved, a.allocated), (32 * MIB, 32 * MIB));
}

#[test]
fn small_blocks_split_down_to_512_bytes() {
    let mut a = CachingAllocator::default();
    a.alloc(0, MIB).unwrap();
    a.alloc(0, MIB - 1024).unwrap();
    assert_eq!(a.free_blocks(), vec![(true, 0, 1024)]);
    a.alloc(0, 512).unwrap();
    a.alloc(0, 512).unwrap();
    assert!(a.free_blocks().is_empty());
    assert_eq!((a.reserved, a.allocated), (2 * MIB, 2 * MIB));
}

#[test]
fn freed_blocks_are_reused_best_fit() {
    let mut a = CachingAllocator::default();
    let x = a.alloc(0, 30 * MIB).unwrap();
    let _keep = a.alloc(0, 12 * MIB).unwrap();
    let y = a.alloc(0, 50 * MIB).unwrap();
    a.free(y);
    a.free(x);
    let before = a.reserved;
    // The 30 MiB block is the smallest that fits 28 MiB; the 50 MiB one serves 48 MiB.
    a.alloc(0, 28 * MIB).unwrap();
    assert_eq!(a.free_blocks(), vec![(false, 0, 2 * MIB), (false, 0, 50 * MIB)]);
    a.alloc(0, 48 * MIB).unwrap();
    assert_eq!(a.reserved, before, "no new segment");
}

#[test]
fn a_freed_block_merges_with_free_neighbours() {
    let mut a = CachingAllocator::default();
    let x = a.alloc(0, 5 * MIB).unwrap();
    let y = a.alloc(0, 5 * MIB).unwrap();
    let z = a.alloc(0, 5 * MIB).unwrap();
    assert_eq!(a.reserved, 20 * MIB);
    a.free(x);
    a.free(z);
    assert_eq!(a.free_blocks(), vec![(false, 0, 5 * MIB), (false, 0, 10 * MIB)]);
    a.free(y);
    assert_eq!(a.free_blocks(), vec![(false, 0, 20 * MIB)], "one block again");
    // The whole segment serves a request it could not have served in pieces.
    a.alloc(0, 18 * MIB).unwrap();
    assert_eq!((a.reserved, a.segments), (20 * MIB, 1));
}

#[test]
fn each_stream_reuses_only_its_own_blocks() {
    let mut a = CachingAllocator::default();
    let on_gather = a.alloc(1, 8 * MIB).unwrap();
    a.free(on_gather);
    a.alloc(0, 8 * MIB).unwrap();
    assert_eq!(
        (a.reserved, a.segments),
        (40 * MIB, 2),
        "stream 1's free block is not stream 0's"
    );
    a.alloc(1, 8 * MIB).unwrap();
    assert_eq!((a.reserved, a.segments), (40 * MIB, 2), "stream 1 reuses its block");
}

#[test]
fn fragmentation_reserves_more_than_is_allocated() {
    // Alternating lifetimes leave free holes too small for a later, larger request.
    let mut a = CachingAllocator::default();
    let blocks: Vec<_> = (0..8).map(|_| a.alloc(0, 64 * MIB).unwrap()).collect();
    for b in blocks.into_iter().step_by(2) {
        a.free(b);
    }
    assert_eq!(a.allocated, 4 * 64 * MIB);
    a.alloc(0, 96 * MIB).unwrap();
    assert_eq!(a.allocated, 4 * 64 * MIB + 96 * MIB);
    assert_eq!(a.reserved, 8 * 64 * MIB + 96 * MIB);
    assert_eq!(a.cached(), 4 * 64 * MIB, "the holes stay reserved");
    assert!(a.reserved as f64 > 1.5 * a.allocated as f64);
    assert!(a.reserved > a.allocated_peak);
}

#[test]
fn peaks_are_kept_after_frees() {
    let mut a = CachingAllocator::default();
    let x = a.alloc(0, 3 * MIB).unwrap();
    let y = a.alloc(0, 1000).unwrap();
    a.free(x);
    a.free(y);
    assert_eq!((a.allocated, a.requested), (0, 0));
    assert_eq!((a.allocated_peak, a.requested_peak), (3 * MIB + 1024, 3 * MIB + 1000));
    assert_eq!(a.reserved, 22 * MIB, "segments are never given back");
    a.free(x);
    assert_eq!(a.allocated, 0, "a second free of the same allocation changes nothing");
}

// ---- expandable segments ----

fn expandable() -> CachingAllocator {
    CachingAllocator::new(true)
}

#[test]
fn expandable_segments_map_pages_of_2_and_20_mib() {
    assert_eq!((SMALL_PAGE, LARGE_PAGE), (2 * MIB, 20 * MIB));
    let mut a = expandable();
    a.alloc(0, KIB).unwrap();
    assert_eq!(a.reserved, 2 * MIB, "one small page");
    // Five 5 MiB requests: four tile the first large page, the fifth maps a second.
    for i in 0..5 {
        a.alloc(0, 5 * MIB).unwrap();
        let pages = if i < 4 { 1 } else { 2 };
        assert_eq!(a.reserved, 2 * MIB + pages * 20 * MIB, "request {i}");
    }
    assert_eq!(
        a.free_blocks(),
        vec![(false, 0, 15 * MIB), (true, 0, 2 * MIB - KIB)],
        "the rest of the last page of each pool"
    );
    // A 48 MiB request extends that free block by 2 pages instead of a segment of its own.
    a.alloc(0, 48 * MIB).unwrap();
    assert_eq!(a.reserved, 2 * MIB + 4 * 20 * MIB);
    assert_eq!(a.free_blocks(), vec![(false, 0, 7 * MIB), (true, 0, 2 * MIB - KIB)]);
}

#[test]
fn expandable_blocks_split_down_to_512_bytes_in_the_large_pool() {
    // Without expandable segments 11 MiB holds a 12 MiB segment whole; here the 9 MiB left
    // of the page stays free, and every block is exactly its rounded request.
    let mut a = expandable();
    a.alloc(0, 11 * MIB).unwrap();
    assert_eq!((a.allocated, a.reserved), (11 * MIB, 20 * MIB));
    a.alloc(0, 9 * MIB - 512).unwrap();
    assert_eq!(a.free_blocks(), vec![(false, 0, 512)]);
    assert_eq!(a.allocated, 20 * MIB - 512);
}

#[test]
fn best_fit_takes_the_end_of_the_mapping_last() {
    let mut a = expandable();
    let _x = a.alloc(0, 10 * MIB).unwrap();
    let y = a.alloc(0, 6 * MIB).unwrap();
    let _z = a.alloc(0, 2 * MIB).unwrap();
    a.free(y);
    // Free: a 6 MiB hole, and the 2 MiB at the end of the page, which could grow.
    assert_eq!(a.free_blocks(), vec![(false, 0, 2 * MIB), (false, 0, 6 * MIB)]);
    // By size the 2 MiB block fits 1.5 MiB best, but it counts as all it could grow to.
    a.alloc(0, 3 * MIB / 2).unwrap();
    assert_eq!(
        a.free_blocks(),
        vec![(false, 0, 2 * MIB), (false, 0, 9 * MIB / 2)],
        "the hole served it"
    );
    a.alloc(0, 9 * MIB / 2).unwrap();
    // With no other block large enough, the end of the mapping serves without growing.
    a.alloc(0, 2 * MIB).unwrap();
    assert!(a.free_blocks().is_empty());
    assert_eq!((a.reserved, a.allocated), (20 * MIB, 20 * MIB));
}

#[test]
fn a_freed_block_at_the_end_grows_with_the_next_mapping() {
    let mut a = expandable();
    let _x = a.alloc(0, 10 * MIB).unwrap();
    let y = a.alloc(0, 5 * MIB).unwrap();
    a.free(y);
    assert_eq!(a.free_blocks(), vec![(false, 0, 10 * MIB)], "merged into the end");
    // 12 MiB needs 2 more: one page, appended to the free 10.
    a.alloc(0, 12 * MIB).unwrap();
    assert_eq!((a.reserved, a.segments), (40 * MIB, 2));
    assert_eq!(a.free_blocks(), vec![(false, 0, 18 * MIB)]);
}

#[test]
fn expandable_segments_are_per_stream_and_pool() {
    let mut a = expandable();
    let g = a.alloc(1, 8 * MIB).unwrap();
    a.free(g);
    a.alloc(0, 8 * MIB).unwrap();
    assert_eq!(a.reserved, 40 * MIB, "stream 1's free page is not stream 0's");
    a.alloc(1, 12 * MIB).unwrap();
    assert_eq!(a.reserved, 40 * MIB, "stream 1 reuses its page");
    a.alloc(0, 4 * KIB).unwrap();
    assert_eq!(a.reserved, 42 * MIB, "the small pool maps its own page");
}

#[test]
fn expandable_holes_still_fragment() {
    // Alternating lifetimes leave holes a larger request cannot use: the mapping grows.
    let mut a = expandable();
    let blocks: Vec<_> = (0..8).map(|_| a.alloc(0, 60 * MIB).unwrap()).collect();
    assert_eq!(a.reserved, 480 * MIB, "eight 60 MiB blocks tile 24 pages exactly");
    for b in blocks.into_iter().step_by(2) {
        a.free(b);
    }
    a.alloc(0, 100 * MIB).unwrap();
    assert_eq!(a.reserved, 580 * MIB);
    assert_eq!(a.cached(), 4 * 60 * MIB);
}

/// One step of a generated trace: allocate on (stream, small?) or free the i-th live block.
#[derive(Clone, Debug)]
enum Op {
    Alloc { stream: u8, bytes: u64 },
    Free(usize),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        (0u8..3, prop_oneof![1u64..2 * MIB, 1u64..200 * MIB]).prop_map(|(stream, bytes)| Op::Alloc { stream, bytes }),
        any::<usize>().prop_map(Op::Free),
    ];
    proptest::collection::vec(op, 1..200)
}

proptest! {
    /// Reserved never falls below allocated, which (expandable: exactly the rounded
    /// requests) never falls below the requests; both allocators agree on the requests.
    #[test]
    fn expandable_reserves_at_least_what_is_allocated(trace in ops()) {
        let mut a = expandable();
        let mut b = CachingAllocator::default();
        let mut live: Vec<(_, _, u64)> = Vec::new();
        for op in trace {
            match op {
                Op::Alloc { stream, bytes } => {
                    live.push((a.alloc(stream, bytes).unwrap(), b.alloc(stream, bytes).unwrap(), bytes));
                }
                Op::Free(i) if !live.is_empty() => {
                    let (x, y, _) = live.swap_remove(i % live.len());
                    a.free(x);
                    b.free(y);
                }
                Op::Free(_) => {}
            }
            let rounded: u64 = live.iter().map(|l| round(l.2)).sum();
            prop_assert_eq!(a.allocated, rounded);
            prop_assert!(b.allocated >= rounded);
            prop_assert!(a.reserved >= a.allocated && a.reserved >= a.allocated_peak);
            prop_assert_eq!(a.requested, b.requested);
            prop_assert_eq!(a.reserved % SMALL_PAGE, 0);
        }
    }

    /// Freed in reverse order of allocation, blocks of one pool and stream always form a
    /// prefix of the mapping: what is reserved is the allocated peak rounded up to a page.
    #[test]
    fn a_stack_of_allocations_reserves_its_peak_rounded_to_a_page(
        trace in proptest::collection::vec((any::<bool>(), 1u64..100 * MIB, 0usize..4), 1..100)
    ) {
        let mut a = expandable();
        let mut stack = Vec::new();
        for (push, bytes, pops) in trace {
            if push || stack.is_empty() {
                stack.push(a.alloc(0, bytes.max(SMALL_SIZE_PLUS)).unwrap());
            } else {
                for _ in 0..pops.min(stack.len()) {
                    a.free(stack.pop().unwrap());
                }
            }
        }
        prop_assert_eq!(a.reserved, a.allocated_peak.div_ceil(LARGE_PAGE) * LARGE_PAGE);
    }
}

/// The smallest request of the large pool.
const SMALL_SIZE_PLUS: u64 = MIB + 1;

// ---- recorded requests ----

#[test]
fn a_replayed_trace_keeps_each_streams_own_peak() {
    use super::{replay_requests, Request};
    use shardplan_frontends::AllocatorConfig;
    let trace = [
        Request::Alloc {
            id: 0,
            stream: 0,
            bytes: 3 * MIB,
        },
        Request::Alloc {
            id: 1,
            stream: 2,
            bytes: 5 * MIB,
        },
        Request::Free { id: 0 },
        Request::Alloc {
            id: 2,
            stream: 0,
            bytes: 2 * MIB,
        },
        // An alloc of a live id frees it first.
        Request::Alloc {
            id: 1,
            stream: 2,
            bytes: MIB,
        },
        Request::Free { id: 9 },
    ];
    for expandable_segments in [false, true] {
        let r = replay_requests(&trace, AllocatorConfig { expandable_segments });
        assert_eq!(r.stream_requested_peaks[0], 3 * MIB);
        assert_eq!(r.stream_requested_peaks[2], 5 * MIB);
        assert_eq!(r.requested_peak, 8 * MIB);
        assert_eq!(r.steps, 1);
    }
}
