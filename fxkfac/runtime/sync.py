"""Gradient and weight synchronization over every copy of a parameter (dp replicas, Chimera pipes, tied weights).

One rule covers the three cases: a parameter's gradient is the *sum* of the partial gradients of
all its copies, wherever they live (another replica, the other Chimera pipeline, another stage
that uses the same tied weight). Each parameter has a holder set (global ranks); parameters with
the same holder set share one process group and one flattened all-reduce.

A tied parameter a family preconditions (`GradSync.owned`) is summed earlier, at the ALLREDUCE_GRAD of the last
stage of each rank that holds it, because its owner's statistics read the sum before the step ends
(planner/problem/costs.py); at the step's end the owner's direction replaces the gradient of every copy
(`send_directions`), so all copies take the same step.

Deadlock freedom: groups are created by every rank in one sorted order; within one sync call a
rank visits its groups in that global order, so no two ranks wait on each other in a cycle.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxkfac.errors import PipelineError
from fxkfac.planner.problem import Programs
from fxkfac.runtime.p2p import Transport
from fxkfac.runtime.stage import StageRunner

__all__ = ["flat_gradient", "split_flat", "GradSync", "grad_key", "TIED_KEY", "holder_sets", "named_groups"]

Holders = tuple[int, ...]


def holder_sets(
    stage_params: Sequence[Sequence[str]], ranks_of_stage: Mapping[int, Iterable[int]]
) -> dict[str, Holders]:
    """Parameter name -> the sorted global ranks holding a copy of it."""
    holders: dict[str, set[int]] = {}
    for stage, names in enumerate(stage_params):
        for name in names:
            holders.setdefault(name, set()).update(ranks_of_stage[stage])
    return {name: tuple(sorted(ranks)) for name, ranks in holders.items()}


def grad_key(stage: int) -> tuple[str, int]:
    """The key under which the gradient all-reduce of `stage` is in flight (`Transport.settle`)."""
    return ("gradients", stage)


TIED_KEY = ("tied gradients",)
"""The key under which the sums of owned tied gradients are in flight (`Transport.settle`)."""


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def flat_gradient(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters' gradients (zeros where one has none) in one flat tensor, in their order."""
    return torch.cat([_grad(p).reshape(-1) for p in params])


def split_flat(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of `flat`'s consecutive chunks, one of each shape (the inverse of `flat_gradient`)."""
    sizes = [math.prod(shape) for shape in shapes]
    return [chunk.view(*shape) for chunk, shape in zip(torch.split(flat, sizes), shapes, strict=True)]


def _scatter(flat: torch.Tensor, copies: Sequence[Sequence[torch.Tensor]], grad: bool) -> None:
    """Write consecutive chunks of `flat` into every copy of each parameter (grad or value)."""
    for same, chunk in zip(copies, split_flat(flat, [same[0].shape for same in copies]), strict=True):
        for t in same:
            if grad:
                t.grad = chunk.clone()
            else:
                with torch.no_grad():
                    t.copy_(chunk)


@dataclass
class GradSync:
    """Sums gradients (and broadcasts initial weights) over each parameter's copies."""

    rank: int
    holders: dict[str, Holders]
    shared: frozenset[str]
    groups: dict[Holders, dist.ProcessGroup | None]
    runners: Sequence[StageRunner]
    owned: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Tied parameters a family preconditions -> (owner stage, root): the rank of the owner stage whose direction
    every copy takes (see the module doc)."""
    sqnorms: list[torch.Tensor] | None = None
    """With gradient clipping, this step's shares of the squared global gradient norm, one per bucket, taken as
    soon as the bucket's gradient is summed over its copies, before anything preconditions it (None: not clipping;
    `take_sqnorm`)."""
    _local: Counter[str] = field(init=False)
    """Parameter name -> this rank's copies of it (its stage copies that hold it)."""
    _reached: set[int] = field(init=False, default_factory=set)
    """This step's local stages whose gradients are complete (their ALLREDUCE_GRAD ran)."""
    _summed: set[str] = field(init=False, default_factory=set)
    """This step's owned tied parameters whose sum has started."""
    _own: dict[int, list[tuple[Holders, list[str]]]] = field(init=False, default_factory=dict)
    """Per local stage: its own (not shared) parameters by holder set (`_buckets`), looked up once (`stage`)."""

    def __post_init__(self) -> None:
        self._local = Counter(n for r in self.runners for n in r.graph.params)

    @classmethod
    def build(
        cls,
        rank: int,
        world: int,
        holders: dict[str, Holders],
        shared: Iterable[str],
        runners: Sequence[StageRunner],
        owned: Mapping[str, tuple[int, int]] | None = None,
    ) -> GradSync:
        """Create the process groups of every holder set; collective: every rank must call it."""
        groups: dict[Holders, dist.ProcessGroup | None] = {}
        for ranks in sorted(set(holders.values())):
            if len(ranks) > 1:
                group = None if len(ranks) == world else dist.new_group(list(ranks))
                if rank in ranks:
                    groups[ranks] = group
        return cls(rank, holders, frozenset(shared), groups, runners, dict(owned or {}))

    def group_of(self, ranks: Holders) -> dist.ProcessGroup | None:
        """The process group of holder set `ranks` (None: the world, or a single rank)."""
        if len(ranks) <= 1:
            return None
        if ranks not in self.groups:
            raise AssertionError(f"no process group for the holders {ranks} on rank {self.rank}")
        return self.groups[ranks]

    def _copies(self, name: str) -> list[torch.Tensor]:
        return [r.param(name) for r in self.runners if name in r.graph.params]

    def _buckets(self, names: Iterable[str]) -> list[tuple[Holders, list[str]]]:
        by_group: dict[Holders, list[str]] = {}
        for name in sorted(names):
            by_group.setdefault(self.holders[name], []).append(name)
        return sorted(by_group.items())

    def _reduce(self, names: Iterable[str], transport: Transport, what: str, key: Hashable | None = None) -> None:
        """Sum the gradients of `names` over their copies: with `key`, the all-reduces are left in flight under it
        (see [Note: collectives in flight] in fxkfac/runtime/p2p.py), else waited for."""
        self._reduce_buckets(self._buckets(names), transport, what, key)

    def _reduce_buckets(
        self, buckets: list[tuple[Holders, list[str]]], transport: Transport, what: str, key: Hashable | None
    ) -> None:
        for ranks, bucket in buckets:
            if len(ranks) == 1 and all(self._local[n] == 1 for n in bucket):
                if self.sqnorms is not None:
                    self._add_sqnorm(flat_gradient([self._copies(n)[0] for n in bucket]), 1)
                continue  # the only copy: nothing to sum
            copies = [self._copies(n) for n in bucket]
            # local copies summed
            flat = torch.cat(
                [
                    sum(_grad(p) for p in c).reshape(-1)  # type: ignore[union-attr]  # c is never empty
                    for c in copies
                ]
            )
            scatter = functools.partial(self._final, copies=copies, holders=len(ranks))
            if len(ranks) == 1:
                scatter(flat)
                continue
            pending = transport.start_all_reduce(flat, self.groups[ranks], f"{what} over ranks {list(ranks)}")
            if key is None:
                scatter(pending.wait())
            else:
                transport.defer(key, pending, scatter)

    def _final(self, flat: torch.Tensor, copies: Sequence[Sequence[torch.Tensor]], holders: int) -> None:
        """A bucket's gradient summed over its copies: written into every copy, and its share of the squared norm
        taken (each of its `holders` ranks adds 1/holders of it: every parameter counts once)."""
        _scatter(flat, copies, grad=True)
        self._add_sqnorm(flat, holders)

    def _add_sqnorm(self, flat: torch.Tensor, holders: int) -> None:
        if self.sqnorms is not None:
            self.sqnorms.append(torch.linalg.vector_norm(flat).to(torch.float64).square() / holders)

    def take_sqnorm(self) -> torch.Tensor | None:
        """This rank's share of the step's squared global gradient norm (float64), and start the next step's;
        None when not clipping."""
        if self.sqnorms is None:
            return None
        total = torch.stack(self.sqnorms).sum() if self.sqnorms else torch.zeros((), dtype=torch.float64)
        self.sqnorms = []
        return total

    def stage(self, stage: int, transport: Transport, what: str) -> None:
        """Start summing the gradients of stage `stage`'s own (not shared) parameters over their copies, in flight
        under `grad_key(stage)` until a reader of them settles it."""
        if stage not in self._own:
            runner = next(r for r in self.runners if r.stage == stage)
            self._own[stage] = self._buckets(n for n in runner.graph.params if n not in self.shared)
        self._reduce_buckets(self._own[stage], transport, what, grad_key(stage))
        self._reached.add(stage)
        if not self.owned:
            return
        ready = [
            n
            for n in self.owned
            if n not in self._summed
            and self._local[n]
            and all(r.stage in self._reached for r in self.runners if n in r.graph.params)
        ]
        self._summed.update(ready)
        self._reduce(ready, transport, f"{what} (tied)", TIED_KEY)

    def require_summed(self, name: str, what: str) -> None:
        """PipelineError unless the sum of the owned tied parameter `name` has started this step (its owner is about
        to read it: settle `TIED_KEY` first)."""
        if name in self.owned and name not in self._summed:
            raise PipelineError(
                f"rank {self.rank}: '{what}' reads the gradient of the tied parameter {name} before every "
                "stage of this rank that uses it has completed its gradient (ALLREDUCE_GRAD): the plan places "
                "its owner's work too early"
            )

    def shared_params(self, transport: Transport, what: str) -> None:
        """Sum the gradients of parameters used by several stages (tied weights) over all copies (the owned ones'
        sums, started earlier, are settled by then); a new step begins."""
        if self.shared:  # most models tie nothing: no walk over every parameter at each step's end
            local = {n for r in self.runners for n in r.graph.params if n in self.shared and n not in self._summed}
            self._reduce(local, transport, what)
        self._reached.clear()
        self._summed.clear()

    def send_directions(self, transport: Transport, what: str) -> None:
        """Give every copy of each owned tied parameter its owner's direction (the gradient the owner preconditioned):
        broadcast from the owner's root over the holders, in one sorted order on every rank (collective)."""
        local = sorted(n for n in self.owned if self._local[n])
        for name in local:
            stage, root = self.owned[name]
            copies = self._copies(name)
            if self.rank == root:
                source = next(r.param(name) for r in self.runners if r.stage == stage and name in r.graph.params)
                flat = _grad(source).detach().clone()
            else:
                flat = torch.zeros_like(copies[0])
            ranks = self.holders[name]
            if len(ranks) > 1:
                transport.broadcast(flat, root, self.group_of(ranks), f"{what}: direction of {name} from rank {root}")
            for p in copies:
                p.grad = flat.clone()

    def broadcast_weights(self, transport: Transport) -> None:
        """Make every copy start from the value on its lowest holder rank (collective)."""
        local = {n for r in self.runners for n in r.graph.params}
        for ranks, bucket in self._buckets(local):
            copies = [self._copies(n) for n in bucket]
            flat = torch.cat([c[0].detach().reshape(-1) for c in copies])
            if len(ranks) > 1:
                transport.broadcast(flat, ranks[0], self.groups[ranks], f"initial weights over {list(ranks)}")
            _scatter(flat, copies, grad=False)


def named_groups(programs: Iterable[Programs], rank: int, world: int) -> dict[Holders, dist.ProcessGroup | None]:
    """The process groups of every rank set an op of `programs` names (`Op.group`: a broadcast within some copies
    of a stage), made in sorted order by every rank (collective); this rank's own, by ranks."""
    named = sorted(
        {
            op.group
            for ps in programs
            for program in ps.values()
            for ops in program
            for op in ops
            if op.group is not None
        }
    )
    groups: dict[Holders, dist.ProcessGroup | None] = {}
    for ranks in named:
        group = None if len(ranks) == world else dist.new_group(list(ranks))
        if rank in ranks:
            groups[ranks] = group
    return groups
