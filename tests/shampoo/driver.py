"""Drive a gradient-fed family through the runtime's contract on one device, and its reference the same way.

`train` is the per-step loop of fxkfac/runtime/preconditioning.py for parts fed by the gradient (no plan:
LayerTiming(refresh_every, refresh_phase, use_offset)): every step folds each part's statistic and, at a
refresh step, snapshots the state after that part's fold; the refresh is decomposed, packed for a broadcast,
unpacked, combined and queued for step t + use_offset; APPLY activates due preconditioners and preconditions;
SGD(lr) steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fxkfac.preconditioner import Family, RefreshState

BATCH = 8


class TinyNet(nn.Module):
    """Two Linear layers with biases, a LayerNorm, and an order-4 parameter (2, 2, 3, 1) that merging changes:
    with blocks of 4 most sides are ragged."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.lin2 = nn.Linear(5, 3)
        self.mix = nn.Parameter(torch.randn(2, 2, 3, 1) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.norm(self.lin1(x)))
        return self.lin2(h) + torch.einsum("bij,ijk->bk", h[:, :4].reshape(-1, 2, 2), self.mix[..., 0])


def model(seed: int = 0) -> TinyNet:
    """A float64 TinyNet with LayerNorm parameters moved off their init (so their gradients are generic)."""
    torch.manual_seed(seed)
    net = TinyNet().double()
    with torch.no_grad():
        net.norm.weight.add_(0.2 * torch.randn(5, dtype=torch.float64))
        net.norm.bias.add_(0.2 * torch.randn(5, dtype=torch.float64))
    return net


def batches(steps: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    """Fixed random regression batches."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(BATCH, 6, generator=gen, dtype=torch.float64),
            torch.randn(BATCH, 3, generator=gen, dtype=torch.float64),
        )
        for _ in range(steps)
    ]


def backward(net: nn.Module, batch: tuple[Tensor, Tensor]) -> None:
    """The step's complete gradient in every `.grad` (mean squared error)."""
    net.zero_grad()
    x, y = batch
    ((net(x) - y) ** 2).mean().backward()


def train(
    family: Family,
    net: nn.Module,
    data: list[tuple[Tensor, Tensor]],
    lr: float,
    *,
    first_step: int = 0,
    states: Mapping[str, RefreshState] | None = None,
    use_offset: int = 0,
) -> Mapping[str, RefreshState]:
    """Steps `first_step`, `first_step + 1`, ... over `data` as the runtime runs them; returns the states."""
    units = family.units(net, [])  # type: ignore[arg-type]  # a plain module: units read only its parameters
    states = {u.name: family.new_state(u) for u in units} if states is None else states
    params = dict(net.named_parameters())
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    for t, batch in enumerate(data, start=first_step):
        backward(net, batch)
        refresh = t % family.refresh_every == family.refresh_phase
        for unit in units:  # STATS (no micro-batch): fold every step
            state, snapshots = states[unit.name], {}
            for part in family.parts:
                family.fold(state, part, family.statistic(unit, part, "gradient", params[unit.name], BATCH))
                snapshots[part] = state.snapshot()
            if refresh:  # DECOMP, BCAST, combine
                halves = {
                    part: family.unpack(
                        unit, part, family.pack(unit, part, family.decompose(unit, snapshots[part], part))
                    )
                    for part in family.parts
                }
                state.refreshes += 1
                state.set_pending(family.combine(unit, state, halves), t + use_offset)
        for unit in units:  # APPLY
            states[unit.name].activate(t)
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        family.precondition(units, grads, states, params)
        optimizer.step()  # OPT_STEP: W <- W - lr P
    return states


def train_reference(reference: Any, net: nn.Module, data: list[tuple[Tensor, Tensor]], lr: float) -> None:
    """The same steps with `reference.step(t, weights, grads) -> directions` (NumPy float64)."""
    params = dict(net.named_parameters())
    for t, batch in enumerate(data):
        backward(net, batch)
        weights = {n: p.detach().numpy().copy() for n, p in params.items()}
        grads = {n: p.grad.detach().numpy().copy() for n, p in params.items() if p.grad is not None}
        directions = reference.step(t, weights, grads)
        with torch.no_grad():
            for n, d in directions.items():
                params[n].sub_(lr * torch.from_numpy(np.ascontiguousarray(d)))


def max_difference(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between the two models' parameters."""
    pb = dict(b.named_parameters())
    return max(float((p - pb[n]).detach().abs().max()) for n, p in a.named_parameters())


def compare(
    make_family: Callable[[], Family],
    make_reference: Callable[[Mapping[str, tuple[int, ...]]], Any],
    steps: int = 8,
    lr: float = 0.05,
) -> float:
    """Train a model with the family and a copy with the reference; the largest parameter difference."""
    net = model()
    twin = copy.deepcopy(net)
    data = batches(steps)
    train(make_family(), net, data, lr)
    train_reference(make_reference({n: tuple(p.shape) for n, p in twin.named_parameters()}), twin, data, lr)
    return max_difference(net, twin)
