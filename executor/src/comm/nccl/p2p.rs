//! The pipeline link over NCCL: point-to-point transfers between the pipeline ranks of one
//! (replicate, shard, tensor) coordinate.
//!
//! NCCL matches sends and receives by order, not by tag, and a pipeline rank consumes what
//! its neighbours send in an order of its own (interleaved stages, zero-bubble schedules).
//! So the link works as the MPI link does: every directed pair of neighbours has a
//! communicator of its own (the sender member 0, the receiver member 1), on which the
//! receiver runs one thread that receives every message in the order sent into a mailbox
//! keyed by (sender, tag); a send waits only for that thread, never for the peer's
//! program. A message is a fixed-size header (its tag, dtype and dims) and then the
//! tensor's elements.
//!
//! This file is the plain part, tested on the CPU: which pairs exchange ([`link_edges`]),
//! in the order every rank opens their communicators, and the header ([`Header`]). The
//! `device` module (feature `cuda`) opens the communicators and moves the bytes.

use crate::ExecError;
use candle_core::DType;

/// Words of a message header.
pub const HEADER_WORDS: usize = 8;

/// The most dims a message's tensor may have (the header's room).
const MAX_DIMS: usize = HEADER_WORDS - 3;

/// The tag of the header that ends a receiving thread (sent by its sender's link when it
/// closes); no transfer of a step uses it.
pub const STOP_TAG: u64 = u64::MAX;

/// The directed pairs (sender, receiver) of a link of `members` (world ranks, in pipeline
/// order) that exchange: each pipeline rank with the ranks before and after it on the
/// ring. A stage sends to the next stage's rank, which is the next pipeline rank under
/// the loop placement and the same or the adjacent one under the V placement, and
/// gradients go back the same way. Sorted: every rank opens the communicators it belongs
/// to in this one order, so each opening finds its peer at the same one.
pub fn link_edges(members: &[u64]) -> Vec<(u64, u64)> {
    let n = members.len();
    let mut edges: Vec<(u64, u64)> = (0..n)
        .flat_map(|i| [(i, (i + 1) % n), (i, (i + n - 1) % n)])
        .filter(|(a, b)| a != b)
        .map(|(a, b)| (members[a], members[b]))
        .collect();
    edges.sort_unstable();
    edges.dedup();
    edges
}

/// What precedes a tensor on the link: the transfer's tag, the tensor's dtype and dims.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub tag: u64,
    pub dtype: DType,
    pub dims: Vec<usize>,
}

/// The dtypes the link carries, by their code on the wire.
const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

impl Header {
    /// The header that ends the receiving thread.
    pub fn stop() -> Header {
        Header {
            tag: STOP_TAG,
            dtype: DType::F32,
            dims: Vec::new(),
        }
    }

    /// Elements of the tensor that follows.
    pub fn elems(&self) -> usize {
        self.dims.iter().product()
    }

    /// The header as words: tag, dtype code, number of dims, then the dims (zeros after).
    pub fn encode(&self) -> Result<[u64; HEADER_WORDS], ExecError> {
        let code = DTYPES.iter().position(|&d| d == self.dtype).ok_or_else(|| {
            ExecError::Unsupported(format!("sending a {:?} tensor over the NCCL pipeline link", self.dtype))
        })?;
        if self.dims.len() > MAX_DIMS {
            return Err(ExecError::Unsupported(format!(
                "sending a tensor of {} dims over the NCCL pipeline link (at most {MAX_DIMS})",
                self.dims.len()
            )));
        }
        let mut words = [0u64; HEADER_WORDS];
        words[0] = self.tag;
        words[1] = code as u64;
        words[2] = self.dims.len() as u64;
        for (w, &d) in words[3..].iter_mut().zip(&self.dims) {
            *w = d as u64;
        }
        Ok(words)
    }

    /// Reads a header `from` (named in errors) sent; refuses one no link wrote.
    pub fn decode(words: &[u64; HEADER_WORDS], from: &str) -> Result<Header, ExecError> {
        let bad =
            |what: String| ExecError::Aborted(format!("pipeline link: a message from {from} is malformed: {what}"));
        let dtype = usize::try_from(words[1])
            .ok()
            .and_then(|c| DTYPES.get(c).copied())
            .ok_or_else(|| bad(format!("dtype code {}", words[1])))?;
        let n = usize::try_from(words[2])
            .ok()
            .filter(|&n| n <= MAX_DIMS)
            .ok_or_else(|| bad(format!("{} dims", words[2])))?;
        let dims = words[3..3 + n]
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| bad(format!("dim {d}"))))
            .collect::<Result<Vec<usize>, ExecError>>()?;
        let elems = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if elems.is_none_or(|e| e > isize::MAX as usize / 8) {
            return Err(bad(format!("dims {dims:?}")));
        }
        Ok(Header {
            tag: words[0],
            dtype,
            dims,
        })
    }
}

#[cfg(feature = "cuda")]
pub mod device;

#[cfg(test)]
mod tests {
    use super::*;

    /// Each pipeline rank exchanges with its ring neighbours both ways, once.
    #[test]
    fn a_link_pairs_each_rank_with_its_ring_neighbours() {
        assert_eq!(link_edges(&[3]), vec![]);
        assert_eq!(link_edges(&[0, 4]), vec![(0, 4), (4, 0)]);
        assert_eq!(
            link_edges(&[1, 5, 9]),
            vec![(1, 5), (1, 9), (5, 1), (5, 9), (9, 1), (9, 5)]
        );
        let four = link_edges(&[0, 1, 2, 3]);
        assert_eq!(four.len(), 8);
        assert!(four.contains(&(3, 0)) && four.contains(&(0, 3)) && !four.contains(&(0, 2)));
        // Sorted, so every rank opens them in one order.
        assert!(four.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn a_header_reads_back_as_written() {
        for h in [
            Header {
                tag: 17,
                dtype: DType::BF16,
                dims: vec![2, 128, 4096],
            },
            Header {
                tag: 0,
                dtype: DType::F64,
                dims: vec![],
            },
            Header::stop(),
        ] {
            assert_eq!(Header::decode(&h.encode().unwrap(), "rank 1").unwrap(), h);
        }
        assert_eq!(Header::stop().elems(), 1);
    }

    #[test]
    fn a_header_no_link_wrote_is_refused() {
        let good = Header {
            tag: 3,
            dtype: DType::F32,
            dims: vec![4, 5],
        }
        .encode()
        .unwrap();
        let mut w = good;
        w[1] = 9;
        assert!(Header::decode(&w, "rank 1")
            .unwrap_err()
            .to_string()
            .contains("dtype code 9"));
        let mut w = good;
        w[2] = 6;
        assert!(Header::decode(&w, "rank 1").unwrap_err().to_string().contains("6 dims"));
        let mut w = good;
        w[3] = u64::MAX / 2;
        w[4] = u64::MAX / 2;
        let e = Header::decode(&w, "rank 1").unwrap_err().to_string();
        assert!(e.contains("malformed") && e.contains("from rank 1"), "{e}");
        let too_many = Header {
            tag: 1,
            dtype: DType::F32,
            dims: vec![1; 6],
        };
        assert!(too_many.encode().is_err());
        let int = Header {
            tag: 1,
            dtype: DType::U32,
            dims: vec![1],
        };
        assert!(int.encode().is_err());
    }
}
