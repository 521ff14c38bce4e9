"""Where the preconditioning of a parameter several stages use (tied weights: GPT-2's wte and lm_head) lives.

Such a parameter is one unit of work: its statistics, decompositions and per-step direction are made once, on one
owner stage, which the planner places and prices like any other unit of that stage (its memory counted once). The
runtime sums the parameter's gradient over its stages before the owner's statistics and sends the owner's
direction to the other stages, so every copy takes the same step (fxkfac/runtime/preconditioning.py).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["tied_owner"]


def tied_owner(stages: Sequence[int]) -> int:
    """The owner of a parameter the `stages` share: the lowest. A pipeline's backward runs the stages in reverse, so
    the lowest stage's gradient is complete last in every schedule: when its ALLREDUCE_GRAD ends, every other
    stage's share of the tied gradient is there too, and the statistics the planner places after that op (as for any
    unit of the stage) see the summed gradient without a dependency across devices. A higher owner would wait, idle
    or not, for a gradient another device completes later."""
    if not stages:
        raise ValueError("a tied parameter is used by at least one stage")
    return min(stages)
