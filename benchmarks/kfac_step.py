"""Time per training step on one device: fxkfac K-FAC vs ASDL K-FAC vs plain AdamW, as ratios, in one run.

The same model, data and batch size for every method; K-FAC refreshes factors and inverses every step in both
fxkfac and ASDL (the same work: factors of every Linear, Cholesky inverses, preconditioning), and fxkfac also
runs with ``refresh_every=10``. Methods are timed in interleaved rounds after a warm-up, and the median step time
of each is divided by plain eager AdamW's. Prints a rich table and one JSON line.

    python benchmarks/kfac_step.py [--width 256] [--batch 128] [--steps 20] [--rounds 3] [--backend inductor]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

import fxkfac
from fxkfac import KFACConfig

KFAC = dict(damping=1e-2, factor_decay=0.95, kl_clip=1e-3)
LR = 0.05


def make_model(width: int) -> nn.Module:
    """A 4-layer tanh MLP on 64 inputs (the digits shape), 10 classes, seed 0."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, 10),
    )


def eager_adamw(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """Plain PyTorch: forward, backward, AdamW step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def fxkfac_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, kfac: KFACConfig | None, backend: str | None
) -> Callable[[], None]:
    """fxkfac.compile on one device (mesh=None); preconditioner=None is the graph path with AdamW alone."""
    factory = (
        (lambda p: torch.optim.AdamW(p, lr=1e-3))
        if kfac is None
        else (lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9))
    )
    trainer = fxkfac.compile(
        model,
        None,
        example_inputs=(x,),
        loss_fn=F.cross_entropy,
        optimizer=factory,
        preconditioner=kfac,
        backend=backend,
    )
    return lambda: trainer.step((x,), y)


@contextlib.contextmanager
def _no_nvtx(*args: object, **kwargs: object) -> Iterator[None]:
    yield


def asdl_kfac(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """ASDL's KfacGradientMaker (empirical Fisher, pi-damping, refresh every step) over the same SGD."""
    from asdl import KfacGradientMaker, PreconditioningConfig

    torch.cuda.nvtx.range = _no_nvtx  # ASDL marks NVTX ranges, which a CPU-only torch cannot
    config = PreconditioningConfig(damping=KFAC["damping"], data_size=len(x), ema_decay=1 - KFAC["factor_decay"])
    maker = KfacGradientMaker(model, config, fisher_type="fisher_emp")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        dummy_y = maker.setup_model_call(model, x)
        maker.setup_loss_call(F.cross_entropy, dummy_y, y)
        maker.forward_and_backward()
        opt.step()

    return step


def time_steps(step: Callable[[], None], n: int) -> list[float]:
    """Seconds of each of n calls."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--backend", default=None, help="torch.compile backend for fxkfac (default: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batch, 64, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    methods = {
        "AdamW (eager)": eager_adamw(make_model(args.width), x, y),
        "fxkfac AdamW (preconditioner=None)": fxkfac_step(make_model(args.width), x, y, None, args.backend),
        "fxkfac K-FAC (refresh 1)": fxkfac_step(make_model(args.width), x, y, KFACConfig(**KFAC), args.backend),
        "fxkfac K-FAC (refresh 10)": fxkfac_step(
            make_model(args.width), x, y, KFACConfig(**KFAC, refresh_every=10), args.backend
        ),
        "ASDL K-FAC (refresh 1)": asdl_kfac(make_model(args.width), x, y),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for step in methods.values():
        time_steps(step, args.warmup)
    for _ in range(args.rounds):
        for name, step in methods.items():
            times[name] += time_steps(step, args.steps)
    median = {name: statistics.median(t) for name, t in times.items()}
    base = median["AdamW (eager)"]
    table = Table(
        title=f"time per step, MLP width {args.width}, batch {args.batch}, 1 thread "
        f"(median of {args.rounds}x{args.steps}), backend {args.backend}"
    )
    for col in ("method", "ms / step", "x AdamW (eager)"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for name, t in median.items():
        table.add_row(name, f"{1e3 * t:.2f}", f"{t / base:.2f}")
    Console().print(table)
    print(
        json.dumps(
            {
                "benchmark": "kfac_step",
                "width": args.width,
                "batch": args.batch,
                "backend": args.backend,
                "ms_per_step": {k: round(1e3 * v, 3) for k, v in median.items()},
                "ratio_to_adamw": {k: round(v / base, 3) for k, v in median.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
