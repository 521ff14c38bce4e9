"""K-FAC step time, fxkfac against kfac-pytorch (gpauloski/kfac-pytorch), as ratios, in one run: one device or 2 ranks.

Both sides train the same model (same seed, same batch) with SGD (lr 0.05, momentum 0.9) and refresh
everything every step: factors, running averages and inverses (kfac-pytorch ``factor_update_steps =
inv_update_steps = 1``, fxkfac ``refresh_every=1``), then precondition every Linear and KL-clip. A step is
forward + backward + preconditioner + optimizer step. Inverse methods, paired:

- ``inverse``: kfac-pytorch ``compute_method=INVERSE`` (``torch.linalg.inv`` of each damped factor) against
  fxkfac ``KFACConfig(inverse="cholesky")`` (Cholesky inverse of each damped factor);
- ``eigen``: kfac-pytorch ``compute_method=EIGEN`` (its default, with the eigenvalue outer product
  precomputed at inversion time) against fxkfac ``KFACConfig(inverse="eigen")``.

Damping: fxkfac's ``damping=1e-3`` everywhere. With eigen both add it to the eigenvalue products
``l_B l_A^T``. With inverse fxkfac damps each factor by ``sqrt(damping)`` and kfac-pytorch by its own
``damping`` argument, so kfac-pytorch gets ``sqrt(1e-3)`` there and the damped factors are the same.
Factor decay 0.95, KL-clip 1e-3 on both sides.

Models (seed 0, float32): ``mlp``, 784-1024-1024-10 tanh MLP, batch 128; ``tokens``, 2 residual blocks of
Linear 256->1024 (GELU) ->256 on ``[16, 64, 256]`` inputs (16 sequences of 64 tokens, 1024 rows per factor)
and a Linear 256->10 head with a cross-entropy per token. The methods run in interleaved rounds after a
warm-up: within a round each model and method alternates one fxkfac step and one kfac-pytorch step
(order flipped every pair), so load on the machine falls on both alike. Reported: the median step of each,
their ratio, and the quartiles of the paired ratios (each fxkfac step over the kfac-pytorch step next to it),
with the load average before and after. Prints a rich table and one JSON line.

``--world 2``: two gloo ranks (one process each, ``--threads`` each), pure data parallelism, the global batch
above split between them. fxkfac compiles on a ``(1, 2)`` mesh without a plan, with ``PlanOptions(strategy=...)``
forced on every layer; kfac-pytorch wraps the model in DistributedDataParallel and gets the
``grad_worker_fraction`` of the same name: ``comm-opt`` = ``COMM_OPT`` (1), ``mem-opt`` = ``MEM_OPT`` (1/W),
``hybrid:0.5`` = 0.5 (at W = 2 the same fraction as MEM-OPT). A timed step runs from one barrier to the next,
the second timed, so it lasts until its slowest rank is done (rank 0's clock is reported; timing rank 0 alone
would favour the side that gives rank 0 less work).

The warm-up is 10 steps by default because an eigendecomposition's time depends on the spectrum: fxkfac's
running average starts from the first batch's factor (rank <= 129 for the MLP's A at batch 128, full rank only
after 8 steps), kfac-pytorch's from the identity, and a rank-deficient factor decomposes faster.

kfac-pytorch is not on PyPI; when ``import kfac`` fails only fxkfac's side runs and the install is printed.
Install it next to the project, without touching the project's environment (torch stays as it is)::

    git clone https://github.com/gpauloski/kfac-pytorch /tmp/kfac-pytorch
    pip install --no-deps --target /tmp/kfac-site /tmp/kfac-pytorch
    PYTHONPATH=/tmp/kfac-site python benchmarks/kfac_pytorch_compare.py

    python benchmarks/kfac_pytorch_compare.py [--models mlp tokens] [--methods inverse eigen] [--steps 5]
        [--rounds 3] [--warmup 10] [--threads 1] [--backend BACKEND] [--capture fused|deferred]
        [--world 2 [--strategies comm-opt ...]]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

import fxkfac
from fxkfac import KFACConfig
from fxkfac.cli_args import enum_option
from fxkfac.config import PlanOptions
from fxkfac.planner.problem import Capture, InverseMethod

DAMPING, FACTOR_DECAY, KL_CLIP, LR, MOMENTUM = 1e-3, 0.95, 1e-3, 0.05, 0.9
FXKFAC_METHOD = {"inverse": InverseMethod.CHOLESKY, "eigen": InverseMethod.EIGEN}
INSTALL = """kfac-pytorch is not importable; only fxkfac's side runs. To compare, install it from a local checkout
of https://github.com/gpauloski/kfac-pytorch without touching this environment (torch stays as it is):
    git clone https://github.com/gpauloski/kfac-pytorch /tmp/kfac-pytorch
    pip install --no-deps --target /tmp/kfac-site /tmp/kfac-pytorch
    PYTHONPATH=/tmp/kfac-site python benchmarks/kfac_pytorch_compare.py
(`import kfac` needs the package's metadata, so PYTHONPATH=/tmp/kfac-pytorch on the bare checkout is not enough.)"""
SEQ, TOKEN_BATCH, TOKEN_BLOCKS, TOKEN_CLASSES = 64, 16, 2, 10
STRATEGIES = ("comm-opt", "mem-opt", "hybrid:0.5")


class TokenBlock(nn.Module):
    """x + fc2(gelu(fc1(x))), Linear 256->1024->256."""

    def __init__(self, width: int = 256, hidden: int = 1024) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class TokenModel(nn.Module):
    """TOKEN_BLOCKS TokenBlocks and a per-token Linear head; logits come out as ``[batch, classes, seq]`` (the
    layout F.cross_entropy takes with ``[batch, seq]`` targets, sharded along the batch like the inputs)."""

    def __init__(self, blocks: int = TOKEN_BLOCKS, width: int = 256) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(TokenBlock(width) for _ in range(blocks)))
        self.head = nn.Linear(width, TOKEN_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).transpose(1, 2)


def make_model(kind: str, device: str = "cpu") -> nn.Module:
    """``mlp`` (784-1024-1024-10, tanh) or ``tokens`` (TokenModel), seed 0, on `device`."""
    torch.manual_seed(0)
    if kind == "mlp":
        model: nn.Module = nn.Sequential(
            nn.Linear(784, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 10)
        )
    else:
        model = TokenModel()
    return model.to(device)


def make_batch(kind: str, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch on `device` (drawn on the CPU, the same everywhere): ``mlp`` 128 x 784 with 10 classes;
    ``tokens`` [16, 64, 256] with a class per token (targets [16, 64])."""
    g = torch.Generator().manual_seed(0)
    if kind == "mlp":
        x, y = torch.randn(128, 784, generator=g), torch.randint(0, 10, (128,), generator=g)
    else:
        x = torch.randn(TOKEN_BATCH, SEQ, 256, generator=g)
        y = torch.randint(0, TOKEN_CLASSES, (TOKEN_BATCH, SEQ), generator=g)
    return x.to(device), y.to(device)


def fxkfac_config(method: str, capture: Capture) -> KFACConfig:
    """The K-FAC settings both sides share (see the module docstring), refreshed every step, with `capture`."""
    return KFACConfig(
        damping=DAMPING,
        factor_decay=FACTOR_DECAY,
        kl_clip=KL_CLIP,
        inverse=FXKFAC_METHOD[method],
        refresh_every=1,
        capture=capture,
    )


def fxkfac_step(
    kind: str, method: str, backend: str | None, capture: Capture = Capture.FUSED, device: str = "cpu"
) -> Callable[[], None]:
    """fxkfac.compile on one device (mesh=None, the model on `device`), K-FAC refreshed every step, SGD with
    momentum."""
    x, y = make_batch(kind, device)
    cfg = fxkfac_config(method, capture)
    trainer = fxkfac.compile(
        make_model(kind, device),
        None,
        example_inputs=(x,),
        loss_fn=F.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM),
        preconditioner=cfg,
        backend=backend,
    )
    return lambda: trainer.step((x,), y)


def kfac_pytorch_available() -> bool:
    """Whether ``import kfac`` gives gpauloski's kfac-pytorch (its warnings about Apex are silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import kfac  # noqa: F401
            from kfac.preconditioner import KFACPreconditioner  # noqa: F401
        except Exception:
            return False
    return True


def kfac_pytorch_step(kind: str, method: str, strategy: str | None = None, device: str = "cpu") -> Callable[[], None]:
    """kfac-pytorch's KFACPreconditioner on the same model and batch (on `device`), everything every step, same
    SGD; with a `strategy` (a process group is up) under DistributedDataParallel with the ``grad_worker_fraction``
    of that name, each rank training on its contiguous shard of the same global batch (as fxkfac shards it)."""
    import logging

    from kfac.enums import ComputeMethod, DistributedStrategy
    from kfac.preconditioner import KFACPreconditioner

    x, y = make_batch(kind, device)
    model = make_model(kind, device)
    extra: dict[str, Any] = {}
    if strategy is not None:
        world, rank = dist.get_world_size(), dist.get_rank()
        shard = len(x) // world
        x, y = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
        model = nn.parallel.DistributedDataParallel(model)
        named = {"comm-opt": DistributedStrategy.COMM_OPT, "mem-opt": DistributedStrategy.MEM_OPT}
        extra["grad_worker_fraction"] = named.get(strategy) or float(strategy.split(":")[1])
    compute = ComputeMethod.INVERSE if method == "inverse" else ComputeMethod.EIGEN
    # kfac-pytorch damps each factor by `damping` with INVERSE; fxkfac by sqrt(damping) (see the module docstring).
    damping = math.sqrt(DAMPING) if method == "inverse" else DAMPING
    precond = KFACPreconditioner(
        model,
        factor_update_steps=1,
        inv_update_steps=1,
        damping=damping,
        factor_decay=FACTOR_DECAY,
        kl_clip=KL_CLIP,
        lr=LR,
        compute_method=compute,
        loglevel=logging.DEBUG,
        **extra,
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        precond.step()
        opt.step()

    return step


def fxkfac_dp_step(kind: str, method: str, strategy: str, capture: Capture = Capture.FUSED) -> Callable[[], None]:
    """fxkfac.compile on a ``(1, W)`` mesh (pure data parallelism, no plan: K-FAC on the critical path, refreshed
    every step) with ``strategy`` forced on every layer; each rank trains on its shard of the global batch."""
    x, y = make_batch(kind)
    cfg = fxkfac_config(method, capture)
    trainer = fxkfac.compile(
        make_model(kind),
        (1, dist.get_world_size()),
        None,
        example_inputs=(x,),
        loss_fn=F.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM),
        preconditioner=cfg,
        backend=None,
        plan_options=PlanOptions(strategy=strategy),
    )
    return lambda: trainer.step((x,), y)


def time_steps(step: Callable[[], None], n: int, sync: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds of each of n calls, each between two ``sync`` calls (a barrier across ranks): the one before is not
    timed, the one after is, so a step lasts until its slowest rank is done, whichever rank that is."""
    out = []
    for _ in range(n):
        sync()
        start = time.perf_counter()
        step()
        sync()
        out.append(time.perf_counter() - start)
    return out


Config = tuple[str, str, str]
"""(model, method, strategy): "one device" or the strategy's name."""


def measure(
    sides: dict[Config, dict[str, Callable[[], None]]],
    args: argparse.Namespace,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Warm up every side, then per round and config one step of each side in turn (order flipped every pair)."""
    load_before = os.getloadavg()
    for pair in sides.values():
        for step in pair.values():
            time_steps(step, args.warmup, sync)
    times: dict[Config, dict[str, list[float]]] = {c: {side: [] for side in pair} for c, pair in sides.items()}
    ratios: dict[Config, list[float]] = {c: [] for c in sides}
    for _ in range(args.rounds):
        for config, pair in sides.items():
            order = list(pair)
            for i in range(args.steps):
                for side in order if i % 2 == 0 else order[::-1]:
                    times[config][side] += time_steps(pair[side], 1, sync)
                if len(order) == 2:
                    ratios[config].append(times[config]["fxkfac"][-1] / times[config]["kfac-pytorch"][-1])
    rows = []
    for (kind, method, strategy), t in times.items():
        ours = statistics.median(t["fxkfac"])
        ref = statistics.median(t["kfac-pytorch"]) if "kfac-pytorch" in t else None
        paired = ratios[(kind, method, strategy)]
        q = statistics.quantiles(paired, n=4) if len(paired) > 1 else None
        rows.append(
            {
                "model": kind,
                "method": method,
                "strategy": strategy,
                "fxkfac_ms": round(1e3 * ours, 2),
                "kfac_pytorch_ms": None if ref is None else round(1e3 * ref, 2),
                "ratio": None if ref is None else round(ours / ref, 3),
                "paired_ratio": None if q is None else [round(v, 3) for v in q],
            }
        )
    return {"rows": rows, "loadavg": [list(load_before), list(os.getloadavg())]}


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    """The rich table and the JSON line."""
    load = result["loadavg"]
    where = "one device" if args.world == 1 else f"{args.world} ranks (gloo, pure data parallelism)"
    table = Table(
        title=f"K-FAC step, {where}, refresh every step, {args.threads} thread(s) per process, fxkfac "
        f"capture {args.capture}, median of {args.rounds}x{args.steps} after {args.warmup} warm-up; "
        f"load {load[0][0]:.2f} -> {load[1][0]:.2f}"
    )
    for col in (
        "model",
        "method",
        "strategy",
        "fxkfac ms",
        "kfac-pytorch ms",
        "fxkfac / kfac-pytorch",
        "paired ratio (IQR)",
    ):
        table.add_column(col, justify="left" if col in ("model", "method", "strategy") else "right")
    for row in result["rows"]:
        q = row["paired_ratio"]
        table.add_row(
            row["model"],
            f"{row['method']} (fxkfac {FXKFAC_METHOD[row['method']]})",
            row["strategy"],
            f"{row['fxkfac_ms']:.1f}",
            "-" if row["ratio"] is None else f"{row['kfac_pytorch_ms']:.1f}",
            "-" if row["ratio"] is None else f"{row['ratio']:.2f}",
            "-" if q is None else f"{q[1]:.2f} ({q[0]:.2f}-{q[2]:.2f})",
        )
    Console(width=140).print(table)
    print(
        json.dumps(
            {
                "benchmark": "kfac_pytorch_compare",
                "kfac_pytorch": result["kfac_pytorch"],
                "world": args.world,
                "threads": args.threads,
                "backend": args.backend,
                "capture": args.capture,
                "steps": args.steps,
                "rounds": args.rounds,
                "warmup": args.warmup,
                "tokens": {"batch": TOKEN_BATCH, "seq": SEQ, "blocks": TOKEN_BLOCKS},
                **result,
            }
        )
    )


def _quiet() -> None:
    """kfac-pytorch's full backward hooks warn, every step, that the model's input needs no gradient."""
    warnings.filterwarnings("ignore", message="Full backward hook is firing")


def _dp_worker(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    """One rank of the data-parallel comparison; rank 0 writes the result."""
    torch.set_num_threads(args.threads)
    _quiet()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world, timeout=timedelta(seconds=600)
    )
    have_ref = kfac_pytorch_available()
    sides: dict[Config, dict[str, Callable[[], None]]] = {}
    for kind in args.models:
        for method in args.methods:
            for strategy in args.strategies:
                sides[(kind, method, strategy)] = {"fxkfac": fxkfac_dp_step(kind, method, strategy, args.capture)}
                if have_ref:
                    sides[(kind, method, strategy)]["kfac-pytorch"] = kfac_pytorch_step(kind, method, strategy)
    result = measure(sides, args, sync=dist.barrier)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({**result, "kfac_pytorch": have_ref}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "tokens"], choices=["mlp", "tokens"])
    parser.add_argument("--methods", nargs="+", default=["inverse", "eigen"], choices=["inverse", "eigen"])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per method per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per method first (see above)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process (both sides)")
    parser.add_argument(
        "--backend",
        default=None,
        help="torch.compile backend for fxkfac on one device (default: eager, like kfac-pytorch)",
    )
    enum_option(
        parser,
        "--capture",
        Capture.FUSED,
        "fxkfac's factor capture (KFACConfig.capture): fused (default) makes each factor in the "
        "forward/backward pass, deferred keeps the rows and makes it in STATS (kfac.factors.gram)",
    )
    parser.add_argument(
        "--world",
        type=int,
        default=1,
        choices=[1, 2],
        help="2: two gloo ranks, pure data parallelism, each --strategies",
    )
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _quiet()
    have_ref = kfac_pytorch_available()
    if not have_ref:
        print(INSTALL)
    if args.world > 1:
        from pipefisher_overhead import spawn_and_report  # launches 2 local ranks, reports rank 0's row

        spawn_and_report(_dp_worker, report, args)
        return
    sides: dict[Config, dict[str, Callable[[], None]]] = {}
    for kind in args.models:
        for method in args.methods:
            sides[(kind, method, "one device")] = {"fxkfac": fxkfac_step(kind, method, args.backend, args.capture)}
            if have_ref:
                sides[(kind, method, "one device")]["kfac-pytorch"] = kfac_pytorch_step(kind, method)
    report({**measure(sides, args), "kfac_pytorch": have_ref}, args)


if __name__ == "__main__":
    main()
