"""fxkfac.compile: a model, a mesh (or None) and K-FAC settings in, a Trainer out."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

from fxkfac.config import KFACConfig
from fxkfac.errors import ConfigError
from fxkfac.planner.ir import LayerTiming
from fxkfac.single import SingleDeviceTrainer
from fxkfac.trainer import OptimizerFactory, Trainer, default_optimizer

__all__ = ["compile"]


def compile(  # noqa: A001 - the public name the design card gives
    model: nn.Module,
    mesh: Any = None,
    plan: Any = "auto",
    *,
    example_inputs: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    optimizer: OptimizerFactory | None = None,
    kfac: KFACConfig | None = KFACConfig(),
    schedule: str = "1f1b",
    microbatches: int = 1,
    backend: str | None = "inductor",
    layer_timing: Mapping[str, LayerTiming] | None = None,
    **kw: Any,
) -> Trainer:
    """Capture ``model``, insert K-FAC into its graph and return a Trainer.

    ``mesh=None`` trains on one device (`SingleDeviceTrainer`). A DeviceMesh with dims ("pp", "dp")
    (or a ``(D, W)`` tuple, with torch.distributed initialized) trains pipelined: with ``kfac`` the
    PipeFisher runtime (`fxkfac.runtime.pipefisher.PipeFisherTrainer`: ``plan="auto"`` profiles and
    solves, a path or a Plan is checked and used), with ``kfac=None`` the plain pipeline. Extra
    keywords (``timeout``, ``virtual_stages``, ``split_points``, ``record_timeline``, ``plan_options``)
    go to it; ``max_skipped_steps`` (NaN/Inf steps skipped in a row before NonFiniteError) to every
    trainer. ``optimizer`` is a factory ``params -> torch.optim.Optimizer`` (default AdamW, lr 1e-3);
    ``kfac=None`` trains with it alone.
    ``backend`` is a torch.compile backend ("inductor", "eager", ...) or None for no compilation.
    ``layer_timing`` sets the refresh timing per layer (the planner's output); on one device a
    ``plan`` object with a ``layers`` mapping of LayerTiming supplies it too.
    """
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"microbatches must be an int >= 1, got {microbatches!r}")
    if mesh is not None:
        common = dict(example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer or default_optimizer,
                      schedule=schedule, microbatches=microbatches, backend=backend, **kw)
        if kfac is None:
            from fxkfac.runtime.trainer import PipelineTrainer

            if plan not in (None, "auto"):
                raise ConfigError("kfac=None trains the plain pipeline, which takes no plan; pass plan=None")
            return PipelineTrainer(model, mesh, **common)
        from fxkfac.runtime.pipefisher import PipeFisherTrainer

        return PipeFisherTrainer(model, mesh, plan=plan, kfac=kfac, layer_timing=layer_timing, **common)
    single_kw = {k: kw.pop(k) for k in ("max_skipped_steps",) if k in kw}
    if kw:
        raise ConfigError(f"unknown arguments for a single-device compile: {sorted(kw)}")
    single_plan = None if plan in (None, "auto") else plan
    if single_plan is not None:
        if isinstance(single_plan, str):
            from fxkfac.planner.plan import Plan

            single_plan = Plan.load(single_plan)
        layer_timing = {**dict(getattr(single_plan, "layers", {})), **dict(layer_timing or {})}
    return SingleDeviceTrainer(model, example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                               kfac=kfac, microbatches=microbatches, backend=backend,
                               layer_timing=layer_timing, plan=single_plan, **single_kw)
