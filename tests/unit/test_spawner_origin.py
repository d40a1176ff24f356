"""What an agent read from the log runs as: its first valid spawn, the one the governor
admits, whatever spawns of it came later."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from grove_core.records import RawRecord
from grove_events import encode
from grove_spawner.service import Spawner
from tests.unit.helpers import Log

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 1, tzinfo=UTC)


class SpawnSubject:
    """The messages on one spawn subject, read the way `EventLog.get_next` reads them."""

    def __init__(self, bodies: list[bytes]) -> None:
        self.records = [
            RawRecord(seq, "grove.spawn.a", body, NOW, None, 0)
            for seq, body in enumerate(bodies, start=1)
        ]
        self.reads = 0

    async def get_next(self, subject: str, from_seq: int) -> RawRecord | None:
        self.reads += 1
        assert subject == "grove.spawn.a"
        return next((r for r in self.records if r.seq >= from_seq), None)


def spawner_reading(bodies: list[bytes]) -> tuple[Spawner, SpawnSubject]:
    spawner = Spawner.__new__(Spawner)  # only the log is used
    subject = SpawnSubject(bodies)
    spawner.log = subject  # type: ignore[assignment]
    return spawner, subject


async def test_a_later_spawn_asking_for_more_changes_nothing() -> None:
    log = Log()
    first = log.spawn("a", task="the task admitted").event
    later = log.spawn("a", task="something else").event.model_copy(
        update={"config": first.config.model_copy(update={"runtime": "python"})}
    )
    spawner, _ = spawner_reading([encode(first), encode(later)])
    origin = await spawner._origin("a")
    assert origin is not None
    assert origin.spawn.event_id == first.event_id
    assert origin.spawn.task == "the task admitted"


async def test_invalid_messages_before_the_first_valid_spawn_are_passed_over() -> None:
    spawn = Log().spawn("a").event
    spawner, subject = spawner_reading([b"not json", b'{"type": "spawn"}', encode(spawn)])
    origin = await spawner._origin("a")
    assert origin is not None
    assert origin.spawn.event_id == spawn.event_id
    assert subject.reads == 3
