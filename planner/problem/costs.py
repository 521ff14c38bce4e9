"""Cost tables: what each stage and preconditioned layer costs in seconds and bytes (+ JSON), the family they price
(`CostTable.family`, whose `WORDS` the views speak in), and what collectives cost (`CostTable.comm`)."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from fxkfac.planner.problem.errors import CostModelError
from fxkfac.planner.problem.hardware import Collective, CommModel, check_count, check_number, parse_json
from fxkfac.planner.problem.hardware import seconds as comm_seconds
from fxkfac.planner.problem.ir import LAYER_SENDS, Op, OpKind

SCHEMA_VERSION = 1  # of the cost-table JSON layout; `CostTable.from_json` refuses any other
COUNT_BYTES = 4  # the micro-batch count a SYNC_STATS all-reduces with each statistic (one fp32 element)
_SPREAD = "_spread"  # suffix of the field that holds the `Spread` of the time field it follows (`bwd_spread`)


def _check_fields(obj: Any, owner: str) -> None:
    """Refuse a malformed field of a cost object: nested objects of another class, a spread not a `Spread`, or a
    number `check_number` refuses (`*_bytes` ints; an unmeasured None passes)."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.name in _NESTED:
            kind = _NESTED[f.name]
            if not isinstance(value, tuple) or not all(isinstance(x, kind) for x in value):
                raise CostModelError(f"{owner}: {f.name} must be a tuple of {kind.__name__}")
        elif f.name.endswith(_SPREAD):
            if value is not None and not isinstance(value, Spread):
                raise CostModelError(f"{owner}: {f.name} must be a Spread {{low, high}} or None, got {value!r}")
        elif (f.name in _SCALES or f.name.endswith("_bytes")) and not (value is None and f.default is None):
            check_number(owner, f.name, value, integer=f.name.endswith("_bytes"))


@dataclass(frozen=True, slots=True)
class Spread:
    """The fastest and slowest of a profiled time's repeats, in seconds (the profiler plans with the fastest)."""

    low: float
    high: float

    def __post_init__(self) -> None:
        check_number("Spread", "low", self.low)
        check_number("Spread", "high", self.high)
        if self.low > self.high:
            raise CostModelError(f"Spread: low {self.low!r} exceeds high {self.high!r}")


@dataclass(frozen=True, slots=True)
class PartCost:
    """One part of a layer's preconditioner (K-FAC's factors A and B): `after` the op whose end makes its capture
    (FWD, BWD, or ALLREDUCE_GRAD every step), `stats` seconds per micro-batch's statistic, `decomp` seconds,
    `capture_bytes` a deferred capture's, `state_bytes` the statistic's (its decomposition's too)."""

    part: str
    after: OpKind
    stats: float
    decomp: float
    capture_bytes: int
    state_bytes: int
    stats_spread: Spread | None = None
    decomp_spread: Spread | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.part, str) or len(self.part) != 1 or not self.part.isupper():
            raise CostModelError(f"PartCost.part must be one capital letter, got {self.part!r}")
        if self.after not in (OpKind.FWD, OpKind.BWD, OpKind.ALLREDUCE_GRAD):
            raise CostModelError(f"PartCost.after must be FWD, BWD or ALLREDUCE_GRAD, got {self.after!r}")
        _check_fields(self, f"part {self.part!r}")


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One preconditioned layer: its parts (none for a Muon matrix), `prec` seconds of its APPLY per step,
    `state_bytes` of optimizer state besides the statistics, `grad_bytes` of its gradient (0: unknown)."""

    name: str
    parts: tuple[PartCost, ...]
    prec: float
    state_bytes: int = 0
    grad_bytes: int = 0
    prec_spread: Spread | None = None
    grad_ready: float | None = None  # from its stage's backward start until its gradient is final; None: estimated
    hand_off: float = 0.0  # a streamed layer's owner making its message in the last backward's gradient hook
    take_back: float = 0.0  # the owner installing what its helper returns (the helper packs it about as long)
    wgrad: float | None = None  # one micro-batch's W of this layer alone, part of its stage's `wgrad`; None: unknown

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise CostModelError(f"LayerCost.name must be a non-empty string, got {self.name!r}")
        _check_fields(self, f"layer {self.name!r}")
        if len({p.part for p in self.parts}) != len(self.parts):
            raise CostModelError(f"layer {self.name!r}: parts {[p.part for p in self.parts]} repeat a name")

    @classmethod
    def kfac(
        cls,
        name: str,
        curv_a: float,
        curv_b: float,
        inv_a: float,
        inv_b: float,
        prec: float,
        a_bytes: int,
        e_bytes: int,
        factor_a_bytes: int,
        factor_b_bytes: int,
        grad_bytes: int = 0,
    ) -> LayerCost:
        """A K-FAC layer: factors A (after FWD) and B (after BWD); B^-1 G A^-1 in prec."""
        return cls(
            name,
            (
                PartCost("A", OpKind.FWD, curv_a, inv_a, a_bytes, factor_a_bytes),
                PartCost("B", OpKind.BWD, curv_b, inv_b, e_bytes, factor_b_bytes),
            ),
            prec,
            grad_bytes=grad_bytes,
        )

    def part(self, name: str) -> PartCost:
        """The cost of part `name`; CostModelError when the layer has none such."""
        for p in self.parts:
            if p.part == name:
                return p
        raise CostModelError(f"layer {self.name!r} has parts {[p.part for p in self.parts]}, not {name!r}")

    @property
    def curv(self) -> float:
        """Seconds of the statistics of every part per micro-batch."""
        return sum(p.stats for p in self.parts)

    @property
    def inv(self) -> float:
        """Seconds to decompose every part."""
        return sum(p.decomp for p in self.parts)

    @property
    def factor_bytes(self) -> int:
        """Bytes of every part's statistic (the same again for the decompositions)."""
        return sum(p.state_bytes for p in self.parts)

    @property
    def gradient_bytes(self) -> int:
        """`grad_bytes`, or when unknown (older files) a two-part layer's factor sides' product, fp32."""
        if self.grad_bytes or len(self.parts) != 2:
            return self.grad_bytes
        a, b = (math.isqrt(p.state_bytes // 4) for p in self.parts)
        return a * b * 4

    @property
    def capture_bytes(self) -> int:
        """Bytes one micro-batch keeps when the layer defers its captures."""
        return sum(p.capture_bytes for p in self.parts)


@dataclass(frozen=True, slots=True)
class StageCost:
    """One pipeline stage: per-micro-batch forward/backward seconds, memory (`act_bytes` per micro-batch in flight,
    `peak_err_bytes` one backward's transient peak) and its layers; optional fields 0 or None where not measured."""

    fwd: float
    bwd: float
    param_bytes: int
    act_bytes: int
    layers: tuple[LayerCost, ...]
    peak_err_bytes: int = 0
    fwd_spread: Spread | None = None
    bwd_spread: Spread | None = None
    tap_fwd: float = 0.0  # what a refresh step adds to one micro-batch's forward by tapping the captured layers
    tap_bwd: float = 0.0  # the same for one micro-batch's backward (the probes' gradients)
    fused_fwd: float | None = None  # a forward beyond `tap_fwd` with all curvature fused (None: its statistics')
    fused_bwd: float | None = None  # the same for one micro-batch's backward
    boundary_bytes: int = 0  # what one micro-batch keeps from forward to backward when the stage recomputes
    wgrad: float | None = None  # of `bwd`, the weight gradient (a zero-bubble W); None: half the backward

    def __post_init__(self) -> None:
        _check_fields(self, "stage")
        if self.wgrad is not None and self.wgrad > self.bwd:
            raise CostModelError(f"StageCost.wgrad ({self.wgrad}) is part of the backward ({self.bwd}): at most bwd")

    @property
    def weight_grad(self) -> float:
        """Seconds of one micro-batch's W (the backward's weight-gradient part): `wgrad`, else half of `bwd`."""
        return self.bwd / 2 if self.wgrad is None else self.wgrad

    def fused_curvature(self, names: Collection[str], after: OpKind) -> float:
        """Seconds fusing the curvature of `names` adds to a refresh step's forward (`after` FWD) or backward: the
        measured `fused_fwd` / `fused_bwd` shared in proportion to their statistics' times, else those times."""
        priced = sum(p.stats for x in self.layers if x.name in names for p in x.parts if p.after is after)
        measured = self.fused_fwd if after is OpKind.FWD else self.fused_bwd
        if measured is None or priced == 0:
            return priced
        return measured * priced / self.stats_after(after)

    def stats_after(self, *kinds: OpKind) -> float:
        """Seconds of one micro-batch's statistics of the parts captured after one of `kinds` (`PartCost.after`)."""
        return sum(p.stats for x in self.layers for p in x.parts if p.after in kinds)

    @property
    def curv(self) -> float:
        """Seconds of curvature of all layers for one micro-batch (T_curv of the paper)."""
        return sum(layer.curv for layer in self.layers)

    @property
    def inv(self) -> float:
        """Seconds to invert every factor of the stage (T_inv)."""
        return sum(layer.inv for layer in self.layers)

    @property
    def prec(self) -> float:
        """Seconds of preconditioning per step (T_prec)."""
        return sum(layer.prec for layer in self.layers)

    @property
    def factor_bytes(self) -> int:
        """Bytes of all factors of the stage (M_curv; the inverses M_inv are as large)."""
        return sum(layer.factor_bytes for layer in self.layers)

    @property
    def deferred_bytes(self) -> int:
        """Bytes one micro-batch keeps when every layer defers its capture (a and e)."""
        return sum(layer.capture_bytes for layer in self.layers)


class PreconditionerKind(StrEnum):
    """A family the planner has a cost model for: the family a cost table prices (`CostTable.family`)."""

    KFAC = "kfac"
    SHAMPOO = "shampoo"
    SOAP = "soap"
    MUON = "muon"


def streamed_bytes(layer: LayerCost, kind: OpKind) -> int:
    """Bytes of a streamed layer's hand-off: its gradient each way, with gradient-fed statistics also its parameter
    out and its statistics and state back."""
    if not any(p.after is OpKind.ALLREDUCE_GRAD for p in layer.parts):
        return layer.gradient_bytes
    if kind is OpKind.SEND_LGRAD:
        return 2 * layer.gradient_bytes
    return layer.gradient_bytes + layer.factor_bytes + layer.state_bytes


@dataclass(frozen=True, slots=True)
class CostTable:
    """Costs of every stage of one model at one micro-batch size, where they came from (`source`, e.g.
    "pipefisher-csv:bert-base_time_memory_p100.csv"), what collectives cost (None: nothing) and the family priced."""

    stages: tuple[StageCost, ...]
    micro_batch_size: int
    source: str
    hardware: str
    comm: CommModel | None = None
    family: PreconditionerKind = PreconditionerKind.KFAC

    def __post_init__(self) -> None:
        if not isinstance(self.family, PreconditionerKind):
            raise CostModelError(f"CostTable.family must be a PreconditionerKind, got {self.family!r}")
        if self.comm is not None and not isinstance(self.comm, CommModel):
            raise CostModelError(f"CostTable.comm must be a CommModel or None, got {type(self.comm).__name__}")
        _check_fields(self, "CostTable")
        if not self.stages:
            raise CostModelError("CostTable.stages must be a non-empty tuple of StageCost")
        check_count("CostTable.micro_batch_size", self.micro_batch_size)
        dupes = sorted(n for n, k in Counter(self.layer_names).items() if k > 1)
        if dupes:
            raise CostModelError(f"CostTable: layer names must be unique across stages; repeated: {dupes}")

    @property
    def layers(self) -> tuple[LayerCost, ...]:
        """Every layer, stage by stage."""
        return tuple(x for s in self.stages for x in s.layers)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(x.name for x in self.layers)

    def layer(self, name: str) -> LayerCost:
        """The cost of layer `name`."""
        return next(x for x in self.stages[self.stage_of(name)].layers if x.name == name)

    def stage_of(self, layer: str) -> int:
        """Index of the stage that holds `layer`."""
        for i, s in enumerate(self.stages):
            if any(x.name == layer for x in s.layers):
                return i
        raise CostModelError(f"no layer {layer!r} in the cost table; known: {list(self.layer_names)}")

    def collective_seconds(self, op: Op, group_size: int) -> float:
        """Seconds of collective `op` over `group_size` ranks under `comm`, summed over the runtime's messages, rounded
        up to a whole microsecond (an exact time grid)."""
        if op.stage is None:
            raise CostModelError(f"{op} names no stage: its bytes are unknown")
        stage = self.stages[op.stage]
        layers = [x for x in stage.layers if op.layer in (None, x.name)]
        parts = [p for x in layers for p in x.parts if op.part in (None, p.part)]
        if op.kind is OpKind.ALLREDUCE_GRAD:
            messages = [(Collective.ALL_REDUCE, stage.param_bytes)]
        elif op.kind is OpKind.SYNC_STATS:
            messages = [(Collective.ALL_REDUCE, p.state_bytes + COUNT_BYTES) for p in parts]
        elif op.kind in (OpKind.BCAST, OpKind.SEND_REPLICA):
            kind = Collective.BROADCAST if op.kind is OpKind.BCAST else Collective.SEND
            messages = [(kind, p.state_bytes) for p in parts]
        elif op.kind is OpKind.BCAST_PREC:
            messages = [(Collective.BROADCAST, x.gradient_bytes) for x in layers]
        elif op.kind in (OpKind.SEND_LGRAD, OpKind.SEND_PGRAD):
            messages = [(Collective.SEND, streamed_bytes(x, op.kind)) for x in layers]
        else:
            raise CostModelError(f"{op} is not a collective the cost table prices")
        total = sum(comm_seconds(self.comm, kind, n, group_size) for kind, n in messages)
        return math.ceil(total * 1e6 - 1e-6) / 1e6

    def message_cpu(self, op: Op, share: int = 1) -> float:
        """CPU seconds the streamed transfer `op` (a SEND_LGRAD, SEND_PGRAD or its RECV) costs its rank's process: its
        unit's bytes and a `share`-th of its message's fixed cost (a bucket's units split it); 0 unmeasured."""
        if self.comm is None or op.layer is None:
            return 0.0
        sends = {recv: send for send, recv in LAYER_SENDS.items()}
        receiving = op.kind in sends
        cpu = self.comm.recv_cpu if receiving else self.comm.send_cpu
        nbytes = streamed_bytes(self.layer(op.layer), sends[op.kind] if receiving else op.kind)
        return cpu.alpha / share + cpu.beta * nbytes

    def bucket_seconds(self, sends: Iterable[Op]) -> float:
        """Seconds of one message carrying the streamed `sends` together (a bucket), rounded as `collective_seconds`."""
        nbytes = sum(streamed_bytes(self.layer(op.layer), op.kind) for op in sends if op.layer is not None)
        return math.ceil(comm_seconds(self.comm, Collective.SEND, nbytes, 2) * 1e6 - 1e-6) / 1e6

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form with the schema version; fields at their default (unmeasured, K-FAC) left out."""
        return {"schema_version": SCHEMA_VERSION, **_plain(self)}

    def to_json(self, *, indent: int | None = 1) -> str:
        """JSON text (`from_json` reads it back to an equal table)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any) -> CostTable:
        """Build from `to_dict` output; every malformed piece raises CostModelError saying which."""
        if not isinstance(data, dict):
            raise CostModelError(f"a cost table must be a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise CostModelError(
                f"cost table schema_version {version!r} is not supported (expected {SCHEMA_VERSION}); "
                "re-create it with this version of fxkfac"
            )
        try:
            stages = tuple(_load(StageCost, s) for s in data["stages"])
            comm = CommModel.from_dict(data["comm"]) if data.get("comm") is not None else None
            head = str(data["source"]).split(":", 1)[0]  # an older file: the family its source begins with, or K-FAC
            family = data.get("family", head if head in set(PreconditionerKind) else PreconditionerKind.KFAC)
            if family not in set(PreconditionerKind):
                raise CostModelError(f"cost table family {family!r} is not one of {', '.join(PreconditionerKind)}")
            kind = PreconditionerKind(family)
            return cls(stages, data["micro_batch_size"], data["source"], data["hardware"], comm, kind)
        except KeyError as e:
            raise CostModelError(f"cost table is missing the key {e.args[0]!r}") from e
        except TypeError as e:
            raise CostModelError(f"cost table has a malformed entry: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> CostTable:
        return cls.from_dict(parse_json(text, "cost table"))

    def save(self, path: str | Path) -> None:
        """Write the JSON form to `path`."""
        Path(path).write_text(self.to_json())

    def scale_times(self, factor: float) -> CostTable:
        """Every time multiplied by `factor` (a faster or slower device); bytes unchanged."""
        check_number("scale_times", "factor", factor)
        return _scaled(self, dict.fromkeys((_Scale.PASS, _Scale.STATS, _Scale.STEP), factor))

    def scale_kfac_times(self, factor: float) -> CostTable:
        """Preconditioner times multiplied by `factor` (a margin); F/B (a layer's W too) and bytes unchanged."""
        check_number("scale_kfac_times", "factor", factor)
        return _scaled(self, dict.fromkeys((_Scale.STATS, _Scale.STEP), factor))

    def with_micro_batch_size(self, micro_batch_size: int) -> CostTable:
        """Costs at another micro-batch size: per-micro-batch times and bytes scale by new/old, the rest stay."""
        check_count("micro_batch_size", micro_batch_size)
        ratio = micro_batch_size / self.micro_batch_size
        scaled = _scaled(self, dict.fromkeys((_Scale.PASS, _Scale.STATS, _Scale.BYTES), ratio))
        return replace(scaled, micro_batch_size=micro_batch_size)


class _Scale(StrEnum):
    """How a cost field scales: a forward/backward time per micro-batch (PASS), a statistic's time per micro-batch
    (STATS), a preconditioner time per step (STEP), or bytes per micro-batch (BYTES); a spread as its time."""

    PASS = "pass"
    STATS = "stats"
    STEP = "step"
    BYTES = "bytes"


_DIFFERENCES = frozenset({"tap_fwd", "tap_bwd", "fused_fwd", "fused_bwd", "wgrad", "grad_ready"})
"""Times measured as a difference of two times of one measurement, whose fastest would be too low."""

_SCALES = {
    **dict.fromkeys(("fwd", "bwd", *_DIFFERENCES), _Scale.PASS),
    "stats": _Scale.STATS,
    **dict.fromkeys(("decomp", "prec", "hand_off", "take_back"), _Scale.STEP),
    **dict.fromkeys(("capture_bytes", "act_bytes", "peak_err_bytes", "boundary_bytes"), _Scale.BYTES),
}
"""The `_Scale` of each scaled field of PartCost, LayerCost and StageCost (the rest: names and fixed bytes)."""

_TIMES = frozenset(name for name, scale in _SCALES.items() if scale is not _Scale.BYTES)  # the time fields
_OPTIONAL = _DIFFERENCES | {"boundary_bytes", "hand_off", "take_back", "comm", "family"}  # files omit at default
_NESTED: dict[str, type] = {"stages": StageCost, "layers": LayerCost, "parts": PartCost}  # tuples of cost objects


def _plain(obj: Any, times: bool = True) -> dict[str, Any]:
    """`obj` (a cost object or table) as JSON-able values, each optional field and spread at its default left out
    (with `times` False every time and spread: what it says besides them)."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        value, spread = getattr(obj, f.name), f.name.endswith(_SPREAD)
        timed = spread or f.name in _TIMES
        if ((f.name in _OPTIONAL or spread) and value == f.default) or (timed and not times):
            continue
        if f.name in _NESTED:
            value = [_plain(x, times) for x in value]
        out[f.name] = asdict(value) if isinstance(value, (Spread, CommModel)) else value
    return out


def _load(cls: type, data: dict[str, Any]) -> Any:
    """A `cls` cost object from its `_plain` form; a layer of a file from before parts (K-FAC's fields) as K-FAC's."""
    if cls is LayerCost and "parts" not in data:
        return LayerCost.kfac(**data)
    values = dict(data)
    for key, value in data.items():
        if key in _NESTED:
            values[key] = tuple(_load(_NESTED[key], x) for x in value)
        elif key.endswith(_SPREAD) and isinstance(value, dict):
            values[key] = Spread(**value)
    if "after" in values:
        values["after"] = OpKind(values["after"])
    return cls(**values)


_KEEP = object()  # what a `_merged` leaf returns for a field it leaves as it is


def _merged(objs: Sequence[Any], leaf: Callable[[str, list[Any]], Any]) -> Any:
    """The first of `objs` (cost objects or tables alike) with each field `leaf(name, their values)` makes anew,
    nested objects field by field; a stage's W at most its backward."""
    changes: dict[str, Any] = {}
    for f in fields(objs[0]):
        values = [getattr(x, f.name) for x in objs]
        if f.name in _NESTED:
            changes[f.name] = tuple(_merged(xs, leaf) for xs in zip(*values, strict=True))
        elif (value := leaf(f.name, values)) is not _KEEP:
            changes[f.name] = value
    if changes.get("wgrad") is not None and "bwd" in changes:
        changes["wgrad"] = min(changes["wgrad"], changes["bwd"])
    return replace(objs[0], **changes)


def _scaled(obj: Any, factors: dict[_Scale, float]) -> Any:
    """`obj` (a cost object or table) with each measured field of a scale in `factors` times its factor, nested."""

    def leaf(name: str, values: list[Any]) -> Any:
        value, scale = values[0], _SCALES.get(name.removesuffix(_SPREAD))
        if scale not in factors or value is None:
            return _KEEP
        factor = factors[scale]
        if isinstance(value, Spread):
            return Spread(value.low * factor, value.high * factor)
        return round(value * factor) if scale is _Scale.BYTES else value * factor

    return _merged([obj], leaf)


def median_of(tables: Sequence[CostTable]) -> CostTable:
    """The figure-wise median of the ranks' profiles of one split, spreads covering theirs, bytes the first's."""
    first = tables[0]

    def untimed(table: CostTable) -> tuple[Any, ...]:
        return (table.micro_batch_size, *(_plain(s, times=False) for s in table.stages))

    for other in tables[1:]:
        if untimed(other) != untimed(first):
            raise CostModelError(
                "the ranks' profiles are of different splits or sizes (stages, layers or bytes differ); every rank "
                "must compile the same model with the same example inputs"
            )
    stages = tuple(combined_stage(of, statistics.median) for of in zip(*(t.stages for t in tables), strict=True))
    return replace(first, stages=stages)


Reduce = Callable[[list[float]], float]  # how measurements of one time make the planned one (min, median)


def combined_stage(stages: Sequence[StageCost], time: Reduce) -> StageCost:
    """One stage's costs from several measurements of it: times by `time`, `_DIFFERENCES` by the median of those
    measured, spreads covering theirs, bytes the first's."""

    def leaf(name: str, values: list[Any]) -> Any:
        known = [v for v in values if v is not None]
        if name.endswith(_SPREAD):
            return Spread(min(s.low for s in known), max(s.high for s in known)) if known else None
        if name in _DIFFERENCES:
            return statistics.median(known) if known else None
        return time(values) if name in _TIMES else _KEEP

    return _merged(stages, leaf)


class InverseMethod(StrEnum):
    """How K-FAC inverts a damped factor (`KFACConfig.inverse`): Cholesky, or an eigendecomposition."""

    CHOLESKY = "cholesky"
    EIGEN = "eigen"


@dataclass(frozen=True, slots=True)
class TaskWords:
    """How one family names itself, its STATS, DECOMP and APPLY, and what its collectives carry (`synced`)."""

    name: str
    stats: str
    decomp: str
    apply: str
    synced: str


WORDS: dict[PreconditionerKind, TaskWords] = {
    PreconditionerKind.KFAC: TaskWords("K-FAC", "curvature", "inversion", "precondition", "grad/curv/inverse"),
    PreconditionerKind.SHAMPOO: TaskWords("Shampoo", "statistics", "root inverse", "precondition", "grad/roots"),
    PreconditionerKind.SOAP: TaskWords("SOAP", "statistics", "eigenbasis", "rotate + Adam", "grad/bases"),
    PreconditionerKind.MUON: TaskWords("Muon", "statistics", "decomposition", "Newton-Schulz", "grad"),
}
"""The words of every family (the one place they are written)."""


def words_of(costs: CostTable) -> TaskWords:
    """The words of the family a cost table is for."""
    return WORDS[costs.family]


def tied_owner(stages: Sequence[int]) -> int:
    """The owner of a parameter the `stages` share (tied weights): the lowest, whose gradient the backward completes
    last, so that after its ALLREDUCE_GRAD every stage's share is there."""
    if not stages:
        raise ValueError("a tied parameter is used by at least one stage")
    return min(stages)
