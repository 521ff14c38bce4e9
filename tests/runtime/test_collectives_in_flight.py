"""Collectives left in flight (fxkfac/runtime/p2p.py, [Note: collectives in flight]): a deferred result is applied
only when its key is settled, in the order deferred, and a wait that never ends becomes an error naming the op."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch

from fxkfac.runtime.p2p import TagSpace, Transport
from tests.support.distributed import run_distributed


def _transport(rank: int, world: int, seconds: float = 30.0) -> Transport:
    return Transport(rank, world, TagSpace(1, 1, 1), timedelta(seconds=seconds))


def _settle_in_order(rank: int, world: int) -> dict:
    transport = _transport(rank, world)
    applied: list[tuple[str, list[float]]] = []
    summed = torch.full((3,), float(rank + 1))
    sent = torch.full((2,), 7.0) if rank == 0 else torch.zeros(2)
    transport.defer(
        ("sum",), transport.start_all_reduce(summed, None, "sum"), lambda t: applied.append(("sum", t.tolist()))
    )
    transport.defer(
        ("bcast",), transport.start_broadcast(sent, 0, None, "bcast"), lambda t: applied.append(("bcast", t.tolist()))
    )
    second = torch.full((1,), 10.0 * (rank + 1))
    transport.defer(
        ("sum",), transport.start_all_reduce(second, None, "sum 2"), lambda t: applied.append(("sum 2", t.tolist()))
    )
    before = (list(applied), transport.in_flight())
    transport.settle(("sum",))
    middle = (list(applied), transport.in_flight())
    transport.settle_all()
    return {"before": before, "middle": middle, "after": (applied, transport.in_flight())}


def test_a_deferred_result_is_applied_when_its_key_is_settled_in_the_order_deferred() -> None:
    results = run_distributed(_settle_in_order, 2, timeout=120)
    assert all(r.ok for r in results), [r.traceback for r in results]
    for r in results:
        assert r.value["before"] == ([], [("sum",), ("bcast",)])
        assert r.value["middle"] == ([("sum", [3.0, 3.0, 3.0]), ("sum 2", [30.0])], [("bcast",)])
        assert r.value["after"] == ([("sum", [3.0, 3.0, 3.0]), ("sum 2", [30.0]), ("bcast", [7.0, 7.0])], [])


def test_in_a_world_of_one_rank_a_deferred_result_is_applied_at_once() -> None:
    transport = _transport(0, 1)
    applied: list[list[float]] = []
    pending = transport.start_all_reduce(torch.ones(2), None, "sum")
    transport.defer(("sum",), pending, lambda t: applied.append(t.tolist()))
    assert applied == [[1.0, 1.0]] and transport.in_flight() == []


def _peer_never_joins(rank: int, world: int) -> None:
    transport = _transport(rank, world, seconds=2.0)
    if rank == 1:
        time.sleep(6.0)  # never starts the all-reduce rank 0 waits for
        return
    transport.defer(("sum",), transport.start_all_reduce(torch.ones(2), None, "SYNC_STATS s0 layer"), lambda t: None)
    transport.settle(("sum",))


def test_a_deferred_collective_a_peer_never_joins_fails_at_the_reader_naming_the_op() -> None:
    results = run_distributed(_peer_never_joins, 2, timeout=120, pg_timeout=30)
    assert results[1].ok
    assert results[0].error_type in ("PipelineTimeoutError", "PipelineError"), results[0]
    assert "SYNC_STATS s0 layer" in (results[0].error or "")


def _trained_step_in_flight(rank: int, world: int) -> list[tuple[str, list]]:
    """One K-FAC step of pure data parallelism under COMM-OPT, refresh every step, plan=None: after each op, the
    keys still in flight on this rank."""
    import torch.nn.functional as F

    import fxkfac
    from fxkfac.config import KFACConfig, PlanOptions
    from tests.support.models import mlp

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
    trainer = fxkfac.compile(
        mlp(),
        (1, world),
        None,
        example_inputs=(x,),
        loss_fn=F.cross_entropy,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
        backend=None,
        preconditioner=KFACConfig(refresh_every=1),
        plan_options=PlanOptions(strategy="comm-opt"),
    )
    seen: list[tuple[str, list]] = []

    def spied(handler: Any) -> Any:
        def run(ctx: Any, op: Any) -> None:
            handler(ctx, op)
            seen.append((str(op), list(ctx.transport.in_flight())))

        return run

    for kind, handler in list(trainer.interpreter.handlers.items()):
        trainer.interpreter.register(kind, spied(handler))
    trainer.step((x,), y)
    return seen


def test_the_runtime_leaves_its_collectives_in_flight_until_a_reader_needs_them() -> None:
    """SYNC_STATS and BCAST return with their collective in flight; the part's DECOMP, or the stage's APPLY, settles
    it; ALLREDUCE_GRAD's sum is in flight until APPLY; nothing is in flight after OPT_STEP."""
    results = run_distributed(_trained_step_in_flight, 2, timeout=300)
    assert all(r.ok for r in results), [r.traceback for r in results]
    for r in results:
        seen = dict(r.value)
        kinds = [op.split()[0] for op, _ in r.value]
        assert "SYNC_STATS" in kinds and "BCAST" in kinds and "ALLREDUCE_GRAD" in kinds, kinds
        assert ("gradients", 0) in seen["ALLREDUCE_GRAD s0"]
        syncs = [(op, keys) for op, keys in r.value if op.startswith("SYNC_STATS")]
        assert all(any(k[0] == "part" and k[1] == op.split()[-1] for k in keys) for op, keys in syncs), syncs
        first_decomp = next(i for i, (op, _) in enumerate(r.value) if op.startswith("DECOMP"))
        op, keys = r.value[first_decomp]
        layer, part = op.split()[-1], op.split()[2]
        assert ("part", layer, part) not in keys, f"'{op}' left its own statistics in flight: {keys}"
        bcasts = [(op, keys) for op, keys in r.value if op.startswith("BCAST")]
        assert all(("part", op.split()[-1], op.split()[2]) in keys for op, keys in bcasts), bcasts
        assert seen["APPLY s0"] == [], "APPLY must settle its stage's gradients and every part of its layers"
        assert r.value[-1] == ("OPT_STEP", [])
