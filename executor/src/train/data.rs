//! Training batches: seeded synthetic tasks, and flat binary token files (nanoGPT's
//! `train.bin` layout: little-endian u16 or u32 ids, memory-mapped).
//!
//! Every source is deterministic in its seed and its position, so a run can be repeated
//! bit for bit (and, later, resumed from a checkpoint).

use crate::init::uniform;
use crate::ExecError;
use candle_core::{Device, Tensor};
use shardplan_frontends::TokenDType;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One micro-batch: a tensor per graph input name.
pub struct Batch {
    pub inputs: Vec<(String, Tensor)>,
    pub tokens: u64,
}

/// The batch of a language model: `tokens [batch, seq]` and `targets [batch * seq]`.
fn token_batch(
    tokens: Vec<u32>,
    targets: Vec<u32>,
    batch: usize,
    seq: usize,
    device: &Device,
) -> Result<Batch, ExecError> {
    Ok(Batch {
        inputs: vec![
            ("tokens".into(), Tensor::from_vec(tokens, (batch, seq), device)?),
            ("targets".into(), Tensor::from_vec(targets, batch * seq, device)?),
        ],
        tokens: (batch * seq) as u64,
    })
}

/// The same token batch every time: another framework's fixed batch, to compare against.
pub struct FixedTokens {
    tokens: Vec<u32>,
    targets: Vec<u32>,
    batch: usize,
    seq: usize,
    position: u64,
}

impl FixedTokens {
    /// `tokens` and `targets` hold `batch x seq` ids each, row by row.
    pub fn new(tokens: Vec<u32>, targets: Vec<u32>, batch: usize, seq: usize) -> Result<Self, ExecError> {
        let n = batch
            .checked_mul(seq)
            .ok_or_else(|| ExecError::Data(format!("a {batch} x {seq} batch")))?;
        if tokens.len() != n || targets.len() != n {
            return Err(ExecError::Data(format!(
                "a {batch} x {seq} batch needs {n} tokens and targets, not {} and {}",
                tokens.len(),
                targets.len()
            )));
        }
        Ok(FixedTokens {
            tokens,
            targets,
            batch,
            seq,
            position: 0,
        })
    }
}

impl DataSource for FixedTokens {
    fn next_batch(&mut self, device: &Device) -> Result<Batch, ExecError> {
        self.position += 1;
        token_batch(self.tokens.clone(), self.targets.clone(), self.batch, self.seq, device)
    }

    fn position(&self) -> u64 {
        self.position
    }

    fn seek(&mut self, position: u64) {
        self.position = position;
    }
}

/// A stream of micro-batches.
pub trait DataSource: Send {
    fn next_batch(&mut self, device: &Device) -> Result<Batch, ExecError>;
    /// Micro-batches handed out so far.
    fn position(&self) -> u64;
    /// Continues from micro-batch `position` (every source is a pure function of it).
    fn seek(&mut self, position: u64);
}

/// Next-token prediction over a fixed random permutation `next = perm[prev]` of the
/// vocabulary: a model learns it (the loss falls from ln(vocab) toward 0), and every batch
/// is a pure function of (seed, position).
pub struct SyntheticTokens {
    perm: Vec<u32>,
    batch: usize,
    seq: usize,
    seed: u64,
    position: u64,
}

impl SyntheticTokens {
    pub fn new(vocab: u64, batch: usize, seq: usize, seed: u64) -> Self {
        let mut perm: Vec<u32> = (0..vocab as u32).collect();
        // Fisher-Yates with the counter-based generator.
        for i in (1..perm.len()).rev() {
            let j = (uniform(seed, u64::MAX, i as u64) * (i + 1) as f64) as usize;
            perm.swap(i, j.min(i));
        }
        SyntheticTokens {
            perm,
            batch,
            seq,
            seed,
            position: 0,
        }
    }
}

impl DataSource for SyntheticTokens {
    fn next_batch(&mut self, device: &Device) -> Result<Batch, ExecError> {
        let v = self.perm.len() as f64;
        let (mut tokens, mut targets) = (
            Vec::with_capacity(self.batch * self.seq),
            Vec::with_capacity(self.batch * self.seq),
        );
        for row in 0..self.batch {
            let stream = self.position * self.batch as u64 + row as u64;
            let mut t = ((uniform(self.seed, u64::MAX - 1, stream) * v) as u32).min(self.perm.len() as u32 - 1);
            for _ in 0..self.seq {
                tokens.push(t);
                t = self.perm[t as usize];
                targets.push(t);
            }
        }
        self.position += 1;
        token_batch(tokens, targets, self.batch, self.seq, device)
    }

    fn position(&self) -> u64 {
        self.position
    }

    fn seek(&mut self, position: u64) {
        self.position = position;
    }
}

/// Classification of feature rows by a fixed random linear map (label = argmax of `W x`),
/// for the MLP family.
pub struct SyntheticFeatures {
    dim: usize,
    classes: usize,
    batch: usize,
    rows: usize,
    seed: u64,
    position: u64,
}

impl SyntheticFeatures {
    pub fn new(dim: usize, classes: usize, batch: usize, rows: usize, seed: u64) -> Self {
        SyntheticFeatures {
            dim,
            classes,
            batch,
            rows,
            seed,
            position: 0,
        }
    }
}

impl DataSource for SyntheticFeatures {
    fn next_batch(&mut self, device: &Device) -> Result<Batch, ExecError> {
        let n = self.batch * self.rows;
        let mut x = Vec::with_capacity(n * self.dim);
        let mut y = Vec::with_capacity(n);
        for r in 0..n as u64 {
            let row: Vec<f64> = (0..self.dim as u64)
                .map(|j| {
                    crate::init::normal(
                        self.seed,
                        u64::MAX - 2,
                        (self.position * n as u64 + r) * self.dim as u64 + j,
                    )
                })
                .collect();
            let label = (0..self.classes)
                .map(|c| {
                    (
                        c,
                        row.iter()
                            .enumerate()
                            .map(|(j, v)| v * crate::init::normal(self.seed, u64::MAX - 3, (c * self.dim + j) as u64))
                            .sum::<f64>(),
                    )
                })
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .map_or(0, |(c, _)| c);
            x.extend(row.iter().map(|&v| v as f32));
            y.push(label as u32);
        }
        self.position += 1;
        Ok(Batch {
            inputs: vec![
                (
                    "features".into(),
                    Tensor::from_vec(x, (self.batch, self.rows, self.dim), device)?,
                ),
                ("targets".into(), Tensor::from_vec(y, n, device)?),
            ],
            tokens: n as u64,
        })
    }

    fn position(&self) -> u64 {
        self.position
    }

    fn seek(&mut self, position: u64) {
        self.position = position;
    }
}

/// Random windows of `seq + 1` tokens from a flat token file (inputs and shifted targets).
pub struct TokenFile {
    path: PathBuf,
    map: memmap2::Mmap,
    width: usize,
    n_tokens: u64,
    vocab: u64,
    batch: usize,
    seq: usize,
    seed: u64,
    position: u64,
}

impl TokenFile {
    /// Opens and checks `path`: it must exist, hold whole tokens, and more than `seq` of them.
    pub fn open(
        path: &Path,
        dtype: TokenDType,
        vocab: u64,
        batch: usize,
        seq: usize,
        seed: u64,
    ) -> Result<Self, ExecError> {
        let bad = |why: String| ExecError::Data(format!("{}: {why}", path.display()));
        let file = std::fs::File::open(path).map_err(|e| bad(format!("cannot open token file: {e}")))?;
        let len = file.metadata().map_err(|e| bad(format!("cannot read: {e}")))?.len();
        let (width, name) = match dtype {
            TokenDType::U16 => (2usize, "u16"),
            TokenDType::U32 => (4, "u32"),
        };
        if len == 0 {
            return Err(bad("token file is empty".into()));
        }
        if len % width as u64 != 0 {
            return Err(bad(format!(
                "size {len} bytes is not a whole number of {name} tokens ({width} bytes each); is `dtype` right?"
            )));
        }
        let n_tokens = len / width as u64;
        if n_tokens <= seq as u64 {
            return Err(bad(format!(
                "holds {n_tokens} tokens; a sequence of {seq} needs at least {}",
                seq + 1
            )));
        }
        // SAFETY: the map is read-only; a file truncated by another process while we train is
        // outside what we guard against (as with every mmap-based loader).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| bad(format!("cannot map: {e}")))?;
        Ok(TokenFile {
            path: path.to_path_buf(),
            map,
            width,
            n_tokens,
            vocab,
            batch,
            seq,
            seed,
            position: 0,
        })
    }

    fn token(&self, index: u64) -> Result<u32, ExecError> {
        let off = (index * self.width as u64) as usize;
        let b = &self.map[off..off + self.width];
        let t = if self.width == 2 {
            u32::from(u16::from_le_bytes([b[0], b[1]]))
        } else {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]])
        };
        if u64::from(t) >= self.vocab {
            return Err(ExecError::Data(format!(
                "{}: token id {t} at byte offset {off} (token {index}) is outside the model's vocabulary of {}",
                self.path.display(),
                self.vocab
            )));
        }
        Ok(t)
    }
}

impl DataSource for TokenFile {
    fn next_batch(&mut self, device: &Device) -> Result<Batch, ExecError> {
        let starts = self.n_tokens - self.seq as u64;
        let (mut tokens, mut targets) = (
            Vec::with_capacity(self.batch * self.seq),
            Vec::with_capacity(self.batch * self.seq),
        );
        for row in 0..self.batch as u64 {
            let start = ((uniform(self.seed, u64::MAX - 4, self.position * self.batch as u64 + row) * starts as f64)
                as u64)
                .min(starts - 1);
            for i in 0..self.seq as u64 {
                tokens.push(self.token(start + i)?);
                targets.push(self.token(start + i + 1)?);
            }
        }
        self.position += 1;
        token_batch(tokens, targets, self.batch, self.seq, device)
    }

    fn position(&self) -> u64 {
        self.position
    }

    fn seek(&mut self, position: u64) {
        self.position = position;
    }
}

/// What mesh rank `rank` reads of a global batch's `inputs`: the rows of its data-parallel
/// index ([`rank_rows`]) and, in a context-parallel graph (`layout`), its rows of each of
/// their sequences ([`context_rows`]).
pub(crate) fn mesh_rows(
    inputs: Vec<(String, Tensor)>,
    mesh: &shardplan_planner::Mesh,
    layout: Option<shardplan_ir::ContextLayout>,
    rank: u64,
) -> Result<HashMap<String, Tensor>, ExecError> {
    let rows = rank_rows(inputs, mesh.data_index(rank) as usize, mesh.data_parallel() as usize)?;
    match layout {
        Some(l) => context_rows(rows, &l, mesh.context_index(rank)),
        None => Ok(rows),
    }
}

/// Context rank `rank`'s rows of every sequence of `inputs` (`tokens [b, s]`, and inputs
/// of `b x s` elements such as the flat `targets`), as `layout` deals them.
pub(crate) fn context_rows(
    inputs: HashMap<String, Tensor>,
    layout: &shardplan_ir::ContextLayout,
    rank: u64,
) -> Result<HashMap<String, Tensor>, ExecError> {
    let b = inputs.get("tokens").map_or(Ok(1), |t| t.dim(0))?;
    let chunks = layout.balance.chunks(layout.degree) as usize;
    inputs
        .into_iter()
        .map(|(name, t)| {
            let dims = t.dims().to_vec();
            let seqs = t.reshape((b, ()))?;
            let len = seqs.dim(1)? / chunks;
            let pieces: Vec<Tensor> = layout
                .chunks_of(rank)
                .into_iter()
                .map(|c| seqs.narrow(1, c as usize * len, len))
                .collect::<Result<_, _>>()?;
            let mine = Tensor::cat(&pieces, 1)?;
            let mine = if dims.len() == 1 {
                mine.flatten_all()?
            } else {
                mine.contiguous()?
            };
            Ok((name, mine))
        })
        .collect()
}

/// Rank `rank`'s rows (of `world` equal shares along dim 0) of every input of a global
/// batch.
pub(crate) fn rank_rows(
    inputs: Vec<(String, Tensor)>,
    rank: usize,
    world: usize,
) -> Result<HashMap<String, Tensor>, ExecError> {
    inputs
        .into_iter()
        .map(|(name, t)| {
            let per = t.dim(0)? / world;
            Ok((name, t.narrow(0, rank * per, per)?))
        })
        .collect()
}
