"""Our K-FAC preconditioned gradients against ASDL's KfacGradientMaker (asdfghjkl 0.1a5) on an MLP and a CNN.

Conventions that differ, and how the test reconciles them (read from asdl/operations and asdl/symmatrix.py):
- Bias: ASDL's A has no ones column; it preconditions the weight by B^-1 W A^-1 and the bias by B^-1 b alone.
  Our side is given the weight as a bias-free layer (KFACLayer with bias=None, same A as ASDL), and its bias is
  checked as our b_inv @ g_bias. (Our own bias column is checked against dense references in test_precondition.)
- Damping: ASDL always pi-splits (damping_A = max(pi sqrt(gamma), 1e-7)); we run with pi_damping=True. The
  1e-7 floor never binds here.
- Loss scaling: ASDL sums the loss and divides factors and gradients by data_size = N; that is our mean loss
  with e multiplied by n = N. Fisher type "fisher_emp" (the true loss gradient), as our e.
- Conv2d: ASDL's B sums e e^T over output positions (then / N); ours is the mean over rows (samples x
  positions). So ASDL's B is ours times L (positions per sample); our B is multiplied by L. A agrees (both
  average over positions).
- Running average: ASDL's ema_decay weights the *new* factor and its average starts from zero
  (A_1 = ema * A_new); ours weights the old one and starts from A_new. The multi-step test uses
  decay = 1 - ema and starts our running factors at zero.
- ASDL wraps work in torch.cuda.nvtx ranges, which fail on a CPU-only build; they are replaced by no-ops.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from asdl import KfacGradientMaker, PreconditioningConfig
from torch import nn

from fxkfac.kfac import LayerState, a_rows, e_rows, factor, grad_matrix, invert, precondition, split_grad
from fxkfac.kfac.factors import running_average
from tests.kfac.helpers import capture_a_e, layer_of
from tests.support.models import image_batch, mlp

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

DAMPING = 1e-2
N = 16


@contextlib.contextmanager
def _no_nvtx(*args: object, **kwargs: object) -> Iterator[None]:
    yield


@pytest.fixture(autouse=True)
def _cpu_nvtx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda.nvtx, "range", _no_nvtx)


def _model_and_batch(kind: str, step: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    if kind == "mlp":
        g = torch.Generator().manual_seed(100 + step)
        x, t = torch.randn(N, 12, generator=g), torch.randint(0, 5, (N,), generator=g)
        return mlp(d_in=12, hidden=16, d_out=5), x, t
    x, t = image_batch(N, seed=100 + step)
    torch.manual_seed(0)  # ASDL's im2col rejects dilation, so not tests.support's cnn()
    conv = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 10),
    )
    return conv, x, t


def _our_step(model: nn.Module, x: torch.Tensor, t: torch.Tensor, states: dict[str, LayerState], decay: float):
    """Preconditioned (weight, bias) per K-FAC layer from our API; factors from plain hooks."""
    modules = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    captured = capture_a_e(model, modules, lambda: F.cross_entropy(model(x), t))
    out = {}
    for name, mod in modules.items():
        a, e = captured[name]
        view = dataclasses.replace(layer_of(mod, name), bias=None)  # ASDL's A: no bias column
        positions = e.shape[2] * e.shape[3] if e.dim() == 4 else 1
        state = states[name]
        state.A = running_average(state.A, factor(a_rows(a, view), torch.float64), decay)
        b_new = factor(e_rows(e, view, N), torch.float64) * positions  # ASDL's conv B sums positions
        state.B = running_average(state.B, b_new, decay)
        inv = invert(state.A, state.B, damping=DAMPING, pi_damping=True)
        weight, _ = split_grad(view, precondition(grad_matrix(view, mod.weight.grad, None), inv))
        bias = None if mod.bias is None else inv.b_inv @ mod.bias.grad
        out[name] = (weight, bias)
    return out


def _asdl_step(gm: KfacGradientMaker, model: nn.Module, x: torch.Tensor, t: torch.Tensor) -> None:
    model.zero_grad()  # ASDL accumulates into .grad, like a plain backward
    dummy_y = gm.setup_model_call(model, x)
    gm.setup_loss_call(F.cross_entropy, dummy_y, t)
    gm.forward_and_backward()


def _compare(ours: dict, ref_model: nn.Module) -> None:
    ref = dict(ref_model.named_modules())
    for name, (weight, bias) in ours.items():
        torch.testing.assert_close(weight, ref[name].weight.grad, rtol=1e-9, atol=1e-12, msg=f"{name}.weight")
        if bias is not None:
            torch.testing.assert_close(bias, ref[name].bias.grad, rtol=1e-9, atol=1e-12, msg=f"{name}.bias")


def _sgd(model: nn.Module, lr: float = 0.1) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_single_refresh_matches_asdl(kind: str) -> None:
    """Without an EMA ASDL inverts the factors of the current batch: our first refresh."""
    model, x, t = _model_and_batch(kind, 0)
    model = model.double()
    ref = copy.deepcopy(model)
    gm = KfacGradientMaker(ref, PreconditioningConfig(damping=DAMPING, data_size=N), fisher_type="fisher_emp")
    _asdl_step(gm, ref, x.double(), t)
    states = {n: LayerState() for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    _compare(_our_step(model, x.double(), t, states, decay=0.9), ref)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_running_average_over_training_steps_matches_asdl_ema(kind: str) -> None:
    """Three steps with parameter updates in between: factors, running averages and inverses stay equal."""
    decay = 0.7
    model, _, _ = _model_and_batch(kind, 0)
    model = model.double()
    ref = copy.deepcopy(model)
    config = PreconditioningConfig(damping=DAMPING, data_size=N, ema_decay=1 - decay)
    gm = KfacGradientMaker(ref, config, fisher_type="fisher_emp")
    states = {}
    for n, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            states[n] = LayerState()
            a_dim = m.weight[0].numel()
            states[n].A = torch.zeros(a_dim, a_dim, dtype=torch.float64)  # ASDL's EMA starts from zero
            states[n].B = torch.zeros(m.weight.shape[0], m.weight.shape[0], dtype=torch.float64)
    for step in range(3):
        _, x, t = _model_and_batch(kind, step)
        _asdl_step(gm, ref, x.double(), t)
        ours = _our_step(model, x.double(), t, states, decay)
        _compare(ours, ref)
        _sgd(ref)
        with torch.no_grad():
            for name, (weight, bias) in ours.items():
                mod = model.get_submodule(name)
                mod.weight.grad = weight
                if bias is not None:
                    mod.bias.grad = bias
        _sgd(model)
