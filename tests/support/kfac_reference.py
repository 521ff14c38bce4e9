"""An independent single-device K-FAC: the eager model with hooks for a / e and fxkfac.kfac for the layer math."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from fxkfac.config import KFACConfig
from fxkfac.kfac.factors import running_average
from fxkfac.kfac.inverse import Inverse, damping_split, invert
from fxkfac.kfac.precondition import grad_matrix, kl_clip_scale, precondition, split_grad
from fxkfac.kfac.split_inverse import previous_half, split_invert_factor
from fxkfac.passes.layers import KFACLayer
from fxkfac.planner.problem.ir import LayerTiming
from tests.passes.reference import hook_factors

__all__ = ["KFACReference"]


class KFACReference:
    """K-FAC by the book on the eager model: hooks for a / e, fxkfac.kfac for the layer math.

    `factor_microbatches[layer]` (default: all) are the micro-batches whose statistics feed the layer's factors:
    DP-KFAC's owner keeps the factors of its own shard. `max_grad_norm`: the gradient is clipped by
    `torch.nn.utils.clip_grad_norm_` after backward, before K-FAC sees it. `autocast_dtype`: the forward and
    loss run under `torch.autocast` (unscaled: no loss scaling), the factors formed in float32 from the hooked
    values."""

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[KFACLayer],
        cfg: KFACConfig | None,
        loss_fn: Callable[[object, Tensor], Tensor],
        microbatches: int,
        timings: Mapping[str, LayerTiming],
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        factor_microbatches: Mapping[str, Sequence[int]] | None = None,
        max_grad_norm: float | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self.max_grad_norm, self.autocast_dtype = max_grad_norm, autocast_dtype
        self.model, self.layers, self.cfg, self.loss_fn = model, list(layers), cfg, loss_fn
        self.n_mb, self.timings = microbatches, timings
        self.opt = optimizer([p for p in model.parameters() if p.requires_grad])
        self.lr = float(self.opt.param_groups[0]["lr"])
        self.factor_mbs = {
            layer.name: list((factor_microbatches or {}).get(layer.name, range(microbatches))) for layer in layers
        }
        self.A: dict[str, Tensor | None] = {layer.name: None for layer in layers}
        self.B: dict[str, Tensor | None] = {layer.name: None for layer in layers}
        self.queue: dict[str, list[tuple[int, Inverse]]] = {layer.name: [] for layer in layers}
        self.active: dict[str, Inverse | None] = {layer.name: None for layer in layers}

    def step(self, t: int, x: Tensor, y: Tensor) -> None:
        n = x.shape[0]
        refresh = [
            layer for layer in self.layers if t % self.timings[layer.name].period == self.timings[layer.name].curv_step
        ]
        sums: dict[str, list[Tensor]] = {}
        for m, (xm, ym) in enumerate(zip(x.chunk(self.n_mb), y.chunk(self.n_mb))):

            def run(xm: Tensor = xm, ym: Tensor = ym) -> Tensor:
                dtype = self.autocast_dtype
                with torch.autocast(xm.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    return self.loss_fn(self.model(xm), ym) / self.n_mb

            if refresh:
                for name, (a_m, b_m) in hook_factors(self.model, refresh, run, n, torch.float32).items():
                    if m in self.factor_mbs[name]:
                        sums.setdefault(name, []).extend([a_m, b_m])
            else:
                run().backward()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if self.cfg is not None:
            self._kfac(t, refresh, sums)
        self.opt.step()
        self.opt.zero_grad()

    def _invert(self, name: str) -> Inverse | None:
        """The layer's damped inverse; a split one starts from the newest inverse queued or active."""
        cfg, A, B = self.cfg, self.A[name], self.B[name]
        if cfg.split_inverse is None:
            return invert(A, B, damping=cfg.damping, method=cfg.inverse)
        latest = self.queue[name][-1][1] if self.queue[name] else self.active[name]
        gamma = damping_split(A, B, cfg.damping, False)
        a, b = (
            split_invert_factor(f, g, cfg.split_inverse, previous=previous_half(latest, part))
            for f, g, part in ((A, gamma[0], "A"), (B, gamma[1], "B"))
        )
        return latest if a is None or b is None else Inverse("cholesky", a_inv=a.inv, b_inv=b.inv)

    def _kfac(self, t: int, refresh: list[KFACLayer], sums: dict[str, list[Tensor]]) -> None:
        cfg = self.cfg
        for layer in refresh:
            fs = sums[layer.name]
            used = len(self.factor_mbs[layer.name])
            a_new, b_new = sum(fs[0::2]) / used, sum(fs[1::2]) / used
            self.A[layer.name] = running_average(self.A[layer.name], a_new, cfg.factor_decay)
            self.B[layer.name] = running_average(self.B[layer.name], b_new, cfg.factor_decay)
            inv = self._invert(layer.name)
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
        nu = kl_clip_scale(dot, self.lr, cfg.kl_clip)
        for layer, P in results:
            w_new, b_new = split_grad(layer, P * nu)
            params[layer.weight].grad = (w_new.t() if layer.weight_transposed else w_new).contiguous()
            if layer.bias:
                params[layer.bias].grad = b_new
