"""The stage split: chaining the stage GraphModules computes the eager model's outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from fxkfac.errors import ConfigError
from fxkfac.passes.meta import STAGE
from fxkfac.passes.split_stages import block_key, split_stages
from tests.support.models import cnn, image_batch, mlp, tiny_bert, tiny_gpt2, token_batch


def _export(model: torch.nn.Module, inputs: tuple) -> torch.fx.GraphModule:
    if hasattr(model, "config"):
        model.config.use_cache = False
    return torch.export.export(model, inputs, strict=False).module()


def _chain(result, inputs):
    values = inputs
    for stage in result.stages:
        assert len(values) == len(stage.inputs)
        for value, spec in zip(values, stage.inputs):
            assert tuple(value.shape) == spec.shape and value.dtype == spec.dtype
        values = stage.gm(*values)
        assert len(values) == len(stage.outputs)
    return values[0]


def _eager_out(model, inputs):
    out = model(*inputs)
    return out.logits if hasattr(out, "logits") else out


CASES = {
    "mlp": (lambda: mlp(), lambda: (torch.randn(6, 12),), (2, 3, 4)),
    "cnn": (lambda: cnn(), lambda: image_batch(6)[:1], (2, 3)),
    "bert": (lambda: tiny_bert(), lambda: token_batch(4)[:1], (2, 4)),
    "gpt2": (lambda: tiny_gpt2(), lambda: token_batch(4)[:1], (2, 4)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_chained_stages_equal_eager_outputs_and_gradients(name: str) -> None:
    make_model, make_inputs, stage_counts = CASES[name]
    model, inputs = make_model(), make_inputs()
    gm = _export(model, inputs)
    ref = _eager_out(model, inputs)
    weight = torch.randn_like(ref)
    (ref * weight).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    for count in stage_counts:
        result = split_stages(gm, count)
        assert len(result.stages) == count
        gm.zero_grad(set_to_none=True)
        out = _chain(result, inputs)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        (out * weight).sum().backward()
        grads = dict(gm.named_parameters())
        for fqn, grad in expected.items():
            canonical = result.param_aliases.get(fqn, fqn)
            torch.testing.assert_close(grads[canonical].grad, grad, rtol=1e-4, atol=1e-6)
        held = [p for s in result.stages for p in s.params]
        assert set(held) == set(grads)
        for fqn in held:
            stages = result.stage_of_param(fqn)
            assert (len(stages) > 1) == (fqn in result.shared_params)


def test_tied_embedding_is_shared_between_first_and_last_stage() -> None:
    model, inputs = tiny_gpt2(), token_batch(4)[:1]
    gm = _export(model, inputs)
    result = split_stages(gm, 4)
    assert result.shared_params == {"transformer.wte.weight": (0, 3)}
    assert result.param_aliases["lm_head.weight"] == "transformer.wte.weight"


def test_stage_meta_is_monotone_and_blocks_balanced() -> None:
    gm = _export(mlp(), (torch.randn(4, 12),))
    result = split_stages(gm, 3)
    stages = [n.meta[STAGE] for n in gm.graph.nodes if STAGE in n.meta]
    assert stages == sorted(stages) and set(stages) == {0, 1, 2}
    assert [s.blocks for s in result.stages] == [("0", "1"), ("2",), ("3", "4")]  # FLOPs 1536+64 | 2048 | 64+640


def test_user_split_points_and_profiled_costs() -> None:
    model, inputs = tiny_bert(layers=3), token_batch(4)[:1]
    gm = _export(model, inputs)
    result = split_stages(gm, 3, split_points=["bert.encoder.layer.1", "bert.encoder.layer.2"])
    assert result.stages[1].blocks == ("bert.encoder.layer.1",)
    assert result.stages[2].blocks[0] == "bert.encoder.layer.2"
    torch.testing.assert_close(_chain(result, inputs), _eager_out(model, inputs), rtol=1e-5, atol=1e-6)
    keys = [block_key(n) for n in gm.graph.nodes]
    costs = {k: (100.0 if k == "bert.embeddings" else 1.0) for k in keys if k}
    weighted = split_stages(gm, 2, cost=costs)
    assert weighted.stages[0].blocks == ("bert.embeddings",)


def test_bad_requests_raise_config_errors() -> None:
    gm = _export(mlp(), (torch.randn(4, 12),))
    with pytest.raises(ConfigError, match="blocks"):
        split_stages(gm, 9)
    with pytest.raises(ConfigError, match="not a block boundary"):
        split_stages(gm, 2, split_points=["nope"])
    with pytest.raises(ConfigError, match="split points"):
        split_stages(gm, 3, split_points=["2"])
