"""PipeFisher end to end: pipelined K-FAC over gloo ranks equals the single-device trainer given the same timings."""

from __future__ import annotations

import pytest
import torch

from fxkfac.config import KLClipScope
from tests.e2e import workers as w
from tests.support.distributed import run_distributed

pytestmark = pytest.mark.multiproc

WORLD2 = [w.Case("gpipe", 2, 2, 1), w.Case("1f1b", 2, 2, 1), w.Case("chimera", 2, 2, 1)]
WORLD4 = [w.Case("1f1b", 2, 2, 2), w.Case("chimera", 2, 2, 2), w.Case("gpipe", 4, 4, 1), w.Case("1f1b", 4, 4, 1)]


_REFERENCES: dict[tuple, dict[str, torch.Tensor]] = {}


def _reference(case: w.Case, layers: dict[str, w.LayerTiming], steps: int | None = None) -> dict[str, torch.Tensor]:
    """The single-device trainer's parameters, computed once per module for what that trainer sees: the schedule
    and the mesh shape are not among it, only N*W micro-batches (and the batches), the layer timings, the KL-clip
    scope and the steps. steps=None: `w.reference_params` (its 2 refresh periods); else `w.reference_for_plan`."""
    key = (case.N * case.W, case.scope if steps is not None else None, tuple(sorted(layers.items())), steps)
    if key not in _REFERENCES:
        _REFERENCES[key] = (
            w.reference_params(case, layers) if steps is None else w.reference_for_plan(case, layers, steps)
        )
    return _REFERENCES[key]


def _run(cases: list[w.Case], world: int) -> list:
    results = run_distributed(w.pipefisher_worker, world, cases, timeout=400)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    return results


def _check(cases: list[w.Case], results: list) -> None:
    for i, case in enumerate(cases):
        names = w._names_for(case)
        timings = w.timings_for(names)
        want = _reference(case, timings)
        covered: set[str] = set()
        for r in results:
            params, losses = r.value[i]
            assert all(abs(loss - results[0].value[i][1][k]) < 1e-6 for k, loss in enumerate(losses)), case
            bad = w.compare(params, want)
            assert not bad, f"{case} rank {r.rank}: {bad[:4]} differ from the single-device trainer by > 1e-5"
            covered |= set(params)
        assert covered == set(want), f"{case}: parameters {sorted(set(want) - covered)} are on no rank"


@pytest.fixture(scope="module")
def sensitivity() -> dict[str, float]:
    """How far K-FAC and its staleness move the parameters: the 1e-5 equality must be able to fail."""
    case = WORLD2[0]
    names = w._names_for(case)
    base = _reference(case, w.timings_for(names))
    fresh = w.reference_params(case, {n: w.LayerTiming(1, 0, 0, "fused") for n in names})
    return {n: float((base[n] - fresh[n]).abs().max()) for n in base}


def test_sensitivity(sensitivity: dict[str, float]) -> None:
    """The timings under test give other parameters than refreshing every step (so staleness is tested)."""
    assert max(sensitivity.values()) > 1e-3


def test_two_ranks_gpipe_1f1b_chimera() -> None:
    """D=2, W=1 for GPipe, 1F1B and Chimera, 2 refresh periods (fused and deferred, use_offset 0 and 1)."""
    _check(WORLD2, _run(WORLD2, 2))


def test_four_ranks_dp_and_deep() -> None:
    """D=2 W=2 (1F1B, Chimera: curvature all-reduce, split inversion + broadcast) and D=4 W=1 (GPipe, 1F1B)."""
    torch.set_num_threads(1)
    _check(WORLD4, _run(WORLD4, 4))


def test_auto_plan_export_load_train_and_refuse_other_model(tmp_path) -> None:
    """plan="auto" (profile + CP-SAT on rank 0, broadcast) saves a plan; loading it trains exactly like the
    single-device trainer given the plan's timings; the same file is refused for a 3-layer BERT."""
    case = w.Case("1f1b", 2, 2, 1)
    path = str(tmp_path / "plan.json")
    results = run_distributed(w.auto_worker, 2, case, path, timeout=400)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    first = results[0].value
    assert first["same_programs"], "the loaded plan differs from the exported one"
    assert first["kfac_ops"] > 0, "the plan has no K-FAC ops"
    want = w.reference_for_plan(case, first["layers"], first["steps"])
    for r in results:
        assert r.value["layers"] == first["layers"], "ranks run different plans"
        assert not w.compare(r.value["params"], want), f"rank {r.rank} differs from the single-device trainer"
        assert r.value["refused"] is not None and "made for graph" in r.value["refused"]


PLANNED = {
    2: [
        w.Case("gpipe", 2, 2, 1),
        w.Case("1f1b", 2, 2, 1),
        w.Case("chimera", 2, 2, 1),
        w.Case("1f1b", 2, 2, 1, KLClipScope.STALE),  # planned without a world barrier at the step's end
        w.Case("interleaved", 2, 4, 1),  # rank 0 holds stages 0 and 2; stage 0's APPLY streams to rank 1
        w.Case("chimera", 2, 2, 1, fused=1e-6, strategy="comm-opt"),  # no bubble, fused curvature cheap: fused
    ],
    4: [
        w.Case("gpipe", 2, 2, 2),
        w.Case("1f1b", 2, 2, 2),
        w.Case("chimera", 2, 2, 2),
        w.Case("gpipe", 4, 4, 1),
        w.Case("1f1b", 4, 4, 1),
        w.Case("chimera", 4, 4, 1),
    ],
    8: [w.Case("gpipe", 4, 4, 2), w.Case("1f1b", 4, 4, 2), w.Case("chimera", 4, 4, 2)],
}


@pytest.mark.parametrize("world", sorted(PLANNED))
def test_planned_runs_equal_single_device_given_the_plan(world: int) -> None:
    """GPipe, 1F1B and Chimera at D=2/4, W=1/2 run the CP-SAT plan (K-FAC in the bubbles, curvature
    all-reduce and split inversion with W=2; at D=2 GPipe, 1F1B and interleaved stream the first stage's APPLY to a
    rank of the second, which sums the copies' gradients where W=2) for two refresh periods; parameters equal the
    single-device trainer given the plan's timings to 1e-5; some plans of each launch refresh less than every step,
    so staleness is exercised."""
    cases = PLANNED[world]
    results = run_distributed(w.planned_worker, world, cases, timeout=600)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for i, case in enumerate(cases):
        layers, steps = results[0].value[i][2], results[0].value[i][3]
        assert all(r.value[i][2] == layers for r in results), f"{case}: ranks ran different plans"
        assert sum(r.value[i][4] for r in results) > 0, f"{case}: no STATS/DECOMP op in any program"
        streamed = {r.value[i][5] for r in results}
        if case.schedule == "chimera" and case.D == 2:  # every rank holds stage 0 (in one pipe or the other)
            assert streamed == {False}, case
        elif case.D == 2:  # stage 0 holds a block of K-FAC layers: its copies (W) hand them to a rank of stage 1
            assert streamed == {True}, case
        assert len(streamed) == 1, f"{case}: ranks ran different plans"
        captures = {t.capture for t in layers.values()}
        assert captures == ({"fused"} if case.fused else {"deferred"}), f"{case}: captures {captures}"
        want = _reference(case, layers, steps)
        covered: set[str] = set()
        for r in results:
            params, losses = r.value[i][0], r.value[i][1]
            assert losses == results[0].value[i][1], f"{case}: ranks report different losses"
            bad = w.compare(params, want)
            assert not bad, f"{case} rank {r.rank}: {bad[:4]} differ from the single-device trainer by > 1e-5"
            covered |= set(params)
        assert covered == set(want), f"{case}: parameters {sorted(set(want) - covered)} are on no rank"
    periods = [max(t.period for t in results[0].value[i][2].values()) for i in range(len(cases))]
    assert max(periods) >= 2, f"every plan of this launch refreshes every step: {periods}"
