#!/usr/bin/env python3
"""Dumps torch.distributed.pipelining's pipeline schedules as JSON (run by hand).

    python scripts/torch-pipeline-schedules.py [--schedule NAME] [--pp N] [--out FILE]

shardplan's pipeline schedules (planner/src/pipeline) must equal the ones torch generates;
this dump is what the parity tests compare against. It needs only torch (CPU is enough): no
process group is created, no model runs. Schedules are built from mock stages, as torch's own
schedule tests do.

Cases, in this order: schedule GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
ZBVZeroBubble, DualPipeV; then P (pipeline ranks) 2, 4, 8; then V (stages per rank): 1 for
GPipe and 1F1B, 1..4 for Interleaved1F1B, LoopedBFS and InterleavedZeroBubble, 1..3 for
ZBVZeroBubble and DualPipeV (only 2 is valid; 1 and 3 record torch's refusal); then M
(micro-batches), the distinct values of 1, P-1, P, 2P, 4P, 3P+1, 2P+1 in ascending order.
There are S = P*V stages. Rank r holds stages r, r+P, r+2P, ... ("loop"), except for
ZBVZeroBubble and DualPipeV, which use the V placement: chunk c of rank r is stage c*P + r
for even c and c*P + P-1-r for odd c (so r and 2P-1-r for V = 2).

Each case is one JSON object:

    schedule, pp, stages_per_rank, microbatches
    error       null, or "<ExceptionType>: <message>" when torch refuses the combination (its
                constructor or its lowering raised); a refused case has no other field
    compute     per rank (0..P-1), the compute-only order as torch's str() of each action
                ("0F0", "1B3", "2I1", "3W0", "(0F3;1B2)OVERLAP_F_B", "0REDUCE_GRAD"), a None
                (an idle step) written as "". Multi-stage schedules: `pipeline_order[rank]`.
                GPipe and 1F1B: `_get_pipeline_order()[rank]`, which includes REDUCE_GRAD and
                WAIT_REDUCE_GRAD, has no idle steps (torch's _add_reduce_grad drops them)
                and, for 1F1B, is wrong on the last rank (it starts at F1 and ends with F<M>,
                a micro-batch that does not exist); it is kept as torch returns it.
    executed    GPipe and 1F1B only (null otherwise): per rank, the compute actions that
                `_step_microbatches` really runs, in order ("0F0", "0B0"; stage = rank)
    lowered     per rank, the schedule lowered to communication actions. Multi-stage
                schedules: `pipeline_order_with_comms[rank]` as the constructor builds it
                with its defaults (max_active_stages=3, unshard_lookahead="full", no
                deferred receives or reduce-grad waits, no send budget). GPipe and 1F1B:
                the `executed` orders lowered by torch itself: a `_PipelineScheduleRuntime`
                over the rank-0 mock stage (P stages, stage s on rank s), with the same
                defaults, whose `_prepare_schedule_with_comms` is given `executed` (it runs
                _add_unshard_reshard, _add_reduce_grad, _add_send_recv, _add_wait_send).
    simulated   per rank, `_simulate_comms_compute` of `lowered` ("" for a step a rank
                waits), or null when it raised
    simulate_error  null, or "<ExceptionType>: <message>" of that simulation

`_simulate_comms_compute` knows no UNSHARD, RESHARD, REDUCE_GRAD or WAIT_REDUCE_GRAD (it
raises "Unsupported action type"), and every lowered schedule has REDUCE_GRAD. So when the
simulation of `lowered` raises, it runs again on `lowered` with those four kinds of action
left out, and `simulated` / `simulate_error` are that second run's. It cannot take
OVERLAP_F_B either (the compound action's stage_index is -1, so the stage-to-rank look-up
raises KeyError: -1), so DualPipeV's simulation fails even then.

The mock stage (MockStage) holds what the code paths used here read: stage_index,
num_stages, group_size, group_rank, is_first, is_last and submod (None, so no torch.compile
or FSDP check applies); the multi-stage constructors also write stage_index_to_group_rank
on it. For `executed`, its forward_one_chunk / backward_one_chunk record the action they
were called for, the get_{fwd,bwd}_{recv,send}_ops return no P2P ops, and
release_fwd_send_outputs / perform_reduce_grad do nothing. No loss function is given
(GPipe's and 1F1B's orders do not depend on it), and the schedule's `_initialize_stage`
(metadata inference and P2P set-up) is replaced by a no-op. The mock is checked against
torch on every run: GPipe's `executed` must equal its `compute` without the idle steps and
the REDUCE_GRAD / WAIT_REDUCE_GRAD entries, or the script stops.

Output: {"torch": torch.__version__, "cases": [...]} to stdout (or --out FILE), one case per
line; nothing else is written to stdout. All 400 cases take about 9 s on 2 cores.
"""
import argparse
import contextlib
import io
import json
import logging
import os
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
from torch.distributed.pipelining import schedules as torch_schedules  # noqa: E402
from torch.distributed.pipelining.schedules import (  # noqa: E402
    _Action,
    _ComputationType,
    _PipelineScheduleRuntime,
    _simulate_comms_compute,
)

SCHEDULE_CLASSES = {
    "GPipe": torch_schedules.ScheduleGPipe,
    "1F1B": torch_schedules.Schedule1F1B,
    "Interleaved1F1B": torch_schedules.ScheduleInterleaved1F1B,
    "LoopedBFS": torch_schedules.ScheduleLoopedBFS,
    "InterleavedZeroBubble": torch_schedules.ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": torch_schedules.ScheduleZBVZeroBubble,
    "DualPipeV": torch_schedules.ScheduleDualPipeV,
}
SINGLE_STAGE = ("GPipe", "1F1B")
V_PLACED = ("ZBVZeroBubble", "DualPipeV")
PP_SIZES = (2, 4, 8)

# The actions `_simulate_comms_compute` does not know (see the module docstring).
FSDP_ACTIONS = (
    _ComputationType.UNSHARD,
    _ComputationType.RESHARD,
    _ComputationType.REDUCE_GRAD,
    _ComputationType.WAIT_REDUCE_GRAD,
)


class MockStage:
    """Stands in for a `_PipelineStageBase`: what the schedules read, and a log of the
    forward/backward chunks a schedule runs on it."""

    def __init__(self, stage_index, num_stages, group_size, group_rank):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.calls = []

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        self.calls.append(_Action(self.stage_index, _ComputationType.FORWARD, fwd_chunk_id))

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        kind = _ComputationType.FULL_BACKWARD if full_backward else _ComputationType.BACKWARD_INPUT
        self.calls.append(_Action(self.stage_index, kind, bwd_chunk_id))

    def get_fwd_recv_ops(self, fwd_chunk_id):
        return []

    def get_fwd_send_ops(self, fwd_chunk_id):
        return []

    def get_bwd_recv_ops(self, bwd_chunk_id):
        return []

    def get_bwd_send_ops(self, bwd_chunk_id):
        return []

    def release_fwd_send_outputs(self, fwd_chunk_id):
        pass

    def perform_reduce_grad(self, grad_scale_factor):
        pass


class Refused(Exception):
    """torch refused a combination; carries the description of torch's exception."""


def describe(exc):
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def torch_refusals():
    """Turns an exception raised by torch into `Refused`. AttributeError and TypeError pass
    through: they mean the mock does not fit what torch calls, not a refusal."""
    try:
        yield
    except (AttributeError, TypeError):
        raise
    except Exception as exc:
        raise Refused(describe(exc)) from exc


def action_strings(actions):
    return ["" if a is None else str(a) for a in actions]


def per_rank_strings(order, pp):
    return [action_strings(order[rank]) for rank in range(pp)]


def stages_per_rank_options(schedule):
    if schedule in SINGLE_STAGE:
        return [1]
    if schedule in V_PLACED:
        return [1, 2, 3]
    return [1, 2, 3, 4]


def microbatch_options(pp):
    return sorted({m for m in (1, pp - 1, pp, 2 * pp, 4 * pp, 3 * pp + 1, 2 * pp + 1) if m > 0})


def stage_indices(schedule, rank, pp, v):
    """The stages rank `rank` holds: looped, or V-shaped for the V schedules."""
    if schedule in V_PLACED:
        return [c * pp + (rank if c % 2 == 0 else pp - 1 - rank) for c in range(v)]
    return [c * pp + rank for c in range(v)]


def mock_stages(schedule, rank, pp, v):
    return [MockStage(s, pp * v, pp, rank) for s in stage_indices(schedule, rank, pp, v)]


def executed_order(schedule, rank, pp, m):
    """The compute actions `_step_microbatches` runs on `rank` of a single-stage schedule."""
    stage = MockStage(rank, pp, pp, rank)
    sched = SCHEDULE_CLASSES[schedule](stage, m)
    sched._initialize_stage = lambda *args, **kwargs: None
    sched._step_microbatches()
    return stage.calls


def check_gpipe_mock(compute, executed):
    """GPipe runs exactly its pipeline_order; anything else means the mock is wrong."""
    for rank, (planned, ran) in enumerate(zip(compute, executed)):
        expected = [a for a in planned if a and not a.endswith("REDUCE_GRAD")]
        if expected != ran:
            sys.exit(f"mock check failed: GPipe rank {rank} ran {ran}, pipeline_order {expected}")


def single_stage_case(schedule, pp, m):
    """GPipe / 1F1B: torch's order, what runs on each rank, and torch's lowering of that."""
    with torch_refusals():
        sched = SCHEDULE_CLASSES[schedule](MockStage(0, pp, pp, 0), m)
    compute = per_rank_strings(sched._get_pipeline_order(), pp)
    executed = {rank: executed_order(schedule, rank, pp, m) for rank in range(pp)}
    with torch_refusals():
        runtime = _PipelineScheduleRuntime([MockStage(0, pp, pp, 0)], m)
        runtime._prepare_schedule_with_comms(executed)
    executed = per_rank_strings(executed, pp)
    if schedule == "GPipe":
        check_gpipe_mock(compute, executed)
    return runtime, {"compute": compute, "executed": executed}


def multi_stage_case(schedule, pp, v, m):
    """The multi-stage schedules compute and lower every rank's order in the constructor."""
    with torch_refusals():
        sched = SCHEDULE_CLASSES[schedule](mock_stages(schedule, 0, pp, v), m)
    return sched, {"compute": per_rank_strings(sched.pipeline_order, pp), "executed": None}


def simulate(runtime, pp):
    """`_simulate_comms_compute` of the lowered schedule; again without FSDP actions if it
    raised. Returns (simulated, simulate_error)."""
    lowered = runtime.pipeline_order_with_comms
    stage_to_rank = runtime.stage_index_to_group_rank.__getitem__
    num_stages = runtime._num_stages
    try:
        result = _simulate_comms_compute(lowered, stage_to_rank, num_stages)
    except Exception:
        without_fsdp = {
            rank: [a for a in actions if a.computation_type not in FSDP_ACTIONS]
            for rank, actions in lowered.items()
        }
        try:
            result = _simulate_comms_compute(without_fsdp, stage_to_rank, num_stages)
        except Exception as exc:
            return None, describe(exc)
    return per_rank_strings(result, pp), None


def run_case(schedule, pp, v, m):
    case = {"schedule": schedule, "pp": pp, "stages_per_rank": v, "microbatches": m}
    try:
        if schedule in SINGLE_STAGE:
            runtime, orders = single_stage_case(schedule, pp, m)
        else:
            runtime, orders = multi_stage_case(schedule, pp, v, m)
    except Refused as refusal:
        case["error"] = str(refusal)
        return case
    case["error"] = None
    case.update(orders)
    case["lowered"] = per_rank_strings(runtime.pipeline_order_with_comms, pp)
    case["simulated"], case["simulate_error"] = simulate(runtime, pp)
    return case


def all_cases(schedule_filter, pp_filter):
    schedules = [schedule_filter] if schedule_filter else list(SCHEDULE_CLASSES)
    pp_sizes = [pp_filter] if pp_filter else list(PP_SIZES)
    for schedule in schedules:
        for pp in pp_sizes:
            for v in stages_per_rank_options(schedule):
                for m in microbatch_options(pp):
                    yield run_case(schedule, pp, v, m)


def to_json(cases):
    """One case per line, so a dump diffs and greps by case."""
    lines = [json.dumps(case, separators=(",", ":")) for case in cases]
    body = ",\n".join(lines)
    return f'{{"torch":{json.dumps(torch.__version__)},"cases":[\n{body}\n]}}\n'


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=list(SCHEDULE_CLASSES), help="only this schedule")
    parser.add_argument("--pp", type=int, help="only this number of pipeline ranks")
    parser.add_argument("--out", help="write the JSON here instead of to stdout")
    args = parser.parse_args()
    if args.pp is not None and args.pp < 2:
        parser.error("--pp must be at least 2")

    logging.disable(logging.CRITICAL)
    # torch prints the partial schedule to stdout when a simulation stops progressing.
    with contextlib.redirect_stdout(io.StringIO()):
        cases = list(all_cases(args.schedule, args.pp))
    text = to_json(cases)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
