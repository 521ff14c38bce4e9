"""A dead or stalled rank makes its peers fail with a clear error (no hang); the measured timeline."""

from __future__ import annotations

import json

import pytest

from tests.runtime.workers import failure_worker, timeline_worker
from tests.support.distributed import run_distributed

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("victim", [0, 1])
def test_dead_rank_makes_peer_fail_with_pipeline_error(victim: int) -> None:
    results = run_distributed(failure_worker, 2, "die", victim, timeout=120)
    dead, peer = results[victim], results[1 - victim]
    assert dead.exitcode == 3 and dead.value is None
    assert peer.error_type in ("PipelineError", "PipelineTimeoutError"), peer
    assert f"rank {1 - victim}" in peer.error and ("peer" in peer.error)
    assert any(word in peer.error for word in ("RECV_", "SEND_", "OPT_STEP", "loss all-reduce")), peer.error


def test_stalled_rank_makes_peer_time_out_naming_instruction() -> None:
    results = run_distributed(failure_worker, 2, "stall", 1, timeout=120)
    assert results[1].value == "stalled"
    peer = results[0]
    assert peer.error_type == "PipelineTimeoutError", peer
    assert "rank 0" in peer.error and "5s" in peer.error and "RECV_GRAD s0" in peer.error


def test_timeline_records_every_instruction_and_exports_a_trace(tmp_path) -> None:
    path = tmp_path / "trace.json"
    results = run_distributed(timeline_worker, 2, str(path), timeout=120)
    assert all(r.ok for r in results), [(r.error, r.traceback) for r in results]
    for r in results:
        local = r.value["local"]
        assert [op for op, step, *_ in local] == r.value["program"] * 2
        assert [step for _, step, *_ in local] == [0] * len(r.value["program"]) + [1] * len(r.value["program"])
        times = [t for _, _, start, end in local for t in (start, end)]
        assert times == sorted(times), "instructions of one rank overlap or go backwards"
    for r in results:  # the part of each instruction spent waiting for a peer
        assert all(0 <= wait <= span for _, span, wait, _ in r.value["waits"])
        computed = [(span, wait, cpu) for kind, span, wait, cpu in r.value["waits"] if kind in ("FWD", "BWD")]
        assert all(wait == 0 for _, wait, _ in computed)
        # A thread's CPU time in one op: above 0 where it computes, and at most the op's wall time (1 ms for the
        # moment between the two clocks' reads).
        assert all(0 < cpu <= span + 1_000_000 for span, _, cpu in computed)
    first_recv = next(wait for kind, _, wait, _ in results[1].value["waits"] if kind == "RECV_ACT")
    assert first_recv > 0, "the last stage's first receive waits for the first stage's forward"
    util = results[0].value["utilization"]
    assert set(util) == {0, 1} and all(0.0 < u < 1.0 for u in util.values())
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1}
    assert len(spans) == sum(len(r.value["local"]) for r in results)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
