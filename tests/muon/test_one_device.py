"""Muon on one device equals torch.optim.Muon on the hidden matrices (and torch.optim.AdamW on the other parameters)
to 1e-5, step for step, for each option both have; its Newton-Schulz equals torch's bit for bit, whole or in pieces.

Step for step: each step starts both from fxkfac's parameters (the optimizers' states each evolve on their own), with
one micro-batch as torch's reference takes the step's gradient in one backward. Newton-Schulz runs in bfloat16 (as
torch's does): fxkfac's step W - lr (lambda W + s O) rounds off torch's W (1 - lr lambda) - lr s O by float32's
rounding, and over later steps such a difference would round some bfloat16 input to the next bfloat16 number (a
2**-8 relative step: 4.5e-5 on a weight at lr 0.02), which is the precision torch.optim.Muon itself has, not a
difference of semantics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.optim._muon import _zeropower_via_newtonschulz

import fxkfac
from fxkfac.muon import LrAdjust, MuonConfig, UnitKind
from fxkfac.muon.family import MuonFamily, MuonUnit, lr_scale
from fxkfac.muon.newton_schulz import iterations_of_piece, ns_end, ns_iterate, ns_start, orthogonalize
from fxkfac.planner.problem.ir import Op, OpKind
from tests.muon.support import (
    LR,
    MATRICES,
    STEPS,
    edited_programs,
    llama_batches,
    llama_loss,
    replace_apply,
    sgd,
    train,
)
from tests.support.models import mlp, mlp_batches, tiny_llama


def _compiled(cfg: MuonConfig) -> fxkfac.Trainer:
    return fxkfac.compile(
        mlp(),
        None,
        None,
        example_inputs=(mlp_batches(1)[0][0],),
        loss_fn=F.mse_loss,
        optimizer=sgd,
        backend=None,
        microbatches=1,
        preconditioner=cfg,
    )


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("ns_steps", [5, 2])
@pytest.mark.parametrize("adjust", [LrAdjust.ORIGINAL, LrAdjust.MATCH_RMS_ADAMW])
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_one_device_equals_torch_muon_step_for_step(
    nesterov: bool, ns_steps: int, adjust: LrAdjust, weight_decay: float
) -> None:
    cfg = MuonConfig(nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust, weight_decay=weight_decay, momentum=0.9)
    trainer = _compiled(cfg)
    assert {u.name for u in trainer.units if u.kind is UnitKind.MATRIX} == set(MATRICES)
    ref = mlp()
    muon = torch.optim.Muon(
        [p for n, p in ref.named_parameters() if n in MATRICES],
        lr=LR,
        weight_decay=weight_decay,
        momentum=0.9,
        nesterov=nesterov,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust.value,
    )
    adamw = torch.optim.AdamW([p for n, p in ref.named_parameters() if n not in MATRICES], lr=LR)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for step, (x, y) in enumerate(mlp_batches(STEPS)):
        with torch.no_grad():
            for (_, got), want in zip(trainer.named_parameters(), ref.parameters(), strict=True):
                want.copy_(got)
        trainer.step(x, y)
        muon.zero_grad()
        adamw.zero_grad()
        F.mse_loss(ref(x), y).backward()
        muon.step()
        adamw.step()
        for (name, got), want in zip(trainer.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"step {step} {name}")
    for name in MATRICES:
        assert float((start[name] - dict(ref.named_parameters())[name]).detach().abs().max()) > 1e-2, "nothing moved"


@pytest.mark.parametrize("shape", [(6, 9), (9, 6), (7, 7)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_newton_schulz_equals_torch_and_its_pieces_equal_the_whole(shape: tuple[int, int], dtype: torch.dtype) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    coefficients, eps = (3.4445, -4.775, 2.0315), 1e-7
    whole = orthogonalize(g, coefficients, 5, eps, dtype)
    if dtype is torch.bfloat16:
        assert torch.equal(whole, _zeropower_via_newtonschulz(g, coefficients, 5, eps))
    for pieces in (2, 3, 5, 7):
        x = ns_start(g, dtype, eps)
        for i in range(pieces):
            x = ns_iterate(x, coefficients, iterations_of_piece(5, i, pieces))
        assert torch.equal(ns_end(x, shape), whole), pieces
    assert sum(iterations_of_piece(5, i, 3) for i in range(3)) == 5


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_stage_apply_iterates_equal_shapes_together_bit_for_bit(dtype: str) -> None:
    """`precondition` of a stage runs the Newton-Schulz iterations of the matrices of one shape (a tall one in its
    transposed orientation included) as one batch: each direction equals the unit's own `direction` bit for bit."""
    family = MuonFamily(MuonConfig(ns_dtype=dtype))
    shapes = {"a": (16, 8), "b": (8, 16), "c": (16, 8), "d": (8, 8), "v": (8,)}
    units = [MuonUnit(n, s, UnitKind.MATRIX if len(s) == 2 else UnitKind.ADAMW) for n, s in shapes.items()]
    gen = torch.Generator().manual_seed(3)
    params = {n: torch.randn(*s, generator=gen) for n, s in shapes.items()}
    grads = {n: torch.randn(*s, generator=gen) for n, s in shapes.items()}
    batched, alone = ({u.name: family.new_state(u) for u in units} for _ in range(2))
    for _ in range(2):  # the second step with momentum
        got = {n: g.clone() for n, g in grads.items()}
        family.precondition(units, got, batched, params)
        for unit in units:
            want = family.direction(unit, grads[unit.name], alone[unit.name], params[unit.name])
            assert torch.equal(got[unit.name], want), unit.name


@pytest.mark.parametrize("pieces", [2, 3])
def test_apply_in_pieces_equals_the_whole_apply(pieces: int) -> None:
    """``APPLY s0 i/n 2.weight`` for i < n, then the rest of the stage's units one APPLY each: bit for bit the run
    with one APPLY of the stage (the pieces run Newton-Schulz's iterations [i*S//n, (i+1)*S//n))."""
    cfg = MuonConfig()
    want = train(cfg, None)
    names = [n for n, _ in mlp().named_parameters()]

    def split(op: Op) -> list[Op]:
        return [
            *(Op(OpKind.APPLY, stage=0, layer="2.weight", piece=(i, pieces)) for i in range(pieces)),
            *(Op(OpKind.APPLY, stage=0, layer=n) for n in names if n != "2.weight"),
        ]

    with edited_programs(lambda programs: replace_apply(programs, 0, 0, split)):
        got = train(cfg, None)
    for name, p in got.items():
        assert torch.equal(p, want[name]), name


def test_a_checkpoint_resumes_exactly_and_a_nan_step_leaves_no_trace(tmp_path) -> None:
    """The momentum and AdamW moments are saved and loaded; a step with a NaN loss changes no state."""
    batches = mlp_batches(STEPS)
    a = _compiled(MuonConfig())
    for x, y in batches[:2]:
        a.step(x, y)
    a.step(batches[2][0] * float("nan"), batches[2][1])
    assert a.skipped_steps == 1
    a.save_checkpoint(str(tmp_path / "ckpt"))
    b = _compiled(MuonConfig())
    b.load_checkpoint(str(tmp_path / "ckpt"))
    c = _compiled(MuonConfig())
    for x, y in batches[:2]:
        c.step(x, y)
    for x, y in batches[2:]:
        assert a.step(x, y) == b.step(x, y) == c.step(x, y)
    for (name, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q) and torch.equal(p, r), name


def test_adamw_options_equal_torch_adamw_at_the_ratio_of_the_lr() -> None:
    """The parameters Muon does not take step as torch.optim.AdamW at lr * adamw_lr_ratio with the config's betas,
    eps and weight decay."""
    cfg = MuonConfig(adamw_lr_ratio=0.5, adamw_betas=(0.8, 0.95), adamw_eps=1e-6, adamw_weight_decay=0.1)
    trainer = _compiled(cfg)
    ref = mlp()
    adamw = torch.optim.AdamW(
        [p for n, p in ref.named_parameters() if n not in MATRICES],
        lr=LR * 0.5,
        betas=(0.8, 0.95),
        eps=1e-6,
        weight_decay=0.1,
    )
    for step, (x, y) in enumerate(mlp_batches(STEPS)):
        with torch.no_grad():
            for (_, got), want in zip(trainer.named_parameters(), ref.parameters(), strict=True):
                want.copy_(got)
        trainer.step(x, y)
        adamw.zero_grad()
        F.mse_loss(ref(x), y).backward()
        adamw.step()
        for name, got in trainer.named_parameters():
            if name not in MATRICES:
                want = dict(ref.named_parameters())[name]
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"step {step} {name}")


def test_tiny_llama_equals_torch_muon_on_its_projections_and_adamw_on_the_rest() -> None:
    """A transformer: every attention and MLP projection is Muon's; the embedding, the (untied) head and the RMSNorm
    scales are AdamW's. Step for step, the momentum buffers equal torch.optim.Muon's to 1e-6 and AdamW's parameters
    torch.optim.AdamW's to 1e-5; the matrices equal torch's within one bfloat16 rounding of the Newton-Schulz
    normalization (lr * s * 2**-7): the captured graph's gradient differs from the eager model's in float32's last
    bits, and where that moves the bfloat16 Frobenius norm to its next number, all of O scales by 2**-8 (seen: 1.7e-4
    on 64x32 at lr 0.02), the precision of torch's own iteration."""
    batches = llama_batches(3)
    trainer = fxkfac.compile(
        tiny_llama(),
        None,
        None,
        example_inputs=(batches[0][0],),
        loss_fn=llama_loss,
        optimizer=sgd,
        backend=None,
        microbatches=1,
        preconditioner=MuonConfig(),
    )
    ref = tiny_llama()
    units = {u.name: u for u in trainer.units}
    matrices = {n for n, u in units.items() if u.kind is UnitKind.MATRIX}
    assert matrices == {n for n, p in ref.named_parameters() if p.dim() == 2 and "proj" in n}, sorted(matrices)
    named = dict(ref.named_parameters())
    muon = torch.optim.Muon([named[n] for n in sorted(matrices)], lr=LR)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in matrices], lr=LR)
    for step, (x, y) in enumerate(batches):
        with torch.no_grad():
            for name, got in trainer.named_parameters():
                named[name].copy_(got)
        trainer.step(x, y)
        muon.zero_grad()
        adamw.zero_grad()
        llama_loss(ref(x), y).backward()
        muon.step()
        adamw.step()
        for name, got in trainer.named_parameters():
            at = f"step {step} {name}"
            if name not in matrices:
                torch.testing.assert_close(got, named[name], rtol=0, atol=1e-5, msg=at)
                continue
            momentum = trainer.layer_states[name].momentum
            torch.testing.assert_close(momentum, muon.state[named[name]]["momentum_buffer"], rtol=0, atol=1e-6, msg=at)
            bound = LR * lr_scale(LrAdjust.ORIGINAL, units[name].shape) * 2**-7
            torch.testing.assert_close(got, named[name], rtol=0, atol=bound, msg=at)
