"""capture(): the exported graph computes and trains like the eager model, under the model's parameter names."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fxkfac.capture import capture
from fxkfac.config import KFACConfig
from fxkfac.errors import CaptureError
from tests.support.models import VOCAB, tiny_bert, token_batch


def test_bert_graph_matches_eager_outputs_and_gradients() -> None:
    model = tiny_bert()
    eager = copy.deepcopy(model)
    ids, targets = token_batch(3)
    with pytest.warns(UserWarning, match="use_cache"):
        cap = capture(model, (ids,), KFACConfig())
    params = dict(model.named_parameters())
    assert {name: p for name, p in cap.gm.named_parameters()}.keys() <= params.keys()
    assert all(p is params[name] for name, p in cap.gm.named_parameters())
    out = cap.unflatten_outputs(cap.gm(*cap.flat_inputs((ids,))))
    ref = eager(ids)
    assert type(out) is type(ref)
    torch.testing.assert_close(out.logits, ref.logits)
    F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
    F.cross_entropy(ref.logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
    ref_params = dict(eager.named_parameters())
    for name, p in cap.gm.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, msg=name)
    assert len(cap.layers) == 13 and cap.signature == (((3, 8), torch.int64),)


def test_inputs_of_another_structure_are_rejected() -> None:
    model = tiny_bert()
    ids, _ = token_batch(2)
    with pytest.warns(UserWarning):
        cap = capture(model, (ids,), None)
    assert cap.layers == [] and cap.skipped == {}
    with pytest.raises(CaptureError, match="structure"):
        cap.flat_inputs((ids, ids))
