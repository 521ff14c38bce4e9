"""Typed configuration of Shampoo and SOAP (frozen dataclasses validated on entry; kinds are enums).

Defaults follow the Distributed Shampoo paper (Shi et al.; its Table 2 where it states no default) and the
SOAP paper (Vyas et al.). A kind given as its string value (``grafting_type="adam"``) is converted to the enum.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from fxkfac.config import member_of
from fxkfac.errors import ConfigError
from fxkfac.planner.problem.analytic import DEFAULT_MAX_DIM, LargeDimMethod

__all__ = [
    "GraftType",
    "LargeDimMethod",
    "RootInvMethod",
    "BasisMethod",
    "ShampooConfig",
    "SOAPConfig",
    "DEFAULT_MAX_DIM",
    "PRECONDITIONER_DTYPES",
]

PRECONDITIONER_DTYPES = ("float32", "float64")
"""The dtypes statistics, roots and bases may be kept in."""


class GraftType(StrEnum):
    """The diagonal method whose per-block step length Shampoo takes (paper §2.4)."""

    SGD = "sgd"
    ADAGRAD = "adagrad"
    RMSPROP = "rmsprop"
    ADAM = "adam"


class RootInvMethod(StrEnum):
    """How a factor's inverse root is computed (paper §3.2.1)."""

    EIGH = "eigh"
    NEWTON = "newton"


class BasisMethod(StrEnum):
    """How SOAP refreshes a factor's eigenbasis: a full eigh, or one QR power iteration from the previous basis
    (eigh when there is none)."""

    EIGH = "eigh"
    QR = "qr"


def _require(ok: bool, cls_name: str, field: str, what: str, value: Any) -> None:
    """ConfigError "<cls>.<field> must be <what>, got <value>" unless `ok`."""
    if not ok:
        raise ConfigError(f"{cls_name}.{field} must be {what}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_common(cfg: Any, cls_name: str) -> None:
    """The fields Shampoo and SOAP share: betas, epsilon, blocking, frequency and start, dtype."""
    betas = cfg.betas
    _require(isinstance(betas, tuple) and len(betas) == 2, cls_name, "betas", "a pair (beta1, beta2)", betas)
    _require(0.0 <= betas[0] < 1.0, cls_name, "betas", "(beta1, beta2) with 0 <= beta1 < 1", betas)
    _require(0.0 < betas[1] <= 1.0, cls_name, "betas", "(beta1, beta2) with 0 < beta2 <= 1", betas)
    _require(cfg.epsilon > 0, cls_name, "epsilon", "> 0", cfg.epsilon)
    _require(cfg.weight_decay >= 0, cls_name, "weight_decay", ">= 0", cfg.weight_decay)
    dim = cfg.max_preconditioner_dim
    _require(
        dim == "auto" or (_is_int(dim) and dim >= 1), cls_name, "max_preconditioner_dim", "an int >= 1 or 'auto'", dim
    )
    _require(
        _is_int(cfg.precondition_frequency) and cfg.precondition_frequency >= 1,
        cls_name,
        "precondition_frequency",
        "an int >= 1",
        cfg.precondition_frequency,
    )
    _require(
        _is_int(cfg.start_preconditioning_step) and cfg.start_preconditioning_step >= 0,
        cls_name,
        "start_preconditioning_step",
        "an int >= 0",
        cfg.start_preconditioning_step,
    )
    _require(
        cfg.preconditioner_dtype in PRECONDITIONER_DTYPES,
        cls_name,
        "preconditioner_dtype",
        f"one of {PRECONDITIONER_DTYPES}",
        cfg.preconditioner_dtype,
    )
    object.__setattr__(
        cfg, "large_dim_method", member_of(LargeDimMethod, cfg.large_dim_method, f"{cls_name}.large_dim_method")
    )


def _check_newton_pieces(cfg: ShampooConfig) -> None:
    """ConfigError unless newton_pieces is an int >= 1, with the Newton method when > 1, and at most
    newton_max_iterations (every piece runs at least one iteration)."""
    pieces = cfg.newton_pieces
    _require(_is_int(pieces) and pieces >= 1, "ShampooConfig", "newton_pieces", "an int >= 1", pieces)
    if pieces > 1 and cfg.root_inv_method is not RootInvMethod.NEWTON:
        raise ConfigError(
            f"ShampooConfig.newton_pieces={pieces} needs root_inv_method='newton' (an eigendecomposition "
            f"is one task; only the coupled Newton iteration is cut into pieces), got "
            f"root_inv_method={cfg.root_inv_method.value!r}; set root_inv_method='newton' or "
            "newton_pieces=1"
        )
    if pieces > cfg.newton_max_iterations:
        raise ConfigError(
            f"ShampooConfig.newton_pieces={pieces} exceeds newton_max_iterations="
            f"{cfg.newton_max_iterations} (each piece runs at least one iteration); lower newton_pieces "
            "or raise newton_max_iterations"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ShampooConfig:
    """Hyperparameters of Distributed Shampoo (semantics: fxkfac/shampoo/family.py)."""

    betas: tuple[float, float] = (0.0, 0.999)
    """beta1 filters the gradient (0: none); beta2 < 1 averages L and R, beta2 = 1 sums them."""
    epsilon: float = 1e-12
    """Added to the shifted eigenvalues of L and R before their inverse roots."""
    use_bias_correction: bool = True
    """Divide the filtered gradient by 1 - beta1^(t+1) and L, R by 1 - beta2^(t+1) (t counted from 0)."""
    momentum: float = 0.9
    """mu of M <- mu M + P (0: none)."""
    use_nesterov: bool = True
    """Step along mu M + P instead of M."""
    weight_decay: float = 1e-4
    """lambda of the weight decay."""
    use_decoupled_weight_decay: bool = True
    """P += lambda W after grafting (AdamW-style); False: G += lambda W before everything (L2)."""
    use_weight_decay_on_bias_and_norm_params: bool = True
    """False: parameters of fewer than 2 dimensions (biases, norm scales) are not decayed."""
    max_preconditioner_dim: int | Literal["auto"] = "auto"
    """Block side b; "auto": the planner's choice, DEFAULT_MAX_DIM (1024) without a plan."""
    large_dim_method: LargeDimMethod = LargeDimMethod.BLOCKING
    """What happens to sides longer than b (fxkfac.planner.problem.analytic)."""
    use_merge_dims: bool = True
    """Merge consecutive dimensions while their product stays <= b."""
    precondition_frequency: int = 50
    """Inverse roots are recomputed every this many steps."""
    start_preconditioning_step: int = 0
    """Steps before it take the graft direction; refreshes happen at t = start (mod frequency)."""
    grafting_type: GraftType = GraftType.SGD
    """The method whose per-block norm the Shampoo direction takes."""
    grafting_epsilon: float = 1e-8
    """epsilon of the graft direction G / (sqrt(A) + epsilon)."""
    grafting_beta2: float = 0.999
    """EMA factor of the RMSProp and Adam graft accumulators."""
    exponent_override: int | None = None
    """p of L^(-eta/p); None: 2 * order of the preconditioned view (4 for a matrix, 2 for a vector)."""
    exponent_multiplier: float = 1.0
    """eta of L^(-eta/p) (eigh only)."""
    root_inv_method: RootInvMethod = RootInvMethod.EIGH
    """Symmetric eigendecomposition, or the coupled inverse Newton iteration."""
    use_protected_eigh: bool = True
    """Retry a failed eigh in float64, then keep the previous roots; False: a failure raises."""
    newton_tolerance: float = 1e-6
    """Newton stops once max row sum of |M_k - I| is below it."""
    newton_max_iterations: int = 100
    """Newton gives up after this many iterations and falls back to (protected) eigh."""
    newton_pieces: int = 1
    """Tasks each root inverse is made in ("DECOMP s L i/n"; 1: one task, under either method). n > 1 needs
    root_inv_method='newton': piece i runs its share of newton_max_iterations and hands (X, M) on, the last
    applies the convergence test and the eigh fallback, so the pieces make exactly the one task's roots."""
    preconditioner_dtype: str = "float32"
    """dtype of L, R and their roots ("float32" or "float64")."""

    def __post_init__(self) -> None:
        name = "ShampooConfig"
        _check_common(self, name)
        _require(0.0 <= self.momentum < 1.0, name, "momentum", "in [0, 1)", self.momentum)
        _require(self.grafting_epsilon > 0, name, "grafting_epsilon", "> 0", self.grafting_epsilon)
        _require(0.0 < self.grafting_beta2 <= 1.0, name, "grafting_beta2", "in (0, 1]", self.grafting_beta2)
        p = self.exponent_override
        _require(p is None or (_is_int(p) and p >= 1), name, "exponent_override", "None or an int >= 1", p)
        _require(self.exponent_multiplier > 0, name, "exponent_multiplier", "> 0", self.exponent_multiplier)
        _require(self.newton_tolerance > 0, name, "newton_tolerance", "> 0", self.newton_tolerance)
        _require(
            _is_int(self.newton_max_iterations) and self.newton_max_iterations >= 1,
            name,
            "newton_max_iterations",
            "an int >= 1",
            self.newton_max_iterations,
        )
        object.__setattr__(self, "grafting_type", member_of(GraftType, self.grafting_type, f"{name}.grafting_type"))
        object.__setattr__(
            self, "root_inv_method", member_of(RootInvMethod, self.root_inv_method, f"{name}.root_inv_method")
        )
        _check_newton_pieces(self)
        if self.root_inv_method is RootInvMethod.NEWTON and self.exponent_multiplier != 1.0:
            raise ConfigError(
                f"{name}.exponent_multiplier must be 1.0 with root_inv_method='newton' (the coupled "
                f"Newton iteration computes integer roots only), got {self.exponent_multiplier!r}; "
                "use root_inv_method='eigh' or exponent_override"
            )

    @property
    def max_dim(self) -> int:
        """The block side without a plan ("auto" -> DEFAULT_MAX_DIM)."""
        return DEFAULT_MAX_DIM if self.max_preconditioner_dim == "auto" else int(self.max_preconditioner_dim)


@dataclass(frozen=True, kw_only=True, slots=True)
class SOAPConfig:
    """Hyperparameters of SOAP: AdamW in the eigenbases of Shampoo's factors (semantics: fxkfac/shampoo/soap.py)."""

    betas: tuple[float, float] = (0.95, 0.95)
    """Adam's beta1 (first moment) and beta2 (second moment), both in the rotated basis."""
    shampoo_beta: float = 0.95
    """EMA factor of L and R (1: plain sums)."""
    epsilon: float = 1e-8
    """Adam's epsilon: m_hat / (sqrt(v_hat) + epsilon)."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay lambda: P += lambda W, on every parameter."""
    use_bias_correction: bool = True
    """Adam's bias correction of both moments."""
    precondition_frequency: int = 10
    """Eigenbases are refreshed every this many steps."""
    start_preconditioning_step: int = 0
    """Steps before the first basis run plain AdamW; refreshes happen at t = start (mod frequency)."""
    max_preconditioner_dim: int | Literal["auto"] = "auto"
    """Block side b; "auto": the planner's choice, DEFAULT_MAX_DIM (1024) without a plan."""
    use_merge_dims: bool = False
    """Merge consecutive dimensions while their product stays <= b."""
    large_dim_method: LargeDimMethod = LargeDimMethod.BLOCKING
    """Sides longer than b: BLOCKING cuts blocks; DIAGONAL keeps the identity basis on that side; ADAGRAD runs
    plain AdamW on the parameter."""
    basis_method: BasisMethod = BasisMethod.QR
    """Refresh by eigh, or by one QR power iteration from the previous basis (SOAP's default)."""
    precondition_1d: bool = False
    """Rotate 1-D parameters by the eigenbasis of their one factor; False: plain AdamW on them."""
    preconditioner_dtype: str = "float32"
    """dtype of L, R and the bases ("float32" or "float64")."""

    def __post_init__(self) -> None:
        name = "SOAPConfig"
        _check_common(self, name)
        _require(
            0.0 < self.betas[1] < 1.0, name, "betas", "(beta1, beta2) with beta2 < 1 (Adam's second moment)", self.betas
        )
        _require(0.0 <= self.shampoo_beta <= 1.0, name, "shampoo_beta", "in [0, 1]", self.shampoo_beta)
        object.__setattr__(self, "basis_method", member_of(BasisMethod, self.basis_method, f"{name}.basis_method"))

    @property
    def max_dim(self) -> int:
        """The block side without a plan ("auto" -> DEFAULT_MAX_DIM)."""
        return DEFAULT_MAX_DIM if self.max_preconditioner_dim == "auto" else int(self.max_preconditioner_dim)
