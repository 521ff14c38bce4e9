"""The examples run as a user runs them: examples/train_bert_torchrun.py under torchrun, tiny settings."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fxkfac.planner.plan_file import load_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--pp",
    "2",
    "--steps",
    "3",
    "--log-every",
    "1",
    "--hidden",
    "32",
    "--ffn",
    "128",
    "--layers",
    "2",
    "--batch",
    "16",
    "--seq",
    "32",
    "--microbatches",
    "4",
    "--val-batches",
    "2",
    "--plan-time",
    "1",
]


@pytest.mark.multiproc
def test_torchrun_example_trains_with_an_auto_plan(tmp_path: Path) -> None:
    plan_path = tmp_path / "plan.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "examples" / "train_bert_torchrun.py"),
        *TINY,
        "--save-plan",
        str(plan_path),
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--save-every",
        "2",
    ]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    losses = [float(x) for x in re.findall(r"step +\d+ +loss (\S+)", out)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), out
    val = re.search(r"validation loss (\S+)", out)
    assert val is not None and math.isfinite(float(val.group(1))), out
    assert (tmp_path / "ckpt" / "fxkfac.json").is_file()  # saved after step 2
    plan = load_plan(plan_path)  # validated against its own problem on load
    assert (plan.problem.D, plan.problem.N, plan.problem.W, str(plan.problem.schedule)) == (2, 4, 1, "1f1b")
    printed = re.search(r"refresh every \[([\d, ]+)\] steps", out)
    assert printed is not None and [int(x) for x in printed.group(1).split(",")] == list(plan.metrics.refresh_steps)
