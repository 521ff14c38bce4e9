"""Shampoo/SOAP analytic costs against hand-computed formulas, bert-base's blocks counted by hand, the family tag of
a cost table, and the block sides the auto search tries."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fxkfac.planner.problem.analytic import (
    NEWTON_ITERATIONS,
    LargeDimMethod,
    RootMethod,
    TensorSpec,
    analytic_cost_table,
    largest_dim,
    newton_matmuls,
    parameter_cost,
    partition,
    preset,
)
from fxkfac.planner.problem.costs import WORDS, CostTable, PreconditionerKind, words_of
from fxkfac.planner.problem.errors import CostModelError
from fxkfac.planner.problem.hardware import HardwareSpec
from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.search.plan_search import block_candidates

PEAK = 1e12
# Compute bound everywhere (bandwidth out of reach), GEMMs at peak, factorizations at half of it: every time is
# FLOPs / rate, which the formulas below write out by hand.
HW = HardwareSpec("test", PEAK, PEAK, 1e30, 1 << 40, matmul_efficiency=1.0, factorization_efficiency=0.5)
SHAMPOO, SOAP = PreconditionerKind.SHAMPOO, PreconditionerKind.SOAP
WEIGHT = TensorSpec("w", (3000, 700))  # max_dim 1024: row blocks 1024, 1024, 952 by one column block of 700
ROWS, COLS = (1024, 1024, 952), 700


def _eigh(b: int) -> float:
    """9 b^3 at the factorization rate, then Q diag Q^T (2 b^3) at the GEMM rate."""
    return 9 * b**3 / (0.5 * PEAK) + 2 * b**3 / PEAK


def test_shampoo_weight_by_hand() -> None:
    cost = parameter_cost(WEIGHT, HW, SHAMPOO, 1024)
    assert cost is not None and cost.name == "w"
    L, R = cost.part("L"), cost.part("R")
    assert L.after is R.after is OpKind.ALLREDUCE_GRAD and L.capture_bytes == R.capture_bytes == 0
    assert L.stats == pytest.approx(sum(2 * r * r * COLS for r in ROWS) / PEAK)  # G G^T per block
    assert R.stats == pytest.approx(sum(2 * r * COLS * COLS for r in ROWS) / PEAK)  # G^T G per block
    assert L.decomp == pytest.approx(sum(_eigh(r) for r in ROWS))
    assert R.decomp == pytest.approx(3 * _eigh(COLS))
    assert cost.prec == pytest.approx(sum(2 * r * COLS * (r + COLS) for r in ROWS) / PEAK)  # L^-1/4 G R^-1/4
    assert L.state_bytes == 4 * sum(r * r for r in ROWS) and R.state_bytes == 4 * 3 * COLS**2
    assert cost.state_bytes == 4 * 3000 * 700  # momentum


def test_shampoo_vector_has_one_factor_and_newton_counts_its_products() -> None:
    cost = parameter_cost(TensorSpec("b", (1500,)), HW, SHAMPOO, 1024, RootMethod.NEWTON)
    assert cost is not None and [p.part for p in cost.parts] == ["L"]
    L = cost.part("L")
    assert L.stats == pytest.approx(2 * (1024**2 + 476**2) / PEAK)  # g g^T of each 1024 + 476 chunk
    # a vector's root is -1/2 (p = 2): Z^2 (1 product), Z^2 M, X Z: 3 products of 2 b^3 per iteration
    assert newton_matmuls(2) == 3 and newton_matmuls(4) == 4 and newton_matmuls(3) == 4
    assert L.decomp == pytest.approx(NEWTON_ITERATIONS * 3 * 2 * (1024**3 + 476**3) / PEAK)


def test_soap_rotates_twice_refreshes_by_power_qr_and_leaves_vectors_to_adam() -> None:
    cost = parameter_cost(WEIGHT, HW, SOAP, 1024)
    assert cost is not None
    assert cost.prec == pytest.approx(2 * sum(2 * r * COLS * (r + COLS) for r in ROWS) / PEAK)
    qr = [
        2 * b**3 / PEAK + (8 / 3) * b**3 / (0.5 * PEAK) + 2 * 2 * b * b * other / PEAK
        for b, other in ((r, COLS) for r in ROWS)
    ]  # L Q, Householder QR with Q, m re-projected on that side
    assert cost.part("L").decomp == pytest.approx(sum(qr))
    assert cost.state_bytes == 2 * 4 * 3000 * 700  # Adam's m and v
    assert parameter_cost(TensorSpec("b", (700,)), HW, SOAP, 1024) is None
    with pytest.raises(CostModelError, match="newton"):
        parameter_cost(WEIGHT, HW, SOAP, 1024, RootMethod.NEWTON)


def _bert_base_blocks_by_hand() -> int:
    """bert-base's blocks at max_dim 1024 (dims merged while their product stays <= 1024, as Shampoo does)."""
    embeddings = 30 + 1 + 1 + 2  # word (30522, 768): 30 row blocks; positions; token types (2, 768); LayerNorm
    layer = 4 + 4 + 3 + 3 + 3 + 1 + 4  # q k v o; their biases; intermediate, its bias, output (3 each); bias; 2 LN
    head = 2 + 30 + 2 + 2 + 2  # pooler; cls.predictions.bias (30522,); transform dense; its LN; seq_relationship
    return embeddings + 12 * layer + head


def test_bert_base_blocks_and_parameters() -> None:
    spec = preset("bert-base")
    blocks = [b for t in spec.parameters for b in partition(t.shape, 1024, LargeDimMethod.BLOCKING)[1]]
    assert len(blocks) == _bert_base_blocks_by_hand() == 336
    table = analytic_cost_table(spec, 4, 32, hardware="a100", kind=SHAMPOO, max_dim=1024)
    layers = [x for s in table.stages for x in s.layers]
    assert [x.name for x in layers] == [t.name for t in spec.parameters]  # every parameter once, in model order
    vectors = sum(len(t.shape) == 1 for t in spec.parameters)
    assert sum(len(x.parts) == 1 for x in layers) == vectors == 206 - 78  # 3 + 12 * 6 + 3 matrices
    factor_bytes = 4 * sum(m * m + n * n for m, n in (b.sides for b in blocks))
    assert sum(s.factor_bytes for s in table.stages) == factor_bytes
    soap = analytic_cost_table(spec, 4, 32, hardware="a100", kind=SOAP, max_dim=1024)
    assert sum(len(s.layers) for s in soap.stages) == 78  # the matrices; vectors run plain AdamW


def test_cost_tables_carry_their_family() -> None:
    table = analytic_cost_table("bert-base", 4, 32, hardware="p100", kind=SHAMPOO, max_dim=512)
    assert table.source == "shampoo:analytic:bert-base:seq128:fp32:eigh:block512"
    assert CostTable.from_json(table.to_json()).family is SHAMPOO
    unblocked = analytic_cost_table("bert-base", 4, 32, hardware="p100", kind=SOAP, max_dim=None)
    assert unblocked.source.endswith(":qr:unblocked") and words_of(unblocked) is WORDS[SOAP]
    assert analytic_cost_table("bert-base", 4, 32).family is PreconditionerKind.KFAC
    with pytest.raises(CostModelError, match="max_dim must be an int >= 1 or None"):
        analytic_cost_table("bert-base", 4, 32, kind=SHAMPOO, max_dim=0)


def test_the_family_is_a_field_not_read_from_the_source_text() -> None:
    table = analytic_cost_table("bert-base", 4, 32, hardware="p100", kind=SOAP, max_dim=512)
    renamed = replace(table, source="my-own-measurements")
    assert renamed.family is SOAP and CostTable.from_json(renamed.to_json()).family is SOAP
    legacy = {k: v for k, v in table.to_dict().items() if k != "family"}  # a file from before the field
    assert CostTable.from_dict(legacy).family is SOAP
    with pytest.raises(CostModelError, match="family 'adam' is not one of kfac, shampoo, soap"):
        CostTable.from_dict({**table.to_dict(), "family": "adam"})


def test_block_candidates_run_from_no_blocking_down_to_256() -> None:
    assert largest_dim(preset("bert-base")) == 30522
    assert block_candidates(30522) == [None, 16384, 8192, 4096, 2048, 1024, 512, 256]
    assert block_candidates(1024) == [None, 512, 256]
