"""Analytic costs of Muon: one LayerCost per parameter, no parts, its APPLY a matrix's Newton-Schulz or AdamW's step.

Muon (`MuonConfig`, fxkfac/muon/) orthogonalizes each hidden 2-D weight's momentum at every step; embeddings, the
output head (a Linear K-FAC skips, `LinearSpec.kfac` False) and 1-D parameters go to AdamW (below). A matrix of
shape (r, c), m = min(r, c) <= n = max(r, c), costs per step (each kernel timed by the K-FAC model's roofline,
`planner.analytic.roofline`, without a launch-latency floor):

- Newton-Schulz, `ns_steps` iterations (5) of the quintic X <- a X + (b A + c A A) X with A = X X^T, X the m x n
  orientation (the transpose when r > c, as torch.optim.Muon does): A = X X^T is m*m*n multiply-adds, A A is m^3,
  (b A + c A A) X is m*m*n, so one iteration is 2 m^2 n + m^3 multiply-adds, 2 (2 m^2 n + m^3) FLOPs
  (`ns_iteration_flops`); the scaling by b, c and the sum are elementwise on m x m and ride in the products'
  epilogues. Priced at `precision`'s peak: BF16 by default, as torch.optim.Muon runs the iterations in bfloat16.
- elementwise: ELEMENTWISE_PASSES fp32 passes over the matrix at memory bandwidth (momentum, Nesterov, the
  normalization before the iterations, the learning-rate adjustment, decoupled weight decay and the update).
- bytes: the momentum buffer (LayerCost.state_bytes) and the gradient a streamed APPLY sends each way
  (LayerCost.grad_bytes), fp32.

Every other parameter (embedding tables, the head, norms, biases) is a unit too, as `fxkfac.compile` makes one of
every trainable parameter (`MuonFamily.units`): its APPLY is AdamW's elementwise step, ADAMW_PASSES fp32 passes at
memory bandwidth (`adamw_cost`), its state the two moments. It is rarely worth a helper (its gradient's transfer
outlasts it but on a link faster than memory bandwidth / ADAMW_PASSES; planner/search/stream_choice.py), so it runs on
its owner, beside the matrices' Newton-Schulz.

A piece i of n of a matrix's APPLY (`Op.piece`) runs iterations [i*S//n, (i+1)*S//n) of S = ns_steps
(`planner.apply_pieces`); its time is that share of the APPLY.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fxkfac.planner.problem.analytic import analytic_cost_table, roofline
from fxkfac.planner.problem.apply_pieces import NS_STEPS
from fxkfac.planner.problem.costs import CostTable, LayerCost, PreconditionerKind
from fxkfac.planner.problem.errors import CostModelError
from fxkfac.planner.problem.hardware import HardwareSpec, Precision
from fxkfac.planner.problem.hardware import hardware as get_hardware
from fxkfac.planner.problem.preconditioners import tagged_source
from fxkfac.planner.problem.presets import BlockSpec, ModelSpec, TensorSpec, preset

__all__ = [
    "ELEMENTWISE_PASSES",
    "ns_iteration_flops",
    "ns_seconds",
    "matrix_cost",
    "adamw_cost",
    "ADAMW_PASSES",
    "muon_matrices",
    "muon_cost_table",
]

_F32 = 4

ELEMENTWISE_PASSES = 10
"""fp32 reads and writes per element of a step's elementwise work: momentum (buffer and gradient read, buffer
written), Nesterov's blend (read, written), the normalization (norm read, scaled copy written), the update with its
learning-rate adjustment and weight decay (weight and direction read, weight written)."""


ADAMW_PASSES = 12
"""fp32 reads and writes per element of an AdamW step: the moments (gradient and both read, both written), the
direction (both moments and the weight read, the direction written), the update (weight and direction read,
weight written)."""


def ns_iteration_flops(rows: int, cols: int) -> int:
    """FLOPs of one Newton-Schulz iteration on a rows x cols matrix: 2 (2 m^2 n + m^3), m <= n its sides."""
    m, n = sorted((rows, cols))
    return 2 * (2 * m * m * n + m**3)


def _iteration_seconds(hw: HardwareSpec, rows: int, cols: int, precision: Precision) -> float:
    """One iteration's three products, each by the roofline at `precision` (operands read, result written)."""
    peak, item = (hw.peak_flops_tensor, 2) if precision is Precision.BF16 else (hw.peak_flops, _F32)
    m, n = sorted((rows, cols))
    gram = roofline(hw, 2 * m * m * n, item * (2 * m * n + m * m), peak, hw.matmul_efficiency)
    square = roofline(hw, 2 * m**3, item * 3 * m * m, peak, hw.matmul_efficiency)
    back = roofline(hw, 2 * m * m * n, item * (m * m + 2 * m * n), peak, hw.matmul_efficiency)
    return gram + square + back


def ns_seconds(
    hw: HardwareSpec, shape: tuple[int, int], ns_steps: int = NS_STEPS, precision: Precision = Precision.BF16
) -> float:
    """Seconds of a step's Muon APPLY of one matrix: its `ns_steps` iterations and its elementwise work."""
    r, c = shape
    elementwise = ELEMENTWISE_PASSES * _F32 * r * c / hw.mem_bandwidth
    return ns_steps * _iteration_seconds(hw, r, c, precision) + elementwise


def matrix_cost(
    tensor: TensorSpec, hw: HardwareSpec, ns_steps: int = NS_STEPS, precision: Precision = Precision.BF16
) -> LayerCost:
    """The LayerCost of one Muon matrix (name: its FQN): no parts, `prec` its step's APPLY."""
    if len(tensor.shape) != 2:
        raise CostModelError(f"Muon orthogonalizes 2-D matrices; {tensor.name} has shape {tensor.shape}")
    r, c = tensor.shape
    numel = _F32 * r * c
    return LayerCost(tensor.name, (), ns_seconds(hw, (r, c), ns_steps, precision), numel, numel)


def adamw_cost(tensor: TensorSpec, hw: HardwareSpec) -> LayerCost:
    """The LayerCost of a parameter AdamW steps (name: its FQN): no parts, `prec` its elementwise step, its state
    the two moments."""
    numel = _F32 * tensor.numel
    return LayerCost(tensor.name, (), ADAMW_PASSES * numel / hw.mem_bandwidth, 2 * numel, numel)


def muon_matrices(block: BlockSpec) -> tuple[TensorSpec, ...]:
    """The block's parameters Muon orthogonalizes: the weights of its Linears other than a vocabulary head (those
    K-FAC skips) or a tied one; embedding tables, norms and biases go to AdamW."""
    return tuple(
        TensorSpec(f"{x.name}.weight", (x.d_in, x.d_out) if x.transposed else (x.d_out, x.d_in))
        for x in block.linears
        if x.kfac and not x.tied
    )


def muon_cost_table(
    model_spec: ModelSpec | str,
    stages: int | Sequence[range | tuple[int, int]],
    micro_batch_size: int,
    seq_len: int | None = None,
    hardware: HardwareSpec | str = "p100",
    *,
    ns_steps: int = NS_STEPS,
    precision: Precision = Precision.FP32,
    ns_precision: Precision = Precision.BF16,
) -> CostTable:
    """The analytic CostTable of Muon over a preset's pipeline: the K-FAC model's stages (same split, forward,
    backward and memory at `precision`) with one LayerCost per parameter of each stage: a Muon matrix's
    (`muon_matrices`) its Newton-Schulz priced at `ns_precision`, every other's AdamW's step (`adamw_cost`). The
    source reads e.g. "muon:analytic:bert-large:seq128:fp32:ns5"."""
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise CostModelError(f"ns_steps must be an int >= 1, got {ns_steps!r}")
    spec = preset(model_spec) if isinstance(model_spec, str) else model_spec
    hw = get_hardware(hardware)

    def units(block: BlockSpec) -> tuple[LayerCost, ...]:
        matrices = {t.name for t in muon_matrices(block)}
        return tuple(
            matrix_cost(t, hw, ns_steps, ns_precision) if t.name in matrices else adamw_cost(t, hw)
            for t in block.parameters
        )

    table = analytic_cost_table(spec, stages, micro_batch_size, seq_len, hw, precision=precision, units=units)
    source = tagged_source(PreconditionerKind.MUON, f"{table.source.rsplit(':', 1)[0]}:ns{ns_steps}")
    return replace(table, source=source, family=PreconditionerKind.MUON)
