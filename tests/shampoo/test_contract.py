"""Shampoo and SOAP keep the runtime's contract: exact checkpoint resume, replaced (never mutated) state,
fixed-size broadcasts, failures that keep the previous preconditioner, and the Family attributes."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import pytest
import torch

from fxkfac.errors import CheckpointError, ConfigError
from fxkfac.preconditioner import Family, RefreshState, Source
from fxkfac.shampoo import (
    GraftType,
    ParamUnit,
    RootInvMethod,
    ShampooConfig,
    ShampooFamily,
    ShampooState,
    SOAPConfig,
    SOAPFamily,
)
from fxkfac.shampoo.config import DEFAULT_MAX_DIM
from fxkfac.shampoo.soap import eigh_basis, qr_basis
from tests.shampoo.driver import backward, batches, model, train

SHAMPOO = ShampooConfig(
    betas=(0.9, 0.99),
    epsilon=1e-6,
    momentum=0.9,
    weight_decay=0.01,
    max_preconditioner_dim=4,
    precondition_frequency=2,
    start_preconditioning_step=1,
    grafting_type=GraftType.ADAM,
    preconditioner_dtype="float64",
)
SOAP = SOAPConfig(
    max_preconditioner_dim=4,
    precondition_frequency=2,
    start_preconditioning_step=3,
    weight_decay=0.01,
    precondition_1d=True,
    preconditioner_dtype="float64",
)
FAMILIES: dict[str, Callable[[], Family]] = {
    "shampoo": lambda: ShampooFamily(SHAMPOO),
    "soap": lambda: SOAPFamily(SOAP),
}


def _saved(states: Mapping[str, RefreshState]) -> dict[str, dict[str, Any]]:
    """state_dict of every state with its tensors copied (as a checkpoint file would hold them)."""
    return {
        n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.state_dict().items()}
        for n, s in states.items()
    }


def _params(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


@pytest.mark.parametrize("name", FAMILIES)
def test_checkpoint_resume_is_exact(name: str) -> None:
    """Kill after 6 steps (a refresh at step 5 pending for step 6: use_offset 1), resume from state_dicts."""
    data = batches(10)
    whole = model()
    train(FAMILIES[name](), whole, data, 0.05, use_offset=1)
    first = model()
    states = train(FAMILIES[name](), first, data[:6], 0.05, use_offset=1)
    assert any(s.pending for s in states.values()), "the checkpoint should hold a pending preconditioner"
    saved, weights = _saved(states), _params(first)
    family, resumed = FAMILIES[name](), model()
    with torch.no_grad():
        for n, p in resumed.named_parameters():
            p.copy_(weights[n])
    fresh = {u.name: family.new_state(u) for u in family.units(resumed, [])}  # type: ignore[arg-type]  # a module
    for n, state in fresh.items():
        state.load_state_dict(saved[n])
    train(family, resumed, data[6:], 0.05, first_step=6, states=fresh, use_offset=1)
    expected = _params(whole)
    assert all(torch.equal(p, expected[n]) for n, p in _params(resumed).items())


@pytest.mark.parametrize("name", FAMILIES)
def test_a_restored_step_leaves_no_trace(name: str) -> None:
    """The runtime's skipped step: snapshot, fold and precondition, then restore the snapshot's attributes."""
    data = batches(7)
    plain = model()
    train(FAMILIES[name](), plain, data, 0.05)
    net, family = model(), FAMILIES[name]()
    states = train(family, net, data[:4], 0.05)
    before = {n: s.snapshot() for n, s in states.items()}
    saved = _saved(states)
    backward(net, (data[4][0] * 3, data[4][1]))  # a step that will be skipped
    params = dict(net.named_parameters())
    units = family.units(net, [])  # type: ignore[arg-type]  # a plain module
    for unit in units:
        for part in family.parts:
            family.fold(states[unit.name], part, family.statistic(unit, part, "gradient", params[unit.name], 8))
    family.precondition(units, {n: p.grad for n, p in params.items() if p.grad is not None}, states, params)
    for n, state in states.items():
        vars(state).update(vars(before[n]))
    assert _saved(states).keys() == saved.keys()
    for n, sd in _saved(states).items():
        assert all(
            torch.equal(v, saved[n][k]) if isinstance(v, torch.Tensor) else v == saved[n][k] for k, v in sd.items()
        )
    train(family, net, data[4:], 0.05, first_step=4, states=states)
    assert all(torch.equal(p, q) for p, q in zip(_params(net).values(), _params(plain).values()))


@pytest.mark.parametrize("name", FAMILIES)
def test_an_in_flight_snapshot_round_trips(name: str) -> None:
    """A refresh snapshot saved in a checkpoint decomposes to the same roots or bases after loading."""
    family = FAMILIES[name]()
    net = model()
    states = train(family, net, batches(6), 0.05)
    for unit in family.units(net, []):  # type: ignore[arg-type]  # a plain module
        snap = states[unit.name].snapshot()
        loaded = family.new_state(unit)
        loaded.load_state_dict(_saved({"x": snap})["x"])
        for part in family.parts:
            a, b = family.decompose(unit, snap, part), family.decompose(unit, loaded, part)
            assert torch.equal(a, b)
            assert torch.equal(family.half_from_state(family.half_to_state(a)), a)


@pytest.mark.parametrize("name", FAMILIES)
def test_packing_has_a_fixed_size(name: str) -> None:
    family = FAMILIES[name]()
    net = model()
    states = train(family, net, batches(4), 0.05)
    for unit in family.units(net, []):  # type: ignore[arg-type]  # a plain module
        for part in family.parts:
            half = family.decompose(unit, states[unit.name].snapshot(), part)
            full, empty = family.pack(unit, part, half), family.pack(unit, part, None)
            assert full.shape == empty.shape == (1 + family.stats_shape(unit, part)[0],)
            assert family.unpack(unit, part, empty) is None
            assert torch.equal(family.unpack(unit, part, full), half)
    with pytest.raises(ValueError, match="flat"):
        family.half_from_state({"q": 1})


@pytest.mark.parametrize("name", FAMILIES)
def test_the_step_state_round_trips_at_a_fixed_size(name: str) -> None:
    """What a streamed unit's helper returns (`step_state`) loads into a fresh state as the same counts and tensors,
    absent ones included (a fresh state's message is as long)."""
    family = FAMILIES[name]()
    net = model()
    states = train(family, net, batches(4), 0.05)
    for unit in family.units(net, []):  # type: ignore[arg-type]  # a plain module
        state, loaded = states[unit.name], family.new_state(unit)
        flat = family.step_state(unit, state)
        assert flat.shape == family.step_state(unit, family.new_state(unit)).shape
        family.load_step_state(unit, loaded, flat)
        assert loaded.folds == state.folds
        for k in state.TENSORS:
            a, b = getattr(state, k), getattr(loaded, k)
            assert (a is None and b is None) or torch.equal(a, b), k


@pytest.mark.parametrize(
    ("options", "left_out"),
    [
        ({}, ()),
        ({"momentum": 0.0}, ("momentum",)),
        ({"betas": (0.0, 0.99), "grafting_type": GraftType.SGD, "momentum": 0.0}, ("graft", "filtered", "momentum")),
    ],
)
def test_the_step_state_leaves_out_what_the_config_never_makes(
    options: dict[str, Any], left_out: tuple[str, ...]
) -> None:
    """A streamed Shampoo unit returns L, R and only the per-step tensors its config makes (no zeros for a momentum
    of 0, SGD grafting or beta1 = 0 on the wire each step), and still trains to the same state."""
    family = ShampooFamily(replace(SHAMPOO, **options))
    net = model()
    states = train(family, net, batches(3), 0.05)
    for unit in family.units(net, []):  # type: ignore[arg-type]  # a plain module
        state, loaded = states[unit.name], family.new_state(unit)
        kept = [k for k in state.TENSORS if k not in left_out]
        assert family.step_tensors(state) == tuple(kept)
        assert all(getattr(state, k) is None for k in left_out)
        shapes = state.shapes
        counts = 16 // family.dtype.itemsize  # two int64 fold counts in the family's dtype
        assert family.step_state(unit, state).numel() == counts + len(kept) + sum(math.prod(shapes[k]) for k in kept)
        family.load_step_state(unit, loaded, family.step_state(unit, state))
        for k in state.TENSORS:
            a, b = getattr(state, k), getattr(loaded, k)
            assert (a is None and b is None) or torch.equal(a, b), k


def test_family_attributes() -> None:
    for family in (
        ShampooFamily(replace(SHAMPOO, start_preconditioning_step=5, precondition_frequency=3)),
        SOAPFamily(replace(SOAP, start_preconditioning_step=5, precondition_frequency=3)),
    ):
        assert family.parts == ("L", "R")
        assert all(family.source(p) is Source.GRADIENT for p in family.parts)
        assert (family.refresh_every, family.refresh_phase) == (3, 2)
        assert family.full_direction and family.kl_clip is None and family.stats_dtype == "float64"


def test_units_are_the_trainable_parameters() -> None:
    net = model()
    net.norm.bias.requires_grad_(False)
    units = ShampooFamily(SHAMPOO).units(net, [])  # type: ignore[arg-type]  # a plain module
    assert units[:2] == [ParamUnit("mix", (2, 2, 3, 1)), ParamUnit("lin1.weight", (5, 6))]
    assert "norm.bias" not in {u.name for u in units} and len(units) == 6


def test_block_side_auto_and_planned() -> None:
    assert ShampooFamily(ShampooConfig()).max_dim == DEFAULT_MAX_DIM == 1024
    assert SOAPFamily(SOAPConfig(), max_dim=8).max_dim == 8
    with pytest.raises(ConfigError, match="max_preconditioner_dim='auto'"):
        ShampooFamily(ShampooConfig(max_preconditioner_dim=16), max_dim=8)


def _refreshed(family: Family, net: torch.nn.Module, unit: ParamUnit) -> ShampooState:
    """The unit's state after 3 steps with a root active."""
    states = train(family, net, batches(3), 0.05)
    state = states[unit.name]
    assert isinstance(state, ShampooState) and state.active is not None
    return state


def test_a_failed_root_keeps_the_previous_one() -> None:
    family, net, unit = ShampooFamily(SHAMPOO), model(), ParamUnit("lin1.weight", (5, 6))
    state = _refreshed(family, net, unit)
    active = state.active
    assert state.L is not None
    state.L = state.L * float("nan")
    halves = {p: family.decompose(unit, state.snapshot(), p) for p in family.parts}
    assert halves["L"] is None
    state.set_pending(family.combine(unit, state, halves), 3)
    assert state.activate(3) is False and state.active is active
    unprotected = ShampooFamily(replace(SHAMPOO, use_protected_eigh=False))
    with pytest.raises(ValueError, match="use_protected_eigh=True"):
        unprotected.decompose(unit, state.snapshot(), "L")


@pytest.mark.parametrize("name", FAMILIES)
def test_the_order_of_the_folds_does_not_matter(name: str) -> None:
    """A plan may fold R before L: each part counts its own folds (bias correction, start)."""
    family, net = FAMILIES[name](), model()
    states = train(family, net, batches(3), 0.05)
    backward(net, batches(4)[3])
    params = dict(net.named_parameters())
    for unit in family.units(net, []):  # type: ignore[arg-type]  # a plain module
        halves = []
        for order in (("L", "R"), ("R", "L")):
            state = states[unit.name].snapshot()
            snaps = {}
            for part in order:
                family.fold(state, part, family.statistic(unit, part, "gradient", params[unit.name], 8))
                snaps[part] = state.snapshot()
            halves.append([family.decompose(unit, snaps[p], p) for p in ("L", "R")])
        assert all(torch.equal(a, b) for a, b in zip(*halves))


def test_decompositions_before_start_are_none() -> None:
    family, net = ShampooFamily(replace(SHAMPOO, start_preconditioning_step=3)), model()
    states = train(family, net, batches(3), 0.05)  # steps 0, 1, 2: all before start
    assert all(s.active is None and not s.pending for s in states.values())
    unit = ParamUnit("lin1.weight", (5, 6))
    assert family.decompose(unit, states[unit.name].snapshot(), "L") is None


def test_newton_that_does_not_converge_falls_back_to_eigh() -> None:
    unit = ParamUnit("lin1.weight", (5, 6))
    state = _refreshed(ShampooFamily(SHAMPOO), model(), unit)
    eigh = ShampooFamily(SHAMPOO)
    capped = ShampooFamily(replace(SHAMPOO, root_inv_method=RootInvMethod.NEWTON, newton_max_iterations=1))
    newton = ShampooFamily(replace(SHAMPOO, root_inv_method=RootInvMethod.NEWTON, newton_tolerance=1e-12))
    for part in ("L", "R"):
        reference, first, converged = (f.decompose(unit, state, part) for f in (eigh, capped, newton))
        assert reference is not None and first is not None and converged is not None
        assert torch.equal(first, reference)
        assert torch.allclose(converged, reference, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("name", FAMILIES)
def test_float32_training_stays_finite(name: str) -> None:
    """The default dtypes: a float32 model, float32 statistics, roots and bases, every step refreshing."""
    cfg: Any = replace(
        SHAMPOO if name == "shampoo" else SOAP,
        preconditioner_dtype="float32",
        precondition_frequency=1,
        start_preconditioning_step=0,
    )
    family = ShampooFamily(cfg) if name == "shampoo" else SOAPFamily(cfg)
    net = model().float()
    data = [(x.float(), y.float()) for x, y in batches(5)]
    states = train(family, net, data, 0.05)
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert all(s.active is not None for s in states.values())


def test_soap_basis_methods_agree_on_a_fixed_matrix() -> None:
    """One QR power iteration from the exact eigenbasis keeps it (up to order and signs)."""
    a = torch.randn(5, 5, dtype=torch.float64)
    a = a @ a.t()
    q = eigh_basis(a)
    assert q is not None
    again = qr_basis(a, q)
    assert again is not None
    overlap = (q.t() @ again).abs()
    assert torch.allclose(overlap.max(0).values, torch.ones(5, dtype=torch.float64))


def test_a_malformed_checkpoint_names_what_is_wrong() -> None:
    family, net = SOAPFamily(SOAP), model()
    states = train(family, net, batches(4), 0.05)
    good = _saved(states)["lin1.weight"]
    state = family.new_state(ParamUnit("lin1.weight", (5, 6)))
    with pytest.raises(CheckpointError, match="folds.R"):
        state.load_state_dict({k: v for k, v in good.items() if k != "folds.R"})
    with pytest.raises(CheckpointError, match="exp_avg must be a tensor of shape"):
        state.load_state_dict({**good, "exp_avg": torch.zeros(3)})
    bad = copy.copy(good)
    bad["active.L"] = "not a tensor"
    with pytest.raises(CheckpointError, match="active.L"):
        state.load_state_dict(bad)
