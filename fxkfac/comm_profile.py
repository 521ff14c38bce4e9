"""Measures the planner's communication model on the backend in use (gloo on CPU, NCCL on GPU).

Every rank of the group times all_reduce, broadcast and all_gather at a few message sizes (and a send between
its first two ranks, as a ping-pong), the ranks agree on the slowest time of each (one all-reduce with MAX),
and each fits the same alpha and beta per kind by non-negative least squares
(`fxkfac.planner.problem.hardware.fit_alpha_beta`): every rank returns the same `CommModel` and so plans the same.
The CPU a message costs each end's process (`CommModel.send_cpu`, `recv_cpu`) is fitted the same way from the
process CPU time of a burst of messages between the first two ranks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from fxkfac.planner.problem.hardware import AlphaBeta, Collective, CommModel, LinkCosts, Sample, fit_alpha_beta
from fxkfac.runtime.p2p import collective_device

__all__ = ["DEFAULT_SIZES", "measure_comm"]

DEFAULT_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20)
"""Message sizes timed, bytes: from latency bound to bandwidth bound on loopback, NVLink and InfiniBand alike,
and quick (a few milliseconds each on gloo)."""

_TIMED = (Collective.ALL_REDUCE, Collective.BROADCAST, Collective.ALL_GATHER, Collective.SEND)


def measure_comm(
    group: dist.ProcessGroup | None = None,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    warmup: int = 2,
    repeats: int = 9,
    devices_per_node: int | None = None,
) -> CommModel | None:
    """The communication model measured over `group` (the world when None); collective: every rank of the group
    calls it. None without an initialized process group; zero-cost over a group of one rank.

    Every group size is priced with the link measured here: inside one node that is the intra-node link, across
    nodes the inter-node one (pessimistic for groups inside a node). devices_per_node defaults to torchrun's
    LOCAL_WORLD_SIZE, else the group's size.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    p = dist.get_world_size(group)
    node = devices_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", p))
    backend = str(dist.get_backend(group))
    source = f"measured:{backend}:{p} ranks"
    if p == 1:
        return CommModel.single_link(LinkCosts.uniform(AlphaBeta(0.0, 0.0)), node, source)
    if len(set(sizes)) < 2 or min(sizes) < 4:
        raise ValueError(f"measure_comm needs two or more distinct message sizes of >= 4 bytes, got {list(sizes)}")
    device = collective_device(group)
    times = torch.tensor(
        [[_time(kind, n, group, device, warmup, repeats) for n in sizes] for kind in _TIMED],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's time: what a step waits for
    agreed = times.cpu().tolist()
    fitted = {kind: fit_alpha_beta(kind, _samples(kind, sizes, row, p)) for kind, row in zip(_TIMED, agreed)}
    link = LinkCosts(
        fitted[Collective.ALL_REDUCE],
        fitted[Collective.BROADCAST],
        fitted[Collective.ALL_GATHER],
        fitted[Collective.SEND],
    )
    send_cpu, recv_cpu = _message_cpu(group, device, sizes, repeats)
    return CommModel(link, link, node, source, send_cpu, recv_cpu)


_BURST = 8
"""Messages a `_message_cpu` sample sends at once (gloo's threads work while the caller posts the rest)."""


def _message_cpu(
    group: dist.ProcessGroup | None, device: torch.device, sizes: Sequence[int], repeats: int
) -> tuple[AlphaBeta, AlphaBeta]:
    """CPU seconds one message costs its sender's and its receiver's process, fitted over `sizes`: the median over
    `repeats` of the process CPU time (gloo's threads included) of a burst of `_BURST` sends from the group's rank 0
    to its rank 1, per message, each received into a new buffer as the runtime's are (its first touch is part of the
    cost); the ranks agree on the largest."""
    me = dist.get_rank(group)
    cpu = torch.zeros(len(sizes), dtype=torch.float64)
    for i, n in enumerate(sizes):
        xs = [torch.ones(max(1, n // 4), dtype=torch.float32, device=device) for _ in range(_BURST)]
        runs = []
        for _ in range(max(1, repeats)):
            dist.barrier(group=group)
            start = time.process_time()
            if me < 2:
                peer = _global(group, 1 - me)
                if me == 0:
                    works = [dist.isend(x, peer, group=group, tag=j) for j, x in enumerate(xs)]
                else:
                    works = [dist.irecv(torch.empty_like(x), peer, group=group, tag=j) for j, x in enumerate(xs)]
                for work in works:
                    if work is not None:  # None: this rank is not in `group` (it is: me < 2)
                        work.wait()
                _sync(device)
            runs.append((time.process_time() - start) / _BURST)
        cpu[i] = sorted(runs)[len(runs) // 2]
    ends = torch.zeros(2, len(sizes), dtype=torch.float64, device=device)
    if me < 2:
        ends[me] = cpu.to(device)
    dist.all_reduce(ends, op=dist.ReduceOp.MAX, group=group)
    send, recv = ([(2, n, t) for n, t in zip(sizes, row, strict=True)] for row in ends.cpu().tolist())
    return fit_alpha_beta(Collective.SEND, send), fit_alpha_beta(Collective.SEND, recv)


def _samples(kind: Collective, sizes: Sequence[int], seconds: Sequence[float], group_size: int) -> list[Sample]:
    """(group size, bytes, seconds) of each timed size, as `fit_alpha_beta` reads them: an all_gather's bytes are
    what it gathers (every rank's piece), a send is between two ranks."""
    if kind is Collective.SEND:
        return [(2, n, t) for n, t in zip(sizes, seconds)]
    per = group_size if kind is Collective.ALL_GATHER else 1
    return [(group_size, n * per, t) for n, t in zip(sizes, seconds)]


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of the group's `rank`."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _call(kind: Collective, nbytes: int, group: dist.ProcessGroup | None, device: torch.device) -> Callable[[], None]:
    """One collective of `kind` moving `nbytes` per rank over `group` (a send: a ping-pong between its first two
    ranks, which the caller halves; the other ranks do nothing)."""
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    me = dist.get_rank(group)
    if kind is Collective.ALL_REDUCE:
        return lambda: dist.all_reduce(x, group=group)
    if kind is Collective.BROADCAST:
        return lambda: dist.broadcast(x, src=_global(group, 0), group=group)
    if kind is Collective.ALL_GATHER:
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        return lambda: dist.all_gather(out, x, group=group)
    if me > 1:
        return lambda: None
    peer = _global(group, 1 - me)

    def ping_pong() -> None:
        for step in (0, 1):
            if step == me:
                dist.send(x, dst=peer, group=group)
            else:
                dist.recv(x, src=peer, group=group)

    return ping_pong


def _time(
    kind: Collective, nbytes: int, group: dist.ProcessGroup | None, device: torch.device, warmup: int, repeats: int
) -> float:
    """Seconds of one `kind` of `nbytes` on this rank, each run started together (a barrier): the lower quartile
    of the runs, which measures the link rather than the spikes another process's load adds on a shared host."""
    call = _call(kind, nbytes, group, device)
    for _ in range(warmup):
        call()
    times = []
    for _ in range(max(1, repeats)):
        dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - start)
    quartile = sorted(times)[len(times) // 4]
    return quartile / 2 if kind is Collective.SEND else quartile


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (NCCL collectives are asynchronous on the GPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
