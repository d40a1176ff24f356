"""The heap is frozen out of the collector's way only in a service's own process."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PROBE = """
import gc
from grove_core import collector
{manage}
kept = [[i] for i in range(1000)]  # long-lived objects, as a started service holds
collector.started()
after_start = gc.get_freeze_count()
state = [[i, "agent"] for i in range(1000)]  # a projection's folded state
collector.caught_up()
print(after_start, gc.get_freeze_count() - after_start)
"""


def frozen(manage: bool) -> tuple[int, int]:
    """(objects frozen at start, objects frozen at the catch-up) in a fresh interpreter."""
    code = PROBE.format(manage="collector.manage()" if manage else "")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    return int(out[0]), int(out[1])


def test_a_service_process_freezes_what_it_loaded_then_its_state() -> None:
    at_start, at_catch_up = frozen(manage=True)
    assert at_start >= 1000
    assert at_catch_up >= 1000


def test_another_process_keeps_its_collector_as_it_was() -> None:
    assert frozen(manage=False) == (0, 0)
