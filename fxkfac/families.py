"""One way to choose the preconditioner: a family's config (or a Family itself) -> the Family that runs it."""

from __future__ import annotations

from typing import Any

from fxkfac.config import KFACConfig
from fxkfac.errors import ConfigError
from fxkfac.kfac.family import KFACFamily
from fxkfac.preconditioner import Family
from fxkfac.shampoo import ShampooConfig, ShampooFamily, SOAPConfig, SOAPFamily

__all__ = ["family_of"]


def family_of(choice: Any) -> Family:
    """The Family of a KFACConfig, ShampooConfig or SOAPConfig, or `choice` itself when it already is one;
    ConfigError otherwise."""
    if isinstance(choice, KFACConfig):
        return KFACFamily(choice)
    if isinstance(choice, ShampooConfig):
        return ShampooFamily(choice)
    if isinstance(choice, SOAPConfig):
        return SOAPFamily(choice)
    if all(hasattr(choice, attr) for attr in ("parts", "source", "new_state", "decompose", "precondition")):
        return choice  # a Family object, checked structurally
    raise ConfigError(
        f"preconditioner must be a KFACConfig, ShampooConfig, SOAPConfig or a "
        f"fxkfac.preconditioner.Family, got {type(choice).__name__}"
    )
