//! Shard layout equals torch.chunk and groups behave as FSDP2 / torchtitan do (the mesh's
//! and the layout's own cases are unit tests in `mesh.rs` and `layout.rs`).

use shardplan_ir::ModuleKind;
use shardplan_models::{preset, trace, TraceOptions};
use shardplan_planner::{chunk_rows, group, PlanError, WrapPolicy};

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
