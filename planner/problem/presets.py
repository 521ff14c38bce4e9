"""Torch-free model specs (widths, blocks, per-block Linears with Hugging Face names) for the analytic cost model."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fxkfac.planner.problem.errors import CostModelError

__all__ = ["TensorSpec", "LinearSpec", "BlockSpec", "ModelSpec", "PRESETS", "preset", "model_spec_from_layers"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One parameter tensor: its FQN as `named_parameters()` gives it, and its shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of the tensor."""
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """One Linear (or a GEMM-shaped layer such as GPT-2's Conv1D or an im2col Conv2d)."""

    name: str
    """Module FQN, e.g. "bert.encoder.layer.3.attention.self.query"."""
    d_in: int
    d_out: int
    bias: bool = True
    tokens: int | None = None
    """Rows per sample (None: the model's sequence length; a pooler: 1; a conv: output positions)."""
    kfac: bool = True
    """False for layers K-FAC skips (a vocabulary head): costed in fwd/bwd, no curvature work."""
    tied: bool = False
    """The weight is another module's (tied to the embedding): not counted again as parameters."""
    transposed: bool = False
    """The weight is stored [d_in, d_out] (GPT-2's Conv1D), not [d_out, d_in]."""
    bias_name: str | None = None
    """FQN of the bias parameter when it is not `<name>.bias` (BERT's decoder bias is `cls.predictions.bias`)."""

    @property
    def params(self) -> int:
        """Parameters this module owns."""
        return sum(t.numel for t in self.tensors)

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """The parameters this module owns: its weight unless tied, its bias if any."""
        shape = (self.d_in, self.d_out) if self.transposed else (self.d_out, self.d_in)
        weight = TensorSpec(f"{self.name}.weight", shape)
        bias = TensorSpec(self.bias_name or f"{self.name}.bias", (self.d_out,))
        return (() if self.tied else (weight,)) + ((bias,) if self.bias else ())


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """A run of layers that stays together on one stage: a Transformer block, or the embeddings/head."""

    name: str
    """FQN prefix, e.g. "bert.encoder.layer.3" (used in messages only; Linears carry full names)."""
    linears: tuple[LinearSpec, ...] = ()
    attention: int = 0
    """Attention cores (Q K^T, softmax, A V): 1 per self-attention, 1 more per cross-attention."""
    elementwise_per_token: int = 0
    """Elements per token that forward's elementwise kernels (norms, residuals, dropout, activation,
    embedding gathers) each read and write once; attention scores are counted from `attention`."""
    saved_per_token: int = 0
    """Activation elements per token kept from forward to backward (besides attention scores)."""
    saved_mask_bytes_per_token: int = 0
    """1-byte dropout masks kept per token (besides the attention-probability mask)."""
    tensors: tuple[TensorSpec, ...] = ()
    """Parameters outside the Linears: norms, embedding tables, relative position bias, ..."""

    @property
    def parameters(self) -> tuple[TensorSpec, ...]:
        """Every parameter of the block: the Linears' (weights unless tied, biases), then `tensors`."""
        return tuple(t for x in self.linears for t in x.tensors) + self.tensors

    @property
    def params(self) -> int:
        """Parameters of the block."""
        return sum(t.numel for t in self.parameters)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model as the analytic cost model needs it: embeddings, a list of blocks, a head."""

    name: str
    hidden: int
    ffn: int
    heads: int
    vocab: int
    seq_len: int
    """Default sequence length (the one the model is profiled / trained at)."""
    blocks: tuple[BlockSpec, ...]
    embed: BlockSpec
    """Costed on the first stage."""
    head: BlockSpec
    """Costed on the last stage (final norm, LM / pre-training heads)."""

    @property
    def params(self) -> int:
        """Parameter count (tied weights once)."""
        return self.embed.params + self.head.params + sum(b.params for b in self.blocks)

    @property
    def linears(self) -> tuple[LinearSpec, ...]:
        """Every Linear in order: embeddings, blocks, head."""
        parts = (self.embed, *self.blocks, self.head)
        return tuple(x for part in parts for x in part.linears)

    @property
    def parameters(self) -> tuple[TensorSpec, ...]:
        """Every parameter (tied weights once) in order: embeddings, blocks, head."""
        return tuple(t for part in (self.embed, *self.blocks, self.head) for t in part.parameters)


def _lin(
    prefix: str, rows: Sequence[tuple[str, int, int]], bias: bool = True, transposed: bool = False
) -> tuple[LinearSpec, ...]:
    return tuple(LinearSpec(f"{prefix}.{name}", d_in, d_out, bias, transposed=transposed) for name, d_in, d_out in rows)


def _norms(names: Sequence[str], width: int, bias: bool = True) -> tuple[TensorSpec, ...]:
    """The weight (and bias) of each norm module in `names` (LayerNorm; T5's RMS norms have no bias)."""
    kinds = ("weight", "bias") if bias else ("weight",)
    return tuple(TensorSpec(f"{name}.{kind}", (width,)) for name in names for kind in kinds)


def _transformer_block(
    name: str,
    linears: tuple[LinearSpec, ...],
    *,
    hidden: int,
    ffn: int,
    attention: int = 1,
    tensors: tuple[TensorSpec, ...],
) -> BlockSpec:
    """A block with `attention` attention sub-layers and one MLP, each wrapped in norm + residual;
    `tensors` are its parameters outside the Linears (the norms, ...).

    Saved activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", sec. 4.1): per attention sub-layer 5h elements + an h mask, the MLP
    h + 2f + an h mask, 1h per norm input; their 34sbh at 16 bits is (8h + 2f) elements + 2h mask
    bytes at f = 4h. Elementwise forward: dropout, residual add and norm over h per sub-layer,
    the activation over f.
    """
    sublayers = attention + 1
    return BlockSpec(
        name=name,
        linears=linears,
        attention=attention,
        elementwise_per_token=3 * hidden * sublayers + ffn,
        saved_per_token=5 * hidden * attention + hidden + 2 * ffn + hidden * sublayers,
        saved_mask_bytes_per_token=hidden * sublayers,
        tensors=tensors,
    )


def _bert(name: str, hidden: int, layers: int, heads: int, ffn: int) -> ModelSpec:
    """BertForPreTraining (MLM + NSP heads, decoder tied to the word embedding), vocab 30522."""
    vocab, h, pre = 30522, hidden, "bert.embeddings"
    blocks = tuple(
        _transformer_block(
            p := f"bert.encoder.layer.{i}",
            _lin(
                p,
                [
                    ("attention.self.query", h, h),
                    ("attention.self.key", h, h),
                    ("attention.self.value", h, h),
                    ("attention.output.dense", h, h),
                    ("intermediate.dense", h, ffn),
                    ("output.dense", ffn, h),
                ],
            ),
            hidden=h,
            ffn=ffn,
            tensors=_norms([f"{p}.attention.output.LayerNorm", f"{p}.output.LayerNorm"], h),
        )  # fmt: skip
        for i in range(layers)
    )
    tables = (
        TensorSpec(f"{pre}.word_embeddings.weight", (vocab, h)),
        TensorSpec(f"{pre}.position_embeddings.weight", (512, h)),
        TensorSpec(f"{pre}.token_type_embeddings.weight", (2, h)),
    )
    embed = BlockSpec(pre, elementwise_per_token=6 * h, tensors=tables + _norms([f"{pre}.LayerNorm"], h))
    head = BlockSpec(
        "cls",
        linears=(
            LinearSpec("bert.pooler.dense", h, h, tokens=1),
            LinearSpec("cls.predictions.transform.dense", h, h),
            LinearSpec("cls.predictions.decoder", h, vocab, kfac=False, tied=True, bias_name="cls.predictions.bias"),
            LinearSpec("cls.seq_relationship", h, 2, tokens=1),
        ),
        elementwise_per_token=2 * h + vocab,
        tensors=_norms(["cls.predictions.transform.LayerNorm"], h),
    )
    return ModelSpec(name, h, ffn, heads, vocab, 128, blocks, embed, head)


def _gpt2() -> ModelSpec:
    """GPT2LMHeadModel (124M): Conv1D layers (weights stored [d_in, d_out]) costed as Linears, lm_head tied
    to wte."""
    vocab, h, ffn = 50257, 768, 3072
    blocks = tuple(
        _transformer_block(
            p := f"transformer.h.{i}",
            _lin(
                p,
                [("attn.c_attn", h, 3 * h), ("attn.c_proj", h, h), ("mlp.c_fc", h, ffn), ("mlp.c_proj", ffn, h)],
                transposed=True,
            ),
            hidden=h,
            ffn=ffn,
            tensors=_norms([f"{p}.ln_1", f"{p}.ln_2"], h),
        )  # fmt: skip
        for i in range(12)
    )
    embed = BlockSpec(
        "transformer",
        elementwise_per_token=3 * h,
        tensors=(TensorSpec("transformer.wte.weight", (vocab, h)), TensorSpec("transformer.wpe.weight", (1024, h))),
    )
    head = BlockSpec(
        "lm_head",
        linears=(LinearSpec("lm_head", h, vocab, bias=False, kfac=False, tied=True),),
        elementwise_per_token=h + vocab,
        tensors=_norms(["transformer.ln_f"], h),
    )
    return ModelSpec("gpt2", h, ffn, 12, vocab, 1024, blocks, embed, head)


def _opt(name: str, hidden: int, layers: int, heads: int, ffn: int, proj: int) -> ModelSpec:
    """OPTForCausalLM; OPT-350m projects a 512-wide embedding in and out and has no final norm."""
    vocab, h, pre = 50272, hidden, "model.decoder"
    blocks = tuple(
        _transformer_block(
            p := f"{pre}.layers.{i}",
            _lin(
                p,
                [
                    ("self_attn.q_proj", h, h),
                    ("self_attn.k_proj", h, h),
                    ("self_attn.v_proj", h, h),
                    ("self_attn.out_proj", h, h),
                    ("fc1", h, ffn),
                    ("fc2", ffn, h),
                ],
            ),
            hidden=h,
            ffn=ffn,
            tensors=_norms([f"{p}.self_attn_layer_norm", f"{p}.final_layer_norm"], h),
        )  # fmt: skip
        for i in range(layers)
    )
    projected = proj != h
    embed = BlockSpec(
        pre,
        linears=(LinearSpec(f"{pre}.project_in", proj, h, bias=False),) if projected else (),
        elementwise_per_token=3 * h,
        tensors=(
            TensorSpec(f"{pre}.embed_tokens.weight", (vocab, proj)),
            TensorSpec(f"{pre}.embed_positions.weight", (2048 + 2, h)),
        ),  # learned positions: an offset of 2
    )
    head = BlockSpec(
        "lm_head",
        linears=(
            *((LinearSpec(f"{pre}.project_out", h, proj, bias=False),) if projected else ()),
            LinearSpec("lm_head", proj, vocab, bias=False, kfac=False, tied=True),
        ),
        elementwise_per_token=h + vocab,
        tensors=() if projected else _norms([f"{pre}.final_layer_norm"], h),  # OPT-350m (post-norm) has none
    )
    return ModelSpec(name, h, ffn, heads, vocab, 2048, blocks, embed, head)


def _t5_base() -> ModelSpec:
    """T5ForConditionalGeneration t5-base: 12 encoder then 12 decoder blocks, no biases, RMS norms.

    Simplifications: the pipeline runs the 24 blocks in one sequence (the encoder output feeding
    every decoder block's cross-attention is not modelled as a transfer), the decoder length equals
    the encoder length, and the relative position bias lives in block 0 of each stack.
    """
    vocab, h, ffn, heads = 32128, 768, 3072, 12

    def attn(p: str, kind: str) -> list[tuple[str, int, int]]:
        return [(f"{p}.{kind}.{w}", h, h) for w in "qkvo"]

    blocks = []
    for stack, n_sub in (("encoder", 2), ("decoder", 3)):
        for i in range(12):
            p = f"{stack}.block.{i}"
            rows = attn("layer.0", "SelfAttention")
            if stack == "decoder":
                rows += attn("layer.1", "EncDecAttention")
            mlp = f"layer.{n_sub - 1}.DenseReluDense"
            rows += [(f"{mlp}.wi", h, ffn), (f"{mlp}.wo", ffn, h)]
            bias = (TensorSpec(f"{p}.layer.0.SelfAttention.relative_attention_bias.weight", (32, heads)),)
            norms = _norms([f"{p}.layer.{j}.layer_norm" for j in range(n_sub)], h, bias=False)
            blocks.append(
                _transformer_block(
                    p,
                    _lin(p, rows, bias=False),
                    hidden=h,
                    ffn=ffn,
                    attention=n_sub - 1,
                    tensors=(bias if i == 0 else ()) + norms,
                )  # fmt: skip
            )
    embed = BlockSpec("shared", elementwise_per_token=2 * h, tensors=(TensorSpec("shared.weight", (vocab, h)),))
    head = BlockSpec(
        "lm_head",
        linears=(LinearSpec("lm_head", h, vocab, bias=False, kfac=False, tied=True),),
        elementwise_per_token=2 * h + vocab,
        tensors=_norms(["encoder.final_layer_norm", "decoder.final_layer_norm"], h, bias=False),
    )
    return ModelSpec("t5-base", h, ffn, heads, vocab, 512, tuple(blocks), embed, head)


PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "bert-base": lambda: _bert("bert-base", 768, 12, 12, 3072),
    "bert-large": lambda: _bert("bert-large", 1024, 24, 16, 4096),
    "gpt2": _gpt2,
    "opt-125m": lambda: _opt("opt-125m", 768, 12, 12, 3072, 768),
    "opt-350m": lambda: _opt("opt-350m", 1024, 24, 16, 4096, 512),
    "t5-base": _t5_base,
}
"""Preset name -> builder of its ModelSpec."""


def preset(name: str) -> ModelSpec:
    """The ModelSpec of a preset model (case-insensitive)."""
    builder = PRESETS.get(name.lower()) if isinstance(name, str) else None
    if builder is None:
        raise CostModelError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return builder()


def _as_linear(item: LinearSpec | Sequence[object], where: str) -> LinearSpec:
    if isinstance(item, LinearSpec):
        return item
    if not isinstance(item, (tuple, list)) or len(item) not in (4, 5):
        raise CostModelError(f"{where}: expected (name, d_in, d_out, tokens[, bias]), got {item!r}")
    name, d_in, d_out, tokens, *bias = item
    dims = (d_in, d_out, tokens)
    if not isinstance(name, str) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise CostModelError(f"{where}: name must be a string and d_in, d_out, tokens positive ints, got {item!r}")
    return LinearSpec(name, d_in, d_out, bool(bias[0]) if bias else True, tokens=tokens)


def model_spec_from_layers(
    stages: Sequence[Sequence[LinearSpec | Sequence[object]]], *, name: str = "model"
) -> ModelSpec:
    """A ModelSpec for a captured user model: one block per stage, made of its K-FAC layers.

    Each layer is (name, d_in, d_out, tokens) or (name, d_in, d_out, tokens, bias) with tokens =
    rows per sample (sequence length; conv: output positions, d_in = C_in*kh*kw), or a LinearSpec.
    seq_len is 1, so every per-token quantity is per sample. Only the layers' GEMMs are costed
    (kept activations: each layer's input; elementwise: each layer's output once): non-Linear
    work of the model is not known here, so measured profiles are preferable where available.
    """
    if not stages:
        raise CostModelError("model_spec_from_layers needs at least one stage")
    blocks = []
    for i, layers in enumerate(stages):
        lins = tuple(_as_linear(x, f"stage {i}") for x in layers)
        if not lins:
            raise CostModelError(f"stage {i} has no layers; every stage needs at least one to be costed")
        rows = [(x.tokens if x.tokens is not None else 1) for x in lins]
        blocks.append(
            BlockSpec(
                name=f"stage{i}",
                linears=lins,
                elementwise_per_token=sum(t * x.d_out for t, x in zip(rows, lins)),
                saved_per_token=sum(t * x.d_in for t, x in zip(rows, lins)),
            )
        )
    widest = max(max(x.d_in, x.d_out) for b in blocks for x in b.linears)
    empty = BlockSpec("none")
    return ModelSpec(name, widest, 0, 0, 0, 1, tuple(blocks), empty, empty)
