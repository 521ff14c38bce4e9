"""fxkfac's Shampoo and SOAP against an independent public implementation, pytorch-optimizer (module
`pytorch_optimizer`, pinned in pyproject.toml's dev extra): ScalableShampoo, Shampoo and SOAP.

Both sides train copies of one float64 model on the same batches and the parameters are compared, relative to
how far training moved them. Each matched case picks the fxkfac and pytorch-optimizer options that mean the
same thing (docs/SHAMPOO.md has the mapping and every difference found); each DIFFERENCES case shows that a
documented difference is real, so the matched cases are not passing by accident.

- Shampoo runs through `fxkfac.compile` on one device (the user's path). ScalableShampoo grafts per parameter,
  so the models have no blocking (one block per parameter) and no 1-D parameters (pytorch-optimizer grafts
  them, fxkfac runs full-matrix AdaGrad on them). Its statistics start at eps*I and decay with beta2 < 1
  (beta2^t eps I), fxkfac adds a constant eps at the root: with eps = 1e-12 that differs below 1e-6
  relative; with beta2 = 1 (sums) both are eps*I + sum G G^T and agree to rounding.
- Plain `Shampoo` does not graft: on one gradient stream its step is fxkfac's with the SGD graft rescaled
  per parameter (fxkfac always grafts), checked step by step.
- SOAP runs through the runtime's per-step contract (as tests/shampoo/driver.py) with use_offset=1: the public
  SOAP computes its basis after the step and uses it from the next one. Its first step only seeds the factors
  and the eigh basis (no update, no moments); the harness reproduces that by folding step 0 without
  preconditioning or stepping (DIFFERENCES["first step"] shows fxkfac's own step 0 differs).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pytorch_optimizer import SOAP, ScalableShampoo, Shampoo
from pytorch_optimizer.optimizer.utils.graft import LayerWiseGrafting
from torch import Tensor, nn

import fxkfac
from fxkfac.preconditioner import Family
from fxkfac.shampoo import GraftType, LargeDimMethod, ShampooConfig, ShampooFamily, SOAPConfig, SOAPFamily
from tests.shampoo.driver import BATCH, backward, batches

STEPS, LR = 8, 0.05


def _bias_free() -> nn.Module:
    """6 -> 5 -> 5 -> 3 without biases (float64): one square and two rectangular weights, no 1-D parameter."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 5, bias=False), nn.Tanh(), nn.Linear(5, 5, bias=False), nn.Tanh(), nn.Linear(5, 3, bias=False)
    ).double()


def _with_biases() -> nn.Module:
    """6 -> 5 -> 3 with biases (float64)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _params(net: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _relative(ours: Mapping[str, Tensor], theirs: Mapping[str, Tensor], start: Mapping[str, Tensor]) -> float:
    """Largest parameter difference over the largest distance training moved a parameter entry."""
    diff = max(float((ours[n] - theirs[n]).abs().max()) for n in start)
    moved = max(float((ours[n] - start[n]).abs().max()) for n in start)
    assert moved > 1e-3, "training did not move the parameters: the comparison would be vacuous"
    return diff / moved


def _train_public(
    net: nn.Module, make: Callable[[Any], torch.optim.Optimizer], data: list[tuple[Tensor, Tensor]]
) -> dict[str, Tensor]:
    opt = make(net.parameters())
    for batch in data:
        backward(net, batch)
        opt.step()
    return _params(net)


# --- Shampoo vs ScalableShampoo ---------------------------------------------------------------------------

SHAMPOO = ShampooConfig(
    betas=(0.0, 0.99),
    epsilon=1e-12,
    use_bias_correction=False,
    momentum=0.0,
    use_nesterov=False,
    weight_decay=0.0,
    max_preconditioner_dim=8,
    use_merge_dims=False,
    precondition_frequency=1,
    start_preconditioning_step=0,
    grafting_type=GraftType.SGD,
    grafting_epsilon=1e-8,
    preconditioner_dtype="float64",
)
"""fxkfac's side of a matched case: beta1 = 0 (pytorch-optimizer has no gradient filter; its beta1 is fxkfac's
momentum), no bias correction (it has none), no merging (its shape interpretation differs), blocks larger
than every side (it grafts per parameter)."""

SCALABLE = dict(
    betas=(0.0, 0.99),
    moving_average_for_momentum=False,
    nesterov=False,
    weight_decay=0.0,
    decoupled_weight_decay=False,
    decoupled_learning_rate=True,
    inverse_exponent_override=0,
    start_preconditioning_step=1,
    preconditioning_compute_steps=1,
    statistics_compute_steps=1,
    block_size=8,
    no_preconditioning_for_layers_with_dim_gt=8,
    shape_interpretation=False,
    graft_type=LayerWiseGrafting.SGD,
    diagonal_eps=1e-8,
    use_svd=True,
    matrix_eps=1e-12,
)
"""pytorch-optimizer's side: SVD roots (its Schur-Newton adds a ridge relative to the largest eigenvalue),
start 1 (its steps count from 1), preconditioners refreshed every `preconditioning_compute_steps` steps."""

# name: (fxkfac changes, ScalableShampoo changes, relative tolerance)
SHAMPOO_CASES: dict[str, tuple[dict[str, Any], dict[str, Any], float]] = {
    "ema, sgd graft, every step": ({}, {}, 1e-6),
    "nesterov, decay inside momentum": (
        {"momentum": 0.9, "use_nesterov": True, "weight_decay": 0.1, "use_decoupled_weight_decay": True},
        {"betas": (0.9, 0.99), "nesterov": True, "weight_decay": 0.1, "decoupled_weight_decay": False},
        1e-6,
    ),
    "heavy-ball momentum": ({"momentum": 0.5}, {"betas": (0.5, 0.99)}, 1e-6),
    "decay outside momentum (no momentum)": (
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "decoupled_weight_decay": True},
        1e-6,
    ),
    "adagrad graft, frequency 3, exponent 2": (
        {
            "grafting_type": GraftType.ADAGRAD,
            "precondition_frequency": 3,
            "start_preconditioning_step": 2,
            "exponent_override": 2,
        },
        {
            "graft_type": LayerWiseGrafting.ADAGRAD,
            "preconditioning_compute_steps": 3,
            "start_preconditioning_step": 3,
            "inverse_exponent_override": 2,
        },
        1e-6,
    ),
    "sgd graft, frequency 3, identity before the first roots": (
        {"precondition_frequency": 3, "start_preconditioning_step": 2, "momentum": 0.9},
        {"preconditioning_compute_steps": 3, "betas": (0.9, 0.99)},
        1e-6,
    ),
    "rmsprop graft": (
        {"betas": (0.0, 0.9), "grafting_type": GraftType.RMSPROP, "grafting_beta2": 0.9},
        {"betas": (0.0, 0.9), "graft_type": LayerWiseGrafting.RMSPROP},
        1e-6,
    ),
    "sides longer than b: graft only": (
        {"max_preconditioner_dim": 5, "large_dim_method": LargeDimMethod.ADAGRAD, "grafting_type": GraftType.ADAGRAD},
        {"block_size": 5, "no_preconditioning_for_layers_with_dim_gt": 5, "graft_type": LayerWiseGrafting.ADAGRAD},
        1e-6,
    ),
    # ScalableShampoo's validator refuses beta2 = 1 but its statistics code sums for it (weight 1, not
    # 1 - beta2): set on the param group after construction. Then eps enters both the same way.
    "beta2=1 sums, adagrad graft, nesterov": (
        {
            "betas": (0.0, 1.0),
            "epsilon": 1e-4,
            "grafting_type": GraftType.ADAGRAD,
            "momentum": 0.9,
            "use_nesterov": True,
        },
        {"betas": (0.9, 1.0), "matrix_eps": 1e-4, "graft_type": LayerWiseGrafting.ADAGRAD, "nesterov": True},
        1e-12,
    ),
}

# name: (fxkfac changes, ScalableShampoo changes, model, smallest relative difference expected)
SHAMPOO_DIFFERENCES: dict[str, tuple[dict[str, Any], dict[str, Any], Callable[[], nn.Module], float]] = {
    "graft norm per block vs per parameter": ({"max_preconditioner_dim": 3}, {"block_size": 3}, _bias_free, 1e-2),
    "decoupled decay with momentum": (
        {"momentum": 0.9, "weight_decay": 0.1},
        {"betas": (0.9, 0.99), "weight_decay": 0.1, "decoupled_weight_decay": True},
        _bias_free,
        1e-2,
    ),
    "1-D parameters: full-matrix AdaGrad vs graft only": ({}, {}, _with_biases, 1e-2),
    "gradient filter beta1 vs momentum beta1": ({"betas": (0.9, 0.99)}, {"betas": (0.9, 0.99)}, _bias_free, 1e-2),
}


def _shampoo_pair(fx: dict[str, Any], po: dict[str, Any], make_model: Callable[[], nn.Module]) -> float:
    """Train with fxkfac.compile and with ScalableShampoo; the relative parameter difference."""
    cfg = replace(SHAMPOO, **fx)
    kwargs = {**SCALABLE, **po}
    beta1, beta2 = kwargs["betas"]
    data = batches(STEPS)
    net = make_model()
    start, twin = _params(net), copy.deepcopy(net)
    trainer = fxkfac.compile(
        net,
        None,
        None,
        example_inputs=(data[0][0],),
        loss_fn=F.mse_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
        backend=None,
        preconditioner=cfg,
    )
    for x, y in data:
        trainer.step(x, y)
    ours = {n: p.detach().clone() for n, p in trainer.named_parameters()}

    def make(ps: Any) -> torch.optim.Optimizer:
        opt = ScalableShampoo(ps, lr=LR, **{**kwargs, "betas": (beta1, min(beta2, 0.9))})
        opt.param_groups[0]["betas"] = (beta1, beta2)  # beta2 = 1 past the validator (see SHAMPOO_CASES)
        return opt

    return _relative(ours, _train_public(twin, make, data), start)


@pytest.mark.parametrize("case", SHAMPOO_CASES.values(), ids=SHAMPOO_CASES.keys())
def test_shampoo_matches_scalable_shampoo(case: tuple[dict[str, Any], dict[str, Any], float]) -> None:
    fx, po, tol = case
    assert _shampoo_pair(fx, po, _bias_free) < tol


@pytest.mark.parametrize("case", SHAMPOO_DIFFERENCES.values(), ids=SHAMPOO_DIFFERENCES.keys())
def test_shampoo_documented_differences_are_real(
    case: tuple[dict[str, Any], dict[str, Any], Callable[[], nn.Module], float],
) -> None:
    fx, po, make_model, least = case
    assert _shampoo_pair(fx, po, make_model) > least


# --- the runtime's per-step contract (tests/shampoo/driver.py's loop, with two hooks) --------------------

Hook = Callable[[int, dict[str, Tensor], dict[str, Tensor]], None]


def _run_family(
    family: Family,
    net: nn.Module,
    data: list[tuple[Tensor, Tensor]],
    *,
    use_offset: int,
    skip_first: bool = False,
    after_precondition: Hook | None = None,
) -> dict[str, Tensor]:
    """The steps as the runtime runs them on one device (tests/shampoo/driver.py: fold every step, refresh at
    t = phase (mod every) from the snapshot after each part's fold, active from t + use_offset, APPLY, SGD).
    `skip_first`: step 0 folds and refreshes but neither preconditions nor steps (the public SOAP's first step).
    `after_precondition(t, raw_grads, directions)` sees each step's gradients and directions."""
    units = family.units(net, [])  # type: ignore[arg-type]  # a plain module: units read only its parameters
    states = {u.name: family.new_state(u) for u in units}
    params = dict(net.named_parameters())
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for t, batch in enumerate(data):
        backward(net, batch)
        refresh = t % family.refresh_every == family.refresh_phase
        for unit in units:
            state, snapshots = states[unit.name], {}
            for part in family.parts:
                family.fold(state, part, family.statistic(unit, part, "gradient", params[unit.name], BATCH))
                snapshots[part] = state.snapshot()
            if refresh:
                halves = {
                    part: family.unpack(
                        unit, part, family.pack(unit, part, family.decompose(unit, snapshots[part], part))
                    )
                    for part in family.parts
                }
                state.refreshes += 1
                state.set_pending(family.combine(unit, state, halves), t + use_offset)
        for unit in units:
            states[unit.name].activate(t)
        if skip_first and t == 0:
            continue
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        raw = {n: g.detach().clone() for n, g in grads.items()}
        family.precondition(units, grads, states, params)
        if after_precondition is not None:
            after_precondition(t, raw, {n: g.detach().clone() for n, g in grads.items()})
        opt.step()
    return _params(net)


# --- Shampoo vs the ungrafted Shampoo ----------------------------------------------------------------------


def test_shampoo_direction_matches_ungrafted_shampoo() -> None:
    """Plain Shampoo (eps I + sum G G^T, roots -1/(2 order) by SVD every step, no graft) fed fxkfac's gradient
    stream: its step times ||G|| / ||step|| per parameter is fxkfac's SGD-grafted direction, biases included
    (full-matrix AdaGrad with root 2 on both sides)."""
    cfg = replace(SHAMPOO, betas=(0.0, 1.0), epsilon=1e-4)
    net = _with_biases()
    twin = copy.deepcopy(net)
    public = Shampoo(
        twin.parameters(), lr=1.0, momentum=0.0, weight_decay=0.0, preconditioning_compute_steps=1, matrix_eps=1e-4
    )
    worst = [0.0]

    def check(t: int, raw: dict[str, Tensor], ours: dict[str, Tensor]) -> None:
        before = _params(twin)
        for n, p in twin.named_parameters():
            p.grad = raw[n].clone()
        public.step()
        for n, p in twin.named_parameters():
            step = before[n] - p.detach()
            theirs = step * (raw[n].norm() / step.norm())
            worst[0] = max(worst[0], float((ours[n] - theirs).abs().max() / ours[n].abs().max()))

    _run_family(ShampooFamily(cfg), net, batches(STEPS), use_offset=0, after_precondition=check)
    assert worst[0] < 1e-12


# --- SOAP vs SOAP -------------------------------------------------------------------------------------------

SOAP_FX = SOAPConfig(
    betas=(0.9, 0.95),
    shampoo_beta=0.9,
    epsilon=1e-8,
    weight_decay=0.0,
    use_bias_correction=False,
    precondition_frequency=100,
    start_preconditioning_step=0,
    max_preconditioner_dim=8,
    large_dim_method=LargeDimMethod.DIAGONAL,
    use_merge_dims=False,
    precondition_1d=False,
    preconditioner_dtype="float64",
)
"""fxkfac's side: no bias correction (the public SOAP corrects through the step size, which moves eps, and counts
one moment update less), no weight decay (it decays after the step), a side longer than b keeps the identity
(DIAGONAL: the public SOAP's max_precondition_dim rule, it never blocks), QR refresh (its default)."""

SOAP_PO = dict(
    betas=(0.9, 0.95),
    shampoo_beta=0.9,
    eps=1e-8,
    weight_decay=0.0,
    correct_bias=False,
    precondition_frequency=100,
    max_precondition_dim=8,
    merge_dims=False,
    precondition_1d=False,
    normalize_gradient=False,
)

# name: (fxkfac changes, SOAP changes, relative tolerance)
SOAP_CASES: dict[str, tuple[dict[str, Any], dict[str, Any], float]] = {
    "eigh basis of the first gradient": ({}, {}, 1e-12),
    "1-D preconditioned": ({"precondition_1d": True}, {"precondition_1d": True}, 1e-12),
    "sides longer than b keep the identity": ({"max_preconditioner_dim": 5}, {"max_precondition_dim": 5}, 1e-12),
    "shampoo_beta 0.5": ({"shampoo_beta": 0.5}, {"shampoo_beta": 0.5}, 1e-12),
    # QR refreshes: the public SOAP only permutes the second moment into the new basis, fxkfac rotates it
    # (squared overlaps). With beta2 = 1e-8 the old second moment weighs 1e-8, and eps = 0.1 keeps coordinates
    # where the gradient vanishes (a rank-deficient factor's null space) from dividing by that 1e-8 remainder;
    # the bases, the refresh schedule and the first moment's rotation must then agree. The public SOAP runs its
    # QR in float32 whatever the parameter dtype: hence 1e-6 (measured: 1.5e-7).
    "QR every 2 steps, memoryless second moment": (
        {"precondition_frequency": 2, "betas": (0.9, 1e-8), "epsilon": 0.1},
        {"precondition_frequency": 2, "betas": (0.9, 1e-8), "eps": 0.1},
        1e-6,
    ),
    "QR every step, memoryless second moment": (
        {"precondition_frequency": 1, "betas": (0.9, 1e-8), "epsilon": 0.1},
        {"precondition_frequency": 1, "betas": (0.9, 1e-8), "eps": 0.1},
        1e-6,
    ),
}

# name: (fxkfac changes, SOAP changes, skip fxkfac's first step, smallest relative difference expected)
SOAP_DIFFERENCES: dict[str, tuple[dict[str, Any], dict[str, Any], bool, float]] = {
    "second moment at a QR refresh": ({"precondition_frequency": 2}, {"precondition_frequency": 2}, True, 1e-2),
    "first step": ({}, {}, False, 1e-2),
    "bias correction": ({"use_bias_correction": True}, {"correct_bias": True}, True, 1e-2),
    "weight decay after the step": ({"weight_decay": 0.1}, {"weight_decay": 0.1}, True, 1e-4),
}


def _soap_pair(fx: dict[str, Any], po: dict[str, Any], skip_first: bool = True) -> float:
    data = batches(STEPS)
    net = _with_biases()
    start, twin = _params(net), copy.deepcopy(net)
    ours = _run_family(SOAPFamily(replace(SOAP_FX, **fx)), net, data, use_offset=1, skip_first=skip_first)
    theirs = _train_public(twin, lambda ps: SOAP(ps, lr=LR, **{**SOAP_PO, **po}), data)
    return _relative(ours, theirs, start)


@pytest.mark.parametrize("case", SOAP_CASES.values(), ids=SOAP_CASES.keys())
def test_soap_matches_soap(case: tuple[dict[str, Any], dict[str, Any], float]) -> None:
    fx, po, tol = case
    assert _soap_pair(fx, po) < tol


@pytest.mark.parametrize("case", SOAP_DIFFERENCES.values(), ids=SOAP_DIFFERENCES.keys())
def test_soap_documented_differences_are_real(case: tuple[dict[str, Any], dict[str, Any], bool, float]) -> None:
    fx, po, skip_first, least = case
    assert _soap_pair(fx, po, skip_first) > least
