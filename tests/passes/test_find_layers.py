"""find_kfac_layers: names, widths, geometry and skip rules, checked against the eager modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxkfac.capture import capture
from fxkfac.config import KFACConfig
from fxkfac.passes.find_layers import find_kfac_layers, layer_nodes
from fxkfac.passes.layers import ConvSpec, KFACLayer, LayerKind
from fxkfac.passes.meta import LAYER
from tests.support.models import SEQ, VOCAB, cnn, image_batch, tiny_gpt2, token_batch


class _LM(nn.Module):
    """Embedding -> Linear blocks -> an untied head as wide as the vocabulary; one inner layer as wide too."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.wide = nn.Linear(16, VOCAB)
        self.back = nn.Linear(VOCAB, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.weight.requires_grad_(False)
        self.grouped = nn.Conv2d(4, 4, 1, groups=2)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.back(torch.relu(self.wide(self.embed(ids))))
        h = self.frozen(h)
        h = self.grouped(h.reshape(h.shape[0], 4, SEQ, 4)).reshape(h.shape)
        return self.head(h)


def test_cnn_layers_match_modules() -> None:
    model = cnn()
    x, _ = image_batch(2)
    gm = capture(model, (x,), None).gm
    layers, skipped = find_kfac_layers(gm)
    assert skipped == {}
    assert [layer.name for layer in layers] == ["conv1", "conv2", "head"]
    conv1, conv2, head = layers
    assert (conv1.kind, conv1.d_in, conv1.d_out, conv1.bias, conv1.tokens_per_sample) == (
        LayerKind.CONV2D,
        9,
        4,
        "conv1.bias",
        64,
    )
    assert conv1.conv == ConvSpec((3, 3), (1, 1), (1, 1), (1, 1))
    assert conv2.conv == ConvSpec((3, 3), (2, 2), (2, 2), (2, 2)) and conv2.bias is None
    with torch.no_grad():
        positions = torch.relu(model.conv2(torch.relu(model.conv1(x)))).shape[2:].numel()
    assert conv2.tokens_per_sample == positions and conv2.d_in == 4 * 9
    assert (head.kind, head.d_in, head.d_out, head.weight) == (LayerKind.LINEAR, 96, 10, "head.weight")
    assert [n.meta[LAYER].name for n in layer_nodes(gm)] == ["conv1", "conv2", "head"]
    assert all(isinstance(layer.kind, LayerKind) for layer in layers)
    with pytest.raises(ValueError, match="lstm"):
        KFACLayer("rnn", "lstm", "rnn.weight", None, 4, 4)  # type: ignore[arg-type]  # the wrong kind is the point


def test_gpt2_conv1d_is_transposed_and_tied_head_skipped() -> None:
    model = tiny_gpt2()
    ids, _ = token_batch(2)
    with pytest.warns(UserWarning, match="use_cache"):
        cap = capture(model, (ids,), KFACConfig())
    by_name = {layer.name: layer for layer in cap.layers}
    c_fc = by_name["transformer.h.0.mlp.c_fc"]
    assert c_fc.weight_transposed and (c_fc.d_in, c_fc.d_out) == tuple(model.transformer.h[0].mlp.c_fc.weight.shape)
    assert c_fc.tokens_per_sample == SEQ
    # c_attn is 3*32 = 96 wide, like the vocabulary, but it is not an output layer: it stays
    assert "transformer.h.0.attn.c_attn" in by_name
    assert "tied" in cap.skipped["lm_head"]


def test_skip_rules() -> None:
    model = _LM()
    ids, _ = token_batch(2)
    with pytest.warns(UserWarning, match="groups=2"):
        cap = capture(model, (ids,), KFACConfig(skip_layers=(r"^back$",)))
    assert [layer.name for layer in cap.layers] == ["wide"]
    assert "vocabulary" in cap.skipped["head"] and "skip pattern" in cap.skipped["back"]
    assert "frozen" in cap.skipped["frozen"] and "groups=2" in cap.skipped["grouped"]
    with pytest.warns(UserWarning, match="groups=2"):
        layers, skipped = find_kfac_layers(cap.gm, skip_vocab_head=False)
    assert [layer.name for layer in layers] == ["wide", "back", "head"]
    with pytest.warns(UserWarning, match="groups=2"):
        layers, _ = find_kfac_layers(cap.gm, vocab_size=16)
    assert [layer.name for layer in layers] == ["wide", "back", "head"]
