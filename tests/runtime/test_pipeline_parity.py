"""Pipelined training equals single-process training: parameters after 3 optimizer steps, to 1e-5.

Coverage (batched into one launch per world size, since process start-up dominates):
- MLP: the full cross product schedule {gpipe, 1f1b, interleaved (v=2), chimera} x D {2, 4}
  x N {D, 2D} x W {1, 2} x optimizer {SGD, AdamW} (64 runs; interleaved uses a 12-block MLP so
  that v*D stages exist).
- BERT (BertForMaskedLM, tied word embeddings/decoder) and GPT-2 (tied wte/lm_head):
  every schedule at D=2 (N=2, W=1, mixed optimizers), plus 1F1B and Chimera at D=2, W=2 and
  GPipe at D=4 (BERT, 4 layers would be needed for interleaved at D=4: not covered).
- Steps ended by each agreement set without a world barrier (`StepAgreement.COPIES`): GPipe, 1F1B and Chimera
  at D=2 (BERT's and GPT-2's tied weights join the first and last stages into one set), and 1F1B at D=2, W=2 (two
  sets, the copies of each stage).
The step losses every rank reports equal the single process's to 1e-5.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fxkfac.config import StepAgreement
from tests.runtime.workers import Config, parity_worker, reference_run
from tests.support.distributed import run_distributed

pytestmark = pytest.mark.multiproc

SCHEDULES = ("gpipe", "1f1b", "interleaved", "chimera")


def _mlp_configs(D: int, W: int) -> list[Config]:
    out = []
    for schedule, N, opt in itertools.product(SCHEDULES, (D, 2 * D), ("sgd", "adamw")):
        interleaved = schedule == "interleaved"
        out.append(Config(schedule, D, N, W, "mlp6" if interleaved else "mlp", opt, v=2 if interleaved else 1))
    return out


HF_CONFIGS = {
    2: [
        Config(s, 2, 2, 1, m, o, v=2 if s == "interleaved" else 1)
        for (s, m, o) in [
            ("gpipe", "bert", "adamw"),
            ("1f1b", "gpt2", "adamw"),
            ("chimera", "bert", "sgd"),
            ("chimera", "gpt2", "adamw"),
            ("1f1b", "bert", "sgd"),
            ("gpipe", "gpt2", "sgd"),
        ]
    ],
    4: [
        Config("1f1b", 2, 4, 2, "bert", "adamw"),
        Config("chimera", 2, 2, 2, "gpt2", "adamw"),
        Config("gpipe", 4, 4, 1, "gpt2", "sgd"),
    ],
    8: [],
}

COPIES = StepAgreement.COPIES
AGREEMENT_CONFIGS = {
    2: [
        Config("1f1b", 2, 4, 1, "mlp", "sgd", agreement=COPIES),
        Config("gpipe", 2, 2, 1, "gpt2", "adamw", agreement=COPIES),
        Config("chimera", 2, 2, 1, "bert", "sgd", agreement=COPIES),
    ],
    4: [Config("1f1b", 2, 4, 2, "mlp", "adamw", agreement=COPIES)],
}

WORLDS = {
    2: _mlp_configs(2, 1) + HF_CONFIGS[2] + AGREEMENT_CONFIGS[2],
    4: _mlp_configs(4, 1) + _mlp_configs(2, 2) + HF_CONFIGS[4] + AGREEMENT_CONFIGS[4],
    8: _mlp_configs(4, 2),
}


def _check(configs: list[Config], world: int) -> None:
    results = run_distributed(parity_worker, world, configs, timeout=400)
    failures = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failures, "\n".join(failures)
    for index, cfg in enumerate(configs):
        reference, reference_losses = reference_run(cfg)
        covered: set[str] = set()
        losses = {tuple(r.value[index]["losses"]) for r in results}
        assert len(losses) == 1, f"{cfg}: ranks disagree on the step losses {losses}"
        torch.testing.assert_close(
            list(losses.pop()), reference_losses, rtol=1e-5, atol=1e-5, msg=lambda m, c=cfg: f"{c} step losses: {m}"
        )
        for r in results:
            run = r.value[index]
            barrier_free = cfg.agreement is StepAgreement.COPIES
            assert run["summed_in_flight"] == [barrier_free] * len(run["losses"]), (
                f"{cfg}: a step {'ended with' if barrier_free else 'without'} a world sum of the loss"
            )
            for name, value in run["params"].items():
                torch.testing.assert_close(
                    value,
                    reference[name],
                    rtol=1e-5,
                    atol=1e-5,
                    msg=lambda m, n=name, c=cfg, k=r.rank: f"{c} rank {k} {n}: {m}",
                )
                covered.add(name)
        expected = {run["aliases"].get(n, n) for n in reference}
        assert covered == expected, f"{cfg}: parameters no rank reported: {expected - covered}"


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_pipelined_params_equal_single_process(world: int) -> None:
    _check(WORLDS[world], world)
