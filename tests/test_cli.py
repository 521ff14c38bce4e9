"""The `fxkfac` CLI: plan/show output at 80 and wide columns, traces, one-line errors, no torch import."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from rich.console import Console

from fxkfac.cli import main, parse_bytes, parse_fraction
from fxkfac.planner.errors import PlannerError
from fxkfac.planner.ir import Op, OpKind
from fxkfac.planner.simulate import Interval, Timeline
from fxkfac.show import chrome_trace, render_timeline, timeline_from_trace

PLAN = ["plan", "bert-base", "--stages", "4", "--microbatches", "4", "--schedule", "1f1b", "--hardware", "p100"]


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


@pytest.mark.parametrize("columns", [80, 200])
def test_plan_show_fits_the_terminal(columns: int, monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(PLAN + ["--show", "--explain"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= columns
    rows = [line for line in lines if line.startswith(("r0 ", "r1 ", "r2 ", "r3 "))]
    assert len(rows) == 4 and all(len(row) == len(rows[0]) for row in rows)
    assert len(rows[0]) >= columns - 2  # the time axis is scaled to the width
    for word in ("forward", "backward", "curvature", "inversion", "precondition", "idle", "T_bubble ="):
        assert word in out


def test_trace_round_trips_and_show_draws_it(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    trace_path = tmp_path / "trace.json"
    assert main(PLAN + ["--trace", str(trace_path)]) == 0
    trace = json.loads(trace_path.read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"rank 0", "rank 1", "rank 2", "rank 3"}
    timeline = timeline_from_trace(trace)
    fb = [iv for iv in timeline.intervals if iv.op.kind in (OpKind.FWD, OpKind.BWD)]
    assert len(fb) == 4 * 4 * 2
    again = timeline_from_trace(chrome_trace(timeline))
    assert [(iv.rank, iv.op) for iv in again.intervals] == [(iv.rank, iv.op) for iv in timeline.intervals]
    assert [iv.end for iv in again.intervals] == pytest.approx([iv.end for iv in timeline.intervals])
    assert timeline.makespan * 1e3 == pytest.approx(float(_step_ms(capsys.readouterr().out)), abs=0.01)
    plan_file = tmp_path / "unused.json"
    plan_file.write_text("{}")
    assert main(["show", str(plan_file), "--measured", str(trace_path)]) == 0
    assert "r3 " in capsys.readouterr().out
    if importlib.util.find_spec("fxkfac.planner.plan") is None:
        assert main(["show", str(plan_file)]) == 2
        assert "Plan.load" in _one_line_error(capsys)


def _step_ms(out: str) -> str:
    line = next(line for line in out.splitlines() if "step time" in line)
    return line.split("│")[2].split("ms")[0].strip()


def test_render_scales_boxes_by_hand() -> None:
    ops = [Interval(0, 0, Op(OpKind.FWD, 0, 0), 0.0, 1.0), Interval(0, 0, Op(OpKind.BWD, 0, 0), 3.0, 5.0),
           Interval(1, 0, Op(OpKind.FWD, 1, 0), 1.0, 2.0), Interval(1, 0, Op(OpKind.BWD, 1, 0), 2.0, 3.0),
           Interval(1, 0, Op(OpKind.INV, 1, layer="fc", factor="A"), 3.0, 5.0)]
    console = Console(width=15, record=True, color_system=None)
    console.print(render_timeline(Timeline(tuple(ops), (0, 1), 1), width=15))
    rows = [line for line in console.export_text().splitlines() if line.startswith(("r0 ", "r1 "))]
    assert rows == ["r0 │00····0000│", "r1 │··0000IIII│"]  # 10 cells of 0.5 s


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    return err


@pytest.mark.parametrize("argv,needle", [
    (["plan", "bert-huge", "-D", "4", "-N", "4"], "unknown model preset"),
    (["plan", "bert-base", "-D", "4", "-N", "4", "--hardware", "tpu"], "unknown hardware"),
    (["plan", "bert-base", "-D", "3", "-N", "4", "--schedule", "chimera"], "even"),
    (["plan", "nofile.py:make", "-D", "2", "-N", "2"], "no file"),
    (["plan", "bert-base", "-D", "4", "-N", "4", "--costs", "missing.json"], "missing.json"),
])
def test_bad_input_is_one_line(argv, needle, capsys) -> None:
    assert main(argv) == 2
    assert needle in _one_line_error(capsys)


def test_missing_factory_and_bad_units_are_one_line(tmp_path, capsys) -> None:
    script = tmp_path / "m.py"
    script.write_text("x = 1\n")
    assert main(["plan", f"{script}:make", "-D", "2", "-N", "2"]) == 2
    assert "no callable 'make'" in _one_line_error(capsys)
    for flag, value in (("--memory", "12XB"), ("--max-overhead", "lots")):
        with pytest.raises(SystemExit) as info:
            main(PLAN + [flag, value])
        assert info.value.code == 2
        assert value in _one_line_error(capsys)


def test_plan_path_does_not_import_torch(tmp_path) -> None:
    code = (
        "import sys\nfrom fxkfac.cli import main\n"
        f"assert main({PLAN + ['--show', '--explain', '--trace', str(tmp_path / 't.json')]!r}) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
