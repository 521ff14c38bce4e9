"""Point-to-point and collective transfers with tags and timeouts: a hang becomes an error."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from fxkfac.errors import PipelineError, PipelineTimeoutError
from fxkfac.passes.split_stages import TensorSpec

__all__ = ["TagSpace", "Transport"]


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


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


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
    _pending: list[tuple[dist.Work, str]] = field(default_factory=list)
    _posted: dict[tuple, tuple[list[torch.Tensor], list[dist.Work]]] = field(default_factory=dict)

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for `work` at most the timeout; a timeout or a dead peer becomes a PipelineError naming `what`."""
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            seconds = self.timeout.total_seconds()
            if _is_timeout(e):
                raise PipelineTimeoutError(
                    f"rank {self.rank} waited more than {seconds:g}s on '{what}': a peer stalled or died "
                    f"(raise `timeout=` if a step legitimately takes longer). Cause: {e}") from e
            raise PipelineError(f"rank {self.rank} failed on '{what}': a peer likely died. Cause: {e}") from e

    def send(self, tensors: Sequence[torch.Tensor], peer: int, grad: bool, stage: int, pipe: int, mb: int,
             what: str) -> None:
        """Start sending `tensors` to `peer`; completion is awaited by `flush`."""
        for index, tensor in enumerate(tensors):
            tag = self.tags.tag(grad, stage, pipe, mb, index)
            work = dist.isend(tensor.detach().contiguous(), dst=peer, tag=tag)
            assert work is not None, "isend on the default group, of which this rank is a member, returns a Work"
            self._pending.append((work, what))

    def post_recv(self, specs: Sequence[TensorSpec], peer: int, grad: bool, stage: int, pipe: int, mb: int) -> None:
        """Post the receives of one transfer now, so the data lands while this rank computes."""
        key = (peer, grad, stage, pipe, mb)
        if key in self._posted:
            raise AssertionError(f"receive {key} posted twice")
        buffers = [torch.empty(spec.shape, dtype=spec.dtype, device=self.device) for spec in specs]
        works: list[dist.Work] = []
        for i, buf in enumerate(buffers):
            work = dist.irecv(buf, src=peer, tag=self.tags.tag(grad, stage, pipe, mb, i))
            assert work is not None, "irecv on the default group, of which this rank is a member, returns a Work"
            works.append(work)
        self._posted[key] = (buffers, works)

    def recv(self, specs: Sequence[TensorSpec], peer: int, grad: bool, stage: int, pipe: int, mb: int,
             what: str) -> list[torch.Tensor]:
        """Receive one tensor per spec from `peer` (using the posted receive when there is one)."""
        key = (peer, grad, stage, pipe, mb)
        if key not in self._posted:
            self.post_recv(specs, peer, grad, stage, pipe, mb)
        buffers, works = self._posted.pop(key)
        for work in works:
            self.wait(work, what)
        return buffers

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> None:
        """Sum `tensor` in place over `group` (None: the world)."""
        if self.world == 1:
            return
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self.wait(work, what)

    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None, what: str) -> None:
        """Broadcast `tensor` in place from global rank `src` over `group`."""
        if self.world == 1:
            return
        work = dist.broadcast(tensor, src=src, group=group, async_op=True)
        self.wait(work, what)

    def flush(self) -> None:
        """Wait for every send started so far."""
        pending, self._pending = self._pending, []
        for work, what in pending:
            self.wait(work, what)
