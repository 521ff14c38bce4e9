"""Event simulation of per-rank programs (`simulate`), a problem's simulated step (`step_timeline`: the reference
step, its collectives and bubbles), and its memory (held all step, activations in flight, peaks)."""

from __future__ import annotations

import math
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TypeVar

from fxkfac.planner.problem.buckets import send_buckets
from fxkfac.planner.problem.costs import StageCost
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
    cut_apply,
    piece_share,
)
from fxkfac.planner.problem.lowering import capture_stats, rank_programs, ready_fractions, step_applies, stream_step
from fxkfac.planner.problem.problem import (
    Problem,
    StageGroup,
    StepBarrier,
    agreement_set,
    stages_on_device,
    streamed_seconds,
    streamed_stats,
)
from fxkfac.planner.problem.schedules import ZERO_BUBBLE_KINDS, weight_gradient_kind
from fxkfac.planner.problem.strategy import LayerDistribution, holding, keeps_statistics

_FIXED_KINDS = frozenset({OpKind.FWD, OpKind.BWD, OpKind.BWD_W})
COMPUTE_KINDS = _FIXED_KINDS | {OpKind.STATS, OpKind.DECOMP, OpKind.APPLY, OpKind.OPT_STEP}
"""What counts as busy by default: work on the device, not waiting and not communication."""

BUSY_KINDS = COMPUTE_KINDS - {OpKind.OPT_STEP}
"""What a plan's utilization counts as busy, planned and measured: F/B and the preconditioner's own work."""
_NOT_BUBBLE = frozenset({OpKind.APPLY, OpKind.STATS, OpKind.BCAST_PREC, OpKind.ALLREDUCE_GRAD})
"""Ops besides F/B during which a window places no preconditioner work (planner/plan/window.py)."""

SYNCHRONIZING_KINDS = COLLECTIVE_KINDS | {OpKind.OPT_STEP}
"""Ops that start together on every rank holding them: the collectives, and OPT_STEP, whose all-reduce (KL-clip,
non-finite flag) over the world or the rank's agreement set (`simulate`'s `barrier`) ends every step."""

Duration = Callable[[int, Op], float]
Buckets = Mapping[tuple[int, Op], frozenset[Op]]
"""The SENDs of each (rank, SEND) that travel as one message."""


def utilization(busy: float, span: float) -> float:
    """`busy` over the `span` it lies in (0 for none): every utilization the planner, views and runtime give."""
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
    """Every op's interval (of a simulation, a plan's view or a measured run) and their measures, whole or per rank."""

    intervals: tuple[Interval, ...]
    ranks: tuple[int, ...]
    steps: int

    @cached_property
    def length(self) -> float:
        """End of the last op (the run starts at 0): one step's step time."""
        return max((iv.end for iv in self.intervals), default=0.0)

    @cached_property
    def ops(self) -> Mapping[int, tuple[tuple[Op, float, float], ...]]:
        """Per rank, (op, start, end) of each op in execution order."""
        out: dict[int, list[tuple[Op, float, float]]] = {r: [] for r in self.ranks}
        for iv in self.intervals:
            out[iv.rank].append((iv.op, iv.start, iv.end))
        return {r: tuple(items) for r, items in out.items()}

    @cached_property
    def allreduce_end(self) -> dict[tuple[int, int], float]:
        """(rank, stage) -> the end of ALLREDUCE_GRAD(stage) on the rank."""
        ends = ((iv.rank, iv.op, iv.end) for iv in self.intervals)
        return {(d, op.stage_id): end for d, op, end in ends if op.kind is OpKind.ALLREDUCE_GRAD}

    def fixed(self, rank: int) -> list[tuple[Op, float, float]]:
        """The rank's F/B ops with their times."""
        return [item for item in self.ops[rank] if item[0].kind in _FIXED_KINDS]

    def end_of(self, rank: int, op: Op) -> float:
        """End time of `op` on `rank` (AssertionError when absent)."""
        for item, _, end in self.ops[rank]:
            if item == op:
                return end
        raise AssertionError(f"{op} is not on rank {rank}")

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
        """`utilization` of one rank (None: all) over `window` (default: the length)."""
        ranks = self.ranks if rank is None else (rank,)
        span, clip = (self.length, (-math.inf, math.inf)) if window is None else (window[1] - window[0], window)
        return utilization(sum(self.busy(r, kinds, clip) for r in ranks), span * len(ranks))

    def bubbles(self, rank: int, kinds: Iterable[OpKind] = COMPUTE_KINDS) -> list[tuple[float, float]]:
        """Idle gaps (start, end) of the rank within [0, length]: time in no op of `kinds`."""
        wanted = frozenset(kinds)
        gaps, cursor = [], 0.0
        for iv in sorted((iv for iv in self.of_rank(rank) if iv.op.kind in wanted), key=lambda iv: iv.start):
            if iv.start > cursor:
                gaps.append((cursor, iv.start))
            cursor = max(cursor, iv.end)
        if self.length > cursor:
            gaps.append((cursor, self.length))
        return gaps


_MESSAGES = {
    OpKind.SEND_ACT: (OpKind.RECV_ACT, 1),
    OpKind.SEND_GRAD: (OpKind.RECV_GRAD, -1),
    **{send: (recv, 0) for send, recv in LAYER_SENDS.items()},
    **{recv: (recv, 0) for recv in RECV_KINDS},
}
"""Per transfer kind: the receive that takes its message, and the offset from its stage to the receiver's."""


def _message_key(src: int, dst: int, op: Op) -> tuple:
    """Matches a SEND on src with the RECV on dst of the same tensor (a streamed layer's by stage and layer)."""
    recv, offset = _MESSAGES[op.kind]
    return (src, dst, recv, op.stage_id + offset, op.mb, op.pipe, op.layer)


def simulate(
    programs: Mapping[int, Sequence[Op]] | Mapping[int, Program],
    duration: Duration,
    *,
    steps: int = 1,
    comm: float = 0.0,
    barrier: Mapping[int, tuple[int, ...]] | None = None,
    lead: Duration | None = None,
    link: Duration | None = None,
    buckets: Buckets | None = None,
) -> Timeline:
    """Run lowered `programs` (per rank a step or a period) `steps` steps, each op once its rank is free and its inputs
    are there: a RECV its message (`comm` later, `lead` s early, a streamed one `link` s on its connection, `buckets`
    sent as one); `SYNCHRONIZING_KINDS` together (OPT_STEP over `barrier`, None: all). DeadlockError when stuck."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    ops = {r: [(j, op) for j in range(steps) for op in p[j % len(p)]] for r, p in as_programs(programs).items()}
    if not any(op.kind in SEND_KINDS for items in ops.values() for _, op in items):  # `simulate` waits for messages
        rank_of = {(op.stage, op.pipe): r for r, items in ops.items() for _, op in items if op.kind is OpKind.FWD}
        if any(s is not None and rank_of.get((s + 1, p), r) != r for (s, p), r in rank_of.items()):
            raise ValueError(
                "the programs pass activations between ranks without SEND/RECV: lower them (add_send_recv)"
            )
    keys: dict[tuple[int, int], tuple[Hashable, int]] = {}  # (rank, index) of a synchronizing op: group, occurrence
    members: dict[Hashable, set[int]] = defaultdict(set)
    for r, items in ops.items():
        seen: Counter[Hashable] = Counter()
        for i, (_, op) in enumerate(items):
            if op.kind in SYNCHRONIZING_KINDS:  # every member runs the same op, OPT_STEP of one agreement set
                group = (op, barrier[r]) if barrier is not None and op.kind is OpKind.OPT_STEP else op
                keys[r, i] = (group, seen[group])
                seen[group] += 1
                members[group].add(r)
    groups = {key: sorted(ranks) for key, ranks in members.items()}
    pos, free = dict.fromkeys(ops, 0), dict.fromkeys(ops, 0.0)
    sent: dict[tuple, deque[float]] = defaultdict(deque)  # arrivals of each message not yet received
    filling: dict[tuple[int, frozenset[Op]], list[tuple[tuple, float]]] = {}  # a bucket's messages posted so far
    link_free: dict[tuple[int, int], float] = {}
    intervals: list[Interval] = []

    def record(rank: int, start: float, end: float) -> None:
        """Run the rank's next op from `start` to `end`; a SEND posts its message (a bucket's all leave together with
        the last one's, a streamed one then holds its connection under `link` after those queued on it)."""
        step, op = ops[rank][pos[rank]]
        intervals.append(Interval(rank, step, op, start, end))
        free[rank] = end
        pos[rank] += 1
        if op.kind not in SEND_KINDS:
            return
        together = (buckets or {}).get((rank, op), frozenset({op}))
        posted = filling.setdefault((rank, together), [])
        posted.append((_message_key(rank, op.peer_rank, op), end + comm - (lead(rank, op) if lead else 0.0)))
        if len(posted) < len(together):
            return
        del filling[rank, together]
        arrival = max(depart for _, depart in posted)
        if link is not None and op.kind in LAYER_SENDS:
            pair = (rank, op.peer_rank)
            link_free[pair] = max(arrival, link_free.get(pair, arrival)) + link(rank, op)
            arrival = link_free[pair]
        for key, _ in posted:
            sent[key].append(arrival)

    def advance(rank: int) -> str:
        """Run the rank's ops as far as inputs allow (a collective once every member stands at the same occurrence,
        a RECV once its message is sent, its interval including the wait); returns what blocks it ('' when done)."""
        while pos[rank] < len(ops[rank]):
            step, op = ops[rank][pos[rank]]
            start = free[rank]
            if op.kind in SYNCHRONIZING_KINDS:
                key = keys[rank, pos[rank]]
                together = groups[key[0]]
                waiting = [m for m in together if keys.get((m, pos[m])) != key]
                if waiting:
                    return f"rank {rank}: {op} (step {step}) waits for ranks {waiting} to reach it"
                start = max(free[m] for m in together)
                end = start + max(duration(m, ops[m][pos[m]][1]) for m in together)
                for m in together:
                    record(m, start, end)
            elif op.kind in RECV_KINDS:
                arrivals = sent[_message_key(op.peer_rank, rank, op)]
                if not arrivals:
                    return f"rank {rank}: {op} (step {step}) waits for a matching send on rank {op.peer}"
                record(rank, start, max(start, arrivals.popleft()) + duration(rank, op))
            else:
                record(rank, start, start + duration(rank, op))
        return ""

    while True:
        before = len(intervals)
        blocked = [msg for msg in (advance(r) for r in sorted(pos)) if msg]
        if not blocked:
            break
        if len(intervals) == before:
            raise DeadlockError("programs deadlock:\n  " + "\n  ".join(blocked))
    return Timeline(tuple(sorted(intervals, key=lambda iv: (iv.start, iv.rank))), tuple(sorted(pos)), steps)


@lru_cache(maxsize=64)
def base_programs(problem: Problem) -> dict[int, list[Op]]:
    """Per global rank, one step of the plain pipeline with its transfers and collectives."""
    return rank_programs(problem.kind, problem.D, problem.N, problem.W, problem.v)


def gradient_stats(stage: StageCost, index: int) -> list[tuple[Op, float]]:
    """The STATS ops (with their seconds) of stage `index`'s gradient-fed parts, in the order every step runs them."""
    return [
        (Op(OpKind.STATS, index, layer=x.name, part=p.part), p.stats)
        for x in stage.layers
        for p in x.parts
        if p.after is OpKind.ALLREDUCE_GRAD
    ]


def prec_work(problem: Problem, device: int, stage: int) -> list[tuple[Op, float]]:
    """The per-step preconditioner work of `stage` on `device` with seconds: gradient STATS, APPLYs, BCAST_PRECs."""
    copies, cost = problem.holders[stage], problem.costs.stages[stage]
    work = [
        (op, secs)
        for op, secs in gradient_stats(cost, stage)
        if op.layer is not None and device in problem.workers(op.layer) and not streamed_stats(problem, op.layer)
    ]
    names, streaming, pieces = [x.name for x in cost.layers], problem.streaming, problem.apply_pieces
    shares: list[Op] = []
    if streaming is not None and streaming.stage == stage:  # the helper applies the streamed layers
        kept = [Op(OpKind.APPLY, stage, layer=n) for n in names if n not in streaming.layers]
        applies = [piece for op in kept for piece in cut_apply(op, pieces)]
    else:
        applies, shares = step_applies(device, stage, names, copies, dict(problem.distributions), pieces=pieces)
    work += [(op, cost.prec if op.layer is None else apply_seconds(problem, op)) for op in applies]
    return work + [(op, problem.costs.collective_seconds(op, len(op.group or copies))) for op in shares]


def apply_seconds(problem: Problem, op: Op) -> float:
    """Seconds of one layer's APPLY, or of its piece (`planner.problem.ir.piece_share`)."""
    return problem.costs.layer(op.layer_name).prec * piece_share(op.piece)


@lru_cache(maxsize=64)
def reference_programs(problem: Problem) -> dict[int, list[Op]]:
    """The base programs with each stage's `prec_work` right after its ALLREDUCE_GRAD: the paper's K-FAC step."""
    out = {}
    for rank, ops in base_programs(problem).items():
        body: list[Op] = []
        for op in ops:
            body.append(op)
            if op.kind is OpKind.ALLREDUCE_GRAD:
                body += [work for work, _ in prec_work(problem, rank, op.stage_id)]
        out[rank] = body
    if problem.streaming is not None:
        out = stream_step(out, problem.streaming, problem.stream_owners, problem.apply_pieces)
    return out


@dataclass(frozen=True)
class StageComm:
    """Seconds of one stage's collectives over its `group` copies: ALLREDUCE_GRAD and BCAST_PREC (`share`) every step,
    SYNC_STATS and BCAST every refresh."""

    group: int
    allreduce: float
    sync: float
    bcast: float
    share: float = 0.0

    def per_step(self, period: int) -> float:
        """Seconds of collectives per step when the stage refreshes every `period` steps."""
        return self.allreduce + self.share + (self.sync + self.bcast) / period


def stage_comm(problem: Problem, stage: int) -> StageComm:
    """The collectives of `stage` priced as the step timeline and the window price them."""
    copies = problem.holders[stage]
    if len(copies) == 1:
        return StageComm(1, 0.0, 0.0, 0.0)
    price = problem.costs.collective_seconds
    sync = bcast = 0.0
    for x in problem.costs.stages[stage].layers:
        workers, local = problem.workers(x.name), problem.where(x.name).strategy.local_factors
        for p in x.parts:
            if p.after is not OpKind.ALLREDUCE_GRAD and not local:
                sync += price(Op(OpKind.SYNC_STATS, stage, layer=x.name, part=p.part), len(copies))
            if len(workers) > 1:
                bcast += price(Op(OpKind.BCAST, stage, layer=x.name, part=p.part, root=workers[0]), len(workers))
    share = max(sum(secs for op, secs in prec_work(problem, d, stage) if op.kind is OpKind.BCAST_PREC) for d in copies)
    return StageComm(len(copies), price(Op(OpKind.ALLREDUCE_GRAD, stage), len(copies)), sync, bcast, share)


def _duration(problem: Problem, fused: frozenset[str], refresh: bool, buckets: Buckets) -> Duration:
    """Op seconds of the reference programs: F/B (a refresh step's with taps and fused curvature, a recomputing BWD with
    its FWD, a split BWD less its W), collectives, `prec_work`, streamed APPLYs and transfers' CPU (over `buckets`)."""
    split = problem.kind in ZERO_BUBBLE_KINDS
    by_stage: dict[tuple[OpKind, int | None], float] = {}  # F, B, W and the gradients' all-reduce by stage
    for i, s in enumerate(problem.costs.stages):
        late = s.fused_curvature(fused, OpKind.BWD)  # the output-gradient curvature, with the W where one splits off
        fwd = s.fwd + (s.tap_fwd if refresh else 0.0) + s.fused_curvature(fused, OpKind.FWD)
        bwd = s.bwd + (s.tap_bwd if refresh else 0.0) + (-s.weight_grad if split else late)
        by_stage[OpKind.FWD, i], by_stage[OpKind.BWD_W, i] = fwd, s.weight_grad + late if split else 0.0
        by_stage[OpKind.BWD, i] = bwd + (fwd if problem.recomputes(i) else 0.0)  # recomputing: the forward again
        allreduce = Op(OpKind.ALLREDUCE_GRAD, i)
        by_stage[OpKind.ALLREDUCE_GRAD, i] = problem.costs.collective_seconds(allreduce, len(problem.holders[i]))
    per_step = {
        (d, op): secs
        for d in problem.devices
        for s in stages_on_device(problem, d)
        for op, secs in prec_work(problem, d, s)
    }

    def duration(rank: int, op: Op) -> float:
        if (op.kind, op.stage) in by_stage:
            return by_stage[op.kind, op.stage]
        if (rank, op) in per_step:
            return per_step[rank, op]
        if op.kind is OpKind.APPLY:
            return streamed_seconds(problem, op)
        if op.kind in STREAMED_TRANSFERS:  # the owner's hand-off; either end's CPU of the message
            layer = problem.costs.layer(op.layer_name)
            own = {OpKind.SEND_LGRAD: layer.hand_off, OpKind.RECV_PGRAD: layer.take_back}.get(op.kind, 0.0)
            send = (rank, op)
            if op.kind not in LAYER_SENDS:  # a RECV: the SEND on its peer whose message it takes
                send = (op.peer_rank, Op(_SENT_AS[op.kind], op.stage_id, peer=rank, layer=op.layer))
            return own + problem.costs.message_cpu(op, len(buckets.get(send, (op,))))
        return 0.0

    return duration


_SENT_AS = {recv: send for send, recv in LAYER_SENDS.items()}
STREAMED_TRANSFERS = frozenset({OpKind.SEND_LGRAD, OpKind.RECV_LGRAD, OpKind.SEND_PGRAD, OpKind.RECV_PGRAD})
"""A streamed unit's per-step transfers (a REPLICA's, once a refresh, are not priced on either end's CPU)."""


def stream_timing(problem: Problem, duration: Duration, buckets: Buckets) -> tuple[Duration | None, Duration | None]:
    """`simulate`'s (lead, link) of streamed transfers: a gradient leaves when the backward (or W) makes it final
    (`ready`); a message (a bucket's once) holds its connection its seconds."""
    streaming = problem.streaming
    if streaming is None:
        return None, None
    stage = problem.costs.stages[streaming.stage]  # `Streaming.whole_backward`: every gradient final at its end
    fractions = (
        dict.fromkeys((x.name for x in stage.layers), 1.0) if streaming.whole_backward else ready_fractions(stage)
    )
    made_by = weight_gradient_kind(problem.kind)  # the op whose end makes the gradients: a zero-bubble one's W
    bwd, fwd = Op(made_by, streaming.stage, 0), Op(OpKind.FWD, streaming.stage, 0)
    again = made_by is OpKind.BWD and problem.recomputes(streaming.stage)  # the recomputed forward runs first

    def lead(rank: int, op: Op) -> float:
        if op.kind is not OpKind.SEND_LGRAD:
            return 0.0
        return (1.0 - fractions[op.layer_name]) * (duration(rank, bwd) - (duration(rank, fwd) if again else 0.0))

    def link(rank: int, op: Op) -> float:
        together = buckets.get((rank, op))
        return problem.costs.collective_seconds(op, 2) if together is None else problem.costs.bucket_seconds(together)

    return lead, link


def problem_buckets(problem: Problem, programs: Mapping[int, Sequence[Sequence[Op]]]) -> Buckets:
    """The streamed SENDs of `programs` that travel together, as the runtime cuts them (`send_buckets`)."""
    if problem.streaming is None:
        return {}
    return send_buckets(programs, problem.costs.layers, problem.costs.family)


@lru_cache(maxsize=256)
def step_timeline(
    problem: Problem, fused: frozenset[str] = frozenset(), with_prec: bool = True, *, refresh: bool = False
) -> Timeline:
    """One simulated step (plain or with the per-step work; `refresh`: a refresh step, F/B with taps and the fused
    layers' curvature): the step a steady run repeats (under agreement sets only where `steps_overlap` is False)."""
    programs = reference_programs(problem) if with_prec else base_programs(problem)
    buckets = problem_buckets(problem, as_programs(programs))
    duration = _duration(problem, fused, refresh, buckets)
    lead, link = stream_timing(problem, duration, buckets)
    return simulate(programs, duration, steps=1, lead=lead, link=link, buckets=buckets)


def plain_step_time(problem: Problem) -> float:
    """T0: the step time of the plain pipeline (no K-FAC)."""
    return step_timeline(problem, frozenset(), False).length


def plain_utilization(problem: Problem) -> float:
    """The plain pipeline's utilization (no K-FAC): its F/B over every device's step."""
    return step_timeline(problem, frozenset(), False).utilization(kinds=_FIXED_KINDS)


@lru_cache(maxsize=64)
def steps_overlap(problem: Problem) -> bool:
    """Whether, each OPT_STEP synchronizing its agreement set alone, some op of 3 simulated steps ends off the
    one-step timeline repeated; the window then keeps the world barrier's step."""
    if problem.barrier is StepBarrier.WORLD:
        return False
    programs = reference_programs(problem)
    barrier = {d: agreement_set(problem, d) for d in problem.devices}
    buckets = problem_buckets(problem, as_programs(programs))
    for fused, refresh in ((frozenset(), False), (frozenset(problem.costs.layer_names), True)):
        one = step_timeline(problem, fused, refresh=refresh)
        run = simulate(programs, _duration(problem, fused, refresh, buckets), steps=3, barrier=barrier)
        for d, items in run.ops.items():  # each rank's ops in execution order, step by step
            due = [j * one.length + end for j in range(3) for _, _, end in one.ops[d]]
            for (op, _, end), want in zip(items, due, strict=True):
                if op.kind is not OpKind.OPT_STEP and abs(end - want) > 1e-9 * one.length:
                    return True
    return False


Time = TypeVar("Time", int, float)


def window_length(refresh: Time, normal: Time, stretch: Time, k: int) -> Time:
    """The length of a window of k steps, the first `refresh` long, the others `normal`, each then `stretch` idle."""
    return refresh + (k - 1) * normal + k * stretch


def step_begins(refresh: Time, normal: Time, stretch: Time, j: int, k: int) -> Time:
    """Where window step j (j >= k: a later window's) begins after step 0 starts, before any lead: the one step
    start of the window, the plan's view and the validator."""
    within = j % k
    start = 0 if within == 0 else refresh + (within - 1) * normal
    return start + within * stretch + window_length(refresh, normal, stretch, k) * (j // k)


def early_start(problem: Problem, step: Timeline, devices: Iterable[int]) -> float:
    """Seconds before the end of `step` at which the next may begin on `devices` (an agreement set): once each has
    run its fixed work and per-step slots; 0 under `StepBarrier.WORLD` or where steps overlap."""
    if problem.barrier is StepBarrier.WORLD or steps_overlap(problem):
        return 0.0
    last = max(
        (
            max((end for op, _, end in step.ops[d] if op.kind not in _SLOT_KINDS), default=0.0)
            + sum(slot_seconds(problem, d, s) for s in stages_on_device(problem, d))
        )
        for d in devices
    )
    return max(0.0, step.length - last)


_SLOT_KINDS = frozenset({OpKind.APPLY, OpKind.STATS, OpKind.BCAST_PREC, OpKind.OPT_STEP})
"""Ops of a step's end that are no fixed work (the per-step slot, which a plan places, and OPT_STEP)."""


def slot_seconds(problem: Problem, device: int, stage: int) -> float:
    """Seconds of `stage`'s per-step slot on `device`, its BCAST_PRECs after the longest work before them on a copy."""
    work = prec_work(problem, device, stage)
    shares = [secs for op, secs in work if op.kind is OpKind.BCAST_PREC]
    if not shares:
        return sum(secs for _, secs in work)
    before = max(
        sum(secs for op, secs in prec_work(problem, c, stage) if op.kind is not OpKind.BCAST_PREC)
        for c in problem.holders[stage]
    )
    return before + sum(shares)


def stream_start(problem: Problem, step: Timeline) -> float:
    """When the first streamed-stage owner starts its last backward (or W): a streamed refresh's deadline."""
    assert problem.streaming is not None, "only a streaming problem has a streamed stage"
    s = problem.streaming.stage
    return min(
        max(a for op, a, _ in step.ops[owner] if op.kind in (OpKind.BWD, OpKind.BWD_W) and op.stage == s)
        for owner in problem.stream_owners
    )


def tap_extra(problem: Problem) -> float:
    """Seconds the refresh step's taps add to a step (not counted against max_overhead)."""
    return step_timeline(problem, refresh=True).length - step_timeline(problem).length


def fused_stats(problem: Problem, fused: frozenset[str], rank: int, bwd: Op) -> list[Op]:
    """The STATS a refresh step runs right after `bwd` (or W) on `rank` for the `fused` layers (timed in F/B)."""
    parts = {
        x.name: [p.part for p in x.parts if p.after is not OpKind.ALLREDUCE_GRAD]
        for x in problem.costs.stages[bwd.stage_id].layers
        if x.name in fused and w_makes(bwd, x.name)
    }
    return capture_stats(bwd, rank, parts, problem.holders[bwd.stage_id], dict(problem.distributions))


def fused_extra(problem: Problem, fused: frozenset[str]) -> float:
    """Seconds the `fused` layers' curvature adds to the refresh step: what fusing costs, against max_overhead."""
    return step_timeline(problem, fused, refresh=True).length - step_timeline(problem, refresh=True).length


def stretch_allowance(problem: Problem, fused: frozenset[str], k: int) -> float:
    """Idle seconds the planner may append to every step at period k: max_overhead less fused curvature per step."""
    normal = step_timeline(problem).length
    return max(0.0, problem.max_overhead * normal - fused_extra(problem, fused) / k)


def refresh_lower_bound(
    problem: Problem, group: StageGroup, fused: frozenset[str] = frozenset(), stretch: bool = False
) -> int:
    """ceil(refresh work / bubble per step) of the group (`group_load`); `stretch`: counting the allowed stretch."""
    work, bubble = group_load(problem, group, fused)
    if work <= 0:
        return 1
    if stretch:
        for k in range(1, problem.max_period + 1):
            if work <= k * (bubble + len(group.devices) * stretch_allowance(problem, fused, k)) * (1 + 1e-9):
                return k
        return problem.max_period + 1
    if bubble <= 1e-9 * step_timeline(problem, fused).length * len(group.devices):  # none but float rounding
        return problem.max_period + 1
    return min(problem.max_period + 1, max(1, math.ceil(work / bubble - 1e-9)))


def group_load(problem: Problem, group: StageGroup, fused: frozenset[str] = frozenset()) -> tuple[float, float]:
    """(seconds of one refresh's unfused curvature and decompositions, seconds of bubble per step) of the group."""
    step = step_timeline(problem, fused)
    work = 0.0
    for device in group.devices:
        for op, _, _ in step.fixed(device):
            copies = problem.holders[op.stage_id]
            work += sum(
                p.stats
                for x in problem.costs.stages[op.stage_id].layers
                if x.name not in fused and keeps_statistics(device, copies, problem.where(x.name))
                for p in x.parts
                if p.after is op.kind
            )
    work += sum(problem.costs.stages[s].inv for s in group.stages)
    busy = sum(
        end - start
        for d in group.devices
        for op, start, end in step.ops[d]
        if op.kind in _FIXED_KINDS or op.kind in _NOT_BUBBLE
    )
    return work, step.length * len(group.devices) - busy


def static_bytes(problem: Problem, device: int) -> int:
    """Memory held all step on `device` (an upper bound): parameters and gradients, each kept layer's `held_bytes`,
    the largest BCAST_PREC buffer and backward error peak, and streaming's buffers."""
    stages = stages_on_device(problem, device)
    total = shared = 0
    for s in stages:
        cost = problem.costs.stages[s]
        total += 2 * cost.param_bytes
        for x in cost.layers:
            kept, buffer = held_bytes(problem, device, x.name, problem.where(x.name))
            total += kept
            shared = max(shared, buffer)
    peak_err = max((problem.costs.stages[s].peak_err_bytes for s in stages), default=0)
    return total + shared + peak_err + _streamed_bytes(problem, device)


def held_bytes(problem: Problem, device: int, layer: str, where: LayerDistribution) -> tuple[int, int]:
    """(bytes `device` keeps of `layer` under `where`: statistics, two decompositions, state; its BCAST_PREC buffer)."""
    x = problem.costs.layer(layer)
    copies = problem.holders[problem.costs.stage_of(layer)]
    held = holding(device, copies, where, all(p.after is OpKind.ALLREDUCE_GRAD for p in x.parts))
    kept = x.factor_bytes * (held.statistics + 2 * held.decompositions) + x.state_bytes * held.decompositions
    return kept, x.gradient_bytes * held.shares_gradient


def _streamed_bytes(problem: Problem, device: int) -> int:
    """Streaming's buffers: an owner's results; a helper's gradients, sum, decompositions and folded state."""
    streaming = problem.streaming
    if streaming is None:
        return 0
    if device in problem.stream_owners:
        return sum(problem.costs.layer(n).gradient_bytes for n in streaming.layers)
    layers = [problem.costs.layer(n) for n in streaming.layers_of(device)]
    gradients = sum(x.gradient_bytes for x in layers)
    kept = sum(x.factor_bytes + x.state_bytes for x in layers if streamed_stats(problem, x.name))
    return (len(problem.stream_owners) + 1) * gradients + 2 * sum(x.factor_bytes for x in layers) + kept


def decomposition_bytes(problem: Problem, device: int, layer: str) -> int:
    """Bytes of one decomposition of `layer` on `device` (as large as its statistics), 0 where it keeps none."""
    return problem.costs.layer(layer).factor_bytes if device in problem.workers(layer) else 0


def activation_intervals(
    problem: Problem, device: int, step: Timeline, w_operands: bool = True
) -> list[tuple[float, float, int]]:
    """(start, end, bytes) of each micro-batch's activations on `device`, F start to B end (a recomputing stage's
    boundary so, its activations over its B), and a deferred W's operands from its B to it (`w_operands`)."""
    since: dict[tuple[int | None, int | None, int], float] = {}  # a micro-batch's F start, then its B end
    out = []
    for op, start, end in step.ops[device]:
        key = (op.stage, op.mb, op.pipe)
        if op.kind is OpKind.FWD:
            since[key] = start
        elif op.kind is OpKind.BWD_W and w_operands:
            out.append((since[key], end, w_operand_bytes(problem.costs.stages[op.stage_id], op.layer)))
        elif op.kind is OpKind.BWD:
            cost = problem.costs.stages[op.stage_id]
            if problem.recomputes(op.stage_id):
                out += [(since[key], end, cost.boundary_bytes), (start, end, cost.act_bytes)]
            else:
                out.append((since[key], end, cost.act_bytes))
            since[key] = end
    return out


def w_operand_bytes(stage: StageCost, layer: str | None = None) -> int:
    """Bytes one micro-batch's deferred W (of `layer` alone, [Note: per-layer W]) keeps: its layers' captures, or
    where they capture none the activations (`w_share` of them)."""
    captured = {
        x.name: sum(p.capture_bytes for p in x.parts if p.after is not OpKind.ALLREDUCE_GRAD) for x in stage.layers
    }
    if not sum(captured.values()):
        return stage.act_bytes if layer is None else round(stage.act_bytes * w_share(stage, layer))
    return sum(captured.values()) if layer is None else captured.get(layer, 0)


# Note [per-layer W]
# ~~~~~~~~~~~~~~~~~~
# Where plans place W's as tasks ([Note: placed W] in planner/plan/window.py) and they are few enough (`w_by_layer`),
# a stage's W is one W per layer ("W s0 m1 fc", [Note: W pieces] in fxkfac/runtime/split_backward.py), each released
# at its B, due by its stage's update, holding its own layer's operands (`w_operand_bytes`). The schedule's W interval
# is cut into them in layer order (`w_layer_ops`), each its layer's share (`w_share`: of the measured pieces,
# `LayerCost.wgrad`, else of the parameters, else even) plus its fused curvature at the refresh step, cut on a
# decimal grid (at most 10^-6 s). Parameters of no layer (a LayerNorm's) run with the first layer's W.


def whole_decimal(values: Iterable[float], most: int) -> int | None:
    """The least e < `most` for which every value is a whole number of 10^-e (within 1e-9), else None."""
    values = list(values)
    for e in range(most):
        m = 10.0**e
        if all(abs(t * m - round(t * m)) <= 1e-9 * max(1.0, t * m) for t in values):
            return e
    return None


def w_share(stage: StageCost, layer: str) -> float:
    """The share of the stage's W one layer's takes ([Note: per-layer W])."""
    timed = {x.name: x.wgrad for x in stage.layers if x.wgrad is not None}
    if len(timed) == len(stage.layers) and sum(timed.values()) > 0:
        return timed[layer] / sum(timed.values())
    total = sum(x.grad_bytes for x in stage.layers)
    if total == 0:
        return 1 / len(stage.layers)
    return next(x.grad_bytes for x in stage.layers if x.name == layer) / total


def w_makes(w: Op, layer: str) -> bool:
    """Whether the W (or BWD) `w` makes `layer`'s weight gradient and output-gradient capture: it names the layer or
    none (a stage's whole W, [Note: per-layer W])."""
    return w.layer in (None, layer)


def w_layer_ops(
    stage: StageCost, w: Op, start: float, end: float, fused: frozenset[str] = frozenset()
) -> list[tuple[Op, float, float]]:
    """A stage's W over [start, end) as one W per layer in order ([Note: per-layer W]), each its share plus its
    `fused` curvature; `w` itself where the stage has no layers."""
    if not stage.layers:
        return [(w, start, end)]
    e = whole_decimal((start, end), 5)  # cut at 1/100 of the decimal unit both ends are whole in: exact stays exact
    quantum = None if e is None else 10.0 ** -(e + 2)
    out, at = [], start
    for i, x in enumerate(stage.layers):
        seconds = w_share(stage, x.name) * stage.weight_grad + stage.fused_curvature({x.name} & fused, OpKind.BWD)
        cut = at + seconds if quantum is None else round((at + seconds) / quantum) * quantum
        stop = end if i == len(stage.layers) - 1 else min(end, max(at, cut))
        out.append((Op(OpKind.BWD_W, w.stage, w.mb, w.pipe, layer=x.name), at, stop))
        at = stop
    return out


def peak_level(spans: Iterable[tuple[float, float, int]]) -> int:
    """The most bytes held at once by (start, end, bytes) spans over [start, end): the planner's one memory sweep."""
    events = sorted(event for start, end, nbytes in spans for event in ((start, nbytes), (end, -nbytes)))
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def activation_peak(problem: Problem, device: int, fused: frozenset[str] = frozenset()) -> int:
    """The peak of activations in flight on `device` over one step."""
    return peak_level(activation_intervals(problem, device, step_timeline(problem, fused)))


def min_memory_bytes(problem: Problem) -> int:
    """The least per-device memory any plan needs: static bytes plus the activation peak, every layer fused."""
    fused = frozenset(problem.costs.layer_names)
    return max(static_bytes(problem, d) + activation_peak(problem, d, fused) for d in problem.devices)
