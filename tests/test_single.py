"""Single-device trainer: parameters after a few steps equal an independent eager + hooks + fxkfac.kfac reference."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fxkfac
from fxkfac.config import KFACConfig
from fxkfac.planner.problem.ir import LayerTiming
from fxkfac.runtime.trainer import Trainer
from tests.support.kfac_reference import KFACReference
from tests.support.models import cnn, image_batch, mlp, mlp_batches, tiny_gpt2, token_batch

LR = 0.05


def _sgd(params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _ce(out: object, targets: Tensor) -> Tensor:
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _mse(out: Tensor, targets: Tensor) -> Tensor:
    return F.mse_loss(out, targets)


def _compare(
    make: Callable[[], nn.Module],
    batches: list[tuple[Tensor, Tensor]],
    loss_fn,
    *,
    cfg: KFACConfig | None,
    microbatches: int = 1,
    backend: str | None = None,
    layer_timing: dict[str, LayerTiming] | None = None,
    rtol: float = 1e-4,
) -> Trainer:
    model = make()
    ref_model = copy.deepcopy(model)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = fxkfac.compile(
        model,
        None,
        example_inputs=(batches[0][0],),
        loss_fn=loss_fn,
        optimizer=_sgd,
        preconditioner=cfg,
        microbatches=microbatches,
        backend=backend,
        layer_timing=layer_timing,
    )
    timings = dict(trainer.timings)
    ref = KFACReference(ref_model, trainer.units, cfg, loss_fn, microbatches, timings, _sgd)
    for t, (x, y) in enumerate(batches):
        loss = trainer.step(x, y)
        with torch.no_grad():
            assert loss == pytest.approx(float(loss_fn(ref_model(x), y)), rel=1e-4)
        ref.step(t, x, y)
    ref_params = dict(ref_model.named_parameters())
    moved = 0.0
    for name, p in trainer.named_parameters():
        torch.testing.assert_close(
            p,
            ref_params[name],
            rtol=rtol,
            atol=rtol * float(ref_params[name].abs().max()),
            msg=lambda m, name=name: f"{name}: {m}",
        )
        moved = max(moved, float((p - initial[name]).abs().max()))
    assert moved > 1e-3, "training did not move the parameters: the comparison would be vacuous"
    return trainer


def _image_batches(k: int) -> list[tuple[Tensor, Tensor]]:
    return [image_batch(8, seed=s) for s in range(k)]


def test_mlp_kfac_two_microbatches_refresh_every_two() -> None:
    cfg = KFACConfig(damping=1e-2, refresh_every=2, factor_decay=0.9)
    trainer = _compare(mlp, mlp_batches(5, seed=5), _mse, cfg=cfg, microbatches=2)
    assert all(state.refreshes == 3 for state in trainer.layer_states.values())


def test_cnn_kfac_deferred_with_staggered_timing() -> None:
    timing = {"conv1": LayerTiming(2, 1, 1, "deferred"), "head": LayerTiming(1, 0, 0, "fused")}
    cfg = KFACConfig(damping=1e-2, capture="deferred", kl_clip=1e-2)
    _compare(cnn, _image_batches(4), _ce, cfg=cfg, microbatches=2, layer_timing=timing)


def test_gpt2_kfac_conv1d_layers() -> None:
    batches = [token_batch(4, seed=s) for s in range(3)]
    with pytest.warns(UserWarning, match="use_cache"):
        _compare(tiny_gpt2, batches, _ce, cfg=KFACConfig(damping=1e-2), microbatches=2, rtol=2e-4)


def test_kfac_none_equals_plain_training() -> None:
    trainer = _compare(cnn, _image_batches(3), _ce, cfg=None, microbatches=2)
    assert trainer.units == [] and trainer.layer_states == {}


@pytest.mark.compile
def test_inductor_backend_equals_reference() -> None:
    cfg = KFACConfig(damping=1e-2, refresh_every=2, capture="deferred")
    _compare(mlp, mlp_batches(3, seed=5), _mse, cfg=cfg, microbatches=2, backend="inductor", rtol=1e-3)


def test_state_dict_round_trip_continues_identically() -> None:
    cfg = KFACConfig(damping=1e-2, refresh_every=2)
    batches = mlp_batches(4, seed=5)
    a = fxkfac.compile(
        mlp(), None, example_inputs=(batches[0][0],), loss_fn=_mse, optimizer=_sgd, preconditioner=cfg, backend=None
    )
    for x, y in batches[:3]:
        a.step(x, y)
    b = fxkfac.compile(
        mlp(seed=7),
        None,
        example_inputs=(batches[0][0],),
        loss_fn=_mse,
        optimizer=_sgd,
        preconditioner=cfg,
        backend=None,
    )
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert b.steps == 3 and set(b.state_dict()["kfac"]) == {layer.name for layer in a.units}
    x, y = batches[3]
    assert a.step(x, y) == b.step(x, y)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
