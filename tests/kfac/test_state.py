"""LayerState: refresh accumulation and running average, pending -> active inverses, state_dict round trips."""

from __future__ import annotations

import io

import pytest
import torch

from fxkfac.config import KFACConfig
from fxkfac.errors import CheckpointError, ConfigError
from fxkfac.kfac import LayerState, invert, precondition


def _sym(d: int, seed: int) -> torch.Tensor:
    m = torch.randn(d, d + 2, generator=torch.Generator().manual_seed(seed))
    return m @ m.t()


def test_refresh_is_mean_of_micro_batches_then_running_average() -> None:
    s = LayerState(a_dim=3, b_dim=2)
    a1, a2, a3 = _sym(3, 0), _sym(3, 1), _sym(3, 2)
    b1, b2, b3 = _sym(2, 3), _sym(2, 4), _sym(2, 5)
    s.add_a(a1), s.add_a(a2), s.add_b(b1), s.add_b(b2)
    s.finish_refresh(0.9)
    torch.testing.assert_close(s.A, (a1 + a2) / 2)  # first refresh: no average with nothing
    torch.testing.assert_close(s.B, (b1 + b2) / 2)
    s.add_a(a3), s.add_b(b3)
    s.finish_refresh(0.9)
    torch.testing.assert_close(s.A, 0.9 * (a1 + a2) / 2 + 0.1 * a3)
    torch.testing.assert_close(s.B, 0.9 * (b1 + b2) / 2 + 0.1 * b3)
    assert s.refreshes == 2 and s.a_sum is None and s.a_count == 0


def test_counted_sums_equal_separate_adds() -> None:
    """An all-reduced sum of k micro-batch factors, added with count=k, is the same refresh."""
    parts = [_sym(3, i) for i in range(4)]
    one, summed = LayerState(), LayerState()
    for p in parts:
        one.add_a(p), one.add_b(p)
    summed.add_a(parts[0]), summed.add_a(parts[1] + parts[2] + parts[3], count=3)
    summed.add_b(sum(parts), count=4)
    one.finish_refresh(0.5), summed.finish_refresh(0.5)
    torch.testing.assert_close(one.A, summed.A)
    torch.testing.assert_close(one.B, summed.B)


def test_finish_refresh_without_factors_is_an_internal_error() -> None:
    s = LayerState()
    s.add_a(torch.eye(2))
    with pytest.raises(AssertionError, match="finish_refresh"):
        s.finish_refresh(0.9)


def test_wrong_factor_side_is_rejected() -> None:
    with pytest.raises(ConfigError, match="side 4"):
        LayerState(a_dim=3).add_a(torch.eye(4))


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
        s.add_a(_sym(3, step)), s.add_b(_sym(2, step + 10))
        s.finish_refresh(0.8)
        s.set_pending(invert(s.A, s.B, damping=1e-2, method=method), step + 2)
        s.activate(step + 1)
    s.add_a(_sym(3, 99))  # a refresh in progress
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
    assert torch.equal(t.A, s.A) and torch.equal(t.B, s.B) and torch.equal(t.a_sum, s.a_sum) and t.b_sum is None
    assert (t.refreshes, t.a_count, t.b_count) == (s.refreshes, s.a_count, s.b_count)
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


def test_invert_pending_follows_the_config_and_falls_back_to_latest() -> None:
    cfg = KFACConfig(damping=1e-2, inverse="eigen", pi_damping=True)
    s = LayerState()
    s.add_a(_sym(3, 0)), s.add_b(_sym(2, 1))
    s.finish_refresh(cfg.factor_decay)
    inv = s.invert_pending(cfg, active_from=1, name="fc")
    expected = invert(s.A, s.B, damping=1e-2, method="eigen", pi_damping=True)
    G = torch.randn(2, 3)
    torch.testing.assert_close(precondition(G, inv), precondition(G, expected), rtol=0, atol=0)
    s.add_a(torch.full((3, 3), float("nan"))), s.add_b(_sym(2, 1))
    s.finish_refresh(cfg.factor_decay)
    assert s.invert_pending(cfg, active_from=2, name="fc") is inv and s.pending == [(1, inv)]


def test_invert_pending_before_any_refresh_is_an_internal_error() -> None:
    with pytest.raises(AssertionError, match="finish_refresh"):
        LayerState().invert_pending(KFACConfig(), active_from=0)
