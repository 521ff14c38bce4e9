"""Streamed preconditioning in programs (docs/STREAMED_APPLY.md): layers of a stage whose APPLY a helper rank runs,
fed their gradients while the last backward of the step makes them on each rank holding the stage (its owners).

On GPipe and 1F1B the first stage's last backward, its APPLY and its next forward lie on the cycle every step
repeats, so that APPLY adds its whole length to the step however the plan places the rest. Streaming takes it
off the cycle: the owner sends each streamed layer's gradient the moment it is final (SEND_LGRAD, placed after the
backward it streams from), the helper receives it (RECV_LGRAD), applies its replica of the layer's preconditioner
(APPLY of the owner's stage naming the layer) and sends the result back (SEND_PGRAD); the owner writes it into the
gradient before OPT_STEP (RECV_PGRAD). At each refresh the owner sends the helper the made preconditioner right
after the DECOMP that completes it (SEND_REPLICA), and the helper takes it in the same step (RECV_REPLICA).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fxkfac.planner.problem.apply_pieces import cut_apply
from fxkfac.planner.problem.costs import LayerCost, PreconditionerKind, StageCost
from fxkfac.planner.problem.errors import PlanFormatError
from fxkfac.planner.problem.ir import LayerTiming, Op, OpKind, Placement, Program

__all__ = [
    "Streaming",
    "Made",
    "stream_step",
    "made_refreshes",
    "replica_born",
    "add_replicas",
    "ready",
    "ready_fractions",
    "can_stream",
]


@dataclass(frozen=True)
class Streaming:
    """Layers of `stage` (held by its owners, `Problem.stream_owners`), in the order the owners' backward makes their
    gradients final, and the rank that preconditions each (`helpers`, one per layer: several helpers share the
    load where one alone would have too little room)."""

    stage: int
    helpers: tuple[int, ...]
    layers: tuple[str, ...]
    whole_backward: bool = False
    """Whether the owner's backward makes every gradient at its end (a stage run compiled: torch.compile's backward
    is one autograd node), so nothing streams during it and the helper only applies its layers beside the owner's;
    else each layer's gradient is final as the backward reaches it (`ready_fractions`)."""

    def __post_init__(self) -> None:
        ok = (
            isinstance(self.stage, int)
            and self.stage >= 0
            and isinstance(self.helpers, tuple)
            and all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in self.helpers)
            and isinstance(self.layers, tuple)
            and len(self.layers) > 0
            and len(self.helpers) == len(self.layers)
            and len(set(self.layers)) == len(self.layers)
            and all(isinstance(n, str) and n for n in self.layers)
            and isinstance(self.whole_backward, bool)
        )
        if not ok:
            raise PlanFormatError(
                f"Streaming needs a stage (int >= 0), distinct layer names and a helper rank (int >= 0) for each, "
                f"got {self!r}"
            )

    @property
    def ranks(self) -> tuple[int, ...]:
        """The helper ranks, each once, in the order of their first layer."""
        return tuple(dict.fromkeys(self.helpers))

    def helper_of(self, layer: str) -> int:
        """The rank that preconditions `layer`."""
        return self.helpers[self.layers.index(layer)]

    def layers_of(self, helper: int) -> tuple[str, ...]:
        """The layers `helper` preconditions, in the order their gradients become final."""
        return tuple(n for n, h in zip(self.layers, self.helpers, strict=True) if h == helper)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form."""
        whole = {"whole_backward": True} if self.whole_backward else {}
        return {"stage": self.stage, "helpers": list(self.helpers), "layers": list(self.layers), **whole}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Streaming:
        """Inverse of `to_dict` (a plan of one helper, {"helper": rank}, as written before helpers were several);
        PlanFormatError when malformed."""
        try:
            layers = tuple(data["layers"])
            helpers = tuple(data["helpers"]) if "helpers" in data else (data["helper"],) * len(layers)
            return cls(data["stage"], helpers, layers, data.get("whole_backward", False))
        except (KeyError, TypeError) as e:
            raise PlanFormatError(f"the plan's streaming is malformed: {e!r}") from e


def can_stream(family: PreconditionerKind, layer: LayerCost) -> bool:
    """Whether a helper may run `layer`'s per-step work: an APPLY that reads its preconditioner alone (no optimizer
    state, statistics from captures: K-FAC's); one whose statistics all come from the reduced gradient, which the
    helper then folds and keeps with the rest of the per-step state (Shampoo, SOAP: docs/STREAMED_APPLY.md, "Stateful
    units"); or a Muon matrix's (the owner keeps the momentum and sends the Newton-Schulz input, the helper keeps
    nothing and needs no replica)."""
    if family is PreconditionerKind.MUON:
        return True
    gradient = [p.after is OpKind.ALLREDUCE_GRAD for p in layer.parts]
    return all(gradient) if any(gradient) else not layer.state_bytes


def ready(streaming: Streaming, stage: StageCost) -> dict[str, float]:
    """The share of the owner's backward done when each of its stage's layers has its gradient final: all at the
    end for a stage whose backward makes them together (`Streaming.whole_backward`), else `ready_fractions`."""
    return dict.fromkeys((x.name for x in stage.layers), 1.0) if streaming.whole_backward else ready_fractions(stage)


def ready_fractions(stage: StageCost) -> dict[str, float]:
    """The share of the stage's (eager) backward done when each layer's gradient is final: as profiled
    (`LayerCost.grad_ready` over the backward, at most 1) where every layer has it; else estimated, the layers (in
    forward order) taking the backward in reverse, each a share as large as its gradient (a linear layer's backward
    FLOPs are proportional to it; the stage's other ops, attention's products and norms, spread with them)."""
    layers, measured = stage.layers, [x.grad_ready for x in stage.layers]
    if layers and stage.bwd > 0 and all(t is not None for t in measured):
        return {x.name: min(1.0, t / stage.bwd) for x, t in zip(layers, measured, strict=True) if t is not None}
    total = sum(x.gradient_bytes for x in layers)
    done, out = 0, {}
    for x in reversed(layers):
        done += x.gradient_bytes
        out[x.name] = done / total if total else 1.0
    return out


def _before_step_end(ops: list[Op], extra: Sequence[Op]) -> list[Op]:
    """`ops` with `extra` before its OPT_STEP (at its end without one)."""
    at = next((i for i, op in enumerate(ops) if op.kind is OpKind.OPT_STEP), len(ops))
    return ops[:at] + list(extra) + ops[at:]


def stream_step(
    ops: Mapping[int, Sequence[Op]], streaming: Streaming, owners: Sequence[int], pieces: int = 1
) -> dict[int, list[Op]]:
    """One step's programs with the streamed layers handed over: each owner (a copy of the stage) sends each layer's
    gradient after the stage's last BWD and receives it preconditioned before its step ends; the helper, before its
    step ends, receives each layer from every owner (their sum is the gradient the copies' all-reduce makes),
    applies it (in `pieces` pieces, `Problem.apply_pieces`) and returns it to every owner, layer by layer (the owners'
    APPLY of those layers is not in `ops`)."""
    s, pairs = streaming.stage, list(zip(streaming.layers, streaming.helpers, strict=True))
    out = {rank: list(body) for rank, body in ops.items()}
    for owner in owners:
        body = out[owner]
        last = max(i for i, op in enumerate(body) if op.kind in (OpKind.BWD, OpKind.BWD_W) and op.stage == s)
        body[last + 1 : last + 1] = [Op(OpKind.SEND_LGRAD, s, peer=h, layer=n) for n, h in pairs]
        back = [Op(OpKind.RECV_PGRAD, s, peer=h, layer=n) for n, h in pairs]
        out[owner] = _before_step_end(body, back)
    for helper in streaming.ranks:
        chain = [
            op
            for n in streaming.layers_of(helper)
            for op in (
                *(Op(OpKind.RECV_LGRAD, s, peer=owner, layer=n) for owner in owners),
                *cut_apply(Op(OpKind.APPLY, s, layer=n), pieces),
                *(Op(OpKind.SEND_PGRAD, s, peer=owner, layer=n) for owner in owners),
            )
        ]
        out[helper] = _before_step_end(out[helper], chain)
    return out


Made = Mapping[str, tuple[Op, int, int]]
"""Per streamed layer: the DECOMP or BCAST that completes a refresh on the first owner, its window step, and the
layer's use offset."""


def made_refreshes(
    streaming: Streaming, placements: Iterable[Placement], timings: Mapping[str, LayerTiming], sender: int
) -> Made:
    """Each streamed layer's op on `sender` (the first owner) after which its refresh is made there: of its DECOMPs
    and BCASTs there (a copied stage broadcasts the halves other copies made), the one its window places last."""
    decomps: dict[str, list[Placement]] = {}
    for p in placements:
        if p.op.kind in (OpKind.DECOMP, OpKind.BCAST) and p.device == sender and p.op.layer in streaming.layers:
            decomps.setdefault(p.op.layer, []).append(p)
    out = {}
    for name, placed in decomps.items():
        last = max(placed, key=lambda p: (p.step, p.end))
        out[name] = (last.op, last.step, timings[name].use_offset)
    return out


def replica_born(streaming: Streaming, owner: int, made: Made) -> dict[int, dict[Op, int]]:
    """The window step from which each replica transfer runs, on the owner and the helper (`startup_programs`):
    its DECOMP's, so that no step sends or awaits a refresh from before step 0."""
    s = streaming.stage
    out: dict[int, dict[Op, int]] = {owner: {}}
    for n, (_, step, _) in made.items():
        helper = streaming.helper_of(n)
        out[owner][Op(OpKind.SEND_REPLICA, s, peer=helper, layer=n)] = step
        out.setdefault(helper, {})[Op(OpKind.RECV_REPLICA, s, peer=owner, layer=n)] = step
    return out


def add_replicas(programs: Mapping[int, Program], streaming: Streaming, owner: int, made: Made) -> dict[int, Program]:
    """The period programs with each streamed layer's replica transfers (`made`: `made_refreshes`, on `owner`, the
    first owner): SEND_REPLICA follows the op that completes a refresh there; RECV_REPLICA runs in the same step on
    the layer's helper (each helper's program unrolled to its and the owner's periods' lcm): before the helper's first
    RECV_LGRAD of the layer when the refresh is first used in that step, else before its step ends."""
    s = streaming.stage
    out = {rank: [list(step) for step in body] for rank, body in programs.items()}
    k_owner = len(out[owner])
    for h in streaming.ranks:
        out[h] = [list(out[h][j % len(out[h])]) for j in range(math.lcm(k_owner, len(out[h])))]
    for layer, (decomp, window_step, use_offset) in made.items():
        helper = streaming.helper_of(layer)
        period = len(out[helper])
        step = out[owner][window_step % k_owner]
        step.insert(step.index(decomp) + 1, Op(OpKind.SEND_REPLICA, s, peer=helper, layer=layer))
        recv = Op(OpKind.RECV_REPLICA, s, peer=owner, layer=layer)
        for j in range(window_step % k_owner, period, k_owner):
            body = out[helper][j]
            if window_step == use_offset:
                first = next(i for i, op in enumerate(body) if op.kind is OpKind.RECV_LGRAD and op.layer == layer)
                body.insert(first, recv)
            else:
                out[helper][j] = _before_step_end(body, [recv])
    return out
