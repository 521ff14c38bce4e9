"""The planner's program IR: printable, round-tripping ops, per-step programs, per-layer timing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from fxkfac.planner.errors import PlanFormatError

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = [
    "OpKind",
    "Op",
    "Program",
    "Programs",
    "LayerTiming",
    "COLLECTIVE_KINDS",
    "SEND_KINDS",
    "RECV_KINDS",
    "as_programs",
    "ops_at",
    "format_program",
    "parse_program",
    "format_programs",
    "parse_programs",
]


class OpKind(StrEnum):
    """What one instruction of a rank's program does."""

    FWD = "FWD"
    BWD = "BWD"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    ALLREDUCE_GRAD = "ALLREDUCE_GRAD"
    CURV = "CURV"
    SYNC_CURV = "SYNC_CURV"
    INV = "INV"
    BCAST_INV = "BCAST_INV"
    PREC = "PREC"
    OPT_STEP = "OPT_STEP"


SEND_KINDS = frozenset({OpKind.SEND_ACT, OpKind.SEND_GRAD})
RECV_KINDS = frozenset({OpKind.RECV_ACT, OpKind.RECV_GRAD})
COLLECTIVE_KINDS = frozenset({OpKind.ALLREDUCE_GRAD, OpKind.SYNC_CURV, OpKind.BCAST_INV})

_SHORT = {OpKind.FWD: "F", OpKind.BWD: "B"}
_BY_NAME = {**{k.value: k for k in OpKind}, **{v: k for k, v in _SHORT.items()}}
# Structured tokens, in the order str(op) writes them; the layer name comes last.
_FIELD_TOKENS = (
    ("stage", re.compile(r"s(\d+)")),
    ("mb", re.compile(r"m(\d+)")),
    ("pipe", re.compile(r"p(\d+)")),
    ("factor", re.compile(r"(A|B)")),
    ("peer", re.compile(r"[<>@]r(\d+)")),
)
_RAW_LAYER = re.compile(r"[A-Za-z0-9_.:/\-\[\]]+")


def _layer_text(layer: str) -> str:
    """A layer name as one token: raw when unambiguous, else JSON-quoted."""
    looks_like_field = any(pattern.fullmatch(layer) for _, pattern in _FIELD_TOKENS)
    if _RAW_LAYER.fullmatch(layer) and not looks_like_field:
        return layer
    return json.dumps(layer)


def _peer_prefix(kind: OpKind) -> str:
    if kind in SEND_KINDS:
        return ">"
    if kind in RECV_KINDS:
        return "<"
    return "@"


@dataclass(frozen=True, slots=True)
class Op:
    """One instruction: `kind` on global (virtual) `stage`, micro-batch `mb` of pipeline `pipe`.

    `layer`/`factor` name K-FAC work ("A" or "B"); `peer` is the other rank of a SEND/RECV
    (for other kinds, a rank the op refers to, e.g. the root of a broadcast).
    `str(op)` is compact ("F s1 m0", "SEND_ACT s1 m0 >r2", "CURV s1 m3 A layer") and
    `Op.parse(str(op)) == op`.
    """

    kind: OpKind
    stage: int | None = None
    mb: int | None = None
    pipe: int = 0
    layer: str | None = None
    factor: str | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, OpKind):
            object.__setattr__(self, "kind", OpKind(self.kind))
        for name in ("stage", "mb", "peer"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise PlanFormatError(f"Op.{name} must be a non-negative int or None, got {value!r}")
        if not isinstance(self.pipe, int) or self.pipe < 0:
            raise PlanFormatError(f"Op.pipe must be a non-negative int, got {self.pipe!r}")
        if self.factor not in (None, "A", "B"):
            raise PlanFormatError(f"Op.factor must be 'A', 'B' or None, got {self.factor!r}")
        if self.layer is not None and (not isinstance(self.layer, str) or not self.layer):
            raise PlanFormatError(f"Op.layer must be a non-empty str or None, got {self.layer!r}")

    def __str__(self) -> str:
        parts = [_SHORT.get(self.kind, self.kind.value)]
        if self.stage is not None:
            parts.append(f"s{self.stage}")
        if self.mb is not None:
            parts.append(f"m{self.mb}")
        if self.pipe:
            parts.append(f"p{self.pipe}")
        if self.factor is not None:
            parts.append(self.factor)
        if self.peer is not None:
            parts.append(f"{_peer_prefix(self.kind)}r{self.peer}")
        if self.layer is not None:
            parts.append(_layer_text(self.layer))
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str) -> Op:
        """The op `str(op)` wrote; raises PlanFormatError naming the text otherwise."""
        head, _, rest = text.strip().partition(" ")
        if head not in _BY_NAME:
            raise PlanFormatError(f"unknown op kind {head!r} in {text!r}; kinds: {sorted(_BY_NAME)}")
        kind = _BY_NAME[head]
        fields: dict[str, Any] = {}  # int or str by name; Op.__post_init__ checks each
        rest = rest.strip()
        for name, pattern in _FIELD_TOKENS:
            token, _, tail = rest.partition(" ")
            match = pattern.fullmatch(token) if token else None
            if match is None:
                continue
            fields[name] = match.group(1) if name == "factor" else int(match.group(1))
            if name == "peer" and token[0] != _peer_prefix(kind):
                raise PlanFormatError(f"peer of {kind} must be written {_peer_prefix(kind)}rN in {text!r}")
            rest = tail.strip()
        if rest:
            fields["layer"] = _parse_layer(rest, text)
        return cls(kind, **fields)


def _parse_layer(rest: str, text: str) -> str:
    if rest.startswith('"'):
        try:
            layer = json.loads(rest)
        except json.JSONDecodeError as e:
            raise PlanFormatError(f"bad quoted layer name in {text!r}: {e}") from e
        if isinstance(layer, str):
            return layer
    elif _RAW_LAYER.fullmatch(rest):
        return rest
    raise PlanFormatError(f"cannot read the layer name {rest!r} in {text!r}")


Program = list[list[Op]]
"""One rank's program: one list of ops per step of the period."""
Programs = dict[int, Program]
"""Programs by rank."""


def _is_step(body: Sequence[Op] | Program) -> TypeIs[Sequence[Op]]:
    """One step's ops rather than a period program; an empty body is an (empty) program."""
    items = list(body)
    return bool(items) and isinstance(items[0], Op)


def as_programs(ops_by_rank: Mapping[int, Sequence[Op]] | Mapping[int, Program]) -> Programs:
    """Programs from either `{rank: [Op, ...]}` (a period of one step) or `{rank: [[Op, ...], ...]}`."""
    result: Programs = {}
    for rank, body in ops_by_rank.items():
        if _is_step(body):
            result[rank] = [list(body)]
        else:
            result[rank] = [list(step) for step in body]
    return result


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
    chunks: dict[int, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(_RANK_MARK):
            rank_text = line[len(_RANK_MARK):].strip()
            if not rank_text.isdigit():
                raise PlanFormatError(f"bad rank header {line!r}; expected '{_RANK_MARK}<int>'")
            current = chunks.setdefault(int(rank_text), [])
        elif current is not None:
            current.append(line)
        elif line.strip() and not line.strip().startswith("#"):
            raise PlanFormatError(f"op {line!r} before any '{_RANK_MARK}R' header")
    return {rank: parse_program("\n".join(lines)) for rank, lines in chunks.items()}


@dataclass(frozen=True, slots=True)
class LayerTiming:
    """When one layer refreshes its factors and uses the inverse (see docs/ARCHITECTURE.md).

    At global step t with `t % period == curv_step` the micro-batches of step t feed a refresh;
    the inverse made from it preconditions steps `t + use_offset` onward. `capture` is
    "fused" or "deferred".
    """

    period: int
    curv_step: int
    use_offset: int
    capture: str
