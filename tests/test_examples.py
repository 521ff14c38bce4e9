"""The examples run as a user runs them: examples/train_bert_torchrun.py and the README's own-model example under
torchrun, and the README's set-up commands are the ones CI runs."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fxkfac.planner.validate.plan_file import load_plan

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


def _readme_block(heading: str, language: str) -> str:
    """The first ```language block after `heading` in README.md."""
    section = (ROOT / "README.md").read_text().split(f"\n{heading}\n", 1)[1]
    return section.split(f"```{language}\n", 1)[1].split("\n```", 1)[0]


def test_readme_opens_with_the_two_commands_ci_runs() -> None:
    """The README opens with the demo and the test command; .ci/run runs the second byte for byte."""
    first = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("\n```", 1)[0].splitlines()
    assert first == [
        'pip install torch==2.13.0 -e ".[dev]" && fxkfac demo',
        'pip install torch==2.13.0 -e ".[dev]" && python -m pytest -q tests',
    ]
    assert (ROOT / ".ci" / "run").read_text().rstrip().splitlines()[-1] == first[1]


@pytest.mark.multiproc
def test_readme_own_model_example_trains_and_resumes_under_torchrun(tmp_path: Path) -> None:
    """The README's example, as printed there, trains a GPT-2 on 2 ranks, saves a checkpoint at step 4, evaluates
    and saves the plan it prints; launched again, it resumes at step 4 on the same plan."""
    (tmp_path / "train.py").write_text(_readme_block("## Use it on your own model", "python"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"]
    printed, plans = [], []
    for _ in range(2):
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        found = re.search(
            r"from step (\d+): loss (\S+), validation (\S+), refresh every \[([\d, ]+)\] steps", done.stdout
        )
        assert found is not None, done.stdout
        printed.append(found)
        plans.append(load_plan(tmp_path / "plan.json"))
    assert [int(p.group(1)) for p in printed] == [0, 4]
    assert all(math.isfinite(float(p.group(2))) and math.isfinite(float(p.group(3))) for p in printed)
    assert [int(x) for x in printed[0].group(4).split(",")] == list(plans[0].metrics.refresh_steps)
    assert (plans[0].problem.D, plans[0].problem.N, str(plans[0].problem.schedule)) == (2, 4, "1f1b")
    assert plans[1] == plans[0]  # adopted from the checkpoint, not planned again
