"""A small local launcher: one spawned process per rank over gloo on 127.0.0.1, results and errors back
to the caller."""

from __future__ import annotations

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

import torch.multiprocessing as mp

from fxkfac.errors import PipelineError, PipelineTimeoutError

__all__ = ["RankContext", "launch", "free_port"]

_RESULT, _ERROR, _EVENT = "result", "error", "event"


@dataclass(frozen=True)
class RankContext:
    """What a launched function gets first: its rank, the world size, and `report` for progress events."""

    rank: int
    world: int
    _channel: Any

    def report(self, payload: Any) -> None:
        """Send a picklable `payload` to the launching process's `on_event(rank, payload)` (in order per rank)."""
        self._channel.put((_EVENT, self.rank, pickle.dumps(payload)))


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable[..., Any], rank: int, world: int, port: int, pg_timeout: float, threads: int, args: tuple, channel: Any
) -> None:
    """Body of one rank: join the gloo group, run `fn(ctx, *args)`, send its value or its error back."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout),
        )
        dist.barrier()  # every rank has its connections before any can finish and close them
        value = fn(RankContext(rank, world, channel), *args)
        channel.put((_RESULT, rank, pickle.dumps(value)))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the launcher, which raises it
        channel.put((_ERROR, rank, pickle.dumps((type(e).__name__, str(e), traceback.format_exc()))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _first_cause(errors: dict[int, tuple[str, str, str]]) -> tuple[int, tuple[str, str, str]]:
    """The rank whose error most likely caused the others: a rank not merely waiting on a peer, else the lowest."""
    secondary = ("PipelineTimeoutError", "PipelineError", "DistBackendError", "DistNetworkError")
    primary = {r: e for r, e in errors.items() if e[0] not in secondary}
    pick = primary or errors
    rank = min(pick)
    return rank, pick[rank]


def launch(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 600.0,
    pg_timeout: float = 120.0,
    threads: int = 1,
    on_event: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """Run `fn(ctx, *args)` in `world` spawned processes (gloo, 127.0.0.1, `threads` threads each).

    `fn` must be importable (defined at module level). Returns each rank's return value, by rank.
    A rank that raises makes this raise PipelineError naming the rank and its error (the full traceback
    is in the exception's `details`); a rank that dies without a word raises PipelineError with its exit
    code; ranks still running after `timeout` seconds are killed and PipelineTimeoutError is raised.
    Events a rank sends with `ctx.report(payload)` reach `on_event(rank, payload)` while it runs.
    """
    if world < 1:
        raise PipelineError(f"launch needs at least one rank, got world={world}")
    ctx = mp.get_context("spawn")
    channel = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world, port, pg_timeout, threads, args, channel), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    errors: dict[int, tuple[str, str, str]] = {}
    try:
        _collect(procs, channel, time.monotonic() + timeout, on_event, values, errors)
    finally:
        killed = _stop(procs, answered=set(values) | set(errors))
    return _outcome(procs, values, errors, killed, timeout)


def _stop(procs: list[Any], answered: set[int], grace: float = 10.0) -> list[int]:
    """Let answered ranks exit (`grace` seconds), kill what still runs; the ranks that never answered and
    were killed."""
    deadline = time.monotonic() + grace
    killed = []
    for r, p in enumerate(procs):
        p.join(timeout=max(0.0, deadline - time.monotonic()) if r in answered else 0.0)
        if p.is_alive():
            p.kill()
            p.join()
            if r not in answered:
                killed.append(r)
    return killed


def _collect(
    procs: list[Any],
    channel: Any,
    deadline: float,
    on_event: Callable[[int, Any], None] | None,
    values: dict[int, Any],
    errors: dict[int, tuple[str, str, str]],
) -> None:
    """Fill `values` and `errors` (and pass events on) until every rank has answered, all exited, or the deadline."""
    while len(values) + len(errors) < len(procs) and time.monotonic() < deadline:
        try:
            kind, rank, blob = channel.get(timeout=0.2)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and channel.empty():
                break
            continue
        if kind == _EVENT:
            if on_event is not None:
                on_event(rank, pickle.loads(blob))
        elif kind == _RESULT:
            values[rank] = pickle.loads(blob)
        else:
            errors[rank] = pickle.loads(blob)
            deadline = min(deadline, time.monotonic() + 30.0)  # peers get a moment to report, then stop


def _outcome(
    procs: list[Any], values: dict[int, Any], errors: dict[int, tuple[str, str, str]], killed: list[int], timeout: float
) -> list[Any]:
    """The values by rank, or the one error that explains the failure."""
    if errors:
        rank, (name, message, trace) = _first_cause(errors)
        err = PipelineError(f"rank {rank} failed: {name}: {message}")
        err.details = trace  # type: ignore[attr-defined]  # the remote traceback, for callers that want it
        raise err
    silent = [r for r in range(len(procs)) if r not in values and r not in killed]
    if silent:
        r = silent[0]
        raise PipelineError(f"rank {r} exited with code {procs[r].exitcode} without reporting a result")
    if killed:
        raise PipelineTimeoutError(
            f"ranks {killed} were still running after {timeout:g} s and were stopped; "
            "raise the timeout or shrink the run"
        )
    return [values[r] for r in range(len(procs))]
