"""Lookups asked for together share one direct get (`multi_last`), against a real nats-server,
and answer exactly what one lookup each would."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import nats.js.errors
import pytest

from grove_core import lookups
from grove_core.log import EventLog
from grove_core.lookups import LastLookups
from grove_core.records import RawRecord
from grove_events import AgentConfig, SpawnEvent, StatusEvent, new_id, subject_for

pytestmark = pytest.mark.integration


def spawn_event(agent_id: str) -> SpawnEvent:
    return SpawnEvent(
        event_id=new_id(),
        agent_id=agent_id,
        timestamp=datetime.now(UTC),
        task="look me up",
        config=AgentConfig(runtime="command", command=["echo", "hello"]),
    )


def status_event(agent_id: str, status_type: str) -> StatusEvent:
    return StatusEvent(
        event_id=new_id(),
        agent_id=agent_id,
        timestamp=datetime.now(UTC),
        status_type=status_type,  # type: ignore[arg-type]
    )


async def from_leader(event_log: EventLog, subject: str) -> tuple[int, bytes] | None:
    try:
        raw = await event_log.js.get_last_msg(event_log.stream, subject)
    except nats.js.errors.NotFoundError:
        return None
    return int(raw.seq or 0), raw.data or b""


def seen(record: RawRecord | None) -> tuple[int, bytes] | None:
    return None if record is None else (record.seq, record.data)


async def agents_with_history(event_log: EventLog, count: int) -> list[str]:
    agents = [new_id() for _ in range(count)]
    for agent in agents:
        await event_log.append(spawn_event(agent))
        await event_log.append(status_event(agent, "admitted"))
        await event_log.append(status_event(agent, "started"))
    return agents


async def test_lookups_made_together_share_one_request_and_match_the_leader(
    event_log: EventLog,
) -> None:
    agents = await agents_with_history(event_log, 5)
    subjects = [subject_for(kind, agent) for agent in agents for kind in ("spawn", "status")]
    subjects += [subject_for("terminate", agents[0]), subjects[0]]  # none; the same twice
    assert await event_log._direct()  # known before: the lookups below start in one turn
    batched = event_log._lookups

    answers = await asyncio.gather(*(event_log.get_last(subject) for subject in subjects))

    assert (batched.requests, batched.subjects) == (1, len(set(subjects)))
    expected = [await from_leader(event_log, subject) for subject in subjects]
    assert [seen(answer) for answer in answers] == expected
    assert expected[-2] is None
    assert all(answer is not None for answer in expected[:-2])


async def test_a_wildcard_lookup_is_answered_alone_with_the_newest_match(
    event_log: EventLog,
) -> None:
    agents = await agents_with_history(event_log, 3)
    literal = [subject_for("spawn", agent) for agent in agents]
    assert await event_log._direct()  # known before: the lookups below start in one turn

    *answers, newest_status = await asyncio.gather(
        *(event_log.get_last(subject) for subject in literal),
        event_log.get_last("grove.status.*"),
    )

    assert event_log._lookups.subjects == len(literal)  # the wildcard was not in the batch
    assert [seen(a) for a in answers] == [await from_leader(event_log, s) for s in literal]
    assert seen(newest_status) == await from_leader(event_log, "grove.status.*")
    assert seen(newest_status) == seen(await event_log.get_last(subject_for("status", agents[-1])))


async def test_a_large_gathering_is_split_and_unknown_subjects_answer_none(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lookups, "MAX_SUBJECTS", 3)
    agents = await agents_with_history(event_log, 4)
    known = [subject_for("spawn", agent) for agent in agents]
    unknown = [subject_for("spawn", new_id()) for _ in range(3)]
    assert await event_log._direct()  # known before: the lookups below start in one turn

    answers = await asyncio.gather(*(event_log.get_last(s) for s in known + unknown))

    # 7 subjects, at most 3 a request: two batches, and the last one on its own
    assert (event_log._lookups.requests, event_log._lookups.subjects) == (2, 6)
    assert [seen(a) for a in answers] == [await from_leader(event_log, s) for s in known] + [
        None
    ] * len(unknown)


async def test_a_refused_batch_falls_back_to_one_lookup_each(event_log: EventLog) -> None:
    asked: list[str] = []

    async def single(subject: str) -> RawRecord | None:
        asked.append(subject)
        return None

    # No stream answers there: the server says "no responders" to the batch.
    gathering = LastLookups(event_log.nc, "NO_SUCH_STREAM", single)
    try:
        answers = await asyncio.gather(
            gathering.get("grove.spawn.a"), gathering.get("grove.spawn.b")
        )
    finally:
        await gathering.close()
    assert answers == [None, None]
    assert sorted(asked) == ["grove.spawn.a", "grove.spawn.b"]
