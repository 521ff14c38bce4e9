"""Split inversions (issue 14) against the exact inverse, on the factors of a real K-FAC run, and their convergence.

Accuracy: TinyBert MLM (`--hidden`, FFN 4x) trains `--warm` steps with exact K-FAC on one device
(`fxkfac.compile(model, None, ...)`, refresh every `--refresh` steps) up to a refresh step. Each layer's factors of
that refresh are inverted exactly (float64 Cholesky of ``F + gamma I``) and split, in float32 as training does:
Newton-Schulz from the layer's previous inverse (what `SplitMethod.NEWTON_SCHULZ` starts from) after k iterations,
float32 Cholesky where its residual bound misses the tolerance (the fallback), and block-diagonal with p blocks.
Reported per k and p over all factors: the median residual bound, the share accepted, the relative error of the
inverse and of the preconditioned gradient ``B^-1 G A^-1`` (both factors split; G of a fresh batch). Float32
Cholesky (the exact path's own rounding) is the first row.
Time of one piece on the largest factor, against one Cholesky inverse of it.

Convergence: `--steps` steps from the same seed on the same batches, exact against each split configuration;
training loss (mean of the last 10 steps) and validation loss; how many of the factor inversions fell back from
Newton-Schulz to Cholesky (the first refresh always does: it has no previous inverse).

    python benchmarks/split_inverse.py [--hidden 128] [--warm 40] [--steps 150] [--refresh 4]

Prints rich tables and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor

import fxkfac
from fxkfac.config import KFACConfig, SplitInverse, SplitMethod
from fxkfac.data import MaskedLMData, stdlib_corpus
from fxkfac.kfac import grad_matrix
from fxkfac.kfac.inverse import factor_dampings
from fxkfac.kfac.split_inverse import Progress, block_bounds, damped, previous_half, schulz_piece, schulz_start
from fxkfac.models import TinyBertConfig, TinyBertMLM, mlm_loss
from fxkfac.planner.problem import InverseMethod
from fxkfac.runtime.trainer import Trainer

SEQ_LEN = 64
BATCH = 32
LR = 4e-3
ITERATIONS = (1, 2, 3, 4)
BLOCKS = (2, 4, 8)
TOLERANCE = 1e-3
SPLITS = {
    "newton-schulz 2x1": SplitInverse(method=SplitMethod.NEWTON_SCHULZ, pieces=2, iterations=1, tolerance=TOLERANCE),
    "newton-schulz 3x1": SplitInverse(method=SplitMethod.NEWTON_SCHULZ, pieces=3, iterations=1, tolerance=TOLERANCE),
    "blocks 2": SplitInverse(method=SplitMethod.BLOCKS, pieces=2),
    "blocks 4": SplitInverse(method=SplitMethod.BLOCKS, pieces=4),
}


@dataclass(frozen=True)
class Factor:
    """One factor of the last refresh: the damped factor, its exact inverse (float64), the previous inverse."""

    layer: str
    part: str
    m: Tensor
    gamma: float
    exact: Tensor
    previous: Tensor | None


def kfac_config(args: argparse.Namespace, split: SplitInverse | None) -> KFACConfig:
    """The run's K-FAC settings (mlm_sweep's defaults), with or without a split inverse."""
    return KFACConfig(
        damping=args.damping, factor_decay=0.95, kl_clip=1e-2, refresh_every=args.refresh, split_inverse=split
    )


def make_trainer(args: argparse.Namespace, split: SplitInverse | None) -> tuple[Trainer, TinyBertMLM, MaskedLMData]:
    """Seed 0 model, AdamW under K-FAC, and its batch stream (seed 0: every run draws the same batches)."""
    train_bytes, _ = stdlib_corpus(2_000_000)
    data = MaskedLMData(train_bytes, seq_len=SEQ_LEN, seed=0)
    torch.manual_seed(0)
    model = TinyBertMLM(TinyBertConfig(hidden=args.hidden, ffn=4 * args.hidden, max_len=SEQ_LEN))
    inputs, _ = data.batch(BATCH)
    trainer = fxkfac.compile(
        model,
        None,
        None,
        example_inputs=(inputs,),
        loss_fn=mlm_loss,
        preconditioner=kfac_config(args, split),
        backend=None,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01),
    )
    return trainer, model, data


def collect(args: argparse.Namespace) -> tuple[list[Factor], dict[str, Tensor]]:
    """Factors of the refresh at step `--warm` (a multiple of `--refresh`), and each layer's gradient matrix."""
    trainer, model, data = make_trainer(args, None)
    for _ in range(args.warm):
        trainer.step(*_batch(data))
    previous = {name: s.latest for name, s in trainer.layer_states.items()}
    trainer.step(*_batch(data))
    params = dict(model.named_parameters())
    model.zero_grad()
    inputs, targets = data.batch(BATCH)
    mlm_loss(model(inputs), targets).backward()
    factors, grads = [], {}
    assert trainer.preconditioning is not None, "K-FAC runs have a preconditioner"
    for name, state in trainer.layer_states.items():
        layer = trainer.preconditioning.layers[name]
        bias = params[layer.bias].grad if layer.bias is not None else None
        grads[name] = grad_matrix(layer, params[layer.weight].grad, bias).double()
        gammas = factor_dampings(
            state.A, state.B, damping=args.damping, method=InverseMethod.CHOLESKY, pi_damping=False
        )
        for part, f, gamma in (("A", state.A, gammas[0]), ("B", state.B, gammas[1])):
            m = damped(f, gamma)
            factors.append(
                Factor(
                    name,
                    part,
                    m,
                    gamma,
                    torch.cholesky_inverse(torch.linalg.cholesky(m.double())),
                    previous_half(previous[name], part),
                )
            )
    return factors, grads


def _batch(data: MaskedLMData) -> tuple[tuple[Tensor], Tensor]:
    inputs, targets = data.batch(BATCH)
    return (inputs,), targets


def schulz_iterates(fac: Factor) -> list[Progress | None]:
    """The Newton-Schulz iterate after each of max(ITERATIONS) iterations (tolerance 0: none skipped)."""
    out: list[Progress | None] = []
    progress = schulz_start(fac.previous, fac.m.shape[0])
    for _ in range(max(ITERATIONS)):
        progress = None if progress is None else schulz_piece(fac.m, progress, 1, 0.0)
        out.append(progress)
    return out


def cholesky(m: Tensor) -> Tensor:
    """``m^-1`` by Cholesky in m's dtype (what the exact path and the fallback compute)."""
    return torch.cholesky_inverse(torch.linalg.cholesky(m))


def block_inverse(fac: Factor, pieces: int) -> Tensor:
    """Block-diagonal damped inverse with `pieces` blocks (float32, as training computes it)."""
    return torch.block_diag(*[cholesky(fac.m[lo:hi, lo:hi]) for lo, hi in block_bounds(fac.m.shape[0], pieces)])


def rel(x: Tensor, ref: Tensor) -> float:
    """||x - ref||_F / ||ref||_F in float64."""
    return float((x.double() - ref).norm() / ref.norm())


def candidates(factors: list[Factor]) -> tuple[dict[str, dict[tuple[str, str], Tensor]], dict[str, list[float]]]:
    """Per method the inverse of each (layer, part) as training would use it, and Newton-Schulz's residual bounds.

    Newton-Schulz after k iterations is used where its bound is within TOLERANCE, else the float32 Cholesky
    inverse (the fallback); ``cholesky`` is float32 Cholesky throughout, the exact path's own rounding.
    """
    invs: dict[str, dict[tuple[str, str], Tensor]] = {"cholesky": {}}
    bounds: dict[str, list[float]] = {}
    for fac in factors:
        key, fallback = (fac.layer, fac.part), cholesky(fac.m)
        invs["cholesky"][key] = fallback
        for k, prog in zip(ITERATIONS, schulz_iterates(fac), strict=True):
            bound = float("inf") if prog is None else prog.bound
            bounds.setdefault(f"newton-schulz {k}", []).append(bound)
            used = prog.x if prog is not None and bound <= TOLERANCE else fallback
            invs.setdefault(f"newton-schulz {k}", {})[key] = used
        for p in BLOCKS:
            invs.setdefault(f"blocks {p}", {})[key] = block_inverse(fac, p)
    return invs, bounds


def accuracy(factors: list[Factor], grads: dict[str, Tensor]) -> dict[str, dict[str, float]]:
    """Per method: median/max relative error of the inverse and of ``P = B^-1 G A^-1`` against float64 Cholesky."""
    invs, bounds = candidates(factors)
    exact = {(f.layer, f.part): f.exact for f in factors}
    out = {}
    for method, inv in invs.items():
        inv_err = [rel(x, exact[key]) for key, x in inv.items()]
        p_err = [
            rel(inv[(name, "B")].double() @ g @ inv[(name, "A")].double(), exact[(name, "B")] @ g @ exact[(name, "A")])
            for name, g in grads.items()
        ]
        out[method] = {
            "inverse_median": statistics.median(inv_err),
            "inverse_max": max(inv_err),
            "precond_median": statistics.median(p_err),
            "precond_max": max(p_err),
        }
        if method in bounds:
            out[method]["bound_median"] = statistics.median(bounds[method])
            out[method]["accepted"] = sum(b <= TOLERANCE for b in bounds[method]) / len(bounds[method])
    return out


def _median_time(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def piece_times(factors: list[Factor]) -> dict[str, float]:
    """Seconds of one piece on the largest factor (float32): Cholesky inverse, one Newton-Schulz iteration, a block."""
    fac = max(factors, key=lambda f: f.m.shape[0])
    start = Progress(fac.exact.float())
    out = {
        "side": float(fac.m.shape[0]),
        "cholesky": _median_time(lambda: cholesky(fac.m)),
        "ns_iteration": _median_time(lambda: schulz_piece(fac.m, start, 1, 0.0)),
    }
    for p in BLOCKS:
        lo, hi = block_bounds(fac.m.shape[0], p)[0]
        out[f"block_of_{p}"] = _median_time(lambda lo=lo, hi=hi: cholesky(fac.m[lo:hi, lo:hi]))
    return out


class _Count(logging.Handler):
    """Counts the Newton-Schulz fallbacks that fxkfac.kfac.split_inverse logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.n += 1


def convergence(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Training and validation loss after `--steps` steps: exact and each of SPLITS, same seed and batches."""
    _, val_bytes = stdlib_corpus(2_000_000)
    val_data = MaskedLMData(val_bytes, seq_len=SEQ_LEN, seed=10_000)
    val = [val_data.batch(32) for _ in range(4)]
    log = logging.getLogger("fxkfac.kfac.split_inverse")
    log.setLevel(logging.INFO)
    out = {}
    for label, split in {"exact": None, **SPLITS}.items():
        counter = _Count()
        log.addHandler(counter)
        trainer, model, data = make_trainer(args, split)
        losses = [trainer.step(*_batch(data)) for _ in range(args.steps)]
        log.removeHandler(counter)
        model.eval()
        with torch.no_grad():
            val_loss = sum(float(mlm_loss(model(x), y)) for x, y in val) / len(val)
        inversions = 2 * sum(state.refreshes for state in trainer.layer_states.values())
        out[label] = {
            "train_loss": statistics.fmean(losses[-10:]),
            "val_loss": val_loss,
            "fallbacks": float(counter.n),
            "inversions": float(inversions),
        }
    return out


def render(
    acc: dict[str, dict[str, float]], times: dict[str, float], conv: dict[str, dict[str, float]], console: Console
) -> None:
    """The three tables."""
    t = Table(
        title=f"inverses as used vs float64 Cholesky (relative Frobenius error; Newton-Schulz k iterations, "
        f"Cholesky where its bound > {TOLERANCE:g})"
    )
    for col in (
        "method",
        "NS bound (median)",
        "NS accepted",
        "inverse median",
        "inverse max",
        "B^-1 G A^-1 median",
        "B^-1 G A^-1 max",
    ):
        t.add_column(col)
    for method, r in acc.items():
        t.add_row(
            method,
            f"{r['bound_median']:.2e}" if "bound_median" in r else "-",
            f"{r['accepted']:.0%}" if "accepted" in r else "-",
            *(f"{r[k]:.2e}" for k in ("inverse_median", "inverse_max", "precond_median", "precond_max")),
        )
    console.print(t)
    t = Table(title=f"one piece on the largest factor (side {int(times['side'])}), CPU float32")
    t.add_column("task")
    t.add_column("ms")
    for key, value in times.items():
        if key != "side":
            t.add_row(key, f"{value * 1e3:.2f}")
    console.print(t)
    t = Table(title="convergence, same seed and batches")
    for col in ("run", "train loss (last 10)", "val loss", "Newton-Schulz fallbacks / inversions"):
        t.add_column(col)
    for label, r in conv.items():
        t.add_row(
            label, f"{r['train_loss']:.4f}", f"{r['val_loss']:.4f}", f"{int(r['fallbacks'])} / {int(r['inversions'])}"
        )
    console.print(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--warm", type=int, default=40, help="steps before the measured refresh")
    parser.add_argument("--steps", type=int, default=150, help="steps of each convergence run")
    parser.add_argument("--refresh", type=int, default=4)
    parser.add_argument("--damping", type=float, default=1e-2)
    args = parser.parse_args()
    if args.warm % args.refresh:
        parser.error("--warm must be a multiple of --refresh (the next step refreshes)")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    factors, grads = collect(args)
    acc, times = accuracy(factors, grads), piece_times(factors)
    conv = convergence(args)
    render(acc, times, conv, Console())
    print(
        json.dumps(
            {
                "benchmark": "split_inverse",
                "args": vars(args),
                "accuracy": acc,
                "piece_seconds": times,
                "convergence": conv,
            }
        )
    )


if __name__ == "__main__":
    main()
