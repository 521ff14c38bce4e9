"""`Trainer.evaluate`: the pipelined forward in eval mode equals the eager model's eval() loss, and leaves training as
if it had not run (state bit for bit, the RNG, the next steps).

One 4-rank launch (process start-up dominates): every schedule at D=2 with two data-parallel replicas, K-FAC on the
critical path refreshing every 2 steps, a model whose dropout makes train and eval losses differ.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxkfac
from tests.runtime.evaluate_workers import EvalConfig, dropout_mlp, evaluate_worker
from tests.support.distributed import run_distributed

CONFIGS = [
    EvalConfig("gpipe", 2, 2, 2),
    EvalConfig("1f1b", 2, 4, 2),
    EvalConfig("interleaved", 2, 2, 2, v=2),
    EvalConfig("chimera", 2, 2, 2),
]


@pytest.mark.multiproc
def test_evaluate_equals_the_eager_eval_loss_and_leaves_training_untouched() -> None:
    results = run_distributed(evaluate_worker, 4, CONFIGS, timeout=400)
    failures = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failures, "\n".join(failures)
    for i, cfg in enumerate(CONFIGS):
        for r in results:
            got = r.value[i]
            assert got["losses"][0] == got["losses"][1], (cfg, r.rank)  # eval mode: no random mask
            assert got["losses"][0] == pytest.approx(got["reference"], rel=1e-6, abs=1e-7), (cfg, r.rank)
            assert got["changed"] == [], (cfg, r.rank, got["changed"])
            assert got["differ"] == [], (cfg, r.rank, got["differ"])
        assert len({r.value[i]["losses"][0] for r in results}) == 1, cfg  # the same on every rank


def test_compiled_stage_evaluates_in_eval_mode() -> None:
    """One device, inductor: the eval graph is compiled on the first evaluate and equals the eager eval() loss."""
    model, g = dropout_mlp(), torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
    trainer = fxkfac.compile(
        model, None, example_inputs=(x,), loss_fn=F.cross_entropy, preconditioner=None, backend="inductor"
    )
    trainer.step(x, y)
    got = trainer.evaluate(x, y)
    with torch.no_grad():
        want = float(F.cross_entropy(model.eval()(x), y))
    assert got == trainer.evaluate(x, y)
    assert abs(got - want) <= 1e-6 * abs(want)
