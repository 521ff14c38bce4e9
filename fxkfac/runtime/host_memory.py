"""Host memory kept by the process once freed, as CUDA's caching allocator keeps device memory ([Note: host memory]).

[Note: host memory] glibc's malloc serves blocks above its mmap threshold with fresh mappings and hands the free
top of its heap back to the system above its trim threshold. A pipeline step frees and allocates the same
megabyte-sized tensors every micro-batch (weight gradients, saved activations), so on CPU each came back as new
pages the kernel zero-fills on first touch: a split backward's W, which frees all of a stage's weight gradients
at once, ran about twice as slow as its matrix products (benchmarks/split_backward.py). Raising both thresholds
keeps freed memory in the heap for the next micro-batch; the process's resident memory stays at its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

__all__ = ["keep_freed_host_memory"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap (glibc's largest mmap threshold on 64-bit)."""
TRIM_THRESHOLD = 1 << 30
"""Free memory at the heap's top kept up to this much."""


def keep_freed_host_memory() -> bool:
    """Keep freed host memory for reuse (glibc on Linux; elsewhere nothing changes); whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:  # not glibc (musl has none)
        return False
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug("host memory kept once freed: %s", done)
    return done
