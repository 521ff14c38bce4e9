"""Factories for `fxkfac plan path.py:factory`: each returns (model, example_inputs), nothing is downloaded.

    fxkfac plan examples/plan_factory.py:mlp --stages 2 --microbatches 4 --hardware cpu --show
    fxkfac plan examples/plan_factory.py:gpt2 --stages 2 --microbatches 4 --hardware a100

The planner prepares the model as `fxkfac.compile` does (torch.export on one micro-batch of the example,
the default `fxkfac.KFACConfig`'s K-FAC layer discovery: every Linear/Conv2d except an LM head, the same
stage split) and costs each stage's K-FAC layers with the analytic model of `--hardware`; an exported plan
carries the graph fingerprint compile computes, so `fxkfac.compile(model, mesh, plan="plan.json",
example_inputs=...)` with the same mesh loads it. Write your own factory the same way: a function without
arguments that builds the model and one example global mini-batch of its inputs (it is split into N x W
micro-batches, as compile splits it).
"""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A 4-layer MLP applied to every token (a transformer's feed-forward shape): 128 samples of 64 tokens
    of 256 features, 4 K-FAC layers."""
    model = nn.Sequential(
        nn.Linear(256, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
    )
    return model, (torch.randn(128, 64, 256),)


def gpt2() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A tiny GPT-2 built from a config (random weights; `use_cache` at its default): 2 blocks of 4 K-FAC
    layers each, the LM head skipped as the default KFACConfig does; 128 sequences of 32 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config), (torch.randint(0, config.vocab_size, (128, 32)),)
