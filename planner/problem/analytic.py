"""Analytic cost model: FLOP and byte counts over a hardware spec (`roofline` seconds a kernel, a multiply-add 2 FLOPs)
made into a CostTable for K-FAC (sympy expressions over one Linear), Shampoo and SOAP (a LayerCost per parameter, its
`matrix_view` in blocks as Distributed Shampoo §4.2) and Muon (a LayerCost per parameter); and the PipeFisher
performance model per pipeline schedule (`perf_model`, paper §3.3)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from functools import cache

import sympy

from fxkfac.planner.problem.costs import (
    WORDS,
    CostTable,
    InverseMethod,
    LayerCost,
    PartCost,
    PreconditionerKind,
    StageCost,
    TaskWords,
)
from fxkfac.planner.problem.errors import CostModelError, ScheduleError
from fxkfac.planner.problem.hardware import HardwareSpec, Precision, check_count
from fxkfac.planner.problem.hardware import hardware as get_hardware
from fxkfac.planner.problem.ir import NS_STEPS, OpKind
from fxkfac.planner.problem.schedules import ZERO_BUBBLE_KINDS, ScheduleKind


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One parameter tensor: its FQN as `named_parameters()` gives it, and its shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """One Linear (or a GEMM-shaped layer such as GPT-2's Conv1D or an im2col Conv2d)."""

    name: str  # module FQN, e.g. "bert.encoder.layer.3.attention.self.query"
    d_in: int
    d_out: int
    bias: bool = True
    tokens: int | None = None  # rows per sample (None: the sequence length; a pooler: 1; a conv: output positions)
    kfac: bool = True  # False for layers K-FAC skips (a vocabulary head): costed in fwd/bwd only
    tied: bool = False  # the weight is another module's (tied to the embedding): not counted again
    transposed: bool = False  # the weight is stored [d_in, d_out] (GPT-2's Conv1D), not [d_out, d_in]
    bias_name: str | None = None  # the bias's FQN when not `<name>.bias` (BERT's decoder: `cls.predictions.bias`)

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

    name: str  # FQN prefix, e.g. "bert.encoder.layer.3" (messages only; Linears carry full names)
    linears: tuple[LinearSpec, ...] = ()
    attention: int = 0  # attention cores (Q K^T, softmax, A V): 1 per self-attention, 1 more per cross-attention
    elementwise_per_token: int = 0
    """Elements per token that forward's elementwise kernels (norms, residuals, dropout, activation,
    embedding gathers) each read and write once; attention scores are counted from `attention`."""
    saved_per_token: int = 0  # activation elements per token kept for the backward (besides attention scores)
    saved_mask_bytes_per_token: int = 0  # 1-byte dropout masks kept per token (besides attention's)
    tensors: tuple[TensorSpec, ...] = ()  # parameters outside the Linears: norms, embedding tables, ...

    @property
    def parameters(self) -> tuple[TensorSpec, ...]:
        """Every parameter of the block: the Linears' (weights unless tied, biases), then `tensors`."""
        return tuple(t for x in self.linears for t in x.tensors) + self.tensors

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.parameters)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model as the analytic cost model needs it: embeddings (costed on the first stage), blocks, a head (the
    last stage's: final norm, LM / pre-training heads)."""

    name: str
    hidden: int
    ffn: int
    heads: int
    vocab: int
    seq_len: int  # the default, the one the model is profiled / trained at
    blocks: tuple[BlockSpec, ...]
    embed: BlockSpec
    head: BlockSpec

    @property
    def parts(self) -> tuple[BlockSpec, ...]:
        """Embeddings, blocks, head, in order."""
        return (self.embed, *self.blocks, self.head)

    @property
    def params(self) -> int:
        """Parameter count (tied weights once)."""
        return sum(b.params for b in self.parts)

    @property
    def linears(self) -> tuple[LinearSpec, ...]:
        """Every Linear in order: embeddings, blocks, head."""
        return tuple(x for part in self.parts for x in part.linears)

    @property
    def parameters(self) -> tuple[TensorSpec, ...]:
        """Every parameter (tied weights once) in order: embeddings, blocks, head."""
        return tuple(t for part in self.parts for t in part.parameters)


def _norms(names: Sequence[str], width: int, bias: bool = True) -> tuple[TensorSpec, ...]:
    """The weight (and bias) of each norm module in `names` (LayerNorm; T5's RMS norms have no bias)."""
    kinds = ("weight", "bias") if bias else ("weight",)
    return tuple(TensorSpec(f"{name}.{kind}", (width,)) for name in names for kind in kinds)


def _rows(attention: Sequence[str], mlp: Sequence[str], h: int, ffn: int) -> list[tuple[str, int, int]]:
    """(name, d_in, d_out) of a block's Linears: each attention projection h -> h, then the MLP h -> ffn -> h."""
    return [(x, h, h) for x in attention] + [(mlp[0], h, ffn), (mlp[1], ffn, h)]


def _block(
    p: str, rows: Sequence[tuple[str, int, int]], norms: Sequence[str], attention: int = 1, bias: bool = True
) -> BlockSpec:
    """A block `p` of `attention` attention sub-layers and an MLP (the last two `rows`, h -> f -> h), each with norm
    and residual; saved activations per Korthikanti et al. 2022, sec. 4.1 (masks 1 byte an element)."""
    _, h, ffn = rows[-2]
    sublayers = attention + 1
    return BlockSpec(
        name=p,
        linears=tuple(LinearSpec(f"{p}.{x}", i, o, bias) for x, i, o in rows),
        attention=attention,
        elementwise_per_token=3 * h * sublayers + ffn,
        saved_per_token=5 * h * attention + h + 2 * ffn + h * sublayers,
        saved_mask_bytes_per_token=h * sublayers,
        tensors=_norms([f"{p}.{x}" for x in norms], h, bias),
    )


def _lm_head(h: int, vocab: int, norms: Sequence[str], elementwise: int, bias: bool = True) -> BlockSpec:
    """A language model's head: final norms and a bias-free vocabulary Linear tied to the token embedding."""
    lm_head = LinearSpec("lm_head", h, vocab, bias=False, kfac=False, tied=True)
    return BlockSpec("lm_head", (lm_head,), elementwise_per_token=elementwise + vocab, tensors=_norms(norms, h, bias))


def _bert(name: str, h: int, layers: int, heads: int, ffn: int) -> ModelSpec:
    """BertForPreTraining (MLM + NSP heads, decoder tied to the word embedding), vocab 30522."""
    vocab, pre = 30522, "bert.embeddings"
    attention = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense")
    rows = _rows(attention, ("intermediate.dense", "output.dense"), h, ffn)
    norms = ("attention.output.LayerNorm", "output.LayerNorm")
    blocks = tuple(_block(f"bert.encoder.layer.{i}", rows, norms) for i in range(layers))
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
    """GPT2LMHeadModel (124M): Conv1D layers (weights stored [d_in, d_out]) costed as Linears, lm_head tied to wte."""
    vocab, h, ffn = 50257, 768, 3072
    rows = [("attn.c_attn", h, 3 * h), ("attn.c_proj", h, h), ("mlp.c_fc", h, ffn), ("mlp.c_proj", ffn, h)]
    blocks = tuple(_block(f"transformer.h.{i}", rows, ("ln_1", "ln_2")) for i in range(12))
    blocks = tuple(replace(x, linears=tuple(replace(y, transposed=True) for y in x.linears)) for x in blocks)
    tables = (TensorSpec("transformer.wte.weight", (vocab, h)), TensorSpec("transformer.wpe.weight", (1024, h)))
    embed = BlockSpec("transformer", elementwise_per_token=3 * h, tensors=tables)
    return ModelSpec("gpt2", h, ffn, 12, vocab, 1024, blocks, embed, _lm_head(h, vocab, ["transformer.ln_f"], h))


def _opt(name: str, h: int, layers: int, heads: int, ffn: int, proj: int) -> ModelSpec:
    """OPTForCausalLM; OPT-350m projects a 512-wide embedding in and out and has no final norm (post-norm)."""
    vocab, pre, projected = 50272, "model.decoder", proj != h
    rows = _rows([f"self_attn.{x}_proj" for x in ("q", "k", "v", "out")], ("fc1", "fc2"), h, ffn)
    norms = ("self_attn_layer_norm", "final_layer_norm")
    blocks = tuple(_block(f"{pre}.layers.{i}", rows, norms) for i in range(layers))
    tables = (
        TensorSpec(f"{pre}.embed_tokens.weight", (vocab, proj)),
        TensorSpec(f"{pre}.embed_positions.weight", (2048 + 2, h)),  # learned positions: an offset of 2
    )
    project_in = (LinearSpec(f"{pre}.project_in", proj, h, bias=False),) if projected else ()
    embed = BlockSpec(pre, project_in, elementwise_per_token=3 * h, tensors=tables)
    head = _lm_head(proj, vocab, [] if projected else [f"{pre}.final_layer_norm"], h)
    if projected:
        head = replace(head, linears=(LinearSpec(f"{pre}.project_out", h, proj, bias=False), *head.linears))
    return ModelSpec(name, h, ffn, heads, vocab, 2048, blocks, embed, head)


def _t5_base() -> ModelSpec:
    """T5ForConditionalGeneration t5-base: 12 encoder then 12 decoder blocks in one sequence (the encoder output
    is no transfer), no biases, RMS norms, the decoder as long as the encoder, position bias in each stack's block 0."""
    vocab, h, ffn, heads = 32128, 768, 3072, 12
    blocks = []
    for stack, n_sub in (("encoder", 2), ("decoder", 3)):
        attention = [f"layer.0.SelfAttention.{w}" for w in "qkvo"]
        if stack == "decoder":
            attention += [f"layer.1.EncDecAttention.{w}" for w in "qkvo"]
        mlp = f"layer.{n_sub - 1}.DenseReluDense"
        rows = _rows(attention, (f"{mlp}.wi", f"{mlp}.wo"), h, ffn)
        norms = [f"layer.{j}.layer_norm" for j in range(n_sub)]
        for i in range(12):
            block = _block(f"{stack}.block.{i}", rows, norms, n_sub - 1, bias=False)
            if i == 0:  # the stack's relative position bias
                bias = TensorSpec(f"{block.name}.layer.0.SelfAttention.relative_attention_bias.weight", (32, heads))
                block = replace(block, tensors=(bias, *block.tensors))
            blocks.append(block)
    embed = BlockSpec("shared", elementwise_per_token=2 * h, tensors=(TensorSpec("shared.weight", (vocab, h)),))
    head = _lm_head(h, vocab, ["encoder.final_layer_norm", "decoder.final_layer_norm"], 2 * h, bias=False)
    return ModelSpec("t5-base", h, ffn, heads, vocab, 512, tuple(blocks), embed, head)


PRESETS: dict[str, Callable[[], ModelSpec]] = {  # preset name -> builder of its ModelSpec
    "bert-base": lambda: _bert("bert-base", 768, 12, 12, 3072),
    "bert-large": lambda: _bert("bert-large", 1024, 24, 16, 4096),
    "gpt2": _gpt2,
    "opt-125m": lambda: _opt("opt-125m", 768, 12, 12, 3072, 768),
    "opt-350m": lambda: _opt("opt-350m", 1024, 24, 16, 4096, 512),
    "t5-base": _t5_base,
}


def preset(name: str) -> ModelSpec:
    """The ModelSpec of a preset model (case-insensitive)."""
    builder = PRESETS.get(name.lower()) if isinstance(name, str) else None
    if builder is None:
        raise CostModelError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return builder()


def _as_linear(item: Sequence[object], where: str) -> LinearSpec:
    """`item`, a (name, d_in, d_out, tokens[, bias]), as a LinearSpec, checked."""
    if not isinstance(item, (tuple, list)) or len(item) not in (4, 5):
        raise CostModelError(f"{where}: expected (name, d_in, d_out, tokens[, bias]), got {item!r}")
    name, d_in, d_out, tokens, *bias = item
    dims = (d_in, d_out, tokens)
    if not isinstance(name, str) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise CostModelError(f"{where}: name must be a string and d_in, d_out, tokens positive ints, got {item!r}")
    return LinearSpec(name, d_in, d_out, bool(bias[0]) if bias else True, tokens=tokens)


def model_spec_from_layers(stages: Sequence[Sequence[Sequence[object]]], *, name: str = "model") -> ModelSpec:
    """A ModelSpec for a captured user model: a block per stage of its K-FAC layers (name, d_in, d_out, tokens[, bias]);
    only the GEMMs are costed (kept: each input; elementwise: each output), so measured profiles are preferable."""
    if not stages:
        raise CostModelError("model_spec_from_layers needs at least one stage")
    blocks = []
    for i, layers in enumerate(stages):
        lins = tuple(_as_linear(x, f"stage {i}") for x in layers)
        if not lins:
            raise CostModelError(f"stage {i} has no layers; every stage needs at least one to be costed")
        rows = [(x.tokens if x.tokens is not None else 1) for x in lins]
        elementwise = sum(t * x.d_out for t, x in zip(rows, lins))
        blocks.append(BlockSpec(f"stage{i}", lins, 0, elementwise, sum(t * x.d_in for t, x in zip(rows, lins))))
    widest = max(max(x.d_in, x.d_out) for b in blocks for x in b.linears)
    return ModelSpec(name, widest, 0, 0, 0, 1, tuple(blocks), BlockSpec("none"), BlockSpec("none"))


DEFAULT_MAX_DIM = 1024  # the block side of max_preconditioner_dim="auto" when no plan chooses one (paper: 1024-8192)


class LargeDimMethod(StrEnum):
    """What a side of the view longer than ``max_dim`` becomes: BLOCKING cuts the view into blocks of side <= max_dim,
    each side a dense factor; DIAGONAL keeps that side's diagonal; ADAGRAD keeps no factors."""

    BLOCKING = "blocking"
    ADAGRAD = "adagrad"
    DIAGONAL = "diagonal"


class FactorKind(StrEnum):
    """The statistic kept for one side of a block: a dense d x d matrix or only its diagonal (d values)."""

    DENSE = "dense"
    DIAGONAL = "diagonal"


@dataclass(frozen=True, slots=True)
class Block:
    """One block of a view: ``(start, end)`` per dimension and each side's factor kind (none: ADAGRAD, large)."""

    ranges: tuple[tuple[int, int], ...]
    kinds: tuple[FactorKind, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(end - start for start, end in self.ranges)

    @property
    def sides(self) -> tuple[int, int]:
        """(m, n): the sides of its dense L and R factors, 0 where that side has none."""
        dense = [d if kind is FactorKind.DENSE else 0 for d, kind in zip(self.shape, self.kinds)] + [0, 0]
        return dense[0], dense[1]


def _check(shape: Sequence[int], max_dim: int) -> None:
    """ValueError naming the bad argument (negative or zero sizes are not parameter shapes)."""
    if max_dim < 1:
        raise ValueError(f"max_dim must be >= 1, got {max_dim}")
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {tuple(shape)} has a negative dimension")


def merge_dims(shape: Sequence[int], max_dim: int, merge: bool = True) -> tuple[int, ...]:
    """Drop size-1 dims, then (`merge`) merge consecutive dims while their product is <= `max_dim` (a scalar: (1,))."""
    _check(shape, max_dim)
    merged: list[int] = []
    for d in (d for d in shape if d != 1):
        if merge and merged and merged[-1] * d <= max_dim:
            merged[-1] *= d
        else:
            merged.append(d)
    return tuple(merged) or (1,)


def matrix_view(shape: Sequence[int], max_dim: int, merge: bool = True) -> tuple[int, ...]:
    """The 1-D or 2-D shape a parameter is preconditioned as: its `merge_dims`, a higher order as (d0, d1*...*dk)."""
    dims = merge_dims(shape, max_dim, merge)
    return dims if len(dims) <= 2 else (dims[0], math.prod(dims[1:]))


def block_ranges(shape: Sequence[int], max_dim: int) -> list[tuple[tuple[int, int], ...]]:
    """Blocks of side <= `max_dim` covering `shape`, ragged at the far edges, row-major: ``(start, end)`` per dim."""
    _check(shape, max_dim)
    chunks = ([(start, min(start + max_dim, d)) for start in range(0, d, max_dim)] for d in shape)
    return list(itertools.product(*chunks))


def partition(
    shape: Sequence[int], max_dim: int, method: LargeDimMethod, merge: bool = True
) -> tuple[tuple[int, ...], list[Block]]:
    """The view of a parameter of `shape` and its blocks under `method` (see the module doc)."""
    view = matrix_view(shape, max_dim, merge)
    whole = tuple((0, d) for d in view)
    if method is LargeDimMethod.BLOCKING:
        return view, [Block(r, (FactorKind.DENSE,) * len(view)) for r in block_ranges(view, max_dim)]
    if method is LargeDimMethod.DIAGONAL:
        return view, [Block(whole, tuple(FactorKind.DIAGONAL if d > max_dim else FactorKind.DENSE for d in view))]
    if method is LargeDimMethod.ADAGRAD:
        return view, [Block(whole, () if any(d > max_dim for d in view) else (FactorKind.DENSE,) * len(view))]
    raise ValueError(f"unknown large_dim_method {method!r}; use one of {[m.value for m in LargeDimMethod]}")


# b micro-batch size, s rows per sample, d_in/d_out Linear widths, beta 1 with a bias (A's ones column), h heads, d_h
# head width, n a factor's side, p bytes per activation element (factors fp32); d, f a block's hidden and MLP widths
b, s, d_in, d_out, beta, h, d_h, n, p = sympy.symbols("b s d_in d_out beta h d_h n p", positive=True)
d, f = sympy.symbols("d f", positive=True)
_ARGS = (b, s, d_in, d_out, beta, h, d_h, n, p)  # what the compiled expressions take, in order
SYMBOLS = {x.name: x for x in (*_ARGS, d, f)}  # the symbols the expressions use, by name

_F32 = 4  # factors, inverses, curvature kernels and optimizer state are fp32

EIGH_FLOPS = 9  # FLOPs per n^3 of an eigendecomposition with eigenvectors (symmetric QR; Golub & Van Loan §8.3.6)


@cache
def linear_expressions(inverse: InverseMethod = InverseMethod.CHOLESKY) -> dict[str, sympy.Expr]:
    """FLOPs and bytes of one Linear's kernels and K-FAC's memory: an n x n inverse by Cholesky + potri (n^3) or
    eigh (EIGH_FLOPS n^3); B^-1 G A^-1 two GEMMs."""
    if inverse not in set(InverseMethod):
        raise CostModelError(f"inverse must be one of {[m.value for m in InverseMethod]}, got {inverse!r}")
    d_a = d_in + beta
    rows = b * s
    return {
        "fwd_flops": 2 * rows * d_in * d_out,
        "fwd_bytes": p * (rows * d_in + d_in * d_out + rows * d_out),
        "bwd_flops": 4 * rows * d_in * d_out,  # grad input and grad weight
        "bwd_bytes": p * (2 * rows * d_out + 2 * rows * d_in + 2 * d_in * d_out),
        "curv_a_flops": 2 * rows * d_a**2,
        "curv_a_bytes": p * rows * d_in + _F32 * d_a**2,
        "curv_b_flops": 2 * rows * d_out**2,
        "curv_b_bytes": p * rows * d_out + _F32 * d_out**2,
        "inv_flops": n**3 if inverse == InverseMethod.CHOLESKY else EIGH_FLOPS * n**3,
        "inv_bytes": 2 * _F32 * n**2,
        "prec_flops": 2 * d_out * d_a * (d_a + d_out),
        "prec_bytes": _F32 * (2 * d_out * d_a + d_a**2 + d_out**2),
        "a_bytes": p * rows * d_in,
        "e_bytes": p * rows * d_out,
        "factor_a_bytes": _F32 * d_a**2,
        "factor_b_bytes": _F32 * d_out**2,
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
    lin, att = linear_expressions(), attention_expressions()
    widths = [(d, d)] * 4 + [(d, f), (f, d)]

    def total(key: str) -> sympy.Expr:
        return sum((lin[key].subs({d_in: i, d_out: o}) for i, o in widths), sympy.Integer(0))

    out = {key: sympy.expand(total(key)) for key in ("fwd_flops", "bwd_flops", "curv_a_flops", "curv_b_flops")}
    out["fwd_flops"] = sympy.expand(out["fwd_flops"] + att["fwd_flops"].subs(d_h, d / h))
    out["bwd_flops"] = sympy.expand(out["bwd_flops"] + att["bwd_flops"].subs(d_h, d / h))
    out["inv_flops"] = sympy.expand(sum((lin["inv_flops"].subs(n, w) for pair in widths for w in pair), 0))
    return out


def explain() -> str:
    """The expressions as text (for `fxkfac plan --explain`), after a kernel's roofline time."""
    flops, peak, eff, nbytes, bw = sympy.symbols("F P eta Q W", positive=True)
    lines = [f"kernel time = {sympy.Max(flops / (peak * eff), nbytes / bw)}"]
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
    return {key: sympy.lambdify(_ARGS, expr, modules="math") for key, expr in exprs.items()}


def _eval(group: str, inverse: InverseMethod = InverseMethod.CHOLESKY, **values: float) -> dict[str, float]:
    args = [values.get(x.name, 4 if x is p else 0) for x in _ARGS]  # p: fp32 unless given
    return {key: float(fn(*args)) for key, fn in _compiled(group, inverse).items()}


def roofline(
    hw: HardwareSpec, flops: float, nbytes: float, peak: float | None = None, eff: float | None = None
) -> float:
    """Seconds of one kernel: max(flops / (peak * eff), nbytes / memory bandwidth); by default an fp32 GEMM's."""
    rate = (hw.peak_flops if peak is None else peak) * (hw.matmul_efficiency if eff is None else eff)
    return max(flops / rate, nbytes / hw.mem_bandwidth)


def _factorization(hw: HardwareSpec, flops: float, b: int) -> float:
    """Seconds of a factorization of `flops` on a b x b fp32 matrix (read and written once)."""
    return roofline(hw, flops, 2 * _F32 * b * b, eff=hw.factorization_efficiency)


def _precision(hw: HardwareSpec, precision: Precision) -> tuple[float, int]:
    """The peak FLOP/s and bytes per element of `precision` on `hw`."""
    if precision not in set(Precision):
        raise CostModelError(f"precision must be one of {[p.value for p in Precision]}, got {precision!r}")
    return (hw.peak_flops, 4) if precision == Precision.FP32 else (hw.peak_flops_tensor, 2)


@dataclass(frozen=True, slots=True)
class Run:
    """What a table's kernels run at: the device, micro-batch size, rows per sample, format and K-FAC's inverse."""

    hw: HardwareSpec
    batch: int
    seq_len: int
    precision: Precision = Precision.FP32
    inverse: InverseMethod = InverseMethod.CHOLESKY


def linear_kernels(lin: LinearSpec, run: Run) -> StageCost:
    """The costs of one Linear as if it were a stage: fwd, bwd per micro-batch, and its K-FAC layer unless skipped."""
    hw, inverse = run.hw, run.inverse
    peak, bpe = _precision(hw, run.precision)
    tokens = lin.tokens if lin.tokens is not None else run.seq_len
    e = _eval("linear", inverse, b=run.batch, s=tokens, d_in=lin.d_in, d_out=lin.d_out, beta=int(lin.bias), p=bpe)
    fwd = roofline(hw, e["fwd_flops"], e["fwd_bytes"], peak)
    bwd = roofline(hw, e["bwd_flops"], e["bwd_bytes"], peak)
    if not lin.kfac:
        return StageCost(fwd, bwd, 0, 0, ())
    side_a = lin.d_in + int(lin.bias)  # K-FAC's kernels run in fp32 (roofline's default)
    curv_a, curv_b, prec = (roofline(hw, e[f"{k}_flops"], e[f"{k}_bytes"]) for k in ("curv_a", "curv_b", "prec"))
    inv_a, inv_b = (_factorization(hw, _eval("linear", inverse, n=x)["inv_flops"], x) for x in (side_a, lin.d_out))
    sizes = (round(e["a_bytes"]), round(e["e_bytes"]), round(e["factor_a_bytes"]), round(e["factor_b_bytes"]))
    layer = LayerCost.kfac(lin.name, curv_a, curv_b, inv_a, inv_b, prec, *sizes, grad_bytes=_F32 * side_a * lin.d_out)
    return StageCost(fwd, bwd, 0, 0, (layer,))


def block_kernels(block: BlockSpec, spec: ModelSpec, run: Run) -> StageCost:
    """A block's costs as if it were a stage (no boundary): Linears, attention cores, elementwise traffic, memory."""
    hw, batch, seq_len = run.hw, run.batch, run.seq_len
    peak, bpe = _precision(hw, run.precision)
    kernels = [linear_kernels(x, run) for x in block.linears]
    fwd = sum(k.fwd for k in kernels)
    bwd = sum(k.bwd for k in kernels)
    act: float = block.saved_per_token * bpe * batch * seq_len + block.saved_mask_bytes_per_token * batch * seq_len
    scores = 0.0
    if block.attention:
        a = _eval("attention", b=batch, s=seq_len, h=spec.heads, d_h=spec.hidden / spec.heads, p=bpe)
        ew = block.attention * a["elementwise_bytes"] / hw.mem_bandwidth
        fwd += block.attention * roofline(hw, a["fwd_flops"] / 2, a["fwd_bytes"] / 2, peak) * 2 + ew
        bwd += block.attention * roofline(hw, a["bwd_flops"] / 2, a["bwd_bytes"] / 2, peak) * 2 + 2 * ew
        act += block.attention * a["saved_bytes"]
        scores = bpe * batch * spec.heads * seq_len * seq_len
    elementwise = 2 * bpe * block.elementwise_per_token * batch * seq_len / hw.mem_bandwidth
    widest = max((x.d_out for x in block.linears), default=0)
    return StageCost(
        fwd=fwd + elementwise,
        bwd=bwd + 2 * elementwise,
        param_bytes=_F32 * block.params,
        act_bytes=round(act),
        layers=tuple(x for k in kernels for x in k.layers),
        peak_err_bytes=round(bpe * batch * seq_len * 2 * widest + scores),
    )


def balanced_stages(costs: Sequence[float], n_stages: int) -> list[range]:
    """Contiguous split of per-block costs into n_stages minimizing the largest stage (exact DP)."""
    nb = len(costs)
    if not 1 <= n_stages <= nb:
        raise CostModelError(f"cannot split {nb} blocks into {n_stages} stages; use 1..{nb} stages")
    prefix = list(itertools.accumulate(costs, initial=0.0))
    best = [[math.inf] * (nb + 1) for _ in range(n_stages + 1)]
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


Stages = int | Sequence[range | tuple[int, int]]
"""A stage count (balanced by fwd + bwd) or each stage's block ranges; the embeddings go first, the head last."""


def _stage_ranges(stages: Stages, block_costs: list[float]) -> list[range]:
    """The blocks of each stage: a balanced split into `stages` stages, or the given ranges once checked."""
    if isinstance(stages, int) and not isinstance(stages, bool):
        return balanced_stages(block_costs, stages)
    assert not isinstance(stages, bool), "stages is an int or block ranges, not a bool"
    ranges = [r if isinstance(r, range) else range(*r) for r in stages]
    starts = [0, *(r.stop for r in ranges)]  # where each stage must start, then where the last one ends
    if any(r.step != 1 or r.start != start or r.stop <= start for r, start in zip(ranges, starts)):
        got = list(map(tuple, ranges))
        raise CostModelError(f"stage block ranges must be contiguous, non-empty and start at 0; got {got}")
    if starts[-1] != len(block_costs):
        raise CostModelError(f"stage block ranges cover {starts[-1]} blocks, the model has {len(block_costs)}")
    return ranges


QR_FLOPS = 8 / 3  # FLOPs per b^3 of a Householder QR of a b x b matrix with Q formed (geqrf 4b^3/3 + orgqr 4b^3/3)

NEWTON_ITERATIONS = 20  # coupled inverse Newton iterations per root (to ||M_k - I|| < 1e-6 in fp32, condition <= 1e6)


class RootMethod(StrEnum):
    """How a factor is decomposed at a refresh (`_decomp` prices each)."""

    EIGH = "eigh"
    NEWTON = "newton"
    QR = "qr"


@dataclass(frozen=True, slots=True)
class _Family:
    """A gradient-fed family's per-parameter terms: root methods (default first), fp32 passes of its elementwise step,
    parameter-sized state buffers, APPLY passes, whether it merges small dims and preconditions 1-D parameters."""

    methods: tuple[RootMethod, ...]
    passes: int
    buffers: int = 0
    applies: int = 1
    merge: bool = False
    vectors: bool = True


_FAMILIES = {
    # G and P for the two norms, P and W read + P written (decay), M read + written; state: the momentum
    PreconditionerKind.SHAMPOO: _Family((RootMethod.EIGH, RootMethod.NEWTON), 8, 1, merge=True),
    # rotated G read, m and v read + written, W read, the direction written twice; Adam's m and v; rotates in and out
    PreconditionerKind.SOAP: _Family((RootMethod.QR, RootMethod.EIGH), 8, 2, applies=2, vectors=False),
    # momentum 3, Nesterov 2, normalization 2, update with lr and decay 3
    PreconditionerKind.MUON: _Family((), 10),
}


def newton_matmuls(p: int) -> int:
    """Matrix products of one coupled Newton step for the inverse p-th root: Z^p by squaring, Z^p M_k, X_k Z."""
    return p.bit_length() - 1 + p.bit_count() - 1 + 2


def _decomp(hw: HardwareSpec, method: RootMethod, b: int, other: int, order: int) -> float:
    """Seconds to decompose one b x b factor of a block whose other side is `other`, of `order` 1 or 2."""
    square = 3 * _F32 * b * b  # two operands read, one result written
    if method is RootMethod.EIGH:
        return _factorization(hw, EIGH_FLOPS * b**3, b) + roofline(hw, 2 * b**3, square)
    if method is RootMethod.NEWTON:
        return NEWTON_ITERATIONS * newton_matmuls(2 * order) * roofline(hw, 2 * b**3, square)
    reproject = 2 * roofline(hw, 2 * b * b * other, _F32 * (b * b + 2 * b * other))
    return roofline(hw, 2 * b**3, square) + _factorization(hw, QR_FLOPS * b**3, b) + reproject


def parameter_cost(
    tensor: TensorSpec, hw: HardwareSpec, kind: PreconditionerKind, max_dim: int, method: RootMethod | None = None
) -> LayerCost | None:
    """The LayerCost of one parameter in blocks of side <= max_dim; None where the family leaves it to AdamW."""
    family = _FAMILIES[kind]
    method = family.methods[0] if method is None else method
    if method not in family.methods:
        raise CostModelError(f"{kind} decomposes by {[m.value for m in family.methods]}, not {method.value!r}")
    view, blocks = partition(tensor.shape, max_dim, LargeDimMethod.BLOCKING, merge=family.merge)
    if len(view) == 1 and not family.vectors:
        return None
    shapes = [(x.shape[0], x.shape[1] if len(view) == 2 else 1) for x in blocks]
    parts = []
    for i, part in enumerate("LR"):  # each side's G G^T (or G^T G) every step, its decomposition at a refresh
        stats, decomp, state = 0.0, 0.0, 0
        for block, shape in zip(blocks, shapes):
            side, other = block.sides[i], shape[1 - i]
            if side:
                stats += roofline(hw, 2 * side * side * other, _F32 * (side * other + 2 * side * side))
                decomp += _decomp(hw, method, side, other, len(view))
                state += _F32 * side * side
        if state:
            parts.append(PartCost(part, OpKind.ALLREDUCE_GRAD, stats, decomp, 0, state))
    prec = 0.0
    for (m, n), (r, c) in zip((x.sides for x in blocks), shapes):
        flops = (2 * r * r * c if m else 0) + (2 * r * c * c if n else 0)
        prec += roofline(hw, family.applies * flops, family.applies * _F32 * (m * m + n * n + 3 * r * c))
    prec += family.passes * _F32 * tensor.numel / hw.mem_bandwidth
    return LayerCost(tensor.name, tuple(parts), prec, family.buffers * _F32 * tensor.numel, _F32 * tensor.numel)


def largest_dim(spec: ModelSpec) -> int:
    """The longest side of any parameter of the model: a block size this large blocks nothing."""
    return max(max(t.shape) for t in spec.parameters)


ADAMW_PASSES = 12  # fp32 reads and writes per element of an AdamW step: moments 5, direction 4, update 3


def matrix_cost(
    tensor: TensorSpec, hw: HardwareSpec, ns_steps: int = NS_STEPS, precision: Precision = Precision.BF16
) -> LayerCost:
    """The LayerCost of one Muon matrix: no parts, `prec` its `ns_steps` iterations at `precision` and elementwise.
    An iteration on the wide orientation X (m x n, m <= n) is three GEMMs: A = X X^T, A A, then (b A + c A A) X."""
    if len(tensor.shape) != 2:
        raise CostModelError(f"Muon orthogonalizes 2-D matrices; {tensor.name} has shape {tensor.shape}")
    peak, item = _precision(hw, precision)
    m, n = sorted(tensor.shape)
    gemms = ((m * m * n, 2 * m * n + m * m), (m**3, 3 * m * m), (m * m * n, m * m + 2 * m * n))  # (MACs, elements)
    iteration = sum(roofline(hw, 2 * macs, item * elements, peak) for macs, elements in gemms)
    numel = _F32 * tensor.numel
    elementwise = _FAMILIES[PreconditionerKind.MUON].passes * numel / hw.mem_bandwidth
    return LayerCost(tensor.name, (), ns_steps * iteration + elementwise, numel, numel)


def adamw_cost(tensor: TensorSpec, hw: HardwareSpec) -> LayerCost:
    """The LayerCost of a parameter AdamW steps (two moments; streamed, its owner steps it in the gradient hook)."""
    numel = _F32 * tensor.numel
    step = ADAMW_PASSES * numel / hw.mem_bandwidth
    return LayerCost(tensor.name, (), step, 2 * numel, numel, hand_off=step)


def muon_matrices(block: BlockSpec) -> tuple[TensorSpec, ...]:
    """The weights Muon orthogonalizes: its Linears' but a vocabulary head's or a tied one's (the rest: AdamW)."""
    return tuple(x.tensors[0] for x in block.linears if x.kfac and not x.tied)


def analytic_cost_table(
    model_spec: ModelSpec | str,
    stages: Stages,
    micro_batch_size: int,
    seq_len: int | None = None,
    hardware: HardwareSpec | str = "p100",
    *,
    kind: PreconditionerKind = PreconditionerKind.KFAC,
    precision: Precision = Precision.FP32,
    inverse: InverseMethod = InverseMethod.CHOLESKY,
    max_dim: int | None = None,
    method: RootMethod | None = None,
    ns_steps: int = NS_STEPS,
    ns_precision: Precision = Precision.BF16,
) -> CostTable:
    """The analytic CostTable of family `kind`: K-FAC's a LayerCost per K-FAC Linear; Shampoo's and SOAP's one per
    parameter in blocks of side `max_dim` (None: unblocked) decomposed by `method`; Muon's one per parameter, a
    matrix's `ns_steps` Newton-Schulz at `ns_precision`. Source e.g. "shampoo:analytic:bert-base:seq128:fp32:eigh"."""
    spec = preset(model_spec) if isinstance(model_spec, str) else model_spec
    hw = get_hardware(hardware)
    check_count("micro_batch_size", micro_batch_size)
    seq = spec.seq_len if seq_len is None else seq_len
    check_count("seq_len", seq)
    tag: str = inverse
    if kind is PreconditionerKind.MUON:
        check_count("ns_steps", ns_steps)
        tag = f"ns{ns_steps}"
    elif kind is not PreconditionerKind.KFAC:
        side = largest_dim(spec) if max_dim is None else max_dim
        check_count("max_dim", side, " or None (no blocking)")
        method = _FAMILIES[kind].methods[0] if method is None else method
        tag = f"{method}:{'unblocked' if max_dim is None else f'block{max_dim}'}"

    def unit(t: TensorSpec, owner: BlockSpec) -> LayerCost | None:
        """The family's LayerCost of parameter `t` of block `owner` (None: the family has none for it)."""
        if kind is PreconditionerKind.MUON:
            return matrix_cost(t, hw, ns_steps, ns_precision) if t in muon_matrices(owner) else adamw_cost(t, hw)
        return parameter_cost(t, hw, kind, side, method)

    run = Run(hw, micro_batch_size, seq, precision, inverse)
    parts = [block_kernels(x, spec, run) for x in spec.parts]  # embeddings, blocks, head
    costs = [x.fwd + x.bwd for x in parts[1:-1]]
    costs[0] += parts[0].fwd + parts[0].bwd
    costs[-1] += parts[-1].fwd + parts[-1].bwd
    ranges = _stage_ranges(stages, costs)
    hidden = _precision(hw, precision)[1] * micro_batch_size * seq * spec.hidden  # bytes of one block's input
    out = []
    for i, r in enumerate(ranges):
        lo, hi = 0 if i == 0 else r.start + 1, len(parts) if i == len(ranges) - 1 else r.stop + 1
        members = parts[lo:hi]
        if kind is PreconditionerKind.KFAC:
            layers = tuple(x for m in members for x in m.layers)
        else:
            units = (unit(t, owner) for owner in spec.parts[lo:hi] for t in owner.parameters)
            layers = tuple(x for x in units if x is not None)
        stage = StageCost(
            fwd=sum(x.fwd for x in members),
            bwd=sum(x.bwd for x in members),
            param_bytes=sum(x.param_bytes for x in members),
            act_bytes=sum(x.act_bytes for x in members),
            layers=layers,
            peak_err_bytes=max(x.peak_err_bytes for x in members),
            boundary_bytes=2 * hidden,  # the stage's input and output
        )
        out.append(stage)
    source = f"analytic:{spec.name}:seq{seq}:{precision}:{tag}"  # the family in front, but K-FAC's (as always)
    source = source if kind is PreconditionerKind.KFAC else f"{kind.value}:{source}"
    return CostTable(tuple(out), micro_batch_size, source, hw.name, hw.comm, kind)


T_f, T_b = sympy.symbols("T_f T_b", positive=True)
D, N, v, W = sympy.symbols("D N v W", positive=True, integer=True)
M_theta, M_act, M_err_peak, M_err_save, M_curv, M_inv = sympy.symbols(
    "M_theta M_act M_err_peak M_err_save M_curv M_inv", nonnegative=True
)
T_curv, T_inv, T_prec, T_gstat = sympy.symbols("T_curv T_inv T_prec T_gstat", nonnegative=True)

_ALL = (T_f, T_b, D, N, v, W, M_theta, M_act, M_err_peak, M_err_save, M_curv, M_inv, T_curv, T_inv, T_prec, T_gstat)
PERF_SYMBOLS: dict[str, sympy.Symbol] = {s.name: s for s in _ALL}
"""Every symbol by name; per (virtual) stage, T_f, T_b, T_curv, M_act, M_err_* per micro-batch, T_gstat per step
(a gradient-fed family's statistics; 0 for K-FAC)."""

_DESCRIPTIONS = {
    "T_pipe": "time of one pipeline step (all F and B of the step, critical path)",
    "T_bubble": "idle time per device in one step (the same on every device for these schedules)",
    "M_pipe": "worst-device memory: parameters+gradients of its stages, in-flight activations, peak errors",
    "T_kfac": "{name} work per device: {stats} and {decomp} (to fit in bubbles) plus {apply}",
    "M_kfac": "{name} memory per device: {stats} and {decomp} results, errors kept for deferred {stats}",
    "ratio": "({stats} + {decomp}) / bubble left by per-step {stats}: pipeline steps needed per refresh",
}


@dataclass(frozen=True)
class PerfModel:
    """The symbolic model of one schedule; `C_f`/`C_b` count F/B on the critical path."""

    kind: ScheduleKind
    C_f: sympy.Expr
    C_b: sympy.Expr
    T_pipe: sympy.Expr
    T_bubble: sympy.Expr
    M_pipe: sympy.Expr
    T_kfac: sympy.Expr
    M_kfac: sympy.Expr
    ratio: sympy.Expr
    peak_inflight: sympy.Expr


def _shape(kind: ScheduleKind) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr]:
    """(C_f, C_b, stages per device, F/B pairs per device, worst-device in-flight micro-batches)."""
    if kind in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B):
        inflight = N if kind is ScheduleKind.GPIPE else sympy.Min(N, D)
        return N + D - 1, N + D - 1, sympy.Integer(1), N, inflight
    if kind is ScheduleKind.INTERLEAVED:
        return N * v + D - 1, N * v + D - 1, v, N * v, sympy.Min(N * v, (v + 1) * D - 1)
    k = N / D
    return D + 2 * (k - 1), k * (2 * D - 2), sympy.Integer(2), N, D


def perf_model(kind: ScheduleKind | str) -> PerfModel:
    """The paper's §3.3 expressions for `kind`, exact for uniform stages (checked against simulate): C_f = C_b =
    N+D-1 for GPipe/1F1B (N*v+D-1 interleaved); Chimera (N = kD) C_f = D+2(k-1), C_b = k(2D-2) for T_b >= T_f. M_pipe
    uses each schedule's exact in-flight peak where the paper writes N*M_act."""
    kind = ScheduleKind(kind)
    if kind in ZERO_BUBBLE_KINDS:
        raise ScheduleError(f"{kind} has no closed form here (its W's fill the bubbles); simulate its programs")
    C_f, C_b, per_device, mbs, inflight = _shape(kind)
    if kind is ScheduleKind.CHIMERA:
        # Li & Hoefler, SC 2021: D*T_f + (2D-2)*T_b per unit of D micro-batches when T_b >= T_f (the roles of T_f
        # and T_b swap otherwise), plus D(T_f+T_b) + (D-2)|T_b-T_f| per extra unit
        lo, hi = sympy.Min(T_f, T_b), sympy.Max(T_f, T_b)
        T_pipe = D * lo + (2 * D - 2) * hi + (N / D - 1) * (D * (T_f + T_b) + (D - 2) * sympy.Abs(T_b - T_f))
        T_bubble = T_pipe - mbs * (T_f + T_b)
    else:
        T_pipe = C_f * T_f + C_b * T_b
        T_bubble = sympy.factor(T_pipe - mbs * (T_f + T_b))
    fill = mbs * T_curv + per_device * T_inv
    return PerfModel(
        kind=kind,
        C_f=sympy.simplify(C_f),
        C_b=sympy.simplify(C_b),
        T_pipe=T_pipe,
        T_bubble=T_bubble,
        M_pipe=2 * per_device * M_theta + inflight * M_act + M_err_peak,
        T_kfac=fill + per_device * (T_gstat + T_prec),
        M_kfac=per_device * (M_curv + M_inv) + mbs * M_err_save,
        ratio=fill / (T_bubble - per_device * T_gstat),
        peak_inflight=inflight,
    )


def evaluate(expr: sympy.Expr, values: Mapping[str, float]) -> float:
    """`expr` as a float with symbols substituted by name (e.g. {"T_f": 1.0, "D": 4, ...}); T_gstat is 0 unless
    given (K-FAC takes no statistics from the gradient)."""
    values = {"T_gstat": 0.0, **values}
    unknown = set(values) - set(PERF_SYMBOLS)
    if unknown:
        raise KeyError(f"unknown symbols {sorted(unknown)}; known: {sorted(PERF_SYMBOLS)}")
    result = expr.subs({PERF_SYMBOLS[name]: value for name, value in values.items()})
    if result.free_symbols:
        missing = sorted(s.name for s in result.free_symbols)
        raise KeyError(f"give values for {missing} to evaluate {expr}")
    return float(result)


def explain_perf_model(kind: ScheduleKind | str, words: TaskWords = WORDS[PreconditionerKind.KFAC]) -> str:
    """Printable expressions of the model for `kind` (`fxkfac plan --explain`), the work named in the family's words."""
    model = perf_model(kind)
    lines = [f"Performance model for {model.kind} (PipeFisher §3.3; times per micro-batch, per stage):"]
    chimera = "  (for T_b >= T_f)" if model.kind is ScheduleKind.CHIMERA else ""
    lines.append(f"  C_f = {model.C_f},  C_b = {model.C_b}{chimera}")
    for name, text in _DESCRIPTIONS.items():
        lines += [f"  {name} = {sympy.sstr(getattr(model, name))}", f"      {text.format(**asdict(words))}"]
    if model.kind is ScheduleKind.CHIMERA:
        lines.append("  for T_b >= T_f (the usual case):")
        slower_backward = {sympy.Max(T_f, T_b): T_b, sympy.Min(T_f, T_b): T_f, sympy.Abs(T_b - T_f): T_b - T_f}
        for name in ("T_pipe", "T_bubble", "ratio"):
            lines.append(f"    {name} = {sympy.sstr(sympy.factor(getattr(model, name).subs(slower_backward)))}")
    return "\n".join(lines)


def pipe_gap(
    at_means: float, at_slowest: float, simulated: float, words: TaskWords = WORDS[PreconditionerKind.KFAC]
) -> str:
    """How T_pipe, written for equal stages, relates to the simulated step (seconds: T_pipe at the stage means, with
    every stage as slow as the slowest, the simulation), in words for `--explain`."""
    if abs(simulated - at_means) <= 1e-3 * simulated:
        return (
            f"  T_pipe agrees with the simulated step before {words.name} ({simulated * 1e3:.2f} ms, the "
            "plan's step time)"
        )
    return (
        f"  T_pipe is written for equal stages; the plan's step time before {words.name} "
        f"({simulated * 1e3:.2f} ms) is "
        f"simulated with each stage's own costs, {(simulated - at_means) * 1e3:+.2f} ms from T_pipe at the stage "
        f"means because the stages differ (every stage as slow as the slowest: T_pipe = {at_slowest * 1e3:.2f} ms)"
    )
