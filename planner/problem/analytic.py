"""Analytic cost model: sympy FLOP and byte expressions over a hardware spec, turned into a CostTable.

Every kernel takes max(flops / (peak * efficiency), bytes / bandwidth) (a roofline). FLOPs count a
multiply-add as 2. Symbols: b micro-batch size, s rows per sample (tokens), d_in/d_out Linear
widths, beta 1 with a bias (the A factor gets a ones column) else 0, h heads, d_h head width,
n a factor's side, p bytes per activation element (4 fp32, 2 bf16); factors are kept in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import sympy

from fxkfac.planner.problem.costs import CostTable, LayerCost, StageCost
from fxkfac.planner.problem.errors import CostModelError
from fxkfac.planner.problem.hardware import HardwareSpec, Precision
from fxkfac.planner.problem.hardware import hardware as get_hardware
from fxkfac.planner.problem.preconditioners import InverseMethod
from fxkfac.planner.problem.presets import BlockSpec, LinearSpec, ModelSpec, preset

__all__ = [
    "SYMBOLS",
    "linear_expressions",
    "attention_expressions",
    "transformer_block_expressions",
    "kernel_time_expression",
    "explain",
    "KernelCost",
    "BlockCost",
    "linear_kernels",
    "block_kernels",
    "analytic_cost_table",
    "balanced_stages",
    "roofline",
    "EIGH_FLOPS",
]

b, s, d_in, d_out, beta, h, d_h, n, p = sympy.symbols("b s d_in d_out beta h d_h n p", positive=True)
d, f = sympy.symbols("d f", positive=True)
SYMBOLS = {x.name: x for x in (b, s, d_in, d_out, beta, h, d_h, n, p, d, f)}
"""The symbols the expressions use, by name."""

_FACTOR_BYTES = 4  # factors, inverses and curvature kernels are fp32

EIGH_FLOPS = 9
"""FLOPs of a symmetric eigendecomposition with eigenvectors, per n^3: ~9n^3 for the symmetric QR algorithm
(Golub & Van Loan, Matrix Computations, 4th ed., sec. 8.3.6; tridiagonal reduction 4n^3/3, QR sweeps and
accumulating Q the rest). LAPACK/cuSOLVER syevd (divide and conquer) does no more than this."""


@cache
def linear_expressions(inverse: InverseMethod = InverseMethod.CHOLESKY) -> dict[str, sympy.Expr]:
    """FLOPs and bytes of one Linear's forward, backward and K-FAC kernels, and the memory K-FAC keeps.

    Inversion of an n x n factor: Cholesky (n^3/3) + cholesky_inverse (potri: 2n^3/3) = n^3; an
    eigendecomposition (symmetric QR with eigenvectors, Golub & Van Loan, Matrix Computations,
    sec. 8.3) ~ 9n^3. Precondition B^-1 G A^-1: two GEMMs, 2 d_out d_a (d_a + d_out) FLOPs.
    """
    if inverse not in set(InverseMethod):
        raise CostModelError(f"inverse must be one of {[m.value for m in InverseMethod]}, got {inverse!r}")
    d_a = d_in + beta
    rows = b * s
    inv_flops = n**3 if inverse == InverseMethod.CHOLESKY else EIGH_FLOPS * n**3
    fb = _FACTOR_BYTES
    return {
        "fwd_flops": 2 * rows * d_in * d_out,
        "fwd_bytes": p * (rows * d_in + d_in * d_out + rows * d_out),
        "bwd_flops": 4 * rows * d_in * d_out,  # grad input and grad weight
        "bwd_bytes": p * (2 * rows * d_out + 2 * rows * d_in + 2 * d_in * d_out),
        "curv_a_flops": 2 * rows * d_a**2,
        "curv_a_bytes": p * rows * d_in + fb * d_a**2,
        "curv_b_flops": 2 * rows * d_out**2,
        "curv_b_bytes": p * rows * d_out + fb * d_out**2,
        "inv_flops": inv_flops,
        "inv_bytes": 2 * fb * n**2,
        "prec_flops": 2 * d_out * d_a * (d_a + d_out),
        "prec_bytes": fb * (2 * d_out * d_a + d_a**2 + d_out**2),
        "a_bytes": p * rows * d_in,
        "e_bytes": p * rows * d_out,
        "factor_a_bytes": fb * d_a**2,
        "factor_b_bytes": fb * d_out**2,
    }


@cache
def attention_expressions() -> dict[str, sympy.Expr]:
    """One attention core: Q K^T and A V GEMMs, and the softmax + dropout over the scores."""
    scores = b * h * s * s
    return {
        "fwd_flops": 2 * (2 * b * h * s * s * d_h),
        "fwd_bytes": 2 * p * (2 * b * s * h * d_h + scores),
        "bwd_flops": 2 * (4 * b * h * s * s * d_h),
        "bwd_bytes": 4 * p * (2 * b * s * h * d_h + scores),
        "elementwise_bytes": 2 * (2 * p * scores),  # softmax and dropout: read + write
        "saved_bytes": (2 * p + 1) * scores,  # softmax output, dropout output, 1-byte mask
    }


@cache
def transformer_block_expressions() -> dict[str, sympy.Expr]:
    """A BERT-style block (q, k, v, o: d -> d; d -> f -> d; one self-attention, h * d_h = d), summed."""
    lin = linear_expressions()
    widths = [(d, d)] * 4 + [(d, f), (f, d)]
    att = attention_expressions()

    def total(key: str) -> sympy.Expr:
        return sum((lin[key].subs({d_in: i, d_out: o}) for i, o in widths), sympy.Integer(0))

    out = {key: sympy.expand(total(key)) for key in ("fwd_flops", "bwd_flops", "curv_a_flops", "curv_b_flops")}
    out["fwd_flops"] = sympy.expand(out["fwd_flops"] + att["fwd_flops"].subs(d_h, d / h))
    out["bwd_flops"] = sympy.expand(out["bwd_flops"] + att["bwd_flops"].subs(d_h, d / h))
    out["inv_flops"] = sympy.expand(sum((lin["inv_flops"].subs(n, w) for pair in widths for w in pair), 0))
    return out


def kernel_time_expression() -> sympy.Expr:
    """Roofline time of one kernel: max(F / (P * eta), Q / W)."""
    flops, peak, eff, nbytes, bw = sympy.symbols("F P eta Q W", positive=True)
    return sympy.Max(flops / (peak * eff), nbytes / bw)


def explain() -> str:
    """The expressions as text (for `fxkfac plan --explain`)."""
    lines = [f"kernel time = {kernel_time_expression()}"]
    for title, exprs in (
        ("Linear", linear_expressions()),
        ("attention core", attention_expressions()),
        ("Transformer block", transformer_block_expressions()),
    ):
        lines.append(f"{title}:")
        lines += [f"  {key} = {expr}" for key, expr in exprs.items()]
    return "\n".join(lines)


@cache
def _compiled(group: str, inverse: InverseMethod) -> dict[str, Callable[..., float]]:
    exprs = linear_expressions(inverse) if group == "linear" else attention_expressions()
    args = (b, s, d_in, d_out, beta, h, d_h, n, p)
    return {key: sympy.lambdify(args, expr, modules="math") for key, expr in exprs.items()}


def _eval(group: str, inverse: InverseMethod = InverseMethod.CHOLESKY, **values: float) -> dict[str, float]:
    env = {"b": 0, "s": 0, "d_in": 0, "d_out": 0, "beta": 0, "h": 0, "d_h": 0, "n": 0, "p": 4, **values}
    args = [env[k] for k in ("b", "s", "d_in", "d_out", "beta", "h", "d_h", "n", "p")]
    return {key: float(fn(*args)) for key, fn in _compiled(group, inverse).items()}


@dataclass(frozen=True, slots=True)
class KernelCost:
    """Seconds of one Linear's work on a device, and the bytes K-FAC keeps for it."""

    fwd: float
    bwd: float
    layer: LayerCost | None
    """None for a layer K-FAC skips."""


def roofline(hw: HardwareSpec, flops: float, nbytes: float, peak: float, eff: float) -> float:
    """Seconds of one kernel: max(flops / (peak * eff), nbytes / memory bandwidth)."""
    return max(flops / (peak * eff), nbytes / hw.mem_bandwidth)


def linear_kernels(
    lin: LinearSpec, *, batch: int, seq_len: int, hw: HardwareSpec, precision: Precision, inverse: InverseMethod
) -> KernelCost:
    """Times of one Linear (fwd, bwd per micro-batch) and its LayerCost (curvature, inversion, ...)."""
    peak, bpe = _precision(hw, precision)
    tokens = lin.tokens if lin.tokens is not None else seq_len
    base = dict(b=batch, s=tokens, d_in=lin.d_in, d_out=lin.d_out, beta=int(lin.bias), p=bpe)
    e = _eval("linear", inverse, **base)
    eff = hw.matmul_efficiency
    fwd = roofline(hw, e["fwd_flops"], e["fwd_bytes"], peak, eff)
    bwd = roofline(hw, e["bwd_flops"], e["bwd_bytes"], peak, eff)
    if not lin.kfac:
        return KernelCost(fwd, bwd, None)
    fp32 = hw.peak_flops

    def inv(side: int) -> float:
        v = _eval("linear", inverse, n=side)
        return roofline(hw, v["inv_flops"], v["inv_bytes"], fp32, hw.factorization_efficiency)

    layer = LayerCost.kfac(
        lin.name,
        curv_a=roofline(hw, e["curv_a_flops"], e["curv_a_bytes"], fp32, eff),
        curv_b=roofline(hw, e["curv_b_flops"], e["curv_b_bytes"], fp32, eff),
        inv_a=inv(lin.d_in + int(lin.bias)),
        inv_b=inv(lin.d_out),
        prec=roofline(hw, e["prec_flops"], e["prec_bytes"], fp32, eff),
        a_bytes=round(e["a_bytes"]),
        e_bytes=round(e["e_bytes"]),
        factor_a_bytes=round(e["factor_a_bytes"]),
        factor_b_bytes=round(e["factor_b_bytes"]),
        grad_bytes=4 * (lin.d_in + int(lin.bias)) * lin.d_out,
    )
    return KernelCost(fwd, bwd, layer)


def _precision(hw: HardwareSpec, precision: Precision) -> tuple[float, int]:
    if precision == Precision.FP32:
        return hw.peak_flops, 4
    if precision == Precision.BF16:
        return hw.peak_flops_tensor, 2
    raise CostModelError(f"precision must be one of {[p.value for p in Precision]}, got {precision!r}")


@dataclass(frozen=True, slots=True)
class BlockCost:
    """Seconds (fwd, bwd per micro-batch) and memory of one block, and its K-FAC layers' costs."""

    fwd: float
    bwd: float
    params: int
    act_bytes: int
    peak_err_bytes: int
    layers: tuple[LayerCost, ...]
    hidden_bytes: int = 0
    """Bytes of one micro-batch's hidden state: the block's input, as large as its output."""


def block_kernels(
    block: BlockSpec,
    spec: ModelSpec,
    *,
    batch: int,
    seq_len: int,
    hw: HardwareSpec,
    precision: Precision,
    inverse: InverseMethod,
) -> BlockCost:
    """Sum of a block's Linears, attention cores and elementwise traffic, and its memory."""
    peak, bpe = _precision(hw, precision)
    kernels = [
        linear_kernels(x, batch=batch, seq_len=seq_len, hw=hw, precision=precision, inverse=inverse)
        for x in block.linears
    ]
    fwd = sum(k.fwd for k in kernels)
    bwd = sum(k.bwd for k in kernels)
    act: float = block.saved_per_token * bpe * batch * seq_len + block.saved_mask_bytes_per_token * batch * seq_len
    scores = 0.0
    if block.attention:
        a = _eval("attention", b=batch, s=seq_len, h=spec.heads, d_h=spec.hidden / spec.heads, p=bpe)
        ew = block.attention * a["elementwise_bytes"] / hw.mem_bandwidth
        eff = hw.matmul_efficiency
        fwd += block.attention * roofline(hw, a["fwd_flops"] / 2, a["fwd_bytes"] / 2, peak, eff) * 2 + ew
        bwd += block.attention * roofline(hw, a["bwd_flops"] / 2, a["bwd_bytes"] / 2, peak, eff) * 2 + 2 * ew
        act += block.attention * a["saved_bytes"]
        scores = bpe * batch * spec.heads * seq_len * seq_len
    elementwise = 2 * bpe * block.elementwise_per_token * batch * seq_len / hw.mem_bandwidth
    widest = max((x.d_out for x in block.linears), default=0)
    return BlockCost(
        fwd=fwd + elementwise,
        bwd=bwd + 2 * elementwise,
        params=block.params,
        act_bytes=round(act),
        peak_err_bytes=round(bpe * batch * seq_len * 2 * widest + scores),
        layers=tuple(k.layer for k in kernels if k.layer is not None),
        hidden_bytes=round(bpe * batch * seq_len * spec.hidden),
    )


def balanced_stages(costs: Sequence[float], n_stages: int) -> list[range]:
    """Contiguous split of per-block costs into n_stages minimizing the largest stage (exact DP)."""
    nb = len(costs)
    if not 1 <= n_stages <= nb:
        raise CostModelError(f"cannot split {nb} blocks into {n_stages} stages; use 1..{nb} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (nb + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (nb + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, nb + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j] - 1e-15:
                    best[k][j], cut[k][j] = v, i
    bounds, j = [], nb
    for k in range(n_stages, 0, -1):
        bounds.append(range(cut[k][j], j))
        j = cut[k][j]
    return bounds[::-1]


def _stage_ranges(stages: int | Sequence[range | tuple[int, int]], block_costs: list[float]) -> list[range]:
    if isinstance(stages, int) and not isinstance(stages, bool):
        return balanced_stages(block_costs, stages)
    assert not isinstance(stages, bool), "stages is an int or block ranges, not a bool"
    ranges = [r if isinstance(r, range) else range(*r) for r in stages]
    expected = 0
    for r in ranges:
        if r.step != 1 or r.start != expected or r.stop <= r.start:
            raise CostModelError(
                f"stage block ranges must be contiguous, non-empty and start at 0; got {list(map(tuple, ranges))}"
            )
        expected = r.stop
    if expected != len(block_costs):
        raise CostModelError(f"stage block ranges cover {expected} blocks, the model has {len(block_costs)}")
    return ranges


def analytic_cost_table(
    model_spec: ModelSpec | str,
    stages: int | Sequence[range | tuple[int, int]],
    micro_batch_size: int,
    seq_len: int | None = None,
    hardware: HardwareSpec | str = "p100",
    *,
    precision: Precision = Precision.FP32,
    inverse: InverseMethod = InverseMethod.CHOLESKY,
    units: Callable[[BlockSpec], tuple[LayerCost, ...]] | None = None,
) -> CostTable:
    """A CostTable from the analytic model, one LayerCost per K-FAC Linear (Hugging Face FQNs).

    stages: an int (balanced contiguous split by fwd+bwd time) or block ranges per stage
    (e.g. [range(0, 3), range(3, 6)] or [(0, 3), (3, 6)]). The embeddings are costed on the
    first stage and the head on the last. Parameters count fp32 master weights (4 bytes).
    units: the preconditioned units of a block (another family's, e.g. Shampoo's parameters) in place
    of its K-FAC Linears; the pipeline's costs and split are the same either way.
    """
    spec = preset(model_spec) if isinstance(model_spec, str) else model_spec
    hw = get_hardware(hardware)
    _check_size("micro_batch_size", micro_batch_size)
    seq = spec.seq_len if seq_len is None else seq_len
    _check_size("seq_len", seq)

    def kernels(block: BlockSpec) -> BlockCost:
        return block_kernels(
            block, spec, batch=micro_batch_size, seq_len=seq, hw=hw, precision=precision, inverse=inverse
        )

    parts = [kernels(x) for x in spec.blocks]
    embed, head = kernels(spec.embed), kernels(spec.head)
    costs = [x.fwd + x.bwd for x in parts]
    costs[0] += embed.fwd + embed.bwd
    costs[-1] += head.fwd + head.bwd
    ranges = _stage_ranges(stages, costs)
    out = []
    for i, r in enumerate(ranges):
        first, last = i == 0, i == len(ranges) - 1
        members = ([embed] if first else []) + [parts[j] for j in r] + ([head] if last else [])
        owners = ([spec.embed] if first else []) + [spec.blocks[j] for j in r] + ([spec.head] if last else [])
        out.append(_stage_cost(members, owners, units))
    source = f"analytic:{spec.name}:seq{seq}:{precision}:{inverse}"
    return CostTable(tuple(out), micro_batch_size, source, hw.name, hw.comm)


def _check_size(name: str, value: object) -> None:
    """CostModelError unless `value` is an int >= 1 (a bool is not): a batch or sequence size."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CostModelError(f"{name} must be an int >= 1, got {value!r}")


def _stage_cost(
    members: Sequence[BlockCost],
    owners: Sequence[BlockSpec],
    units: Callable[[BlockSpec], tuple[LayerCost, ...]] | None,
) -> StageCost:
    """One stage's costs: the sums over its blocks' costs `members`; its layers are those blocks' K-FAC Linears, or
    `units` of each of its blocks `owners` when given."""
    return StageCost(
        fwd=sum(x.fwd for x in members),
        bwd=sum(x.bwd for x in members),
        param_bytes=4 * sum(x.params for x in members),
        act_bytes=sum(x.act_bytes for x in members),
        layers=tuple(layer for x in members for layer in x.layers)
        if units is None
        else tuple(layer for block in owners for layer in units(block)),
        peak_err_bytes=max(x.peak_err_bytes for x in members),
        boundary_bytes=members[0].hidden_bytes + members[-1].hidden_bytes,  # the stage's input and output
    )
