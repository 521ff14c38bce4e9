"""Dense float64 references of Shampoo and SOAP, written from the papers in NumPy (no fxkfac.shampoo code).

Each block is preconditioned in its Kronecker form on vec(G_b) (row-major):
- Shampoo: P_b = (L^(2 eta/p) kron R^(2 eta/p))^(-1/2) vec(G^_b) with L, R shifted to a positive spectrum plus
  epsilon (a diagonal side: diag of the statistic), i.e. the paper's (L^(1/2) kron R^(1/2))^(-1/2) vec(G) for
  p = 4, eta = 1; then grafting per block, weight decay, momentum (Alg. 2).
- SOAP: Q = Q_L kron Q_R; Adam on Q^T vec(G_b), rotated back by Q; the moments follow a new basis by
  O = Q_old^T Q_new: m <- O^T m, v <- (O o O)^T v.
Blocking, merging and the large-dimension rules are re-derived here from the paper, independently.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fxkfac.shampoo.config import BasisMethod, GraftType, LargeDimMethod, ShampooConfig, SOAPConfig

Array = np.ndarray


def view_of(shape: tuple[int, ...], b: int, merge: bool) -> tuple[int, ...]:
    """Size-1 dims dropped, merged while the product stays <= b, then (d0, rest) for order > 2."""
    dims = [d for d in shape if d != 1] or [1]
    if merge:
        out = [dims[0]]
        for d in dims[1:]:
            out = out[:-1] + [out[-1] * d] if out[-1] * d <= b else out + [d]
        dims = out
    return tuple(dims) if len(dims) <= 2 else (dims[0], math.prod(dims[1:]))


@dataclass
class RefBlock:
    """One block: its index, and per side "dense", "diag" or None (no factor)."""

    index: tuple[slice, ...]
    sides: list[str | None]


def blocks_of(view: tuple[int, ...], b: int, method: LargeDimMethod) -> list[RefBlock]:
    """BLOCKING: b-sized ragged blocks, dense factors; DIAGONAL: one block, diag factors above b; ADAGRAD: one
    block, no factors when any side is above b."""
    whole = tuple(slice(0, d) for d in view)
    if method == LargeDimMethod.DIAGONAL:
        return [RefBlock(whole, ["diag" if d > b else "dense" for d in view])]
    if method == LargeDimMethod.ADAGRAD:
        return [RefBlock(whole, [None if any(d > b for d in view) else "dense" for _ in view])]
    rows = [slice(i, min(i + b, view[0])) for i in range(0, view[0], b)]
    if len(view) == 1:
        return [RefBlock((r,), ["dense"]) for r in rows]
    cols = [slice(j, min(j + b, view[1])) for j in range(0, view[1], b)]
    return [RefBlock((r, c), ["dense", "dense"]) for r in rows for c in cols]


def side_gram(g: Array, side: int, kind: str) -> Array:
    """G G^T (side 0) or G^T G (side 1) of a 2-D block, g g^T of a 1-D one; a diag side keeps the diagonal."""
    m = g.reshape(-1, 1) if g.ndim == 1 else (g if side == 0 else g.T)
    gram = m @ m.T
    return np.diag(np.diag(gram)) if kind == "diag" else gram


def mat_power(a: Array, power: float) -> Array:
    """a^power of a symmetric positive definite matrix."""
    w, v = np.linalg.eigh(a)
    return (v * w**power) @ v.T


def shifted(a: Array, eps: float) -> Array:
    """a with its spectrum shifted to >= 0, plus eps."""
    w, v = np.linalg.eigh(a)
    w = w - min(w.min(), 0.0) + eps
    return (v * w) @ v.T


def refreshes(cfg: ShampooConfig | SOAPConfig, t: int) -> bool:
    """Roots or bases are recomputed at start, start + f, start + 2f, ..."""
    start = cfg.start_preconditioning_step
    return t >= start and (t - start) % cfg.precondition_frequency == 0


def ema(old: Array | None, new: Array, beta: float) -> Array:
    """beta old + (1 - beta) new from zero; a sum when beta is 1."""
    old = np.zeros_like(new) if old is None else old
    return old + new if beta == 1.0 else beta * old + (1 - beta) * new


@dataclass
class _ShampooParam:
    view: tuple[int, ...]
    blocks: list[RefBlock]
    stats: dict[tuple[int, int], Array] = field(default_factory=dict)
    kron: dict[int, Array] = field(default_factory=dict)
    graft: Array | None = None
    filtered: Array | None = None
    momentum: Array | None = None


class ShampooReference:
    """Alg. 2 of the Distributed Shampoo paper, one parameter at a time; `step` returns the directions P."""

    def __init__(self, cfg: ShampooConfig, shapes: Mapping[str, tuple[int, ...]], b: int) -> None:
        self.cfg = cfg
        self.shapes = dict(shapes)
        self.params = {}
        for name, shape in shapes.items():
            view = view_of(shape, b, cfg.use_merge_dims)
            self.params[name] = _ShampooParam(view, blocks_of(view, b, cfg.large_dim_method))

    def step(self, t: int, weights: Mapping[str, Array], grads: Mapping[str, Array]) -> dict[str, Array]:
        """The directions of step t (from 0)."""
        return {n: self._param(n, t, weights[n], grads[n]).reshape(self.shapes[n]) for n in grads}

    def _param(self, name: str, t: int, w: Array, grad: Array) -> Array:
        cfg, st = self.cfg, self.params[name]
        beta1, beta2 = cfg.betas
        w, g = w.reshape(st.view), grad.reshape(st.view)
        decays = cfg.weight_decay > 0 and (cfg.use_weight_decay_on_bias_and_norm_params or len(self.shapes[name]) > 1)
        if decays and not cfg.use_decoupled_weight_decay:
            g = g + cfg.weight_decay * w
        for i, blk in enumerate(st.blocks):
            for side, kind in enumerate(blk.sides):
                if kind is not None:
                    st.stats[i, side] = ema(st.stats.get((i, side)), side_gram(g[blk.index], side, kind), beta2)
        if cfg.grafting_type != GraftType.SGD:
            st.graft = ema(st.graft, g * g, 1.0 if cfg.grafting_type == GraftType.ADAGRAD else cfg.grafting_beta2)
        if refreshes(cfg, t):
            self._refresh(st, t)
        g_hat = g
        if beta1 > 0:
            st.filtered = ema(st.filtered, g, beta1)
            g_hat = st.filtered / (1 - beta1 ** (t + 1)) if cfg.use_bias_correction else st.filtered
        p_graft = self._graft_direction(st, g_hat, t)
        p = p_graft.copy()
        for i, blk in enumerate(st.blocks):
            if i in st.kron:
                s = (st.kron[i] @ g_hat[blk.index].reshape(-1)).reshape(g_hat[blk.index].shape)
                norm = np.linalg.norm(s)
                p[blk.index] = s * np.linalg.norm(p_graft[blk.index]) / norm if norm > 0 else 0.0
        if decays and cfg.use_decoupled_weight_decay:
            p = p + cfg.weight_decay * w
        if cfg.momentum > 0:
            st.momentum = cfg.momentum * (0 if st.momentum is None else st.momentum) + p
            p = cfg.momentum * st.momentum + p if cfg.use_nesterov else st.momentum
        return p

    def _refresh(self, st: _ShampooParam, t: int) -> None:
        """(L^(2 eta/p) kron R^(2 eta/p))^(-1/2) per block with factors."""
        cfg = self.cfg
        beta2 = cfg.betas[1]
        correction = 1 - beta2 ** (t + 1) if cfg.use_bias_correction and beta2 < 1 else 1.0
        p = cfg.exponent_override or 2 * len(st.view)
        for i, blk in enumerate(st.blocks):
            if blk.sides[0] is None:
                continue
            factors = [
                mat_power(shifted(st.stats[i, s] / correction, cfg.epsilon), 2 * cfg.exponent_multiplier / p)
                for s in range(len(blk.sides))
            ]
            k = factors[0] if len(factors) == 1 else np.kron(factors[0], factors[1])
            st.kron[i] = mat_power(k, -0.5)

    def _graft_direction(self, st: _ShampooParam, g_hat: Array, t: int) -> Array:
        cfg = self.cfg
        if cfg.grafting_type == GraftType.SGD:
            return g_hat
        acc = st.graft
        assert acc is not None
        if cfg.grafting_type == GraftType.ADAM and cfg.use_bias_correction and cfg.grafting_beta2 < 1:
            acc = acc / (1 - cfg.grafting_beta2 ** (t + 1))
        return g_hat / (np.sqrt(acc) + cfg.grafting_epsilon)


@dataclass
class _SOAPParam:
    view: tuple[int, ...]
    blocks: list[RefBlock]
    stats: dict[tuple[int, int], Array] = field(default_factory=dict)
    bases: dict[tuple[int, int], Array] = field(default_factory=dict)
    m: dict[int, Array] = field(default_factory=dict)
    v: dict[int, Array] = field(default_factory=dict)


class SOAPReference:
    """SOAP: AdamW on Q^T vec(G_b) per block, Q = Q_L kron Q_R (identity where a side has no factor)."""

    def __init__(self, cfg: SOAPConfig, shapes: Mapping[str, tuple[int, ...]], b: int) -> None:
        self.cfg = cfg
        self.shapes = dict(shapes)
        self.params = {}
        for name, shape in shapes.items():
            view = view_of(shape, b, cfg.use_merge_dims)
            blocks = blocks_of(view, b, cfg.large_dim_method)
            for blk in blocks:
                blk.sides = [
                    None if k == "diag" or (len(view) == 1 and not cfg.precondition_1d) else k for k in blk.sides
                ]
            self.params[name] = _SOAPParam(view, blocks)

    def step(self, t: int, weights: Mapping[str, Array], grads: Mapping[str, Array]) -> dict[str, Array]:
        """The directions of step t (from 0)."""
        return {n: self._param(n, t, weights[n], grads[n]).reshape(self.shapes[n]) for n in grads}

    def _kron(self, st: _SOAPParam, i: int) -> Array:
        """Q of block i (identity on sides without a basis)."""
        blk = st.blocks[i]
        dims = [s.stop - s.start for s in blk.index]
        qs = [st.bases.get((i, s), np.eye(d)) for s, d in enumerate(dims)]
        return qs[0] if len(qs) == 1 else np.kron(qs[0], qs[1])

    def _param(self, name: str, t: int, w: Array, grad: Array) -> Array:
        cfg, st = self.cfg, self.params[name]
        beta1, beta2 = cfg.betas
        w, g = w.reshape(st.view), grad.reshape(st.view)
        for i, blk in enumerate(st.blocks):
            for side, kind in enumerate(blk.sides):
                if kind is not None:
                    st.stats[i, side] = ema(
                        st.stats.get((i, side)), side_gram(g[blk.index], side, kind), cfg.shampoo_beta
                    )
        if refreshes(cfg, t):
            self._refresh(st)
        p = np.zeros_like(g)
        for i, blk in enumerate(st.blocks):
            q = self._kron(st, i)
            rotated = q.T @ g[blk.index].reshape(-1)
            st.m[i] = ema(st.m.get(i), rotated, beta1)
            st.v[i] = ema(st.v.get(i), rotated**2, beta2)
            m_hat, v_hat = st.m[i], st.v[i]
            if cfg.use_bias_correction:
                m_hat, v_hat = m_hat / (1 - beta1 ** (t + 1)), v_hat / (1 - beta2 ** (t + 1))
            p[blk.index] = (q @ (m_hat / (np.sqrt(v_hat) + cfg.epsilon))).reshape(g[blk.index].shape)
        return p + cfg.weight_decay * w

    def _refresh(self, st: _SOAPParam) -> None:
        """New bases per factor (eigh, or sorted power iteration + QR from the current one); moments follow."""
        old = {i: self._kron(st, i) for i in range(len(st.blocks))}
        for (i, side), stat in st.stats.items():
            prev = st.bases.get((i, side))
            if prev is None or self.cfg.basis_method == BasisMethod.EIGH:
                st.bases[i, side] = np.linalg.eigh(stat)[1]
            else:
                prev = prev[:, np.argsort(-np.diag(prev.T @ stat @ prev), kind="stable")]
                st.bases[i, side] = np.linalg.qr(stat @ prev)[0]
        for i in st.m:
            o = old[i].T @ self._kron(st, i)
            st.m[i], st.v[i] = o.T @ st.m[i], (o * o).T @ st.v[i]
