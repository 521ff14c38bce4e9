"""Event simulation of per-rank programs with op durations: the timeline, its step time and bubbles."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from fxkfac.planner.problem.errors import DeadlockError
from fxkfac.planner.problem.ir import (
    COLLECTIVE_KINDS,
    LAYER_SENDS,
    RECV_KINDS,
    SEND_KINDS,
    Op,
    OpKind,
    Program,
    as_programs,
)

__all__ = ["Interval", "Timeline", "simulate", "utilization", "COMPUTE_KINDS", "BUSY_KINDS", "SYNCHRONIZING_KINDS"]

COMPUTE_KINDS = frozenset(
    {OpKind.FWD, OpKind.BWD, OpKind.BWD_W, OpKind.STATS, OpKind.DECOMP, OpKind.APPLY, OpKind.OPT_STEP}
)
"""What counts as busy by default: work on the device, not waiting and not communication."""

BUSY_KINDS = COMPUTE_KINDS - {OpKind.OPT_STEP}
"""What a plan's utilization counts as busy, planned and measured: F/B and the preconditioner's own work."""

SYNCHRONIZING_KINDS = COLLECTIVE_KINDS | {OpKind.OPT_STEP}
"""Ops that start together on every rank holding them: the collectives, and OPT_STEP, which the runtime
runs with an all-reduce (KL-clip <P, G> and the non-finite flag) over the world, or over the rank's agreement
set under a barrier-free KL-clip scope (`simulate`'s `barrier`), so every step ends with a barrier."""

Duration = Callable[[int, Op], float]


def utilization(busy: float, span: float) -> float:
    """The fraction of device time spent busy: `busy` seconds (or ns) over the `span` of device time they lie in,
    0 for no device time. The one definition behind every utilization the planner, the views and the runtime give."""
    return busy / span if span > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Interval:
    """`op` of `step` ran on `rank` from `start` to `end` (a RECV's interval includes its wait)."""

    rank: int
    step: int
    op: Op
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Every op's interval; measures of the whole run and per rank."""

    intervals: tuple[Interval, ...]
    ranks: tuple[int, ...]
    steps: int

    @property
    def makespan(self) -> float:
        """End of the last op (the run starts at 0)."""
        return max((iv.end for iv in self.intervals), default=0.0)

    @property
    def step_time(self) -> float:
        """Steady-state period: start of the last step's first op on the lowest rank minus that of
        the step before; for steps=1 the makespan (one step of a flushed pipeline)."""
        if self.steps == 1:
            return self.makespan
        first: dict[int, float] = {}
        for iv in self.of_rank(self.ranks[0]):
            first.setdefault(iv.step, iv.start)
        return first[self.steps - 1] - first[self.steps - 2]

    def of_rank(self, rank: int) -> list[Interval]:
        """The rank's intervals in execution order."""
        return [iv for iv in self.intervals if iv.rank == rank]

    def busy(
        self, rank: int, kinds: Iterable[OpKind] = COMPUTE_KINDS, window: tuple[float, float] = (-math.inf, math.inf)
    ) -> float:
        """Total time the rank spends in ops of `kinds` inside `window` (start, end) (default: all of it)."""
        wanted, (start, end) = frozenset(kinds), window
        return sum(
            max(0.0, min(iv.end, end) - max(iv.start, start)) for iv in self.of_rank(rank) if iv.op.kind in wanted
        )

    def utilization(
        self,
        rank: int | None = None,
        kinds: Iterable[OpKind] = COMPUTE_KINDS,
        window: tuple[float, float] | None = None,
    ) -> float:
        """`utilization` of one rank, or of all ranks together when `rank` is None, over `window` (start, end)
        (default: the makespan)."""
        ranks = self.ranks if rank is None else (rank,)
        span = self.makespan if window is None else window[1] - window[0]
        clip = (-math.inf, math.inf) if window is None else window
        return utilization(sum(self.busy(r, kinds, clip) for r in ranks), span * len(ranks))

    def bubbles(self, rank: int, kinds: Iterable[OpKind] = COMPUTE_KINDS) -> list[tuple[float, float]]:
        """Idle gaps (start, end) of the rank within [0, makespan]: time in no op of `kinds`."""
        wanted = frozenset(kinds)
        gaps, cursor = [], 0.0
        for iv in sorted((iv for iv in self.of_rank(rank) if iv.op.kind in wanted), key=lambda iv: iv.start):
            if iv.start > cursor:
                gaps.append((cursor, iv.start))
            cursor = max(cursor, iv.end)
        if self.makespan > cursor:
            gaps.append((cursor, self.makespan))
        return gaps

    def bubble_time(self, rank: int, kinds: Iterable[OpKind] = COMPUTE_KINDS) -> float:
        """Total idle time of the rank (the sum of its bubbles)."""
        return sum(end - start for start, end in self.bubbles(rank, kinds))


_Slot = tuple[int, int]  # (rank, index into that rank's flat op list)


@dataclass
class _Flat:
    """Programs unrolled over the simulated steps, with occurrence counts for matching."""

    ops: dict[int, list[tuple[int, Op]]]
    occurrence: dict[_Slot, int]
    where: dict[tuple[int, Op, int], int]  # (rank, op, k) -> index of the k-th occurrence
    holders: dict[Op, list[int]]  # ranks whose programs contain the op, ascending


def _flatten(programs: Mapping[int, Program], steps: int) -> _Flat:
    ops: dict[int, list[tuple[int, Op]]] = {}
    occurrence: dict[_Slot, int] = {}
    where: dict[tuple[int, Op, int], int] = {}
    holders: dict[Op, set[int]] = defaultdict(set)
    for rank, program in programs.items():
        flat = [(j, op) for j in range(steps) for op in program[j % len(program)]]
        ops[rank] = flat
        seen: Counter[Op] = Counter()
        for i, (_, op) in enumerate(flat):
            occurrence[rank, i] = seen[op]
            where[rank, op, seen[op]] = i
            seen[op] += 1
            holders[op].add(rank)
    return _Flat(ops, occurrence, where, {op: sorted(r) for op, r in holders.items()})


def _producer(rank: int, op: Op, flat: _Flat, num_stages: Mapping[int, int]) -> Op | None:
    """The op whose result `op` consumes from another stage (inferred mode: no SEND/RECV ops)."""
    if op.kind is OpKind.FWD and op.stage:
        return Op(OpKind.FWD, op.stage - 1, op.mb, op.pipe)
    if op.kind is OpKind.BWD and op.stage is not None:
        if op.stage + 1 < num_stages[op.pipe]:
            return Op(OpKind.BWD, op.stage + 1, op.mb, op.pipe)
        return Op(OpKind.FWD, op.stage, op.mb, op.pipe)
    return None


def _producer_rank(rank: int, op: Op, producer: Op, flat: _Flat) -> int:
    """The producer's rank in the consumer's replica (same position among the holders)."""
    candidates = flat.holders.get(producer)
    if not candidates:
        raise DeadlockError(f"rank {rank}: {op} needs {producer}, which no rank's program runs")
    if len(candidates) == 1:
        return candidates[0]
    own = flat.holders[op]
    if len(own) != len(candidates):
        raise DeadlockError(
            f"rank {rank}: {op} cannot tell which copy of {producer} it needs "
            f"(held by ranks {candidates}); lower the programs with add_send_recv"
        )
    return candidates[own.index(rank)]


_LAYER_RECVS = {recv: send for send, recv in LAYER_SENDS.items()}


def _message_key(src: int, dst: int, op: Op) -> tuple:
    """Matches a SEND on src with the RECV on dst of the same tensor (by consumer stage; a streamed layer's by its
    stage and layer)."""
    if op.kind in LAYER_SENDS or op.kind in _LAYER_RECVS:
        return (src, dst, _LAYER_RECVS.get(op.kind, op.kind), op.stage, op.layer)
    if op.kind is OpKind.SEND_ACT:
        return (src, dst, "act", op.stage_id + 1, op.mb, op.pipe)
    if op.kind is OpKind.SEND_GRAD:
        return (src, dst, "grad", op.stage_id - 1, op.mb, op.pipe)
    return (src, dst, "act" if op.kind is OpKind.RECV_ACT else "grad", op.stage, op.mb, op.pipe)


def _sync_key(op: Op, rank: int, barrier: Mapping[int, tuple[int, ...]] | None) -> Hashable:
    """What the members of a synchronizing op share: the op, and for OPT_STEP under `barrier` the rank's agreement
    set (each set ends its steps apart from the others)."""
    return (op, barrier[rank]) if barrier is not None and op.kind is OpKind.OPT_STEP else op


class _Sim:
    """The state of one simulation: per-rank cursor and free time, finished ends, messages."""

    def __init__(
        self,
        flat: _Flat,
        duration: Duration,
        comm: float,
        barrier: Mapping[int, tuple[int, ...]] | None,
        lead: Duration | None,
    ) -> None:
        self.flat, self.duration, self.comm, self.lead = flat, duration, comm, lead
        self.explicit = any(op.kind in SEND_KINDS | RECV_KINDS for ops in flat.ops.values() for _, op in ops)
        self.num_stages: dict[int, int] = defaultdict(int)
        for ops in flat.ops.values():
            for _, op in ops:
                if op.stage is not None and op.kind in (OpKind.FWD, OpKind.BWD):
                    self.num_stages[op.pipe] = max(self.num_stages[op.pipe], op.stage + 1)
        self.pos = {r: 0 for r in flat.ops}
        self.free = {r: 0.0 for r in flat.ops}
        self.ends: dict[_Slot, float] = {}
        self.sent: dict[tuple, list[float]] = defaultdict(list)
        self.recv_count: Counter[tuple] = Counter()
        self.keys: dict[_Slot, Hashable] = {}
        members: dict[Hashable, set[int]] = defaultdict(set)
        for r, ops in flat.ops.items():
            for i, (_, op) in enumerate(ops):
                if op.kind in SYNCHRONIZING_KINDS:
                    self.keys[r, i] = _sync_key(op, r, barrier)  # every member runs the same op
                    members[self.keys[r, i]].add(r)
        self.groups = {key: sorted(ranks) for key, ranks in members.items()}
        self.intervals: list[Interval] = []

    def ready_time(self, rank: int, op: Op) -> tuple[float | None, str]:
        """When `op`'s inputs are there (None: not yet known) and, if unknown, what it waits for."""
        if op.kind in RECV_KINDS:
            key = _message_key(op.peer_rank, rank, op)
            arrivals = self.sent[key]
            n = self.recv_count[key]
            return (arrivals[n], "") if n < len(arrivals) else (None, f"a matching send on rank {op.peer}")
        if self.explicit:
            return 0.0, ""
        producer = _producer(rank, op, self.flat, self.num_stages)
        if producer is None:
            return 0.0, ""
        src = _producer_rank(rank, op, producer, self.flat)
        k = self.flat.occurrence[rank, self.pos[rank]]
        slot = (src, self.flat.where.get((src, producer, k), -1))
        if slot not in self.ends:
            return None, f"{producer} on rank {src}"
        return self.ends[slot] + (self.comm if src != rank else 0.0), ""

    def record(self, rank: int, start: float, end: float) -> None:
        step, op = self.flat.ops[rank][self.pos[rank]]
        self.intervals.append(Interval(rank, step, op, start, end))
        self.ends[rank, self.pos[rank]] = end
        self.free[rank] = end
        if op.kind in SEND_KINDS:
            early = self.lead(rank, op) if self.lead is not None else 0.0
            self.sent[_message_key(rank, op.peer_rank, op)].append(end + self.comm - early)
        if op.kind in RECV_KINDS:
            self.recv_count[_message_key(op.peer_rank, rank, op)] += 1
        self.pos[rank] += 1

    def try_collective(self, rank: int, op: Op) -> str:
        """Run the collective if every member stands at the same occurrence; else what it waits for."""
        key = self.keys[rank, self.pos[rank]]
        members = self.groups[key]
        k = self.flat.occurrence[rank, self.pos[rank]]
        waiting = [
            m for m in members if self.keys.get((m, self.pos[m])) != key or self.flat.occurrence[m, self.pos[m]] != k
        ]
        if waiting:
            return f"ranks {waiting} to reach it"
        start = max(self.free[m] for m in members)
        end = start + max(self.duration(m, self.flat.ops[m][self.pos[m]][1]) for m in members)
        for m in members:
            self.record(m, start, end)
        return ""

    def advance(self, rank: int) -> str:
        """Run the rank's ops as far as inputs allow; returns what blocks it ('' when done)."""
        while self.pos[rank] < len(self.flat.ops[rank]):
            step, op = self.flat.ops[rank][self.pos[rank]]
            if op.kind in SYNCHRONIZING_KINDS:
                blocked = self.try_collective(rank, op)
                if blocked:
                    return f"rank {rank}: {op} (step {step}) waits for {blocked}"
                continue
            ready, blocked = self.ready_time(rank, op)
            if ready is None:
                return f"rank {rank}: {op} (step {step}) waits for {blocked}"
            start = max(self.free[rank], ready if op.kind not in RECV_KINDS else 0.0)
            end = max(start, ready) + self.duration(rank, op)
            self.record(rank, start, end)
        return ""


def simulate(
    programs: Mapping[int, Sequence[Op]] | Mapping[int, Program],
    duration: Duration,
    *,
    steps: int = 1,
    comm: float = 0.0,
    barrier: Mapping[int, tuple[int, ...]] | None = None,
    lead: Duration | None = None,
) -> Timeline:
    """Run `programs` (per rank: one step's ops, or a period of steps) for `steps` steps.

    Each rank executes its ops in order; an op starts when the rank is free and its inputs are
    there. Without SEND/RECV ops, FWD waits for the previous stage's FWD of the same (mb, pipe)
    and BWD for the next stage's BWD (`comm` later when on another rank; with several copies the
    one in the same replica); a BWD_W waits only for its own BWD, earlier on its rank. With SEND/RECV ops,
    only RECVs wait: for the matching SEND's end
    plus `comm` (sends never block). Collectives (ALLREDUCE_GRAD, SYNC_STATS, BCAST) and OPT_STEP
    start together once every rank holding them reaches them (`SYNCHRONIZING_KINDS`: OPT_STEP is the
    runtime's end-of-step barrier) and last the longest `duration` of their members (the planner's
    callers price collectives with the cost table's comm model, `CostTable.collective_seconds`); other
    K-FAC ops follow program order. `barrier`: per rank, the ranks its OPT_STEP waits for (its agreement set;
    None: every rank holding OPT_STEP, a world barrier). `lead`: seconds before a SEND's start that its message
    leaves (a streamed send's: the part of the BWD before it that ran after the data was final).
    Step j runs the period's step j % period. Raises DeadlockError naming the blocked ops.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    sim = _Sim(_flatten(as_programs(programs), steps), duration, comm, barrier, lead)
    while True:
        before = len(sim.intervals)
        blocked = [msg for msg in (sim.advance(r) for r in sorted(sim.pos)) if msg]
        if not blocked:
            break
        if len(sim.intervals) == before:
            raise DeadlockError("programs deadlock:\n  " + "\n  ".join(blocked))
    intervals = tuple(sorted(sim.intervals, key=lambda iv: (iv.start, iv.rank)))
    return Timeline(intervals, tuple(sorted(sim.pos)), steps)
