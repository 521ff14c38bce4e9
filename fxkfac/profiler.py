"""Measures the planner's CostTable on the device it runs on: stage forward/backward, a family's kernels, bytes.

A unit's costs come from a `UnitCost` function: K-FAC's layers are timed on random captures of their real
shape (`kfac_unit_cost`); a family fed by the gradient (Shampoo, SOAP) is timed through its own methods on a
random gradient of the parameter's shape (`gradient_unit_cost`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from fxkfac.config import KFACConfig
from fxkfac.kfac.factors import a_rows, e_rows, factor
from fxkfac.kfac.inverse import Inverse, combine, invert_factor
from fxkfac.kfac.precondition import Preconditioner
from fxkfac.kfac.state import LayerState
from fxkfac.passes.layers import KFACLayer
from fxkfac.passes.split_stages import SplitResult
from fxkfac.planner.costs import CostTable, LayerCost, PartCost, StageCost
from fxkfac.planner.ir import OpKind
from fxkfac.preconditioner import Family, gradient_parts

__all__ = ["profile", "time_call", "UnitCost", "kfac_unit_cost", "gradient_unit_cost"]

MAX_WARM_FOLDS = 1000
"""Folds of a random gradient a unit may take before its family decomposes it (its start step)."""

UnitCost = Callable[[str, int], LayerCost]
"""(unit name, rows of one micro-batch) -> the unit's measured LayerCost."""

log = logging.getLogger(__name__)


def time_call(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 3) -> float:
    """Median seconds of `fn()` over `repeats` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _spd(dim: int, rows: int) -> Tensor:
    x = torch.randn(max(rows, dim), dim)
    return x.t() @ x / x.shape[0]


def _curv_calls(layer: KFACLayer, rows: int, dtype: torch.dtype) -> tuple[Callable[[], object], Callable[[], object]]:
    """The runtime's deferred STATS of one micro-batch (fxkfac.runtime.kfac_ops): rows of the captured a / e
    (bias column, scaling by n) and their factor; conv2d: the factor of rows of the final width (im2col
    needs the input's geometry)."""
    if layer.kind == "conv2d":
        a, e = torch.randn(rows, layer.a_dim), torch.randn(rows, layer.b_dim)
        return (lambda: factor(a, dtype)), (lambda: factor(e, dtype))
    a_in, e_out = torch.randn(rows, layer.d_in), torch.randn(rows, layer.d_out)
    return (lambda: factor(a_rows(a_in, layer), dtype)), (lambda: factor(e_rows(e_out, layer, 1), dtype))


def _weight_shape(layer: KFACLayer) -> tuple[int, ...]:
    if layer.kind == "conv2d" and layer.conv is not None:
        kh, kw = layer.conv.kernel_size
        return (layer.d_out, layer.d_in // (kh * kw), kh, kw)
    return (layer.d_in, layer.d_out) if layer.weight_transposed else (layer.d_out, layer.d_in)


def _prec_call(layer: KFACLayer, inverse: Inverse) -> Callable[[], object]:
    """The runtime's APPLY of one layer (fxkfac.kfac.precondition.Preconditioner): gradient matrix with the bias column,
    P = B^-1 G A^-1, <P, G>, and P written back into the gradients."""
    state = LayerState(layer.a_dim, layer.b_dim)
    state.active = inverse
    weight, bias = torch.randn(_weight_shape(layer)), torch.randn(layer.d_out)
    run = Preconditioner([layer])

    def call() -> object:
        grads = {layer.weight: weight.clone()}
        if layer.bias is not None:
            grads[layer.bias] = bias.clone()
        return run(grads, {layer.name: state})
    return call


def kfac_unit_cost(layers: Mapping[str, KFACLayer], cfg: KFACConfig, *, warmup: int = 2,
                   repeats: int = 5) -> UnitCost:
    """K-FAC's UnitCost: each layer timed by `_layer_cost`."""
    return lambda name, rows: _layer_cost(layers[name], rows * layers[name].tokens_per_sample, cfg, warmup, repeats)


def _state_bytes(state: Any) -> int:
    """Bytes of every tensor in a state's `state_dict()`."""
    return sum(_nbytes(v) for v in state.state_dict().values() if isinstance(v, Tensor))


def gradient_unit_cost(family: Family, units: Mapping[str, Any], params: Mapping[str, Tensor], *,
                       warmup: int = 2, repeats: int = 5) -> UnitCost:
    """The UnitCost of a family whose parts are all fed by the gradient: its statistic, decomposition and
    preconditioning of one unit, timed through the family's own methods on a random gradient of the
    parameter's shape. The statistic is folded until the family decomposes it (a family declines before its
    start step), at most `MAX_WARM_FOLDS` times, so the decomposition is timed as it will run."""
    if gradient_parts(family) != set(family.parts):
        raise AssertionError(f"{family.name} has parts fed by captures: time them with their own UnitCost")

    def cost(name: str, rows: int) -> LayerCost:
        unit = units[name]
        p = params[name].detach().clone().requires_grad_(True)
        grad = torch.randn_like(p)
        p.grad = grad
        state = family.new_state(unit)
        stats, decomp, folded = {}, {}, {}
        for part in family.parts:
            def statistic(part: str = part) -> Tensor:
                return family.statistic(unit, part, "gradient", p, rows)
            stats[part] = time_call(statistic, warmup=warmup, repeats=repeats)
            folded[part] = _nbytes(statistic())
        for _ in range(MAX_WARM_FOLDS):
            for part in family.parts:
                family.fold(state, part, family.statistic(unit, part, "gradient", p, rows))
            snap = state.snapshot()
            halves = {part: family.decompose(unit, snap, part) for part in family.parts}
            if all(half is not None for half in halves.values()):
                break
        else:
            log.warning("%s declined to decompose %s after %d folds: its decompositions are timed as declined "
                        "(too cheap) and the plan may refresh it too often", family.name, name, MAX_WARM_FOLDS)
        for part in family.parts:
            def decompose(part: str = part) -> object:
                return family.decompose(unit, snap, part)
            decomp[part] = time_call(decompose, warmup=warmup, repeats=repeats)
        state.set_pending(family.combine(unit, state, halves), 0)
        state.activate(0)
        prec = time_call(lambda: family.precondition([unit], {name: grad.clone()}, {name: state}, {name: p}),
                         warmup=warmup, repeats=repeats)
        parts = tuple(PartCost(part, OpKind.ALLREDUCE_GRAD, stats[part], decomp[part], 0, folded[part])
                      for part in family.parts)
        extra = max(0, _state_bytes(state) - 2 * sum(folded.values()))
        return LayerCost(name, parts, prec, extra, p.numel() * p.element_size())
    return cost


def _layer_cost(layer: KFACLayer, rows: int, cfg: KFACConfig, warmup: int, repeats: int) -> LayerCost:
    """Curvature of one micro-batch (rows of a and of e), inversion per factor and precondition, timed
    on the code paths the runtime's STATS, DECOMP and APPLY handlers run."""
    dtype = getattr(torch, cfg.factor_dtype)
    curv_a, curv_b = _curv_calls(layer, rows, dtype)
    A, B = _spd(layer.a_dim, rows), _spd(layer.b_dim, rows)
    gamma = cfg.damping ** 0.5
    inv_a = invert_factor(A, gamma, method=cfg.inverse)
    inv_b = invert_factor(B, gamma, method=cfg.inverse)
    if inv_a is None or inv_b is None:
        raise AssertionError("a well-conditioned random factor could not be inverted")
    inverse = combine(inv_a, inv_b, 0.0 if cfg.inverse == "cholesky" else cfg.damping)
    item = torch.finfo(dtype).bits // 8
    cost = LayerCost.kfac(layer.name,
        curv_a=time_call(curv_a, warmup=warmup, repeats=repeats),
        curv_b=time_call(curv_b, warmup=warmup, repeats=repeats),
        inv_a=time_call(lambda: invert_factor(A, gamma, method=cfg.inverse), warmup=warmup, repeats=repeats),
        inv_b=time_call(lambda: invert_factor(B, gamma, method=cfg.inverse), warmup=warmup, repeats=repeats),
        prec=time_call(_prec_call(layer, inverse), warmup=warmup, repeats=repeats),
        a_bytes=rows * layer.d_in * 4, e_bytes=rows * layer.d_out * 4,
        factor_a_bytes=layer.a_dim ** 2 * item, factor_b_bytes=layer.b_dim ** 2 * item,
        grad_bytes=layer.a_dim * layer.b_dim * 4)
    if cfg.inverse == "cholesky":
        return cost
    # the eigen form also keeps each decomposition's eigenvalues (the active one and the next) and, once used,
    # the active one's divisor l_b l_a^T + damping (fxkfac/kfac/inverse.py)
    return replace(cost, state_bytes=(2 * (layer.a_dim + layer.b_dim) + layer.a_dim * layer.b_dim) * item)


def _act_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes of every intermediate value of a stage graph: an upper bound of what its backward keeps."""
    total = 0
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, Tensor):
            total += _nbytes(val)
    return total


def _stage_times(gm: torch.fx.GraphModule, inputs: Sequence[Tensor], loss: Callable[[Sequence[Tensor]], Tensor] | None,
                 warmup: int, repeats: int) -> tuple[float, float, list[Tensor]]:
    """Forward and backward seconds of one stage on one micro-batch, and its (detached) outputs."""
    def leaves() -> list[Tensor]:
        return [x.detach().requires_grad_(True) if x.is_floating_point() else x for x in inputs]

    def fwd() -> tuple[Tensor, ...]:
        return tuple(gm(*leaves()))

    fwd_s = time_call(fwd, warmup=warmup, repeats=repeats)
    outs = fwd()

    def bwd_once() -> None:
        out = tuple(gm(*leaves()))
        if loss is not None:
            loss(out).backward()
        else:
            pairs = [(o, torch.ones_like(o)) for o in out if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    both = time_call(bwd_once, warmup=warmup, repeats=repeats)
    gm.zero_grad(set_to_none=True)
    return fwd_s, max(both - fwd_s, 0.0), [o.detach() for o in outs]


def profile(split: SplitResult, stage_layers: Mapping[int, Sequence[str]], unit_cost: UnitCost,
            micro_inputs: Sequence[Tensor], loss: Callable[[Sequence[Tensor]], Tensor], *,
            warmup: int = 2, repeats: int = 5, hardware: str = "cpu") -> CostTable:
    """The CostTable of the split model at the micro-batch of `micro_inputs`, measured here, stage by stage.

    The stages are chained in this one process (rank 0 profiles all: every stage copy is the same
    graph). `loss(flat_outputs)` is the last stage's scalar loss for one micro-batch. Forward is the
    median over `repeats`; backward is (forward + backward) minus forward. Each preconditioned unit of a
    stage is timed by `unit_cost` (with the micro-batch's rows) through the functions the runtime's STATS,
    DECOMP and APPLY handlers call.
    """
    batch = int(micro_inputs[0].shape[0])
    inputs = list(micro_inputs)
    stages = []
    last = len(split.stages) - 1
    for st in split.stages:
        fwd_s, bwd_s, inputs_next = _stage_times(st.gm, inputs, loss if st.index == last else None, warmup, repeats)
        costs = tuple(unit_cost(n, batch) for n in stage_layers.get(st.index, ()))
        params = {n: p for n, p in st.gm.named_parameters()}
        stages.append(StageCost(fwd=fwd_s, bwd=bwd_s, param_bytes=sum(_nbytes(p) for p in params.values()),
                                act_bytes=_act_bytes(st.gm), layers=costs))
        log.info("profiled stage %d: fwd %.2f ms, bwd %.2f ms, %d preconditioned units", st.index, fwd_s * 1e3,
                 bwd_s * 1e3, len(costs))
        inputs = inputs_next
    return CostTable(tuple(stages), batch, f"measured:{hardware}", hardware)
