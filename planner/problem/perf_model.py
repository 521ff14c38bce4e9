"""The PipeFisher performance model (paper §3.3, Table 1) in sympy, per pipeline schedule."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

import sympy as sp

from fxkfac.planner.problem.costs import WORDS, PreconditionerKind, TaskWords
from fxkfac.planner.problem.errors import ScheduleError
from fxkfac.planner.problem.schedules import ZERO_BUBBLE_KINDS, ScheduleKind

T_f, T_b = sp.symbols("T_f T_b", positive=True)
D, N, v, W = sp.symbols("D N v W", positive=True, integer=True)
M_theta, M_act, M_err_peak, M_err_save, M_curv, M_inv = sp.symbols(
    "M_theta M_act M_err_peak M_err_save M_curv M_inv", nonnegative=True
)
T_curv, T_inv, T_prec, T_gstat = sp.symbols("T_curv T_inv T_prec T_gstat", nonnegative=True)

_ALL = (T_f, T_b, D, N, v, W, M_theta, M_act, M_err_peak, M_err_save, M_curv, M_inv, T_curv, T_inv, T_prec, T_gstat)
SYMBOLS: dict[str, sp.Symbol] = {s.name: s for s in _ALL}
"""Every symbol by name; per (virtual) stage, T_f, T_b, T_curv, M_act, M_err_* per micro-batch, T_gstat per step
(a gradient-fed family's statistics; 0 for K-FAC)."""

_DESCRIPTIONS = {
    "T_pipe": "time of one pipeline step (all F and B of the step, critical path)",
    "T_bubble": "idle time per device in one step (the same on every device for these schedules)",
    "M_pipe": "worst-device memory: parameters+gradients of its stages, in-flight activations, peak errors",
    "T_kfac": "{name} work per device: {stats} and {decomp} (to fit in bubbles) plus {apply}",
    "M_kfac": "{name} memory per device: {stats} and {decomp} results, errors kept for deferred {stats}",
    "ratio": "({stats} + {decomp}) / bubble left by per-step {stats}: pipeline steps needed per refresh",
}


@dataclass(frozen=True)
class PerfModel:
    """The symbolic model of one schedule; `C_f`/`C_b` count F/B on the critical path."""

    kind: ScheduleKind
    C_f: sp.Expr
    C_b: sp.Expr
    T_pipe: sp.Expr
    T_bubble: sp.Expr
    M_pipe: sp.Expr
    T_kfac: sp.Expr
    M_kfac: sp.Expr
    ratio: sp.Expr
    peak_inflight: sp.Expr


def _shape(kind: ScheduleKind) -> tuple[sp.Expr, sp.Expr, sp.Expr, sp.Expr, sp.Expr]:
    """(C_f, C_b, stages per device, F/B pairs per device, worst-device in-flight micro-batches)."""
    if kind in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B):
        inflight = N if kind is ScheduleKind.GPIPE else sp.Min(N, D)
        return N + D - 1, N + D - 1, sp.Integer(1), N, inflight
    if kind is ScheduleKind.INTERLEAVED:
        return N * v + D - 1, N * v + D - 1, v, N * v, sp.Min(N * v, (v + 1) * D - 1)
    k = N / D
    return D + 2 * (k - 1), k * (2 * D - 2), sp.Integer(2), N, D


def perf_model(kind: ScheduleKind | str) -> PerfModel:
    """The paper's §3.3 expressions for `kind`, exact for uniform stages (checked against simulate): C_f = C_b =
    N+D-1 for GPipe/1F1B (N*v+D-1 interleaved); Chimera (N = kD) C_f = D+2(k-1), C_b = k(2D-2) for T_b >= T_f. M_pipe
    uses each schedule's exact in-flight peak where the paper writes N*M_act."""
    kind = ScheduleKind(kind)
    if kind in ZERO_BUBBLE_KINDS:
        raise ScheduleError(f"{kind} has no closed form here (its W's fill the bubbles); simulate its programs")
    C_f, C_b, per_device, mbs, inflight = _shape(kind)
    if kind is ScheduleKind.CHIMERA:
        # Li & Hoefler, SC 2021: D*T_f + (2D-2)*T_b per unit of D micro-batches when T_b >= T_f (the roles of T_f
        # and T_b swap otherwise), plus D(T_f+T_b) + (D-2)|T_b-T_f| per extra unit
        lo, hi = sp.Min(T_f, T_b), sp.Max(T_f, T_b)
        T_pipe = D * lo + (2 * D - 2) * hi + (N / D - 1) * (D * (T_f + T_b) + (D - 2) * sp.Abs(T_b - T_f))
        T_bubble = T_pipe - mbs * (T_f + T_b)
    else:
        T_pipe = C_f * T_f + C_b * T_b
        T_bubble = sp.factor(T_pipe - mbs * (T_f + T_b))
    fill = mbs * T_curv + per_device * T_inv
    return PerfModel(
        kind=kind,
        C_f=sp.simplify(C_f),
        C_b=sp.simplify(C_b),
        T_pipe=T_pipe,
        T_bubble=T_bubble,
        M_pipe=2 * per_device * M_theta + inflight * M_act + M_err_peak,
        T_kfac=fill + per_device * (T_gstat + T_prec),
        M_kfac=per_device * (M_curv + M_inv) + mbs * M_err_save,
        ratio=fill / (T_bubble - per_device * T_gstat),
        peak_inflight=inflight,
    )


def evaluate(expr: sp.Expr, values: Mapping[str, float]) -> float:
    """`expr` as a float with symbols substituted by name (e.g. {"T_f": 1.0, "D": 4, ...}); T_gstat is 0 unless
    given (K-FAC takes no statistics from the gradient)."""
    values = {"T_gstat": 0.0, **values}
    unknown = set(values) - set(SYMBOLS)
    if unknown:
        raise KeyError(f"unknown symbols {sorted(unknown)}; known: {sorted(SYMBOLS)}")
    result = expr.subs({SYMBOLS[name]: value for name, value in values.items()})
    if result.free_symbols:
        missing = sorted(s.name for s in result.free_symbols)
        raise KeyError(f"give values for {missing} to evaluate {expr}")
    return float(result)


def explain(kind: ScheduleKind | str, words: TaskWords = WORDS[PreconditionerKind.KFAC]) -> str:
    """Printable expressions of the model for `kind` (`fxkfac plan --explain`), the work named in the family's words."""
    model = perf_model(kind)
    lines = [f"Performance model for {model.kind} (PipeFisher §3.3; times per micro-batch, per stage):"]
    chimera = "  (for T_b >= T_f)" if model.kind is ScheduleKind.CHIMERA else ""
    lines.append(f"  C_f = {model.C_f},  C_b = {model.C_b}{chimera}")
    for f in fields(model):
        if f.name in _DESCRIPTIONS:
            text = _DESCRIPTIONS[f.name].format(**asdict(words))
            lines += [f"  {f.name} = {sp.sstr(getattr(model, f.name))}", f"      {text}"]
    if model.kind is ScheduleKind.CHIMERA:
        lines.append("  for T_b >= T_f (the usual case):")
        slower_backward = {sp.Max(T_f, T_b): T_b, sp.Min(T_f, T_b): T_f, sp.Abs(T_b - T_f): T_b - T_f}
        for name in ("T_pipe", "T_bubble", "ratio"):
            lines.append(f"    {name} = {sp.sstr(sp.factor(getattr(model, name).subs(slower_backward)))}")
    return "\n".join(lines)


def pipe_gap(
    at_means: float, at_slowest: float, simulated: float, words: TaskWords = WORDS[PreconditionerKind.KFAC]
) -> str:
    """How T_pipe, written for equal stages, relates to the simulated step (seconds: T_pipe at the stage means, with
    every stage as slow as the slowest, the simulation), in words for `--explain`."""
    if abs(simulated - at_means) <= 1e-3 * simulated:
        return (
            f"  T_pipe agrees with the simulated step before {words.name} ({simulated * 1e3:.2f} ms, the "
            "plan's step time)"
        )
    return (
        f"  T_pipe is written for equal stages; the plan's step time before {words.name} "
        f"({simulated * 1e3:.2f} ms) is "
        f"simulated with each stage's own costs, {(simulated - at_means) * 1e3:+.2f} ms from T_pipe at the stage "
        f"means because the stages differ (every stage as slow as the slowest: T_pipe = {at_slowest * 1e3:.2f} ms)"
    )
