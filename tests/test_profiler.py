"""The profiler's figures as a user relies on them: backward timed alone and never 0, each time the fastest of its
repeats with their spread, and the spread carried by the cost table's JSON (old files still load)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from fxkfac import profiler
from fxkfac.capture import capture
from fxkfac.config import KFACConfig
from fxkfac.errors import CostModelError
from fxkfac.passes.split_stages import SplitResult, split_stages
from fxkfac.planner.problem.costs import CostTable, LayerCost, Spread, StageCost
from fxkfac.profiler import Timing, kfac_unit_cost, time_after, time_call

CFG = KFACConfig()


class FakeClock:
    """A clock that advances only when told to, so tests can say what each call took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The fake behind both clocks a profile may read (`profiler.clock`)."""
    fake = FakeClock()
    monkeypatch.setattr(time, "perf_counter", fake)
    monkeypatch.setattr(time, "thread_time", fake)
    return fake


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(96, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 96), nn.Tanh(), nn.Linear(96, 8)
    )


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread, as each rank of a launch has: on a shared machine a second thread that is not
    scheduled stalls the first, which makes single repeats hundreds of times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def split() -> tuple[SplitResult, dict[int, list[str]], dict, Tensor]:
    """A 4-layer MLP captured and split in two stages, its K-FAC layers by stage, and one micro-batch of 512 rows
    (a backward of milliseconds, long against a clock read)."""
    x = torch.randn(512, 96)
    captured = capture(_mlp(), (x,), CFG)
    result = split_stages(captured.gm, 2, layers=captured.layers)
    layers = {layer.name: layer for layer in captured.layers}
    by_stage = {st.index: [n for n in layers if n in st.layers] for st in result.stages}
    return result, by_stage, layers, x


def _loss(outputs: list[Tensor]) -> Tensor:
    return torch.stack([o.float().mean() for o in outputs]).sum()


def test_time_after_times_the_call_alone_as_the_fastest_of_its_repeats(clock: FakeClock) -> None:
    """A slow setup (the forward before a backward) is not counted; the figure is the fastest repeat, the spread
    the fastest and slowest."""
    took = iter([8.0, 0.75, 0.125, 0.25, 1.0, 0.5])  # one warm-up, then five repeats (exact in binary)

    def backward(_: None) -> None:
        clock.spend(next(took))

    timing = time_after(lambda: clock.spend(64.0), backward, warmup=1, repeats=5)
    assert timing == Timing(0.125, Spread(0.125, 1.0))


def test_time_call_is_time_after_with_nothing_to_set_up(clock: FakeClock) -> None:
    took: Iterator[float] = iter([1.0, 2.0, 4.0, 3.0])
    assert time_call(lambda: clock.spend(next(took)), warmup=0, repeats=4) == Timing(1.0, Spread(1.0, 4.0))


def test_a_profile_reads_cpu_time_when_torch_computes_on_this_thread_alone() -> None:
    """One intra-op thread (the module's fixture): the thread's CPU time, which other processes on the cores do
    not lengthen; more threads compute elsewhere too, so the wall clock."""
    assert profiler.clock() is time.thread_time
    torch.set_num_threads(2)
    try:
        assert profiler.clock() is time.perf_counter
    finally:
        torch.set_num_threads(1)


def test_profiled_times_are_positive_and_within_their_spreads(split: tuple) -> None:
    result, by_stage, layers, x = split
    table = profiler.profile(
        result, by_stage, kfac_unit_cost(layers, CFG, warmup=1, repeats=3), [x], _loss, warmup=1, repeats=3
    )
    for stage in table.stages:
        for value, spread in ((stage.fwd, stage.fwd_spread), (stage.bwd, stage.bwd_spread)):
            assert spread is not None and 0 < spread.low <= value <= spread.high
        for layer in stage.layers:
            assert layer.prec_spread is not None and layer.prec_spread.low <= layer.prec <= layer.prec_spread.high
            for part in layer.parts:
                assert part.stats_spread is not None and part.stats_spread.low <= part.stats <= part.stats_spread.high
                assert part.decomp_spread is not None
                assert part.decomp_spread.low <= part.decomp <= part.decomp_spread.high
    assert CostTable.from_json(table.to_json()) == table


def test_a_stage_recomputing_keeps_its_inputs_and_outputs(split: tuple) -> None:
    """`StageCost.boundary_bytes`: the bytes of the stage's inputs and outputs for one micro-batch."""
    result, by_stage, layers, x = split
    table = profiler.profile(
        result, by_stage, kfac_unit_cost(layers, CFG, warmup=0, repeats=1), [x], _loss, warmup=0, repeats=1
    )
    inputs = [x]
    for st, stage in zip(result.stages, table.stages, strict=True):
        outputs = [o.detach() for o in st.gm(*inputs)]
        assert stage.boundary_bytes == sum(t.numel() * t.element_size() for t in (*inputs, *outputs)) > 0
        inputs = outputs


def _backward_alone(result: SplitResult, x: Tensor, repeats: int) -> list[float]:
    """Each stage's backward, timed here independently of the profiler (on its clock): the fastest of `repeats`
    after a forward."""
    now, fastest, inputs = profiler.clock(), [], [x]
    for st in result.stages:
        last = st.index == len(result.stages) - 1
        samples = []
        for _ in range(repeats + 1):
            leaves = [t.detach().requires_grad_(True) for t in inputs]
            out = list(st.gm(*leaves))
            roots = [_loss(out)] if last else out
            grads = None if last else [torch.ones_like(o) for o in out]
            start = now()
            torch.autograd.backward(roots, grads)
            samples.append(now() - start)
        fastest.append(min(samples[1:]))
        inputs = [o.detach() for o in st.gm(*inputs)]
        st.gm.zero_grad(set_to_none=True)
    return fastest


def test_profiled_backward_is_the_backward_alone(split: tuple) -> None:
    """The profiled backward agrees with a backward timed by hand (within a factor of 3 either way: both are
    the fastest of repeats of the same work on a shared machine); it used to be forward+backward minus forward,
    which the noise of two separate figures could leave near 0."""
    result, _, _, x = split
    table = profiler.profile(result, {}, kfac_unit_cost({}, CFG), [x], _loss, warmup=2, repeats=7)
    alone = _backward_alone(result, x, repeats=7)
    for stage, reference in zip(table.stages, alone, strict=True):
        assert stage.bwd > 0
        assert 1 / 3 < stage.bwd / reference < 3, (stage.bwd, reference)


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_a_time_of_zero_never_reaches_the_table(split: tuple, monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """A clock that missed the work (0 s) raises an error naming the stage and what to do, not a table."""
    result, _, _, x = split
    measured = profiler._stage_times

    def zero(*args: object) -> tuple[Timing, Timing, list[Tensor]]:
        fwd, bwd, out = measured(*args)  # type: ignore[arg-type]  # the wrapper passes _stage_times' own arguments
        nothing = Timing(0.0, Spread(0.0, 0.0))
        return (nothing, bwd, out) if which == "forward" else (fwd, nothing, out)

    monkeypatch.setattr(profiler, "_stage_times", zero)
    with pytest.raises(CostModelError, match=f"stage 0's {which} was measured as 0 ms.*PlanOptions\\(costs="):
        profiler.profile(result, {}, kfac_unit_cost({}, CFG), [x], _loss, warmup=0, repeats=1)


def test_a_noisy_stage_time_is_logged_and_planned_at_its_fastest(
    split: tuple, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    result, _, _, x = split
    measured = profiler._stage_times

    def noisy(*args: object) -> tuple[Timing, Timing, list[Tensor]]:
        fwd, _, out = measured(*args)  # type: ignore[arg-type]  # the wrapper passes _stage_times' own arguments
        return fwd, Timing(1e-3, Spread(1e-3, 4e-3)), out

    monkeypatch.setattr(profiler, "_stage_times", noisy)
    with caplog.at_level(logging.WARNING, logger="fxkfac.profiler"):
        table = profiler.profile(result, {}, kfac_unit_cost({}, CFG), [x], _loss, warmup=0, repeats=1)
    assert "busy while profiling: repeats of stage 0 bwd 1-4 ms" in caplog.text
    assert table.stages[0].bwd == 1e-3 and table.stages[0].bwd_spread == Spread(1e-3, 4e-3)


def test_each_time_is_the_fastest_of_all_rounds_with_the_spread_of_all_their_repeats(
    split: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds over the whole model: a round slowed by another process does not set any figure."""
    result, by_stage, _, x = split
    measured = profiler._stage_times
    bwd = iter(
        [
            Timing(3e-3, Spread(3e-3, 5e-3)),
            Timing(9e-3, Spread(9e-3, 9e-3)),  # round 0: stages 0, 1
            Timing(2e-3, Spread(2e-3, 2.5e-3)),
            Timing(8e-3, Spread(8e-3, 12e-3)),
        ]
    )  # round 1

    def stage_times(*args: object) -> tuple[Timing, Timing, list[Tensor]]:
        fwd, _, out = measured(*args)  # type: ignore[arg-type]  # the wrapper passes _stage_times' own arguments
        return fwd, next(bwd), out

    precs = iter([4e-4, 7e-4, 1e-4, 6e-4, 5e-4, 3e-4, 2e-4, 9e-4])  # the 4 layers in round 0, then in round 1

    def unit_cost(name: str, rows: int) -> LayerCost:
        prec = next(precs)
        return replace(
            LayerCost.kfac(name, 1e-4, 1e-4, 1e-3, 1e-3, prec, 8, 8, 16, 16), prec_spread=Spread(prec, 2 * prec)
        )

    monkeypatch.setattr(profiler, "_stage_times", stage_times)
    table = profiler.profile(result, by_stage, unit_cost, [x], _loss, warmup=0, repeats=1, rounds=2)
    assert [(s.bwd, s.bwd_spread) for s in table.stages] == [(2e-3, Spread(2e-3, 5e-3)), (8e-3, Spread(8e-3, 12e-3))]
    first = table.stages[0].layers[0]
    assert (first.prec, first.prec_spread) == (4e-4, Spread(4e-4, 10e-4))
    assert [x.prec for s in table.stages for x in s.layers] == [4e-4, 3e-4, 1e-4, 6e-4]


def _table(spread: bool) -> CostTable:
    def s(lo: float, hi: float) -> Spread | None:
        return Spread(lo, hi) if spread else None

    layer = LayerCost.kfac(
        "fc",
        curv_a=1e-4,
        curv_b=2e-4,
        inv_a=1e-3,
        inv_b=2e-3,
        prec=5e-4,
        a_bytes=64,
        e_bytes=32,
        factor_a_bytes=1024,
        factor_b_bytes=256,
    )
    parts = tuple(
        replace(p, stats_spread=s(p.stats / 2, p.stats * 2), decomp_spread=s(p.decomp, p.decomp * 3))
        for p in layer.parts
    )
    layer = replace(layer, parts=parts, prec_spread=s(4e-4, 9e-4))
    stage = StageCost(
        fwd=2e-3,
        bwd=4e-3,
        param_bytes=4096,
        act_bytes=2048,
        layers=(layer,),
        fwd_spread=s(1.5e-3, 3e-3),
        bwd_spread=s(3e-3, 8e-3),
    )
    return CostTable((stage,), 8, "measured:cpu", "cpu")


def test_spreads_round_trip_through_json_and_scale_with_their_times() -> None:
    table = _table(spread=True)
    assert CostTable.from_json(table.to_json()) == table
    assert table.to_dict()["stages"][0]["bwd_spread"] == {"low": 3e-3, "high": 8e-3}
    doubled = table.with_micro_batch_size(16).stages[0]
    assert doubled.bwd_spread == Spread(6e-3, 16e-3)
    assert doubled.layers[0].part("A").stats_spread == Spread(1e-4, 4e-4)
    assert doubled.layers[0].part("A").decomp_spread == table.stages[0].layers[0].part("A").decomp_spread
    margin = table.scale_kfac_times(1.5).stages[0]
    assert margin.layers[0].prec_spread == Spread(4e-4 * 1.5, 9e-4 * 1.5) and margin.fwd_spread == Spread(1.5e-3, 3e-3)


def test_tables_without_spreads_write_and_read_as_before() -> None:
    """A table nobody profiled writes no spread keys, and a file from before spreads loads with none."""
    plain = _table(spread=False)
    text = plain.to_json()
    assert "_spread" not in text
    old = json.loads(_table(spread=True).to_json())
    for stage in old["stages"]:
        del stage["fwd_spread"], stage["bwd_spread"]
        for layer in stage["layers"]:
            del layer["prec_spread"]
            for part in layer["parts"]:
                del part["stats_spread"], part["decomp_spread"]
    assert CostTable.from_dict(old) == plain


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"low": 2.0, "high": 1.0}, "exceeds high"),
        ({"low": -1.0, "high": 1.0}, "finite and >= 0"),
        ([1.0, 2.0], "bwd_spread must be a Spread"),
        ({"low": 1.0}, "malformed entry"),
    ],
)
def test_a_malformed_spread_is_refused_naming_it(bad: object, message: str) -> None:
    data = json.loads(_table(spread=True).to_json())
    data["stages"][0]["bwd_spread"] = bad
    with pytest.raises(CostModelError, match=message):
        CostTable.from_dict(data)


def test_a_refresh_steps_taps_are_timed_for_the_captured_layers_alone(split: tuple) -> None:
    """With `captured`, each stage's deferred taps and its fused curvature are timed (never below 0) and kept through
    JSON; a stage without captured layers has neither, and without `captured` a table has none and its file no tap
    or fused keys (as before they were profiled)."""
    result, by_stage, layers, x = split
    cost = kfac_unit_cost(layers, CFG)
    captured = {s: [layers[n] for n in names] for s, names in by_stage.items() if s == 0}
    tapped = profiler.profile(result, by_stage, cost, [x], _loss, repeats=3, rounds=3, captured=captured)
    first, *rest = tapped.stages
    assert first.tap_fwd >= 0 and first.tap_bwd >= 0
    assert first.fused_fwd is not None and first.fused_fwd >= 0
    assert first.fused_bwd is not None and first.fused_bwd >= 0
    assert rest and all(s.tap_fwd == 0 and s.fused_fwd is None and s.fused_bwd is None for s in rest)
    assert CostTable.from_json(tapped.to_json()) == tapped
    plain = profiler.profile(result, by_stage, cost, [x], _loss, repeats=1, rounds=1)
    assert all(s.tap_fwd == 0 and s.tap_bwd == 0 and s.fused_fwd is None for s in plain.stages)
    keys = {key for s in json.loads(plain.to_json())["stages"] for key in s}
    assert not any(key.startswith(("tap_", "fused_")) for key in keys)


def test_each_captured_layers_gradient_is_timed_from_its_stages_backward(split: tuple) -> None:
    """With `captured`, every K-FAC layer gets when its stage's backward makes its gradient (`LayerCost.grad_ready`):
    within the backward, later in the backward for a layer earlier in the forward, kept through JSON; without
    `captured`, none (and the estimate stands: planner/problem/lowering.py `ready_fractions`)."""
    result, by_stage, layers, x = split
    cost = kfac_unit_cost(layers, CFG)
    captured = {s: [layers[n] for n in names] for s, names in by_stage.items()}
    table = profiler.profile(result, by_stage, cost, [x], _loss, repeats=3, rounds=2, captured=captured)
    for stage in table.stages:
        ready = [x.grad_ready for x in stage.layers]
        assert all(t is not None and 0 <= t <= 3 * stage.bwd_spread.high for t in ready), (ready, stage.bwd_spread)
        assert ready == sorted(ready, reverse=True), ready  # forward order: the backward reaches the last first
    assert CostTable.from_json(table.to_json()) == table
    plain = profiler.profile(result, by_stage, cost, [x], _loss, repeats=1, rounds=1)
    assert all(x.grad_ready is None for s in plain.stages for x in s.layers)


def test_profile_runs_under_the_runs_autocast(split: tuple) -> None:
    """With `autocast_dtype` the stages are timed under autocast (the loss sees the last Linear's bfloat16 output)
    and their activations are priced at its width: half of float32's for an MLP, whose intermediates are all
    floating."""
    result, _, _, x = split
    seen: list[torch.dtype] = []

    def loss(outputs: list[Tensor]) -> Tensor:
        seen.append(outputs[0].dtype)
        return _loss(outputs)

    full = profiler.profile(result, {}, kfac_unit_cost({}, CFG), [x], loss, warmup=0, repeats=1, rounds=1)
    assert set(seen) == {torch.float32}
    seen.clear()
    narrow = profiler.profile(
        result, {}, kfac_unit_cost({}, CFG), [x], loss, warmup=0, repeats=1, rounds=1, autocast_dtype=torch.bfloat16
    )
    assert set(seen) == {torch.bfloat16}
    for a, b in zip(full.stages, narrow.stages, strict=True):
        assert b.act_bytes * 2 == a.act_bytes


def test_a_zero_bubble_profile_times_each_stages_w_as_its_share_of_the_backward(split: tuple) -> None:
    """`split_backward`: each stage's W (`StageCost.wgrad`) timed on the split the runtime runs, a part of the
    backward (a Linear's weight and input gradients are matmuls of one size: neither half is nothing), on the first
    stage, whose micro-batch takes no gradient, nearly all of it (its B makes nothing); a plain profile leaves it
    unmeasured (the planner's half)."""
    result, _, _, x = split
    plain = profiler.profile(result, {}, kfac_unit_cost({}, CFG), [x], _loss, warmup=1, repeats=3, rounds=1)
    table = profiler.profile(
        result, {}, kfac_unit_cost({}, CFG), [x], _loss, warmup=1, repeats=3, rounds=2, split_backward=True
    )
    assert all(stage.wgrad is None for stage in plain.stages)
    first, *others = table.stages
    assert first.wgrad is not None and 0.9 * first.bwd < first.wgrad <= first.bwd, (first.wgrad, first.bwd)
    for stage in others:
        assert stage.wgrad is not None and 0.1 * stage.bwd < stage.wgrad < 0.9 * stage.bwd, (stage.wgrad, stage.bwd)
    assert CostTable.from_json(table.to_json()) == table


def test_a_zero_bubble_profile_times_each_layers_w_piece_as_a_part_of_its_stages_w(split: tuple) -> None:
    """With the units' parameters, each layer's own W piece (`LayerCost.wgrad`) is timed on the split a program of
    per-layer W's runs, in the same W runs as the stage's W: each positive, together about the stage's W and never
    more (each piece's fastest repeat against the fastest of their sums; the shared piece counts in W alone).
    Without them W is one piece and the layers are left untimed. The JSON keeps them."""
    result, by_stage, layers, x = split
    units = kfac_unit_cost(layers, CFG)
    params = {n: layer.params for n, layer in layers.items()}

    def zero_bubble(**given: Any) -> CostTable:
        return profiler.profile(
            result, by_stage, units, [x], _loss, warmup=1, repeats=3, rounds=1, split_backward=True, **given
        )

    table = zero_bubble(unit_params=params)
    for stage in table.stages:
        times = [layer.wgrad or 0.0 for layer in stage.layers]
        assert stage.wgrad is not None and len(times) == 2 and min(times) > 0, stage
        assert 0.6 * stage.wgrad < sum(times) <= stage.wgrad * (1 + 1e-9), (times, stage.wgrad)
    assert CostTable.from_json(table.to_json()) == table
    whole = zero_bubble()
    assert all(s.wgrad is not None and all(x.wgrad is None for x in s.layers) for s in whole.stages)


@pytest.mark.parametrize("family_name", ["shampoo", "soap", "muon"])
def test_streamed_units_price_their_owners_hand_off_and_it_round_trips(family_name: str) -> None:
    """Shampoo's, SOAP's and Muon's unit costs carry the owner's side of a streamed unit (`LayerCost.hand_off`, the
    message made in the gradient hook; `take_back`, the result installed), which a cost table's JSON keeps; a table
    without them (0) writes no key, as before them."""
    from fxkfac.muon import MuonConfig
    from fxkfac.muon.family import MuonFamily, MuonUnit, UnitKind
    from fxkfac.shampoo.config import ShampooConfig, SOAPConfig
    from fxkfac.shampoo.family import ShampooFamily
    from fxkfac.shampoo.layout import ParamUnit
    from fxkfac.shampoo.soap import SOAPFamily

    param = torch.randn(32, 16)
    family: Any
    if family_name == "muon":
        family, unit = MuonFamily(MuonConfig()), MuonUnit("w", (32, 16), UnitKind.MATRIX)
    else:
        cls, cfg = (ShampooFamily, ShampooConfig) if family_name == "shampoo" else (SOAPFamily, SOAPConfig)
        family, unit = cls(cfg(max_preconditioner_dim=16)), ParamUnit("w", (32, 16))
    cost = family.unit_cost({"w": unit}, {"w": param})("w", 8)
    assert cost.hand_off > 0 and cost.take_back > 0
    table = CostTable((StageCost(1e-3, 2e-3, 0, 0, (cost,)),), 1, "test", "test")
    assert CostTable.from_dict(json.loads(table.to_json())) == table
    plain = replace(cost, hand_off=0.0, take_back=0.0)
    layer = CostTable((StageCost(1e-3, 2e-3, 0, 0, (plain,)),), 1, "test", "test").to_dict()["stages"][0]["layers"][0]
    assert "hand_off" not in layer and "take_back" not in layer
