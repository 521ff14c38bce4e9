"""plan="auto" profiles the stages on every rank at once, as every rank computes in training, and rank 0 plans with
each figure's median over the ranks (`fxkfac.autoplan.gathered_profile`, `planner.problem.costs.median_of`)."""

from __future__ import annotations

from fxkfac.errors import ConfigError
from fxkfac.planner.problem.costs import CostTable
from tests.planner.kfac_cases import table
from tests.support.distributed import run_distributed

SCALES = (1.0, 10.0, 2.0)


def _table(rank: int) -> CostTable:
    return table(2, layers=2).scale_times(SCALES[rank])


def _gather(rank: int, world: int, failing: int) -> str | None:
    from fxkfac.autoplan import gathered_profile

    def profile() -> CostTable:
        if rank == failing:
            raise ConfigError("no profile here")
        return _table(rank)

    got = gathered_profile(profile, rank)
    return None if got is None else got.to_json() if isinstance(got, CostTable) else f"{type(got).__name__}: {got}"


def test_rank_0_plans_with_the_median_of_every_ranks_profile() -> None:
    results = run_distributed(_gather, 3, -1, timeout=120)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    assert results[1].value is None and results[2].value is None
    assert CostTable.from_json(results[0].value) == _table(2)  # the middle of 1x, 10x and 2x


def test_a_rank_that_cannot_profile_fails_the_plan_on_rank_0_naming_it() -> None:
    results = run_distributed(_gather, 3, 1, timeout=120)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    assert results[0].value == "ConfigError: rank 1 could not profile: no profile here"
