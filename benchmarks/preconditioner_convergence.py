"""AdamW, K-FAC (PipeFisher), Shampoo, SOAP and Muon through the pipeline: wall time to AdamW's best validation loss.

Two models of the same sizes (4 blocks, hidden 64, 4 heads, FFN 256, 64-byte windows), chosen by `--model`, on the
CPython standard library's own source (fxkfac.data: every 10th file held out for validation):
- `tinybert` (the default): the embedded TinyBertMLM (pre-LN encoder) as a masked LM (fixed masks);
- `gpt2`: a Hugging Face GPT2LMHeadModel from a config (no weights downloaded; head tied to the token embedding)
  trained on next-byte prediction (fxkfac.models.ByteGPT2Config).
Both train over 2 pipeline stages (2 local processes over gloo, one thread each, 1F1B, 4 micro-batches) through
`fxkfac.demo`'s launcher, every run in one launch. The families (`FAMILIES`, extended by adding a `Family`):

- AdamW (weight decay 0.01): the plain pipeline;
- K-FAC: PipeFisher, K-FAC preconditioning AdamW's gradients (`DEMO_KFAC`), planned into the bubbles;
- Shampoo, SOAP and Muon: they make the whole update direction, so the base optimizer is
  `torch.optim.SGD(params, lr)`; their root inverses / eigenbases / Newton-Schulz iterations planned into the
  bubbles (Muon's embeddings, output head and vectors step by AdamW inside the family).

Every run warms the learning rate up linearly over `--warmup` steps and decays it by a cosine to 0 at the
last step (`fxkfac.demo.lr_at`). Each family is swept over `--lrs-per-family` peak learning rates (a factor
2 apart around its `Family.center_lr`, or `--center-lr FAMILY=LR`) and trained with `--seeds` seeds (model
initialization and batch order; the validation set is fixed); runs are interleaved (seed, lr, family) so
drifting machine load hits all families alike.

Plans are deterministic within a launch: plan="auto" (the ranks profile, CP-SAT) runs once per family, on
its first run, and that same Plan is reused by every later run of the family (`fxkfac.demo.RunSpec.plan`).
The plans are written to `--plan-dir` (one file per model and family); `--reuse-plans` loads them from there
instead of planning, so a second invocation repeats the first one's plans exactly. `--unplanned FAMILY...`
(default none) trains those families without a plan (plan=None: their per-step and refresh work in each
stage's own step, on the critical path, as torch.optim.Muon in a pipeline would run).

Report: for each family, its best learning rate (lowest final validation loss, mean over seeds; flagged
when it lies at an edge of the sweep), and on the seed-mean curve at that lr the steps and train wall time
(rank 0's step loop, evaluation excluded) to first reach the best AdamW run's final validation loss
(mean over seeds), and the ratio to AdamW's own time to it (goal <= 0.6 for the best family). Prints rich
tables and one JSON line; saves validation loss against wall time as PNG.

    python benchmarks/preconditioner_convergence.py [--model tinybert|gpt2] [--steps 250] [--batch-size 128]
        [--seeds 2] [--lrs-per-family 3] [--families AdamW K-FAC Shampoo SOAP Muon] [--center-lr K-FAC=0.01]
        [--unplanned Muon] [--png out/preconditioner_convergence.png]

Wall times on a shared machine are noisy; the ratios compare runs interleaved in the same launch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from pipefisher_convergence import plot_losses
from rich.console import Console
from rich.table import Table

from fxkfac.demo import DEMO_KFAC, Curve, DemoConfig, RunSpec, run_demo
from fxkfac.models import ByteGPT2Config, LMConfig, TinyBertConfig

SEQ_LEN = 64
PRECONDITION_FREQUENCY = 10


class Model(StrEnum):
    """The model and task trained: TinyBert on masked bytes, or a GPT-2 from a Hugging Face config on next bytes."""

    TINYBERT = "tinybert"
    GPT2 = "gpt2"


MODELS: dict[Model, LMConfig] = {
    Model.TINYBERT: TinyBertConfig(max_len=SEQ_LEN),
    Model.GPT2: ByteGPT2Config(hidden=64, heads=4, ffn=256, layers=4, max_len=SEQ_LEN),
}
"""The same sizes for both: 4 blocks, hidden 64, 4 heads, FFN 256, 64-byte windows (GPT-2's head tied to its
token embedding, as GPT-2's)."""
TASKS = {Model.TINYBERT: "stdlib masked bytes, TinyBert", Model.GPT2: "stdlib next byte, GPT-2"}
YLABELS = {Model.TINYBERT: "masked bytes", Model.GPT2: "next byte"}


def _shampoo() -> Any:
    """Distributed Shampoo's AdamW-like setting (its README): beta1 0.9 filters the gradient, so no extra momentum;
    L and R averaged with beta2 0.999; Adam grafting (beta2 0.999, eps 1e-8) takes Adam's step length per block, so
    the learning rate is on AdamW's scale; decoupled weight decay 0.01 as AdamW's. eps 1e-12 is the paper's default
    (grafting fixes the step's length, so eps only bounds the condition). Blocks of at most 128: hidden-64 sides are
    whole, the 256-wide FFN and the byte head are cut, which keeps each eigh small enough for the bubbles. Roots every
    10 steps without a plan (a plan chooses its own period per stage). Preconditioning starts at step 0, not the
    paper's step 10: plan="auto" profiles a decomposition on a fresh state, where a later start makes the family
    decline it, so the planner would see free roots (fxkfac/profiler.py: "times as 0") and overfill the bubbles."""
    from fxkfac.shampoo.config import ShampooConfig

    return ShampooConfig(
        betas=(0.9, 0.999),
        epsilon=1e-12,
        momentum=0.0,
        use_nesterov=False,
        weight_decay=0.01,
        use_decoupled_weight_decay=True,
        grafting_type="adam",
        grafting_beta2=0.999,
        grafting_epsilon=1e-8,
        max_preconditioner_dim=128,
        precondition_frequency=PRECONDITION_FREQUENCY,
        start_preconditioning_step=0,
    )


def _soap() -> Any:
    """The SOAP paper's defaults: betas (0.95, 0.95), shampoo_beta 0.95, eps 1e-8, weight decay 0.01, bias
    correction, eigenbases refreshed every 10 steps by one QR power iteration, 1-D parameters by plain Adam, no
    dimension merging; its 10000-wide blocks mean whole factors: 1024 covers every side here."""
    from fxkfac.shampoo.config import SOAPConfig

    return SOAPConfig(
        betas=(0.95, 0.95),
        shampoo_beta=0.95,
        epsilon=1e-8,
        weight_decay=0.01,
        precondition_frequency=PRECONDITION_FREQUENCY,
        max_preconditioner_dim=1024,
        basis_method="qr",
        precondition_1d=False,
        use_merge_dims=False,
    )


def _muon(model: Model) -> Any:
    """torch.optim.Muon's defaults (momentum 0.95, Nesterov, 5 quintic Newton-Schulz steps in bfloat16, the original
    sqrt(max(1, rows/cols)) lr adjustment) on the hidden matrices, AdamW (betas 0.9/0.999, eps 1e-8, weight decay
    0.01) on embeddings, the output head and vectors, as Muon prescribes. Decoupled weight decay 0.01 on the
    matrices as on every family (torch's default is 0.1). Muon's lr is the base lr (center 0.02, Muon's practice);
    AdamW's part steps at `adamw_lr_ratio` times it, set so that at the sweep's center it is AdamW's own center."""
    from fxkfac.muon.config import MuonConfig

    return MuonConfig(
        weight_decay=0.01,
        adamw_weight_decay=0.01,
        adamw_lr_ratio=FAMILIES["AdamW"].center_lr[model] / FAMILIES["Muon"].center_lr[model],
    )


@dataclass(frozen=True)
class Family:
    """A benchmarked optimizer: its name, the middle of its learning-rate sweep per model (the peak lr of the
    warm-up/cosine schedule) and its preconditioner for a model (`make(model)`; None trains the plain AdamW
    pipeline). A family that makes the whole update direction steps by plain SGD(lr) (`fxkfac.demo.RunSpec.base`)."""

    name: str
    center_lr: dict[Model, float]
    make: Callable[[Model], Any]


def _both(tinybert: float, gpt2: float) -> dict[Model, float]:
    return {Model.TINYBERT: tinybert, Model.GPT2: gpt2}


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("AdamW", _both(8e-3, 2e-3), lambda model: None),
        Family("K-FAC", _both(1.6e-2, 4e-3), lambda model: DEMO_KFAC),
        Family("Shampoo", _both(1.6e-2, 4e-3), lambda model: _shampoo()),
        Family("SOAP", _both(1.6e-2, 4e-3), lambda model: _soap()),
        Family("Muon", _both(2e-2, 2e-2), _muon),
    )
}
"""The families, in table order. AdamW (weight decay 0.01) is the plain pipeline; K-FAC is PipeFisher, K-FAC
preconditioning AdamW's gradients (`DEMO_KFAC`), planned into the bubbles; Shampoo, SOAP and Muon make the whole
update direction, their root inverses / eigenbases / Newton-Schulz iterations planned into the bubbles.
TinyBert centers: AdamW's best constant lr at batch 128 was 8e-3 (benchmarks/pipefisher_convergence.py); K-FAC
preconditions AdamW's gradients, Shampoo grafts Adam's step length and SOAP is Adam in a rotated basis, so all share
Adam's lr scale. A first sweep around 8e-3 for all (TinyBert, 100 steps, batch 64, 2 seeds) found AdamW's best at
8e-3 inside its sweep but K-FAC's, Shampoo's and SOAP's at the top edge (1.6e-2), so theirs are centered one factor
2 higher. GPT-2 centers: AdamW's best of 5e-4..8e-3 (100 steps, batch 32, 1 seed) was 2e-3 (GPT-2's 0.02-std
initialization and tied head take a smaller lr); the Adam-scale families one factor 2 higher, as on TinyBert.
Muon's matrices step on their own scale (an orthogonalized update), 0.02 for both."""
STEPS = 250
BATCH_SIZE = 128
SEEDS = 2
LRS_PER_FAMILY = 3
EVAL_EVERY = 25
EVAL_BATCHES = 4
TARGET_RATIO = 0.6


def family_config(family: str, model: Model = Model.TINYBERT) -> Any:
    """The preconditioner of a family for `model` (None: AdamW alone); Shampoo, SOAP and Muon imported when asked."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {tuple(FAMILIES)}")
    return FAMILIES[family].make(model)


def sweep(center: float, n: int) -> tuple[float, ...]:
    """n learning rates a factor 2 apart around `center` (n=3: center/2, center, 2*center)."""
    return tuple(center * 2.0 ** (i - (n - 1) // 2) for i in range(n))


def centers(args: argparse.Namespace) -> dict[str, float]:
    """Each benchmarked family's sweep center: the table's, or the one given by --center-lr FAMILY=LR."""
    given = {}
    for item in args.center_lr:
        family, _, lr = item.partition("=")
        if family not in args.families or not lr:
            raise SystemExit(f"--center-lr {item!r}: expected FAMILY=LR with FAMILY one of {args.families}")
        given[family] = float(lr)
    return {f: given.get(f, FAMILIES[f].center_lr[args.model]) for f in args.families}


@dataclass(frozen=True)
class Run:
    """What a run name stands for."""

    family: str
    lr: float
    seed: int


def plan_path(plan_dir: Path, model: Model, family: str) -> Path:
    """Where a family's plan for `model` is written (the TinyBert plans keep their earlier names)."""
    prefix = "" if model is Model.TINYBERT else f"{model}-"
    return plan_dir / f"{prefix}{family.lower().replace('-', '')}.json"


def runs(args: argparse.Namespace) -> tuple[tuple[RunSpec, ...], dict[str, Run]]:
    """Every (seed, lr index, family) run, interleaved in that order, and what each name stands for."""
    configs = {f: family_config(f, args.model) for f in args.families}
    lrs = {f: sweep(c, args.lrs_per_family) for f, c in centers(args).items()}
    specs, meaning = [], {}
    for seed in range(args.seeds):
        for i in range(args.lrs_per_family):
            for family in args.families:
                lr = lrs[family][i]
                name = f"{family} lr {lr:g} seed {seed}"
                plan, planned = None, family not in args.unplanned
                if args.reuse_plans and planned and configs[family] is not None:
                    plan = str(plan_path(args.plan_dir, args.model, family))
                specs.append(
                    RunSpec(
                        name=name,
                        preconditioner=configs[family],
                        lr=lr,
                        seed=seed,
                        warmup_steps=args.warmup,
                        cosine=True,
                        plan=plan,
                        planned=planned,
                    )
                )
                meaning[name] = Run(family, lr, seed)
    return tuple(specs), meaning


def _mean_curve(curves: list[Curve]) -> list[tuple[int, float, float]]:
    """(step, mean train seconds, mean validation loss) over seeds, evaluation by evaluation."""
    return [
        (pts[0][0], statistics.fmean(p[1] for p in pts), statistics.fmean(p[2] for p in pts))
        for pts in zip(*(c.points for c in curves), strict=True)
    ]


def _reach(points: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    return next(((s, t) for s, t, v in points if v <= target), None)


def summarize(curves: tuple[Curve, ...], meaning: dict[str, Run], args: argparse.Namespace) -> dict[str, Any]:
    """Seed-mean curves per (family, lr); each family's best lr; the target; steps/time to it; ratios."""
    groups: dict[tuple[str, float], list[Curve]] = {}
    for c in curves:
        run = meaning[c.name]
        groups.setdefault((run.family, run.lr), []).append(c)
    sweep_rows = []
    for (family, lr), cs in groups.items():
        mean = _mean_curve(cs)
        sweep_rows.append(
            {
                "family": family,
                "lr": lr,
                "final_val_loss": mean[-1][2],
                "final_val_per_seed": [c.final_val for c in cs],
                "ms_per_step": statistics.fmean(c.step_time for c in cs) * 1e3,
                "seconds": statistics.fmean(c.seconds for c in cs),
                "curve": mean,
            }
        )
    best: dict[str, dict[str, Any]] = {}
    for family in args.families:
        rows = [r for r in sweep_rows if r["family"] == family]
        pick = min(rows, key=lambda r: r["final_val_loss"])
        lrs = sorted(r["lr"] for r in rows)
        edge = (
            None if len(lrs) < 2 else "lowest" if pick["lr"] == lrs[0] else "highest" if pick["lr"] == lrs[-1] else None
        )
        best[family] = {**pick, "edge": edge}
    out: dict[str, Any] = {
        "target_val_loss": None,
        "families": {},
        "sweep": [{k: v for k, v in r.items() if k != "curve"} for r in sweep_rows],
    }
    if "AdamW" not in best:
        return out
    target = best["AdamW"]["final_val_loss"]
    base = _reach(best["AdamW"]["curve"], target)
    assert base is not None  # its own final loss, reached at the last evaluation at the latest
    out["target_val_loss"], out["adamw_seconds"], out["adamw_steps"] = target, base[1], base[0]
    step_s = {f: statistics.median(c.step_time for c in curves if meaning[c.name].family == f) for f in best}
    for family, r in best.items():
        got = _reach(r["curve"], target)
        per_seed = [_reach(list(c.points), target) for c in groups[(family, r["lr"])]]
        steady = None if got is None else got[0] * step_s[family] / (base[0] * step_s["AdamW"])
        out["families"][family] = {
            "best_lr": r["lr"],
            "best_lr_at_edge": r["edge"],
            "final_val_loss": r["final_val_loss"],
            "ms_per_step": r["ms_per_step"],
            "steps_to_target": None if got is None else got[0],
            "seconds_to_target": None if got is None else got[1],
            "time_ratio_to_adamw": None if got is None else got[1] / base[1],
            "seeds_reaching_target": sum(g is not None for g in per_seed),
            "step_ratio_to_adamw": None if got is None else got[0] / base[0],
            "median_ms_per_step": step_s[family] * 1e3,
            "time_ratio_at_median_step": steady,
        }
    ratios = {
        f: r["time_ratio_to_adamw"]
        for f, r in out["families"].items()
        if f != "AdamW" and r["time_ratio_to_adamw"] is not None
    }
    out["best_family"] = min(ratios, key=lambda f: ratios[f]) if ratios else None
    out["best_ratio"] = ratios[out["best_family"]] if ratios else None
    steady = {
        f: r["time_ratio_at_median_step"]
        for f, r in out["families"].items()
        if f != "AdamW" and r["time_ratio_at_median_step"] is not None
    }
    out["best_ratio_at_median_step"] = min(steady.values()) if steady else None
    out["target_ratio"] = TARGET_RATIO
    out["curves"] = {f: r["curve"] for f, r in best.items()}
    return out


def report(summary: dict[str, Any], args: argparse.Namespace, console: Console) -> None:
    """The per-family table at each best lr, then the whole sweep."""
    dash = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
    target = summary["target_val_loss"]
    table = Table(
        title=f"{TASKS[args.model]}, 2 stages 1F1B, batch {args.batch_size}, {args.steps} steps, warm-up "
        f"{args.warmup} + cosine, mean over {args.seeds} seed(s): time to AdamW's best final "
        f"validation loss {dash(target, '{:.4f}')}",
        title_justify="left",
    )
    for col in (
        "family",
        "best lr",
        "final val",
        "ms/step",
        "steps to target",
        "s to target",
        "time / AdamW",
        "steps / AdamW",
        "median ms/step",
        "time / AdamW at median",
        "seeds reaching",
    ):
        table.add_column(col, justify="left" if col == "family" else "right", no_wrap=col == "family")
    for family, r in summary["families"].items():
        edge = f" ({r['best_lr_at_edge']} of sweep!)" if r["best_lr_at_edge"] else ""
        table.add_row(
            family + (" (no plan)" if family in args.unplanned else ""),
            f"{r['best_lr']:g}{edge}",
            f"{r['final_val_loss']:.4f}",
            f"{r['ms_per_step']:.1f}",
            dash(r["steps_to_target"], "{}"),
            dash(r["seconds_to_target"], "{:.1f}"),
            dash(r["time_ratio_to_adamw"], "{:.2f}"),
            dash(r["step_ratio_to_adamw"], "{:.2f}"),
            f"{r['median_ms_per_step']:.1f}",
            dash(r["time_ratio_at_median_step"], "{:.2f}"),
            f"{r['seeds_reaching_target']}/{args.seeds}",
        )
    console.print(table)
    console.print(
        "s to target: measured train wall time on the seed-mean curve at the best lr; 'at median': steps "
        "to target x the family's median ms/step over all its runs (less sensitive to load spikes)",
        highlight=False,
    )
    lrs = Table(title="the sweep: final validation loss (mean over seeds; per seed), ms per step", title_justify="left")
    for col in ("family", "peak lr", "final val", "per seed", "ms/step"):
        lrs.add_column(col, justify="left" if col == "family" else "right")
    for r in sorted(summary["sweep"], key=lambda r: (list(FAMILIES).index(r["family"]), r["lr"])):
        lrs.add_row(
            r["family"],
            f"{r['lr']:g}",
            f"{r['final_val_loss']:.4f}",
            " ".join(f"{v:.4f}" for v in r["final_val_per_seed"]),
            f"{r['ms_per_step']:.1f}",
        )
    console.print(lrs)
    edges = [f for f, r in summary["families"].items() if r["best_lr_at_edge"]]
    if edges:
        console.print(
            f"best lr at an edge of the sweep for: {', '.join(edges)} (the optimum may lie outside it)", highlight=False
        )
    if summary.get("best_family"):
        console.print(
            f"best family {summary['best_family']}: {summary['best_ratio']:.2f} of AdamW's wall time to "
            f"the target (goal <= {TARGET_RATIO}; at median step times the best family's ratio is "
            f"{summary['best_ratio_at_median_step']:.2f})",
            highlight=False,
        )
    elif target is not None:
        console.print("no preconditioned family reached AdamW's final validation loss", highlight=False)


def plot(summary: dict[str, Any], path: Path, args: argparse.Namespace) -> None:
    """Validation loss against train wall time: each family at its best lr (seed means), the target dotted."""
    lines = [
        (
            [t for _, t, _ in curve],
            [v for _, _, v in curve],
            f"{family} (lr {summary['families'][family]['best_lr']:g})",
            "--" if family == "AdamW" else "-",
        )
        for family, curve in summary["curves"].items()
    ]
    plot_losses(
        lines,
        summary["target_val_loss"],
        path,
        xlabel="train wall time (s, rank 0, mean over seeds)",
        ylabel=f"validation loss ({YLABELS[args.model]})",
        title=f"{TASKS[args.model]}, 2 stages 1F1B, batch {args.batch_size}, best lr per family",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="global mini-batch (sequences)")
    parser.add_argument("--seeds", type=int, default=SEEDS)
    parser.add_argument("--lrs-per-family", type=int, default=LRS_PER_FAMILY)
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 10%% of --steps)")
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    parser.add_argument("--eval-batches", type=int, default=EVAL_BATCHES)
    parser.add_argument("--model", type=Model, default=Model.TINYBERT, choices=list(Model))
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument(
        "--center-lr", nargs="*", default=[], metavar="FAMILY=LR", help="another sweep center for a family"
    )
    parser.add_argument(
        "--unplanned",
        nargs="*",
        default=[],
        choices=list(FAMILIES),
        help="families trained without a plan (plan=None: their work in each stage's own step, on the critical "
        "path); by default every family is planned",
    )
    parser.add_argument("--plan-dir", type=Path, default=Path("out/preconditioner_convergence_plans"))
    parser.add_argument("--reuse-plans", action="store_true", help="load each family's plan from --plan-dir")
    parser.add_argument("--png", type=Path, default=None, help="default: out/preconditioner_convergence[_gpt2].png")
    args = parser.parse_args()
    if args.warmup is None:
        args.warmup = max(1, args.steps // 10)
    if args.png is None:
        suffix = "" if args.model is Model.TINYBERT else f"_{args.model}"
        args.png = Path(f"out/preconditioner_convergence{suffix}.png")
    if "AdamW" not in args.families:
        parser.error("--families must include AdamW (the baseline)")
    console = Console(width=max(Console().width, 160))
    specs, meaning = runs(args)
    cfg = DemoConfig(
        steps=args.steps,
        eval_every=args.eval_every,
        batch_size=args.batch_size,
        eval_batches=args.eval_batches,
        seq_len=SEQ_LEN,
        model=MODELS[args.model],
        runs=specs,
        timeout_s=3600.0,
    )
    load = os.getloadavg()
    result = run_demo(cfg, console, show_plan=False)
    load_after = os.getloadavg()
    if not args.reuse_plans:
        args.plan_dir.mkdir(parents=True, exist_ok=True)
        for c in result.curves:
            path = plan_path(args.plan_dir, args.model, meaning[c.name].family)
            if c.plan_json is not None and meaning[c.name].seed == 0:
                path.write_text(c.plan_json)
    summary = summarize(result.curves, meaning, args)
    report(summary, args, console)
    console.print(
        f"machine load (1/5/15-min averages) before {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, after "
        f"{load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f} on {os.cpu_count()} cores "
        "(the benchmark itself keeps 2 busy)",
        highlight=False,
    )
    plot(summary, args.png, args)
    console.print(f"wrote {args.png} and the plans under {args.plan_dir}", highlight=False)
    row = {k: v for k, v in summary.items() if k != "curves"}
    print(
        json.dumps(
            {
                "benchmark": "preconditioner_convergence",
                "model": str(args.model),
                "steps": args.steps,
                "batch_size": args.batch_size,
                "seeds": args.seeds,
                "warmup": args.warmup,
                "families": args.families,
                "unplanned": args.unplanned,
                "loadavg": [load, load_after],
                **row,
            }
        )
    )


if __name__ == "__main__":
    main()
