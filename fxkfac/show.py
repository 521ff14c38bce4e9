"""Terminal rendering of timelines and plans (rich), and Chrome/Perfetto traces; torch-free."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from fxkfac.planner.problem import Op, OpKind, PlanFormatError, PreconditionerKind
from fxkfac.planner.problem.costs import WORDS, TaskWords
from fxkfac.planner.problem.step_timeline import Interval, Timeline

__all__ = [
    "CATEGORIES",
    "categories",
    "category",
    "render_timeline",
    "render_summary",
    "chrome_trace",
    "timeline_from_trace",
]


@dataclass(frozen=True, slots=True)
class Category:
    """How one kind of work is drawn: a cell character, a rich style, a legend label."""

    char: str
    style: str
    label: str


def categories(words: TaskWords = WORDS[PreconditionerKind.KFAC]) -> dict[str, Category]:
    """Every drawing category, the preconditioner's tasks labelled in its family's `words`."""
    return {
        "fwd": Category("F", "bold white on blue", "forward (digit: micro-batch)"),
        "bwd": Category("B", "bold white on green", "backward"),
        "curv": Category("c", "black on yellow", words.stats),
        "inv": Category("I", "bold white on magenta", words.decomp),
        "sync": Category("s", "black on cyan", f"sync ({words.synced})"),
        "prec": Category("P", "bold white on red", words.apply),
        "idle": Category("·", "dim", "idle"),
    }


CATEGORIES: dict[str, Category] = categories()
"""The categories in K-FAC's words (chars and styles are the same for every family)."""

_CATEGORY_OF = {
    OpKind.FWD: "fwd",
    OpKind.BWD: "bwd",
    OpKind.BWD_W: "bwd",  # a zero-bubble schedule's W, the backward's weight-gradient half
    OpKind.STATS: "curv",
    OpKind.DECOMP: "inv",
    OpKind.SYNC_STATS: "sync",
    OpKind.BCAST: "sync",
    OpKind.ALLREDUCE_GRAD: "sync",
    OpKind.APPLY: "prec",
}


def category(op: Op) -> str:
    """The drawing category of `op` ("idle" for transfers, waits and the optimizer step)."""
    return _CATEGORY_OF.get(op.kind, "idle")


def _cells(intervals: Sequence[Interval], t0: float, t1: float, width: int) -> list[tuple[str, Op | None]]:
    """Per cell of [t0, t1) split into `width` cells, the category covering most of it and its
    longest op there (idle when work covers less than half the cell). Collectives without duration
    (the cost tables have no communication times) mark an otherwise idle cell as sync."""
    span = (t1 - t0) / width
    cover: list[dict[str, float]] = [{} for _ in range(width)]
    longest: list[tuple[float, Op | None]] = [(0.0, None)] * width
    instants: dict[int, Op] = {}
    for iv in intervals:
        name = category(iv.op)
        if name == "sync" and iv.end <= iv.start and t0 <= iv.start < t1:
            instants.setdefault(int((iv.start - t0) / span), iv.op)
        if name == "idle" or iv.end <= iv.start:
            continue
        first = max(0, int((iv.start - t0) / span))
        for cell in range(first, min(width - 1, int((iv.end - t0) / span)) + 1):
            overlap = min(t0 + (cell + 1) * span, iv.end) - max(t0 + cell * span, iv.start)
            if overlap > 0:
                cover[cell][name] = cover[cell].get(name, 0.0) + overlap
                longest[cell] = max(longest[cell], (overlap, iv.op), key=lambda x: x[0])
    cells: list[tuple[str, Op | None]] = []
    for n, (c, (_, op)) in enumerate(zip(cover, longest)):
        if c and sum(c.values()) >= span / 2:
            cells.append((max(c, key=c.__getitem__), op))
        elif n in instants:
            cells.append(("sync", instants[n]))
        else:
            cells.append(("idle", None))
    return cells


def _char(name: str, op: Op | None) -> str:
    """F/B cells show the micro-batch's last digit so neighbouring boxes stay apart."""
    if name in ("fwd", "bwd") and op is not None and op.mb is not None:
        return str(op.mb % 10)
    return CATEGORIES[name].char


def render_timeline(
    timeline: Timeline,
    *,
    width: int = 80,
    title: str = "",
    window: tuple[float, float] | None = None,
    words: TaskWords = WORDS[PreconditionerKind.KFAC],
) -> RenderableType:
    """One row per rank across `window` (default: the whole run), scaled to `width` columns, and a legend that
    names the preconditioner's tasks in its family's `words`."""
    t0, t1 = window if window is not None else (0.0, timeline.length)
    label_width = len(f"r{max(timeline.ranks, default=0)}") + 1
    cells = max(8, width - label_width - 2)
    lines: list[Text] = []
    if title:
        lines.append(Text(title, style="bold"))
    axis = f"{t0 * 1e3:.1f} ms".ljust(cells - 12) + f"{t1 * 1e3:.1f} ms".rjust(12)
    lines.append(Text(" " * label_width + " " + axis[:cells], style="dim"))
    for rank in timeline.ranks:
        row = Text(f"r{rank}".ljust(label_width) + "│")
        inside = [iv for iv in timeline.of_rank(rank) if iv.end > t0 and iv.start < t1]
        for name, op in _cells(inside, t0, t1, cells) if t1 > t0 else []:
            row.append(_char(name, op), style=CATEGORIES[name].style)
        row.append("│")
        lines.append(row)
    lines.append(_legend(width, words))
    return Group(*lines)


def _legend(width: int, words: TaskWords) -> Text:
    legend = Text()
    used = 0
    for cat in categories(words).values():
        entry = f" {cat.char} {cat.label}  "
        if used + len(entry) > width:
            legend.append("\n")
            used = 0
        legend.append(f" {cat.char} ", style=cat.style)
        legend.append(f" {cat.label}  ")
        used += len(entry)
    return legend


def render_summary(title: str, rows: Iterable[tuple[str, str]]) -> Table:
    """A two-column table (quantity, value)."""
    table = Table(title=title, show_header=False, title_justify="left", pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows:
        table.add_row(name, value)
    return table


def chrome_trace(
    timeline: Timeline, path: str | Path | None = None, words: TaskWords = WORDS[PreconditionerKind.KFAC]
) -> dict[str, Any]:
    """A Chrome/Perfetto trace (one track per rank, µs), the runtime's format; written to `path` if given. Each
    event's args name its task in the family's `words` ("task": "root inverse"); its name is the op."""
    labels = categories(words)
    events: list[dict[str, Any]] = [
        {
            "name": str(iv.op),
            "cat": iv.op.kind.value,
            "ph": "X",
            "pid": 0,
            "tid": iv.rank,
            "ts": iv.start * 1e6,
            "dur": (iv.end - iv.start) * 1e6,
            "args": {"step": iv.step, "task": labels[category(iv.op)].label},
        }
        for iv in timeline.intervals
    ]
    events += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}} for r in timeline.ranks
    ]
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


def timeline_from_trace(trace: Mapping[str, Any]) -> Timeline:
    """A Timeline from a Chrome trace written by `chrome_trace` or the runtime (event names are ops)."""
    try:
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        intervals = tuple(
            Interval(
                int(e["tid"]),
                int(e.get("args", {}).get("step", 0)),
                Op.parse(e["name"]),
                float(e["ts"]) / 1e6,
                (float(e["ts"]) + float(e["dur"])) / 1e6,
            )
            for e in events
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PlanFormatError(f"not a Chrome trace of fxkfac ops ({type(e).__name__}: {e})") from e
    start = min((iv.start for iv in intervals), default=0.0)
    shifted = tuple(
        sorted(
            (Interval(iv.rank, iv.step, iv.op, iv.start - start, iv.end - start) for iv in intervals),
            key=lambda iv: (iv.start, iv.rank),
        )
    )
    ranks = tuple(sorted({iv.rank for iv in shifted}))
    return Timeline(shifted, ranks, 1 + max((iv.step for iv in shifted), default=0))
