"""The runtime's NaN/Inf check of losses and gradients: exact, also where a float32 sum overflows."""

from __future__ import annotations

import pytest
import torch

from fxkfac.runtime.interpreter import _nonfinite

BIG = torch.full((10,), 3e38)  # finite values whose float32 sum is inf


@pytest.mark.parametrize("tensors,expected", [
    ([], False),
    ([torch.ones(3), torch.zeros(())], False),
    ([BIG], False),
    ([BIG, torch.ones(2, dtype=torch.bfloat16)], False),
    ([torch.ones(3), torch.tensor([1.0, float("nan")])], True),
    ([torch.tensor([float("inf")])], True),
    ([BIG, torch.tensor([float("-inf")])], True),
    ([torch.tensor([float("nan")], dtype=torch.bfloat16)], True),
])
def test_nonfinite_matches_isfinite(tensors: list[torch.Tensor], expected: bool) -> None:
    assert _nonfinite(tensors) is expected
    assert expected == any(not bool(torch.isfinite(t).all()) for t in tensors)
