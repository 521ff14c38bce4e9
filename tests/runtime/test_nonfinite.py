"""The runtime's NaN/Inf check of losses and gradients: exact, also where a float32 sum overflows (of one tensor,
or of a tied weight's gradients summed across stages)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from fxkfac.config import KLClipScope
from fxkfac.runtime.p2p import TagSpace, Transport
from fxkfac.runtime.step_end import NonFiniteCheck, StepEnd, unclipped
from tests.runtime.workers import tied_overflow_worker
from tests.support.distributed import run_distributed

BIG = torch.full((10,), 3e38)  # finite values whose float32 sum is inf


@pytest.mark.parametrize(
    "tensors,expected",
    [
        ([], False),
        ([torch.ones(3), torch.zeros(())], False),
        ([BIG], False),
        ([BIG, torch.ones(2, dtype=torch.bfloat16)], False),
        ([torch.ones(3), torch.tensor([1.0, float("nan")])], True),
        ([torch.tensor([float("inf")])], True),
        ([BIG, torch.tensor([float("-inf")])], True),
        ([torch.tensor([float("nan")], dtype=torch.bfloat16)], True),
    ],
)
@pytest.mark.parametrize("scope", [KLClipScope.GLOBAL, KLClipScope.STAGE])
def test_nonfinite_matches_isfinite(tensors: list[torch.Tensor], expected: bool, scope: KLClipScope) -> None:
    """A step's verdict from its check (one rank: each sum leaves its tensor) skips exactly where a tensor holds
    NaN/Inf."""
    end = StepEnd.build(scope, Transport(0, 1, TagSpace(1, 1, 1), timedelta(seconds=1)), [(0,)], {0: [0]})
    assert (
        end.finish(
            {0: torch.zeros((), dtype=torch.float64)}, NonFiniteCheck.of(tensors), torch.zeros(()), unclipped
        ).skip
        is expected
    )
    assert expected == any(not bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.multiproc
def test_tied_gradients_whose_sum_overflows_skip_the_step_on_every_rank() -> None:
    """Each stage's part of a tied weight's gradient is finite, their sum is not: OPT_STEP sums tied gradients
    before the verdict (with a preconditioner too), so every rank skips the step and keeps its parameters."""
    results = run_distributed(tied_overflow_worker, 2, timeout=300)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for r in results:
        for run, v in r.value.items():
            assert v["tied"], "the model has no weight shared by both stages"
            assert (v["skipped"], v["steps"]) == (1, 1), (
                f"{run} rank {r.rank}: skipped {v['skipped']}, stepped {v['steps']}"
            )
            for name, value in v["before"].items():
                assert torch.equal(value, v["after"][name]), f"{run} rank {r.rank}: {name} changed in a skipped step"


def _verdict(rank: int, world: int, scope: KLClipScope, held: dict[int, list[float]]) -> bool:
    """The verdict of one step end over two ranks, rank r's check made of `held[r]`."""
    transport = Transport(rank, world, TagSpace(2, 4, 3), timedelta(seconds=60))
    end = StepEnd.build(scope, transport, [(0, 1)], {0: [0], 1: [1]})
    end.post(1)
    check = NonFiniteCheck.of([torch.tensor(held[rank])])
    verdict = end.finish({0: torch.zeros((), dtype=torch.float64)}, check, torch.zeros(()), unclipped)
    transport.flush()
    return verdict.skip


@pytest.mark.multiproc
@pytest.mark.parametrize("scope", [KLClipScope.GLOBAL, KLClipScope.STAGE])
@pytest.mark.parametrize(
    "held,expected",
    [
        ({0: [3e38, 3e38], 1: [1.0]}, False),  # rank 0's float32 sum overflows: the exact checks agree it is finite
        ({0: [1.0], 1: [float("nan")]}, True),
        ({0: [3e38, 3e38], 1: [float("-inf")]}, True),
    ],
)
def test_every_rank_takes_one_verdict_where_a_check_sum_is_not_finite(
    scope: KLClipScope, held: dict[int, list[float]], expected: bool
) -> None:
    results = run_distributed(_verdict, 2, scope, held, timeout=120)
    assert all(r.ok for r in results), [r.traceback for r in results]
    assert [r.value for r in results] == [expected, expected]
