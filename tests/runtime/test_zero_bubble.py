"""Zero-bubble schedules (ZB-H1, ZB-V, interleaved ZB) run their split backward: a BWD that has a BWD_W makes only
the input gradients, the BWD_W the weight gradients; pipelined training equals one device to 1e-5 for every family
(AdamW, K-FAC, Shampoo, SOAP) at W = 1 and 2, eagerly and in one compiled case."""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn

import fxkfac
from fxkfac.capture import capture
from fxkfac.config import PipelineOptions
from fxkfac.errors import PipelineError
from fxkfac.families import family_of
from fxkfac.passes.split_stages import StageGraph, TensorSpec, split_stages
from fxkfac.planner.problem import Capture
from fxkfac.planner.problem.ir import LayerTiming, Op, OpKind
from fxkfac.runtime.split_backward import ArgGrad, PendingW, split_stage
from fxkfac.runtime.stage import StageRunner
from fxkfac.runtime.tapped_runner import TappedRunner, read_before_w
from tests import test_shampoo_pipeline as shampoo
from tests.e2e import workers as kfac
from tests.runtime.workers import Config, loss_for, make_batches, make_model, make_optimizer, reference_run
from tests.support import models
from tests.support.distributed import run_distributed


@dataclass(frozen=True)
class Case:
    """One pipelined run: family (adamw, kfac, shampoo, soap), schedule, D, N per replica, W, virtual stages."""

    family: str
    schedule: str
    D: int
    N: int
    W: int
    backend: str | None = None

    @property
    def v(self) -> int:
        return 1 if self.schedule == "zb-h1" else 2

    @property
    def config(self) -> Config:
        """The AdamW run of tests/runtime/workers.py (mlp6: enough blocks for 2D stages)."""
        return Config(self.schedule, self.D, self.N, self.W, "mlp6", "adamw", v=self.v)


def _trainer(case: Case) -> fxkfac.Trainer:
    options = PipelineOptions(virtual_stages=case.v, timeout=120.0)
    mesh = (case.D, case.W)
    if case.family == "adamw":
        batches = make_batches(case.config)
        return fxkfac.compile(
            make_model("mlp6"),
            mesh,
            None,
            example_inputs=(batches[0][0],),
            loss_fn=loss_for("mlp6"),
            optimizer=make_optimizer("adamw"),
            preconditioner=None,
            schedule=case.schedule,
            microbatches=case.N,
            backend=case.backend,
            pipeline=options,
        )
    if case.family == "kfac":
        data = kfac.batches(kfac.Case(case.schedule, case.D, case.N, case.W))
        return fxkfac.compile(
            kfac.make_model(),
            mesh,
            None,
            preconditioner=kfac.KFAC,
            example_inputs=(data[0][0],),
            loss_fn=kfac.loss_fn,
            optimizer=kfac.optimizer,
            schedule=case.schedule,
            backend=case.backend,
            microbatches=case.N,
            layer_timing=kfac.timings_for(kfac._names_for(kfac.Case(case.schedule, case.D, case.N, case.W))),
            pipeline=options,
        )
    return fxkfac.compile(
        shampoo.mlp(seed=0),
        mesh,
        None,
        example_inputs=(shampoo.mlp_batches(shampoo.STEPS)[0][0],),
        loss_fn=F.mse_loss,
        optimizer=shampoo._sgd,
        backend=case.backend,
        schedule=case.schedule,
        microbatches=case.N,
        preconditioner=shampoo.FAMILIES[case.family],
        layer_timing=shampoo._timings(),
        pipeline=options,
    )


def _data(case: Case) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    if case.family == "adamw":
        return [((x,), y) for x, y in make_batches(case.config)]
    if case.family == "kfac":
        return [((ids,), y) for ids, y in kfac.batches(kfac.Case(case.schedule, case.D, case.N, case.W))]
    return [((x,), y) for x, y in shampoo.mlp_batches(shampoo.STEPS)]


def _read_after_w(programs: list[list[Op]], layers: set[str]) -> bool:
    """Whether a program step reads an output-gradient capture (K-FAC's B part) of one of `layers` after the W of its
    micro-batch: W makes it ([Note: late captures] in fxkfac/runtime/tapped_runner.py)."""
    for step in programs:
        w_ran = set()
        for op in step:
            if op.kind is OpKind.BWD_W:
                w_ran.add((op.stage, op.pipe, op.mb))
            elif op.kind is OpKind.STATS and op.part == "B" and op.layer in layers:
                if (op.stage, op.pipe, op.mb) in w_ran:
                    return True
    return False


def _worker(rank: int, world: int, cases: list[Case]) -> list[dict]:
    out = []
    for case in cases:
        trainer = _trainer(case)
        ops = [op for step in trainer.spec.programs[rank] for op in step]
        timings = trainer.spec.timings if case.family == "kfac" else {}
        deferred = {n for n, t in timings.items() if t.capture is Capture.DEFERRED}
        for inputs, y in _data(case):
            trainer.step(inputs, y)
        out.append(
            {
                "params": {n: copy.deepcopy(p.detach()) for n, p in trainer.named_parameters()},
                "weights_deferred": any(op.kind is OpKind.BWD_W for op in ops),
                "split": all(r.split for r in trainer.runners.values()),
                "aliases": trainer.spec.split.param_aliases,
                "deferred_made_by_w": _read_after_w(trainer.spec.programs[rank], deferred),
            }
        )
        dist.barrier()
    return out


def _reference(case: Case) -> dict[str, torch.Tensor]:
    """One device on the same mini-batches and N*W micro-batches."""
    if case.family == "adamw":
        return reference_run(case.config)[0]
    if case.family == "kfac":
        kcase = kfac.Case(case.schedule, case.D, case.N, case.W)
        return kfac.reference_params(kcase, kfac.timings_for(kfac._names_for(kcase)))
    assert case.N * case.W == shampoo.N, "the Shampoo/SOAP reference trains N micro-batches"
    return shampoo._one_device(case.family)


def _check(cases: list[Case], world: int) -> None:
    results = run_distributed(_worker, world, cases, timeout=600)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for i, case in enumerate(cases):
        want = _reference(case)
        covered: set[str] = set()
        for r in results:
            run = r.value[i]
            assert run["weights_deferred"] and run["split"], f"{case} rank {r.rank}: no BWD_W ran split"
            for name, value in run["params"].items():
                torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=f"{case} rank {r.rank} {name}")
                covered.add(name)
        if case.family == "kfac":  # deferred captures read after their W, made by it: its G equals one device's
            assert any(r.value[i]["deferred_made_by_w"] for r in results), f"{case}: no deferred capture read after W"
        aliases = {a for r in results for a in r.value[i]["aliases"]}
        assert covered | aliases >= set(want), f"{case}: parameters {sorted(set(want) - covered)} are on no rank"


FAMILIES = ("adamw", "kfac", "shampoo", "soap")
SCHEDULES = ("zb-h1", "zb-v", "zb-1p")


@pytest.mark.multiproc
def test_zero_bubble_schedules_equal_one_device_w1() -> None:
    """Every family on every zero-bubble schedule at D=2, W=1."""
    _check([Case(f, s, 2, 4 if f == "adamw" else 2, 1) for f in FAMILIES for s in SCHEDULES], 2)


@pytest.mark.multiproc
def test_zero_bubble_schedules_equal_one_device_w2() -> None:
    """Every family on ZB-H1 and ZB-V at D=2, W=2."""
    _check([Case(f, s, 2, 2 if f == "adamw" else 1, 2) for f in FAMILIES for s in ("zb-h1", "zb-v")], 4)


@pytest.mark.multiproc
def test_compiled_zero_bubble_equals_one_device() -> None:
    """ZB-H1 with every stage's forward, B and W compiled by inductor."""
    _check([Case("adamw", "zb-h1", 2, 4, 1, backend="inductor")], 2)


def _runner(backend: str | None = None) -> tuple[StageRunner, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.LayerNorm(3))
    gm = fx.symbolic_trace(copy.deepcopy(model))
    inputs, outputs = (TensorSpec("x", (5, 4), torch.float32),), (TensorSpec("y", (5, 3), torch.float32),)
    graph = StageGraph(0, gm, inputs, outputs, tuple(n for n, _ in gm.named_parameters()))
    runner = StageRunner.build(graph, 0, False, backend, copy=False)
    runner.split = True
    return runner, model


def test_b_makes_input_gradients_and_w_weight_gradients() -> None:
    """A deferred backward leaves the weights' gradients unset until `backward_weights`; then they, and the input
    gradient B returned, equal autograd's."""
    runner, model = _runner()
    x, g = torch.randn(5, 4), torch.randn(5, 3)
    runner.forward(0, [x.clone()], needs_grad=True)
    (dx,) = runner.backward(0, [g], defer_weights=True)
    assert all(p.grad is None for p in runner.module.parameters())
    assert runner.pending() == [0]
    runner.backward_weights(0)
    assert runner.pending() == []
    xr = x.clone().requires_grad_(True)
    model(xr).backward(g)
    torch.testing.assert_close(dx, xr.grad)
    for p, q in zip(runner.module.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_w_accumulates_over_micro_batches_and_runs_parameter_hooks() -> None:
    """W of two micro-batches sums into the weights' gradients as autograd's backward of both does (the second W
    adds its products into `.grad` in place), with and without a hook on a parameter (the hooked parameter's
    gradient passes through its hook, as autograd's would)."""
    seen: list[torch.Tensor] = []

    def double(grad: torch.Tensor) -> torch.Tensor:
        seen.append(grad)
        return grad * 2

    for hooked in (False, True):
        runner, model = _runner()
        seen.clear()
        if hooked:
            next(runner.module.parameters()).register_hook(double)
            next(model.parameters()).register_hook(lambda grad: grad * 2)
        xs, gs = [torch.randn(5, 4) for _ in range(2)], [torch.randn(5, 3) for _ in range(2)]
        for mb in range(2):
            runner.forward(mb, [xs[mb].clone()], needs_grad=True)
            runner.backward(mb, [gs[mb]], defer_weights=True)
        for mb in range(2):
            runner.backward_weights(mb)
        for x, g in zip(xs, gs, strict=True):
            model(x.clone().requires_grad_(True)).backward(g)
        assert len(seen) == (2 if hooked else 0)
        for p, q in zip(runner.module.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)  # float32 rounding: BLAS adds into .grad


def _chain() -> nn.Module:
    """Three Linear layers (tanh between them) and a LayerNorm, whose parameters no named layer holds."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3), nn.LayerNorm(3)
    ).double()


CHAIN_LAYERS = {"0": ("0.weight", "0.bias"), "2": ("2.weight", "2.bias"), "4": ("4.weight", "4.bias")}


@pytest.mark.parametrize("side", [ArgGrad.INPUT, ArgGrad.NONE])
def test_w_pieces_equal_the_fused_backward_and_release_their_operands(side: ArgGrad) -> None:
    """W cut by layer ([Note: W pieces]), its pieces run in another order than the layers', makes the weight
    gradients of autograd's fused backward (float64, to 1e-12), also on a first stage (side NONE: B makes nothing,
    W the whole backward); after each piece the operands no piece left reads are released (their tensors freed)."""
    model = _chain()
    gm = fx.symbolic_trace(model)
    state = dict(gm.named_parameters())
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=side is ArgGrad.INPUT)
    g = torch.randn(5, 3, dtype=torch.float64)
    split = split_stage(gm, state, list(state), [x], [side], 1, lambda graph: graph, CHAIN_LAYERS)
    assert [p.layer for p in split.pieces] == [None, "0", "2", "4"]  # the LayerNorm's gradients are shared
    with torch.no_grad():
        saved = split.forward(*state.values(), x)[split.n_outputs :]
        kept = split.input_grad(*(saved[i] for i in split.b_saved), g)[split.n_arg_grads :]
    pending = PendingW(split, [*(saved[i] for i in split.w_saved), *kept])
    held = {_storage(t) for t in [*state.values(), x, g]}
    del saved, kept
    grads: dict[int, torch.Tensor] = {}
    for layer in ("2", "0", "4"):
        for piece in pending.take(layer):
            with torch.no_grad():  # as the runner runs W: no autograd record keeps an operand
                out = piece.fn(*pending.operands(piece))
            mine = held | {_storage(v) for v in out if v is not None}  # a gradient B made passes W unchanged
            alive = [None if _storage(v) in mine else weakref.ref(v) for v in pending.operands(piece)]
            grads |= dict(zip(piece.params, out, strict=False))
            pending.ran(piece, out[len(piece.params) + len(piece.weight_args) :])
            left = {i for p in pending.left for i in p.reads}
            for i, ref in zip(piece.reads, alive, strict=True):
                assert (pending.pool[i] is None) == (i not in left), (layer, i)
                if ref is not None:  # not the parameters, input, output gradient and gradients the test holds
                    assert (ref() is None) == (i not in left), f"piece {piece.layer}: operand {i} outlives its readers"
    assert pending.done and all(v is None for v in pending.pool)
    model(x.detach().clone().requires_grad_(True)).backward(g)
    for i, (name, p) in enumerate(model.named_parameters()):
        torch.testing.assert_close(grads[i], p.grad, rtol=0, atol=1e-12, msg=name)


def _storage(t: torch.Tensor) -> int:
    """Where `t`'s memory is (a view's is its base's)."""
    return t.untyped_storage().data_ptr()


def test_runner_runs_the_w_of_each_layer_the_program_names() -> None:
    """A runner whose program names layers' W's ("W s0 m0 2") runs each layer's piece on its own (the LayerNorm's,
    shared, with the first): a layer's gradients appear with its piece, and the micro-batch waits until the last."""
    model = _chain()
    gm = fx.symbolic_trace(copy.deepcopy(model))
    specs = (TensorSpec("x", (5, 4), torch.float64),), (TensorSpec("y", (5, 3), torch.float64),)
    runner = StageRunner.build(
        StageGraph(0, gm, *specs, tuple(n for n, _ in gm.named_parameters())), 0, False, None, copy=False
    )
    runner.split, runner.layer_params, runner.w_layers = True, dict(CHAIN_LAYERS), set(CHAIN_LAYERS)
    x, g = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    runner.forward(0, [x.clone()], needs_grad=True)
    runner.backward(0, [g], defer_weights=True)
    params = dict(runner.module.named_parameters())
    runner.backward_weights(0, "2")
    assert {n for n, p in params.items() if p.grad is not None} == {"2.weight", "2.bias", "5.weight", "5.bias"}
    assert runner.waiting_weights() == [0]
    runner.backward_weights(0, "4")
    runner.backward_weights(0, "0")
    assert runner.waiting_weights() == []
    model(x.clone().requires_grad_(True)).backward(g)
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=0, atol=1e-12, msg=name)


PLANNED = [kfac.Case("zb-h1", 2, 2, 1)]


@pytest.mark.multiproc
def test_planned_kfac_on_zb_h1_equals_one_device_given_the_plan() -> None:
    """K-FAC planned on ZB-H1 (curvature in the bubbles W leaves) runs its plan for two refresh periods and equals
    the single-device trainer given the plan's timings (fused layers, folded after each W, are covered by the
    given timings of the tests above)."""
    results = run_distributed(kfac.planned_worker, 2, PLANNED, timeout=600)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for i, case in enumerate(PLANNED):
        layers, steps = results[0].value[i][2], results[0].value[i][3]
        assert sum(r.value[i][4] for r in results) > 0, f"{case}: no STATS/DECOMP op in any program"
        want = kfac.reference_for_plan(case, layers, steps)
        for r in results:
            bad = kfac.compare(r.value[i][0], want)
            assert not bad, f"{case} rank {r.rank}: {bad[:4]} differ from the single-device trainer by > 1e-5"


def uneven_costs(stage_layers, layers, fused=None):
    """Costs under which the plan defers a W to join two bubbles (tests/planner/test_zero_bubble.py's uneven ZB-H1):
    stage 0 (B 1 ms, W 2 ms) waits for stage 1's long B (4 ms; W 3 ms), and its first layer's decompositions take
    4 ms each, as long as the bubble before its first B and the one W m0 leaves when it moves past B m1."""
    from fxkfac.planner.problem.costs import CostTable, LayerCost, StageCost

    ms, stages = 1e-3, []
    for s in sorted(stage_layers):
        costs = tuple(
            LayerCost.kfac(
                name,
                curv_a=0.01 * ms,
                curv_b=0.01 * ms,
                inv_a=4 * ms if (s, i) == (0, 0) else 0.01 * ms,
                inv_b=4 * ms if (s, i) == (0, 0) else 0.01 * ms,
                prec=0.01 * ms,
                a_bytes=4096,
                e_bytes=4096,
                factor_a_bytes=layers[name].a_dim ** 2 * 4,
                factor_b_bytes=layers[name].b_dim ** 2 * 4,
            )
            for i, name in enumerate(stage_layers[s])
        )
        bwd, wgrad = (3 * ms, 2 * ms) if s == 0 else (7 * ms, 3 * ms)
        stages.append(StageCost(ms, bwd, 1 << 20, 1 << 16, costs, wgrad=wgrad))
    return CostTable(tuple(stages), 2, "synthetic:uneven", "cpu")


def placed_w_worker(rank: int, world: int, cases: list[kfac.Case]) -> dict:
    """Each case planned over `uneven_costs` (rank 0 solves, every rank runs it) for two refresh periods: {case
    index: (params, losses, plan layers, steps, the rank's programs)}."""
    out = {}
    for i, case in enumerate(cases):
        options = fxkfac.PlanOptions(costs=uneven_costs, time_limit_s=3.0)
        trainer = kfac.pipelined(case, "auto", options)
        steps = 2 * max(t.period for t in trainer.plan.layers.values())
        data = kfac.batches(case)
        for ids, y in (data * steps)[:steps]:
            trainer.step((ids,), y)
        params = {n: p.detach().clone() for n, p in trainer.named_parameters()}
        out[i] = (
            params,
            dict(trainer.plan.layers),
            steps,
            [[str(op) for op in st] for st in trainer.plan.programs[rank]],
        )
    return out


PLACED_W = [kfac.Case("zb-h1", 2, 2, 1), kfac.Case("zb-h1", 2, 2, 2)]


@pytest.mark.multiproc
def test_kfac_with_planner_placed_ws_equals_one_device() -> None:
    """K-FAC on ZB-H1 whose W's the planner placed, one per layer (a W moved past a later B where W = 1, every W due by
    its stage's gradient all-reduce where W = 2), runs its plan for two refresh periods and equals the single-device
    trainer given the plan's timings to 1e-5."""
    for case in PLACED_W:
        results = run_distributed(placed_w_worker, case.D * case.W, [case], timeout=600)
        failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
        assert not failed, "\n".join(failed)
        _, layers, steps, program = results[0].value[0]
        refresh = program[0]
        ws = [i for i, op in enumerate(refresh) if op.startswith("W s0 m0 ")]  # one W per layer ([Note: per-layer W])
        stats = {op.split()[-1] for op in refresh if op.startswith("STATS s0 ")}  # stage 0's layers, refreshed
        assert len(ws) > 1 and {refresh[i].split()[-1] for i in ws} == stats, refresh
        if case.W == 1:  # rank 0 defers a W of m0 of its refresh step past B m1 (the decomposition's room)
            assert max(ws) > refresh.index("B s0 m1"), refresh
        want = kfac.reference_for_plan(case, layers, steps)
        for r in results:
            bad = kfac.compare(r.value[0][0], want)
            assert not bad, f"{case} rank {r.rank}: {bad[:4]} differ from the single-device trainer by > 1e-5"


class _Wide(nn.Module):
    """A layer 256 wide (`gram` makes its Gram by column panels) whose output gradient a fused tap captures."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 256), nn.Linear(256, 3)

    def forward(self, x: torch.Tensor, probe: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.out(torch.ops.fxkfac.tap_e(self.fc(x), probe, False).tanh()),)


def test_w_makes_a_wide_fused_capture_as_autograd_does() -> None:
    """A fused output-gradient capture 256 wide, made by W, equals autograd's and the dense float64 G^T G / rows:
    `gram` fills its buffer by in-place writes into its panels, which no value W returns is computed from, and W
    keeps them (it once returned the buffer unwritten: uninitialized memory as a K-FAC factor)."""
    torch.manual_seed(0)
    model = _Wide()
    gm = fx.symbolic_trace(model)
    state = dict(gm.named_parameters())
    x, g, probe = torch.randn(5, 4), torch.randn(5, 3), torch.zeros(256, 256)
    sides = [ArgGrad.INPUT, ArgGrad.WEIGHT]
    split = split_stage(gm, state, list(state), [x, probe], sides, 1, lambda graph: graph)
    with torch.no_grad():
        saved = split.forward(*state.values(), x, probe)[split.n_outputs :]
        kept = split.input_grad(*(saved[i] for i in split.b_saved), g)[split.n_arg_grads :]
        capture = split.weights([*(saved[i] for i in split.w_saved), *kept])[1][0]
    tapped = probe.clone().requires_grad_(True)
    model(x, tapped)[0].backward(g)
    torch.testing.assert_close(capture, tapped.grad)
    h = model.fc(x).double()
    rows = (g.double() @ model.out.weight.double()) * (1 - h.tanh() ** 2)
    torch.testing.assert_close(capture.double(), rows.T @ rows / 5, rtol=1e-5, atol=1e-7)
    layers = {"fc": ("fc.weight", "fc.bias"), "out": ("out.weight", "out.bias")}
    pieces = split_stage(gm, state, list(state), [x, probe], sides, 1, lambda graph: graph, layers).pieces
    assert [p.layer for p in pieces if p.weight_args] == ["fc"], "the capture goes with the W of the layer it taps"


NAIVE = (kfac.Case("zb-h1", 2, 2, 1), kfac.Case("zb-v", 2, 2, 1))
WIDE = 256
"""The FFN width of `naive_worker`'s BERT: its intermediate layers' fused B captures are made by `gram`'s panels."""


def _wide_kfac(case: kfac.Case, mesh: tuple[int, int] | None) -> fxkfac.Trainer:
    """K-FAC on the critical path (plan=None, every layer refreshed every step, fused: made by W on zero-bubble
    schedules) of the tiny BERT with a 256-wide FFN, eager, over `mesh` (None: one device, N*W micro-batches)."""
    data = kfac.batches(case)
    names = kfac._names_for(case)
    return fxkfac.compile(
        models.tiny_bert(layers=2, intermediate=WIDE),
        mesh,
        None,
        preconditioner=kfac.KFAC,
        example_inputs=(data[0][0],),
        loss_fn=kfac.loss_fn,
        optimizer=kfac.optimizer,
        schedule=case.schedule if mesh is not None else None,
        backend=None,
        microbatches=case.N * (1 if mesh is not None else case.W),
        layer_timing={n: LayerTiming(1, 0, 0, "fused") for n in names},
        pipeline=PipelineOptions(virtual_stages=1 if case.schedule == "zb-h1" else 2, timeout=120.0)
        if mesh is not None
        else PipelineOptions(),
    )


def _factors(trainer: fxkfac.Trainer) -> dict[str, torch.Tensor]:
    """Each K-FAC factor the trainer holds, by "layer.A" / "layer.B"."""
    states = trainer.preconditioning.states
    return {f"{n}.{k}": getattr(s, k).clone() for n, s in states.items() for k in "AB" if getattr(s, k) is not None}


def _trained_wide(trainer: fxkfac.Trainer, case: kfac.Case) -> dict:
    """`trainer` after the case's batches: parameters, factors, and the warnings fxkfac logged meanwhile."""
    handler = _Warnings()
    logging.getLogger("fxkfac").addHandler(handler)
    try:
        for ids, y in kfac.batches(case):
            trainer.step((ids,), y)
    finally:
        logging.getLogger("fxkfac").removeHandler(handler)
    params = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    return {"params": params, "factors": _factors(trainer), "warnings": handler.messages}


class _Warnings(logging.Handler):
    """The messages of the warnings (and worse) logged while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def naive_worker(rank: int, world: int, cases: tuple[kfac.Case, ...]) -> list[dict]:
    """Each case's `_wide_kfac` on its (D, W) mesh, trained (`_trained_wide`)."""
    return [_trained_wide(_wide_kfac(case, (case.D, case.W)), case) for case in cases]


@pytest.mark.multiproc
def test_naive_kfac_on_zero_bubble_equals_one_device_with_wide_fused_captures() -> None:
    """Naive K-FAC (plan=None: curvature every step, fused, made by W) on ZB-H1 and ZB-V, on a BERT whose FFN is 256
    wide, equals one device to 1e-5 in parameters and factors, and logs no warning (it once folded uninitialized
    memory into the FFN's B factors: NaN/Inf and failed Cholesky)."""
    results = run_distributed(naive_worker, 2, NAIVE, timeout=600)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for i, case in enumerate(NAIVE):
        torch.manual_seed(0)
        want = _trained_wide(_wide_kfac(case, None), case)
        assert not want["warnings"], want["warnings"]
        wide = [n for n, f in want["factors"].items() if n.endswith(".B") and f.shape[0] == WIDE]
        assert wide, f"{case}: no {WIDE}-wide B factor on one device"
        held: set[str] = set()
        for r in results:
            run = r.value[i]
            assert not run["warnings"], f"{case} rank {r.rank}: {run['warnings'][:4]}"
            bad = kfac.compare(run["params"], want["params"])
            assert not bad, f"{case} rank {r.rank}: {bad[:4]} differ from one device by > 1e-5"
            for name, factor in run["factors"].items():
                assert torch.isfinite(factor).all(), f"{case} rank {r.rank}: {name} has NaN/Inf"
                torch.testing.assert_close(factor, want["factors"][name], rtol=1e-5, atol=1e-5, msg=f"{case} {name}")
            held |= set(run["factors"])
        assert held >= set(wide), f"{case}: the wide B factors {sorted(set(wide) - held)} are on no rank"


def test_a_recomputing_stage_refuses_to_split() -> None:
    """Activation checkpointing would run the forward inside B, which W needs again: refused with what to change."""
    runner, _ = _runner()
    runner.recompute = True
    with pytest.raises(PipelineError, match="recompute"):
        runner.forward(0, [torch.randn(5, 4)], needs_grad=True)


def _tapped_first_stage() -> tuple[TappedRunner, nn.Module, list[str]]:
    """`_chain` captured for K-FAC as one first stage (its input takes no gradient), run split, every layer's W named:
    the runner, the model it shares its parameters with, and the K-FAC layers in order."""
    model = _chain()
    captured = capture(model, (torch.randn(5, 4, dtype=torch.float64),), kfac.KFAC)
    (graph,) = split_stages(captured.gm, 1, layers=captured.layers).stages
    layers = {layer.name: layer for layer in captured.layers}
    runner = TappedRunner.wrap(StageRunner.build(graph, 0, False, None, copy=False), layers, family_of(kfac.KFAC))
    runner.split, runner.layer_params = True, {n: x.params for n, x in layers.items()}
    runner.w_layers = set(layers)
    return runner, model, list(layers)


def _autograd(
    model: nn.Module, x: torch.Tensor, g: torch.Tensor, names: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Autograd's backward of a copy of `model`: the gradient of each named layer's output (the deferred
    output-gradient capture, unscaled), and each parameter's."""
    model = copy.deepcopy(model)
    out: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[[nn.Module, Any, torch.Tensor], None]:
        def hook(_: nn.Module, __: Any, y: torch.Tensor) -> None:
            y.register_hook(lambda grad: out.update({name: grad}))

        return hook

    for n in names:
        model.get_submodule(n).register_forward_hook(keep(n))
    model(x.clone()).backward(g)
    return out, {name: p.grad for name, p in model.named_parameters()}


def test_w_makes_a_first_stages_deferred_captures_unless_the_program_reads_them_before_it() -> None:
    """On a first stage a refresh step's deferred output-gradient captures (G, the gradient of each layer's output) are
    made by W where the program reads them only after the layer's W: B then makes nothing, as on other steps (the
    stage's whole backward chain stays out of B); where it reads them between B and W, B makes them. Either way each
    capture is autograd's output gradient (float64, to 1e-12) and the weight gradients autograd's."""
    names = _tapped_first_stage()[2]
    stats = [Op(OpKind.STATS, 0, 0, layer=n, part="B") for n in names]
    b, whole = Op(OpKind.BWD, 0, 0), Op(OpKind.BWD_W, 0, 0)
    for program, early in (([b, whole, *stats], False), ([b, stats[1], whole, *stats[:1]], True)):
        runner, model, names = _tapped_first_stage()
        x, g = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
        want, grads = _autograd(model, x, g, names)
        runner.begin_step(dict.fromkeys(names, Capture.DEFERRED), program)
        assert runner.early == ({0} if early else set())
        runner.forward(0, [x.clone()], needs_grad=False)
        runner.backward(0, [g], defer_weights=True)
        split = runner._weights[0][0].split
        made_by_b = {n for n in names if (n, "B", 0) in runner.captures}
        assert made_by_b == (set(names) if early else set()), program
        b_ops = [n for n in split.input_grad.graph.nodes if n.op == "call_function"]
        assert bool(b_ops) == early, f"B computes {len(b_ops)} ops on a first stage"
        runner.backward_weights(0)
        for n in names:
            (capture_,) = runner.captures[(n, "B", 0)]
            torch.testing.assert_close(capture_, want[n], rtol=0, atol=1e-12, msg=n)
        for name, p in model.named_parameters():  # the runner's stage trains the model's own parameters
            torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-12, msg=name)


def test_a_program_read_before_w_marks_the_micro_batch_whose_captures_b_makes() -> None:
    """`read_before_w`: a micro-batch whose output-gradient capture a STATS reads after its B and before the W of its
    layer (a per-layer W naming it, or the first whole W), of this stage and pipe; not one read after that W, one of
    another part (the layer input's), one whose W runs with its B (no BWD_W), or another stage's."""

    def program(text: str) -> list[Op]:
        return [Op.parse(line.strip()) for line in text.strip().splitlines()]

    cases = {
        "B s0 m0\nW s0 m0\nSTATS s0 m0 B fc": set(),
        "B s0 m0\nSTATS s0 m0 B fc\nW s0 m0": {0},
        "B s0 m0\nSTATS s0 m0 A fc\nW s0 m0": set(),
        "B s0 m0\nW s0 m0 fc\nSTATS s0 m0 B fc\nW s0 m0 out": set(),
        "B s0 m0\nW s0 m0 out\nSTATS s0 m0 B fc\nW s0 m0 fc": {0},
        "B s0 m0\nW s0 m0 fc\nSTATS s0 m0 B out\nW s0 m0": {0},
        "B s0 m0\nSTATS s0 m0 B fc\nB s0 m1\nW s0 m1\nW s0 m0": {0},
        "B s0 m1\nSTATS s0 m1 B fc": set(),
        "B s1 m0\nSTATS s1 m0 B fc\nW s1 m0": set(),
        "B s0 m0 p1\nSTATS s0 m0 p1 B fc\nW s0 m0 p1": set(),
    }
    for text, want in cases.items():
        assert read_before_w(program(text), 0, 0, ["B"]) == want, text


@pytest.mark.parametrize("method", ["greedy", "cpsat"])
def test_planned_programs_leave_every_output_gradient_to_w(method: str) -> None:
    """A plan's refresh step never has B make a deferred output gradient (`read_before_w` finds no micro-batch of any
    stage on any rank): the planner reads G after the W that makes it, as its B is priced (first-fit and CP-SAT
    read some before their W on this ZB-H1 before the rule)."""
    from fxkfac.planner.problem.problem import SolverConfig
    from fxkfac.planner.search.attempt import solve
    from tests.planner.kfac_cases import problem

    p = problem(
        "zb-h1", 4, 2, layers=2, fwd=1.0, bwd=2.0, curv=0.25, inv=1.0, prec=0.25, max_overhead=0.5, max_period=8
    )
    plan = solve(p, SolverConfig(time_limit_s=4.0), method)
    assert any(op.kind is OpKind.STATS and op.part == "B" for program in plan.programs.values() for op in program[0])
    for rank, program in plan.programs.items():
        held = {(op.stage_id, op.pipe) for op in program[0] if op.kind is OpKind.BWD}
        for stage, pipe in held:
            assert read_before_w(program[0], stage, pipe, ["B"]) == set(), (rank, stage, program[0])
