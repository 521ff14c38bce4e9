"""fxkfac on one CUDA device: bf16 training steps, BERT block profiles planned, K-FAC against kfac-pytorch.

One script that runs every GPU path of fxkfac once, in under 8 minutes on one H200-class device:

1. train: one-device K-FAC, Shampoo and SOAP (and plain AdamW, the baseline of the step-time ratios) on
   fxkfac.models.TinyBertMLM (hidden 256, 4 blocks, batch 32 x 128 tokens, one fixed batch), in bf16 with
   `--backend` (inductor). bf16 comes from `PipelineOptions(autocast_dtype=...)` where fxkfac has that field, else
   from torch.autocast around `Trainer.step` (the table says which). Reported: the first step (capture and
   compile), the median step, the loss at the first and last step; checked: every loss finite, the last below
   the first.
2. profile: one Transformer block of BERT-Base and of BERT-Large (Hugging Face `BertLayer`s, sequence 128,
   micro-batches `--batch-sizes`) in PipeFisher's profile columns, written to `--out` as `<model>_<device>.json`
   (`fxkfac.planner.problem.profiles.block_profile_json`): forward and backward under the same autocast, timed with
   CUDA events (median of repeats after a warm-up); curvature, inversion and preconditioning of the block's six
   Linears timed by fxkfac's own profiler (`fxkfac.profiler.kfac_unit_cost`, the runtime's code paths, fp32
   factors) on the device; memory: parameters, the activations the forward saves for the backward, the
   allocator's peak during the backward, deferred error captures and factors. Copied to
   planner/data/gpu_profiles/ the files ship as `gpu:<model>/<device>`.
3. plan: the PipeFisher configurations of benchmarks/paper_configs.py planned on those files
   (`paper_configs.plan_configs`, its table and checks).
4. kfac-pytorch: fxkfac's K-FAC step against kfac-pytorch's on the device (benchmarks/kfac_pytorch_compare.py's
   models, settings and interleaved timing, both eager). kfac-pytorch is not on PyPI and a device machine may
   have no network: `--kfac-pytorch-wheel PATH` installs a wheel (built elsewhere, e.g. `pip wheel --no-deps`
   of a checkout) into a temporary folder; without it, and not importable, only fxkfac's side runs and the
   table says why.

Each part runs on its own: one that raises is reported (its error in the JSON) and the others still run; the
exit status is 1 when a part failed or a check did not hold. Prints one rich table per part and one JSON line;
writes the cost tables and that JSON (gpu_check.json) under `--out` (default $OUT if set, else ./out).

    python benchmarks/gpu_check.py [--out DIR] [--kfac-pytorch-wheel PATH] [--backend inductor]
        [--batch-sizes 8 16 32] [--plan-time-limit 10]
    python benchmarks/gpu_check.py --smoke   # every part tiny, on the CPU (tests/test_gpu_check_smoke.py)

Without CUDA the script refuses, except with --smoke: tiny sizes, wall-clock timers for CUDA events, bf16
autocast on the CPU, eager stages unless --backend is given; its numbers only show that the code paths run.

On a GPU machine without network, bring what its Python lacks as wheels in the gitignored .whl/ (made where pip
works: `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl
ortools immutabledict protobuf` at the versions ortools needs, `pip wheel --no-deps -w .whl .` for fxkfac, and
`pip wheel --no-deps -w .whl/kfac <kfac-pytorch checkout>`), then:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py --out $OUT --kfac-pytorch-wheel .whl/kfac/kfac_pytorch-*.whl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import kfac_pytorch_compare as kpc
import paper_configs
import torch
from preconditioner_convergence import family_config
from rich.console import Console
from rich.table import Table
from torch import nn

import fxkfac
from fxkfac.config import KFACConfig, PipelineOptions
from fxkfac.models import TinyBertConfig, TinyBertMLM, mlm_loss
from fxkfac.passes.layers import KFACLayer, LayerKind
from fxkfac.planner.problem.profiles import PIPEFISHER_COLUMNS, block_profile_json
from fxkfac.profiler import kfac_unit_cost

MIB = 1 << 20
FAMILIES = ("AdamW", "K-FAC", "Shampoo", "SOAP")
"""AdamW alone (the baseline) and the three families, each as benchmarks/preconditioner_convergence.py sets it."""
LR = 2e-3
"""Every family's learning rate: all are on Adam's scale there (K-FAC preconditions AdamW's gradients, Shampoo
grafts Adam's step length, SOAP is Adam in a rotated basis); constant, one fixed batch to fit."""
BERT = {
    "bert-base": {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072},
    "bert-large": {"hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 4096},
}
"""The blocks the PipeFisher paper profiled (its bert-base / bert-large CSVs), as Hugging Face BertConfig sizes."""
AUTOCAST_FIELD = "autocast_dtype" in {f.name for f in dataclasses.fields(PipelineOptions)}
"""Whether this fxkfac runs a step under autocast itself (PipelineOptions.autocast_dtype)."""
console = Console(width=180)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one run measures: the real run's sizes (`FULL`) or tiny ones on the CPU (`SMOKE`)."""

    train_model: TinyBertConfig
    train_batch: int
    train_steps: int
    block_shapes: dict[str, dict[str, int]]
    seq: int
    warmup: int
    repeats: int
    plan_configs: tuple[paper_configs.Config, ...]
    compare_models: tuple[str, ...]
    compare_methods: tuple[str, ...]
    compare_warmup: int
    compare_rounds: int
    compare_steps: int


FULL = Sizes(
    train_model=TinyBertConfig(hidden=256, heads=4, ffn=1024, layers=4, max_len=128),
    train_batch=32,
    train_steps=30,
    block_shapes=BERT,
    seq=128,
    warmup=5,
    repeats=20,
    plan_configs=paper_configs.CONFIGS,
    compare_models=("mlp", "tokens"),
    compare_methods=("inverse", "eigen"),
    compare_warmup=10,
    compare_rounds=3,
    compare_steps=5,
)
SMOKE = Sizes(
    train_model=TinyBertConfig(hidden=32, heads=2, ffn=64, layers=2, max_len=16),
    train_batch=4,
    train_steps=3,
    block_shapes={m: {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 128} for m in BERT},
    seq=16,
    warmup=0,
    repeats=1,
    plan_configs=(paper_configs.CONFIGS[0],),
    compare_models=("mlp",),
    compare_methods=("inverse",),
    compare_warmup=0,
    compare_rounds=1,
    compare_steps=1,
)


def device_name(device: torch.device) -> str:
    """A device's short name for file names: 'NVIDIA H200' -> 'h200', 'NVIDIA GeForce RTX 3090' -> 'rtx3090',
    'NVIDIA A100-SXM4-80GB' -> 'a100' (the words up to the first with a digit, vendor words dropped); 'cpu'."""
    if device.type != "cuda":
        return device.type
    words = [w for w in re.split(r"[\s\-_]+", torch.cuda.get_device_name(device).lower()) if w]
    words = [w for w in words if w not in ("nvidia", "tesla", "geforce", "quadro")]
    upto = next((i for i, w in enumerate(words) if any(c.isdigit() for c in w)), len(words) - 1)
    return re.sub(r"[^a-z0-9]", "", "".join(words[: upto + 1])) or "gpu"


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a CPU runs inline)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager[Any]:
    """torch.autocast on the device in `dtype` (None: full precision)."""
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def median_seconds(
    setup: Callable[[], Any], fn: Callable[[Any], object], device: torch.device, warmup: int, repeats: int
) -> float:
    """The median seconds of `fn(setup())` over `repeats` after `warmup` untimed runs, `setup` untimed: CUDA
    events around `fn` on a GPU (the kernels' time, however far the host runs ahead), the wall clock after a
    sync on a CPU."""
    for _ in range(warmup):
        fn(setup())
    samples = []
    for _ in range(repeats):
        arg = setup()
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(arg)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn(arg)
            samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def _error(e: Exception) -> str:
    """The end of an exception's traceback: where it was raised and what it says."""
    return "".join(traceback.format_exception(e)[-8:])


# ---------------------------------------------------------------------------------------------------- 1. train


def train_family(family: str, sizes: Sizes, device: torch.device, dtype: torch.dtype, backend: str | None) -> dict:
    """`sizes.train_steps` one-device steps of `family` on TinyBertMLM (one fixed batch: every token its own
    target) in `dtype`: the first step's seconds (capture, compile), the median step and the losses."""
    torch.manual_seed(0)
    cfg = sizes.train_model
    model = TinyBertMLM(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (sizes.train_batch, cfg.max_len), device=device)
    base = torch.optim.AdamW if family in ("AdamW", "K-FAC") else torch.optim.SGD
    preconditioner = family_config(family)
    options = PipelineOptions(**({"autocast_dtype": dtype} if AUTOCAST_FIELD else {}))
    trainer = fxkfac.compile(
        model,
        None,
        example_inputs=(ids,),
        loss_fn=mlm_loss,
        optimizer=lambda params: base(params, lr=LR),
        preconditioner=preconditioner,
        backend=backend,
        pipeline=options,
    )
    outer = nullcontext() if AUTOCAST_FIELD else autocast(device, dtype)
    losses, seconds = [], []
    for _ in range(sizes.train_steps):
        sync(device)
        begin = time.perf_counter()
        with outer:
            loss = float(trainer.step((ids,), ids))
        sync(device)
        seconds.append(time.perf_counter() - begin)
        losses.append(loss)
    return {
        "family": family,
        "first_step_s": round(seconds[0], 2),
        "step_ms": round(1e3 * statistics.median(seconds[1:]), 2),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "finite": all(math.isfinite(x) for x in losses),
        "decreased": losses[-1] < losses[0],
    }


def part_train(sizes: Sizes, device: torch.device, dtype: torch.dtype, backend: str | None) -> dict:
    """Every family's run (one that raises: its error in its row, the others still run), each one's step time
    over AdamW's, and the table."""
    rows = []
    for family in FAMILIES:
        try:
            rows.append(train_family(family, sizes, device, dtype, backend))
        except Exception as e:  # a family that fails on this device is a finding; the others still run
            rows.append({"family": family, "error": _error(e)})
            console.print(f"[bold red]train {family} failed[/bold red]:\n{rows[-1]['error']}")
    adamw = rows[0].get("step_ms")
    for row in rows:
        row["step_vs_adamw"] = None if adamw is None or "error" in row else round(row["step_ms"] / adamw, 2)
    how = "PipelineOptions.autocast_dtype" if AUTOCAST_FIELD else "torch.autocast around Trainer.step"
    cfg = sizes.train_model
    table = Table(
        title=f"1. one-device training, {dtype} ({how}), backend {backend}, TinyBertMLM hidden {cfg.hidden} x "
        f"{cfg.layers} blocks, batch {sizes.train_batch} x {cfg.max_len}, {sizes.train_steps} steps on one batch"
    )
    for col in ("family", "first step s", "step ms", "vs AdamW", "loss first -> last", "finite", "decreased"):
        table.add_column(col, justify="left" if col == "family" else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["family"], "failed: " + r["error"].strip().splitlines()[-1][:100])
            continue
        table.add_row(
            r["family"],
            f"{r['first_step_s']:.1f}",
            f"{r['step_ms']:.2f}",
            "-" if r["step_vs_adamw"] is None else f"{r['step_vs_adamw']:.2f}",
            f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}",
            str(r["finite"]),
            str(r["decreased"]),
        )
    console.print(table)
    return {"autocast": how, "dtype": str(dtype), "backend": backend, "rows": rows}


# -------------------------------------------------------------------------------------------------- 2. profile


def bert_block(shape: dict[str, int], device: torch.device) -> nn.Module:
    """One Hugging Face BertLayer of `shape` (BertConfig's defaults otherwise: dropout 0.1, GELU), SDPA
    attention, in training mode."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    torch.manual_seed(0)
    return BertLayer(BertConfig(**shape, attn_implementation="sdpa")).to(device).train()


def _output(out: Any) -> torch.Tensor:
    """A BertLayer's hidden states (older transformers return them in a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def saved_bytes(block: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors the forward saves for the backward, parameters and repeats left out: the block's
    activation memory per micro-batch."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _output(block(x))
    return sum(seen.values())


def peak_backward_bytes(block: nn.Module, x: torch.Tensor, device: torch.device, act_bytes: int) -> int:
    """Bytes the backward allocates at its peak over what the forward left (the allocator's peak on a GPU; the
    saved activations stand in on a CPU, which keeps no such count)."""
    if device.type != "cuda":
        return act_bytes
    out = _output(block(x))
    grad = torch.ones_like(out)
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device)
    out.backward(grad)
    sync(device)
    block.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated(device) - held


def block_row(model: str, bs: int, sizes: Sizes, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """One profile row (`PIPEFISHER_COLUMNS`, ms and MiB per block) of `model`'s block at micro-batch `bs`."""
    shape = sizes.block_shapes[model]
    block = bert_block(shape, device)
    x = torch.randn(bs, sizes.seq, shape["hidden_size"], device=device, requires_grad=True)
    with autocast(device, dtype):
        time_f = median_seconds(lambda: None, lambda _: block(x), device, sizes.warmup, sizes.repeats)
        time_b = median_seconds(
            lambda: _output(block(x)),
            lambda out: out.backward(torch.ones_like(out)),
            device,
            sizes.warmup,
            sizes.repeats,
        )
        act = saved_bytes(block, x)
        peak = peak_backward_bytes(block, x, device, act)
    linears = {
        name: KFACLayer(
            name, LayerKind.LINEAR, f"{name}.weight", f"{name}.bias", m.in_features, m.out_features, sizes.seq
        )
        for name, m in block.named_modules()
        if isinstance(m, nn.Linear)
    }
    unit_cost = kfac_unit_cost(linears, KFACConfig(), warmup=sizes.warmup, repeats=sizes.repeats)
    with torch.device(device):  # fxkfac's profiler makes its random captures and factors on the default device
        costs = [unit_cost(name, bs) for name in linears]
    return {
        "bs": bs,
        "time_f": 1e3 * time_f,
        "time_b": 1e3 * time_b,
        "time_kron": 1e3 * sum(c.curv for c in costs),
        "time_inv": 1e3 * sum(c.inv for c in costs),
        "time_prec": 1e3 * sum(c.prec for c in costs),
        "mem_param": sum(p.numel() * p.element_size() for p in block.parameters()) / MIB,
        "mem_act": act / MIB,
        "mem_peak_err": peak / MIB,
        "mem_save_err": sum(c.part("B").capture_bytes for c in costs) / MIB,
        "mem_kron": sum(c.factor_bytes for c in costs) / MIB,
    }


def part_profile(sizes: Sizes, batch_sizes: list[int], device: torch.device, dtype: torch.dtype, out: Path) -> dict:
    """Each BERT block's rows, written as `<model>_<device>.json` under `out`, and the table."""
    name, files = device_name(device), {}
    table = Table(
        title=f"2. BERT blocks on {name} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}"
        f"), seq {sizes.seq}, {dtype} autocast, ms and MiB per block; median of {sizes.repeats} after "
        f"{sizes.warmup} warm-up ({'CUDA events' if device.type == 'cuda' else 'wall clock'})"
    )
    for col in ("model", *PIPEFISHER_COLUMNS):
        table.add_column(col, justify="left" if col == "model" else "right")
    profiles: dict[str, list[dict[str, float]]] = {}
    for model in sizes.block_shapes:
        rows = [block_row(model, bs, sizes, device, dtype) for bs in batch_sizes]
        profiles[model] = rows
        path = out / f"{model}_{name}.json"
        path.write_text(
            block_profile_json(
                rows,
                model=model,
                device=name,
                device_full_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                dtype=str(dtype).removeprefix("torch."),
                seq_len=sizes.seq,
                block={"transformers.BertLayer": sizes.block_shapes[model]},
                torch=torch.__version__,
                measured=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                by="benchmarks/gpu_check.py",
            )
        )
        files[model] = str(path)
        for r in rows:
            table.add_row(model, *(f"{r[c]:.0f}" if c == "bs" else f"{r[c]:.3g}" for c in PIPEFISHER_COLUMNS))
    console.print(table)
    return {"device": name, "files": files, "rows": profiles}


# ----------------------------------------------------------------------------------------------------- 3. plan


def part_plan(sizes: Sizes, profile: dict, batch_sizes: list[int], time_limit: float) -> dict:
    """The paper's configurations (paper_configs.CONFIGS; --smoke: the first) planned on the written profiles, at
    micro-batch 32 or the largest measured: paper_configs' own planning, table and checks."""
    device = profile["device"]
    source = str(Path(next(iter(profile["files"].values()))).parent / f"{{model}}_{device}.json")
    bs = 32 if 32 in batch_sizes else max(batch_sizes)
    configs = [dataclasses.replace(c, micro_batch_size=bs) for c in sizes.plan_configs]
    results = paper_configs.plan_configs(configs, source, time_limit=time_limit)
    paper_configs.render(
        results, 0.0, 1, paper_configs.StepBarrier.WORLD, paper_configs.ProfileLayers.BLOCK, console, source
    )
    verdict = paper_configs.checks(results, 0.0)
    console.print(verdict)
    return {"source": source, "micro_batch_size": bs, "results": results, "checks": verdict}


# ---------------------------------------------------------------------------------------------- 4. kfac-pytorch


def kfac_pytorch_import(wheel: Path | None) -> str | None:
    """Make kfac-pytorch importable (install `wheel`, without its dependencies, into a temporary folder on
    sys.path): None when it is, else why it is not."""
    if wheel is not None:
        target = tempfile.mkdtemp(prefix="kfac-pytorch-")
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", target]
        done = subprocess.run([*pip, str(wheel)], capture_output=True, text=True)
        if done.returncode != 0:
            return f"installing {wheel} failed: {done.stderr.strip().splitlines()[-1:]}"
        sys.path.insert(0, target)
    if kpc.kfac_pytorch_available():
        return None
    if wheel is not None:
        return f"{wheel} installed, but `import kfac` (gpauloski's KFACPreconditioner) still fails"
    return (
        "kfac-pytorch is not importable and no --kfac-pytorch-wheel was given (it is not on PyPI; build one with "
        "`pip wheel --no-deps -w DIR <checkout of github.com/gpauloski/kfac-pytorch>`)"
    )


def part_compare(sizes: Sizes, device: torch.device, wheel: Path | None) -> dict:
    """fxkfac's and kfac-pytorch's K-FAC steps on the device, kfac_pytorch_compare's way (eager, refreshed every
    step, interleaved); only fxkfac's when kfac-pytorch cannot be imported (said in a line and the JSON)."""
    missing = kfac_pytorch_import(wheel)
    if missing is not None:
        console.print(f"[bold]4. kfac-pytorch skipped[/bold]: {missing}; fxkfac's side runs alone")
    kpc._quiet()
    sides: dict[kpc.Config, dict[str, Callable[[], None]]] = {}
    for kind in sizes.compare_models:
        for method in sizes.compare_methods:
            pair = {"fxkfac": kpc.fxkfac_step(kind, method, None, device=str(device))}
            if missing is None:
                pair["kfac-pytorch"] = kpc.kfac_pytorch_step(kind, method, device=str(device))
            sides[(kind, method, "one device")] = pair
    args = argparse.Namespace(warmup=sizes.compare_warmup, rounds=sizes.compare_rounds, steps=sizes.compare_steps)
    result = kpc.measure(sides, args, sync=lambda: sync(device))
    table = Table(
        title=f"4. K-FAC step on {device_name(device)}, fxkfac against kfac-pytorch (both eager, refresh every "
        f"step), median of {args.rounds}x{args.steps} after {args.warmup} warm-up"
    )
    for col in ("model", "method", "fxkfac ms", "kfac-pytorch ms", "fxkfac / kfac-pytorch"):
        table.add_column(col, justify="left" if col in ("model", "method") else "right")
    for row in result["rows"]:
        table.add_row(
            row["model"],
            row["method"],
            f"{row['fxkfac_ms']:.2f}",
            "-" if row["ratio"] is None else f"{row['kfac_pytorch_ms']:.2f}",
            "-" if row["ratio"] is None else f"{row['ratio']:.2f}",
        )
    console.print(table)
    return {"kfac_pytorch": missing is None, "skipped_because": missing, **result}


# ----------------------------------------------------------------------------------------------------- driver


@contextmanager
def part(name: str, report: dict, errors: dict) -> Iterator[None]:
    """Run one part: its seconds into report['wall_s'], an exception it raises into `errors` (printed, not
    raised: the other parts still run)."""
    begin = time.perf_counter()
    try:
        yield
    except Exception as e:  # a part that fails is a finding of the check; the rest still runs
        errors[name] = _error(e)
        console.print(f"[bold red]{name} failed[/bold red]:\n{errors[name]}")
    report["wall_s"][name] = round(time.perf_counter() - begin, 1)


def failed_checks(report: dict) -> list[str]:
    """The checks that did not hold: a family that failed to train or whose loss was non-finite or did not
    decrease, a plan off its lower bound."""
    bad = [
        f"train {r['family']}: {what}"
        for r in report.get("train", {}).get("rows", [])
        for what, ok in (
            ("failed", "error" not in r),
            ("non-finite loss", r.get("finite", True)),
            ("loss did not decrease", r.get("decreased", True)),
        )
        if not ok
    ]
    at_bound = report.get("plan", {}).get("checks", {}).get("cpsat_at_lower_bound", {})
    return bad + [f"plan {name}: no CP-SAT plan at the lower bound" for name, ok in at_bound.items() if not ok]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out"), help="where files go")
    parser.add_argument("--smoke", action="store_true", help="every part tiny on the CPU (no CUDA needed)")
    parser.add_argument("--backend", default=None, help="torch.compile backend of part 1 (default: inductor; "
                        "--smoke: eager)")  # fmt: skip
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="micro-batches profiled "
                        "(default 8 16 32; --smoke 4)")  # fmt: skip
    parser.add_argument("--plan-time-limit", type=float, default=None, help="CP-SAT seconds per configuration "
                        "(default 10; --smoke 1)")  # fmt: skip
    parser.add_argument("--kfac-pytorch-wheel", type=Path, default=None, help="a kfac-pytorch wheel to install")
    parser.add_argument("--parts", nargs="+", default=["train", "profile", "plan", "kfac-pytorch"])
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check needs a CUDA device (torch.cuda.is_available() is False); --smoke runs every part tiny on "
              "the CPU", file=sys.stderr)  # fmt: skip
        return 2
    sizes, device = (SMOKE, torch.device("cpu")) if args.smoke else (FULL, torch.device("cuda"))
    backend = args.backend if args.backend is not None else (None if args.smoke else "inductor")
    batch_sizes = args.batch_sizes or ([4] if args.smoke else [8, 16, 32])
    time_limit = args.plan_time_limit or (1.0 if args.smoke else 10.0)
    dtype = torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "gpu_check",
        "smoke": args.smoke,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "autocast_field": AUTOCAST_FIELD,
        "wall_s": {},
    }
    errors: dict[str, str] = {}
    if "train" in args.parts:
        with part("train", report, errors):
            report["train"] = part_train(sizes, device, dtype, backend)
    if "profile" in args.parts:
        with part("profile", report, errors):
            report["profile"] = part_profile(sizes, batch_sizes, device, dtype, args.out)
    if "plan" in args.parts and "profile" in report:
        with part("plan", report, errors):
            report["plan"] = part_plan(sizes, report["profile"], batch_sizes, time_limit)
    if "kfac-pytorch" in args.parts:
        with part("kfac-pytorch", report, errors):
            report["kfac_pytorch"] = part_compare(sizes, device, args.kfac_pytorch_wheel)
    report["errors"] = errors
    report["failed_checks"] = failed_checks(report)
    line = json.dumps(report, default=str)
    (args.out / "gpu_check.json").write_text(line + "\n")
    print(line)
    return 1 if errors or report["failed_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
