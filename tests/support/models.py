"""Tiny models shared by the tests: an MLP, a CNN, and Hugging Face BERT / GPT-2 from small configs."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["mlp", "cnn", "tiny_bert", "tiny_gpt2", "tiny_llama", "token_batch", "image_batch", "VOCAB", "SEQ"]

VOCAB = 96
SEQ = 8


def mlp(d_in: int = 12, hidden: int = 16, d_out: int = 5, *, seed: int = 0) -> nn.Module:
    """A 3-layer MLP (one Linear without bias) for fast K-FAC and pipeline tests."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden, bias=False),
        nn.Tanh(),
        nn.Linear(hidden, d_out),
    )


class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, bias=False)
        self.head = nn.Linear(6 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.head(x.flatten(1))


def mlp_batches(steps: int, *, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` deterministic mini-batches of `mlp()`'s regression: 8 inputs of 12 features, 8 targets of 5."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)) for _ in range(steps)]


def cnn(*, seed: int = 0) -> nn.Module:
    """A 2-conv CNN for 8x8 single-channel images (the sklearn digits shape)."""
    torch.manual_seed(seed)
    return _CNN()


def tiny_bert(*, layers: int = 2, seed: int = 0, intermediate: int = 64) -> nn.Module:
    """Hugging Face BertForMaskedLM from a small config (no weights are downloaded); `intermediate`: its FFN width."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=intermediate,
        max_position_embeddings=4 * SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config).eval()


def tiny_gpt2(*, layers: int = 2, seed: int = 0) -> nn.Module:
    """Hugging Face GPT2LMHeadModel from a small config (no weights are downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=layers,
        n_head=2,
        n_positions=4 * SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


def tiny_llama(*, seed: int = 0) -> nn.Module:
    """Hugging Face LlamaForCausalLM from a tiny config, the rest default (RMSNorm, rotary, SwiGLU, grouped-query
    attention with 4 heads over 2 key/value heads, untied head); no weights are downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return LlamaForCausalLM(config).eval()


def token_batch(batch: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token-like targets of shape [batch, SEQ]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (batch, SEQ), generator=g)


def image_batch(batch: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 1x8x8 images and class labels in [0, 10)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)
