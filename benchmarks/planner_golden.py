"""Golden plans: the planner's plans on a fixed set of problems, recorded once and compared with a later planner.

Run (from the repository root): python -m benchmarks.planner_golden record [--set full|ci] [--golden FILE]
                                python -m benchmarks.planner_golden compare [--set full|ci] [--golden FILE]

The set ([issue 36, item 7]): every cell of benchmarks/paper_configs.py's README table (global scope greedy and
CP-SAT; no barrier, 4 pieces per inversion, per block, sublayer and Linear: CP-SAT), planner_scaling's D=8 and D=64
(full set only), `fxkfac demo`'s plan="auto" planning of its saved profile (tests/data/demo_costs.json), the README
snippet's 2 x 2 mesh (tests/data/readme_snippet_2x2_costs.json, issue 38) as `fxkfac plan` plans it (auto, comm-opt,
mem-opt), and 200 random problems drawn once from tests/planner/kfac_cases.py's hypothesis strategy and kept in
tests/data/planner_golden_problems.json (`draw` draws them anew; each is recorded with a digest of its JSON, so a
changed problem is reported, not compared). The "ci" set (tests/planner/test_golden.py) is 30 of the random problems
and the README snippet at a 2 s limit. Each plan is recorded as its refresh periods per stage, step time, peak memory
per device and the deterministic time its planning spent (CP-SAT's clock, [Note: deterministic budget] in
planner/search/budget.py), which repeat on any load unless the wall-clock safety net ends a search first (recorded as
"capped": not compared). `compare` says per plan: equal, better (something better, nothing worse), "worse: plan" (a
refresh period, the step or the plan's peak memory worse; or no plan where one was) or "worse: time" (an equal or
better plan found in more deterministic time). The deterministic time compared is counted as the records count it:
CP-SAT's own, and first-fit's tasks at the rate charged when they were recorded (RECORDED_GREEDY_DTIME_PER_TASK),
without the step simulations the recorded planner did not charge. Prints a rich table and one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.paper_configs import CONFIGS
from benchmarks.paper_configs import Config as PaperConfig
from benchmarks.paper_configs import costs_of as paper_costs
from fxkfac.planner import (
    Budget,
    CostTable,
    Distributions,
    Method,
    Overhead,
    Plan,
    PlanError,
    Problem,
    SearchOptions,
    SolverConfig,
    StepBarrier,
    Strategy,
    StrategyKind,
    StreamApply,
    TimeLimit,
)
from fxkfac.planner import plan as plan_search
from fxkfac.planner.problem import ProfileLayers, load_cost_table
from fxkfac.planner.search.choose import strategy_of

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
GOLDEN = DATA / "planner_golden.json"
README_SNIPPET = DATA / "readme_snippet_2x2_costs.json"
DEMO = DATA / "demo_costs.json"
PROBLEMS = DATA / "planner_golden_problems.json"
"""The random problems of the set, as `Problem.to_dict` wrote them (drawn by `draw_problems`)."""
RANDOM = 200
RANDOM_CI = 30
RANDOM_LIMIT_S = 2.0
DTIME_TOL = 1e-9
RECORDED_GREEDY_DTIME_PER_TASK = 1e-5
"""The rate first-fit's tasks were charged at when the golden set was recorded (planner/search/budget.py's
GREEDY_DTIME_PER_TASK then, by task alone): the comparison counts every run's tasks at it, in place of what the budget
charges the greedy rule now (`_Tally.greedy`: windows, packing bounds and first-fit's scans)."""
"""Deterministic time is a count of CP-SAT's operations: equal runs spend it equally, up to float rounding."""

Outcome = dict[str, Any]
"""A plan's record (refresh, bound, step_ms, peak, dtime, status, strategy) or {"error": ..., "dtime": ...}."""


class Boxes:
    """The Budgets of one case's planning (one per placement under EACH_SOLVE), for the deterministic time spent."""

    def __init__(self) -> None:
        self.boxes: list[Budget] = []

    def new(self, config: SolverConfig) -> Budget:
        box = Budget.of(config)
        self.boxes.append(box)
        return box

    @property
    def spent(self) -> float:
        """The deterministic time spent, counted as the records count it (first-fit by task at
        `RECORDED_GREEDY_DTIME_PER_TASK` in place of the greedy rule's charges; step simulations, which the recorded
        planner did not charge, left out): a comparison of like with like."""
        return sum(
            b.tally.spent - b.tally.simulated - b.tally.greedy + b.tally.greedy_tasks * RECORDED_GREEDY_DTIME_PER_TASK
            for b in self.boxes
        )

    @property
    def capped(self) -> bool:
        """Whether the wall-clock safety net, not the deterministic budget, ended a search (a loaded machine)."""
        return any(b.capped for b in self.boxes)


def _outcome(plan: Plan, boxes: Boxes) -> Outcome:
    m = plan.metrics
    return {
        "refresh": list(m.refresh_steps),
        "bound": list(m.lower_bound_steps),
        "step_ms": m.step_time * 1e3,
        "peak": {str(d): b for d, b in sorted(m.peak_memory.items())},
        "dtime": boxes.spent,
        "status": m.solver.status,
        "strategy": strategy_of(plan),
    }


def _run(plan: Callable[[Boxes], Plan]) -> Outcome:
    boxes = Boxes()
    try:
        out = _outcome(plan(boxes), boxes)
    except PlanError as e:
        out = {"error": str(e).splitlines()[0], "dtime": boxes.spent}
    return {**out, "capped": True} if boxes.capped else out


@dataclass(frozen=True)
class Case:
    """One golden problem: its name, the sets it is in, and how it is planned."""

    name: str
    ci: bool
    plan: Callable[[Boxes], Plan]
    digest: str = ""


def _paper(cfg: PaperConfig, method: str, layers: ProfileLayers, barrier: StepBarrier, pieces: int) -> Case:
    """One paper_configs cell as `paper_configs.planned` plans it (streaming where it keeps the refresh, the
    distributions chosen, max_overhead 0, a 10 s limit for the whole search)."""
    config = SolverConfig(time_limit_s=10.0)

    def plan(boxes: Boxes) -> Plan:
        problem = Problem(cfg.schedule, cfg.D, cfg.N, paper_costs(cfg, layers), decomp_pieces=pieces, barrier=barrier)
        search = SearchOptions(
            config, Method(method), stream_apply=StreamApply.KEEP_REFRESH, time_limit=TimeLimit.EACH_SOLVE
        )
        return plan_search(problem, search, new_budget=lambda: boxes.new(config))

    scope = "global" if barrier is StepBarrier.WORLD else f"no-barrier/{layers.value}"
    return Case(f"paper {cfg.model} {cfg.schedule} D={cfg.D} {scope} {method}", False, plan)


def paper_cases() -> list[Case]:
    """The README table's cells: global scope (per block) greedy and CP-SAT, then no barrier with 4 pieces per
    inversion per block, sublayer and Linear (CP-SAT)."""
    out = []
    for cfg in CONFIGS:
        out += [_paper(cfg, m, ProfileLayers.BLOCK, StepBarrier.WORLD, 1) for m in ("greedy", "cpsat")]
        out += [_paper(cfg, "cpsat", layers, StepBarrier.AGREEMENT_SET, 4) for layers in ProfileLayers]
    return out


def scaling_case(D: int) -> Case:
    """planner_scaling's depth D: 1F1B, N = D, BERT-Large P100 blocks x3 per stage, `plan` at its 60 s limit."""
    config = SolverConfig(time_limit_s=60.0)

    def plan(boxes: Boxes) -> Plan:
        costs = load_cost_table("paper:bert-large/p100", blocks_per_stage=3, n_stages=D, micro_batch_size=32)
        search = SearchOptions(config, strategy=Distributions.GIVEN, stream_apply=StreamApply.OFF)
        return plan_search(Problem("1f1b", D, D, costs), search, budget=boxes.new(config))

    return Case(f"planner_scaling D={D}", False, plan)


def demo_case() -> Case:
    """`fxkfac demo`'s plan="auto" (`fxkfac.autoplan.solve_for`): TinyBert 1F1B D=2 N=4 W=1, eager stages, its
    saved profile (K-FAC's longest refresh period 32), a 10 s limit per placement; the bubbles alone first, else
    the least max_overhead that places it."""
    config = SolverConfig(time_limit_s=10.0)

    def plan(boxes: Boxes) -> Plan:
        problem = Problem("1f1b", 2, 4, CostTable.from_json(DEMO.read_text()), W=1, max_period=32)
        search = SearchOptions(
            config, stream_apply=StreamApply.KEEP_REFRESH, overhead=Overhead.LEAST, time_limit=TimeLimit.EACH_SOLVE
        )
        return plan_search(problem, search, new_budget=lambda: boxes.new(config))

    return Case("demo 1f1b D=2 N=4 (plan='auto')", False, plan)


def snippet_problem() -> Problem:
    """The README snippet's launch (issue 38): TinyBert 1F1B D=2 N=4 W=2 on its profiled cost table, the cpu's
    16 GiB budget, as `fxkfac plan bert-base --stages 2 --microbatches 4 --dp 2 --schedule 1f1b --costs FILE`."""
    costs = CostTable.from_json(README_SNIPPET.read_text())
    return Problem("1f1b", 2, 4, costs, W=2, memory_budget=16 * 2**30)


def snippet_case(strategy: Strategy | None, limit: float, ci: bool = False) -> Case:
    """The snippet planned as `fxkfac plan` does (streaming where it keeps the refresh, sent at the backward's end)
    with `strategy` (None: auto)."""
    config = SolverConfig(time_limit_s=limit)

    def plan(boxes: Boxes) -> Plan:
        search = SearchOptions(
            config,
            strategy=Distributions.CHOSEN if strategy is None else strategy,
            stream_apply=StreamApply.KEEP_REFRESH,
            whole_backward=True,
            time_limit=TimeLimit.EACH_SOLVE,
        )
        return plan_search(snippet_problem(), search, new_budget=lambda: boxes.new(config))

    words = "auto" if strategy is None else str(strategy)
    return Case(f"readme snippet 1f1b D=2 N=4 W=2 {words} {limit:g}s", ci, plan)


def random_problems(n: int = RANDOM) -> list[Problem]:
    """The first `n` of the golden set's random problems, read from `PROBLEMS` (`draw_problems` drew them once)."""
    return [Problem.from_dict(d) for d in json.loads(PROBLEMS.read_text())[:n]]


def draw_problems(n: int = RANDOM) -> list[Problem]:
    """`n` problems of kfac_cases' `problems()` strategy, derandomized. Hypothesis also draws literals it finds in the
    modules loaded at the time, so the same call draws other problems in another process (a test session that
    imported more modules): the golden set keeps the problems it drew, in `PROBLEMS`, and reads them from there."""
    from hypothesis import HealthCheck, Phase, given, settings

    from tests.planner.kfac_cases import problems

    out: list[Problem] = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(problems())
    def collect(p: Problem) -> None:
        out.append(p)

    collect()
    return out[:n]


def digest(problem: Problem) -> str:
    """A short digest of the problem's JSON: a golden record compares plans of the same problem only."""
    return hashlib.sha256(json.dumps(problem.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def random_cases(n: int = RANDOM) -> list[Case]:
    """Each random problem planned by `plan` (the distributions chosen, no streaming) at a 2 s limit."""
    config = SolverConfig(time_limit_s=RANDOM_LIMIT_S)

    def case(i: int, problem: Problem) -> Case:
        def plan(boxes: Boxes) -> Plan:
            search = SearchOptions(config, stream_apply=StreamApply.OFF)
            return plan_search(problem, search, budget=boxes.new(config))

        name = f"random {i:03d} {problem.schedule} D={problem.D} N={problem.N} W={problem.W}"
        return Case(name, i < RANDOM_CI, plan, digest(problem))

    return [case(i, p) for i, p in enumerate(random_problems(n))]


def cases(full: bool) -> Iterator[Case]:
    """The golden set (`full`), or its ci subset."""
    if full:
        yield from paper_cases()
        yield scaling_case(8)
        yield scaling_case(64)
        yield demo_case()
        for strategy in (None, Strategy(StrategyKind.COMM_OPT), Strategy(StrategyKind.MEM_OPT)):
            yield snippet_case(strategy, 10.0)
    yield snippet_case(None, 2.0, ci=True)
    yield from (c for c in random_cases(RANDOM if full else RANDOM_CI) if full or c.ci)


def record(case: Case) -> Outcome:
    """The case planned now, with its digest and wall time (the latter for the reader only)."""
    began = time.perf_counter()
    out = _run(case.plan)
    out["wall_s"] = round(time.perf_counter() - began, 2)
    if case.digest:
        out["digest"] = case.digest
    return out


def verdict(old: Outcome, new: Outcome) -> str:
    """equal, better (something better, nothing worse), "worse: plan" (a refresh period, the step or the peak memory
    worse, or no plan where one was), or "worse: time" (the plan equal or better, found in more deterministic time);
    "changed problem" where the digests differ, "capped" where the wall-clock safety net ended a search of either
    (planner/search/budget.py: that plan depends on the machine's load, so it is not compared). The peak memory is the
    plan's, the most of any device (`planner.plan.rank`'s): a plan may hold more on one device and less on another."""
    if old.get("digest", "") != new.get("digest", ""):
        return "changed problem"
    if old.get("capped") or new.get("capped"):
        return "capped"
    if "error" in old or "error" in new:
        if "error" in old and "error" in new:
            return _by_time(old, new, [])
        return "worse: plan" if "error" in new else "better"
    signs = [_sign(a, b) for a, b in zip(old["refresh"], new["refresh"], strict=True)]
    signs.append(_sign(old["step_ms"], new["step_ms"], 1e-9))
    signs.append(_sign(max(old["peak"].values()), max(new["peak"].values())))
    if any(s > 0 for s in signs):
        return "worse: plan"
    return _by_time(old, new, signs)


def _by_time(old: Outcome, new: Outcome, signs: list[int]) -> str:
    time = _sign(old["dtime"], new["dtime"], DTIME_TOL)
    if time > 0:
        return "worse: time"
    return "better" if any(s < 0 for s in [*signs, time]) else "equal"


def _sign(old: float, new: float, rel: float = 0.0) -> int:
    """+1 when new is worse (larger) than old beyond `rel`, -1 when better, else 0."""
    if math.isclose(old, new, rel_tol=rel, abs_tol=1e-12):
        return 0
    return 1 if new > old else -1


def compare(golden: dict[str, Outcome], now: dict[str, Outcome]) -> dict[str, str]:
    """Each recorded case's verdict ("not run" where `now` lacks it)."""
    return {name: verdict(old, now[name]) if name in now else "not run" for name, old in golden.items()}


def _cell(o: Outcome) -> str:
    if "error" in o:
        return f"no plan ({o['error'][:40]})"
    return f"{' '.join(map(str, o['refresh']))} | {o['step_ms']:.3f} ms | {o['status']} | {o['dtime']:.3f}"


def render(golden: dict[str, Outcome], now: dict[str, Outcome], verdicts: dict[str, str], console: Console) -> None:
    table = Table(title="planner golden set: refresh per stage | step | solver | deterministic s")
    for col in ("case", "golden", "now", "verdict"):
        table.add_column(col)
    for name, v in verdicts.items():
        table.add_row(name, _cell(golden[name]), _cell(now[name]) if name in now else "-", v)
    console.print(table)


def run_set(full: bool, only: Callable[[str], bool] = lambda _: True) -> dict[str, Outcome]:
    """Every case of the set (those `only` keeps) planned now, by name."""
    return {c.name: record(c) for c in cases(full) if only(c.name)}


def load(path: Path = GOLDEN) -> dict[str, Outcome]:
    return dict(json.loads(path.read_text())["cases"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["record", "compare", "draw"], help="draw: draw the random problems anew")
    parser.add_argument("--set", choices=["full", "ci"], default="full")
    parser.add_argument("--golden", type=Path, default=GOLDEN)
    parser.add_argument("--match", default="", help="only the cases whose name contains this")
    args = parser.parse_args(argv)
    if args.mode == "draw":
        PROBLEMS.write_text(json.dumps([p.to_dict() for p in draw_problems()], separators=(",", ":")) + "\n")
        print(json.dumps({"benchmark": "planner_golden", "drew": RANDOM, "file": str(PROBLEMS)}))
        return
    now = run_set(args.set == "full", lambda name: args.match in name)
    if args.mode == "record":
        old = load(args.golden) if args.golden.exists() else {}
        merged = {**old, **now}
        args.golden.write_text(json.dumps({"cases": merged}, indent=1, sort_keys=True) + "\n")
        print(json.dumps({"benchmark": "planner_golden", "recorded": len(now), "file": str(args.golden)}))
        return
    golden = {k: v for k, v in load(args.golden).items() if k in now}
    verdicts = compare(golden, now)
    render(golden, now, verdicts, Console(width=200))
    counts = {v: sum(1 for x in verdicts.values() if x == v) for v in sorted(set(verdicts.values()))}
    print(json.dumps({"benchmark": "planner_golden", "counts": counts, "verdicts": verdicts, "now": now}))


if __name__ == "__main__":
    main()
