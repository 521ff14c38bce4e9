"""Streamed preconditioning end to end (docs/STREAMED_APPLY.md): a plan whose first stage hands its APPLY to an idle
rank trains as the single-device trainer does, skips a NaN step on every rank, and resumes from a checkpoint taken
mid-run bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxkfac.config import KLClipScope
from tests.e2e import workers as w
from tests.support.distributed import run_distributed

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("scope", [KLClipScope.GLOBAL, KLClipScope.STAGE])
def test_streamed_run_skips_a_nan_step_and_resumes_exactly(tmp_path, scope: KLClipScope) -> None:
    """The helper's <P, G> joins the owner's KL-clip sum: each scope's nu as on one device (STALE: the planned runs of
    tests/e2e/test_pipefisher.py)."""
    case = w.Case("1f1b", 2, 2, 1, scope)
    results = run_distributed(w.streamed_resume_worker, 2, case, str(tmp_path / "ckpt"), timeout=600)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    first = results[0].value
    assert first["streaming"] is not None and first["streaming"].ranks == (1,), first["streaming"]
    assert all(r.value["skipped"] == 1 for r in results)
    period = max(t.period for t in first["layers"].values())
    want = w.reference_with_skip(case, first["layers"], first["steps"], period, first["stages"])
    covered: set[str] = set()
    for r in results:
        assert not w.compare(r.value["params"], want), f"rank {r.rank} differs from the single-device trainer"
        same = [n for n, p in r.value["params"].items() if torch.equal(p, r.value["resumed"][n])]
        assert len(same) == len(r.value["params"]), f"rank {r.rank}: the resumed run differs"
        covered |= set(r.value["params"])
    assert covered == set(want)


def test_two_helpers_share_the_streamed_layers_of_two_copies() -> None:
    """1F1B D=2 W=2: stage 0's copies (ranks 0, 1) hand every other streamed layer to rank 2 and the rest to rank 3;
    each helper sums the copies' gradients of its layers and returns them to both. Parameters equal the
    single-device trainer at the plan's timings to 1e-5."""
    case = w.Case("1f1b", 2, 2, 2)
    results = run_distributed(w.two_helpers_worker, 4, case, timeout=600)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    first = results[0].value
    assert first["streaming"].ranks == (2, 3), first["streaming"]
    want = w.reference_for_plan(case, first["layers"], first["steps"])
    covered: set[str] = set()
    for r in results:
        assert r.value["losses"] == first["losses"], f"rank {r.rank} reports other losses"
        bad = w.compare(r.value["params"], want)
        assert not bad, f"rank {r.rank}: {bad[:4]} differ from the single-device trainer by > 1e-5"
        covered |= set(r.value["params"])
    assert covered == set(want)


def test_streamed_layers_are_clipped_as_on_one_device() -> None:
    """`PipelineOptions.max_grad_norm` with stage 0's APPLY streamed to the other rank: the norm is taken from the
    owner's raw gradient before it is handed off, and the helper's preconditioned gradient is clipped at OPT_STEP
    like the rest; parameters equal the single-device trainer (clipping as `clip_grad_norm_`,
    tests/runtime/test_mixed_precision.py) at the plan's timings to 1e-5."""
    case = w.Case("1f1b", 2, 2, 1, max_grad_norm=0.05)
    results = run_distributed(w.streamed_worker, 2, case, timeout=600)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    first = results[0].value
    assert first["streaming"] is not None and first["streaming"].ranks == (1,), first["streaming"]
    want = w.reference_for_plan(case, first["layers"], first["steps"])
    unclipped = w.reference_for_plan(dataclasses.replace(case, max_grad_norm=None), first["layers"], first["steps"])
    assert w.compare(unclipped, want, atol=1e-4), "the clip changed nothing"
    covered: set[str] = set()
    for r in results:
        bad = w.compare(r.value["params"], want)
        assert not bad, f"rank {r.rank}: {bad[:4]} differ from the single-device trainer by > 1e-5"
        covered |= set(r.value["params"])
    assert covered == set(want)
