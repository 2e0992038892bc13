//! Context parallelism's layout: which tokens of a sequence each rank of a context group
//! holds, and so which positions its rotary embedding and causal mask use.
//!
//! A context-parallel graph is one context rank's program, as a tensor-parallel graph is
//! one tensor rank's: every rank runs the same nodes on its own rows of the sequence. The
//! ops that read a position (`rope`, `attention`, `attn_probs`) carry the layout and take
//! the rank from the group they run on.

use serde::{Deserialize, Serialize};

/// How a sequence's rows are dealt to the `degree` ranks of a context group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ContextLayout {
    /// Ranks of the context group (at least 2 in a traced graph).
    pub degree: u64,
    pub balance: ContextBalance,
}

/// Which rows a context rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContextBalance {
    /// The sequence cut in `2 x degree` chunks; rank `r` holds chunks `r` and
    /// `2 x degree - 1 - r` (torch's head-tail load balancer), so every rank does the same
    /// share of causal attention.
    HeadTail,
    /// The sequence cut in `degree` chunks; rank `r` holds chunk `r`.
    None,
}

/// How a context group's keys and values reach every rank (torch's
/// `set_rotate_method`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContextRotate {
    /// One all-gather of every rank's keys and values.
    #[serde(rename = "allgather")]
    AllGather,
    /// `degree - 1` ring steps, each passing the block in hand to the next rank.
    #[serde(rename = "alltoall")]
    AllToAll,
}

impl ContextBalance {
    pub fn name(self) -> &'static str {
        match self {
            ContextBalance::HeadTail => "head_tail",
            ContextBalance::None => "none",
        }
    }

    /// Chunks a sequence is cut in over `degree` ranks.
    pub fn chunks(self, degree: u64) -> u64 {
        match self {
            ContextBalance::HeadTail => 2 * degree,
            ContextBalance::None => degree,
        }
    }
}

impl ContextRotate {
    pub fn name(self) -> &'static str {
        match self {
            ContextRotate::AllGather => "allgather",
            ContextRotate::AllToAll => "alltoall",
        }
    }
}

impl ContextLayout {
    /// The chunks (of [`ContextBalance::chunks`]) rank `rank` holds, in its row order.
    pub fn chunks_of(&self, rank: u64) -> Vec<u64> {
        match self.balance {
            ContextBalance::HeadTail => vec![rank, 2 * self.degree - 1 - rank],
            ContextBalance::None => vec![rank],
        }
    }

    /// The position in the whole sequence of row `i` of rank `rank`'s `local` rows.
    pub fn position(&self, rank: u64, local: u64, i: u64) -> u64 {
        let chunks = self.chunks_of(rank);
        let len = local / chunks.len() as u64;
        let (piece, within) = (i / len.max(1), i % len.max(1));
        chunks[(piece as usize).min(chunks.len() - 1)] * len + within
    }

    /// The positions of rank `rank`'s `local` rows, in row order.
    pub fn positions(&self, rank: u64, local: u64) -> Vec<u64> {
        (0..local).map(|i| self.position(rank, local, i)).collect()
    }

    /// For each position of a sequence of `degree x local` rows, the row of the rank-order
    /// gather (every rank's `local` rows one after another) that holds it.
    pub fn gathered_rows(&self, local: u64) -> Vec<u64> {
        let mut out = vec![0; (local * self.degree) as usize];
        for rank in 0..self.degree {
            for i in 0..local {
                out[self.position(rank, local, i) as usize] = rank * local + i;
            }
        }
        out
    }

    /// The share of a causal attention's query-key pairs over a whole sequence of
    /// `degree x local` rows that rank `rank` computes.
    pub fn causal_share(&self, rank: u64, local: u64) -> f64 {
        let chunks = self.chunks_of(rank);
        let len = (local / chunks.len() as u64) as f64;
        // Chunk `c` of `len` rows: its row `i` at position `c * len + i` sees that many
        // keys plus one.
        let pairs: f64 = chunks
            .iter()
            .map(|&c| len * (c as f64 * len) + len * (len + 1.0) / 2.0)
            .sum();
        let whole = (local * self.degree) as f64;
        pairs / (whole * (whole + 1.0) / 2.0)
    }

    /// The largest [`ContextLayout::causal_share`] over the group's ranks: the rank that
    /// finishes last.
    pub fn worst_causal_share(&self, local: u64) -> f64 {
        (0..self.degree)
            .map(|r| self.causal_share(r, local))
            .fold(0.0, f64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_tail_gives_each_rank_a_head_and_a_tail_chunk() {
        let l = ContextLayout {
            degree: 2,
            balance: ContextBalance::HeadTail,
        };
        // 8 tokens, 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
        assert_eq!(l.positions(0, 4), [0, 1, 6, 7]);
        assert_eq!(l.positions(1, 4), [2, 3, 4, 5]);
        assert_eq!(l.gathered_rows(4), [0, 1, 4, 5, 6, 7, 2, 3]);
        assert!((l.causal_share(0, 4) - l.causal_share(1, 4)).abs() < 1e-12);
        let plain = ContextLayout {
            balance: ContextBalance::None,
            ..l
        };
        assert_eq!(plain.positions(1, 4), [4, 5, 6, 7]);
        assert_eq!(plain.gathered_rows(4), (0..8).collect::<Vec<_>>());
        // The last rank's chunk sees the most keys: 26 of the 36 pairs.
        assert!((plain.worst_causal_share(4) - 26.0 / 36.0).abs() < 1e-12);
        // The closed form counts what the positions say.
        for layout in [l, plain] {
            for rank in 0..2 {
                let pairs: u64 = layout.positions(rank, 4).iter().map(|p| p + 1).sum();
                assert!((layout.causal_share(rank, 4) - pairs as f64 / 36.0).abs() < 1e-12);
            }
        }
    }
}
