"""Muon (Jordan et al.; torch.optim.Muon) as a `fxkfac.preconditioner.Family` with `MuonConfig`, and AdamW for the
parameters Muon does not take, in the same family so that one compile call trains them all.

Units are every trainable parameter (`MuonUnit`). The hidden matrices (`UnitKind.MATRIX`: the 2-D weight of a
captured Linear layer other than the output head, the graph's last) step by Muon; embeddings, the output head,
convolutions and 1-D parameters (`UnitKind.ADAMW`) by AdamW. Per step t (from 1), with the base optimizer's lr:
  Muon:  B <- mu B + (1 - mu) G (from zero); X = (1 - mu) G + mu B (Nesterov) or B;
         O = NS_k(X) (fxkfac/muon/newton_schulz.py, in ns_dtype); P = s O + lambda W, s the lr adjustment of the
         matrix's shape (A, B) = (rows, columns): sqrt(max(1, A/B)) or 0.2 sqrt(max(A, B)).
  AdamW: m <- beta1 m + (1 - beta1) G; v <- beta2 v + (1 - beta2) G^2;
         P = r (m / (1 - beta1^t) / (sqrt(v) / sqrt(1 - beta2^t) + eps) + lambda_a W), r = adamw_lr_ratio.
The base optimizer is SGD(lr) without momentum or weight decay: W <- W - lr P, which is torch.optim.Muon's and
torch.optim.AdamW's step. Muon has no statistics and no refreshes (no parts): its per-step work is APPLY alone, and
that splits in three (`SplitApplyFamily`): the owner's input (momentum, the Nesterov blend), the core (Newton-Schulz,
which a plan may run on another rank, or in pieces of its iterations) and the owner's output (lr adjustment and weight
decay).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import Tensor, fx

from fxkfac.config import KFACConfig, KLClipScope
from fxkfac.muon.config import LrAdjust, MuonConfig
from fxkfac.muon.newton_schulz import iterations_of_piece, ns_end, ns_iterate, ns_start
from fxkfac.muon.state import MuonState
from fxkfac.passes.layers import KFACLayer, LayerKind
from fxkfac.planner.problem import Capture, LayerCost
from fxkfac.preconditioner import RefreshState, Source, direction_dot
from fxkfac.profiler import time_call

__all__ = ["MuonFamily", "MuonUnit", "UnitKind", "lr_scale"]


class UnitKind(StrEnum):
    """Which optimizer steps a parameter: Muon (a hidden matrix) or AdamW (everything else)."""

    MATRIX = "matrix"
    ADAMW = "adamw"


@dataclass(frozen=True, slots=True)
class MuonUnit:
    """One trainable parameter, by FQN, with its shape and the optimizer that steps it."""

    name: str
    shape: tuple[int, ...]
    kind: UnitKind


def lr_scale(adjust: LrAdjust, shape: tuple[int, ...]) -> float:
    """The factor of a matrix's learning rate (torch.optim.Muon's `_adjust_lr`, over lr)."""
    rows, cols = shape[:2]
    if adjust is LrAdjust.ORIGINAL:
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def hidden_matrices(layers: Sequence[KFACLayer]) -> frozenset[str]:
    """The weights Muon takes: those of the Linear layers before the graph's last (the output head)."""
    linear = [layer for layer in layers if layer.kind is LayerKind.LINEAR]
    return frozenset(layer.weight for layer in linear[:-1])


class MuonFamily:
    """The `Family` of Muon, also a `SplitApplyFamily` (see the module doc)."""

    name = "muon"
    parts: tuple[str, ...] = ()
    kl_clip: float | None = None
    kl_clip_scope: KLClipScope = KLClipScope.GLOBAL
    layer_config: KFACConfig = KFACConfig(skip_vocab_head=False)
    """Every Linear layer, the output head included: `hidden_matrices` tells the head by its place, the last."""
    stats_dtype = "float32"
    refresh_every = 1
    capture: Capture = Capture.FUSED
    refresh_phase = 0
    max_period: int | None = None
    warm_start = False
    full_direction = True

    def __init__(self, cfg: MuonConfig) -> None:
        self.cfg = cfg
        self.ns_dtype: torch.dtype = getattr(torch, cfg.ns_dtype)

    # --- units ---------------------------------------------------------------------------------------

    def units(self, gm: fx.GraphModule, layers: Sequence[KFACLayer]) -> list[MuonUnit]:
        """One unit per trainable parameter of `gm`: a hidden Linear's 2-D weight is a MATRIX, the rest ADAMW."""
        matrices = hidden_matrices(layers)
        return [
            MuonUnit(n, tuple(p.shape), UnitKind.MATRIX if n in matrices and p.dim() == 2 else UnitKind.ADAMW)
            for n, p in gm.named_parameters()
            if p.requires_grad
        ]

    def new_state(self, unit: MuonUnit) -> MuonState:
        """No momentum, no moments, no step yet."""
        return MuonState()

    def params_of(self, unit: MuonUnit) -> tuple[str, ...]:
        """The unit's parameter."""
        return (unit.name,)

    # --- no parts: the refresh methods are never called -----------------------------------------------

    def _no_parts(self, part: str) -> AssertionError:
        return AssertionError(f"muon has no parts (no statistics, no refreshes), but part {part!r} was asked for")

    def source(self, part: str) -> Source:
        raise self._no_parts(part)

    def stats_shape(self, unit: MuonUnit, part: str) -> tuple[int, ...]:
        raise self._no_parts(part)

    def statistic(self, unit: MuonUnit, part: str, mode: Capture | None, raw: Tensor, n: int) -> Tensor:
        raise self._no_parts(part)

    def fold(self, state: RefreshState, part: str, mean: Tensor) -> None:
        raise self._no_parts(part)

    def decompose(self, unit: MuonUnit, state: RefreshState, part: str) -> Any:
        raise self._no_parts(part)

    def pack(self, unit: MuonUnit, part: str, half: Any) -> Tensor:
        raise self._no_parts(part)

    def unpack(self, unit: MuonUnit, part: str, flat: Tensor) -> Any:
        raise self._no_parts(part)

    def combine(self, unit: MuonUnit, state: RefreshState, halves: Mapping[str, Any]) -> Any:
        raise self._no_parts(",".join(halves))

    def half_to_state(self, half: Any) -> dict[str, Any] | None:
        raise self._no_parts("-")

    def half_from_state(self, saved: Any) -> Any:
        raise self._no_parts("-")

    # --- every step ---------------------------------------------------------------------------------

    def apply_input(self, unit: MuonUnit, grad: Tensor, state: RefreshState, param: Tensor) -> Tensor:
        """The owner's first part of the APPLY, which updates the state: a matrix's Newton-Schulz input (momentum,
        then the Nesterov blend); an AdamW parameter's whole direction."""
        state, cfg, g = _muon_state(state), self.cfg, grad.detach()
        if unit.kind is UnitKind.ADAMW:
            return self._adamw([state], [g], [param.detach()])[0]
        state.steps += 1
        buf = torch.zeros_like(g) if state.momentum is None else state.momentum
        state.momentum = torch.lerp(buf, g, 1 - cfg.momentum)
        return torch.lerp(g, state.momentum, cfg.momentum) if cfg.nesterov else state.momentum

    def apply_core(self, unit: MuonUnit, x: Tensor, index: int, pieces: int) -> Tensor:
        """Piece `index` of `pieces` of the core, which any rank may run (no state): a matrix's Newton-Schulz
        iterations [i*S//n, (i+1)*S//n), piece 0 starting from `apply_input`'s output, the last returning O in
        the matrix's orientation; nothing for an AdamW parameter."""
        if unit.kind is UnitKind.ADAMW:
            return x
        cfg = self.cfg
        if index == 0:
            x = ns_start(x, self.ns_dtype, cfg.eps)
        x = ns_iterate(x, cfg.ns_coefficients, iterations_of_piece(cfg.ns_steps, index, pieces))
        return ns_end(x, unit.shape) if index == pieces - 1 else x

    def apply_output(self, unit: MuonUnit, core: Tensor, param: Tensor) -> Tensor:
        """The owner's last part: a matrix's direction s O + lambda W, in the parameter's dtype; an AdamW
        parameter's direction as `apply_input` made it."""
        if unit.kind is UnitKind.ADAMW:
            return core
        cfg = self.cfg
        p = param.detach()
        out = core.to(p.dtype) * lr_scale(cfg.adjust_lr_fn, unit.shape)
        return torch.add(out, p, alpha=cfg.weight_decay) if cfg.weight_decay else out

    def _adamw(self, states: Sequence[MuonState], gs: list[Tensor], ws: list[Tensor]) -> list[Tensor]:
        """torch.optim.AdamW's step over lr (times adamw_lr_ratio) of each parameter, its moments replaced in its state
        (the step counted); each pass one `torch._foreach_*` op over the parameters (the same op per tensor)."""
        cfg = self.cfg
        beta1, beta2 = cfg.adamw_betas
        for state in states:
            state.steps += 1
        ms = [torch.zeros_like(g) if s.exp_avg is None else s.exp_avg for s, g in zip(states, gs, strict=True)]
        vs = [torch.zeros_like(g) if s.exp_avg_sq is None else s.exp_avg_sq for s, g in zip(states, gs, strict=True)]
        ms = list(torch._foreach_lerp(ms, gs, 1 - beta1))
        vs = list(torch._foreach_mul(vs, beta2))
        torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
        for state, m, v in zip(states, ms, vs, strict=True):
            state.exp_avg, state.exp_avg_sq = m, v
        denoms = torch._foreach_sqrt(vs)
        torch._foreach_div_(denoms, [math.sqrt(1 - beta2**s.steps) for s in states])
        torch._foreach_add_(denoms, cfg.adamw_eps)
        out = torch._foreach_div(ms, [1 - beta1**s.steps for s in states])
        torch._foreach_div_(out, denoms)
        if cfg.adamw_weight_decay:
            torch._foreach_add_(out, ws, alpha=cfg.adamw_weight_decay)
        if cfg.adamw_lr_ratio != 1.0:
            torch._foreach_mul_(out, cfg.adamw_lr_ratio)
        return list(out)

    def direction(self, unit: MuonUnit, grad: Tensor, state: RefreshState, param: Tensor) -> Tensor:
        """The unit's whole step direction: input, core in one piece, output."""
        x = self.apply_input(unit, grad, state, param)
        return self.apply_output(unit, self.apply_core(unit, x, 0, 1), param)

    def precondition(
        self,
        units: Sequence[Any],
        grads: MutableMapping[str, Tensor],
        states: Mapping[str, RefreshState],
        params: Mapping[str, Tensor],
    ) -> Tensor:
        """Replace each unit's gradient by its direction P (module doc); returns sum <P, G> (float64). Each unit's
        `direction`, with the Newton-Schulz iterations of equally shaped matrices run together (`_cores`)."""
        live = [unit for unit in units if grads.get(unit.name) is not None]
        inputs = [
            grads[u.name]
            if u.kind is UnitKind.ADAMW
            else self.apply_input(u, grads[u.name], states[u.name], params[u.name])
            for u in live
        ]
        adamw = [i for i, unit in enumerate(live) if unit.kind is UnitKind.ADAMW]
        if adamw:  # AdamW's whole step, `apply_input` of these units, as one pass per op over them all
            done = self._adamw(
                [_muon_state(states[live[i].name]) for i in adamw],
                [inputs[i].detach() for i in adamw],
                [params[live[i].name].detach() for i in adamw],
            )
            for i, direction in zip(adamw, done, strict=True):
                inputs[i] = direction
        dot = torch.zeros((), dtype=torch.float64)
        for unit, core in zip(live, self._cores(live, inputs), strict=True):
            grad = grads[unit.name]
            p = self.apply_output(unit, core, params[unit.name])
            if self.kl_clip is not None:  # without a KL-clip <P, G> is never read: no zero per unit to add
                dot = dot + direction_dot(self, p, grad)
            grad.copy_(p)
        return dot

    def _cores(self, units: Sequence[MuonUnit], inputs: Sequence[Tensor]) -> list[Tensor]:
        """`apply_core` of each unit in one piece, the matrices of one shape (after `ns_start`'s orientation) iterated
        as one stack: a batched product per term instead of one per matrix, each matrix's numbers unchanged (the
        batched kernels compute every product as the single-matrix ones do; tests/muon/test_one_device.py)."""
        cfg = self.cfg
        cores = list(inputs)
        starts: dict[tuple[tuple[int, ...], bool], list[tuple[int, Tensor]]] = {}
        for i, (unit, x) in enumerate(zip(units, inputs, strict=True)):
            if unit.kind is UnitKind.MATRIX:
                x0 = ns_start(x, self.ns_dtype, cfg.eps)
                starts.setdefault((tuple(x0.shape), x0.is_contiguous()), []).append((i, x0))
        for (_, rowwise), group in starts.items():
            if len(group) == 1:
                stack = group[0][1]
            else:  # a tall matrix's X_0 is a transposed view: stacked as such, so each product sees its layout
                stack = torch.stack([x0 for _, x0 in group]) if rowwise else torch.stack([x0.T for _, x0 in group]).mT
            done = ns_iterate(stack, cfg.ns_coefficients, cfg.ns_steps)
            for (i, _), x in zip(group, [done] if len(group) == 1 else done.unbind(0), strict=True):
                cores[i] = ns_end(x, units[i].shape)
        return cores

    def clip_scale(self, dot_sum: float, lr: float) -> float:
        """1.0: Muon has no KL-clip."""
        return 1.0

    def scale(self, units: Sequence[Any], grads: MutableMapping[str, Tensor], nu: float) -> None:
        """Multiply the directions by `nu` (unused: no KL-clip)."""
        for unit in units:
            if grads.get(unit.name) is not None:
                grads[unit.name].mul_(nu)

    def unit_cost(self, units: Mapping[str, Any], params: Mapping[str, Tensor]) -> Callable[[str, int], LayerCost]:
        """A unit's LayerCost: no parts, `prec` the APPLY (momentum and Newton-Schulz, or AdamW) timed on a random
        gradient of its shape, its state (the momentum, or AdamW's two moments) and its gradient's bytes, and what its
        owner runs when it streams (`hand_off`: `apply_input`, `take_back`: `apply_output`)."""

        def cost(name: str, rows: int) -> LayerCost:
            unit, p = units[name], params[name].detach()
            grad, state = torch.randn_like(p), self.new_state(unit)
            prec = time_call(lambda: self.direction(unit, grad, state, p), warmup=1, repeats=3)
            # a streamed matrix's owner: the core's input made in the gradient hook, the output when it lands
            send = time_call(lambda: self.apply_input(unit, grad, state, p).reshape(-1).to(p.dtype), repeats=3)
            land = time_call(lambda: self.apply_output(unit, grad, p), repeats=3)
            nbytes = p.numel() * p.element_size()
            held = nbytes if unit.kind is UnitKind.MATRIX else 2 * nbytes
            return LayerCost(
                name,
                (),
                prec.seconds,
                state_bytes=held,
                grad_bytes=nbytes,
                prec_spread=prec.spread,
                hand_off=send.seconds,
                take_back=land.seconds,
            )

        return cost


def _muon_state(state: RefreshState) -> MuonState:
    """`state`, which a Muon unit's is."""
    assert isinstance(state, MuonState), "a Muon unit's state is a MuonState"
    return state
