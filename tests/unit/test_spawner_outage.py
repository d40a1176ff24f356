"""An agent's end survives a nats-server that does not answer for a while: the spawner asks
again instead of losing the run's end."""

from __future__ import annotations

import nats.errors
import pytest

from grove_core.log import LogError
from grove_core.records import RawRecord
from grove_spawner import service
from grove_spawner.service import Spawner

pytestmark = pytest.mark.unit


class SilentLog:
    """A log that fails the first reads the way a restarting server does."""

    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.reads = 0

    async def get_last(self, subject: str) -> RawRecord | None:
        self.reads += 1
        if self.failures:
            raise self.failures.pop(0)
        return None


async def test_the_last_status_is_read_again_until_the_log_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(service, "TERMINATE_RETRY_S", 0.01)
    spawner = Spawner.__new__(Spawner)  # only the log is used
    silent = SilentLog(
        [nats.errors.TimeoutError(), nats.errors.ConnectionClosedError(), LogError("gone")]
    )
    spawner.log = silent  # type: ignore[assignment]
    assert await spawner._read_until_answered("grove.status.a") is None
    assert silent.reads == 4
