"""`fxkfac demo`: PipeFisher against the plain AdamW pipeline on the embedded default (fxkfac/demo.py), and the table
that compares them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table

from fxkfac.demo import DemoConfig, DemoResult, reach, run_demo

__all__ = ["main", "render_result"]


def render_result(result: DemoResult, cfg: DemoConfig) -> Table:
    """PipeFisher against AdamW: validation loss, steps, wall time, time per step, and time to the baseline's loss."""
    baseline = next((c for c in result.curves if c.plan_json is None), result.curves[-1])
    table = Table(
        title=f"{cfg.schedule} D={cfg.stages} W={cfg.dp} N={cfg.microbatches}, batch {cfg.batch_size} x "
        f"{cfg.seq_len} tokens: validation loss (stdlib held-out files)",
        title_justify="left",
    )
    for col in ("run", "val loss", "steps", "train wall s", "ms / step", f"to {baseline.name}'s final loss"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for c in result.curves:
        got = reach(c, baseline.final_val)
        to = "-" if got is None else f"{got[0]} steps, {got[1]:.1f} s"
        table.add_row(c.name, f"{c.final_val:.4f}", str(c.steps), f"{c.seconds:.1f}", f"{c.step_time * 1e3:.1f}", to)
    return table


def config_from(base: DemoConfig, **overrides: Any) -> DemoConfig:
    """`base` with the given fields replaced (None values are ignored), validated."""
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def main(args: Any, console: Console) -> int:
    """`fxkfac demo`: plan, train PipeFisher and AdamW over local processes, print the comparison."""
    cfg = config_from(
        DemoConfig(),
        stages=args.stages,
        dp=args.dp,
        schedule=args.schedule,
        microbatches=args.microbatches,
        steps=args.steps,
        seconds=args.seconds,
    )
    if cfg.seconds is not None and args.steps is None:
        cfg = replace(cfg, steps=1_000_000)
    console.print(
        f"fxkfac demo: TinyBert MLM ({cfg.model.layers} blocks, hidden {cfg.model.hidden}) on the CPython "
        f"stdlib source, {cfg.world} local processes ({cfg.schedule}, D={cfg.stages}, W={cfg.dp}, "
        f"N={cfg.microbatches}); planning K-FAC into the bubbles (plan='auto')",
        highlight=False,
    )
    result = run_demo(cfg, console)
    console.print(render_result(result, cfg))
    return 0
