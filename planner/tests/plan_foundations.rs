//! Shard layout equals torch.chunk, layouts account for every byte, meshes and groups
//! behave as FSDP2 / torchtitan do.

use proptest::prelude::*;
use shardplan_ir::{DType, ModuleKind};
use shardplan_models::{preset, trace, TraceOptions};
use shardplan_planner::{chunk_rows, group, layout, Coords, Mesh, PlanError, WrapPolicy};

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

fn tiny(name: &str) -> shardplan_ir::Graph {
    trace(
        &preset(name).unwrap(),
        TraceOptions {
            batch: 1,
            seq_len: Some(4),
            ..TraceOptions::default()
        },
    )
    .unwrap()
}

#[test]
fn block_wrap_puts_embeddings_norm_and_head_in_the_root_group_last() {
    let g = tiny("tiny-llama");
    let groups = group(&g, &WrapPolicy::kinds(&[ModuleKind::Block])).unwrap();
    let names: Vec<&str> = groups.iter().map(|gr| gr.module.as_str()).collect();
    assert_eq!(names, ["layers.0", "layers.1", "<root>"]);
    let root: Vec<&str> = groups[2].params.iter().map(|&p| &*g.param(p).name).collect();
    assert_eq!(
        root,
        ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    );
    // Every parameter in exactly one group.
    let mut all: Vec<_> = groups.iter().flat_map(|gr| gr.params.clone()).collect();
    all.sort();
    assert_eq!(all, g.params().map(|(p, _)| p).collect::<Vec<_>>());
}

#[test]
fn nested_wrap_is_bottom_up() {
    let g = tiny("tiny-llama");
    let groups = group(&g, &WrapPolicy::kinds(&[ModuleKind::Attention, ModuleKind::Block])).unwrap();
    let names: Vec<&str> = groups.iter().map(|gr| gr.module.as_str()).collect();
    // Forward order, as FSDP2's hooks fire: the block (its attention_norm is read first),
    // then its attention unit.
    assert_eq!(
        names,
        [
            "layers.0",
            "layers.0.attention",
            "layers.1",
            "layers.1.attention",
            "<root>"
        ]
    );
    // The block unit keeps what its attention unit did not take: norms and the MLP.
    assert!(groups[0].params.iter().all(|&p| !g.param(p).name.contains("self_attn")));
    assert_eq!(groups[0].params.len(), 5);
    assert_eq!(groups[1].params.len(), 4);
    // Tied GPT-2: the shared table stays in the root group.
    let g = tiny("tiny-gpt2");
    let groups = group(&g, &WrapPolicy::kinds(&[ModuleKind::Block])).unwrap();
    let root = groups.last().unwrap();
    assert!(root.is_root());
    assert!(root
        .params
        .iter()
        .any(|&p| &*g.param(p).name == "transformer.wte.weight"));
}

#[test]
fn a_wrap_kind_the_model_lacks_is_an_error() {
    let e = group(&tiny("tiny-mlp"), &WrapPolicy::kinds(&[ModuleKind::Attention])).unwrap_err();
    assert!(matches!(e, PlanError::WrapMatchesNothing { .. }));
    assert_eq!(
        e.to_string(),
        "wrap policy `attention` matches no module of this model (its module kinds: block, head, loss)"
    );
    // No wrap at all: one root group holding everything (fully_shard on the root only).
    let g = tiny("tiny-mlp");
    let groups = group(&g, &WrapPolicy::kinds(&[])).unwrap();
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].params.len(), g.params().len());
}

#[test]
fn mesh_coordinates_groups_and_nodes() {
    assert_eq!(
        Mesh::new(2, 8, 12, 8).unwrap_err().to_string(),
        "mesh replicate 2 x shard 8 = 16 ranks, but the world has 12"
    );
    assert!(matches!(Mesh::new(0, 8, 0, 8), Err(PlanError::EmptyAxis { .. })));
    let m = Mesh::new(2, 8, 16, 8).unwrap();
    for rank in 0..16 {
        assert_eq!(m.rank(m.coords(rank)), rank);
    }
    assert_eq!(
        m.coords(11),
        Coords {
            replicate: 1,
            shard: 3,
            tensor: 0
        }
    );
    assert_eq!(m.shard_group(11), (8..16).collect::<Vec<_>>());
    assert_eq!(m.replicate_group(11), [3, 11]);
    assert_eq!(m.reshard_group(11, 4), [8, 9, 10, 11]);
    assert!(m.intra_node(&m.shard_group(3)), "shard groups stay in a node");
    assert!(!m.intra_node(&m.replicate_group(3)), "replicas span nodes");
    let flat = Mesh::new(1, 16, 16, 8).unwrap();
    assert!(!flat.intra_node(&flat.shard_group(0)));
}

#[test]
fn a_tensor_axis_is_innermost() {
    assert_eq!(
        Mesh::with_tensor(2, 4, 2, 12, 8).unwrap_err().to_string(),
        "mesh replicate 2 x shard 4 x tensor 2 = 16 ranks, but the world has 12"
    );
    assert!(matches!(
        Mesh::with_tensor(1, 4, 0, 0, 8),
        Err(PlanError::EmptyAxis { tensor: 0, .. })
    ));
    // 2 x 4 x 2 on nodes of 8: rank = (r * 4 + s) * 2 + t.
    let m = Mesh::with_tensor(2, 4, 2, 16, 8).unwrap();
    assert_eq!(m.world(), 16);
    assert_eq!(m.data_parallel(), 8);
    for rank in 0..16 {
        assert_eq!(m.rank(m.coords(rank)), rank);
    }
    assert_eq!(
        m.coords(11),
        Coords {
            replicate: 1,
            shard: 1,
            tensor: 1
        }
    );
    assert_eq!(m.tensor_group(11), [10, 11]);
    assert_eq!(m.shard_group(11), [9, 11, 13, 15]);
    assert_eq!(m.replicate_group(11), [3, 11]);
    assert_eq!(m.reshard_group(11, 2), [9, 11]);
    assert!(m.intra_node(&m.tensor_group(3)), "tensor groups stay in a node");
    assert!(m.intra_node(&m.shard_group(3)));
    assert!(!m.intra_node(&m.replicate_group(3)));
}

#[test]
fn layout_packs_padded_shards_back_to_back() {
    let g = tiny("tiny-llama");
    let groups = group(&g, &WrapPolicy::kinds(&[ModuleKind::Block])).unwrap();
    let root = layout(&g, groups.last().unwrap(), 3);
    // embed [256, 64]: 86 rows per rank (258 padded); norm [64]: 22 (66); head [256, 64]: 86.
    let chunks: Vec<u64> = root.params.iter().map(|p| p.chunk_rows).collect();
    assert_eq!(chunks, [86, 22, 86]);
    assert_eq!(root.params[1].shard_offset, 86 * 64);
    assert_eq!(root.shard_numel, 86 * 64 + 22 + 86 * 64);
    assert_eq!(root.padding(), 3 * root.shard_numel - (2 * 256 * 64 + 64));
    assert_eq!(root.gathered_offset(2, 1), root.shard_numel + 86 * 64 + 22);
    assert_eq!(root.shard_bytes(DType::BF16), root.shard_numel * 2);
    // Rank 2 holds only 84 real rows of the embedding.
    assert_eq!(root.params[0].valid_numel(3, 2), 84 * 64);
}

proptest! {
    #[test]
    fn layouts_account_for_every_element(dims in prop::collection::vec((1u64..300, 1u64..5), 1..6), shard in 1u64..17) {
        let mut g = shardplan_ir::Graph::new("p");
        let scope = g.add_scope(g.root(), "layers.0", ModuleKind::Block);
        for (i, (d0, d1)) in dims.iter().enumerate() {
            g.add_param(&format!("w{i}"), shardplan_ir::TensorType::new(DType::F32, [*d0, *d1]), scope).unwrap();
        }
        let groups = group(&g, &WrapPolicy::kinds(&[ModuleKind::Block])).unwrap();
        let l = layout(&g, &groups[0], shard);
        let model: u64 = dims.iter().map(|(a, b)| a * b).sum();
        prop_assert_eq!(l.numel, model);
        // Sharded bytes summed over the shard group = model bytes + padding.
        prop_assert_eq!(l.shard_bytes(DType::F32) * shard, (model + l.padding()) * 4);
        for p in &l.params {
            let valid: u64 = (0..shard).map(|r| p.valid_numel(shard, r)).sum();
            prop_assert_eq!(valid, p.numel());
            prop_assert!(p.shard_numel() >= p.valid_numel(shard, 0));
            // ceil(d0 / shard) * shard - d0 < shard: under one row of padding per rank.
            let padding = p.shard_numel() * shard - p.numel();
            prop_assert!(padding < shard * p.row_elems, "padding {} for dims {:?} over {}", padding, p.dims, shard);
        }
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
