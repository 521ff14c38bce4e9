"""benchmarks/gpu_check.py's code paths run (--smoke: every part tiny on the CPU), and without CUDA it refuses."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from fxkfac.planner.problem.profiles import load_cost_table

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import gpu_check  # noqa: E402 - a benchmark script, found on the path just set


def test_smoke_runs_every_part_and_writes_loadable_profiles(tmp_path: Path) -> None:
    assert gpu_check.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["errors"] == {} and report["failed_checks"] == []
    assert [r["family"] for r in report["train"]["rows"]] == ["AdamW", "K-FAC", "Shampoo", "SOAP"]
    assert all(math.isfinite(r["loss_last"]) and r["step_ms"] > 0 for r in report["train"]["rows"])
    for model in ("bert-base", "bert-large"):
        path = tmp_path / f"{model}_cpu.json"
        assert report["profile"]["files"][model] == str(path)
        table = load_cost_table(path, blocks_per_stage=3, n_stages=4, micro_batch_size=4)
        assert table.hardware == "cpu" and all(s.fwd > 0 and s.bwd > 0 for s in table.stages)
        # six Linears per block, their factors fp32 with the bias column on the A side (hidden 32, FFN 128)
        kron = 4 * (4 * (33**2 + 32**2) + 33**2 + 128**2 + 129**2 + 32**2)
        assert table.stages[0].layers[0].factor_bytes == kron
    (plan,) = report["plan"]["results"]
    assert plan["cpsat"]["refresh_steps"] == plan["cpsat"]["lower_bound_steps"]
    compare = report["kfac_pytorch"]
    assert compare["kfac_pytorch"] or "not importable" in compare["skipped_because"]
    assert compare["rows"][0]["fxkfac_ms"] > 0


def test_without_cuda_it_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.parametrize(
    ("name", "short"),
    [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"),
     ("Tesla V100-SXM2-16GB", "v100"), ("NVIDIA GeForce RTX 3090", "rtx3090")],
)  # fmt: skip
def test_device_names_are_short(name: str, short: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert gpu_check.device_name(torch.device("cuda")) == short


def test_a_family_that_fails_is_reported_and_the_others_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trained = gpu_check.train_family

    def train(family: str, *args: object) -> dict:
        if family == "SOAP":
            raise RuntimeError("Expected all tensors to be on the same device")
        return trained(family, *args)

    monkeypatch.setattr(gpu_check, "FAMILIES", ("AdamW", "SOAP"))
    monkeypatch.setattr(gpu_check, "train_family", train)
    assert gpu_check.main(["--smoke", "--parts", "train", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    adamw, soap = report["train"]["rows"]
    assert adamw["finite"] and "same device" in soap["error"]
    assert report["failed_checks"] == ["train SOAP: failed"] and report["errors"] == {}
