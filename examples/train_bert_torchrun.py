"""Train a small BERT-style masked language model with PipeFisher: 2 pipeline stages x 2 replicas on CPU.

    torchrun --nproc-per-node 4 examples/train_bert_torchrun.py               # K-FAC in the bubbles
    torchrun --nproc-per-node 4 examples/train_bert_torchrun.py --kfac none   # the plain AdamW pipeline

One process per rank (torchrun sets RANK/WORLD_SIZE/MASTER_ADDR; gloo on CPU). The data is the CPython
standard library's own source, byte-level tokens, BERT-style masking (fxkfac.data): nothing is
downloaded. `fxkfac.compile(..., plan="auto")` makes rank 0 profile the two stages, place K-FAC's
curvature and inversion work into the pipeline's bubbles with the CP-SAT planner, and share the plan;
every rank then runs its part of it. At the end `trainer.evaluate` reports the loss on held-out files (the
pipelined forward in eval mode, over the same ranks).

With `--checkpoint DIR` the run saves every `--save-every` steps, and launching the same command again resumes
from the last save: plan="auto" adopts the plan the checkpoint was saved with (no new profile) and training
continues bit for bit (`fxkfac.compile(..., resume_from=DIR)`).

Change anything below: the sizes, the schedule ("gpipe", "1f1b", "chimera"), the optimizer, K-FAC's
damping. `--pp 4 --nproc-per-node 4` gives 4 stages x 1 replica.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fxkfac
from fxkfac.config import PlanOptions
from fxkfac.data import MaskedLMData, stdlib_corpus
from fxkfac.models import TinyBertConfig, TinyBertMLM, mlm_loss

# -----------------------------------------------------------------------------
# settings (small defaults: a run takes a minute or two on 2 CPU cores)
parser = argparse.ArgumentParser(description="PipeFisher on a small BERT-style MLM, launched with torchrun")
parser.add_argument("--kfac", choices=("kfac", "none"), default="kfac", help="'none': the AdamW pipeline baseline")
parser.add_argument("--pp", type=int, default=2, help="pipeline stages; the rest of the world is replicas")
parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "chimera"))
parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per replica per step")
parser.add_argument("--batch", type=int, default=32, help="global mini-batch (sequences)")
parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--ffn", type=int, default=256)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--damping", type=float, default=1e-2)
parser.add_argument("--kl-clip", type=float, default=1e-2)
parser.add_argument("--log-every", type=int, default=10)
parser.add_argument("--val-batches", type=int, default=8)
parser.add_argument("--plan-time", type=float, default=5.0, help="CP-SAT time limit (s) of plan='auto'")
parser.add_argument(
    "--max-overhead",
    type=float,
    default=None,
    help="how much longer than the plain pipeline a step may get to make room for K-FAC (0: bubbles "
    "only; default: bubbles when they hold the work, else the least that places it)",
)
parser.add_argument("--save-plan", default=None, help="rank 0 writes the plan JSON here")
parser.add_argument("--checkpoint", default=None, help="save here every --save-every steps; a relaunch resumes")
parser.add_argument("--save-every", type=int, default=20)
args = parser.parse_args()

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
torch.set_num_threads(1)  # several ranks share the machine's cores
torch.manual_seed(0)  # every rank builds the same initial model

# -----------------------------------------------------------------------------
# the mesh: ranks laid out row-major as (pp, dp); global rank = pp * dp_size + dp
dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
if world % args.pp:
    raise SystemExit(f"world size {world} is not a multiple of --pp {args.pp}")
mesh = init_device_mesh("cpu", (args.pp, world // args.pp), mesh_dim_names=("pp", "dp"))
master = rank == 0


def log(msg: str) -> None:
    if master:
        print(msg, flush=True)


# -----------------------------------------------------------------------------
# data: the same deterministic batches on every rank (each replica takes its own shard of a batch)
train_bytes, val_bytes = stdlib_corpus()
train_data = MaskedLMData(train_bytes, seq_len=args.seq, seed=0)
val_data = MaskedLMData(val_bytes, seq_len=args.seq, seed=1)
example, _ = train_data.batch(args.batch)

# -----------------------------------------------------------------------------
# model and trainer
config = TinyBertConfig(hidden=args.hidden, ffn=args.ffn, layers=args.layers, max_len=args.seq)
model = TinyBertMLM(config)
kfac = None if args.kfac == "none" else fxkfac.KFACConfig(damping=args.damping, factor_decay=0.95, kl_clip=args.kl_clip)
started = time.perf_counter()
trainer = fxkfac.compile(
    model,
    mesh,
    plan="auto" if kfac is not None else None,
    example_inputs=(example,),
    loss_fn=mlm_loss,
    optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
    preconditioner=kfac,
    schedule=args.schedule,
    microbatches=args.microbatches,
    backend=None,  # eager stage functions; "inductor" compiles them (slow to start on a small CPU)
    plan_options=PlanOptions(time_limit_s=args.plan_time, max_overhead=args.max_overhead),
    resume_from=args.checkpoint,  # a checkpoint there: adopt its plan and resume from it
)
log(
    f"compiled in {time.perf_counter() - started:.1f} s: {args.pp} stages x {world // args.pp} replicas, "
    f"{args.schedule}, {args.microbatches} micro-batches, K-FAC {'off' if kfac is None else 'on'}"
)

if kfac is not None and master:  # the plan every rank runs: refresh period per stage, predicted utilization
    m = trainer.plan.metrics
    print(
        f"plan: refresh every {list(m.refresh_steps)} steps per stage (lower bound {list(m.lower_bound_steps)}), "
        f"utilization {m.utilization_baseline:.1%} -> {m.utilization:.1%}, step {m.step_time_baseline * 1e3:.1f} ms "
        f"-> {m.step_time * 1e3:.1f} ms (profiled), solver {m.solver.status} in {m.solver.wall_time:.1f} s"
    )
    if args.save_plan:
        trainer.plan.save(args.save_plan)
        print(f"plan written to {args.save_plan} (draw it: fxkfac show {args.save_plan})")

# -----------------------------------------------------------------------------
# training loop: trainer.step takes the global mini-batch and returns the step loss on every rank
# a resumed run skips the batches its checkpoint has trained on
if trainer.steps:
    log(f"resumed from {args.checkpoint} at step {trainer.steps}")
for _ in range(trainer.steps):
    train_data.batch(args.batch)
started, done = time.perf_counter(), trainer.steps
for step in range(trainer.steps + 1, args.steps + 1):
    inputs, targets = train_data.batch(args.batch)
    loss = trainer.step(inputs, targets)
    if step % args.log_every == 0 or step == done + 1:
        log(f"step {step:4d}  loss {loss:.4f}  {(time.perf_counter() - started) / (step - done) * 1e3:.0f} ms/step")
    if args.checkpoint and step % args.save_every == 0:
        trainer.save_checkpoint(args.checkpoint)  # every rank

# -----------------------------------------------------------------------------
# validation: the pipelined forward in eval mode over the held-out files (every rank gets the loss)
losses = [trainer.evaluate(x, y) for x, y in (val_data.batch(args.batch) for _ in range(args.val_batches))]
log(f"validation loss {sum(losses) / len(losses):.4f} over {args.val_batches} batches of held-out files")
dist.barrier()  # no rank tears its connections down while a peer still uses them
dist.destroy_process_group()
