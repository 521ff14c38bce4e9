"""The README's save-and-relaunch: the same plan="auto" script launched twice continues bit for bit, the second
launch adopting the checkpoint's plan without profiling (`compile(resume_from=...)`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxkfac
from fxkfac.reshard import replanned
from tests.runtime.relaunch_workers import SAVE_AT, training_script
from tests.support import models
from tests.support.distributed import run_distributed


def _launch(ckpt: str) -> list[dict]:
    results = run_distributed(training_script, 2, ckpt, timeout=300)
    failures = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failures, "\n".join(failures)
    return [r.value for r in results]


@pytest.mark.multiproc
def test_relaunched_script_adopts_the_checkpoint_plan_and_continues_bit_for_bit(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    uninterrupted = _launch(ckpt)  # trains every step, saving after step SAVE_AT on the way
    resumed = _launch(ckpt)
    assert [r["started"] for r in uninterrupted] == [0, 0]
    assert [r["started"] for r in resumed] == [SAVE_AT, SAVE_AT]
    for first, second in zip(uninterrupted, resumed, strict=True):
        assert first["params"].keys() == second["params"].keys()
        assert all(torch.equal(p, second["params"][n]) for n, p in first["params"].items())
    assert any("profiling" in m for m in uninterrupted[0]["shown"])
    assert not any("profiling" in m or "measuring" in m or "solving" in m for m in resumed[0]["shown"])
    assert any("adopting the plan checkpoint" in m for m in resumed[0]["shown"])


def test_one_device_script_resumes_from_its_checkpoint_and_starts_afresh_without_one(tmp_path: Path) -> None:
    batches = models.mlp_batches(4)

    def script(ckpt: Path | None, until: int) -> fxkfac.Trainer:
        trainer = fxkfac.compile(
            models.mlp(), None, example_inputs=(batches[0][0],), loss_fn=F.mse_loss, backend=None, resume_from=ckpt
        )
        for x, y in batches[trainer.steps : until]:
            trainer.step(x, y)
        if ckpt is not None:
            trainer.save_checkpoint(ckpt)
        return trainer

    ckpt = tmp_path / "ckpt"
    assert script(ckpt, 2).steps == 2  # nothing to resume from: a fresh start
    resumed, uninterrupted = script(ckpt, 4), script(None, 4)
    assert resumed.steps == 4
    mine = dict(uninterrupted.named_parameters())
    assert all(torch.equal(p, mine[n]) for n, p in resumed.named_parameters())


def test_a_load_counts_as_replanned_when_only_the_plan_differs() -> None:
    """What makes a refused load say to pass resume_from: the same layout under another plan (plan="auto" again)."""
    run = {
        "mesh": [2, 1],
        "schedule": "1f1b",
        "microbatches": 2,
        "virtual_stages": 1,
        "global_batch": 8,
        "stages": [["0.weight"], ["2.weight"]],
        "graph": "g",
        "plan": "g#1",
        "timings": {"0": [2, 0, 1, "deferred"]},
        "programs": "a",
    }
    again = {**run, "plan": "g#2", "timings": {"0": [3, 0, 1, "deferred"]}, "programs": "b"}
    assert replanned(run, again)
    assert not replanned(run, run)
    assert not replanned(run, {**again, "mesh": [1, 2]})
