"""KLClipScope: each scope's nu against a hand-written float64 formula, and pipelined runs (2 stages over gloo)
equal to one device with the same scope."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fxkfac
from fxkfac.config import KFACConfig, KLClipScope, PipelineOptions
from tests.support import models
from tests.support.distributed import run_distributed

LR, KAPPA, STEPS = 0.5, 1e-4, 3


def _kfac(scope: KLClipScope) -> KFACConfig:
    return KFACConfig(damping=1e-2, kl_clip=KAPPA, kl_clip_scope=scope)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 12, generator=gen), torch.randint(0, 5, (8,), generator=gen)) for _ in range(STEPS)]


def _trainer(scope: KLClipScope, mesh, stages: dict[str, int] | None = None):
    """An MLP trainer (SGD, lr LR); `stages` gives one device the KL-clip groups of a pipelined run's stages."""
    data = _batches()
    trainer = fxkfac.compile(
        models.mlp(),
        mesh,
        None,
        example_inputs=(data[0][0],),
        loss_fn=F.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=LR),
        preconditioner=_kfac(scope),
        microbatches=2,
        backend=None,
        pipeline=PipelineOptions(timeout=60.0),
    )
    if stages is not None:
        trainer.preconditioning.clip_groups = dict(stages)
        trainer.preconditioning.step_end.groups = 1 + max(stages.values())
    return trainer


def _reference_nu(dot: float) -> float:
    """kl_clip_scale by hand, in float64."""
    return min(1.0, math.sqrt(KAPPA / (LR * LR * dot)))


def _spy(trainer) -> tuple[list[list[tuple[tuple[str, ...], float]]], list[list[tuple[tuple[str, ...], float]]]]:
    """Record, per step, each precondition call's (layers, <P, G>) and each scale call's (layers, nu)."""
    family = trainer.preconditioning.family
    dots: list[list] = []
    nus: list[list] = []
    precondition, scale = family.precondition, family.scale

    def spy_precondition(layers, grads, states, params):
        dot = precondition(layers, grads, states, params)
        dots[-1].append((tuple(layer.name for layer in layers), float(dot)))
        return dot

    def spy_scale(layers, grads, nu):
        nus[-1].append((tuple(layer.name for layer in layers), nu))
        scale(layers, grads, nu)

    family.precondition, family.scale = spy_precondition, spy_scale
    return dots, nus


def test_stage_and_stale_nu_follow_the_formulas() -> None:
    """STAGE: each group's nu from its own layers' sum; STALE: the last step's total sum (step 0: its own)."""
    for scope in (KLClipScope.STAGE, KLClipScope.STALE):
        trainer = _trainer(scope, None)
        names = sorted(trainer.layer_states)
        trainer_groups = {n: i % 2 for i, n in enumerate(names)}
        if scope is KLClipScope.STAGE:
            trainer.preconditioning.clip_groups = trainer_groups
            trainer.preconditioning.step_end.groups = 2
        dots, nus = _spy(trainer)
        for x, y in _batches():
            dots.append([])
            nus.append([])
            trainer.step((x,), y)
        clipped = [nu for step in nus for _, nu in step if nu < 1]
        assert clipped, f"{scope}: kappa {KAPPA} clips nothing, the test checks nothing"
        for t in range(STEPS):
            if scope is KLClipScope.STAGE:
                for layers, nu in nus[t]:
                    group = {trainer_groups[n] for n in layers}
                    assert len(group) == 1, f"scale mixes KL-clip groups: {layers}"
                    dot = sum(d for ls, d in dots[t] if {trainer_groups[n] for n in ls} == group)
                    assert nu == pytest.approx(_reference_nu(dot), rel=1e-12)
            else:
                dot = sum(d for _, d in dots[max(t - 1, 0)])
                assert all(nu == pytest.approx(_reference_nu(dot), rel=1e-12) for _, nu in nus[t]), t


def _pipelined(rank: int, world: int, scopes: list[KLClipScope]) -> list[dict]:
    """Each scope on 1F1B, 2 stages: parameters, losses (read as floats) and each layer's stage."""
    out = []
    for scope in scopes:
        trainer = _trainer(scope, (2, 1))
        losses = [float(trainer.step((x,), y)) for x, y in _batches()]
        out.append(
            {
                "params": {n: p.detach().clone() for n, p in trainer.named_parameters()},
                "losses": losses,
                "stages": {n: s for s, names in trainer.spec.stage_units.items() for n in names},
            }
        )
    return out


@pytest.mark.multiproc
def test_pipelined_equals_one_device_for_every_scope() -> None:
    scopes = list(KLClipScope)
    results = run_distributed(_pipelined, 2, scopes, timeout=300)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    finals = {}
    for i, scope in enumerate(scopes):
        stages = results[0].value[i]["stages"]
        reference = _trainer(scope, None, stages if scope is KLClipScope.STAGE else None)
        losses = [float(reference.step((x,), y)) for x, y in _batches()]
        want = {n: p.detach() for n, p in reference.named_parameters()}
        finals[scope] = want
        assert len(set(stages.values())) == 2, f"both stages hold K-FAC layers: {stages}"
        for r in results:
            run = r.value[i]
            assert run["losses"] == pytest.approx(losses, abs=1e-6), f"{scope} rank {r.rank}"
            for name, value in run["params"].items():
                torch.testing.assert_close(
                    value, want[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name, s=scope: f"{s} {n}: {m}"
                )
    for scope in (KLClipScope.STAGE, KLClipScope.STALE):
        moved = max(float((finals[scope][n] - finals[KLClipScope.GLOBAL][n]).abs().max()) for n in finals[scope])
        assert moved > 1e-4, f"{scope} trains as GLOBAL does: the equality above cannot tell the scopes apart"


def test_a_deferred_loss_reads_as_its_sum() -> None:
    """Under STAGE and STALE a step returns a StepLoss: every way a training loop reads a float waits for the sum."""
    import pickle

    from fxkfac.runtime.step_end import StepLoss

    class Summed:
        def wait(self) -> torch.Tensor:
            return torch.tensor(2.5)

    loss = StepLoss(Summed())  # type: ignore[arg-type]  # a Pending's wait() alone is read
    assert float(loss) == 2.5 and f"{loss:.2f}" == "2.50" and repr(loss) == "2.5"
    assert loss == 2.5 and loss < 3 and loss <= 2.5 and loss > 2 and loss >= 2.5 and not loss > 2.5
    assert 1 + loss == 3.5 and loss - 1 == 1.5 and 3 - loss == 0.5 and 2 * loss == 5.0 and loss / 5 == 0.5
    assert -loss == -2.5 and abs(loss) == 2.5 and min([3.0, loss]) == 2.5 and pickle.loads(pickle.dumps(loss)) == 2.5
