"""The files of a checkpoint directory ([Note: checkpoint format] in fxkfac/checkpoint.py): a state as its JSON
skeleton and its tensors by DCP key, JSON written durably and read with errors a user can act on, and
torch.distributed.checkpoint's tensor files with their metadata as JSON (``.metadata.json``) instead of DCP's pickle,
so nothing is unpickled on load."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from fxkfac.errors import CheckpointError
from fxkfac.reshard import LOCAL_SECTIONS

__all__ = [
    "DCP_METADATA",
    "JsonMetadataWriter",
    "JsonMetadataReader",
    "read_tensor_metadata",
    "write_json",
    "read_json",
    "split_tensors",
    "join_tensors",
    "tensor_keys",
]

DCP_METADATA = ".metadata.json"
_TENSOR = "__tensor__"
_ITEMS = "__items__"


def split_tensors(state: Mapping[str, Any], rank: int) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(skeleton, tensors)``: the JSON-able skeleton of ``state`` and its tensors by DCP key.

    Dict keys are strings (or ints, kept as ``{"__items__": [[key, value], ...]}``); tuples become lists.
    Sections in LOCAL_SECTIONS get keys under ``rank<r>/``.
    """
    tensors: dict[str, Tensor] = {}

    def walk(value: Any, key: str) -> Any:
        if isinstance(value, Tensor):
            tensors[key] = value.detach()
            return {_TENSOR: key}
        if isinstance(value, Mapping):
            if all(isinstance(k, str) for k in value):
                return {k: walk(v, f"{key}/{k}") for k, v in value.items()}
            if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
                raise AssertionError(f"state keys under {key!r} must be str or int: {list(value)[:4]}")
            return {_ITEMS: [[k, walk(v, f"{key}/{k}")] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{key}/{i}") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise AssertionError(f"state at {key!r} holds a {type(value).__name__}, which a checkpoint cannot store")

    skeleton = {
        section: walk(value, f"rank{rank}/{section}" if section in LOCAL_SECTIONS else section)
        for section, value in state.items()
    }
    return skeleton, tensors


def join_tensors(skeleton: Any, tensors: Mapping[str, Tensor]) -> Any:
    """Inverse of `split_tensors`: the skeleton with its tensor placeholders filled from ``tensors``."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR}:
            return tensors[skeleton[_TENSOR]]
        if set(skeleton) == {_ITEMS}:
            return {k: join_tensors(v, tensors) for k, v in skeleton[_ITEMS]}
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_tensors(v, tensors) for v in skeleton]
    return skeleton


def tensor_keys(skeleton: Any) -> list[str]:
    """Every DCP key a skeleton refers to."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR}:
            return [skeleton[_TENSOR]]
        values = [v for _, v in skeleton[_ITEMS]] if set(skeleton) == {_ITEMS} else list(skeleton.values())
        return [k for v in values for k in tensor_keys(v)]
    if isinstance(skeleton, list):
        return [k for v in skeleton for k in tensor_keys(v)]
    return []


def _metadata_to_json(md: Metadata) -> dict[str, Any]:
    tensors = {}
    for key, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise AssertionError(f"checkpoint entry {key!r} is not a tensor; non-tensor state goes to JSON")
        tensors[key] = {
            "dtype": str(item.properties.dtype).removeprefix("torch."),
            "size": list(item.size),
            "chunks": [[list(c.offsets), list(c.sizes)] for c in item.chunks],
        }
    storage = [
        {
            "fqn": idx.fqn,
            "offset": list(idx.offset or []),
            "index": idx.index,
            "path": info.relative_path,
            "start": info.offset,
            "length": info.length,
            "transforms": list(info.transform_descriptors or []),
        }
        for idx, info in md.storage_data.items()
    ]
    return {"version": md.version, "tensors": tensors, "storage": storage}


def _dtype(name: Any) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def _safe_file(name: Any) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"storage file {name!r} is not a plain file name")
    return name


def _metadata_from_json(data: Any) -> Metadata:
    """DCP Metadata from `_metadata_to_json`'s output; ValueError/KeyError/TypeError when malformed."""
    tensors: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    tensors = {
        key: TensorStorageMetadata(
            TensorProperties(dtype=_dtype(t["dtype"])),
            torch.Size(t["size"]),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in t["chunks"]],
        )
        for key, t in data["tensors"].items()
    }
    storage = {
        MetadataIndex(s["fqn"], s["offset"], s["index"]): _StorageInfo(
            _safe_file(s["path"]), int(s["start"]), int(s["length"]), list(s["transforms"]) or None
        )
        for s in data["storage"]
    }
    return Metadata(
        tensors, planner_data=None, storage_data=storage, storage_meta=StorageMeta(), version=data.get("version")
    )


class JsonMetadataWriter(FileSystemWriter):
    """DCP's file writer with the global metadata written as JSON (``.metadata.json``) instead of a pickle."""

    def finish(self, metadata: Metadata, results: list) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for wr_list in results for wr in wr_list}
        write_json(Path(self.path) / DCP_METADATA, _metadata_to_json(metadata))


class JsonMetadataReader(FileSystemReader):
    """DCP's file reader taking the metadata from ``.metadata.json`` (tensor files: torch.load(weights_only=True))."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_tensor_metadata(Path(self.path))


def read_tensor_metadata(path: Path) -> Metadata:
    """The DCP metadata of checkpoint ``path``; CheckpointError when it is missing or corrupt."""
    data = read_json(path / DCP_METADATA, "tensor metadata")
    try:
        return _metadata_from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(
            f"the tensor metadata {path / DCP_METADATA} is corrupt ({e!r}); "
            "restore the checkpoint from a copy or resume from an older one"
        ) from e


def write_json(path: Path, data: Any) -> None:
    """Write `data` as compact JSON and fsync it (a checkpoint's files are on disk before it moves into place)."""
    with open(path, "w") as f:
        json.dump(data, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())


def read_json(path: Path, what: str) -> Any:
    """The JSON in `path`; CheckpointError naming `what` when it is missing (and where a complete checkpoint may
    be) or corrupt."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} is missing: {_where_is_it(path.parent)}") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"the {what} {path} is unreadable or corrupt ({e}); restore the checkpoint from a "
            "copy or resume from an older one"
        ) from e


def _where_is_it(path: Path) -> str:
    """Why a checkpoint directory lacks a file, and where a complete one may be."""
    if not path.is_dir():
        older = sorted(path.parent.glob(f"{path.name}.old-*"))
        if older:
            return (
                f"no checkpoint at {path}, but a save into it was interrupted after the previous checkpoint "
                f"was moved to {older[-1]}: load that one"
            )
        return f"no checkpoint directory at {path}"
    return (
        f"{path} is not a complete fxkfac checkpoint (a save was interrupted, or it was written by "
        "another tool); load a directory that save() finished"
    )
