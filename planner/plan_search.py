"""`plan(problem, options)`: the planner's one entry point, the whole search (streaming, strategy, recompute, overhead).

[Note: plan search] Every caller (plan="auto", `fxkfac plan`, the benchmarks) plans through `plan`, which composes,
outside in: the max_overhead rule (`Overhead`: the problem's own, or the bubbles alone first and else the least the
refusal names, `planner.choose.least_overhead`), activation checkpointing's choice of stages
(`planner.recompute.plan_recomputing`), streaming the first stage's APPLY (`planner.stream_choice.solve_streamed`)
and the distributions (forced, as given, or chosen by `planner.choose.solve_with_strategy`). Every solve of it, and
a refusal's search for suggestions, runs in a `TimeBox` ([Note: time limit] in planner/solve.py): one for the whole
search, or one per placement (`TimeLimit`: what plan="auto" and `fxkfac plan` use, since one box for everything
made worse plans); a box keeps every plan it made, so a retry of a problem it planned takes no more time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum

from fxkfac.planner.attempt import Method
from fxkfac.planner.errors import ConfigError
from fxkfac.planner.plan import Plan
from fxkfac.planner.problem import Problem, SolverConfig
from fxkfac.planner.recompute import plan_recomputing
from fxkfac.planner.solve import TimeBox, solve
from fxkfac.planner.strategy import Strategy
from fxkfac.planner.stream_choice import StreamApply, solve_streamed

__all__ = ["Distributions", "Overhead", "SearchOptions", "TimeLimit", "plan"]


class Distributions(StrEnum):
    """Where each layer's work lives among its stage's copies when no Strategy is forced: chosen by the planner
    ([Note: strategy search] in planner/choose.py), or the problem's own `distributions` as given."""

    CHOSEN = "chosen"
    GIVEN = "given"


class TimeLimit(StrEnum):
    """What `SolverConfig.time_limit_s` bounds: the WHOLE_SEARCH (one TimeBox for every solve), or EACH_SOLVE (a box
    per placement: the streamed try, the plan without streaming and the least-overhead retry each get the whole
    limit; what plan="auto" and `fxkfac plan` use). One box for the whole search made worse plans: the paper's
    BERT-Large Chimera refreshed every 5 on two stages instead of 4, and a fresh launch of the README's 2 x 2 mesh got
    first-fit's 28 31 after the streamed try spent the box, where its own box plans 25 26 (issue 38)."""

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
    """Time limit (for the whole search), deterministic clock, progress observer."""
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
    box: TimeBox | None = None,
    new_box: Callable[[], TimeBox] | None = None,
) -> Plan:
    """The plan of `problem` by the whole search `options` ask for ([Note: plan search]), every solve in `box` (a
    new one of `options.solver`: one time limit for all), or under TimeLimit.EACH_SOLVE each placement in a box of
    its own (`new_box()`, else a new one). Raises the planner's PlanError (with its suggestions) when nothing plans.
    Under Overhead.LEAST the problem's max_overhead must be 0 (the rule's first try); the plan's
    `problem.max_overhead` is the value it took."""
    if options.overhead is Overhead.LEAST and problem.max_overhead != 0:
        raise ConfigError(
            f"Overhead.LEAST plans at max_overhead 0 first, but the problem has {problem.max_overhead:g}; "
            "use Overhead.STRICT to plan within it"
        )
    from fxkfac.planner.choose import least_overhead, solve_with_strategy  # loads ortools: at the first plan only

    config, method = options.solver, options.method
    whole = box or TimeBox(config)

    def box_of_solve() -> TimeBox:
        if options.time_limit is TimeLimit.WHOLE_SEARCH:
            return whole
        return new_box() if new_box is not None else TimeBox(config)

    def placed(p: Problem, *, suggest: bool = True) -> Plan:
        """The placement, with the distributions chosen, or those of `p` (forced or given); `suggest` False where
        the refusal is only logged (`planner.stream_choice.Solver`)."""
        if options.strategy is Distributions.CHOSEN:
            return solve_with_strategy(p, None, config, method, box=box_of_solve(), suggest=suggest)
        return solve(p, config, method, box=box_of_solve(), suggest=suggest)  # a forced strategy is in `p`

    def streamed(p: Problem) -> Plan:
        """`placed` with streaming where it pays; a forced strategy first, so that only the layers it leaves
        COMM-OPT may stream."""
        given = p.with_strategy(options.strategy) if isinstance(options.strategy, Strategy) else p
        return solve_streamed(given, placed, options.stream_apply, whole_backward=options.whole_backward)

    def recomputing(p: Problem) -> Plan:
        return plan_recomputing(p, streamed) if options.choose_recompute else streamed(p)

    if options.overhead is Overhead.STRICT:
        return recomputing(problem)
    made, _ = least_overhead(lambda value: recomputing(replace(problem, max_overhead=value)))
    return made
