"""Variable input shapes: the model captured again, once per shape, and split where the first capture was.

[Note: variable shapes] A step whose mini-batch has another batch size or sequence length than `example_inputs`
runs on the model captured at that shape: `Recapture` exports it on one micro-batch of the new mini-batch, finds
the family's units and splits it at the first split's block boundaries, so every stage holds the same parameters
and layers; each stage copy then runs that graph on its own weights (`StageRunner.use_shape`). The plan made for
`example_inputs` is reused as it is: its ops name stages, micro-batches and layers, none of them shapes. Shapes are
kept in a bounded cache (`PipelineOptions.shape_cache_size`).

Why a capture per shape and not one export with dynamic dimensions (torch.export.Dim), measured by
benchmarks/variable_shapes.py on a tiny Llama (2026-11-29, 2 shared cores, load 3.5): the dynamic export succeeds
and equals the eager model, but costs 1.0 s against 0.33-0.58 s for a capture at one shape, so it pays off only
from the third shape on; its eager forward+backward is about as fast (0.97-1.09x); and it does not go through
the passes fxkfac runs on the graph: the stage split meets symbolic sizes (``sym_size_int``) that later stages
read, while stages exchange tensors only and every receive allocates its buffer from the boundary's concrete
shape. torch.compile specializes per shape anyway (``dynamic=False``), so the stages would be compiled once per
shape either way; and a trainer's first step at a new shape (capture, factor taps, first run: 2.4-4.5 s there)
costs what its first step at the example's shape costs. A static graph per shape keeps the split, the layer
records and the factor taps exact and unchanged.

Statistics follow the step's own samples: a micro-batch's factors are averages over its own rows, and the
output-gradient captures are rescaled to the batch the stages were built for (`TappedRunner.grad_scale`), so a
shorter batch is weighted by its own sample count; each step's factor then enters the running average with the
family's decay whatever its size, as on one device. Every micro-batch of one step has the same shape: a mini-batch
that microbatches x replicas does not divide is refused (`shard_microbatches`), since unequal micro-batches would
each need their own graph and their losses and statistics weighted by their sizes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fxkfac.capture import capture
from fxkfac.config import KFACConfig
from fxkfac.errors import ConfigError
from fxkfac.passes.split_stages import SplitResult, split_stages
from fxkfac.preconditioner import Family

__all__ = ["ShapeVariant", "Recapture", "Signature", "batch_size", "check_signature", "elements"]

Signature = tuple[tuple[tuple[int, ...], Any], ...]
"""Shapes and dtypes of a mini-batch's tensors (`fxkfac.capture.input_signature`)."""


@dataclass(frozen=True)
class ShapeVariant:
    """The model captured at one input shape: its split, and the units each stage preconditions by name."""

    signature: Signature
    batch: int
    """Samples in the global mini-batch of this shape."""
    split: SplitResult
    stage_units: Mapping[int, Mapping[str, Any]]


@dataclass(frozen=True)
class Recapture:
    """What `fxkfac.compile` needs to capture the model again at another input shape, split as it first was."""

    model: nn.Module
    family: Family | None
    microbatches: int
    replicas: int
    split: SplitResult
    """The split made for `example_inputs`: the stage boundaries every shape keeps."""
    stage_units: Mapping[int, Sequence[str]]

    def __call__(self, micro: tuple[Any, ...], signature: Signature, batch: int) -> ShapeVariant:
        """The model captured on `micro` (one micro-batch of a mini-batch shaped `signature`) and split at the
        first split's boundaries; ConfigError when that puts other parameters or layers on some stage."""
        family = self.family
        captured = capture(self.model, micro, family.layer_config if family is not None else KFACConfig())
        units = {u.name: u for u in family.units(captured.gm, captured.layers)} if family is not None else {}
        points = [stage.blocks[0] for stage in self.split.stages[1:]]
        split = split_stages(captured.gm, len(self.split.stages), split_points=points, layers=captured.layers)
        for first, now in zip(self.split.stages, split.stages, strict=True):
            names = self.stage_units[first.index]
            if now.params != first.params or not set(names) <= set(units):
                raise ConfigError(
                    f"inputs of {_words(signature)} split the model otherwise than example_inputs did (stage "
                    f"{first.index} would hold other parameters or layers); pass mini-batches shaped like "
                    "example_inputs, or set PipelineOptions(shape_cache_size=0) to be told at once"
                )
        return ShapeVariant(
            signature,
            batch,
            split,
            {s: {n: units[n] for n in names} for s, names in self.stage_units.items()},
        )


def batch_size(inputs: Any, what: str = "inputs") -> int:
    """Dim 0 of the first tensor of `inputs` that has one: the mini-batch's samples."""
    for leaf in pytree.tree_leaves(inputs):
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ConfigError(f"{what} contain no tensor with a batch dimension to split into micro-batches")


def elements(signature: Signature) -> int:
    """Elements of the first input tensor (an LM's tokens per step): what a step's cost grows with."""
    return math.prod(signature[0][0]) if signature else 0


def _words(signature: Signature) -> str:
    """Shapes as a user writes them."""
    return ", ".join(str(list(shape)) for shape, _ in signature) or "no tensors"


def check_signature(got: Signature, built: Signature) -> None:
    """ConfigError unless `got` has `built`'s tensors with their dtypes and ranks (only sizes may differ)."""
    same = len(got) == len(built) and all(
        g_dtype == b_dtype and len(g_shape) == len(b_shape)
        for (g_shape, g_dtype), (b_shape, b_dtype) in zip(got, built)
    )
    if not same:
        raise ConfigError(
            f"inputs have tensors {_words(got)} ({[str(d) for _, d in got]}), but the model was compiled for "
            f"example_inputs of {_words(built)} ({[str(d) for _, d in built]}): a step may change sizes "
            "(batch, sequence length), not the number, rank or dtype of its tensors"
        )
