"""Step efficiency of K-FAC over AdamW against AdamW alone on the embedded MLM, in one process (no pipeline).

A quick way to choose the learning rates and K-FAC settings the pipelined convergence benchmark runs:
`fxkfac.compile(model, None, ...)` (one device, the same K-FAC semantics as the pipeline) trains the default
TinyBert MLM on the stdlib corpus for each grid point, refreshing curvature and inverses every
`--refresh` steps (about what the plans choose), from the same initialization on the same batches.
Validation loss (4 fixed batches of 32 held-out sequences) every `--eval-every` steps.

    python benchmarks/mlm_sweep.py --batch 128 --steps 1000 --adamw 4e-3 8e-3 --kfac 8e-3 [--damping 1e-2]

Prints a table (validation loss at each evaluation) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
from rich.console import Console
from rich.table import Table

import fxkfac
from fxkfac.config import KFACConfig
from fxkfac.data import MaskedLMData, stdlib_corpus
from fxkfac.models import TinyBertConfig, TinyBertMLM, mlm_loss

SEQ_LEN = 64
MICROBATCHES = 4


def train(
    args: argparse.Namespace,
    lr: float,
    kfac: KFACConfig | None,
    train_bytes: bytes,
    val: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[int, float]]:
    """(step, validation loss) of one run; every run draws the same batches (a fresh generator, seed 0)."""
    data = MaskedLMData(train_bytes, seq_len=SEQ_LEN, seed=0)
    torch.manual_seed(0)
    model = TinyBertMLM(TinyBertConfig(max_len=SEQ_LEN, pre_norm=not args.post_norm))
    inputs, targets = data.batch(args.batch)
    trainer = fxkfac.compile(
        model,
        None,
        None,
        example_inputs=(inputs,),
        loss_fn=mlm_loss,
        preconditioner=kfac,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01),
        microbatches=MICROBATCHES,
        backend=None,
    )

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            loss = sum(float(mlm_loss(model(x), y)) for x, y in val) / len(val)
        model.train()
        return loss

    points = [(0, evaluate())]
    for step in range(1, args.steps + 1):
        trainer.step((inputs,), targets)
        if step % args.eval_every == 0 or step == args.steps:
            points.append((step, evaluate()))
        inputs, targets = data.batch(args.batch)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--adamw", type=float, nargs="*", default=[4e-3, 8e-3], help="AdamW learning rates")
    parser.add_argument("--kfac", type=float, nargs="*", default=[8e-3], help="K-FAC-over-AdamW learning rates")
    parser.add_argument("--damping", type=float, default=1e-2)
    parser.add_argument("--kl-clip", type=float, default=1e-2)
    parser.add_argument("--refresh", type=int, default=4)
    parser.add_argument("--skip-head", action="store_true", help="leave the MLM head to AdamW")
    parser.add_argument("--post-norm", action="store_true", help="post-LN blocks (the original BERT's)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    kfac = KFACConfig(
        damping=args.damping,
        factor_decay=0.95,
        kl_clip=args.kl_clip,
        refresh_every=args.refresh,
        skip_vocab_head=args.skip_head,
    )
    runs = [(f"AdamW lr {lr:g}", lr, None) for lr in args.adamw] + [(f"K-FAC lr {lr:g}", lr, kfac) for lr in args.kfac]
    train_bytes, val_bytes = stdlib_corpus(2_000_000)
    val_data = MaskedLMData(val_bytes, seq_len=SEQ_LEN, seed=10_000)
    val = [val_data.batch(32) for _ in range(4)]
    curves = {name: train(args, lr, cfg, train_bytes, val) for name, lr, cfg in runs}
    table = Table(title=f"validation loss, batch {args.batch}, one process", title_justify="left")
    table.add_column("run")
    steps = [s for s, _ in next(iter(curves.values()))]
    for s in steps:
        table.add_column(str(s), justify="right")
    for name, points in curves.items():
        table.add_row(name, *(f"{v:.2f}" for _, v in points))
    Console().print(table)
    print(
        json.dumps(
            {
                "benchmark": "mlm_sweep",
                "batch": args.batch,
                "steps": args.steps,
                "damping": args.damping,
                "kl_clip": args.kl_clip,
                "refresh": args.refresh,
                "curves": curves,
            }
        )
    )


if __name__ == "__main__":
    main()
