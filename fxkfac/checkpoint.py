"""Checkpoints of every trainer: tensors through torch.distributed.checkpoint, the rest JSON, written atomically.

[Note: checkpoint format] A checkpoint is one directory:

- ``fxkfac.json``: the header (format, version, step, world size, and `describe_run` of the trainer
  that wrote it: kind, mesh, schedule, micro-batches, parameter shapes, preconditioned units, graph
  fingerprint, plan and layer timings). Written last: a directory without it is incomplete.
- ``rank-<r>.json``: rank r's state skeleton: the trainer's ``state_dict()`` with every tensor replaced
  by ``{"__tensor__": key}`` (ints, floats, bools, strings stay as they are).
- ``plan.json``: the plan in use, when there is one (``planner.validate.plan_file.load_plan`` reads it back; the header
  holds its digest).
- ``__<r>_0.distcp`` and ``.metadata.json``: the tensors, written by `torch.distributed.checkpoint`
  (DCP) with a JSON metadata file in place of DCP's pickled ``.metadata``. Keys are global wherever the
  state is: ``model/<fqn>``, ``optimizer/state/<fqn>/<name>`` (the original model's parameter names),
  ``kfac/<unit>/<name>`` (the preconditioner's layer or parameter name, whatever the family); DCP writes
  a key held by several ranks once, and `save` first checks that they hold it alike. Per-rank state (work
  in flight, the RNG) is keyed ``rank<r>/...``.

[Note: resharding] `load` compares the header with the run. Another family, model (parameter names and
shapes) or set of preconditioned units (a split that changes which layers exist) is refused. The same
layout (mesh, schedule, micro-batches, batch, split, plan, timings, programs, world size) loads each rank's
own skeleton, work in flight included: resume is exact. A relaunched plan="auto" script keeps its layout only with
the checkpoint's plan, which `compile(resume_from=...)` adopts (`autoplan.resumed_plan`) instead of profiling and
planning again. Any other layout is resharded:
- every rank reads every saved rank's skeleton; each parameter's, optimizer state's and unit's entry is
  taken from its *fullest copy*: the copy with the most entries, of which every other copy's entries must
  be a subset. A rank saves what it holds and nothing for a value it lacks (None), so a unit's state is
  assembled from whichever rank held it (KAISA's grad workers hold the decomposition, DP-KFAC's owner the
  factors too); entries no rank wrote load as absent;
- each rank then takes the entries of the parameters and units it holds under its own layout, and the
  trainer keeps of a unit what its strategy holds there (no decomposition on a rank that is not one of
  the unit's grad workers, nothing on a DP-KFAC non-owner); each optimizer group takes the settings its
  parameters' groups had; rank r takes saved rank r's RNG when there was one, else keeps its own;
- work in flight (open refresh records with partial sums, decompositions waiting for a broadcast,
  captures) is specific to the ranks and plan that made it: a resharded load refuses a checkpoint with
  any, naming a step to save at instead, and refuses to resume a planned run at a step where its plan
  would finish refreshes begun before it (the new run never made them). With the critical-path programs
  (plan=None) every refresh finishes within its step, so any step of theirs resumes.
Resharded resume equals the uninterrupted run when the layer timings are the same and the new layout
splits the global batch into the same micro-batches (W x N fixed); otherwise the new timings apply from
the resumed step, and pending preconditioners activate at the step they were made for.

Nothing is unpickled on load: JSON, and tensor files through ``torch.load(weights_only=True)``.
`save` writes into ``<dir>.tmp-<step>`` and rank 0 moves it into place after a barrier; an existing
checkpoint at ``<dir>`` is first renamed to ``<dir>.old-<step>`` and removed only once the new one
is in place, so a crash at any moment leaves a complete checkpoint on disk. `load` refuses (with
CheckpointError) a checkpoint it cannot load before touching the trainer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from fxkfac.checkpoint_files import (
    JsonMetadataReader,
    JsonMetadataWriter,
    join_tensors,
    read_json,
    read_tensor_metadata,
    split_tensors,
    tensor_keys,
    write_json,
)
from fxkfac.errors import CheckpointError
from fxkfac.reshard import LoadKind, check_run, in_flight_refusal, layout_changes, replanned, resharded_state

__all__ = [
    "Checkpointable",
    "Checkpointing",
    "save",
    "load",
    "found",
    "plan_file",
    "digest",
    "FORMAT",
    "VERSION",
]

log = logging.getLogger(__name__)

FORMAT = "fxkfac-checkpoint"
VERSION = 2
"""2: global keys for every holder's state and ``units`` in the header, so a checkpoint follows the state."""
HEADER = "fxkfac.json"
PLAN = "plan.json"
# --- what a checkpoint is made for ---------------------------------------------------------------------


class Checkpointable(Protocol):
    """What a trainer offers checkpoints: its state, its step, its plan, how to describe its run, a timeout."""

    steps: int
    plan: Any

    @property
    def timeout(self) -> timedelta: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def describe_run(self) -> dict[str, Any]: ...


class Checkpointing:
    """`save_checkpoint` / `load_checkpoint` for a Checkpointable trainer (collective when pipelined)."""

    def save_checkpoint(self: Checkpointable, path: str | os.PathLike) -> None:
        """Write a checkpoint directory (see `save`)."""
        save(self, path)

    def load_checkpoint(self: Checkpointable, path: str | os.PathLike) -> None:
        """Resume from a checkpoint directory (see `load`)."""
        load(self, path)


def digest(obj: Any) -> str:
    """A short stable digest of a JSON-able value."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- barriers, agreement -------------------------------------------------------------------------------


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(trainer: Checkpointable, what: str) -> None:
    """Wait for every rank; a rank that does not arrive within the trainer's timeout is named in the error."""
    if _rank_world()[1] == 1:
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=trainer.timeout)
        else:
            dist.barrier()
    except RuntimeError as e:
        raise CheckpointError(f"rank {dist.get_rank()}: {what}: not every rank arrived ({e})") from e


def _agree(error: str | None) -> None:
    """Raise the same CheckpointError on every rank when any rank found one (before any collective load)."""
    rank, world = _rank_world()
    if world == 1:
        errors = [error]
    else:
        errors = [None] * world
        dist.all_gather_object(errors, error)
    if errors[rank] is not None:
        raise CheckpointError(errors[rank])
    found = [(r, e) for r, e in enumerate(errors) if e is not None]
    if found:
        raise CheckpointError(f"rank {found[0][0]}: {found[0][1]}")


def _tensor_digest(t: Tensor) -> str:
    """A digest of a tensor's dtype, shape and bytes."""
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype} {list(t.shape)} {hashlib.blake2b(flat, digest_size=16).hexdigest()}"


def _check_copies_agree(tensors: Mapping[str, Tensor], rank: int) -> None:
    """CheckpointError on every rank when two ranks hold different values under one global key, which DCP
    writes once: the copies of a parameter or unit diverged, and a resharded load would take one of them."""
    world = _rank_world()[1]
    if world == 1:
        return
    mine = {k: _tensor_digest(t) for k, t in tensors.items() if not k.startswith(f"rank{rank}/")}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    first: dict[str, tuple[int, str]] = {}
    for r, digests in enumerate(everyone):
        for key, value in digests.items():
            holder, seen = first.setdefault(key, (r, value))
            if seen != value:
                raise CheckpointError(
                    f"ranks {holder} and {r} hold different values of {key!r}, which a checkpoint "
                    "stores once for every copy: the copies diverged (a replica stepped "
                    "differently, or a strategy keeps per-rank values under a global key); "
                    "nothing was written"
                )


def _cause(e: BaseException) -> str:
    """A one-line account of a failure; DCP's CheckpointException as each failing rank's exception."""
    if isinstance(e, dcp.CheckpointException):
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {e}"


@contextmanager
def _one_process_quietly() -> Iterator[None]:
    """DCP warns that it assumes one process when torch.distributed is not initialized: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(tmp: Path, path: Path, step: int) -> None:
    """Put the finished ``tmp`` at ``path``; an older checkpoint there survives until the new one is in place."""
    old = path.with_name(f"{path.name}.old-{step}")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


# --- save / load ----------------------------------------------------------------------------------------


def save(trainer: Checkpointable, path: str | os.PathLike) -> Path:
    """Write ``trainer``'s full state (model, optimizer, K-FAC, step, plan, RNG) to directory ``path``.

    Collective: every rank of a pipelined run calls it at the same step. Atomic: the files go to
    ``<path>.tmp-<step>``, which rank 0 renames to ``path`` once every rank has finished writing.
    """
    path = Path(path)
    rank, world = _rank_world()
    step = trainer.steps
    state = dict(trainer.state_dict())
    state["rng"] = torch.get_rng_state()
    skeleton, tensors = split_tensors(state, rank)
    _check_copies_agree(tensors, rank)
    tmp = path.with_name(f"{path.name}.tmp-{step}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(trainer, f"saving checkpoint {path}")
    try:
        with _one_process_quietly():
            dcp.save(
                tensors,
                storage_writer=JsonMetadataWriter(tmp),
                no_dist=world == 1,
                planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            )
        write_json(tmp / f"rank-{rank}.json", {"rank": rank, "state": skeleton})
    except (OSError, RuntimeError, dcp.CheckpointException) as e:
        raise CheckpointError(
            f"rank {rank}: writing checkpoint {tmp} failed ({_cause(e)}); the checkpoint at "
            f"{path}, if any, is untouched"
        ) from e
    _barrier(trainer, f"saving checkpoint {path}")
    if rank == 0:
        header = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "world_size": world,
            "torch": torch.__version__,
            "run": trainer.describe_run(),
        }
        if trainer.plan is not None:
            (tmp / PLAN).write_text(trainer.plan.to_json())
        write_json(tmp / HEADER, header)
        _move_into_place(tmp, path, step)
    _barrier(trainer, f"moving checkpoint {path} into place")
    log.info("rank %d: checkpoint of step %d saved to %s", rank, step, path)
    return path


def _read_header(path: Path) -> dict[str, Any]:
    header = read_json(path / HEADER, "checkpoint header")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(f"{path / HEADER} is not an fxkfac checkpoint header")
    if header.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {header.get('version')!r}; this fxkfac reads version {VERSION}"
        )
    return header


def found(path: str | os.PathLike, *, collective: bool) -> bool:
    """Whether directory `path` holds a complete checkpoint (its header, written last); with `collective`, rank 0's
    answer on every rank, so that the ranks of a pipelined run resume together or not at all."""
    box = [(Path(path) / HEADER).is_file()]
    if collective and _rank_world()[1] > 1:
        dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def plan_file(path: str | os.PathLike) -> Path | None:
    """The plan the complete checkpoint at `path` was saved with; None without a checkpoint there or when it was
    saved without a plan (plan=None, one device, no preconditioner)."""
    file = Path(path) / PLAN
    return file if (Path(path) / HEADER).is_file() and file.is_file() else None


def _check_sections(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """The saved skeleton holds exactly the state this rank has (nothing would be dropped or left unset)."""
    for section in ("model", "kfac", "inflight"):
        a, b = saved.get(section), mine.get(section)
        if isinstance(a, dict) and isinstance(b, dict) and section != "inflight" and set(a) != set(b):
            raise CheckpointError(
                f"checkpoint {section} state names {sorted(set(a) ^ set(b))[:4]}, which this rank "
                "does not hold alike; it was written for another model or layout"
            )
        if (a is None) != (b is None):
            raise CheckpointError(
                f"checkpoint {'lacks' if a is None else 'has'} {section} state, this run "
                f"{'has' if b is not None else 'has none'}; it was written by another trainer"
            )


def _rank_skeleton(path: Path, rank: int) -> dict[str, Any]:
    """The state skeleton saved rank `rank` wrote; CheckpointError when missing or corrupt."""
    data = read_json(path / f"rank-{rank}.json", f"state of rank {rank}")
    skeleton = data.get("state") if isinstance(data, dict) else None
    if not isinstance(skeleton, dict) or data.get("rank") != rank or "rng" not in skeleton:
        raise CheckpointError(f"{path / f'rank-{rank}.json'} is corrupt (no state of rank {rank})")
    return skeleton


def _resharded_skeleton(
    path: Path, header: Mapping[str, Any], mine: Mapping[str, Any], run: Mapping[str, Any], rank: int
) -> dict[str, Any]:
    """The skeleton this rank loads from a checkpoint written under another layout (see [Note: resharding])."""
    world = header.get("world_size")
    if not isinstance(world, int) or world < 1:
        raise CheckpointError(f"{path / HEADER} is corrupt (world size {world!r})")
    saved = {r: _rank_skeleton(path, r) for r in range(world)}
    refusal = in_flight_refusal(path, header, run, saved)
    again = replanned(header["run"], run) and world == _rank_world()[1]
    if refusal is not None:
        raise CheckpointError(refusal + (_replanned_words(path) if again else ""))
    if again:
        log.warning(
            "rank %d: checkpoint %s continues on another plan than it was saved with%s, which is not the "
            "uninterrupted run",
            rank,
            path,
            _replanned_words(path),
        )
    log.info(
        "rank %d: checkpoint %s follows the state onto this layout (%s)", rank, path, layout_changes(header["run"], run)
    )
    return resharded_state(saved, mine, rank)


def _replanned_words(path: Path) -> str:
    """What to do when only the plan changed: the relaunch of a plan="auto" script planned again."""
    return (
        f". Only the plan differs (plan='auto' planned again on the same layout): compile with "
        f"resume_from='{path}' to adopt the checkpoint's plan (or plan='{path / PLAN}')"
    )


def _prepare(trainer: Checkpointable, path: Path, rank: int, world: int) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """This rank's skeleton to load and empty tensors to load into, after every check (CheckpointError)."""
    header = _read_header(path)
    run = trainer.describe_run()
    kind = check_run(header.get("run") or {}, run)
    mine = split_tensors(trainer.state_dict(), rank)[0]
    if kind is LoadKind.SAME_LAYOUT and header.get("world_size") == world:
        skeleton = _rank_skeleton(path, rank)
        _check_sections(skeleton, mine)
    else:
        skeleton = _resharded_skeleton(path, header, mine, run, rank)
    metadata = read_tensor_metadata(path).state_dict_metadata
    keys = tensor_keys(skeleton)
    missing = [k for k in keys if k not in metadata]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks the tensors {missing[:4]} rank {rank}'s state names; it is corrupt or incomplete"
        )
    specs = {k: metadata[k] for k in keys}
    empty = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in specs.items()}  # type: ignore[union-attr]  # keys name tensors: only their entries are read
    return skeleton, empty


def load(trainer: Checkpointable, path: str | os.PathLike) -> None:
    """Restore ``trainer`` (and this rank's RNG) from the checkpoint directory ``path``; collective.

    A checkpoint of the same layout resumes exactly; one of another layout follows the state (see [Note:
    resharding]). Every check runs on every rank before anything changes: a checkpoint that is incomplete,
    corrupt, made for another family, model or set of units, or that cannot be resharded raises
    CheckpointError on all ranks and leaves the trainer as it was.
    """
    path = Path(path)
    rank, world = _rank_world()
    error, prepared = None, None
    try:
        prepared = _prepare(trainer, path, rank, world)
    except CheckpointError as e:
        error = str(e)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a skeleton that is JSON but not ours
        error = f"checkpoint {path} is malformed for rank {rank} ({e!r}); it is corrupt or from another tool"
    _agree(error)
    skeleton, tensors = prepared  # type: ignore[misc]  # _agree raised if any rank, this one included, could not prepare
    try:
        with _one_process_quietly():
            dcp.load(
                tensors,
                storage_reader=JsonMetadataReader(path),
                no_dist=world == 1,
                planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            )
    except (OSError, RuntimeError, ValueError, dcp.CheckpointException) as e:
        raise CheckpointError(
            f"rank {rank}: reading the tensors of checkpoint {path} failed ({_cause(e)}); it is corrupt or incomplete"
        ) from e
    state = join_tensors(skeleton, tensors)
    rng = state.pop("rng", None)  # absent only when resharded onto more ranks than saved
    error = None
    try:
        trainer.load_state_dict(state)
    except CheckpointError as e:
        error = str(e)
    _agree(error)
    if rng is not None:
        torch.set_rng_state(rng)
    log.info("rank %d: resumed from %s at step %d", rank, path, trainer.steps)
