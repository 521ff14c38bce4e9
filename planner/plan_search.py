"""`plan(problem, options)`: the planner's one entry point, the whole search (streaming, strategy, recompute, overhead).

[Note: plan search] Every caller (plan="auto", `fxkfac plan`, the benchmarks) plans through `plan`, which composes,
outside in: the max_overhead rule (`Overhead`: the problem's own, or the bubbles alone first and else the least the
refusal names, `planner.choose.least_overhead`), activation checkpointing's choice of stages
(`planner.recompute.plan_recomputing`), the distributions (forced, as given, or chosen by
`planner.choose.solve_with_strategy`, which plans each candidate as forcing it would) and streaming the first stage's
APPLY (`planner.stream_choice.solve_streamed`) around each placement. Every search of it is a candidate of one search
in one `planner.budget.Budget` ([Note: one budget]): the streamed try and the plan without streaming, each candidate
distribution and the joint choice, fusing rounds, the recompute choices and a refusal's suggestions each take a part
of what is left, and the streaming and distribution choices' simulations are charged to it. Under
TimeLimit.WHOLE_SEARCH (`fxkfac plan`, plan="auto") the time limit bounds it all; TimeLimit.EACH_SOLVE gives each
placement the whole limit (the benchmarks' golden records were made that way), each candidate distribution of the
choice too: the budget forcing it gets, so the choice is never worse than forcing any candidate (issue 38). A budget
keeps every plan it made, so a retry of a problem it planned takes no more time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum

from fxkfac.planner.attempt import Method
from fxkfac.planner.budget import Budget
from fxkfac.planner.errors import ConfigError
from fxkfac.planner.plan import Plan
from fxkfac.planner.problem import Problem, SolverConfig
from fxkfac.planner.recompute import plan_recomputing
from fxkfac.planner.solve import solve
from fxkfac.planner.step_timeline import step_timeline
from fxkfac.planner.strategy import Strategy
from fxkfac.planner.stream_choice import StreamApply, solve_streamed, with_streaming

__all__ = ["Distributions", "Overhead", "SearchOptions", "TimeLimit", "plan"]


class Distributions(StrEnum):
    """Where each layer's work lives among its stage's copies when no Strategy is forced: chosen by the planner
    ([Note: strategy search] in planner/choose.py), or the problem's own `distributions` as given."""

    CHOSEN = "chosen"
    GIVEN = "given"


class TimeLimit(StrEnum):
    """What `SolverConfig.time_limit_s` bounds: the WHOLE_SEARCH (one Budget for all of it, off-clock simulations
    and suggestions included: what plan="auto" and `fxkfac plan` use, so `--time-limit` bounds the command), or
    EACH_SOLVE (a budget per placement: the streamed try, the plan without streaming, each candidate distribution
    and the least-overhead retry each get the whole limit, as the golden records were planned)."""

    WHOLE_SEARCH = "whole-search"
    EACH_SOLVE = "each-solve"


class Overhead(StrEnum):
    """How the problem's max_overhead is read: STRICT, a bound the plan keeps; LEAST, the rule of max_overhead None
    (the API's and `fxkfac plan`'s default): the bubbles alone (0) first, else the least max_overhead the refusal
    names (`planner.choose.least_overhead`)."""

    STRICT = "strict"
    LEAST = "least"


@dataclass(frozen=True)
class SearchOptions:
    """What `plan` searches besides the placement: the solver's limits, the distributions, streaming, activation
    checkpointing and the max_overhead rule."""

    solver: SolverConfig = field(default_factory=SolverConfig)
    """Time limit (read by `time_limit`), deterministic clock, progress observer."""
    method: Method = Method.CPSAT
    strategy: Strategy | Distributions = Distributions.CHOSEN
    """A Strategy every layer follows, or `Distributions` (chosen by the planner, or the problem's own)."""
    stream_apply: StreamApply = StreamApply.KEEP_REFRESH
    whole_backward: bool = False
    """The stages run compiled: a backward makes every gradient at its end (`planner.streaming.Streaming`)."""
    choose_recompute: bool = False
    """Activation checkpointing AUTO: the planner chooses which stages recompute for the memory budget; False:
    the problem's own `recompute`."""
    overhead: Overhead = Overhead.STRICT
    time_limit: TimeLimit = TimeLimit.WHOLE_SEARCH

    def __post_init__(self) -> None:
        if not isinstance(self.solver, SolverConfig):
            raise ConfigError(f"SearchOptions.solver must be a SolverConfig, got {self.solver!r}")
        try:
            object.__setattr__(self, "method", Method(self.method))
            object.__setattr__(self, "stream_apply", StreamApply(self.stream_apply))
            object.__setattr__(self, "overhead", Overhead(self.overhead))
            object.__setattr__(self, "time_limit", TimeLimit(self.time_limit))
        except ValueError as e:
            raise ConfigError(f"SearchOptions: {e}") from None
        if not isinstance(self.strategy, (Strategy, Distributions)):
            raise ConfigError(
                f"SearchOptions.strategy must be a Strategy or Distributions.CHOSEN/GIVEN, got {self.strategy!r}"
            )


def plan(
    problem: Problem,
    options: SearchOptions = SearchOptions(),
    *,
    budget: Budget | None = None,
    new_budget: Callable[[], Budget] | None = None,
) -> Plan:
    """The plan of `problem` by the whole search `options` ask for ([Note: plan search]). TimeLimit.WHOLE_SEARCH:
    everything in `budget`, else a new one of `options.solver` that ends the whole search within its time limit
    (`Budget.of(..., whole=True)`; a command passes one opened at its start). TimeLimit.EACH_SOLVE: each placement in
    a budget of its own (`new_budget()`, else a new one), the search around them untimed. Raises the planner's
    PlanError (with its suggestions) when nothing plans. Under Overhead.LEAST the problem's max_overhead must be 0
    (the rule's first try); the plan's `problem.max_overhead` is the value it took."""
    if options.overhead is Overhead.LEAST and problem.max_overhead != 0:
        raise ConfigError(
            f"Overhead.LEAST plans at max_overhead 0 first, but the problem has {problem.max_overhead:g}; "
            "use Overhead.STRICT to plan within it"
        )
    from fxkfac.planner.choose import least_overhead, solve_with_strategy  # loads ortools: at the first plan only

    config, method = options.solver, options.method
    each_solve = options.time_limit is TimeLimit.EACH_SOLVE
    whole = Budget.untimed(config.deterministic) if each_solve else budget or Budget.of(config, whole=True)

    def own(view: Budget) -> Budget:
        """The budget a placement runs in: its part of the whole, or under EACH_SOLVE one of its own."""
        if not each_solve:
            return view
        return new_budget() if new_budget is not None else Budget.of(config)

    def solved(p: Problem, view: Budget, *, suggest: bool = True) -> Plan:
        """The placement of `p`'s own distributions (forced or given)."""
        return solve(p, config, method, budget=own(view), suggest=suggest)

    def streamed(p: Problem, view: Budget) -> Plan:
        """`solved` with streaming where it pays (`planner.stream_choice.solve_streamed`)."""
        return solve_streamed(p, solved, options.stream_apply, whole_backward=options.whole_backward, budget=view)

    choices: dict[int, tuple[Problem, Problem]] = {}

    def streaming_of(p: Problem) -> Problem:
        """`p` with the streaming a forced planning of it would choose (`with_streaming`, once per candidate)."""
        if id(p) not in choices:
            keep = options.stream_apply is StreamApply.KEEP_REFRESH
            choices[id(p)] = (p, with_streaming(p, options.whole_backward, keep_bounds=keep, budget=whole))
        return choices[id(p)][1]

    def reference(p: Problem) -> float:
        """The least reference step a candidate reaches, streaming included: the choice's allowance is of it."""
        return step_timeline(streaming_of(p)).length

    def candidate(p: Problem, view: Budget, shares: int) -> Plan:
        """One distribution of the choice, planned as forcing it would be (streaming included): with all the time
        left, so the first that can win is planned as forcing it would be, and the others in what it leaves (the
        `shares` left are not taken); its refusal names nothing (the choice's own refusal searches what would plan)."""

        def quiet(q: Problem, b: Budget, *, suggest: bool = True) -> Plan:
            return solved(q, b, suggest=False)

        return solve_streamed(
            p,
            quiet,
            options.stream_apply,
            whole_backward=options.whole_backward,
            budget=view,
            streamed=streaming_of(p),
        )

    def placed(p: Problem) -> Plan:
        """The placement: the distributions chosen, each candidate with streaming where it pays (issue 38: so the
        choice is never worse than a forced candidate), or those of `p` (forced, then only the layers the strategy
        leaves COMM-OPT may stream, or given)."""
        if options.strategy is Distributions.CHOSEN:
            off = options.stream_apply is StreamApply.OFF
            each, ref = (None, None) if off else (candidate, reference)
            if each_solve:  # each candidate in a budget of its own, as forcing it would be planned
                return solve_with_strategy(p, None, config, method, each=each, reference=ref, own=lambda: own(whole))
            return solve_with_strategy(p, None, config, method, budget=whole, each=each, reference=ref)
        given = p.with_strategy(options.strategy) if isinstance(options.strategy, Strategy) else p
        return streamed(given, whole)

    def recomputing(p: Problem) -> Plan:
        return plan_recomputing(p, placed) if options.choose_recompute else placed(p)

    if options.overhead is Overhead.STRICT:
        return recomputing(problem)
    made, _ = least_overhead(lambda value: recomputing(replace(problem, max_overhead=value)))
    return made
