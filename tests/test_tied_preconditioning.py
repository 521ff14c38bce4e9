"""Tied weights under every family: default-config GPT-2 (wte tied to lm_head, on the first and the last stage)
pipelined over 2 ranks (1F1B, GPipe, and Chimera, which holds two copies of each stage). Shampoo and SOAP
precondition the tied weight once, on its owner stage (the first, planner/problem/costs.py), and send the direction to
the other copies: the run equals one device to 1e-5 and every copy of the tied weight is equal after every step. K-FAC,
which leaves the tied weight to the base optimizer, still equals one device. plan="auto" places the tied weight's
work once, on its owner; its state is saved once, by the owner, and resumes on the pipeline and on one device."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import fxkfac
from fxkfac.compile_api import prepare
from fxkfac.config import KFACConfig, PipelineOptions, PlanOptions
from fxkfac.planner.problem.ir import LayerTiming
from fxkfac.planner.problem.schedules import ScheduleKind
from fxkfac.shampoo import GraftType, ShampooConfig, ShampooFamily, SOAPConfig
from tests.support.distributed import run_distributed
from tests.support.models import SEQ, VOCAB, token_batch

TIED = "transformer.wte.weight"
N, STEPS, BATCH = 2, 4, 4
EPS = 1e-6
"""The Adam epsilons: attention key biases have a mathematically zero gradient (softmax is shift-invariant), so theirs
is rounding noise that no two summation orders reproduce; Adam's default 1e-8 would make it updates of O(lr)."""
SHAMPOO = ShampooConfig(
    precondition_frequency=2,
    max_preconditioner_dim=8,
    grafting_type=GraftType.ADAM,
    betas=(0.9, 0.99),
    epsilon=1e-4,
    grafting_epsilon=EPS,
    momentum=0.5,
    preconditioner_dtype="float64",
)
SOAP = SOAPConfig(precondition_frequency=2, max_preconditioner_dim=8, epsilon=EPS, preconditioner_dtype="float64")
FAMILIES: dict[str, Any] = {"shampoo": SHAMPOO, "soap": SOAP, "kfac": KFACConfig(damping=1e-2)}
LR = {"shampoo": 0.01, "soap": 0.01, "kfac": 0.05}


def gpt2(seed: int = 0) -> torch.nn.Module:
    """GPT2LMHeadModel with GPT2Config's defaults (tie_word_embeddings=True, dropout 0.1 off by eval) at tiny sizes;
    n_positions is the sequence length, so that no row of wpe has a zero gradient (SOAP's eigenbasis of a rank-
    deficient statistic is arbitrary in its null space, which rounding noise then picks)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config).eval()


def _batches() -> list[tuple[Tensor, Tensor]]:
    return [token_batch(BATCH, seed=step) for step in range(STEPS)]


def _loss(out: Any, y: Tensor) -> Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _timings(family: str) -> dict[str, LayerTiming] | None:
    """The tied weight's roots are used a step after their refresh (a planned run's staleness); the rest at once."""
    return {TIED: LayerTiming(2, 0, 1, "fused")} if family != "kfac" else None


def _compile(
    family: str, mesh: tuple[int, int] | None, plan: Any = None, *, seed: int = 0, **kw: Any
) -> fxkfac.Trainer:
    return fxkfac.compile(
        gpt2(seed),
        mesh,
        plan,
        example_inputs=(_batches()[0][0],),
        loss_fn=_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR[family]),
        backend=None,
        microbatches=N,
        preconditioner=FAMILIES[family],
        pipeline=PipelineOptions(timeout=120.0),
        **kw,
    )


def _one_device(family: str, timings: dict[str, LayerTiming] | None) -> dict[str, Tensor]:
    trainer = _compile(family, None, layer_timing=timings)
    for x, y in _batches():
        trainer.step(x, y)
    return {n: p.detach().clone() for n, p in trainer.named_parameters()}


def _tied_copies(trainer: fxkfac.Trainer) -> list[Tensor]:
    """This rank's copies of the tied weight, one per local stage that uses it."""
    return [r.param(TIED).detach().clone() for r in trainer.runners.values() if TIED in r.graph.params]


def _run(trainer: fxkfac.Trainer) -> dict[str, Any]:
    """Train STEPS steps; this rank's parameters and its copies of the tied weight after every step."""
    tied = []
    for x, y in _batches():
        trainer.step(x, y)
        tied.append(_tied_copies(trainer))
    return {"params": {n: copy.deepcopy(p.detach()) for n, p in trainer.named_parameters()}, "tied": tied}


@pytest.mark.parametrize("kind,v", [(ScheduleKind.ONE_F_ONE_B, 1), (ScheduleKind.INTERLEAVED, 2)])
def test_a_tied_parameter_is_a_unit_of_its_lowest_stage_alone(kind: ScheduleKind, v: int) -> None:
    prepared = prepare(gpt2(), (_batches()[0][0],), ShampooFamily(SHAMPOO), kind=kind, D=2, W=1, N=2, v=v)
    stages = prepared.split.shared_params[TIED]
    assert stages == (0, 2 * v - 1), "wte on the first stage, lm_head on the last"
    assert [s for s, names in prepared.stage_layers.items() if TIED in names] == [0]
    everything = sorted(n for names in prepared.stage_layers.values() for n in names)
    assert everything == sorted(u.name for u in prepared.units), "every unit on exactly one stage"


def _pipelined_worker(rank: int, world: int, cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    out = []
    for family, schedule in cases:
        out.append(_run(_compile(family, (2, 1), schedule=schedule, layer_timing=_timings(family))))
        dist.barrier()
    return out


def _assert_tied_equal_on_both_stages(results: list, index: int | None = None) -> None:
    """Every step, every copy of the tied weight (one per stage on each rank that uses it) is bit for bit equal."""
    values = [r.value if index is None else r.value[index] for r in results]
    assert all(v["tied"][0] for v in values), "the tied weight must be on both ranks (first and last stage)"
    for step in range(STEPS):
        copies = [t for v in values for t in v["tied"][step]]
        assert all(torch.equal(t, copies[0]) for t in copies), f"tied copies differ after step {step}"


def _assert_equal(results: list, want: dict[str, Tensor], label: str, index: int | None = None) -> None:
    start = dict(gpt2().named_parameters())
    assert float((want[TIED] - start[TIED].detach()).abs().max()) > 1e-4, f"{label}: the tied weight did not move"
    for r in results:
        params = r.value["params"] if index is None else r.value[index]["params"]
        assert TIED in params or r.rank == 1
        for name, p in params.items():
            torch.testing.assert_close(
                p, want[name], rtol=0, atol=1e-5, msg=lambda m, n=name, k=r.rank: f"{label} rank {k} {n}: {m}"
            )


@pytest.mark.multiproc
def test_tied_gpt2_pipelined_equals_one_device_for_every_family() -> None:
    cases = [("shampoo", "1f1b"), ("soap", "1f1b"), ("shampoo", "gpipe"), ("soap", "chimera"), ("kfac", "1f1b")]
    results = run_distributed(_pipelined_worker, 2, cases, timeout=600)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    for i, (family, schedule) in enumerate(cases):
        _assert_tied_equal_on_both_stages(results, i)
        _assert_equal(results, _one_device(family, _timings(family)), f"{family} {schedule}", i)


def _planned_worker(rank: int, world: int) -> dict[str, Any]:
    trainer = _compile("shampoo", (2, 1), "auto", schedule="1f1b", plan_options=PlanOptions(time_limit_s=3.0))
    out = _run(trainer)
    assert trainer.plan is not None
    out["plan"] = trainer.plan
    return out


@pytest.mark.multiproc
def test_planned_tied_weight_is_one_task_on_its_owner_stage() -> None:
    results = run_distributed(_planned_worker, 2, timeout=600)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    plan = results[0].value["plan"]
    owners = [i for i, s in enumerate(plan.problem.costs.stages) if TIED in {layer.name for layer in s.layers}]
    assert owners == [0], f"the tied weight must be costed once, on stage 0, not on stages {owners}"
    tied_ops = [p for p in plan.placements if p.op.layer == TIED]
    assert tied_ops, "the plan places no work of the tied weight"
    assert {(p.op.stage, p.device) for p in tied_ops} == {(0, 0)}, tied_ops
    on_rank1 = [op for program in plan.programs[1] for op in program if op.layer == TIED]
    assert not on_rank1, f"rank 1 runs work of the tied weight: {on_rank1}"
    _assert_tied_equal_on_both_stages(results)
    _assert_equal(results, _one_device("shampoo", dict(plan.layers)), "shampoo planned")


def _checkpoint_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    """SOAP pipelined: saved after 2 steps, loaded into a fresh trainer (another init), both run on in lockstep."""
    batches, timings = _batches(), _timings("soap")
    a = _compile("soap", (2, 1), schedule="1f1b", layer_timing=timings)
    for x, y in batches[:2]:
        a.step(x, y)
    a.save_checkpoint(path)
    b = _compile("soap", (2, 1), schedule="1f1b", layer_timing=timings, seed=5)
    b.load_checkpoint(path)
    for x, y in batches[2:]:
        a.step(x, y)
        b.step(x, y)
    differ = [
        n for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True) if not torch.equal(p, q)
    ]
    return {"differ": differ, "holds_state": TIED in a.layer_states, "tied": _tied_copies(b)}


@pytest.mark.multiproc
def test_tied_state_is_saved_once_by_its_owner_and_resumes_on_the_pipeline_and_on_one_device(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    results = run_distributed(_checkpoint_worker, 2, path, timeout=600)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    assert [r.value["holds_state"] for r in results] == [True, False], "the owner (rank 0) alone holds the state"
    assert all(not r.value["differ"] for r in results), [(r.rank, r.value["differ"]) for r in results]
    assert torch.equal(results[0].value["tied"][0], results[1].value["tied"][0])
    single = _compile("soap", None, layer_timing=_timings("soap"), seed=5)
    single.load_checkpoint(path)  # resharded: the owner's state of the tied weight, the stages' parameters
    for x, y in _batches()[2:]:
        single.step(x, y)
    want = _one_device("soap", _timings("soap"))
    for name, p in single.named_parameters():
        torch.testing.assert_close(p.detach(), want[name], rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
