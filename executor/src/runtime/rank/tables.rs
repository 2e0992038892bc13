//! What running a step needs from the plan alone, derived once per plan ([`ProgramTables`])
//! and read by every step of every rank: the issue order of allocations and collectives,
//! which instructions each stream runs, the all-to-all steps' hand-overs, where each
//! group's persistent state lives and how gradient pieces are packed.

use super::*;

/// The tables a rank's program runs from, built once per plan (`ProgramTables::new`).
pub struct ProgramTables {
    /// Issue-order sequence number of each alloc/free (`usize::MAX` for the others).
    pub(super) mem_seq: Vec<usize>,
    /// Issue-order sequence number of each collective, and of each compute step that runs
    /// collectives among its ops (`usize::MAX`: no launch turn).
    pub(super) launch_seq: Vec<usize>,
    /// Each collective's position in its group's issue order within a step (the low half
    /// of its tag; the step number is the high half).
    pub(super) comm_seq: Vec<u64>,
    /// The (group, stream) pairs collectives are issued on, in order of first issue.
    pub(super) issued_on: Vec<(Comm, Stream)>,
    /// The same pairs, sorted (`Program::communicators`): the order they are flushed in.
    pub(super) communicators: Vec<(Comm, Stream)>,
    /// The streams that run instructions, in `Stream::ALL` order.
    pub(super) streams: Vec<StreamProgram>,
    /// Per compute-stream event an all-to-all step waits for before it runs: that step's
    /// issue index. The compute stream hands the step its operands as it records it.
    pub(super) ready_of: Vec<Option<usize>>,
    /// Per value slot and micro-batch: the issue index of the last all-to-all step that
    /// reads it.
    pub(super) a2a_last: HashMap<(ValueSlot, u32), usize>,
    /// Each group's sharded parameter buffer.
    pub(super) sharded: Vec<Option<BufId>>,
    /// The pool of each group's optimizer state buffer, when it has one.
    pub(super) opt_pool: Vec<Option<Pool>>,
    /// Per `PackGrads` instruction (empty for the others): each gradient piece and, for
    /// each of its parameters in order, its position in the group's layout and its elements.
    pub(super) packs: Vec<Vec<PackPiece>>,
}

/// A gradient piece a `PackGrads` reads and, for each of its parameters in order, (its
/// position in the group's layout, its elements).
pub(super) type PackPiece = (BufId, Vec<(usize, usize)>);

/// One stream's instructions, by issue index.
pub(super) struct StreamProgram {
    pub(super) stream: Stream,
    pub(super) instrs: Vec<usize>,
    /// The group of the stream's first collective (whose CUDA stream its work is issued to).
    pub(super) first_comm: Option<Comm>,
}

impl ProgramTables {
    /// The tables of `shared.plan`'s program.
    pub fn new(shared: &Shared) -> Result<Self, ExecError> {
        let plan = &shared.plan;
        let IssueOrder {
            mem_seq,
            launch_seq,
            comm_seq,
            issued_on,
        } = issue_order(plan);
        let (ready_of, a2a_last) = all_to_all_hand_overs(shared)?;
        Ok(ProgramTables {
            mem_seq,
            launch_seq,
            comm_seq,
            issued_on,
            communicators: plan.programs[0].communicators(),
            streams: stream_programs(plan),
            ready_of,
            a2a_last,
            sharded: (0..plan.groups.len())
                .map(|g| plan.persistent_buffer(g, Category::ShardedParams).map(|b| b.id))
                .collect(),
            opt_pool: (0..plan.groups.len())
                .map(|g| plan.persistent_buffer(g, Category::OptimizerState).map(|b| b.pool))
                .collect(),
            packs: pack_layouts(plan)?,
        })
    }

    /// Whether this rank launches its collectives in issue order: when `shared` asks for it
    /// or any of its communicators only enqueues them (every communicator is looked up).
    pub(super) fn ordered_launch(&self, shared: &Shared, comms: &Comms) -> Result<bool, ExecError> {
        let mut ordered = shared.ordered_launch;
        for &(comm, stream) in &self.issued_on {
            ordered |= comms.get(comm, stream)?.enqueues();
        }
        Ok(ordered)
    }

    /// Group `g`'s sharded parameter buffer.
    pub(super) fn sharded_buffer(&self, g: usize) -> Result<BufId, ExecError> {
        self.sharded
            .get(g)
            .copied()
            .flatten()
            .ok_or_else(|| ExecError::Internal(format!("no sharded parameter buffer for g{g}")))
    }

    /// Whether these tables were built for a program of `n` instructions.
    pub(super) fn fits(&self, n: usize) -> bool {
        self.mem_seq.len() == n
    }
}

/// The program's issue order, as [`ProgramTables`] keeps it (its fields of the same names).
struct IssueOrder {
    mem_seq: Vec<usize>,
    launch_seq: Vec<usize>,
    comm_seq: Vec<u64>,
    issued_on: Vec<(Comm, Stream)>,
}

/// Per instruction: its alloc/free turn, its launch turn and its position in its group's
/// collectives; and the (group, stream) pairs in order of first issue.
fn issue_order(plan: &Plan) -> IssueOrder {
    let program = &plan.programs[0];
    let mut mem_seq = vec![usize::MAX; program.instrs.len()];
    let mut launch_seq = vec![usize::MAX; program.instrs.len()];
    let mut comm_seq = vec![0u64; program.instrs.len()];
    let mut issued_on = Vec::new();
    let mut q = 0;
    let mut launches = 0;
    let mut per_comm: HashMap<Comm, u64> = HashMap::new();
    for (i, x) in program.instrs.iter().enumerate() {
        if matches!(x.instr, Instr::Alloc { .. } | Instr::Free { .. }) {
            mem_seq[i] = q;
            q += 1;
        }
        if let Some((comm, _, _)) = x.instr.collective() {
            let n = per_comm.entry(comm).or_insert(0);
            comm_seq[i] = *n;
            *n += 1;
            launch_seq[i] = launches;
            launches += 1;
            if !issued_on.contains(&(comm, x.stream)) {
                issued_on.push((comm, x.stream));
            }
        }
        // A compute step that runs collectives among its ops (tensor or expert parallelism)
        // takes one launch turn for all of them: no other stream's collective launches
        // between two of them, so their order among the rank's launches is the issue
        // order on every rank.
        if let Instr::Compute { step, .. } = &x.instr {
            if plan.steps.get(step.index()).is_some_and(|s| !s.tensor_ops.is_empty()) {
                launch_seq[i] = launches;
                launches += 1;
            }
        }
    }
    IssueOrder {
        mem_seq,
        launch_seq,
        comm_seq,
        issued_on,
    }
}

/// Each stream's instructions in issue order, for the streams that have any.
fn stream_programs(plan: &Plan) -> Vec<StreamProgram> {
    let program = &plan.programs[0];
    let mut out = Vec::new();
    for stream in Stream::ALL {
        let instrs: Vec<usize> = program
            .instrs
            .iter()
            .enumerate()
            .filter(|(_, x)| x.stream == stream)
            .map(|(i, _)| i)
            .collect();
        if instrs.is_empty() {
            continue;
        }
        let first_comm = instrs
            .iter()
            .find_map(|&i| program.instrs[i].instr.collective().map(|(c, _, _)| c));
        out.push(StreamProgram {
            stream,
            instrs,
            first_comm,
        });
    }
    out
}

/// Type of [`all_to_all_hand_overs`]' result: `ready_of` and `a2a_last`.
type HandOvers = (Vec<Option<usize>>, HashMap<(ValueSlot, u32), usize>);

/// The compute-stream event each all-to-all step waits for last before it runs (by event),
/// and the last all-to-all step that reads each value slot and micro-batch.
fn all_to_all_hand_overs(shared: &Shared) -> Result<HandOvers, ExecError> {
    let plan = &shared.plan;
    let program = &plan.programs[0];
    let mut ready_of = vec![None; plan.events as usize];
    let mut a2a_last = HashMap::new();
    let mut last_wait = None;
    for (i, x) in program.instrs.iter().enumerate() {
        if let (Stream::AllToAll, Instr::Compute { step, micro, .. }) = (x.stream, &x.instr) {
            if let (Some(s), Some(r)) = (
                plan.steps.get(step.index()),
                plan.steps.get(step.index()).and_then(|s| s.nodes.first()),
            ) {
                let id = NodeId(r.start);
                let copy = s.phase == shardplan_planner::Phase::Recompute;
                for &input in &shared.joint.graph.node(id).inputs {
                    a2a_last.insert((shared.exec.read_slot(id, copy, input), *micro), i);
                }
            }
        }
        match x.instr {
            Instr::Wait { event } if x.stream == Stream::AllToAll => last_wait = Some(event.index()),
            Instr::Compute { .. } if x.stream == Stream::AllToAll => {
                let e = last_wait.take().filter(|&e| {
                    program.instrs[..i].iter().any(|r| {
                        r.stream == Stream::Compute && matches!(r.instr, Instr::Record { event } if event.index() == e)
                    })
                });
                let e = e.ok_or_else(|| {
                    ExecError::Internal(format!(
                        "all-to-all step #{i} does not wait for the compute stream just before it"
                    ))
                })?;
                ready_of[e] = Some(i);
            }
            _ => {}
        }
    }
    Ok((ready_of, a2a_last))
}

/// Per instruction: a `PackGrads`' pieces and where each piece's parameters sit in its
/// group's layout.
fn pack_layouts(plan: &Plan) -> Result<Vec<Vec<PackPiece>>, ExecError> {
    let mut packs = Vec::with_capacity(plan.programs[0].instrs.len());
    for x in &plan.programs[0].instrs {
        let Instr::PackGrads { group, srcs, .. } = &x.instr else {
            packs.push(Vec::new());
            continue;
        };
        let layout = &plan.groups[group.index()].layout;
        let mut pieces = Vec::with_capacity(srcs.len());
        for &b in srcs {
            let mut params = Vec::with_capacity(plan.buffer(b).params.len());
            for p in &plan.buffer(b).params {
                let i =
                    layout.params.iter().position(|l| l.param == *p).ok_or_else(|| {
                        ExecError::Internal(format!("{p} of {} is not in {group}", plan.buffer(b).name))
                    })?;
                params.push((i, layout.params[i].numel() as usize));
            }
            pieces.push((b, params));
        }
        packs.push(pieces);
    }
    Ok(packs)
}
