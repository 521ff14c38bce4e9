"""Single-device K-FAC training through the captured graph: the reference the pipelined runtime must equal."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fxkfac.capture import Captured, capture, input_signature, normalize_inputs
from fxkfac.config import KFACConfig
from fxkfac.errors import CaptureError, CheckpointError, ConfigError
from fxkfac.kfac.factors import a_rows, e_rows, factor
from fxkfac.kfac.precondition import kl_clip_scale
from fxkfac.kfac.state import LayerState
from fxkfac.passes.factor_capture import FactorTaps, insert_factor_capture
from fxkfac.passes.layers import KFACLayer
from fxkfac.passes.precondition import make_preconditioner
from fxkfac.planner.ir import LayerTiming
from fxkfac.trainer import (Checkpointing, OptimizerFactory, base_lr, check_skip_streak, default_optimizer,
                            grads_finite, layer_timings, refreshing, split_microbatches)

__all__ = ["SingleDeviceTrainer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Variant:
    """One runnable graph: a capture for one input signature, with taps on one set of layers."""

    captured: Captured
    taps: FactorTaps
    fn: Callable[..., Any]


class SingleDeviceTrainer(Checkpointing):
    """K-FAC (or the base optimizer alone) on one device, with the semantics of docs/ARCHITECTURE.md.

    A step: split the mini-batch into ``microbatches`` equal parts; per micro-batch run the captured
    graph (with factor taps on the layers that refresh at this step), backpropagate
    ``loss_fn(outputs_m, targets_m) / microbatches`` and collect ``A_m``, ``B_m``; if loss and gradients
    are finite, fold the factors into the running averages, invert what refreshed, activate due
    inverses, precondition, KL-clip, and step the base optimizer. Otherwise the step is skipped and
    counted (``skipped_steps``), with parameters, optimizer and K-FAC state untouched and the step
    counter not advanced; more than ``max_skipped_steps`` skips in a row raise NonFiniteError.
    """

    def __init__(self, model: nn.Module, *, example_inputs: Any, loss_fn: Callable[[Any, Any], Tensor],
                 optimizer: OptimizerFactory | None = None, kfac: KFACConfig | None = KFACConfig(),
                 microbatches: int = 1, backend: str | None = "inductor",
                 layer_timing: Mapping[str, LayerTiming] | None = None, plan: Any = None,
                 max_skipped_steps: int | None = 10) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.kfac = kfac
        self.microbatches = microbatches
        self.backend = backend
        self.plan = plan
        first = capture(model, _first_microbatch(normalize_inputs(example_inputs), microbatches), kfac)
        self._captures: dict[Any, Captured] = {first.signature: first}
        self._variants: dict[Any, _Variant] = {}
        self.layers: list[KFACLayer] = list(first.layers)
        self.skipped: dict[str, str] = dict(first.skipped)
        if kfac is not None and not self.layers:
            warnings.warn(f"{type(model).__name__} has no Linear/Conv2d layer K-FAC can precondition; "
                          "it trains with the base optimizer alone", stacklevel=3)
        self.timings = layer_timings(self.layers, kfac, layer_timing) if kfac is not None else {}
        self.kfac_states = {layer.name: LayerState(layer.a_dim, layer.b_dim) for layer in self.layers}
        self._preconditioner = make_preconditioner(self.layers)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = (optimizer or default_optimizer)(self._params)
        self.step_count = 0
        self.skipped_steps = 0
        self.max_skipped_steps = max_skipped_steps
        self._skips_in_a_row = 0

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters under their FQNs (the captured graph uses the same tensors)."""
        return self.model.named_parameters()

    def step(self, inputs: Any, targets: Any) -> float:
        """One optimizer step over the mini-batch ``(inputs, targets)``; returns the loss ``L``."""
        batch, parts = split_microbatches(normalize_inputs(inputs), targets, self.microbatches)
        modes = refreshing(self.timings, self.step_count)
        collected: dict[str, list[tuple[Tensor, Tensor]]] = {name: [] for name in modes}
        total = 0.0
        for args_m, targets_m in parts:
            loss_m, factors = self._forward_backward(args_m, targets_m, modes, batch)
            total += loss_m
            for name, pair in factors.items():
                collected[name].append(pair)
        loss = total / self.microbatches
        if not (math.isfinite(loss) and grads_finite(self._params)):
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            log.warning("step %d skipped: loss or gradients are NaN/Inf (%d skipped so far)",
                        self.step_count, self.skipped_steps)
            self._skips_in_a_row += 1
            check_skip_streak(self._skips_in_a_row, self.max_skipped_steps, self.step_count)
            return loss
        self._skips_in_a_row = 0
        if self.kfac is not None and self.layers:
            self._update_curvature(collected)
            self._precondition()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return loss

    def _forward_backward(self, args: tuple[Any, ...], targets: Any, modes: Mapping[str, str],
                          n: int) -> tuple[float, dict[str, tuple[Tensor, Tensor]]]:
        """Forward and backward of one micro-batch; its loss and ``{layer: (A_m, B_m)}`` for the tapped layers."""
        variant = self._variant(args, modes)
        taps = variant.taps
        device = self._params[0].device if self._params else torch.device("cpu")
        order = sorted(taps.probes, key=taps.probes.__getitem__)
        probes = [torch.zeros(taps.probe_shapes[name], device=device, requires_grad=True) for name in order]
        outs = variant.fn(*variant.captured.flat_inputs(args), *probes)
        loss = self.loss_fn(variant.captured.unflatten_outputs(outs[:taps.n_outputs]), targets)
        (loss / self.microbatches).backward()
        factors = {}
        dtype = self.kfac.factor_dtype if self.kfac is not None else "float32"
        for layer in taps.layers:
            a_cap = outs[taps.a_outputs[layer.name]].detach()
            e_cap = probes[taps.probes[layer.name]].grad
            if taps.modes[layer.name] == "fused":
                factors[layer.name] = (_factor_cast(a_cap, dtype), _factor_cast(e_cap * (n * n), dtype))
            else:
                factors[layer.name] = (factor(a_rows(a_cap, layer), dtype), factor(e_rows(e_cap, layer, n), dtype))
        return float(loss.detach()), factors

    def _variant(self, args: tuple[Any, ...], modes: Mapping[str, str]) -> _Variant:
        """The (cached) graph for this input signature with taps on ``modes``; recaptures for new shapes."""
        signature = input_signature(args)
        key = (signature, tuple(sorted(modes.items())))
        if key in self._variants:
            return self._variants[key]
        captured = self._captures.get(signature)
        if captured is None:
            log.info("capturing %s again for input shapes %s", type(self.model).__name__, signature)
            captured = capture(self.model, args, self.kfac)
            if [layer.name for layer in captured.layers] != [layer.name for layer in self.layers]:
                raise CaptureError(f"the model's K-FAC layers differ for input shapes {signature}; "
                                   "use inputs shaped like example_inputs")
            self._captures[signature] = captured
        taps = insert_factor_capture(captured.gm, captured.layers, modes)
        fn = taps.gm if self.backend is None else torch.compile(taps.gm, backend=self.backend)
        self._variants[key] = _Variant(captured, taps, fn)
        return self._variants[key]

    def _update_curvature(self, collected: Mapping[str, list[tuple[Tensor, Tensor]]]) -> None:
        """Fold this step's factors into the running averages, invert them, and activate due inverses."""
        if self.kfac is None:
            raise AssertionError("curvature update without a KFACConfig")
        for name, pairs in collected.items():
            state = self.kfac_states[name]
            for a_m, b_m in pairs:
                state.add_a(a_m)
                state.add_b(b_m)
            state.finish_refresh(self.kfac.factor_decay)
            state.invert_pending(self.kfac, self.step_count + self.timings[name].use_offset, name)
        for state in self.kfac_states.values():
            state.activate(self.step_count)

    def _precondition(self) -> None:
        """Natural gradients for the K-FAC layers, then the KL-clip over all of them."""
        if self.kfac is None:
            raise AssertionError("preconditioning without a KFACConfig")
        grads = {name: p.grad for name, p in self.model.named_parameters() if p.grad is not None}
        dot = self._preconditioner(grads, self.kfac_states)
        nu = kl_clip_scale(float(dot), base_lr(self.optimizer), self.kfac.kl_clip)
        self._preconditioner.scale(grads, nu)

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, K-FAC layer states (by layer name) and counters."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "kfac": {name: state.state_dict() for name, state in self.kfac_states.items()},
            "step": self.step_count,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` output; CheckpointError when it lacks a part or names other layers."""
        missing = {"model", "optimizer", "kfac", "step"} - set(state)
        if missing:
            raise CheckpointError(f"trainer state lacks {sorted(missing)}; it was not written by Trainer.state_dict()")
        if set(state["kfac"]) != set(self.kfac_states):
            raise CheckpointError(f"checkpoint K-FAC layers {sorted(state['kfac'])} differ from this model's "
                                  f"{sorted(self.kfac_states)}; it was written for another model or config")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for name, layer_state in state["kfac"].items():
            self.kfac_states[name].load_state_dict(layer_state)
        self.step_count = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._skips_in_a_row = 0


def _first_microbatch(args: tuple[Any, ...], microbatches: int) -> tuple[Any, ...]:
    """The first micro-batch of the example inputs (the shape steps run at); the inputs if N does not divide them."""
    try:
        return split_microbatches(args, None, microbatches)[1][0][0]
    except ConfigError:
        return args


def _factor_cast(f: Tensor, dtype: str) -> Tensor:
    """A fused factor from the graph in the configured factor dtype."""
    return f.to(getattr(torch, dtype))
