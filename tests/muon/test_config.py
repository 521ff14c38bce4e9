"""MuonConfig refuses what torch.optim.Muon refuses (and more) with an actionable ConfigError; compile takes it as
`preconditioner=`, exported from fxkfac; embeddings, the output head and 1-D parameters go to AdamW; a unit's cost
has no parts, its APPLY only."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fxkfac
from fxkfac.errors import ConfigError
from fxkfac.families import family_of
from fxkfac.muon import LrAdjust, MuonConfig, MuonFamily, UnitKind
from fxkfac.muon.family import lr_scale
from fxkfac.planner.problem.costs import PreconditionerKind


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("momentum", 1.0, r"momentum must be in \[0, 1\)"),
        ("ns_steps", 100, "ns_steps must be an int in"),
        ("ns_steps", 2.5, "ns_steps must be an int in"),
        ("ns_coefficients", (1.0, 2.0), "ns_coefficients must be a tuple of three"),
        ("eps", 0.0, "eps must be > 0"),
        ("weight_decay", -0.1, "weight_decay must be >= 0"),
        ("adjust_lr_fn", "rms", "adjust_lr_fn must be one of 'original', 'match_rms_adamw'"),
        ("ns_dtype", "float16", "ns_dtype must be one of"),
        ("adamw_lr_ratio", 0.0, "adamw_lr_ratio must be > 0"),
        ("adamw_betas", (0.9, 1.0), "adamw_betas must be a pair"),
        ("nesterov", 1, "nesterov must be a bool"),
    ],
)
def test_bad_values_are_refused_naming_the_field(field: str, value: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MuonConfig(**{field: value})


def test_defaults_follow_torch_muon_and_names_convert() -> None:
    cfg = MuonConfig(adjust_lr_fn="match_rms_adamw")
    assert cfg.adjust_lr_fn is LrAdjust.MATCH_RMS_ADAMW
    assert MuonConfig(adjust_lr_fn=None).adjust_lr_fn is LrAdjust.ORIGINAL  # type: ignore[arg-type]  # torch's None
    default = MuonConfig()
    assert (default.momentum, default.nesterov, default.ns_steps, default.eps, default.weight_decay) == (
        0.95,
        True,
        5,
        1e-7,
        0.1,
    )
    assert default.ns_coefficients == (3.4445, -4.775, 2.0315)
    assert fxkfac.MuonConfig is MuonConfig and "MuonConfig" in fxkfac.__all__
    assert isinstance(family_of(cfg), MuonFamily)
    assert PreconditionerKind.MUON.value == MuonFamily.name


def test_lr_scales_are_torchs() -> None:
    assert lr_scale(LrAdjust.ORIGINAL, (64, 16)) == 2.0 and lr_scale(LrAdjust.ORIGINAL, (16, 64)) == 1.0
    assert lr_scale(LrAdjust.MATCH_RMS_ADAMW, (16, 64)) == pytest.approx(1.6)


class _LM(nn.Module):
    """Embedding -> two hidden Linear -> LayerNorm -> output head: only the hidden Linear weights are Muon's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.down(torch.relu(self.up(self.embed(x))))))


def test_embeddings_head_and_vectors_go_to_adamw_in_the_same_compile_call() -> None:
    trainer = fxkfac.compile(
        _LM(),
        None,
        None,
        example_inputs=(torch.randint(0, 11, (4, 3)),),
        loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
        backend=None,
        preconditioner=MuonConfig(),
    )
    kinds = {u.name: u.kind for u in trainer.units}
    assert {n for n, k in kinds.items() if k is UnitKind.MATRIX} == {"up.weight", "down.weight"}
    assert set(kinds) == {n for n, _ in _LM().named_parameters()}
    before = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    trainer.step(torch.randint(0, 11, (4, 3)), torch.randint(0, 11, (4, 3)))
    assert all(not torch.equal(before[n], p) for n, p in trainer.named_parameters()), "every parameter steps"


def test_a_units_cost_is_its_apply_alone() -> None:
    family = MuonFamily(MuonConfig())
    unit = next(u for u in family.units(*_captured()) if u.kind is UnitKind.MATRIX)
    cost = family.unit_cost({unit.name: unit}, {unit.name: torch.zeros(unit.shape)})(unit.name, 4)
    assert cost.parts == () and cost.prec > 0
    assert cost.grad_bytes == cost.state_bytes == 4 * unit.shape[0] * unit.shape[1]


def _captured() -> tuple[Any, Any]:
    from fxkfac.capture import capture
    from tests.support.models import mlp

    captured = capture(mlp(), (torch.zeros(2, 12),), MuonFamily.layer_config)
    return captured.gm, captured.layers


def test_an_apply_piece_is_written_and_read_back() -> None:
    from fxkfac.planner.problem.ir import Op, OpKind

    op = Op(OpKind.APPLY, 0, layer="blocks.0.fc.weight", piece=(1, 3))
    assert str(op) == "APPLY s0 1/3 blocks.0.fc.weight" and Op.parse(str(op)) == op
