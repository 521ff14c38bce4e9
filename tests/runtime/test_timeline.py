"""The measured timeline's accounting of time a rank lost to other processes of its host."""

from __future__ import annotations

import pytest

from fxkfac.runtime.timeline import Event, descheduled


def test_descheduled_is_wall_time_less_cpu_and_waits_between_instruction_ends() -> None:
    """Rank 0 runs 0-10 (8 on the CPU: 2 lost), then 12-20 with 2 waiting and 4 on the CPU since 10 (4 lost); rank 1
    runs 0-20 on the CPU throughout (nothing lost). One step spanning 20."""
    events = [
        Event(0, "F s0 m0", "FWD", 0, 0, 10, wait_ns=0, cpu_ns=8),
        Event(0, "RECV_GRAD s0 m0 <r1", "RECV_GRAD", 0, 12, 20, wait_ns=2, cpu_ns=4),
        Event(1, "F s1 m0", "FWD", 0, 0, 20, wait_ns=0, cpu_ns=20),
    ]
    assert descheduled(events) == pytest.approx({0: 6 / 20, 1: 0.0})
