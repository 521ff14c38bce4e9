"""Factors from a_rows/e_rows against explicit loops over patches and tokens; running average; dtype."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from torch import nn

from fxkfac.errors import ConfigError
from fxkfac.kfac import a_rows, e_rows, factor, running_average
from fxkfac.passes.factor_capture import gram
from tests.kfac.helpers import layer_of


def _naive_patch_factor(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """A by an explicit loop: zero-pad, visit every output position, read the dilated patch, sum outer products."""
    kh, kw = conv.kernel_size
    (sh, sw), (dh, dw) = conv.stride, conv.dilation
    ph, pw = cast(tuple[int, int], conv.padding)  # the cases below give padding as numbers, never 'same'
    xp = torch.zeros(x.shape[0], x.shape[1], x.shape[2] + 2 * ph, x.shape[3] + 2 * pw, dtype=x.dtype)
    xp[:, :, ph : ph + x.shape[2], pw : pw + x.shape[3]] = x
    out_h = (x.shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    out_w = (x.shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    side = x.shape[1] * kh * kw + (conv.bias is not None)
    total, rows = torch.zeros(side, side, dtype=x.dtype), 0
    for n in range(x.shape[0]):
        for i in range(out_h):
            for j in range(out_w):
                patch = xp[n, :, i * sh : i * sh + dh * (kh - 1) + 1 : dh, j * sw : j * sw + dw * (kw - 1) + 1 : dw]
                col = patch.reshape(-1)
                if conv.bias is not None:
                    col = torch.cat([col, col.new_ones(1)])
                total = total + torch.outer(col, col)
                rows += 1
    return total / rows


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(2, 3, 3, stride=2, padding=1, dilation=2),
        nn.Conv2d(3, 2, (2, 3), stride=(1, 2), padding=(2, 0), bias=False),
        nn.Conv2d(1, 4, 1),
    ],
    ids=["s2_p1_d2_bias", "rect_nobias", "1x1"],
)
def test_conv_a_factor_equals_naive_patch_loop(conv: nn.Conv2d) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, conv.in_channels, 7, 8, dtype=torch.float64)
    A = factor(a_rows(x, layer_of(conv)), torch.float64)
    torch.testing.assert_close(A, _naive_patch_factor(x, conv), rtol=1e-12, atol=1e-12)


def test_conv_b_factor_equals_per_position_sum() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3)
    e = torch.randn(4, 3, 5, 6, dtype=torch.float64)
    n = 4
    total = sum(torch.outer(e[s, :, i, j], e[s, :, i, j]) for s in range(4) for i in range(5) for j in range(6))
    expected = total * n * n / (4 * 5 * 6)
    torch.testing.assert_close(factor(e_rows(e, layer_of(conv), n), torch.float64), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_token_factors_equal_per_token_sums(bias: bool) -> None:
    """Inputs [samples, tokens, d]: A and B are the mean over every (sample, token) of the outer products."""
    torch.manual_seed(0)
    lin = nn.Linear(5, 3, bias=bias)
    layer = layer_of(lin)
    a = torch.randn(4, 6, 5, dtype=torch.float64)
    e = torch.randn(4, 6, 3, dtype=torch.float64)
    n = 16  # samples in the global mini-batch (this micro-batch holds 4 of them)
    a_total = torch.zeros(lin.in_features + bias, lin.in_features + bias, dtype=torch.float64)
    b_total = torch.zeros(3, 3, dtype=torch.float64)
    for s in range(4):
        for t in range(6):
            col = torch.cat([a[s, t], a.new_ones(1)]) if bias else a[s, t]
            a_total = a_total + torch.outer(col, col)
            b_total = b_total + torch.outer(n * e[s, t], n * e[s, t])
    torch.testing.assert_close(factor(a_rows(a, layer), torch.float64), a_total / 24, rtol=1e-12, atol=0)
    torch.testing.assert_close(factor(e_rows(e, layer, n), torch.float64), b_total / 24, rtol=1e-12, atol=0)


def test_factor_dtype_defaults_to_float32_and_can_be_chosen() -> None:
    rows = torch.randn(10, 3, dtype=torch.bfloat16)
    assert factor(rows).dtype == torch.float32
    assert factor(rows.double(), torch.float64).dtype == torch.float64


def test_running_average_weights_the_old_value_by_decay() -> None:
    new = torch.full((2, 2), 3.0)
    assert running_average(None, new, 0.9) is new
    old = torch.full((2, 2), 1.0)
    torch.testing.assert_close(running_average(old, new, 0.9), torch.full((2, 2), 0.9 * 1.0 + 0.1 * 3.0))


def test_shape_mismatches_name_the_layer() -> None:
    layer = layer_of(nn.Linear(5, 3), name="enc.fc")
    with pytest.raises(ConfigError, match="enc.fc"):
        a_rows(torch.randn(2, 4), layer)
    with pytest.raises(ConfigError, match="enc.fc"):
        e_rows(torch.randn(2, 4), layer, 2)
    with pytest.raises(ConfigError, match="conv2d"):
        a_rows(torch.randn(2, 3, 4), layer_of(nn.Conv2d(3, 2, 2)))


def test_factor_dtype_by_name() -> None:
    rows = torch.randn(10, 3)
    assert factor(rows, "float64").dtype == torch.float64
    with pytest.raises(ConfigError, match="floating"):
        factor(rows, "int32")
    with pytest.raises(ConfigError, match="floating"):
        factor(rows, "float17")


def test_running_average_and_factor_round_as_the_plain_expressions() -> None:
    """The fewer-temporaries forms give bit for bit ``old * d + new * (1 - d)`` and ``r^T r / rows``."""
    g = torch.Generator().manual_seed(0)
    old, new = torch.randn(33, 33, generator=g), torch.randn(33, 33, generator=g)
    assert torch.equal(running_average(old, new, 0.95), old * 0.95 + new * (1.0 - 0.95))
    mixed = running_average(old, new.double(), 0.95)  # dtypes differ: promoted as the plain expression does
    assert mixed.dtype == torch.float64 and torch.equal(mixed, old * 0.95 + new.double() * (1.0 - 0.95))
    rows = torch.randn(17, 9, generator=g)
    assert torch.equal(factor(rows), (rows.t() @ rows) / 17)


@pytest.mark.parametrize("shape", [(300, 517), (64, 1025), (40, 256)], ids=["rows<dim", "8_panels", "2_panels"])
def test_gram_by_panels_equals_one_gemm_and_is_symmetric(shape: tuple[int, int]) -> None:
    """The panel Gram (a syrk) is ``r^T r / rows`` to float64 rounding, and symmetric bit for bit."""
    rows = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = gram(rows)
    assert torch.equal(got, got.t())
    torch.testing.assert_close(got, rows.t() @ rows / shape[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(factor(rows.float()), got.float(), rtol=1e-5, atol=1e-5)
