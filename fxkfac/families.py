"""One way to choose the preconditioner: a family's config (or a Family itself) -> the Family that runs it."""

from __future__ import annotations

from typing import Any

from fxkfac.config import KFACConfig
from fxkfac.errors import ConfigError
from fxkfac.kfac.family import KFACFamily
from fxkfac.muon import MuonConfig, MuonFamily
from fxkfac.preconditioner import Family
from fxkfac.shampoo import ShampooConfig, ShampooFamily, SOAPConfig, SOAPFamily

__all__ = ["family_of"]

REQUIRED = (
    "parts",
    "source",
    "new_state",
    "decompose",
    "precondition",
    "clip_scale",
    "kl_clip_scope",
    "layer_config",
    "unit_cost",
)
"""Members a Family object must have (checked structurally; the full list is `fxkfac.preconditioner.Family`)."""


def family_of(choice: Any) -> Family:
    """The Family of a KFACConfig, ShampooConfig, SOAPConfig or MuonConfig, or `choice` itself when it already is one;
    ConfigError otherwise."""
    if isinstance(choice, KFACConfig):
        return KFACFamily(choice)
    if isinstance(choice, ShampooConfig):
        return ShampooFamily(choice)
    if isinstance(choice, SOAPConfig):
        return SOAPFamily(choice)
    if isinstance(choice, MuonConfig):
        return MuonFamily(choice)
    missing = [attr for attr in REQUIRED if not hasattr(choice, attr)]
    if not missing:
        return choice  # a Family object, checked structurally
    if "parts" not in missing and "precondition" not in missing:
        raise ConfigError(f"{type(choice).__name__} lacks the Family members {missing} (fxkfac.preconditioner.Family)")
    raise ConfigError(
        f"preconditioner must be a KFACConfig, ShampooConfig, SOAPConfig, MuonConfig or a "
        f"fxkfac.preconditioner.Family, got {type(choice).__name__}"
    )
