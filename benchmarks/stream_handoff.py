"""What streaming one Shampoo or SOAP unit costs its owner and its helper per step (fxkfac/runtime/streaming.py,
"Stateful units"), against the unit's own per-step work (its statistics' fold and its APPLY) that streaming moves off
the owner, and against what the planner prices the hand-off at: process CPU time (gloo's threads included), 2 ranks,
1 thread each, so that a loaded host compares them side by side.

Per unit and step the owner packs its gradient and parameter into one message (`Packing`), sends it, takes back one
message (the direction, <P, G>, the unit's per-step state in the family's dtype) and installs the state; the helper
takes the message and packs the return (its fold and APPLY are the unit's work, timed apart). The planner's price of
the owner's side is `LayerCost.hand_off` + `take_back` (the copies and the state's install, timed here the way the
profiler times them) + `CostTable.message_cpu` of both messages under the communication model measured here
(`CommModel.send_cpu`, `recv_cpu`).

Run: python benchmarks/stream_handoff.py [--reps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from pipefisher_overhead import init_worker, spawn_and_report
from preconditioner_convergence import family_config

from fxkfac.comm_profile import measure_comm
from fxkfac.preconditioner import fold_gradient, gradient_parts
from fxkfac.runtime.streaming import Packing
from fxkfac.shampoo import ShampooFamily, SOAPFamily

__all__ = ["main"]

SHAPES = ((128, 128), (512, 128), (128, 512))
"""TinyBert h128 / ffn512's matrices (benchmarks/shampoo_overhead.py's model)."""
FAMILIES = {"Shampoo": ShampooFamily, "SOAP": SOAPFamily}


def _unit(family_name: str, shape: tuple[int, int]) -> tuple[Any, Any, Any, torch.nn.Parameter]:
    """(family, unit, a state past its first refresh with every per-step tensor made, the parameter with a gradient)."""
    family = FAMILIES[family_name](family_config(family_name))
    net = torch.nn.Linear(shape[1], shape[0], bias=False)
    net.weight.grad = torch.randn_like(net.weight)
    (unit,) = list(family.units(net, []))
    state = family.new_state(unit)
    work = _work(family, unit, state, net.weight)
    for _ in range(2):
        work()
    halves = {part: family.decompose(unit, state.snapshot(), part) for part in family.parts}
    state.set_pending(family.combine(unit, state, halves), 0)
    state.activate(0)
    work()
    return family, unit, state, net.weight


def _work(family: Any, unit: Any, state: Any, p: torch.nn.Parameter) -> Callable[[], None]:
    """The unit's per-step work: its gradient statistics' folds and its APPLY (what a helper runs for it)."""

    def run() -> None:
        for part in sorted(gradient_parts(family), key=family.parts.index):
            fold_gradient(family, unit, state, part, p, 1)
        family.precondition([unit], {unit.name: p.grad.clone()}, {unit.name: state}, {unit.name: p})

    return run


def _cpu(fn: Callable[[], object], reps: int) -> float:
    """Process CPU seconds of one call of `fn`, the least of five runs of `reps` calls."""
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.process_time() - start) / reps)
    return best


def _owner_side(
    unit: tuple[Any, Any, Any, torch.nn.Parameter], flat_state: torch.Tensor, reps: int
) -> tuple[float, float]:
    """The owner's `LayerCost.hand_off` and `take_back` as the profiler times them: the flat gradient and parameter
    copied, and a returned state installed."""
    family, layer, _, p = unit
    hand_off = _cpu(lambda: (p.grad.reshape(-1).clone(), p.detach().reshape(-1).clone()), reps)
    take_back = _cpu(lambda: family.load_step_state(layer, family.new_state(layer), flat_state), reps)
    return hand_off, take_back


def _exchange(rank: int, unit: tuple[Any, Any, Any, torch.nn.Parameter], reps: int) -> dict[str, float]:
    """This rank's CPU seconds per step of the hand-off (rank 0 the owner, rank 1 the helper), and the message sizes."""
    family, layer, state, p = unit
    flat_state = family.step_state(layer, state)
    n = p.numel()
    out = Packing(((n, p.dtype), (n, p.dtype)))
    back = Packing(((n, p.dtype), (1, torch.float64), (flat_state.numel(), flat_state.dtype)))
    dot = torch.zeros(1, dtype=torch.float64)

    def owner() -> None:
        buf = torch.empty(back.nbytes, dtype=torch.uint8)
        works = [dist.irecv(buf, 1, tag=1), dist.isend(out.pack([p.grad, p.detach()]), 1, tag=0)]
        for work in works:
            work.wait()
        flat, _, s = back.unpack(buf)
        p.grad = flat.view(p.shape)
        family.load_step_state(layer, family.new_state(layer), s)

    def helper() -> None:
        buf = torch.empty(out.nbytes, dtype=torch.uint8)
        dist.irecv(buf, 0, tag=0).wait()
        g, _ = out.unpack(buf)
        dist.isend(back.pack([g, dot, flat_state]), 0, tag=1).wait()

    dist.barrier()
    seconds = _cpu(owner if rank == 0 else helper, reps)
    return {"cpu_s": seconds, "out_bytes": out.nbytes, "back_bytes": back.nbytes}


def _worker(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    init_worker(rank, port)
    comm = measure_comm()
    assert comm is not None, "two ranks measure a model"
    rows = []
    for family_name in args.families:
        for shape in SHAPES:
            unit = _unit(family_name, shape)
            family, layer, state, p = unit
            mine = _exchange(rank, unit, args.reps)
            both: list[Any] = [None, None]
            dist.all_gather_object(both, mine)
            if rank != 0:
                continue
            flat_state = family.step_state(layer, state)
            hand_off, take_back = _owner_side(unit, flat_state, args.reps)
            cpu = comm.send_cpu.alpha + comm.send_cpu.beta * mine["out_bytes"]
            cpu += comm.recv_cpu.alpha + comm.recv_cpu.beta * mine["back_bytes"]
            rows.append(
                {
                    "family": family_name,
                    "shape": list(shape),
                    "work_s": _cpu(_work(family, layer, state, p), args.reps),
                    "owner_s": both[0]["cpu_s"],
                    "helper_s": both[1]["cpu_s"],
                    "priced_owner_s": hand_off + take_back + cpu,
                    "out_bytes": mine["out_bytes"],
                    "back_bytes": mine["back_bytes"],
                }
            )
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "comm": comm.to_dict(), "loadavg": list(os.getloadavg())}, f)
    dist.destroy_process_group()


def _report(result: dict[str, Any], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"a streamed unit's hand-off, CPU ms per step (2 ranks, 1 thread each, {args.reps} reps)")
    for col in ("family", "shape", "fold + APPLY", "owner", "priced owner", "helper", "bytes out / back"):
        table.add_column(col)
    for r in result["rows"]:
        table.add_row(
            r["family"],
            "x".join(map(str, r["shape"])),
            f"{1e3 * r['work_s']:.3f}",
            f"{1e3 * r['owner_s']:.3f}",
            f"{1e3 * r['priced_owner_s']:.3f}",
            f"{1e3 * r['helper_s']:.3f}",
            f"{r['out_bytes']} / {r['back_bytes']}",
        )
    console = Console(width=140)
    console.print(table)
    console.print(f"load average: {result['loadavg'][0]:.1f} on {os.cpu_count()} cores", markup=False)
    print(json.dumps({"benchmark": "stream_handoff", "args": vars(args), **result}))


def main() -> None:
    """Spawn the two ranks, then print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--reps", type=int, default=100)
    spawn_and_report(_worker, _report, parser.parse_args())


if __name__ == "__main__":
    main()
