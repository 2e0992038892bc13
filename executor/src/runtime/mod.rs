//! Running graphs and Plans: the single-rank reference interpreter (`interp`), the rank
//! runtime that executes one rank's Plan program (`rank`: a worker per stream, events,
//! issue-ordered allocation, measured memory), and device selection (`device`).

pub mod device;
pub mod interp;
pub mod optim;
pub(crate) mod rank;
