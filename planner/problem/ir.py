"""The planner's program IR: printable, round-tripping ops, per-step programs, per-layer timing."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from fxkfac.planner.problem.errors import PlanFormatError

if TYPE_CHECKING:
    from typing_extensions import TypeIs

T = TypeVar("T")


class OpKind(StrEnum):
    """What one instruction of a rank's program does. BWD_W ("W") is the weight-gradient half of the BWD of its (stage,
    mb, pipe); naming a layer ("W s0 m1 fc"), that layer's alone (docs/ZERO_BUBBLE.md), else every layer's left."""

    FWD = "FWD"
    BWD = "BWD"
    BWD_W = "BWD_W"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    ALLREDUCE_GRAD = "ALLREDUCE_GRAD"
    STATS = "STATS"
    SYNC_STATS = "SYNC_STATS"
    DECOMP = "DECOMP"
    BCAST = "BCAST"
    APPLY = "APPLY"
    BCAST_PREC = "BCAST_PREC"
    OPT_STEP = "OPT_STEP"
    SEND_LGRAD = "SEND_LGRAD"
    RECV_LGRAD = "RECV_LGRAD"
    SEND_PGRAD = "SEND_PGRAD"
    RECV_PGRAD = "RECV_PGRAD"
    SEND_REPLICA = "SEND_REPLICA"
    RECV_REPLICA = "RECV_REPLICA"


class Capture(StrEnum):
    """How a refresh step takes a layer's statistics: FUSED computes the factors inside its F/B, DEFERRED keeps the
    captured rows for STATS tasks placed in bubbles."""

    FUSED = "fused"
    DEFERRED = "deferred"


LAYER_SENDS: Mapping[OpKind, OpKind] = {
    OpKind.SEND_LGRAD: OpKind.RECV_LGRAD,
    OpKind.SEND_PGRAD: OpKind.RECV_PGRAD,
    OpKind.SEND_REPLICA: OpKind.RECV_REPLICA,
}
"""A streamed layer's transfers (docs/STREAMED_APPLY.md), each send with its receive: its gradient to the helper
(LGRAD), back preconditioned (PGRAD), and its preconditioner at each refresh (REPLICA)."""
SEND_KINDS = frozenset({OpKind.SEND_ACT, OpKind.SEND_GRAD, *LAYER_SENDS})
RECV_KINDS = frozenset({OpKind.RECV_ACT, OpKind.RECV_GRAD, *LAYER_SENDS.values()})
COLLECTIVE_KINDS = frozenset({OpKind.ALLREDUCE_GRAD, OpKind.SYNC_STATS, OpKind.BCAST, OpKind.BCAST_PREC})
LAYER_TRANSFER_KINDS = frozenset({*LAYER_SENDS, *LAYER_SENDS.values()})
PRECONDITIONER_KINDS = frozenset(
    {OpKind.STATS, OpKind.SYNC_STATS, OpKind.DECOMP, OpKind.BCAST, OpKind.APPLY, OpKind.BCAST_PREC}
    | LAYER_TRANSFER_KINDS
)
"""The ops a preconditioner family plugs into a pipeline's program (the plans place them)."""

_SHORT = {OpKind.FWD: "F", OpKind.BWD: "B", OpKind.BWD_W: "W"}
_BY_NAME = {**{k.value: k for k in OpKind}, **{v: k for k, v in _SHORT.items()}}
_FIELD_TOKENS = (
    ("stage", re.compile(r"s\d+"), "s{}"),
    ("mb", re.compile(r"m\d+"), "m{}"),
    ("pipe", re.compile(r"p\d+"), "p{}"),
    ("part", re.compile(r"[A-Z]"), "{}"),
    ("piece", re.compile(r"\d+/\d+"), "{}/{}"),
    ("peer", re.compile(r"[<>]r\d+"), "{to}r{}"),
    ("root", re.compile(r"@r\d+"), "@r{}"),
    ("group", re.compile(r"\{\d+(?:,\d+)*\}"), "{{{}}}"),
)
"""Each structured token of an op's text: its field, pattern and template, in the order `str(op)` writes them (the
layer name comes last; a transfer's peer is written ">rN" to send to, "<rN" to receive from)."""

_FIELDS_OF = {
    **dict.fromkeys((OpKind.FWD, OpKind.BWD), ("stage mb", "pipe")),
    OpKind.BWD_W: ("stage mb", "pipe layer"),
    **dict.fromkeys((OpKind.SEND_ACT, OpKind.RECV_ACT, OpKind.SEND_GRAD, OpKind.RECV_GRAD), ("stage mb peer", "pipe")),
    OpKind.ALLREDUCE_GRAD: ("", "stage"),
    OpKind.STATS: ("stage", "mb pipe layer part"),
    OpKind.SYNC_STATS: ("stage", "layer part"),
    OpKind.DECOMP: ("stage", "layer part piece"),
    OpKind.BCAST: ("stage root", "layer part group"),
    OpKind.APPLY: ("stage", "pipe layer piece"),
    OpKind.BCAST_PREC: ("stage root layer", "group"),
    OpKind.OPT_STEP: ("", ""),
    **dict.fromkeys(LAYER_TRANSFER_KINDS, ("stage peer layer", "")),
}
OP_FIELDS = {kind: (frozenset(need.split()), frozenset(may.split())) for kind, (need, may) in _FIELDS_OF.items()}
"""The fields each kind of op must and may have. Without `layer` (`part`) an op covers every layer (part) of its stage,
without `group` every copy; `piece` (i, n): piece i of n of a DECOMP or of a Muon APPLY's Newton-Schulz iterations."""
_RAW_LAYER = re.compile(r"[A-Za-z0-9_.:/\-\[\]]+")


class _Named(Generic[T]):
    """A typed accessor of an optional field of an op (`Op.stage_id` of `stage`, ...): the value, or PlanFormatError
    where the op names none (a preconditioner's op may cover every layer, part)."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __get__(self, op: Op, owner: type[Op]) -> T:
        value = getattr(op, self.field)
        if value is None:
            raise PlanFormatError(f"{op} names no {self.field}, which this use of a {op.kind.value} needs")
        return value


@dataclass(frozen=True, slots=True)
class Op:
    """One instruction: `kind` on global (virtual) `stage`, micro-batch `mb` of pipeline `pipe`, with the fields
    `OP_FIELDS` allows; `str(op)` is compact ("F s1 m0", "BCAST s1 A @r2 layer") and `Op.parse(str(op)) == op`."""

    kind: OpKind
    stage: int | None = None
    mb: int | None = None
    pipe: int = 0
    layer: str | None = None
    part: str | None = None
    peer: int | None = None
    root: int | None = None
    group: tuple[int, ...] | None = None
    piece: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, OpKind):
            object.__setattr__(self, "kind", OpKind(self.kind))
        for name in ("stage", "mb", "peer", "root", "pipe"):
            value = getattr(self, name)
            if (value is not None or name == "pipe") and (not isinstance(value, int) or value < 0):
                none = "" if name == "pipe" else " or None"
                raise PlanFormatError(f"Op.{name} must be a non-negative int{none}, got {value!r}")
        if self.part is not None and not (isinstance(self.part, str) and re.fullmatch("[A-Z]", self.part)):
            raise PlanFormatError(f"Op.part must be one capital letter or None, got {self.part!r}")
        if self.layer is not None and (not isinstance(self.layer, str) or not self.layer):
            raise PlanFormatError(f"Op.layer must be a non-empty str or None, got {self.layer!r}")
        if self.group is not None:
            group = tuple(self.group) if isinstance(self.group, (tuple, list)) else ()
            ranks = all(isinstance(r, int) and r >= 0 for r in group) and list(group) == sorted(set(group))
            if len(group) < 2 or not ranks or (self.root is not None and self.root not in group):
                raise PlanFormatError(
                    f"Op.group must be two or more ascending distinct ranks holding the root {self.root}, "
                    f"got {self.group!r}"
                )
            object.__setattr__(self, "group", group)
        if self.piece is not None:
            i, n = self.piece if isinstance(self.piece, (tuple, list)) and len(self.piece) == 2 else (None, None)
            if not (isinstance(i, int) and isinstance(n, int) and 0 <= i < n and n >= 2):
                raise PlanFormatError(f"Op.piece must be (i, n) with 0 <= i < n and n >= 2, got {self.piece!r}")
            object.__setattr__(self, "piece", (i, n))
        required, allowed = OP_FIELDS[self.kind]
        present = {name for name in (*(name for name, _, _ in _FIELD_TOKENS), "layer") if self._has(name)}
        if not required <= present or not present <= required | allowed:
            raise PlanFormatError(
                f"{self.kind.value} needs {sorted(required)} and may have {sorted(allowed)}, got {sorted(present)}"
            )

    def _has(self, name: str) -> bool:
        """Whether the op names field `name` (a pipe other than 0, any other field set)."""
        return getattr(self, name) is not None and (name != "pipe" or self.pipe != 0)

    stage_id = _Named[int]("stage")
    mb_id = _Named[int]("mb")
    peer_rank = _Named[int]("peer")
    layer_name = _Named[str]("layer")
    part_name = _Named[str]("part")

    def __str__(self) -> str:
        parts = [_SHORT.get(self.kind, self.kind.value)]
        for name, _, template in _FIELD_TOKENS:
            if self._has(name):
                value = getattr(self, name)
                args = value if name == "piece" else [",".join(map(str, value))] if name == "group" else [value]
                parts.append(template.format(*args, to=">" if self.kind in SEND_KINDS else "<"))
        if self.layer is not None:  # a layer name as one token: raw when unambiguous, else JSON-quoted
            raw = _RAW_LAYER.fullmatch(self.layer) and not any(p.fullmatch(self.layer) for _, p, _ in _FIELD_TOKENS)
            parts.append(self.layer if raw else json.dumps(self.layer))
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str) -> Op:
        """The op `str(op)` wrote; raises PlanFormatError naming the text otherwise."""
        head, _, rest = text.strip().partition(" ")
        if head not in _BY_NAME:
            raise PlanFormatError(f"unknown op kind {head!r} in {text!r}; kinds: {sorted(_BY_NAME)}")
        kind, to = _BY_NAME[head], ">" if _BY_NAME[head] in SEND_KINDS else "<"
        fields: dict[str, Any] = {}  # int, str or tuple by name; Op.__post_init__ checks each
        rest = rest.strip()
        for name, pattern, _ in _FIELD_TOKENS:
            token, _, tail = rest.partition(" ")
            if not token or pattern.fullmatch(token) is None:
                continue
            numbers = tuple(int(n) for n in re.findall(r"\d+", token))
            fields[name] = token if name == "part" else numbers if name in ("piece", "group") else numbers[0]
            if name == "peer" and token[0] != to:
                raise PlanFormatError(f"peer of {kind} must be written {to}rN in {text!r}")
            rest = tail.strip()
        if rest.startswith('"'):
            try:
                fields["layer"] = json.loads(rest)
            except json.JSONDecodeError as e:
                raise PlanFormatError(f"bad quoted layer name in {text!r}: {e}") from e
        elif rest:
            if not _RAW_LAYER.fullmatch(rest):
                raise PlanFormatError(f"cannot read the layer name {rest!r} in {text!r}")
            fields["layer"] = rest
        return cls(kind, **fields)


@dataclass(frozen=True)
class Placement:
    """Where one preconditioner op runs: `device`, window step `step` (0..2k-1), `start` to `end` s into its window."""

    op: Op
    device: int
    step: int
    start: float
    end: float

    def to_dict(self) -> dict[str, object]:
        """JSON-able form."""
        return {"op": str(self.op), "device": self.device, "step": self.step, "start": self.start, "end": self.end}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Placement:
        """Inverse of `to_dict`."""
        return cls(
            Op.parse(str(data["op"])), int(data["device"]), int(data["step"]), float(data["start"]), float(data["end"])
        )


Program = list[list[Op]]
"""One rank's program: one list of ops per step of the period."""
Programs = dict[int, Program]
"""Programs by rank."""
P = TypeVar("P", list[Op], Program)


def is_period(body: Sequence[Op] | Program) -> TypeIs[Program]:
    """A period program (steps of ops) rather than one step's ops; an empty body is one (empty) step."""
    items = list(body)
    return bool(items) and not isinstance(items[0], Op)


def per_step(body: P, lower: Callable[[Sequence[Op]], list[Op]]) -> P:
    """`lower` of each step of a period program, or of one step's ops."""
    return [lower(step) for step in body] if is_period(body) else lower(body)


def as_programs(ops_by_rank: Mapping[int, Sequence[Op]] | Mapping[int, Program]) -> Programs:
    """Programs from either `{rank: [Op, ...]}` (a period of one step) or `{rank: [[Op, ...], ...]}`."""
    return {rank: [list(s) for s in body] if is_period(body) else [list(body)] for rank, body in ops_by_rank.items()}


def ops_at(programs: Mapping[int, Program], startup: Mapping[int, Program], rank: int, step: int) -> list[Op]:
    """What `rank` executes at global step `step`: its start-up steps while they last, then its period."""
    first = startup.get(rank, [])
    if step < len(first):
        return first[step]
    program = programs[rank]
    return program[step % len(program)]


_STEP_MARK = "---"
_RANK_MARK = "=== rank "


def format_program(program: Iterable[Sequence[Op]]) -> str:
    """One op per line, a `---` line between steps (golden-file text)."""
    return f"\n{_STEP_MARK}\n".join("\n".join(str(op) for op in step) for step in program) + "\n"


def parse_program(text: str) -> Program:
    """Inverse of `format_program`; blank lines and `#` comments are ignored."""
    steps: Program = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line == _STEP_MARK:
            steps.append([])
        else:
            steps[-1].append(Op.parse(line))
    return steps


def format_programs(programs: Mapping[int, Iterable[Sequence[Op]]]) -> str:
    """Every rank's program under a `=== rank R` header, ranks ascending."""
    return "".join(f"{_RANK_MARK}{rank}\n{format_program(programs[rank])}" for rank in sorted(programs))


def parse_programs(text: str) -> Programs:
    """Inverse of `format_programs`."""
    head, *chunks = re.split(f"^{_RANK_MARK}(.*)$", text, flags=re.MULTILINE)
    if parse_program(head) != [[]]:
        raise PlanFormatError(f"ops before any '{_RANK_MARK}R' header: {head.strip()!r}")
    programs: Programs = {}
    for rank_text, body in zip(chunks[::2], chunks[1::2], strict=True):
        if not rank_text.strip().isdigit():
            raise PlanFormatError(f"bad rank header {_RANK_MARK}{rank_text!r}; expected '{_RANK_MARK}<int>'")
        programs[int(rank_text)] = parse_program(body)
    return programs


@dataclass(frozen=True, slots=True)
class LayerTiming:
    """When one layer refreshes: step t with `t % period == curv_step` feeds a refresh, used from step
    `t + use_offset` on; `capture` how its statistics are taken."""

    period: int
    curv_step: int
    use_offset: int
    capture: Capture

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "capture", Capture(self.capture))
        except ValueError:
            raise PlanFormatError(
                f"LayerTiming.capture must be one of {[c.value for c in Capture]}, got {self.capture!r}"
            ) from None


NS_STEPS = 5
"""Newton-Schulz iterations per step the planner prices pieces with (MuonConfig's `ns_steps` default)."""


def piece_iterations(piece: tuple[int, int] | None, ns_steps: int = NS_STEPS) -> range:
    """The iterations piece (i, n) of a matrix's APPLY runs: [i*S//n, (i+1)*S//n) of S = ns_steps (all: None)."""
    i, n = piece or (0, 1)
    return range(i * ns_steps // n, (i + 1) * ns_steps // n)


def piece_share(piece: tuple[int, int] | None) -> float:
    """The share of its matrix's APPLY seconds piece (i, n) takes: its iterations' share of `NS_STEPS`."""
    return len(piece_iterations(piece)) / NS_STEPS


def cut_apply(op: Op, pieces: int) -> list[Op]:
    """A layer's APPLY as `pieces` pieces in order (itself when 1)."""
    assert op.kind is OpKind.APPLY and op.layer is not None, "only one layer's APPLY is cut"
    return [op] if pieces == 1 else [replace(op, piece=(i, pieces)) for i in range(pieces)]
