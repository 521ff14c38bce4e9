"""The (pp, dp) layout of ranks: which global rank runs which pipeline rank and replica."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from fxkfac.errors import ConfigError

__all__ = ["MeshLayout", "StageCopies"]


@dataclass(frozen=True, slots=True)
class MeshLayout:
    """D pipeline ranks x W data-parallel replicas; global rank = pp * W + dp (row-major)."""

    D: int
    W: int
    rank: int

    def __post_init__(self) -> None:
        if self.D < 1 or self.W < 1:
            raise ConfigError(f"mesh sizes must be >= 1, got pp={self.D}, dp={self.W}")
        if not 0 <= self.rank < self.D * self.W:
            raise ConfigError(f"rank {self.rank} is outside a {self.D}x{self.W} mesh")

    @property
    def pp(self) -> int:
        """This rank's pipeline index."""
        return self.rank // self.W

    @property
    def dp(self) -> int:
        """This rank's replica index."""
        return self.rank % self.W

    @property
    def world_size(self) -> int:
        """D * W."""
        return self.D * self.W

    @classmethod
    def local(cls) -> MeshLayout:
        """One device: a 1x1 layout that needs no process group."""
        return cls(1, 1, 0)

    @classmethod
    def from_mesh(cls, mesh: Any) -> MeshLayout:
        """From a torch DeviceMesh with dims ("pp", "dp"), ("pp",) or ("dp",) (pure data parallelism: D = 1), or a
        (D,) / (D, W) tuple.

        The process group must be initialized and its world size must equal D * W; a DeviceMesh
        must lay ranks out row-major (as `init_device_mesh` does).
        """
        if not dist.is_initialized():
            raise ConfigError(
                "torch.distributed is not initialized; call init_process_group "
                "(or init_device_mesh) before compiling with a mesh"
            )
        if isinstance(mesh, tuple):
            sizes = tuple(int(x) for x in mesh)
        else:
            names = tuple(mesh.mesh_dim_names or ())
            if names not in (("pp", "dp"), ("pp",), ("dp",)):
                raise ConfigError(f"mesh dims must be ('pp', 'dp'), ('pp',) or ('dp',), got {names}")
            sizes = (1, *mesh.mesh.shape) if names == ("dp",) else tuple(mesh.mesh.shape)
            flat = [int(r) for r in mesh.mesh.flatten().tolist()]
            if flat != list(range(len(flat))):
                raise ConfigError(f"mesh ranks must be row-major 0..{len(flat) - 1}, got {flat}")
        D, W = (sizes[0], sizes[1] if len(sizes) > 1 else 1)
        if D * W != dist.get_world_size():
            raise ConfigError(f"mesh {D}x{W} does not match world size {dist.get_world_size()}")
        return cls(D, W, dist.get_rank())


@dataclass(frozen=True)
class StageCopies:
    """Every copy of one stage: the holder ranks and their process group (None: the world or alone)."""

    ranks: tuple[int, ...]
    group: Any
