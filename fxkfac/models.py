"""The embedded models: the default, a small BERT-style masked language model in plain PyTorch, and a small GPT-2
(Hugging Face, from a config) for next-byte prediction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from fxkfac.data import BYTE_VOCAB_SIZE, IGNORE_INDEX, VOCAB_SIZE, Objective

__all__ = [
    "TinyBertConfig",
    "TinyBertMLM",
    "ByteGPT2Config",
    "LMConfig",
    "mlm_loss",
    "next_byte_loss",
    "loss_of",
]


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

    objective: ClassVar[Objective] = Objective.MASKED

    def build(self) -> TinyBertMLM:
        """A freshly initialized model (from torch's global generator)."""
        return TinyBertMLM(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class ByteGPT2Config:
    """Sizes of a GPT-2 over the 256 byte values for next-byte prediction: Hugging Face's GPT2LMHeadModel built
    from a GPT2Config (no weights downloaded), its output head tied to the token embedding as GPT-2's, dropout off
    (as the MLM's, so that runs differ only by optimizer), no key/value cache."""

    hidden: int = 64
    heads: int = 4
    ffn: int = 256
    layers: int = 4
    max_len: int = 128

    objective: ClassVar[Objective] = Objective.NEXT_BYTE

    def build(self) -> nn.Module:
        """A freshly initialized GPT2LMHeadModel (from torch's global generator); it returns a ModelOutput whose
        `logits` `next_byte_loss` reads."""
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=BYTE_VOCAB_SIZE,
            n_embd=self.hidden,
            n_head=self.heads,
            n_inner=self.ffn,
            n_layer=self.layers,
            n_positions=self.max_len,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(config)


LMConfig = TinyBertConfig | ByteGPT2Config
"""An embedded model's sizes; its `objective` says which batches (fxkfac.data.lm_data) and loss (`loss_of`) it takes."""


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


def next_byte_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of a Hugging Face causal LM's `logits` against the next bytes, over every position."""
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def loss_of(objective: Objective) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss of the models trained for `objective`."""
    return mlm_loss if objective is Objective.MASKED else next_byte_loss
