"""fxkfac: pipeline-parallel training with a second-order preconditioner (K-FAC, Shampoo, SOAP, Muon) placed into the
pipeline's bubbles.

Torch-backed names load lazily, so `import fxkfac.planner` (and the planning CLI)
never pays for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "compile",
    "KFACConfig",
    "ShampooConfig",
    "SOAPConfig",
    "MuonConfig",
    "PipelineOptions",
    "PlanOptions",
    "Plan",
    "errors",
]

_LAZY = {
    "compile": ("fxkfac.compile_api", "compile"),
    "KFACConfig": ("fxkfac.config", "KFACConfig"),
    "ShampooConfig": ("fxkfac.shampoo.config", "ShampooConfig"),
    "SOAPConfig": ("fxkfac.shampoo.config", "SOAPConfig"),
    "MuonConfig": ("fxkfac.muon.config", "MuonConfig"),
    "PipelineOptions": ("fxkfac.config", "PipelineOptions"),
    "PlanOptions": ("fxkfac.config", "PlanOptions"),
    "Plan": ("fxkfac.planner.plan.plan", "Plan"),
    "errors": ("fxkfac.errors", None),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fxkfac' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)
