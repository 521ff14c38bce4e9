"""Rank functions for the checkpoint, resume and fault tests (importable by spawned ranks)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxkfac
from fxkfac.config import KFACConfig, PipelineOptions
from fxkfac.planner.problem.ir import LayerTiming
from tests.support import models

__all__ = [
    "KFAC",
    "bert_batches",
    "mlp_batches",
    "bert_trainer",
    "mlp_trainer",
    "mlp_single",
    "snapshot",
    "same_snapshot",
    "crash_worker",
    "resume_worker",
    "nan_run",
    "collective_death_worker",
]

KFAC = KFACConfig(damping=1e-2, factor_decay=0.9, kl_clip=1e-2)
BERT_STEPS = 5
SAVE_AT = 2  # the checkpoint holds the state after steps 0 and 1
MLP_BATCH = 8


def _bert() -> torch.nn.Module:
    return models.tiny_bert(layers=2)


def bert_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global mini-batches of 4 sequences (2 micro-batches of 2)."""
    return [models.token_batch(4, seed=200 + step) for step in range(BERT_STEPS)]


def _bert_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _mixed_timings(names: list[str]) -> dict[str, LayerTiming]:
    """Fused at step 0 used at once, deferred at step 1 used a step later: a pending inverse at step 2."""
    return {
        n: LayerTiming(2, 0, 0, "fused") if i % 2 == 0 else LayerTiming(2, 1, 1, "deferred")
        for i, n in enumerate(names)
    }


def bert_trainer(timeout: float = 20.0) -> Any:
    """A 2-rank PipeFisher run of the tiny BERT (1F1B, N=2) with mixed refresh timings."""
    from fxkfac.capture import capture

    ids = bert_batches()[0][0]
    names = [layer.name for layer in capture(_bert(), (ids[:2],), KFAC).layers]
    return fxkfac.compile(
        _bert(),
        (2, 1),
        None,
        preconditioner=KFAC,
        example_inputs=(ids,),
        loss_fn=_bert_loss,
        optimizer=_sgd,
        schedule="1f1b",
        microbatches=2,
        layer_timing=_mixed_timings(names),
        backend=None,
        pipeline=PipelineOptions(timeout=timeout),
    )


def mlp_batches(steps: int, *, nan_at: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, Any]]:
    """MLP mini-batches; targets are (classes, weights), the weights NaN at the steps in ``nan_at``."""
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(steps):
        x, y = torch.randn(MLP_BATCH, 12, generator=g), torch.randint(0, 5, (MLP_BATCH,), generator=g)
        w = torch.full((MLP_BATCH,), float("nan") if step in nan_at else 1.0)
        out.append((x, (y, w)))
    return out


def mlp_loss(out: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy times the mean weight: NaN weights make a NaN loss and NaN gradients."""
    y, w = target
    return F.cross_entropy(out, y) * w.mean()


MLP_LAYERS = ["0", "2", "4"]
NAN_AT, NAN_STEPS = (2,), 5  # step 2 refreshes the factors (period 2): its NaN captures must not land


def mlp_trainer(schedule: str = "1f1b", period: int = 1, **kw: Any) -> Any:
    """A 2-rank PipeFisher run of the 3-layer MLP (N=2)."""
    timings = {n: LayerTiming(period, 0, 0, "fused") for n in MLP_LAYERS}
    options = PipelineOptions(timeout=kw.pop("timeout", 20.0), **kw)
    return fxkfac.compile(
        models.mlp(),
        (2, 1),
        None,
        preconditioner=KFAC,
        example_inputs=(mlp_batches(1)[0][0],),
        loss_fn=mlp_loss,
        optimizer=_sgd,
        schedule=schedule,
        microbatches=2,
        backend=None,
        layer_timing=timings,
        pipeline=options,
    )


def mlp_single(period: int = 1, **kw: Any) -> Any:
    """The single-device trainer of the pipelined MLP run (N*W = 2 micro-batches, the same timings)."""
    timings = {n: LayerTiming(period, 0, 0, "fused") for n in MLP_LAYERS}
    return fxkfac.compile(
        models.mlp(),
        None,
        example_inputs=(mlp_batches(1)[0][0],),
        loss_fn=mlp_loss,
        optimizer=_sgd,
        preconditioner=KFAC,
        microbatches=2,
        backend=None,
        layer_timing=timings,
        pipeline=PipelineOptions(**kw),
    )


def snapshot(trainer: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """A deep copy of the trainer's whole state: JSON skeleton and tensors by key."""
    from fxkfac.checkpoint_files import split_tensors

    skeleton, tensors = split_tensors(trainer.state_dict(), 0)
    return skeleton, {k: t.clone() for k, t in tensors.items()}


def _json_diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in _json_diff(a.get(k), b.get(k), f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _json_diff(x, y, f"{path}/{i}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"[:300]]


def same_snapshot(a: tuple[Any, dict], b: tuple[Any, dict]) -> list[str]:
    """What differs between two snapshots (bit for bit): [] when equal."""
    differ = _json_diff(a[0], b[0])
    if differ:
        return differ
    return [k for k in a[1] if not (a[1][k].dtype == b[1][k].dtype and torch.equal(a[1][k], b[1][k]))]


def _error(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


def crash_worker(rank: int, world: int, ckpt: str, mlp_ckpt: str) -> dict:
    """Save at step 2, train to the end (the reference, also written to ``<ckpt>.reference-<rank>.pt``), resume
    in place, then rank 1 is SIGKILLed after step 3."""
    from fxkfac.errors import PipelineError

    mlp = mlp_trainer()
    for x, y in mlp_batches(2):
        mlp.step(x, y)
    mlp.save_checkpoint(mlp_ckpt)
    trainer = bert_trainer()
    data = bert_batches()
    losses = [trainer.step((ids,), y) for ids, y in data[:SAVE_AT]]
    trainer.save_checkpoint(ckpt)
    losses += [trainer.step((ids,), y) for ids, y in data[SAVE_AT:]]
    reference = snapshot(trainer)
    torch.save(reference, f"{ckpt}.reference-{rank}.pt")
    trainer.load_checkpoint(ckpt)
    resumed_loss = trainer.step((data[SAVE_AT][0],), data[SAVE_AT][1])
    out = {"losses": losses, "resumed_loss": resumed_loss, "error": None}
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        trainer.step((data[SAVE_AT + 1][0],), data[SAVE_AT + 1][1])
    except PipelineError as e:
        out["error"] = _error(e)
    return out


def _expect_refusal(trainer: Any, path: str, before: tuple) -> tuple[str, str, list[str]]:
    """Load ``path`` expecting CheckpointError; the error and what changed in the trainer (nothing, we hope)."""
    from fxkfac.errors import CheckpointError

    try:
        trainer.load_checkpoint(path)
    except CheckpointError as e:
        return (*_error(e), same_snapshot(before, snapshot(trainer)))
    return ("no error", "", same_snapshot(before, snapshot(trainer)))


def _resharded(trainer: Any, path: str, reference: Any) -> tuple[int, list[str]]:
    """Load ``path`` into ``trainer`` (another layout): its step, and the parameters that differ from
    ``reference``'s (loaded from the same checkpoint on its own layout)."""
    trainer.load_checkpoint(path)
    want = dict(reference.named_parameters())
    return trainer.steps, [n for n, p in trainer.named_parameters() if not torch.equal(p, want[n])]


def _corrupt_copies(rank: int, ckpt: str, root: Path) -> dict[str, str]:
    """Copies of ``ckpt`` with truncated tensor metadata, a truncated header, and a missing tensor file."""
    paths = {k: str(root / k) for k in ("truncated_metadata", "truncated_header", "missing_tensors")}
    if rank == 0:
        for path in paths.values():
            shutil.copytree(ckpt, path)
        for name, file in (("truncated_metadata", ".metadata.json"), ("truncated_header", "fxkfac.json")):
            target = Path(paths[name]) / file
            target.write_bytes(target.read_bytes()[: len(target.read_bytes()) // 2])
        for f in Path(paths["missing_tensors"]).glob("*.distcp"):
            f.unlink()
    dist.barrier()
    return paths


def _files(path: str) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(Path(path).iterdir())}


def _bad_construction(plan_path: str) -> dict:
    """Micro-batches that do not divide the batch, and a plan made for another mesh: the errors, and whether
    the model handed in and the plan file stayed as they were."""
    from fxkfac.errors import FxkfacError

    model = models.mlp()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan_bytes = Path(plan_path).read_bytes()
    out: dict[str, Any] = {}
    for name, kw in (("microbatches", {"microbatches": 3}), ("plan for another mesh", {"plan": plan_path})):
        try:
            fxkfac.compile(
                model,
                (2, 1),
                preconditioner=KFAC,
                example_inputs=(mlp_batches(1)[0][0],),
                loss_fn=mlp_loss,
                optimizer=_sgd,
                schedule="1f1b",
                backend=None,
                **{"plan": None, "microbatches": 2, **kw},
            )
            out[name] = ("no error", "")
        except FxkfacError as e:
            out[name] = _error(e)
    out["untouched"] = (
        all(torch.equal(p, params[n]) for n, p in model.named_parameters())
        and Path(plan_path).read_bytes() == plan_bytes
    )
    return out


def resume_worker(
    rank: int, world: int, ckpt: str, mlp_ckpt: str, single_ckpt: str, plan_path: str, scratch: str
) -> dict:
    """Bad checkpoints are refused with nothing changed; the step-2 checkpoint resumes; the MLP's checkpoints load
    under another plan, schedule and mesh; interrupted saves; bad constructor input; a NaN step (`nan_run`)."""
    import fxkfac.checkpoint_files as checkpoint_files

    trainer = bert_trainer()
    data = bert_batches()
    fresh = snapshot(trainer)
    refusals = {"another model": _expect_refusal(trainer, mlp_ckpt, fresh)}
    for name, path in _corrupt_copies(rank, ckpt, Path(scratch)).items():
        refusals[name] = _expect_refusal(trainer, path, fresh)
    refusals["no checkpoint"] = _expect_refusal(trainer, str(Path(scratch) / "nothing"), fresh)
    trainer.load_checkpoint(ckpt)
    loaded_step = trainer.steps
    losses = [trainer.step((ids,), y) for ids, y in data[SAVE_AT:]]
    final = snapshot(trainer)

    same, single = mlp_trainer(), mlp_single()
    same.load_checkpoint(mlp_ckpt)
    single.load_checkpoint(single_ckpt)
    resharded = {
        "another plan": _resharded(mlp_trainer(period=2), mlp_ckpt, same),
        "another schedule": _resharded(mlp_trainer(schedule="gpipe"), mlp_ckpt, same),
    }
    gpipe = mlp_trainer(schedule="gpipe")
    resharded["one-device checkpoint"] = _resharded(gpipe, single_ckpt, single)
    before = snapshot(gpipe)
    x, y = mlp_batches(1)[0]
    try:
        gpipe.step(x[:5], (y[0][:5], y[1][:5]))  # 2 micro-batches do not divide 5 samples
        other_batch = ("no error", "", [])
    except Exception as e:  # the test checks the type and message
        other_batch = (*_error(e), same_snapshot(before, snapshot(gpipe)))

    # A save that fails half way (rank 1's tensor write raises) keeps the checkpoint it was replacing.
    again = str(Path(scratch) / "again")
    trainer.save_checkpoint(again)
    saved = snapshot(trainer)
    files = _files(again)
    write = checkpoint_files.JsonMetadataWriter.write_data

    def failing_write(self: Any, plan: Any, planner: Any) -> Any:
        write(self, plan, planner)
        raise OSError("disk full (injected)")

    if rank == 1:
        checkpoint_files.JsonMetadataWriter.write_data = failing_write  # type: ignore[method-assign]  # the test injects a failing write
    trainer.step((data[0][0],), data[0][1])
    failed_save = None
    try:
        trainer.save_checkpoint(again)
    except Exception as e:  # the test checks the type and message
        failed_save = _error(e)
    checkpoint_files.JsonMetadataWriter.write_data = write  # type: ignore[method-assign]  # the test restores the original write
    unchanged = _files(again) == files
    leftovers = sorted(p.name for p in Path(scratch).iterdir() if p.name.startswith("again."))
    trainer.load_checkpoint(again)
    reloaded = same_snapshot(saved, snapshot(trainer))
    return {
        "refusals": refusals,
        "resharded": resharded,
        "loaded_step": loaded_step,
        "losses": losses,
        "final": final,
        "failed_save": failed_save,
        "unchanged": unchanged,
        "leftovers": leftovers,
        "reloaded": reloaded,
        "nan": nan_run(NAN_AT, NAN_STEPS),
        "other_batch": other_batch,
        "construction": _bad_construction(plan_path),
    }


def nan_run(nan_at: tuple[int, ...], steps: int) -> dict:
    """MLP PipeFisher run with NaN losses at the steps in ``nan_at``: the state after every step; then a run with
    max_skipped_steps=1 fed two NaN steps in a row."""
    from fxkfac.errors import NonFiniteError

    trainer = mlp_trainer(period=2)
    states, losses = [snapshot(trainer)], []
    for x, y in mlp_batches(steps, nan_at=nan_at):
        losses.append(trainer.step(x, y))
        states.append(snapshot(trainer))
    params = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    strict = mlp_trainer(period=2, max_skipped_steps=1)
    errors = []
    for x, y in mlp_batches(3, nan_at=(1, 2)):
        try:
            strict.step(x, y)
        except NonFiniteError as e:
            errors.append(_error(e))
    return {
        "states": states,
        "losses": losses,
        "skipped": trainer.skipped_steps,
        "steps": trainer.steps,
        "params": params,
        "strict_errors": errors,
        "strict_skipped": strict.skipped_steps,
        "strict_steps": strict.steps,
    }


def collective_death_worker(rank: int, world: int, where: str) -> dict:
    """Chimera MLP (both ranks hold every stage): rank 1 dies just before a K-FAC collective of step 1."""
    from fxkfac.errors import PipelineError
    from fxkfac.planner.problem.ir import OpKind

    trainer = mlp_trainer(schedule="chimera", timeout=10.0)
    batches = mlp_batches(2)
    trainer.step(*batches[0])
    if rank == 1:

        def die(*args: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        trainer.interpreter.register(OpKind[where], die)
    try:
        trainer.step(*batches[1])
    except PipelineError as e:
        return {"error": _error(e)}
    return {"error": None}
