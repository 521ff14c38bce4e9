"""Mixed precision on one rank: the autocast a stage runs under, the width activations cross stages at, and
float16's dynamic loss scale.

[Note: mixed precision]
- Every stage's forward and the loss run under `torch.autocast(device, dtype)`; backward is not wrapped: its ops
  follow the dtypes of the forward's, as torch prescribes. Parameters are float32 (the master weights), so their
  gradients, the optimizer's state and every preconditioner statistic are float32 too; captured activations and
  output gradients are upcast to float32 before any factor is formed (`TappedRunner`).
- The trainer runs each step inside an outer autocast context that is itself off (`Trainer._one_cast_per_step`):
  autocast then keeps its cache of weight casts from one micro-batch's forward to the next, so an eager stage casts
  each weight once per step; the cache empties when the step ends, after the optimizer changed the weights.
- A stage's floating outputs are cast to the autocast dtype inside its autograd graph: activations (and their
  gradients) cross stages at that width, on the wire and between two stages of one rank alike, so the result
  does not depend on where stages are placed.
- float16 scales the last stage's loss by `LossScale.scale` before backward. Each parameter's gradient is
  divided by it as autograd hands it over (a hook on the parameter, `LossScale.hook`), before it is accumulated:
  whatever reads a gradient (the all-reduce, a streamed layer's helper, a statistic, APPLY, clipping, the
  optimizer) sees it unscaled, as after `GradScaler.unscale_`. Output-gradient captures are divided likewise. An
  overflow leaves an Inf/NaN gradient, which the step end's NaN/Inf agreement turns into a skip on every rank
  (fxkfac/runtime/step_end.py); `LossScale.update` then backs the scale off, the same on every rank since every
  rank reads the same verdict.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from fxkfac.config import LossScaling
from fxkfac.errors import CheckpointError
from fxkfac.passes.split_stages import TensorSpec

__all__ = ["LossScale", "autocast", "to_wire", "wire_specs"]


def autocast(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """`torch.autocast` of `dtype` on `device`'s type; a no-op context for None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def to_wire(tensors: Sequence[Tensor], dtype: torch.dtype | None) -> tuple[Tensor, ...]:
    """The floating tensors cast to `dtype` (in the autograd graph), the rest as they are; None: unchanged."""
    if dtype is None:
        return tuple(tensors)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def wire_specs(specs: Sequence[TensorSpec], dtype: torch.dtype | None) -> list[TensorSpec]:
    """The specs of tensors crossing a stage boundary as `to_wire` sends them."""
    if dtype is None:
        return list(specs)
    return [replace(s, dtype=dtype) if s.dtype.is_floating_point else s for s in specs]


@dataclass
class LossScale:
    """float16's dynamic loss scale on one rank (see [Note: mixed precision]); `enabled` False: a scale of 1
    that never changes (bfloat16 and full precision)."""

    config: LossScaling
    enabled: bool
    scale: float = 1.0
    growth_tracker: int = 0
    """Steps in a row that stood since the scale last changed."""

    @classmethod
    def build(cls, config: LossScaling, enabled: bool) -> LossScale:
        """The scale a run starts with."""
        return cls(config, enabled, config.init_scale if enabled else 1.0)

    def hook(self, grad: Tensor) -> Tensor:
        """A parameter's gradient as autograd hands it over, unscaled (`Tensor.register_hook`)."""
        return grad * (1.0 / self.scale) if self.enabled else grad

    def unscale(self, value: Tensor, power: int = 1) -> Tensor:
        """A capture made from the scaled loss as float32, divided by the scale to `power` (2: a Gram matrix of
        output gradients)."""
        value = value.float()
        return value * (1.0 / self.scale**power) if self.enabled else value

    def update(self, skipped: bool) -> None:
        """GradScaler's update after a step: back off on a skip (an overflow), grow after `growth_interval`
        steps in a row that stood."""
        if not self.enabled:
            return
        if skipped:
            self.scale *= self.config.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.config.growth_interval:
            self.scale *= self.config.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, float | int]:
        """What a checkpoint keeps of the scale."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: Any) -> None:
        """Take over `state_dict` output; CheckpointError when it is malformed."""
        try:
            scale, tracker = float(state["scale"]), int(state["growth_tracker"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"the checkpoint's loss scale is malformed ({e!r})") from e
        if not scale > 0:
            raise CheckpointError(f"the checkpoint's loss scale must be > 0, got {scale!r}")
        self.scale, self.growth_tracker = scale, tracker
