//! Choosing the next token from logits: greedy at temperature 0, else nucleus (top-p)
//! sampling from the tempered softmax, with draws from the counter-based generator so a
//! seed repeats a generation exactly.

use crate::init::uniform;
use crate::ExecError;

/// How to choose tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    pub max_new_tokens: u64,
    /// 0: greedy (the most likely token); otherwise logits are divided by it.
    pub temperature: f64,
    /// Keep the most likely tokens whose probabilities add up to at least this (0 < p <= 1).
    pub top_p: f64,
    pub seed: u64,
}

impl Sampling {
    /// Greedy decoding of `n` tokens.
    pub fn greedy(n: u64) -> Self {
        Sampling {
            max_new_tokens: n,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// Stream of the generator's draws (apart from initialisation and data order).
const STREAM: u64 = u64::MAX - 16;

/// The token for `logits` at new-token index `i` of a generation.
pub fn choose(logits: &[f32], s: &Sampling, i: u64) -> Result<u32, ExecError> {
    let bad = || ExecError::Internal("the logits are not finite".into());
    if s.temperature <= 0.0 {
        return super::argmax(logits).map(|t| t as u32).ok_or_else(bad);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return Err(bad());
    }
    let mut p: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(t, &l)| (t, (f64::from(l - max) / s.temperature).exp()))
        .collect();
    let total: f64 = p.iter().map(|x| x.1).sum();
    // Most likely first; equal probabilities in token order.
    p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = 0usize;
    let mut mass = 0f64;
    for (_, q) in &p {
        kept += 1;
        mass += q / total;
        if mass >= s.top_p {
            break;
        }
    }
    let p = &p[..kept];
    let kept_total: f64 = p.iter().map(|x| x.1).sum();
    let mut u = uniform(s.seed, STREAM, i) * kept_total;
    for &(t, q) in p {
        if u < q {
            return Ok(t as u32);
        }
        u -= q;
    }
    Ok(p[kept - 1].0 as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest_and_top_p_keeps_the_nucleus() {
        assert_eq!(choose(&[0.1, 3.0, 3.0, -1.0], &Sampling::greedy(1), 0).unwrap(), 1);
        // Token 2 holds almost all the mass: top-p 0.5 keeps only it, whatever the draw.
        let s = Sampling {
            max_new_tokens: 1,
            temperature: 1.0,
            top_p: 0.5,
            seed: 7,
        };
        for i in 0..50 {
            assert_eq!(choose(&[0.0, 1.0, 9.0, 2.0], &s, i).unwrap(), 2);
        }
        // At top-p 1 every token is drawn sometimes, in proportion: equal logits, equal counts.
        let s = Sampling { top_p: 1.0, ..s };
        let mut counts = [0usize; 4];
        for i in 0..4000 {
            counts[choose(&[1.0; 4], &s, i).unwrap() as usize] += 1;
        }
        assert!(counts.iter().all(|&c| (850..1150).contains(&c)), "{counts:?}");
        // The same seed and index give the same token; NaN logits are an error.
        assert_eq!(
            choose(&[0.3, 0.2, 0.1], &s, 3).unwrap(),
            choose(&[0.3, 0.2, 0.1], &s, 3).unwrap()
        );
        assert!(choose(&[f32::NAN, 1.0], &Sampling::greedy(1), 0).is_err());
    }
}
