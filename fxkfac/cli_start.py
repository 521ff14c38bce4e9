"""When a command began: where its `--time-limit` counts from ([Note: command budget], planner/search/budget.py)."""

from __future__ import annotations

import os
import time
from enum import StrEnum

from fxkfac.planner.search.budget import Start

_IMPORTED = time.perf_counter()
"""When this module was imported: where a command's budget opens when the process's start cannot be read."""


class StartSource(StrEnum):
    """Where a command's budget opens."""

    PROCESS = "the process's start"
    IMPORT = "fxkfac's command-line import (Python's start and the imports before it not counted)"
    CALL = "the call"


def started_at(stat: str, uptime: float, ticks_per_second: int, now: float) -> float:
    """The perf_counter time a process started, from its /proc/<pid>/stat line (`starttime`, the 22nd field: clock
    ticks since boot), the seconds since boot (/proc/uptime) and perf_counter's `now` read at the same moment."""
    fields = stat[stat.rindex(")") + 2 :].split()  # the name, in parentheses, may hold spaces
    age = uptime - int(fields[19]) / ticks_per_second  # field 22 is the 20th after the name
    return now - max(0.0, age)


def process_start() -> tuple[Start, StartSource]:
    """The start of a command that is its process (the console script): /proc/self/stat where there is one (Linux,
    to its clock tick), else this module's import, which misses the interpreter's start and the imports before it;
    every module the process loaded is the command's."""
    try:
        with open("/proc/self/stat") as f, open("/proc/uptime") as u:
            stat, uptime, now = f.read(), float(u.read().split()[0]), time.perf_counter()
        return Start(started_at(stat, uptime, os.sysconf("SC_CLK_TCK"), now)), StartSource.PROCESS
    except (OSError, ValueError, IndexError, AttributeError):  # no procfs (macOS, Windows), or one unlike Linux's
        return Start(_IMPORTED), StartSource.IMPORT


def call_start() -> tuple[Start, StartSource]:
    """The start of a command called in a running process (`fxkfac.cli.main(argv)`): now, its imports not charged (what
    the process loaded before depends on what it ran, and a plan would)."""
    return Start(time.perf_counter(), None), StartSource.CALL
