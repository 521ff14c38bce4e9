"""Variable shapes: one capture per input shape (what fxkfac does) against one export with dynamic dimensions.

On a tiny Llama (Hugging Face LlamaForCausalLM from a config: RMSNorm, rotary, SwiGLU, grouped-query attention)
and steps of three shapes, it measures for each option: the seconds to capture (per shape, or once), the seconds
of a forward+backward of the captured graph at every shape, whether its outputs equal the eager model's, and
whether the graph goes through what fxkfac runs on it (K-FAC layer discovery and the stage split, which sizes
every receive buffer from the boundary's shape). Prints a table and a JSON line with the ratios dynamic/static.

    python benchmarks/variable_shapes.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import fx

from fxkfac.capture import capture
from fxkfac.config import KFACConfig
from fxkfac.passes.find_layers import find_kfac_layers
from fxkfac.passes.split_stages import split_stages

SHAPES = [(4, 16), (4, 12), (2, 16)]
"""(batch, sequence): the example's, a shorter sequence, a shorter batch."""


def tiny_llama() -> torch.nn.Module:
    """LlamaForCausalLM with hidden 32, 2 layers, 4 heads, 2 kv heads, vocabulary 64; the rest default."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def _seconds(fn: Callable[[], Any]) -> tuple[float, Any]:
    began = time.perf_counter()
    out = fn()
    return time.perf_counter() - began, out


def _fb_seconds(gm: torch.nn.Module, x: torch.Tensor) -> float:
    """Seconds of one forward and backward of `gm` on `x`, the logits' float sum as the loss."""
    began = time.perf_counter()
    out = gm(x)
    logits = out.logits if hasattr(out, "logits") else out[0]
    logits.float().sum().backward()
    return time.perf_counter() - began


def _step_ms(graphs: list[torch.nn.Module], x: torch.Tensor, repeats: int) -> list[float]:
    """Each graph's least ms of a forward and backward on `x` over `repeats` rounds after one warm-up, the graphs
    taking turns within a round (the machine is shared: turns and the least keep the load out of the ratio)."""
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(repeats + 1):
        for i, gm in enumerate(graphs):
            times[i].append(_fb_seconds(gm, x))
    return [1e3 * min(t[1:]) for t in times]


def _passes(gm: fx.GraphModule) -> str:
    """'ok', or the error K-FAC layer discovery or the 2-stage split raise on the graph."""
    try:
        layers, _ = find_kfac_layers(gm)
        split_stages(gm, 2, layers=layers)
    except Exception as exc:  # noqa: BLE001 - the benchmark reports any failure of the passes
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"
    return "ok"


def _trainer_steps(model: torch.nn.Module, inputs: list[torch.Tensor]) -> dict[str, float]:
    """fxkfac on one device (K-FAC, eager stages): ms of a step at the example's shape, s of the first step at each
    other shape (its capture included), ms of a later step at it."""
    import torch.nn.functional as F

    import fxkfac

    def loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits.reshape(-1, 64), y.reshape(-1))

    trainer = fxkfac.compile(model, None, None, example_inputs=(inputs[0],), loss_fn=loss, backend=None)
    seconds = {}
    for x in inputs:
        y = torch.randint(0, 64, x.shape)
        seconds[f"first step {list(x.shape)}"], _ = _seconds(lambda x=x, y=y: trainer.step(x, y))
        seconds[f"later step {list(x.shape)}"] = min(_seconds(lambda x=x, y=y: trainer.step(x, y))[0] for _ in range(5))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(1)
    model = tiny_llama()
    inputs = [torch.randint(0, 64, shape) for shape in SHAPES]
    capture(model, (inputs[0],), KFACConfig())  # warm torch.export up: both options then start equal

    static_s, static_gms, static_ok = [], [], True
    for x in inputs:
        seconds, captured = _seconds(lambda x=x: capture(model, (x,), KFACConfig()))
        static_s.append(seconds)
        static_gms.append(captured.gm)
        static_ok &= bool(torch.allclose(captured.unflatten_outputs(captured.gm(x)).logits, model(x).logits))
    static_passes = _passes(capture(model, (inputs[0],), None).gm)

    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=64)
    dynamic_s, ep = _seconds(
        lambda: torch.export.export(model, (inputs[0],), dynamic_shapes=({0: batch, 1: seq},), strict=False)
    )
    gm = ep.module()
    dynamic_ok = all(bool(torch.allclose(gm(x).logits, model(x).logits)) for x in inputs)
    dynamic_passes = _passes(ep.module())
    paired = [_step_ms([static, gm], x, args.repeats) for static, x in zip(static_gms, inputs, strict=True)]
    static_ms, dynamic_ms = [p[0] for p in paired], [p[1] for p in paired]

    steps = _trainer_steps(model, inputs)

    table = Table(title="variable shapes: tiny Llama, 3 shapes " + " ".join(str(list(s)) for s in SHAPES))
    for column in ("option", "capture s", "F+B ms per shape", "equals eager", "find layers + split"):
        table.add_column(column)
    table.add_row(
        "capture per shape",
        " + ".join(f"{s:.2f}" for s in static_s),
        " ".join(f"{ms:.1f}" for ms in static_ms),
        str(static_ok),
        static_passes,
    )
    table.add_row(
        "one dynamic export",
        f"{dynamic_s:.2f}",
        " ".join(f"{ms:.1f}" for ms in dynamic_ms),
        str(dynamic_ok),
        dynamic_passes,
    )
    console = Console(width=160)
    console.print(table)
    console.print("fxkfac one device, K-FAC: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in steps.items()))
    print(
        json.dumps(
            {
                "benchmark": "variable_shapes",
                "static_capture_s": [round(s, 3) for s in static_s],
                "dynamic_export_s": round(dynamic_s, 3),
                "dynamic_export_over_one_capture": round(dynamic_s / statistics.median(static_s), 2),
                "static_step_ms": [round(ms, 2) for ms in static_ms],
                "dynamic_step_ms": [round(ms, 2) for ms in dynamic_ms],
                "dynamic_step_over_static": [round(d / s, 2) for d, s in zip(dynamic_ms, static_ms, strict=True)],
                "static_equal": static_ok,
                "dynamic_equal": dynamic_ok,
                "static_passes": static_passes,
                "dynamic_passes": dynamic_passes,
                "trainer_step_ms": {k: round(1e3 * v, 1) for k, v in steps.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
