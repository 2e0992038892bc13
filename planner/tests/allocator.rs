//! The caching-allocator model on hand-made sequences: rounding, pools, segment sizes,
//! splitting, best-fit reuse, merging, per-stream pools, and fragmentation reserving more
//! than is allocated.

use shardplan_planner::allocator::{round, segment_size, CachingAllocator};

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
