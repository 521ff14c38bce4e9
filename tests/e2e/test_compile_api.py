"""`fxkfac.compile(model, mesh, plan="auto")`: the public entry point, over a DeviceMesh, with torch.compile."""

from __future__ import annotations

import pytest

from tests.e2e import workers as w
from tests.support.distributed import run_distributed

pytestmark = [pytest.mark.multiproc, pytest.mark.compile]


def test_compile_with_mesh_and_inductor_equals_single_device_given_the_plan() -> None:
    """1F1B over 2 ranks, stage graphs (tapped and plain) compiled with inductor: after two refresh
    periods the parameters equal the eager single-device trainer given the same plan (inductor may
    reorder float sums, hence 1e-4). The first stage's APPLY is shared with rank 1 (compiled: each gradient sent at
    the backward's end, by the parameter hooks the compiled backward's accumulation still fires)."""
    case = w.Case("1f1b", 2, 2, 1)
    results = run_distributed(w.compile_api_worker, 2, case, "inductor", timeout=600)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    first = results[0].value
    assert first["streaming"] is not None and first["streaming"].whole_backward, first["streaming"]
    want = w.reference_for_plan(case, first["layers"], first["steps"])
    for r in results:
        assert r.value["layers"] == first["layers"]
        bad = w.compare(r.value["params"], want, atol=1e-4)
        assert not bad, f"rank {r.rank}: {bad[:4]} differ from the single-device trainer by > 1e-4"
