"""Muon: each hidden matrix's momentum orthogonalized by Newton-Schulz at every step, AdamW for the other parameters.

`MuonFamily(MuonConfig(...))` implements `fxkfac.preconditioner.Family` and `SplitApplyFamily` (fxkfac/muon/family.py);
the iteration itself is fxkfac/muon/newton_schulz.py; the differences from torch.optim.Muon are in docs/MUON.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxkfac.muon.config import LrAdjust, MuonConfig
from fxkfac.muon.family import MuonFamily, MuonUnit, UnitKind
from fxkfac.muon.state import MuonState

__all__ = ["LrAdjust", "MuonConfig", "MuonFamily", "MuonUnit", "MuonState", "UnitKind"]

if TYPE_CHECKING:  # mypy checks that MuonFamily implements the Family and SplitApplyFamily protocols
    from fxkfac.preconditioner import Family, SplitApplyFamily

    def _family(cfg: MuonConfig) -> tuple[Family, SplitApplyFamily]:
        return MuonFamily(cfg), MuonFamily(cfg)
