"""Cost tables: the PipeFisher CSV loader against the raw file, JSON round trips, and clear errors."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxkfac.planner.problem.analytic import preset
from fxkfac.planner.problem.costs import CostTable, LayerCost, StageCost
from fxkfac.planner.problem.errors import CostModelError
from fxkfac.planner.problem.profiles import (
    ProfileLayers,
    cost_table_from_pipefisher_csv,
    load_cost_table,
)

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "planner" / "data" / "pipefisher_profiles"  # the shipped copy, read here by path
BERT_P100 = PROFILES / "bert-base_time_memory_p100.csv"
MIB = 2**20


def _raw_rows(path: Path) -> dict[int, dict[str, float]]:
    """The file read by hand (split on commas), the independent reference for the loader."""
    header, *lines = path.read_text().split()
    names = header.split(",")
    rows = [dict(zip(names, map(float, line.split(",")))) for line in lines]
    return {int(r["bs"]): r for r in rows}


def test_csv_loader_reproduces_every_number_of_the_file_in_seconds_and_bytes() -> None:
    raw = _raw_rows(BERT_P100)[32]
    table = cost_table_from_pipefisher_csv(BERT_P100, blocks_per_stage=[3, 3, 3, 3], micro_batch_size=32)
    assert table.micro_batch_size == 32 and table.hardware == "p100"
    assert [len(s.layers) for s in table.stages] == [3, 3, 3, 3]
    assert table.layer_names == tuple(f"block{i}" for i in range(12))
    assert table.stage_of("block7") == 2
    for stage in table.stages:
        assert stage.fwd == pytest.approx(3 * raw["time_f"] / 1000, rel=1e-12)
        assert stage.bwd == pytest.approx(3 * raw["time_b"] / 1000, rel=1e-12)
        assert stage.act_bytes == round(3 * raw["mem_act"] * MIB)
        assert stage.param_bytes == round(3 * raw["mem_param"] * MIB)
        assert stage.peak_err_bytes == round(raw["mem_peak_err"] * MIB)
        for layer in stage.layers:
            assert layer.curv == pytest.approx(raw["time_kron"] / 1000, rel=1e-12)
            assert layer.inv == pytest.approx(raw["time_inv"] / 1000, rel=1e-12)
            assert layer.prec == pytest.approx(raw["time_prec"] / 1000, rel=1e-12)
            assert layer.factor_bytes == raw["mem_kron"] * MIB
            assert layer.part("B").capture_bytes == raw["mem_save_err"] * MIB
        assert stage.curv == pytest.approx(3 * raw["time_kron"] / 1000, rel=1e-12)


def test_every_profile_file_and_row_loads_with_its_hardware() -> None:
    files = sorted(PROFILES.glob("*_time_memory_*.csv"))
    assert len(files) == 18
    for path in files:
        for bs, raw in _raw_rows(path).items():
            table = cost_table_from_pipefisher_csv(path, blocks_per_stage=2, n_stages=3, micro_batch_size=bs)
            assert table.hardware == path.stem.rsplit("_", 1)[1]
            assert table.stages[2].fwd == pytest.approx(2 * raw["time_f"] / 1000, rel=1e-12)
            assert table.stages[0].layers[1].part("B").decomp == pytest.approx(raw["time_inv"] / 2000, rel=1e-12)


def test_paper_names_are_the_shipped_files() -> None:
    paths = sorted(PROFILES.glob("*.csv"))
    names = [f"paper:{model}/{hw}" for model, hw in (path.stem.split("_time_memory_") for path in paths)]
    assert len(names) == 18 and "paper:t5-large/rtx3090" in names
    for name, path in zip(names, paths, strict=True):  # each file by its paper: name, as by its path
        options: dict[str, Any] = dict(blocks_per_stage=[1], micro_batch_size=min(_raw_rows(path)))
        assert load_cost_table(name, **options) == load_cost_table(path, **options)
    available = re.escape(", ".join(sorted(names)))
    with pytest.raises(CostModelError, match=f"no shipped PipeFisher profile 'paper:x/y'; available: {available}$"):
        load_cost_table("paper:x/y", blocks_per_stage=[1], micro_batch_size=1)


def test_paper_name_loads_the_shipped_csv_like_its_path() -> None:
    options = dict(blocks_per_stage=3, n_stages=4, micro_batch_size=32)
    by_name = load_cost_table("paper:bert-base/p100", **options)
    assert by_name == load_cost_table(BERT_P100, **options)
    assert by_name == cost_table_from_pipefisher_csv("paper:bert-base/p100", **options)
    assert by_name.source == "pipefisher-csv:bert-base_time_memory_p100.csv" and by_name.hardware == "p100"
    assert by_name.stages[3].fwd == pytest.approx(3 * _raw_rows(BERT_P100)[32]["time_f"] / 1000, rel=1e-12)
    large = load_cost_table("paper:bert-large/v100", blocks_per_stage=[1], micro_batch_size=8)
    large_rows = _raw_rows(PROFILES / "bert-large_time_memory_v100.csv")
    assert large.stages[0].bwd == pytest.approx(large_rows[8]["time_b"] / 1000)


def test_unknown_paper_name_lists_the_available_ones() -> None:
    listing = r"available: paper:bert-base/p100, paper:bert-base/rtx3090, .*paper:t5-large/v100$"
    with pytest.raises(CostModelError, match=r"no shipped PipeFisher profile 'paper:bert-base/a100'; " + listing):
        load_cost_table("paper:bert-base/a100", blocks_per_stage=3, n_stages=4, micro_batch_size=32)
    with pytest.raises(CostModelError, match="no shipped PipeFisher profile 'paper:gpt2'"):
        load_cost_table("paper:gpt2")  # the unknown name is reported before the missing options
    with pytest.raises(CostModelError, match="no shipped PipeFisher profile 'paper:bert-base/p100.csv'"):
        cost_table_from_pipefisher_csv("paper:bert-base/p100.csv", blocks_per_stage=[1], micro_batch_size=1)


def test_a_profile_without_its_sizes_says_what_to_pass() -> None:
    for source in ("paper:bert-base/p100", BERT_P100):
        with pytest.raises(
            CostModelError,
            match=r"per-Transformer-block profile: pass \['blocks_per_stage', "
            r"'micro_batch_size'\]",
        ):
            load_cost_table(source)


def test_the_profiles_are_package_data() -> None:
    """Every shipped file (the paper's profiles, the GPU ones) matches a package-data pattern of fxkfac.planner, so
    an installed fxkfac has it."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    planner_dir = REPO / setuptools["package-dir"]["fxkfac.planner"]
    patterns = setuptools["package-data"]["fxkfac.planner"]
    folders = (PROFILES, PROFILES.parent / "gpu_profiles")
    shipped = {p for folder in folders for p in folder.iterdir() if p.is_file()}
    assert {p for pattern in patterns for p in planner_dir.glob(pattern)} == shipped
    assert {folder / "README.md" for folder in folders} <= shipped


def test_fifty_fifty_split_follows_from_the_factor_dims_of_a_bert_block() -> None:
    """The loader's docstring claims sum d_in^k == sum d_out^k per block and mem_kron = 4 B * sum d^2."""
    block = preset("bert-base").blocks[0]
    dims_in = [x.d_in for x in block.linears]
    dims_out = [x.d_out for x in block.linears]
    for k in (1, 2, 3):
        assert sum(d**k for d in dims_in) == sum(d**k for d in dims_out)
    mem_kron = _raw_rows(BERT_P100)[32]["mem_kron"]
    assert 4 * sum(d * d for d in dims_in + dims_out) == mem_kron * MIB
    save_err = _raw_rows(BERT_P100)[32]["mem_save_err"]  # errors of 32 x 128 tokens, fp32
    assert 4 * 32 * 128 * sum(dims_out) == save_err * MIB


@pytest.mark.parametrize("layers", list(ProfileLayers))
def test_every_granularity_shares_out_exactly_what_a_block_costs(layers: ProfileLayers) -> None:
    """Whatever the K-FAC layer, a block's layers together cost the profiled block: time, factors, captures."""
    raw = _raw_rows(BERT_P100)[32]
    table = cost_table_from_pipefisher_csv(BERT_P100, blocks_per_stage=[2], micro_batch_size=32, layers=layers)
    per_block = {"block": 1, "sublayer": 2, "linear": 6}[layers.value]
    assert len(table.stages[0].layers) == 2 * per_block
    for block in ("block0", "block1"):
        mine = [x for x in table.stages[0].layers if x.name.split(".")[0] == block]
        assert len(mine) == per_block
        assert sum(x.curv for x in mine) == pytest.approx(raw["time_kron"] / 1000, rel=1e-12)
        assert sum(x.inv for x in mine) == pytest.approx(raw["time_inv"] / 1000, rel=1e-12)
        assert sum(x.prec for x in mine) == pytest.approx(raw["time_prec"] / 1000, rel=1e-12)
        assert sum(x.factor_bytes for x in mine) == pytest.approx(raw["mem_kron"] * MIB, abs=per_block * 2)
        assert sum(x.part("B").capture_bytes for x in mine) == pytest.approx(raw["mem_save_err"] * MIB, abs=6)
        assert sum(x.grad_bytes for x in mine) == pytest.approx(raw["mem_param"] * MIB, abs=6)


def test_linear_layers_cost_what_bert_large_linears_do_by_their_shapes() -> None:
    """Each Linear's share, against the preset's real widths (1024 and 4096): inversion d^3 per factor, APPLY
    d_in d_out (d_in + d_out), curvature d^2 per factor; the layers come in forward order."""
    raw = _raw_rows(PROFILES / "bert-large_time_memory_p100.csv")[32]
    table = load_cost_table(
        "paper:bert-large/p100", blocks_per_stage=1, n_stages=1, micro_batch_size=32, layers=ProfileLayers.LINEAR
    )
    linears = preset("bert-large").blocks[0].linears
    cubes = sum(x.d_in**3 + x.d_out**3 for x in linears)
    squares = sum(x.d_in**2 + x.d_out**2 for x in linears)
    applies = sum(x.d_in * x.d_out * (x.d_in + x.d_out) for x in linears)
    names = ("q", "k", "v", "o", "fc1", "fc2")
    assert table.layer_names == tuple(f"block0.{n}" for n in names)
    for layer, x in zip(table.stages[0].layers, linears, strict=True):
        assert layer.part("A").decomp == pytest.approx(raw["time_inv"] / 1000 * x.d_in**3 / cubes, rel=1e-12)
        assert layer.part("B").decomp == pytest.approx(raw["time_inv"] / 1000 * x.d_out**3 / cubes, rel=1e-12)
        assert layer.part("B").stats == pytest.approx(raw["time_kron"] / 1000 * x.d_out**2 / squares, rel=1e-12)
        assert layer.prec == pytest.approx(raw["time_prec"] / 1000 * x.d_in * x.d_out * (x.d_in + x.d_out) / applies)
    sub = load_cost_table(
        "paper:bert-large/p100", blocks_per_stage=1, n_stages=1, micro_batch_size=32, layers=ProfileLayers.SUBLAYER
    )
    attention, ffn = sub.stages[0].layers
    assert (attention.name, ffn.name) == ("block0.attn", "block0.ffn")
    assert attention.prec == pytest.approx(sum(x.prec for x in table.stages[0].layers[:4]), rel=1e-12)
    assert ffn.inv == pytest.approx(sum(x.inv for x in table.stages[0].layers[4:]), rel=1e-12)


def test_micro_batch_between_measured_sizes_is_interpolated_and_outside_is_refused() -> None:
    rows = _raw_rows(BERT_P100)
    mid = cost_table_from_pipefisher_csv(BERT_P100, blocks_per_stage=[1], micro_batch_size=24)
    assert mid.stages[0].fwd == pytest.approx((rows[16]["time_f"] + rows[32]["time_f"]) / 2000, rel=1e-12)
    with pytest.raises(CostModelError, match=r"outside the measured sizes \[1, 2, 4, 8, 16, 32, 64\]"):
        cost_table_from_pipefisher_csv(BERT_P100, blocks_per_stage=[1], micro_batch_size=128)


def test_csv_errors_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "x.csv"
    bad.write_text("bs,time_f\n1,2\n")
    with pytest.raises(CostModelError, match="rows lack the columns"):
        cost_table_from_pipefisher_csv(bad, blocks_per_stage=[1], micro_batch_size=1)
    with pytest.raises(CostModelError, match="needs n_stages"):
        cost_table_from_pipefisher_csv(BERT_P100, blocks_per_stage=3, micro_batch_size=32)
    with pytest.raises(CostModelError, match="positive ints"):
        cost_table_from_pipefisher_csv(BERT_P100, blocks_per_stage=[3, 0], micro_batch_size=32)
    with pytest.raises(CostModelError, match="cannot read"):
        cost_table_from_pipefisher_csv(tmp_path / "missing.csv", blocks_per_stage=[1], micro_batch_size=1)


def test_json_round_trip_and_load_dispatch(tmp_path: Path) -> None:
    table = cost_table_from_pipefisher_csv(BERT_P100, blocks_per_stage=[2, 1], micro_batch_size=8)
    assert CostTable.from_json(table.to_json()) == table
    path = tmp_path / "costs.json"
    table.save(path)
    assert load_cost_table(path) == table
    assert load_cost_table(BERT_P100, blocks_per_stage=[2, 1], micro_batch_size=8) == table
    with pytest.raises(CostModelError, match="unknown cost file type '.yaml'.* such as paper:bert-base/p100"):
        load_cost_table(tmp_path / "costs.yaml")


def test_cost_files_from_before_parts_read_as_kfac_parts() -> None:
    """A layer written with K-FAC's fields (curv_a, ..., factor_b_bytes) is K-FAC's parts A and B."""
    table = cost_table_from_pipefisher_csv(BERT_P100, blocks_per_stage=[1, 1], micro_batch_size=8)
    data = table.to_dict()
    for stage in data["stages"]:
        stage["layers"] = [
            {
                "name": x["name"],
                "prec": x["prec"],
                **{
                    f"{k}_{side}": p[v]
                    for side, p in zip("ab", x["parts"])
                    for k, v in (("curv", "stats"), ("inv", "decomp"))
                },
                "a_bytes": x["parts"][0]["capture_bytes"],
                "e_bytes": x["parts"][1]["capture_bytes"],
                "factor_a_bytes": x["parts"][0]["state_bytes"],
                "factor_b_bytes": x["parts"][1]["state_bytes"],
            }
            for x in stage["layers"]
        ]
    old = replace(
        table,
        stages=tuple(replace(st, layers=tuple(replace(x, grad_bytes=0) for x in st.layers)) for st in table.stages),
    )  # the gradient's size came later
    assert CostTable.from_dict(data) == old


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(schema_version=99), "schema_version 99 is not supported"),
        (lambda d: d.pop("stages"), "missing the key 'stages'"),
        (lambda d: d["stages"][0]["layers"][0]["parts"][0].update(stats=-1.0), "stats must be finite and >= 0"),
        (lambda d: d["stages"][0]["layers"][0]["parts"][1].update(capture_bytes=1.5), "capture_bytes must be an int"),
        (
            lambda d: d["stages"][0]["layers"][0]["parts"][1].update(after="OPT_STEP"),
            "after must be FWD, BWD or ALLREDUCE_GRAD",
        ),
        (lambda d: d["stages"][0]["layers"][0]["parts"][1].update(part="A"), "repeat a name"),
        (lambda d: d["stages"][0].update(fwd=float("nan")), "fwd must be finite"),
        (lambda d: d["stages"][0].update(bogus=1), "malformed entry"),
        (lambda d: d["stages"][1]["layers"][0].update(name="block0"), "repeated: \\['block0'\\]"),
        (lambda d: d.update(micro_batch_size=0), "micro_batch_size must be an int >= 1"),
    ],
)
def test_bad_json_is_refused_with_a_clear_error(mutate: Callable[[dict[str, Any]], object], message: str) -> None:
    data = cost_table_from_pipefisher_csv(BERT_P100, blocks_per_stage=[1, 1], micro_batch_size=8).to_dict()
    mutate(data)
    with pytest.raises(CostModelError, match=message):
        CostTable.from_dict(data)


def test_not_json_is_refused() -> None:
    with pytest.raises(CostModelError, match="not valid JSON"):
        CostTable.from_json("{stages:")


def test_scaling_helpers() -> None:
    table = cost_table_from_pipefisher_csv(BERT_P100, blocks_per_stage=[1, 2], micro_batch_size=16)
    double = table.with_micro_batch_size(32)
    s0, s1 = table.stages[1], double.stages[1]
    assert double.micro_batch_size == 32
    assert s1.fwd == pytest.approx(2 * s0.fwd) and s1.curv == pytest.approx(2 * s0.curv)
    assert s1.act_bytes == 2 * s0.act_bytes and s1.deferred_bytes == 2 * s0.deferred_bytes
    assert s1.inv == s0.inv and s1.prec == s0.prec and s1.factor_bytes == s0.factor_bytes
    slow = table.scale_times(2.5)
    assert slow.stages[0].inv == pytest.approx(2.5 * table.stages[0].inv)
    assert slow.stages[0].bwd == pytest.approx(2.5 * table.stages[0].bwd)
    assert slow.stages[0].act_bytes == table.stages[0].act_bytes


_seconds = st.floats(min_value=0, max_value=10, allow_nan=False)
_bytes = st.integers(min_value=0, max_value=2**40)
_layer = st.builds(LayerCost.kfac, st.just("x"), *([_seconds] * 5), *([_bytes] * 4))


@st.composite
def _tables(draw: st.DrawFn) -> CostTable:
    stages = []
    for i in range(draw(st.integers(1, 4))):
        layers = draw(st.lists(_layer, max_size=3))
        named = tuple(replace(x, name=f"s{i}.l{j}") for j, x in enumerate(layers))
        stages.append(StageCost(draw(_seconds), draw(_seconds), draw(_bytes), draw(_bytes), named, draw(_bytes)))
    return CostTable(tuple(stages), draw(st.integers(1, 512)), "test", "cpu")


@settings(max_examples=60, deadline=None)
@given(_tables())
def test_any_table_round_trips_through_json_exactly(table: CostTable) -> None:
    back = CostTable.from_json(table.to_json())
    assert back == table
    assert math.isclose(back.stages[0].curv, table.stages[0].curv)


def test_the_median_of_ranks_profiles_takes_each_figure_apart_and_refuses_other_splits() -> None:
    """Each time is its own median over the tables (so no one table is returned whole), a figure one table did not
    measure is the median of the others', spreads cover all; a table of another split is refused."""
    from fxkfac.planner.problem.costs import Spread, median_of
    from tests.planner.kfac_cases import table

    base = table(2, layers=2)

    def varied(fwd: float, stats: float, fused: float | None) -> CostTable:
        first = base.stages[0]
        layer = replace(
            first.layers[0], parts=(replace(first.layers[0].parts[0], stats=stats), *first.layers[0].parts[1:])
        )
        stage = replace(
            first, fwd=fwd, fused_fwd=fused, fwd_spread=Spread(fwd, 2 * fwd), layers=(layer, *first.layers[1:])
        )
        return replace(base, stages=(stage, *base.stages[1:]))

    got = median_of([varied(1.0, 0.9, None), varied(3.0, 0.1, 0.4), varied(2.0, 0.5, 0.2)])
    stage = got.stages[0]
    assert (stage.fwd, stage.layers[0].parts[0].stats) == (2.0, 0.5)  # the middle of each, from different tables
    assert stage.fused_fwd == pytest.approx(0.3)  # the median of the two that measured it
    assert stage.fwd_spread == Spread(1.0, 6.0)
    assert got.stages[1:] == base.stages[1:]
    other = replace(
        base, stages=(replace(base.stages[0], param_bytes=base.stages[0].param_bytes + 4), *base.stages[1:])
    )
    with pytest.raises(CostModelError, match="different splits"):
        median_of([base, other])


def _with_layer_w(table: CostTable, seconds: Callable[[int], float]) -> CostTable:
    """`table` with each stage's W measured (half its backward) and each stage's layer j's W piece `seconds(j)`."""
    return replace(
        table,
        stages=tuple(
            replace(s, wgrad=s.bwd / 2, layers=tuple(replace(x, wgrad=seconds(j)) for j, x in enumerate(s.layers)))
            for s in table.stages
        ),
    )


def test_a_layers_w_round_trips_scales_with_its_micro_batch_and_old_files_load_without_it() -> None:
    """`LayerCost.wgrad` (a layer's W piece per micro-batch) is kept by the JSON, scales with the micro-batch and the
    device as the stage's W does and not with the K-FAC margin, and combines over rank profiles as the stage's W
    does (the median); a file without it (every file before it) loads unmeasured and writes as before."""
    from fxkfac.planner.problem.costs import median_of

    old = cost_table_from_pipefisher_csv(BERT_P100, blocks_per_stage=[1, 2], micro_batch_size=16)
    ms = [1e-4 * (j + 1) for j in range(len(old.stages[1].layers))]
    timed = _with_layer_w(old, lambda j: ms[j])
    assert CostTable.from_json(timed.to_json()) == timed
    assert all("wgrad" in x for s in timed.to_dict()["stages"] for x in s["layers"])
    assert all("wgrad" not in x for s in old.to_dict()["stages"] for x in s["layers"])
    assert CostTable.from_json(old.to_json()) == old
    assert all(x.wgrad is None for s in old.stages for x in s.layers)

    def layer_w(table: CostTable) -> list[float | None]:
        return [x.wgrad for x in table.stages[1].layers]

    assert layer_w(timed.with_micro_batch_size(32)) == pytest.approx([2 * t for t in ms])
    assert layer_w(timed.scale_times(2.5)) == pytest.approx([2.5 * t for t in ms])
    assert layer_w(timed.scale_kfac_times(3.0)) == ms
    ranks = [_with_layer_w(old, lambda j, r=r: r * 1e-4) for r in (1, 3, 2)]
    assert {x.wgrad for s in median_of(ranks).stages for x in s.layers} == {2e-4}
