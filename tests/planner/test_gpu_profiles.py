"""`gpu:<model>/<device>` per-block profiles (benchmarks/gpu_check.py's): found, loaded like `paper:` ones, planned."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxkfac.planner.problem import profiles
from fxkfac.planner.problem.errors import CostModelError
from fxkfac.planner.problem.problem import Problem, SolverConfig
from fxkfac.planner.problem.profiles import (
    block_profile_json,
    cost_table_from_pipefisher_csv,
    is_profile,
    load_cost_table,
)
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate

FIXTURES = Path(__file__).parent.parent / "data" / "gpu_profiles"
"""A shipped-folder stand-in holding bert-base_testgpu.json: made-up numbers in the format gpu_check writes."""
OPTIONS = {"blocks_per_stage": 3, "n_stages": 4, "micro_batch_size": 32}


@pytest.fixture
def shipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixture folder as planner/data/gpu_profiles."""
    monkeypatch.setitem(profiles.SHIPPED, profiles.GPU_PREFIX, FIXTURES)


def test_a_gpu_name_loads_the_shipped_table_and_plans(shipped: None) -> None:
    assert is_profile("gpu:bert-base/testgpu")
    table = load_cost_table("gpu:bert-base/testgpu", **OPTIONS)
    # the file's bs-32 row (ms and MiB per block), three blocks a stage, its device the table's hardware
    assert table.hardware == "testgpu" and table.source == "gpu-profile:bert-base_testgpu.json"
    assert [s.fwd for s in table.stages] == pytest.approx([3 * 0.75e-3] * 4)
    assert [s.bwd for s in table.stages] == pytest.approx([3 * 1.5e-3] * 4)
    assert sum(x.curv for x in table.stages[0].layers) == pytest.approx(3 * 1.7e-3)
    assert sum(x.inv for x in table.stages[0].layers) == pytest.approx(3 * 6.0e-3)
    assert table.stages[0].act_bytes == round(3 * 8.5 * 32 * 2**20)
    # the same file by path is the same table
    assert load_cost_table(FIXTURES / "bert-base_testgpu.json", **OPTIONS) == table
    plan = solve(Problem("1f1b", 4, 4, table), SolverConfig(time_limit_s=5))
    assert validate(plan.problem, plan) == []
    assert all(k >= 1 for k in plan.metrics.refresh_steps)


def test_the_written_format_round_trips(tmp_path: Path) -> None:
    """What gpu_check writes (`block_profile_json`) loads back to the rows it was given, interpolated between them."""
    rows = [{c: float(i + 1) for c in profiles.PIPEFISHER_COLUMNS} | {"bs": bs} for i, bs in enumerate((8, 16))]
    path = tmp_path / "bert-large_h200.json"
    path.write_text(block_profile_json(rows, model="bert-large", device="h200", dtype="bfloat16", seq_len=128))
    assert is_profile(path)
    mid = cost_table_from_pipefisher_csv(path, blocks_per_stage=[1], micro_batch_size=12)
    assert mid.hardware == "h200"
    assert mid.stages[0].fwd == pytest.approx(1.5e-3)  # halfway between 1 ms (bs 8) and 2 ms (bs 16)


def test_errors_name_the_problem(shipped: None, tmp_path: Path) -> None:
    with pytest.raises(CostModelError, match="no shipped GPU profile 'gpu:bert-base/v100'.*gpu:bert-base/testgpu"):
        load_cost_table("gpu:bert-base/v100", **OPTIONS)
    with pytest.raises(CostModelError, match="pass \\['blocks_per_stage', 'micro_batch_size'\\]"):
        load_cost_table("gpu:bert-base/testgpu")
    with pytest.raises(CostModelError, match="rows lack the columns"):
        block_profile_json([{"bs": 1.0}], model="m", device="d")
    bad = tmp_path / "m_d.json"
    bad.write_text('{"format": "fxkfac-block-profile/1", "rows": [{"bs": 1}]}')
    with pytest.raises(CostModelError, match="rows lack the columns"):
        load_cost_table(bad, **OPTIONS)
