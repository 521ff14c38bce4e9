"""Factors captured by the fx taps (fused and deferred, eager and torch.compile) equal those from module hooks."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxkfac.capture import Captured, capture
from fxkfac.config import KFACConfig
from fxkfac.kfac.factors import a_rows, e_rows, factor
from fxkfac.passes.factor_capture import insert_factor_capture, new_probes
from fxkfac.passes.find_layers import layer_input
from fxkfac.passes.meta import LAYER, TAP
from tests.passes.reference import hook_factors
from tests.support.models import cnn, image_batch, tiny_bert, tiny_gpt2, token_batch

BATCH = 4


def _loss(out: object, targets: Tensor) -> Tensor:
    """Cross-entropy on logits (Hugging Face ModelOutput or a plain tensor)."""
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


_MODELS = {
    "bert": (tiny_bert, lambda: token_batch(BATCH, seed=1)),
    "gpt2": (tiny_gpt2, lambda: token_batch(BATCH, seed=2)),
    "cnn": (cnn, lambda: image_batch(BATCH, seed=3)),
}


@pytest.fixture(scope="module")
def captured() -> dict[str, tuple[nn.Module, Captured, tuple[Tensor, Tensor]]]:
    """Each model (kept eager for the hooks), its capture, and one batch."""
    out = {}
    for key, (make, batch) in _MODELS.items():
        model = make()
        x, y = batch()
        with pytest.warns(UserWarning) if hasattr(model, "config") else _nothing():
            cap = capture(model, (x,), KFACConfig())
        out[key] = (model, cap, (x, y))
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def graph_factors(
    cap: Captured, modes: Mapping[str, str], x: Tensor, y: Tensor, backend: str | None = None
) -> dict[str, tuple[Tensor, Tensor]]:
    """``{layer: (A_m, B_m)}`` from the taps, scaled per [Note: factor scaling] with n = batch."""
    taps = insert_factor_capture(cap.gm, cap.layers, modes)
    fn = taps.gm if backend is None else torch.compile(taps.gm, backend=backend)
    probes = new_probes(taps, torch.device("cpu"))
    outs = fn(*cap.flat_inputs((x,)), *probes)
    _loss(cap.unflatten_outputs(outs[: taps.n_outputs]), y).backward()
    n = x.shape[0]
    result = {}
    for layer in taps.layers:
        a_cap = outs[taps.a_outputs[layer.name]].detach()
        e_cap = probes[taps.probes[layer.name]].grad
        if modes[layer.name] == "fused":
            result[layer.name] = (a_cap.double(), (e_cap * n * n).double())
        else:
            result[layer.name] = (
                factor(a_rows(a_cap, layer), torch.float64),
                factor(e_rows(e_cap, layer, n), torch.float64),
            )
    return result


def _assert_factors_equal(got: Mapping[str, tuple[Tensor, Tensor]], ref: Mapping[str, tuple[Tensor, Tensor]]) -> None:
    assert set(got) == set(ref) and got
    for name in ref:
        for side, g, r in zip("AB", got[name], ref[name]):
            assert g.shape == r.shape, (name, side)
            torch.testing.assert_close(
                g,
                r,
                rtol=1e-4,
                atol=1e-5 * float(r.abs().max()),
                msg=lambda m, name=name, side=side: f"{name} {side}: {m}",
            )


def _reference(model: nn.Module, cap: Captured, x: Tensor, y: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    eager = copy.deepcopy(model)
    return hook_factors(eager, cap.layers, lambda: _loss(eager(x), y), n=x.shape[0])


@pytest.mark.parametrize("mode", ["fused", "deferred"])
@pytest.mark.parametrize("key", list(_MODELS))
def test_taps_equal_module_hooks_eager(captured, key: str, mode: str) -> None:
    model, cap, (x, y) = captured[key]
    got = graph_factors(cap, {layer.name: mode for layer in cap.layers}, x, y)
    _assert_factors_equal(got, _reference(model, cap, x, y))


@pytest.mark.compile
@pytest.mark.parametrize("key", ["gpt2"])
def test_taps_equal_module_hooks_inductor(captured, key: str) -> None:
    """Half the layers fused, half deferred, compiled with inductor."""
    model, cap, (x, y) = captured[key]
    modes = {layer.name: ("fused", "deferred")[i % 2] for i, layer in enumerate(cap.layers)}
    got = graph_factors(cap, modes, x, y, backend="inductor")
    _assert_factors_equal(got, _reference(model, cap, x, y))


def test_pass_leaves_input_graph_alone_and_marks_taps(captured) -> None:
    _, cap, (x, y) = captured["cnn"]
    before = [n.format_node() for n in cap.gm.graph.nodes]
    modes = {cap.layers[0].name: "fused", cap.layers[1].name: "deferred"}
    taps = insert_factor_capture(cap.gm, cap.layers, modes)
    assert [n.format_node() for n in cap.gm.graph.nodes] == before
    tagged = [(n.meta[LAYER].name, n.meta[TAP]) for n in taps.gm.graph.nodes if TAP in n.meta]
    name0, name1 = cap.layers[0].name, cap.layers[1].name
    assert sorted(tagged) == sorted(
        [
            (name0, ("a", "fused")),
            (name0, ("e", "fused")),
            (name0, ("e", "fused")),
            (name1, ("e", "deferred")),
            (name1, ("e", "deferred")),
        ]
    )
    assert taps.probe_shapes[name0] == (cap.layers[0].d_out, cap.layers[0].d_out)
    # a deferred A capture is the layer's input itself, returned as an output: no copy in the graph
    returned = taps.gm.graph.output_node().args[0][taps.a_outputs[name1]]
    (layer_node,) = (
        n
        for n in taps.gm.graph.nodes
        if n.meta.get(LAYER) is not None and TAP not in n.meta and n.meta[LAYER].name == name1
    )
    assert returned is layer_input(layer_node)
    assert not any(n.target is torch.ops.aten.clone.default for n in taps.gm.graph.nodes)
    # the tapped graph computes the same outputs
    torch.testing.assert_close(
        taps.gm(*cap.flat_inputs((x,)), *new_probes(taps, torch.device("cpu")))[0],
        cap.gm(x)[0],
    )


def test_unknown_mode_or_layer_is_rejected(captured) -> None:
    _, cap, _ = captured["cnn"]
    with pytest.raises(ValueError, match="fused"):
        insert_factor_capture(cap.gm, cap.layers, {cap.layers[0].name: "lazy"})
    with pytest.raises(ValueError, match="no layer node"):
        insert_factor_capture(cap.gm, cap.layers, {"not.a.layer": "fused"})


class _SelfAttention(nn.Module):
    """nn.MultiheadAttention (batch first) then a Linear head: its out_proj is a Linear never called as a module."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        y, _ = self.att(x, x, x, need_weights=False)
        return self.head(torch.tanh(y))


def _dense_attention_factors(model: _SelfAttention, cap: Captured, x: Tensor, y: Tensor) -> dict:
    """float64 A and B of the attention's input and output projections, the attention written out by hand."""
    m = copy.deepcopy(model).double()
    att, (B, L, E), heads = m.att, x.shape, m.att.num_heads
    x64 = x.double()
    qkv = F.linear(x64, att.in_proj_weight, att.in_proj_bias)
    qkv.retain_grad()
    q, k, v = (t.reshape(B, L, heads, E // heads).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    scores = torch.softmax(q @ k.transpose(-1, -2) / (E // heads) ** 0.5, dim=-1)
    attended = (scores @ v).transpose(1, 2).reshape(B, L, E)
    out = F.linear(attended, att.out_proj.weight, att.out_proj.bias)
    out.retain_grad()
    logits = m.head(torch.tanh(out))
    torch.testing.assert_close(logits.float(), model(x), rtol=1e-5, atol=1e-6)  # the hand-written attention is MHA's
    _loss(logits, y).backward()
    layers = {layer.name: layer for layer in cap.layers}
    rows = {"att": (x64, qkv.grad), "att.out_proj": (attended.detach(), out.grad)}
    return {
        name: (factor(a_rows(a, layers[name]), torch.float64), factor(e_rows(e, layers[name], B), torch.float64))
        for name, (a, e) in rows.items()
    }


@pytest.mark.parametrize("mode", ["fused", "deferred"])
def test_multihead_attention_projections_are_layers_with_dense_float64_factors(mode: str) -> None:
    """kfac-pytorch misses out_proj (their #267): here it is a layer of its own, and the packed input projection
    one too, both with the factors of the attention computed densely in float64."""
    model = _SelfAttention()
    x, y = torch.randn(BATCH, 5, 8), torch.randint(0, 3, (BATCH, 5))
    cap = capture(model, (x,), KFACConfig())
    assert [layer.name for layer in cap.layers] == ["att", "att.out_proj", "head"], cap.skipped
    got = graph_factors(cap, {layer.name: mode for layer in cap.layers}, x, y)
    _assert_factors_equal({n: got[n] for n in ("att", "att.out_proj")}, _dense_attention_factors(model, cap, x, y))
