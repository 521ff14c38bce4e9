"""Cost tables from per-Transformer-block profiles: the PipeFisher paper's (CSV or `paper:` name) and those
benchmarks/gpu_check.py measures on a GPU (JSON or `gpu:` name); and `load_cost_table`."""

from __future__ import annotations

import csv
import io
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from importlib.resources import files
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from fxkfac.planner.problem.costs import CostTable, LayerCost, StageCost
from fxkfac.planner.problem.errors import CostModelError
from fxkfac.planner.problem.hardware import HARDWARE, parse_json

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

PIPEFISHER_COLUMNS = (
    "bs", "time_f", "time_b", "time_kron", "time_inv", "time_prec",
    "mem_param", "mem_act", "mem_peak_err", "mem_save_err", "mem_kron",
)  # fmt: skip
"""Columns of the PipeFisher profiles (planner/data/pipefisher_profiles/*.csv; ms and MiB per Transformer block)."""

PAPER_PREFIX = "paper:"  # `paper:<model>/<hardware>`: a PipeFisher profile shipped in planner/data/
GPU_PREFIX = "gpu:"  # `gpu:<model>/<device>`: a profile benchmarks/gpu_check.py measured, shipped in planner/data/
BLOCK_PROFILE_FORMAT = "fxkfac-block-profile/1"  # the `format` of a per-block profile JSON (`block_profile_json`)


class ProfileLayers(StrEnum):
    """What one K-FAC layer of a profiled block is: the block, its attention and feed-forward, or each of its six
    Linears (as the paper's code), sharing the block's costs by their shapes."""

    BLOCK = "block"
    SUBLAYER = "sublayer"
    LINEAR = "linear"


_SHAPES = {"q": (1, 1), "k": (1, 1), "v": (1, 1), "o": (1, 1), "fc1": (1, 4), "fc2": (4, 1)}
"""The Linears of a profiled block in forward order: (d_in / d, d_out / d); every profiled model has f = 4d."""

_GROUPS: dict[ProfileLayers, tuple[tuple[str, tuple[str, ...]], ...]] = {
    ProfileLayers.BLOCK: (("", tuple(_SHAPES)),),
    ProfileLayers.SUBLAYER: ((".attn", ("q", "k", "v", "o")), (".ffn", ("fc1", "fc2"))),
    ProfileLayers.LINEAR: tuple((f".{n}", (n,)) for n in _SHAPES),
}
"""Each granularity's layers of one block, in forward order: the suffix of the layer's name and its Linears."""

_PROFILE_MARK = "_time_memory_"  # the shipped files are <model>_time_memory_<hardware>.csv
_PROFILE_OPTIONS = ("blocks_per_stage", "micro_batch_size")  # required; `layers` and the rest are optional

_MS = 1e-3
_MIB = 1 << 20

SHIPPED: dict[str, Traversable] = {
    PAPER_PREFIX: files("fxkfac.planner") / "data" / "pipefisher_profiles",
    GPU_PREFIX: files("fxkfac.planner") / "data" / "gpu_profiles",
}
"""The folder of the profiles each prefix names (package data, read through importlib.resources)."""


def _shipped(prefix: str) -> dict[str, Traversable]:
    """Shipped profile files by `paper:<model>/<hardware>` or `gpu:<model>/<device>` name, sorted."""
    paper, folder = prefix == PAPER_PREFIX, SHIPPED[prefix]
    names = {}
    for entry in folder.iterdir() if folder.is_dir() else ():
        stem = PurePath(entry.name).stem
        model, sep, device = stem.partition(_PROFILE_MARK) if paper else stem.rpartition("_")
        if entry.name.endswith(".csv" if paper else ".json") and sep and model:
            names[f"{prefix}{model}/{device}"] = entry
    return dict(sorted(names.items()))


def _shipped_file(name: str) -> Traversable | None:
    """The shipped file a `paper:` or `gpu:` name stands for (CostModelError when unknown); None for a path."""
    prefix = next((x for x in SHIPPED if name.startswith(x)), None)
    if prefix is None:
        return None
    known = _shipped(prefix)
    if name in known:
        return known[name]
    if prefix == PAPER_PREFIX:
        raise CostModelError(f"no shipped PipeFisher profile {name!r}; available: {', '.join(known)}")
    raise CostModelError(
        f"no shipped GPU profile {name!r} (available: {', '.join(known) or 'none yet'}); benchmarks/gpu_check.py "
        "measures one on a CUDA device, and its file can be passed as a path"
    )


def is_profile(source: str | Path) -> bool:
    """Whether `source` is a per-block profile (.csv, a .json of `block_profile_json`, a `paper:` or `gpu:` name)."""
    path = Path(source)
    if str(source).startswith((PAPER_PREFIX, GPU_PREFIX)) or path.suffix.lower() == ".csv":
        return True
    try:
        data = json.loads(path.read_text()) if path.suffix.lower() == ".json" else None
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == BLOCK_PROFILE_FORMAT


def block_profile_json(rows: Sequence[Mapping[str, float]], *, model: str, device: str, **about: Any) -> str:
    """The text of a per-block profile JSON: `rows`, one per micro-batch size with every `PIPEFISHER_COLUMNS` value
    (ms and MiB per block), the model and device, and `about` the measurement (dtype, sequence length ...)."""
    body = {"format": BLOCK_PROFILE_FORMAT, "model": model, "device": device, **about}
    body["rows"] = list(_checked_rows(rows, "a block profile").values())
    return json.dumps(body, indent=1) + "\n"


_Rows = dict[int, dict[str, float]]


def _checked_rows(rows: Any, where: str) -> _Rows:
    """`rows` (objects with every `PIPEFISHER_COLUMNS` value) as numbers by micro-batch size, checked."""
    if not isinstance(rows, (list, tuple)) or not rows or not all(isinstance(r, Mapping) for r in rows):
        raise CostModelError(f"{where}: the profile needs rows (objects) with the columns {list(PIPEFISHER_COLUMNS)}")
    missing = sorted({c for r in rows for c in PIPEFISHER_COLUMNS if c not in r})
    if missing:
        raise CostModelError(f"{where}: rows lack the columns {missing}")
    try:
        return {int(float(r["bs"])): {c: float(r[c]) for c in PIPEFISHER_COLUMNS} for r in rows}
    except (ValueError, TypeError) as e:
        raise CostModelError(f"{where}: a value is not a number ({e})") from e


def _profile_rows(source: str | Path) -> tuple[_Rows, str, str | None]:
    """A per-block profile's rows by micro-batch size, its file name and a GPU profile's device: a shipped one by
    `paper:` or `gpu:` name, or a .csv (PipeFisher's) or .json (`block_profile_json`) file by path."""
    where = str(source)
    path = _shipped_file(where) or Path(source)
    name, csv_file = path.name, not path.name.lower().endswith(".json")
    try:
        text = path.read_text()
    except OSError as e:
        raise CostModelError(f"cannot read profile {path}: {e}") from e
    device: str | None = None
    if csv_file:
        rows: Any = list(csv.DictReader(io.StringIO(text)))
    else:
        data = parse_json(text, where)
        if not isinstance(data, dict) or data.get("format") != BLOCK_PROFILE_FORMAT:
            raise CostModelError(f"{where}: not a per-block profile (its 'format' is not {BLOCK_PROFILE_FORMAT!r})")
        rows, device = data.get("rows"), str(data.get("device", "unknown"))
    return _checked_rows(rows, where), name, device


def _row_at(rows: _Rows, bs: int, where: str) -> dict[str, float]:
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


def _block_layers(row: dict[str, float], block: str, layers: ProfileLayers) -> tuple[LayerCost, ...]:
    """The block's K-FAC layers (`_GROUPS`), each its Linears' share of the block's cost: curvature and factors by
    d^2 a side, inversion d^3, APPLY d_in d_out (d_in + d_out), captures d, gradient d_in d_out."""
    sides = [d for i, o in _SHAPES.values() for d in (i, o)]
    sq, cube = sum(d**2 for d in sides), sum(d**3 for d in sides)
    width = sum(i for i, _ in _SHAPES.values())
    apply = sum(i * o * (i + o) for i, o in _SHAPES.values())
    weights = sum(i * o for i, o in _SHAPES.values())

    def share(linears: tuple[str, ...], work: Callable[[int, int], int]) -> float:
        return sum(work(*_SHAPES[n]) for n in linears)

    return tuple(
        LayerCost.kfac(
            f"{block}{suffix}",
            curv_a=row["time_kron"] * _MS * share(linears, lambda i, o: i**2) / sq,
            curv_b=row["time_kron"] * _MS * share(linears, lambda i, o: o**2) / sq,
            inv_a=row["time_inv"] * _MS * share(linears, lambda i, o: i**3) / cube,
            inv_b=row["time_inv"] * _MS * share(linears, lambda i, o: o**3) / cube,
            prec=row["time_prec"] * _MS * share(linears, lambda i, o: i * o * (i + o)) / apply,
            a_bytes=round(row["mem_save_err"] * _MIB * share(linears, lambda i, o: i) / width),
            e_bytes=round(row["mem_save_err"] * _MIB * share(linears, lambda i, o: o) / width),
            factor_a_bytes=round(row["mem_kron"] * _MIB * share(linears, lambda i, o: i**2) / sq),
            factor_b_bytes=round(row["mem_kron"] * _MIB * share(linears, lambda i, o: o**2) / sq),
            grad_bytes=round(row["mem_param"] * _MIB * share(linears, lambda i, o: i * o) / weights),
        )
        for suffix, linears in _GROUPS[layers]
    )


def cost_table_from_pipefisher_csv(
    path: str | Path,
    *,
    blocks_per_stage: Sequence[int] | int,
    micro_batch_size: int,
    n_stages: int | None = None,
    hardware: str | None = None,
    layers: ProfileLayers = ProfileLayers.BLOCK,
) -> CostTable:
    """A CostTable from a per-block profile (`_profile_rows`): a stage of k blocks costs k blocks (peak error one
    block's), its K-FAC layers as `layers` says; blocks_per_stage: per stage, or an int with n_stages."""
    rows, file_name, device = _profile_rows(path)
    row = _row_at(rows, micro_batch_size, str(path))
    counts = _blocks_per_stage(blocks_per_stage, n_stages)
    stages = tuple(
        StageCost(
            fwd=k * row["time_f"] * _MS,
            bwd=k * row["time_b"] * _MS,
            param_bytes=round(k * row["mem_param"] * _MIB),
            act_bytes=round(k * row["mem_act"] * _MIB),
            layers=tuple(x for j in range(first, first + k) for x in _block_layers(row, f"block{j}", layers)),
            peak_err_bytes=round(row["mem_peak_err"] * _MIB),
        )
        for k, first in zip(counts, itertools.accumulate(counts, initial=0))
    )
    stem = PurePath(file_name).stem  # the paper's files: <model>_time_memory_<hardware>
    hw = hardware or device or (stem.rsplit("_", 1)[1] if "_time_memory" in stem else "unknown")
    kind = "pipefisher-csv" if device is None else "gpu-profile"
    spec = HARDWARE.get(hw.lower())  # a known preset's analytic links; none for others (rtx3090)
    return CostTable(stages, micro_batch_size, f"{kind}:{file_name}", hw, spec.comm if spec else None)


def load_cost_table(path: str | Path, **csv_options: Any) -> CostTable:
    """A cost table from .json (CostTable.to_json) or a per-block profile (`is_profile`; pass the keyword arguments
    of `cost_table_from_pipefisher_csv`)."""
    if is_profile(path):
        _shipped_file(str(path))  # an unknown name is the first thing to fix
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
