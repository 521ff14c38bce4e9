"""Hardware specs for the analytic cost model, and an alpha-beta model of each collective over p ranks (alpha per
message step, beta per byte on the wire; `_ALGORITHMS`): a group within one node uses the `intra` link, a larger one
the `inter` link; a measured model (fxkfac.comm_profile) fits alpha and beta per kind."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import Any

from fxkfac.planner.problem.errors import CostModelError


class Collective(StrEnum):
    """A kind of communication the planner prices."""

    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    ALL_GATHER = "all_gather"
    SEND = "send"


def check_number(owner: str, name: str, value: Any, *, integer: bool = False) -> None:
    """CostModelError naming `owner`'s `name` unless `value` is a finite number >= 0 (an int with `integer`)."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise CostModelError(f"{owner}: {name} must be {'an int (bytes)' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise CostModelError(f"{owner}: {name} must be finite and >= 0, got {value!r}")


def check_count(name: str, value: Any, hint: str = "") -> None:
    """CostModelError unless `value` is an int >= 1 (a bool is not): a size, a count of ranks or steps."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CostModelError(f"{name} must be an int >= 1{hint}, got {value!r}")


def parse_json(text: str, what: str) -> Any:
    """The JSON value `text` holds; CostModelError saying `what` is not valid JSON."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise CostModelError(f"{what} is not valid JSON: {e}") from e


_ALGORITHMS: dict[Collective, tuple[Callable[[int], float], Callable[[int], float]]] = {
    # ring (Patarasuk & Yuan, JPDC 2009; NCCL's ring)
    Collective.ALL_REDUCE: (lambda p: 2.0 * (p - 1), lambda p: 2.0 * (p - 1) / p),
    # long messages, scatter + ring all-gather (Thakur, Rabenseifner & Gropp, IJHPCA 2005, §4.1)
    Collective.BROADCAST: (lambda p: math.ceil(math.log2(p)) + p - 1.0, lambda p: 2.0 * (p - 1) / p),
    Collective.ALL_GATHER: (lambda p: p - 1.0, lambda p: (p - 1) / p),  # ring, of the gathered bytes (ibid., §3.1)
    Collective.SEND: (lambda p: 1.0, lambda p: 1.0),  # one point-to-point message (Hockney 1994)
}
"""Per kind over p > 1 ranks: (alphas, the share of the bytes each beta)."""


def latency_steps(kind: Collective, group_size: int) -> float:
    """How many alphas `kind` pays over `group_size` ranks."""
    check_count("a group's size in ranks", group_size)
    return 0.0 if group_size == 1 else _ALGORITHMS[kind][0](group_size)


def wire_bytes(kind: Collective, nbytes: float, group_size: int) -> float:
    """How many betas (bytes on each rank's busiest link) `kind` of `nbytes` pays over `group_size` ranks."""
    check_count("a group's size in ranks", group_size)
    check_number("a message", "bytes", nbytes)
    return 0.0 if group_size == 1 else _ALGORITHMS[kind][1](group_size) * nbytes


@dataclass(frozen=True, slots=True)
class AlphaBeta:
    """One link: `alpha` seconds per message step (latency), `beta` seconds per byte (1 / bandwidth)."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        check_number("AlphaBeta", "alpha", self.alpha)
        check_number("AlphaBeta", "beta", self.beta)

    @classmethod
    def of_link(cls, latency_s: float, bandwidth: float) -> AlphaBeta:
        """From a latency in seconds and a bandwidth in bytes per second (one direction)."""
        if not bandwidth > 0:
            raise CostModelError(f"a link's bandwidth must be > 0 bytes/s, got {bandwidth!r}")
        return cls(latency_s, 1.0 / bandwidth)

    def seconds(self, kind: Collective, nbytes: float, group_size: int) -> float:
        """Seconds of `kind` moving `nbytes` over `group_size` ranks on this link."""
        return self.alpha * latency_steps(kind, group_size) + self.beta * wire_bytes(kind, nbytes, group_size)


@dataclass(frozen=True, slots=True)
class LinkCosts:
    """Alpha and beta of every collective kind over one kind of link (fitted per kind when measured)."""

    all_reduce: AlphaBeta
    broadcast: AlphaBeta
    all_gather: AlphaBeta
    send: AlphaBeta

    @classmethod
    def uniform(cls, link: AlphaBeta) -> LinkCosts:
        return cls(link, link, link, link)

    def of(self, kind: Collective) -> AlphaBeta:
        value: AlphaBeta = getattr(self, kind.value)
        return value


@dataclass(frozen=True, slots=True)
class CommModel:
    """Collective costs: `intra` for groups within one node of `devices_per_node` devices, `inter` for larger."""

    intra: LinkCosts
    inter: LinkCosts
    devices_per_node: int
    source: str
    send_cpu: AlphaBeta = AlphaBeta(0.0, 0.0)
    """CPU seconds a point-to-point message costs its sender's process (gloo's threads on a host whose cores the
    ranks fill), per message and per byte; zero: not measured, or not on the ranks' cores."""
    recv_cpu: AlphaBeta = AlphaBeta(0.0, 0.0)  # the same for its receiver's process

    def __post_init__(self) -> None:
        check_count("CommModel.devices_per_node", self.devices_per_node)
        if not all(isinstance(x, LinkCosts) for x in (self.intra, self.inter)):
            raise CostModelError("CommModel.intra and .inter must be LinkCosts")
        if not all(isinstance(x, AlphaBeta) for x in (self.send_cpu, self.recv_cpu)):
            raise CostModelError("CommModel.send_cpu and .recv_cpu must be AlphaBeta")

    @classmethod
    def single_link(cls, link: LinkCosts, devices_per_node: int, source: str) -> CommModel:
        """A model where every group, inside a node or across nodes, uses `link`."""
        return cls(link, link, devices_per_node, source)

    def link(self, group_size: int) -> LinkCosts:
        """The link a group of `group_size` ranks uses."""
        return self.intra if group_size <= self.devices_per_node else self.inter

    def seconds(self, kind: Collective, nbytes: float, group_size: int) -> float:
        """Seconds of `kind` moving `nbytes` over `group_size` ranks (0 for one rank)."""
        return self.link(group_size).of(kind).seconds(kind, nbytes, group_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """JSON text (`from_json` reads it back to an equal model)."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any) -> CommModel:
        """Inverse of `to_dict`; CostModelError naming what is malformed."""
        try:
            links = {
                name: LinkCosts(**{f.name: AlphaBeta(**data[name][f.name]) for f in fields(LinkCosts)})
                for name in ("intra", "inter")
            }
            cpu = {k: AlphaBeta(**data[k]) for k in ("send_cpu", "recv_cpu") if k in data}  # absent: not measured
            return cls(links["intra"], links["inter"], data["devices_per_node"], data["source"], **cpu)
        except KeyError as e:
            raise CostModelError(f"the communication model is missing the key {e.args[0]!r}") from e
        except TypeError as e:
            raise CostModelError(f"the communication model has a malformed entry: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> CommModel:
        return cls.from_dict(parse_json(text, "the communication model"))


ZERO = CommModel.single_link(LinkCosts.uniform(AlphaBeta(0.0, 0.0)), 1, "none")  # communication taking no time


def seconds(model: CommModel | None, kind: Collective, nbytes: float, group_size: int) -> float:
    """Seconds of `kind` moving `nbytes` over `group_size` ranks under `model` (None: no time, as `ZERO`)."""
    return (model or ZERO).seconds(kind, nbytes, group_size)


Sample = tuple[int, float, float]  # one timed collective: (group size, bytes, seconds)


def fit_alpha_beta(kind: Collective, samples: Sequence[Sample]) -> AlphaBeta:
    """The alpha and beta >= 0 of `kind` that best fit `samples` (alpha * latency_steps + beta * wire_bytes) in
    least squares (each alone, or both when neither is negative); CostModelError without two distinct sizes."""
    raw = [(latency_steps(kind, p), wire_bytes(kind, n, p), t) for p, n, t in samples]
    if len({(x, y) for x, y, _ in raw}) < 2:
        raise CostModelError(
            f"fitting {kind} needs samples at two or more message sizes or group sizes, got {list(samples)}"
        )
    for _, _, t in raw:
        check_number(f"a {kind} sample", "seconds", t)
    unit = max(y for _, y, _ in raw) or 1.0  # bytes in units of the largest message: a well-conditioned system
    rows = [(x, y / unit, t) for x, y, t in raw]
    sxx, sxy, syy = (sum(r[i] * r[j] for r in rows) for i, j in ((0, 0), (0, 1), (1, 1)))
    sxt, syt = (sum(r[i] * r[2] for r in rows) for i in (0, 1))
    candidates = [(max(0.0, sxt / sxx) if sxx > 0 else 0.0, 0.0), (0.0, max(0.0, syt / syy) if syy > 0 else 0.0)]
    det = sxx * syy - sxy * sxy
    if abs(det) > 1e-12 * max(sxx * syy, 1e-300):  # the 2x2 normal equations are regular
        both = ((syy * sxt - sxy * syt) / det, (sxx * syt - sxy * sxt) / det)
        candidates += [both] if min(both) >= 0 else []
    alpha, beta = min(candidates, key=lambda ab: sum((ab[0] * x + ab[1] * y - t) ** 2 for x, y, t in rows))
    return AlphaBeta(alpha, beta / unit)


def describe(model: CommModel | None) -> list[str]:
    """The model in words, one line per link and kind (alpha in microseconds, 1 / beta in GB/s), for --explain."""
    if model is None:
        return ["Communication: no model in the cost table; collectives are planned as free"]
    lines = [f"Communication ({model.source}; alpha per message step, bandwidth 1/beta):"]
    tiers = [("within a node", "<=", model.intra), ("across nodes", ">", model.inter)]
    for where, size, link in tiers if model.inter != model.intra else tiers[:1]:
        uniform = len({link.of(kind) for kind in Collective}) == 1
        lines.append(f"  {where} (groups of {size} {model.devices_per_node} ranks):")
        for kind in (Collective.ALL_REDUCE,) if uniform else tuple(Collective):
            ab = link.of(kind)
            bandwidth = f"{1e-9 / ab.beta:.4g} GB/s" if ab.beta > 0 else "unlimited"
            pair = f"alpha {ab.alpha * 1e6:.3g} us, beta {ab.beta:.3g} s/B ({bandwidth})"
            lines.append(f"    {'every kind' if uniform else kind.value:<10} {pair}")
    return lines


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
    peak_flops: float  # dense FP32 FLOP/s (no tensor cores)
    peak_flops_tensor: float  # dense tensor-core FLOP/s at 16-bit (FP16 on P100/V100, BF16 on A100/H100)
    mem_bandwidth: float  # bytes/s
    memory_bytes: int
    matmul_efficiency: float = 0.7  # the fraction of peak a large GEMM reaches (cuBLAS SGEMM: typically 70-80%)
    factorization_efficiency: float = 0.1
    """Fraction of peak a Cholesky + cholesky_inverse of a K-FAC factor (d <= 4096) reaches: latency bound, about
    0.1 on GPUs as the PipeFisher profiles show."""
    comm: CommModel | None = None  # the links between devices (within a node, across nodes); None: free

    def __post_init__(self) -> None:
        for field in ("peak_flops", "peak_flops_tensor", "mem_bandwidth"):
            if not getattr(self, field) > 0:
                raise CostModelError(f"HardwareSpec {self.name!r}: {field} must be > 0")
        for field in ("matmul_efficiency", "factorization_efficiency"):
            if not 0 < getattr(self, field) <= 1:
                raise CostModelError(f"HardwareSpec {self.name!r}: {field} must be in (0, 1]")


_US = 1e-6
_NODE = 8  # DGX-1 (P100, V100), DGX A100 and DGX H100 hold 8 GPUs per node
_NVLINK_US, _NET_US = 3.4 * _US, 9.6 * _US  # a message step's latency: NCCL's tuning.cc `hwLat` (Ring, Simple)


_DATASHEETS = {
    # NVIDIA Tesla P100 SXM2 16 GB (2016); NVLink 1.0, 4 links x 20 GB/s each way; DGX-1: 4x IB EDR per 8 GPUs.
    "p100": (10.6, 21.2, 732, 16, 80, 6.25, "NVLink 1.0 / IB EDR"),
    # NVIDIA Tesla V100 SXM2 32 GB (2017/2020); NVLink 2.0, 6 links x 25 GB/s each way; DGX-1: 4x IB EDR per 8 GPUs.
    "v100": (15.7, 125, 900, 32, 150, 6.25, "NVLink 2.0 / IB EDR"),
    # NVIDIA A100 80GB SXM (2021), BF16 tensor dense; NVLink 3.0, 600 GB/s both ways; DGX A100: IB HDR per GPU.
    "a100": (19.5, 312, 2039, 80, 300, 25, "NVLink 3.0 / IB HDR"),
    # NVIDIA H100 SXM5 (2023), BF16 tensor dense; NVLink 4.0, 900 GB/s both ways; DGX H100: IB NDR per GPU.
    "h100": (67, 989, 3350, 80, 450, 50, "NVLink 4.0 / IB NDR"),
}
"""Datasheet figures per GPU: FP32 and 16-bit tensor TFLOP/s, memory GB/s and GiB, then GB/s per direction of all
its NVLinks together (NCCL runs a ring per link) and of its share of the node's InfiniBand ports."""


def _datasheet(name: str, figures: tuple[float, float, float, int, float, float, str]) -> HardwareSpec:
    """A GPU of `_DATASHEETS`: NVLink within a node of 8 GPUs, the network across."""
    fp32, tensor, bandwidth, gib, nvlink, network, links = figures
    intra = LinkCosts.uniform(AlphaBeta.of_link(_NVLINK_US, nvlink * _GB))
    inter = LinkCosts.uniform(AlphaBeta.of_link(_NET_US, network * _GB))
    comm = CommModel(intra, inter, _NODE, f"analytic:{name} {links}")
    return HardwareSpec(name, fp32 * _T, tensor * _T, bandwidth * _GB, gib * _GIB, comm=comm)


HARDWARE: dict[str, HardwareSpec] = {name: _datasheet(name, figures) for name, figures in _DATASHEETS.items()}

_GLOO = ((441, 1.44), (152, 2.64), (356, 0.44), (318, 3.41))  # (alpha us, GB/s) per Collective: comm_fit's fit
_LOOPBACK = LinkCosts(*(AlphaBeta.of_link(alpha * _US, bandwidth * _GB) for alpha, bandwidth in _GLOO))
_CPU_COMM = CommModel.single_link(_LOOPBACK, _NODE, "analytic:cpu gloo loopback (measured)")
# A nominal 2-core AVX2/FMA CPU (2 cores x 2.5 GHz x 32 FP32 FLOP/cycle, no faster 16-bit path, DDR4), LAPACK at a
# larger share of its peak than cuSOLVER of a GPU's.
HARDWARE["cpu"] = HardwareSpec("cpu", 0.16 * _T, 0.16 * _T, 20 * _GB, 16 * _GIB, 0.6, 0.3, _CPU_COMM)


def hardware(name: str | HardwareSpec) -> HardwareSpec:
    """The spec called `name` (case-insensitive); a HardwareSpec passes through."""
    if isinstance(name, HardwareSpec):
        return name
    try:
        return HARDWARE[name.lower()]
    except (KeyError, AttributeError):
        raise CostModelError(f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))}") from None
