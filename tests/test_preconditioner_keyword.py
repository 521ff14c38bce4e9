"""`compile`'s one preconditioner keyword: omitted is K-FAC, None the base optimizer alone, `kfac=` a warned alias."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fxkfac
from fxkfac.config import KFACConfig
from fxkfac.errors import ConfigError
from fxkfac.runtime.trainer import Trainer
from tests.support.models import mlp, mlp_batches


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # type: ignore[arg-type]  # compile hands an iterable of parameters


def _compile(model: nn.Module, **kw: object) -> Trainer:
    x = mlp_batches(1)[0][0]
    return fxkfac.compile(model, None, example_inputs=(x,), loss_fn=F.mse_loss, optimizer=_sgd, backend=None, **kw)  # type: ignore[arg-type]  # keywords under test


def test_preconditioner_none_trains_the_base_optimizer_alone() -> None:
    """preconditioner=None equals plain PyTorch SGD on a copy of the model (it once fell back to K-FAC)."""
    model = mlp()
    reference = copy.deepcopy(model)
    trainer = _compile(model, preconditioner=None)
    opt = _sgd(reference.parameters())
    for x, y in mlp_batches(3):
        trainer.step((x,), y)
        opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        opt.step()
    assert trainer.units == []
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_omitted_is_kfac_with_the_default_config() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default warns nothing
        trainer = _compile(mlp())
    assert trainer.spec.family is not None and trainer.spec.family.name == "kfac"
    assert trainer.spec.family.layer_config == KFACConfig()
    assert len(trainer.units) == 3


def _params_after(trainer: Trainer, model: nn.Module) -> list[Tensor]:
    for x, y in mlp_batches(3):
        trainer.step((x,), y)
    return [p.detach().clone() for p in model.parameters()]


def test_kfac_is_a_warned_alias_of_preconditioner() -> None:
    cfg = KFACConfig(damping=1e-2, refresh_every=1)
    new, old = mlp(), mlp()
    by_name = _params_after(_compile(new, preconditioner=cfg), new)
    with pytest.warns(FutureWarning, match="preconditioner="):
        aliased = _compile(old, kfac=cfg)
    for got, want in zip(_params_after(aliased, old), by_name, strict=True):
        assert torch.equal(got, want)
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="KFACConfig or None"):
        _compile(mlp(), kfac="kfac")


def test_both_keywords_are_refused() -> None:
    with pytest.raises(ConfigError, match="pass preconditioner= alone"):
        _compile(mlp(), preconditioner=KFACConfig(), kfac=KFACConfig())


def test_family_configs_are_exported_from_the_top_level() -> None:
    from fxkfac.shampoo import ShampooConfig, SOAPConfig

    assert fxkfac.ShampooConfig is ShampooConfig and fxkfac.SOAPConfig is SOAPConfig
    assert {"KFACConfig", "ShampooConfig", "SOAPConfig"} <= set(fxkfac.__all__)
    assert all(getattr(fxkfac, name) is not None for name in fxkfac.__all__)
