//! torchtitan's own parameter names for its Llama 3 (`tok_embeddings.weight`,
//! `layers.0.attention.wq.weight`, ...), and the rotary permutation its state-dict adapter
//! applies between them and Hugging Face's: torchtitan (Meta's layout) keeps each head's
//! query and key rows as interleaved (even, odd) pairs, Hugging Face as the first halves
//! then the second halves. A checkpoint torchtitan wrote is read under these names, its
//! `wq`/`wk` rows (and their optimizer states') taken in Hugging Face's order.

pub use crate::train::sharded::CheckpointNames;
use shardplan_models::ModelConfig;

/// torchtitan's name of Hugging Face Llama parameter `hf`; `None` for a name it has no
/// counterpart for.
pub fn torchtitan_name(hf: &str) -> Option<String> {
    let fixed = [
        ("model.embed_tokens.weight", "tok_embeddings.weight"),
        ("model.norm.weight", "norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, tt)) = fixed.iter().find(|(h, _)| *h == hf) {
        return Some(tt.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, leaf) = rest.split_once('.')?;
    let leaf = match leaf {
        "self_attn.q_proj.weight" => "attention.wq.weight",
        "self_attn.k_proj.weight" => "attention.wk.weight",
        "self_attn.v_proj.weight" => "attention.wv.weight",
        "self_attn.o_proj.weight" => "attention.wo.weight",
        "mlp.gate_proj.weight" => "feed_forward.w1.weight",
        "mlp.down_proj.weight" => "feed_forward.w2.weight",
        "mlp.up_proj.weight" => "feed_forward.w3.weight",
        "input_layernorm.weight" => "attention_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        _ => return None,
    };
    Some(format!("layers.{layer}.{leaf}"))
}

/// For a query or key projection `hf` of `model`: its heads and head dim, whose rows
/// torchtitan keeps in Meta's rotary layout.
pub fn rotary_rows(model: &ModelConfig, hf: &str) -> Option<(usize, usize)> {
    let ModelConfig::Llama(c) = model else { return None };
    let hd = c.head_dim() as usize;
    if hf.ends_with("self_attn.q_proj.weight") {
        Some((c.n_heads as usize, hd))
    } else if hf.ends_with("self_attn.k_proj.weight") {
        Some((c.n_kv_heads as usize, hd))
    } else {
        None
    }
}

/// The row of a torchtitan (Meta layout) projection that holds Hugging Face row `row`,
/// heads of `head_dim` rows: within a head, Hugging Face's row `s * head_dim / 2 + p` is
/// Meta's `2 * p + s`.
pub fn meta_row(row: usize, head_dim: usize) -> usize {
    let (head, j) = (row / head_dim, row % head_dim);
    let half = head_dim / 2;
    let (s, p) = (j / half, j % half);
    head * head_dim + 2 * p + s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_torchtitans() {
        assert_eq!(
            torchtitan_name("model.embed_tokens.weight").as_deref(),
            Some("tok_embeddings.weight")
        );
        assert_eq!(
            torchtitan_name("model.layers.11.mlp.gate_proj.weight").as_deref(),
            Some("layers.11.feed_forward.w1.weight")
        );
        assert_eq!(
            torchtitan_name("model.layers.0.post_attention_layernorm.weight").as_deref(),
            Some("layers.0.ffn_norm.weight")
        );
        assert_eq!(torchtitan_name("model.layers.0.self_attn.q_norm.weight"), None);
    }

    #[test]
    fn a_heads_rows_interleave_its_halves() {
        // Head dim 4: HF rows (0, 1 | 2, 3) are Meta's (0, 2 | 1, 3); the next head follows.
        let rows: Vec<usize> = (0..8).map(|r| meta_row(r, 4)).collect();
        assert_eq!(rows, vec![0, 2, 1, 3, 4, 6, 5, 7]);
    }
}
