"""Analytic cost model: sympy FLOP and byte expressions over a hardware spec, turned into a CostTable.

Every kernel takes max(flops / (peak * efficiency), bytes / bandwidth) (a roofline). FLOPs count a
multiply-add as 2. Symbols: b micro-batch size, s rows per sample (tokens), d_in/d_out Linear
widths, beta 1 with a bias (the A factor gets a ones column) else 0, h heads, d_h head width,
n a factor's side, p bytes per activation element (4 fp32, 2 bf16); factors are kept in fp32.

Torch-free model specs (widths, blocks, per-block Linears with Hugging Face names) for the analytic cost model.

How Shampoo and SOAP cut a parameter into preconditioned blocks (torch-free: the planner counts them too).

The paper's rules (Shi et al., Distributed Shampoo, §4.2, Table 1) under one hyperparameter ``max_dim`` (b):

- *view*: size-1 dimensions are dropped; with merging, consecutive dimensions are merged while their product
  stays <= b (b=8: (10, 2, 2, 4) -> (10, 4, 4)); a tensor still of order > 2 is then viewed as the matrix
  (d0, d1*...*dk). The paper keeps one factor per dimension with root 2*order; fxkfac's families have two
  parts, L (rows) and R (columns), so a view is always 1-D or 2-D. A scalar (or all-ones shape) is (1,).
- ``LargeDimMethod.BLOCKING``: the view is cut into blocks of side <= b, ragged at the far edges, in row-major
  order; every side of every block gets a dense factor.
- ``LargeDimMethod.DIAGONAL``: one block (the whole view); a side longer than b keeps only the diagonal of its
  factor (matdiag), the others a dense factor.
- ``LargeDimMethod.ADAGRAD``: one block; when any side of the view is longer than b, the block has no factors
  (the parameter follows the diagonal graft method); otherwise every side gets a dense factor.

Analytic costs of Shampoo and SOAP: one LayerCost per parameter, parts L and R fed by the reduced gradient.

Every parameter of the model is cut into blocks by `planner.problem.analytic` (Shampoo: merged dims, as
`ShampooConfig.use_merge_dims`; SOAP: unmerged, and its 1-D parameters left to plain AdamW, as
`SOAPConfig.precondition_1d=False`). A block of shape (r, c) (a 1-D block is (r, 1)) with factor sides (m, n)
costs, each kernel timed by the K-FAC model's roofline (`planner.problem.analytic.roofline`, fp32 peak, the hardware's
matmul and factorization efficiencies; that model has no launch-latency floor, so neither has this one):

- statistics, every step (parts L and R, `after=ALLREDUCE_GRAD`): L += G G^T, 2 r^2 c FLOPs; R += G^T G,
  2 r c^2 FLOPs; bytes: G read, the factor read and written.
- decomposition, every refresh, per side of b = m or n:
  Shampoo by eigh (`RootMethod.EIGH`, its default): EIGH_FLOPS b^3 = 9 b^3 at factorization efficiency (Golub &
  Van Loan sec. 8.3.6), then Q diag(lambda^-1/p) Q^T, 2 b^3 at matmul efficiency;
  Shampoo by coupled Newton (`RootMethod.NEWTON`): NEWTON_ITERATIONS x `newton_matmuls(p)` products of 2 b^3;
  SOAP by one power step and QR (`RootMethod.QR`, its default): L Q (2 b^3, matmul) then Householder QR with Q
  formed, QR_FLOPS b^3 = 8/3 b^3 (geqrf 4/3 + orgqr 4/3, Golub & Van Loan sec. 5.2.2), plus re-projecting
  Adam's first moment into the new basis on that side (two products, 2 r c b each).
- preconditioning, every step (LayerCost.prec): Shampoo L^-1/p G R^-1/p, 2 r c (r + c) FLOPs; SOAP rotates
  the gradient in and the Adam direction out, twice that; plus ELEMENTWISE_PASSES fp32 passes over the
  parameter (graft norms, momentum, weight decay; SOAP: Adam's moments) at memory bandwidth.
- bytes: each factor 4 b^2 (PartCost.state_bytes; its root or basis is as large, as K-FAC's inverse is);
  LayerCost.state_bytes: Shampoo's momentum (ShampooConfig: momentum 0.9, SGD graft, beta1 0: no graft or
  filtered-gradient state), SOAP's Adam moments m and v.

Analytic costs of Muon: one LayerCost per parameter, no parts, its APPLY a matrix's Newton-Schulz or AdamW's step.

Muon (`MuonConfig`, fxkfac/muon/) orthogonalizes each hidden 2-D weight's momentum at every step; embeddings, the
output head (a Linear K-FAC skips, `LinearSpec.kfac` False) and 1-D parameters go to AdamW (below). A matrix of
shape (r, c), m = min(r, c) <= n = max(r, c), costs per step (each kernel timed by the K-FAC model's roofline,
`planner.problem.analytic.roofline`, without a launch-latency floor):

- Newton-Schulz, `ns_steps` iterations (5) of the quintic X <- a X + (b A + c A A) X with A = X X^T, X the m x n
  orientation (the transpose when r > c, as torch.optim.Muon does): A = X X^T is m*m*n multiply-adds, A A is m^3,
  (b A + c A A) X is m*m*n, so one iteration is 2 m^2 n + m^3 multiply-adds, 2 (2 m^2 n + m^3) FLOPs
  (`ns_iteration_flops`); the scaling by b, c and the sum are elementwise on m x m and ride in the products'
  epilogues. Priced at `precision`'s peak: BF16 by default, as torch.optim.Muon runs the iterations in bfloat16.
- elementwise: ELEMENTWISE_PASSES fp32 passes over the matrix at memory bandwidth (momentum, Nesterov, the
  normalization before the iterations, the learning-rate adjustment, decoupled weight decay and the update).
- bytes: the momentum buffer (LayerCost.state_bytes) and the gradient a streamed APPLY sends each way
  (LayerCost.grad_bytes), fp32.

Every other parameter (embedding tables, the head, norms, biases) is a unit too, as `fxkfac.compile` makes one of
every trainable parameter (`MuonFamily.units`): its APPLY is AdamW's elementwise step, ADAMW_PASSES fp32 passes at
memory bandwidth (`adamw_cost`), its state the two moments. It is rarely worth a helper (its gradient's transfer
outlasts it but on a link faster than memory bandwidth / ADAMW_PASSES; planner/search/plan_search.py), so it runs on
its owner, beside the matrices' Newton-Schulz.

A piece i of n of a matrix's APPLY (`Op.piece`) runs iterations [i*S//n, (i+1)*S//n) of S = ns_steps
(`planner.problem.ir`); its time is that share of the APPLY.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import cache

import sympy

from fxkfac.planner.problem.costs import (
    CostTable,
    InverseMethod,
    LayerCost,
    PartCost,
    PreconditionerKind,
    StageCost,
    tagged_source,
)
from fxkfac.planner.problem.errors import CostModelError
from fxkfac.planner.problem.hardware import HardwareSpec, Precision
from fxkfac.planner.problem.hardware import hardware as get_hardware
from fxkfac.planner.problem.ir import NS_STEPS, OpKind


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


DEFAULT_MAX_DIM = 1024
"""The block side used when ``max_preconditioner_dim="auto"`` and no plan chooses one (paper: 1024-8192)."""


class LargeDimMethod(StrEnum):
    """What happens to a side of the view longer than ``max_dim`` (see the module doc)."""

    BLOCKING = "blocking"
    ADAGRAD = "adagrad"
    DIAGONAL = "diagonal"


class FactorKind(StrEnum):
    """The statistic kept for one side of a block: a dense d x d matrix or only its diagonal (d values)."""

    DENSE = "dense"
    DIAGONAL = "diagonal"


@dataclass(frozen=True, slots=True)
class Block:
    """One block of a view: ``(start, end)`` per dimension of the view and the factor kind of each side
    (``kinds`` is empty when the block has no factors: ``LargeDimMethod.ADAGRAD`` on a large view)."""

    ranges: tuple[tuple[int, int], ...]
    kinds: tuple[FactorKind, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """Side lengths of the block."""
        return tuple(end - start for start, end in self.ranges)

    @property
    def sides(self) -> tuple[int, int]:
        """(m, n): the sides of its dense L and R factors, 0 where that side has none (a 1-D block's R, a
        diagonal factor, no factors at all)."""
        dense = [d if kind is FactorKind.DENSE else 0 for d, kind in zip(self.shape, self.kinds)]
        dense += [0] * (2 - len(dense))
        return dense[0], dense[1]


def _check(shape: Sequence[int], max_dim: int) -> None:
    """ValueError naming the bad argument (negative or zero sizes are not parameter shapes)."""
    if max_dim < 1:
        raise ValueError(f"max_dim must be >= 1, got {max_dim}")
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {tuple(shape)} has a negative dimension")


def merge_dims(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """Drop size-1 dims, then merge consecutive dims while their product stays <= `max_dim` (a scalar: (1,))."""
    _check(shape, max_dim)
    merged: list[int] = []
    for d in (d for d in shape if d != 1):
        if merged and merged[-1] * d <= max_dim:
            merged[-1] *= d
        else:
            merged.append(d)
    return tuple(merged) or (1,)


def matrix_view(shape: Sequence[int], max_dim: int, merge: bool = True) -> tuple[int, ...]:
    """The 1-D or 2-D shape a parameter is preconditioned as: size-1 dims dropped, merged when `merge`, and an
    order > 2 result viewed as (d0, d1*...*dk) (L on the first dimension, R on the rest)."""
    _check(shape, max_dim)
    dims = merge_dims(shape, max_dim) if merge else (tuple(d for d in shape if d != 1) or (1,))
    return dims if len(dims) <= 2 else (dims[0], math.prod(dims[1:]))


def _chunks(d: int, max_dim: int) -> list[tuple[int, int]]:
    """[0, d) cut into pieces of length `max_dim`, the last one ragged (none for d = 0)."""
    return [(start, min(start + max_dim, d)) for start in range(0, d, max_dim)]


def block_ranges(shape: Sequence[int], max_dim: int) -> list[tuple[tuple[int, int], ...]]:
    """Blocks of side <= `max_dim` covering `shape` (a view), ragged at the far edges, in row-major order:
    ``(start, end)`` per dimension. (25, 7) with max_dim 10: rows (0,10) (10,20) (20,25) x cols (0,7)."""
    _check(shape, max_dim)
    return list(itertools.product(*(_chunks(d, max_dim) for d in shape)))


def block_shapes(shape: Sequence[int], max_dim: int) -> list[tuple[int, ...]]:
    """The side lengths of `block_ranges(shape, max_dim)`, in the same order."""
    return [tuple(end - start for start, end in ranges) for ranges in block_ranges(shape, max_dim)]


def partition(
    shape: Sequence[int], max_dim: int, method: LargeDimMethod, merge: bool = True
) -> tuple[tuple[int, ...], list[Block]]:
    """The view of a parameter of `shape` and its blocks under `method` (see the module doc)."""
    view = matrix_view(shape, max_dim, merge)
    large = any(d > max_dim for d in view)
    whole = tuple((0, d) for d in view)
    if method is LargeDimMethod.BLOCKING:
        return view, [Block(r, (FactorKind.DENSE,) * len(view)) for r in block_ranges(view, max_dim)]
    if method is LargeDimMethod.DIAGONAL:
        kinds = tuple(FactorKind.DIAGONAL if d > max_dim else FactorKind.DENSE for d in view)
        return view, [Block(whole, kinds)]
    if method is LargeDimMethod.ADAGRAD:
        return view, [Block(whole, () if large else (FactorKind.DENSE,) * len(view))]
    raise ValueError(f"unknown large_dim_method {method!r}; use one of {[m.value for m in LargeDimMethod]}")


def factor_sides(
    shape: Sequence[int], max_dim: int, method: LargeDimMethod, merge: bool = True
) -> list[tuple[int, int]]:
    """(m, n) per block of a parameter of `shape`: the sides of its dense L and R factors (what eigh and the
    preconditioning matmuls cost), 0 where a side has none (`Block.sides`). Block sizes: `partition`."""
    return [block.sides for block in partition(shape, max_dim, method, merge)[1]]


b, s, d_in, d_out, beta, h, d_h, n, p = sympy.symbols("b s d_in d_out beta h d_h n p", positive=True)
d, f = sympy.symbols("d f", positive=True)
SYMBOLS = {x.name: x for x in (b, s, d_in, d_out, beta, h, d_h, n, p, d, f)}
"""The symbols the expressions use, by name."""

_FACTOR_BYTES = 4  # factors, inverses and curvature kernels are fp32

EIGH_FLOPS = 9
"""FLOPs of a symmetric eigendecomposition with eigenvectors, per n^3: ~9n^3 for the symmetric QR algorithm
(Golub & Van Loan, Matrix Computations, 4th ed., sec. 8.3.6; tridiagonal reduction 4n^3/3, QR sweeps and
accumulating Q the rest). LAPACK/cuSOLVER syevd (divide and conquer) does no more than this."""


@cache
def linear_expressions(inverse: InverseMethod = InverseMethod.CHOLESKY) -> dict[str, sympy.Expr]:
    """FLOPs and bytes of one Linear's forward, backward and K-FAC kernels, and the memory K-FAC keeps.

    Inversion of an n x n factor: Cholesky (n^3/3) + cholesky_inverse (potri: 2n^3/3) = n^3; an
    eigendecomposition (symmetric QR with eigenvectors, Golub & Van Loan, Matrix Computations,
    sec. 8.3) ~ 9n^3. Precondition B^-1 G A^-1: two GEMMs, 2 d_out d_a (d_a + d_out) FLOPs.
    """
    if inverse not in set(InverseMethod):
        raise CostModelError(f"inverse must be one of {[m.value for m in InverseMethod]}, got {inverse!r}")
    d_a = d_in + beta
    rows = b * s
    inv_flops = n**3 if inverse == InverseMethod.CHOLESKY else EIGH_FLOPS * n**3
    fb = _FACTOR_BYTES
    return {
        "fwd_flops": 2 * rows * d_in * d_out,
        "fwd_bytes": p * (rows * d_in + d_in * d_out + rows * d_out),
        "bwd_flops": 4 * rows * d_in * d_out,  # grad input and grad weight
        "bwd_bytes": p * (2 * rows * d_out + 2 * rows * d_in + 2 * d_in * d_out),
        "curv_a_flops": 2 * rows * d_a**2,
        "curv_a_bytes": p * rows * d_in + fb * d_a**2,
        "curv_b_flops": 2 * rows * d_out**2,
        "curv_b_bytes": p * rows * d_out + fb * d_out**2,
        "inv_flops": inv_flops,
        "inv_bytes": 2 * fb * n**2,
        "prec_flops": 2 * d_out * d_a * (d_a + d_out),
        "prec_bytes": fb * (2 * d_out * d_a + d_a**2 + d_out**2),
        "a_bytes": p * rows * d_in,
        "e_bytes": p * rows * d_out,
        "factor_a_bytes": fb * d_a**2,
        "factor_b_bytes": fb * d_out**2,
    }


@cache
def attention_expressions() -> dict[str, sympy.Expr]:
    """One attention core: Q K^T and A V GEMMs, and the softmax + dropout over the scores."""
    scores = b * h * s * s
    return {
        "fwd_flops": 2 * (2 * b * h * s * s * d_h),
        "fwd_bytes": 2 * p * (2 * b * s * h * d_h + scores),
        "bwd_flops": 2 * (4 * b * h * s * s * d_h),
        "bwd_bytes": 4 * p * (2 * b * s * h * d_h + scores),
        "elementwise_bytes": 2 * (2 * p * scores),  # softmax and dropout: read + write
        "saved_bytes": (2 * p + 1) * scores,  # softmax output, dropout output, 1-byte mask
    }


@cache
def transformer_block_expressions() -> dict[str, sympy.Expr]:
    """A BERT-style block (q, k, v, o: d -> d; d -> f -> d; one self-attention, h * d_h = d), summed."""
    lin = linear_expressions()
    widths = [(d, d)] * 4 + [(d, f), (f, d)]
    att = attention_expressions()

    def total(key: str) -> sympy.Expr:
        return sum((lin[key].subs({d_in: i, d_out: o}) for i, o in widths), sympy.Integer(0))

    out = {key: sympy.expand(total(key)) for key in ("fwd_flops", "bwd_flops", "curv_a_flops", "curv_b_flops")}
    out["fwd_flops"] = sympy.expand(out["fwd_flops"] + att["fwd_flops"].subs(d_h, d / h))
    out["bwd_flops"] = sympy.expand(out["bwd_flops"] + att["bwd_flops"].subs(d_h, d / h))
    out["inv_flops"] = sympy.expand(sum((lin["inv_flops"].subs(n, w) for pair in widths for w in pair), 0))
    return out


def kernel_time_expression() -> sympy.Expr:
    """Roofline time of one kernel: max(F / (P * eta), Q / W)."""
    flops, peak, eff, nbytes, bw = sympy.symbols("F P eta Q W", positive=True)
    return sympy.Max(flops / (peak * eff), nbytes / bw)


def explain() -> str:
    """The expressions as text (for `fxkfac plan --explain`)."""
    lines = [f"kernel time = {kernel_time_expression()}"]
    for title, exprs in (
        ("Linear", linear_expressions()),
        ("attention core", attention_expressions()),
        ("Transformer block", transformer_block_expressions()),
    ):
        lines.append(f"{title}:")
        lines += [f"  {key} = {expr}" for key, expr in exprs.items()]
    return "\n".join(lines)


@cache
def _compiled(group: str, inverse: InverseMethod) -> dict[str, Callable[..., float]]:
    exprs = linear_expressions(inverse) if group == "linear" else attention_expressions()
    args = (b, s, d_in, d_out, beta, h, d_h, n, p)
    return {key: sympy.lambdify(args, expr, modules="math") for key, expr in exprs.items()}


def _eval(group: str, inverse: InverseMethod = InverseMethod.CHOLESKY, **values: float) -> dict[str, float]:
    env = {"b": 0, "s": 0, "d_in": 0, "d_out": 0, "beta": 0, "h": 0, "d_h": 0, "n": 0, "p": 4, **values}
    args = [env[k] for k in ("b", "s", "d_in", "d_out", "beta", "h", "d_h", "n", "p")]
    return {key: float(fn(*args)) for key, fn in _compiled(group, inverse).items()}


@dataclass(frozen=True, slots=True)
class KernelCost:
    """Seconds of one Linear's work on a device, and the bytes K-FAC keeps for it."""

    fwd: float
    bwd: float
    layer: LayerCost | None
    """None for a layer K-FAC skips."""


def roofline(hw: HardwareSpec, flops: float, nbytes: float, peak: float, eff: float) -> float:
    """Seconds of one kernel: max(flops / (peak * eff), nbytes / memory bandwidth)."""
    return max(flops / (peak * eff), nbytes / hw.mem_bandwidth)


def linear_kernels(
    lin: LinearSpec, *, batch: int, seq_len: int, hw: HardwareSpec, precision: Precision, inverse: InverseMethod
) -> KernelCost:
    """Times of one Linear (fwd, bwd per micro-batch) and its LayerCost (curvature, inversion, ...)."""
    peak, bpe = _precision(hw, precision)
    tokens = lin.tokens if lin.tokens is not None else seq_len
    base = dict(b=batch, s=tokens, d_in=lin.d_in, d_out=lin.d_out, beta=int(lin.bias), p=bpe)
    e = _eval("linear", inverse, **base)
    eff = hw.matmul_efficiency
    fwd = roofline(hw, e["fwd_flops"], e["fwd_bytes"], peak, eff)
    bwd = roofline(hw, e["bwd_flops"], e["bwd_bytes"], peak, eff)
    if not lin.kfac:
        return KernelCost(fwd, bwd, None)
    fp32 = hw.peak_flops

    def inv(side: int) -> float:
        v = _eval("linear", inverse, n=side)
        return roofline(hw, v["inv_flops"], v["inv_bytes"], fp32, hw.factorization_efficiency)

    layer = LayerCost.kfac(
        lin.name,
        curv_a=roofline(hw, e["curv_a_flops"], e["curv_a_bytes"], fp32, eff),
        curv_b=roofline(hw, e["curv_b_flops"], e["curv_b_bytes"], fp32, eff),
        inv_a=inv(lin.d_in + int(lin.bias)),
        inv_b=inv(lin.d_out),
        prec=roofline(hw, e["prec_flops"], e["prec_bytes"], fp32, eff),
        a_bytes=round(e["a_bytes"]),
        e_bytes=round(e["e_bytes"]),
        factor_a_bytes=round(e["factor_a_bytes"]),
        factor_b_bytes=round(e["factor_b_bytes"]),
        grad_bytes=4 * (lin.d_in + int(lin.bias)) * lin.d_out,
    )
    return KernelCost(fwd, bwd, layer)


def _precision(hw: HardwareSpec, precision: Precision) -> tuple[float, int]:
    if precision == Precision.FP32:
        return hw.peak_flops, 4
    if precision == Precision.BF16:
        return hw.peak_flops_tensor, 2
    raise CostModelError(f"precision must be one of {[p.value for p in Precision]}, got {precision!r}")


@dataclass(frozen=True, slots=True)
class BlockCost:
    """Seconds (fwd, bwd per micro-batch) and memory of one block, and its K-FAC layers' costs."""

    fwd: float
    bwd: float
    params: int
    act_bytes: int
    peak_err_bytes: int
    layers: tuple[LayerCost, ...]
    hidden_bytes: int = 0
    """Bytes of one micro-batch's hidden state: the block's input, as large as its output."""


def block_kernels(
    block: BlockSpec,
    spec: ModelSpec,
    *,
    batch: int,
    seq_len: int,
    hw: HardwareSpec,
    precision: Precision,
    inverse: InverseMethod,
) -> BlockCost:
    """Sum of a block's Linears, attention cores and elementwise traffic, and its memory."""
    peak, bpe = _precision(hw, precision)
    kernels = [
        linear_kernels(x, batch=batch, seq_len=seq_len, hw=hw, precision=precision, inverse=inverse)
        for x in block.linears
    ]
    fwd = sum(k.fwd for k in kernels)
    bwd = sum(k.bwd for k in kernels)
    act: float = block.saved_per_token * bpe * batch * seq_len + block.saved_mask_bytes_per_token * batch * seq_len
    scores = 0.0
    if block.attention:
        a = _eval("attention", b=batch, s=seq_len, h=spec.heads, d_h=spec.hidden / spec.heads, p=bpe)
        ew = block.attention * a["elementwise_bytes"] / hw.mem_bandwidth
        eff = hw.matmul_efficiency
        fwd += block.attention * roofline(hw, a["fwd_flops"] / 2, a["fwd_bytes"] / 2, peak, eff) * 2 + ew
        bwd += block.attention * roofline(hw, a["bwd_flops"] / 2, a["bwd_bytes"] / 2, peak, eff) * 2 + 2 * ew
        act += block.attention * a["saved_bytes"]
        scores = bpe * batch * spec.heads * seq_len * seq_len
    elementwise = 2 * bpe * block.elementwise_per_token * batch * seq_len / hw.mem_bandwidth
    widest = max((x.d_out for x in block.linears), default=0)
    return BlockCost(
        fwd=fwd + elementwise,
        bwd=bwd + 2 * elementwise,
        params=block.params,
        act_bytes=round(act),
        peak_err_bytes=round(bpe * batch * seq_len * 2 * widest + scores),
        layers=tuple(k.layer for k in kernels if k.layer is not None),
        hidden_bytes=round(bpe * batch * seq_len * spec.hidden),
    )


def balanced_stages(costs: Sequence[float], n_stages: int) -> list[range]:
    """Contiguous split of per-block costs into n_stages minimizing the largest stage (exact DP)."""
    nb = len(costs)
    if not 1 <= n_stages <= nb:
        raise CostModelError(f"cannot split {nb} blocks into {n_stages} stages; use 1..{nb} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (nb + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (nb + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, nb + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j] - 1e-15:
                    best[k][j], cut[k][j] = v, i
    bounds, j = [], nb
    for k in range(n_stages, 0, -1):
        bounds.append(range(cut[k][j], j))
        j = cut[k][j]
    return bounds[::-1]


def _stage_ranges(stages: int | Sequence[range | tuple[int, int]], block_costs: list[float]) -> list[range]:
    if isinstance(stages, int) and not isinstance(stages, bool):
        return balanced_stages(block_costs, stages)
    assert not isinstance(stages, bool), "stages is an int or block ranges, not a bool"
    ranges = [r if isinstance(r, range) else range(*r) for r in stages]
    expected = 0
    for r in ranges:
        if r.step != 1 or r.start != expected or r.stop <= r.start:
            raise CostModelError(
                f"stage block ranges must be contiguous, non-empty and start at 0; got {list(map(tuple, ranges))}"
            )
        expected = r.stop
    if expected != len(block_costs):
        raise CostModelError(f"stage block ranges cover {expected} blocks, the model has {len(block_costs)}")
    return ranges


def analytic_cost_table(
    model_spec: ModelSpec | str,
    stages: int | Sequence[range | tuple[int, int]],
    micro_batch_size: int,
    seq_len: int | None = None,
    hardware: HardwareSpec | str = "p100",
    *,
    precision: Precision = Precision.FP32,
    inverse: InverseMethod = InverseMethod.CHOLESKY,
    units: Callable[[BlockSpec], tuple[LayerCost, ...]] | None = None,
) -> CostTable:
    """A CostTable from the analytic model, one LayerCost per K-FAC Linear (Hugging Face FQNs).

    stages: an int (balanced contiguous split by fwd+bwd time) or block ranges per stage
    (e.g. [range(0, 3), range(3, 6)] or [(0, 3), (3, 6)]). The embeddings are costed on the
    first stage and the head on the last. Parameters count fp32 master weights (4 bytes).
    units: the preconditioned units of a block (another family's, e.g. Shampoo's parameters) in place
    of its K-FAC Linears; the pipeline's costs and split are the same either way.
    """
    spec = preset(model_spec) if isinstance(model_spec, str) else model_spec
    hw = get_hardware(hardware)
    _check_size("micro_batch_size", micro_batch_size)
    seq = spec.seq_len if seq_len is None else seq_len
    _check_size("seq_len", seq)

    def kernels(block: BlockSpec) -> BlockCost:
        return block_kernels(
            block, spec, batch=micro_batch_size, seq_len=seq, hw=hw, precision=precision, inverse=inverse
        )

    parts = [kernels(x) for x in spec.blocks]
    embed, head = kernels(spec.embed), kernels(spec.head)
    costs = [x.fwd + x.bwd for x in parts]
    costs[0] += embed.fwd + embed.bwd
    costs[-1] += head.fwd + head.bwd
    ranges = _stage_ranges(stages, costs)
    out = []
    for i, r in enumerate(ranges):
        first, last = i == 0, i == len(ranges) - 1
        members = ([embed] if first else []) + [parts[j] for j in r] + ([head] if last else [])
        owners = ([spec.embed] if first else []) + [spec.blocks[j] for j in r] + ([spec.head] if last else [])
        out.append(_stage_cost(members, owners, units))
    source = f"analytic:{spec.name}:seq{seq}:{precision}:{inverse}"
    return CostTable(tuple(out), micro_batch_size, source, hw.name, hw.comm)


def _check_size(name: str, value: object) -> None:
    """CostModelError unless `value` is an int >= 1 (a bool is not): a batch or sequence size."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CostModelError(f"{name} must be an int >= 1, got {value!r}")


def _stage_cost(
    members: Sequence[BlockCost],
    owners: Sequence[BlockSpec],
    units: Callable[[BlockSpec], tuple[LayerCost, ...]] | None,
) -> StageCost:
    """One stage's costs: the sums over its blocks' costs `members`; its layers are those blocks' K-FAC Linears, or
    `units` of each of its blocks `owners` when given."""
    return StageCost(
        fwd=sum(x.fwd for x in members),
        bwd=sum(x.bwd for x in members),
        param_bytes=4 * sum(x.params for x in members),
        act_bytes=sum(x.act_bytes for x in members),
        layers=tuple(layer for x in members for layer in x.layers)
        if units is None
        else tuple(layer for block in owners for layer in units(block)),
        peak_err_bytes=max(x.peak_err_bytes for x in members),
        boundary_bytes=members[0].hidden_bytes + members[-1].hidden_bytes,  # the stage's input and output
    )


_F32 = 4

QR_FLOPS = 8 / 3
"""FLOPs per b^3 of a Householder QR of a b x b matrix with Q formed (geqrf 4b^3/3 + orgqr 4b^3/3)."""

NEWTON_ITERATIONS = 20
"""Coupled inverse Newton iterations per root (an estimate): the paper gives no count, the reference
implementations cap it at 100 (`num_iters=100` in google-research scalable_shampoo; ShampooConfig's
newton_max_iterations) and stop at ||M_k - I|| < 1e-6; from the scaled start X0 = I/c the error shrinks
linearly, then quadratically, which takes about 20 steps for float32 factors of condition number <= 1e6."""

ELEMENTWISE_PASSES: dict[PreconditionerKind, int] = {
    PreconditionerKind.SHAMPOO: 8,  # G and P for the two norms, P and W read + P written (decay), M read + written
    PreconditionerKind.SOAP: 8,  # rotated G read, m and v read + written, W read, the direction written twice
    # momentum (buffer and gradient read, buffer written), Nesterov's blend (read, written), the normalization (norm
    # read, scaled copy written), the update with its learning-rate adjustment and weight decay (W and direction
    # read, W written)
    PreconditionerKind.MUON: 10,
}
"""fp32 reads and writes per parameter element of a step's elementwise work (besides the matmuls)."""

STATE_BUFFERS: dict[PreconditionerKind, int] = {PreconditionerKind.SHAMPOO: 1, PreconditionerKind.SOAP: 2}
"""Parameter-sized fp32 buffers of optimizer state: Shampoo's momentum; SOAP's Adam m and v."""


class RootMethod(StrEnum):
    """How a factor is decomposed at a refresh (the module doc gives each one's cost)."""

    EIGH = "eigh"
    NEWTON = "newton"
    QR = "qr"


_METHODS = {
    PreconditionerKind.SHAMPOO: (RootMethod.EIGH, RootMethod.NEWTON),
    PreconditionerKind.SOAP: (RootMethod.QR, RootMethod.EIGH),
}
"""The methods each family has, its default first."""


def newton_matmuls(p: int) -> int:
    """Matrix products of one coupled Newton step for the inverse p-th root: Z^p by repeated squaring
    (floor(log2 p) squarings and popcount(p) - 1 products), Z^p M_k, and X_k Z."""
    return p.bit_length() - 1 + p.bit_count() - 1 + 2


@dataclass(frozen=True, slots=True)
class SideCost:
    """One side's share of a block: seconds of its statistic per step and of its decomposition per refresh."""

    stats: float
    decomp: float


def _gemm(hw: HardwareSpec, flops: float, nbytes: float) -> float:
    return roofline(hw, flops, nbytes, hw.peak_flops, hw.matmul_efficiency)


def _factorization(hw: HardwareSpec, flops: float, b: int) -> float:
    return roofline(hw, flops, 2 * _F32 * b * b, hw.peak_flops, hw.factorization_efficiency)


def _decomp(hw: HardwareSpec, method: RootMethod, b: int, other: int, order: int) -> float:
    """Seconds to decompose one b x b factor of a block whose other side is `other`, of `order` 1 or 2."""
    square = 3 * _F32 * b * b  # two operands read, one result written
    if method is RootMethod.EIGH:
        return _factorization(hw, EIGH_FLOPS * b**3, b) + _gemm(hw, 2 * b**3, square)
    if method is RootMethod.NEWTON:
        return NEWTON_ITERATIONS * newton_matmuls(2 * order) * _gemm(hw, 2 * b**3, square)
    reproject = 2 * _gemm(hw, 2 * b * b * other, _F32 * (b * b + 2 * b * other))
    return _gemm(hw, 2 * b**3, square) + _factorization(hw, QR_FLOPS * b**3, b) + reproject


def side_cost(hw: HardwareSpec, method: RootMethod, side: int, other: int, order: int) -> SideCost:
    """The cost of one factor of side `side` of a block side x other (`order` 2), or of a vector block of
    `side` elements (`order` 1, other = 1): its statistic G G^T (or G^T G) and its decomposition."""
    stats = _gemm(hw, 2 * side * side * other, _F32 * (side * other + 2 * side * side))
    return SideCost(stats, _decomp(hw, method, side, other, order))


def _apply_flops(kind: PreconditionerKind, shape: tuple[int, int], sides: tuple[int, int]) -> tuple[int, int]:
    """FLOPs and bytes of a step's preconditioning matmuls of one block of `shape` with factor `sides`."""
    r, c = shape
    flops = (2 * r * r * c if sides[0] else 0) + (2 * r * c * c if sides[1] else 0)
    nbytes = _F32 * (sides[0] ** 2 + sides[1] ** 2 + 3 * r * c)
    times = 2 if kind is PreconditionerKind.SOAP else 1  # SOAP rotates in and out
    return times * flops, times * nbytes


def parameter_cost(
    tensor: TensorSpec, hw: HardwareSpec, kind: PreconditionerKind, max_dim: int, method: RootMethod | None = None
) -> LayerCost | None:
    """The LayerCost of one parameter (name: its FQN) cut into blocks of side <= max_dim; None when the family
    leaves it to its diagonal method (SOAP's 1-D parameters). `method`: the family's default when None."""
    method = _METHODS[kind][0] if method is None else method
    if method not in _METHODS[kind]:
        raise CostModelError(f"{kind} decomposes by {[m.value for m in _METHODS[kind]]}, not {method.value!r}")
    view, blocks = partition(tensor.shape, max_dim, LargeDimMethod.BLOCKING, merge=kind is PreconditionerKind.SHAMPOO)
    if kind is PreconditionerKind.SOAP and len(view) == 1:
        return None
    sides: dict[str, list[SideCost]] = {"L": [], "R": []}
    bytes_of = {"L": 0, "R": 0}
    prec = 0.0
    for block in blocks:
        shape = (block.shape[0], block.shape[1] if len(view) == 2 else 1)
        for part, side, other in (("L", block.sides[0], shape[1]), ("R", block.sides[1], shape[0])):
            if side:
                sides[part].append(side_cost(hw, method, side, other, len(view)))
                bytes_of[part] += _F32 * side * side
        prec += _gemm(hw, *_apply_flops(kind, shape, block.sides))
    prec += ELEMENTWISE_PASSES[kind] * _F32 * tensor.numel / hw.mem_bandwidth
    parts = tuple(
        PartCost(
            part, OpKind.ALLREDUCE_GRAD, sum(x.stats for x in costs), sum(x.decomp for x in costs), 0, bytes_of[part]
        )
        for part, costs in sides.items()
        if costs
    )
    return LayerCost(tensor.name, parts, prec, STATE_BUFFERS[kind] * _F32 * tensor.numel, _F32 * tensor.numel)


def largest_dim(spec: ModelSpec) -> int:
    """The longest side of any parameter of the model: a block size this large blocks nothing."""
    return max(max(t.shape) for t in spec.parameters)


def gradient_cost_table(
    model_spec: ModelSpec | str,
    stages: int | Sequence[range | tuple[int, int]],
    micro_batch_size: int,
    seq_len: int | None = None,
    hardware: HardwareSpec | str = "p100",
    *,
    kind: PreconditionerKind,
    max_dim: int | None,
    method: RootMethod | None = None,
    precision: Precision = Precision.FP32,
) -> CostTable:
    """The analytic CostTable of Shampoo or SOAP over a preset's pipeline: the K-FAC model's stages (same split,
    forward, backward and memory) with one LayerCost per parameter of each stage in place of the K-FAC layers.

    max_dim: the block side (`max_preconditioner_dim`); None blocks nothing (the largest parameter dimension).
    The source reads e.g. "shampoo:analytic:bert-base:seq128:fp32:eigh:block1024".
    """
    if kind is PreconditionerKind.KFAC:
        raise CostModelError("gradient_cost_table costs Shampoo or SOAP; K-FAC's is analytic_cost_table")
    spec = preset(model_spec) if isinstance(model_spec, str) else model_spec
    hw = get_hardware(hardware)
    side = largest_dim(spec) if max_dim is None else max_dim
    if isinstance(side, bool) or not isinstance(side, int) or side < 1:
        raise CostModelError(f"max_dim must be an int >= 1 or None (no blocking), got {max_dim!r}")
    how = _METHODS[kind][0] if method is None else method

    def units(block: BlockSpec) -> tuple[LayerCost, ...]:
        costs = (parameter_cost(t, hw, kind, side, how) for t in block.parameters)
        return tuple(c for c in costs if c is not None)

    table = analytic_cost_table(spec, stages, micro_batch_size, seq_len, hw, precision=precision, units=units)
    blocking = "unblocked" if max_dim is None else f"block{max_dim}"
    source = tagged_source(kind, f"{table.source.rsplit(':', 1)[0]}:{how.value}:{blocking}")
    return replace(table, source=source, family=kind)


ADAMW_PASSES = 12
"""fp32 reads and writes per element of an AdamW step: the moments (gradient and both read, both written), the
direction (both moments and the weight read, the direction written), the update (weight and direction read,
weight written)."""


def ns_iteration_flops(rows: int, cols: int) -> int:
    """FLOPs of one Newton-Schulz iteration on a rows x cols matrix: 2 (2 m^2 n + m^3), m <= n its sides."""
    m, n = sorted((rows, cols))
    return 2 * (2 * m * m * n + m**3)


def _iteration_seconds(hw: HardwareSpec, rows: int, cols: int, precision: Precision) -> float:
    """One iteration's three products, each by the roofline at `precision` (operands read, result written)."""
    peak, item = (hw.peak_flops_tensor, 2) if precision is Precision.BF16 else (hw.peak_flops, _F32)
    m, n = sorted((rows, cols))
    gram = roofline(hw, 2 * m * m * n, item * (2 * m * n + m * m), peak, hw.matmul_efficiency)
    square = roofline(hw, 2 * m**3, item * 3 * m * m, peak, hw.matmul_efficiency)
    back = roofline(hw, 2 * m * m * n, item * (m * m + 2 * m * n), peak, hw.matmul_efficiency)
    return gram + square + back


def ns_seconds(
    hw: HardwareSpec, shape: tuple[int, int], ns_steps: int = NS_STEPS, precision: Precision = Precision.BF16
) -> float:
    """Seconds of a step's Muon APPLY of one matrix: its `ns_steps` iterations and its elementwise work."""
    r, c = shape
    elementwise = ELEMENTWISE_PASSES[PreconditionerKind.MUON] * _F32 * r * c / hw.mem_bandwidth
    return ns_steps * _iteration_seconds(hw, r, c, precision) + elementwise


def matrix_cost(
    tensor: TensorSpec, hw: HardwareSpec, ns_steps: int = NS_STEPS, precision: Precision = Precision.BF16
) -> LayerCost:
    """The LayerCost of one Muon matrix (name: its FQN): no parts, `prec` its step's APPLY."""
    if len(tensor.shape) != 2:
        raise CostModelError(f"Muon orthogonalizes 2-D matrices; {tensor.name} has shape {tensor.shape}")
    r, c = tensor.shape
    numel = _F32 * r * c
    return LayerCost(tensor.name, (), ns_seconds(hw, (r, c), ns_steps, precision), numel, numel)


def adamw_cost(tensor: TensorSpec, hw: HardwareSpec) -> LayerCost:
    """The LayerCost of a parameter AdamW steps (name: its FQN): no parts, `prec` its elementwise step, its state
    the two moments."""
    numel = _F32 * tensor.numel
    return LayerCost(tensor.name, (), ADAMW_PASSES * numel / hw.mem_bandwidth, 2 * numel, numel)


def muon_matrices(block: BlockSpec) -> tuple[TensorSpec, ...]:
    """The block's parameters Muon orthogonalizes: the weights of its Linears other than a vocabulary head (those
    K-FAC skips) or a tied one; embedding tables, norms and biases go to AdamW."""
    return tuple(
        TensorSpec(f"{x.name}.weight", (x.d_in, x.d_out) if x.transposed else (x.d_out, x.d_in))
        for x in block.linears
        if x.kfac and not x.tied
    )


def muon_cost_table(
    model_spec: ModelSpec | str,
    stages: int | Sequence[range | tuple[int, int]],
    micro_batch_size: int,
    seq_len: int | None = None,
    hardware: HardwareSpec | str = "p100",
    *,
    ns_steps: int = NS_STEPS,
    precision: Precision = Precision.FP32,
    ns_precision: Precision = Precision.BF16,
) -> CostTable:
    """The analytic CostTable of Muon over a preset's pipeline: the K-FAC model's stages (same split, forward,
    backward and memory at `precision`) with one LayerCost per parameter of each stage: a Muon matrix's
    (`muon_matrices`) its Newton-Schulz priced at `ns_precision`, every other's AdamW's step (`adamw_cost`). The
    source reads e.g. "muon:analytic:bert-large:seq128:fp32:ns5"."""
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise CostModelError(f"ns_steps must be an int >= 1, got {ns_steps!r}")
    spec = preset(model_spec) if isinstance(model_spec, str) else model_spec
    hw = get_hardware(hardware)

    def units(block: BlockSpec) -> tuple[LayerCost, ...]:
        matrices = {t.name for t in muon_matrices(block)}
        return tuple(
            matrix_cost(t, hw, ns_steps, ns_precision) if t.name in matrices else adamw_cost(t, hw)
            for t in block.parameters
        )

    table = analytic_cost_table(spec, stages, micro_batch_size, seq_len, hw, precision=precision, units=units)
    source = tagged_source(PreconditionerKind.MUON, f"{table.source.rsplit(':', 1)[0]}:ns{ns_steps}")
    return replace(table, source=source, family=PreconditionerKind.MUON)
