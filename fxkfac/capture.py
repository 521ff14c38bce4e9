"""Model capture: torch.export (non-strict) -> a flat, trainable GraphModule plus its K-FAC layers."""

from __future__ import annotations

import inspect
import logging
import os
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from fxkfac.config import KFACConfig
from fxkfac.errors import CaptureError
from fxkfac.passes.find_layers import find_kfac_layers
from fxkfac.passes.layers import KFACLayer

__all__ = ["Captured", "capture", "normalize_inputs", "input_signature"]

log = logging.getLogger(__name__)
_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Captured:
    """A captured model: ``gm(*flat_inputs)`` returns the flat outputs; parameters keep their model FQNs.

    ``gm`` shares its parameters and buffers with the model (the same tensor objects), so an optimizer
    over ``model.named_parameters()`` trains it. ``in_spec`` / ``out_spec`` are the pytree specs of
    ``(args, kwargs)`` and of the model's return value (e.g. a Hugging Face ModelOutput), so callers
    can hand ``loss_fn`` exactly what the eager model returns.
    """

    gm: fx.GraphModule
    layers: list[KFACLayer]
    skipped: dict[str, str]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    signature: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    """Shapes and dtypes of the flat example inputs the graph was specialized to."""

    def flat_inputs(self, args: Sequence[Any]) -> list[Any]:
        """Flatten positional ``args`` like the example inputs; CaptureError if their structure differs."""
        flat, spec = pytree.tree_flatten((tuple(args), {}))
        if spec != self.in_spec:
            raise CaptureError(
                f"inputs have structure {spec}, but the model was captured with {self.in_spec}; "
                "pass inputs shaped like example_inputs"
            )
        return flat

    def unflatten_outputs(self, flat: Sequence[Any]) -> Any:
        """The model's return value (same pytree as the eager model's) from the flat user outputs."""
        return pytree.tree_unflatten(list(flat), self.out_spec)


def normalize_inputs(example_inputs: Any) -> tuple[Any, ...]:
    """A tuple of positional inputs from a tensor, a tuple or a list."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise CaptureError(
        f"example_inputs must be a tensor or a tuple of forward()'s positional arguments, "
        f"got {type(example_inputs).__name__}"
    )


def input_signature(args: Sequence[Any]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """Shapes and dtypes of the tensors among ``args`` (flattened): the key a captured graph is valid for."""
    return tuple((tuple(t.shape), t.dtype) for t in pytree.tree_leaves(tuple(args)) if isinstance(t, torch.Tensor))


def capture(model: nn.Module, example_inputs: Any, kfac: KFACConfig | None = None) -> Captured:
    """Export ``model`` on ``example_inputs`` and find its K-FAC layers (none when ``kfac`` is None).

    The graph is specialized to the shapes of ``example_inputs`` (callers recapture for other
    shapes). Raises CaptureError when the inputs do not fit ``forward()`` or when the model does not
    export; the message names the construct and what to do.
    """
    args = normalize_inputs(example_inputs)
    _check_arity(model, args)
    _disable_hf_cache(model)
    _check_runs(model, args)
    try:
        ep = torch.export.export(model, args, strict=False)
    except Exception as exc:  # torch.export raises many unrelated types; all become one actionable error
        raise CaptureError(_explain_export_failure(model, exc)) from exc
    gm, in_spec, out_spec = _flat_module(ep.module())
    layers: list[KFACLayer]
    skipped: dict[str, str]
    if kfac is None:
        layers, skipped = [], {}
    else:
        layers, skipped = find_kfac_layers(
            gm, skip=kfac.skip_layers, skip_vocab_head=kfac.skip_vocab_head, vocab_size=kfac.vocab_size
        )
    for name, reason in skipped.items():
        log.info("K-FAC skips %s: %s", name, reason)
    log.info("captured %s: %d nodes, %d K-FAC layers", type(model).__name__, len(gm.graph.nodes), len(layers))
    return Captured(gm, layers, skipped, in_spec, out_spec, input_signature(args))


def _flat_module(gm: fx.GraphModule) -> tuple[fx.GraphModule, pytree.TreeSpec, pytree.TreeSpec]:
    """A GraphModule with plain codegen (flat inputs, tuple of flat outputs) and the pytree specs it dropped."""
    info = gm.graph._codegen.pytree_info  # type: ignore[attr-defined]  # an exported graph has a _PyTreeCodeGen
    graph = gm.graph
    graph._codegen = fx.graph.CodeGen()
    out_node = next(n for n in graph.nodes if n.op == "output")
    if not isinstance(out_node.args[0], (tuple, list)):
        out_node.args = ((out_node.args[0],),)
    flat = fx.GraphModule(gm, graph)
    return flat, info.in_spec, info.out_spec


def _check_arity(model: nn.Module, args: tuple[Any, ...]) -> None:
    """CaptureError when ``args`` cannot bind to ``model.forward``'s parameters."""
    try:
        inspect.signature(model.forward).bind(*args)
    except TypeError as exc:
        forward = f"{type(model).__name__}.forward{inspect.signature(model.forward)}"
        raise CaptureError(
            f"example_inputs do not fit {forward}: {exc}; pass a tuple with one entry per positional argument"
        ) from exc
    except ValueError:  # no signature (builtins); export will tell
        return


def _disable_hf_cache(model: nn.Module) -> None:
    """Turn off a Hugging Face model's KV cache: training does not use it and its cache object does not export."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        warnings.warn(
            f"{type(model).__name__}.config.use_cache set to False for training (the KV cache is not "
            "used by training and does not export)",
            stacklevel=3,
        )
        config.use_cache = False


def _check_runs(model: nn.Module, args: tuple[Any, ...]) -> None:
    """Run the eager model once, so that inputs that do not fit it are told apart from export failures."""
    try:
        with torch.no_grad():
            model(*args)
    except Exception as exc:  # any failure of the user's forward on these inputs
        shapes = [f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else type(a).__name__ for a in args]
        raise CaptureError(
            f"{type(model).__name__}.forward fails on example_inputs ({', '.join(shapes)}) at {_user_frame(exc)}: "
            f"{type(exc).__name__}: {_first_line(exc)}. Pass example_inputs with the number, shapes and dtypes "
            "forward() expects (e.g. integer token ids for an embedding)"
        ) from exc


def _explain_export_failure(model: nn.Module, exc: Exception) -> str:
    """An actionable message for an export failure: the construct, where it is, and what to do."""
    msg = str(exc)
    where = _user_frame(exc)
    head = (
        f"torch.export could not capture {type(model).__name__} at {where}: {type(exc).__name__}: {_first_line(exc)}."
    )
    if "data-dependent" in msg or "GuardOnDataDependent" in type(exc).__name__ or "Could not guard" in msg:
        fix = (
            "This is data-dependent control flow (a Python branch or size that depends on tensor values). "
            "Make it static, express it with torch.cond / torch.where, or move it out of forward()"
        )
    elif "pytree" in msg or "not a known type" in msg:
        fix = (
            "forward() returns or takes an object torch.export cannot flatten. Return tensors, tuples, dicts "
            "or a registered pytree type (torch.utils._pytree.register_pytree_node)"
        )
    elif "Unsupported" in type(exc).__name__ or "not supported" in msg.lower():
        fix = (
            "The construct is not supported by torch.export. Rewrite it with torch operations, or move that "
            "module out of the captured model (e.g. preprocess its output outside forward())"
        )
    else:
        fix = (
            "Check that example_inputs match forward(), that control flow does not depend on tensor values "
            "(use torch.cond), and that forward() uses only torch operations"
        )
    return f"{head} {fix}."


def _user_frame(exc: BaseException) -> str:
    """``file:line in function`` of the innermost traceback frame outside torch (the user's code)."""
    frames = traceback.extract_tb(exc.__traceback__)
    outside = [f for f in frames if not f.filename.startswith((_TORCH_DIR, _OWN_DIR, "<"))]
    if not outside:
        inside = [f for f in frames if f.filename.startswith(_TORCH_DIR) and "/nn/modules/" in f.filename]
        if not inside:
            return "an unknown location inside torch"
        f = inside[-1]
        where = os.path.relpath(f.filename, _TORCH_DIR)
        return f"torch code {where}:{f.lineno} in {f.name} (an nn module of the model)"
    f = outside[-1]
    code = f" `{f.line.strip()}`" if f.line else ""
    return f"{f.filename}:{f.lineno} in {f.name}{code}"


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message, shortened."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else "")[:300]
