"""The command line's values: memory sizes, overheads, block sides and strategies read from text, and defaults."""

from __future__ import annotations

import argparse
import re
from decimal import Decimal, InvalidOperation
from enum import StrEnum
from typing import Literal

from fxkfac.config import ActivationCheckpointing, CheckpointMode
from fxkfac.planner.problem import ConfigError, PlannerError, PreconditionerKind, Strategy
from fxkfac.planner.problem.schedules import num_stages, validate_schedule_args
from fxkfac.planner.problem.strategy import parse_strategy

AUTO: Literal["auto"] = "auto"
"""--max-preconditioner-dim auto: the planner chooses the block side (planner.search.plan_search.choose_block_size)."""

MICRO_BATCH_SIZE = 32
"""Samples per micro-batch of a preset or a PipeFisher profile when --micro-batch-size is not given (the paper's)."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def enum_option(parser: argparse.ArgumentParser, flag: str, default: StrEnum, help: str) -> None:
    """Add option `flag` taking one value of `default`'s enum (every value listed by --help), `default` when absent."""
    kind = type(default)
    parser.add_argument(flag, type=kind, choices=list(kind), default=default, help=help)


class CliError(PlannerError):
    """Bad command-line input; printed as one line."""


def parse_bytes(text: str) -> int:
    """'16GiB', '512 MiB', '1.5e9', '8GB' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise CliError(f"cannot read the memory size {text!r}; write e.g. 16GiB, 512MiB, 8GB or 1.5e9")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def memory_text(n: int) -> str:
    """Bytes as '84.46GiB' where parse_bytes reads that back to exactly `n`, else the plain number."""
    for unit in ("GiB", "MiB", "KiB"):
        text = f"{n / _UNITS[unit.lower()]:.2f}{unit}"
        if n >= _UNITS[unit.lower()] and parse_bytes(text) == n:
            return text
    return str(n)


def parse_fraction(text: str) -> float:
    """'5%' -> 0.05, '0.05' -> 0.05 (decimal arithmetic: '5.23%' is exactly the float 0.0523, the value a
    refusal names)."""
    body = text.strip()
    try:
        value = float(Decimal(body[:-1]) / 100 if body.endswith("%") else Decimal(body))
    except InvalidOperation:
        raise CliError(f"cannot read the overhead {text!r}; write e.g. 5% or 0.05") from None
    if value < 0:
        raise CliError(f"the overhead must be >= 0, got {text!r}")
    return value


def parse_block_size(text: str) -> int | Literal["auto"]:
    """'auto' or a block side >= 1 ('1024')."""
    body = text.strip().lower()
    if body == AUTO:
        return AUTO
    if not body.isdigit() or int(body) < 1:
        raise CliError(f"cannot read the block size {text!r}; write a side >= 1 such as 1024, or auto")
    return int(body)


def positive(text: str) -> int:
    """An int >= 1 ('50')."""
    if not text.strip().isdigit() or int(text) < 1:
        raise CliError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def checkpointing_arg(text: str) -> ActivationCheckpointing:
    """--activation-checkpointing's value: off, auto, or the stages that recompute ('0,2')."""
    words = text.strip().lower()
    try:
        if words in (CheckpointMode.OFF, CheckpointMode.AUTO):
            return ActivationCheckpointing.of(words)
        return ActivationCheckpointing.of(tuple(int(s) for s in words.split(",")))
    except (ConfigError, ValueError):
        raise CliError(f"expected off, auto or stage indices such as 0,2, got {text!r}") from None


def strategy_arg(text: str) -> Strategy | None:
    """--strategy's value: a Strategy, or None for auto."""
    try:
        return None if text.strip().lower() == "auto" else parse_strategy(text)
    except ConfigError as e:
        raise CliError(str(e)) from None


def kind(args: argparse.Namespace) -> PreconditionerKind:
    """--preconditioner: the family planned."""
    return PreconditionerKind(args.preconditioner)


def micro_batch_size(args: argparse.Namespace) -> int:
    """--micro-batch-size, else MICRO_BATCH_SIZE."""
    return args.micro_batch_size or MICRO_BATCH_SIZE


def device(args: argparse.Namespace) -> str:
    """The device the analytic costs are for."""
    return args.hardware or "p100"


def check_schedule(args: argparse.Namespace) -> int:
    """Validate the schedule arguments; the number of (virtual) stages."""
    validate_schedule_args(args.schedule, args.stages, args.microbatches, args.virtual_stages)
    if args.dp < 1:
        raise CliError(f"--dp must be >= 1, got {args.dp}")
    return num_stages(args.schedule, args.stages, args.virtual_stages)
