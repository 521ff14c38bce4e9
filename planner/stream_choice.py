"""Which layers of the first stage to stream, and to which rank (planner/streaming.py): the choice that shortens
the reference step most."""

from __future__ import annotations

from dataclasses import replace

from fxkfac.planner.ir import OpKind
from fxkfac.planner.problem import Problem, copies_of_stage
from fxkfac.planner.step_timeline import step_timeline
from fxkfac.planner.streaming import Streaming, ready_fractions

__all__ = ["with_streaming", "STREAMED_STAGE"]

STREAMED_STAGE = 0
"""The stage whose APPLY lies on the cycle every step repeats (GPipe, 1F1B): its last backward ends the step."""


def _streamable(problem: Problem) -> list[str]:
    """The first stage's layers a helper may apply, in the order its backward makes their gradients final: every
    layer whose APPLY reads its preconditioner alone (no optimizer state, statistics from captures)."""
    layers = problem.costs.stages[STREAMED_STAGE].layers
    fractions = ready_fractions(layers)
    ok = [x.name for x in layers if not x.state_bytes and all(p.after is not OpKind.ALLREDUCE_GRAD for p in x.parts)]
    return sorted(ok, key=lambda n: fractions[n])


def _helper(problem: Problem) -> int:
    """The rank that ends its step's F/B and per-step work first (it idles longest before the step ends), the
    lowest such rank on a tie; never the streamed stage's owner."""
    step = step_timeline(problem)
    owner = copies_of_stage(problem, STREAMED_STAGE)[0]
    ends = {
        d: max((end for op, _, end in step.ops[d] if op.kind is not OpKind.OPT_STEP), default=0.0)
        for d in problem.devices
        if d != owner
    }
    return min(ends, key=lambda d: (ends[d], d))


def with_streaming(problem: Problem) -> Problem:
    """`problem` with the first stage's APPLY streamed to the rank that idles longest at the step's end, for the
    prefix of its layers (in the order their gradients become final) that gives the shortest reference step; the
    problem unchanged where nothing shortens it, where the stage has copies (W > 1, Chimera) or a single rank runs
    every stage, or where it already streams."""
    if problem.streaming is not None or len(problem.devices) < 2:
        return problem
    if len(copies_of_stage(problem, STREAMED_STAGE)) != 1:
        return problem
    names = _streamable(problem)
    if not names:
        return problem
    helper = _helper(problem)
    best, best_length = problem, step_timeline(problem).length
    for n in range(1, len(names) + 1):
        candidate = replace(problem, streaming=Streaming(STREAMED_STAGE, helper, tuple(names[:n])))
        length = step_timeline(candidate).length
        if length < best_length * (1 - 1e-9):
            best, best_length = candidate, length
    return best
