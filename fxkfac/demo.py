"""`fxkfac demo`: PipeFisher against the plain AdamW pipeline on the embedded default, over local processes."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fxkfac.config import KFACConfig, PipelineOptions, PlanOptions, member_of
from fxkfac.errors import ConfigError
from fxkfac.launch import RankContext, launch
from fxkfac.models import LMConfig, TinyBertConfig
from fxkfac.planner.validate import parse_plan

if TYPE_CHECKING:
    from fxkfac.muon.config import MuonConfig
    from fxkfac.shampoo.config import ShampooConfig, SOAPConfig

__all__ = [
    "BaseOptimizer",
    "RunSpec",
    "DemoConfig",
    "Curve",
    "DemoResult",
    "default_runs",
    "run_demo",
    "plan_view",
    "reach",
    "lr_at",
]

log = logging.getLogger(__name__)

DEMO_KFAC = KFACConfig(damping=1e-2, factor_decay=0.95, kl_clip=1e-2, skip_vocab_head=False)
"""K-FAC settings of the demo and of benchmarks/pipefisher_convergence.py (which documents how they were chosen):
damping 1e-2, running average 0.95, KL-clip 1e-2, the MLM head preconditioned too."""
DEMO_LR = 8e-3
"""AdamW's learning rate in the demo, for both runs: the best of the benchmark's AdamW sweep at batch 128."""


class BaseOptimizer(StrEnum):
    """The optimizer a demo run steps with: AdamW (betas 0.9/0.999, weight decay 0.01), SGD with momentum 0.9, or
    plain SGD (the base of a family that makes the whole update direction)."""

    ADAMW = "adamw"
    SGD = "sgd"
    PLAIN_SGD = "plain-sgd"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """One training run: a name, the preconditioner (None: the plain pipeline), the base optimizer, its peak
    learning rate and schedule (`lr_at`), and optionally its own seed and plan file."""

    name: str
    preconditioner: KFACConfig | ShampooConfig | SOAPConfig | MuonConfig | None = None
    """The family's hyperparameters (`fxkfac.compile(preconditioner=...)`); None trains the plain pipeline."""
    optimizer: BaseOptimizer | None = None
    """The base optimizer (its text accepted); None: the family's own base, plain SGD for a family that makes the
    whole update direction (Shampoo, SOAP, Muon: compile refuses anything else), AdamW otherwise (the plain pipeline;
    PipeFisher's K-FAC over AdamW)."""
    lr: float = 1e-3
    """Peak learning rate."""
    warmup_steps: int = 0
    """Linear warm-up to `lr` over this many steps."""
    cosine: bool = False
    """Cosine decay from `lr` after the warm-up to 0 at the run's last step (needs `DemoConfig.steps`)."""
    seed: int | None = None
    """Model initialization and training batches; None: `DemoConfig.seed` (validation always uses the config's)."""
    plan: str | None = None
    """A plan file for the preconditioner (refused when made for another graph, mesh or schedule); None:
    plan="auto" (profile on rank 0, CP-SAT) by the first run of this preconditioner config in the launch, and
    that Plan reused by every later run of the same config, so runs that differ in lr or seed share one plan."""
    planned: bool = True
    """False: no plan (`fxkfac.compile(plan=None)`), the preconditioner's work runs in each stage's own step, on the
    critical path."""

    def __post_init__(self) -> None:
        if self.optimizer is not None:
            optimizer = member_of(BaseOptimizer, self.optimizer, f"run {self.name!r}: optimizer")
            object.__setattr__(self, "optimizer", optimizer)
        if not self.lr > 0 or self.warmup_steps < 0:
            raise ConfigError(
                f"run {self.name!r}: lr must be > 0 and warmup_steps >= 0, got lr={self.lr}, "
                f"warmup_steps={self.warmup_steps}"
            )
        if self.plan is not None and not self.planned:
            raise ConfigError(f"run {self.name!r}: a plan file was given but planned=False; drop one of them")

    @property
    def base(self) -> BaseOptimizer:
        """The base optimizer this run trains with (`optimizer`, or the family's default)."""
        if self.optimizer is not None:
            return self.optimizer
        if self.preconditioner is None:
            return BaseOptimizer.ADAMW
        from fxkfac.families import family_of

        return BaseOptimizer.PLAIN_SGD if family_of(self.preconditioner).full_direction else BaseOptimizer.ADAMW

    def make_optimizer(self) -> Callable[[list[Any]], Any]:
        """The optimizer factory `fxkfac.compile` takes."""
        import torch

        lr, kind = self.lr, self.base
        if kind is BaseOptimizer.ADAMW:
            return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
        if kind is BaseOptimizer.PLAIN_SGD:
            return lambda params: torch.optim.SGD(params, lr=lr)
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)

    def lr_at(self, step: int, steps: int) -> float:
        """This run's learning rate at 0-based step `step` of `steps` (`lr_at`)."""
        return lr_at(step, self.lr, steps=steps, warmup=self.warmup_steps, cosine=self.cosine)


def lr_at(step: int, lr: float, *, steps: int, warmup: int = 0, cosine: bool = False) -> float:
    """The learning rate of 0-based optimizer step `step` in a run of `steps` steps with peak `lr`: linear warm-up
    (lr * (step + 1) / warmup) over the first `warmup` steps, then `lr`, or with `cosine` lr * (1 + cos(pi * p)) / 2
    where p = (step - warmup) / (steps - warmup) goes from 0 after the warm-up to 1 at the end of the run."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if not cosine:
        return lr
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """Sizes of a demo or benchmark run; every rank derives the same data and models from it."""

    stages: int = 2
    """Pipeline stages D (processes per replica)."""
    dp: int = 1
    """Data-parallel replicas W; D * W local processes are launched."""
    schedule: str = "1f1b"
    microbatches: int = 4
    """Micro-batches N per replica per step."""
    steps: int = 200
    """Optimizer steps per run (an upper bound when `seconds` is set)."""
    seconds: float | None = None
    """Train each run for this much wall time (rank 0's clock, evaluation excluded) instead of `steps`."""
    batch_size: int = 128
    """Global mini-batch (sequences); divisible by N * W."""
    seq_len: int = 64
    model: LMConfig = field(default_factory=lambda: TinyBertConfig(max_len=64))
    """The model and so the task: TinyBert's masked bytes (the default) or GPT-2's next byte (`ByteGPT2Config`)."""
    corpus_bytes: int = 2_000_000
    eval_every: int = 25
    """Validation loss every this many steps (and after the last)."""
    eval_batches: int = 4
    """Validation batches of `batch_size` sequences (fixed windows and masks), the same for every run."""
    seed: int = 0
    plan_time_limit_s: float = 10.0
    plan_max_overhead: float | None = None
    """How much the planner may stretch the step for K-FAC work that fits no bubble (0: bubbles only; None: the
    bubbles when they hold the work, else the least stretch that places it)."""
    timeout_s: float = 900.0
    runs: tuple[RunSpec, ...] = ()
    """What to train, in order; `default_runs()` when empty."""

    def __post_init__(self) -> None:
        if self.stages < 2 or self.dp < 1:
            raise ConfigError(f"the demo needs stages >= 2 and dp >= 1, got stages={self.stages}, dp={self.dp}")
        if self.steps < 1 or self.microbatches < 1 or self.eval_every < 1:
            raise ConfigError("steps, microbatches and eval_every must be >= 1")
        if self.batch_size % (self.microbatches * self.dp):
            raise ConfigError(
                f"batch size {self.batch_size} is not divisible by microbatches x dp = "
                f"{self.microbatches} x {self.dp}; pick microbatches and dp whose product divides it"
            )
        if self.seq_len > self.model.max_len:
            raise ConfigError(f"seq_len {self.seq_len} exceeds the model's max_len {self.model.max_len}")
        if self.seconds is not None and not self.seconds > 0:
            raise ConfigError(f"seconds must be > 0, got {self.seconds}")
        if self.seconds is not None and any(r.cosine for r in self.runs):
            raise ConfigError("cosine decay needs the run's length in steps; set steps instead of seconds")

    @property
    def world(self) -> int:
        """Processes to launch: D * W."""
        return self.stages * self.dp

    def run_specs(self) -> tuple[RunSpec, ...]:
        """The runs to train (the defaults when none are given)."""
        return self.runs or default_runs()


def default_runs() -> tuple[RunSpec, ...]:
    """PipeFisher (K-FAC in the bubbles, over AdamW) and the plain AdamW pipeline at the same learning rate."""
    return (
        RunSpec(name="PipeFisher", optimizer=BaseOptimizer.ADAMW, lr=DEMO_LR, preconditioner=DEMO_KFAC),
        RunSpec(name="AdamW", optimizer=BaseOptimizer.ADAMW, lr=DEMO_LR),
    )


@dataclass(frozen=True)
class Curve:
    """What one run did: evaluation points (step, train seconds, validation loss), the train losses, totals."""

    name: str
    points: tuple[tuple[int, float, float], ...]
    train_losses: tuple[float, ...]
    seconds: float
    plan_json: str | None = None

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return len(self.train_losses)

    @property
    def final_val(self) -> float:
        """Validation loss after the last step."""
        return self.points[-1][2]

    @property
    def step_time(self) -> float:
        """Mean seconds per step."""
        return self.seconds / max(1, self.steps)


@dataclass(frozen=True)
class DemoResult:
    """The curves of every run (in the order of the config's runs) and the plan PipeFisher used."""

    curves: tuple[Curve, ...]

    def curve(self, name: str) -> Curve:
        """The curve of the run called `name`."""
        return next(c for c in self.curves if c.name == name)


def reach(curve: Curve, target: float) -> tuple[int, float] | None:
    """(steps, train seconds) at the first evaluation with validation loss <= target, or None."""
    return next(((s, t) for s, t, v in curve.points if v <= target), None)


# ---------------------------------------------------------------- what each rank runs


def _validation(cfg: DemoConfig) -> list[tuple[Any, Any]]:
    """The fixed validation batches (the corpus' held-out files, fixed windows and masks)."""
    from fxkfac.data import lm_data, stdlib_corpus

    _, val = stdlib_corpus(cfg.corpus_bytes)
    data = lm_data(cfg.model.objective, val, seq_len=cfg.seq_len, seed=10_000 + cfg.seed)
    return [data.batch(cfg.batch_size) for _ in range(cfg.eval_batches)]


def _evaluate(trainer: Any, batches: Sequence[tuple[Any, Any]]) -> float:
    """Mean validation loss of the pipelined model over `batches` (`Trainer.evaluate`, collective: the same value on
    every rank)."""
    return sum(trainer.evaluate((x,), y) for x, y in batches) / len(batches)


def _should_stop(cfg: DemoConfig, step: int, elapsed: float) -> bool:
    """Rank 0's decision (shared by broadcast in `seconds` mode) whether the run is over after `step` steps."""
    if step >= cfg.steps or cfg.seconds is None:
        return step >= cfg.steps
    import torch
    import torch.distributed as dist

    flag = torch.tensor([float(elapsed >= cfg.seconds)])
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _compile_run(cfg: DemoConfig, spec: RunSpec, inputs: Any, plans: dict[str, Any]) -> Any:
    """A new model of `cfg.model` compiled for `spec` over the (pp, dp) mesh: the run's own plan, else the one planned
    for its preconditioner earlier in this launch (kept in `plans`), else plan="auto"; no plan without a
    preconditioner or with `spec.planned` False."""
    import fxkfac
    from fxkfac.models import loss_of

    key = repr(spec.preconditioner)
    plan = None if spec.preconditioner is None or not spec.planned else spec.plan or plans.get(key, "auto")
    trainer = fxkfac.compile(
        cfg.model.build(),
        (cfg.stages, cfg.dp),
        plan,
        example_inputs=(inputs,),
        loss_fn=loss_of(cfg.model.objective),
        optimizer=spec.make_optimizer(),
        preconditioner=spec.preconditioner,
        schedule=cfg.schedule,
        microbatches=cfg.microbatches,
        backend=None,
        pipeline=PipelineOptions(timeout=cfg.timeout_s),
        plan_options=PlanOptions(time_limit_s=cfg.plan_time_limit_s, max_overhead=cfg.plan_max_overhead),
    )
    if trainer.plan is not None and spec.plan is None:
        plans.setdefault(key, trainer.plan)
    return trainer


def _train_run(
    ctx: RankContext, cfg: DemoConfig, spec: RunSpec, val: Sequence[tuple[Any, Any]], plans: dict[str, Any]
) -> Curve:
    """Compile one run over the (pp, dp) mesh, train it, evaluate every `eval_every` steps; rank 0 reports.
    `plans` holds the Plan of each preconditioner config planned so far in this launch (see `RunSpec.plan`)."""
    import torch

    from fxkfac.data import lm_data, stdlib_corpus

    seed = cfg.seed if spec.seed is None else spec.seed
    train, _ = stdlib_corpus(cfg.corpus_bytes)
    data = lm_data(cfg.model.objective, train, seq_len=cfg.seq_len, seed=seed)
    torch.manual_seed(seed)
    inputs, targets = data.batch(cfg.batch_size)
    trainer = _compile_run(cfg, spec, inputs, plans)
    plan_json = trainer.plan.to_json(indent=None) if trainer.plan is not None and ctx.rank == 0 else None
    if plan_json is not None:
        ctx.report(("plan", spec.name, plan_json))
    points = [(0, 0.0, _evaluate(trainer, val))]
    losses: list[float] = []
    elapsed, step = 0.0, 0
    while True:
        began = time.perf_counter()
        for group in trainer.optimizer.param_groups if trainer.optimizer is not None else ():
            group["lr"] = spec.lr_at(step, cfg.steps)
        losses.append(trainer.step((inputs,), targets))
        elapsed += time.perf_counter() - began
        step += 1
        stop = _should_stop(cfg, step, elapsed)
        if ctx.rank == 0:
            ctx.report(("step", spec.name, step, losses[-1], elapsed))
        if stop or step % cfg.eval_every == 0:
            points.append((step, elapsed, _evaluate(trainer, val)))
            if ctx.rank == 0:
                ctx.report(("eval", spec.name, step, elapsed, points[-1][2]))
        if stop:
            break
        inputs, targets = data.batch(cfg.batch_size)
    return Curve(spec.name, tuple(points), tuple(losses), elapsed, plan_json)


def demo_rank(ctx: RankContext, cfg: DemoConfig) -> tuple[Curve, ...] | None:
    """The body of every launched rank: train each run in turn; rank 0 returns the curves."""
    import warnings

    warnings.filterwarnings("ignore")  # torch.export chatter; errors still raise
    val = _validation(cfg)
    plans: dict[str, Any] = {}
    curves = tuple(_train_run(ctx, cfg, spec, val, plans) for spec in cfg.run_specs())
    return curves if ctx.rank == 0 else None


# ---------------------------------------------------------------- the launching process


class _Display:
    """Rich progress bars per run, and the plan view when rank 0 reports the plan."""

    def __init__(self, cfg: DemoConfig, console: Console, show_plan: bool) -> None:
        self.cfg, self.console, self.show_plan = cfg, console, show_plan
        self.progress = Progress(
            TextColumn("{task.description:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.tasks: dict[str, Any] = {}
        self.last_val: dict[str, float] = {}
        self.shown: set[str] = set()

    def _task(self, name: str) -> Any:
        if name not in self.tasks:
            total = self.cfg.steps if self.cfg.seconds is None else math.ceil(self.cfg.seconds)
            self.tasks[name] = self.progress.add_task(name, total=total, info="compiling")
        return self.tasks[name]

    def __call__(self, rank: int, event: Any) -> None:
        kind, name, *rest = event
        if kind == "plan":
            self._task(name)
            if self.show_plan and rest[0] not in self.shown:  # a plan reused by later runs is shown once
                self.shown.add(rest[0])
                self.progress.console.print(plan_view(rest[0], self.console.width))
            return
        task = self._task(name)
        if kind == "step":
            step, loss, elapsed = rest
            done = step if self.cfg.seconds is None else min(elapsed, self.cfg.seconds)
            val = self.last_val.get(name)
            info = f"loss {loss:.3f}" + ("" if val is None else f"  val {val:.3f}") + f"  {elapsed:.1f}s train"
            self.progress.update(task, completed=done, info=info)
        elif kind == "eval":
            self.last_val[name] = rest[2]


def run_demo(cfg: DemoConfig, console: Console | None = None, *, show_plan: bool = True) -> DemoResult:
    """Launch D * W local processes, train every run, and return the curves (progress drawn on `console`)."""
    console = console or Console()
    display = _Display(cfg, console, show_plan)
    with display.progress:
        values = launch(demo_rank, cfg.world, cfg, timeout=cfg.timeout_s, on_event=display)
    curves = values[0]
    if curves is None:
        raise AssertionError("rank 0 returned no curves")
    return DemoResult(tuple(curves))


def plan_view(plan_json: str, width: int = 100) -> Any:
    """The plan as `fxkfac plan --show` draws it (summary and planned timeline)."""
    from fxkfac.plan_view import render_plan

    plan = parse_plan(plan_json)
    return render_plan(
        plan,
        width=width,
        title=f"plan='auto': {plan.problem.schedule} D={plan.problem.D} N={plan.problem.N} W={plan.problem.W}",
    )
