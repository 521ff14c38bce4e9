"""The PipeFisher paper's greedy first-fit into bubbles (baseline and warm start), the stretch allowance, and lower
bounds on a group's refresh period.

First-fit follows kazukiosawa/pipe-fisher's `assign_workloads_to_bubbles`: per device, tasks in priority order go into
the first gap where `duration * 1.05` fits, after their dependencies; a window that does not hold them grows a step.
Decompositions go to a stage's copies longest first to the least loaded; memory is left to the validator. The least
stretch is then bisected (not proven least: first-fit is not monotone in it).

The packing bound (`packing_lower_bound`) raises the fluid `refresh_lower_bound`: a task runs whole inside one bubble,
so a bubble holds at most the longest sum of task lengths that fits (`Packer`). Each simplification only enlarges what
a window may hold (releases, memory and simultaneity ignored), so the bound stays valid.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from fxkfac.planner.plan.solution import GroupSolution, use_offsets
from fxkfac.planner.plan.window import (
    Interval,
    TaskKind,
    Window,
    build_window,
    done_by,
    free_gaps,
    grid_scale,
    idle_regions,
    w_makers,
    warm_starts,
    wrap,
)
from fxkfac.planner.problem.costs import words_of
from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.lowering import Assignment, assign_decompositions
from fxkfac.planner.problem.problem import Problem, SolverConfig, StageGroup
from fxkfac.planner.problem.step_timeline import refresh_lower_bound, step_timeline, stretch_allowance
from fxkfac.planner.search.budget import Budget

Probe = Callable[[int], tuple[str, GroupSolution | None]]
"""A solver at one stretch (ticks): (status name, solution or None); "INFEASIBLE" means proven."""


@dataclass(frozen=True)
class Allowance:
    """The stretch a problem allows: `ticks(k)` per step at period k on the grid `scale` of all groups (None: off)."""

    problem: Problem
    fused: frozenset[str]
    scale: tuple[float, bool] | None

    @property
    def enabled(self) -> bool:
        return self.scale is not None

    def ticks(self, k: int) -> int:
        """The most idle ticks per step at refresh period k (0 when off)."""
        if self.scale is None:
            return 0
        return max(0, math.floor(stretch_allowance(self.problem, self.fused, k) * self.scale[0] + 1e-6))

    def window(
        self,
        group: StageGroup,
        k: int,
        stretch: int | None = None,
        *,
        stats_chunk: int,
        resolution: int,
        meter: Budget | None = None,
    ) -> Window:
        """The window of `group` at period k with `stretch` ticks per step (None: the whole allowance), charged to
        `meter` by its busy intervals and tasks (a W twice)."""
        w = build_window(
            self.problem,
            group,
            k,
            self.fused,
            stats_chunk=stats_chunk,
            resolution=resolution,
            stretch=self.ticks(k) if stretch is None else stretch,
            scale=self.scale,
        )
        if meter is not None:
            meter.charge_window(sum(map(len, w.fixed.values())) + sum(1 + (t.kind is TaskKind.WGRAD) for t in w.tasks))
        return w


def allowance(problem: Problem, fused: frozenset[str], config: SolverConfig) -> Allowance:
    """`problem`'s allowance: on (one grid for all stages) when config.stretch and max_overhead > 0."""
    if not (config.stretch and problem.max_overhead > 0):
        return Allowance(problem, fused, None)
    return Allowance(problem, fused, grid_scale(problem, range(problem.num_stages), fused, config.time_resolution))


def restretch(solution: GroupSolution, stretch: int) -> GroupSolution:
    """The same placement at a longer `stretch`: a start in window step j moves j * (added ticks) later, so order,
    overlaps, memory and use offsets hold."""
    w = solution.window
    delta = stretch - w.stretch
    assert delta >= 0, f"restretch only lengthens: {w.stretch} -> {stretch}"
    if delta == 0:
        return solution
    new = build_window(
        w.problem, w.group, w.k, w.fused, stats_chunk=w.stats_chunk, stretch=stretch, scale=(w.scale, w.exact)
    )
    tasks = {task.name: task for task in new.tasks}
    bounds = [w.step_start(j) for j in range(2 * w.k + 1)]  # where each step begins

    def move(t: int) -> int:
        return t + max(0, bisect_right(bounds, t) - 1) * delta

    return replace(
        solution,
        window=replace(new, tasks=tuple(replace(tasks[t.name], devices=t.devices) for t in w.tasks)),
        starts=tuple(move(t) for t in solution.starts),
        prec_starts=tuple(move(t) for t in solution.prec_starts),
        bcasts={name: move(t) for name, t in solution.bcasts.items()},
    )


def stretch_lower_bound(window: Window) -> int:
    """Ticks of stretch per step any placement needs: each task fits one idle region of its device(s) (one meeting a
    step boundary grows with the stretch), and all the work fits the devices' free time."""
    x, k, n, L = window.stretch, window.k, len(window.group.devices), window.length
    bounds = [window.step_start(j) % L for j in range(k)]
    gaps = {}
    for d in window.group.devices:  # (longest region meeting no step boundary, longest meeting one)
        inside = across = 0
        for region in idle_regions(window.fixed[d], L):
            if any(s <= b <= e or s <= b + L <= e for s, e in region for b in bounds):
                across = max(across, _span(region))
            else:
                inside = max(inside, _span(region))
        gaps[d] = inside, across
    need = 0
    for task in window.tasks:
        per_device = [0 if task.ticks <= gaps[d][0] else task.ticks - (gaps[d][1] - x) for d in task.devices]
        need = max(need, min(per_device) if task.kind is TaskKind.INV else max(per_device))
    work = sum(t.ticks * (len(t.devices) if t.kind.collective else 1) for t in window.tasks)
    work += sum(p.ticks for p in window.precs)
    free = n * L - sum(e - s for d in window.group.devices for s, e in window.fixed[d])
    return max(need, x + math.ceil((work - free) / (k * n)), 0)


def bisect_least(
    lower: int, found: GroupSolution, probe: Probe, size: Callable[[GroupSolution], int] = lambda s: s.window.stretch
) -> tuple[GroupSolution, bool]:
    """The placement of least `size` (stretch or step ticks) `probe` finds in [lower, found's] by bisection, and whether
    it is proven least (every smaller size INFEASIBLE)."""
    lo, hi, best, proven = lower, size(found), found, True
    while lo < hi:
        mid = (lo + hi) // 2
        status, solution = probe(mid)
        if solution is not None:
            hi, best = size(solution), solution
        else:
            proven = proven and status == "INFEASIBLE"
            lo = mid + 1
    return best, proven


def first_fits(place: Callable[[int], GroupSolution | None], meter: Budget | None) -> Probe:
    """A probe by first-fit (`place` at a size): never a proof; nothing once `meter` (if any) runs out."""
    return lambda size: ("UNKNOWN", None if _spent(meter) else place(size))


UNITS_PER_STEP = 2000
"""The packing table's units per step (task lengths round down, bubbles up: it only over-counts)."""

MAX_CHOICES = 4096
"""The most placements of bubble-sharing APPLY slots one bound tries; beyond, bubbles count idle less slots."""


class Packer:
    """The most ticks of tasks (lengths `sizes`, each any number of times) that fit in a bubble; `work` counts the
    lookups, table cells and slot placements `packing_lower_bound` charges."""

    def __init__(self, sizes: Iterable[int], unit: int) -> None:
        if unit < 1:
            raise ValueError(f"a packing unit is at least one tick, got {unit}")
        self.unit = unit
        by_weight: dict[int, int] = {}
        for size in (x for x in sizes if x > 0):
            by_weight[size // unit] = max(by_weight.get(size // unit, 0), size)
        self.free = 0 in by_weight  # some task is shorter than a unit: every bubble counts as full
        self.items = sorted(by_weight.items())
        self._best = [0]
        self.work = 0

    def packable(self, length: int) -> int:
        """An upper bound on the ticks of whole tasks that fit in `length` ticks."""
        self.work += 1
        if length <= 0 or not self.items:
            return 0
        if self.free:
            return length
        units = -(-length // self.unit)
        best = self._best
        self.work += max(0, units + 1 - len(best)) * len(self.items)
        while len(best) <= units:
            n = len(best)
            best.append(max([best[n - 1]] + [best[n - w] + v for w, v in self.items if w <= n]))
        return min(length, best[units])


def _span(region: Sequence[Interval]) -> int:
    return sum(end - start for start, end in region)


def _device_capacity(window: Window, device: int, packer: Packer) -> int:
    """The most task ticks the device's bubbles may hold, its APPLY slots where they cost the least (W's at home)."""
    homes = tuple(
        wrap(t.home, t.home + t.ticks, window.length)[0]
        for t in window.tasks
        if t.kind is TaskKind.WGRAD and t.home is not None and t.devices[0] == device
    )
    regions = idle_regions(window.fixed[device] + homes, window.length)
    slots = [s for s in window.precs if s.device == device and s.ticks > 0]
    allowed = [wrap(p.release, max(p.deadline, p.release + p.ticks), window.length) for p in slots]
    candidates = [  # the bubbles long enough for each slot that meet the span it may run in
        [
            i
            for i, r in enumerate(regions)
            if _span(r) >= p.ticks and any(a < d and c < b for a, b in r for c, d in span)
        ]
        for p, span in zip(slots, allowed)
    ]
    packer.work += len(window.tasks) + len(window.fixed[device]) + len(slots) * len(regions)
    total, seen = 0, set()
    for component in _components(candidates):  # slots sharing bubbles: each placement tried, flush with an end
        members = {i for j in component for i in candidates[j]}
        seen |= members
        spans = {i: _span(regions[i]) for i in members}
        loose = min(
            sum(packer.packable(s) for s in spans.values()),
            sum(spans.values()) - sum(slots[j].ticks for j in component),
        )
        choices = [candidates[j] for j in component]
        if not all(choices) or math.prod(map(len, choices)) > MAX_CHOICES:
            total += max(0, loose)
            continue
        best = 0
        packer.work += math.prod(map(len, choices)) * len(members)
        for choice in itertools.product(*choices):
            load = dict.fromkeys(members, 0)
            for j, i in zip(component, choice):
                load[i] += slots[j].ticks
            if all(load[i] <= spans[i] for i in members):
                best = max(best, sum(packer.packable(spans[i] - load[i]) for i in members))
        total += best
    return total + sum(packer.packable(_span(r)) for i, r in enumerate(regions) if i not in seen)


def _components(candidates: Sequence[Sequence[int]]) -> list[list[int]]:
    """The slots in groups that share no candidate bubble with another group."""
    groups: list[tuple[set[int], list[int]]] = []
    for j, regions in enumerate(candidates):
        joined = [g for g in groups if g[0] & set(regions)]
        merged = (set(regions).union(*(g[0] for g in joined)), [x for g in joined for x in g[1]] + [j])
        groups = [g for g in groups if g not in joined] + [merged]
    return sorted(sorted(slots) for _, slots in groups)


def window_work(window: Window) -> int:
    """Ticks of the refresh's statistics and decomposition pieces (the same under every distribution of a layer)."""
    return sum(t.ticks for t in window.tasks if t.kind in (TaskKind.CURV, TaskKind.INV))


def packing_lower_bound(window_at: Callable[[int], Window], lower: int, top: int, meter: Budget | None = None) -> int:
    """The least period in [`lower`, `top`] (`top + 1`: none) whose window may hold its computations whole, and apart
    all its tasks (short collectives would fill the bubbles); charged to `meter`, when out the period reached."""
    packers: tuple[Packer, Packer] | None = None
    found = top + 1
    for k in range(lower, top + 1):
        window = window_at(k)
        tasks = [t for t in window.tasks if t.kind is not TaskKind.WGRAD]  # a W keeps its place
        loads = [t.ticks for t in tasks for _ in (t.devices if t.kind.collective else (0,))]  # a collective on each
        if packers is None:
            unit = max(1, window.offsets[1] // UNITS_PER_STEP)
            computations = [t.ticks for t in tasks if t.kind in (TaskKind.CURV, TaskKind.INV)]
            packers = Packer(computations, unit), Packer(loads, unit)
        capacity = [sum(_device_capacity(window, d, packer) for d in window.group.devices) for packer in packers]
        if window_work(window) <= capacity[0] and sum(loads) <= capacity[1] or _spent(meter):
            found = k  # with no time left, k: every smaller period was ruled out, so it still bounds
            break
    if meter is not None and packers is not None:
        meter.charge_packing(sum(packer.work for packer in packers))
    return found


def group_lower_bound(
    allowance: Allowance,
    group: StageGroup,
    window_at: Callable[[int], Window],
    min_k: int = 1,
    meter: Budget | None = None,
) -> int:
    """The least refresh period of `group` (max_period + 1: none): the fluid bound raised by the packing bound."""
    problem = allowance.problem
    fluid = max(min_k, refresh_lower_bound(problem, group, allowance.fused, stretch=allowance.enabled))
    return packing_lower_bound(window_at, fluid, problem.max_period, meter)


MARGIN = 0.05
"""pipe-fisher's margin_ratio: a task needs duration * (1 + MARGIN) of free gap."""

_ORDER = {kind: n for n, kind in enumerate(TaskKind)}
"""Priority of a task kind (then a layer's parts in their order: K-FAC's curvature A, B, sync A, B, ...)."""


class _Gaps:
    """A device's free [start, end) gaps beside its fixed work and APPLY slots; `scanned` counts the gaps examined."""

    def __init__(self, window: Window, device: int) -> None:
        slots = tuple((p.reference, p.reference + p.ticks) for p in window.precs if p.device == device and p.ticks > 0)
        busy = window.fixed[device] + slots
        self.gaps = [list(gap) for gap in free_gaps(busy, window.length)]
        self.scanned = len(busy)

    def first_fit(self, earliest: int, need: int) -> int | None:
        """The earliest start >= `earliest` with `need` free ticks, or None."""
        for n, (s, e) in enumerate(self.gaps):
            t = max(s, earliest)
            if t + need <= e:
                self.scanned += n + 1
                return t
        self.scanned += len(self.gaps)
        return None

    def occupy(self, start: int, ticks: int) -> None:
        """Mark [start, start + ticks) busy (it lies inside one gap)."""
        for i, (s, e) in enumerate(self.gaps):
            if s <= start and start + ticks <= e:
                self.scanned += i + 1
                self.gaps[i : i + 1] = [g for g in ([s, start], [start + ticks, e]) if g[0] < g[1]]
                return
        raise AssertionError(f"[{start}, {start + ticks}) is not free")


def _fit_together(gaps: list[_Gaps], earliest: int, need: int) -> int | None:
    """The earliest start where every device in `gaps` has `need` free ticks at once."""
    t: int | None = earliest
    while t is not None:
        fits = [g.first_fit(t, need) for g in gaps]
        latest = None if None in fits else max(s for s in fits if s is not None)
        if latest == t:
            return t
        t = latest
    return None


def _inv_devices(window: Window) -> dict[tuple[str, str], int]:
    """Each factor's decomposition device: dealt over its grad workers longest first to the least loaded (LPT: the
    paper's round robin by layer sent every feed-forward to one copy)."""
    seconds: dict[tuple[str, str], float] = {}
    dealt: dict[tuple[int, tuple[int, ...]], list[tuple[str, str]]] = {}
    for task in window.tasks:
        if task.kind is TaskKind.INV:
            key = task.factors[0]
            if key not in seconds:
                dealt.setdefault((task.stage, task.devices), []).append(key)
            seconds[key] = seconds.get(key, 0.0) + sum(task.seconds)
    lpt = [assign_decompositions(factors, devices, Assignment.LPT, seconds) for (_, devices), factors in dealt.items()]
    return {key: device for dealing in lpt for key, device in dealing.items()}


def greedy_window(window: Window, meter: Budget | None = None) -> GroupSolution | None:
    """Every task first-fit in priority order (None: one does not fit), charged to `meter` ([Note: greedy charge])."""
    gaps = {d: _Gaps(window, d) for d in window.group.devices}
    solution = _place(window, gaps)
    if meter is not None:
        meter.charge_first_fit(len(window.tasks) + len(window.precs), sum(g.scanned for g in gaps.values()))
    return solution


def _place(window: Window, gaps: dict[int, _Gaps]) -> GroupSolution | None:
    """`greedy_window`'s placement into the devices' `gaps`."""
    rank = {
        p.part: j
        for s in window.group.stages
        for x in window.problem.costs.stages[s].layers
        for j, p in enumerate(x.parts)
    }
    tasks, makers, inv_device = window.tasks, w_makers(window), _inv_devices(window)
    starts, devices = [0] * len(tasks), [0] * len(tasks)
    done: dict[tuple[str, str], int] = {}  # factor -> end of its latest placed task
    ws = [i for i, task in enumerate(tasks) if task.kind is TaskKind.WGRAD]  # first, at home ([Note: placed W])
    rest = (i for i, task in enumerate(tasks) if task.kind is not TaskKind.WGRAD)
    for i in ws + sorted(rest, key=lambda i: (_ORDER[tasks[i].kind], rank[tasks[i].side], tasks[i].release, i)):
        task = tasks[i]
        if task.kind is TaskKind.WGRAD:
            assert task.home is not None and task.deadline is not None, "a W task has a home and a deadline"
            members, gap = [task.devices[0]], gaps[task.devices[0]]
            home = gap.first_fit(task.home, task.ticks) == task.home
            start = task.home if home else gap.first_fit(task.release, task.ticks)
            start = None if start is None or start + task.ticks > task.deadline else start
        else:
            members = [inv_device[task.factors[0]]] if task.kind is TaskKind.INV else list(task.devices)
            made = (starts[w] + tasks[w].ticks for w, c in makers if c == i)  # a deferred curvature waits for its W
            after = max(made if task.kind is TaskKind.CURV else (done.get(f, 0) for f in task.factors), default=0)
            slot = window.precs[window.slot(members[0], task.stage)] if task.after_slot else None
            release = slot.reference + slot.ticks if slot is not None else 0  # a gradient-fed part after its slot
            earliest = max(after, release, window.earliest(task))
            start = _fit_together([gaps[d] for d in members], earliest, math.ceil(task.ticks * (1 + MARGIN)))
        if start is None:
            return None
        for d in members:
            gaps[d].occupy(start, task.ticks)
        starts[i] = start
        devices[i] = inv_device[task.factors[0]] if task.kind is TaskKind.BCAST else members[0]
        for f in task.factors:
            done[f] = max(done.get(f, 0), start + task.ticks)
    if any(starts[i] + done_by(window.tasks[i]) > starts[f] + window.length for i, f in warm_starts(window)):
        return None  # a refresh not made before the next one warm-starts from it
    precs = tuple(p.reference for p in window.precs)
    offsets = use_offsets(window, tuple(starts), precs)
    return GroupSolution(window, tuple(starts), tuple(devices), precs, offsets, "greedy", "FEASIBLE", 1)


def _spent(meter: Budget | None) -> bool:
    """Whether `meter`'s clock is out (not the wall net, which stops CP-SAT only)."""
    return meter is not None and meter.left() <= 0


def greedy_group(
    allowance: Allowance,
    group: StageGroup,
    *,
    stats_chunk: int = 1,
    resolution: int = 100_000,
    min_k: int = 1,
    meter: Budget | None = None,
    shrink_stretch: bool = True,
    cut: bool = True,
) -> GroupSolution:
    """The paper's rule for one group: the least k where first-fit places everything with the whole allowance, then
    (`shrink_stretch`) the least stretch; PlanError when no k does, or (`cut`) when `meter` runs out first."""
    began, problem = time.perf_counter(), allowance.problem

    @functools.cache
    def window_at(k: int, stretch: int | None = None) -> Window:
        return allowance.window(group, k, stretch, stats_chunk=stats_chunk, resolution=resolution, meter=meter)

    lower = group_lower_bound(allowance, group, window_at, min_k, meter)
    for k in range(lower, problem.max_period + 1):
        if cut and _spent(meter):
            raise PlanError(
                f"the time limit ran out while the greedy rule placed the {words_of(problem.costs).name} work of "
                f"stages {list(group.stages)} ({k - lower} refresh period(s) from {lower} tried); a longer time "
                "limit searches further"
            )
        window = window_at(k)
        solution = greedy_window(window, meter)
        if solution is not None:
            if allowance.ticks(k) > 0 and shrink_stretch:
                at = functools.partial(window_at, k)
                solution = _least_stretch(solution, stretch_lower_bound(window), at, meter, cut)
            return replace(solution, k_lower_bound=lower, wall_time=time.perf_counter() - began)
    raise PlanError(
        f"the greedy rule cannot place the {words_of(problem.costs).name} work of stages {list(group.stages)} within "
        f"{problem.max_period} steps: some curvature or inversion is longer than every bubble; "
        "raise max_period or max_overhead, split the layer, or allow fused curvature"
    )


def _least_stretch(
    found: GroupSolution, lower: int, window_of: Callable[[int], Window], meter: Budget | None, cut: bool
) -> GroupSolution:
    """The least stretch first-fit finds from `lower` to found's (`cut`: until `meter` runs out)."""
    probe = first_fits(lambda stretch: greedy_window(window_of(stretch), meter), meter if cut else None)
    return bisect_least(lower, found, probe)[0]


def greedy_overhead(
    group: StageGroup, allowance: Allowance, *, stats_chunk: int, resolution: int, meter: Budget
) -> tuple[int, GroupSolution | None]:
    """For a refusal's hint, the stretch the group needs at max_period whatever max_overhead says: (ticks any plan
    needs, first-fit's least-stretch solution or None when none within 10 reference steps is found in time)."""
    assert allowance.scale is not None, "greedy_overhead needs an allowance with a grid"
    problem = allowance.problem
    most = math.floor(10 * step_timeline(problem).length * allowance.scale[0])
    window = functools.partial(
        allowance.window, group, problem.max_period, stats_chunk=stats_chunk, resolution=resolution, meter=meter
    )
    lower = stretch_lower_bound(window(0))
    failed, ticks = lower - 1, lower
    while ticks <= most and not _spent(meter):
        found = greedy_window(window(ticks), meter)
        if found is not None:
            return lower, _least_stretch(found, failed + 1, window, meter, cut=True)
        failed, ticks = ticks, max(ticks + 1, math.ceil(ticks * 1.25))
    return lower, None
