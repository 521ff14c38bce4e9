"""The golden set's ci subset (benchmarks/planner_golden.py): no plan worse than recorded before the planner changed.

30 random problems of kfac_cases' strategy and the README snippet's 2 x 2 mesh (issue 38) at a 2 s limit, each
planned now and compared with tests/data/planner_golden.json: refresh periods, step, peak memory and the
deterministic time spent each equal or better. The full set (paper configurations, planner_scaling, the demo, 200
random problems): `python -m benchmarks.planner_golden compare`.
"""

from __future__ import annotations

from benchmarks.planner_golden import compare, load, run_set, verdict


def test_the_ci_subset_plans_no_worse_than_recorded() -> None:
    now = run_set(full=False)
    golden = load()
    assert set(now) <= set(golden), f"cases never recorded: {sorted(set(now) - set(golden))}"
    verdicts = compare({k: golden[k] for k in now}, now)
    bad = {name: (v, golden[name], now[name]) for name, v in verdicts.items() if v not in ("equal", "better", "capped")}
    assert not bad, bad
    assert list(verdicts.values()).count("capped") < len(verdicts) / 2, "the machine is too loaded to compare plans"


def test_the_verdict_counts_a_worse_criterion_as_worse_whatever_else_improved() -> None:
    old = {"refresh": [3, 5], "step_ms": 10.0, "peak": {"0": 100}, "dtime": 1.0}
    assert verdict(old, dict(old)) == "equal"
    assert verdict(old, {**old, "refresh": [3, 4]}) == "better"
    assert verdict(old, {**old, "refresh": [2, 6]}) == "worse"
    assert verdict(old, {**old, "refresh": [2, 4], "dtime": 1.5}) == "worse"
    assert verdict(old, {**old, "peak": {"0": 101}, "step_ms": 9.0}) == "worse"
    assert verdict(old, {"error": "no plan", "dtime": 0.5}) == "worse"
    assert verdict({"error": "no plan", "dtime": 0.5}, old) == "better"
    assert verdict({**old, "digest": "a"}, {**old, "digest": "b"}) == "changed problem"
    assert verdict(old, {**old, "refresh": [4, 5], "capped": True}) == "capped"
