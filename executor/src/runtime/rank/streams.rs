//! A step's stream threads: one per plan stream, each running its instructions in issue
//! order, timing them, and stopping the world at the first failure.

use super::tables::StreamProgram;
use super::*;

impl StepCtx<'_> {
    /// Runs every stream's instructions on a thread of its own; the first stream's failure
    /// (in `Stream::ALL` order), if any.
    pub(super) fn run_streams(&self, state: &Mutex<Option<Compute>>) -> Result<(), ExecError> {
        std::thread::scope(|scope| {
            let mut handles = Vec::new();
            for s in &self.tables.streams {
                let clock = self.stream_clock(s)?;
                handles.push(scope.spawn(move || self.run_stream(s, clock, state)));
            }
            let mut first = Ok(());
            for h in handles {
                let r = h
                    .join()
                    .unwrap_or_else(|_| Err(ExecError::Internal("a stream thread panicked".into())));
                if first.is_ok() {
                    first = r;
                }
            }
            first
        })
    }

    /// With device timing, the clock of the CUDA stream a plan stream's work is issued to:
    /// the compute stream's, or that of the communicators its collectives run on (one per
    /// plan stream).
    fn stream_clock(&self, s: &StreamProgram) -> Result<Option<Clock>, ExecError> {
        let t = &self.timing;
        if t.origin.is_none() {
            return Ok(None);
        }
        Ok(Some(match s.stream {
            Stream::Compute => t.clock.clone(),
            Stream::AllToAll => self
                .comms
                .expert
                .as_ref()
                .map_or_else(|| t.clock.clone(), |e| e.clock()),
            stream => match s.first_comm {
                Some(c) => self.comms.get(c, stream)?.clock(),
                None => t.clock.clone(),
            },
        }))
    }

    /// One stream's thread: its instructions in order, each timed (on `clock` when given).
    fn run_stream(
        &self,
        s: &StreamProgram,
        clock: Option<Clock>,
        state: &Mutex<Option<Compute>>,
    ) -> Result<(), ExecError> {
        crate::runtime::device::bind_thread(&self.device)?;
        for &i in &s.instrs {
            if let Some(r) = self.abort.reason() {
                return Err(ExecError::Aborted(r));
            }
            let fault = self.fault_at(i);
            let started = wall_seconds();
            let mark = clock.as_ref().map(|c| c.mark()).transpose()?;
            let result = match fault {
                None => self.execute(i, state),
                Some(f) => self.injected(f),
            };
            *lock(&self.timing.times[i]) = [started, wall_seconds()];
            if let (Some(c), Some(m)) = (&clock, mark) {
                *lock(&self.timing.marks[i]) = Some((m, c.mark()?));
            }
            if let Err(e) = result {
                self.report_failure(i, &e);
                return Err(e);
            }
        }
        if s.stream == Stream::Compute {
            // The all-to-all stream's last step ends before the compute stream's.
            if let Some(c) = lock(state).as_ref() {
                c.ctx.flush_groups()?;
                lock(&self.out).routing = c.ctx.take_routing_load();
            }
        }
        Ok(())
    }

    /// The fault a test injected at instruction `i` of this rank, at this step.
    fn fault_at(&self, i: usize) -> Option<Fault> {
        self.shared
            .faults
            .iter()
            .find(|f| f.rank == self.rank && f.instr == i && f.step.is_none_or(|s| s == self.step_no + 1))
            .map(|f| f.fault)
    }

    /// What an injected fault does in place of its instruction.
    fn injected(&self, fault: Fault) -> Result<(), ExecError> {
        match fault {
            Fault::Stall => loop {
                if let Some(r) = self.abort.reason() {
                    break Err(ExecError::Aborted(r));
                }
                std::thread::sleep(Duration::from_millis(10));
            },
            Fault::Fail => Err(ExecError::Internal("injected failure".into())),
            Fault::OutOfMemory => Err(ExecError::Candle(candle_core::Error::Cuda(Box::new(
                InjectedOutOfMemory,
            )))),
        }
    }

    /// Stops every rank with instruction `i`'s failure `e`, unless `e` is that stop.
    fn report_failure(&self, i: usize, e: &ExecError) {
        if matches!(e, ExecError::Aborted(_)) {
            return;
        }
        let plan = &self.shared.plan;
        let what = shardplan_planner::print::describe(plan, &plan.programs[0].instrs[i]);
        let advice = if e.is_out_of_memory() {
            format!("\n{}", out_of_memory_advice(plan))
        } else {
            String::new()
        };
        self.abort.abort(format!(
            "step {}: rank {}: instruction #{i} `{what}` failed: {e}{advice}",
            self.step_no + 1,
            self.rank
        ));
    }
}
