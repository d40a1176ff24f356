"""The heap is frozen out of the collector's way only in a service's own process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grove_core import collector

pytestmark = pytest.mark.unit

PROBE = """
import gc
from grove_core import collector
default = gc.get_threshold()[0]
{manage}
kept = [[i] for i in range(1000)]  # long-lived objects, as a started service holds
collector.started()
after_start = gc.get_freeze_count()
state = [[i, "agent"] for i in range(1000)]  # a projection's folded state
collector.caught_up()
threshold = gc.get_threshold()[0]
print(after_start, gc.get_freeze_count() - after_start, "raised" if threshold != default else "kept", threshold)
"""


def frozen(manage: bool) -> tuple[int, int, str, int]:
    """(objects frozen at start, objects frozen at the catch-up, whether the collector's first
    threshold was raised or kept, that threshold) in a fresh interpreter."""
    code = PROBE.format(manage="collector.manage()" if manage else "")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    return int(out[0]), int(out[1]), out[2], int(out[3])


def test_a_service_process_freezes_what_it_loaded_then_its_state() -> None:
    at_start, at_catch_up, raised, threshold = frozen(manage=True)
    assert at_start >= 1000
    assert at_catch_up >= 1000
    assert (raised, threshold) == ("raised", collector.LIVE_THRESHOLD)


def test_another_process_keeps_its_collector_as_it_was() -> None:
    assert frozen(manage=False)[:3] == (0, 0, "kept")
