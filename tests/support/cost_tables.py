"""Small hand-made cost tables shared by planner and autoplan tests."""

from __future__ import annotations

from collections.abc import Sequence

from fxkfac.planner.problem.costs import CostTable, LayerCost, StageCost

MS = 1e-3


def light_pipeline(stages: int, layers: int = 4, param_bytes: int = 1 << 20) -> CostTable:
    """One pipeline (4 ms forward, 8 ms backward per micro-batch, half of it W) of `layers` light K-FAC layers, cut
    into `stages` even stages, each holding `param_bytes` of parameters; a layer's work is longer than Chimera D=2's
    bubbles."""
    per = layers // stages
    return CostTable(
        tuple(
            StageCost(
                4 * MS / stages,
                8 * MS / stages,
                param_bytes,
                1 << 16,
                tuple(
                    LayerCost.kfac(f"l{s * per + i}", 0.05 * MS, 0.05 * MS, 0.2 * MS, 0.2 * MS, 0.01 * MS, *[4096] * 4)
                    for i in range(per)
                ),
                wgrad=4 * MS / stages,
            )
            for s in range(stages)
        ),
        2,
        "test",
        "cpu",
    )


def kfac_stages(
    layers: Sequence[int],
    curv: float,
    inv: tuple[float, float],
    prec: float,
    *,
    name: str = "l{s}_{i}",
    source: str = "test",
) -> CostTable:
    """Stages of 1 ms forward and 2 ms backward per micro-batch, stage s holding `layers[s]` K-FAC layers (named by
    `name`) of `curv` ms curvature per factor, `inv` ms inversions (A, B) and `prec` ms APPLY, every factor 4 KiB."""
    return CostTable(
        tuple(
            StageCost(
                1 * MS,
                2 * MS,
                1 << 20,
                1 << 16,
                tuple(
                    LayerCost.kfac(
                        name.format(s=s, i=i), curv * MS, curv * MS, inv[0] * MS, inv[1] * MS, prec * MS, *[4096] * 4
                    )
                    for i in range(n)
                ),
            )
            for s, n in enumerate(layers)
        ),
        2,
        source,
        "cpu",
    )
