"""Muon in the planner: analytic Newton-Schulz costs, plans whose NS tasks the independent validator accepts (stage
0's matrices streamed to idle ranks on 1F1B without replicas, the copies' share under mem-opt), and `fxkfac plan
--preconditioner muon` without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fxkfac.planner.plan.plan import NSWhere, Plan, critical_path_step, ns_tasks
from fxkfac.planner.problem import buckets
from fxkfac.planner.problem.analytic import (
    Precision,
    TensorSpec,
    analytic_cost_table,
    matrix_cost,
    model_spec_from_layers,
    muon_matrices,
    preset,
)
from fxkfac.planner.problem.buckets import bucketable, bundles_streams
from fxkfac.planner.problem.costs import CostTable, PreconditionerKind, streamed_bytes
from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.hardware import AlphaBeta, CommModel, HardwareSpec, hardware
from fxkfac.planner.problem.ir import Op, OpKind, as_programs, piece_iterations
from fxkfac.planner.problem.problem import Problem, SolverConfig
from fxkfac.planner.problem.step_timeline import plain_step_time, problem_buckets, reference_programs, step_timeline
from fxkfac.planner.problem.strategy import parse_strategy
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.search.plan_search import with_streaming
from fxkfac.planner.validate import validate
from fxkfac.planner.validate.plan_file import parse_plan

MUON = PreconditionerKind.MUON


def _multiply_adds(rows: int, cols: int) -> int:
    """One quintic iteration counted product by product on the wide orientation X (m x n, m <= n): A = X X^T,
    A A, then (b A + c A A) X, each (p x q)(q x r) product p q r multiply-adds."""
    m, n = min(rows, cols), max(rows, cols)
    return m * n * m + m * m * m + m * m * n


@pytest.mark.parametrize("shape", [(1024, 4096), (4096, 1024), (768, 768), (3, 5)])
def test_an_iteration_costs_two_flops_per_multiply_add_of_its_three_products(shape: tuple[int, int]) -> None:
    compute_bound = HardwareSpec("test", 1e12, 2e12, 1e30, 1 << 40, matmul_efficiency=1.0)
    cost = matrix_cost(TensorSpec("w", shape), compute_bound, ns_steps=3)
    assert cost.prec == pytest.approx(3 * 2 * _multiply_adds(*shape) / 2e12, rel=1e-12)  # at the 16-bit peak


def test_pieces_cut_the_iterations_in_order() -> None:
    assert [list(piece_iterations((i, 2))) for i in range(2)] == [[0, 1], [2, 3, 4]]
    assert [i for k in range(3) for i in piece_iterations((k, 3))] == list(range(5))
    assert list(piece_iterations(None)) == list(range(5))
    assert str(Op(OpKind.APPLY, 0, layer="fc.weight", piece=(1, 2))) == "APPLY s0 1/2 fc.weight"
    assert Op.parse("APPLY s0 1/2 fc.weight") == Op(OpKind.APPLY, 0, layer="fc.weight", piece=(1, 2))


def test_muon_covers_the_hidden_matrices_and_the_table_round_trips() -> None:
    """Every Linear weight but the tied decoder: the pooler and the heads' transform are hidden matrices, each a unit
    without parts whose APPLY is its NS and whose state its momentum; the embedding tables, norms and biases are
    units too (as compile makes one of every trainable parameter), AdamW's: an elementwise step, two moments."""
    table = analytic_cost_table("bert-base", 4, 8, kind=MUON)
    units = [x for s in table.stages for x in s.layers]
    spec = preset("bert-base")
    assert [x.name for x in units] == [t.name for b in (spec.embed, *spec.blocks, spec.head) for t in b.parameters]
    hidden = {t.name for b in (spec.embed, *spec.blocks, spec.head) for t in muon_matrices(b)}
    assert len(hidden) == 12 * 6 + 3 and "bert.pooler.dense.weight" in hidden
    assert not any("embeddings" in n or "decoder" in n or "LayerNorm" in n for n in hidden)
    matrices = [x for x in units if x.name in hidden]
    adamw = [x for x in units if x.name not in hidden]
    assert len(matrices) == len(hidden) and any("word_embeddings" in x.name for x in adamw)
    assert all(x.parts == () and x.prec > 0 and x.state_bytes == x.grad_bytes for x in matrices)
    assert all(x.parts == () and x.prec > 0 and x.state_bytes == 2 * x.grad_bytes for x in adamw)
    layer0 = [x.prec for x in matrices if ".layer.0." in x.name]  # an encoder layer's six, 768 x 768 or x 3072
    assert max(x.prec for x in adamw if "embeddings" not in x.name) < min(layer0) / 100
    assert table.family is PreconditionerKind.MUON and table.source.startswith("muon:analytic:bert-base")
    assert CostTable.from_json(table.to_json()) == table


def test_the_ns_time_grows_with_the_iterations_and_the_flops() -> None:
    """A 1024 x 4096 matrix's 5 iterations at the P100's 16-bit tensor peak and matmul efficiency (compute bound)."""
    hw = hardware("p100")
    x = analytic_cost_table("bert-large", 8, 32, kind=MUON).layer("bert.encoder.layer.0.intermediate.dense.weight")
    compute = 5 * 2 * _multiply_adds(1024, 4096) / (hw.peak_flops_tensor * hw.matmul_efficiency)
    assert compute < x.prec < compute * 1.05
    longer = analytic_cost_table("bert-large", 8, 32, ns_steps=10, kind=MUON).layer(x.name)
    assert longer.prec == pytest.approx(2 * x.prec, rel=0.05)


@pytest.fixture(scope="module")
def streamed() -> tuple[Problem, Plan]:
    """BERT-Base 1F1B D=4: stage 0's gradients are final last, its NS streams to the ranks idle at the step's end."""
    problem = with_streaming(
        Problem("1f1b", 4, 4, analytic_cost_table("bert-base", 4, 32, kind=MUON)), whole_backward=True
    )
    return problem, solve(problem, SolverConfig(time_limit_s=5))


def test_stage_zero_streams_to_idle_ranks_and_the_validator_accepts_it(streamed: tuple[Problem, Plan]) -> None:
    problem, plan = streamed
    assert validate(problem, plan) == []
    assert parse_plan(plan.to_json()) == plan
    assert problem.streaming is not None and len(problem.streaming.ranks) >= 2
    ops = [op for body in plan.programs.values() for step in body for op in step]
    assert not any(op.kind in (OpKind.SEND_REPLICA, OpKind.RECV_REPLICA) for op in ops)  # no refresh, no replica
    assert not any(op.kind in (OpKind.STATS, OpKind.SYNC_STATS, OpKind.DECOMP, OpKind.BCAST) for op in ops)
    plain = plain_step_time(problem)
    assert plain < plan.metrics.step_time < critical_path_step(problem)
    tasks = ns_tasks(plan)
    helped = {t.rank for t in tasks if t.stage == 0 and t.where is NSWhere.STREAMED}
    assert helped == set(problem.streaming.ranks) and 0 not in helped
    assert all(t.transfer > 0 for t in tasks if t.where is NSWhere.STREAMED)  # priced on the comm model
    last = [t for t in tasks if t.stage == 3]
    assert last and all(t.where is NSWhere.OWN and t.end <= plain for t in last)  # the last stage's own tail bubble


def test_the_validator_refuses_a_replica_of_a_matrix_without_refresh(streamed: tuple[Problem, Plan]) -> None:
    problem, plan = streamed
    assert problem.streaming is not None
    layer, helper = problem.streaming.layers[0], problem.streaming.helpers[0]
    owner_steps = [list(step) for step in plan.programs[0]]
    owner_steps[0].insert(0, Op(OpKind.SEND_REPLICA, 0, peer=helper, layer=layer))
    broken = Plan(
        plan.problem,
        {**plan.programs, 0: owner_steps},
        plan.layers,
        plan.placements,
        plan.metrics,
        plan.fingerprint,
        startup=plan.startup,
    )
    assert any("replica" in e for e in validate(problem, broken, run=False))


def test_copies_share_the_matrices_and_broadcast_the_updates_under_mem_opt() -> None:
    """Moonlight's distributed Muon: with two replicas each orthogonalizes about half of its stage's matrices and
    broadcasts the results (BCAST_PREC), and the step is shorter than every copy doing all of them."""
    costs = analytic_cost_table("bert-base", 2, 32, kind=MUON)
    problem = Problem("1f1b", 2, 4, costs, W=2).with_strategy(parse_strategy("mem-opt"))
    plan = solve(problem, SolverConfig(time_limit_s=5))
    assert validate(problem, plan) == []
    tasks = [t for t in ns_tasks(plan) if t.stage == 0]
    assert all(t.where is NSWhere.SHARED and len(t.layers) == 1 for t in tasks)
    per_rank = {r: sum(costs.layer(t.layers[0]).prec for t in tasks if t.rank == r) for r in {t.rank for t in tasks}}
    assert len(per_rank) == 2 and max(per_rank.values()) < 0.6 * costs.stages[0].prec
    assert sorted(n for t in tasks for n in t.layers) == sorted(x.name for x in costs.stages[0].layers)
    everyone = Problem("1f1b", 2, 4, costs, W=2)
    assert plan.metrics.step_time < solve(everyone, SolverConfig(time_limit_s=5)).metrics.step_time


def test_a_stage_with_copies_does_not_stream_its_matrices() -> None:
    """W=2: the owner's Newton-Schulz input needs the copies' all-reduced gradient, which a streamed send (during the
    backward) precedes, so the runtime refuses it; the planner streams no Muon stage with copies (W=1 streams)."""
    costs = analytic_cost_table("bert-base", 4, 32, kind=MUON)
    assert with_streaming(Problem("1f1b", 4, 4, costs), whole_backward=True).streaming is not None
    copies = Problem("1f1b", 4, 4, costs, W=2)
    assert with_streaming(copies, whole_backward=True) is copies


def test_fxkfac_plan_muon_runs_without_torch_and_shows_the_ns_tasks(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    argv = ["plan", "bert-base", "-D", "4", "-N", "4", "--preconditioner", "muon", "--method", "greedy"]
    argv += ["--show", "--explain", "--trace", str(trace)]
    code = (
        "import sys\nfrom fxkfac.cli import main\n"
        f"assert main({argv!r}) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env={"COLUMNS": "120", "PATH": ""}
    )
    out = done.stdout
    assert "muon:analytic:bert-base" in out and "Muon reference" in out, out
    assert "Newton-Schulz added" in out and "streamed on r" in out and "critical path" in out, out
    assert "Newton-Schulz tasks of the step" in out and "s3 all" in out, out
    assert "refresh steps per stage" not in out and "T_ns = " in out and "ratio" not in out, out
    tasks = {e["args"]["task"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert "Newton-Schulz" in tasks and "decomposition" not in tasks


@pytest.mark.parametrize("pieces", [2, 3])
def test_cut_ns_runs_its_pieces_in_order_on_one_rank_and_takes_the_same_time(pieces: int) -> None:
    """Every matrix's APPLY in pieces (the owner's and a helper's): the validator accepts the plan, each layer's
    pieces follow one another on one rank, and they sum to the uncut APPLY (the step time stays the uncut plan's)."""
    costs = analytic_cost_table("bert-base", 4, 32, kind=MUON)
    whole = with_streaming(Problem("1f1b", 4, 4, costs), whole_backward=True)
    cut = replace(whole, decomp_pieces=pieces)
    plan = solve(cut, SolverConfig(time_limit_s=5))
    assert validate(cut, plan) == []
    assert plan.metrics.step_time == pytest.approx(solve(whole, SolverConfig(time_limit_s=5)).metrics.step_time)
    for rank, body in plan.programs.items():
        applies = [op for op in body[0] if op.kind is OpKind.APPLY]
        assert applies and all(op.layer is not None and op.piece is not None for op in applies)
        for layer in {op.layer for op in applies}:
            assert [op.piece for op in applies if op.layer == layer] == [(i, pieces) for i in range(pieces)], rank
    tasks = ns_tasks(plan)
    for layer in costs.stages[0].layers:
        mine = [t for t in tasks if t.layers == (layer.name,)]
        assert len({t.rank for t in mine}) == 1
        assert sum(t.end - t.start for t in mine) == pytest.approx(layer.prec)


def test_the_validator_refuses_pieces_out_of_order_and_more_pieces_than_iterations() -> None:
    costs = analytic_cost_table("bert-base", 2, 32, kind=MUON)
    problem = Problem("1f1b", 2, 4, costs, decomp_pieces=2)
    plan = solve(problem, SolverConfig(time_limit_s=5))
    assert validate(problem, plan) == []
    body = list(plan.programs[1][0])
    first = next(i for i, op in enumerate(body) if op.kind is OpKind.APPLY)
    body[first], body[first + 1] = body[first + 1], body[first]
    swapped = Plan(
        plan.problem,
        {**plan.programs, 1: [body]},
        plan.layers,
        plan.placements,
        plan.metrics,
        plan.fingerprint,
        startup=plan.startup,
    )
    assert validate(problem, swapped, run=False)
    with pytest.raises(PlanError, match="at most 5"):
        Problem("1f1b", 2, 4, costs, decomp_pieces=6)


@pytest.mark.parametrize(
    ("schedule", "D", "N", "v"), [("gpipe", 4, 4, 1), ("interleaved", 2, 4, 2), ("chimera", 2, 2, 1)]
)
def test_muon_plans_of_every_schedule_pass_the_validator(schedule: str, D: int, N: int, v: int) -> None:
    """Wherever the planner streams or not, every schedule's Muon plan is valid and no slower than Muon on the
    critical path."""
    problem = with_streaming(Problem(schedule, D, N, analytic_cost_table("bert-base", D * v, 32, kind=MUON), v=v), True)
    plan = solve(problem, SolverConfig(time_limit_s=5))
    assert validate(problem, plan) == []
    assert plan.metrics.step_time <= critical_path_step(problem) + 1e-9


def _small_matrices() -> Problem:
    """1F1B D=2, twelve 64 x 64 matrices a stage on the measured gloo-loopback links ("cpu"): each one's
    Newton-Schulz is shorter than its own message's fixed cost, far longer than its bytes."""
    spec = model_spec_from_layers([[(f"s{s}.fc{i}", 64, 64, 256, False) for i in range(12)] for s in range(2)])
    return Problem(
        "1f1b", 2, 4, analytic_cost_table(spec, 2, 8, hardware="cpu", ns_precision=Precision.FP32, kind=MUON)
    )


def test_small_matrices_stream_in_buckets_each_priced_as_one_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled stages make every gradient final at once, so a message a matrix queues on the link, each paying the
    fixed cost that is longer than the matrix's Newton-Schulz. Priced as the runtime sends them, in buckets (one fixed
    cost, the bytes together), stage 0 streams more matrices than priced a message a matrix, at a shorter predicted
    step; the same streaming priced a message a matrix is slower; the validator, which prices buckets alike, accepts
    the plan."""
    base = _small_matrices()
    costs = base.costs
    send = [Op(OpKind.SEND_LGRAD, 0, peer=1, layer=x.name) for x in costs.stages[0].layers]
    assert all(x.prec < costs.collective_seconds(op, 2) for x, op in zip(costs.stages[0].layers, send, strict=True))
    problem = with_streaming(base, whole_backward=True)
    assert problem.streaming is not None and len(problem.streaming.layers) >= 2
    cut = problem_buckets(problem, as_programs(reference_programs(problem)))
    sent = {cut[0, op] for op in send if (0, op) in cut}
    assert len(sent) == 1, "a bucket holds 1 MiB: the streamed matrices' 16 KiB each fit one"
    (bucket,) = sent
    assert len(bucket) == len(problem.streaming.layers)
    assert costs.bucket_seconds(bucket) < sum(costs.collective_seconds(op, 2) for op in bucket) / 1.5
    bucketed = step_timeline(problem).length
    assert bucketed < critical_path_step(problem)
    plan = solve(problem, SolverConfig(time_limit_s=5))
    assert validate(problem, plan) == []
    step_timeline.cache_clear()
    monkeypatch.setattr(buckets, "bundles_streams", lambda family: False)
    try:
        assert problem_buckets(problem, as_programs(reference_programs(problem))) == {}
        assert bucketed < step_timeline(problem).length, "priced a message a matrix, the same streaming is slower"
        alone = with_streaming(base, whole_backward=True)
        streamed = 0 if alone.streaming is None else len(alone.streaming.layers)
        assert streamed < len(problem.streaming.layers) and bucketed < step_timeline(alone).length
    finally:
        step_timeline.cache_clear()


def test_only_one_message_units_bundle_and_only_where_every_program_allows() -> None:
    """K-FAC's streamed units travel alone (a result and its <P, G>, two messages); Muon's, Shampoo's and SOAP's
    (one message each way) in buckets; a Muon owner whose streamed sends are not in a row sends each alone (the
    runtime's `bucketable`, the same function)."""
    assert [bundles_streams(k) for k in PreconditionerKind] == [
        k is not PreconditionerKind.KFAC for k in PreconditionerKind
    ]
    problem = with_streaming(_small_matrices(), whole_backward=True)
    programs = as_programs(reference_programs(problem))
    owner = programs[0][0]
    at = next(i for i, op in enumerate(owner) if op.kind is OpKind.SEND_LGRAD)
    split = [*owner[: at + 1], Op(OpKind.RECV_ACT, 1, 0, peer=1), *owner[at + 1 :]]
    assert (0, 1, 0) in bucketable(programs)
    assert (0, 1, 0) not in bucketable({**programs, 0: [split]})


def test_a_streamed_transfer_costs_its_ranks_the_messages_cpu() -> None:
    """A measured CPU a message costs each end (`CommModel.send_cpu`, `recv_cpu`) prices every streamed transfer on
    its own rank: its unit's bytes and its bucket's fixed cost split among the bucket's units; the predicted step
    grows, and the validator, which simulates the same step, accepts the plan."""
    problem = with_streaming(_small_matrices(), whole_backward=True)
    assert problem.streaming is not None and problem.costs.comm is not None
    send_cpu, recv_cpu = AlphaBeta(1e-4, 2e-10), AlphaBeta(3e-5, 5e-10)
    comm = replace(problem.costs.comm, send_cpu=send_cpu, recv_cpu=recv_cpu)
    priced = replace(problem, costs=replace(problem.costs, comm=comm))
    cut = problem_buckets(priced, as_programs(reference_programs(priced)))
    step = step_timeline(priced)
    checked = 0
    for rank, items in step.ops.items():
        for op, start, end in items:
            if op.kind not in (OpKind.SEND_LGRAD, OpKind.SEND_PGRAD) or op.layer is None:
                continue
            layer = priced.costs.layer(op.layer)
            own = layer.hand_off if op.kind is OpKind.SEND_LGRAD else 0.0
            share = len(cut.get((rank, op), {op}))
            want = own + send_cpu.alpha / share + send_cpu.beta * streamed_bytes(layer, op.kind)
            assert end - start == pytest.approx(want, rel=1e-9, abs=1e-12), op
            checked += 1
    assert checked == 2 * len(problem.streaming.layers)
    assert step.length > step_timeline(problem).length
    assert CommModel.from_json(comm.to_json()) == comm
    assert CommModel.from_dict({k: v for k, v in comm.to_dict().items() if not k.endswith("_cpu")}).send_cpu == (
        AlphaBeta(0.0, 0.0)
    ), "a model measured before has no CPU a message"
    plan = solve(priced, SolverConfig(time_limit_s=5))
    assert validate(priced, plan) == []
