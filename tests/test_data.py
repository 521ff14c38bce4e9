"""The embedded corpus and default model: deterministic, real, and shaped as the trainers expect."""

from __future__ import annotations

import math

import torch

from fxkfac.data import (
    BYTE_VOCAB_SIZE,
    IGNORE_INDEX,
    MASK_TOKEN,
    MaskedLMData,
    NextByteData,
    Objective,
    lm_data,
    stdlib_corpus,
)
from fxkfac.models import ByteGPT2Config, TinyBertConfig, TinyBertMLM, loss_of, mlm_loss, next_byte_loss


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


def _reference_block(block: torch.nn.Module, x: torch.Tensor, pre_norm: bool) -> torch.Tensor:
    """The encoder block written out: multi-head attention, then the GELU FFN, each with a residual; LayerNorm
    before each (pre-LN) or after each residual sum (post-LN, the original BERT)."""

    def attention(h: torch.Tensor) -> torch.Tensor:
        b, s, d = h.shape
        heads = block.heads
        q, k, v = (
            lin(h).view(b, s, heads, d // heads).transpose(1, 2) for lin in (block.query, block.key, block.value)
        )
        weights = torch.softmax(q @ k.transpose(-1, -2) / (d // heads) ** 0.5, dim=-1)
        return block.attn_out((weights @ v).transpose(1, 2).reshape(b, s, d))

    def ffn(h: torch.Tensor) -> torch.Tensor:
        return block.output(torch.nn.functional.gelu(block.intermediate(h)))

    if pre_norm:
        x = x + attention(block.norm1(x))
        return x + ffn(block.norm2(x))
    x = block.norm1(x + attention(x))
    return block.norm2(x + ffn(x))


def test_blocks_compute_pre_and_post_layernorm_as_written() -> None:
    x = torch.randn(2, 8, 64)
    for pre_norm in (True, False):
        torch.manual_seed(0)
        block = TinyBertMLM(TinyBertConfig(layers=1, pre_norm=pre_norm)).blocks[0]
        torch.testing.assert_close(block(x), _reference_block(block, x, pre_norm), rtol=1e-5, atol=1e-5)


def test_next_byte_targets_are_the_inputs_one_byte_on_in_the_corpus() -> None:
    train, _ = stdlib_corpus(50_000)
    x, y = NextByteData(train, seq_len=16, seed=3).batch(8)
    again = NextByteData(train, seq_len=16, seed=3).batch(8)
    assert x.shape == y.shape == (8, 16) and torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert torch.equal(y[:, :-1], x[:, 1:])
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        assert bytes([*row_x, row_y[-1]]) in train  # 17 consecutive corpus bytes
    assert not torch.equal(x, NextByteData(train, seq_len=16, seed=4).batch(8)[0])
    assert isinstance(lm_data(Objective.NEXT_BYTE, train, seq_len=16, seed=0), NextByteData)
    assert isinstance(lm_data(Objective.MASKED, train, seq_len=16, seed=0), MaskedLMData)


def test_byte_gpt2_is_gpt2_of_the_sizes_and_its_loss_is_next_byte_cross_entropy() -> None:
    cfg = ByteGPT2Config(hidden=32, heads=2, ffn=48, layers=2, max_len=16)
    torch.manual_seed(0)
    model = cfg.build()
    hf = model.config
    assert (hf.vocab_size, hf.n_embd, hf.n_head, hf.n_inner, hf.n_layer, hf.n_positions) == (256, 32, 2, 48, 2, 16)
    assert model.lm_head.weight is model.transformer.wte.weight  # GPT-2's tied head
    assert loss_of(cfg.objective) is next_byte_loss and loss_of(TinyBertConfig.objective) is mlm_loss
    x, y = NextByteData(stdlib_corpus(50_000)[0], seq_len=16).batch(4)
    logits = model(x).logits
    reference = -sum(torch.log_softmax(logits[b, t].double(), dim=0)[y[b, t]] for b in range(4) for t in range(16)) / (
        4 * 16
    )
    loss = next_byte_loss(model(x), y)
    torch.testing.assert_close(loss.double(), reference, rtol=1e-5, atol=1e-5)
    assert abs(loss.item() - math.log(BYTE_VOCAB_SIZE)) < 1.0  # starts near uniform
