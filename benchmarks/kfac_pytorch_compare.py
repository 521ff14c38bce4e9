"""K-FAC step time on one device, fxkfac against kfac-pytorch (gpauloski/kfac-pytorch), as ratios, in one run.

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

The warm-up is 10 steps by default because an eigendecomposition's time depends on the spectrum: fxkfac's
running average starts from the first batch's factor (rank <= 129 for the MLP's A at batch 128, full rank only
after 8 steps), kfac-pytorch's from the identity, and a rank-deficient factor decomposes faster.

kfac-pytorch is not on PyPI; when ``import kfac`` fails only fxkfac's side runs and the install is printed.
Install it next to the project, without touching the project's environment (torch stays as it is)::

    git clone https://github.com/gpauloski/kfac-pytorch /tmp/kfac-pytorch
    pip install --no-deps --target /tmp/kfac-site /tmp/kfac-pytorch
    PYTHONPATH=/tmp/kfac-site python benchmarks/kfac_pytorch_compare.py

    python benchmarks/kfac_pytorch_compare.py [--models mlp tokens] [--methods inverse eigen] [--steps 5]
        [--rounds 3] [--warmup 10] [--threads 1] [--backend BACKEND]
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
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

import fxkfac
from fxkfac import KFACConfig

DAMPING, FACTOR_DECAY, KL_CLIP, LR, MOMENTUM = 1e-3, 0.95, 1e-3, 0.05, 0.9
FXKFAC_METHOD = {"inverse": "cholesky", "eigen": "eigen"}
INSTALL = """kfac-pytorch is not importable; only fxkfac's side runs. To compare, install it from a local checkout
of https://github.com/gpauloski/kfac-pytorch without touching this environment (torch stays as it is):
    git clone https://github.com/gpauloski/kfac-pytorch /tmp/kfac-pytorch
    pip install --no-deps --target /tmp/kfac-site /tmp/kfac-pytorch
    PYTHONPATH=/tmp/kfac-site python benchmarks/kfac_pytorch_compare.py
(`import kfac` needs the package's metadata, so PYTHONPATH=/tmp/kfac-pytorch on the bare checkout is not enough.)"""
SEQ, TOKEN_BATCH, TOKEN_BLOCKS, TOKEN_CLASSES = 64, 16, 2, 10


class TokenBlock(nn.Module):
    """x + fc2(gelu(fc1(x))), Linear 256->1024->256."""

    def __init__(self, width: int = 256, hidden: int = 1024) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class TokenModel(nn.Module):
    """TOKEN_BLOCKS TokenBlocks and a per-token Linear head; logits come out as ``[tokens, classes]``."""

    def __init__(self, blocks: int = TOKEN_BLOCKS, width: int = 256) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(TokenBlock(width) for _ in range(blocks)))
        self.head = nn.Linear(width, TOKEN_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).reshape(-1, TOKEN_CLASSES)


def make_model(kind: str) -> nn.Module:
    """``mlp`` (784-1024-1024-10, tanh) or ``tokens`` (TokenModel), seed 0."""
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(784, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 10))
    return TokenModel()


def make_batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch: ``mlp`` 128 x 784 with 10 classes; ``tokens`` [16, 64, 256] with a class per token."""
    g = torch.Generator().manual_seed(0)
    if kind == "mlp":
        return torch.randn(128, 784, generator=g), torch.randint(0, 10, (128,), generator=g)
    return (torch.randn(TOKEN_BATCH, SEQ, 256, generator=g),
            torch.randint(0, TOKEN_CLASSES, (TOKEN_BATCH * SEQ,), generator=g))


def fxkfac_step(kind: str, method: str, backend: str | None) -> Callable[[], None]:
    """fxkfac.compile on one device (mesh=None), K-FAC refreshed every step, SGD with momentum."""
    x, y = make_batch(kind)
    cfg = KFACConfig(damping=DAMPING, factor_decay=FACTOR_DECAY, kl_clip=KL_CLIP, inverse=FXKFAC_METHOD[method],
                     refresh_every=1)
    trainer = fxkfac.compile(make_model(kind), None, example_inputs=(x,), loss_fn=F.cross_entropy,
                             optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM), kfac=cfg,
                             backend=backend)
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


def kfac_pytorch_step(kind: str, method: str) -> Callable[[], None]:
    """kfac-pytorch's KFACPreconditioner on the same model and batch, everything every step, same SGD."""
    import logging

    from kfac.enums import ComputeMethod
    from kfac.preconditioner import KFACPreconditioner

    x, y = make_batch(kind)
    model = make_model(kind)
    compute = ComputeMethod.INVERSE if method == "inverse" else ComputeMethod.EIGEN
    # kfac-pytorch damps each factor by `damping` with INVERSE; fxkfac by sqrt(damping) (see the module docstring).
    damping = math.sqrt(DAMPING) if method == "inverse" else DAMPING
    precond = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, damping=damping,
                                 factor_decay=FACTOR_DECAY, kl_clip=KL_CLIP, lr=LR, compute_method=compute,
                                 loglevel=logging.DEBUG)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        precond.step()
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
    parser.add_argument("--models", nargs="+", default=["mlp", "tokens"], choices=["mlp", "tokens"])
    parser.add_argument("--methods", nargs="+", default=["inverse", "eigen"], choices=["inverse", "eigen"])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per method per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per method first (see above)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides)")
    parser.add_argument("--backend", default=None, help="torch.compile backend for fxkfac (default: eager, like "
                                                         "kfac-pytorch)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # kfac-pytorch's full backward hooks warn, every step, that the model's input needs no gradient
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    have_ref = kfac_pytorch_available()
    if not have_ref:
        print(INSTALL)
    steps: dict[tuple[str, str, str], Callable[[], None]] = {}
    for kind in args.models:
        for method in args.methods:
            steps[(kind, method, "fxkfac")] = fxkfac_step(kind, method, args.backend)
            if have_ref:
                steps[(kind, method, "kfac-pytorch")] = kfac_pytorch_step(kind, method)
    load_before = os.getloadavg()
    for step in steps.values():
        time_steps(step, args.warmup)
    times: dict[tuple[str, str, str], list[float]] = {key: [] for key in steps}
    pair_ratios: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for kind in args.models:
            for method in args.methods:
                sides = [key for key in steps if key[:2] == (kind, method)]
                for i in range(args.steps):  # one step of each side in turn, order alternated (ABBA): paired
                    for key in sides if i % 2 == 0 else sides[::-1]:
                        times[key] += time_steps(steps[key], 1)
                    if have_ref:
                        pair = [times[key][-1] for key in sides]
                        pair_ratios.setdefault((kind, method), []).append(pair[0] / pair[1])
    load_after = os.getloadavg()
    median = {key: statistics.median(t) for key, t in times.items()}
    table = Table(title=f"K-FAC step on one device, refresh every step, {args.threads} thread(s), median of "
                        f"{args.rounds}x{args.steps} after {args.warmup} warm-up; load "
                        f"{load_before[0]:.2f} -> {load_after[0]:.2f}")
    for col in ("model", "method", "fxkfac ms", "kfac-pytorch ms", "fxkfac / kfac-pytorch",
                "paired ratio (IQR)"):
        table.add_column(col, justify="left" if col in ("model", "method") else "right")
    rows: list[dict[str, Any]] = []
    for kind in args.models:
        for method in args.methods:
            ours = median[(kind, method, "fxkfac")]
            ref = median.get((kind, method, "kfac-pytorch"))
            ratio = None if ref is None else ours / ref
            paired = pair_ratios.get((kind, method))
            q = statistics.quantiles(paired, n=4) if paired and len(paired) > 1 else None
            rows.append({"model": kind, "method": method, "fxkfac_ms": round(1e3 * ours, 2),
                         "kfac_pytorch_ms": None if ref is None else round(1e3 * ref, 2),
                         "ratio": None if ratio is None else round(ratio, 3),
                         "paired_ratio": None if q is None else [round(v, 3) for v in q]})
            table.add_row(kind, f"{method} (fxkfac {FXKFAC_METHOD[method]})", f"{1e3 * ours:.1f}",
                          "-" if ref is None else f"{1e3 * ref:.1f}", "-" if ratio is None else f"{ratio:.2f}",
                          "-" if q is None else f"{q[1]:.2f} ({q[0]:.2f}-{q[2]:.2f})")
    Console(width=120).print(table)
    print(json.dumps({"benchmark": "kfac_pytorch_compare", "kfac_pytorch": have_ref, "threads": args.threads,
                      "backend": args.backend, "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
                      "tokens": {"batch": TOKEN_BATCH, "seq": SEQ, "blocks": TOKEN_BLOCKS}, "rows": rows,
                      "loadavg": [list(load_before), list(load_after)]}))


if __name__ == "__main__":
    main()
