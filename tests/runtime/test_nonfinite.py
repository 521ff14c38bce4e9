"""The runtime's NaN/Inf check of losses and gradients: exact, also where a float32 sum overflows (of one tensor,
or of a tied weight's gradients summed across stages)."""

from __future__ import annotations

import pytest
import torch

from fxkfac.runtime.interpreter import _nonfinite
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
def test_nonfinite_matches_isfinite(tensors: list[torch.Tensor], expected: bool) -> None:
    assert _nonfinite(tensors) is expected
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
