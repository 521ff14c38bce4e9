"""ShampooFamily through the runtime's contract against the dense float64 Kronecker reference, option by option."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest

from fxkfac.shampoo import GraftType, LargeDimMethod, RootInvMethod, ShampooConfig, ShampooFamily
from tests.shampoo.driver import compare
from tests.shampoo.reference import ShampooReference

B = 4
BASE = ShampooConfig(
    betas=(0.0, 0.99),
    epsilon=1e-6,
    momentum=0.0,
    weight_decay=0.0,
    max_preconditioner_dim=B,
    precondition_frequency=2,
    preconditioner_dtype="float64",
)

CASES: dict[str, dict[str, Any]] = {
    "beta2<1": {},
    "beta2=1": {"betas": (0.0, 1.0)},
    "no bias correction": {"use_bias_correction": False},
    "beta1 filtering": {"betas": (0.9, 0.99)},
    "beta1 without bias correction": {"betas": (0.9, 0.99), "use_bias_correction": False},
    "graft adagrad": {"grafting_type": GraftType.ADAGRAD},
    "graft rmsprop": {"grafting_type": GraftType.RMSPROP, "grafting_beta2": 0.9},
    "graft adam": {"grafting_type": GraftType.ADAM, "grafting_beta2": 0.9},
    "graft adam no bias correction": {"grafting_type": GraftType.ADAM, "use_bias_correction": False},
    "blocks of 3": {"max_preconditioner_dim": 3},
    "blocks of 2, every step": {"max_preconditioner_dim": 2, "precondition_frequency": 1},
    "no merging": {"use_merge_dims": False},
    "exponent override": {"exponent_override": 2},
    "exponent multiplier": {"exponent_multiplier": 1.82},
    "start 3 (not a multiple of 2)": {"start_preconditioning_step": 3},
    "start 4": {"start_preconditioning_step": 4, "precondition_frequency": 3},
    "momentum": {"momentum": 0.9, "use_nesterov": False},
    "nesterov": {"momentum": 0.5, "use_nesterov": True},
    "coupled weight decay": {"weight_decay": 0.1, "use_decoupled_weight_decay": False},
    "decoupled weight decay": {"weight_decay": 0.1},
    "no decay on bias and norm": {
        "weight_decay": 0.1,
        "use_weight_decay_on_bias_and_norm_params": False,
        "use_decoupled_weight_decay": False,
    },
    "newton": {"root_inv_method": RootInvMethod.NEWTON, "newton_tolerance": 1e-12},
    "newton, override 2": {"root_inv_method": RootInvMethod.NEWTON, "newton_tolerance": 1e-12, "exponent_override": 2},
    "diagonal large dims": {"large_dim_method": LargeDimMethod.DIAGONAL},
    "adagrad large dims": {"large_dim_method": LargeDimMethod.ADAGRAD, "grafting_type": GraftType.ADAGRAD},
    "paper's momentum and decay": {"epsilon": 1e-10, "momentum": 0.9, "use_nesterov": True, "weight_decay": 1e-4},
}


@pytest.mark.parametrize("changes", CASES.values(), ids=CASES.keys())
def test_matches_reference(changes: dict[str, Any]) -> None:
    cfg = replace(BASE, **changes)
    b = int(cfg.max_preconditioner_dim)
    assert compare(lambda: ShampooFamily(cfg), lambda shapes: ShampooReference(cfg, shapes, b)) < 1e-6


def test_reference_comparison_tells_options_apart() -> None:
    """The comparison is sharp: a reference with another exponent or block size is far off."""
    others: list[dict[str, Any]] = [{"exponent_override": 2}, {"max_preconditioner_dim": 3}]
    for other in others:
        ref_cfg = replace(BASE, **other)
        reference = functools.partial(ShampooReference, ref_cfg, b=int(ref_cfg.max_preconditioner_dim))
        assert compare(lambda: ShampooFamily(BASE), reference) > 1e-3
