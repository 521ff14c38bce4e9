"""K-FAC in the pipelined runtime: tapped stage runners and the CURV, SYNC_CURV, INV, BCAST_INV, PREC handlers.

[Note: pipelined K-FAC semantics] The handlers reproduce the single-device trainer (fxkfac/single.py)
exactly, whatever step or rank a plan puts each op on:
- at step t every local layer with ``t % period == curv_step`` is tapped (fused or deferred) in its
  stage's forward/backward, and a *refresh record* for step t is opened;
- ``CURV s m F layer`` turns micro-batch m's capture into ``A_m`` / ``B_m`` and adds it to the oldest
  open record of the layer (captures wait in FIFOs, so a plan may run curvature steps later);
- ``SYNC_CURV s [F] layer`` sums the record's factor over every copy of the stage (dp replicas and
  Chimera's two pipelines) and folds the mean into the running average (a stage held once folds at
  its first INV instead);
- ``INV s F layer`` inverts one factor (damping split as `fxkfac.kfac.inverse.invert` does);
  ``BCAST_INV s F @rR layer`` broadcasts it from rank R to the stage's other copies; once both halves
  are there the layer's inverse is queued to become active at ``t + use_offset``;
- ``PREC s`` activates due inverses and preconditions the stage's gradients; an inverse that is due but
  missing is a plan error (PipelineError), never a silent use of an older one;
- OPT_STEP is wrapped: the KL-clip's ``sum <P, G>`` is all-reduced over all ranks (each stage's share
  divided by its number of copies) together with the NaN/Inf flag of the step, the K-FAC gradients are
  scaled by nu, then the core OPT_STEP runs.
- a skipped step (NaN/Inf loss or gradients on some rank) leaves no trace: the runtime is an
  interpreter listener, and ``abort_step`` restores the layer states, refresh records, inverse outbox
  and captures as they were when the step began (the single-device trainer's skip, exactly).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fxkfac.config import KFACConfig
from fxkfac.errors import CheckpointError, PipelineError
from fxkfac.kfac.factors import a_rows, e_rows, factor, running_average
from fxkfac.kfac.inverse import FactorInverse, combine, damping_split, invert_factor
from fxkfac.kfac.precondition import kl_clip_scale
from fxkfac.kfac.state import LayerState
from fxkfac.passes.factor_capture import FactorTaps, insert_factor_capture
from fxkfac.passes.layers import KFACLayer
from fxkfac.kfac.precondition import Preconditioner
from fxkfac.planner.ir import LayerTiming, Op, OpKind
from fxkfac.runtime.interpreter import CORE_HANDLERS, Interpreter, StepContext, local_nonfinite
from fxkfac.runtime.stage import StageRunner

__all__ = ["TappedRunner", "StageGroup", "KFACRuntime"]

FACTORS = ("A", "B")


@dataclass
class TappedRunner(StageRunner):
    """A StageRunner whose forward/backward also capture K-FAC factors of the layers in `modes`.

    `modes` (layer -> "fused" | "deferred") is set by the trainer before each step; with no modes the
    plain stage function runs. Captures wait in `captures[(layer, factor, mb)]` FIFOs for CURV ops.
    """

    layers: dict[str, KFACLayer] = field(default_factory=dict)
    backend: str | None = None
    modes: dict[str, str] = field(default_factory=dict)
    captures: dict[tuple[str, str, int], deque[Tensor]] = field(default_factory=dict)
    _variants: dict[tuple, tuple[FactorTaps, Any]] = field(default_factory=dict)
    _probes: dict[int, dict[str, Tensor]] = field(default_factory=dict)

    @classmethod
    def wrap(cls, runner: StageRunner, layers: Mapping[str, KFACLayer], backend: str | None) -> TappedRunner:
        """The same stage copy (same module and parameters) with factor capture for `layers`."""
        return cls(runner.graph, runner.pipe, runner.module, runner.fn, runner.is_last,
                   layers=dict(layers), backend=backend)

    def _variant(self) -> tuple[FactorTaps, Any]:
        key = tuple(sorted(self.modes.items()))
        if key not in self._variants:
            taps = insert_factor_capture(self.module, list(self.layers.values()), self.modes)
            fn = taps.gm if self.backend is None else torch.compile(taps.gm, backend=self.backend, dynamic=False)
            self._variants[key] = (taps, fn)
        return self._variants[key]

    def forward(self, mb: int, inputs: Sequence[Tensor], needs_grad: bool) -> tuple[Tensor, ...]:
        """Run the stage on micro-batch `mb`, keeping the A-side captures and the B-side probes."""
        if not self.modes:
            return super().forward(mb, inputs, needs_grad)
        taps, fn = self._variant()
        order = sorted(taps.probes, key=taps.probes.__getitem__)
        device = inputs[0].device if inputs else torch.device("cpu")
        probes = [torch.zeros(taps.probe_shapes[n], device=device, requires_grad=True) for n in order]
        leaves = [x.requires_grad_(True) if needs_grad and x.is_floating_point() else x for x in inputs]
        outs = tuple(fn(*leaves, *probes))
        user = outs[:taps.n_outputs]
        self._inputs[mb] = leaves
        self._outputs[mb] = user
        for name, index in taps.a_outputs.items():
            self.captures.setdefault((name, "A", mb), deque()).append(outs[index].detach())
        self._probes[mb] = dict(zip(order, probes))
        return user

    def backward(self, mb: int, output_grads: Sequence[Tensor] | None) -> list[Tensor]:
        """Backpropagate `mb`; the probes' gradients are the B-side captures."""
        probes = self._probes.pop(mb, {})
        grads = super().backward(mb, output_grads)
        for name, probe in probes.items():
            value = probe.grad if probe.grad is not None else torch.zeros_like(probe)
            self.captures.setdefault((name, "B", mb), deque()).append(value)
        return grads

    def captures_state(self) -> list[list[Any]]:
        """The captures waiting for CURV ops: ``[[layer, side, mb, [tensors, oldest first]], ...]``."""
        return [[layer, side, mb, list(queue)] for (layer, side, mb), queue in sorted(self.captures.items()) if queue]

    def parse_captures(self, saved: Any) -> dict[tuple[str, str, int], deque[Tensor]]:
        """`captures_state` output as capture FIFOs of this stage's layers; CheckpointError when malformed."""
        try:
            out = {(str(layer), str(side), int(mb)): deque(tensors) for layer, side, mb, tensors in saved}
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"captures of stage {self.stage} are malformed ({e!r})") from e
        strange = sorted({k[0] for k in out if k[0] not in self.layers or k[1] not in FACTORS})
        if strange or not all(isinstance(t, Tensor) for q in out.values() for t in q):
            raise CheckpointError(f"captures of stage {self.stage} name layers it does not hold ({strange}) "
                                  "or hold no tensors; the checkpoint was written for another split")
        return out

    def take(self, layer: str, side: str, mb: int, op: Op) -> Tensor:
        """The oldest capture of (layer, side, mb); PipelineError when the plan consumes one never made."""
        queue = self.captures.get((layer, side, mb))
        if not queue:
            raise PipelineError(f"'{op}': no capture of {side} for micro-batch {mb} (the layer was not tapped "
                                "or its FWD/BWD has not run): the plan orders CURV wrongly for its LayerTiming")
        value = queue.popleft()
        if not queue:
            del self.captures[(layer, side, mb)]
        return value


@dataclass(frozen=True)
class StageGroup:
    """Every copy of one stage: the holder ranks and their process group (None: the world or alone)."""

    ranks: tuple[int, ...]
    group: Any


@dataclass
class _Refresh:
    """One refresh of one layer in flight: factor sums, whether each is folded, and the two inverse halves."""

    step: int
    sums: dict[str, Tensor] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"A": 0, "B": 0})
    folded: set[str] = field(default_factory=set)
    halves: dict[str, FactorInverse | None] = field(default_factory=dict)


class KFACRuntime:
    """K-FAC state of one rank's stages and the handlers that act on it (see [Note: pipelined K-FAC semantics])."""

    def __init__(self, cfg: KFACConfig, layers: Mapping[str, KFACLayer], stage_of: Mapping[str, int],
                 timings: Mapping[str, LayerTiming], groups: Mapping[int, StageGroup], rank: int,
                 microbatches_total: int, global_batch: int) -> None:
        self.cfg = cfg
        self.layers = dict(layers)
        self.stage_of = dict(stage_of)
        self.timings = dict(timings)
        self.groups = dict(groups)
        self.rank = rank
        self.total = microbatches_total
        self.n = global_batch
        self.states = {name: LayerState(layer.a_dim, layer.b_dim) for name, layer in self.layers.items()}
        self.refreshes: dict[str, deque[_Refresh]] = {name: deque() for name in self.layers}
        self._by_stage = {s: [self.layers[n] for n in self.layers if self.stage_of[n] == s] for s in groups}
        self._preconditioners = {s: Preconditioner(ls) for s, ls in self._by_stage.items()}
        self._dot = torch.zeros((), dtype=torch.float64)
        self._scaled: list[tuple[int, dict[str, Tensor]]] = []
        self._outbox: dict[tuple[str, str], deque[FactorInverse | None]] = {}
        """Halves this rank inverted for a stage with several copies, waiting for their BCAST_INV."""
        self._at_begin: Any = None
        """The state `begin_step` remembered, restored by `abort_step`."""

    def install(self, interpreter: Interpreter) -> None:
        """Register the K-FAC handlers and the KL-clipping OPT_STEP on `interpreter`."""
        interpreter.register(OpKind.CURV, self.curv)
        interpreter.register(OpKind.SYNC_CURV, self.sync_curv)
        interpreter.register(OpKind.INV, self.inv)
        interpreter.register(OpKind.BCAST_INV, self.bcast_inv)
        interpreter.register(OpKind.PREC, self.prec)
        interpreter.register(OpKind.OPT_STEP, self.opt_step)
        interpreter.listeners.append(self)

    def modes_at(self, step: int, layer_names: Sequence[str]) -> dict[str, str]:
        """The layers among `layer_names` that step `step` taps, with their capture mode."""
        return {n: self.timings[n].capture for n in layer_names
                if step % self.timings[n].period == self.timings[n].curv_step}

    def open_refreshes(self, step: int) -> None:
        """Open a refresh record at `step` for every local layer that refreshes then."""
        for name in self.modes_at(step, list(self.layers)):
            self.refreshes[name].append(_Refresh(step))

    # --- handlers -------------------------------------------------------------------------------

    def _layers_of(self, op: Op) -> list[str]:
        if op.layer is not None:
            if op.layer not in self.layers:
                raise PipelineError(f"rank {self.rank}: '{op}' names a layer this rank does not hold; the plan "
                                    f"was made for another graph or split (local layers: {sorted(self.layers)})")
            return [op.layer]
        return [layer.name for layer in self._by_stage.get(op.stage, [])]

    def _record(self, name: str, op: Op, ready: Any) -> _Refresh:
        for record in self.refreshes[name]:
            if ready(record):
                return record
        raise PipelineError(f"rank {self.rank}: '{op}' has no refresh of {name} to act on: the plan "
                            f"does not match the layer's timing {self.timings[name]}")

    def curv(self, ctx: StepContext, op: Op) -> None:
        """Add micro-batch `op.mb`'s A_m and/or B_m to the layer's open refresh."""
        runner = ctx.runner(op)
        if not isinstance(runner, TappedRunner):
            raise AssertionError("CURV on a runner without factor capture")
        for name in self._layers_of(op):
            layer, mode = self.layers[name], self.timings[name].capture
            for side in (op.factor,) if op.factor else FACTORS:
                raw = runner.take(name, side, op.mb, op)  # type: ignore[arg-type]
                value = self._factor(layer, side, mode, raw)
                record = self._record(name, op, lambda r, s=side: s not in r.folded)
                record.sums[side] = value if side not in record.sums else record.sums[side] + value
                record.counts[side] += 1

    def _factor(self, layer: KFACLayer, side: str, mode: str, raw: Tensor) -> Tensor:
        dtype = getattr(torch, self.cfg.factor_dtype)
        if mode == "fused":
            return raw.to(dtype) if side == "A" else (raw * (self.n * self.n)).to(dtype)
        rows = a_rows(raw, layer) if side == "A" else e_rows(raw, layer, self.n)
        return factor(rows, dtype)

    def sync_curv(self, ctx: StepContext, op: Op) -> None:
        """Sum the refresh's factor(s) over every copy of the stage, then fold them into the running average."""
        for name in self._layers_of(op):
            group = self.groups[self.stage_of[name]]
            for side in (op.factor,) if op.factor else FACTORS:
                record = self._record(name, op, lambda r, s=side: s not in r.folded)
                local = record.sums.get(side)
                dim = self.layers[name].a_dim if side == "A" else self.layers[name].b_dim
                flat = torch.zeros(dim * dim + 1, dtype=getattr(torch, self.cfg.factor_dtype))
                if local is not None:
                    flat[:-1] = local.reshape(-1)
                flat[-1] = record.counts[side]
                if len(group.ranks) > 1:
                    ctx.transport.all_reduce(flat, group.group, str(op))
                record.sums[side] = flat[:-1].view(dim, dim)
                record.counts[side] = int(round(float(flat[-1])))
                self._fold(name, side, record, op)

    def _fold(self, name: str, side: str, record: _Refresh, op: Op) -> None:
        if record.counts[side] != self.total:
            raise PipelineError(f"rank {self.rank}: '{op}' folds {side} of {name} from {record.counts[side]} "
                                f"micro-batches, expected {self.total}: the plan lacks CURV or SYNC_CURV ops")
        state = self.states[name]
        mean = record.sums.pop(side) / record.counts[side]
        if side == "A":
            state.A = running_average(state.A, mean, self.cfg.factor_decay)
        else:
            state.B = running_average(state.B, mean, self.cfg.factor_decay)
        record.folded.add(side)
        if record.folded == set(FACTORS):
            state.refreshes += 1

    def _gamma(self, name: str, side: str, op: Op) -> float:
        cfg, state = self.cfg, self.states[name]
        if cfg.inverse == "eigen" and not cfg.pi_damping:
            return 0.0
        if cfg.pi_damping and (state.A is None or state.B is None):
            raise PipelineError(f"'{op}': pi-damping needs both factors of {name} folded before either is "
                                "inverted; put both SYNC_CURV ops before the INV ops")
        gamma_a, gamma_b = damping_split(state.A, state.B, cfg.damping, cfg.pi_damping)  # type: ignore[arg-type]
        return gamma_a if side == "A" else gamma_b

    def inv(self, ctx: StepContext, op: Op) -> None:
        """Invert one factor (folding it first when the stage has a single copy)."""
        for name in self._layers_of(op):
            for side in (op.factor,) if op.factor else FACTORS:
                record = self._record(name, op, lambda r, s=side: s not in r.halves)
                if side not in record.folded:
                    self._fold(name, side, record, op)
                f = self.states[name].A if side == "A" else self.states[name].B
                half = invert_factor(f, self._gamma(name, side, op), method=self.cfg.inverse,
                                     max_retries=self.cfg.max_cholesky_retries, name=name, side=side)
                record.halves[side] = half
                if len(self.groups[self.stage_of[name]].ranks) > 1:
                    self._outbox.setdefault((name, side), deque()).append(half)
                self._maybe_combine(name)

    def bcast_inv(self, ctx: StepContext, op: Op) -> None:
        """Broadcast one inverted factor from rank `op.peer` to every copy of the stage."""
        if op.peer is None:
            raise PipelineError(f"'{op}' needs the root rank (@rN)")
        for name in self._layers_of(op):
            group = self.groups[self.stage_of[name]]
            for side in (op.factor,) if op.factor else FACTORS:
                dim = self.layers[name].a_dim if side == "A" else self.layers[name].b_dim
                if op.peer == self.rank:
                    outbox = self._outbox.get((name, side))
                    if not outbox:
                        raise PipelineError(f"rank {self.rank}: '{op}' broadcasts an inverse this rank has not "
                                            "computed: the plan lacks the INV before it")
                    flat = _pack(outbox.popleft(), dim, self.cfg)
                else:
                    flat = _empty(dim, self.cfg)
                if len(group.ranks) > 1:
                    ctx.transport.broadcast(flat, op.peer, group.group, str(op))
                if op.peer != self.rank:
                    record = self._record(name, op, lambda r, s=side: s not in r.halves)
                    record.halves[side] = _unpack(flat, dim, self.cfg)
                    self._maybe_combine(name)

    def _maybe_combine(self, name: str) -> None:
        """Queue the layer's inverse once both halves of its oldest refresh are known."""
        queue = self.refreshes[name]
        while queue and set(queue[0].halves) == set(FACTORS):
            record = queue.popleft()
            a, b = record.halves["A"], record.halves["B"]
            if a is not None and b is not None:
                shift = self.cfg.damping if self.cfg.inverse == "eigen" and not self.cfg.pi_damping else 0.0
                self.states[name].set_pending(combine(a, b, shift), record.step + self.timings[name].use_offset)

    def prec(self, ctx: StepContext, op: Op) -> None:
        """Activate due inverses and precondition stage `op.stage`'s gradients; add its share of <P, G>."""
        runner = ctx.stage_runner(op.stage)  # type: ignore[arg-type]
        names = [layer.name for layer in self._by_stage.get(op.stage, [])]  # type: ignore[arg-type]
        for name in names:
            late = [r.step for r in self.refreshes[name] if r.step + self.timings[name].use_offset <= ctx.step]
            if late:
                raise PipelineError(f"rank {self.rank}: '{op}' at step {ctx.step} needs the inverse of {name} "
                                    f"refreshed at step {late[0]}, which the plan has not made yet")
            self.states[name].activate(ctx.step)
        grads = {n: p.grad for n, p in runner.module.named_parameters() if p.grad is not None}
        dot = self._preconditioners[op.stage](grads, self.states)  # type: ignore[index]
        self._dot = self._dot + dot / len(self.groups[op.stage].ranks)  # type: ignore[index]
        self._scaled.append((op.stage, grads))  # type: ignore[arg-type]

    def opt_step(self, ctx: StepContext, op: Op) -> None:
        """One world all-reduce of sum <P, G> (KL-clip over all stages) and the NaN/Inf flag; then the core
        OPT_STEP, which steps unless some rank's loss or gradients were non-finite."""
        both = torch.stack([self._dot, torch.tensor(float(local_nonfinite(ctx)), dtype=torch.float64)])
        ctx.transport.all_reduce(both, None, f"{op} (KL-clip <P, G> and non-finite check all-reduce)")
        ctx.skipped = bool(both[1] > 0)
        if self.cfg.kl_clip is not None and not ctx.skipped:
            nu = kl_clip_scale(float(both[0]), float(ctx.optimizer.param_groups[0]["lr"]), self.cfg.kl_clip)
            for stage, grads in self._scaled:
                self._preconditioners[stage].scale(grads, nu)
        self._dot = torch.zeros((), dtype=torch.float64)
        self._scaled = []
        CORE_HANDLERS[OpKind.OPT_STEP](ctx, op)

    # --- skipped steps and checkpoints ------------------------------------------------------------

    def begin_step(self, ctx: StepContext) -> None:
        """Remember the K-FAC state and the runners' captures (see `abort_step`), then open the step's refreshes."""
        captures = {key: {k: deque(q) for k, q in r.captures.items()} for key, r in ctx.runners.items()
                    if isinstance(r, TappedRunner)}
        self._at_begin = (self._copy(), captures)
        self.open_refreshes(ctx.step)

    def abort_step(self, ctx: StepContext) -> None:
        """Restore what `begin_step` remembered: a skipped step leaves no factor, inverse or capture behind."""
        (states, refreshes, outbox), captures = self._at_begin
        self._install(states, refreshes, outbox)
        for key, saved in captures.items():
            ctx.runners[key].captures = saved  # type: ignore[attr-defined]
        self._dot = torch.zeros((), dtype=torch.float64)
        self._scaled = []

    def _copy(self) -> tuple[dict[str, LayerState], dict[str, deque[_Refresh]], dict]:
        states = {}
        for name, state in self.states.items():
            states[name] = copy.copy(state)
            states[name].pending = list(state.pending)
        refreshes = {n: deque(_Refresh(r.step, dict(r.sums), dict(r.counts), set(r.folded), dict(r.halves))
                              for r in q) for n, q in self.refreshes.items()}
        return states, refreshes, {k: deque(q) for k, q in self._outbox.items()}

    def _install(self, states: Mapping[str, LayerState], refreshes: Mapping[str, deque[_Refresh]],
                 outbox: Mapping[tuple[str, str], deque[FactorInverse | None]]) -> None:
        """Take over the given state, keeping the LayerState objects others hold (the trainer's kfac_states)."""
        for name, state in states.items():
            vars(self.states[name]).update(vars(state))
        self.refreshes = {n: deque(refreshes.get(n, ())) for n in self.layers}
        self._outbox = dict(outbox)

    def state_dict(self) -> dict[str, Any]:
        """``{"kfac": {layer: LayerState.state_dict()}, "inflight": {...}}``: the layer states (alike on every
        copy of a stage) and this rank's work in flight: open refreshes and inverses waiting for BCAST_INV."""
        refreshes = {n: [{"step": r.step, "sums": dict(r.sums), "counts": dict(r.counts), "folded": sorted(r.folded),
                          "halves": {side: _half_state(h) for side, h in r.halves.items()}} for r in q]
                     for n, q in self.refreshes.items() if q}
        outbox = [[n, side, [_half_state(h) for h in q]] for (n, side), q in sorted(self._outbox.items()) if q]
        return {"kfac": {n: s.state_dict() for n, s in self.states.items()},
                "inflight": {"refreshes": refreshes, "outbox": outbox}}

    def parse_state(self, state: Mapping[str, Any]) -> tuple:
        """`state_dict` output as new layer states, refresh records and outbox, checked against this rank's
        layers; CheckpointError when it names other layers or is malformed. Changes nothing (see `load_parsed`)."""
        saved, inflight = state.get("kfac"), state.get("inflight")
        if not isinstance(saved, Mapping) or set(saved) != set(self.layers) or not isinstance(inflight, Mapping):
            raise CheckpointError(f"checkpoint K-FAC layers {sorted(saved or {})[:6]} differ from this rank's "
                                  f"{sorted(self.layers)[:6]}; it was written for another model, split or plan")
        states = {}
        for name, layer in self.layers.items():
            states[name] = LayerState(layer.a_dim, layer.b_dim)
            states[name].load_state_dict(dict(saved[name]))
        try:
            refreshes = {n: deque(_Refresh(int(r["step"]), dict(r["sums"]), {k: int(v) for k, v in r["counts"].items()},
                                           set(r["folded"]), {k: _half(h) for k, h in r["halves"].items()})
                                  for r in records) for n, records in inflight["refreshes"].items()}
            outbox = {(str(n), str(side)): deque(_half(h) for h in halves) for n, side, halves in inflight["outbox"]}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"K-FAC work in flight is malformed in the checkpoint ({e!r})") from e
        unknown = sorted((set(refreshes) | {n for n, _ in outbox}) - set(self.layers))
        if unknown:
            raise CheckpointError(f"checkpoint has K-FAC work in flight for layers {unknown} this rank does not hold")
        return states, refreshes, outbox

    def load_parsed(self, parsed: tuple) -> None:
        """Install what `parse_state` returned."""
        self._install(*parsed)


def _half_state(half: FactorInverse | None) -> dict[str, Any] | None:
    if half is None:
        return None
    if half.method == "cholesky":
        return {"method": "cholesky", "inv": half.inv}
    return {"method": "eigen", "q": half.q, "l": half.l}


def _half(saved: Any) -> FactorInverse | None:
    if saved is None:
        return None
    if saved["method"] == "cholesky" and isinstance(saved["inv"], Tensor):
        return FactorInverse("cholesky", inv=saved["inv"])
    if saved["method"] == "eigen" and isinstance(saved["q"], Tensor) and isinstance(saved["l"], Tensor):
        return FactorInverse("eigen", q=saved["q"], l=saved["l"])
    raise ValueError(f"an inverse half has method {saved['method']!r} or lacks its tensors")


def _pack(half: FactorInverse | None, dim: int, cfg: KFACConfig) -> Tensor:
    """``[ok, payload]``: the inverse (Cholesky) or eigenvectors and eigenvalues (eigen); ok=0 for a failure."""
    out = _empty(dim, cfg)
    if half is None:
        return out
    out[0] = 1.0
    if half.method == "cholesky":
        out[1:] = half.inv.reshape(-1)  # type: ignore[union-attr]
    else:
        out[1:1 + dim * dim] = half.q.reshape(-1)  # type: ignore[union-attr]
        out[1 + dim * dim:] = half.l  # type: ignore[assignment]
    return out


def _empty(dim: int, cfg: KFACConfig) -> Tensor:
    size = 1 + dim * dim + (dim if cfg.inverse == "eigen" else 0)
    return torch.zeros(size, dtype=getattr(torch, cfg.factor_dtype))


def _unpack(flat: Tensor, dim: int, cfg: KFACConfig) -> FactorInverse | None:
    if float(flat[0]) == 0.0:
        return None
    if cfg.inverse == "cholesky":
        return FactorInverse("cholesky", inv=flat[1:].view(dim, dim).clone())
    return FactorInverse("eigen", q=flat[1:1 + dim * dim].view(dim, dim).clone(), l=flat[1 + dim * dim:].clone())
