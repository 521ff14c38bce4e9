"""A command's start, where its `--time-limit` counts from (fxkfac/cli_start.py, [Note: command budget])."""

from __future__ import annotations

import sys

import pytest

from fxkfac import cli_start
from fxkfac.cli_start import StartSource, call_start, process_start, started_at
from fxkfac.planner.search.budget import Start


def test_the_process_start_is_read_from_its_stat_line_name_and_all() -> None:
    """`starttime`, the 22nd field, counts clock ticks since boot; a process name may hold spaces and parentheses."""
    fields = ["S"] + ["0"] * 18 + ["12345"] + ["0"] * 10  # state, then fields 4..21, starttime (22), the rest
    stat = "4242 (fx (kfac) plan) " + " ".join(fields)
    assert started_at(stat, uptime=130.45, ticks_per_second=100, now=7.0) == pytest.approx(7.0 - 7.0)
    assert started_at(stat, uptime=123.45, ticks_per_second=100, now=7.0) == 7.0  # read within one tick: no age


def test_process_start_says_what_it_measures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where /proc is there (Linux) the start is the process's and no later than now; where it is not, this module's
    import, said so; either way every module loaded is the command's. An in-process call starts now and charges no
    imports."""
    start, source = process_start()
    if sys.platform == "linux":
        assert source is StartSource.PROCESS and start.at <= cli_start.time.perf_counter() and start.modules == 0

    def no_procfs(*_: object, **__: object) -> None:
        raise FileNotFoundError("/proc/self/stat")

    monkeypatch.setattr(cli_start, "open", no_procfs, raising=False)
    assert process_start() == (Start(cli_start._IMPORTED, 0), StartSource.IMPORT)
    called, source = call_start()
    assert source is StartSource.CALL and called.modules is None
