"""A checkpoint follows the state onto another layout: W=2 -> W=4 -> W=2, other KAISA strategies and pp=2 -> pp=1
resume where the uninterrupted run is; DP-KFAC resumes exactly on its own layout and gives its owners' unit states
to another W or strategy; another family, model or set of units, and work in flight that cannot follow, are
refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import fxkfac
from fxkfac import reshard
from fxkfac.config import PipelineOptions
from fxkfac.errors import CheckpointError
from fxkfac.shampoo import ShampooConfig
from tests.runtime import checkpoint_workers as cw
from tests.runtime import reshard_workers as rw
from tests.support import models
from tests.support.distributed import run_distributed


def _ok(results: list) -> list:
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    return results


def _merged(results: list, key: str) -> dict[str, torch.Tensor]:
    """Every rank's parameters under `key`, one entry per FQN (replicas must agree bit for bit)."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        for name, value in r.value[key].items():
            assert name not in out or torch.equal(out[name], value), f"replicas of {name} differ"
            out[name] = value
    return out


def _far(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert set(got) == set(want)
    return [n for n in want if not torch.allclose(got[n], want[n], atol=1e-5, rtol=0)]


def _differs(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """The keys of two unit `state_dict`s whose values differ (bit for bit); [] when equal."""
    keys = sorted(set(got) | set(want))
    return [
        k
        for k in keys
        if k not in got
        or k not in want
        or type(got[k]) is not type(want[k])
        or not (torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k])
    ]


def _owners_states(written: list) -> dict[str, dict[str, Any]]:
    """DP-KFAC's saved unit states, each from the one rank that held it (its owner)."""
    held = [(n, s) for r in written for n, s in r.value["dp_kfac_saved"].items()]
    assert len(held) == len(dict(held)) == len(rw.TIMINGS), "DP-KFAC: each unit's statistics on exactly one rank"
    assert all(r.value["dp_kfac_saved"] for r in written), "every unit on one replica: the test would not see DP-KFAC"
    return dict(held)


@pytest.mark.multiproc
def test_data_parallel_resumes_at_four_replicas_and_back_and_a_pipeline_without_its_stages(tmp_path: Path) -> None:
    """K-FAC, W=2 for 2 steps -> W=4 for 2 -> W=2 to step 6 equals 6 uninterrupted steps at W=2, and so does
    MEM-OPT at W=2 -> HYBRID 0.5 at W=4 -> MEM-OPT at W=2 (where the inverses live changes no number); a 2-stage
    pipeline saved at step 3 resumes at pp=1, W=4 where its uninterrupted run ends. The checkpoint stores each
    replicated tensor once.

    DP-KFAC (local factors) at W=2 saved at step 2 resumes on the same layout bit for bit, pending inverses
    included. Loaded at W=4 under DP-KFAC, each unit's new owner alone holds the saved owner's state; loaded at W=2
    under COMM-OPT, every replica holds it ([Note: resharding]: a unit's fullest copy, kept where the strategy holds
    it). Both then train, but are not compared with a reference: DP-KFAC's factors come from the owner's shard, so
    another W (another shard) or strategy (all-reduced factors) is another algorithm from the resumed step on."""
    dp_ckpt, pp_ckpt, mem_ckpt, wide_ckpt, hybrid_ckpt, dp_kfac_ckpt = (
        str(tmp_path / n) for n in ("dp", "pp", "mem", "wide", "hybrid", "dp_kfac")
    )
    written = _ok(run_distributed(rw.write_worker, 2, dp_ckpt, pp_ckpt, mem_ckpt, dp_kfac_ckpt, timeout=300))
    assert written[0].value["pending"], "the W=2 checkpoint should hold a pending inverse"
    metadata = json.loads((Path(dp_ckpt) / ".metadata.json").read_text())
    stored = [s["fqn"] for s in metadata["storage"]]
    assert len(stored) == len(set(stored)) == len(metadata["tensors"])  # each key once, not once per replica
    assert {"model/0.weight", "kfac/2/A", "optimizer/state/0.weight/momentum_buffer"} <= set(stored)

    owners = _owners_states(written)
    assert any(s["pending_count"] for s in owners.values()), "the DP-KFAC checkpoint should hold a pending inverse"
    assert all(r.value["dp_kfac_resumed"] == [] for r in written), [r.value["dp_kfac_resumed"][:3] for r in written]

    wide = _ok(
        run_distributed(
            rw.widen_worker, 4, dp_ckpt, pp_ckpt, mem_ckpt, wide_ckpt, hybrid_ckpt, dp_kfac_ckpt, timeout=300
        )
    )
    assert all(r.value["loaded"] == 2 and r.value["pending"] == written[0].value["pending"] for r in wide)
    assert all(r.value["from_pp"] == 3 for r in wide)
    assert _far(_merged(wide, "pp"), _merged(written, "pp")) == []

    spread = [(n, r.rank, s) for r in wide for n, s in r.value["dp_kfac"].items()]
    assert sorted(n for n, _, _ in spread) == sorted(owners), "DP-KFAC at W=4: each unit on its new owner alone"
    assert {n: _differs(s, owners[n]) for n, _, s in spread} == dict.fromkeys(owners, [])
    owner_before = {n: r.rank for r in written for n in r.value["dp_kfac_saved"]}
    moved = {n for n, rank, _ in spread if owner_before[n] != rank}
    assert moved, "no unit changed owner at W=4: the test would not see the state follow it"

    narrow = _ok(run_distributed(rw.narrow_worker, 2, wide_ckpt, hybrid_ckpt, dp_kfac_ckpt, timeout=300))
    assert all(r.value["loaded"] == 4 for r in narrow)
    assert _far(_merged(narrow, "dp"), _merged(written, "dp")) == []
    assert _far(_merged(narrow, "mem"), _merged(written, "dp")) == []
    for r in narrow:  # COMM-OPT: every replica holds every unit, as DP-KFAC's owner saved it
        assert {n: _differs(s, owners[n]) for n, s in r.value["dp_kfac"].items()} == dict.fromkeys(owners, [])


def _single(microbatches: int = 2, **kw: Any) -> Any:
    """The one-device K-FAC MLP with the resharding tests' timings."""
    kw.setdefault("preconditioner", cw.KFAC)
    return fxkfac.compile(
        kw.pop("model", None) or models.mlp(),
        None,
        example_inputs=(cw.mlp_batches(1)[0][0],),
        loss_fn=cw.mlp_loss,
        optimizer=cw._sgd,
        microbatches=microbatches,
        backend=None,
        layer_timing=rw.TIMINGS if kw.get("preconditioner") is not None else None,
        pipeline=PipelineOptions(),
        **kw,
    )


def _refusal(trainer: Any, path: Path) -> str:
    before = cw.snapshot(trainer)
    with pytest.raises(CheckpointError) as e:
        trainer.load_checkpoint(str(path))
    assert cw.same_snapshot(before, cw.snapshot(trainer)) == [], "a refused load changed the trainer"
    return str(e.value)


def test_another_family_model_or_unit_set_is_refused(tmp_path: Path) -> None:
    trainer = _single()
    rw.train(trainer, 2)
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    shampoo = fxkfac.compile(
        models.mlp(),
        None,
        example_inputs=(cw.mlp_batches(1)[0][0],),
        loss_fn=cw.mlp_loss,
        preconditioner=ShampooConfig(),
        microbatches=2,
        backend=None,
    )
    assert (
        "checkpoint made for the kfac preconditioner, this run trains with the shampoo preconditioner; its state "
        "belongs to another family"
    ) in _refusal(shampoo, tmp_path / "ckpt")
    assert "this run trains with no preconditioner (preconditioner=None)" in _refusal(
        _single(preconditioner=None), tmp_path / "ckpt"
    )
    wider = _single(model=models.mlp(hidden=8))
    assert "checkpoint made for another model, this run is 5 parameters (shapes differ for" in _refusal(
        wider, tmp_path / "ckpt"
    )
    run = trainer.describe_run()
    fewer = {**run, "units": {n: s for n, s in run["units"].items() if n != "2"}}
    with pytest.raises(
        CheckpointError,
        match=r"other kfac units than this run's \(units only in this run \['2'\]\)"
        r": the stage split or the model changed",
    ):
        reshard.check_run(fewer, run)
    assert reshard.check_run(run, run) is reshard.LoadKind.SAME_LAYOUT
    assert reshard.check_run({**run, "mesh": [1, 4]}, run) is reshard.LoadKind.RESHARD


def test_work_in_flight_is_refused_on_another_layout_and_resumes_on_the_same(tmp_path: Path) -> None:
    """One device, N=2 -> N=4 is another layout: an open refresh cannot follow, and the error names the next step
    to save at; the same layout takes it back exactly; a checkpoint of that step reshards."""
    trainer = _single()
    rw.train(trainer, 2)
    assert trainer.preconditioning is not None
    trainer.preconditioning.open_refreshes(trainer.steps)  # as a plan leaves a refresh open across steps
    trainer.save_checkpoint(str(tmp_path / "busy"))
    message = _refusal(_single(microbatches=4), tmp_path / "busy")
    assert "was saved at step 2 with work in flight (rank 0: open refreshes of ['0', '4'])" in message
    assert "microbatches 2 -> 4" in message and "for these layer timings step 3" in message
    assert "or train with plan=None" in message
    same = _single()
    same.load_checkpoint(str(tmp_path / "busy"))
    assert cw.same_snapshot(cw.snapshot(trainer), cw.snapshot(same)) == []

    quiet = _single()
    rw.train(quiet, 3)
    quiet.save_checkpoint(str(tmp_path / "quiet"))
    rw.train(quiet, rw.STEPS)
    more = _single(microbatches=4)
    more.load_checkpoint(str(tmp_path / "quiet"))
    rw.train(more, rw.STEPS)
    want = dict(quiet.named_parameters())
    assert all(torch.allclose(p, want[n], atol=1e-5, rtol=0) for n, p in more.named_parameters())


def test_quiet_steps_follow_the_layer_timings() -> None:
    """A refresh at t runs its ops in steps t .. t + use_offset: step s is quiet once the last one is done."""
    timings = {n: [t.period, t.curv_step, t.use_offset, t.capture] for n, t in rw.TIMINGS.items()}
    assert [s for s in range(8) if reshard.quiet(s, timings)] == [0, 1, 3, 5, 7]
    assert reshard.next_quiet_step(2, [timings]) == 3
    assert reshard.next_quiet_step(3, [timings, {"x": [3, 0, 1, "fused"]}]) == 5
    assert reshard.next_quiet_step(0, [{"x": [2, 0, 2, "fused"]}]) is None


def _layer(*keys: str, pending: int = 0) -> dict[str, Any]:
    return {"refreshes": 1, "pending_count": pending, **{k: {"__tensor__": f"kfac/l/{k}"} for k in keys}}


def _rank(kfac: dict[str, Any], lr: float = 0.1) -> dict[str, Any]:
    return {
        "model": {"w": {"__tensor__": "model/w"}},
        "kfac": kfac,
        "step": 4,
        "skipped_steps": 0,
        "optimizer": {
            "state": {"w": {"momentum_buffer": {"__tensor__": "optimizer/state/w/momentum_buffer"}}},
            "param_groups": [{"lr": lr, "params": ["w"]}],
        },
        "inflight": {"refreshes": {}, "outbox": [], "captures": {"0.0": []}},
        "rng": {"__tensor__": "rank/rng"},
    }


def test_a_unit_follows_its_fullest_copy() -> None:
    """KAISA's grad worker holds the decomposition the other copy lacks; DP-KFAC's owner alone holds the factors:
    every rank gets the holder's entries. Copies that hold different entries are refused."""
    grad_worker = _layer("A", "B", "pending.0.inv", pending=1)
    receiver, idle = _layer("A", "B"), _layer()
    mine = {**_rank({"l": _layer()}), "inflight": {"refreshes": {"l": []}, "outbox": [], "captures": {"1.0": []}}}
    del mine["rng"]
    for saved in (
        {0: _rank({"l": receiver}), 1: _rank({"l": grad_worker})},
        {0: _rank({"l": idle}), 1: _rank({"l": grad_worker})},
    ):
        state = reshard.resharded_state(saved, mine, 3)
        assert state["kfac"] == {"l": grad_worker} and state["model"] == saved[0]["model"]
        assert state["inflight"] == {"refreshes": {"l": []}, "outbox": [], "captures": {"1.0": []}}
        assert "rng" not in state and state["optimizer"]["param_groups"] == [{"lr": 0.1, "params": ["w"]}]
    assert reshard.resharded_state({0: _rank({"l": receiver})}, mine, 0)["rng"] == {"__tensor__": "rank/rng"}
    with pytest.raises(
        CheckpointError,
        match=r"state of 'l' differs between rank 0 and rank 1 \(only rank 1 "
        r"wrote \['B'\]\)",
    ):
        reshard.resharded_state({0: _rank({"l": _layer("A")}), 1: _rank({"l": _layer("B")})}, mine, 0)
    with pytest.raises(CheckpointError, match="parameters \\['w'\\] of one group here different settings"):
        reshard.resharded_state({0: _rank({"l": receiver}), 1: _rank({"l": receiver}, lr=0.2)}, mine, 0)
    busy = {0: _rank({"l": receiver}), 1: {**_rank({"l": receiver}), "inflight": {"outbox": [["l", "A", []]]}}}
    assert reshard.work_in_flight(busy) == ["rank 1: decompositions waiting for their BCAST (1)"]
