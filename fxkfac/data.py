"""A real, deterministic text corpus that ships with Python: the CPython standard library's source.

Byte-level tokens (0..255) plus a [MASK] token; masked-language-model or next-byte batches with a fixed
generator, and a train/validation split by file, so every run sees the same data without downloads.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

__all__ = [
    "MASK_TOKEN",
    "VOCAB_SIZE",
    "BYTE_VOCAB_SIZE",
    "IGNORE_INDEX",
    "Objective",
    "stdlib_corpus",
    "MaskedLMData",
    "NextByteData",
    "lm_data",
]

MASK_TOKEN = 256
VOCAB_SIZE = 257
"""The masked LM's vocabulary: the 256 byte values and [MASK]."""
BYTE_VOCAB_SIZE = 256
"""The next-byte LM's vocabulary: the byte values alone."""
IGNORE_INDEX = -100


class Objective(StrEnum):
    """What a language model learns from the byte corpus: masked bytes (BERT-style) or the next byte (causal)."""

    MASKED = "masked"
    NEXT_BYTE = "next-byte"


def stdlib_corpus(max_bytes: int = 2_000_000, *, root: str | None = None) -> tuple[bytes, bytes]:
    """(train, validation) bytes from the stdlib's top-level .py files, sorted by name; every 10th file validates."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in base.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no .py files under {base}; pass root= to a directory of Python sources")
    train, val = bytearray(), bytearray()
    for i, path in enumerate(files):
        target = val if i % 10 == 9 else train
        if len(target) < max_bytes:
            target += path.read_bytes()[: max_bytes - len(target)]
    return bytes(train), bytes(val)


@dataclass
class MaskedLMData:
    """Fixed-length windows of a byte corpus with BERT-style masking (15%, all masked to [MASK])."""

    data: bytes
    seq_len: int = 64
    mask_prob: float = 0.15
    seed: int = 0

    def __post_init__(self) -> None:
        self._tokens = torch.frombuffer(bytearray(self.data), dtype=torch.uint8).long()
        self._gen = torch.Generator().manual_seed(self.seed)

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A random batch: (input ids with masks, targets with IGNORE_INDEX where not masked)."""
        windows = _windows(self._tokens, self._gen, self.seq_len, batch_size)
        masked = torch.rand(windows.shape, generator=self._gen) < self.mask_prob
        masked[:, 0] |= ~masked.any(dim=1)  # every row predicts at least one token
        inputs = windows.masked_fill(masked, MASK_TOKEN)
        targets = windows.masked_fill(~masked, IGNORE_INDEX)
        return inputs, targets


@dataclass
class NextByteData:
    """Fixed-length windows of a byte corpus for a causal LM: each window's bytes, and as targets the same bytes one
    on (every position predicts the byte after it)."""

    data: bytes
    seq_len: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        self._tokens = torch.frombuffer(bytearray(self.data), dtype=torch.uint8).long()
        self._gen = torch.Generator().manual_seed(self.seed)

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A random batch: (input ids, next-byte targets), both [batch_size, seq_len]."""
        windows = _windows(self._tokens, self._gen, self.seq_len, batch_size, extra=1)
        return windows[:, :-1], windows[:, 1:]


def _windows(tokens: torch.Tensor, gen: torch.Generator, seq_len: int, batch_size: int, extra: int = 0) -> torch.Tensor:
    """`batch_size` windows of `seq_len + extra` tokens at starts drawn from `gen` below `len(tokens) - seq_len`:
    [batch_size, seq_len + extra]."""
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=gen)
    return torch.stack([tokens[s : s + seq_len + extra] for s in starts.tolist()])


def lm_data(objective: Objective, data: bytes, *, seq_len: int, seed: int) -> MaskedLMData | NextByteData:
    """The batches of `objective` over `data`."""
    if objective is Objective.MASKED:
        return MaskedLMData(data, seq_len=seq_len, seed=seed)
    return NextByteData(data, seq_len=seq_len, seed=seed)
