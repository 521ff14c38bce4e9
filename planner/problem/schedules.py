"""Pipeline schedules as per-pp-rank op lists: GPipe, 1F1B, interleaved 1F1B, Chimera, ZB-H1, ZB-V, ZB-1P."""

from __future__ import annotations

from enum import StrEnum

from fxkfac.planner.problem.errors import ScheduleError
from fxkfac.planner.problem.ir import Op, OpKind


class ScheduleKind(StrEnum):
    """The pipeline schedules fxkfac generates."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    CHIMERA = "chimera"
    ZB_H1 = "zb-h1"
    ZB_V = "zb-v"
    ZB_1P = "zb-1p"


ZERO_BUBBLE_KINDS = frozenset({ScheduleKind.ZB_H1, ScheduleKind.ZB_V, ScheduleKind.ZB_1P})
"""Schedules that split each backward into B (input gradient) and a deferred W (weight gradient, OpKind.BWD_W): ZB-H1
(Qi et al. 2024), ZB-V (two stages per rank in a V) and interleaved zero bubble (v stages per rank)."""


def weight_gradient_kind(kind: ScheduleKind | str) -> OpKind:
    """The op whose end makes one micro-batch's weight gradient of a stage: the zero-bubble family's BWD_W (a fused
    layer's output-gradient curvature runs with it), BWD otherwise."""
    return OpKind.BWD_W if _kind(kind) in ZERO_BUBBLE_KINDS else OpKind.BWD


def capture_kind(kind: ScheduleKind | str, after: OpKind) -> OpKind:
    """The op whose end makes a refresh step's capture taken `after` FWD or BWD: an output gradient's is the weight
    gradient's, so a STATS of it follows its W ([Note: late captures] in fxkfac/runtime/tapped_runner.py)."""
    return weight_gradient_kind(kind) if after is OpKind.BWD else after


_VIRTUAL_KINDS = frozenset({ScheduleKind.INTERLEAVED, ScheduleKind.ZB_1P})
"""Schedules whose ranks hold v stages, r, r+D, ...; ZB-V holds two, r and 2D-1-r."""


def _kind(kind: ScheduleKind | str) -> ScheduleKind:
    try:
        return ScheduleKind(kind)
    except ValueError:
        names = ", ".join(k.value for k in ScheduleKind)
        raise ScheduleError(f"unknown schedule {kind!r}; choose one of: {names}") from None


def validate_schedule_args(kind: ScheduleKind | str, D: int, N: int, v: int = 1) -> ScheduleKind:
    """The schedule kind, after checking that (D, N, v) is a combination it can run."""
    kind = _kind(kind)
    for name, value in (("stages D", D), ("micro-batches N", N), ("virtual stages v", v)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")
    if kind is ScheduleKind.ZB_V and v != 2:
        raise ScheduleError(f"zb-v runs two stages per rank in a V: use v=2, got v={v}")
    if kind not in _VIRTUAL_KINDS | {ScheduleKind.ZB_V} and v != 1:
        raise ScheduleError(f"{kind} runs one stage per rank: use v=1 (virtual stages need 'interleaved' or 'zb-1p')")
    if kind is ScheduleKind.CHIMERA and D % 2:
        raise ScheduleError(f"chimera needs an even number of stages D, got D={D}")
    if kind in _VIRTUAL_KINDS | {ScheduleKind.CHIMERA} and N % D:
        raise ScheduleError(f"{kind} needs N a multiple of D; got N={N}, D={D} (try N={D * -(-N // D)})")
    return kind


def num_stages(kind: ScheduleKind | str, D: int, v: int = 1) -> int:
    """The number S of global (virtual) stages: v*D for interleaved and zb-1p, 2D for zb-v, D otherwise."""
    kind = _kind(kind)
    return 2 * D if kind is ScheduleKind.ZB_V else D * v if kind in _VIRTUAL_KINDS else D


def stage_rank(kind: ScheduleKind | str, D: int, stage: int, pipe: int = 0, *, v: int = 1) -> int:
    """The pp rank that runs `stage` of pipeline `pipe` (Chimera: 0 down, 1 up)."""
    kind = _kind(kind)
    if not 0 <= stage < num_stages(kind, D, v):
        raise ScheduleError(f"stage {stage} out of range for {kind} with D={D}, v={v}")
    if pipe not in pipes(kind):
        raise ScheduleError(f"pipe {pipe} does not exist in {kind}")
    if kind in _VIRTUAL_KINDS:
        return stage % D
    if kind is ScheduleKind.ZB_V:
        return stage if stage < D else 2 * D - 1 - stage
    if kind is ScheduleKind.CHIMERA and pipe == 1:
        return D - 1 - stage
    return stage


def stages_of_rank(kind: ScheduleKind | str, D: int, rank: int, *, v: int = 1) -> list[tuple[int, int]]:
    """The (stage, pipe) pairs pp rank `rank` holds, stages ascending."""
    stages = range(num_stages(kind, D, v))
    return [(s, p) for s in stages for p in pipes(kind) if stage_rank(kind, D, s, p, v=v) == rank]


def pipes(kind: ScheduleKind | str) -> tuple[int, ...]:
    """The pipelines of a schedule: Chimera's two (0 down, 1 up), one otherwise."""
    return (0, 1) if _kind(kind) is ScheduleKind.CHIMERA else (0,)


def schedule_programs(kind: ScheduleKind | str, D: int, N: int, *, v: int = 1) -> dict[int, list[Op]]:
    """Per pp rank, one step's F/B (and W) in schedule order, an ALLREDUCE_GRAD per stage held, then OPT_STEP;
    ScheduleError for an unsupported (D, N, v)."""
    kind = validate_schedule_args(kind, D, N, v)
    if kind is ScheduleKind.CHIMERA:
        return {r: _chimera_rank(D, N, r) for r in range(D)}
    make = {
        ScheduleKind.GPIPE: lambda r: _steady_rank(D, 1, r, N, N),
        ScheduleKind.ONE_F_ONE_B: lambda r: _steady_rank(D, 1, r, N, D - r - 1),
        ScheduleKind.INTERLEAVED: lambda r: _steady_rank(D, v, r, N * v, (D - r - 1) * 2 + (v - 1) * D),
        ScheduleKind.ZB_H1: lambda r: _steady_rank(D, 1, r, N, D - 1 - r, w_lag=r),
        ScheduleKind.ZB_1P: lambda r: _steady_rank(D, v, r, N * v, (v - 1) * D + (D - 1 - r), w_lag=r),
        ScheduleKind.ZB_V: lambda r: _zb_v_rank(D, N, r),
    }[kind]
    programs = {}
    for r in range(D):
        ops = make(r)
        held = sorted({op.stage for op in ops if op.stage is not None}, reverse=True)  # every op made here has one
        programs[r] = ops + [Op(OpKind.ALLREDUCE_GRAD, s) for s in held] + [Op(OpKind.OPT_STEP)]
    return programs


def _steady_rank(D: int, v: int, r: int, total: int, warmup: int, w_lag: int | None = None) -> list[Op]:
    """`warmup` forwards, then per unit k of `total` forward k+warmup (while any is left) and backward k (GPipe, 1F1B,
    interleaved); with `w_lag` r torch's ScheduleInterleavedZeroBubble (ZB-1P, ZB-H1): after B j the W of B j-r."""

    def unit(k: int, kind: OpKind) -> Op:
        """The k-th `kind` op: D micro-batches a chunk, forwards through chunks r, r+D, ... and backwards back."""
        chunk = (k // D) % v
        return Op(kind, (chunk if kind is OpKind.FWD else v - 1 - chunk) * D + r, (k // (D * v)) * D + k % D)

    warmup = min(warmup, total)
    ops = [unit(k, OpKind.FWD) for k in range(warmup)]
    for j in range(total):
        if warmup + j < total:
            ops.append(unit(warmup + j, OpKind.FWD))
        ops.append(unit(j, OpKind.BWD))
        if w_lag is not None and j >= w_lag:
            ops.append(unit(j - w_lag, OpKind.BWD_W))
    return ops if w_lag is None else ops + [unit(j, OpKind.BWD_W) for j in range(max(total - w_lag, 0), total)]


def _zb_v_rank(D: int, N: int, r: int) -> list[Op]:
    """ZB-V in torch's ScheduleZBVZeroBubble order: rank r holds stage r (down the V) and 2D-1-r (back up), run in the
    phases below for max(N, 2D-1) micro-batches, those >= N dropped."""
    F, B, W = OpKind.FWD, OpKind.BWD, OpKind.BWD_W
    low, high = r, 2 * D - 1 - r
    n = max(N, 2 * D - 1)
    done = {(kind, s): 0 for kind in (F, B, W) for s in (low, high)}
    ops: list[Op] = []

    def run(times: int, *pattern: tuple[OpKind, int]) -> None:
        for _ in range(times):
            for kind, stage in pattern:
                ops.append(Op(kind, stage, done[kind, stage]))
                done[kind, stage] += 1

    run(2 * (D - r) - 1, (F, low))
    run(r, (F, high), (F, low))
    run(D - r, (F, high), (B, high), (W, high))
    while done[F, high] < done[F, low] or done[F, low] < n:
        if done[F, low] < n:
            run(1, (F, low))
        run(1, (B, low), (W, low), (F, high), (B, high), (W, high))
    run(r, (B, low), (B, high))
    run(D - r, (B, low), (W, low))
    run(done[B, high] - done[W, high], (W, high))
    run(done[B, low] - done[W, low], (W, low))
    return [op for op in ops if op.mb_id < N]


def _chimera_rank(D: int, N: int, r: int) -> list[Op]:
    """Chimera by its paper's slot rule (Li & Hoefler, SC 2021), N/D units: micro-batch j of unit u runs F at stage s
    in slot 2Du+2j+s, B in 2Du+2j+2D-1-s; the high stage's gradient sync after its last B when above D/2."""
    slotted: list[tuple[int, Op]] = []
    half = D // 2
    for u in range(N // D):
        for j in range(half):
            for pipe, stage in ((0, r), (1, D - 1 - r)):  # the rank's one stage of each pipe (`stage_rank`)
                mb, base = u * D + pipe * half + j, 2 * D * u + 2 * j
                slotted.append((base + stage, Op(OpKind.FWD, stage, mb, pipe)))
                slotted.append((base + 2 * D - 1 - stage, Op(OpKind.BWD, stage, mb, pipe)))
    slotted.sort(key=lambda item: item[0])
    if len({slot for slot, _ in slotted}) != len(slotted):
        raise AssertionError(f"chimera slot collision on rank {r} (D={D}, N={N})")
    ops = [op for _, op in slotted]
    low, high = min(r, D - 1 - r), max(r, D - 1 - r)
    if high > half:
        last_high_b = max(i for i, op in enumerate(ops) if op.kind is OpKind.BWD and op.stage == high)
        ops.insert(last_high_b + 1, Op(OpKind.ALLREDUCE_GRAD, high))
        tail = [Op(OpKind.ALLREDUCE_GRAD, low)]
    else:
        tail = [Op(OpKind.ALLREDUCE_GRAD, high), Op(OpKind.ALLREDUCE_GRAD, low)]
    return ops + tail + [Op(OpKind.OPT_STEP)]
