"""SOAPFamily through the runtime's contract against the dense float64 Kronecker reference, option by option.

The first basis comes after a few steps (start 3) so that every factor has full rank: an eigenbasis of a
degenerate eigenspace is arbitrary, and Adam in it is not invariant to that choice.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest

from fxkfac.shampoo import BasisMethod, LargeDimMethod, SOAPConfig, SOAPFamily
from tests.shampoo.driver import compare
from tests.shampoo.reference import SOAPReference

B = 4
BASE = SOAPConfig(
    betas=(0.9, 0.95),
    shampoo_beta=0.9,
    weight_decay=0.0,
    max_preconditioner_dim=B,
    precondition_frequency=2,
    start_preconditioning_step=3,
    preconditioner_dtype="float64",
)

CASES: dict[str, dict[str, Any]] = {
    "qr": {},
    "eigh": {"basis_method": BasisMethod.EIGH},
    "every step": {"precondition_frequency": 1, "start_preconditioning_step": 4},
    "start 4, frequency 3": {"start_preconditioning_step": 4, "precondition_frequency": 3},
    "1-D preconditioned": {"precondition_1d": True, "start_preconditioning_step": 5},
    "no bias correction": {"use_bias_correction": False},
    "weight decay": {"weight_decay": 0.1},
    "shampoo_beta=1 (sums)": {"shampoo_beta": 1.0},
    "merged dims": {"use_merge_dims": True},
    "blocks of 3": {"max_preconditioner_dim": 3},
    "diagonal large dims": {"large_dim_method": LargeDimMethod.DIAGONAL},
    "adagrad large dims": {"large_dim_method": LargeDimMethod.ADAGRAD},
    "beta1 = 0": {"betas": (0.0, 0.95)},
}


@pytest.mark.parametrize("changes", CASES.values(), ids=CASES.keys())
def test_matches_reference(changes: dict[str, Any]) -> None:
    cfg = replace(BASE, **changes)
    b = int(cfg.max_preconditioner_dim)
    assert compare(lambda: SOAPFamily(cfg), lambda shapes: SOAPReference(cfg, shapes, b), steps=10) < 1e-6


def test_reference_comparison_tells_options_apart() -> None:
    """The comparison is sharp: plain AdamW (no basis in 10 steps) or eigh instead of QR are far off."""
    others: list[dict[str, Any]] = [{"start_preconditioning_step": 20}, {"basis_method": BasisMethod.EIGH}]
    for other in others:
        reference = functools.partial(SOAPReference, replace(BASE, **other), b=B)
        assert compare(lambda: SOAPFamily(BASE), reference, steps=10) > 1e-4
