"""Activation checkpointing: pipelined training whose stages recompute their forward equals one device (2 ranks,
GPipe and 1F1B, plain AdamW and K-FAC), and plan="auto" under a budget that needs it recomputes and trains so."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fxkfac
from fxkfac.config import PipelineOptions
from fxkfac.errors import ConfigError
from tests.e2e import workers as e2e
from tests.runtime import recompute_workers as rw
from tests.runtime import workers as rt
from tests.support import models
from tests.support.distributed import run_distributed

PLAIN = [rt.Config("gpipe", 2, 2, 1, "gpt2", "adamw"), rt.Config("1f1b", 2, 4, 1, "mlp", "adamw")]
KFAC = [e2e.Case("gpipe", 2, 2, 1), e2e.Case("1f1b", 2, 2, 1)]
AUTO = e2e.Case("1f1b", 2, 2, 1)


@pytest.mark.multiproc
def test_recomputing_stages_train_as_one_device() -> None:
    budget = rw.auto_budget_of(AUTO)
    results = run_distributed(rw.checkpointed_worker, 2, PLAIN, KFAC, [(AUTO, budget)], timeout=600)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for i, cfg in enumerate(PLAIN):
        want, want_losses = rt.reference_run(cfg)
        for r in results:
            params, losses, calls = r.value["plain"][i]
            assert calls == cfg.N * rt.STEPS, f"{cfg} rank {r.rank}: {calls} checkpointed forwards"
            assert losses == pytest.approx(want_losses, abs=1e-5), cfg
            assert not e2e.compare(params, want), f"{cfg} rank {r.rank} differs from one device by > 1e-5"
    for i, case in enumerate(KFAC):
        want = e2e.reference_params(case, e2e.timings_for(e2e._names_for(case)))
        for r in results:
            params, _, calls = r.value["kfac"][i]
            assert calls == case.N * e2e.STEPS, f"{case} rank {r.rank}: {calls} checkpointed forwards"
            bad = e2e.compare(params, want)
            assert not bad, f"{case} rank {r.rank}: {bad[:4]} differ from the single-device trainer by > 1e-5"
    (_, _, _, recompute, layers, steps) = results[0].value["auto"][0]
    assert recompute == (0,), "1F1B keeps two micro-batches in flight on rank 0, one on rank 1: stage 0 recomputes"
    want = e2e.reference_for_plan(AUTO, layers, steps)
    for r in results:
        params, _, calls, got, _, _ = r.value["auto"][0]
        assert got == recompute
        assert calls == (AUTO.N * steps if r.rank == 0 else 0), f"rank {r.rank}: {calls} checkpointed forwards"
        bad = e2e.compare(params, want)
        assert not bad, f"auto rank {r.rank}: {bad[:4]} differ from the single-device trainer by > 1e-5"


def test_a_recomputing_stage_runs_its_forward_again_and_keeps_the_gradients() -> None:
    """One device, preconditioner=None: the stage function runs twice per micro-batch, and the parameters equal a run
    that keeps its activations."""
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    out = {}
    for stages in ((), (0,)):
        trainer = fxkfac.compile(
            models.mlp(),
            None,
            example_inputs=(x,),
            loss_fn=torch.nn.functional.cross_entropy,
            preconditioner=None,
            microbatches=2,
            backend=None,
            pipeline=PipelineOptions(activation_checkpointing=stages or "off"),
        )
        calls = [0]
        trainer.runners[(0, 0)].module.register_forward_pre_hook(
            lambda *_, calls=calls: calls.__setitem__(0, calls[0] + 1)
        )
        trainer.step((x,), y)
        out[stages] = (calls[0], {n: p.detach().clone() for n, p in trainer.named_parameters()})
    assert out[()][0] == 2 and out[(0,)][0] == 4
    assert all(torch.equal(p, out[(0,)][1][n]) for n, p in out[()][1].items())


@pytest.mark.parametrize(
    ("checkpointing", "match"),
    [((1,), "stages \\[1\\], but the run has stages 0..0"), ("auto", "chosen by the planner")],
)
def test_refused_where_the_run_cannot_recompute_so(checkpointing: Any, match: str) -> None:
    x = torch.randn(8, 12)
    with pytest.raises(ConfigError, match=match):
        fxkfac.compile(
            models.mlp(),
            None,
            example_inputs=(x,),
            loss_fn=torch.nn.functional.cross_entropy,
            preconditioner=None,
            backend=None,
            pipeline=PipelineOptions(activation_checkpointing=checkpointing),
        )
