"""Plan files read back (written by `Plan.save`): parsed, shape-checked and, on `load_plan`, validated. The validator
assumes a well-formed plan, so the shape checks refuse one that is not (an op on a rank without its stage, a NaN that
makes every comparison pass) with a PlanFormatError saying what is wrong: loading never ends in another exception."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path
from typing import Any

from fxkfac.planner.plan.plan import SCHEMA_VERSION, Plan
from fxkfac.planner.plan.solution import plan_born
from fxkfac.planner.plan.window import placed_w
from fxkfac.planner.problem.errors import PlanError, PlanFormatError, PlanMismatchError
from fxkfac.planner.problem.ir import PRECONDITIONER_KINDS, Op, OpKind
from fxkfac.planner.problem.lowering import startup_programs
from fxkfac.planner.problem.problem import Problem, is_streamed
from fxkfac.planner.problem.step_timeline import base_programs
from fxkfac.planner.validate.checks import check_plan

MAX_QUANTUM_SHARE = 0.01
"""The coarsest time grid a file may claim, as a share of the step (the planner's is 1e-5 or exact): the
validator's tolerance is the grid, so a coarse claimed grid would let overlaps pass."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise PlanFormatError(f"the plan file is malformed: {message}; make the plan again (fxkfac plan ... --export)")


def _check_op(problem: Problem, op: Op, device: int, fixed: dict[int, set]) -> None:
    """A preconditioner's op (placed or in a program) names a stage `device` runs, and its layer, part, micro-batch."""
    _need(op.kind in PRECONDITIONER_KINDS, f"placement of {op}: only the preconditioner's ops are placed")
    _need(op.stage is not None and op.stage < problem.num_stages, f"placement of {op}: no such stage")
    _need(device in problem.holders[op.stage_id], f"{op} is placed on r{device}, which does not run its stage")
    layers = {x.name: x for x in problem.costs.stages[op.stage_id].layers}
    if op.kind in (OpKind.STATS, OpKind.SYNC_STATS, OpKind.DECOMP, OpKind.BCAST):  # name a layer and its part
        parts = {p.part for p in layers[op.layer_name].parts} if op.layer in layers else set()
        _need(op.part in parts, f"{op}: stage {op.stage} has no layer {op.layer!r} or the layer has no such part")
    if op.kind in (OpKind.APPLY, OpKind.BCAST_PREC) and op.layer is not None:  # may (APPLY) or must name a layer
        _need(op.layer in layers, f"{op}: stage {op.stage} has no layer {op.layer!r}")
    if op.kind is OpKind.STATS:
        kind = problem.costs.layer(op.layer_name).part(op.part_name).after
        if kind is OpKind.ALLREDUCE_GRAD:
            _need(
                op.mb is None and op.pipe == 0,
                f"{op}: part {op.part} is fed by the reduced gradient, so its "
                "STATS names no micro-batch and no pipe (one per step and copy of the stage)",
            )
        else:
            _need(op.mb is not None, f"{op}: part {op.part} is fed by a capture, so its STATS names a micro-batch")
            _need(
                (kind, op.stage, op.mb, op.pipe) in fixed[device],
                f"{op} on r{device}: r{device} runs no such micro-batch of the stage",
            )


def _check_placements(plan: Plan, fixed: dict[int, set]) -> None:
    problem = plan.problem
    for p in plan.placements:
        _need(_is_int(p.device) and p.device in fixed, f"placement of {p.op}: no rank {p.device}")
        _need(_is_int(p.step) and p.step >= 0, f"placement of {p.op}: step must be an int >= 0")
        _need(
            _is_number(p.start) and _is_number(p.end) and p.start <= p.end,
            f"placement of {p.op}: start and end must be finite, start <= end",
        )
        if p.op.kind is OpKind.BWD_W:  # a zero-bubble schedule's W, placed among the preconditioner's work
            _need(
                placed_w(problem) and (p.op.kind, p.op.stage, p.op.mb, p.op.pipe) in fixed[p.device],
                f"placement of {p.op} on r{p.device}: no such W of the schedule is placed",
            )
            layers = [x.name for x in problem.costs.stages[p.op.stage_id].layers]
            _need(p.op.layer in (None, *layers), f"placement of {p.op} on r{p.device}: no layer {p.op.layer} there")
        else:
            _check_op(problem, p.op, p.device, fixed)


def _check_programs(plan: Plan) -> dict[int, set]:
    """The programs' shape; returns each rank's F/B/W as (kind, stage, micro-batch, pipe)."""
    _need(
        plan.problem.D * plan.problem.W == len(plan.programs),
        f"programs for {len(plan.programs)} ranks, the mesh has D x W = {plan.problem.D * plan.problem.W}",
    )  # before the ranks are listed: a mutated D or W
    devices = set(plan.problem.devices)
    _need(set(plan.programs) == devices, f"programs for ranks {sorted(plan.programs)}, the mesh has {sorted(devices)}")
    _need(all(len(steps) >= 1 for steps in plan.programs.values()), "every rank's program needs at least one step")
    forwards = sum(op.kind is OpKind.FWD for steps in plan.programs.values() for op in steps[0])
    _need(
        plan.problem.N <= forwards,
        f"N={plan.problem.N} micro-batches, but the programs' first step runs only {forwards} forwards",
    )  # before the schedule of N is built: a mutated N must not cost gigabytes
    fixed = {
        d: {(op.kind, op.stage, op.mb, op.pipe) for op in ops if op.kind in (OpKind.FWD, OpKind.BWD, OpKind.BWD_W)}
        for d, ops in base_programs(plan.problem).items()
    }
    streaming = plan.problem.streaming
    for device, steps in plan.programs.items():
        for op in (op for ops in steps for op in ops if op.kind in PRECONDITIONER_KINDS):
            if not is_streamed(plan.problem, device, op):
                _check_op(plan.problem, op, device, fixed)  # the same rules as a placed op's
                continue
            # a streamed layer's op: between its stage's owners and the layer's helper
            on = f"{op} on r{device}"
            _need(streaming is not None and op.layer in streaming.layers, f"{on}: the problem streams no such layer")
            assert streaming is not None and op.layer is not None  # _need raised otherwise
            ends = {*plan.problem.stream_owners, streaming.helper_of(op.layer)}
            _need(
                op.stage == streaming.stage and device in ends, f"{on}: not between the stage's owners and its helper"
            )
            _need(op.peer is None or op.peer in ends - {device}, f"{on}: its peer is not the other end")
    return fixed


def _check_metrics(plan: Plan) -> None:
    m = plan.metrics
    for f in fields(m):  # by the field's type: a float, or a per-stage tuple of ints
        value, kind = getattr(m, f.name), str(f.type)
        if isinstance(value, float) or kind in ("float", str(float)):
            _need(_is_number(value) and value >= 0, f"metrics.{f.name} must be a finite number >= 0")
        if kind.startswith("tuple[int"):
            _need(len(value) == plan.problem.num_stages, f"metrics.{f.name} needs one entry per stage")
            ok = all(_is_int(v) or (v is None and "None" in kind) for v in value)
            _need(ok, f"metrics.{f.name} must hold ints")
    _need(all(_is_int(d) and _is_int(b) for d, b in m.peak_memory.items()), "metrics.peak_memory maps ranks to bytes")
    solver = m.solver
    numbers = _is_number(solver.wall_time) and _is_number(solver.gap) and all(_is_int(v) for v in solver.objective)
    _need(isinstance(solver.status, str) and numbers, "metrics.solver is malformed")
    _need(
        m.time_quantum <= MAX_QUANTUM_SHARE * max(m.step_time_reference, 0.0),
        f"metrics.time_quantum {m.time_quantum!r} s is coarser than {MAX_QUANTUM_SHARE:.0%} of the step",
    )
    _need(m.utilization <= 1 + 1e-9 and m.utilization_baseline <= 1 + 1e-9, "utilization above 100%")


def _check_startup(plan: Plan) -> None:
    """The start-up steps are what `startup_programs` derives (their count compared first, so a placement claiming a
    huge window step is refused without building that many steps)."""
    born = plan_born(plan.problem, plan.placements, plan.layers)
    _need(set(plan.startup) <= set(plan.programs), "start-up steps for ranks that have no program")
    for rank in plan.programs:
        have, last = len(plan.startup.get(rank, [])), max(born.get(rank, {}).values(), default=0)
        _need(have == last, f"rank {rank} has {have} start-up steps, its placements call for {last}")
    _need(
        dict(plan.startup) == dict(startup_programs(plan.programs, born)),
        "the start-up steps are not the programs' first steps without the refreshes from before step 0",
    )


def check_structure(plan: Plan) -> None:
    """Raise PlanFormatError unless `plan` is well formed for its own problem (see the module doc)."""
    problem = plan.problem
    for name in ("schedule", "hardware", "fingerprint"):
        _need(isinstance(getattr(problem, name), str), f"problem.{name} must be a string")
    _need(all(_is_int(v) for v in (problem.N, problem.D, problem.v)), "problem.D/N/v must be ints")
    try:
        hash(problem)
    except TypeError as e:
        raise PlanFormatError(f"the plan file is malformed: a value of the problem has the wrong type ({e})") from None
    _need(isinstance(plan.fingerprint, str), "fingerprint must be a string")
    names = set(problem.costs.layer_names)
    _need(set(plan.layers) == names, f"layers {sorted(plan.layers)} are not the cost table's {sorted(names)}")
    for name, t in plan.layers.items():
        _need(
            all(_is_int(v) and v >= 0 for v in (t.period, t.curv_step, t.use_offset)) and t.period >= 1,
            f"layer {name}: period, curv_step and use_offset must be ints (period >= 1)",
        )
    _check_placements(plan, _check_programs(plan))
    _check_startup(plan)
    _check_metrics(plan)


def parse_plan(text: str) -> Plan:
    """Parse `Plan.to_json` output; raises PlanFormatError for corrupt, truncated, malformed or newer files."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFormatError(f"the plan file is not valid JSON (corrupt or truncated?): {e}") from e
    if not isinstance(data, dict):
        raise PlanFormatError(f"a plan must be a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if type(version) is int and version > SCHEMA_VERSION:  # not bool: true is not a version
        raise PlanFormatError(
            f"the plan has schema_version {version}, newer than this fxkfac reads ({SCHEMA_VERSION}); upgrade fxkfac"
        )
    if type(version) is int and 1 <= version < SCHEMA_VERSION:
        raise PlanFormatError(
            f"the plan has schema_version {version}, older than this fxkfac's ({SCHEMA_VERSION}): it may place work "
            "across a step's closing barrier (1) or lack its start-up steps (2); re-plan it (fxkfac plan ... --export)"
        )
    if type(version) is not int or version != SCHEMA_VERSION:
        raise PlanFormatError(f"unknown plan schema_version {version!r} (expected {SCHEMA_VERSION})")
    try:
        plan = Plan.from_dict(data)
        check_structure(plan)
        return plan
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise PlanFormatError(f"the plan file is malformed (missing or bad entry: {e})") from e


def read_plan(path: str | Path) -> Plan:
    """Read and parse a plan file, not yet validated against its problem (see `load_plan`); errors name the file."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise PlanFormatError(f"cannot read the plan file {path}: {e}") from e
    try:
        return parse_plan(text)
    except PlanFormatError as e:
        raise PlanFormatError(f"plan file {path}: {e}") from e


def load_plan(path: str | Path, *, expect_fingerprint: str | None = None) -> Plan:
    """Read and validate a plan; PlanMismatchError when made for another graph."""
    plan = read_plan(path)
    if expect_fingerprint is not None and plan.fingerprint != expect_fingerprint:
        raise PlanMismatchError(
            f"{path} was made for graph {plan.fingerprint!r}, not {expect_fingerprint!r}; "
            "make a new plan for this model, mesh and schedule (fxkfac plan ... --export)"
        )
    try:
        check_plan(plan.problem, plan)
    except PlanError as e:
        raise PlanError(f"plan file {path}: {e}") from e
    return plan
