"""`path.py:factory` targets: the model a factory makes, captured once per command line and costed for planning."""

from __future__ import annotations

import argparse
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from fxkfac.cli_args import CliError, device
from fxkfac.planner.problem import ConfigError, CostTable


def is_factory(target: str) -> bool:
    """Whether TARGET is `path.py:factory` (else a preset's name)."""
    return ":" in target and target.split(":", 1)[0].endswith(".py")


@dataclass(frozen=True)
class Factory:
    """A `path.py:factory` target prepared as `fxkfac.compile` prepares it: its cost table and the fingerprint
    compile computes for the same model, example inputs and mesh (so its exported plan loads there)."""

    costs: CostTable
    fingerprint: str


@dataclass(frozen=True)
class _Capture:
    """What a prepared factory depends on: the target and the flags that shape its stages and costs."""

    target: str
    schedule: str
    stages: int
    dp: int
    microbatches: int
    virtual_stages: int
    micro_batch_size: int | None
    device: str


def factory(args: argparse.Namespace, S: int) -> Factory:
    """Import, call and prepare the factory of `args.target` (once per command line: capturing is slow)."""
    return _prepared(
        _Capture(
            args.target,
            args.schedule,
            args.stages,
            args.dp,
            args.microbatches,
            args.virtual_stages,
            args.micro_batch_size,
            device(args),
        ),
        S,
    )


@functools.cache
def _prepared(capture: _Capture, S: int) -> Factory:
    """Capture the model a `path.py:factory` makes (this path imports torch), split it into stages as compile
    does, and cost each stage's K-FAC layers with the analytic model."""
    model, example = _call_factory(capture.target)
    from torch import nn

    from fxkfac.compile_api import prepare
    from fxkfac.config import KFACConfig
    from fxkfac.families import family_of
    from fxkfac.planner.problem import ScheduleKind
    from fxkfac.planner.problem.analytic import analytic_cost_table, model_spec_from_layers

    target, N, W = capture.target, capture.microbatches, capture.dp
    if not isinstance(model, nn.Module):
        raise CliError(
            f"{target} must return (model, example_inputs) with an nn.Module model, got {type(model).__name__}"
        )
    try:
        prepared = prepare(
            model,
            example,
            family_of(KFACConfig()),
            kind=ScheduleKind(capture.schedule),
            D=capture.stages,
            W=W,
            N=N,
            v=capture.virtual_stages,
        )
    except ConfigError as e:
        raise CliError(f"{target}: {e}") from None
    micro = prepared.batch // (N * W)
    if capture.micro_batch_size not in (None, micro):
        raise CliError(
            f"{target}'s example inputs hold {prepared.batch} samples, {micro} per micro-batch at "
            f"N={N}, W={W}; --micro-batch-size {capture.micro_batch_size} differs (drop it: a factory's "
            "example is the global mini-batch, as fxkfac.compile takes it)"
        )
    layers = {x.name: x for x in prepared.captured.layers}  # the K-FAC layers fxkfac.compile finds by default
    stages = [[layers[name] for name in prepared.stage_layers.get(s, [])] for s in range(S)]
    empty = [s for s, names in enumerate(stages) if not names]
    if empty:
        raise CliError(
            f"{target} splits into {S} stages with no K-FAC layer (Linear/Conv2d that the default "
            f"KFACConfig keeps) on stages {empty}; use fewer stages"
        )
    spec = model_spec_from_layers(
        [[(x.name, x.d_in, x.d_out, x.tokens_per_sample, x.bias is not None) for x in st] for st in stages],
        name=target.split(":", 1)[1],
    )
    costs = analytic_cost_table(spec, [range(i, i + 1) for i in range(S)], micro, 1, capture.device)
    return Factory(costs, prepared.target.fingerprint)


def _call_factory(target: str) -> tuple[object, object]:
    """Import `path.py` and call its `factory`: (model, example_inputs), or a CliError saying what went wrong."""
    path_text, factory_name = target.split(":", 1)
    path = Path(path_text)
    if not path.is_file():
        raise CliError(f"no file {path} (TARGET path.py:factory)")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise CliError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: report what it raised, in one line
        raise CliError(f"importing {path} failed: {type(e).__name__}: {e}") from None
    made_by = getattr(module, factory_name, None)
    if not callable(made_by):
        raise CliError(f"{path} has no callable {factory_name!r}")
    try:
        made = made_by()
    except Exception as e:
        raise CliError(f"{path}:{factory_name}() failed: {type(e).__name__}: {e}") from None
    if not (isinstance(made, tuple) and len(made) == 2):
        raise CliError(f"{factory_name}() must return (model, example_inputs)")
    return made
