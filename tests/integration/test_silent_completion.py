"""The completion the spawner says for an agent that ended well without saying so, against a
real nats-server: appended with no read first when no status came after the newest it knows
of, and never over an end the agent reported on another path."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import REGISTRY

from grove_core.log import Appended, EventLog, LogError
from grove_core.records import RawRecord, Recorded
from grove_events import (
    AgentConfig,
    Event,
    SpawnEvent,
    StatusEvent,
    StatusPayload,
    new_id,
    subject_for,
)
from grove_spawner import service
from grove_spawner.runtimes import Outcome
from grove_spawner.service import RunningAgent, Spawner

pytestmark = pytest.mark.integration

GUARD_LOST = "grove_spawner_completion_guard_lost_total"


def guard_lost() -> float:
    return REGISTRY.get_sample_value(GUARD_LOST) or 0.0


def status(agent_id: str, status_type: str, summary: str = "") -> StatusEvent:
    return StatusEvent(
        event_id=new_id(),
        agent_id=agent_id,
        timestamp=datetime.now(UTC),
        status_type=status_type,  # type: ignore[arg-type]
        payload=StatusPayload(summary=summary),
    )


async def started_agent(event_log: EventLog, agent_id: str) -> tuple[Spawner, RunningAgent]:
    """A spawner (only its log is used) and an instance of `agent_id` it started."""
    spawn = SpawnEvent(
        event_id=new_id(),
        agent_id=agent_id,
        task="say nothing",
        config=AgentConfig(runtime="command", command=["true"]),
        timestamp=datetime.now(UTC),
    )
    await event_log.append(spawn)
    started = await event_log.append(status(agent_id, "started"))
    spawner = Spawner.__new__(Spawner)
    spawner.log = event_log
    agent = RunningAgent(spawn=spawn, tree_id=agent_id)
    agent.started_seq = agent.status_seq = started.seq
    return spawner, agent


async def statuses(event_log: EventLog, agent_id: str) -> list[tuple[str, str]]:
    """The agent's statuses on the log, oldest first: (status type, summary)."""
    subject = subject_for("status", agent_id)
    return [
        (item.event.status_type, item.event.payload.summary)
        async for item in event_log.events(1)
        if isinstance(item, Recorded)
        and item.subject == subject
        and isinstance(item.event, StatusEvent)
    ]


async def test_nothing_after_the_newest_status_known_the_completion_is_appended_at_once(
    event_log: EventLog,
) -> None:
    spawner, agent = await started_agent(event_log, "quiet")
    before = guard_lost()
    await spawner._report_silent_completion(agent, Outcome(completed=True, summary="done"), 0)
    assert await statuses(event_log, "quiet") == [("started", ""), ("completed", "done")]
    assert guard_lost() == before


async def test_an_end_the_agent_reported_elsewhere_stands_alone(event_log: EventLog) -> None:
    spawner, agent = await started_agent(event_log, "told")
    await event_log.append(status("told", "completed", "said so on its own connection"))
    before = guard_lost()
    await spawner._report_silent_completion(agent, Outcome(completed=True, summary="done"), 0)
    assert await statuses(event_log, "told") == [
        ("started", ""),
        ("completed", "said so on its own connection"),
    ]
    assert guard_lost() == before + 1


async def test_statuses_the_spawner_had_not_folded_come_before_the_completion(
    event_log: EventLog,
) -> None:
    spawner, agent = await started_agent(event_log, "busy")
    await event_log.append(status("busy", "checkpoint", "half way"))
    await event_log.append(status("busy", "discovery", "a clue"))
    before = guard_lost()
    await spawner._report_silent_completion(agent, Outcome(completed=True, summary="done"), 7)
    assert await statuses(event_log, "busy") == [
        ("started", ""),
        ("checkpoint", "half way"),
        ("discovery", "a clue"),
        ("completed", "done"),
    ]
    assert guard_lost() == before + 1


async def test_an_end_of_an_earlier_instance_does_not_count(event_log: EventLog) -> None:
    await event_log.append(status("again", "completed", "the first run"))
    spawner, agent = await started_agent(event_log, "again")
    agent.status_seq = 1  # as if the spawner knew only of a status before this instance
    await spawner._report_silent_completion(agent, Outcome(completed=True, summary="done"), 0)
    assert [s for s in await statuses(event_log, "again") if s[0] == "completed"] == [
        ("completed", "the first run"),
        ("completed", "done"),
    ]


class AckLostOnce:
    """The log, but the first append's acknowledgement is lost after the append is stored."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.lost = False

    async def append(self, event: Event, **guard: Any) -> Appended:
        appended = await self.log.append(event, **guard)
        if not self.lost:
            self.lost = True
            raise LogError("no acknowledgement (lost on the way back)")
        return appended

    async def get_last(self, subject: str) -> RawRecord | None:
        return await self.log.get_last(subject)


async def test_a_notice_stored_but_not_acknowledged_is_not_said_twice(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "TERMINATE_RETRY_S", 0.01)
    spawner, agent = await started_agent(event_log, "unsure")
    flaky = AckLostOnce(event_log)
    spawner.log = flaky  # type: ignore[assignment]
    await spawner._report_silent_completion(agent, Outcome(completed=True, summary="done"), 0)
    assert flaky.lost
    # Stored once: the retry loses its guard to the notice itself.
    assert await statuses(event_log, "unsure") == [("started", ""), ("completed", "done")]
