"""The sympy model substituted equals the simulated base timeline: step time, bubbles, activation peak."""

from __future__ import annotations

import pytest

from fxkfac.planner.problem.analytic import PERF_SYMBOLS, evaluate, explain_perf_model, perf_model
from fxkfac.planner.problem.errors import ScheduleError
from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.problem.lowering import rank_programs
from fxkfac.planner.problem.schedules import ZERO_BUBBLE_KINDS, ScheduleKind, schedule_programs
from fxkfac.planner.problem.step_timeline import simulate

CONFIGS = {
    "gpipe": [(2, 1, 1), (4, 4, 1), (4, 7, 1), (8, 3, 1)],
    "1f1b": [(2, 2, 1), (4, 4, 1), (4, 9, 1), (8, 3, 1), (6, 6, 1)],
    "interleaved": [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 12, 3), (3, 6, 4)],
    "chimera": [(2, 2, 1), (2, 6, 1), (4, 4, 1), (4, 8, 1), (6, 18, 1), (8, 8, 1), (8, 16, 1)],
}
TIMES = [(1.0, 1.0), (1.0, 2.0), (0.7, 2.9), (2.0, 1.0), (1.5, 1.25)]


def _fb(tf: float, tb: float):
    return lambda rank, op: tf if op.kind is OpKind.FWD else tb if op.kind is OpKind.BWD else 0.0


def _cases():
    for kind, configs in CONFIGS.items():
        for D, N, v in configs:
            for tf, tb in TIMES:
                yield kind, D, N, v, tf, tb


@pytest.mark.parametrize("kind,D,N,v,tf,tb", list(_cases()))
def test_step_time_and_bubble_per_device_match_the_simulation(kind, D, N, v, tf, tb) -> None:
    model = perf_model(kind)
    values = {"D": D, "N": N, "v": v, "T_f": tf, "T_b": tb}
    timeline = simulate(rank_programs(kind, D, N, 1, v=v), _fb(tf, tb))
    assert evaluate(model.T_pipe, values) == pytest.approx(timeline.length)
    # Uniform stages: every device idles the same time, so the per-device expression is exact on each.
    for rank in timeline.ranks:
        assert evaluate(model.T_bubble, values) == pytest.approx(timeline.length - timeline.busy(rank))
    if kind != "chimera" or tb >= tf:
        critical = model.C_f * PERF_SYMBOLS["T_f"] + model.C_b * PERF_SYMBOLS["T_b"]
        assert evaluate(critical, values) == pytest.approx(timeline.length)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_activation_peak_matches_the_programs(kind: str) -> None:
    model = perf_model(kind)
    for D, N, v in CONFIGS[kind]:
        worst = 0
        for ops in schedule_programs(kind, D, N, v=v).values():
            live = 0
            for op in ops:
                live += (op.kind is OpKind.FWD) - (op.kind is OpKind.BWD)
                worst = max(worst, live)
        assert evaluate(model.peak_inflight, {"D": D, "N": N, "v": v}) == worst


def test_paper_table_1_constants_at_n_equal_d() -> None:
    for kind in ("gpipe", "1f1b"):
        m = perf_model(kind)
        assert evaluate(m.C_f, {"N": 4, "D": 4}) == 7 == evaluate(m.C_b, {"N": 4, "D": 4})
    m = perf_model("chimera")
    assert (evaluate(m.C_f, {"N": 8, "D": 8}), evaluate(m.C_b, {"N": 8, "D": 8})) == (8, 14)


def test_k_fac_terms_and_ratio() -> None:
    m = perf_model("1f1b")
    values = {"D": 4, "N": 4, "T_f": 1, "T_b": 2, "T_curv": 0.5, "T_inv": 7, "T_prec": 0.25}
    assert evaluate(m.T_kfac, values) == 4 * 0.5 + 7 + 0.25
    assert evaluate(m.ratio, values) == pytest.approx((4 * 0.5 + 7) / 9)
    mem = {"D": 4, "N": 4, "M_theta": 10, "M_act": 3, "M_err_peak": 1, "M_curv": 2, "M_inv": 2, "M_err_save": 0.5}
    assert evaluate(m.M_pipe, mem) == 2 * 10 + 4 * 3 + 1
    assert evaluate(perf_model("chimera").M_kfac, mem) == 2 * (2 + 2) + 4 * 0.5


def test_evaluate_names_missing_and_unknown_symbols() -> None:
    with pytest.raises(KeyError, match="T_b"):
        evaluate(perf_model("gpipe").T_pipe, {"D": 2, "N": 2, "T_f": 1})
    with pytest.raises(KeyError, match="unknown"):
        evaluate(perf_model("gpipe").T_pipe, {"Q": 1})


@pytest.mark.parametrize("kind", [k.value for k in ScheduleKind if k not in ZERO_BUBBLE_KINDS])
def test_explain_prints_every_quantity(kind: str) -> None:
    text = explain_perf_model(kind)
    for name in ("T_pipe", "T_bubble", "M_pipe", "T_kfac", "M_kfac", "ratio", "C_f"):
        assert f"{name} = " in text


@pytest.mark.parametrize("kind", sorted(ZERO_BUBBLE_KINDS))
def test_zero_bubble_has_no_closed_form(kind: str) -> None:
    with pytest.raises(ScheduleError, match="simulate"):
        perf_model(kind)
