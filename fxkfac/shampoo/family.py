"""Distributed Shampoo (Shi et al., Alg. 2) as a `fxkfac.preconditioner.Family` with `ShampooConfig`.

Per parameter, seen as a 1-D or 2-D view cut into blocks (fxkfac.planner.problem.analytic), each step t (from 0):
  1. G <- G + lambda W when weight decay is coupled (L2); it feeds everything below.
  2. (fold, every step) L <- beta2 L + (1 - beta2) G_b G_b^T and R <- ... G_b^T G_b per block (from zero;
     beta2 = 1: plain sums); a side longer than b under DIAGONAL keeps the diagonal only.
  3. The graft accumulator takes G (fxkfac/shampoo/graft.py).
  4. (refresh, t = start mod precondition_frequency, decomposed at or after the step) the inverse roots
     L^(-eta/p), R^(-eta/p) of L / (1 - beta2^(t+1)) (bias correction, beta2 < 1), p = exponent_override or
     2 * order of the view, by shifted eigh (eps added after shifting the spectrum to >= 0; protected: retry
     in float64, then keep the previous roots) or coupled Newton ((L + eps I)^(-1/p); if it does not reach
     the tolerance within newton_max_iterations, protected eigh instead; with newton_pieces = n a plan runs the
     iterations as n DECOMP pieces, each its share of newton_max_iterations, handing the pairs (X, M) on, and
     the last piece makes the roots as one task would, bit for bit). A snapshot taken before
     start_preconditioning_step decomposes to None, so the first roots come from the first refresh step >= start
     (the paper's gap when start is not a multiple of the frequency); a failure in any block keeps the previous
     roots of the whole parameter.
  5. G~ <- beta1 G~ + (1 - beta1) G (beta1 > 0, from zero), G^ = G~ / (1 - beta1^(t+1)) with bias correction.
  6. The graft direction P_g of G^.
  7. Per block with roots: P_b = ||P_g,b||_F * S_b / ||S_b||_F, S_b = L^ G^_b R^ (0 when S_b = 0); blocks
     without factors (ADAGRAD on a large view) and every block before the first roots: P_b = P_g,b.
  8. P += lambda W when weight decay is decoupled.
  9. M <- mu M + P; P = mu M + P (Nesterov) or M.
The base optimizer is SGD(lr) without momentum or weight decay: W <- W - lr P (the paper's signs are
inconsistent; this is its intended descent step). Parameters with fewer than 2 dimensions are not decayed when
use_weight_decay_on_bias_and_norm_params is False. All per-step state is kept in preconditioner_dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fxkfac.planner.problem.analytic import DEFAULT_MAX_DIM, FactorKind
from fxkfac.preconditioner import RefreshState
from fxkfac.shampoo import graft
from fxkfac.shampoo.base import BlockFamily, block_side
from fxkfac.shampoo.config import GraftType, RootInvMethod, ShampooConfig
from fxkfac.shampoo.layout import Factor, Layout, ParamUnit, make_layout, running_sums
from fxkfac.shampoo.roots import (
    NewtonIterate,
    diagonal_root_inverse,
    newton_result,
    newton_share,
    newton_start,
    newton_steps,
    protected_eigh_root_inverse,
)
from fxkfac.shampoo.state import BlockState, ShampooState, Sides

__all__ = ["ShampooFamily", "NewtonCarry"]

NewtonCarry = tuple[NewtonIterate, ...]
"""A root inverse between pieces: the Newton pair (X, M) of each iterated factor of the part, in layout order
(empty under eigh, which has nothing to hand on)."""


class ShampooFamily(BlockFamily):
    """The `Family` of Shampoo, also a `PiecewiseFamily` (see the module doc). `max_dim`: the planner's block side
    for a config whose max_preconditioner_dim is "auto" (default DEFAULT_MAX_DIM)."""

    name = "shampoo"

    def __init__(self, cfg: ShampooConfig, *, max_dim: int | None = None) -> None:
        super().__init__(
            dtype=cfg.preconditioner_dtype,
            frequency=cfg.precondition_frequency,
            start=cfg.start_preconditioning_step,
            stat_beta=cfg.betas[1],
        )
        self.cfg = cfg
        self.max_dim = block_side(cfg.max_preconditioner_dim, max_dim, DEFAULT_MAX_DIM)
        self.decomp_pieces = cfg.newton_pieces
        """n: the pieces each root inverse is made in (`ShampooConfig.newton_pieces`; 1: one task)."""

    def _make_layout(self, unit: ParamUnit) -> Layout:
        """Every factor kind: dense, or diagonal for sides above b under DIAGONAL."""
        return make_layout(unit.shape, self.max_dim, self.cfg.large_dim_method, self.cfg.use_merge_dims, FactorKind)

    def _new_state(self, layout: Layout) -> ShampooState:
        """No statistics, roots, graft, filtered gradient or momentum yet."""
        return ShampooState((layout.size("L"), layout.size("R")), layout.view)

    def decays(self, unit: ParamUnit) -> bool:
        """Whether weight decay applies to the unit (not to < 2-D ones unless configured)."""
        cfg = self.cfg
        return cfg.weight_decay > 0 and (cfg.use_weight_decay_on_bias_and_norm_params or len(unit.shape) >= 2)

    def gradient(self, unit: ParamUnit, grad: Tensor | None, param: Tensor) -> Tensor:
        """The view-shaped gradient with L2 weight decay when it is coupled."""
        g = super().gradient(unit, grad, param)
        if self.decays(unit) and not self.cfg.use_decoupled_weight_decay:
            g = g + self.cfg.weight_decay * param.detach().reshape(g.shape)
        return g

    def step_tensors(self, state: BlockState) -> tuple[str, ...]:
        """L, R and those of the graft accumulator (not with SGD grafting), the filtered gradient (beta1 > 0) and the
        momentum (momentum > 0) that the config makes: the others stay None, so a streamed unit does not send them."""
        cfg = self.cfg
        never = {
            "graft": cfg.grafting_type is GraftType.SGD,
            "filtered": cfg.betas[0] == 0.0,
            "momentum": cfg.momentum == 0.0,
        }
        return tuple(k for k in state.TENSORS if not never.get(k, False))

    # --- refresh ------------------------------------------------------------------------------------

    def decompose(self, unit: ParamUnit, state: RefreshState, part: str) -> Tensor | None:
        """The part's inverse roots, flat in its layout; None before start or on a (protected) failure. Runs the
        coupled Newton iterations in `decomp_pieces` shares in a row: exactly what the pieces make run apart."""
        stats = self._corrected(unit, state, part)
        if stats is None:
            return None
        carry = self._newton_start(unit, part, stats)
        for index in range(self.decomp_pieces):
            carry = self._newton_piece(unit, index, carry)
        return self._finish(unit, part, stats, carry)

    def decompose_piece(
        self, unit: ParamUnit, state: RefreshState, part: str, index: int, carry: NewtonCarry | None
    ) -> NewtonCarry | Tensor | None:
        """Piece `index` of `decompose`: piece 0 starts the Newton pairs from the statistic, each piece runs its
        share of the iterations, the last makes the roots (or None). A carry of None: nothing to decompose yet."""
        n = self.decomp_pieces
        if not 0 <= index < n:
            raise ValueError(f"{unit.name} {part}: piece {index} of a root inverse made in {n} piece(s)")
        stats = self._corrected(unit, state, part) if index in (0, n - 1) else None
        if index == 0:
            carry = None if stats is None else self._newton_start(unit, part, stats)
        carry = None if carry is None else self._newton_piece(unit, index, carry)
        if index < n - 1:
            return carry
        return None if stats is None or carry is None else self._finish(unit, part, stats, carry)

    def carry_to_state(self, carry: NewtonCarry | None) -> dict[str, Any] | None:
        """A root inverse in flight as tensors: the X and M of each iterated factor, in layout order."""
        return None if carry is None else {"x": [x for x, _ in carry], "m": [m for _, m in carry]}

    def carry_from_state(self, saved: Any) -> NewtonCarry | None:
        """Inverse of `carry_to_state`; ValueError when malformed."""
        if saved is None:
            return None
        xs, ms = (saved.get(k) if isinstance(saved, Mapping) else None for k in ("x", "m"))
        if not (
            isinstance(xs, list)
            and isinstance(ms, list)
            and len(xs) == len(ms)
            and all(isinstance(t, Tensor) for t in xs + ms)
        ):
            raise ValueError(
                f"a Shampoo root inverse in flight must be {{'x': [tensors], 'm': [tensors]}} of equal "
                f"lengths, got {saved!r}"
            )
        return tuple(zip(xs, ms, strict=True))

    def _corrected(self, unit: ParamUnit, state: RefreshState, part: str) -> Tensor | None:
        """The statistic the roots are taken of (bias-corrected when beta2 < 1); None before start."""
        stats = self.statistic_to_decompose(unit, state, part)
        if stats is None:
            return None
        assert isinstance(state, ShampooState)
        beta2 = self.cfg.betas[1]
        if self.cfg.use_bias_correction and beta2 < 1.0:
            stats = stats / (1.0 - beta2 ** state.folds[part])
        return stats

    def _iterates(self, factor: Factor) -> bool:
        """Whether the factor's root comes from the coupled Newton iteration (dense, method NEWTON)."""
        return factor.kind is FactorKind.DENSE and self.cfg.root_inv_method is RootInvMethod.NEWTON

    def _newton_start(self, unit: ParamUnit, part: str, stats: Tensor) -> NewtonCarry:
        """The first Newton pair of each iterated factor of the part (none under eigh)."""
        layout = self.layout(unit)
        p, eps = self.root_of(layout), self.cfg.epsilon
        return tuple(newton_start(f.take(stats), p, eps) for f in layout.factors[part] if self._iterates(f))

    def _newton_piece(self, unit: ParamUnit, index: int, carry: NewtonCarry) -> NewtonCarry:
        """Piece `index`'s share of newton_max_iterations on every pair of `carry`."""
        cfg, p = self.cfg, self.root_of(self.layout(unit))
        share = newton_share(cfg.newton_max_iterations, self.decomp_pieces, index)
        return tuple(newton_steps(pair, p, cfg.newton_tolerance, share) for pair in carry)

    def _finish(self, unit: ParamUnit, part: str, stats: Tensor, carry: NewtonCarry) -> Tensor | None:
        """The part's roots, flat, from the last Newton pairs (eigh where Newton missed the tolerance), the eigh
        or diagonal roots of the other factors; None when a factor's root fails (protected)."""
        layout = self.layout(unit)
        factors = layout.factors[part]
        if len(carry) != sum(map(self._iterates, factors)):
            raise ValueError(
                f"{unit.name} {part}: a root inverse in flight has {len(carry)} Newton pairs, the part "
                f"iterates {sum(map(self._iterates, factors))}: it was made under another layout"
            )
        pairs = iter(carry)
        roots = []
        for factor in factors:
            pair = next(pairs) if self._iterates(factor) else None
            root = self._root(unit, part, factor, factor.take(stats), self.root_of(layout), pair)
            if root is None:
                return None
            roots.append(root.reshape(-1))
        return torch.cat(roots) if roots else stats.new_zeros(0)

    def root_of(self, layout: Layout) -> int:
        """p: the exponent override, else 2 * order of the view."""
        return self.cfg.exponent_override or 2 * len(layout.view)

    def _root(
        self, unit: ParamUnit, part: str, factor: Factor, stat: Tensor, p: int, newton: NewtonIterate | None
    ) -> Tensor | None:
        """One factor's inverse root (see the module doc) from its last Newton pair, if it iterates; ValueError when
        it fails and eigh is unprotected."""
        cfg = self.cfg
        exponent = cfg.exponent_multiplier / p
        if factor.kind is FactorKind.DIAGONAL:
            root = diagonal_root_inverse(stat, exponent, cfg.epsilon)
        else:
            root = None if newton is None else newton_result(newton, cfg.newton_tolerance)
            if root is None:
                root = protected_eigh_root_inverse(stat, exponent, cfg.epsilon, cfg.use_protected_eigh)
        if root is None and not cfg.use_protected_eigh:
            raise ValueError(
                f"the inverse root of factor {part} of block {factor.block} of {unit.name} failed in "
                f"{self.stats_dtype}; set ShampooConfig.use_protected_eigh=True (retry in float64, "
                "else keep the previous roots) or preconditioner_dtype='float64'"
            )
        return root

    def combine(self, unit: ParamUnit, state: RefreshState, halves: Mapping[str, Any]) -> Sides | None:
        """Both parts' roots; None (keep the previous) when either is missing."""
        left, right = halves["L"], halves["R"]
        return None if left is None or right is None else Sides(left, right)

    # --- every step -----------------------------------------------------------------------------------

    def precondition(
        self,
        units: Sequence[Any],
        grads: MutableMapping[str, Tensor],
        states: Mapping[str, RefreshState],
        params: Mapping[str, Tensor],
    ) -> Tensor:
        """Replace each unit's gradient by its search direction P (module doc, steps 5-9); returns sum <P, G>."""
        live = [unit for unit in units if grads.get(unit.name) is not None]
        directions = self._directions(
            live,
            [_shampoo_state(states[unit.name]) for unit in live],
            [grads[unit.name] for unit in live],
            [params[unit.name] for unit in live],
        )
        return self.write_directions(live, directions, grads)

    def _directions(
        self,
        units: Sequence[ParamUnit],
        states: Sequence[ShampooState],
        grads: Sequence[Tensor],
        params: Sequence[Tensor],
    ) -> list[Tensor]:
        """P of each parameter, in its view shape; replaces the states' per-step tensors. The elementwise steps run
        over all the parameters at once (one `torch._foreach_*` op per pass: the same op per tensor, without a Python
        op per parameter), the blocks' products per parameter."""
        cfg = self.cfg
        # never an alias of a gradient, which is overwritten last
        gs = [self.gradient(u, g, w).to(self.dtype, copy=True) for u, g, w in zip(units, grads, params, strict=True)]
        accs = graft.accumulate(cfg.grafting_type, [state.graft for state in states], gs, cfg.grafting_beta2)
        for state, acc in zip(states, accs, strict=True):
            state.graft = acc
        g_hats = self._filtered(states, gs)
        p_grafts = graft.direction(
            cfg.grafting_type,
            accs,
            g_hats,
            [state.count for state in states],
            eps=cfg.grafting_epsilon,
            beta2=cfg.grafting_beta2,
            bias_correction=cfg.use_bias_correction,
        )
        ps = self._grafted(units, states, g_hats, p_grafts)
        decayed = [i for i, unit in enumerate(units) if self.decays(unit)] if cfg.use_decoupled_weight_decay else []
        if decayed:
            weights = [params[i].detach().reshape(self.layout(units[i]).view).to(self.dtype) for i in decayed]
            for i, p in zip(decayed, torch._foreach_add([ps[i] for i in decayed], weights, alpha=cfg.weight_decay)):
                ps[i] = p
        return self._momentum(states, ps) if cfg.momentum > 0 and ps else ps

    def _momentum(self, states: Sequence[ShampooState], ps: list[Tensor]) -> list[Tensor]:
        """M <- mu M + P (M = P at first); mu M + P (Nesterov) or M."""
        mu = self.cfg.momentum
        old = [(i, state.momentum) for i, state in enumerate(states) if state.momentum is not None]
        momenta = list(ps)
        if old:
            summed = torch._foreach_mul([m for _, m in old], mu)
            torch._foreach_add_(summed, [ps[i] for i, _ in old])
            for (i, _), m in zip(old, summed, strict=True):
                momenta[i] = m
        for state, m in zip(states, momenta, strict=True):
            state.momentum = m
        if not self.cfg.use_nesterov:
            return momenta
        nesterov = torch._foreach_mul(momenta, mu)
        torch._foreach_add_(nesterov, ps)
        return list(nesterov)

    def _filtered(self, states: Sequence[ShampooState], gs: list[Tensor]) -> list[Tensor]:
        """G^ of each parameter: the beta1-filtered gradient, bias-corrected (G itself when beta1 = 0)."""
        beta1 = self.cfg.betas[0]
        if beta1 == 0.0 or not gs:
            return gs
        filtered = running_sums([state.filtered for state in states], gs, beta1)
        for state, f in zip(states, filtered, strict=True):
            state.filtered = f
        if not self.cfg.use_bias_correction:
            return filtered
        return list(torch._foreach_div(filtered, [1.0 - beta1**state.count for state in states]))

    def _grafted(
        self, units: Sequence[ParamUnit], states: Sequence[ShampooState], g_hats: list[Tensor], p_grafts: list[Tensor]
    ) -> list[Tensor]:
        """Per block of each parameter: the Shampoo direction S_b with the graft direction's Frobenius norm (the graft
        itself for a block without factors or a parameter without roots yet). S per parameter (a `Grid`'s blocks as
        one batched product); the norms and the rescaling of every block of every parameter as a few foreach ops."""
        out = list(p_grafts)
        found = [
            (i, self.layout(unit), _shampoo_blocks(self.layout(unit), state.active, g_hat, p_graft))
            for i, (unit, state, g_hat, p_graft) in enumerate(zip(units, states, g_hats, p_grafts, strict=True))
            if state.active is not None
        ]
        blocks = [block for _, _, blocks in found for block in blocks]
        if not blocks:
            return out
        scaled = iter(_rescaled([s for _, s, _ in blocks], [target for _, _, target in blocks]))
        for i, layout, mine in found:
            done = [next(scaled) for _ in mine]
            if layout.grid is not None:
                out[i] = layout.grid.join(done[0].unsqueeze(0) if len(done) == 1 else torch.stack(done))
            elif len(layout.sides) == 1 and done:  # one block (a vector): no copy to write into
                out[i] = done[0]
            else:
                out[i] = p_grafts[i].clone()
                for (index, _, _), s in zip(mine, done, strict=True):
                    out[i][layout.region(index)] = s
        return out


def _shampoo_blocks(layout: Layout, roots: Sides, g_hat: Tensor, p_graft: Tensor) -> list[tuple[int, Tensor, Tensor]]:
    """(index, S_b = L^ G^_b R^, the graft direction's block) of each block with factors, in block order; a `Grid`'s
    S_b as one batched product (views of it)."""
    grid = layout.grid
    if grid is not None:
        s = torch.bmm(torch.bmm(grid.factors(roots.L, "L"), grid.split(g_hat)), grid.factors(roots.R, "R"))
        return [
            (i, s_b, p_b) for i, (s_b, p_b) in enumerate(zip(s.unbind(0), grid.split(p_graft).unbind(0), strict=True))
        ]
    out = []
    for index, (left, right) in enumerate(layout.sides):
        if left is not None or right is not None:
            region = layout.region(index)
            out.append((index, _kron_apply(g_hat[region], left, right, roots), p_graft[region]))
    return out


def _rescaled(ss: list[Tensor], targets: list[Tensor]) -> list[Tensor]:
    """Each s with the Frobenius norm of its target (0 where s = 0): `torch._foreach_norm` over all, tensors
    throughout (no host sync on an accelerator)."""
    norms, wanted = torch.stack(torch._foreach_norm(ss)), torch.stack(torch._foreach_norm(targets))
    return list(torch._foreach_mul(ss, list(torch.where(norms > 0, wanted / norms, 0.0).unbind(0))))


def _shampoo_state(state: RefreshState) -> ShampooState:
    """`state`, which a Shampoo unit's is."""
    assert isinstance(state, ShampooState), "a Shampoo unit's state is a ShampooState"
    return state


def _kron_apply(g: Tensor, left: Factor | None, right: Factor | None, roots: Sides) -> Tensor:
    """L^ g R^ for one block (1-D: L^ g), a diagonal root scaling rows or columns."""
    if left is not None:
        root = left.take(roots.L)
        g = root @ g if left.kind is FactorKind.DENSE else root.view(-1, *([1] * (g.dim() - 1))) * g
    if right is not None:
        root = right.take(roots.R)
        g = g @ root if right.kind is FactorKind.DENSE else g * root
    return g
