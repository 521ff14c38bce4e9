"""Hardware specs (peak FLOP/s, memory bandwidth and size, achievable efficiency, links) for the analytic cost model."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fxkfac.planner.problem.comm import AlphaBeta, CommModel, LinkCosts
from fxkfac.planner.problem.errors import CostModelError

__all__ = ["Precision", "HardwareSpec", "HARDWARE", "hardware"]

_T = 1e12
_GB = 1e9
_GIB = 1 << 30


class Precision(StrEnum):
    """The number format a cost model prices matmuls in: FP32 at the device's plain peak, BF16 at its tensor peak."""

    FP32 = "fp32"
    BF16 = "bf16"


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
    comm: CommModel | None = None
    """The links between devices (planner/problem/comm.py: within a node, across nodes); None: communication is free."""

    def __post_init__(self) -> None:
        for field in ("peak_flops", "peak_flops_tensor", "mem_bandwidth"):
            if not getattr(self, field) > 0:
                raise CostModelError(f"HardwareSpec {self.name!r}: {field} must be > 0")
        for field in ("matmul_efficiency", "factorization_efficiency"):
            if not 0 < getattr(self, field) <= 1:
                raise CostModelError(f"HardwareSpec {self.name!r}: {field} must be in (0, 1]")


_US = 1e-6
_NODE = 8  # DGX-1 (P100, V100), DGX A100 and DGX H100 hold 8 GPUs per node


def _links(
    intra_latency: float, intra_bandwidth: float, inter_latency: float, inter_bandwidth: float, source: str
) -> CommModel:
    """A datasheet comm model: every kind over an intra-node link (within 8 GPUs) and an inter-node one, each
    from its latency (s) and one-direction bandwidth (bytes/s)."""
    return CommModel(
        LinkCosts.uniform(AlphaBeta.of_link(intra_latency, intra_bandwidth)),
        LinkCosts.uniform(AlphaBeta.of_link(inter_latency, inter_bandwidth)),
        _NODE,
        source,
    )


# Links: bandwidth is the datasheet's peak per direction (NVLink datasheets quote both directions together, so
# half of it), all of a GPU's links together (NCCL runs one ring per link); across nodes, the GPU's share of
# its node's InfiniBand ports (the DGX system datasheets). Latency per message step is no datasheet figure:
# NCCL's own model of it is used, src/graph/tuning.cc `hwLat`, Ring / Simple protocol: NVLink 3.4 us,
# PCIe 5.7 us, network 9.6 us.
_NVLINK_US, _NET_US = 3.4 * _US, 9.6 * _US

# factorization_efficiency 0.1 on GPUs: calibrated from planner/data/pipefisher_profiles, where
# Cholesky + cholesky_inverse of a BERT-Base block's factors (d^3 FLOPs each: 10 of d=768, 2 of
# 3072, 62.5 GFLOP) takes 71.7 ms on a P100 (8% of peak), BERT-Large's (148 GFLOP) 126.7 ms (11%),
# and 49 ms on a V100 (8%): batched-free small factorizations are latency bound.
HARDWARE: dict[str, HardwareSpec] = {
    # NVIDIA Tesla P100 SXM2 16 GB datasheet (2016): 10.6 TFLOPS FP32, 21.2 TFLOPS FP16,
    # 732 GB/s HBM2. The PipeFisher profiles were measured on P100s. Links: NVLink 1.0, 160 GB/s
    # bidirectional (4 links x 20 GB/s each way); DGX-1 (P100) datasheet: 4x InfiniBand EDR 100 Gb/s per 8 GPUs
    # (6.25 GB/s per GPU). (A P100 for PCIe would have PCIe 3.0 x16, 16 GB/s each way, instead of NVLink.)
    "p100": HardwareSpec(
        "p100",
        10.6 * _T,
        21.2 * _T,
        732 * _GB,
        16 * _GIB,
        comm=_links(_NVLINK_US, 80 * _GB, _NET_US, 6.25 * _GB, "analytic:p100 NVLink 1.0 / IB EDR"),
    ),
    # NVIDIA Tesla V100 SXM2 datasheet (2017/2020): 15.7 TFLOPS FP32, 125 TFLOPS tensor (FP16),
    # 900 GB/s HBM2, 16 or 32 GB (32 GB here). Links: NVLink 2.0, 300 GB/s bidirectional (6 links x 25 GB/s each
    # way); DGX-1 (V100) datasheet: 4x InfiniBand EDR 100 Gb/s per 8 GPUs (6.25 GB/s per GPU).
    "v100": HardwareSpec(
        "v100",
        15.7 * _T,
        125 * _T,
        900 * _GB,
        32 * _GIB,
        comm=_links(_NVLINK_US, 150 * _GB, _NET_US, 6.25 * _GB, "analytic:v100 NVLink 2.0 / IB EDR"),
    ),
    # NVIDIA A100 80GB SXM datasheet (2021): 19.5 TFLOPS FP32, 312 TFLOPS BF16 tensor (dense),
    # 2,039 GB/s HBM2e, 80 GB. Links: NVLink 3.0, 600 GB/s bidirectional; DGX A100 datasheet: 8x ConnectX-6
    # InfiniBand HDR 200 Gb/s, one per GPU (25 GB/s).
    "a100": HardwareSpec(
        "a100",
        19.5 * _T,
        312 * _T,
        2039 * _GB,
        80 * _GIB,
        comm=_links(_NVLINK_US, 300 * _GB, _NET_US, 25 * _GB, "analytic:a100 NVLink 3.0 / IB HDR"),
    ),
    # NVIDIA H100 SXM5 datasheet (2023): 67 TFLOPS FP32, 989 TFLOPS BF16 tensor (dense; 1,979 with
    # sparsity), 3.35 TB/s HBM3, 80 GB. Links: NVLink 4.0, 900 GB/s bidirectional; DGX H100 datasheet: 8x
    # ConnectX-7 InfiniBand NDR 400 Gb/s, one per GPU (50 GB/s).
    "h100": HardwareSpec(
        "h100",
        67 * _T,
        989 * _T,
        3350 * _GB,
        80 * _GIB,
        comm=_links(_NVLINK_US, 450 * _GB, _NET_US, 50 * _GB, "analytic:h100 NVLink 4.0 / IB NDR"),
    ),
    # A nominal 2-core AVX2/FMA laptop-class CPU, not a datasheet: 2 cores x 2.5 GHz x 32 FP32
    # FLOP/cycle (two 8-wide FMA units) = 160 GFLOP/s, no faster 16-bit path; ~20 GB/s DDR4 dual
    # channel; 16 GiB. LAPACK potrf/potri reach a larger share of a CPU's peak than cuSOLVER's of a GPU.
    # Links: gloo over TCP loopback between processes of one host (every group: no second node), fitted per kind
    # by fxkfac.comm_profile.measure_comm on this project's 2-core machine, 2 ranks, the median of three runs of
    # `python benchmarks/comm_fit.py` (load average 6 from other jobs; single runs vary by 2-3x):
    # all_reduce 441 us + 1.44 GB/s, broadcast 152 us + 2.64 GB/s, all_gather 356 us + 0.44 GB/s, send 318 us +
    # 3.41 GB/s.
    "cpu": HardwareSpec(
        "cpu",
        0.16 * _T,
        0.16 * _T,
        20 * _GB,
        16 * _GIB,
        matmul_efficiency=0.6,
        factorization_efficiency=0.3,
        comm=CommModel.single_link(
            LinkCosts(
                AlphaBeta.of_link(441 * _US, 1.44 * _GB),
                AlphaBeta.of_link(152 * _US, 2.64 * _GB),
                AlphaBeta.of_link(356 * _US, 0.44 * _GB),
                AlphaBeta.of_link(318 * _US, 3.41 * _GB),
            ),
            _NODE,
            "analytic:cpu gloo loopback (measured)",
        ),
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
