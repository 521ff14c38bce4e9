"""The communication model measured on this machine: `fxkfac.comm_profile.measure_comm` over gloo loopback ranks.

Prints alpha (latency per message step) and bandwidth (1 / beta) of each collective kind, fitted by
non-negative least squares, for each of `--runs` runs and their median (the cpu preset's comm model in
planner/problem/hardware.py is the median of three runs at 2 ranks).

Run: python benchmarks/comm_fit.py [--ranks 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics

from fxkfac.launch import RankContext, launch
from fxkfac.planner.problem.hardware import Collective, CommModel


def _measure(ctx: RankContext) -> str:
    from fxkfac.comm_profile import measure_comm

    model = measure_comm()
    if model is None:
        raise AssertionError("measure_comm ran without a process group")
    return model.to_json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    fits = {kind: [] for kind in Collective}
    for run in range(args.runs):
        models = {CommModel.from_json(text) for text in launch(_measure, args.ranks)}
        if len(models) != 1:
            raise AssertionError(f"the ranks measured different models: {models}")
        link = models.pop().intra
        for kind in Collective:
            fits[kind].append(link.of(kind))
        print(f"run {run}: " + ", ".join(_text(kind, link.of(kind).alpha, link.of(kind).beta) for kind in Collective))
    print(
        "median: "
        + ", ".join(
            _text(
                kind, statistics.median(ab.alpha for ab in fits[kind]), statistics.median(ab.beta for ab in fits[kind])
            )
            for kind in Collective
        )
    )


def _text(kind: Collective, alpha: float, beta: float) -> str:
    bandwidth = f"{1e-9 / beta:.3g} GB/s" if beta > 0 else "inf GB/s"
    return f"{kind} {alpha * 1e6:.0f} us + {bandwidth}"


if __name__ == "__main__":
    main()
