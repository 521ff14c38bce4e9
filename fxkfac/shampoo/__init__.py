"""Shampoo and SOAP: second-order families fed by each parameter's complete gradient (parts L and R).

`ShampooFamily(ShampooConfig(...))` and `SOAPFamily(SOAPConfig(...))` implement `fxkfac.preconditioner.Family`;
their semantics are in fxkfac/shampoo/family.py and fxkfac/shampoo/soap.py, the blocking rules in
fxkfac/planner/problem/analytic.py (torch-free, shared with the planner's cost model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxkfac.shampoo.config import (
    BasisMethod,
    GraftType,
    LargeDimMethod,
    RootInvMethod,
    ShampooConfig,
    SOAPConfig,
)
from fxkfac.shampoo.family import ShampooFamily
from fxkfac.shampoo.layout import ParamUnit
from fxkfac.shampoo.soap import SOAPFamily
from fxkfac.shampoo.state import ShampooState, Sides, SOAPState

__all__ = [
    "BasisMethod",
    "GraftType",
    "LargeDimMethod",
    "RootInvMethod",
    "ShampooConfig",
    "SOAPConfig",
    "ShampooFamily",
    "SOAPFamily",
    "ParamUnit",
    "ShampooState",
    "SOAPState",
    "Sides",
]

if TYPE_CHECKING:  # mypy checks that both classes implement the Family protocol, Shampoo also PiecewiseFamily
    from fxkfac.preconditioner import Family, PiecewiseFamily

    def _families(shampoo: ShampooConfig, soap: SOAPConfig) -> tuple[Family, Family, PiecewiseFamily]:
        return ShampooFamily(shampoo), SOAPFamily(soap), ShampooFamily(shampoo)
