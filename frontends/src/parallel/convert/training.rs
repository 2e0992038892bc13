//! The training run's sections: the batch, the optimizer and its schedule, gradient
//! clipping, and the data trained and evaluated on.

use super::{at_least_1, number, record};
use crate::either::NameOr;
use crate::parallel::file::*;
use crate::parallel::*;
use crate::yaml::pos;
use crate::{Origin, SpecError};
use serde_saphyr::Spanned;
use std::path::{Path, PathBuf};

/// The batch per rank (1 sequence of the model's length unless written), its gradient
/// accumulation and when gradients are synchronised.
pub(super) fn batch(o: &mut Origin, spec: Option<Spanned<BatchFile>>) -> Result<Batch, SpecError> {
    let mut batch = Batch {
        per_rank: 1,
        seq_len: None,
        grad_accum: 1,
        grad_sync: GradSync::EveryMicroBatch,
    };
    if let Some(b) = spec {
        o.insert("batch", pos(&b));
        let b = b.value;
        record(o, "batch.per_rank", &b.per_rank);
        record(o, "batch.seq_len", &b.seq_len);
        record(o, "batch.grad_accum", &b.grad_accum);
        batch.per_rank = at_least_1(o, "batch.per_rank", b.per_rank.map_or(1, |s| s.value))?;
        batch.seq_len = b.seq_len.map(|s| at_least_1(o, "batch.seq_len", s.value)).transpose()?;
        batch.grad_accum = at_least_1(o, "batch.grad_accum", b.grad_accum.map_or(1, |s| s.value))?;
        record(o, "batch.grad_sync", &b.grad_sync);
        batch.grad_sync = b.grad_sync.map_or(GradSync::EveryMicroBatch, |s| s.value);
    }
    Ok(batch)
}

/// The optimizer, and AdamW's implementation in a PyTorch run (`fused` unless written).
pub(super) fn optimizer(
    o: &mut Origin,
    spec: Option<Spanned<OptimizerFile>>,
) -> Result<(Optimizer, AdamwImplementation), SpecError> {
    let Some(spec) = spec else {
        let adamw = Optimizer::AdamW {
            lr: 3e-4,
            betas: [0.9, 0.95],
            eps: 1e-8,
            weight_decay: 0.1,
        };
        return Ok((adamw, AdamwImplementation::Fused));
    };
    o.insert("optimizer", pos(&spec));
    let get = |o: &mut Origin,
               field: &str,
               v: Option<Spanned<f64>>,
               default: f64,
               ok: fn(f64) -> bool,
               rule: &str|
     -> Result<f64, SpecError> {
        match v {
            None => Ok(default),
            Some(s) => {
                o.insert(field, pos(&s));
                number(o, field, s.value, ok, rule)
            }
        }
    };
    Ok(match spec.value {
        OptimizerFile::Adamw(a) => {
            let lr = get(o, "optimizer.adamw.lr", a.lr, 3e-4, |v| v > 0.0, "> 0")?;
            let eps = get(o, "optimizer.adamw.eps", a.eps, 1e-8, |v| v > 0.0, "> 0")?;
            let weight_decay = get(
                o,
                "optimizer.adamw.weight_decay",
                a.weight_decay,
                0.1,
                |v| v >= 0.0,
                ">= 0",
            )?;
            let betas = match a.betas {
                None => [0.9, 0.95],
                Some(b) => {
                    o.insert("optimizer.adamw.betas", pos(&b));
                    for v in b.value {
                        number(o, "optimizer.adamw.betas", v, |x| (0.0..1.0).contains(&x), "in [0, 1)")?;
                    }
                    b.value
                }
            };
            record(o, "optimizer.adamw.implementation", &a.implementation);
            let implementation = a.implementation.map_or(AdamwImplementation::Fused, |s| s.value);
            let adamw = Optimizer::AdamW {
                lr,
                betas,
                eps,
                weight_decay,
            };
            (adamw, implementation)
        }
        OptimizerFile::Sgd(s) => (
            Optimizer::Sgd {
                lr: get(o, "optimizer.sgd.lr", s.lr, 1e-2, |v| v > 0.0, "> 0")?,
                momentum: get(
                    o,
                    "optimizer.sgd.momentum",
                    s.momentum,
                    0.0,
                    |v| (0.0..1.0).contains(&v),
                    "in [0, 1)",
                )?,
                weight_decay: get(
                    o,
                    "optimizer.sgd.weight_decay",
                    s.weight_decay,
                    0.0,
                    |v| v >= 0.0,
                    ">= 0",
                )?,
            },
            AdamwImplementation::Fused,
        ),
    })
}

/// The gradient clipping norm: 1.0 unless written, none when written null.
pub(super) fn grad_clip(o: &mut Origin, spec: Option<Spanned<Option<f64>>>) -> Result<Option<f64>, SpecError> {
    record(o, "grad_clip", &spec);
    Ok(match spec.map(|s| s.value) {
        None => Some(1.0),
        Some(None) => None,
        Some(Some(c)) => Some(number(o, "grad_clip", c, |v| v > 0.0, "> 0 (or null for no clipping)")?),
    })
}

/// The learning-rate schedule: warmup steps (none unless written) and the floor of the
/// decay, as a fraction of the peak (0.1 unless written).
pub(super) fn lr_schedule(o: &mut Origin, spec: Option<Spanned<LrScheduleFile>>) -> Result<LrSchedule, SpecError> {
    let mut lr_schedule = LrSchedule {
        warmup_steps: 0,
        min_lr_ratio: 0.1,
    };
    if let Some(ls) = spec {
        o.insert("lr_schedule", pos(&ls));
        if let Some(w) = &ls.value.warmup_steps {
            o.insert("lr_schedule.warmup_steps", pos(w));
            lr_schedule.warmup_steps = w.value;
        }
        if let Some(m) = &ls.value.min_lr_ratio {
            o.insert("lr_schedule.min_lr_ratio", pos(m));
            lr_schedule.min_lr_ratio = number(
                o,
                "lr_schedule.min_lr_ratio",
                m.value,
                |v| (0.0..=1.0).contains(&v),
                "in [0, 1]",
            )?;
        }
    }
    Ok(lr_schedule)
}

/// The data trained on: synthetic unless written, or a token file (with its validation
/// file) whose relative paths are relative to the spec at `spec_path`.
pub(super) fn data(
    o: &mut Origin,
    spec: Option<Spanned<NameOr<DataFile>>>,
    spec_path: &Path,
) -> Result<DataSource, SpecError> {
    let Some(d) = spec else {
        return Ok(DataSource::Synthetic);
    };
    o.insert("data", pos(&d));
    match d.value {
        NameOr::Name(n) if n == "synthetic" => Ok(DataSource::Synthetic),
        NameOr::Name(n) => Err(o.error(
            "data",
            format!("unknown data source `{n}`"),
            "use `synthetic` or `{tokens: path/to/train.bin, dtype: u16}`",
        )),
        NameOr::Map(f) => {
            o.insert("data.tokens", pos(&f.tokens));
            let base = spec_path.parent().unwrap_or_else(|| Path::new(""));
            let path = resolve(base, &f.tokens.value);
            let eval = eval(o, &f, base)?;
            Ok(DataSource::Tokens {
                path,
                dtype: f.dtype.map_or(TokenDType::U16, |d| d.value),
                eval,
            })
        }
    }
}

/// A path as written in the spec: absolute, or relative to the spec's folder `base`.
fn resolve(base: &Path, written: &str) -> PathBuf {
    let rel = PathBuf::from(written);
    if rel.is_absolute() {
        rel
    } else {
        base.join(rel)
    }
}

/// The evaluation on the validation token file, when one is given: every 100 steps on 10
/// batches unless written; its settings without the file are refused.
fn eval(o: &mut Origin, f: &DataFile, base: &Path) -> Result<Option<Eval>, SpecError> {
    record(o, "data.val", &f.val);
    record(o, "data.eval_every", &f.eval_every);
    record(o, "data.eval_batches", &f.eval_batches);
    match (&f.val, &f.eval_every, &f.eval_batches) {
        (None, None, None) => Ok(None),
        (None, every, _) => {
            let field = if every.is_some() {
                "data.eval_every"
            } else {
                "data.eval_batches"
            };
            Err(o.error(
                field,
                "validation needs a validation token file",
                "add `val: path/to/val.bin` to `data` (what `shardplan data prepare` writes beside train.bin)",
            ))
        }
        (Some(val), every, batches) => {
            let every = at_least_1(o, "data.eval_every", every.as_ref().map_or(100, |s| s.value))?;
            let batches = at_least_1(o, "data.eval_batches", batches.as_ref().map_or(10, |s| s.value))?;
            if batches > MAX_EVAL_BATCHES {
                return Err(o.error(
                    "data.eval_batches",
                    format!("{batches} batches per evaluation is more than the {MAX_EVAL_BATCHES} shardplan runs"),
                    format!("set `data.eval_batches` to at most {MAX_EVAL_BATCHES}"),
                ));
            }
            if val.value.trim().is_empty() {
                return Err(o.error(
                    "data.val",
                    "the validation file's path is empty",
                    "give the path of a token file, such as data/val.bin",
                ));
            }
            Ok(Some(Eval {
                path: resolve(base, &val.value),
                every,
                batches,
            }))
        }
    }
}
