"""What K-FAC knows about one layer: the record every pass, kernel and plan refers to by name."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["LayerKind", "ConvSpec", "KFACLayer"]


class LayerKind(StrEnum):
    """The module kinds K-FAC preconditions: their factors differ (a conv's input rows are im2col patches)."""

    LINEAR = "linear"
    CONV2D = "conv2d"


@dataclass(frozen=True, slots=True)
class ConvSpec:
    """Geometry of a Conv2d (groups=1), enough to im2col its input."""

    kernel_size: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)


@dataclass(frozen=True, slots=True)
class KFACLayer:
    """A Linear or Conv2d that K-FAC preconditions, named by its module's fully qualified name."""

    name: str
    """Module FQN from nn_module_stack, e.g. "bert.encoder.layer.0.output.dense"."""
    kind: LayerKind
    weight: str
    """Parameter FQN of the weight ("<name>.weight")."""
    bias: str | None
    """Parameter FQN of the bias, or None."""
    d_in: int
    """Input width without the bias column (conv: C_in * kh * kw)."""
    d_out: int
    """Output width (conv: C_out)."""
    tokens_per_sample: int = 1
    """Rows each sample contributes to the factors (tokens; conv: output positions)."""
    conv: ConvSpec | None = None
    weight_transposed: bool = False
    """The weight is stored ``[d_in, d_out]`` (Hugging Face Conv1D, e.g. GPT-2), not ``[d_out, d_in]``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LayerKind(self.kind))  # its text is accepted; an unknown kind raises

    @property
    def params(self) -> tuple[str, ...]:
        """The parameters whose gradients make the layer's: its weight and bias."""
        return (self.weight,) if self.bias is None else (self.weight, self.bias)

    @property
    def a_dim(self) -> int:
        """Side of the A factor (d_in, plus one for the bias column)."""
        return self.d_in + (1 if self.bias is not None else 0)

    @property
    def b_dim(self) -> int:
        """Side of the B factor."""
        return self.d_out
