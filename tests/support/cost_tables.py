"""Small hand-made cost tables shared by planner and autoplan tests."""

from __future__ import annotations

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
