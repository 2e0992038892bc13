//! Attention's mask: which keys each query row sees, for every attention kernel (the
//! fused CPU ones, the composed candle ones, the blockwise backward).

/// Which keys each query row of an attention sees: row `i` the keys `0..keys(i)`.
#[derive(Clone, Debug, PartialEq)]
pub enum Mask {
    /// Every key.
    Full,
    /// Causal, the rows aligned to the end of the keys: row `i` of `s` sees `0..=i + t - s`.
    Causal,
    /// A context rank's rows of a whole sequence (the keys in position order): row `i` sees
    /// the keys up to its position, `positions[i]`.
    Positions(std::sync::Arc<[usize]>),
}

impl Mask {
    /// The mask of an attention op (`causal`, and a context-parallel graph's `context`)
    /// on context rank `rank`'s `rows` query rows.
    pub fn of(causal: bool, context: Option<shardplan_ir::ContextLayout>, rank: u64, rows: usize) -> Mask {
        match (causal, context) {
            (false, _) => Mask::Full,
            (true, None) => Mask::Causal,
            (true, Some(l)) => {
                Mask::Positions(l.positions(rank, rows as u64).into_iter().map(|p| p as usize).collect())
            }
        }
    }

    /// Keys `0..keys(i)` that query row `i` of `s` sees among `t`.
    pub fn keys(&self, i: usize, s: usize, t: usize) -> usize {
        match self {
            Mask::Full => t,
            Mask::Causal => (i + 1 + t).saturating_sub(s).min(t),
            Mask::Positions(p) => p.get(i).map_or(t, |&p| (p + 1).min(t)),
        }
    }

    /// The most keys any of rows `r0..r1` sees.
    pub fn block_keys(&self, r0: usize, r1: usize, s: usize, t: usize) -> usize {
        (r0..r1).map(|i| self.keys(i, s, t)).max().unwrap_or(0)
    }

    /// The mask of rows `r0..r1` on their own, against the first `tk` keys (at least the
    /// keys those rows see): a causal block stays aligned to the end of its keys, a
    /// context rank's rows keep their positions.
    pub fn rows(&self, r0: usize, r1: usize) -> Mask {
        match self {
            Mask::Positions(p) => Mask::Positions(p[r0.min(p.len())..r1.min(p.len())].into()),
            m => m.clone(),
        }
    }

    pub fn is_full(&self) -> bool {
        *self == Mask::Full
    }
}
