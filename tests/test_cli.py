"""The `fxkfac` CLI: plans drawn at 80 and 200 columns, export/show round trip, traces, one-line errors."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from fxkfac import cli_plan
from fxkfac.cli import build_parser, main
from fxkfac.cli_args import parse_block_size, parse_bytes, parse_fraction
from fxkfac.cli_costs import cost_table
from fxkfac.cli_plan import problem_of, search_options
from fxkfac.cli_start import StartSource, process_start
from fxkfac.plan_view import planned_utilization, planned_view, render_plan
from fxkfac.planner import plan as plan_search
from fxkfac.planner import validate
from fxkfac.planner.plan.plan import SCHEMA_VERSION, Plan
from fxkfac.planner.problem.errors import PlannerError
from fxkfac.planner.problem.ir import Op, OpKind
from fxkfac.planner.problem.step_timeline import Interval, Timeline, min_memory_bytes, plain_step_time
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.search.budget import (
    COST_DTIME_PER_LAYER,
    IMPORT_DTIME_PER_MODULE,
    Budget,
    after_search,
)
from fxkfac.planner.validate.plan_file import load_plan
from fxkfac.show import chrome_trace, render_timeline, timeline_from_trace
from tests.planner.kfac_cases import problem, table

PLAN = [
    "plan",
    "bert-base",
    "--stages",
    "4",
    "--microbatches",
    "4",
    "--schedule",
    "1f1b",
    "--hardware",
    "p100",
    "--method",
    "greedy",
]
KFAC_KINDS = (OpKind.STATS, OpKind.SYNC_STATS, OpKind.DECOMP, OpKind.BCAST, OpKind.APPLY)


@cache
def _plan(schedule: str = "1f1b", W: int = 2) -> Plan:
    """A small plan with every kind of K-FAC op (W=2 or Chimera: curvature sync and inverse broadcast)."""
    D = 4 if schedule == "chimera" else 2
    return solve(problem(schedule, D, 4, W=W, layers=2, curv=0.25, inv=0.5), method="greedy")


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_parse_units() -> None:
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5e9") == 1_500_000_000
    assert parse_bytes("8GB") == 8 * 10**9
    assert parse_fraction("5%") == pytest.approx(0.05)
    assert parse_fraction("0.1") == pytest.approx(0.1)
    for bad in ("12XB", "GiB", ""):
        with pytest.raises(PlannerError, match="16GiB"):
            parse_bytes(bad)
    with pytest.raises(PlannerError):
        parse_fraction("five")


@pytest.mark.parametrize("width", [80, 200])
@pytest.mark.parametrize("schedule", ["1f1b", "chimera"])
def test_plan_view_fits_the_terminal(width: int, schedule: str) -> None:
    plan = _plan(schedule, 1 if schedule == "chimera" else 2)
    console = Console(width=width, record=True, color_system=None)
    console.print(render_plan(plan, width=width))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width
    rows = [
        line
        for line in text.splitlines()
        if line.startswith(tuple(f"r{d} " for d in plan.problem.devices)) and "│" in line
    ]
    rows = [row for row in rows if row.endswith("│")]
    assert len(rows) == len(plan.problem.devices) and all(len(row) == width for row in rows)
    for word in (
        "forward",
        "backward",
        "curvature",
        "inversion",
        "sync",
        "precondition",
        "idle",
        "utilization before -> after",
        "refresh steps per stage",
        "lower bound",
        "greedy",
        "step time before -> after",
        "peak memory per device",
        "refresh window",
    ):
        assert word in text, word
    cells = "".join(row[3:] for row in rows)
    assert "c" in cells and "P" in cells


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_planned_view_holds_each_placement_once_and_nothing_overlaps(schedule: str) -> None:
    plan = _plan(schedule)  # zb-h1: the plan places W tasks, drawn once (not also as the step's own W)
    for d in plan.problem.devices:
        k = len(plan.programs[d])  # the device's refresh period
        view = planned_view(plan, k)
        mine = view.timeline.of_rank(d)
        busy = sorted((iv.start, iv.end, str(iv.op)) for iv in mine if iv.end > iv.start)
        for (s1, e1, a), (s2, e2, b) in zip(busy, busy[1:]):
            assert s2 >= e1 - 1e-9, f"r{d}: {a} [{s1}, {e1}) overlaps {b} [{s2}, {e2})"
        drawn = sorted(
            (str(iv.op), round(iv.start % view.end, 9))
            for iv in mine
            if iv.op.kind in (*KFAC_KINDS, OpKind.BWD_W) and 0 <= iv.start < view.end
        )
        placed = sorted((str(p.op), round(p.start % view.end, 9)) for p in plan.placements if p.device == d)
        assert drawn == placed
        fb = [iv for iv in mine if iv.op.kind in (OpKind.FWD, OpKind.BWD)]
        assert len(fb) == k * 2 * plan.problem.N  # every F and B of each step (1F1B: one stage per rank)


def test_planned_utilization_agrees_with_the_plan_metrics() -> None:
    for plan in (_plan(), _plan("chimera", 1), _plan("zb-h1", 1)):
        per_device = planned_utilization(plan)
        assert sum(per_device.values()) / len(per_device) == pytest.approx(plan.metrics.utilization, rel=1e-9)


def test_plan_export_show_and_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    export, trace_path = tmp_path / "plan.json", tmp_path / "trace.json"
    assert main(PLAN + ["--show", "--explain", "--export", str(export), "--trace", str(trace_path)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "T_bubble =" in out and "refresh steps per stage" in out
    plan = load_plan(export)
    refresh = " ".join(map(str, plan.metrics.refresh_steps))
    assert refresh in out
    trace = json.loads(trace_path.read_text())
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"} == {f"rank {r}" for r in range(4)}
    kinds = {Op.parse(e["name"]).kind for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {OpKind.FWD, OpKind.BWD, OpKind.STATS, OpKind.DECOMP, OpKind.APPLY} <= kinds
    timeline = timeline_from_trace(trace)
    again = timeline_from_trace(chrome_trace(timeline))
    assert [(iv.rank, iv.op) for iv in again.intervals] == [(iv.rank, iv.op) for iv in timeline.intervals]
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["show", str(export)]) == 0
    shown = capsys.readouterr().out
    assert refresh in shown and max(len(line) for line in shown.splitlines()) <= 200


def test_show_measured_prints_utilization_per_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fxkfac.runtime.timeline import Event, as_timeline

    monkeypatch.setenv("COLUMNS", "100")
    plan_path, run_path = tmp_path / "plan.json", tmp_path / "run.json"
    _plan().save(plan_path)
    ms = 1_000_000
    events = [
        Event(0, "F s0 m0", "FWD", 0, 0, 2 * ms),
        Event(0, "B s0 m0", "BWD", 0, 6 * ms, 8 * ms),
        Event(1, "F s1 m0", "FWD", 0, 2 * ms, 3 * ms),
        Event(1, "B s1 m0", "BWD", 0, 3 * ms, 6 * ms),
        Event(1, "STATS s1 m0 A l1_0", "STATS", 0, 6 * ms, 7 * ms),
    ]
    chrome_trace(as_timeline(events), run_path)
    assert main(["show", str(plan_path), "--measured", str(run_path)]) == 0
    out = capsys.readouterr().out
    assert "measured:" in out
    planned = planned_utilization(_plan())
    # busy / length (8 ms): r0 4/8, r1 5/8, ranks 2 and 3 ran nothing here
    assert _row(out, "r0") == (f"{planned[0]:.1%}", "50.0%")
    assert _row(out, "r1") == (f"{planned[1]:.1%}", "62.5%")
    assert _row(out, "r3") == (f"{planned[3]:.1%}", "-")


def _row(out: str, name: str) -> tuple[str, str]:
    line = next(line for line in out.splitlines() if line.strip("│ ").startswith(name + " ") and "|" in line)
    planned, measured = line.split("│")[2].split("|")
    return planned.strip(), measured.strip()


def test_render_scales_boxes_by_hand() -> None:
    ops = [
        Interval(0, 0, Op(OpKind.FWD, 0, 0), 0.0, 1.0),
        Interval(0, 0, Op(OpKind.BWD, 0, 0), 3.0, 5.0),
        Interval(1, 0, Op(OpKind.FWD, 1, 0), 1.0, 2.0),
        Interval(1, 0, Op(OpKind.BWD, 1, 0), 2.0, 3.0),
        Interval(1, 0, Op(OpKind.DECOMP, 1, layer="fc", part="A"), 3.0, 5.0),
    ]
    console = Console(width=15, record=True, color_system=None)
    console.print(render_timeline(Timeline(tuple(ops), (0, 1), 1), width=15))
    rows = [line for line in console.export_text().splitlines() if line.startswith(("r0 ", "r1 "))]
    assert rows == ["r0 │00····0000│", "r1 │··0000IIII│"]  # 10 cells of 0.5 s


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["plan", "bert-huge", "-D", "4", "-N", "4"], "unknown model preset"),
        (["plan", "bert-base", "-D", "4", "-N", "4", "--hardware", "tpu"], "unknown hardware"),
        (["plan", "bert-base", "-D", "3", "-N", "4", "--schedule", "chimera"], "even"),
        (["plan", "nofile.py:make", "-D", "2", "-N", "2"], "no file"),
        (["plan", "bert-base", "-D", "4", "-N", "4", "--costs", "missing.json"], "missing.json"),
        (["show", "missing-plan.json"], "missing-plan.json"),
    ],
)
def test_bad_input_is_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert needle in _one_line_error(capsys)


def test_missing_factory_and_bad_units_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "m.py"
    script.write_text("x = 1\ndef broken():\n    raise RuntimeError('no model today')\n")
    assert main(["plan", f"{script}:make", "-D", "2", "-N", "2"]) == 2
    assert "no callable 'make'" in _one_line_error(capsys)
    assert main(["plan", f"{script}:broken", "-D", "2", "-N", "2"]) == 2
    assert "no model today" in _one_line_error(capsys)
    for flag, value in (("--memory", "12XB"), ("--max-overhead", "lots")):
        with pytest.raises(SystemExit) as info:
            main(PLAN + [flag, value])
        assert info.value.code == 2
        assert value in _one_line_error(capsys)


@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda text: text[: len(text) // 2], "not valid JSON"),
        (lambda text: "\x00garbage" + text, "not valid JSON"),
        (lambda text: json.dumps({**json.loads(text), "schema_version": SCHEMA_VERSION + 1}), "upgrade fxkfac"),
        (lambda text: json.dumps({**json.loads(text), "layers": {}}), "malformed"),
    ],
)
def test_show_refuses_damaged_plans_in_one_line(
    damage, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(damage(_plan().to_json()))
    before = path.read_bytes()
    assert main(["show", str(path)]) == 2
    assert needle in _one_line_error(capsys)
    assert path.read_bytes() == before


def test_infeasible_budget_says_the_least_memory_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(PLAN)
    need = min_memory_bytes(problem_of(args, cost_table(args, 4)))
    export, trace = tmp_path / "plan.json", tmp_path / "trace.json"
    export.write_text("keep me")
    assert main(PLAN + ["--memory", str(need - 1), "--export", str(export), "--trace", str(trace)]) == 2
    err = _one_line_error(capsys)
    assert f"{need} bytes" in err and "least any plan needs" in err
    assert export.read_text() == "keep me" and not trace.exists()
    assert main(PLAN + ["--memory", str(need * 4), "--export", str(export)]) == 0
    assert load_plan(export).problem.memory_budget == need * 4


def test_plan_path_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom fxkfac.cli import main\n"
        f"assert main({PLAN + ['--show', '--explain', '--trace', str(tmp_path / 't.json')]!r}) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


EXAMPLE_FACTORIES = Path(__file__).resolve().parents[1] / "examples" / "plan_factory.py"
GPT2_LAYERS = [
    f"transformer.h.{b}.{name}" for b in range(2) for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
]


@pytest.mark.parametrize("factory,layers", [("mlp", ["0", "2", "4", "6"]), ("gpt2", GPT2_LAYERS)])
def test_factory_targets_plan_the_layers_compile_finds(
    factory: str, layers: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/plan_factory.py plans from the CLI: every Linear but GPT-2's (tied) LM head, on the stages
    fxkfac.compile splits the same model into, and the exported plan carries the fingerprint compile computes
    for that model and mesh (so a run loads it)."""
    import runpy

    from fxkfac.autoplan import check_matches
    from fxkfac.compile_api import prepare
    from fxkfac.config import KFACConfig
    from fxkfac.kfac.family import KFACFamily
    from fxkfac.planner.problem.schedules import ScheduleKind

    export = tmp_path / "plan.json"
    argv = [
        "plan",
        f"{EXAMPLE_FACTORIES}:{factory}",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--hardware",
        "cpu",
        "--method",
        "greedy",
        "--export",
        str(export),
    ]
    assert main(argv) == 0
    assert "refresh steps per stage" in capsys.readouterr().out
    plan = load_plan(export)
    planned = [[x.name for x in stage.layers] for stage in plan.problem.costs.stages]
    assert sorted(sum(planned, [])) == sorted(layers) and all(planned)
    model, example = runpy.run_path(str(EXAMPLE_FACTORIES))[factory]()
    compiled = prepare(model, example, KFACFamily(KFACConfig()), kind=ScheduleKind.ONE_F_ONE_B, D=2, W=1, N=4)
    assert planned == [compiled.stage_layers[s] for s in range(2)]
    check_matches(plan, compiled.target, str(export))  # PlanMismatchError if compile would refuse it


GPT2_A100 = ["plan", "gpt2", "--stages", "4", "--microbatches", "8", "--hardware", "a100", "--method", "greedy"]


def test_the_device_memory_is_the_default_budget_and_a_refusal_names_max_overhead_not_more_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """GPT-2 on 4 A100s (80 GiB) peaks at 84.5 GiB with deferred curvature: at --max-overhead 0 it is refused, the
    hint naming the max_overhead that fuses curvature, never more memory than the card has (it said "try --memory
    84.87GiB"); by default, the API's rule, it plans at that max_overhead and says so in one line (issue 36)."""
    args = build_parser().parse_args(GPT2_A100)
    unlimited = solve(dataclasses.replace(problem_of(args, cost_table(args, 4)), memory_budget=None), method="greedy")
    assert max(unlimited.metrics.peak_memory.values()) > 80 * 2**30  # greedy's plan without a budget does not fit
    assert main(GPT2_A100 + ["--max-overhead", "0"]) == 2
    err = _one_line_error(capsys)
    assert "a100's device memory" in err and "80.0 GiB" in err
    flag = re.search(r"try --max-overhead ([0-9.]+)%", err)
    assert flag is not None and not re.search(r"--memory [0-9]", err), err
    assert main(GPT2_A100) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"planned with --max-overhead {flag.group(1)}%, the least the planner found that places it" in out, out


def test_the_command_budget_leaves_every_distribution_candidate_a_part() -> None:
    """`fxkfac plan bert-large -D 8 -N 8 --schedule chimera --costs paper:bert-large/p100 --max-overhead 0`: COMM-OPT,
    the first candidate, is refused (the 16 GiB card needs fused curvature); with the whole --time-limit its streamed
    try and its plan without streaming spent all of it, and the distributions that plan kept first-fit's 5 5 6 4 4 6
    5 5. Each candidate takes its part of the time left (`planner.plan`'s `candidate`), so CP-SAT improves on first-fit
    (deterministic)."""
    args = build_parser().parse_args(
        ["plan", "bert-large", "-D", "8", "-N", "8", "--schedule", "chimera", "--costs", "paper:bert-large/p100"]
        + ["--max-overhead", "0"]
    )
    made = plan_search(problem_of(args, cost_table(args, 8)), search_options(args))
    m = made.metrics
    assert m.solver.status != "GREEDY"
    assert all(k <= g for k, g in zip(m.refresh_steps, m.greedy_refresh_steps, strict=True) if g is not None)
    assert sum(m.refresh_steps) < sum(g or 0 for g in m.greedy_refresh_steps)
    assert validate(made.problem, made) == []


def test_the_readme_snippet_chosen_under_the_command_budget_is_no_worse_than_forced_comm_opt() -> None:
    """`fxkfac plan bert-base --stages 2 --microbatches 4 --dp 2 --schedule 1f1b --costs <snippet>` with and without
    `--strategy comm-opt`, each in the whole --time-limit: the choice, whose first candidate is COMM-OPT, refreshes no
    less often (an equal share of the time gave it 11 30 where forcing reaches 11 28)."""
    argv = ["plan", "bert-base", "--stages", "2", "--microbatches", "4", "--dp", "2", "--schedule", "1f1b"]
    argv += ["--costs", str(Path(__file__).parent / "data" / "readme_snippet_2x2_costs.json")]
    made = []
    for extra in ([], ["--strategy", "comm-opt"]):
        args = build_parser().parse_args(argv + extra)
        made.append(plan_search(problem_of(args, cost_table(args, 2)), search_options(args)))
    chosen, forced = made
    assert sum(chosen.metrics.refresh_steps) <= sum(forced.metrics.refresh_steps)
    assert validate(chosen.problem, chosen) == []


def test_plan_says_whether_the_result_is_optimal(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(PLAN[:-2] + ["--time-limit", "1"]) == 0
    solver = next(line for line in capsys.readouterr().out.splitlines() if "solver" in line)
    assert re.search(r"(OPTIMAL \(proven optimal\)|FEASIBLE \(not proven optimal\)|GREEDY \(first-fit)", solver), solver


def test_decomp_pieces_plan_every_decomposition_in_that_many_tasks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--decomp-pieces n: each layer's decomposition of a refresh is n DECOMP tasks, 0/n .. n-1/n, each placed on
    its own; the summary says so, and n < 1 is refused in one line."""
    path = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "bert-base",
                "-D",
                "4",
                "-N",
                "4",
                "--costs",
                "paper:bert-base/p100",
                "--decomp-pieces",
                "4",
                "--method",
                "greedy",
                "--export",
                str(path),
            ]
        )
        == 0
    )
    assert "in 4 pieces each" in capsys.readouterr().out
    plan = load_plan(path)
    pieces: dict[tuple[str | None, str | None], set[tuple[int, int] | None]] = {}
    for op in (p.op for p in plan.placements if p.op.kind is OpKind.DECOMP):
        pieces.setdefault((op.layer, op.part), set()).add(op.piece)
    assert pieces and all(got == {(i, 4) for i in range(4)} for got in pieces.values()), pieces
    assert main(["plan", "bert-base", "-D", "4", "-N", "4", "--decomp-pieces", "0"]) == 2
    assert "--decomp-pieces must be >= 1" in _one_line_error(capsys)


def test_profile_layers_plan_each_sublayer_of_a_profiled_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--profile-layers sublayer: the profile's blocks are planned as attention and feed-forward layers (every one
    refreshed in the exported plan); without a profile the flag is refused in one line."""
    path = tmp_path / "plan.json"
    argv = ["plan", "bert-base", "-D", "4", "-N", "4", "--costs", "paper:bert-base/p100", "--method", "greedy"]
    assert main([*argv, "--profile-layers", "sublayer", "--export", str(path)]) == 0
    plan = load_plan(path)
    assert sorted(plan.layers) == sorted(f"block{i}.{part}" for i in range(12) for part in ("attn", "ffn"))
    capsys.readouterr()
    assert _status(["plan", "bert-base", "-D", "4", "-N", "4", "--profile-layers", "linear"]) == 2
    assert "--profile-layers splits the blocks of a PipeFisher profile" in _one_line_error(capsys)


def test_stream_apply_shortest_step_streams_chimera_and_off_streams_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--stream-apply: on BERT-Base Chimera (paper profiles) the default streams nothing (it would cost refreshes),
    shortest-step streams the first stage's layers; off streams nothing on 1F1B either."""
    base = ["plan", "bert-base", "-D", "4", "-N", "4", "--costs", "paper:bert-base/p100", "--method", "greedy"]
    base += ["--kl-clip-scope", "stale", "--decomp-pieces", "4", "--eager"]
    streamed = {}
    for schedule, policy in (("chimera", "keep-refresh"), ("chimera", "shortest-step"), ("1f1b", "off")):
        path = tmp_path / f"{schedule}-{policy}.json"
        argv = [*base, "--schedule", schedule, "--stream-apply", policy, "--export", str(path)]
        assert main(argv) == 0
        streamed[schedule, policy] = load_plan(path).problem.streaming is not None
    assert streamed == {("chimera", "keep-refresh"): False, ("chimera", "shortest-step"): True, ("1f1b", "off"): False}
    capsys.readouterr()


def test_trace_timestamps_are_never_negative(tmp_path: Path) -> None:
    """Chimera's greedy plan has a APPLY whose grid-rounded end lies a tick past the window: it was drawn
    (and traced) one window early as well, at a negative time, as step -1."""
    trace = tmp_path / "trace.json"
    assert (
        main(
            [
                "plan",
                "bert-base",
                "-D",
                "4",
                "-N",
                "4",
                "--schedule",
                "chimera",
                "--method",
                "greedy",
                "--trace",
                str(trace),
            ]
        )
        == 0
    )
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert events and min(e["ts"] for e in events) >= 0 and min(e["args"]["step"] for e in events) >= 0


def test_explain_names_why_t_pipe_differs_from_the_step_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(PLAN + ["--explain"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # words, whatever the console wrapped
    before = re.search(r"step time before -> after\s*│\s*([0-9.]+) ms", out)
    assert before is not None and f"step time before K-FAC ({before.group(1)} ms)" in out
    assert "written for equal stages" in out
    uniform = tmp_path / "uniform.json"  # 4 equal stages: F 1 s, B 2 s, N=4, D=4: (N + D - 1)(F + B) = 21 s
    uniform.write_text(json.dumps(table(4, layers=2).to_dict()))
    assert (
        main(["plan", "uniform", "-D", "4", "-N", "4", "--costs", str(uniform), "--method", "greedy", "--explain"]) == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    assert "T_pipe = 21000.00 ms" in out and "T_pipe agrees with the simulated step" in out
    assert main(PLAN + ["--explain", "--memory", "1"]) == 2  # refused: the model is printed all the same
    assert "written for equal stages" in " ".join(capsys.readouterr().out.split())


def _renamed(text: str, old: str, new: str) -> str:
    """A plan file with one layer renamed everywhere (a consistent edit the validator cannot catch)."""
    return text.replace(old, new)


def test_plan_file_errors_name_the_file(tmp_path: Path) -> None:
    from fxkfac.autoplan import Target, load_plan_for
    from fxkfac.planner.problem.errors import PlanMismatchError
    from fxkfac.planner.problem.schedules import ScheduleKind

    plan = _plan()
    layers = {s: [x.name for x in stage.layers] for s, stage in enumerate(plan.problem.costs.stages)}
    path = tmp_path / "edited.json"
    path.write_text(_renamed(plan.to_json(), "l1_0", "l1_renamed"))
    target = Target(
        plan.fingerprint, ScheduleKind(plan.problem.schedule), plan.problem.D, plan.problem.N, plan.problem.W
    )
    assert load_plan(path).layers.keys() != plan.layers.keys()  # valid by itself: only the model knows
    with pytest.raises(PlanMismatchError, match=rf"plan file {re.escape(str(path))}.*l1_renamed"):
        load_plan_for(path, target, layers)
    assert load_plan_for(_saved(plan, tmp_path), target, layers).layers == plan.layers
    truncated = tmp_path / "truncated.json"
    truncated.write_text(plan.to_json()[:100])
    with pytest.raises(PlannerError, match=re.escape(str(truncated))):
        load_plan_for(truncated, target, layers)


def _saved(plan: Plan, folder: Path) -> Path:
    path = folder / "plan.json"
    plan.save(path)
    return path


@pytest.mark.parametrize(
    "field,edit,needle",
    [
        ("refresh_steps", lambda steps: [k + 1 for k in steps], "refresh steps per stage"),
        ("utilization", lambda _: 0.99, "utilization 0.99"),
        ("step_time_baseline", lambda _: 123.0, "step time before 123"),
    ],
)
def test_show_refuses_a_summary_its_placements_contradict(
    field: str,
    edit,
    needle: str,
    tmp_path: Path,  # type: ignore[no-untyped-def]  # `edit` is a lambda of the parametrization
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = json.loads(_plan().to_json())
    data["metrics"][field] = edit(data["metrics"][field])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert main(["show", str(path)]) == 2
    err = _one_line_error(capsys)
    assert str(path) in err and needle in err and "contradicts" in err


SHAMPOO = ["plan", "bert-base", "--preconditioner", "shampoo", "--hardware", "a100"]


def test_preconditioner_flags_parse() -> None:
    args = build_parser().parse_args(SHAMPOO + ["--max-preconditioner-dim", "1024", "--precondition-frequency", "50"])
    assert (args.preconditioner, args.max_preconditioner_dim, args.precondition_frequency) == ("shampoo", 1024, 50)
    assert (args.stages, args.microbatches) == (4, 4)
    defaults = build_parser().parse_args(["plan", "bert-base"])
    assert (defaults.preconditioner, defaults.max_preconditioner_dim, defaults.precondition_frequency) == (
        "kfac",
        "auto",
        None,
    )
    assert parse_block_size(" AUTO ") == "auto" and parse_block_size("256") == 256
    assert problem_of(args, cost_table(args, 4)).max_period == 50


@pytest.mark.parametrize(
    "argv,needle",
    [
        (SHAMPOO + ["--max-preconditioner-dim", "0"], "a side >= 1 such as 1024, or auto"),
        (SHAMPOO + ["--precondition-frequency", "0"], "a whole number >= 1"),
        (["plan", "bert-base", "--preconditioner", "lamb"], "invalid choice: 'lamb'"),
        (["plan", "bert-base", "--max-preconditioner-dim", "512"], "K-FAC has none"),
        (SHAMPOO + ["--costs", "paper:bert-base/p100"], "K-FAC per-block profile"),
        (["plan", f"{EXAMPLE_FACTORIES}:mlp", "--preconditioner", "soap"], "costed as K-FAC layers only"),
    ],
)
def test_preconditioner_flags_refuse_in_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _status(argv) == 2
    assert needle in _one_line_error(capsys)


def _status(argv: list[str]) -> int | str | None:
    """The exit status of `fxkfac ARGV`: main's return, or argparse's exit on a usage error."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_a_kfac_table_is_not_planned_as_shampoo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kfac.json"
    table(2, layers=2).save(path)
    assert main(["plan", "x", "-D", "2", "--preconditioner", "shampoo", "--costs", str(path)]) == 2
    assert "a cost table of K-FAC, not of Shampoo; pass --preconditioner kfac" in _one_line_error(capsys)


def test_shampoo_plan_path_does_not_import_torch_and_speaks_shampoo(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    argv = SHAMPOO + ["--max-preconditioner-dim", "512", "--show", "--explain", "--trace", str(trace)]
    code = (
        "import sys\nfrom fxkfac.cli import main\n"
        f"assert main({argv!r}) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env={"COLUMNS": "120", "PATH": ""}
    )
    out = done.stdout
    assert "root inverse" in out and "statistics" in out and "Shampoo reference" in out, out
    assert "curvature" not in out and "K-FAC" not in out, out
    tasks = {e["args"]["task"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert {"root inverse", "forward (digit: micro-batch)"} <= tasks


# max_preconditioner_dim auto at 1F1B, D=4, N=4, micro-batch 32, max_overhead 0, refresh within 32 steps: the
# binding task is the root inverse of one parameter's L (its blocks decomposed as one task), which must fit in one
# bubble: bert-base's word embedding (30522 x 768) at 1024 takes 0.151 s on an A100 (0.28 s on a P100), longer
# than its stage's longest bubble; bert-large's bubbles (6 blocks per stage) hold it at 1024, not at 2048.
AUTO_CHOICES = {("bert-base", "a100"): 512, ("bert-large", "p100"): 1024}
"""Two of the four choices docs/PLANNING.md reports (bert-base p100 512, bert-large a100 1024 too): each search solves
up to eight block sides, so the suite checks one per model."""


@pytest.mark.parametrize("model,hardware", sorted(AUTO_CHOICES))
def test_auto_chooses_the_largest_block_that_fits(
    model: str, hardware: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["plan", model, "--preconditioner", "shampoo", "--hardware", hardware, "--method", "greedy", "--explain"])
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    side = AUTO_CHOICES[model, hardware]
    assert f"max_preconditioner_dim auto: block side {side}: the largest of" in out
    assert f"{side}: plans" in out and f"{side * 2}: " in out


def test_a_budget_refused_without_activation_checkpointing_plans_with_auto(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPipe keeps N micro-batches' activations on every rank: 8 GiB is below the least any plan needs (9.3 GiB);
    with --activation-checkpointing auto the planner recomputes stages 0-2 (rank 3's last stage keeps less) and
    the plan fits, its backward longer by their forwards."""
    argv = [*PLAN, "--microbatches", "8", "--schedule", "gpipe", "--memory", "8GiB"]
    assert main(argv) == 2
    assert "--activation-checkpointing auto" in _one_line_error(capsys)
    export = tmp_path / "plan.json"
    assert main([*argv, "--activation-checkpointing", "auto", "--export", str(export), "--show"]) == 0
    shown = capsys.readouterr().out
    assert "stages 0, 1, 2 recompute their forward" in shown
    plan = load_plan(export)
    assert plan.problem.recompute == (0, 1, 2)
    assert max(plan.metrics.peak_memory.values()) <= 8 << 30
    unbounded = dataclasses.replace(plan.problem, recompute=(), memory_budget=None)  # a shorter step
    assert plan.metrics.step_time_baseline > plain_step_time(unbounded)
    assert main([*argv, "--activation-checkpointing", "0,9"]) == 2
    assert "names stages [9]" in _one_line_error(capsys)


def test_plan_schedule_auto_plans_every_schedule_of_the_mesh_and_says_which_and_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "bert-base", "-D", "2", "-N", "2", "--schedule", "auto", "--hardware", "p100", "--method"]
    assert main([*argv, "greedy", "--max-overhead", "50%", "--time-limit", "1"]) == 0
    out = capsys.readouterr().out
    chosen = re.search(r"│ (\S+)(?: v=\d)? \(chosen\)", out)
    assert chosen is not None and "the least step at the freshest curvature" in out
    for kind in ("gpipe", "1f1b", "interleaved v=2", "chimera", "zb-h1", "zb-v v=2", "zb-1p v=2"):
        assert kind in out
    assert re.search(rf"schedule\s+│ {re.escape(chosen.group(1))}\s+D=2 N=2", out)


def test_a_profile_cuts_each_ranks_blocks_over_its_stages() -> None:
    from fxkfac.cli_args import CliError
    from fxkfac.cli_costs import stage_blocks

    assert stage_blocks("bert-base", 12, 4, 4) == [3, 3, 3, 3]
    assert stage_blocks("bert-base", 12, 4, 8) == [2, 2, 2, 2, 1, 1, 1, 1]  # zb-v: rank r holds stages r, 7-r
    assert stage_blocks("bert-large", 24, 8, 24) == [1] * 24
    with pytest.raises(CliError, match="not divisible into 10 stages"):
        stage_blocks("bert-base", 12, 5, 10)


def _command_budgets(monkeypatch: pytest.MonkeyPatch) -> list[Budget]:
    """The budgets `fxkfac plan` opens, kept for a look at what was charged to them."""
    made: list[Budget] = []
    real = Budget.of

    def of(*args: Any, **kwargs: Any) -> Budget:
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(cli_plan.TimeBudget, "of", staticmethod(of))
    return made


def test_time_limit_counts_the_cost_tables_and_keeps_a_reserve_for_the_output(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Called in a running process, `fxkfac plan --time-limit T` opens at the call and charges no imports (what the
    process loaded before is not the command's); each cost table built, the search, and the output after it (the
    summary and --export: the reserve the search left) are charged, within T on the deterministic clock."""
    made = _command_budgets(monkeypatch)
    argv = ["plan", "bert-base", "-D", "4", "-N", "4", "--schedule", "zb-h1", "--costs", "paper:bert-base/p100"]
    assert main([*argv, "--time-limit", "1", "--export", str(tmp_path / "plan.json")]) == 0
    (whole,) = made
    assert whole.tally.modules is None and whole.tally.setup == pytest.approx(12 * COST_DTIME_PER_LAYER)
    assert whole.tally.output == after_search(2 * 4 * 4, 1)
    assert 0 < whole.tally.spent <= whole.limit * 1.1


def test_time_limit_of_the_console_script_counts_from_the_process_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The console script (`main()` reading sys.argv) opens its budget at the process's start and charges every module
    the process loaded: here a test session's thousands, more than the whole limit, so the search has no time left
    and still plans (first-fit)."""
    made = _command_budgets(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["fxkfac", *PLAN[:-2], "--time-limit", "1"])
    assert main() == 0
    (whole,) = made
    assert whole.tally.modules is not None and whole.tally.modules <= len(sys.modules)  # the output may import more
    assert whole.tally.setup >= whole.tally.modules * IMPORT_DTIME_PER_MODULE > whole.limit
    start, source = process_start()  # read again: the same start, to the clock tick of /proc (10 ms) twice over
    assert source is not StartSource.PROCESS or whole.tally.began == pytest.approx(start.at, abs=0.03)
    assert "GREEDY" in capsys.readouterr().out
