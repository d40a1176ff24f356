"""The completion the spawner says for an agent that ended well without saying so, against a
real nats-server: appended with no read first when no status came after the newest it knows
of, and never over an end the agent reported on another path."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from prometheus_client import REGISTRY

from grove_core.log import EventLog
from grove_core.records import Recorded
from grove_events import AgentConfig, SpawnEvent, StatusEvent, StatusPayload, new_id, subject_for
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
