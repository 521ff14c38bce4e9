"""Parameters and optimizer state of one pipelined rank, keyed by parameter FQN (for state dicts and checkpoints).

A rank may hold several copies of a parameter (Chimera's two pipelines, tied weights used by two local
stages); the copies are kept equal by the gradient sync, so their state is saved once per FQN and
loaded into every copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from fxkfac.errors import CheckpointError
from fxkfac.runtime.stage import StageRunner

__all__ = ["param_names", "optimizer_state", "check_model_state", "load_model_state", "parse_optimizer_state"]


def param_names(runners: Iterable[StageRunner]) -> list[str]:
    """The FQN of each parameter in the order the trainer hands them to its optimizer."""
    return [name for r in runners for name, _ in r.module.named_parameters()]


def optimizer_state(optimizer: torch.optim.Optimizer | None, names: list[str]) -> dict[str, Any]:
    """``{"state": {fqn: {key: value}}, "param_groups": [{..., "params": [fqn, ...]}]}`` (empty without optimizer)."""
    if optimizer is None:
        return {"state": {}, "param_groups": []}
    sd = optimizer.state_dict()
    state: dict[str, Any] = {}
    for index, value in sd["state"].items():
        state.setdefault(names[index], dict(value))
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
        for g in sd["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def parse_optimizer_state(
    optimizer: torch.optim.Optimizer | None, names: list[str], saved: Mapping[str, Any]
) -> dict[str, Any] | None:
    """`optimizer_state` output as a torch optimizer state dict for ``optimizer``; CheckpointError when its
    parameter groups name other parameters."""
    if optimizer is None:
        if saved.get("state") or saved.get("param_groups"):
            raise CheckpointError("checkpoint has optimizer state for a rank that holds no parameters")
        return None
    current = optimizer.state_dict()["param_groups"]
    try:
        groups = list(saved["param_groups"])
        wanted = [[names[i] for i in g["params"]] for g in current]
        if [list(g["params"]) for g in groups] != wanted:
            raise CheckpointError(
                f"checkpoint optimizer groups hold parameters {[g['params'][:3] for g in groups]}, "
                f"this rank's {[w[:3] for w in wanted]}; it was written for another model or layout"
            )
        state = {i: dict(saved["state"][n]) for i, n in enumerate(names) if n in saved["state"]}
        unknown = sorted(set(saved["state"]) - set(names))
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint optimizer state is malformed ({e!r})") from e
    if unknown:
        raise CheckpointError(f"checkpoint optimizer state names parameters {unknown[:4]} this rank does not hold")
    return {"state": state, "param_groups": [{**g, "params": c["params"]} for g, c in zip(groups, current)]}


def check_model_state(runners: Iterable[StageRunner], saved: Any) -> None:
    """CheckpointError unless ``saved`` holds exactly this rank's parameters, with their shapes."""
    mine = {n: p for r in runners for n, p in r.module.named_parameters()}
    if not isinstance(saved, Mapping) or set(saved) != set(mine):
        names = sorted(set(saved or {}) ^ set(mine))
        raise CheckpointError(
            f"checkpoint parameters differ from this rank's ({names[:4]}); it was written for another model or layout"
        )
    bad = [n for n, p in mine.items() if not isinstance(saved[n], Tensor) or saved[n].shape != p.shape]
    if bad:
        raise CheckpointError(f"checkpoint parameters {bad[:4]} have other shapes than this model's")


def load_model_state(runners: Iterable[StageRunner], saved: Mapping[str, Tensor]) -> None:
    """Copy ``saved`` into every local copy of each parameter."""
    with torch.no_grad():
        for r in runners:
            for name, param in r.module.named_parameters():
                param.copy_(saved[name])
