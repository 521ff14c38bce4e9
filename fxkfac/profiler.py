"""Measures the planner's CostTable on the device it runs on: stage forward/backward, a family's kernels, bytes.

A unit's costs come from a `UnitCost` function: K-FAC's layers are timed on random captures of their real
shape (`kfac_unit_cost`); a family fed by the gradient (Shampoo, SOAP) is timed through its own methods on a
random gradient of the parameter's shape (`gradient_unit_cost`).

Every time is the fastest of its repeats, with their fastest and slowest kept beside it (`Timing`,
`planner.problem.costs.Spread`); a stage's backward is timed alone, after an untimed forward of its own.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
from torch import Tensor

from fxkfac.config import KFACConfig
from fxkfac.errors import CostModelError
from fxkfac.kfac.factors import a_rows, e_rows, factor
from fxkfac.kfac.inverse import Inverse, combine, invert_factor
from fxkfac.kfac.precondition import Preconditioner
from fxkfac.kfac.split_inverse import split_invert_factor
from fxkfac.kfac.state import LayerState
from fxkfac.passes.factor_capture import FactorTaps, insert_factor_capture, new_probes
from fxkfac.passes.layers import KFACLayer, LayerKind
from fxkfac.passes.split_stages import SplitResult
from fxkfac.planner.problem import Capture, CostTable, InverseMethod, LayerCost, OpKind, PartCost, StageCost
from fxkfac.planner.problem.costs import Spread, combined_stage
from fxkfac.preconditioner import Family, SteppedFamily, fold_gradient, gradient_parts
from fxkfac.runtime.precision import autocast, to_wire
from fxkfac.runtime.split_backward import ArgGrad, PendingW, split_stage
from fxkfac.runtime.sync import flat_gradient

__all__ = ["profile", "Timing", "clock", "time_call", "time_after", "UnitCost", "kfac_unit_cost", "gradient_unit_cost"]

MAX_WARM_FOLDS = 1000
"""Folds of a random gradient a unit may take before its family decomposes it (its start step)."""

UnitCost = Callable[[str, int], LayerCost]
"""(unit name, rows of one micro-batch) -> the unit's measured LayerCost."""

NOISY = 2.0
"""A stage time whose slowest repeat took more than this many times its fastest is noisy (logged)."""

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Timing:
    """One profiled call: the seconds the cost table plans with, the fastest of its repeats, and their spread.

    The fastest, not the median or the mean: other processes only ever add time to a repeat, so the fastest is
    the call's own cost and the most reproducible figure. On the 2-core machine this was built on, under a load
    of 8, a stage backward's fastest repeat (wall clock) stayed within 2.31-2.54 ms over five profiles while its
    median jumped between 2.5 and 6.7 ms with how many repeats were preempted.
    """

    seconds: float
    spread: Spread

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        """The fastest of `samples` (seconds), and their (min, max)."""
        return cls(min(samples), Spread(min(samples), max(samples)))


def clock() -> Callable[[], float]:
    """The clock a profile reads: this thread's CPU time while torch computes on this thread alone (one intra-op
    thread, no CUDA: what each rank of a launch or torchrun does), else the wall clock. CPU time does not count
    what other processes take of the cores, which moved the wall-clock time of one stage 2.3-fold between
    profiles on the 2-core machine this was built on; on an idle machine the two agree."""
    if torch.get_num_threads() == 1 and not torch.cuda.is_initialized():
        return time.thread_time
    return time.perf_counter


def _sync() -> None:
    """Wait for the work queued on an accelerator, so that a clock read after it counts it (a CPU runs inline)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_after(setup: Callable[[], T], fn: Callable[[T], object], *, warmup: int = 1, repeats: int = 3) -> Timing:
    """`fn(setup())` over `repeats` runs after `warmup` untimed ones, timing `fn` alone on `clock()`: `setup` runs
    untimed before every run (a fresh forward before each timed backward) and the device is synchronized before
    the clock starts and before it stops."""
    for _ in range(warmup):
        fn(setup())
    now, samples = clock(), []
    for _ in range(max(1, repeats)):
        arg = setup()
        _sync()
        start = now()
        fn(arg)
        _sync()
        samples.append(now() - start)
    return Timing.of(samples)


def time_call(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 3) -> Timing:
    """`fn()` over `repeats` runs after `warmup` untimed ones (`time_after` with nothing to set up)."""
    return time_after(lambda: None, lambda _: fn(), warmup=warmup, repeats=repeats)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _spd(dim: int, rows: int) -> Tensor:
    x = torch.randn(max(rows, dim), dim)
    return x.t() @ x / x.shape[0]


def _curv_calls(layer: KFACLayer, rows: int, dtype: torch.dtype) -> tuple[Callable[[], object], Callable[[], object]]:
    """The runtime's deferred STATS of one micro-batch (fxkfac.runtime.kfac_ops): rows of the captured a / e
    (bias column, scaling by n) and their factor; conv2d: the factor of rows of the final width (im2col
    needs the input's geometry)."""
    if layer.kind is LayerKind.CONV2D:
        a, e = torch.randn(rows, layer.a_dim), torch.randn(rows, layer.b_dim)
        return (lambda: factor(a, dtype)), (lambda: factor(e, dtype))
    a_in, e_out = torch.randn(rows, layer.d_in), torch.randn(rows, layer.d_out)
    return (lambda: factor(a_rows(a_in, layer), dtype)), (lambda: factor(e_rows(e_out, layer, 1), dtype))


def _decomp_call(f: Tensor, gamma: float, cfg: KFACConfig, rows: int) -> Callable[[], object]:
    """The runtime's DECOMP of one factor: Cholesky (or eigh), or every piece of `cfg.split_inverse` in a row,
    Newton-Schulz started, as in a run, from the inverse of a factor one running-average step away
    (``0.95 f + 0.05 f_new``, a fresh random ``f_new``)."""
    split = cfg.split_inverse
    if split is None:
        return lambda: invert_factor(f, gamma, method=cfg.inverse)
    older = invert_factor(0.95 * f + 0.05 * _spd(f.shape[0], rows), gamma)
    previous = None if older is None else older.inv
    return lambda: split_invert_factor(f, gamma, split, previous=previous)


def _weight_shape(layer: KFACLayer) -> tuple[int, ...]:
    if layer.kind is LayerKind.CONV2D and layer.conv is not None:
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


def kfac_unit_cost(
    layers: Mapping[str, KFACLayer],
    cfg: KFACConfig,
    *,
    device: torch.device | None = None,
    warmup: int = 1,
    repeats: int = 1,
) -> UnitCost:
    """K-FAC's UnitCost: each layer timed by `_layer_cost` on `device` (its random captures, factors and gradients
    made there: where the layer's parameters train; None: the CPU)."""

    def cost(name: str, rows: int) -> LayerCost:
        with torch.device(device or "cpu"):
            return _layer_cost(layers[name], rows * layers[name].tokens_per_sample, cfg, warmup, repeats)

    return cost


def _state_bytes(state: Any) -> int:
    """Bytes of every tensor in a state's `state_dict()`."""
    return sum(_nbytes(v) for v in state.state_dict().values() if isinstance(v, Tensor))


def gradient_unit_cost(
    family: Family, units: Mapping[str, Any], params: Mapping[str, Tensor], *, warmup: int = 1, repeats: int = 1
) -> UnitCost:
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
        stats, decomp, folded = {}, {}, {}
        scratch = family.new_state(unit)
        for part in family.parts:

            def statistic(part: str = part) -> Tensor:
                return family.statistic(unit, part, None, p, rows)

            def fold(part: str = part) -> None:  # the step's STATS: the statistic and its fold (from the 2nd on)
                fold_gradient(family, unit, scratch, part, p, rows)

            stats[part] = time_call(fold, warmup=max(1, warmup), repeats=repeats)
            folded[part] = _nbytes(statistic())
        state, snap, halves = _warm_state(family, name, unit, p, rows)
        for part in family.parts:

            def decompose(part: str = part) -> object:
                return family.decompose(unit, snap, part)

            decomp[part] = time_call(decompose, warmup=warmup, repeats=repeats)
        state.set_pending(family.combine(unit, state, halves), 0)
        state.activate(0)
        prec = time_call(
            lambda: family.precondition([unit], {name: grad.clone()}, {name: state}, {name: p}),
            warmup=warmup,
            repeats=repeats,
        )
        parts = tuple(
            PartCost(
                part,
                OpKind.ALLREDUCE_GRAD,
                stats[part].seconds,
                decomp[part].seconds,
                0,
                folded[part],
                stats[part].spread,
                decomp[part].spread,
            )
            for part in family.parts
        )
        extra = max(0, _state_bytes(state) - 2 * sum(folded.values()))
        hand_off, take_back = _stepped_hand_off(family, unit, state, p, warmup, repeats)
        return LayerCost(
            name,
            parts,
            prec.seconds,
            extra,
            p.numel() * p.element_size(),
            prec.spread,
            hand_off=hand_off,
            take_back=take_back,
        )

    return cost


def _stepped_hand_off(
    family: Family, unit: Any, state: Any, p: Tensor, warmup: int, repeats: int
) -> tuple[float, float]:
    """A streamed stateful unit's owner-side seconds (`LayerCost.hand_off`, `take_back`): its flat gradient and
    parameter made in the gradient hook, and the state its helper returns installed (fxkfac/runtime/streaming.py);
    (0, 0) for a family that returns no state."""
    if not isinstance(family, SteppedFamily):
        return 0.0, 0.0
    flat, scratch = family.step_state(unit, state), family.new_state(unit)
    send = time_call(lambda: (flat_gradient([p]), torch.cat([p.detach().reshape(-1)])), warmup=warmup, repeats=repeats)
    land = time_call(lambda: family.load_step_state(unit, scratch, flat), warmup=warmup, repeats=repeats)
    return send.seconds, land.seconds


def _warm_state(family: Family, name: str, unit: Any, p: Tensor, rows: int) -> tuple[Any, Any, dict[str, Any]]:
    """A new state of `unit` with its gradient statistic folded until the family decomposes it (at most
    `MAX_WARM_FOLDS` times; a family declines before its start step): (state, its snapshot, the decomposed halves)."""
    state = family.new_state(unit)
    for _ in range(MAX_WARM_FOLDS):
        for part in family.parts:
            family.fold(state, part, family.statistic(unit, part, None, p, rows))
        snap = state.snapshot()
        halves = {part: family.decompose(unit, snap, part) for part in family.parts}
        if all(half is not None for half in halves.values()):
            return state, snap, halves
    log.warning(
        "%s declined to decompose %s after %d folds: its decompositions are timed as declined "
        "(too cheap) and the plan may refresh it too often",
        family.name,
        name,
        MAX_WARM_FOLDS,
    )
    return state, snap, halves


def _layer_cost(layer: KFACLayer, rows: int, cfg: KFACConfig, warmup: int, repeats: int) -> LayerCost:
    """Curvature of one micro-batch (rows of a and of e), inversion per factor and precondition, timed
    on the code paths the runtime's STATS, DECOMP and APPLY handlers run."""
    dtype = getattr(torch, cfg.factor_dtype)
    curv_a, curv_b = _curv_calls(layer, rows, dtype)
    A, B = _spd(layer.a_dim, rows), _spd(layer.b_dim, rows)
    gamma = cfg.damping**0.5
    inv_a = invert_factor(A, gamma, method=cfg.inverse)
    inv_b = invert_factor(B, gamma, method=cfg.inverse)
    if inv_a is None or inv_b is None:
        raise AssertionError("a well-conditioned random factor could not be inverted")
    inverse = combine(inv_a, inv_b, 0.0 if cfg.inverse == InverseMethod.CHOLESKY else cfg.damping)
    item = torch.finfo(dtype).bits // 8

    def timed(fn: Callable[[], object]) -> Timing:
        return time_call(fn, warmup=warmup, repeats=repeats)

    stats = {"A": timed(curv_a), "B": timed(curv_b)}
    decomp = {"A": timed(_decomp_call(A, gamma, cfg, rows)), "B": timed(_decomp_call(B, gamma, cfg, rows))}
    prec = timed(_prec_call(layer, inverse))
    cost = LayerCost.kfac(
        layer.name,
        curv_a=stats["A"].seconds,
        curv_b=stats["B"].seconds,
        inv_a=decomp["A"].seconds,
        inv_b=decomp["B"].seconds,
        prec=prec.seconds,
        a_bytes=rows * layer.d_in * 4,
        e_bytes=rows * layer.d_out * 4,
        factor_a_bytes=layer.a_dim**2 * item,
        factor_b_bytes=layer.b_dim**2 * item,
        grad_bytes=layer.a_dim * layer.b_dim * 4,
    )
    parts = tuple(
        replace(p, stats_spread=stats[p.part].spread, decomp_spread=decomp[p.part].spread) for p in cost.parts
    )
    cost = replace(cost, parts=parts, prec_spread=prec.spread)
    if cfg.inverse == InverseMethod.CHOLESKY:
        return cost
    # the eigen form also keeps each decomposition's eigenvalues (the active one and the next) and, once used,
    # the active one's divisor l_b l_a^T + damping (fxkfac/kfac/inverse.py)
    return replace(cost, state_bytes=(2 * (layer.a_dim + layer.b_dim) + layer.a_dim * layer.b_dim) * item)


def _act_bytes(gm: torch.fx.GraphModule, autocast_dtype: torch.dtype | None = None) -> int:
    """Bytes of every intermediate value of a stage graph: an upper bound of what its backward keeps. Under
    autocast, floating values are counted at its width (the ops autocast keeps in float32, such as softmax and the
    losses, are few and small next to the matmuls' outputs)."""
    total, width = 0, None if autocast_dtype is None else autocast_dtype.itemsize
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, Tensor):
            total += val.numel() * width if width is not None and val.is_floating_point() else _nbytes(val)
    return total


def _stage_times(
    gm: torch.fx.GraphModule,
    inputs: Sequence[Tensor],
    loss: Callable[[Sequence[Tensor]], Tensor] | None,
    warmup: int,
    repeats: int,
    taps: FactorTaps | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[Timing, Timing, list[Tensor]]:
    """Forward and backward of one stage on one micro-batch, each timed alone, and its (detached) outputs; with
    `taps` (`gm` is then `taps.gm`, the stage's graph with captures), its probes are made in the forward.

    The backward is timed from the roots an untimed forward made for it (the last stage's `loss`, else every
    output with a gradient of ones), not derived from a timed forward + backward: two figures of separate runs
    differ by their noise, which once left a stage's backward at 0."""

    forward, roots = _stage_calls(gm, inputs, loss, taps, autocast_dtype)
    fwd = time_call(forward, warmup=warmup, repeats=repeats)
    bwd = time_after(roots, _backward, warmup=warmup, repeats=repeats)
    gm.zero_grad(set_to_none=True)
    return fwd, bwd, [o.detach() for o in forward()]


Roots = tuple[list[Tensor], list[Tensor] | None]
"""What a stage's backward starts from: its roots and their gradients (None: a scalar loss)."""


def _stage_calls(
    gm: torch.fx.GraphModule,
    inputs: Sequence[Tensor],
    loss: Callable[[Sequence[Tensor]], Tensor] | None,
    taps: FactorTaps | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[Callable[[], tuple[Tensor, ...]], Callable[[], Roots]]:
    """The stage's forward on fresh leaves of `inputs`, and a forward that returns the roots of its backward (the last
    stage's `loss`, else every output with a gradient of ones); under autocast of `autocast_dtype` as the runtime runs
    them (its outputs at that width: [Note: mixed precision] in fxkfac/runtime/precision.py)."""
    device = _device(inputs)

    def leaves() -> list[Tensor]:
        return [x.detach().requires_grad_(True) if x.is_floating_point() else x for x in inputs]

    def forward() -> tuple[Tensor, ...]:
        with autocast(autocast_dtype, device):
            if taps is None:
                out = tuple(gm(*leaves()))
            else:
                out = tuple(gm(*leaves(), *new_probes(taps, device, autocast_dtype))[: taps.n_outputs])
        return out if loss is not None else to_wire(out, autocast_dtype)

    def roots() -> Roots:
        out = forward()
        if loss is not None:
            with autocast(autocast_dtype, device):
                return [loss(out)], None
        live = [o for o in out if o.requires_grad]
        return live, [torch.ones_like(o) for o in live]

    return forward, roots


@dataclass(frozen=True, slots=True)
class _WShares:
    """A stage's W as shares of its backward (`_w_shares`): the whole W's, and each named layer's piece's."""

    stage: float
    layers: dict[str, float]


def _w_shares(
    gm: torch.fx.GraphModule,
    inputs: Sequence[Tensor],
    layers: Mapping[str, Sequence[str]],
    warmup: int,
    repeats: int,
    autocast_dtype: torch.dtype | None = None,
    *,
    first: bool = False,
) -> _WShares:
    """The shares of the stage's backward its W and each of `layers`' W pieces take (a zero-bubble schedule's weight
    gradient, `StageCost.wgrad`, `LayerCost.wgrad`): B and W of the split the runtime runs ([Note: B/W split] in
    docs/ZERO_BUBBLE.md, eager), W cut into the pieces of `layers` (layer -> its parameters' names) as a program of
    per-layer W's cuts it, output gradients of ones; the `first` stage's inputs take no gradient, as the runtime's
    (its B makes nothing, its W is the backward through the stage: a layer's piece also makes its output gradient
    G, or the shared piece where several layers' need it). B is timed after an untimed forward; W's pieces one after
    another after an untimed forward and B, each alone on the clock: W is the fastest repeat of their sum, a layer
    its piece's fastest, and the shared piece ([Note: W pieces]) counts in W alone. Shares, applied to the backward
    timed whole (`_stage_times`): the split's B and W run the same aten ops as autograd's backward, and the planner
    takes W out of that backward."""
    params = dict(gm.named_parameters())
    state = {**params, **dict(gm.named_buffers())}
    args = [x.detach().requires_grad_(not first) if x.is_floating_point() else x for x in inputs]
    sides = [ArgGrad.INPUT if a.requires_grad else ArgGrad.NONE for a in args]
    device, values = _device(inputs), list(state.values())
    with autocast(autocast_dtype, device):
        outs = gm(*args)
    outs = (outs,) if isinstance(outs, Tensor) else tuple(outs)
    split = split_stage(gm, state, list(params), args, sides, len(outs), lambda g: g, layers)

    def before_b() -> tuple[list[Tensor], list[Tensor]]:
        with torch.no_grad(), autocast(autocast_dtype, device):
            saved = split.forward(*values, *args)[split.n_outputs :]
        return list(saved), [torch.ones(shape, dtype=dtype, device=device) for shape, dtype in split.tangents]

    def b(made: tuple[list[Tensor], list[Tensor]]) -> tuple[Tensor, ...]:
        saved, tangents = made
        with torch.no_grad(), autocast(autocast_dtype, device):
            return tuple(split.input_grad(*(saved[i] for i in split.b_saved), *tangents))

    def w_pieces() -> list[float]:
        """One W after an untimed forward and B: the seconds of each piece, in `split.pieces`' order."""
        made = before_b()
        pending = PendingW(split, [*(made[0][i] for i in split.w_saved), *b(made)[split.n_arg_grads :]])
        seconds = []
        for piece in pending.take(None):
            operands, now = pending.operands(piece), clock()
            _sync()
            start = now()
            with torch.no_grad(), autocast(autocast_dtype, device):
                out = piece.fn(*operands)
            _sync()
            seconds.append(now() - start)
            pending.ran(piece, out[len(piece.params) + len(piece.weight_args) :])
        return seconds

    b_time = time_after(before_b, b, warmup=warmup, repeats=repeats).seconds
    for _ in range(warmup):
        w_pieces()
    samples = [w_pieces() for _ in range(max(1, repeats))]
    w_time = min(map(sum, samples))
    total = b_time + w_time
    if not total > 0:
        return _WShares(0.5, {})
    fastest = [min(times) for times in zip(*samples, strict=True)]
    shares = {p.layer: t / total for p, t in zip(split.pieces, fastest, strict=True) if p.layer is not None}
    return _WShares(w_time / total, shares)


def _backward(made: Roots) -> None:
    """The stage's backward from the roots a forward made."""
    torch.autograd.backward(made[0], made[1])


def _ready_times(
    gm: torch.fx.GraphModule,
    inputs: Sequence[Tensor],
    loss: Callable[[Sequence[Tensor]], Tensor] | None,
    params_of: Mapping[str, Sequence[str]],
    repeats: int,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Per layer (its parameters by name), the seconds from the start of the stage's backward until its gradient is
    final, every parameter of it accumulated: the median of `repeats` backwards, each after an untimed forward, read
    by hooks on the accumulation (CUDA events on a GPU, whose kernels run behind the host). What a streamed APPLY
    waits for (`LayerCost.grad_ready`); a layer the backward does not reach is left out."""
    if not params_of:
        return {}
    _, roots = _stage_calls(gm, inputs, loss, autocast_dtype=autocast_dtype)
    samples: dict[str, list[float]] = {name: [] for name in params_of}
    for _ in range(max(1, repeats)):
        made = roots()
        stamps = _Stamps(_device(inputs))
        handles = [
            gm.get_parameter(p).register_post_accumulate_grad_hook(stamps.marker(name))
            for name, params in params_of.items()
            for p in params
        ]
        try:
            stamps.start()
            _backward(made)
        finally:
            for handle in handles:
                handle.remove()
        for name, seconds in stamps.read().items():
            samples[name].append(seconds)
    gm.zero_grad(set_to_none=True)
    return {name: statistics.median(found) for name, found in samples.items() if found}


class _Stamps:
    """When each named event of one backward happened, its last mark counting, in seconds after `start`: on the
    profile's clock on a CPU, by CUDA events on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.origin: Any = None
        self.marks: dict[str, Any] = {}

    def _now(self) -> Any:
        """A CUDA event recorded now on a GPU, else the clock's reading."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return clock()()

    def start(self) -> None:
        """Mark the backward's start (after the device's queued work)."""
        _sync()
        self.origin = self._now()

    def marker(self, name: str) -> Callable[[Tensor], None]:
        """A parameter hook that marks `name` now."""

        def mark(_: Tensor) -> None:
            self.marks[name] = self._now()

        return mark

    def read(self) -> dict[str, float]:
        """Each name's last mark in seconds after the start (once the device's work is done)."""
        _sync()
        if self.cuda:
            return {name: self.origin.elapsed_time(event) / 1e3 for name, event in self.marks.items()}
        return {name: at - self.origin for name, at in self.marks.items()}


def _device(inputs: Sequence[Tensor]) -> torch.device:
    """Where a stage's micro-batch lives (its probes go there too)."""
    return inputs[0].device if inputs else torch.device("cpu")


def _tapped_times(
    taps: FactorTaps | None,
    inputs: Sequence[Tensor],
    loss: Callable[[Sequence[Tensor]], Tensor] | None,
    warmup: int,
    repeats: int,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[Timing, Timing] | None:
    """The stage's forward and backward with `taps` (None without taps)."""
    if taps is None:
        return None
    fwd, bwd, _ = _stage_times(taps.gm, inputs, loss, warmup, repeats, taps, autocast_dtype)
    return fwd, bwd


def _extra(timed: tuple[Timing, Timing], over: tuple[Timing, Timing]) -> tuple[float, float]:
    """Seconds `timed` adds to `over`'s forward and backward (never below 0: two timings' noise)."""
    return max(0.0, timed[0].seconds - over[0].seconds), max(0.0, timed[1].seconds - over[1].seconds)


def _trusted(stage: StageCost, index: int) -> StageCost:
    """`stage` when a plan can rely on its times; CostModelError for no time at all (a clock that missed the work:
    a stage never computes for free)."""
    for what, seconds, spread in (("forward", stage.fwd, stage.fwd_spread), ("backward", stage.bwd, stage.bwd_spread)):
        if not seconds > 0:
            repeats = "" if spread is None else f" (repeats {spread.low * 1e3:.3g}-{spread.high * 1e3:.3g} ms)"
            raise CostModelError(
                f"stage {index}'s {what} was measured as {seconds * 1e3:.3g} ms{repeats}, which no "
                "plan can rely on; profile again on a quieter machine, or plan with a cost table: "
                "PlanOptions(costs=...)"
            )
    return stage


def _noisy(stages: Sequence[StageCost]) -> list[str]:
    """The stage times whose slowest repeat took more than `NOISY` times the fastest, as 'stage i bwd 2.3-9.8 ms'."""
    return [
        f"stage {i} {name} {spread.low * 1e3:.3g}-{spread.high * 1e3:.3g} ms"
        for i, stage in enumerate(stages)
        for name, spread in (("fwd", stage.fwd_spread), ("bwd", stage.bwd_spread))
        if spread is not None and spread.high > NOISY * spread.low
    ]


def _one_round(
    split: SplitResult,
    stage_layers: Mapping[int, Sequence[str]],
    unit_cost: UnitCost,
    micro_inputs: Sequence[Tensor],
    loss: Callable[[Sequence[Tensor]], Tensor],
    warmup: int,
    repeats: int,
    taps: Mapping[int, FactorTaps],
    fused: Mapping[int, FactorTaps],
    params_of: Mapping[int, Mapping[str, Sequence[str]]],
    autocast_dtype: torch.dtype | None = None,
    w_layers: Mapping[int, Mapping[str, Sequence[str]]] | None = None,
) -> list[StageCost]:
    """Every stage's forward and backward (`_stage_times`), with its deferred `taps` and with its curvature
    `fused` (`_tapped_times`), its units (`unit_cost`), when its backward makes each of `params_of`'s layers'
    gradients (`_ready_times`) and with `w_layers` (each stage's layers and their parameters) its W and each
    layer's W piece (`_w_shares`), timed once over."""
    batch = int(micro_inputs[0].shape[0])
    inputs, stages = list(micro_inputs), []
    last = len(split.stages) - 1
    for st in split.stages:
        fed, stage_loss = inputs, loss if st.index == last else None
        fwd, bwd, inputs = _stage_times(st.gm, fed, stage_loss, warmup, repeats, None, autocast_dtype)
        boundary = sum(_nbytes(t) for t in (*fed, *inputs))  # what the stage keeps when it recomputes
        tapped = _tapped_times(taps.get(st.index), fed, stage_loss, warmup, repeats, autocast_dtype)
        tap_fwd, tap_bwd = (0.0, 0.0) if tapped is None else _extra(tapped, (fwd, bwd))
        with_fused = _tapped_times(fused.get(st.index), fed, stage_loss, warmup, repeats, autocast_dtype)
        fused_fwd, fused_bwd = (None, None) if with_fused is None or tapped is None else _extra(with_fused, tapped)
        params = {n: p for n, p in st.gm.named_parameters()}
        ready = _ready_times(st.gm, fed, stage_loss, params_of.get(st.index, {}), repeats, autocast_dtype)
        units = tuple(unit_cost(n, batch) for n in stage_layers.get(st.index, ()))
        w = None
        if w_layers is not None:
            w = _w_shares(st.gm, fed, w_layers.get(st.index, {}), warmup, repeats, autocast_dtype, first=st.index == 0)
        w_of = {} if w is None else {n: share * bwd.seconds for n, share in w.layers.items()}
        stages.append(
            StageCost(
                fwd=fwd.seconds,
                bwd=bwd.seconds,
                tap_fwd=tap_fwd,
                tap_bwd=tap_bwd,
                fused_fwd=fused_fwd,
                fused_bwd=fused_bwd,
                param_bytes=sum(map(_nbytes, params.values())),
                act_bytes=_act_bytes(st.gm, autocast_dtype),
                boundary_bytes=boundary,
                layers=tuple(replace(x, grad_ready=ready.get(x.name), wgrad=w_of.get(x.name)) for x in units),
                fwd_spread=fwd.spread,
                bwd_spread=bwd.spread,
                wgrad=None if w is None else w.stage * bwd.seconds,
            )
        )
    return stages


def profile(
    split: SplitResult,
    stage_layers: Mapping[int, Sequence[str]],
    unit_cost: UnitCost,
    micro_inputs: Sequence[Tensor],
    loss: Callable[[Sequence[Tensor]], Tensor],
    *,
    warmup: int = 1,
    repeats: int = 1,
    rounds: int = 5,
    hardware: str = "cpu",
    captured: Mapping[int, Sequence[KFACLayer]] | None = None,
    autocast_dtype: torch.dtype | None = None,
    split_backward: bool = False,
    unit_params: Mapping[str, Sequence[str]] | None = None,
) -> CostTable:
    """The CostTable of the split model at the micro-batch of `micro_inputs`, measured here, stage by stage.
    `captured`: each stage's layers with captured parts (K-FAC's), which a refresh step taps: their deferred
    taps' extra F/B is timed too (`StageCost.tap_fwd`), and the F/B with their curvature fused
    (`StageCost.fused_fwd`), which lets the planner fuse where that is cheaper than placing the statistics; and when
    the backward makes each one's gradient (`LayerCost.grad_ready`, what a streamed APPLY waits for).

    The stages are chained in this one process (a rank profiles all: every stage copy is the same graph; on a mesh
    every rank does at once, `fxkfac.autoplan.gathered_profile`). `loss(flat_outputs)` is the last stage's scalar
    loss for one micro-batch. Forward and backward are each timed alone (`_stage_times`) on `clock()`, under
    autocast of `autocast_dtype` as the run trains (its activations priced at that width: `_act_bytes`). Each
    preconditioned unit of a stage is timed by `unit_cost` (with the micro-batch's rows) through the functions the
    runtime's STATS, DECOMP and APPLY handlers call.

    The whole model is timed `rounds` times over (`repeats` runs of each call per round), and each time is the
    fastest of all rounds (`Timing`), its spread from the fastest to the slowest repeat of any round: the
    repeats of one figure lie spread over the whole profile, so a moment when another process takes the device
    slows one round of every figure, not all repeats of a few. A stage time of 0 raises CostModelError (no plan
    is made from it); times whose repeats varied more than `NOISY`-fold are logged as a warning. `split_backward`
    (a zero-bubble schedule's run): each stage's W is timed too, as its share of the backward (`StageCost.wgrad`),
    and each unit's own W piece, as its (`LayerCost.wgrad`; W cut as a program of per-layer W's cuts it, by the
    parameters of each unit, `unit_params`, the family's `params_of`; none: W is one piece, the layers untimed).
    """
    log.info(
        "profiling %d stages, %d rounds, on %s",
        len(split.stages),
        rounds,
        "this thread's CPU time" if clock() is time.thread_time else "the wall clock",
    )
    taps, fused = (
        {
            st.index: insert_factor_capture(st.gm, layers, dict.fromkeys((x.name for x in layers), mode))
            for st in split.stages
            if (layers := list((captured or {}).get(st.index, ())))
        }
        for mode in (Capture.DEFERRED, Capture.FUSED)
    )
    params_of = {s: {x.name: x.params for x in layers} for s, layers in (captured or {}).items()}
    w_layers = None
    if split_backward:
        known = unit_params or {}
        w_layers = {s: {n: known[n] for n in names if n in known} for s, names in stage_layers.items()}
    passes = [
        _one_round(
            split,
            stage_layers,
            unit_cost,
            micro_inputs,
            loss,
            warmup,
            repeats,
            taps,
            fused,
            params_of,
            autocast_dtype,
            w_layers,
        )
        for _ in range(max(1, rounds))
    ]
    stages = [_trusted(combined_stage(of, min), i) for i, of in enumerate(zip(*passes, strict=True))]
    for i, s in enumerate(stages):
        log.info(
            "profiled stage %d: fwd %.2f ms, bwd %.2f ms, %d preconditioned units",
            i,
            s.fwd * 1e3,
            s.bwd * 1e3,
            len(s.layers),
        )
    noisy = _noisy(stages)
    if noisy:
        log.warning(
            "the device was busy while profiling: repeats of %s varied more than %g-fold (another process "
            "on the device?); the plan uses the fastest repeat of each",
            ", ".join(noisy),
            NOISY,
        )
    return CostTable(tuple(stages), int(micro_inputs[0].shape[0]), f"measured:{hardware}", hardware)
