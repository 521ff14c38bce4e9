"""An autouse fixture for tests of tiny problems: one torch thread (on 2 shared cores thread hand-offs cost more
than the math, and single-threaded runs are deterministic); the global setting is restored afterwards.

Import it into a test module or a folder's conftest.py to apply it there."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

__all__ = ["one_thread"]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """torch.set_num_threads(1) for the test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
