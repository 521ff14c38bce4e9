"""ShampooConfig and SOAPConfig refuse bad values with a message naming the field; kinds become enums."""

from __future__ import annotations

import re
from typing import Any

import pytest

from fxkfac.errors import ConfigError
from fxkfac.shampoo import BasisMethod, GraftType, LargeDimMethod, RootInvMethod, ShampooConfig, SOAPConfig

SHAMPOO_BAD: dict[str, tuple[dict[str, Any], str]] = {
    "negative epsilon": ({"epsilon": -1.0}, "ShampooConfig.epsilon must be > 0, got -1.0"),
    "unknown graft": ({"grafting_type": "lion"}, "ShampooConfig.grafting_type must be one of 'sgd', 'adagrad'"),
    "frequency 0": ({"precondition_frequency": 0}, "ShampooConfig.precondition_frequency must be an int >= 1"),
    "beta1 = 1": ({"betas": (1.0, 0.99)}, "ShampooConfig.betas must be"),
    "beta2 = 0": ({"betas": (0.0, 0.0)}, "ShampooConfig.betas must be"),
    "betas not a pair": ({"betas": (0.9,)}, "ShampooConfig.betas must be a pair"),
    "momentum 1": ({"momentum": 1.0}, "ShampooConfig.momentum must be in"),
    "negative decay": ({"weight_decay": -0.1}, "ShampooConfig.weight_decay must be >= 0"),
    "block 0": ({"max_preconditioner_dim": 0}, "ShampooConfig.max_preconditioner_dim must be an int >= 1 or 'auto'"),
    "block 'big'": ({"max_preconditioner_dim": "big"}, "ShampooConfig.max_preconditioner_dim"),
    "negative start": ({"start_preconditioning_step": -1}, "ShampooConfig.start_preconditioning_step"),
    "dtype": ({"preconditioner_dtype": "bfloat16"}, "ShampooConfig.preconditioner_dtype must be one of"),
    "large dim": ({"large_dim_method": "shrink"}, "ShampooConfig.large_dim_method must be one of"),
    "root method": ({"root_inv_method": "cholesky"}, "ShampooConfig.root_inv_method must be one of"),
    "exponent 0": ({"exponent_override": 0}, "ShampooConfig.exponent_override must be None or an int >= 1"),
    "exponent 2.5": ({"exponent_override": 2.5}, "ShampooConfig.exponent_override"),
    "multiplier 0": ({"exponent_multiplier": 0.0}, "ShampooConfig.exponent_multiplier must be > 0"),
    "newton with multiplier": (
        {"root_inv_method": "newton", "exponent_multiplier": 1.82},
        "ShampooConfig.exponent_multiplier must be 1.0 with root_inv_method='newton'",
    ),
    "newton tolerance": ({"newton_tolerance": 0.0}, "ShampooConfig.newton_tolerance must be > 0"),
    "newton iterations": ({"newton_max_iterations": 0}, "ShampooConfig.newton_max_iterations"),
    "graft epsilon": ({"grafting_epsilon": 0.0}, "ShampooConfig.grafting_epsilon must be > 0"),
    "graft beta2": ({"grafting_beta2": 1.5}, "ShampooConfig.grafting_beta2 must be in"),
}

SOAP_BAD: dict[str, tuple[dict[str, Any], str]] = {
    "negative epsilon": ({"epsilon": -1e-8}, "SOAPConfig.epsilon must be > 0"),
    "beta2 = 1": ({"betas": (0.9, 1.0)}, "SOAPConfig.betas must be (beta1, beta2) with beta2 < 1"),
    "shampoo beta": ({"shampoo_beta": 1.5}, "SOAPConfig.shampoo_beta must be in [0, 1]"),
    "frequency 0": ({"precondition_frequency": 0}, "SOAPConfig.precondition_frequency"),
    "basis": ({"basis_method": "svd"}, "SOAPConfig.basis_method must be one of 'eigh', 'qr'"),
    "dtype": ({"preconditioner_dtype": "half"}, "SOAPConfig.preconditioner_dtype"),
}


@pytest.mark.parametrize(("changes", "message"), SHAMPOO_BAD.values(), ids=SHAMPOO_BAD.keys())
def test_bad_shampoo_config(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        ShampooConfig(**changes)


@pytest.mark.parametrize(("changes", "message"), SOAP_BAD.values(), ids=SOAP_BAD.keys())
def test_bad_soap_config(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        SOAPConfig(**changes)


def test_kind_strings_become_enums() -> None:
    strings: dict[str, Any] = {"grafting_type": "adam", "large_dim_method": "diagonal", "root_inv_method": "newton"}
    cfg = ShampooConfig(**strings)
    assert cfg.grafting_type is GraftType.ADAM
    assert cfg.large_dim_method is LargeDimMethod.DIAGONAL and cfg.root_inv_method is RootInvMethod.NEWTON
    assert SOAPConfig(**{"basis_method": "eigh"}).basis_method is BasisMethod.EIGH


def test_defaults_are_the_papers() -> None:
    cfg = ShampooConfig()
    assert (cfg.betas, cfg.epsilon, cfg.momentum, cfg.use_nesterov, cfg.weight_decay) == (
        (0.0, 0.999),
        1e-12,
        0.9,
        True,
        1e-4,
    )
    assert cfg.use_decoupled_weight_decay and cfg.use_bias_correction and cfg.use_protected_eigh
    assert (cfg.precondition_frequency, cfg.grafting_type, cfg.exponent_multiplier) == (50, GraftType.SGD, 1.0)
    assert cfg.max_dim == 1024 and ShampooConfig(max_preconditioner_dim=64).max_dim == 64
    soap = SOAPConfig()
    assert (soap.betas, soap.shampoo_beta, soap.precondition_frequency, soap.basis_method) == (
        (0.95, 0.95),
        0.95,
        10,
        BasisMethod.QR,
    )
