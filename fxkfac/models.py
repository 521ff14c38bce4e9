"""The embedded default model: a small BERT-style masked language model in plain PyTorch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fxkfac.data import IGNORE_INDEX, VOCAB_SIZE

__all__ = ["TinyBertConfig", "TinyBertMLM", "mlm_loss"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyBertConfig:
    """Sizes of the default model (byte vocabulary, a few encoder blocks)."""

    vocab_size: int = VOCAB_SIZE
    hidden: int = 64
    heads: int = 4
    ffn: int = 256
    layers: int = 4
    max_len: int = 128
    pre_norm: bool = True
    """LayerNorm before attention and FFN (GPT-2 style; trains without the long plateau of post-LN at this
    size) or after the residual sums, as in the original BERT."""


class _Block(nn.Module):
    def __init__(self, cfg: TinyBertConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.pre_norm = cfg.pre_norm
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_out = nn.Linear(cfg.hidden, cfg.hidden)
        self.norm1 = nn.LayerNorm(cfg.hidden)
        self.intermediate = nn.Linear(cfg.hidden, cfg.ffn)
        self.output = nn.Linear(cfg.ffn, cfg.hidden)
        self.norm2 = nn.LayerNorm(cfg.hidden)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        return x.view(b, s, self.heads, h // self.heads).transpose(1, 2)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        return self.attn_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape))

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(F.gelu(self.intermediate(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self._attention(self.norm1(x))
            return x + self._ffn(self.norm2(x))
        x = self.norm1(x + self._attention(x))
        return self.norm2(x + self._ffn(x))


class TinyBertMLM(nn.Module):
    """Token + position embeddings, `layers` encoder blocks, and an MLM head over the vocabulary."""

    def __init__(self, cfg: TinyBertConfig = TinyBertConfig()) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_len, cfg.hidden)
        self.norm = nn.LayerNorm(cfg.hidden)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.transform = nn.Linear(cfg.hidden, cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.norm(self.tok(ids) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(F.gelu(self.transform(x)))


def mlm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the masked positions (IGNORE_INDEX elsewhere)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
