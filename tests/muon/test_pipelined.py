"""Muon pipelined (GPipe, 1F1B, interleaved, Chimera) and data-parallel (W=2: every replica orthogonalizes, or one does
and broadcasts the direction) equals one device to 1e-5, and so does a hand-made plan that streams stage 0's matrix
to the idle rank, its Newton-Schulz there in two pieces.

Newton-Schulz runs in float32 here: the micro-batches' gradients are summed in another order on each layout, a float32
rounding, which bfloat16 (torch.optim.Muon's dtype, `MuonConfig.ns_dtype`'s default) would round to the next bfloat16
number now and then (a 2**-8 relative step), the precision of the iteration, not a difference of semantics."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from fxkfac.muon import MuonConfig
from fxkfac.planner.problem.ir import Op, OpKind, Programs
from tests.muon.support import edited_programs, train
from tests.support.distributed import run_distributed
from tests.support.models import mlp

CFG = MuonConfig(ns_dtype="float32", momentum=0.9)
CASES: list[tuple[str, int, int, str, int, str | None]] = [
    # (model, D, W, schedule, virtual stages, strategy)
    ("mlp", 2, 1, "gpipe", 1, None),
    ("mlp", 2, 1, "1f1b", 1, None),
    ("mlp6", 2, 1, "interleaved", 2, None),
    ("mlp", 2, 1, "chimera", 1, None),
    ("mlp", 1, 2, "gpipe", 1, None),
    ("mlp", 1, 2, "gpipe", 1, "mem-opt"),  # one replica orthogonalizes, BCAST_PREC gives the other the direction
    ("llama", 2, 1, "1f1b", 1, None),
]
N = 2


def _streamed(programs: Programs) -> Programs:
    """1F1B D=2: rank 0 (stage 0) sends 0.weight's Newton-Schulz input to rank 1 at its last backward, applies its
    other units itself and takes the orthogonalized matrix back before OPT_STEP; rank 1 runs it in two pieces."""
    layer = "0.weight"
    out: Programs = {}
    for rank, program in programs.items():
        steps = []
        for step in program:
            ops: list[Op] = []
            for op in step:
                if rank == 0 and op.kind is OpKind.APPLY:
                    ops.append(Op(OpKind.SEND_LGRAD, stage=0, peer=1, layer=layer))
                    ops.append(Op(OpKind.APPLY, stage=0, layer="0.bias"))
                elif rank == 0 and op.kind is OpKind.OPT_STEP:
                    ops.append(Op(OpKind.RECV_PGRAD, stage=0, peer=1, layer=layer))
                elif rank == 1 and op.kind is OpKind.OPT_STEP:
                    ops.append(Op(OpKind.RECV_LGRAD, stage=0, peer=0, layer=layer))
                    ops += [Op(OpKind.APPLY, stage=0, layer=layer, piece=(i, 2)) for i in range(2)]
                    ops.append(Op(OpKind.SEND_PGRAD, stage=0, peer=0, layer=layer))
                if not (rank == 0 and op.kind is OpKind.APPLY):
                    ops.append(op)
            steps.append(ops)
        out[rank] = steps
    return out


def _worker(rank: int, world: int) -> list[dict[str, Tensor]]:
    out = []
    for model, D, W, schedule, v, strategy in CASES:
        trained = train(CFG, (D, W), schedule=schedule, model=model, microbatches=N // W, v=v, strategy=strategy)
        out.append(trained)
        dist.barrier()
    with edited_programs(_streamed):
        out.append(train(CFG, (2, 1), schedule="1f1b"))
    return out


@pytest.mark.multiproc
def test_muon_pipelined_and_streamed_equal_one_device() -> None:
    results = run_distributed(_worker, 2, timeout=600)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    want = {name: train(CFG, None, model=name, microbatches=N) for name in ("mlp", "mlp6", "llama")}
    start = dict(mlp().named_parameters())
    assert min(float((want["mlp"][n] - p.detach()).abs().max()) for n, p in start.items()) > 1e-3, "nothing moved"
    cases: list[Any] = [*CASES, ("mlp", 2, 1, "1f1b streamed", 1, None)]
    for r in results:
        for case, params in zip(cases, r.value, strict=True):
            assert params, f"{case}: rank {r.rank} holds no parameter"
            for name, p in params.items():
                torch.testing.assert_close(
                    p, want[case[0]][name], rtol=0, atol=1e-5, msg=f"{case} rank {r.rank} {name}"
                )
