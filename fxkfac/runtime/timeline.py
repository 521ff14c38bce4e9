"""Measured timeline: every instruction per rank, gathered to rank 0, as a planner Timeline; utilization."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist

from fxkfac.planner.problem import Op
from fxkfac.planner.problem.step_timeline import Interval, Timeline
from fxkfac.planner.problem.step_timeline import utilization as simulated_utilization

__all__ = ["Event", "Recorder", "as_timeline", "utilization", "descheduled", "gather_timelines"]

PIPELINE_KINDS = ("FWD", "BWD")
"""What measured utilization counts: the pipeline's own work."""


@dataclass(frozen=True, slots=True)
class Event:
    """One executed instruction: its text, kind, step, wall-clock start/end in ns, how much of it was spent
    waiting for peers (a receive, a collective settled by its reader, a step-end sum), and the CPU time its
    thread took since the previous instruction ended (`cpu_ns`, the interpreter's microseconds between two included;
    below the wall time when the rank was preempted or blocked)."""

    rank: int
    op: str
    kind: str
    step: int
    start_ns: int
    end_ns: int
    wait_ns: int = 0
    cpu_ns: int = 0


@dataclass
class Recorder:
    """What one rank did, instruction by instruction; `enabled=False` records nothing (no cost)."""

    rank: int
    enabled: bool = True
    events: list[Event] = field(default_factory=list)

    def record(
        self, op: str, kind: str, step: int, start_ns: int, end_ns: int, wait_ns: int = 0, cpu_ns: int = 0
    ) -> None:
        """Add one finished instruction."""
        if self.enabled:
            self.events.append(Event(self.rank, op, kind, step, start_ns, end_ns, wait_ns, cpu_ns))

    @staticmethod
    def now() -> int:
        """The clock events use (wall clock ns: comparable across processes of one machine)."""
        return time.time_ns()

    @staticmethod
    def cpu_now() -> int:
        """This thread's CPU time in ns (what an op computed, apart from what other processes took of the cores)."""
        return time.thread_time_ns()

    def clear(self) -> None:
        """Forget every event (e.g. after warm-up steps)."""
        self.events.clear()


def gather_timelines(timeline: Recorder, world: int, dst: int = 0) -> list[Event] | None:
    """Every rank's events on rank `dst` (collective over `world` ranks); None on the other ranks."""
    if world == 1:
        return list(timeline.events)
    records = [asdict(e) for e in timeline.events]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(records, gathered, dst=dst)
    if gathered is None:
        return None
    return [Event(**e) for part in gathered for e in part]


def as_timeline(events: Iterable[Event]) -> Timeline:
    """Measured events as the planner's `Timeline` (seconds from the first start), so one view and one Chrome trace
    format (`fxkfac.show`) serve plans, simulations and runs."""
    events = list(events)
    t0 = min((e.start_ns for e in events), default=0)
    intervals = tuple(
        Interval(e.rank, e.step, Op.parse(e.op), (e.start_ns - t0) / 1e9, (e.end_ns - t0) / 1e9) for e in events
    )
    return Timeline(intervals, tuple(sorted({e.rank for e in events})), 1 + max((e.step for e in events), default=0))


def _by_rank_step(events: Iterable[Event]) -> dict[int, dict[int, list[Event]]]:
    table: dict[int, dict[int, list[Event]]] = {}
    for e in events:
        table.setdefault(e.rank, {}).setdefault(e.step, []).append(e)
    return table


def utilization(events: Iterable[Event], kinds: Sequence[str] = PIPELINE_KINDS) -> dict[int, float]:
    """Per rank: time in `kinds` / the step span, summed over steps.

    The span of a step is the same for every rank: from the earliest start to the latest end
    of that step over all ranks, so waiting for peers counts as idle.
    """
    table = _by_rank_step(events)
    total = _total_span(table)
    return {
        rank: simulated_utilization(
            sum(e.end_ns - e.start_ns for evs in steps.values() for e in evs if e.kind in kinds), total
        )
        for rank, steps in sorted(table.items())
    }


def _total_span(table: dict[int, dict[int, list[Event]]]) -> int:
    """The steps' spans summed, each from the earliest start to the latest end of that step over all ranks."""
    spans: dict[int, tuple[int, int]] = {}
    for steps in table.values():
        for step, evs in steps.items():
            lo, hi = spans.get(step, (min(e.start_ns for e in evs), max(e.end_ns for e in evs)))
            spans[step] = (min(lo, *(e.start_ns for e in evs)), max(hi, *(e.end_ns for e in evs)))
    return sum(hi - lo for lo, hi in spans.values())


def descheduled(events: Iterable[Event]) -> dict[int, float]:
    """Per rank: the part of the step spans (as `utilization`'s) its thread was neither running nor waiting for a
    peer, from each instruction's end to the next one's: wall time less CPU time (`Event.cpu_ns`, which counts the
    interpreter's time between two) less the transport's waits: the time other processes of the host took its
    core, or that a send blocked in gloo (whose threads need a core too); on a quiet host with cores to spare,
    near 0."""
    table = _by_rank_step(events)
    total = _total_span(table)
    lost: dict[int, int] = {}
    for rank, steps in table.items():
        for evs in steps.values():
            evs = sorted(evs, key=lambda e: e.start_ns)
            ends = [evs[0].start_ns] + [e.end_ns for e in evs[:-1]]
            lost[rank] = lost.get(rank, 0) + sum(
                max(0, e.end_ns - since - e.cpu_ns - e.wait_ns) for e, since in zip(evs, ends, strict=True)
            )
    return {rank: simulated_utilization(ns, total) for rank, ns in sorted(lost.items())}
