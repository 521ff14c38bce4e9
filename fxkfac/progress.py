"""What a run is doing, shown on one rank: plan="auto"'s phases and solver, and training's step, loss and speed.

Rich draws a live line when stdout is a terminal; otherwise the same news goes to `logging` (logger
``fxkfac.progress``, INFO). When logging is not configured at all, that logger writes to stderr itself, so a
piped run is never silent. The planner reports through plain data (`planner.problem.SolveProgress`) and knows
nothing of this module; these renderers only observe.
"""

from __future__ import annotations

import atexit
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.status import Status
from rich.text import Text

from fxkfac.planner.problem import SolveProgress

if TYPE_CHECKING:
    from fxkfac.planner.plan import Plan

__all__ = [
    "Display",
    "PlanProgress",
    "TrainingProgress",
    "plan_progress",
    "training_progress",
    "solve_text",
    "steps_per_second",
]

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
"""Seconds between two training lines (and two solver improvements) in log mode."""

RATE_WINDOW = 20
"""Steps/s is measured over the last this many steps (the first step, which compiles, drops out)."""


class Display(Enum):
    """How progress is shown: a rich live line (stdout is a terminal), log records, or not at all (other ranks)."""

    RICH = "rich"
    LOG = "log"
    OFF = "off"

    @classmethod
    def of(cls, shown: bool, console: Console | None = None) -> Display:
        """RICH on a terminal, else LOG; OFF when this rank shows nothing."""
        if not shown:
            return cls.OFF
        return cls.RICH if (console or Console()).is_terminal else cls.LOG


def _loggable() -> None:
    """Make INFO of this module's logger visible when the program configured no logging (the root has no
    handler): a plain stderr handler on this logger alone. A configured program decides for itself."""
    if logging.getLogger().handlers or log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fxkfac: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


_PLACEMENT = {
    "OPTIMAL": "placed",
    "FEASIBLE": "placed",
    "INFEASIBLE": "cannot be placed",
    "UNKNOWN": "no placement yet",
    "MODEL_INVALID": "invalid model",
}
"""A search for any placement (a refresh period or a stretch tried), by CP-SAT status, in words."""


def solve_text(event: SolveProgress) -> str:
    """One solver report in words: the window and, when minimizing staleness (the objective: steps a layer runs on
    an old decomposition), the objective, its bound and the gap."""
    if event.objective is None:
        what = _PLACEMENT.get(event.status, event.status.lower())
        if event.bound is not None:
            what += f", bound {event.bound:g}"
    else:
        what = f"objective {event.objective:g}, bound {event.bound:g}, gap {event.gap:.0%}"
        if event.done:
            what += ", optimal" if event.status == "OPTIMAL" else ", time limit"
    return f"{event.window}: {what} ({event.seconds:.1f} s)"


def _line(text: str, width: int) -> Text:
    """A live line beside a spinner that never wraps: cut with an ellipsis to `width` columns less the spinner's."""
    line = Text(text)
    line.truncate(max(1, width - 2), overflow="ellipsis")
    return line


def steps_per_second(stamps: deque[float]) -> float | None:
    """Steps per second over the time stamps of the last steps (None before two)."""
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return None
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


class PlanProgress:
    """plan="auto" on rank 0: each phase (measuring links, profiling, solving) with its time, the solver's
    reports (`solver`, the `SolverConfig.progress` callback) and the plan's summary (`done`)."""

    def __init__(
        self, display: Display, console: Console | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.display, self.clock = display, clock
        self.console = console or Console()
        self.status: Status | None = None
        self.current: tuple[str, float] | None = None
        self.last_log = -LOG_EVERY_S
        if display is Display.LOG:
            _loggable()

    @property
    def shown(self) -> bool:
        """Whether this rank shows anything."""
        return self.display is not Display.OFF

    def phase(self, text: str) -> None:
        """A new phase begins (the one before ends, with its time)."""
        self._end_phase()
        self.current = (text, self.clock())
        if self.display is Display.LOG:
            log.info("plan='auto': %s", text)
        elif self.display is Display.RICH:
            if self.status is None:
                self.status = self.console.status(_line(f"plan='auto': {text}", self.console.width))
                self.status.start()
            else:
                self.status.update(_line(f"plan='auto': {text}", self.console.width))

    def note(self, text: str) -> None:
        """A fact the user should know about this plan (a line of its own)."""
        if self.display is Display.LOG:
            log.info("plan='auto': %s", text)
        elif self.display is Display.RICH:
            self.console.print(text, markup=False)

    def solver(self, event: SolveProgress) -> None:
        """A report of CP-SAT (`SolverConfig.progress`): the live line shows the latest; the log gets the end of
        every staleness minimization and, at most every LOG_EVERY_S, the latest report."""
        text = solve_text(event)
        if self.display is Display.RICH and self.status is not None:
            self.status.update(_line(f"plan='auto': solving {text}", self.console.width))
        elif self.display is Display.LOG:
            now = self.clock()
            if (event.done and event.objective is not None) or now - self.last_log >= LOG_EVERY_S:
                self.last_log = now
                log.info("plan='auto': solving: %s", text)

    def done(self, plan: Plan) -> None:
        """Planning ended with `plan`: its summary (fxkfac.plan_view's rows, as `fxkfac plan` prints them)."""
        from fxkfac.plan_view import plan_rows
        from fxkfac.show import render_summary

        self.close()
        if self.display is Display.LOG:
            for name, value in plan_rows(plan):
                log.info("plan='auto': %s: %s", name, value)
        elif self.display is Display.RICH:
            self.console.print(render_summary("plan='auto'", plan_rows(plan)))

    def close(self) -> None:
        """End the phase in progress and the live line."""
        self._end_phase()
        if self.status is not None:
            self.status.stop()
            self.status = None

    def _end_phase(self) -> None:
        if self.current is None:
            return
        text, began = self.current
        self.current = None
        seconds = self.clock() - began
        if self.display is Display.LOG:
            log.info("plan='auto': %s took %.1f s", text, seconds)
        elif self.display is Display.RICH:
            self.console.print(f"[green]✓[/green] {text} ({seconds:.1f} s)")


@contextmanager
def plan_progress(shown: bool) -> Iterator[PlanProgress]:
    """A PlanProgress for the block (OFF where not `shown`), whose live line ends with it, errors included."""
    progress = PlanProgress(Display.of(shown))
    try:
        yield progress
    finally:
        progress.close()


class TrainingProgress:
    """Step, loss and steps/s after each `update`: a rich bar on a terminal, a log line on the first step and
    every LOG_EVERY_S after it otherwise, nothing when OFF. The bar ends at `close` or at exit."""

    def __init__(
        self,
        display: Display,
        console: Console | None = None,
        clock: Callable[[], float] = time.perf_counter,
        every_s: float = LOG_EVERY_S,
    ) -> None:
        self.display, self.clock, self.every_s = display, clock, every_s
        self.console = console
        self.stamps: deque[float] = deque(maxlen=RATE_WINDOW)
        self.bar: Progress | None = None
        self.task = TaskID(0)
        self.last_log: float | None = None
        if display is Display.LOG:
            _loggable()

    def update(self, step: int, loss: float) -> None:
        """Step `step` (steps done so far) ended with `loss`."""
        if self.display is Display.OFF:
            return
        now = self.clock()
        self.stamps.append(now)
        rate = steps_per_second(self.stamps)
        speed = "-" if rate is None else f"{rate:.2f}"
        if self.display is Display.LOG:
            if self.last_log is None or now - self.last_log >= self.every_s:
                self.last_log = now
                log.info("step %d  loss %.4f  %s steps/s", step, loss, speed)
            return
        if self.bar is None:
            self.bar = Progress(
                SpinnerColumn(),
                TextColumn("step {task.fields[step]}"),
                TextColumn("loss {task.fields[loss]:.4f}"),
                TextColumn("{task.fields[speed]} steps/s"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self.task = self.bar.add_task("train", total=None, step=step, loss=loss, speed=speed)
            self.bar.start()
            atexit.register(self.close)
        self.bar.update(self.task, step=step, loss=loss, speed=speed)

    def close(self) -> None:
        """End the bar (its last state stays on the terminal)."""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
            atexit.unregister(self.close)


def training_progress(enabled: bool, rank: int) -> TrainingProgress:
    """The trainer's progress (`PipelineOptions.progress`): shown on rank 0 only (every rank returns the same loss)."""
    return TrainingProgress(Display.of(enabled and rank == 0), every_s=LOG_EVERY_S)
