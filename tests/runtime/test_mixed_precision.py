"""Mixed precision and gradient clipping, pipelined, equal single-process PyTorch (`torch.autocast`,
`torch.amp.GradScaler`, `torch.nn.utils.clip_grad_norm_`, gradients accumulated over the same micro-batches) on CPU,
over 2 ranks in one launch.

Tolerances (parameters and step losses after 3 steps): the MLPs, whose stage boundaries already carry the autocast
dtype, to 1e-6 in bfloat16 and float16 (they agree bit for bit today), and the full-precision run is checked to lie
outside it (1e-4 to 2e-4 away), so a run that ignored autocast would fail; GPT-2, whose float32 residual stream is
rounded to the autocast dtype where it crosses stages, to torch.testing's rtol of the dtype (bfloat16 1.6e-2,
measured 6e-4; float16 1e-3, measured 6e-5); full precision 1e-5 as the other parity tests.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fxkfac.config import LossScaling, PipelineOptions, StepAgreement
from fxkfac.errors import ConfigError
from fxkfac.shampoo import ShampooConfig
from tests.runtime.precision_workers import (
    DTYPES,
    KFAC,
    Case,
    kfac_batches,
    kfac_compile,
    kfac_sgd,
    kfac_worker,
    precision_reference,
    precision_worker,
)
from tests.runtime.workers import Config
from tests.support.distributed import run_distributed
from tests.support.kfac_reference import KFACReference
from tests.support.models import mlp

DTYPE_TOLERANCE = {None: 1e-5, "bf16": 1.6e-2, "fp16": 1e-3}
EXACT = 1e-6


def _tolerance(case: Case) -> float:
    """EXACT for an MLP in low precision (no rounding at its stage boundaries), else the dtype's."""
    return EXACT if case.dtype is not None and case.cfg.model.startswith("mlp") else DTYPE_TOLERANCE[case.dtype]


SCHEDULES = [
    Config("gpipe", 2, 2, 1, "mlp", "sgd"),
    Config("1f1b", 2, 4, 1, "mlp", "sgd"),
    Config("interleaved", 2, 2, 1, "mlp6", "sgd", v=2),
    Config("chimera", 2, 2, 1, "mlp", "sgd"),
]
"""SGD with momentum: AdamW's first steps move each parameter by about lr whatever its gradient's size, so a
rounding difference in a near-zero gradient would become an lr-sized one, hiding the dtype's tolerance."""
OVERFLOW = LossScaling(init_scale=2.0**40, backoff_factor=2.0**-30, growth_interval=1)
"""Step 0 overflows float16 (gradients times 2**40), the scale falls to 2**10, and grows at every step that stands."""
CLIP = 0.05
"""Below every step's gradient norm of these runs (checked), so every step clips."""

CASES = [
    *(Case(cfg, dtype) for dtype in ("bf16", "fp16") for cfg in SCHEDULES),
    Case(Config("1f1b", 2, 2, 1, "mlp", "sgd"), "fp16", scaling=OVERFLOW),
    Case(Config("gpipe", 2, 2, 1, "mlp", "sgd"), "fp16", scaling=OVERFLOW),
    Case(Config("1f1b", 2, 4, 1, "mlp", "adamw"), max_grad_norm=CLIP),
    Case(Config("gpipe", 2, 2, 1, "mlp", "sgd"), max_grad_norm=CLIP),
    Case(Config("chimera", 2, 2, 1, "mlp", "adamw"), max_grad_norm=CLIP),
    Case(Config("1f1b", 2, 2, 1, "gpt2", "adamw"), max_grad_norm=CLIP),
    Case(Config("1f1b", 2, 2, 1, "mlp", "sgd"), "fp16", max_grad_norm=CLIP, scaling=OVERFLOW),
    Case(Config("1f1b", 2, 2, 1, "gpt2", "sgd"), "bf16"),
    Case(Config("gpipe", 2, 2, 1, "gpt2", "sgd"), "fp16"),
]


@pytest.mark.multiproc
def test_mixed_precision_and_clipping_equal_single_process() -> None:
    """Every schedule in bfloat16 and float16; a float16 overflow skipped on every rank and recovered from, as
    GradScaler does; clipping under GPipe, 1F1B, Chimera and with GPT-2's tied embeddings, as `clip_grad_norm_`."""
    results = run_distributed(precision_worker, 2, CASES, timeout=400)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    for index, case in enumerate(CASES):
        want = precision_reference(case)
        tol = _tolerance(case)
        if tol == EXACT:
            full = precision_reference(dataclasses.replace(case, dtype=None))["params"]
            assert max(float((full[n] - p).abs().max()) for n, p in want["params"].items()) > 10 * tol
        if case.max_grad_norm is not None:
            stood = [n for n in want["norms"] if math.isfinite(n)]  # an overflow's norm is Inf/NaN
            assert min(stood) > case.max_grad_norm, f"{case}: a step the reference did not clip"
        if case.scaling is OVERFLOW:
            assert want["skipped"] == 1, f"{case}: the reference did not skip exactly its first step"
        covered = set()
        for r in results:
            got = r.value[index]
            assert got["skipped"] == want["skipped"], f"{case} rank {r.rank}: skipped {got['skipped']}"
            assert got["scale"] == want["scale"], f"{case} rank {r.rank}: loss scale {got['scale']}"
            if case.dtype == "fp16":
                assert got["state_scale"]["scale"] == want["scale"], "the checkpointed loss scale"
            torch.testing.assert_close(got["losses"], want["losses"], rtol=tol, atol=tol, msg=f"{case} losses")
            for name, value in got["params"].items():
                torch.testing.assert_close(
                    value, want["params"][name], rtol=tol, atol=tol, msg=lambda m, n=name, c=case: f"{c} {n}: {m}"
                )
                covered.add(name)
        assert covered >= {n for n in want["params"] if "wte" not in n and "lm_head" not in n}, f"{case}: coverage"


KFAC_CASES = [
    ("gpipe", CLIP, None),
    ("1f1b", CLIP, None),
    ("gpipe", None, "bf16"),
    ("1f1b", None, "fp16"),
    ("1f1b", CLIP, "bf16"),
]
"""(schedule, max_grad_norm, dtype) of the K-FAC runs."""


@pytest.mark.multiproc
def test_kfac_with_clipping_and_autocast_equals_single_process_kfac() -> None:
    """K-FAC over 2 stages equals the single-process reference: with the raw gradient clipped first (GPipe, 1F1B),
    as `clip_grad_norm_` before K-FAC, whose KL-clip then sees the clipped gradient; under bfloat16 and float16
    autocast, whose factors are formed in float32 from the upcast captures (float16 scaled by 2**16 and unscaled,
    against the unscaled reference: scaling by a power of two is exact short of overflow and underflow)."""
    results = run_distributed(kfac_worker, 2, KFAC_CASES, timeout=400)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    one = kfac_compile(None, "gpipe", None)

    def reference(max_grad_norm: float | None, dtype: str | None) -> dict[str, torch.Tensor]:
        model = mlp(seed=1)
        ref = KFACReference(
            model,
            one.units,
            KFAC,
            F.mse_loss,
            2,
            dict(one.timings),
            kfac_sgd,
            max_grad_norm=max_grad_norm,
            autocast_dtype=DTYPES[dtype],
        )
        for t, (x, y) in enumerate(kfac_batches()):
            ref.step(t, x, y)
        return {n: p.detach() for n, p in model.named_parameters()}

    full = reference(None, None)
    for index, (schedule, max_grad_norm, dtype) in enumerate(KFAC_CASES):
        want = reference(max_grad_norm, dtype)
        assert max(float((want[n] - p).abs().max()) for n, p in full.items()) > 1e-4, "clip or autocast did nothing"
        for r in results:
            for name, value in r.value[index].items():
                torch.testing.assert_close(
                    value, want[name], rtol=0, atol=1e-5, msg=f"{schedule} {max_grad_norm} {dtype} {name}"
                )


def test_loss_scale_is_checkpointed() -> None:
    """A float16 trainer's loss scale and growth tracker are in its state dict and come back on load."""
    x = torch.randn(4, 12)
    y = torch.randint(0, 5, (4,))

    def make() -> object:
        import fxkfac

        return fxkfac.compile(
            mlp(seed=0),
            None,
            None,
            example_inputs=(x,),
            loss_fn=F.cross_entropy,
            preconditioner=None,
            backend=None,
            pipeline=PipelineOptions(autocast_dtype=torch.float16, loss_scaling=LossScaling(init_scale=2.0**40)),
        )

    trainer = make()
    trainer.step(x, y)  # overflows: the scale backs off
    state = trainer.state_dict()
    assert state["loss_scale"] == {"scale": 2.0**39, "growth_tracker": 0}
    fresh = make()
    fresh.load_state_dict(state)
    assert fresh.loss_scale.scale == 2.0**39


def test_autocast_dtype_is_checked() -> None:
    with pytest.raises(ConfigError, match="torch.bfloat16, torch.float16 or None"):
        PipelineOptions(autocast_dtype=torch.float32)


@pytest.mark.parametrize(
    ("options", "preconditioner", "words"),
    [
        ({"max_grad_norm": 1.0}, ShampooConfig(), "not linear in the gradient"),
        ({"max_grad_norm": 1.0, "step_agreement": StepAgreement.COPIES}, None, "one world verdict"),
        ({"autocast_dtype": torch.float16, "step_agreement": StepAgreement.COPIES}, None, "one world verdict"),
    ],
)
def test_refused_settings_say_why(options: dict, preconditioner: object, words: str) -> None:
    import fxkfac

    with pytest.raises(ConfigError, match=words):
        fxkfac.compile(
            mlp(seed=0),
            None,
            None,
            preconditioner=preconditioner,
            example_inputs=(torch.randn(4, 12),),
            loss_fn=F.cross_entropy,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            backend=None,
            pipeline=PipelineOptions(**options),
        )


def test_compiled_float16_kfac_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor-compiled stages under float16 with K-FAC's fused captures train as eager ones do, to float16's
    tolerance (measured 1.4e-4): its factors are float32 Grams of the unscaled captures (a capture's backward,
    traced under autocast, once formed float16 Grams of loss-scaled gradients: Inf). Compiled afresh: torch's
    compile caches key a graph by its ops, not by the Python of a custom op's backward, so a cache written before
    that fix would hand the old backward back."""
    import fxkfac

    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(3)]
    runs = {}
    for backend in (None, "inductor"):
        trainer = fxkfac.compile(
            mlp(seed=1),
            None,
            None,
            example_inputs=(data[0][0],),
            loss_fn=F.cross_entropy,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            preconditioner=KFAC,
            backend=backend,
            microbatches=2,
            pipeline=PipelineOptions(autocast_dtype=torch.float16),
        )
        for x, y in data:
            trainer.step(x, y)
        assert all(torch.isfinite(s.B).all() for s in trainer.layer_states.values())
        runs[backend] = {n: p.detach() for n, p in trainer.named_parameters()}
    for name, value in runs["inductor"].items():
        torch.testing.assert_close(value, runs[None][name], rtol=1e-3, atol=1e-3, msg=name)
