"""Typed configuration of K-FAC and of a compile (frozen dataclasses, validated on entry)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from fxkfac.errors import ConfigError
from fxkfac.planner.problem import Capture, InverseMethod, StepBarrier, Strategy
from fxkfac.planner.problem.strategy import parse_strategy
from fxkfac.planner.search import StreamApply

if TYPE_CHECKING:
    import torch

__all__ = [
    "ActivationCheckpointing",
    "CheckpointMode",
    "KFACConfig",
    "KLClipScope",
    "LossScaling",
    "PipelineOptions",
    "PlanOptions",
    "PROFILE_MARGIN",
    "SplitInverse",
    "SplitMethod",
    "StepAgreement",
]


E = TypeVar("E", bound=StrEnum)


def member_of(kind: type[E], value: Any, where: str) -> E:
    """`value` (a member or its text) as a member of `kind`; else a ConfigError naming `where` and the choices."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in kind)
        raise ConfigError(f"{where} must be one of {choices} ({kind.__name__}), got {value!r}") from None


class KLClipScope(StrEnum):
    """Over which layers the KL-clip's ``sum <P, G>`` runs, and so which ranks a step's end waits for
    ([Note: KL-clip scope] in fxkfac/runtime/step_end.py)."""

    GLOBAL = "global"
    """One nu over every layer of the model, from this step's sum: a world sum ends every step."""
    STAGE = "stage"
    """A nu per pipeline stage over its own layers (all-reduced over the stage's copies only)."""
    STALE = "stale"
    """One nu over every layer, from the last step's sum (its world all-reduce overlaps this step); the first
    step of a run, which has no last step, uses its own sum as GLOBAL does."""

    @property
    def barrier(self) -> StepBarrier:
        """The step barrier the scope makes, as the planner prices it: a world sum ends every step under GLOBAL;
        STAGE and STALE end it over the rank's agreement set alone."""
        return StepBarrier.WORLD if self is KLClipScope.GLOBAL else StepBarrier.AGREEMENT_SET


class StepAgreement(StrEnum):
    """Which ranks agree on skipping a step whose loss or gradients hold NaN/Inf, in a run without a
    preconditioner (a preconditioner's run ends its steps as its KL-clip scope says: `KLClipScope`)."""

    WORLD = "world"
    """Every rank: one world sum of the NaN/Inf flag and the loss ends every step."""
    COPIES = "copies"
    """Each agreement set (the ranks linked by holding copies of one parameter) agrees by itself: no world
    barrier ends a step, and `step()` returns a StepLoss summed in flight. Every copy of a parameter steps or
    skips together; two sets may decide differently ([Note: KL-clip scope] in fxkfac/runtime/step_end.py)."""


class SplitMethod(StrEnum):
    """How a factor's damped inverse is cut into pieces that can run apart (fxkfac/kfac/split_inverse.py)."""

    NEWTON_SCHULZ = "newton-schulz"
    """Newton-Schulz from the previous refresh's inverse, `SplitInverse.iterations` per piece; Cholesky when the
    residual does not fall to `SplitInverse.tolerance` (or there is no previous inverse)."""
    BLOCKS = "blocks"
    """The factor's `SplitInverse.pieces` diagonal blocks, each inverted by Cholesky (an approximation that drops
    the factor's off-block entries, as Shampoo's blocking does)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitInverse:
    """A factor's damped inverse in `pieces` tasks instead of one Cholesky (issue 14: no task larger than a bubble)."""

    method: SplitMethod = SplitMethod.NEWTON_SCHULZ
    pieces: int = 2
    """Tasks per factor (BLOCKS: at most the factor's side)."""
    iterations: int = 1
    """Newton-Schulz iterations per piece (NEWTON_SCHULZ only)."""
    tolerance: float = 1e-3
    """Bound on ||I - (F + gamma I) X||_F, hence on the inverse's relative error, below which Newton-Schulz is
    accepted (NEWTON_SCHULZ only)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", member_of(SplitMethod, self.method, "SplitInverse.method"))
        for name in ("pieces", "iterations"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(f"SplitInverse.{name} must be an int >= 1, got {value!r}")
        if not 0 < self.tolerance < 1:
            raise ConfigError(f"SplitInverse.tolerance must be in (0, 1), got {self.tolerance!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class KFACConfig:
    """Hyperparameters of K-FAC; the semantics are those of DESIGN.md ("K-FAC semantics")."""

    damping: float = 1e-3
    """Tikhonov damping gamma added to the Kronecker factors (split sqrt(gamma) each, or pi-split)."""
    factor_decay: float = 0.95
    """Running average: A <- decay * A + (1 - decay) * A_new (decay weights the old value)."""
    kl_clip: float | None = 1e-3
    """kappa of the KL-clip; None disables clipping."""
    inverse: InverseMethod = InverseMethod.CHOLESKY
    """How factors are inverted: Cholesky of damped factors, or eigendecomposition."""
    pi_damping: bool = False
    """Split damping between A and B by pi = sqrt((tr A / d_A) / (tr B / d_B))."""
    refresh_every: int = 1
    """Curvature and inverses are refreshed every this many steps (a plan overrides it per layer)."""
    skip_layers: tuple[str, ...] = ()
    """Regexes on layer names (module FQNs) that K-FAC leaves to the base optimizer."""
    skip_vocab_head: bool = True
    """Skip a Linear whose output dimension equals the vocabulary size (an LM head)."""
    vocab_size: int | None = None
    """Vocabulary size for `skip_vocab_head`; inferred from the largest embedding when None."""
    capture: Capture = Capture.FUSED
    """Default factor capture when no plan chooses per layer."""
    factor_dtype: str = "float32"
    """dtype the factors are accumulated in."""
    max_cholesky_retries: int = 3
    """Retries with 10x more damping before falling back to float64, then to the previous inverse."""
    split_inverse: SplitInverse | None = None
    """Invert each factor in pieces (Cholesky form only); None: one exact Cholesky per factor."""
    kl_clip_scope: KLClipScope = KLClipScope.GLOBAL
    """The layers and step the KL-clip's sum comes from; STAGE and STALE end a step without a world barrier."""

    def __post_init__(self) -> None:
        if not self.damping > 0:
            raise ConfigError(f"KFACConfig.damping must be > 0, got {self.damping!r}")
        if not 0.0 <= self.factor_decay < 1.0:
            raise ConfigError(f"KFACConfig.factor_decay must be in [0, 1), got {self.factor_decay!r}")
        if self.kl_clip is not None and not self.kl_clip > 0:
            raise ConfigError(f"KFACConfig.kl_clip must be > 0 or None, got {self.kl_clip!r}")
        object.__setattr__(self, "inverse", member_of(InverseMethod, self.inverse, "KFACConfig.inverse"))
        object.__setattr__(self, "capture", member_of(Capture, self.capture, "KFACConfig.capture"))
        if not (isinstance(self.refresh_every, int) and self.refresh_every >= 1):
            raise ConfigError(f"KFACConfig.refresh_every must be an int >= 1, got {self.refresh_every!r}")
        object.__setattr__(
            self, "kl_clip_scope", member_of(KLClipScope, self.kl_clip_scope, "KFACConfig.kl_clip_scope")
        )
        if self.split_inverse is not None and not isinstance(self.split_inverse, SplitInverse):
            raise ConfigError(f"KFACConfig.split_inverse must be a SplitInverse or None, got {self.split_inverse!r}")
        if self.split_inverse is not None and self.inverse != InverseMethod.CHOLESKY:
            raise ConfigError(
                "KFACConfig.split_inverse needs inverse='cholesky' (the pieces are of Cholesky-form "
                f"inverses), got inverse={self.inverse!r}"
            )


class CheckpointMode(StrEnum):
    """Which stages recompute their forward in their backward instead of keeping its activations."""

    OFF = "off"
    """None (a loaded plan that recomputes brings its own stages)."""
    STAGES = "stages"
    """The stages `ActivationCheckpointing.stages` names."""
    AUTO = "auto"
    """The planner's choice under plan="auto": the stages whose recomputation fits the memory budget with the
    shortest step, none when it fits without (planner/search/plan_search.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationCheckpointing:
    """Activation checkpointing: a stage that recomputes keeps only its inputs (and outputs) per micro-batch in
    flight and runs its forward again at the start of each backward (K-FAC captures come from the first forward)."""

    mode: CheckpointMode = CheckpointMode.OFF
    stages: tuple[int, ...] = ()
    """The stages that recompute (global stage indices, as `fxkfac plan --show` numbers them); STAGES only."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", member_of(CheckpointMode, self.mode, "ActivationCheckpointing.mode"))
        stages = self.stages
        if not isinstance(stages, tuple) or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in stages):
            raise ConfigError(f"ActivationCheckpointing.stages must be a tuple of stage indices >= 0, got {stages!r}")
        object.__setattr__(self, "stages", tuple(sorted(set(stages))))
        if (self.mode is CheckpointMode.STAGES) != bool(stages):
            raise ConfigError(
                f"ActivationCheckpointing(mode={self.mode.value!r}) takes "
                + ("the stages that recompute" if self.mode is CheckpointMode.STAGES else "no stages")
                + f", got stages={stages!r}"
            )

    @classmethod
    def of(cls, value: Any) -> ActivationCheckpointing:
        """`value` as a config: one already, a mode or its text ("off", "auto"), or a tuple/list of stages."""
        if isinstance(value, ActivationCheckpointing):
            return value
        if isinstance(value, (tuple, list)):
            return cls(mode=CheckpointMode.STAGES, stages=tuple(value))
        if isinstance(value, str) and value != CheckpointMode.STAGES:
            return cls(mode=member_of(CheckpointMode, value, "PipelineOptions.activation_checkpointing"))
        raise ConfigError(
            "PipelineOptions.activation_checkpointing must be 'off', 'auto', a tuple of stage indices or an "
            f"ActivationCheckpointing, got {value!r}"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScaling:
    """Dynamic loss scaling of a float16 run, with `torch.amp.GradScaler`'s semantics: the loss is multiplied by
    the scale before backward, gradients are divided by it before anything reads them, a step whose gradients
    overflow is skipped and halves the scale, and `growth_interval` steps in a row without one double it."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not self.init_scale > 0:
            raise ConfigError(f"LossScaling.init_scale must be > 0, got {self.init_scale!r}")
        if not self.growth_factor > 1:
            raise ConfigError(f"LossScaling.growth_factor must be > 1, got {self.growth_factor!r}")
        if not 0 < self.backoff_factor < 1:
            raise ConfigError(f"LossScaling.backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise ConfigError(f"LossScaling.growth_interval must be an int >= 1, got {self.growth_interval!r}")


AUTOCAST_DTYPES = ("torch.bfloat16", "torch.float16")
"""The dtypes `PipelineOptions.autocast_dtype` accepts, as `str(dtype)` writes them (config imports no torch:
`fxkfac plan` runs without it)."""


def _is_autocast_dtype(value: Any) -> bool:
    """Whether `value` is torch.bfloat16 or torch.float16 (a torch dtype, not its text)."""
    return type(value).__module__ == "torch" and str(value) in AUTOCAST_DTYPES


"""The dtypes `PipelineOptions.autocast_dtype` accepts."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineOptions:
    """How a mesh runs the model: stage split, virtual stages, timeouts, timeline, NaN/Inf tolerance, progress,
    mixed precision and gradient clipping."""

    virtual_stages: int = 1
    """Stages per pipeline rank for the interleaved schedule (v)."""
    split_points: tuple[str, ...] | None = None
    """Module FQNs where stages 1.. begin; None balances the stages by estimated FLOPs."""
    timeout: float = 120.0
    """Seconds any rank waits for a peer before the run fails with an error naming the instruction."""
    record_timeline: bool = False
    """Record every instruction's start and end (`trainer.trace(path)` writes a Chrome trace)."""
    max_skipped_steps: int | None = 10
    """NaN/Inf steps skipped in a row before NonFiniteError (None: never raise)."""
    progress: bool = False
    """Show step, loss and steps/s on rank 0 after every step: a rich bar when stdout is a terminal, else a log
    line (logger ``fxkfac.progress``) on the first step and every 10 s (fxkfac/progress.py)."""
    step_agreement: StepAgreement = StepAgreement.WORLD
    """Without a preconditioner: whether a world sum ends every step (WORLD) or each agreement set decides
    alone (COPIES). With one, `KFACConfig.kl_clip_scope` decides and this must stay WORLD."""
    activation_checkpointing: ActivationCheckpointing | CheckpointMode | str | tuple[int, ...] = (
        ActivationCheckpointing()
    )
    """Which stages recompute their forward in their backward: "off", a tuple of stage indices, "auto" (the
    planner chooses under plan="auto"'s memory budget) or an ActivationCheckpointing (`checkpointing`)."""
    shape_cache_size: int = 8
    """Input shapes (batch size, sequence length) other than `example_inputs`' whose captured stages are kept: a
    step of a new shape captures the model at it once (fxkfac/shapes.py), the least recently used beyond this many
    is dropped. 0: every step must be shaped like `example_inputs`."""
    autocast_dtype: torch.dtype | None = None
    """Run every stage's forward (and the loss) under `torch.autocast` of this dtype (torch.bfloat16 or
    torch.float16) on the stage's device; backward follows the forward's dtypes, as torch prescribes. Weights,
    optimizer state and every preconditioner statistic stay float32; activations cross stages at this width.
    float16 scales the loss (`loss_scaling`). None: full precision."""
    loss_scaling: LossScaling = LossScaling()
    """The dynamic loss scale of a float16 run (unused otherwise); checkpointed with the trainer."""
    max_grad_norm: float | None = None
    """Clip the gradient to this global L2 norm, taken over every parameter of the model once (replicas and tied
    copies counted once), as `torch.nn.utils.clip_grad_norm_` on one device: after float16's unscaling, before
    the preconditioner. K-FAC's KL-clip (`KFACConfig.kl_clip`) is another bound: it scales the *preconditioned*
    update so that its KL step stays under kappa; both apply, this one to the raw gradient first (the KL-clip's
    sum <P, G> is that of the clipped gradient). Needs a world sum at each step's end (KLClipScope.GLOBAL,
    StepAgreement.WORLD) and, with a preconditioner, one linear in the gradient (K-FAC). None: no clipping."""

    def __post_init__(self) -> None:
        if not (isinstance(self.virtual_stages, int) and self.virtual_stages >= 1):
            raise ConfigError(f"PipelineOptions.virtual_stages must be an int >= 1, got {self.virtual_stages!r}")
        if not self.timeout > 0:
            raise ConfigError(f"PipelineOptions.timeout must be > 0 seconds, got {self.timeout!r}")
        if self.max_skipped_steps is not None and self.max_skipped_steps < 0:
            raise ConfigError(f"PipelineOptions.max_skipped_steps must be >= 0 or None, got {self.max_skipped_steps!r}")
        if not isinstance(self.progress, bool):
            raise ConfigError(f"PipelineOptions.progress must be True or False, got {self.progress!r}")
        if not (isinstance(self.shape_cache_size, int) and self.shape_cache_size >= 0):
            raise ConfigError(f"PipelineOptions.shape_cache_size must be an int >= 0, got {self.shape_cache_size!r}")
        if not isinstance(self.step_agreement, StepAgreement):
            raise ConfigError(
                f"PipelineOptions.step_agreement must be a StepAgreement "
                f"({', '.join(m.name for m in StepAgreement)}), got {self.step_agreement!r}"
            )
        object.__setattr__(self, "activation_checkpointing", ActivationCheckpointing.of(self.activation_checkpointing))
        if self.autocast_dtype is not None and not _is_autocast_dtype(self.autocast_dtype):
            raise ConfigError(
                f"PipelineOptions.autocast_dtype must be torch.bfloat16, torch.float16 or None, got "
                f"{self.autocast_dtype!r}"
            )
        if not isinstance(self.loss_scaling, LossScaling):
            raise ConfigError(f"PipelineOptions.loss_scaling must be a LossScaling, got {self.loss_scaling!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"PipelineOptions.max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")

    @property
    def checkpointing(self) -> ActivationCheckpointing:
        """`activation_checkpointing` as the config it is made into."""
        assert isinstance(self.activation_checkpointing, ActivationCheckpointing), "__post_init__ made it one"
        return self.activation_checkpointing

    @property
    def scales_loss(self) -> bool:
        """True when the run scales its loss (float16)."""
        return str(self.autocast_dtype) == "torch.float16"


PROFILE_MARGIN = 1.2
"""Profiled K-FAC times are planned 20% longer: timed alone (when rank 0 profiled while the others waited) they
ran 10-20% faster than in training, where every rank computes at once (benchmarks/pipefisher_overhead.py), and a
bubble planned full spills every excess onto the critical path. Every rank now profiles at once; the margin stays
until measurements show it can go."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """What `plan="auto"` plans with: a cost source, the step-time allowance, memory and solver limits."""

    costs: Any = None
    """None (profile the stages here), a CostTable, a cost file (.json, .csv, `paper:<model>/<hw>`), or a
    callable `(stage_layers, layers) -> CostTable`."""
    max_overhead: float | None = None
    """How much the step may grow over the plain pipeline to make room for K-FAC (0: bubbles only). None: the
    bubbles alone when they hold the work, else the least growth the planner finds that places it (logged);
    a number is kept to strictly."""
    kfac_margin: float = PROFILE_MARGIN
    """Factor on profiled K-FAC times (only when the costs are profiled here)."""
    memory_budget: int | None = None
    """Bytes per device. None under `plan="auto"`: on a GPU, what rank 0's device reports free when planning
    starts, plus its stages' parameters already there (the plan counts those itself); on CPU, unlimited."""
    time_limit_s: float = 10.0
    """Planning time in seconds: deterministic, a budget of CP-SAT deterministic time converted from it (about
    these seconds on a quiet machine); otherwise the wall-clock limit of the solver."""
    deterministic: bool = True
    """Plan the same way on any load, so two runs of one command train identically (given the same costs:
    profiled costs still vary); False: a wall-clock budget, which a slower machine spends on less search."""
    strategy: Strategy | str | None = None
    """How the copies of a stage share each layer's work (planner/problem/strategy.py): a Strategy or its text
    (``comm-opt``, ``mem-opt``, ``hybrid:0.5``, ``dp-kfac``) forces it on every layer; None or ``auto``: the
    planner chooses (`plan=None`: COMM-OPT)."""
    stream_apply: StreamApply = StreamApply.KEEP_REFRESH
    """When ranks that idle at the step's end precondition the first stage's layers, fed their gradients during
    its last backward (stages run eagerly, `backend=None`) or at its end (compiled stages, whose backward makes every
    gradient at once: the helpers then apply their share beside the owner; docs/STREAMED_APPLY.md): KEEP_REFRESH
    where that shortens the step and costs no refresh (GPipe, 1F1B), SHORTEST_STEP wherever it shortens the step
    (Chimera too, refreshing less often), OFF never. The training is the same either way."""

    def __post_init__(self) -> None:
        if isinstance(self.strategy, str):
            text = self.strategy.strip().lower()
            object.__setattr__(self, "strategy", None if text == "auto" else parse_strategy(text))
        elif self.strategy is not None and not isinstance(self.strategy, Strategy):
            raise ConfigError(f"PlanOptions.strategy must be a Strategy, its text or 'auto', got {self.strategy!r}")
        if self.max_overhead is not None and not self.max_overhead >= 0:
            raise ConfigError(f"PlanOptions.max_overhead must be >= 0, got {self.max_overhead!r}")
        if not self.kfac_margin > 0:
            raise ConfigError(f"PlanOptions.kfac_margin must be > 0, got {self.kfac_margin!r}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ConfigError(f"PlanOptions.memory_budget must be > 0 bytes or None, got {self.memory_budget!r}")
        if not self.time_limit_s > 0:
            raise ConfigError(f"PlanOptions.time_limit_s must be > 0, got {self.time_limit_s!r}")
        if not isinstance(self.deterministic, bool):
            raise ConfigError(f"PlanOptions.deterministic must be True or False, got {self.deterministic!r}")
        if not isinstance(self.stream_apply, StreamApply):
            raise ConfigError(
                f"PlanOptions.stream_apply must be a StreamApply ({', '.join(m.name for m in StreamApply)}), "
                f"got {self.stream_apply!r}"
            )

    @property
    def forced_strategy(self) -> Strategy | None:
        """The strategy every layer must follow, None when the planner chooses."""
        return self.strategy if isinstance(self.strategy, Strategy) else None
