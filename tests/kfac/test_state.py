"""LayerState: pending -> active inverses, state_dict round trips."""

from __future__ import annotations

import io

import pytest
import torch

from fxkfac.errors import CheckpointError
from fxkfac.kfac import LayerState, invert, precondition


def _sym(d: int, seed: int) -> torch.Tensor:
    m = torch.randn(d, d + 2, generator=torch.Generator().manual_seed(seed))
    return m @ m.t()


def test_pending_inverse_becomes_active_at_its_step() -> None:
    s = LayerState()
    inv1 = invert(_sym(3, 0), _sym(2, 1), damping=1e-2)
    s.set_pending(inv1, 5)
    assert not s.activate(4) and s.active is None and s.latest is inv1
    assert s.activate(5) and s.active is inv1 and s.pending == []
    assert not s.activate(6)


def test_overlapping_refresh_windows_activate_in_order() -> None:
    """use_offset > period: inverses from steps t and t+1 are both pending; each is used from its own step."""
    s = LayerState()
    inv2, inv3 = (invert(_sym(3, i), _sym(2, i), damping=1e-2) for i in (2, 3))
    s.set_pending(inv2, 7)
    s.set_pending(inv3, 8)
    assert s.activate(7) and s.active is inv2 and s.pending == [(8, inv3)]
    assert s.activate(8) and s.active is inv3


def test_skipping_steps_activates_the_newest_due_inverse() -> None:
    s = LayerState()
    inv2, inv3 = (invert(_sym(3, i), _sym(2, i), damping=1e-2) for i in (2, 3))
    s.set_pending(inv2, 7)
    s.set_pending(inv3, 8)
    assert s.activate(9) and s.active is inv3 and s.pending == []


def test_failed_inversion_does_not_delay_the_pending_one() -> None:
    """invert() returns `previous` on failure; queuing it again must not move its activation step."""
    s = LayerState()
    inv = invert(_sym(3, 0), _sym(2, 1), damping=1e-2)
    s.set_pending(inv, 5)
    bad = torch.full((3, 3), float("nan"))
    s.set_pending(invert(bad, _sym(2, 1), damping=1e-2, previous=s.latest), 6)
    s.set_pending(None, 6)
    assert s.pending == [(5, inv)]


def _populated(method: str) -> LayerState:
    s = LayerState(a_dim=3, b_dim=2)
    for step in range(3):
        s.A, s.B = _sym(3, step), _sym(2, step + 10)
        s.refreshes += 1
        s.set_pending(invert(s.A, s.B, damping=1e-2, method=method), step + 2)
        s.activate(step + 1)
    return s


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
def test_state_dict_round_trip_through_weights_only_load(method: str) -> None:
    s = _populated(method)
    buf = io.BytesIO()
    torch.save({f"layer.{k}": v for k, v in s.state_dict().items()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    t = LayerState(a_dim=3, b_dim=2)
    t.load_state_dict({k.removeprefix("layer."): v for k, v in loaded.items()})
    assert torch.equal(t.A, s.A) and torch.equal(t.B, s.B) and t.refreshes == s.refreshes == 3
    assert [at for at, _ in t.pending] == [at for at, _ in s.pending] and len(t.pending) == 1
    G = torch.randn(2, 3)
    assert torch.equal(precondition(G, t.active), precondition(G, s.active))
    s.activate(10), t.activate(10)
    assert torch.equal(precondition(G, t.active), precondition(G, s.active))


def test_empty_state_round_trips() -> None:
    t = LayerState()
    t.load_state_dict(LayerState().state_dict())
    assert t.A is None and t.active is None and t.pending == []


def test_corrupt_state_dict_raises_checkpoint_error() -> None:
    sd = _populated("cholesky").state_dict()
    missing = {k: v for k, v in sd.items() if k != "pending.0.b_inv"}
    with pytest.raises(CheckpointError):
        LayerState(a_dim=3, b_dim=2).load_state_dict(missing)
    with pytest.raises(CheckpointError, match="another model"):
        LayerState(a_dim=4, b_dim=2).load_state_dict(sd)
    with pytest.raises(CheckpointError):
        LayerState().load_state_dict({"A": torch.eye(2)})
