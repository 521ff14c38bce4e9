"""K-FAC through fxkfac.compile(model, None, ...) trains faster than tuned AdamW on scikit-learn's digits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import fxkfac
from fxkfac import KFACConfig
from tests.support.threads import one_thread  # noqa: F401  # autouse: single-threaded like the benchmark

STEPS = 100
BATCH = 128
ADAMW_LRS = (1e-2, 3e-2, 1e-1)  # the best of these is the baseline (1e-2 for the MLP, 3e-2 for the CNN)


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:1400]
    return x[order], torch.tensor(data.target, dtype=torch.long)[order]


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out: list[torch.Tensor] = []
    while len(out) < STEPS:
        perm = torch.randperm(n, generator=g)
        out += [perm[i : i + BATCH] for i in range(0, n - BATCH + 1, BATCH)]
    return out[:STEPS]


def _full_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def _adamw(kind: str, lr: float, x: torch.Tensor, y: torch.Tensor) -> float:
    """The baseline in plain PyTorch, independent of fxkfac."""
    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for idx in _batches(len(x)):
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return _full_loss(model, x, y)


def _kfac(kind: str, x: torch.Tensor, y: torch.Tensor) -> float:
    model = _model(kind)
    trainer = fxkfac.compile(
        model,
        None,
        example_inputs=(x[:BATCH],),
        loss_fn=F.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        preconditioner=KFACConfig(damping=1e-2, factor_decay=0.95, kl_clip=1e-3),
        backend=None,
    )
    for idx in _batches(len(x)):
        trainer.step((x[idx],), y[idx])
    return _full_loss(model, x, y)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_kfac_training_loss_beats_tuned_adamw(kind: str, digits: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = digits
    start = _full_loss(_model(kind), x, y)
    adamw = min(_adamw(kind, lr, x, y) for lr in ADAMW_LRS)
    kfac = _kfac(kind, x, y)
    assert adamw < 0.1 * start, "the AdamW baseline itself should train"
    assert kfac < adamw, f"K-FAC reached {kfac:.4g} after {STEPS} steps, AdamW's best {adamw:.4g}"
