"""The embedded corpus and default model: deterministic, real, and shaped as the trainers expect."""

from __future__ import annotations

import torch

from fxkfac.data import IGNORE_INDEX, MASK_TOKEN, MaskedLMData, stdlib_corpus
from fxkfac.models import TinyBertConfig, TinyBertMLM, mlm_loss


def test_corpus_is_python_source_and_split_is_disjoint() -> None:
    train, val = stdlib_corpus(200_000)
    assert len(train) == 200_000 and 0 < len(val) <= 200_000
    assert b"def " in train and b"import " in val
    assert train[:4096] not in val


def test_masked_batches_are_deterministic_and_consistent() -> None:
    train, _ = stdlib_corpus(50_000)
    x1, y1 = MaskedLMData(train, seq_len=16, seed=3).batch(8)
    x2, y2 = MaskedLMData(train, seq_len=16, seed=3).batch(8)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    masked = y1 != IGNORE_INDEX
    assert masked.any(dim=1).all()
    assert (x1[masked] == MASK_TOKEN).all() and (x1[~masked] < 256).all()


def test_default_model_loss_starts_near_uniform() -> None:
    torch.manual_seed(0)
    cfg = TinyBertConfig(layers=2)
    x, y = MaskedLMData(stdlib_corpus(50_000)[0], seq_len=16).batch(4)
    loss = mlm_loss(TinyBertMLM(cfg)(x), y)
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 1.0
