"""One stage's backward through autograd against the split one (forward, then B, then W), eager, same inputs,
1 thread: the time of each part, with glibc's default malloc and with freed host memory kept
([Note: host memory] in fxkfac/runtime/host_memory.py), and the aten ops of each side by torch.profiler.

Run: python benchmarks/split_backward.py [--width 512] [--layers 4] [--batch 32] [--iters 200] [--stat median|min]
    [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from fxkfac.capture import capture
from fxkfac.passes.split_stages import StageGraph, TensorSpec
from fxkfac.runtime.host_memory import keep_freed_host_memory
from fxkfac.runtime.stage import StageRunner


def make_stage(width: int, layers: int, batch: int, split: bool) -> StageRunner:
    """A stage of `layers` blocks of Linear + GELU (pipeline_vs_torch.py's), run split or through autograd."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])
    gm = capture(model, (torch.randn(batch, width),)).gm
    spec = (TensorSpec("x", (batch, width), torch.float32),)
    graph = StageGraph(
        0, gm, spec, (TensorSpec("y", (batch, width), torch.float32),), tuple(dict(gm.named_parameters()))
    )
    runner = StageRunner.build(graph, 0, False, None, copy=False)
    runner.split = split
    return runner


def parts(runner: StageRunner, x: torch.Tensor, g: torch.Tensor) -> dict[str, Callable[[], object]]:
    """One micro-batch's forward and backward, in the order they run (split: B, then W)."""
    if not runner.split:
        return {
            "forward": lambda: runner.forward(0, [x.clone()], needs_grad=True),
            "backward": lambda: runner.backward(0, [g]),
        }
    return {
        "forward": lambda: runner.forward(0, [x.clone()], needs_grad=True),
        "B": lambda: runner.backward(0, [g], defer_weights=True),
        "W": lambda: runner.backward_weights(0),
    }


def measure(
    sides: dict[str, dict[str, Callable[[], object]]], iters: int, warmup: int = 10, stat: Callable = statistics.median
) -> dict[str, dict[str, float]]:
    """Milliseconds of each part (`stat` over the iterations: the median, or the least, which a loaded machine's
    preemptions do not reach), the sides alternating micro-batch by micro-batch."""
    times: dict[str, dict[str, list[float]]] = {s: {p: [] for p in ps} for s, ps in sides.items()}
    for i in range(warmup + iters):
        for side, ps in sides.items():
            for part, fn in ps.items():
                t0 = time.perf_counter()
                fn()
                if i >= warmup:
                    times[side][part].append(time.perf_counter() - t0)
    return {s: {p: stat(v) * 1e3 for p, v in ps.items()} for s, ps in times.items()}


def profile(sides: dict[str, dict[str, Callable[[], object]]]) -> None:
    """torch.profiler's aten ops of each side, by input shape."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for side, ps in sides.items():
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(30):
                for fn in ps.values():
                    fn()
        print(side)
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="the micro-batch")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler's op tables")
    parser.add_argument(
        "--stat", choices=("median", "min"), default="median", help="of each part's times (min: on a loaded machine)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, g = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    sides = {
        name: parts(make_stage(args.width, args.layers, args.batch, split), x, g)
        for name, split in (("autograd", False), ("split", True))
    }
    stat = statistics.median if args.stat == "median" else min
    results = {"default malloc": measure(sides, args.iters, stat=stat)}
    if keep_freed_host_memory():
        results["freed memory kept"] = measure(sides, args.iters, stat=stat)
    if args.profile:
        profile(sides)

    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"one stage: {args.layers} x Linear({args.width}) + GELU, micro-batch {args.batch}, ms ({args.stat})"
    )
    for col in (
        "host memory",
        "autograd F",
        "autograd backward",
        "split F",
        "split B",
        "split W",
        "B+W / backward",
        "step split/autograd",
    ):
        table.add_column(col)
    rows = []
    for mode, r in results.items():
        a, s = r["autograd"], r["split"]
        bw = (s["B"] + s["W"]) / a["backward"]
        step = sum(s.values()) / sum(a.values())
        table.add_row(
            mode,
            *(f"{v:.3f}" for v in (a["forward"], a["backward"], s["forward"], s["B"], s["W"])),
            f"{bw:.2f}",
            f"{step:.2f}",
        )
        rows.append({"host_memory": mode, "autograd_ms": a, "split_ms": s, "bw_over_backward": bw, "step_ratio": step})
    Console().print(table)
    print(json.dumps({"benchmark": "split_backward", "args": vars(args), "results": rows}))


if __name__ == "__main__":
    main()
