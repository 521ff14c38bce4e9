"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B and Chimera as per-pp-rank op lists."""

from __future__ import annotations

from enum import StrEnum

from fxkfac.planner.errors import ScheduleError
from fxkfac.planner.ir import Op, OpKind

__all__ = [
    "ScheduleKind",
    "schedule_programs",
    "stage_rank",
    "stages_of_rank",
    "num_stages",
    "validate_schedule_args",
]


class ScheduleKind(StrEnum):
    """The pipeline schedules fxkfac generates."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    CHIMERA = "chimera"


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
    if kind is not ScheduleKind.INTERLEAVED and v != 1:
        raise ScheduleError(f"{kind} runs one stage per rank: use v=1 (virtual stages need 'interleaved')")
    if kind is ScheduleKind.INTERLEAVED and N % D:
        raise ScheduleError(f"interleaved 1F1B needs N a multiple of D; got N={N}, D={D} (try N={D * -(-N // D)})")
    if kind is ScheduleKind.CHIMERA:
        if D % 2:
            raise ScheduleError(f"chimera needs an even number of stages D, got D={D}")
        if N % D:
            raise ScheduleError(f"chimera needs N a multiple of D; got N={N}, D={D} (try N={D * -(-N // D)})")
    return kind


def num_stages(kind: ScheduleKind | str, D: int, v: int = 1) -> int:
    """The number S of global (virtual) stages: v*D for interleaved, D otherwise."""
    return D * v if _kind(kind) is ScheduleKind.INTERLEAVED else D


def stage_rank(kind: ScheduleKind | str, D: int, stage: int, pipe: int = 0, *, v: int = 1) -> int:
    """The pp rank that runs `stage` of pipeline `pipe` (Chimera: 0 down, 1 up)."""
    kind = _kind(kind)
    if not 0 <= stage < num_stages(kind, D, v):
        raise ScheduleError(f"stage {stage} out of range for {kind} with D={D}, v={v}")
    if pipe not in ((0, 1) if kind is ScheduleKind.CHIMERA else (0,)):
        raise ScheduleError(f"pipe {pipe} does not exist in {kind}")
    if kind is ScheduleKind.INTERLEAVED:
        return stage % D
    if kind is ScheduleKind.CHIMERA and pipe == 1:
        return D - 1 - stage
    return stage


def stages_of_rank(kind: ScheduleKind | str, D: int, rank: int, *, v: int = 1) -> list[tuple[int, int]]:
    """The (stage, pipe) pairs pp rank `rank` holds, stages ascending."""
    kind = _kind(kind)
    if kind is ScheduleKind.INTERLEAVED:
        return [(rank + c * D, 0) for c in range(v)]
    if kind is ScheduleKind.CHIMERA:
        return sorted([(rank, 0), (D - 1 - rank, 1)])
    return [(rank, 0)]


def schedule_programs(kind: ScheduleKind | str, D: int, N: int, *, v: int = 1) -> dict[int, list[Op]]:
    """Per pp rank, the ordered compute ops of one training step.

    FWD/BWD in schedule order, then ALLREDUCE_GRAD per stage held (the gradient sync across
    the copies of the stage), then OPT_STEP. Raises ScheduleError for unsupported (D, N, v).
    """
    kind = validate_schedule_args(kind, D, N, v)
    if kind is ScheduleKind.CHIMERA:
        return {r: _chimera_rank(D, N, r) for r in range(D)}
    make = {
        ScheduleKind.GPIPE: lambda r: _gpipe_rank(N, r),
        ScheduleKind.ONE_F_ONE_B: lambda r: _one_f_one_b_rank(D, N, r),
        ScheduleKind.INTERLEAVED: lambda r: _interleaved_rank(D, N, v, r),
    }[kind]
    programs = {}
    for r in range(D):
        ops = make(r)
        held = sorted({op.stage for op in ops if op.stage is not None}, reverse=True)  # every op made here has one
        programs[r] = ops + [Op(OpKind.ALLREDUCE_GRAD, s) for s in held] + [Op(OpKind.OPT_STEP)]
    return programs


def _gpipe_rank(N: int, r: int) -> list[Op]:
    return [Op(OpKind.FWD, r, m) for m in range(N)] + [Op(OpKind.BWD, r, m) for m in range(N)]


def _one_f_one_b_rank(D: int, N: int, r: int) -> list[Op]:
    """1F1B with flush: min(D-r-1, N) warm-up forwards, then F/B pairs, then the remaining B."""
    warmup = min(D - r - 1, N)
    ops = [Op(OpKind.FWD, r, m) for m in range(warmup)]
    for i in range(N - warmup):
        ops += [Op(OpKind.FWD, r, warmup + i), Op(OpKind.BWD, r, i)]
    ops += [Op(OpKind.BWD, r, m) for m in range(N - warmup, N)]
    return ops


def _interleaved_rank(D: int, N: int, v: int, r: int) -> list[Op]:
    """Megatron's interleaved 1F1B: rank r holds stages r, r+D, ...; micro-batches go in groups of D."""
    total = N * v

    def unit(k: int, forward: bool) -> Op:
        chunk = (k // D) % v
        mb = (k // (D * v)) * D + k % D
        if forward:
            return Op(OpKind.FWD, chunk * D + r, mb)
        return Op(OpKind.BWD, (v - 1 - chunk) * D + r, mb)

    warmup = min((D - r - 1) * 2 + (v - 1) * D, total)
    ops = [unit(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        ops += [unit(warmup + i, True), unit(i, False)]
    ops += [unit(k, False) for k in range(total - warmup, total)]
    return ops


def _chimera_rank(D: int, N: int, r: int) -> list[Op]:
    """Chimera by the slot rule of notes/chimera.md §2 (direct concatenation of N/D units).

    Micro-batch j of unit u: F at stage s in slot 2Du+2j+s, B in slot 2Du+2j+2D-1-s, on the rank
    holding s in that pipeline; down gets micro-batches uD..uD+D/2-1, up uD+D/2..uD+D-1.
    Gradient syncs per §4: the high stage right after its last B when it is above D/2
    (otherwise at the end, first), then the low stage, then OPT_STEP.
    """
    slotted: list[tuple[int, Op]] = []
    half = D // 2
    for u in range(N // D):
        for j in range(half):
            for pipe in (0, 1):
                mb = u * D + pipe * half + j
                for stage in range(D):
                    if stage_rank(ScheduleKind.CHIMERA, D, stage, pipe) != r:
                        continue
                    base = 2 * D * u + 2 * j
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
