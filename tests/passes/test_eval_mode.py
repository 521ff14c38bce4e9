"""`eval_graph`: a train-mode capture computes what the eager model computes in eval(), on the same parameters."""

from __future__ import annotations

import torch
from torch import nn

from fxkfac.capture import capture
from fxkfac.passes.eval_mode import DROPOUTS, eval_graph


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def test_eval_graph_is_the_eager_eval_forward_and_updates_no_buffer() -> None:
    model, x = _model(), torch.randn(5, 6)
    captured = capture(model, (x,))
    model(x)  # running statistics away from their initial values
    before = {n: b.clone() for n, b in model.named_buffers()}
    gm = eval_graph(captured.gm)
    got = gm(x)[0]
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())  # nothing counted or updated
    assert torch.equal(got, model.eval()(x))
    assert gm.get_parameter("0.weight") is model[0].weight  # trains with the model: no copy
    assert any(n.target in DROPOUTS for n in captured.gm.graph.nodes)  # the training graph is left as it was
