"""Hardware specs (peak FLOP/s, memory bandwidth and size, achievable efficiency) for the analytic cost model."""

from __future__ import annotations

from dataclasses import dataclass

from fxkfac.planner.errors import CostModelError

__all__ = ["HardwareSpec", "HARDWARE", "hardware"]

_T = 1e12
_GB = 1e9
_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One device as the analytic model sees it: a kernel takes max(flops / (peak * eff), bytes / bw)."""

    name: str
    peak_flops: float
    """Dense FP32 FLOP/s (no tensor cores)."""
    peak_flops_tensor: float
    """Dense tensor-core FLOP/s at 16-bit (FP16 on P100/V100, BF16 on A100/H100), no sparsity."""
    mem_bandwidth: float
    """Device-memory bandwidth, bytes/s."""
    memory_bytes: int
    """Device memory, bytes."""
    matmul_efficiency: float = 0.7
    """Fraction of peak a large GEMM reaches (cuBLAS SGEMM: typically 70-80%)."""
    factorization_efficiency: float = 0.1
    """Fraction of peak a Cholesky + cholesky_inverse of a K-FAC factor (d <= 4096) reaches."""

    def __post_init__(self) -> None:
        for field in ("peak_flops", "peak_flops_tensor", "mem_bandwidth"):
            if not getattr(self, field) > 0:
                raise CostModelError(f"HardwareSpec {self.name!r}: {field} must be > 0")
        for field in ("matmul_efficiency", "factorization_efficiency"):
            if not 0 < getattr(self, field) <= 1:
                raise CostModelError(f"HardwareSpec {self.name!r}: {field} must be in (0, 1]")


# factorization_efficiency 0.1 on GPUs: calibrated from planner/data/pipefisher_profiles, where
# Cholesky + cholesky_inverse of a BERT-Base block's factors (d^3 FLOPs each: 10 of d=768, 2 of
# 3072, 62.5 GFLOP) takes 71.7 ms on a P100 (8% of peak), BERT-Large's (148 GFLOP) 126.7 ms (11%),
# and 49 ms on a V100 (8%): batched-free small factorizations are latency bound.
HARDWARE: dict[str, HardwareSpec] = {
    # NVIDIA Tesla P100 SXM2 16 GB datasheet (2016): 10.6 TFLOPS FP32, 21.2 TFLOPS FP16,
    # 732 GB/s HBM2. The PipeFisher profiles were measured on P100s.
    "p100": HardwareSpec("p100", 10.6 * _T, 21.2 * _T, 732 * _GB, 16 * _GIB),
    # NVIDIA Tesla V100 SXM2 datasheet (2017/2020): 15.7 TFLOPS FP32, 125 TFLOPS tensor (FP16),
    # 900 GB/s HBM2, 16 or 32 GB (32 GB here).
    "v100": HardwareSpec("v100", 15.7 * _T, 125 * _T, 900 * _GB, 32 * _GIB),
    # NVIDIA A100 80GB SXM datasheet (2021): 19.5 TFLOPS FP32, 312 TFLOPS BF16 tensor (dense),
    # 2,039 GB/s HBM2e, 80 GB.
    "a100": HardwareSpec("a100", 19.5 * _T, 312 * _T, 2039 * _GB, 80 * _GIB),
    # NVIDIA H100 SXM5 datasheet (2023): 67 TFLOPS FP32, 989 TFLOPS BF16 tensor (dense; 1,979 with
    # sparsity), 3.35 TB/s HBM3, 80 GB.
    "h100": HardwareSpec("h100", 67 * _T, 989 * _T, 3350 * _GB, 80 * _GIB),
    # A nominal 2-core AVX2/FMA laptop-class CPU, not a datasheet: 2 cores x 2.5 GHz x 32 FP32
    # FLOP/cycle (two 8-wide FMA units) = 160 GFLOP/s, no faster 16-bit path; ~20 GB/s DDR4 dual
    # channel; 16 GiB. LAPACK potrf/potri reach a larger share of a CPU's peak than cuSOLVER's of a GPU.
    "cpu": HardwareSpec(
        "cpu", 0.16 * _T, 0.16 * _T, 20 * _GB, 16 * _GIB, matmul_efficiency=0.6, factorization_efficiency=0.3
    ),
}


def hardware(name: str | HardwareSpec) -> HardwareSpec:
    """The spec called `name` (case-insensitive); a HardwareSpec passes through."""
    if isinstance(name, HardwareSpec):
        return name
    try:
        return HARDWARE[name.lower()]
    except (KeyError, AttributeError):
        raise CostModelError(f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))}") from None
