"""Measured timeline: start/end of every instruction per rank, Chrome/Perfetto traces, utilization."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["Event", "Timeline", "chrome_trace", "utilization", "bubble_fraction", "gather_timelines"]

COMPUTE_KINDS = ("FWD", "BWD")


@dataclass(frozen=True, slots=True)
class Event:
    """One executed instruction: its text, kind, step, and wall-clock start/end in ns."""

    rank: int
    op: str
    kind: str
    step: int
    start_ns: int
    end_ns: int


@dataclass
class Timeline:
    """What one rank did; `enabled=False` records nothing (no cost)."""

    rank: int
    enabled: bool = True
    events: list[Event] = field(default_factory=list)

    def record(self, op: str, kind: str, step: int, start_ns: int, end_ns: int) -> None:
        """Add one finished instruction."""
        if self.enabled:
            self.events.append(Event(self.rank, op, kind, step, start_ns, end_ns))

    @staticmethod
    def now() -> int:
        """The clock events use (wall clock ns: comparable across processes of one machine)."""
        return time.time_ns()

    def clear(self) -> None:
        """Forget every event (e.g. after warm-up steps)."""
        self.events.clear()


def gather_timelines(timeline: Timeline, world: int, dst: int = 0) -> list[Event] | None:
    """Every rank's events on rank `dst` (collective over `world` ranks); None on the other ranks."""
    if world == 1:
        return list(timeline.events)
    records = [asdict(e) for e in timeline.events]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(records, gathered, dst=dst)
    if gathered is None:
        return None
    return [Event(**e) for part in gathered for e in part]


def chrome_trace(events: Iterable[Event], path: str | Path | None = None) -> dict:
    """A Chrome/Perfetto trace (one track per rank); written to `path` when given."""
    events = list(events)
    t0 = min((e.start_ns for e in events), default=0)
    trace = {"traceEvents": [
        {"name": e.op, "cat": e.kind, "ph": "X", "pid": 0, "tid": e.rank,
         "ts": (e.start_ns - t0) / 1e3, "dur": (e.end_ns - e.start_ns) / 1e3, "args": {"step": e.step}}
        for e in events
    ] + [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
         for r in sorted({e.rank for e in events})]}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


def _by_rank_step(events: Iterable[Event]) -> dict[int, dict[int, list[Event]]]:
    table: dict[int, dict[int, list[Event]]] = {}
    for e in events:
        table.setdefault(e.rank, {}).setdefault(e.step, []).append(e)
    return table


def utilization(events: Iterable[Event], kinds: Sequence[str] = COMPUTE_KINDS) -> dict[int, float]:
    """Per rank: time in `kinds` / the step span, summed over steps.

    The span of a step is the same for every rank: from the earliest start to the latest end
    of that step over all ranks, so waiting for peers counts as idle.
    """
    table = _by_rank_step(events)
    spans: dict[int, tuple[int, int]] = {}
    for steps in table.values():
        for step, evs in steps.items():
            lo, hi = spans.get(step, (min(e.start_ns for e in evs), max(e.end_ns for e in evs)))
            spans[step] = (min(lo, *(e.start_ns for e in evs)), max(hi, *(e.end_ns for e in evs)))
    total = sum(hi - lo for lo, hi in spans.values())
    return {rank: sum(e.end_ns - e.start_ns for evs in steps.values() for e in evs if e.kind in kinds) / total
            for rank, steps in sorted(table.items())}


def bubble_fraction(events: Iterable[Event]) -> dict[int, float]:
    """Per rank: 1 - utilization (the share of the step spent not computing FWD/BWD)."""
    return {rank: 1.0 - u for rank, u in utilization(events).items()}


def summarize(events: Iterable[Event]) -> Mapping[str, float]:
    """Mean duration in seconds per instruction kind."""
    sums: dict[str, list[float]] = {}
    for e in events:
        sums.setdefault(e.kind, []).append((e.end_ns - e.start_ns) / 1e9)
    return {k: sum(v) / len(v) for k, v in sums.items()}
