"""Checkpoints: exact resume after a killed rank, refusals that change nothing, atomic saves, NaN steps skipped."""

from __future__ import annotations

import json
import re
from collections import deque
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from fxkfac import checkpoint_files
from fxkfac.capture import capture
from fxkfac.config import KLClipScope
from fxkfac.errors import CheckpointError
from fxkfac.kfac.family import KFACFamily
from fxkfac.kfac.inverse import FactorInverse, Inverse
from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.ir import LayerTiming
from fxkfac.planner.search.attempt import solve
from fxkfac.runtime.mesh import StageCopies
from fxkfac.runtime.p2p import TagSpace, Transport
from fxkfac.runtime.preconditioning import PreconditionerRuntime
from fxkfac.runtime.step_end import StepEnd
from tests.runtime import checkpoint_workers as cw
from tests.support import models
from tests.support.distributed import run_distributed


def _ok(results: list) -> list:
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    return results


def test_single_device_checkpoint_resumes_bit_for_bit_without_pickle(tmp_path: Path) -> None:
    data = cw.mlp_batches(5)
    a = cw.mlp_single(period=2)
    for x, y in data[:2]:
        a.step(x, y)
    a.save_checkpoint(str(tmp_path / "ckpt"))
    for x, y in data[2:]:
        a.step(x, y)
    b = cw.mlp_single(period=2)
    b.load_checkpoint(str(tmp_path / "ckpt"))
    assert b.steps == 2
    for x, y in data[2:]:
        b.step(x, y)
    assert cw.same_snapshot(cw.snapshot(a), cw.snapshot(b)) == []
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == [".metadata.json", "__0_0.distcp", "fxkfac.json", "rank-0.json"]  # no pickled .metadata
    header = json.loads((tmp_path / "ckpt" / "fxkfac.json").read_text())
    assert header["step"] == 2 and header["run"]["trainer"] == "kfac" and header["run"]["mesh"] == [1, 1]


def test_failed_save_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that dies after writing tensors leaves the old directory byte for byte; a crash between the two
    renames of the swap leaves it at <dir>.old-<step>, which the error names."""
    path = tmp_path / "ckpt"
    trainer = cw.mlp_single()
    data = cw.mlp_batches(3)
    trainer.step(*data[0])
    trainer.save_checkpoint(str(path))
    saved = cw.snapshot(trainer)
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    write = checkpoint_files.JsonMetadataWriter.write_data

    def failing_write(self, plan, planner):  # type: ignore[no-untyped-def]  # DCP's private writer signature
        write(self, plan, planner)
        raise OSError("disk full (injected)")

    monkeypatch.setattr(checkpoint_files.JsonMetadataWriter, "write_data", failing_write)
    trainer.step(*data[1])
    with pytest.raises(CheckpointError, match=r"writing checkpoint .*ckpt.tmp-2 failed .*untouched"):
        trainer.save_checkpoint(str(path))
    monkeypatch.undo()
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before
    fresh = cw.mlp_single()
    fresh.load_checkpoint(str(path))
    assert cw.same_snapshot(saved, cw.snapshot(fresh)) == []
    path.rename(tmp_path / "ckpt.old-2")  # as if the process died between the renames
    with pytest.raises(CheckpointError, match=r"moved to .*ckpt.old-2: load that one"):
        fresh.load_checkpoint(str(path))
    fresh.load_checkpoint(str(tmp_path / "ckpt.old-2"))


def test_state_split_into_json_and_tensors_round_trips() -> None:
    state = {
        "model": {"w": torch.ones(2)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "n": 4}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}],
        },
        "inflight": {"outbox": [["l", "A", [None, {"method": "cholesky", "inv": torch.eye(2)}]]]},
    }
    skeleton, tensors = checkpoint_files.split_tensors(state, 3)
    assert set(tensors) == {"model/w", "optimizer/state/0/step", "rank3/inflight/outbox/0/2/1/inv"}
    back = checkpoint_files.join_tensors(json.loads(json.dumps(skeleton)), tensors)
    assert back["optimizer"]["state"][0]["n"] == 4 and torch.equal(
        back["optimizer"]["state"][0]["step"], torch.tensor(3.0)
    )
    assert back["inflight"]["outbox"][0][2][0] is None and back["optimizer"]["param_groups"][0]["betas"] == [0.9, 0.99]


def _runtime() -> PreconditionerRuntime:
    x = cw.mlp_batches(1)[0][0]
    layers = {layer.name: layer for layer in capture(models.mlp(), (x[:4],), cw.KFAC).layers}
    timings = {n: LayerTiming(2, 0, 1, "deferred") for n in layers}
    copies = {0: StageCopies((0,), None)}
    alone = Transport(0, 1, TagSpace(1, 1, 1), timedelta(seconds=1))
    step_end = StepEnd.build(KLClipScope.GLOBAL, alone, [(0,)], {0: (0,)})
    return PreconditionerRuntime(
        KFACFamily(cw.KFAC), layers, {n: 0 for n in layers}, timings, copies, 0, 2, 8, step_end
    )


def test_kfac_work_in_flight_round_trips_through_a_checkpoint_state() -> None:
    """Open refreshes (partial sums, folded sides, inverse halves), the BCAST outbox and pending inverses."""
    g = torch.Generator().manual_seed(0)
    rt = _runtime()
    rt.open_refreshes(0)
    name, other = sorted(rt.layers)[:2]
    d = rt.layers[name].a_dim
    record = rt.refreshes[name][0]
    record.sums["A"], record.counts["A"] = torch.randn(d, d, generator=g), 1
    record.folded.add("B")
    record.halves["B"] = FactorInverse("eigen", q=torch.randn(3, 3, generator=g), l=torch.rand(3, generator=g))
    rt._outbox[(other, "A")] = deque([None, FactorInverse("cholesky", inv=torch.randn(2, 2, generator=g))])
    d_other = rt.layers[other].a_dim
    rt.states[other].A = torch.randn(d_other, d_other, generator=g)
    rt.states[other].set_pending(Inverse("cholesky", a_inv=torch.eye(2), b_inv=torch.eye(3)), 3)
    skeleton, tensors = checkpoint_files.split_tensors(rt.state_dict(), 0)
    restored = _runtime()
    restored.load_parsed(restored.parse_state(checkpoint_files.join_tensors(json.loads(json.dumps(skeleton)), tensors)))
    again, again_tensors = checkpoint_files.split_tensors(restored.state_dict(), 0)
    assert again == skeleton and set(again_tensors) == set(tensors)
    assert all(torch.equal(again_tensors[k], tensors[k]) for k in tensors)
    bad = checkpoint_files.join_tensors(skeleton, tensors)
    bad["inflight"]["refreshes"]["not.a.layer"] = bad["inflight"]["refreshes"].pop(name)
    with pytest.raises(CheckpointError, match=r"in flight for layers \['not.a.layer'\]"):
        restored.parse_state(bad)


@pytest.mark.multiproc
def test_killed_rank_fails_the_job_and_a_fresh_launch_resumes_exactly(tmp_path: Path) -> None:
    """2-rank PipeFisher BERT: checkpoint at step 2, rank 1 SIGKILLed after step 3 -> rank 0 fails naming itself
    and the instruction; a fresh launch resumes from step 2 and ends bit for bit where the uninterrupted run did.
    The fresh launch first refuses bad checkpoints (nothing changes), loads the MLP's checkpoints under another
    plan, schedule and mesh, and a save that fails half way keeps the checkpoint it was replacing."""
    ckpt, mlp_ckpt, single_ckpt = (str(tmp_path / n) for n in ("bert", "mlp", "single"))
    crash = run_distributed(cw.crash_worker, 2, ckpt, mlp_ckpt, timeout=300)
    assert crash[1].exitcode == -9 and crash[1].value is None, crash[1]
    survivor = crash[0]
    assert survivor.ok, survivor.traceback
    kind, message = survivor.value["error"]
    assert kind in ("PipelineError", "PipelineTimeoutError") and "rank 0" in message, message
    assert any(op in message for op in ("RECV_", "SEND_", "OPT_STEP", "all-reduce")), message
    assert survivor.value["resumed_loss"] == survivor.value["losses"][cw.SAVE_AT]  # resumed in place, same loss

    single = cw.mlp_single()
    single.step(*cw.mlp_batches(1)[0])
    single.save_checkpoint(single_ckpt)
    (tmp_path / "scratch").mkdir()
    plan_path = str(tmp_path / "plan-2x2.json")
    _plan_for_a_2x2_mesh().save(plan_path)
    results = _ok(
        run_distributed(
            cw.resume_worker, 2, ckpt, mlp_ckpt, single_ckpt, plan_path, str(tmp_path / "scratch"), timeout=300
        )
    )
    for r in results:
        v = r.value
        assert v["loaded_step"] == cw.SAVE_AT
        assert v["losses"] == survivor.value["losses"][cw.SAVE_AT :]
        reference = torch.load(f"{ckpt}.reference-{r.rank}.pt", weights_only=True)
        assert cw.same_snapshot(reference, v["final"]) == [], f"rank {r.rank} did not resume exactly"
        _check_refusals(v["refusals"])
        assert v["resharded"] == {
            "another plan": (2, []),
            "another schedule": (2, []),
            "one-device checkpoint": (1, []),
        }
        kind, message = v["failed_save"]
        assert kind == "CheckpointError" and "failed" in message, v["failed_save"]
        assert v["unchanged"] and v["reloaded"] == []
        assert v["leftovers"] and all(".tmp-" in name for name in v["leftovers"])
        _check_nan_run(v["nan"])
        kind, message, changed = v["other_batch"]
        assert kind == "ConfigError" and "microbatches=2 x 1 replica(s) does not divide the mini-batch of 5" in message
        assert changed == []
        built = v["construction"]
        assert built["untouched"], "a failed construction changed the model or the plan file"
        assert built["microbatches"][0] == "ConfigError"
        assert "microbatches=3 x 1 replica(s) does not divide the mini-batch of 8" in built["microbatches"][1]
        assert built["plan for another mesh"][0] == "PlanMismatchError"
        assert re.search(
            r"was made for 1f1b D=2 N=2 W=2 v=1, but this run is 1f1b D=2 N=2 W=1 v=1",
            built["plan for another mesh"][1],
        ), built["plan for another mesh"]


def _plan_for_a_2x2_mesh() -> Plan:
    """A plan (the paper's greedy placement on analytic costs) for 1F1B on a 2x2 mesh."""
    from fxkfac.planner.problem.analytic import analytic_cost_table
    from fxkfac.planner.problem.problem import Problem, SolverConfig

    problem = Problem(
        "1f1b",
        2,
        2,
        analytic_cost_table("bert-base", 2, 2, 128),
        W=2,
        max_overhead=1.0,
        fingerprint="fx1-0000000000000000",
    )
    return solve(problem, SolverConfig(time_limit_s=2), method="greedy")


def _check_nan_run(v: dict) -> None:
    """The NaN step is skipped and counted on every rank, leaves parameters, optimizer and K-FAC state as they
    were, and the run ends where the single-device trainer (which skips it too) ends."""
    assert v["skipped"] == 1 and v["steps"] == cw.NAN_STEPS - 1
    assert all(torch.isnan(torch.tensor(v["losses"][i])) for i in cw.NAN_AT)
    before, after = v["states"][cw.NAN_AT[0]], v["states"][cw.NAN_AT[0] + 1]
    assert after[0]["skipped_steps"] == 1 and before[0]["skipped_steps"] == 0
    assert cw.same_snapshot(({**before[0], "skipped_steps": 1}, before[1]), after) == []
    assert any(k.startswith("kfac/") for k in after[1]), "the snapshot holds no K-FAC state"
    single = cw.mlp_single(period=2)
    for x, y in cw.mlp_batches(cw.NAN_STEPS, nan_at=cw.NAN_AT):
        single.step(x, y)
    assert single.skipped_steps == 1
    want = dict(single.named_parameters())
    bad = [n for n, p in v["params"].items() if not torch.allclose(p, want[n], atol=1e-5, rtol=0)]
    assert not bad, f"pipelined parameters {bad} differ from the single-device trainer's"
    assert [kind for kind, _ in v["strict_errors"]] == ["NonFiniteError"]
    assert "2 steps in a row had NaN/Inf loss or gradients (max_skipped_steps=1)" in v["strict_errors"][0][1]
    assert v["strict_skipped"] == 2 and v["strict_steps"] == 1


@pytest.mark.multiproc
def test_rank_dying_at_a_kfac_collective_fails_its_peer_with_the_instruction() -> None:
    """Chimera on 2 ranks (both hold every stage): rank 1 dies instead of its SYNC_STATS; rank 0 fails there."""
    results = run_distributed(cw.collective_death_worker, 2, "SYNC_STATS", timeout=120)
    assert results[1].exitcode == -9, results[1]
    assert results[0].ok, results[0].traceback
    kind, message = results[0].value["error"]
    assert kind in ("PipelineError", "PipelineTimeoutError") and "rank 0" in message, message
    assert "SYNC_STATS" in message and "peer" in message, message


EXPECTED_REFUSALS = {
    "another model": r"checkpoint made for another model, this run is \d+ parameters \(parameters only in the "
    r"checkpoint \['0.bias'",
    "truncated_metadata": r"tensor metadata .*\.metadata\.json is unreadable or corrupt",
    "truncated_header": r"checkpoint header .*fxkfac\.json is unreadable or corrupt",
    "missing_tensors": r"reading the tensors of checkpoint .* failed",
    "no checkpoint": r"no checkpoint directory at .*nothing",
}


def _check_refusals(refusals: dict) -> None:
    assert set(refusals) == set(EXPECTED_REFUSALS)
    for name, (kind, message, changed) in refusals.items():
        assert kind == "CheckpointError", (name, kind, message)
        assert re.search(EXPECTED_REFUSALS[name], message), (name, message)
        assert changed == [], (name, changed)
