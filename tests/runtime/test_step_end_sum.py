"""The step end's sums (fxkfac/runtime/step_end.py, [Note: KL-clip scope]): a sum over some ranks meets at the
member that ends its step last, which adds the shares in rank order and sends every member one total."""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from fxkfac.planner.problem.lowering import ranks_of_stages
from fxkfac.runtime.p2p import TagSpace, Transport
from fxkfac.runtime.step_end import last_to_end
from tests.support.distributed import run_distributed

# Rank order matters in float64: (1e16 + 1) - 1e16 == 0, while 1e16 - 1e16 + 1 == 1.
SHARES = {0: 1e16, 1: 1.0, 2: -1e16, 3: 5.0}


def _sum_over(rank: int, world: int, members: tuple[int, ...], root: int) -> list[float] | None:
    transport = Transport(rank, world, TagSpace(2, 4, 3), timedelta(seconds=60))
    if rank not in members:
        return None
    if rank != root:
        time.sleep(0.2 * rank)  # the others arrive one after another, the root before or after them
    tensor = torch.tensor([SHARES[rank], float(rank)], dtype=torch.float64)
    transport.sum_at(tensor, members, root, "test sum")
    transport.flush()
    return tensor.tolist()


def test_a_sum_at_a_root_gives_every_member_the_rank_ordered_total() -> None:
    for members, root in (((0, 1, 2), 2), ((0, 1, 2), 0), ((1, 2, 3), 2)):
        results = run_distributed(_sum_over, 4, members, root, timeout=120)
        assert all(r.ok for r in results), [r.traceback for r in results]
        expected = [0.0, 0.0]
        for m in members:  # the independent reference: shares added in rank order
            expected = [expected[0] + SHARES[m], expected[1] + float(m)]
        got = {r.rank: r.value for r in results if r.value is not None}
        assert sorted(got) == list(members)
        assert all(value == expected for value in got.values()), (members, root, got, expected)


def _sums_posted_early(rank: int, world: int, posting: tuple[int, ...], rounds: int) -> list[list[float]]:
    """`rounds` sums over the world through rank 0 in a row, the ranks in `posting` posting each sum's receives
    (`Transport.post_sum`) before they sleep, as a step posts them before its work; the others when they sum."""
    transport = Transport(rank, world, TagSpace(2, 4, 3), timedelta(seconds=60))
    totals = []
    for k in range(rounds):
        if rank in posting:
            transport.post_sum((2,), torch.float64, range(world), 0)
        time.sleep(0.1 * ((rank + k) % world))  # the members arrive in another order each round
        tensor = torch.tensor([SHARES[rank] * (k + 1), float(rank + k)], dtype=torch.float64)
        transport.sum_at(tensor, range(world), 0, f"test sum {k}")
        transport.flush()
        totals.append(tensor.tolist())
    return totals


def test_sums_whose_receives_were_posted_early_give_every_member_the_rank_ordered_total() -> None:
    rounds = 3
    results = run_distributed(_sums_posted_early, 3, (0, 2), rounds, timeout=120)
    assert all(r.ok for r in results), [r.traceback for r in results]
    for k in range(rounds):
        expected = [0.0, 0.0]
        for m in range(3):  # the independent reference: shares added in rank order
            expected = [expected[0] + SHARES[m] * (k + 1), expected[1] + float(m + k)]
        assert all(r.value[k] == expected for r in results), (k, [r.value[k] for r in results], expected)


def test_a_sum_over_one_member_leaves_its_tensor() -> None:
    transport = Transport(0, 1, TagSpace(1, 1, 1), timedelta(seconds=1))
    tensor = torch.tensor([3.0])
    transport.sum_at(tensor, (0,), 0, "alone")
    assert tensor.tolist() == [3.0]


def test_the_root_is_the_lowest_rank_holding_the_lowest_stage() -> None:
    # 1F1B, D=4, W=2: stage s on ranks 2s, 2s+1.
    holders = ranks_of_stages("1f1b", 4, 2)
    assert last_to_end(range(8), holders) == 0
    assert last_to_end((4, 5), holders) == 4
    # Chimera D=4: stage 0 on rank 0 (down pipe) and rank 3 (up pipe); an agreement set {1, 2} holds stages 1, 2.
    chimera = ranks_of_stages("chimera", 4, 1)
    assert chimera[0] == (0, 3)
    assert last_to_end(range(4), chimera) == 0
    assert last_to_end((1, 2), chimera) == 1
