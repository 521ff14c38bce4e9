"""Fuzz of the plan loader: a mutated plan file either loads as a valid plan or is refused with an fxkfac error."""

from __future__ import annotations

import copy
import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxkfac.errors import FxkfacError
from fxkfac.planner.plan.plan import SCHEMA_VERSION
from fxkfac.planner.problem.errors import PlanFormatError
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate
from fxkfac.planner.validate.plan_file import load_plan
from tests.planner.kfac_cases import problem

TreePath = tuple[Any, ...]


@lru_cache(maxsize=1)
def _valid_text() -> str:
    """A small plan with every kind of K-FAC op (W=2: curvature sync and inverse broadcast)."""
    plan = solve(problem("1f1b", 2, 2, W=2, layers=2, curv=0.25, inv=0.5), method="greedy")
    return plan.to_json()


def _paths(node: Any, here: TreePath = ()) -> list[TreePath]:
    """Every path into the JSON tree (the root excluded)."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        out.append(here + (key,))
        out += _paths(child, here + (key,))
    return out


def _get(tree: Any, path: TreePath) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: Any, path: TreePath, value: Any) -> None:
    _get(tree, path[:-1])[path[-1]] = value


def _delete(tree: Any, path: TreePath) -> None:
    del _get(tree, path[:-1])[path[-1]]


_ODD_VALUES = [None, True, "", "x", -1, 0, 1.5, 10**30, float("nan"), float("inf"), [], {}, [1], {"a": 1}]


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _mutate(tree: Any, draw: st.DrawFn) -> str:
    """Apply one random mutation in place; returns its name."""
    paths = _paths(tree)
    how = draw(st.sampled_from(["delete", "retype", "renumber", "swap", "version", "op_text"]))
    if how == "delete":
        _delete(tree, draw(st.sampled_from(paths)))
    elif how == "retype":
        _set(tree, draw(st.sampled_from(paths)), copy.deepcopy(draw(st.sampled_from(_ODD_VALUES))))
    elif how == "renumber":
        numbers = [p for p in paths if _numeric(_get(tree, p))]
        path = draw(st.sampled_from(numbers))
        old = _get(tree, path)
        new = draw(st.sampled_from([old + 1, old - 1, -old, old * 2, 0, old + 0.5, old * 1e-3, 10**9]))
        _set(tree, path, new)
    elif how == "swap":
        lists = [p for p in paths if isinstance(_get(tree, p), list) and len(_get(tree, p)) > 1]
        lists += [p for p in paths if isinstance(_get(tree, p), str) and "\n" in _get(tree, p)]
        path = draw(st.sampled_from(lists))
        value = _get(tree, path)
        seq = value.split("\n") if isinstance(value, str) else list(value)
        i = draw(st.integers(0, len(seq) - 1))
        j = draw(st.integers(0, len(seq) - 1))
        seq[i], seq[j] = seq[j], seq[i]
        _set(tree, path, "\n".join(seq) if isinstance(value, str) else seq)
    elif how == "version":
        tree["schema_version"] = draw(st.sampled_from([SCHEMA_VERSION + 1, SCHEMA_VERSION + 100, 0, "1", 1.0]))
    else:
        texts = [p for p in paths if isinstance(_get(tree, p), str) and _get(tree, p).strip()]
        path = draw(st.sampled_from(texts))
        value = _get(tree, path)
        replacement = draw(
            st.sampled_from(
                [
                    "STATS s0 m0 A nolayer",
                    "DECOMP s9 A l0_0",
                    "F s0 m0",
                    "BOGUS",
                    "\n---\n",
                    "APPLY s1",
                    "STATS s0 m7 B l0_0",
                    "BCAST s0 A @r7 l0_0",
                ]
            )
        )
        cut = draw(st.integers(0, len(value)))
        _set(tree, path, value[:cut] + replacement + value[cut:])
    return how


@st.composite
def _mutated_texts(draw: st.DrawFn) -> str:
    text = _valid_text()
    if draw(st.integers(0, 9)) == 0:
        return text[: draw(st.integers(0, len(text) - 1))]
    tree = json.loads(text)
    for _ in range(draw(st.integers(1, 3))):
        if not isinstance(tree, dict) or not tree:
            break
        _mutate(tree, draw)
    return json.dumps(tree)


def test_the_unmutated_plan_loads_and_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(_valid_text())
    plan = load_plan(path)
    assert validate(plan.problem, plan) == []
    assert plan.to_json() == _valid_text()


def test_a_program_op_naming_a_layer_its_stage_lacks_is_refused(tmp_path: Path) -> None:
    """Found by the fuzz: a program's STATS of an unknown layer reached the validator's simulation."""
    tree = json.loads(_valid_text())
    steps = tree["programs"]["0"]
    lines = steps[0].split("\n")
    i = next(i for i, line in enumerate(lines) if line.startswith("STATS "))
    lines[i] = lines[i].rsplit(" ", 1)[0] + " BOGUS"
    steps[0] = "\n".join(lines)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(tree))
    with pytest.raises(PlanFormatError, match="BOGUS"):
        load_plan(path)


@settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(_mutated_texts())
def test_mutated_plans_load_valid_or_fail_with_an_fxkfac_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(text)
    try:
        plan = load_plan(path)
    except FxkfacError as e:
        assert str(e).strip(), "an error without a message"
        return
    assert validate(plan.problem, plan) == []
    assert all(math.isfinite(t) for t in (plan.metrics.step_time, plan.metrics.utilization))


@pytest.mark.parametrize(
    "version,needle",
    [
        (SCHEMA_VERSION + 1, "upgrade fxkfac"),
        (SCHEMA_VERSION - 1, "re-plan"),
        ("1", "schema_version"),
        (True, "schema_version"),
        (None, "schema_version"),
    ],
)
def test_versions_other_than_ours_are_refused(tmp_path: Path, version: Any, needle: str) -> None:
    tree = json.loads(_valid_text())
    tree["schema_version"] = version
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(tree))
    with pytest.raises(PlanFormatError, match=needle):
        load_plan(path)


@pytest.mark.parametrize("field,value,needle", [("N", 10**7, "micro-batches"), ("W", 10**8, "D x W")])
def test_a_huge_mesh_or_micro_batch_count_is_refused_before_its_schedule_is_built(
    tmp_path: Path, field: str, value: int, needle: str
) -> None:
    """Seen in the suite: a fuzzed N made the loader build that schedule (15 GB) before comparing programs."""
    tree = json.loads(_valid_text())
    tree["problem"][field] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(tree))
    with pytest.raises(PlanFormatError, match=needle):
        load_plan(path)
