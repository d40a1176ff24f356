"""A stop ends a run as stopped whenever the spawner folds it, against a real nats-server.

The spawner runs in the test's own process, its projection fed by the log as in the service, so
that a stop can be folded at the exact moments that matter: after a run's task is made and
before it first runs (a cancellation then ends the task without any of the run, its end
included), and while a stopped run is appending its end (a second cancellation then could
lose that append).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

from agentgrove.client import GroveClient, build_config
from grove_core.log import Appended, EventLog
from grove_core.records import Recorded
from grove_events import (
    ControlEvent,
    Event,
    SpawnEvent,
    StatusEvent,
    StatusPayload,
    TerminateEvent,
    new_id,
    subject_for,
)
from grove_spawner import service
from grove_spawner.service import Spawner

pytestmark = pytest.mark.integration

#: Sleeps for a minute unless stopped.
SLEEPER = build_config("python", entrypoint="tests.routing_agents:sleeps_then_drains")


async def admit(event_log: EventLog, config: Any) -> tuple[str, Recorded]:
    """Spawn an agent and admit it, as the governor would; the admission as recorded."""
    agent_id = await GroveClient(event_log).spawn("work", config)
    (spawn,) = [
        item.event
        async for item in event_log.events(1, subjects=subject_for("spawn", agent_id))
        if isinstance(item, Recorded)
    ]
    assert isinstance(spawn, SpawnEvent)
    admitted = StatusEvent(
        event_id=new_id(),
        agent_id=agent_id,
        tree_id=agent_id,
        timestamp=datetime.now(UTC),
        causation_id=spawn.event_id,
        status_type="admitted",
        payload=StatusPayload(summary="admitted", details={"start": "spawn"}),
    )
    stored = await event_log.append(admitted)
    return agent_id, Recorded(stored.seq, subject_for("status", agent_id), admitted)


def stop_of(agent_id: str) -> ControlEvent:
    return ControlEvent(
        event_id=new_id(),
        agent_id=agent_id,
        timestamp=datetime.now(UTC),
        action="stop",
        reason="enough",
    )


async def ends(event_log: EventLog, agent_id: str) -> list[TerminateEvent]:
    return [
        item.event
        async for item in event_log.events(1, subjects=subject_for("terminate", agent_id))
        if isinstance(item, Recorded) and isinstance(item.event, TerminateEvent)
    ]


async def test_a_stop_folded_before_the_run_first_runs_ends_it_as_stopped(
    spawner: Spawner, event_log: EventLog
) -> None:
    agent_id, admitted = await admit(event_log, SLEEPER)
    assert isinstance(admitted.event, StatusEvent)
    await spawner.start(admitted, admitted.event)
    agent = spawner.running[agent_id]
    assert agent.task is not None
    assert not agent.began  # made, not yet run

    stop = stop_of(agent_id)
    spawner._stop(stop)  # folded now, before the run's first step
    await event_log.append(stop)

    ended = await GroveClient(event_log).wait(agent_id, timeout=10)
    assert (ended.reason, ended.summary) == ("stopped", "enough")
    await asyncio.wait_for(agent.task, 5)
    assert agent_id not in spawner.running
    assert len(await ends(event_log, agent_id)) == 1


async def test_a_run_appending_its_end_after_a_stop_is_not_cancelled_again(
    spawner: Spawner, event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped run that is slow to append its end is not cancelled again meanwhile: the
    cancellation would land in that append."""
    monkeypatch.setattr(service, "RECANCEL_AFTER_S", 0.1)
    ending = asyncio.Event()
    go_on = asyncio.Event()
    append = event_log.append

    async def held_end(event: Event, **guard: Any) -> Appended:
        """The real append; a terminate waits until the test lets it go on."""
        if isinstance(event, TerminateEvent):
            ending.set()
            await go_on.wait()
        return await append(event, **guard)

    monkeypatch.setattr(event_log, "append", held_end)
    agent_id, admitted = await admit(event_log, SLEEPER)
    assert isinstance(admitted.event, StatusEvent)
    await spawner.start(admitted, admitted.event)
    agent = spawner.running[agent_id]
    await asyncio.sleep(0.3)  # the run is under way
    assert agent.began

    stop = stop_of(agent_id)
    await append(stop)
    spawner._stop(stop)
    await asyncio.wait_for(ending.wait(), 10)
    await asyncio.sleep(0.5)  # five times the wait before a second cancellation
    go_on.set()

    ended = await GroveClient(event_log).wait(agent_id, timeout=10)
    assert (ended.reason, ended.summary) == ("stopped", "enough")
    assert agent.task is not None
    await asyncio.wait_for(agent.task, 5)
    assert not agent.task.cancelled()
    assert len(await ends(event_log, agent_id)) == 1
