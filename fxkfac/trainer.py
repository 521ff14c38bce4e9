"""The Trainer protocol shared by the single-device and pipelined trainers, and the step logic they share."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fxkfac.config import KFACConfig
from fxkfac.errors import ConfigError, NonFiniteError
from fxkfac.passes.layers import KFACLayer
from fxkfac.planner.ir import LayerTiming

__all__ = [
    "Trainer",
    "Checkpointing",
    "check_skip_streak",
    "OptimizerFactory",
    "default_optimizer",
    "split_microbatches",
    "layer_timings",
    "refreshing",
    "base_lr",
    "grads_finite",
]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class Checkpointing:
    """`save_checkpoint` / `load_checkpoint` for every trainer: one directory format (`fxkfac.checkpoint`)."""

    def save_checkpoint(self, path: str) -> None:
        """Write a checkpoint directory (collective when pipelined; see `fxkfac.checkpoint.save`)."""
        from fxkfac import checkpoint

        checkpoint.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Resume from a checkpoint directory (collective when pipelined; see `fxkfac.checkpoint.load`)."""
        from fxkfac import checkpoint

        checkpoint.load(self, path)


def check_skip_streak(in_a_row: int, limit: int | None, step: int) -> None:
    """NonFiniteError when `in_a_row` NaN/Inf steps were skipped in a row, more than `limit` allows."""
    if limit is not None and in_a_row > limit:
        raise NonFiniteError(f"{in_a_row} steps in a row had NaN/Inf loss or gradients (max_skipped_steps={limit}); "
                             f"the state is that of step {step}: lower the learning rate, check the data, or raise "
                             "max_skipped_steps")


@runtime_checkable
class Trainer(Protocol):
    """What `fxkfac.compile` returns, for one device or a pipeline.

    ``step`` takes the global mini-batch and returns the loss ``L`` (mean over micro-batches of
    ``loss_fn(outputs_m, targets_m)``); ``layers`` are the K-FAC layers; ``plan`` the plan in use (None
    on one device without a plan); ``skipped_steps`` counts steps dropped for NaN/Inf loss or gradients.
    """

    layers: list[KFACLayer]
    plan: Any
    skipped_steps: int

    def step(self, inputs: Any, targets: Any) -> float: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with lr 1e-3: the base optimizer when none is given."""
    return torch.optim.AdamW(params, lr=1e-3)


def _batch_size(leaves: Sequence[Any]) -> int:
    """Dim 0 of the first tensor among ``leaves``."""
    for leaf in leaves:
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ConfigError("inputs contain no tensor with a batch dimension to split into micro-batches")


def split_microbatches(inputs: Sequence[Any], targets: Any, n: int) -> tuple[int, list[tuple[tuple[Any, ...], Any]]]:
    """``(global batch size, [(inputs_m, targets_m)] * n)``: tensors with the batch as dim 0 split in n equal parts.

    Non-tensor leaves (and tensors whose dim 0 is not the batch) are passed to every micro-batch unchanged.
    Raises ConfigError when ``n`` does not divide the batch.
    """
    leaves, spec = pytree.tree_flatten((tuple(inputs), targets))
    batch = _batch_size(leaves)
    if n < 1 or batch % n != 0:
        raise ConfigError(f"microbatches={n} does not divide the mini-batch of {batch} samples; "
                          f"use a batch size that is a multiple of {n} or another number of micro-batches")
    size = batch // n
    parts = []
    for m in range(n):
        chunk = [leaf[m * size:(m + 1) * size] if isinstance(leaf, Tensor) and leaf.dim() > 0
                 and leaf.shape[0] == batch else leaf for leaf in leaves]
        inputs_m, targets_m = pytree.tree_unflatten(chunk, spec)
        parts.append((tuple(inputs_m), targets_m))
    return batch, parts


def layer_timings(layers: Iterable[KFACLayer], cfg: KFACConfig,
                  given: Mapping[str, LayerTiming] | None = None) -> dict[str, LayerTiming]:
    """Each layer's timing: ``given`` where it names the layer, else ``LayerTiming(refresh_every, 0, 0, cfg.capture)``.

    ConfigError for timings of unknown layers or with invalid fields.
    """
    names = [layer.name for layer in layers]
    given = dict(given or {})
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ConfigError(f"layer_timing names layers that are not K-FAC layers of this model: {unknown}; "
                          f"the K-FAC layers are {names}")
    out = {}
    for name in names:
        t = given.get(name, LayerTiming(cfg.refresh_every, 0, 0, cfg.capture))
        bad_capture = t.capture not in ("fused", "deferred")
        if t.period < 1 or not 0 <= t.curv_step < t.period or t.use_offset < 0 or bad_capture:
            raise ConfigError(f"invalid LayerTiming for {name}: {t} (need period >= 1, 0 <= curv_step < period, "
                              "use_offset >= 0, capture 'fused' or 'deferred')")
        out[name] = t
    return out


def refreshing(timings: Mapping[str, LayerTiming], step: int) -> dict[str, str]:
    """Layers whose factors step ``step`` refreshes, with their capture mode."""
    return {name: t.capture for name, t in timings.items() if step % t.period == t.curv_step}


def base_lr(optimizer: torch.optim.Optimizer) -> float:
    """The lr of the optimizer's first parameter group (the lr of the KL-clip)."""
    return float(optimizer.param_groups[0]["lr"])


def grads_finite(params: Iterable[nn.Parameter]) -> bool:
    """True when every existing gradient is free of NaN/Inf."""
    return all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)

