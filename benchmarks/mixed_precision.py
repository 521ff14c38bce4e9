"""Step time and memory of mixed precision (bfloat16, float16 with loss scaling) against float32, on CPU.

One trainer per (dtype, preconditioner) on one device (a deep MLP, eager stages), each in its own spawned process so
that its peak resident memory is its own; the dtypes run side by side, alternating, over `--rounds` rounds, and each
figure is the median over rounds. Memory: the bytes autograd saved for backward in one step, parameters excluded,
split into activations and autocast's narrow copies of the weights (cast once per step: the trainer keeps autocast's
cast cache alive over the step's micro-batches), and the process's peak resident set (weights,
optimizer and preconditioner state are float32 in every run). Ratios are against float32 of the same
preconditioner. CPU autocast's speed depends on the CPU's low-precision support (AVX512-BF16/AMX, AVX512-FP16):
without it the narrow matmuls are emulated and slower than float32.

Run: python benchmarks/mixed_precision.py [--width 1024] [--depth 6] [--batch 256] [--steps 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

import fxkfac
from fxkfac.config import KFACConfig, PipelineOptions

DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
FAMILIES = ("adamw", "kfac")


def make_model(width: int, depth: int, classes: int = 10) -> nn.Module:
    """A deep MLP: `depth` blocks of Linear + GELU, then a classifier."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


def saved_bytes(step: Any, params: Sequence[torch.Tensor]) -> tuple[int, int]:
    """Bytes of the tensors autograd saves for backward while `step()` runs, each once, parameters excluded:
    (activations, narrow copies of the weights: tensors of a parameter's shape in another dtype)."""
    seen = {p.data_ptr() for p in params}
    shapes = {tuple(p.shape) for p in params}
    totals = [0, 0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in seen:  # each tensor once, however many ops save it
            seen.add(t.data_ptr())
            totals[int(tuple(t.shape) in shapes and t.dtype != torch.float32)] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return totals[0], totals[1]


def measure(args: argparse.Namespace, dtype_name: str, family: str) -> dict[str, float]:
    """One run in this process: median step time, bytes saved for backward in a step, peak resident memory."""
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    trainer = fxkfac.compile(
        make_model(args.width, args.depth),
        None,
        None,
        example_inputs=(x,),
        loss_fn=F.cross_entropy,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        preconditioner=KFACConfig() if family == "kfac" else None,
        backend=None,
        microbatches=args.microbatches,
        pipeline=PipelineOptions(autocast_dtype=DTYPES[dtype_name]),
    )
    params = [p for _, p in trainer.named_parameters()]
    trainer.step(x, y)  # warm-up
    acts, casts = saved_bytes(lambda: trainer.step(x, y), params)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        trainer.step(x, y)
        times.append(time.perf_counter() - start)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_s": statistics.median(times), "act_bytes": acts, "cast_bytes": casts, "peak_rss_bytes": rss}


def _child(args: argparse.Namespace, dtype_name: str, family: str, out: Any) -> None:
    out.put(measure(args, dtype_name, family))


def run(args: argparse.Namespace, dtype_name: str, family: str) -> dict[str, float]:
    """`measure` in a fresh spawned process (its own peak memory)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(args, dtype_name, family, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    samples: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for family in FAMILIES:
            for dtype_name in DTYPES:
                samples.setdefault((family, dtype_name), []).append(run(args, dtype_name, family))
    medians = {
        key: {field: statistics.median(s[field] for s in runs) for field in runs[0]} for key, runs in samples.items()
    }
    table = Table(title=f"mixed precision on CPU: MLP {args.depth}x{args.width}, batch {args.batch}, one device")
    columns = ("optimizer", "dtype", "step ms", "x fp32", "activ. MiB", "x fp32", "w. casts MiB", "peak RSS MiB")
    for column in (*columns, "x fp32"):
        table.add_column(column, justify="right")
    rows = []
    for (family, dtype_name), m in medians.items():
        base = medians[(family, "float32")]
        ratios = {field: m[field] / base[field] for field in m if base[field]}
        rows.append({"optimizer": family, "dtype": dtype_name, **m, **{f"{k}_ratio": v for k, v in ratios.items()}})
        table.add_row(
            family,
            dtype_name,
            f"{m['step_s'] * 1e3:.1f}",
            f"{ratios['step_s']:.2f}",
            f"{m['act_bytes'] / 2**20:.1f}",
            f"{ratios['act_bytes']:.2f}",
            f"{m['cast_bytes'] / 2**20:.1f}",
            f"{m['peak_rss_bytes'] / 2**20:.0f}",
            f"{ratios['peak_rss_bytes']:.2f}",
        )
    Console(width=140).print(table)
    print(json.dumps({"benchmark": "mixed_precision", "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
