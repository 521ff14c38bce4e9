"""K-FAC vs AdamW on scikit-learn's bundled digits: steps each needs to reach AdamW's best final training loss.

Two models (an MLP and a small CNN), each trained for STEPS mini-batch steps from the same initialization and
batch order: AdamW with a small lr sweep, and fxkfac K-FAC (single device, ``fxkfac.compile(model, None, ...)``)
over SGD with momentum with a small lr sweep. The full training-set loss is measured every EVAL_EVERY steps.
The target is the lowest final loss of the AdamW sweep; the table gives, per run, the first measured step at
which the loss is at or below it. Prints a rich table and one JSON line.

    python benchmarks/kfac_convergence.py [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from sklearn.datasets import load_digits
from torch import nn

import fxkfac
from fxkfac import KFACConfig

STEPS = 300
BATCH = 128
EVAL_EVERY = 5
TRAIN_SIZE = 1400  # of 1797 digits, after a fixed shuffle; the rest is never used here
ADAMW_LRS = (1e-2, 3e-2, 1e-1)  # 3e-2 is best for both models at 300 steps; the neighbours show it
KFAC_LRS = (0.1, 0.3)  # SGD lr under K-FAC; the KL-clip bounds the step, so the choice matters little
KFAC = KFACConfig(damping=1e-2, factor_decay=0.95, kl_clip=1e-3)
MODELS = ("mlp", "cnn")


@dataclass(frozen=True)
class Run:
    """One training run: its curve of (step, full training loss) and wall time."""

    model: str
    method: str
    lr: float
    curve: list[tuple[int, float]]
    seconds: float

    @property
    def final(self) -> float:
        return self.curve[-1][1]

    def steps_to(self, target: float) -> int | None:
        """First measured step with loss <= target (None: never within the run)."""
        return next((step for step, loss in self.curve if loss <= target), None)


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The first TRAIN_SIZE digits after a fixed shuffle: pixels scaled to [0, 1] as [n, 64], labels."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:TRAIN_SIZE]
    return x[order], y[order]


def make_model(kind: str) -> nn.Module:
    """The MLP (64-64-64-10, tanh) or the CNN (two 3x3 convs, one strided, and a linear head), seed 0."""
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def shape_inputs(kind: str, x: torch.Tensor) -> torch.Tensor:
    """Flat pixels for the MLP, 1x8x8 images for the CNN."""
    return x if kind == "mlp" else x.view(-1, 1, 8, 8)


def batch_order(steps: int, n: int) -> list[torch.Tensor]:
    """Indices of each step's mini-batch: epochs of a fixed-seed permutation, the ragged tail dropped."""
    g = torch.Generator().manual_seed(1)
    out: list[torch.Tensor] = []
    while len(out) < steps:
        perm = torch.randperm(n, generator=g)
        out += [perm[i : i + BATCH] for i in range(0, n - BATCH + 1, BATCH)]
    return out[:steps]


def train(kind: str, method: str, lr: float, steps: int, data: tuple[torch.Tensor, torch.Tensor]) -> Run:
    """Train one model with fxkfac.compile (preconditioner=None for AdamW) and measure the full training loss."""
    x_all, y_all = data
    inputs = shape_inputs(kind, x_all)
    model = make_model(kind)
    if method == "adamw":
        factory: Callable = lambda params: torch.optim.AdamW(params, lr=lr)  # noqa: E731
        kfac = None
    else:
        factory = lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
        kfac = KFAC
    trainer = fxkfac.compile(
        model,
        None,
        example_inputs=(inputs[:BATCH],),
        loss_fn=F.cross_entropy,
        optimizer=factory,
        preconditioner=kfac,
        backend=None,
    )
    curve = []
    start = time.perf_counter()
    for step, idx in enumerate(batch_order(steps, len(inputs)), start=1):
        trainer.step((inputs[idx],), y_all[idx])
        if step % EVAL_EVERY == 0:
            with torch.no_grad():
                curve.append((step, float(F.cross_entropy(model(inputs), y_all))))
    return Run(kind, method, lr, curve, time.perf_counter() - start)


def summarize(runs: list[Run]) -> dict:
    """Per model: the AdamW target, the best steps-to-target of each method, and their ratio."""
    out = {}
    for kind in MODELS:
        mine = [r for r in runs if r.model == kind]
        target = min(r.final for r in mine if r.method == "adamw")
        best = {}
        for method in ("adamw", "kfac"):
            reached = [s for r in mine if r.method == method and (s := r.steps_to(target)) is not None]
            best[method] = min(reached) if reached else None
        ratio = best["kfac"] / best["adamw"] if best["kfac"] and best["adamw"] else None
        out[kind] = {
            "target_loss": target,
            "adamw_steps": best["adamw"],
            "kfac_steps": best["kfac"],
            "kfac_over_adamw": ratio,
        }
    return out


def report(runs: list[Run], summary: dict, console: Console) -> None:
    """One row per run, then one per model with the step ratio."""
    table = Table(title=f"digits: steps to AdamW's best final training loss ({runs[0].curve[-1][0]} steps)")
    for col in ("model", "method", "lr", "final loss", "steps to target", "seconds"):
        table.add_column(col, justify="right" if col not in ("model", "method") else "left")
    for r in runs:
        reached = r.steps_to(summary[r.model]["target_loss"])
        table.add_row(
            r.model,
            r.method,
            f"{r.lr:g}",
            f"{r.final:.3g}",
            "-" if reached is None else str(reached),
            f"{r.seconds:.1f}",
        )
    console.print(table)
    for kind, s in summary.items():
        ratio = "n/a" if s["kfac_over_adamw"] is None else f"{s['kfac_over_adamw']:.2f}"
        console.print(
            f"{kind}: target {s['target_loss']:.3g}; AdamW {s['adamw_steps']} steps, "
            f"K-FAC {s['kfac_steps']} steps, ratio {ratio} (goal <= 0.5)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = digits()
    runs = []
    for kind in MODELS:
        runs += [train(kind, "adamw", lr, args.steps, data) for lr in ADAMW_LRS]
        runs += [train(kind, "kfac", lr, args.steps, data) for lr in KFAC_LRS]
    summary = summarize(runs)
    report(runs, summary, Console())
    print(
        json.dumps(
            {
                "benchmark": "kfac_convergence",
                "steps": args.steps,
                "batch": BATCH,
                "kfac": {"damping": KFAC.damping, "factor_decay": KFAC.factor_decay, "kl_clip": KFAC.kl_clip},
                "adamw_lrs": ADAMW_LRS,
                "kfac_sgd_lrs": KFAC_LRS,
                "models": summary,
            }
        )
    )


if __name__ == "__main__":
    main()
