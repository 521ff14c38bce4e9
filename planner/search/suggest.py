"""A refusal's suggestions: max_overhead, budget or N values shown to plan by attempts run in the time left."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from decimal import ROUND_CEILING, Decimal

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.errors import InfeasibleBudgetError, Knob, PlanError, ScheduleError, Suggestion
from fxkfac.planner.problem.hardware import HARDWARE
from fxkfac.planner.problem.problem import Problem, SolverConfig, format_bytes, stage_groups
from fxkfac.planner.problem.step_timeline import fused_extra, min_memory_bytes, step_timeline
from fxkfac.planner.search.attempt import Method, Refused, attempt_plan, stats_chunk_of
from fxkfac.planner.search.budget import Budget
from fxkfac.planner.search.stretch import Allowance
from fxkfac.planner.search.window_build import grid_scale

__all__ = ["with_suggestions"]

STRETCH_SEARCH_S = 5.0
"""The most seconds of the limit (and at most half the time left) CP-SAT refines the least stretch of one group."""


# Suggestions: each refusal searches the knobs that may lift it, upward from the refused value, and
# names only values it has solved the problem with (everything else unchanged).


def with_suggestions(
    refused: Refused, problem: Problem, config: SolverConfig, method: Method, until: Budget
) -> PlanError:
    """The refusal's error with the values that plan, searched until `until`: each knob alone; where
    none does and a budget is set, max_overhead and the budget together; then more micro-batches."""
    found: list[Suggestion] = []
    searched: list[str] = []
    stages: list[tuple[Knob, ...]] = [(knob,) for knob in refused.knobs if knob is not Knob.MICROBATCHES]
    if _at_device(problem) and Knob.MEMORY_BUDGET in refused.knobs:  # no more memory: more time, fusing
        stages = [(Knob.MAX_OVERHEAD,)] + [k for k in stages if k not in ((Knob.MAX_OVERHEAD,), (Knob.MEMORY_BUDGET,))]
    if problem.memory_budget is not None and {Knob.MAX_OVERHEAD, Knob.MEMORY_BUDGET} & set(refused.knobs):
        stages.append((Knob.MAX_OVERHEAD, Knob.MEMORY_BUDGET))
    if Knob.MICROBATCHES in refused.knobs:
        stages.append((Knob.MICROBATCHES,))
    for knobs in stages:
        if until.out() or (len(knobs) > 1 or knobs == (Knob.MICROBATCHES,)) and found:
            break
        searched.append(_SEARCHED[knobs].format(N=4 * problem.N))
        search = _search_together if len(knobs) > 1 else _SEARCHES[knobs[0]]
        suggestion = search(problem, refused.fused, config, method, until)
        if suggestion is not None:
            found.append(suggestion)
    text = f"{refused.error}. {_suggestion_text(problem, config, found, searched, until.out())}"
    error = refused.error
    if isinstance(error, InfeasibleBudgetError):
        return InfeasibleBudgetError(text, error.needed_bytes, suggestions=tuple(found))
    return PlanError(text, suggestions=tuple(found))


def _suggestion_text(
    problem: Problem, config: SolverConfig, found: list[Suggestion], searched: list[str], timed_out: bool
) -> str:
    if found:
        return "Solved with: " + "; or ".join(_describe(problem, s) for s in found)
    if timed_out:
        return (
            f"Nothing that plans it was found before the time ran out (time limit {config.time_limit_s:g} s): "
            f"searched {'; '.join(searched) or 'nothing'}; a longer time limit searches further"
        )
    return f"Nothing plans it: no {'; no '.join(searched)}"


_SEARCHED = {
    (Knob.MAX_OVERHEAD,): "max_overhead below 10",
    (Knob.MEMORY_BUDGET,): "memory budget from the peak of a plan made without one",
    (Knob.MAX_OVERHEAD, Knob.MEMORY_BUDGET): "max_overhead with a memory budget",
    (Knob.MICROBATCHES,): "number of micro-batches from 1 to {N}",
}
"""What each search tries, for the message that says none of it plans."""


def _describe(problem: Problem, s: Suggestion) -> str:
    """A suggestion in words: every value as `field=value`."""
    words = []
    for knob, value in s.changes:
        if knob is Knob.MAX_OVERHEAD:
            words.append(f"max_overhead={value:g}")
        elif knob is Knob.MEMORY_BUDGET:
            words.append(f"memory_budget={value} bytes ({format_bytes(value)})")
        else:
            words.append(f"N={value} micro-batches (of the same size)")
    text = " with ".join(words)
    if s.least:
        text += (
            ", the least max_overhead that places it (rounded up to 3 digits; refresh every "
            f"{problem.max_period} steps)"
        )
    if [knob for knob, _ in s.changes] == [Knob.MEMORY_BUDGET]:
        text += f" at max_overhead={problem.max_overhead:g}"
    return text


def _plans(problem: Problem, config: SolverConfig, method: Method, until: Budget, *, thorough: bool = False) -> bool:
    """Whether `solve` makes a plan of `problem`: with greedy placement first (CP-SAT's first pass, whose
    plan it keeps), then, `thorough` and with method CP-SAT, with CP-SAT itself within the time left."""
    return _plan_or_none(problem, config, method, until, thorough=thorough) is not None


def _plan_or_none(
    problem: Problem, config: SolverConfig, method: Method, until: Budget, *, thorough: bool = False
) -> Plan | None:
    made = until.made.get((problem, method))
    if made is not None:
        return made
    now = until.now()
    tries = [now] + (
        [min(until.cutoff, now + until.units(config.time_limit_s))] if thorough and method is Method.CPSAT else []
    )
    for deadline in tries:
        if until.out():
            return None
        try:
            plan = attempt_plan(problem, config, method, until.later(deadline), time.perf_counter())
        except Refused:
            continue
        until.made[(problem, method)] = plan
        return plan
    return None


def _search_overhead(
    problem: Problem, fused: frozenset[str], config: SolverConfig, method: Method, until: Budget
) -> Suggestion | None:
    """A max_overhead that plans: from greedy's stretch estimate doubling, checked by greedy placement (then,
    with CP-SAT, by CP-SAT itself); then, while time is left, CP-SAT's least stretch (checked by CP-SAT,
    named least where proven) or a few bisection probes below it."""
    estimate, proven = _overhead_estimate(problem, fused, config, Method.GREEDY, until)
    ladder = _ladder(max(estimate or 0.0, problem.max_overhead * 1.01, 1e-4), problem.max_overhead)
    for thorough in (False, True) if method is Method.CPSAT else (False,):
        failed = problem.max_overhead
        for candidate in ladder:
            if _plans(replace(problem, max_overhead=candidate), config, method, until, thorough=thorough):
                break
            if until.out():
                return None
            failed = candidate
        else:
            continue
        break
    else:
        return None
    if proven and candidate == estimate:
        return Suggestion(((Knob.MAX_OVERHEAD, candidate),), least=True)
    if method is Method.CPSAT:
        least, proven = _overhead_estimate(problem, fused, config, method, until)
        if (
            least is not None
            and failed < least < candidate
            and _plans(replace(problem, max_overhead=least), config, method, until, thorough=True)
        ):
            return Suggestion(((Knob.MAX_OVERHEAD, least),), least=proven)
    return Suggestion(((Knob.MAX_OVERHEAD, _bisect_down(problem, config, method, until, failed, candidate)),))


def _ladder(start: float, above: float) -> list[float]:
    """max_overhead values to try: `start` doubling, 3 significant digits, above `above` and below 10."""
    values, x = [], _sig_up(start)
    while x < 10:
        if x > above:
            values.append(x)
        x = _sig_up(x * 2)
    return values


def _bisect_down(
    problem: Problem, config: SolverConfig, method: Method, until: Budget, failed: float, works: float
) -> float:
    """A smaller max_overhead than `works` that still plans (a few probes between it and `failed`)."""
    for _ in range(4):
        middle = _sig_up((failed + works) / 2)
        if not failed < middle < works:
            break
        if _plans(replace(problem, max_overhead=middle), config, method, until):
            works = middle
        elif until.out():
            break
        else:
            failed = middle
    return works


def device_bytes(problem: Problem) -> int | None:
    """The memory of the problem's device (`planner.hardware.HARDWARE`), None where it is not a known one."""
    spec = HARDWARE.get(problem.hardware.lower())
    return None if spec is None else spec.memory_bytes


def _at_device(problem: Problem) -> bool:
    """Whether the memory budget is already all the device has: no suggestion may raise it."""
    device = device_bytes(problem)
    return device is not None and problem.memory_budget is not None and problem.memory_budget >= device


def _search_memory(
    problem: Problem, fused: frozenset[str], config: SolverConfig, method: Method, until: Budget
) -> Suggestion | None:
    """A memory budget that plans at the problem's max_overhead: the peak of the plan made without a
    budget, rounded up (raised by a quarter while it does not plan), never above the device's memory."""
    free = _plan_or_none(replace(problem, memory_budget=None), config, method, until)
    if free is None:
        return None
    budget = _bytes_up(
        max(max(free.metrics.peak_memory.values()), min_memory_bytes(problem), (problem.memory_budget or 0) + 1)
    )
    device = device_bytes(problem)
    for _ in range(4):
        if device is not None and budget > device:
            return None
        if _plans(replace(problem, memory_budget=budget), config, method, until):
            return Suggestion(((Knob.MEMORY_BUDGET, budget),))
        budget = _bytes_up(budget * 1.25)
    return None


def _search_microbatches(
    problem: Problem, fused: frozenset[str], config: SolverConfig, method: Method, until: Budget
) -> Suggestion | None:
    """The nearest N (valid for the schedule) that plans: fewer first (less curvature per step for the
    same bubbles), then more, up to 4 times this one."""
    for n in [*range(problem.N - 1, 0, -1), *range(problem.N + 1, 4 * problem.N + 1)]:
        try:
            candidate = replace(problem, N=n)
        except ScheduleError:
            continue
        if _plans(candidate, config, method, until):
            return Suggestion(((Knob.MICROBATCHES, n),))
        if until.out():
            return None
    return None


def _search_together(
    problem: Problem, fused: frozenset[str], config: SolverConfig, method: Method, until: Budget
) -> Suggestion | None:
    """A max_overhead that plans without the budget, and a budget that plans at it."""
    overhead = _search_overhead(replace(problem, memory_budget=None), frozenset(), config, method, until)
    if overhead is None:
        return None
    value = overhead.fields()["max_overhead"]
    memory = _search_memory(replace(problem, max_overhead=value), fused, config, method, until)
    return None if memory is None else Suggestion(((Knob.MAX_OVERHEAD, value),) + memory.changes)


_SEARCHES = {
    Knob.MAX_OVERHEAD: _search_overhead,
    Knob.MEMORY_BUDGET: _search_memory,
    Knob.MICROBATCHES: _search_microbatches,
}


def _overhead_estimate(
    problem: Problem, fused: frozenset[str], config: SolverConfig, method: Method, until: Budget
) -> tuple[float | None, bool]:
    """The max_overhead that stretching the step needs at the longest refresh period (rounded up to 3
    digits), and whether it is proven least (CP-SAT refines greedy's stretch while time is left); None
    when stretching is off or no stretch up to 10 reference steps places the work."""
    from fxkfac.planner.search.greedy import greedy_overhead

    if not config.stretch:
        return None, False
    grid = Allowance(problem, fused, grid_scale(problem, range(problem.num_stages), fused, config.time_resolution))
    upper, proven = 0, True
    for group in stage_groups(problem):
        low, found = greedy_overhead(
            problem,
            group,
            grid,
            stats_chunk=stats_chunk_of(problem, group, config, grid),
            resolution=config.time_resolution,
            meter=until,
        )
        if found is None:
            return None, False
        least = found.window.stretch <= low
        left = until.left()
        if method is Method.CPSAT and not least and left > 0:
            from fxkfac.planner.search.group_search import refine_stretch

            found, least = refine_stretch(
                found, grid, config, until, min(until.units(min(STRETCH_SEARCH_S, config.time_limit_s)), left / 2)
            )
        upper, proven = max(upper, found.window.stretch), proven and least
    need = _overhead(problem, fused, problem.max_period, upper, grid)
    return (_sig_up(need) if need > 0 else None), proven


def _overhead(problem: Problem, fused: frozenset[str], k: int, ticks: int, grid: Allowance) -> float:
    """max_overhead that a stretch of `ticks` per step at period k needs, fused curvature included."""
    normal = step_timeline(problem).length
    return (ticks / grid.scale[0] + fused_extra(problem, fused) / k) / normal  # type: ignore[index]  # the allowance has a grid


def _sig_up(x: float, digits: int = 3) -> float:
    """`x` > 0 rounded up to `digits` significant digits: a value to type that is never short (its
    shortest decimal text is what `f"{x:g}"` prints and float() reads back)."""
    quantum = Decimal(1).scaleb(math.floor(math.log10(x)) - digits + 1)
    return float((Decimal(repr(x)) / quantum).to_integral_value(rounding=ROUND_CEILING) * quantum)


_BYTE_UNITS = ((1 << 30), (1 << 20), (1 << 10))


def _bytes_up(n: float) -> int:
    """`n` bytes rounded up to two decimals of GiB, MiB or KiB (whole bytes below 1 KiB), as the CLI
    reads '84.47GiB': int(float('84.47') * 2**30)."""
    for unit in _BYTE_UNITS:
        if n >= unit:
            hundredths = math.ceil(n * 100 / unit - 1e-6)
            while int(float(f"{hundredths / 100:.2f}") * unit) < n:
                hundredths += 1
            return int(float(f"{hundredths / 100:.2f}") * unit)
    return math.ceil(n)
