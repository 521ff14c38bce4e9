"""How a step ends on one rank: the NaN/Inf verdict, the KL-clip's nu under each `KLClipScope`, the loss.

[Note: KL-clip scope]
- GLOBAL: one world sum of [sum <P, G>, non-finite check, loss], one nu over every layer. Every rank waits
  for the slowest one: a world barrier ends every step (the default; the single-device equality tests).
- STAGE: one sum over the rank's *agreement set* (below) of [check, sum <P, G> of each stage]; each
  stage's layers get the nu of their own stage's sum.
- STALE: the first step of a run (no last sum yet) ends as GLOBAL does. Later steps take the verdict as STAGE
  does, and one nu over every layer from the last step's world sum, whose all-reduce was started without
  waiting at the last step's end and is waited for here (long done: every rank has passed that step's end
  before any rank gets this far, since the pipeline's transfers of this step depend on it). A step that some
  agreement set skipped adds NaN to the sum; a non-finite sum keeps the previous one (on every rank alike).
  The sum is part of the runtime's checkpointed state, so a resumed run goes on exactly.
These sums are not all-reduces: each meets at the member that ends its step last (`last_to_end`: stage 0's
rank), which adds the shares the others sent when they got there and sends the total back
(`Transport.sum_at`; every member posts its receives while the step computes, `StepEnd.post` from OPT_STEP's
prepare, so the messages have landed when the sum begins). The last rank waits for no message (an all-reduce
would cost it a round trip on the critical path: 0.59 ms against 0.13 ms between two gloo processes on one
host); the others wait for the total while they would idle anyway, since their next step starts with the root's
next activations. The root adds in rank order, and every rank reads the root's total: one value on every rank.
One device runs the same code with every collective a no-op, so it implements each scope exactly; its model is
one stage, so STAGE there needs `clip_groups` naming the pipeline's stages to equal a pipelined run.

Agreement set: the smallest set of ranks closed under holding a copy of one parameter (the copies of a stage:
dp replicas, Chimera's two pipes; and the stages a tied weight joins). Under STAGE and STALE its ranks agree on
skipping a step by one sum of the check, so every copy of every parameter steps or skips together: a
parameter never steps on one rank and skips on another. Two sets may decide differently (one skips: its step
counter stays and its preconditioner state is restored; the other steps). That is sound because ranks of two
sets exchange only activations and gradients, whose ops are the same at every step of a program (their tags name
stage, pipe and micro-batch, never the step), so every send still meets its receive; the deferred world sums
pair by call, which every rank makes once per step. The price: after a skip, the sets' step counters differ, and
a NonFiniteError raised on one set leaves the others to time out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import total_ordering
from typing import Any

import torch
import torch.distributed as dist

from fxkfac.config import KLClipScope
from fxkfac.planner.problem.lowering import linked_classes
from fxkfac.runtime.p2p import Pending, Transport

__all__ = [
    "agreement_sets",
    "last_to_end",
    "StepLoss",
    "StepEnd",
    "NonFiniteCheck",
    "Verdict",
    "ClipScale",
    "unclipped",
    "clip_scales",
    "norm_clip",
]

ClipScale = Callable[[float], float]
"""A clip group's sum <P, G> -> its nu: the family's `clip_scale` at the step's learning rate."""


def unclipped(dot_sum: float) -> float:
    """nu of a step without a KL-clip (no preconditioner): 1."""
    return 1.0


def agreement_sets(holders: Iterable[Sequence[int]], world: int) -> list[tuple[int, ...]]:
    """The agreement sets of ranks 0..world-1: classes of the relation "hold a copy of one parameter", given
    every parameter's holder ranks (sorted; ranks that hold nothing are sets of their own)."""
    return linked_classes(holders, world)


def last_to_end(members: Iterable[int], ranks_of_stage: Mapping[int, Sequence[int]]) -> int:
    """The member that ends a step last in every schedule: the lowest rank holding the lowest stage any member
    holds (stage 0's last backward waits on every other stage's, and its APPLY comes after)."""
    members = set(members)
    for stage in sorted(ranks_of_stage):
        held = members.intersection(ranks_of_stage[stage])
        if held:
            return min(held)
    raise AssertionError(f"ranks {sorted(members)} hold no stage (every rank holds one)")


def _total(dots: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """This rank's share of the sum <P, G> over every group (float64)."""
    return sum(dots.values(), torch.zeros((), dtype=torch.float64))


def _scalars(values: Sequence[torch.Tensor | float], device: torch.device) -> torch.Tensor:
    """A float64 vector of scalars on `device`: one tensor made of their host values on the CPU (a stack costs a
    conversion and a copy per scalar, ~80 us on OPT_STEP's critical path), stacked on an accelerator (no host
    synchronization)."""
    if device.type == "cpu":
        return torch.tensor([float(v) for v in values], dtype=torch.float64)
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])


@dataclass(frozen=True)
class NonFiniteCheck:
    """One rank's NaN/Inf check of its losses and gradients, in two parts so that the common case costs no read of
    its own: `total`, the float32 sum of every tensor, rides in the step-end sum, whose sum over the ranks is finite
    iff every rank's is (finite float32 values do not overflow float64); only where it is not does every rank take
    `exact`, which checks each tensor (a float32 sum also overflows on large finite values), and those are summed
    once more (`StepEnd._flagged`)."""

    total: torch.Tensor | float
    tensors: Sequence[torch.Tensor] = ()

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> NonFiniteCheck:
        """The check of `tensors`: one float32 sum per tensor and their sum, no read (a float64 sum converts every
        gradient first: 45x slower, ~2.7 ms per 1M parameters)."""
        if not tensors:
            return cls(0.0)
        with torch.no_grad():  # a loss or gradient that requires grad is read, not differentiated
            return cls(torch.stack([t.sum(dtype=torch.float32) for t in tensors]).sum(), tensors)

    def exact(self) -> bool:
        """Whether some tensor holds NaN/Inf, each checked exactly."""
        return not all(bool(torch.isfinite(t).all()) for t in self.tensors)


def clip_scales(sums: Mapping[int, float], scale: ClipScale) -> dict[int, float]:
    """nu of each group from its own sum <P, G>."""
    return {group: scale(value) for group, value in sums.items()}


def norm_clip(sqnorm: float, max_norm: float | None) -> float:
    """The factor `torch.nn.utils.clip_grad_norm_` multiplies every gradient by, given the squared global norm:
    ``min(1, max_norm / (norm + 1e-6))`` (1 without clipping)."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (math.sqrt(sqnorm) + 1e-6))


@total_ordering
class StepLoss:
    """A step's loss whose world all-reduce runs on while training goes on: reading it (float, formatting,
    arithmetic, comparison, pickling) waits for the sum. The same value on every rank."""

    def __init__(self, pending: Pending) -> None:
        self._pending = pending

    def __float__(self) -> float:
        return float(self._pending.wait())

    def __repr__(self) -> str:
        return repr(float(self))

    def __format__(self, spec: str) -> str:
        return format(float(self), spec)

    def __reduce__(self) -> tuple[type, tuple[float]]:
        return (float, (float(self),))

    def __eq__(self, other: object) -> bool:
        return float(self) == other

    def __hash__(self) -> int:
        return hash(float(self))

    def __lt__(self, other: float) -> bool:
        return float(self) < other

    def __add__(self, other: float) -> float:
        return float(self) + other

    __radd__ = __add__

    def __sub__(self, other: float) -> float:
        return float(self) - other

    def __rsub__(self, other: float) -> float:
        return other - float(self)

    def __mul__(self, other: float) -> float:
        return float(self) * other

    __rmul__ = __mul__

    def __truediv__(self, other: float) -> float:
        return float(self) / other

    def __neg__(self) -> float:
        return -float(self)

    def __abs__(self) -> float:
        return abs(float(self))


@dataclass(frozen=True)
class Verdict:
    """How a step ends on a rank: skipped or not, the nu of each KL-clip group, and the step loss summed over the
    world where the world sum that ended the step carried it (None: `StepEnd.loss` sums it)."""

    skip: bool
    nus: dict[int, float]
    loss: float | None = None
    clip: float = 1.0
    """The factor every gradient is multiplied by for `PipelineOptions.max_grad_norm` (1: no clipping); the nus
    are already those of the clipped gradient."""


@dataclass
class StepEnd:
    """One rank's end of a step under `scope`: whom it waits for, and the nu of each KL-clip group.

    `agreement` is this rank's agreement set and its process group (None: the world, or the rank alone);
    `deferred` the process group of the world sums that run on while the next step trains (STALE's <P, G>
    and the loss; its own group, so they never queue behind or before another collective of the world)."""

    scope: KLClipScope
    transport: Transport
    agreement: tuple[int, ...]
    root: int
    """Where this rank's step-end sum meets (`Transport.sum_at`): the world's root under GLOBAL, else its set's."""
    deferred: Any
    groups: int = 1
    """KL-clip groups under STAGE: the model's stages 0..groups-1 (the same number on every rank)."""
    stale: float | None = None
    """STALE: the last world sum <P, G> that was finite (None before the first step stood)."""
    world_root: int = 0
    """The world's root: STALE's first step ends as GLOBAL does."""
    max_grad_norm: float | None = None
    """`PipelineOptions.max_grad_norm`: the global norm rides in GLOBAL's world sum (other scopes refuse it)."""
    _pending: Pending | None = None

    @classmethod
    def build(
        cls,
        scope: KLClipScope,
        transport: Transport,
        holders: Iterable[Sequence[int]],
        ranks_of_stage: Mapping[int, Sequence[int]],
        max_grad_norm: float | None = None,
    ) -> StepEnd:
        """This rank's StepEnd from every parameter's holder ranks and every stage's; makes the deferred sums'
        process group (collective) unless the scope is GLOBAL or the world one rank."""
        rank, world = transport.rank, transport.world
        stages = len(ranks_of_stage)
        world_root = last_to_end(range(world), ranks_of_stage)
        if scope is KLClipScope.GLOBAL or world == 1:
            return cls(
                scope,
                transport,
                tuple(range(world)),
                world_root,
                None,
                stages,
                world_root=world_root,
                max_grad_norm=max_grad_norm,
            )
        mine = next(ranks for ranks in agreement_sets(holders, world) if rank in ranks)
        root = last_to_end(mine, ranks_of_stage)
        return cls(scope, transport, mine, root, dist.new_group(list(range(world))), stages, world_root=world_root)

    @property
    def barrier_free(self) -> bool:
        """True when no world collective ends a step (STAGE, and STALE after its first step)."""
        return self.scope is not KLClipScope.GLOBAL

    def _ends_global(self) -> bool:
        """Whether this step ends with the world sum: GLOBAL, and STALE before its first sum stood."""
        return self.scope is KLClipScope.GLOBAL or (self.scope is KLClipScope.STALE and self.stale is None)

    def post(self, shares: int = 0) -> None:
        """Post the receives of this step's end sum now (`Transport.post_sum`), so its messages land while the rank
        computes; `shares` is the number of <P, G> shares a STAGE sum carries besides the check (one per KL-clip
        group with a preconditioner, none without: `finish`'s `dots`)."""
        if self._ends_global():
            self.transport.post_sum((4,), torch.float64, range(self.transport.world), self.world_root)
        else:
            size = 1 + (shares if self.scope is KLClipScope.STAGE else 0)
            self.transport.post_sum((size,), torch.float64, self.agreement, self.root)

    def finish(
        self,
        dots: Mapping[int, torch.Tensor],
        check: NonFiniteCheck,
        loss: torch.Tensor,
        scale: ClipScale,
        sqnorm: torch.Tensor | None = None,
    ) -> Verdict:
        """The verdict from this rank's share of each group's sum <P, G> (`dots`, group -> float64 scalar: under
        STAGE every group of the model, 0 where the rank holds none of it; else the one group 0), its NaN/Inf
        check, its share of the step loss and, when clipping, its share of the gradient's squared global norm;
        `scale` turns a group's sum into its nu."""
        if self._ends_global():
            return self._global(dots, check, loss, scale, sqnorm)
        assert self.max_grad_norm is None, "clipping needs the world sum of a GLOBAL step end (the trainer refuses)"
        groups = sorted(dots)
        shares = [dots[g] for g in groups] if self.scope is KLClipScope.STAGE else []
        skip, sums = self._agree(check, shares)
        if self.scope is KLClipScope.STAGE:
            return Verdict(skip, clip_scales(dict(zip(groups, sums)), scale))
        self._take_stale()
        assert self.stale is not None, "STALE ends its first step as GLOBAL, which sets the sum"
        total = torch.tensor(math.nan, dtype=torch.float64) if skip else _total(dots)
        total = total.to(self.transport.device)
        self._pending = self.transport.start_all_reduce(total, self.deferred, "KL-clip <P, G> (stale) all-reduce")
        return Verdict(skip, dict.fromkeys(dots, scale(self.stale)))

    def _global(
        self,
        dots: Mapping[int, torch.Tensor],
        check: NonFiniteCheck,
        loss: torch.Tensor,
        scale: ClipScale,
        sqnorm: torch.Tensor | None,
    ) -> Verdict:
        """One world sum of [sum <P, G>, check, loss, squared gradient norm] at the world's root; under STALE, the
        sum becomes the next step's. With clipping, nu is that of the clipped gradient: <P, G> scales by the
        clip factor squared (P is linear in G)."""
        # every share moves to the transport's device: NCCL sums device memory, gloo host memory
        norm = 0.0 if sqnorm is None else sqnorm.detach()
        dot = _total(dots) if dots else 0.0
        flat = _scalars([dot, check.total, loss.detach(), norm], self.transport.device)
        world = range(self.transport.world)
        what = "OPT_STEP (KL-clip <P, G>, non-finite check, loss and gradient norm sums)"
        self.transport.sum_at(flat, world, self.world_root, what)
        dot, checked, total_loss, sqnorm_sum = flat.tolist()  # one read of the four sums
        skip = self._flagged(checked, check, world, self.world_root, what) or not math.isfinite(sqnorm_sum)
        clip = norm_clip(sqnorm_sum, self.max_grad_norm) if not skip else 1.0
        if self.scope is KLClipScope.STALE and not skip and math.isfinite(dot):
            self.stale = dot
        nu = scale(dot * clip * clip)
        return Verdict(skip, dict.fromkeys(dots, nu), total_loss, clip)

    def _agree(self, check: NonFiniteCheck, shares: Sequence[torch.Tensor]) -> tuple[bool, list[float]]:
        """Sum [check, shares] over the agreement set: the verdict and the sums of the shares (a stage's copies lie
        in one set, so a stage's sum is whole there)."""
        flat = _scalars([check.total, *shares], self.transport.device)
        what = f"OPT_STEP (non-finite check over ranks {list(self.agreement)})"
        self.transport.sum_at(flat, self.agreement, self.root, what)
        checked, *sums = flat.tolist()
        return self._flagged(checked, check, self.agreement, self.root, what), sums

    def _flagged(self, checked: float, check: NonFiniteCheck, members: Sequence[int], root: int, what: str) -> bool:
        """Whether some rank of `members` holds NaN/Inf, given the sum of their checks' totals: not where it is
        finite; else by the sum of their exact checks, through `root` as the first sum (every member sees the same
        total, so every member makes this second sum, or none does)."""
        if math.isfinite(checked):
            return False
        flag = _scalars([float(check.exact())], self.transport.device)
        self.transport.sum_at(flag, members, root, f"{what}: exact")
        return float(flag[0]) > 0

    def _take_stale(self) -> None:
        """Fold the last step's deferred world sum into `stale` when it is finite."""
        if self._pending is None:
            return
        value = float(self._pending.wait())
        self._pending = None
        if math.isfinite(value):
            self.stale = value

    def state(self) -> float | None:
        """The STALE sum the next step uses (waits for the deferred one): what a checkpoint keeps."""
        self._take_stale()
        return self.stale

    def restore(self, stale: float | None) -> None:
        """Take over a checkpoint's STALE sum (None: the next step ends as GLOBAL does); a sum still running is
        dropped (it belonged to the state the checkpoint replaces)."""
        if self._pending is not None:
            self._pending.wait()
        self.stale, self._pending = stale, None

    def loss(self, loss: torch.Tensor) -> float | StepLoss:
        """The step loss summed over the world where no world sum ended the step (a barrier-free step):
        without waiting, a StepLoss (on one device, the loss itself)."""
        if self.transport.world == 1:
            return float(loss)
        return StepLoss(self.transport.start_all_reduce(loss, self.deferred, "loss all-reduce"))
