//! One entry of a pipeline rank's program, in torch.distributed.pipelining's vocabulary and
//! text form (`2F0`, `1UNSHARD`, `3SEND_F1`, `(0F3;1B2)OVERLAP_F_B`), so a schedule prints,
//! reads and compares as torch writes it.

use std::fmt;
use std::str::FromStr;

/// What an [`Op`] does; the names are torch's `_ComputationType`s.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// A stage's forward of one micro-batch.
    Forward,
    /// A stage's whole backward of one micro-batch (input and weight gradients).
    Backward,
    /// The input-gradient half of a backward (zero-bubble schedules).
    BackwardInput,
    /// The weight-gradient half of a backward, run after its input half.
    BackwardWeight,
    /// FSDP's all-gather of a stage's parameters.
    Unshard,
    /// FSDP's free of a stage's unsharded parameters.
    Reshard,
    /// A stage's output activation sent to the next stage's rank.
    SendF,
    /// The activation a stage receives from the previous stage's rank.
    RecvF,
    /// A stage's input gradient sent to the previous stage's rank.
    SendB,
    /// The output gradient a stage receives from the next stage's rank.
    RecvB,
    /// Waits until a forward send is done, so its buffer can be freed.
    WaitSendF,
    /// Waits until a backward send is done.
    WaitSendB,
    /// The stage's gradient reduction over its data-parallel ranks, once per step.
    ReduceGrad,
    /// Waits for that reduction.
    WaitReduceGrad,
}

impl OpKind {
    /// Every kind, longest name first where one name starts another (the parse order).
    const BY_NAME: [(OpKind, &'static str); 14] = [
        (OpKind::WaitReduceGrad, "WAIT_REDUCE_GRAD"),
        (OpKind::WaitSendF, "WAIT_SEND_F"),
        (OpKind::WaitSendB, "WAIT_SEND_B"),
        (OpKind::ReduceGrad, "REDUCE_GRAD"),
        (OpKind::Unshard, "UNSHARD"),
        (OpKind::Reshard, "RESHARD"),
        (OpKind::SendF, "SEND_F"),
        (OpKind::RecvF, "RECV_F"),
        (OpKind::SendB, "SEND_B"),
        (OpKind::RecvB, "RECV_B"),
        (OpKind::Forward, "F"),
        (OpKind::BackwardInput, "I"),
        (OpKind::Backward, "B"),
        (OpKind::BackwardWeight, "W"),
    ];

    /// torch's name of the kind (`F`, `SEND_F`, ...).
    pub fn name(self) -> &'static str {
        Self::BY_NAME
            .iter()
            .find(|(k, _)| *k == self)
            .map(|(_, n)| *n)
            .expect("every kind has a name")
    }

    /// Compute on a stage: F, B, I or W.
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            OpKind::Forward | OpKind::Backward | OpKind::BackwardInput | OpKind::BackwardWeight
        )
    }

    /// Whether the kind names a micro-batch (compute, sends, receives and their waits).
    pub fn has_microbatch(self) -> bool {
        !matches!(
            self,
            OpKind::Unshard | OpKind::Reshard | OpKind::ReduceGrad | OpKind::WaitReduceGrad
        )
    }
}

/// One action on one stage: `stage`, `kind`, and the micro-batch where the kind has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Op {
    pub stage: u32,
    pub kind: OpKind,
    pub microbatch: Option<u32>,
}

impl Op {
    pub fn new(stage: u32, kind: OpKind, microbatch: u32) -> Op {
        Op {
            stage,
            kind,
            microbatch: Some(microbatch),
        }
    }

    /// An action of a kind without a micro-batch (`UNSHARD`, `REDUCE_GRAD`, ...).
    pub fn stage_only(stage: u32, kind: OpKind) -> Op {
        Op {
            stage,
            kind,
            microbatch: None,
        }
    }

    /// The same stage and micro-batch, another kind.
    pub fn with_kind(self, kind: OpKind) -> Op {
        Op { kind, ..self }
    }
}

/// One slot of a rank's program: an op, or DualPipeV's forward and backward of two stages
/// overlapped (`OVERLAP_F_B`, run as one unit).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Op(Op),
    Overlap(Vec<Op>),
}

impl Action {
    /// The ops the action runs, one for a plain op.
    pub fn ops(&self) -> &[Op] {
        match self {
            Action::Op(op) => std::slice::from_ref(op),
            Action::Overlap(ops) => ops,
        }
    }

    /// Compute (F, B, I, W, or an overlap of them), as against communication and FSDP.
    pub fn is_compute(&self) -> bool {
        self.ops().iter().all(|op| op.kind.is_compute())
    }

    /// The plain op, or `None` for an overlap.
    pub fn op(&self) -> Option<Op> {
        match self {
            Action::Op(op) => Some(*op),
            Action::Overlap(_) => None,
        }
    }
}

impl From<Op> for Action {
    fn from(op: Op) -> Action {
        Action::Op(op)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.stage, self.kind.name())?;
        if let Some(mb) = self.microbatch {
            write!(f, "{mb}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Op(op) => op.fmt(f),
            Action::Overlap(ops) => {
                let parts: Vec<String> = ops.iter().map(Op::to_string).collect();
                write!(f, "({})OVERLAP_F_B", parts.join(";"))
            }
        }
    }
}

/// Why a cell of a schedule does not read as an action.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{text}` is not a pipeline action: {why} (write [stage][kind][micro-batch], e.g. `2F0`, `1B3`, `0UNSHARD`, `(0F3;1B2)OVERLAP_F_B`)")]
pub struct ActionParseError {
    pub text: String,
    pub why: String,
}

fn parse_error(text: &str, why: impl Into<String>) -> ActionParseError {
    ActionParseError {
        text: text.to_string(),
        why: why.into(),
    }
}

impl FromStr for Op {
    type Err = ActionParseError;

    fn from_str(text: &str) -> Result<Op, ActionParseError> {
        let digits = text.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(parse_error(text, "it does not start with a stage number"));
        }
        let stage: u32 = text[..digits]
            .parse()
            .map_err(|_| parse_error(text, "its stage number is too large"))?;
        let rest = &text[digits..];
        let (kind, name) = OpKind::BY_NAME
            .iter()
            .find(|(_, name)| rest.starts_with(name))
            .ok_or_else(|| parse_error(text, format!("`{rest}` starts with no action kind")))?;
        let mb_text = &rest[name.len()..];
        let microbatch = if mb_text.is_empty() {
            None
        } else if mb_text.bytes().all(|b| b.is_ascii_digit()) {
            Some(
                mb_text
                    .parse()
                    .map_err(|_| parse_error(text, "its micro-batch number is too large"))?,
            )
        } else {
            return Err(parse_error(
                text,
                format!("`{mb_text}` after `{name}` is not a micro-batch number"),
            ));
        };
        match (kind.has_microbatch(), microbatch) {
            (true, None) => Err(parse_error(text, format!("`{name}` needs a micro-batch"))),
            (false, Some(_)) => Err(parse_error(text, format!("`{name}` takes no micro-batch"))),
            _ => Ok(Op {
                stage,
                kind: *kind,
                microbatch,
            }),
        }
    }
}

impl FromStr for Action {
    type Err = ActionParseError;

    fn from_str(text: &str) -> Result<Action, ActionParseError> {
        let text = text.trim();
        let Some(inner) = text.strip_prefix('(') else {
            return text.parse().map(Action::Op);
        };
        let Some((parts, kind)) = inner.split_once(')') else {
            return Err(parse_error(text, "its `(` has no `)`"));
        };
        if kind != "OVERLAP_F_B" {
            return Err(parse_error(
                text,
                format!("only OVERLAP_F_B groups actions, not `{kind}`"),
            ));
        }
        let ops = parts
            .split(';')
            .map(|p| p.trim().parse::<Op>())
            .collect::<Result<Vec<Op>, _>>()?;
        if ops.len() < 2 || ops.iter().any(|op| !op.kind.is_compute()) {
            return Err(parse_error(text, "an overlap groups two or more compute actions"));
        }
        Ok(Action::Overlap(ops))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_round_trips_as_torch_writes_it() {
        for text in [
            "2F0",
            "10B31",
            "1UNSHARD",
            "3SEND_F1",
            "0RECV_B12",
            "4WAIT_SEND_F2",
            "0REDUCE_GRAD",
            "0WAIT_REDUCE_GRAD",
            "(0F3;1B2)OVERLAP_F_B",
        ] {
            let action: Action = text.parse().unwrap();
            assert_eq!(action.to_string(), text);
        }
    }

    #[test]
    fn bad_text_is_refused_with_the_reason() {
        for (text, why) in [
            ("F0", "stage number"),
            ("2X0", "no action kind"),
            ("2F", "needs a micro-batch"),
            ("1UNSHARD3", "takes no micro-batch"),
            ("2F0x", "not a micro-batch"),
            ("(0F3;1B2", "no `)`"),
            ("(0F3)OVERLAP_F_B", "two or more"),
            ("(0F3;1B2)F", "only OVERLAP_F_B"),
            ("99999999999F0", "too large"),
        ] {
            let err = text.parse::<Action>().unwrap_err().to_string();
            assert!(err.contains(why), "{text}: {err}");
        }
    }
}
