"""A split APPLY's streamed units travel in buckets ([Note: streamed buckets] in fxkfac/runtime/streaming.py): both ends
cut the same buckets, only where no rank would wait for a bucket whose last unit waits on it, and Muon streamed in one
bucket or in one bucket a unit equals one device to 1e-5."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from fxkfac.muon import MuonConfig
from fxkfac.planner.problem.buckets import bucketable
from fxkfac.planner.problem.ir import Op, OpKind, Programs
from fxkfac.runtime import streaming
from fxkfac.runtime.p2p import Transport
from fxkfac.runtime.streaming import buckets
from tests.muon.support import STEPS, edited_programs, train
from tests.support.distributed import run_distributed

CFG = MuonConfig(ns_dtype="float32", momentum=0.9)
STREAMED = ("0.weight", "2.weight", "4.weight")
"""mlp6's matrices on stage 0 of D=2 (its head, 10.weight, is AdamW's)."""


def test_both_ends_cut_the_same_buckets_in_descending_unit_order() -> None:
    order = {"a": 0, "b": 1, "c": 2, "d": 3}
    f32 = torch.float32
    units = [(1, 0, "a", 100, f32), (1, 0, "c", 300, f32), (1, 0, "b", 200, f32), (2, 0, "d", 50, f32)]
    cut = buckets(units, order, cap=4 * 400)  # closes once it holds 400 float32 elements
    assert cut[1, "c"].units == ("c", "b") and cut[1, "c"] is cut[1, "b"]
    assert cut[1, "c"].spans == {"c": (0, 300), "b": (300, 200)} and cut[1, "c"].numel == 500
    assert cut[1, "a"].units == ("a",) and cut[2, "d"].units == ("d",) and cut[2, "d"].peer == 2
    copies = buckets([*units, (3, 0, "a", 100, f32)], order, cap=4 * 400)  # a stage's copies: one bucket a peer
    assert copies[3, "a"].peer == 3 and copies[1, "a"].peer == 1 and copies[1, "c"] == cut[1, "c"]
    assert buckets(units[::-1], order, cap=4 * 400) == cut, "both ends list the units in another order"
    assert {b.units for b in buckets(units, order, cap=1).values()} == {("a",), ("b",), ("c",), ("d",)}


def test_a_packed_message_returns_each_piece_bit_for_bit() -> None:
    """A stateful unit's message (`Packing`): pieces of mixed dtypes and odd sizes, each at an aligned offset of one
    uint8 tensor, come back equal bit for bit (NaN and a denormal included), as views of it."""
    pieces = [torch.randn(3, 5), torch.tensor([float("nan"), 1e-310], dtype=torch.float64), torch.arange(7.0)]
    packing = streaming.Packing(tuple((x.numel(), x.dtype) for x in pieces))
    flat = packing.pack(pieces)
    assert flat.dtype == torch.uint8 and flat.numel() == packing.nbytes == 64 + 16 + 32
    out = packing.unpack(flat)
    assert all(torch.equal(a.reshape(-1).view(torch.uint8), b.view(torch.uint8)) for a, b in zip(pieces, out))
    assert all(b.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for b in out)


def _owner(sends: list[Op], tail: list[Op]) -> list[Op]:
    return [Op(OpKind.BWD, stage=0, mb=0), *sends, *tail, Op(OpKind.OPT_STEP)]


def test_buckets_only_where_no_rank_waits_inside_one() -> None:
    send = [Op(OpKind.SEND_LGRAD, stage=0, peer=1, layer=u) for u in ("x", "y")]
    back = [Op(OpKind.RECV_PGRAD, stage=0, peer=1, layer=u) for u in ("x", "y")]
    helper = [
        op
        for u in ("x", "y")
        for op in (
            Op(OpKind.RECV_LGRAD, stage=0, peer=0, layer=u),
            Op(OpKind.APPLY, stage=0, layer=u),
            Op(OpKind.SEND_PGRAD, stage=0, peer=0, layer=u),
        )
    ]
    good: Programs = {0: [_owner(send, back)], 1: [[*helper, Op(OpKind.OPT_STEP)]]}
    assert bucketable(good) == {(0, 1, 0)}
    recv = Op(OpKind.RECV_GRAD, stage=0, mb=1, peer=1)
    split_sends: Programs = {0: [_owner([send[0], recv, send[1]], back)], 1: good[1]}
    assert bucketable(split_sends) == frozenset(), "the owner waits between a bucket's units"
    act = Op(OpKind.RECV_ACT, stage=1, mb=0, peer=0)
    waiting_helper: Programs = {0: good[0], 1: [[*helper[:3], act, *helper[3:], Op(OpKind.OPT_STEP)]]}
    assert bucketable(waiting_helper) == frozenset(), "the helper waits on the owner between two returns"


def _streamed(programs: Programs) -> Programs:
    """1F1B D=2: rank 0 hands stage 0's three matrices to rank 1 after its last backward (biases its own APPLYs) and
    takes the orthogonalized matrices back before OPT_STEP; rank 1 runs each whole."""
    out: Programs = {}
    for rank, program in programs.items():
        steps = []
        for step in program:
            ops: list[Op] = []
            for op in step:
                if rank == 0 and op.kind is OpKind.APPLY:
                    ops += [Op(OpKind.SEND_LGRAD, stage=0, peer=1, layer=u) for u in STREAMED]
                    ops += [Op(OpKind.APPLY, stage=0, layer=u.replace("weight", "bias")) for u in STREAMED]
                    continue
                if rank == 0 and op.kind is OpKind.OPT_STEP:
                    ops += [Op(OpKind.RECV_PGRAD, stage=0, peer=1, layer=u) for u in STREAMED]
                elif rank == 1 and op.kind is OpKind.OPT_STEP:
                    for u in STREAMED:
                        ops.append(Op(OpKind.RECV_LGRAD, stage=0, peer=0, layer=u))
                        ops.append(Op(OpKind.APPLY, stage=0, layer=u))
                        ops.append(Op(OpKind.SEND_PGRAD, stage=0, peer=0, layer=u))
                ops.append(op)
            steps.append(ops)
        out[rank] = steps
    return out


def _worker(rank: int, world: int) -> list[tuple[dict[str, Tensor], int]]:
    """Each cap's trained parameters, with the buckets this rank sent (gradients out, or results back)."""
    sent: list[str] = []
    send = Transport.send_tagged

    def counted(self: Transport, tensor: Tensor, peer: int, tag: int, what: str) -> None:
        sent.append(what)
        send(self, tensor, peer, tag, what)

    Transport.send_tagged = counted  # type: ignore[method-assign]  # counts this worker process's sends
    out = []
    for cap in (streaming.BUCKET_BYTES, 1):  # one bucket of three units; a bucket a unit
        streaming.BUCKET_BYTES = cap
        sent.clear()
        with edited_programs(_streamed):
            params = train(CFG, (2, 1), schedule="1f1b", model="mlp6")
        out.append((params, sum(" bucket " in what for what in sent)))
    return out


@pytest.mark.multiproc
def test_muon_streamed_in_buckets_equals_one_device() -> None:
    results = run_distributed(_worker, 2, timeout=300)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    want = train(CFG, None, model="mlp6", microbatches=2)
    for r in results:
        for (cap, per_step), (params, sent) in zip((("one bucket", 1), ("a bucket a unit", 3)), r.value, strict=True):
            assert sent == STEPS * per_step, f"{cap}: rank {r.rank} sent {sent} buckets in {STEPS} steps"
            assert params, f"rank {r.rank} holds no parameter"
            for name, p in params.items():
                torch.testing.assert_close(p, want[name], rtol=0, atol=1e-5, msg=f"{cap}: rank {r.rank} {name}")
