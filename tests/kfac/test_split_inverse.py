"""Split inverses (issue 14): Newton-Schulz against a float64 reference, fallbacks, blocks, config, family, trainer."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fxkfac
from fxkfac.config import KFACConfig, SplitInverse, SplitMethod
from fxkfac.errors import ConfigError, PipelineError
from fxkfac.kfac import Inverse, LayerState
from fxkfac.kfac.family import KFACFamily
from fxkfac.kfac.split_inverse import (
    Carry,
    Progress,
    block_bounds,
    carry_from_state,
    carry_to_state,
    damped,
    schulz_accepts,
    schulz_piece,
    schulz_start,
    split_invert_factor,
)
from fxkfac.planner.problem.ir import LayerTiming, Op, OpKind
from fxkfac.runtime.trainer import Trainer
from tests.kfac.helpers import layer_of
from tests.support.kfac_reference import KFACReference
from tests.support.models import mlp, mlp_batches

NS = SplitInverse(method=SplitMethod.NEWTON_SCHULZ, pieces=3, iterations=2, tolerance=1e-6)
SPLITS = [SplitInverse(pieces=2, iterations=2), SplitInverse(method=SplitMethod.BLOCKS, pieces=3)]


def _spd(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(d, 2 * d, generator=g, dtype=torch.float64)
    return m @ m.t() / (2 * d)


def _drifted(f: torch.Tensor, seed: int) -> torch.Tensor:
    """A running average one refresh later: 0.95 f + 0.05 f_new."""
    return 0.95 * f + 0.05 * _spd(f.shape[0], seed)


def _numpy_schulz(m: np.ndarray, x: np.ndarray, iterations: int) -> np.ndarray:
    """Reference: X <- X (2I - M X), float64, no checks."""
    for _ in range(iterations):
        x = x @ (2 * np.eye(len(m)) - m @ x)
    return x


def test_newton_schulz_pieces_equal_a_float64_reference_from_the_same_start() -> None:
    f, gamma = _spd(24, 0), 0.1
    start = torch.linalg.inv(damped(_drifted(f, 1), gamma))  # the previous refresh's inverse
    m = damped(f, gamma)
    progress = schulz_start(start, 24)
    for _ in range(2):  # 2 pieces of 2 iterations; tolerance 0 skips none
        assert progress is not None
        progress = schulz_piece(m, progress, 2, 0.0)
    assert progress is not None
    ref = _numpy_schulz(m.numpy(), start.numpy(), 4)
    np.testing.assert_allclose(progress.x.numpy(), ref, atol=1e-6 * np.abs(ref).max())
    assert progress.bound >= float(torch.linalg.matrix_norm(torch.eye(24, dtype=m.dtype) - m @ progress.x))


def test_accepted_newton_schulz_is_the_exact_inverse_within_its_tolerance() -> None:
    f, gamma = _spd(24, 0), 0.1
    previous = torch.linalg.inv(damped(_drifted(f, 1), gamma))
    out = split_invert_factor(f, gamma, NS, previous=previous)
    exact = torch.linalg.inv(damped(f, gamma))
    assert out is not None and out.inv is not None
    assert float(torch.linalg.matrix_norm(out.inv - exact, 2) / torch.linalg.matrix_norm(exact, 2)) <= NS.tolerance


@pytest.mark.parametrize("start", ["none", "indefinite", "too_far"])
def test_newton_schulz_falls_back_to_cholesky(start: str) -> None:
    f, gamma = _spd(16, 2), 0.1
    exact = torch.cholesky_inverse(torch.linalg.cholesky(damped(f, gamma)))
    previous = {
        "none": None,
        "indefinite": -torch.eye(16, dtype=f.dtype),
        "too_far": 5 * torch.linalg.inv(damped(f, gamma)),
    }[start]
    if previous is not None:  # the fallback is needed: the iteration itself diverges or stalls
        progress = schulz_start(previous, 16)
        for _ in range(NS.pieces):
            progress = progress and schulz_piece(damped(f, gamma), progress, NS.iterations, NS.tolerance)
        assert not schulz_accepts(progress, NS.tolerance)
    out = split_invert_factor(f, gamma, NS, previous=previous)
    assert out is not None and torch.equal(out.inv, exact)


def test_newton_schulz_stops_iterating_once_within_tolerance() -> None:
    f, gamma = _spd(8, 3), 0.1
    exact = torch.linalg.inv(damped(f, gamma))
    done = schulz_piece(damped(f, gamma), Progress(exact), 3, 1e-6)
    assert done is not None and done.x is exact and done.bound <= 1e-6


def test_block_bounds_cover_the_side_in_near_equal_blocks() -> None:
    assert block_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert block_bounds(2, 4) == [(0, 1), (1, 2)]


def test_blocks_are_per_block_cholesky_inverses() -> None:
    f, gamma = _spd(10, 4), 0.05
    out = split_invert_factor(f, gamma, SplitInverse(method=SplitMethod.BLOCKS, pieces=3), previous=None)
    assert out is not None and out.inv is not None
    expected = torch.zeros(10, 10, dtype=f.dtype)
    for lo, hi in [(0, 3), (3, 6), (6, 10)]:
        expected[lo:hi, lo:hi] = torch.linalg.inv(f[lo:hi, lo:hi] + gamma * torch.eye(hi - lo, dtype=f.dtype))
    torch.testing.assert_close(out.inv, expected, rtol=1e-10, atol=1e-12)


def test_a_block_that_cannot_be_inverted_fails_the_factor() -> None:
    f = torch.diag(torch.tensor([1.0, 1.0, -5.0, 1.0], dtype=torch.float64))
    split = SplitInverse(method=SplitMethod.BLOCKS, pieces=2)
    assert split_invert_factor(f, 1e-4, split, previous=None, max_retries=1) is None


def test_config_checks_the_split() -> None:
    assert KFACConfig(split_inverse=SplitInverse(method="blocks")).split_inverse.method is SplitMethod.BLOCKS
    for bad in (dict(pieces=0), dict(iterations=True), dict(tolerance=1.0), dict(method="lu")):
        with pytest.raises(ConfigError, match="SplitInverse"):
            SplitInverse(**bad)
    with pytest.raises(ConfigError, match="cholesky"):
        KFACConfig(inverse="eigen", split_inverse=SplitInverse())
    with pytest.raises(ConfigError, match="SplitInverse or None"):
        KFACConfig(split_inverse=2)  # type: ignore[arg-type]  # the wrong type is the point


def test_family_starts_newton_schulz_from_the_layers_latest_inverse() -> None:
    layer = layer_of(torch.nn.Linear(5, 3))
    state = LayerState(layer.a_dim, layer.b_dim)
    state.A, state.B = _spd(6, 5).float(), _spd(3, 6).float()
    family = KFACFamily(KFACConfig(damping=1e-2, split_inverse=NS))
    first = family.decompose(layer, state, "A")  # no inverse yet: Cholesky
    assert first is not None and first.inv is not None
    state.active = Inverse("cholesky", a_inv=first.inv, b_inv=torch.eye(3))
    state.A = _drifted(state.A.double(), 7).float()
    half = family.decompose(layer, state, "A")
    expected = split_invert_factor(state.A, 0.1, NS, previous=first.inv)
    assert half is not None and expected is not None and torch.equal(half.inv, expected.inv)
    assert not torch.equal(half.inv, torch.cholesky_inverse(torch.linalg.cholesky(damped(state.A, 0.1))))


@pytest.mark.parametrize("split", SPLITS, ids=["ns", "blocks"])
def test_family_pieces_run_apart_equal_decompose(split: SplitInverse) -> None:
    layer = layer_of(torch.nn.Linear(5, 3))
    state = LayerState(layer.a_dim, layer.b_dim)
    state.A, state.B = _spd(6, 5).float(), _spd(3, 6).float()
    family = KFACFamily(KFACConfig(damping=1e-2, split_inverse=split))
    state.active = Inverse(
        "cholesky", a_inv=torch.linalg.inv(damped(_drifted(state.A.double(), 8).float(), 0.1)), b_inv=torch.eye(3)
    )
    carry = None
    for index in range(split.pieces):
        carry = family.decompose_piece(layer, state, "A", index, carry)
    whole = family.decompose(layer, state, "A")
    assert family.decomp_pieces == split.pieces and whole is not None and torch.equal(carry.inv, whole.inv)
    with pytest.raises(ValueError, match=f"piece {split.pieces} of a decomposition made in {split.pieces}"):
        family.decompose_piece(layer, state, "A", split.pieces, carry)  # one past the last


@pytest.mark.parametrize("split", SPLITS, ids=["ns", "blocks"])
def test_single_device_trainer_equals_the_reference_with_split_inverses(
    split: SplitInverse, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = KFACConfig(damping=1e-2, factor_decay=0.9, split_inverse=split)
    batches = mlp_batches(4, seed=5)
    model, sgd = mlp(), (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    ref_model = copy.deepcopy(model)
    trainer = fxkfac.compile(
        model,
        None,
        example_inputs=(batches[0][0],),
        loss_fn=F.mse_loss,
        optimizer=sgd,
        preconditioner=cfg,
        backend=None,
    )
    ref = KFACReference(ref_model, trainer.units, cfg, F.mse_loss, 1, dict(trainer.timings), sgd)
    with caplog.at_level(logging.INFO, logger="fxkfac.kfac.split_inverse"):
        for t, (x, y) in enumerate(batches):
            trainer.step(x, y)
            ref.step(t, x, y)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(dict(trainer.named_parameters())[name], p, rtol=1e-4, atol=1e-6)
    fallbacks = sum("Cholesky instead" in r.message for r in caplog.records) // 2  # trainer and reference log
    if split.method is SplitMethod.BLOCKS:
        assert fallbacks == 0
    else:  # the first refresh has no start; later ones are (at least partly) Newton-Schulz, or the test is vacuous
        assert 2 * len(trainer.units) <= fallbacks < 2 * len(trainer.units) * len(batches)


def _pieces_across_steps(trainer: Trainer, order: tuple[int, ...] = (0, 1)) -> None:
    """Rewrite the one-device program: each DECOMP's piece order[0] at the refresh step, order[1] at the next step
    before its APPLY (the layers' use_offset is 1)."""
    refresh, after = trainer.spec.programs[0]
    decomps = [op for op in refresh if op.kind is OpKind.DECOMP]
    refresh[:] = [dataclasses.replace(op, piece=(order[0], 2)) if op.kind is OpKind.DECOMP else op for op in refresh]
    at = next(i for i, op in enumerate(after) if op.kind is OpKind.APPLY)
    after[at:at] = [dataclasses.replace(op, piece=(order[1], 2)) for op in decomps]


def _mlp_trainer(cfg: KFACConfig, batch: torch.Tensor) -> Trainer:
    timing = {name: LayerTiming(2, 0, 1, "fused") for name in ("0", "2", "4")}
    return fxkfac.compile(
        mlp(),
        None,
        example_inputs=(batch,),
        loss_fn=F.mse_loss,
        preconditioner=cfg,
        backend=None,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        layer_timing=timing,
    )


@pytest.mark.parametrize("split", SPLITS, ids=["ns", "blocks"])
def test_pieces_run_in_different_steps_equal_the_reference_and_survive_a_checkpoint(split: SplitInverse) -> None:
    cfg = KFACConfig(damping=1e-2, factor_decay=0.9, split_inverse=dataclasses.replace(split, pieces=2))
    batches = mlp_batches(5, seed=5)
    trainer = _mlp_trainer(cfg, batches[0][0])
    _pieces_across_steps(trainer)
    ref_model = mlp()
    ref = KFACReference(
        ref_model,
        trainer.units,
        cfg,
        F.mse_loss,
        1,
        dict(trainer.timings),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    )
    trainer.step(*batches[0])
    ref.step(0, *batches[0])
    saved = copy.deepcopy(trainer.state_dict())  # every layer's pieces are half done
    assert all(r["carries"] for q in saved["inflight"]["refreshes"].values() for r in q)
    resumed = _mlp_trainer(cfg, batches[0][0])
    _pieces_across_steps(resumed)
    resumed.load_state_dict(saved)
    for t, (x, y) in enumerate(batches[1:], start=1):
        trainer.step(x, y)
        resumed.step(x, y)
        ref.step(t, x, y)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(dict(trainer.named_parameters())[name], p, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(
            dict(resumed.named_parameters())[name], dict(trainer.named_parameters())[name], rtol=0, atol=0
        )


def test_pieces_out_of_order_or_of_another_count_are_plan_errors() -> None:
    batch = torch.randn(8, 12), torch.randn(8, 5)
    trainer = _mlp_trainer(KFACConfig(damping=1e-2, split_inverse=SplitInverse(pieces=2)), batch[0])
    _pieces_across_steps(trainer, order=(1, 0))
    with pytest.raises(PipelineError, match="runs piece 1 of A of 0 refreshed at step 0 after 0 of its pieces"):
        trainer.step(*batch)
    trainer.spec.programs[0][0][:] = [Op(OpKind.DECOMP, 0, layer="0", part="A", piece=(0, 3))]
    with pytest.raises(PipelineError, match="in 3 pieces, the kfac family makes it in 2"):
        trainer.step(*batch)


@pytest.mark.parametrize("carry", [None, Progress(torch.eye(2), math.inf, 0.5), (torch.eye(2), torch.ones(1, 1))])
def test_carries_round_trip_through_a_checkpoint_state(carry: Carry) -> None:
    back = carry_from_state(copy.deepcopy(carry_to_state(carry)))
    if isinstance(carry, Progress):
        assert isinstance(back, Progress) and torch.equal(back.x, carry.x)
        assert (back.measured, back.bound) == (carry.measured, carry.bound)
    else:
        assert back == carry if carry is None else all(torch.equal(a, b) for a, b in zip(back, carry, strict=True))
    with pytest.raises(ValueError, match="malformed"):
        carry_from_state({"x": 1})
