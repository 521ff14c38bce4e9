"""Point-to-point and collective transfers with tags and timeouts: a hang becomes an error.

[Note: collectives in flight]
A collective an op of the plan starts (SYNC_STATS, BCAST, BCAST_PREC, ALLREDUCE_GRAD) runs on while the rank
goes on with its next ops: the op starts it and `defer`s what to do with the result under a key naming the state
it writes (a layer's part, a stage's gradients). Every op that reads that state `settle`s the key first (waits,
then applies the result), and OPT_STEP settles all, so nothing is in flight across a step's end (skipped steps and
checkpoints see whole state). The order of collectives on each rank is the plan's, as when each op waited; only
the waits move later, to the first reader, as kfac-pytorch's asynchronous factor all-reduce and broadcast do. The
planner models each collective as occupying its rank for its whole cost: an upper bound of what runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from fxkfac.errors import PipelineError, PipelineTimeoutError
from fxkfac.passes.split_stages import TensorSpec

__all__ = ["TagSpace", "Transport", "Pending", "LAYER_MESSAGES"]


@dataclass(frozen=True, slots=True)
class TagSpace:
    """Unique message tags per (activation|gradient, stage, pipe, micro-batch, tensor index)."""

    stages: int
    microbatches: int
    max_tensors: int

    def tag(self, grad: bool, stage: int, pipe: int, mb: int, index: int) -> int:
        """The tag both ends of one tensor transfer use."""
        key = ((int(grad) * self.stages + stage) * 2 + pipe) * self.microbatches + mb
        return key * self.max_tensors + index

    def beyond(self, index: int) -> int:
        """The `index`-th tag past every transfer's: for messages that are not activations or gradients."""
        return 2 * self.stages * 2 * self.microbatches * self.max_tensors + index

    def of_layer(self, layer: int, message: int) -> int:
        """The tag of tensor `message` (< LAYER_MESSAGES) of a streamed layer's transfers, the layer numbered in the
        model's unit order (after `beyond`'s first two, which the step-end sums use)."""
        if not 0 <= message < LAYER_MESSAGES:
            raise AssertionError(f"layer message {message} outside 0..{LAYER_MESSAGES - 1}")
        return self.beyond(2 + layer * LAYER_MESSAGES + message)


LAYER_MESSAGES = 8
"""Tags reserved per layer for its streamed transfers (gradient, preconditioned gradient and its <P, G>, each part
of a replica and its refresh step)."""


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the tensors of this process's messages and collectives live: the current CUDA device under NCCL (which
    moves only device memory), else the CPU (gloo; one device, no process group)."""
    if dist.is_available() and dist.is_initialized() and str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Transport:
    """Sends, receives and collectives of one rank; every wait is bounded by `timeout`.

    In a world of one rank (one device, no process group) the collectives have nothing to do.
    """

    rank: int
    world: int
    tags: TagSpace
    timeout: timedelta
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _sends: list[tuple[dist.Work, str]] = field(default_factory=list)
    _posted: dict[Hashable, tuple[list[torch.Tensor], list[dist.Work]]] = field(default_factory=dict)
    _inflight: dict[Hashable, list[tuple[Pending, Callable[[torch.Tensor], None]]]] = field(default_factory=dict)
    waited_ns: int = 0
    """Wall-clock ns spent in `wait` so far: what the timeline counts of an op as waiting for peers."""

    @property
    def sends_wait_for_receives(self) -> bool:
        """Whether a send started here can hold up this rank's later transfers until its receiver posts the receive:
        NCCL's (CUDA tensors), run in order on one stream per peer; gloo's (CPU) send only queues its bytes."""
        return self.device.type == "cuda"

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for `work` at most the timeout; a timeout or a dead peer becomes a PipelineError naming `what`."""
        began = time.time_ns()
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            seconds = self.timeout.total_seconds()
            if _is_timeout(e):
                raise PipelineTimeoutError(
                    f"rank {self.rank} waited more than {seconds:g}s on '{what}': a peer stalled or died "
                    f"(raise `timeout=` if a step legitimately takes longer). Cause: {e}"
                ) from e
            raise PipelineError(f"rank {self.rank} failed on '{what}': a peer likely died. Cause: {e}") from e
        finally:
            self.waited_ns += time.time_ns() - began

    def send(
        self, tensors: Sequence[torch.Tensor], peer: int, grad: bool, stage: int, pipe: int, mb: int, what: str
    ) -> None:
        """Start sending `tensors` to `peer`; completion is awaited by `flush`."""
        for index, tensor in enumerate(tensors):
            self.send_tagged(tensor, peer, self.tags.tag(grad, stage, pipe, mb, index), what)

    def send_tagged(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> None:
        """Start sending `tensor` to `peer` under `tag`; completion is awaited by `flush`."""
        self._sends.append((_work(dist.isend(tensor.detach().contiguous(), dst=peer, tag=tag)), what))

    def post_tagged(self, key: Hashable, buffers: Sequence[torch.Tensor], peer: int, tags: Sequence[int]) -> None:
        """Post the receives of `buffers` from `peer` under `tags` now, to be taken by `take(key)`."""
        if key in self._posted:
            raise AssertionError(f"receive {key} posted twice")
        works = [_work(dist.irecv(buf, src=peer, tag=tag)) for buf, tag in zip(buffers, tags, strict=True)]
        self._posted[key] = (list(buffers), works)

    def take(self, key: Hashable, what: str) -> list[torch.Tensor]:
        """The buffers `post_tagged` posted under `key`, once received."""
        if key not in self._posted:
            raise AssertionError(f"'{what}': its receive was not posted (the program orders its instructions wrongly)")
        buffers, works = self._posted.pop(key)
        for work in works:
            self.wait(work, what)
        return buffers

    def post_recv(self, specs: Sequence[TensorSpec], peer: int, grad: bool, stage: int, pipe: int, mb: int) -> None:
        """Post the receives of one transfer now, so the data lands while this rank computes."""
        buffers = [torch.empty(spec.shape, dtype=spec.dtype, device=self.device) for spec in specs]
        tags = [self.tags.tag(grad, stage, pipe, mb, i) for i in range(len(buffers))]
        self.post_tagged((peer, grad, stage, pipe, mb), buffers, peer, tags)

    def recv(
        self, specs: Sequence[TensorSpec], peer: int, grad: bool, stage: int, pipe: int, mb: int, what: str
    ) -> list[torch.Tensor]:
        """Receive one tensor per spec from `peer` (using the posted receive when there is one)."""
        if (peer, grad, stage, pipe, mb) not in self._posted:
            self.post_recv(specs, peer, grad, stage, pipe, mb)
        return self.take((peer, grad, stage, pipe, mb), what)

    def start_all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> Pending:
        """Start summing `tensor` in place over `group` (None: the world), without waiting."""
        if self.world == 1:
            return Pending(self, [], what, tensor)
        return Pending(self, [_work(dist.all_reduce(tensor, group=group, async_op=True))], what, tensor)

    def start_broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None, what: str) -> Pending:
        """Start broadcasting `tensor` in place from global rank `src` over `group`, without waiting."""
        if self.world == 1:
            return Pending(self, [], what, tensor)
        return Pending(self, [_work(dist.broadcast(tensor, src=src, group=group, async_op=True))], what, tensor)

    def post_sum(self, shape: Sequence[int], dtype: torch.dtype, members: Sequence[int], root: int) -> None:
        """Post now the receives of a later `sum_at` of a tensor of `shape` over `members` through `root` (the
        shares at the root, the total elsewhere; those posted already are kept). gloo moves a message's bytes only
        once its receive is posted, so a receive posted when its sum begins costs a round trip through the
        sender's I/O thread (on a loaded host, milliseconds); one posted early finds the bytes landed."""
        if len(members) == 1 or self.world == 1:
            return
        for key in self._sum_keys(members, root):
            if key not in self._posted:
                _, part, peer = key
                buffer = torch.empty(tuple(shape), dtype=dtype, device=self.device)
                self.post_tagged(key, [buffer], peer, [self.tags.beyond(part)])

    def _sum_keys(self, members: Sequence[int], root: int) -> list[tuple[str, int, int]]:
        """The receives of this rank in a sum through `root`: ("sum", 0, member) for each share at the root, else
        ("sum", 1, root) for the total (the part is also the tag's index past the transfers')."""
        return [("sum", 0, m) for m in sorted(members) if m != root] if self.rank == root else [("sum", 1, root)]

    def _take_sum_part(self, key: tuple[str, int, int], like: torch.Tensor, what: str) -> torch.Tensor:
        (received,) = self.take(key, what)
        if received.shape != like.shape or received.dtype != like.dtype:
            raise AssertionError(
                f"'{what}': a {like.dtype} {tuple(like.shape)} sum met a receive posted for {received.dtype} "
                f"{tuple(received.shape)} (`post_sum` and `sum_at` disagree)"
            )
        return received

    def sum_at(self, tensor: torch.Tensor, members: Sequence[int], root: int, what: str) -> None:
        """Sum `tensor` in place over `members` (global ranks, this one among them) through `root`: every other
        member sends its share to the root, which adds the shares in member order and sends the total back. The
        receives `post_sum` posted are taken; the others are posted now.

        An all-reduce costs its last caller a round trip; here the root, when it arrives last, finds the others'
        shares already sent and waits for nothing. So a step's end sums at the member that ends its step last
        (see [Note: KL-clip scope] in fxkfac/runtime/step_end.py)."""
        if len(members) == 1 or self.world == 1:
            return
        self.post_sum(tensor.shape, tensor.dtype, members, root)
        if self.rank != root:
            sent = _work(dist.isend(tensor.detach().clone(), dst=root, tag=self.tags.beyond(0)))
            self.wait(sent, f"{what}: the share sent to rank {root}")
            tensor.copy_(self._take_sum_part(("sum", 1, root), tensor, f"{what}: the total from rank {root}"))
            return
        shares = {
            key[2]: self._take_sum_part(key, tensor, f"{what}: the share of rank {key[2]}")
            for key in self._sum_keys(members, root)
        }
        shares[root] = tensor.detach()
        ordered = sorted(members)
        # the shares added in rank order into a new tensor (the caller may change `tensor` while the total is sent)
        total = sum((shares[m] for m in ordered[1:]), shares[ordered[0]])
        for m in ordered:
            if m != root:
                self._sends.append((_work(dist.isend(total, dst=m, tag=self.tags.beyond(1))), what))
        tensor.copy_(total)  # once the total is on its way

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> None:
        """Sum `tensor` in place over `group` (None: the world), waiting for it."""
        self.start_all_reduce(tensor, group, what).wait()

    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None, what: str) -> None:
        """Broadcast `tensor` in place from global rank `src` over `group`, waiting for it."""
        self.start_broadcast(tensor, src, group, what).wait()

    def defer(self, key: Hashable, pending: Pending, then: Callable[[torch.Tensor], None]) -> None:
        """Leave `pending` in flight until a reader settles `key`, which then applies `then` to its tensor (see
        [Note: collectives in flight]); with nothing to wait for (a world of one rank) `then` runs at once."""
        if pending.works:
            self._inflight.setdefault(key, []).append((pending, then))
        else:
            then(pending.wait())

    def settle(self, key: Hashable) -> None:
        """Wait for what is in flight under `key` and apply it, oldest first (nothing when none is)."""
        for pending, then in self._inflight.pop(key, ()):
            then(pending.wait())

    def settle_all(self) -> None:
        """Settle every key, in the order each was first deferred."""
        for key in list(self._inflight):
            self.settle(key)

    def in_flight(self) -> list[Hashable]:
        """The keys with collectives still in flight."""
        return list(self._inflight)

    def flush(self) -> None:
        """Wait for every send started so far."""
        sends, self._sends = self._sends, []
        for work, what in sends:
            self.wait(work, what)


def _work(work: dist.Work | None) -> dist.Work:
    """The Work an asynchronous collective returned (typed optional by torch: None only without async_op)."""
    assert work is not None, "a collective with async_op=True on a group this rank belongs to returns a Work"
    return work


@dataclass
class Pending:
    """A collective started without waiting on `tensor`; `wait` waits for it (at most the transport's timeout)
    and returns the tensor."""

    transport: Transport
    works: list[dist.Work]
    what: str
    tensor: torch.Tensor

    def wait(self) -> torch.Tensor:
        """The tensor, once the collective is done."""
        works, self.works = self.works, []
        for work in works:
            self.transport.wait(work, self.what)
        return self.tensor
