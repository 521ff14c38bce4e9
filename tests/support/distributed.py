"""Multi-process test launcher: one process per rank (forked from a fork server) over gloo on 127.0.0.1, results
back to the test."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["RankResult", "run_distributed", "free_port"]


@dataclass(frozen=True)
class RankResult:
    """What one rank ended with: a value, or an error (type name, message, traceback), and its exit code."""

    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    exitcode: int | None = None

    @property
    def ok(self) -> bool:
        """The worker returned normally."""
        return self.error_type is None and self.exitcode in (0, None)


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.export",
    "torch._dynamo",
    "torch.export._trace",
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    "networkx",
    "transformers.models.bert.modeling_bert",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "fxkfac",
    "torch._inductor.sizevars",
    "torch.distributed.checkpoint",
    "sympy.combinatorics",
    "sympy.tensor.tensor",
    "fxkfac.compile_api",
    "fxkfac.checkpoint",
    "fxkfac.comm_profile",
    "fxkfac.plan_view",
    "tests.support.models",
]
"""Imported once by the fork server, which every rank is forked from: a rank does not re-import torch,
transformers and fxkfac (seconds of CPU each, times the ranks, on a 2-core machine). Only imports: no tensor
work runs before the fork. A module that fails to import is left to the rank."""


@functools.cache
def _launch_context() -> Any:
    """The forkserver context, its server preloading `_PRELOAD` (started once per test session)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    pg_timeout: float,
    args: tuple,
    results: Any,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the launching process's environment, as a spawned rank would have it
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world, *args)
        results.put((rank, pickle.dumps(RankResult(rank, value))))
    except BaseException as e:  # reported to the test, which decides
        results.put((rank, pickle.dumps(RankResult(rank, None, type(e).__name__, str(e), traceback.format_exc()))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0, pg_timeout: float = 60.0
) -> list[RankResult]:
    """Run `fn(rank, world, *args)` in `world` fresh processes; return each rank's RankResult.

    `fn` must be importable (module level). A rank that exits without reporting (e.g. os._exit)
    gets a RankResult with its exit code and no value. Processes still alive after `timeout`
    seconds are killed and reported with error_type "LauncherTimeout".
    """
    ctx = _launch_context()
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world, port, pg_timeout, args, results, environ), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    got: dict[int, RankResult] = {}
    while len(got) < world and time.monotonic() < deadline:
        try:
            rank, blob = results.get(timeout=0.5)
            got[rank] = pickle.loads(blob)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    out = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            out.append(RankResult(r, None, "LauncherTimeout", f"rank {r} still running after {timeout}s"))
            continue
        res = got.get(r, RankResult(r))
        out.append(RankResult(res.rank, res.value, res.error_type, res.error, res.traceback, p.exitcode))
    return out
