"""Bad input gets a clear fxkfac error, a warning, or a skipped step, and never NaN parameters."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fxkfac
from fxkfac.capture import capture
from fxkfac.config import KFACConfig, PipelineOptions, PlanOptions, StepAgreement
from fxkfac.errors import CaptureError, CheckpointError, ConfigError, NonFiniteError
from fxkfac.planner.problem.costs import InverseMethod
from fxkfac.planner.problem.ir import Capture
from fxkfac.runtime.trainer import Trainer
from tests.support.models import mlp, tiny_bert, token_batch


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        if h.sum() > 0:
            return h * 2
        return h


class _Opaque:
    def __init__(self, t: Tensor) -> None:
        self.t = t


class _ReturnsObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> _Opaque:
        return _Opaque(self.lin(x))


class _NoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((5,), 0.5))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x * self.scale)


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _one_device(model: nn.Module, x: Tensor) -> Trainer:
    """`model` on one device with K-FAC (damping 1e-2) and SGD, eager: the set-up the tests below share."""
    return fxkfac.compile(
        model,
        None,
        example_inputs=(x,),
        loss_fn=_mse,
        optimizer=_sgd,
        preconditioner=KFACConfig(damping=1e-2),
        backend=None,
    )


def test_data_dependent_control_flow_names_the_line_and_the_fix() -> None:
    with pytest.raises(CaptureError) as info:
        capture(_DataDependent(), (torch.randn(2, 4),), None)
    msg = str(info.value)
    assert "if h.sum() > 0:" in msg and "test_bad_input.py" in msg
    assert "data-dependent control flow" in msg and "torch.cond" in msg


def test_unflattenable_output_says_what_to_return() -> None:
    with pytest.raises(CaptureError, match="register_pytree_node"):
        capture(_ReturnsObject(), (torch.randn(2, 4),), None)


@pytest.mark.parametrize(
    "inputs, expected",
    [
        ((torch.randn(2, 12), torch.randn(2, 12)), r"forward\(input\)"),  # arity
        ((torch.randn(2, 7),), r"\(2, 7\).*linear.py.*mat1 and mat2.*shapes and dtypes"),  # shape
    ],
)
def test_wrong_example_inputs(inputs: tuple[Tensor, ...], expected: str) -> None:
    with pytest.raises(CaptureError, match=expected):
        fxkfac.compile(mlp(), None, example_inputs=inputs, loss_fn=_mse, backend=None)


def test_wrong_dtype_example_inputs_for_bert() -> None:
    ids, _ = token_batch(2)
    with pytest.warns(UserWarning), pytest.raises(CaptureError, match="integer token ids"):
        capture(tiny_bert(), (ids.float(),), None)


def test_model_without_layers_trains_with_base_optimizer_and_warns() -> None:
    model = _NoLayers()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    with pytest.warns(UserWarning, match="no Linear/Conv2d"):
        trainer = fxkfac.compile(model, None, example_inputs=(x,), loss_fn=_mse, optimizer=_sgd, backend=None)
    opt = _sgd(list(ref.parameters()))
    for _ in range(3):
        trainer.step(x, y)
        opt.zero_grad()
        _mse(ref(x), y).backward()
        opt.step()
    torch.testing.assert_close(model.scale, ref.scale)
    assert not torch.equal(ref.scale, torch.full((5,), 0.5))


def test_microbatches_must_divide_the_batch() -> None:
    x, y = torch.randn(6, 12), torch.randn(6, 5)
    with pytest.raises(ConfigError, match=r"microbatches=4 x 1 replica\(s\) does not divide the mini-batch of 6"):
        fxkfac.compile(mlp(), None, example_inputs=(x,), loss_fn=_mse, microbatches=4, backend=None)
    trainer = fxkfac.compile(mlp(), None, example_inputs=(x,), loss_fn=_mse, microbatches=2, backend=None)
    with pytest.raises(ConfigError, match=r"microbatches=2 x 1 replica\(s\) does not divide the mini-batch of 5"):
        trainer.step(x[:5], y[:5])
    with pytest.raises(ConfigError, match="microbatches"):
        fxkfac.compile(mlp(), None, example_inputs=(x,), loss_fn=_mse, microbatches=0, backend=None)


@pytest.mark.parametrize("poison", [float("nan"), -1e6])
def test_nan_or_indefinite_factor_falls_back_to_previous_inverse(poison: float) -> None:
    x, y = torch.randn(8, 12), torch.randn(8, 5)
    cfg = KFACConfig(damping=1e-3, factor_decay=0.5)
    trainer = fxkfac.compile(
        mlp(), None, example_inputs=(x,), loss_fn=_mse, optimizer=_sgd, preconditioner=cfg, backend=None
    )
    trainer.step(x, y)
    name = trainer.units[0].name
    state = trainer.layer_states[name]
    before = state.active
    state.A = state.A + poison * torch.eye(state.A.shape[0])  # NaN, or hugely indefinite after averaging
    trainer.step(x, y)
    assert state.active is before, "the failed inversion must keep the previous inverse"
    assert all(torch.isfinite(p).all() for _, p in trainer.named_parameters())
    assert trainer.skipped_steps == 0


def test_nan_gradients_skip_the_step_and_leave_state_untouched() -> None:
    x, y = torch.randn(8, 12), torch.randn(8, 5)
    trainer = _one_device(mlp(), x)
    trainer.step(x, y)
    params = {name: p.detach().clone() for name, p in trainer.named_parameters()}
    factors = {name: s.A.clone() for name, s in trainer.layer_states.items()}
    bad = y.clone()
    bad[0, 0] = float("nan")
    trainer.step(x, bad)
    assert trainer.skipped_steps == 1 and trainer.steps == 1
    for name, p in trainer.named_parameters():
        assert torch.equal(p, params[name]) and p.grad is None
    for name, s in trainer.layer_states.items():
        assert torch.equal(s.A, factors[name]) and s.refreshes == 1
    trainer.step(x, y)
    assert trainer.steps == 2 and all(s.refreshes == 2 for s in trainer.layer_states.values())


def _state(trainer: Trainer) -> dict[str, Tensor]:
    return {f"{name}": p.detach().clone() for name, p in trainer.named_parameters()}


def _trained_mlp_checkpoint(path: str) -> None:
    x, y = torch.randn(8, 12), torch.randn(8, 5)
    trainer = _one_device(mlp(), x)
    trainer.step(x, y)
    trainer.save_checkpoint(path)


def test_checkpoint_of_another_model_is_refused_and_changes_nothing(tmp_path) -> None:
    _trained_mlp_checkpoint(str(tmp_path / "mlp"))
    x = torch.randn(4, 12)
    other = _one_device(mlp(hidden=8), x)
    before = _state(other)
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint made for another model, this run is 5 parameters "
        r"\(shapes differ for \[\('0.bias', \[16\], \[8\]\)",
    ):
        other.load_checkpoint(str(tmp_path / "mlp"))
    assert all(torch.equal(p, before[n]) for n, p in _state(other).items()) and other.steps == 0


def test_corrupt_checkpoint_metadata_is_refused_and_changes_nothing(tmp_path) -> None:
    path = tmp_path / "mlp"
    _trained_mlp_checkpoint(str(path))
    metadata = path / ".metadata.json"
    metadata.write_bytes(metadata.read_bytes()[:100])  # truncated
    x = torch.randn(8, 12)
    trainer = _one_device(mlp(), x)
    before = _state(trainer)
    with pytest.raises(CheckpointError, match=r"tensor metadata .*\.metadata\.json is unreadable or corrupt"):
        trainer.load_checkpoint(str(path))
    assert all(torch.equal(p, before[n]) for n, p in _state(trainer).items()) and trainer.steps == 0
    assert all(s.A is None for s in trainer.layer_states.values())


def test_repeated_nan_steps_stop_with_nonfinite_error() -> None:
    x, y = torch.randn(8, 12), torch.randn(8, 5)
    trainer = fxkfac.compile(
        mlp(),
        None,
        example_inputs=(x,),
        loss_fn=_mse,
        optimizer=_sgd,
        backend=None,
        preconditioner=KFACConfig(damping=1e-2),
        pipeline=PipelineOptions(max_skipped_steps=2),
    )
    bad = torch.full_like(y, float("nan"))
    trainer.step(x, bad)
    trainer.step(x, bad)
    with pytest.raises(NonFiniteError, match=r"3 steps in a row had NaN/Inf .*max_skipped_steps=2"):
        trainer.step(x, bad)
    assert trainer.skipped_steps == 3 and trainer.steps == 0
    trainer.step(x, y)
    assert trainer.steps == 1


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("max_overhead", -0.1, "max_overhead must be >= 0"),
        ("kfac_margin", 0.0, "kfac_margin must be > 0"),
        ("memory_budget", 0, "memory_budget must be > 0 bytes"),
        ("time_limit_s", 0.0, "time_limit_s must be > 0"),
        ("deterministic", 1, "deterministic must be True or False"),
        ("stream_apply", True, "stream_apply must be a StreamApply .OFF, KEEP_REFRESH, SHORTEST_STEP."),
    ],
)
def test_plan_options_refuse_values_no_plan_can_use(field: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        PlanOptions(**{field: value})  # type: ignore[arg-type]  # the wrong types are the point


def test_step_agreement_is_checked_and_left_to_the_kl_clip_scope_under_a_preconditioner() -> None:
    with pytest.raises(ConfigError, match="StepAgreement"):
        PipelineOptions(step_agreement="copies")  # type: ignore[arg-type]  # a string where the enum belongs
    x = torch.randn(8, 12)
    copies = PipelineOptions(step_agreement=StepAgreement.COPIES)
    with pytest.raises(ConfigError, match="kl_clip_scope"):
        fxkfac.compile(
            mlp(), None, example_inputs=(x,), loss_fn=_mse, preconditioner=KFACConfig(), pipeline=copies, backend=None
        )
    trainer = fxkfac.compile(
        mlp(), None, example_inputs=(x,), loss_fn=_mse, preconditioner=None, pipeline=copies, backend=None
    )
    assert isinstance(trainer.step((x,), torch.randn(8, 5)), float)  # one device: nothing to sum in flight


def test_kfac_capture_is_a_capture_mode_or_its_text() -> None:
    assert KFACConfig(capture="deferred").capture is Capture.DEFERRED  # type: ignore[arg-type]  # text is accepted
    with pytest.raises(ConfigError, match="KFACConfig.capture must be one of 'fused', 'deferred'"):
        KFACConfig(capture="lazy")  # type: ignore[arg-type]  # the wrong value is the point


def test_kfac_inverse_is_an_inverse_method_or_its_text() -> None:
    assert KFACConfig(inverse="eigen").inverse is InverseMethod.EIGEN  # type: ignore[arg-type]  # text is accepted
    with pytest.raises(ConfigError, match="KFACConfig.inverse must be one of 'cholesky', 'eigen'"):
        KFACConfig(inverse="svd")  # type: ignore[arg-type]  # the wrong value is the point


@pytest.mark.parametrize(
    "plan,preconditioner,options,needle",
    [
        (None, KFACConfig(), PipelineOptions(), "needs plan='auto' and a preconditioner"),
        ("auto", None, PipelineOptions(), "needs plan='auto' and a preconditioner"),
    ],
)
def test_schedule_auto_is_the_planners_choice_among_the_schedules_of_the_mesh(
    plan: str | None, preconditioner: KFACConfig | None, options: PipelineOptions, needle: str
) -> None:
    x = torch.randn(8, 16)
    with pytest.raises(ConfigError, match=needle):  # refused before any capture or process group
        fxkfac.compile(
            mlp(),
            (2, 1),
            plan,
            example_inputs=(x,),
            loss_fn=_mse,
            preconditioner=preconditioner,
            schedule="auto",
            pipeline=options,
            backend=None,
        )
