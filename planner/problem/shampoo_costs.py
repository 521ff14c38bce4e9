"""Analytic costs of Shampoo and SOAP: one LayerCost per parameter, parts L and R fed by the reduced gradient.

Every parameter of the model is cut into blocks by `planner.blocking` (Shampoo: merged dims, as
`ShampooConfig.use_merge_dims`; SOAP: unmerged, and its 1-D parameters left to plain AdamW, as
`SOAPConfig.precondition_1d=False`). A block of shape (r, c) (a 1-D block is (r, 1)) with factor sides (m, n)
costs, each kernel timed by the K-FAC model's roofline (`planner.analytic.roofline`, fp32 peak, the hardware's
matmul and factorization efficiencies; that model has no launch-latency floor, so neither has this one):

- statistics, every step (parts L and R, `after=ALLREDUCE_GRAD`): L += G G^T, 2 r^2 c FLOPs; R += G^T G,
  2 r c^2 FLOPs; bytes: G read, the factor read and written.
- decomposition, every refresh, per side of b = m or n:
  Shampoo by eigh (`RootMethod.EIGH`, its default): EIGH_FLOPS b^3 = 9 b^3 at factorization efficiency (Golub &
  Van Loan sec. 8.3.6), then Q diag(lambda^-1/p) Q^T, 2 b^3 at matmul efficiency;
  Shampoo by coupled Newton (`RootMethod.NEWTON`): NEWTON_ITERATIONS x `newton_matmuls(p)` products of 2 b^3;
  SOAP by one power step and QR (`RootMethod.QR`, its default): L Q (2 b^3, matmul) then Householder QR with Q
  formed, QR_FLOPS b^3 = 8/3 b^3 (geqrf 4/3 + orgqr 4/3, Golub & Van Loan sec. 5.2.2), plus re-projecting
  Adam's first moment into the new basis on that side (two products, 2 r c b each).
- preconditioning, every step (LayerCost.prec): Shampoo L^-1/p G R^-1/p, 2 r c (r + c) FLOPs; SOAP rotates
  the gradient in and the Adam direction out, twice that; plus ELEMENTWISE_PASSES fp32 passes over the
  parameter (graft norms, momentum, weight decay; SOAP: Adam's moments) at memory bandwidth.
- bytes: each factor 4 b^2 (PartCost.state_bytes; its root or basis is as large, as K-FAC's inverse is);
  LayerCost.state_bytes: Shampoo's momentum (ShampooConfig: momentum 0.9, SGD graft, beta1 0: no graft or
  filtered-gradient state), SOAP's Adam moments m and v.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from fxkfac.planner.problem.analytic import EIGH_FLOPS, analytic_cost_table, roofline
from fxkfac.planner.problem.blocking import LargeDimMethod, partition
from fxkfac.planner.problem.costs import CostTable, LayerCost, PartCost
from fxkfac.planner.problem.errors import CostModelError
from fxkfac.planner.problem.hardware import HardwareSpec, Precision
from fxkfac.planner.problem.hardware import hardware as get_hardware
from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.problem.preconditioners import PreconditionerKind, tagged_source
from fxkfac.planner.problem.presets import BlockSpec, ModelSpec, TensorSpec, preset

__all__ = [
    "RootMethod",
    "QR_FLOPS",
    "NEWTON_ITERATIONS",
    "ELEMENTWISE_PASSES",
    "STATE_BUFFERS",
    "newton_matmuls",
    "SideCost",
    "side_cost",
    "parameter_cost",
    "largest_dim",
    "gradient_cost_table",
]

_F32 = 4

QR_FLOPS = 8 / 3
"""FLOPs per b^3 of a Householder QR of a b x b matrix with Q formed (geqrf 4b^3/3 + orgqr 4b^3/3)."""

NEWTON_ITERATIONS = 20
"""Coupled inverse Newton iterations per root (an estimate): the paper gives no count, the reference
implementations cap it at 100 (`num_iters=100` in google-research scalable_shampoo; ShampooConfig's
newton_max_iterations) and stop at ||M_k - I|| < 1e-6; from the scaled start X0 = I/c the error shrinks
linearly, then quadratically, which takes about 20 steps for float32 factors of condition number <= 1e6."""

ELEMENTWISE_PASSES: dict[PreconditionerKind, int] = {
    PreconditionerKind.SHAMPOO: 8,  # G and P for the two norms, P and W read + P written (decay), M read + written
    PreconditionerKind.SOAP: 8,  # rotated G read, m and v read + written, W read, the direction written twice
}
"""fp32 reads and writes per parameter element of a step's elementwise work (besides the matmuls)."""

STATE_BUFFERS: dict[PreconditionerKind, int] = {PreconditionerKind.SHAMPOO: 1, PreconditionerKind.SOAP: 2}
"""Parameter-sized fp32 buffers of optimizer state: Shampoo's momentum; SOAP's Adam m and v."""


class RootMethod(StrEnum):
    """How a factor is decomposed at a refresh (the module doc gives each one's cost)."""

    EIGH = "eigh"
    NEWTON = "newton"
    QR = "qr"


_METHODS = {
    PreconditionerKind.SHAMPOO: (RootMethod.EIGH, RootMethod.NEWTON),
    PreconditionerKind.SOAP: (RootMethod.QR, RootMethod.EIGH),
}
"""The methods each family has, its default first."""


def newton_matmuls(p: int) -> int:
    """Matrix products of one coupled Newton step for the inverse p-th root: Z^p by repeated squaring
    (floor(log2 p) squarings and popcount(p) - 1 products), Z^p M_k, and X_k Z."""
    return p.bit_length() - 1 + p.bit_count() - 1 + 2


@dataclass(frozen=True, slots=True)
class SideCost:
    """One side's share of a block: seconds of its statistic per step and of its decomposition per refresh."""

    stats: float
    decomp: float


def _gemm(hw: HardwareSpec, flops: float, nbytes: float) -> float:
    return roofline(hw, flops, nbytes, hw.peak_flops, hw.matmul_efficiency)


def _factorization(hw: HardwareSpec, flops: float, b: int) -> float:
    return roofline(hw, flops, 2 * _F32 * b * b, hw.peak_flops, hw.factorization_efficiency)


def _decomp(hw: HardwareSpec, method: RootMethod, b: int, other: int, order: int) -> float:
    """Seconds to decompose one b x b factor of a block whose other side is `other`, of `order` 1 or 2."""
    square = 3 * _F32 * b * b  # two operands read, one result written
    if method is RootMethod.EIGH:
        return _factorization(hw, EIGH_FLOPS * b**3, b) + _gemm(hw, 2 * b**3, square)
    if method is RootMethod.NEWTON:
        return NEWTON_ITERATIONS * newton_matmuls(2 * order) * _gemm(hw, 2 * b**3, square)
    reproject = 2 * _gemm(hw, 2 * b * b * other, _F32 * (b * b + 2 * b * other))
    return _gemm(hw, 2 * b**3, square) + _factorization(hw, QR_FLOPS * b**3, b) + reproject


def side_cost(hw: HardwareSpec, method: RootMethod, side: int, other: int, order: int) -> SideCost:
    """The cost of one factor of side `side` of a block side x other (`order` 2), or of a vector block of
    `side` elements (`order` 1, other = 1): its statistic G G^T (or G^T G) and its decomposition."""
    stats = _gemm(hw, 2 * side * side * other, _F32 * (side * other + 2 * side * side))
    return SideCost(stats, _decomp(hw, method, side, other, order))


def _apply_flops(kind: PreconditionerKind, shape: tuple[int, int], sides: tuple[int, int]) -> tuple[int, int]:
    """FLOPs and bytes of a step's preconditioning matmuls of one block of `shape` with factor `sides`."""
    r, c = shape
    flops = (2 * r * r * c if sides[0] else 0) + (2 * r * c * c if sides[1] else 0)
    nbytes = _F32 * (sides[0] ** 2 + sides[1] ** 2 + 3 * r * c)
    times = 2 if kind is PreconditionerKind.SOAP else 1  # SOAP rotates in and out
    return times * flops, times * nbytes


def parameter_cost(
    tensor: TensorSpec, hw: HardwareSpec, kind: PreconditionerKind, max_dim: int, method: RootMethod | None = None
) -> LayerCost | None:
    """The LayerCost of one parameter (name: its FQN) cut into blocks of side <= max_dim; None when the family
    leaves it to its diagonal method (SOAP's 1-D parameters). `method`: the family's default when None."""
    method = _METHODS[kind][0] if method is None else method
    if method not in _METHODS[kind]:
        raise CostModelError(f"{kind} decomposes by {[m.value for m in _METHODS[kind]]}, not {method.value!r}")
    view, blocks = partition(tensor.shape, max_dim, LargeDimMethod.BLOCKING, merge=kind is PreconditionerKind.SHAMPOO)
    if kind is PreconditionerKind.SOAP and len(view) == 1:
        return None
    sides: dict[str, list[SideCost]] = {"L": [], "R": []}
    bytes_of = {"L": 0, "R": 0}
    prec = 0.0
    for block in blocks:
        shape = (block.shape[0], block.shape[1] if len(view) == 2 else 1)
        for part, side, other in (("L", block.sides[0], shape[1]), ("R", block.sides[1], shape[0])):
            if side:
                sides[part].append(side_cost(hw, method, side, other, len(view)))
                bytes_of[part] += _F32 * side * side
        prec += _gemm(hw, *_apply_flops(kind, shape, block.sides))
    prec += ELEMENTWISE_PASSES[kind] * _F32 * tensor.numel / hw.mem_bandwidth
    parts = tuple(
        PartCost(
            part, OpKind.ALLREDUCE_GRAD, sum(x.stats for x in costs), sum(x.decomp for x in costs), 0, bytes_of[part]
        )
        for part, costs in sides.items()
        if costs
    )
    return LayerCost(tensor.name, parts, prec, STATE_BUFFERS[kind] * _F32 * tensor.numel, _F32 * tensor.numel)


def largest_dim(spec: ModelSpec) -> int:
    """The longest side of any parameter of the model: a block size this large blocks nothing."""
    return max(max(t.shape) for t in spec.parameters)


def gradient_cost_table(
    model_spec: ModelSpec | str,
    stages: int | Sequence[range | tuple[int, int]],
    micro_batch_size: int,
    seq_len: int | None = None,
    hardware: HardwareSpec | str = "p100",
    *,
    kind: PreconditionerKind,
    max_dim: int | None,
    method: RootMethod | None = None,
    precision: Precision = Precision.FP32,
) -> CostTable:
    """The analytic CostTable of Shampoo or SOAP over a preset's pipeline: the K-FAC model's stages (same split,
    forward, backward and memory) with one LayerCost per parameter of each stage in place of the K-FAC layers.

    max_dim: the block side (`max_preconditioner_dim`); None blocks nothing (the largest parameter dimension).
    The source reads e.g. "shampoo:analytic:bert-base:seq128:fp32:eigh:block1024".
    """
    if kind is PreconditionerKind.KFAC:
        raise CostModelError("gradient_cost_table costs Shampoo or SOAP; K-FAC's is analytic_cost_table")
    spec = preset(model_spec) if isinstance(model_spec, str) else model_spec
    hw = get_hardware(hardware)
    side = largest_dim(spec) if max_dim is None else max_dim
    if isinstance(side, bool) or not isinstance(side, int) or side < 1:
        raise CostModelError(f"max_dim must be an int >= 1 or None (no blocking), got {max_dim!r}")
    how = _METHODS[kind][0] if method is None else method

    def units(block: BlockSpec) -> tuple[LayerCost, ...]:
        costs = (parameter_cost(t, hw, kind, side, how) for t in block.parameters)
        return tuple(c for c in costs if c is not None)

    table = analytic_cost_table(spec, stages, micro_batch_size, seq_len, hw, precision=precision, units=units)
    blocking = "unblocked" if max_dim is None else f"block{max_dim}"
    source = tagged_source(kind, f"{table.source.rsplit(':', 1)[0]}:{how.value}:{blocking}")
    return replace(table, source=source, family=kind)
