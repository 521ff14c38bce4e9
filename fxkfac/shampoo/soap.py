"""SOAP (Vyas et al., "SOAP: Improving and Stabilizing Shampoo using Adam") as a `Family` with `SOAPConfig`.

Per parameter, seen as a 1-D or 2-D view cut into blocks like Shampoo's (fxkfac.planner.problem.analytic), step t:
  1. (fold, every step) L <- b L + (1 - b) G_b G_b^T, R <- b R + (1 - b) G_b^T G_b per block, b = shampoo_beta
     (from zero; b = 1: sums).
  2. (refresh, t = start mod precondition_frequency, t >= start; earlier snapshots decompose to None) the
     eigenbasis Q of each factor: eigh (retried in float64), or with BasisMethod.QR one power iteration from
     the previous basis (the newest pending or active one when the decomposition runs, which a plan makes the
     previous refresh's: `Family.warm_start`; eigh when there is none): columns sorted by descending
     diag(Q^T L Q), then Q <- qr(L Q). A failure in any block keeps the previous bases of the whole parameter.
  3. When a new basis becomes active, Adam's moments move into it. With O = Q_old^T Q_new per side (Q_old = I
     before the first basis): the first moment exactly, m <- O_L^T m O_R; the second moment, which is not
     linear in the basis, as the diagonal of the rotated covariance of independent coordinates:
     v <- (O_L o O_L)^T v (O_R o O_R) (o: elementwise). This is exact for permutations and sign flips of the
     basis (eigh's ordering), keeps v >= 0 and its sum, and is the identity when the basis is unchanged.
  4. G' = Q_L^T G_b Q_R per block; m <- beta1 m + (1 - beta1) G', v <- beta2 v + (1 - beta2) G'^2 (from zero);
     N' = m_hat / (sqrt(v_hat) + eps) (bias-corrected with t + 1 when use_bias_correction);
     P_b = Q_L N'_b Q_R^T; then P += lambda W (decoupled, AdamW), on every parameter.
Before the first basis is active (and for blocks without factors) the basis is the identity: plain AdamW.
A side that has no factor keeps the identity basis: under DIAGONAL a side longer than b (SOAP's own rule for
large dimensions), under ADAGRAD every side of a large view, and both sides of a 1-D view unless
precondition_1d. The base optimizer is SGD(lr): W <- W - lr P. Moments are kept in preconditioner_dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fxkfac.planner.problem.analytic import DEFAULT_MAX_DIM, FactorKind, matrix_view
from fxkfac.preconditioner import RefreshState
from fxkfac.shampoo.base import BlockFamily, block_side
from fxkfac.shampoo.config import BasisMethod, SOAPConfig
from fxkfac.shampoo.layout import Factor, Layout, ParamUnit, make_layout, running_squares, running_sums
from fxkfac.shampoo.state import Sides, SOAPState

__all__ = ["SOAPFamily", "eigh_basis", "qr_basis"]


def eigh_basis(a: Tensor) -> Tensor | None:
    """The eigenvectors of `a` (columns), retried in float64; None when eigh fails or is not finite."""
    for x in (a, a.double()):
        try:
            q = torch.linalg.eigh(x)[1].to(a.dtype)
        except torch.linalg.LinAlgError:
            continue
        if bool(torch.isfinite(q).all()):
            return q
    return None


def qr_basis(a: Tensor, previous: Tensor) -> Tensor | None:
    """One power iteration from `previous`: its columns by descending estimated eigenvalue, then qr(a Q)."""
    order = torch.argsort(torch.diagonal(previous.t() @ a @ previous), descending=True)
    q = torch.linalg.qr(a @ previous[:, order])[0]
    return q if bool(torch.isfinite(q).all()) else None


Side = Callable[[Factor], Tensor]
"""The matrix applied on one side of a block, given the block's factor on that side."""


def _blockwise(layout: Layout, x: Tensor, left: Side, right: Side) -> Tensor:
    """x with every block that has factors replaced by left(L-factor) @ x_b @ right(R-factor) (a side without a
    factor: the identity); a new tensor. The blocks of a `Grid` go through one batched product per side."""
    grid = layout.grid
    if grid is not None:
        lefts = _stacked([left(lf) for lf, _ in layout.sides if lf is not None])
        rights = _stacked([right(rf) for _, rf in layout.sides if rf is not None])
        return grid.join(torch.bmm(torch.bmm(lefts, grid.split(x)), rights))
    out = x.clone()
    for index, (lf, rf) in enumerate(layout.sides):
        if lf is None and rf is None:
            continue
        region = layout.region(index)
        xb = x[region]
        if lf is not None:
            xb = left(lf) @ xb
        if rf is not None:
            xb = xb @ right(rf)
        out[region] = xb
    return out


def _rotated(layout: Layout, x: Tensor, bases: Sides | None, *, back: bool) -> Tensor:
    """x into the bases, Q_L^T x_b Q_R per block, or `back` from them, Q_L x_b Q_R^T (x itself without bases or
    without factors, as a vector that is not preconditioned)."""
    if bases is None or not any(layout.factors.values()):
        return x
    if back:
        return _blockwise(layout, x, lambda f: f.take(bases.L), lambda f: f.take(bases.R).t())
    return _blockwise(layout, x, lambda f: f.take(bases.L).t(), lambda f: f.take(bases.R))


def _stacked(matrices: list[Tensor]) -> Tensor:
    """The matrices as one (k, m, n) batch: a view of a single one (no copy of a whole parameter's basis)."""
    return matrices[0].unsqueeze(0) if len(matrices) == 1 else torch.stack(matrices)


class SOAPFamily(BlockFamily):
    """The `Family` of SOAP (see the module doc). `max_dim`: the planner's block side for a config whose
    max_preconditioner_dim is "auto" (default DEFAULT_MAX_DIM)."""

    name = "soap"

    def __init__(self, cfg: SOAPConfig, *, max_dim: int | None = None) -> None:
        super().__init__(
            dtype=cfg.preconditioner_dtype,
            frequency=cfg.precondition_frequency,
            start=cfg.start_preconditioning_step,
            stat_beta=cfg.shampoo_beta,
        )
        self.cfg = cfg
        self.max_dim = block_side(cfg.max_preconditioner_dim, max_dim, DEFAULT_MAX_DIM)
        self.warm_start = cfg.basis_method is BasisMethod.QR  # one power iteration from the previous basis

    def _make_layout(self, unit: ParamUnit) -> Layout:
        """Dense factors only (a diagonal side keeps the identity basis); none on a 1-D view unless precondition_1d."""
        cfg = self.cfg
        one_d = len(matrix_view(unit.shape, self.max_dim, cfg.use_merge_dims)) == 1
        kept = () if one_d and not cfg.precondition_1d else (FactorKind.DENSE,)
        return make_layout(unit.shape, self.max_dim, cfg.large_dim_method, cfg.use_merge_dims, kept)

    def _new_state(self, layout: Layout) -> SOAPState:
        """No statistics, bases or moments yet."""
        return SOAPState((layout.size("L"), layout.size("R")), layout.view)

    # --- refresh ------------------------------------------------------------------------------------

    def decompose(self, unit: ParamUnit, state: RefreshState, part: str) -> Tensor | None:
        """The part's eigenbases, flat in its layout; None before start or when any block fails."""
        stats = self.statistic_to_decompose(unit, state, part)
        if stats is None:
            return None
        assert isinstance(state, SOAPState)
        latest = state.latest
        previous = None if latest is None or self.cfg.basis_method is BasisMethod.EIGH else getattr(latest, part)
        bases = []
        for factor in self.layout(unit).factors[part]:
            stat = factor.take(stats)
            q = eigh_basis(stat) if previous is None else qr_basis(stat, factor.take(previous))
            if q is None:
                return None
            bases.append(q.reshape(-1))
        return torch.cat(bases) if bases else stats.new_zeros(0)

    def combine(self, unit: ParamUnit, state: RefreshState, halves: Mapping[str, Any]) -> Sides | None:
        """Both parts' bases; None (keep the previous) when either is missing."""
        left, right = halves["L"], halves["R"]
        return None if left is None or right is None else Sides(left, right)

    def load_step_state(self, unit: ParamUnit, state: RefreshState, flat: Tensor) -> None:
        """As `BlockFamily`'s, the moments in the active bases (where the helper's APPLY moved them)."""
        super().load_step_state(unit, state, flat)
        assert isinstance(state, SOAPState)
        state.moments_basis = state.active

    # --- every step -----------------------------------------------------------------------------------

    def precondition(
        self,
        units: Sequence[Any],
        grads: MutableMapping[str, Tensor],
        states: Mapping[str, RefreshState],
        params: Mapping[str, Tensor],
    ) -> Tensor:
        """Move moments into newly active bases, then replace each gradient by its AdamW direction in its bases;
        returns sum <P, G>."""
        soap_states: dict[str, SOAPState] = {}
        for unit in units:
            state = states[unit.name]
            assert isinstance(state, SOAPState)
            if state.moments_basis is not state.active:
                self._move_moments(self.layout(unit), state)
            soap_states[unit.name] = state
        live = [unit for unit in units if grads.get(unit.name) is not None]
        directions = self._directions(
            live,
            [soap_states[u.name] for u in live],
            [grads[u.name] for u in live],
            [params[u.name] for u in live],
        )
        return self.write_directions(live, directions, grads)

    def _move_moments(self, layout: Layout, state: SOAPState) -> None:
        """Express the moments in the active bases (module doc, step 3)."""
        new, old = state.active, state.moments_basis
        assert new is not None, "bases are replaced, never removed"
        if state.exp_avg is not None and state.exp_avg_sq is not None:

            def overlap(f: Factor, part: str) -> Tensor:
                q_new = f.take(getattr(new, part))
                return q_new if old is None else f.take(getattr(old, part)).t() @ q_new

            state.exp_avg = _blockwise(layout, state.exp_avg, lambda f: overlap(f, "L").t(), lambda f: overlap(f, "R"))
            state.exp_avg_sq = _blockwise(
                layout, state.exp_avg_sq, lambda f: overlap(f, "L").square().t(), lambda f: overlap(f, "R").square()
            )
        state.moments_basis = new

    def _directions(
        self, units: Sequence[ParamUnit], states: Sequence[SOAPState], grads: Sequence[Tensor], params: Sequence[Tensor]
    ) -> list[Tensor]:
        """P of each parameter in its view shape; replaces the moments. The rotations per parameter, Adam's
        elementwise passes over all the parameters at once (one `torch._foreach_*` op each: the same op per tensor,
        without a Python op per parameter)."""
        cfg = self.cfg
        (beta1, beta2), layouts = cfg.betas, [self.layout(unit) for unit in units]
        gs = [
            _rotated(layout, grad.detach().reshape(layout.view).to(self.dtype), state.active, back=False)
            for layout, state, grad in zip(layouts, states, grads, strict=True)
        ]
        ms = running_sums([state.exp_avg for state in states], gs, beta1)
        vs = running_squares([state.exp_avg_sq for state in states], gs, beta2)
        for state, m, v in zip(states, ms, vs, strict=True):
            state.exp_avg, state.exp_avg_sq = m, v
        if not gs:
            return []
        # m_hat / (sqrt(v_hat) + eps) with the bias corrections as scalars (one pass each, no m_hat or v_hat)
        counts = [state.count if cfg.use_bias_correction else 0 for state in states]  # beta^0: no correction
        denoms = torch._foreach_sqrt(vs)
        torch._foreach_mul_(denoms, [1.0 / math.sqrt(1.0 - beta2**c) if c else 1.0 for c in counts])
        torch._foreach_add_(denoms, cfg.epsilon)
        ns = torch._foreach_div(ms, denoms)
        torch._foreach_mul_(ns, [1.0 / (1.0 - beta1**c) if c else 1.0 for c in counts])
        out = [
            _rotated(layout, n, state.active, back=True) for layout, state, n in zip(layouts, states, ns, strict=True)
        ]
        if cfg.weight_decay:  # every direction is a new tensor
            weights = [
                param.detach().reshape(layout.view).to(self.dtype)
                for layout, param in zip(layouts, params, strict=True)
            ]
            torch._foreach_add_(out, weights, alpha=cfg.weight_decay)
        return out
