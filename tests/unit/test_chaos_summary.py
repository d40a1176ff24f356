"""The chaos run's summary groups failures by cause, whatever agent or spawner they hit."""

from __future__ import annotations

import pytest
from chaos.run import failure_causes

from tests.unit.helpers import Log

pytestmark = pytest.mark.unit


def test_failures_are_counted_by_cause_with_ids_and_numbers_masked() -> None:
    log = Log()
    lost = "spawner {} restarted; the agent's run was lost"
    log.terminate("0193a1b2-7c3d-7e4f-8a9b-0c1d2e3f4a5b", "failed", error=lost.format("spawner-1"))
    log.terminate("0193a1b2-7c3d-7e4f-8a9b-0c1d2e3f4a6c", "failed", error=lost.format("spawner-2"))
    log.terminate("c", "failed", error="exit status 3 after 12 tries")
    log.terminate("d", "failed")
    log.terminate("e", "completed")
    log.terminate("f", "stopped", error="stopped by 0193a1b2-7c3d-7e4f-8a9b-0c1d2e3f4a5b")

    assert failure_causes(log.records) == {
        "spawner # restarted; the agent's run was lost": 2,
        "exit status # after # tries": 1,
        "no error given": 1,
    }
