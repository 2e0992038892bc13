//! Shard layout equals torch.chunk, and absurd sizes are refused before the memory passes
//! (the mesh's, the grouping's and the layout's own cases are unit tests in `mesh.rs`,
//! `group.rs` and `layout.rs`).

use shardplan_models::{trace, TraceOptions};
use shardplan_planner::{chunk_rows, PlanError};

/// `[c.numel() for c in torch.chunk(torch.arange(n), k)]`, padded with 0 for the ranks that
/// get no chunk, as printed by PyTorch 2.15.
const TORCH_CHUNK: &[(u64, u64, &[u64])] = &[
    (1, 1, &[1]),
    (1, 2, &[1, 0]),
    (1, 3, &[1, 0, 0]),
    (1, 4, &[1, 0, 0, 0]),
    (1, 5, &[1, 0, 0, 0, 0]),
    (1, 6, &[1, 0, 0, 0, 0, 0]),
    (1, 7, &[1, 0, 0, 0, 0, 0, 0]),
    (1, 8, &[1, 0, 0, 0, 0, 0, 0, 0]),
    (3, 1, &[3]),
    (3, 2, &[2, 1]),
    (3, 3, &[1, 1, 1]),
    (3, 4, &[1, 1, 1, 0]),
    (3, 5, &[1, 1, 1, 0, 0]),
    (3, 6, &[1, 1, 1, 0, 0, 0]),
    (3, 7, &[1, 1, 1, 0, 0, 0, 0]),
    (3, 8, &[1, 1, 1, 0, 0, 0, 0, 0]),
    (5, 1, &[5]),
    (5, 2, &[3, 2]),
    (5, 3, &[2, 2, 1]),
    (5, 4, &[2, 2, 1, 0]),
    (5, 5, &[1, 1, 1, 1, 1]),
    (5, 6, &[1, 1, 1, 1, 1, 0]),
    (5, 7, &[1, 1, 1, 1, 1, 0, 0]),
    (5, 8, &[1, 1, 1, 1, 1, 0, 0, 0]),
    (8, 1, &[8]),
    (8, 2, &[4, 4]),
    (8, 3, &[3, 3, 2]),
    (8, 4, &[2, 2, 2, 2]),
    (8, 5, &[2, 2, 2, 2, 0]),
    (8, 6, &[2, 2, 2, 2, 0, 0]),
    (8, 7, &[2, 2, 2, 2, 0, 0, 0]),
    (8, 8, &[1, 1, 1, 1, 1, 1, 1, 1]),
    (4097, 1, &[4097]),
    (4097, 2, &[2049, 2048]),
    (4097, 3, &[1366, 1366, 1365]),
    (4097, 4, &[1025, 1025, 1025, 1022]),
    (4097, 5, &[820, 820, 820, 820, 817]),
    (4097, 6, &[683, 683, 683, 683, 683, 682]),
    (4097, 7, &[586, 586, 586, 586, 586, 586, 581]),
    (4097, 8, &[513, 513, 513, 513, 513, 513, 513, 506]),
];

#[test]
fn chunk_rows_equal_torch_chunk() {
    assert_eq!(TORCH_CHUNK.len(), 40);
    for &(n, k, sizes) in TORCH_CHUNK {
        let mut next = 0;
        for (rank, &size) in sizes.iter().enumerate() {
            let r = chunk_rows(n, k, rank as u64);
            assert_eq!(r.end - r.start, size, "dim0 {n} over {k} ranks, rank {rank}");
            if size > 0 {
                assert_eq!(r.start, next, "chunks are consecutive");
                next = r.end;
            }
        }
        assert_eq!(next, n, "chunks cover dim0 {n}");
    }
}

/// A model whose per-rank bytes would overflow the memory simulation's sums is refused, not
/// a panic in the allocator model (found by tests/fuzz_inputs.rs: an MLP with ffn_dim 2^53).
#[test]
fn absurd_sizes_are_refused_before_the_memory_passes() {
    let model = shardplan_models::ModelConfig::Mlp(shardplan_models::MlpConfig {
        name: "huge".into(),
        dim: 32,
        ffn_dim: 1 << 53,
        n_layers: 2,
        n_classes: 10,
    });
    let g = trace(&model, TraceOptions::default()).unwrap();
    let joint = shardplan_ir::differentiate(&g).unwrap();
    let config = shardplan_frontends::parse_parallel_spec(&shardplan_frontends::Source::from_text(
        "p.yaml",
        "mesh: {shard: 1}\ngpus_per_node: 1\n",
    ))
    .unwrap()
    .0;
    match shardplan_planner::plan(&joint, &config) {
        Err(PlanError::Graph(m)) => assert!(m.contains("1 EiB"), "{m}"),
        other => panic!("{:?}", other.map(|p| p.memory.peak)),
    }
}
