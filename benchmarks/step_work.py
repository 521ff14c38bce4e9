"""The per-step work of Shampoo, SOAP and Muon timed in isolation, against AdamW's step on the same parameters.

What `benchmarks/shampoo_overhead.py` and `benchmarks/muon_overhead.py` measure inside a pipeline, without the pipeline:
one thread, the TinyBertMLM of those benchmarks (hidden 128, FFN 512, 4 layers), a random gradient per parameter. Per
family, the work a stage runs every step after its gradient is final, through the family's own methods:

Shampoo, SOAP  fold  the statistics L and R of every parameter (`fold_gradient`, as STATS does);
               apply the direction of every parameter (`precondition`, as APPLY does), with roots / bases active;
Muon           input the owner's part of each unit's APPLY (`apply_input`: momentum and the Nesterov blend of a
                     matrix, AdamW's whole step of the rest), which streaming runs in the gradient hooks;
               apply the whole direction of every unit (`precondition`).

Variants are timed in this thread's CPU time (not wall-clock time, which a loaded machine stretches), round by round,
interleaved; each number is the fastest round's mean (the JSON line also has the medians). The ratio is to
`torch.optim.AdamW`'s step on the same parameters (foreach), the plain pipeline's per-step work. Run it on two commits
(PYTHONPATH=<the old tree>) for a before/after. Two counts of one more call, which no load changes, say where the time
goes: the aten ops it dispatches (each costs microseconds on small tensors, whatever its size; a `torch._foreach_*` op
is one) and its matrix products' floating-point operations (`torch.utils.flop_counter`; at a core's matmul rate, the
part no overhead cut removes).

Run: python benchmarks/step_work.py [--rounds 7] [--repeats 5] [--stage 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from fxkfac.models import TinyBertConfig, TinyBertMLM
from fxkfac.muon import MuonConfig
from fxkfac.muon.family import MuonFamily, MuonUnit, UnitKind
from fxkfac.shampoo.family import ShampooFamily
from fxkfac.shampoo.layout import ParamUnit
from fxkfac.shampoo.soap import SOAPFamily

__all__ = ["main"]


def _params(args: argparse.Namespace) -> dict[str, torch.nn.Parameter]:
    """The model's parameters (those of stage `args.stage` of a 2-stage split at the middle block when given), each
    with a random gradient."""
    torch.manual_seed(0)
    cfg = TinyBertConfig(hidden=args.hidden, ffn=args.ffn, layers=args.layers, heads=4, max_len=64)
    params = dict(TinyBertMLM(cfg).named_parameters())
    if args.stage is not None:
        first = ("tok.", "pos.", "norm.", *(f"blocks.{i}." for i in range(args.layers // 2)))
        params = {n: p for n, p in params.items() if n.startswith(first) == (args.stage == 0)}
    for p in params.values():
        p.grad = torch.randn_like(p)
    return params


def _grads(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    assert all(p.grad is not None for p in params.values())
    return {n: p.grad.clone() for n, p in params.items() if p.grad is not None}


def _fold_gradient(family: ShampooFamily | SOAPFamily, unit: ParamUnit, state: Any, part: str, raw: Tensor) -> None:
    """The runtime's STATS of a gradient part: `fxkfac.preconditioner.fold_gradient` (a tree from before it: the
    family's `fold` of its `statistic`, which it replaced)."""
    try:
        from fxkfac.preconditioner import fold_gradient
    except ImportError:
        family.fold(state, part, family.statistic(unit, part, None, raw, 1))
        return
    fold_gradient(family, unit, state, part, raw, 1)


def _block_family(family: ShampooFamily | SOAPFamily, params: dict[str, torch.nn.Parameter]) -> dict[str, Callable]:
    """Fold and apply of a Shampoo or SOAP family, its roots or bases made once from a first fold."""
    units = [ParamUnit(n, tuple(p.shape)) for n, p in params.items()]
    states = {u.name: family.new_state(u) for u in units}

    def fold() -> None:
        for u in units:
            for part in family.parts:
                _fold_gradient(family, u, states[u.name], part, params[u.name])

    def apply() -> None:
        family.precondition(units, _grads(params), states, params)

    fold()
    for u in units:
        state = states[u.name]
        made = family.combine(u, state, {part: family.decompose(u, state, part) for part in family.parts})
        state.set_pending(made, 0)
        state.activate(0)
    apply()
    return {"fold": fold, "apply": apply}


def _muon(params: dict[str, torch.nn.Parameter]) -> dict[str, Callable]:
    """Muon's owner input and whole APPLY; the blocks' and the transform's 2-D weights are its matrices."""
    family = MuonFamily(MuonConfig())
    units = [
        MuonUnit(
            n,
            tuple(p.shape),
            UnitKind.MATRIX if p.dim() == 2 and n.startswith(("blocks.", "transform.")) else UnitKind.ADAMW,
        )
        for n, p in params.items()
    ]
    states = {u.name: family.new_state(u) for u in units}

    def inputs() -> None:
        for u in units:
            grad = params[u.name].grad
            assert grad is not None
            family.apply_input(u, grad, states[u.name], params[u.name])

    def apply() -> None:
        family.precondition(units, _grads(params), states, params)

    return {"input": inputs, "apply": apply}


def _adamw(params: dict[str, torch.nn.Parameter]) -> Callable[[], None]:
    """AdamW's step on copies of the parameters (the plain pipeline's per-step work)."""
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params.values()]
    for c, p in zip(copies, params.values(), strict=True):
        c.grad = None if p.grad is None else p.grad.clone()
    opt = torch.optim.AdamW(copies, lr=1e-3)
    return opt.step  # type: ignore[return-value]  # step() returns the optional loss, unused here


class _OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _counts(fn: Callable[[], object]) -> tuple[int, float]:
    """The aten ops one call of `fn` dispatches and its matrix products' MFLOP."""
    with _OpCount() as ops:
        fn()
    flops = FlopCounterMode(display=False)
    with flops:
        fn()
    return ops.ops, flops.get_total_flops() / 1e6


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of this thread's CPU per call (torch runs every op on it with one thread): other processes on a
    loaded machine take turns on the cores but add nothing to it, as they would to wall-clock time."""
    start = time.thread_time()
    for _ in range(repeats):
        fn()
    return (time.thread_time() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--stage", type=int, choices=(0, 1), default=None, help="one stage's parameters of 2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5, help="calls per variant per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from preconditioner_convergence import family_config

    params = _params(args)
    calls: dict[str, Callable[[], object]] = {"AdamW step": _adamw(params)}
    for name, family in (
        ("Shampoo", ShampooFamily(family_config("Shampoo"))),
        ("SOAP", SOAPFamily(family_config("SOAP"))),
    ):
        for what, fn in _block_family(family, params).items():
            calls[f"{name} {what}"] = fn
    for what, fn in _muon(params).items():
        calls[f"Muon {what}"] = fn
    load = os.getloadavg()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for fn in calls.values():
        fn()
    for _ in range(args.rounds):
        for k, fn in calls.items():
            times[k].append(_time(fn, args.repeats))
    counts = {k: _counts(fn) for k, fn in calls.items()}
    ms = {k: 1e3 * min(v) for k, v in times.items()}
    median_ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    base = ms["AdamW step"]

    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"per-step work, 1 thread, TinyBert h{args.hidden} ffn{args.ffn} x{args.layers}, stage {args.stage}"
    )
    for col in ("work", "ms (fastest round)", "ratio to AdamW's step", "aten ops", "MFLOP (matmuls)"):
        table.add_column(col)
    for k, v in ms.items():
        table.add_row(k, f"{v:.2f}", f"{v / base:.2f}", str(counts[k][0]), f"{counts[k][1]:.0f}")
    console = Console(width=120)
    console.print(table)
    console.print(f"load average before: {load[0]:.2f}, after: {os.getloadavg()[0]:.2f}", markup=False)
    print(
        json.dumps(
            {
                "benchmark": "step_work",
                "args": vars(args),
                "ms": ms,
                "median_ms": median_ms,
                "ratio_to_adamw": {k: v / base for k, v in ms.items()},
                "aten_ops": {k: c[0] for k, c in counts.items()},
                "mflop": {k: c[1] for k, c in counts.items()},
                "loadavg": [load[0], os.getloadavg()[0]],
            }
        )
    )


if __name__ == "__main__":
    main()
