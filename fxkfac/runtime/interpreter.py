"""The per-rank program interpreter: a dispatch table keyed by OpKind over a step's context.

The core handlers (FWD, BWD, BWD_W, SEND/RECV of activations and gradients, ALLREDUCE_GRAD, OPT_STEP)
are registered here; a preconditioner's ops (STATS, SYNC_STATS, DECOMP, BCAST, APPLY) plug in with
`Interpreter.register(kind, handler)` without touching the loop. A handler takes the
`StepContext` and the `Op`; state of its own lives in the object that registered it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from fxkfac.errors import PipelineError
from fxkfac.planner.problem import Op, OpKind
from fxkfac.runtime.p2p import Transport
from fxkfac.runtime.stage import StageRunner
from fxkfac.runtime.step_end import NonFiniteCheck, StepEnd, unclipped
from fxkfac.runtime.sync import GradSync
from fxkfac.runtime.timeline import Recorder

__all__ = [
    "StepContext",
    "Handler",
    "Prepare",
    "StepListener",
    "Interpreter",
    "CORE_HANDLERS",
    "EVAL_HANDLERS",
    "forward_only",
    "local_nonfinite",
]

Key = tuple[int, int, int]  # (stage, pipe, micro-batch)


@dataclass
class StepContext:
    """Everything one training step's instructions read and write on one rank."""

    rank: int
    step: int
    runners: dict[tuple[int, int], StageRunner]
    transport: Transport
    sync: GradSync
    optimizer: torch.optim.Optimizer | None
    inputs: Sequence[Sequence[torch.Tensor]]
    """Flat model inputs per micro-batch (used by stage 0)."""
    targets: Sequence[Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    out_spec: pytree.TreeSpec | None
    scale: float
    """1 / (N * W): each micro-batch's share of the step loss."""
    step_end: StepEnd
    """How OPT_STEP takes the verdict on skipping the step and the loss (fxkfac/runtime/step_end.py)."""
    loss_scale: float = 1.0
    """float16's loss scale at this step: the last stage's backward starts from the loss times it ([Note: mixed
    precision] in fxkfac/runtime/precision.py)."""
    acts: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    """Inputs waiting for FWD (stage, pipe, mb)."""
    grads: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    """Output gradients waiting for BWD (stage, pipe, mb)."""
    to_send: dict[tuple[str, Key], list[torch.Tensor]] = field(default_factory=dict)
    deferred: set[Key] = field(default_factory=set)
    """Backwards whose weight gradients wait for a BWD_W of the step (stage, pipe, mb)."""
    losses: list[torch.Tensor] = field(default_factory=list)
    skipped: bool | None = None
    """Set at OPT_STEP by `step_end` (a sum over the world, or over the agreement set where steps end
    without a world barrier): True when some rank there saw NaN/Inf loss or gradients."""
    loss: float | None = None
    """The step loss summed over the world, where OPT_STEP's world sum carried it (None where steps end
    without a world barrier: the trainer sums it without waiting)."""

    def runner(self, op: Op) -> StageRunner:
        """The local stage copy `op` runs on."""
        try:
            return self.runners[(op.stage_id, op.pipe)]
        except KeyError:
            raise PipelineError(
                f"rank {self.rank} got '{op}' but holds only stages "
                f"{sorted(self.runners)} (stage, pipe): the program was made for another layout"
            ) from None

    def stage_runner(self, stage: int) -> StageRunner:
        """This rank's copy of `stage`, whatever its pipe (APPLY names a stage, not a Chimera pipe)."""
        held = [runner for (s, _), runner in self.runners.items() if s == stage]
        if len(held) != 1:
            raise PipelineError(
                f"rank {self.rank} holds {len(held)} copies of stage {stage} (stages "
                f"{sorted(self.runners)} (stage, pipe)); the program was made for another layout"
            )
        return held[0]


Handler = Callable[[StepContext, Op], None]
Prepare = Callable[[StepContext, Op, Sequence[Op]], None]
"""What an op needs done when its step begins, before any op of the step runs (given the step's ops): receives
posted, hooks armed."""


def _key(op: Op) -> Key:
    """(stage, pipe, micro-batch) of a FWD, BWD or transfer: where its activations and gradients are kept."""
    if op.stage is None or op.mb is None:
        raise AssertionError(f"'{op}' names no stage or micro-batch (Op requires both of FWD, BWD and transfers)")
    return (op.stage, op.pipe, op.mb)


def _message(op: Op) -> tuple[int, bool, int, int, int]:
    """(peer, gradient?, stage, pipe, micro-batch): the message of a transfer as both ends name it, activations by
    the stage that sends them (a RECV_ACT names the stage after) and gradients by the stage that receives them (a
    SEND_GRAD names the stage after)."""
    if op.peer is None:
        raise AssertionError(f"'{op}' names no peer (Op requires one of a transfer)")
    stage, pipe, mb = _key(op)
    grad = op.kind in (OpKind.SEND_GRAD, OpKind.RECV_GRAD)
    return op.peer, grad, stage - 1 if op.kind in (OpKind.RECV_ACT, OpKind.SEND_GRAD) else stage, pipe, mb


def _take(store: dict, key: Any, op: Op, missing: str) -> Any:
    if key not in store:
        raise AssertionError(f"'{op}': {missing} (the program orders its instructions wrongly)")
    return store.pop(key)


def _fwd_inputs(ctx: StepContext, op: Op) -> Sequence[torch.Tensor]:
    """The inputs of a FWD: the micro-batch's on stage 0, else the activations received (or handed over)."""
    stage, _, mb = _key(op)
    return ctx.inputs[mb] if stage == 0 else _take(ctx.acts, _key(op), op, "its input was not received")


def _scaled_loss(ctx: StepContext, runner: StageRunner, outs: Sequence[torch.Tensor], mb: int) -> torch.Tensor:
    """The last stage's share of the step loss for micro-batch `mb`: ``loss_fn`` on the model's output (under the
    run's autocast, as the forward), scaled."""
    model_out = pytree.tree_unflatten(list(outs), ctx.out_spec) if ctx.out_spec is not None else outs[0]
    with runner.precision():
        return ctx.loss_fn(model_out, ctx.targets[mb]) * ctx.scale


def _hand_on(ctx: StepContext, op: Op, outs: Sequence[torch.Tensor]) -> None:
    """A FWD's outputs to the next stage: handed over when it is local, else kept for SEND_ACT."""
    stage, pipe, mb = _key(op)
    if (stage + 1, pipe) in ctx.runners:  # next stage is local: hand over without a message
        ctx.acts[(stage + 1, pipe, mb)] = [o.detach() for o in outs]
    else:
        ctx.to_send[("act", _key(op))] = list(outs)


def _fwd(ctx: StepContext, op: Op) -> None:
    runner = ctx.runner(op)
    stage, _, mb = _key(op)
    outs = runner.forward(mb, _fwd_inputs(ctx, op), needs_grad=stage > 0)
    if runner.is_last:
        loss = _scaled_loss(ctx, runner, outs, mb)
        runner.keep_loss(mb, loss * ctx.loss_scale if ctx.loss_scale != 1.0 else loss)  # float16: scaled backward
        ctx.losses.append(loss.detach())
    else:
        _hand_on(ctx, op, outs)


def _eval_fwd(ctx: StepContext, op: Op) -> None:
    """Evaluation's FWD: the stage in eval mode without autograd (`StageRunner.infer`); the last stage keeps its
    share of the loss."""
    runner = ctx.runner(op)
    outs = runner.infer(_fwd_inputs(ctx, op))
    if runner.is_last:
        ctx.losses.append(_scaled_loss(ctx, runner, outs, _key(op)[2]))
    else:
        _hand_on(ctx, op, outs)


def _bwd(ctx: StepContext, op: Op) -> None:
    runner = ctx.runner(op)
    stage, pipe, mb = _key(op)
    out_grads = None if runner.is_last else _take(ctx.grads, _key(op), op, "its output gradient was not received")
    in_grads = runner.backward(mb, out_grads, defer_weights=_key(op) in ctx.deferred)
    if stage == 0:
        return
    if (stage - 1, pipe) in ctx.runners:
        ctx.grads[(stage - 1, pipe, mb)] = in_grads
    else:
        ctx.to_send[("grad", _key(op))] = in_grads


def _bwd_w(ctx: StepContext, op: Op) -> None:
    """The weight-gradient half of a backward whose BWD ran only B (one layer's piece of it where the op names one)."""
    runner = ctx.runner(op)
    runner.backward_weights(_key(op)[2], op.layer)
    if _key(op)[2] not in runner.waiting_weights():
        ctx.deferred.discard(_key(op))


def _defer_w(ctx: StepContext, op: Op, _: Sequence[Op]) -> None:
    """A BWD_W in the step: its BWD runs only B, on a stage copy that runs split (`StageRunner.split`), W cut into
    the pieces of the layers BWD_W ops name (`StageRunner.w_layers`)."""
    runner = ctx.runner(op)
    runner.split = True
    if op.layer is not None:
        runner.w_layers.add(op.layer)
    ctx.deferred.add(_key(op))


def _send_act(ctx: StepContext, op: Op) -> None:
    tensors = _take(ctx.to_send, ("act", _key(op)), op, "its FWD has not run")
    ctx.transport.send(tensors, *_message(op), str(op))


def _recv_act(ctx: StepContext, op: Op) -> None:
    runner = ctx.runner(op)
    specs = runner.wire(runner.graph.inputs)
    ctx.acts[_key(op)] = ctx.transport.recv(specs, *_message(op), str(op))


def _send_grad(ctx: StepContext, op: Op) -> None:
    tensors = _take(ctx.to_send, ("grad", _key(op)), op, "its BWD has not run")
    ctx.transport.send(tensors, *_message(op), str(op))


def _grad_specs(ctx: StepContext, op: Op) -> list:
    runner = ctx.runner(op)
    return runner.wire([s for s in runner.graph.outputs if s.is_float])


def _recv_grad(ctx: StepContext, op: Op) -> None:
    ctx.grads[_key(op)] = ctx.transport.recv(_grad_specs(ctx, op), *_message(op), str(op))


def _post_act(ctx: StepContext, op: Op, _: Sequence[Op]) -> None:
    runner = ctx.runner(op)
    ctx.transport.post_recv(runner.wire(runner.graph.inputs), *_message(op))


def _post_grad(ctx: StepContext, op: Op, _: Sequence[Op]) -> None:
    ctx.transport.post_recv(_grad_specs(ctx, op), *_message(op))


def _allreduce_grad(ctx: StepContext, op: Op) -> None:
    waiting = [(s, p, r.waiting_weights()) for (s, p), r in ctx.runners.items() if op.stage in (None, s)]
    if any(mbs for _, _, mbs in waiting):
        raise AssertionError(f"'{op}' before the BWD_W of {waiting} (the program orders its instructions wrongly)")
    if op.stage is None:
        for stage, _ in sorted(ctx.runners):
            ctx.sync.stage(stage, ctx.transport, str(op))
    else:
        ctx.sync.stage(op.stage, ctx.transport, str(op))


def local_nonfinite(ctx: StepContext) -> NonFiniteCheck:
    """The NaN/Inf check of this rank's losses and gradients (of every local stage copy)."""
    grads = [p.grad for r in ctx.runners.values() for p in r.param_list if p.grad is not None]
    return NonFiniteCheck.of([*ctx.losses, *grads])


def local_loss(ctx: StepContext) -> torch.Tensor:
    """This rank's share of the step loss: the sum of its micro-batches' scaled losses (0 off the last stage)."""
    return torch.stack(ctx.losses).sum() if ctx.losses else torch.zeros(())


def end_gradients(ctx: StepContext, op: Op) -> None:
    """Make this rank's gradients final: settle every collective still in flight and sum tied gradients over the
    stages that share them, so the verdict on skipping sees the gradients the optimizer would apply."""
    ctx.transport.settle_all()
    ctx.sync.shared_params(ctx.transport, str(op))


def clip_gradients(ctx: StepContext, factor: float) -> None:
    """Multiply every local gradient by the verdict's clip factor (`PipelineOptions.max_grad_norm`), as
    `torch.nn.utils.clip_grad_norm_` does (also by 1: no gradient is left out on one rank and not another)."""
    for runner in ctx.runners.values():
        for p in runner.param_list:
            if p.grad is not None:
                p.grad.mul_(factor)


def step_or_skip(ctx: StepContext, clip: float | None = None) -> None:
    """Step the optimizer unless the verdict (`ctx.skipped`) is to skip, its gradients first multiplied by `clip`
    when clipping; clear gradients; send what waits."""
    if ctx.optimizer is not None:
        if not ctx.skipped:
            if clip is not None:
                clip_gradients(ctx, clip)
            ctx.optimizer.step()
        ctx.optimizer.zero_grad(set_to_none=True)
    ctx.transport.flush()


def _opt_step(ctx: StepContext, op: Op) -> None:
    """Final gradients, the verdict on skipping the step and the loss (`StepEnd.finish`), then step or not."""
    end_gradients(ctx, op)
    verdict = ctx.step_end.finish({}, local_nonfinite(ctx), local_loss(ctx), unclipped, ctx.sync.take_sqnorm())
    ctx.skipped, ctx.loss = verdict.skip, verdict.loss
    step_or_skip(ctx, verdict.clip if ctx.step_end.max_grad_norm is not None else None)


CORE_HANDLERS: Mapping[OpKind, Handler] = {
    OpKind.FWD: _fwd,
    OpKind.BWD: _bwd,
    OpKind.BWD_W: _bwd_w,
    OpKind.SEND_ACT: _send_act,
    OpKind.RECV_ACT: _recv_act,
    OpKind.SEND_GRAD: _send_grad,
    OpKind.RECV_GRAD: _recv_grad,
    OpKind.ALLREDUCE_GRAD: _allreduce_grad,
    OpKind.OPT_STEP: _opt_step,
}


EVAL_HANDLERS: Mapping[OpKind, Handler] = {
    OpKind.FWD: _eval_fwd,
    OpKind.SEND_ACT: _send_act,
    OpKind.RECV_ACT: _recv_act,
}
"""What evaluation runs: a step's forward ops (`forward_only`), the stages in eval mode."""


def forward_only(ops: Iterable[Op]) -> list[Op]:
    """The FWDs and activation transfers of a step's ops, in their order: the forward half of the schedule, which
    runs as training's does (every receive has its send before it) with the backward, gradients and
    preconditioner work left out."""
    return [op for op in ops if op.kind in EVAL_HANDLERS]


def _post_step_end(ctx: StepContext, op: Op, _: Sequence[Op]) -> None:
    """The receives of OPT_STEP's sum (`StepEnd.post`: the core's carries no <P, G> share)."""
    ctx.step_end.post()


CORE_PREPARES: Mapping[OpKind, Prepare] = {
    OpKind.RECV_ACT: _post_act,
    OpKind.RECV_GRAD: _post_grad,
    OpKind.BWD_W: _defer_w,
    OpKind.OPT_STEP: _post_step_end,
}


class StepListener(Protocol):
    """State outside the core (the preconditioner's) that must survive a skipped step unchanged."""

    def begin_step(self, ctx: StepContext) -> None: ...

    def abort_step(self, ctx: StepContext) -> None: ...

    def commit_step(self, ctx: StepContext) -> None: ...


_PROGRAMS_KEPT = 64
"""Op lists an interpreter keeps looked up: more than a rank's start-up steps and program period."""


@dataclass(frozen=True, slots=True)
class _Program:
    """A step's ops as the interpreter runs them, looked up once per op list (a rank's programs are the same lists
    every period): what each op needs when the step begins, then each op with its handler, text and kind."""

    ops: Sequence[Op]
    """The op list this was made of (kept: its id is the cache key)."""
    made_of: tuple[Op, ...]
    """Its ops when this was made: a list changed in place since is looked up again."""
    sends_first: bool
    """Whether the sends right after the first FWD or BWD go before the late receives' posts (`_late_from`)."""
    prepares: tuple[tuple[Prepare, Op], ...]
    """What runs when the step begins."""
    head: tuple[tuple[Handler, Op, str, str], ...]
    """The ops up to the step's first FWD or BWD (all of them where it has none), and with `sends_first` the sends
    right after it; none where the step begins with a receive and `sends_first` (`_late_from`)."""
    posts: tuple[tuple[Prepare, Op], ...]
    """The receives of the ops after it, posted once it ends ([Note: when receives are posted])."""
    tail: tuple[tuple[Handler, Op, str, str], ...]
    """The ops after it."""


_COMPUTE = (OpKind.FWD, OpKind.BWD)
_SENDS = (OpKind.SEND_ACT, OpKind.SEND_GRAD)
_TRANSFERS_IN = (OpKind.RECV_ACT, OpKind.RECV_GRAD)
_RECEIVES = (*_TRANSFERS_IN, OpKind.OPT_STEP)
"""The ops whose prepare posts receives (OPT_STEP: its sum's, `StepEnd.post`)."""

# [Note: when receives are posted]
# Every receive of a step is posted before any of its sends, so that no transport that matches a send with its
# receive in posting order (NCCL) can wait on a cycle; a posted receive also lets its message land while the rank
# computes. The receives of the ops after the step's first FWD or BWD are posted once that op ends, not when the
# step begins: on gloo each post wakes the peer's I/O thread, and on a host with a core per rank the step's first
# op, which every other rank waits for, then loses a core to those wake-ups.
# OPT_STEP's receives (the step-end sum's: the shares at its root, the total elsewhere, `StepEnd.post`) are posted
# with them: gloo moves a message's bytes only once its receive is posted, so a share received only when the root's
# OPT_STEP begins costs a round trip through the peer's I/O thread on the step's critical path.
# Where a send never waits on its receiver (gloo: `Transport.sends_wait_for_receives` is False) the sends right after
# that first FWD or BWD go before those posts: they carry what a peer waits for (1F1B's stage 0 sends its first
# activation after its first FWD). Under NCCL each stays behind the posts: two ranks whose first op sends to the
# other (Chimera's two pipes) would each hold its receive's post behind a send that waits for the other's.
# On gloo a rank whose step begins with a receive (1F1B's and GPipe's later stages) posts every receive when the step
# begins: it waits for that first message anyway, while the posts after its first FWD would sit between its first
# FWD and BWD, on the critical path. Spreading the late posts over the step (each one op ahead) was slower: a receive
# posted after its send moves its bytes through both ranks' gloo threads while they compute. The measurements behind
# each rule are in docs/RESULTS.md ("The runtime against `torch.distributed.pipelining`").


def _execute(steps: Sequence[tuple[Handler, Op, str, str]], ctx: StepContext, recorder: Recorder | None) -> None:
    """Run `steps` in order, each into `recorder` where there is one (wall clock, waits and CPU time per op)."""
    if recorder is None:
        for handler, op, _, _ in steps:
            handler(ctx, op)
        return
    cpu = Recorder.cpu_now()
    for handler, op, text, kind in steps:
        start, waited = Recorder.now(), ctx.transport.waited_ns
        handler(ctx, op)
        end, took = Recorder.now(), -cpu
        cpu = Recorder.cpu_now()  # one CPU clock read per op: a system call (1-3 us)
        recorder.record(text, kind, ctx.step, start, end, ctx.transport.waited_ns - waited, took + cpu)


def _late_from(ops: Sequence[Op], sends_first: bool) -> int:
    """The index of the op after which the step's late receives are posted: its first FWD or BWD, or the last of the
    sends right after it when `sends_first`; with `sends_first`, -1 (every receive posted when the step begins)
    where the step begins with a receive, which the rank waits for anyway ([Note: when receives are posted])."""
    if sends_first and ops and ops[0].kind in _TRANSFERS_IN:
        return -1
    first = next((i for i, op in enumerate(ops) if op.kind in _COMPUTE), len(ops))
    while sends_first and first + 1 < len(ops) and ops[first + 1].kind in _SENDS:
        first += 1
    return first


def _same_ops(made_of: tuple[Op, ...], ops: Sequence[Op]) -> bool:
    """Whether `ops` still holds the very ops it held (by identity: a few ns an op, no hashing of op fields)."""
    return len(made_of) == len(ops) and all(a is b for a, b in zip(made_of, ops, strict=True))


class Interpreter:
    """Runs a list of ops through a dispatch table, recording each into a Recorder."""

    def __init__(self, handlers: Mapping[OpKind, Handler] | None = None) -> None:
        self.handlers: dict[OpKind, Handler] = dict(CORE_HANDLERS if handlers is None else handlers)
        self.prepares: dict[OpKind, Prepare] = dict(CORE_PREPARES)
        self.listeners: list[StepListener] = []
        """Told when a step begins and when it is skipped (`abort`), to restore their state."""
        self._programs: dict[int, _Program] = {}
        """Op lists looked up so far by their id (`_program`); emptied by `register`."""

    def abort(self, ctx: StepContext) -> None:
        """The step of `ctx` is skipped: every listener restores the state it had when the step began."""
        for listener in self.listeners:
            listener.abort_step(ctx)

    def commit(self, ctx: StepContext) -> None:
        """The step of `ctx` stood: every listener drops what it kept to restore (so it frees that memory)."""
        for listener in self.listeners:
            listener.commit_step(ctx)

    def register(self, kind: OpKind, handler: Handler, prepare: Prepare | None = None) -> None:
        """Install (or replace) the handler of `kind`, and what its ops need when their step begins."""
        self.handlers[kind] = handler
        if prepare is not None:
            self.prepares[kind] = prepare
        self._programs.clear()

    def _program(self, ops: Sequence[Op], rank: int, sends_first: bool) -> _Program:
        """`ops` with every op's prepare, handler and text looked up (once per op list: the per-op dictionary
        lookups and texts are not paid again each step); PipelineError for an op without a handler."""
        program = self._programs.get(id(ops))
        if (
            program is not None
            and program.ops is ops
            and program.sends_first == sends_first
            and _same_ops(program.made_of, ops)
        ):
            return program
        missing = next((op for op in ops if op.kind not in self.handlers), None)
        if missing is not None:
            raise PipelineError(
                f"rank {rank} has no handler for '{missing}'; register one with "
                f"Interpreter.register(OpKind.{missing.kind.name}, fn) (preconditioner ops need the family's runtime)"
            )
        first = _late_from(ops, sends_first)
        prepares: list[tuple[Prepare, Op]] = []
        posts: list[tuple[Prepare, Op]] = []
        for i, op in enumerate(ops):
            if op.kind in self.prepares:
                (posts if i > first and op.kind in _RECEIVES else prepares).append((self.prepares[op.kind], op))
        steps = tuple((self.handlers[op.kind], op, str(op), op.kind.value) for op in ops)
        if len(self._programs) >= _PROGRAMS_KEPT:  # op lists made anew per call (evaluation's) must not pile up
            self._programs.clear()
        program = _Program(
            ops, tuple(ops), sends_first, tuple(prepares), steps[: first + 1], tuple(posts), steps[first + 1 :]
        )
        self._programs[id(ops)] = program
        return program

    def run(self, ops: Sequence[Op], ctx: StepContext, timeline: Recorder | None = None) -> None:
        """Execute `ops` in order on `ctx`, each op's `prepares` entry run first, except the receives after the
        step's first FWD or BWD, posted once it ends (on gloo, once the sends right after it have started, or when
        the step begins with a receive, all at its start) ([Note: when receives are posted])."""
        program = self._program(ops, ctx.rank, not ctx.transport.sends_wait_for_receives)
        for listener in self.listeners:
            listener.begin_step(ctx)
        for prepare, op in program.prepares:
            prepare(ctx, op, ops)
        recorder = timeline if timeline is not None and timeline.enabled else None  # no clock read otherwise
        _execute(program.head, ctx, recorder)
        for prepare, op in program.posts:
            prepare(ctx, op, ops)
        _execute(program.tail, ctx, recorder)
        leftovers = [r for r in ctx.runners.values() if r.pending()]
        if leftovers or ctx.acts or ctx.grads or ctx.to_send or ctx.transport.in_flight():
            raise AssertionError(
                f"rank {ctx.rank}: step {ctx.step} ended with unconsumed state "
                f"(acts {list(ctx.acts)}, grads {list(ctx.grads)}, sends {list(ctx.to_send)}, "
                f"collectives in flight {ctx.transport.in_flight()})"
            )
