"""Cost tables: what each stage and K-FAC layer costs in seconds and bytes (+ JSON, + PipeFisher CSV), and what
communication costs between the devices (`CostTable.comm`, planner/comm.py).

The PipeFisher paper's measured profiles ship in planner/data/pipefisher_profiles/ and are named
without a path as `paper:<model>/<hardware>` (`paper_profile_names()`) wherever a profile CSV is taken.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from importlib.resources import files
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from fxkfac.planner.comm import Collective, CommModel
from fxkfac.planner.comm import seconds as comm_seconds
from fxkfac.planner.errors import CostModelError
from fxkfac.planner.hardware import HARDWARE
from fxkfac.planner.ir import Op, OpKind

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = [
    "Spread",
    "PartCost",
    "SCHEMA_VERSION",
    "COUNT_BYTES",
    "LayerCost",
    "StageCost",
    "CostTable",
    "PIPEFISHER_COLUMNS",
    "PAPER_PREFIX",
    "paper_profile_names",
    "is_profile",
    "cost_table_from_pipefisher_csv",
    "load_cost_table",
]

SCHEMA_VERSION = 1
"""Version of the cost-table JSON layout; `CostTable.from_json` refuses any other."""

PIPEFISHER_COLUMNS = (
    "bs", "time_f", "time_b", "time_kron", "time_inv", "time_prec",
    "mem_param", "mem_act", "mem_peak_err", "mem_save_err", "mem_kron",
)  # fmt: skip
"""Columns of the PipeFisher profiles (planner/data/pipefisher_profiles/*.csv; ms and MiB per Transformer block)."""

PAPER_PREFIX = "paper:"
"""`paper:<model>/<hardware>` names a profile shipped in planner/data/pipefisher_profiles/."""

_PROFILE_MARK = "_time_memory_"  # the shipped files are <model>_time_memory_<hardware>.csv
_PROFILE_OPTIONS = ("blocks_per_stage", "micro_batch_size")

_MS = 1e-3
_MIB = 1 << 20

COUNT_BYTES = 4
"""Bytes of the micro-batch count a SYNC_STATS all-reduces with each statistic (one element of the fp32
statistics; the runtime appends it to the flattened sum)."""


_SPREAD = "_spread"
"""Suffix of the field that holds the `Spread` of the time field it follows (`bwd` -> `bwd_spread`)."""


def _check_number(owner: str, field: str, value: Any, *, integer: bool) -> None:
    """Refuse a negative, non-finite or wrongly typed cost, naming where it sits."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        want = "an int (bytes)" if integer else "a number (seconds)"
        raise CostModelError(f"{owner}: {field} must be {want}, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise CostModelError(f"{owner}: {field} must be finite and >= 0, got {value!r}")


def _check_fields(obj: Any, owner: str, byte_fields: frozenset[str], skip: frozenset[str]) -> None:
    for f in fields(obj):
        if f.name not in skip and not f.name.endswith(_SPREAD):
            _check_number(owner, f.name, getattr(obj, f.name), integer=f.name in byte_fields)


@dataclass(frozen=True, slots=True)
class Spread:
    """The fastest and slowest of a profiled time's repeats, in seconds (the profiler plans with the fastest).

    (min, max) rather than quartiles: a profile takes a handful of repeats (5 by default), whose quartiles are
    barely other samples, and the extremes show at once how far a busy machine moved one figure. Tables from a
    file or a preset have none (None)."""

    low: float
    high: float

    def __post_init__(self) -> None:
        _check_number("Spread", "low", self.low, integer=False)
        _check_number("Spread", "high", self.high, integer=False)
        if self.low > self.high:
            raise CostModelError(f"Spread: low {self.low!r} exceeds high {self.high!r}")

    @property
    def width(self) -> float:
        """Seconds between the slowest and the fastest repeat."""
        return self.high - self.low

    def scaled(self, factor: float) -> Spread:
        """Both ends multiplied by `factor` (as the time they belong to is)."""
        return Spread(self.low * factor, self.high * factor)


def _check_spreads(obj: Any, owner: str) -> None:
    """Each `<time>_spread` field is None or a Spread. Whether it still holds its time is not checked: a time
    changed by hand keeps the spread it was measured with (the CostTable helpers scale both)."""
    for f in fields(obj):
        spread = getattr(obj, f.name)
        if f.name.endswith(_SPREAD) and spread is not None and not isinstance(spread, Spread):
            raise CostModelError(f"{owner}: {f.name} must be a Spread or None, got {spread!r}")


def _scaled(spread: Spread | None, factor: float) -> Spread | None:
    return None if spread is None else spread.scaled(factor)


@dataclass(frozen=True, slots=True)
class PartCost:
    """What one part of a layer's preconditioner costs per refresh (K-FAC's parts: the factors A and B).

    after: the op whose end makes the part's capture (FWD: the layer input; BWD: its output gradient;
    ALLREDUCE_GRAD: the stage's reduced gradient, a statistic taken at every step before APPLY);
    stats: seconds to turn one micro-batch's capture (a gradient part: one step's gradient) into its
    statistic; decomp: seconds to decompose (invert) the statistic; capture_bytes: what a *deferred*
    capture keeps per micro-batch (0 for a gradient part); state_bytes: the statistic (its decomposition
    is as large); stats_spread, decomp_spread: the fastest and slowest repeat of a profiled stats / decomp
    (`Spread`; None when not measured here).
    """

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
        _check_fields(self, f"part {self.part!r}", frozenset({"capture_bytes", "state_bytes"}),
                      frozenset({"part", "after"}))
        _check_spreads(self, f"part {self.part!r}")


@dataclass(frozen=True, slots=True)
class LayerCost:
    """What one preconditioned layer costs: its parts, `prec` seconds to apply its preconditioner per step,
    `state_bytes` of per-step optimizer state besides the parts' statistics (Shampoo's graft state and
    momentum, SOAP's Adam moments), held for the whole run, and `grad_bytes` of its gradient (what a grad worker
    broadcasts when it preconditions the layer for other copies; 0: unknown, see `gradient_bytes`);
    `prec_spread` the fastest and slowest repeat of a profiled `prec` (None when not measured here)."""

    name: str
    parts: tuple[PartCost, ...]
    prec: float
    state_bytes: int = 0
    grad_bytes: int = 0
    prec_spread: Spread | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise CostModelError(f"LayerCost.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.parts, tuple) or not self.parts or not all(isinstance(p, PartCost) for p in self.parts):
            raise CostModelError(f"layer {self.name!r}: parts must be a non-empty tuple of PartCost")
        if len({p.part for p in self.parts}) != len(self.parts):
            raise CostModelError(f"layer {self.name!r}: parts {[p.part for p in self.parts]} repeat a name")
        _check_number(f"layer {self.name!r}", "prec", self.prec, integer=False)
        _check_number(f"layer {self.name!r}", "state_bytes", self.state_bytes, integer=True)
        _check_number(f"layer {self.name!r}", "grad_bytes", self.grad_bytes, integer=True)
        _check_spreads(self, f"layer {self.name!r}")

    @classmethod
    def kfac(cls, name: str, curv_a: float, curv_b: float, inv_a: float, inv_b: float, prec: float,
             a_bytes: int, e_bytes: int, factor_a_bytes: int, factor_b_bytes: int, grad_bytes: int = 0) -> LayerCost:
        """A K-FAC layer: A_m / B_m from one micro-batch in curv_a / curv_b seconds, each factor inverted in
        inv_a / inv_b, B^-1 G A^-1 in prec; a deferred capture keeps a_bytes / e_bytes (the rows of a and of e)
        per micro-batch; each factor takes factor_a_bytes / factor_b_bytes; the weight and bias gradients
        grad_bytes."""
        return cls(name, (PartCost("A", OpKind.FWD, curv_a, inv_a, a_bytes, factor_a_bytes),
                          PartCost("B", OpKind.BWD, curv_b, inv_b, e_bytes, factor_b_bytes)), prec,
                   grad_bytes=grad_bytes)

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
        """`grad_bytes`, or when unknown (cost files from before it) the product of the sides of a square
        two-part layer's statistics (K-FAC's a_dim x b_dim gradient) at their element size."""
        if self.grad_bytes or len(self.parts) != 2:
            return self.grad_bytes
        item = 4
        a, b = (math.isqrt(p.state_bytes // item) for p in self.parts)
        return a * b * item

    @property
    def capture_bytes(self) -> int:
        """Bytes one micro-batch keeps when the layer defers its captures."""
        return sum(p.capture_bytes for p in self.parts)


@dataclass(frozen=True, slots=True)
class StageCost:
    """What one pipeline stage costs: per-micro-batch forward/backward, memory, and its K-FAC layers.

    act_bytes is kept per in-flight micro-batch (from its forward until its backward);
    peak_err_bytes is the transient peak of errors inside one backward (counted once);
    fwd_spread, bwd_spread: the fastest and slowest repeat of a profiled fwd / bwd (None when not measured here).
    """

    fwd: float
    bwd: float
    param_bytes: int
    act_bytes: int
    layers: tuple[LayerCost, ...]
    peak_err_bytes: int = 0
    fwd_spread: Spread | None = None
    bwd_spread: Spread | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layers, tuple) or not all(isinstance(x, LayerCost) for x in self.layers):
            raise CostModelError("StageCost.layers must be a tuple of LayerCost")
        byte_fields = frozenset({"param_bytes", "act_bytes", "peak_err_bytes"})
        _check_fields(self, "stage", byte_fields, frozenset({"layers"}))
        _check_spreads(self, "stage")

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


@dataclass(frozen=True, slots=True)
class CostTable:
    """Costs of every stage of one model at one micro-batch size, and where they came from."""

    stages: tuple[StageCost, ...]
    micro_batch_size: int
    source: str
    """How the numbers were made, e.g. "pipefisher-csv:bert-base_time_memory_p100.csv"."""
    hardware: str
    comm: CommModel | None = None
    """What collectives cost between the devices (planner/comm.py); None: nothing (tables from before it)."""

    def __post_init__(self) -> None:
        if self.comm is not None and not isinstance(self.comm, CommModel):
            raise CostModelError(f"CostTable.comm must be a CommModel or None, got {type(self.comm).__name__}")
        if not isinstance(self.stages, tuple) or not self.stages:
            raise CostModelError("CostTable.stages must be a non-empty tuple of StageCost")
        if not all(isinstance(s, StageCost) for s in self.stages):
            raise CostModelError("CostTable.stages must hold StageCost objects")
        mbs = self.micro_batch_size
        if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
            raise CostModelError(f"CostTable.micro_batch_size must be an int >= 1, got {mbs!r}")
        names = [layer.name for s in self.stages for layer in s.layers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise CostModelError(f"CostTable: layer names must be unique across stages; repeated: {dupes}")

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every K-FAC layer name, stage by stage."""
        return tuple(layer.name for s in self.stages for layer in s.layers)

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
        """Seconds of collective `op` over `group_size` ranks under `comm`, summed over the collectives the runtime
        makes of it, rounded up to a whole microsecond (so a table of whole microseconds keeps an exact time
        grid, [Note: time grid] in planner/window.py): ALLREDUCE_GRAD all-reduces the stage's gradients
        (`param_bytes`), SYNC_STATS each named part's statistic with its count (`state_bytes` + `COUNT_BYTES`),
        BCAST broadcasts each named part's decomposition (as large as its statistic, `state_bytes`), BCAST_PREC
        the named layer's preconditioned gradient (`LayerCost.gradient_bytes`)."""
        if op.stage is None:
            raise CostModelError(f"{op} names no stage: its bytes are unknown")
        stage = self.stages[op.stage]
        if op.kind is OpKind.ALLREDUCE_GRAD:
            messages = [(Collective.ALL_REDUCE, stage.param_bytes)]
        elif op.kind in (OpKind.SYNC_STATS, OpKind.BCAST):
            sync = op.kind is OpKind.SYNC_STATS
            kind = Collective.ALL_REDUCE if sync else Collective.BROADCAST
            messages = [(kind, p.state_bytes + (COUNT_BYTES if sync else 0))
                        for x in stage.layers if op.layer in (None, x.name)
                        for p in x.parts if op.part in (None, p.part)]
        elif op.kind is OpKind.BCAST_PREC:
            messages = [(Collective.BROADCAST, x.gradient_bytes) for x in stage.layers if x.name == op.layer]
        else:
            raise CostModelError(f"{op} is not a collective the cost table prices")
        total = sum(comm_seconds(self.comm, kind, n, group_size) for kind, n in messages)
        return math.ceil(total * 1e6 - 1e-6) / 1e6

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form with the schema version (no "comm" key without a communication model, no
        `*_spread` key for a time that was not profiled: the file of an unprofiled table is as before spreads)."""
        body = asdict(self)
        if self.comm is None:
            del body["comm"]
        for stage in body["stages"]:
            _drop_empty_spreads(stage)
            for layer in stage["layers"]:
                _drop_empty_spreads(layer)
                for part in layer["parts"]:
                    _drop_empty_spreads(part)
        return {"schema_version": SCHEMA_VERSION, **body}

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
            stages = tuple(_stage_from_dict(s) for s in data["stages"])
            comm = CommModel.from_dict(data["comm"]) if data.get("comm") is not None else None
            return cls(stages, data["micro_batch_size"], data["source"], data["hardware"], comm)
        except KeyError as e:
            raise CostModelError(f"cost table is missing the key {e.args[0]!r}") from e
        except TypeError as e:
            raise CostModelError(f"cost table has a malformed entry: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> CostTable:
        """Parse `to_json` output."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise CostModelError(f"cost table is not valid JSON: {e}") from e
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        """Write the JSON form to `path`."""
        Path(path).write_text(self.to_json())

    def scale_times(self, factor: float) -> CostTable:
        """Every time multiplied by `factor` (a faster or slower device); bytes unchanged."""
        _check_number("scale_times", "factor", factor, integer=False)
        return replace(self, stages=tuple(_scale_stage(s, factor, factor, 1.0) for s in self.stages))

    def scale_kfac_times(self, factor: float) -> CostTable:
        """Curvature, inversion and preconditioning times multiplied by `factor`; F/B and bytes unchanged.

        A planning margin: K-FAC kernels timed alone run slower when every rank computes at once
        (shared memory bandwidth), and a bubble planned full spills the excess onto the critical path.
        """
        _check_number("scale_kfac_times", "factor", factor, integer=False)
        stages = tuple(replace(s, layers=tuple(_scale_layer(x, factor, factor, 1.0) for x in s.layers))
                       for s in self.stages)
        return replace(self, stages=stages)

    def with_micro_batch_size(self, micro_batch_size: int) -> CostTable:
        """Costs at another micro-batch size, assuming per-micro-batch costs grow linearly with it.

        fwd, bwd, curvature, kept activations, a/e and the error peak scale by new/old; inversion,
        preconditioning, parameters and factors do not depend on the micro-batch size.
        """
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise CostModelError(f"micro_batch_size must be an int >= 1, got {micro_batch_size!r}")
        r = micro_batch_size / self.micro_batch_size
        stages = tuple(_scale_stage(s, r, 1.0, r) for s in self.stages)
        return replace(self, stages=stages, micro_batch_size=micro_batch_size)


def _drop_empty_spreads(body: dict[str, Any]) -> None:
    """Remove the `*_spread` keys of `body` (one cost object's `asdict`) whose time was not profiled."""
    for key in [k for k, v in body.items() if k.endswith(_SPREAD) and v is None]:
        del body[key]


def _with_spreads(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (one cost object's JSON) with each `*_spread` object read as a Spread; files without them load."""
    out = dict(data)
    for key, value in data.items():
        if key.endswith(_SPREAD) and value is not None:
            if not isinstance(value, dict):
                raise CostModelError(f"{key} must be an object {{'low': seconds, 'high': seconds}} or null, "
                                     f"got {value!r}")
            out[key] = Spread(**value)
    return out


def _layer_from_dict(data: dict[str, Any]) -> LayerCost:
    """A layer of `CostTable.to_dict`; the K-FAC fields of cost files from before parts read as K-FAC's parts."""
    if "parts" not in data:
        return LayerCost.kfac(**data)
    parts = tuple(PartCost(**_with_spreads({**p, "after": OpKind(p["after"])})) for p in data["parts"])
    return LayerCost(**_with_spreads({**data, "parts": parts}))


def _stage_from_dict(data: dict[str, Any]) -> StageCost:
    layers = tuple(_layer_from_dict(layer) for layer in data["layers"])
    return StageCost(**_with_spreads({**data, "layers": layers}))


def _scale_layer(x: LayerCost, per_mb: float, fixed: float, mem: float) -> LayerCost:
    """Statistics times by per_mb, decompositions and preconditioning by fixed, captured bytes by mem (and the
    times' spreads as their times)."""
    parts = tuple(replace(p, stats=p.stats * per_mb, decomp=p.decomp * fixed,
                          capture_bytes=round(p.capture_bytes * mem),
                          stats_spread=_scaled(p.stats_spread, per_mb),
                          decomp_spread=_scaled(p.decomp_spread, fixed)) for p in x.parts)
    return replace(x, parts=parts, prec=x.prec * fixed, prec_spread=_scaled(x.prec_spread, fixed))


def _scale_stage(s: StageCost, per_mb: float, fixed: float, mem: float) -> StageCost:
    """Scale per-micro-batch times by per_mb, per-step times by fixed, per-micro-batch bytes by mem."""
    layers = tuple(_scale_layer(x, per_mb, fixed, mem) for x in s.layers)
    return replace(
        s,
        fwd=s.fwd * per_mb,
        bwd=s.bwd * per_mb,
        fwd_spread=_scaled(s.fwd_spread, per_mb),
        bwd_spread=_scaled(s.bwd_spread, per_mb),
        act_bytes=round(s.act_bytes * mem),
        peak_err_bytes=round(s.peak_err_bytes * mem),
        layers=layers,
    )


def _profiles_folder() -> Traversable:
    """planner/data/pipefisher_profiles, read through importlib.resources (package data when installed)."""
    return files("fxkfac.planner") / "data" / "pipefisher_profiles"


def _paper_files() -> dict[str, str]:
    """Shipped profile file names by their `paper:<model>/<hardware>` name, sorted by name."""
    names = {}
    for entry in _profiles_folder().iterdir():
        stem = PurePath(entry.name).stem
        if entry.name.endswith(".csv") and _PROFILE_MARK in stem:
            model, hardware = stem.split(_PROFILE_MARK, 1)
            names[f"{PAPER_PREFIX}{model}/{hardware}"] = entry.name
    return dict(sorted(names.items()))


def paper_profile_names() -> tuple[str, ...]:
    """Every `paper:<model>/<hardware>` name of a profile shipped with fxkfac (the PipeFisher paper's)."""
    return tuple(_paper_files())


def _is_paper_name(source: str | Path) -> bool:
    return str(source).startswith(PAPER_PREFIX)


def _paper_file(name: str) -> str:
    """The shipped file a `paper:` name stands for; CostModelError listing the names when unknown."""
    known = _paper_files()
    if name not in known:
        raise CostModelError(f"no shipped PipeFisher profile {name!r}; available: {', '.join(known)}")
    return known[name]


def is_profile(source: str | Path) -> bool:
    """Whether `source` is a PipeFisher per-block profile (a .csv path or a `paper:` name), which needs
    blocks_per_stage and micro_batch_size to become a cost table."""
    return _is_paper_name(source) or Path(source).suffix.lower() == ".csv"


def _profile_text(source: str | Path) -> tuple[str, str]:
    """The CSV text and file name of a profile: a shipped one by `paper:` name, or a file by path."""
    if _is_paper_name(source):
        name = _paper_file(str(source))
        return (_profiles_folder() / name).read_text(), name
    path = Path(source)
    try:
        return path.read_text(), path.name
    except OSError as e:
        raise CostModelError(f"cannot read profile CSV {path}: {e}") from e


def _read_pipefisher_rows(text: str, where: str) -> dict[int, dict[str, float]]:
    """Rows of a PipeFisher profile CSV by micro-batch size (`where` names it in errors)."""
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in PIPEFISHER_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise CostModelError(f"{where}: not a PipeFisher profile CSV, missing columns {missing}")
    try:
        rows = {int(float(r["bs"])): {c: float(r[c]) for c in PIPEFISHER_COLUMNS} for r in reader}
    except (ValueError, TypeError) as e:
        raise CostModelError(f"{where}: a value is not a number ({e})") from e
    if not rows:
        raise CostModelError(f"{where}: the profile CSV has no rows")
    return rows


def _row_at(rows: dict[int, dict[str, float]], bs: int, where: str) -> dict[str, float]:
    """The row for micro-batch size bs, linearly interpolated between the nearest measured sizes."""
    if bs in rows:
        return rows[bs]
    sizes = sorted(rows)
    if not sizes[0] < bs < sizes[-1]:
        raise CostModelError(
            f"{where}: micro-batch size {bs} is outside the measured sizes {sizes}; "
            "pick one in that range (sizes in between are interpolated)"
        )
    lo = max(s for s in sizes if s < bs)
    hi = min(s for s in sizes if s > bs)
    w = (bs - lo) / (hi - lo)
    return {c: rows[lo][c] * (1 - w) + rows[hi][c] * w for c in PIPEFISHER_COLUMNS}


def _blocks_per_stage(blocks_per_stage: Sequence[int] | int, n_stages: int | None) -> list[int]:
    if isinstance(blocks_per_stage, int):
        if n_stages is None:
            raise CostModelError("blocks_per_stage given as an int needs n_stages (how many stages)")
        counts = [blocks_per_stage] * n_stages
    else:
        counts = list(blocks_per_stage)
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise CostModelError(f"blocks_per_stage must be positive ints, got {blocks_per_stage!r}")
    return counts


def _block_layer(row: dict[str, float], name: str) -> LayerCost:
    half_kron = row["mem_kron"] * _MIB / 2
    return LayerCost.kfac(
        name,
        curv_a=row["time_kron"] * _MS / 2,
        curv_b=row["time_kron"] * _MS / 2,
        inv_a=row["time_inv"] * _MS / 2,
        inv_b=row["time_inv"] * _MS / 2,
        prec=row["time_prec"] * _MS,
        a_bytes=round(row["mem_save_err"] * _MIB),
        e_bytes=round(row["mem_save_err"] * _MIB),
        factor_a_bytes=round(half_kron),
        factor_b_bytes=round(half_kron),
        grad_bytes=round(row["mem_param"] * _MIB),
    )


def cost_table_from_pipefisher_csv(
    path: str | Path,
    *,
    blocks_per_stage: Sequence[int] | int,
    micro_batch_size: int,
    n_stages: int | None = None,
    hardware: str | None = None,
) -> CostTable:
    """A CostTable from a PipeFisher per-Transformer-block profile (ms and MiB per block).

    Every Transformer block is one K-FAC "layer" named ``block{i}`` (i counts blocks over the
    whole model) of its stage; a stage with k blocks costs k times a block. Mapping:

    - time_f, time_b -> fwd, bwd (per micro-batch); time_prec -> prec of the block.
    - time_kron -> curv_a + curv_b, split 50/50; time_inv -> inv_a + inv_b, split 50/50. The split
      follows from the factor dims of the blocks profiled (BERT, OPT, T5): the six Linears map
      d -> d (q, k, v, o), d -> f and f -> d, so the A sides {d,d,d,d,d,f} and the B sides
      {d,d,d,d,f,d} are the same multiset: sum d_in^2 = sum d_out^2 (curvature, rows * d^2) and
      sum d_in^3 = sum d_out^3 (inversion) exactly.
    - mem_kron -> factor_a_bytes + factor_b_bytes, split 50/50 (it equals 4 bytes * sum of the
      twelve d^2 without bias columns: 94.5 MiB for d=768, f=3072).
    - mem_save_err -> e_bytes (errors a deferred B capture keeps per micro-batch); a_bytes is set
      to the same value since sum of d_in * tokens = sum of d_out * tokens by the same symmetry.
    - mem_param -> param_bytes, mem_act -> act_bytes (summed over the blocks of the stage),
      mem_peak_err -> peak_err_bytes (the largest block peak: one backward is transient).

    path is a profile CSV, or `paper:<model>/<hardware>` for one shipped with fxkfac
    (`paper_profile_names()`). A micro-batch size not in the file is linearly interpolated between
    the nearest measured sizes; one outside the measured range raises CostModelError.
    blocks_per_stage is a list (one count per stage) or an int with n_stages.
    """
    text, file_name = _profile_text(path)
    row = _row_at(_read_pipefisher_rows(text, str(path)), micro_batch_size, str(path))
    counts = _blocks_per_stage(blocks_per_stage, n_stages)
    stages, first = [], 0
    for k in counts:
        layers = tuple(_block_layer(row, f"block{first + j}") for j in range(k))
        stages.append(
            StageCost(
                fwd=k * row["time_f"] * _MS,
                bwd=k * row["time_b"] * _MS,
                param_bytes=round(k * row["mem_param"] * _MIB),
                act_bytes=round(k * row["mem_act"] * _MIB),
                layers=layers,
                peak_err_bytes=round(row["mem_peak_err"] * _MIB),
            )
        )
        first += k
    hw = hardware if hardware is not None else _hardware_from_name(PurePath(file_name).stem)
    return CostTable(tuple(stages), micro_batch_size, f"pipefisher-csv:{file_name}", hw, _comm_of(hw))


def _comm_of(hardware: str) -> CommModel | None:
    """The analytic comm model of a known hardware preset (planner/hardware.py); None for others (rtx3090)."""
    spec = HARDWARE.get(hardware.lower())
    return spec.comm if spec is not None else None


def _hardware_from_name(stem: str) -> str:
    """'bert-base_time_memory_p100' -> 'p100' (the files' naming); 'unknown' otherwise."""
    parts = stem.rsplit("_", 1)
    return parts[1] if len(parts) == 2 and "_time_memory" in stem else "unknown"


def load_cost_table(path: str | Path, **csv_options: Any) -> CostTable:
    """Load a cost table from .json (CostTable.to_json), or from a PipeFisher profile: a .csv path or a
    shipped `paper:<model>/<hardware>` name (pass the keyword arguments of `cost_table_from_pipefisher_csv`)."""
    if is_profile(path):
        if _is_paper_name(path):
            _paper_file(str(path))  # an unknown name is the first thing to fix
        missing = [k for k in _PROFILE_OPTIONS if k not in csv_options]
        if missing:
            raise CostModelError(
                f"{path} is a per-Transformer-block profile: pass {missing} to load_cost_table "
                "(blocks per stage, micro-batch size) and plan with the CostTable it returns"
            )
        return cost_table_from_pipefisher_csv(path, **csv_options)
    path = Path(path)
    if path.suffix.lower() == ".json":
        if csv_options:
            raise CostModelError(f"options {sorted(csv_options)} apply to .csv profiles, not to {path.name}")
        try:
            text = path.read_text()
        except OSError as e:
            raise CostModelError(f"cannot read cost table {path}: {e}") from e
        return CostTable.from_json(text)
    raise CostModelError(
        f"{path}: unknown cost file type {path.suffix.lower()!r}; use .json (a cost table), .csv (a profile) "
        f"or a shipped profile name such as {PAPER_PREFIX}bert-base/p100"
    )
