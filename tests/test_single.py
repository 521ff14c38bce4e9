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
from fxkfac.kfac.factors import running_average
from fxkfac.kfac.inverse import Inverse, invert
from fxkfac.kfac.precondition import grad_matrix, kl_clip_scale, precondition, split_grad
from fxkfac.passes.layers import KFACLayer
from fxkfac.planner.ir import LayerTiming
from fxkfac.runtime.trainer import Trainer
from tests.passes.reference import hook_factors
from tests.support.models import cnn, image_batch, mlp, tiny_gpt2, token_batch

LR = 0.05


def _sgd(params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _ce(out: object, targets: Tensor) -> Tensor:
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _mse(out: Tensor, targets: Tensor) -> Tensor:
    return F.mse_loss(out, targets)


class _Reference:
    """K-FAC by the book on the eager model: hooks for a / e, fxkfac.kfac for the layer math."""

    def __init__(self, model: nn.Module, layers: Sequence[KFACLayer], cfg: KFACConfig | None,
                 loss_fn: Callable[[object, Tensor], Tensor], microbatches: int,
                 timings: dict[str, LayerTiming]) -> None:
        self.model, self.layers, self.cfg, self.loss_fn = model, list(layers), cfg, loss_fn
        self.n_mb, self.timings = microbatches, timings
        self.opt = _sgd([p for p in model.parameters() if p.requires_grad])
        self.A: dict[str, Tensor | None] = {layer.name: None for layer in layers}
        self.B: dict[str, Tensor | None] = {layer.name: None for layer in layers}
        self.queue: dict[str, list[tuple[int, Inverse]]] = {layer.name: [] for layer in layers}
        self.active: dict[str, Inverse | None] = {layer.name: None for layer in layers}

    def step(self, t: int, x: Tensor, y: Tensor) -> None:
        n = x.shape[0]
        refresh = [layer for layer in self.layers
                   if t % self.timings[layer.name].period == self.timings[layer.name].curv_step]
        sums: dict[str, list[Tensor]] = {}
        for xm, ym in zip(x.chunk(self.n_mb), y.chunk(self.n_mb)):
            run = lambda xm=xm, ym=ym: self.loss_fn(self.model(xm), ym) / self.n_mb  # noqa: E731
            if refresh:
                for name, (a_m, b_m) in hook_factors(self.model, refresh, run, n, torch.float32).items():
                    sums.setdefault(name, []).extend([a_m, b_m])
            else:
                run().backward()
        if self.cfg is not None:
            self._kfac(t, refresh, sums)
        self.opt.step()
        self.opt.zero_grad()

    def _kfac(self, t: int, refresh: list[KFACLayer], sums: dict[str, list[Tensor]]) -> None:
        cfg = self.cfg
        for layer in refresh:
            fs = sums[layer.name]
            a_new, b_new = sum(fs[0::2]) / self.n_mb, sum(fs[1::2]) / self.n_mb
            self.A[layer.name] = running_average(self.A[layer.name], a_new, cfg.factor_decay)
            self.B[layer.name] = running_average(self.B[layer.name], b_new, cfg.factor_decay)
            inv = invert(self.A[layer.name], self.B[layer.name], damping=cfg.damping, method=cfg.inverse)
            self.queue[layer.name].append((t + self.timings[layer.name].use_offset, inv))
        for name, q in self.queue.items():
            while q and q[0][0] <= t:
                self.active[name] = q.pop(0)[1]
        params = dict(self.model.named_parameters())
        results, dot = [], 0.0
        for layer in self.layers:
            w = params[layer.weight]
            wg = w.grad.t() if layer.weight_transposed else w.grad
            G = grad_matrix(layer, wg, params[layer.bias].grad if layer.bias else None)
            P = precondition(G, self.active[layer.name])
            dot += float((P.double() * G.double()).sum())
            results.append((layer, P))
        nu = kl_clip_scale(dot, LR, cfg.kl_clip)
        for layer, P in results:
            w_new, b_new = split_grad(layer, P * nu)
            params[layer.weight].grad = (w_new.t() if layer.weight_transposed else w_new).contiguous()
            if layer.bias:
                params[layer.bias].grad = b_new


def _compare(make: Callable[[], nn.Module], batches: list[tuple[Tensor, Tensor]], loss_fn, *,
             cfg: KFACConfig | None, microbatches: int = 1, backend: str | None = None,
             layer_timing: dict[str, LayerTiming] | None = None, rtol: float = 1e-4) -> Trainer:
    model = make()
    ref_model = copy.deepcopy(model)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = fxkfac.compile(model, None, example_inputs=(batches[0][0],), loss_fn=loss_fn, optimizer=_sgd,
                             kfac=cfg, microbatches=microbatches, backend=backend, layer_timing=layer_timing)
    timings = dict(trainer.timings)
    ref = _Reference(ref_model, trainer.units, cfg, loss_fn, microbatches, timings)
    for t, (x, y) in enumerate(batches):
        loss = trainer.step(x, y)
        with torch.no_grad():
            assert loss == pytest.approx(float(loss_fn(ref_model(x), y)), rel=1e-4)
        ref.step(t, x, y)
    ref_params = dict(ref_model.named_parameters())
    moved = 0.0
    for name, p in trainer.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=rtol, atol=rtol * float(ref_params[name].abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")
        moved = max(moved, float((p - initial[name]).abs().max()))
    assert moved > 1e-3, "training did not move the parameters: the comparison would be vacuous"
    return trainer


def _image_batches(k: int) -> list[tuple[Tensor, Tensor]]:
    return [image_batch(8, seed=s) for s in range(k)]


def _mlp_batches(k: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)) for _ in range(k)]


def test_mlp_kfac_two_microbatches_refresh_every_two() -> None:
    cfg = KFACConfig(damping=1e-2, refresh_every=2, factor_decay=0.9)
    trainer = _compare(mlp, _mlp_batches(5), _mse, cfg=cfg, microbatches=2)
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
    _compare(mlp, _mlp_batches(3), _mse, cfg=cfg, microbatches=2, backend="inductor", rtol=1e-3)


def test_state_dict_round_trip_continues_identically() -> None:
    cfg = KFACConfig(damping=1e-2, refresh_every=2)
    batches = _mlp_batches(4)
    a = fxkfac.compile(mlp(), None, example_inputs=(batches[0][0],), loss_fn=_mse, optimizer=_sgd, kfac=cfg,
                       backend=None)
    for x, y in batches[:3]:
        a.step(x, y)
    b = fxkfac.compile(mlp(seed=7), None, example_inputs=(batches[0][0],), loss_fn=_mse, optimizer=_sgd, kfac=cfg,
                       backend=None)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert b.steps == 3 and set(b.state_dict()["kfac"]) == {layer.name for layer in a.units}
    x, y = batches[3]
    assert a.step(x, y) == b.step(x, y)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
